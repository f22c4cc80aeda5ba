"""Custom TF ops with CPU and Metal kernels, where no fused kernel exists.

- `softshrink(x, lambd=0.5)`: ``TfmetalExt>Softshrink`` (+ gradient op).
- `layer_norm(x, gamma=None, beta=None, epsilon=1e-3)`: ``TfmetalExt>LayerNorm``
  (+ ``TfmetalExt>LayerNormGrad``: dx, dgamma, dbeta in one op).
- `rms_norm(x, gamma=None, epsilon=1e-6)`: ``TfmetalExt>RMSNorm``
  (+ ``TfmetalExt>RMSNormGrad``: dx and dgamma in one op).
- `multi_tensor_adam(variables, ms, vs, grads, ...)`: ``TfmetalExt>MultiTensorAdam``,
  Adam (AMSGrad, decoupled decay) for N variables of one dtype in one op.
- `multi_tensor_lion(variables, ms, grads, lr, beta_1, beta_2, ...)`:
  ``TfmetalExt>MultiTensorLion``, Keras' Lion (optional decoupled decay) for N
  variables of one dtype in one op.
- `multi_tensor_rmsprop(variables, velocities, grads, lr, rho, momentum, epsilon, ...)`:
  ``TfmetalExt>MultiTensorRMSprop``, Keras' RMSprop (momentum, centered,
  decoupled decay) for N variables of one dtype in one op.
- `attention(query, key, value, *, mask=None, causal=False, scale=None, dropout_rate=0.0, seed=None,
  heads_last=False, sliding_window=None, layout="BHSD")`:
  ``TfmetalExt>Attention`` (+ ``TfmetalExt>AttentionGrad``), softmax attention
  flash-style: the score matrix is never stored, forward or backward; attention
  dropout inside, by TensorFlow's stateless dropout mask drawn again from the seed;
  grouped-query key/value heads read in place; a sliding window as the op's own band; inputs and
  output in (batch, heads, seq, dim) or, with ``layout="BSHD"``, (batch, seq, heads, dim), in place.
- `dropout(x, rate, seed)`: ``TfmetalExt>Dropout`` (+ ``TfmetalExt>DropoutGrad``), dropout whose
  counter-based (Philox) mask is TensorFlow's stateless dropout's bit for bit, drawn again from the
  seed in the backward pass instead of stored.
- `int8_matmul(x, kernel, kernel_scale, bias=None, activation=None)` and
  `int8_conv2d(x, kernel, kernel_scale, bias=None, strides, padding, dilation_rate, activation)`:
  ``TfmetalExt>Int8MatMul`` / ``TfmetalExt>Int8Conv2D``, weight-only int8 contractions (float
  activations, an int8 kernel with Keras' per-output-channel scale, bias and activation in the same
  op); `quantize_int8(kernel, axis)` quantizes a float kernel the way Keras does.
- `rope(x, positions=None, max_wavelength=10000, scaling_factor=1.0, *, start_index=0, ...)`:
  ``TfmetalExt>Rope`` (+ ``TfmetalExt>RopeGrad``), keras-hub's rotary position embedding
  (linear, dynamic, YaRN and Llama 3 frequency scaling) in one op each way.
- `batch_norm_act(x, gamma=None, beta=None, side=None, *, activation="relu", epsilon=1e-3, alpha=0.2)`:
  ``TfmetalExt>BatchNormAct`` (+ ``TfmetalExt>BatchNormActGrad``: dx, dgamma, dbeta and d side in
  one op), batch normalization with batch statistics (training), an optional residual input and the
  activation in one op; returns ``(y, mean, variance)`` for the moving averages.
- `activation_grad(dy, x, activation)`: ``TfmetalExt>ActivationGrad``, ``dy * act'(x)`` of silu
  (swish), exact gelu or tanh gelu in one op (a feed-forward's backward pass; TF's autodiff makes
  3-5 temporaries of the activation's size); its own gradient (second order) is registered.
- `gated_activation_grad(dy, gate, up, activation)`: ``TfmetalExt>GatedActivationGrad``, the
  backward of ``act(gate) * up`` (``dy * up * act'(gate)``, ``dy * act(gate)``) in one op, for gated
  feed-forwards (Llama, Gemma); ``"activation_grad"`` covers it too.
- `sparse_softmax_cross_entropy(labels, logits)`: ``TfmetalExt>SparseSoftmaxCrossEntropy`` (+
  ``TfmetalExt>SparseSoftmaxCrossEntropyGrad``), ``tf.nn.sparse_softmax_cross_entropy_with_logits``
  in one op each way, keeping two float32 statistics per row instead of the [..., classes] softmax
  gradient (`tfmetal_ext.losses.FusedSparseCategoricalCrossentropy` runs it).
- `gemv(x, kernel, bias=None)`: ``TfmetalExt>Gemv``, ``x @ kernel + bias`` for an `x` of a few
  rows (a decoding step's projections), each weight read once; FusedDense and FusedEinsumDense run
  it up to ``fusion.GEMV_MAX_ROWS`` rows. Its gradient is MatMuls.

The op library is compiled on first use into a cache keyed by the TF version,
compiler flags and sources (see `status()`, ``tfmetal-ext build-ops``).
Without a compiler, or with ``TFMETAL_EXT_REFERENCE_OPS=1``, every op runs
its pure-TF reference instead (same results, more ops); so does each op that
``tfmetal_ext.configure(avoid_fusions=[...])`` names (``"softshrink"``,
``"layer_norm"``, ``"rms_norm"``, ``"multi_tensor_adam"``, ``"multi_tensor_lion"``,
``"multi_tensor_rmsprop"``, ``"attention"``, ``"int8_matmul"``, ``"int8_conv2d"``, ``"dropout"``, ``"rope"``,
``"batch_norm_act"``, ``"activation_grad"``, ``"sparse_softmax_cross_entropy"``, ``"gemv"``).
"""

from __future__ import annotations

from tfmetal_ext.ops import _loader  # noqa: F401  (ops._loader: the library loader, reached by tests)
from tfmetal_ext.ops._loader import BuildError, OpCacheError
from tfmetal_ext.ops.activation_grad import activation_grad, gated_activation_grad
from tfmetal_ext.ops.attention import attention
from tfmetal_ext.ops.batch_norm_act import batch_norm_act
from tfmetal_ext.ops.dropout import dropout
from tfmetal_ext.ops.gemv import gemv
from tfmetal_ext.ops.int8 import int8_conv2d, int8_matmul, quantize_int8
from tfmetal_ext.ops.layer_norm import layer_norm
from tfmetal_ext.ops.multi_tensor_adam import multi_tensor_adam
from tfmetal_ext.ops.multi_tensor_lion import multi_tensor_lion
from tfmetal_ext.ops.multi_tensor_rmsprop import multi_tensor_rmsprop
from tfmetal_ext.ops.rms_norm import rms_norm
from tfmetal_ext.ops.rope import rope
from tfmetal_ext.ops.softshrink import softshrink
from tfmetal_ext.ops.sparse_xent import sparse_softmax_cross_entropy
from tfmetal_ext.ops.status import OpsStatus, build, status

__all__ = ["BuildError", "OpCacheError", "OpsStatus", "activation_grad", "attention", "batch_norm_act", "build", "dropout", "gated_activation_grad", "gemv",
           "int8_conv2d", "int8_matmul", "layer_norm", "multi_tensor_adam", "quantize_int8",
           "multi_tensor_lion", "multi_tensor_rmsprop", "rms_norm", "rope", "softshrink", "sparse_softmax_cross_entropy",
           "status"]
