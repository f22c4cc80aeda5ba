"""The open tensorflow-metal-plugin PluggableDevice (PyPI; Apache-2.0), the Metal backend of TF 2.21.

Facts read from its sdist (``pip download --no-deps tensorflow-metal-plugin==0.4.1``:
``README.md``, ``TF_SUPPORTED_VERSION``, ``setup.py`` and
``src/tensorflow/core/common_runtime/metal/``). None of its code is in this
project; the tests and scripts that need its source fetch the sdist at run
time (`tfmetal_ext.testing.metal_plugin_source`). Not measured here: no Mac on
the project's machines.

Kernels (`KERNELS`, `HOST_MEMORY`, `TF_DEFAULT_KERNELS`, `UNREGISTERED_HOST_OPS`): generated from the
sdist by ``scripts/gen_metal_plugin_kernels.py`` into
`tfmetal_ext.backends._metal_plugin_kernels`, which runs the plugin's own
registration functions (``kernels/metal_kernels.mm``
``RegisterAllMetalKernels`` and the per-file ``RegisterMetal*Kernels``)
against a recording stand-in of TF's kernel-builder C API. 0.4.1: 268 ops on
TF 2.21, the count its README claims ("268, listed in docs/kernels.md"),
float32/float16 almost everywhere, bfloat16 only as a ``Cast`` end. No
``Einsum``, no ``CudnnRNN*``, no ``BlockLSTM``/``GRUBlockCell`` (its README:
those subsystems were removed), no ``Pack``/``Unpack``. `HOST_MEMORY` holds
the arguments each kernel declares with ``TF_KernelBuilder_HostMemory`` (the
axes, shapes and sizes it reads on the host: ``ConcatV2``'s ``axis``, the
reductions' ``reduction_indices``), in the shape of Apple's table;
`Backend.host_memory_args` answers from it, so predicted transfers on this
backend follow the plugin's own declarations.

Host ops: ``RegisterAllMetalKernels`` registers the ref- and resource-variable
kernels, the optimizers' ``ResourceApply*`` and ``ParallelConcat`` only when
``ResourceVariableApiAvailable()`` (``kernels/metal_kernel_util.mm``) finds
``TF_GetInputTensorFromVariable``, ``TF_MaybeLockVariableInputMutexesInOrder``
and the other symbols of
`_metal_plugin_kernels.RESOURCE_VARIABLE_API_SYMBOLS` with ``dlsym``. TF
2.20/2.21 export none of them (tensorflow/tensorflow#126374; fixed for 2.22 by
#126377), so on TF 2.21 those ops run on the host: on the CPU device, or, for
``Assign{,Add,Sub}VariableOp``, through TF's own device-agnostic kernel, which
the plugin's comment in ``metal_kernel_util.h`` says reads and writes the
device memory from the host. The plugin then makes every Metal kernel wait for
the GPU before returning (``SynchronousMode()``; ``TF_METAL_SYNCHRONOUS``
forces either way). ``GatherNd`` is registered unconditionally (its
``RegisterMetalGatherNdKernels``), unlike ``ResourceGatherNd``. Our op
library's gap kernels for ``AssignVariableOp`` / ``AssignAddVariableOp`` /
``AssignSubVariableOp`` (`tfmetal_ext.backends.gap_kernels`) reach the
variables through TF's C++ kernel API, which TF 2.21 exports, and take those
three off the host; they stay unregistered where TF exports the C API
(`gap_kernels.variable_api_exported`), since the plugin then has its own.

Fusions, in the order they run on a graph placed on the plugin's device
(named ``GPU``):

* TF's grappler remapper, which runs for a pluggable device named GPU (TF 2.21
  ``tensorflow/core/grappler/optimizers/remapper.cc``, its GPU branches):
  Conv2D + BiasAdd + Relu -> ``_FusedConv2D`` only with Relu, only spatial
  filters (not 1x1), NHWC/NCHW; float32, and float16 too as measured on TF
  2.21's remapper under a virtual GPU cluster without oneDNN
  (``tests/plugin_pass``; a newer upstream ``IsGpuCompatibleDataType`` reads
  float32 only; with oneDNN on, the remapper skips every half node on any
  device); the plugin's pass fuses half either way;
  never Conv2D + BiasAdd alone (that pattern is GPU-compatible only for a
  MatMul); MatMul only with ``TF_USE_CUBLASLT=1`` (``BlasLtMatmulEnabled``);
  FusedBatchNorm(V2/V3) [+ Add] + Relu -> ``_FusedBatchNormEx`` on GPU for
  float32/half with ``U`` float32 and a single data consumer, and in training
  only with cuDNN's ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT``
  (``BatchnormSpatialPersistentEnabled()``: compiled out without cuDNN, as in
  TF's macOS wheel) plus half, NHWC and channels % 4 == 0; FusedBatchNormGrad
  + ReluGrad -> ``_FusedBatchNormGradEx`` needs that cuDNN mode too. Conv2D +
  FusedBatchNorm and DepthwiseConv2dNative + BiasAdd fuse only on a CPU.
* Then the plugin's own graph pass (``metal_graph.mm`` ``FuseGraph``, plugin
  optimizers run last): a ``BiasAdd`` whose input is a ``Conv2D`` or
  ``MatMul`` (transposed operands too) that feeds nothing else, both placed
  on a device whose name contains "GPU", becomes ``_FusedConv2D`` /
  ``_FusedMatMul`` with ``fused_ops=[BiasAdd]``; when the BiasAdd in turn
  feeds only one of Relu, Relu6, Elu, LeakyRelu, Sigmoid, Tanh (also on the
  GPU), that is absorbed too. It checks no dtype: the node only needs a
  ``T``. Where TF's remapper already fused a chain no BiasAdd is left and the
  pass does nothing. It also turns TF's layout optimizer off (``MetalInitGraph``).
* In a training step the LeakyRelu gradient reads the pre-activation (TF's
  ``nn_grad.py``), so the BiasAdd has two consumers and only ``[BiasAdd]``
  fuses; Relu, Relu6, Elu, Sigmoid and Tanh gradients read the output.

Stock LSTM / GRU: Keras 3.15 (``keras/src/backend/tensorflow/rnn.py``
``cudnn_ok``, ``keras/src/layers/rnn/lstm.py`` / ``gru.py`` ``inner_loop``)
emits ``CudnnRNNV3`` when ``use_cudnn`` is ``"auto"`` (the default) or True,
``recurrent_dropout`` is 0, the activation is tanh and the recurrent
activation sigmoid, ``unroll=False``, ``use_bias=True`` (GRU: also
``reset_after=True``) and ``tf.config.list_logical_devices("GPU")`` is not
empty, which the plugin's device makes it. The plugin has no kernel for it
and TF no CPU kernel, so the step fails.
"""

import types

from tfmetal_ext.backends import _metal_plugin_kernels as _generated
from tfmetal_ext.backends import fusion
from tfmetal_ext.backends import pairings as _pairings
from tfmetal_ext.backends._table import PREDICT, Fusion, backend, never
from tfmetal_ext.backends.fusion import CONTRACTION_ACTIVATION_OPS

# The release this package's tables were generated from and tested against (the pairing data's pin).
# When the pin moves, rerun `python scripts/gen_metal_plugin_kernels.py` and update SDIST_SHA256.
PIN = _pairings.PLUGIN_PIN
# Its TF_SUPPORTED_VERSION: the one TensorFlow release it loads into (checked at load).
TF_VERSION = _pairings.PLUGIN_TF_VERSION
# sha256 of the pin's sdist (tensorflow_metal_plugin-<PIN>.tar.gz) as PyPI serves it.
SDIST_SHA256 = "7ce3f583d679fc4fda2f0aec1ab497681c0faf986e12912028b5159ecfcf2bd7"
# The oldest macOS it runs on (it calls APIs that arrived in macOS 15).
MIN_MACOS = _pairings.PLUGIN_MIN_MACOS

F32_F16 = ("float32", "float16")

# The activations FuseGraph absorbs after Conv2D/MatMul + BiasAdd (its IsFusableActivation).
PASS_ACTS = tuple(CONTRACTION_ACTIVATION_OPS) + tuple(
    a for a in ("Sigmoid", "Tanh") if a not in CONTRACTION_ACTIVATION_OPS
)
# In a training step: LeakyRelu's gradient (LeakyReluGrad) reads the pre-activation, so it stays out.
PASS_TRAIN_ACTS = tuple(a for a in PASS_ACTS if a != "LeakyRelu")

# op -> dtypes of its first type constraint (DTYPE_ATTR names the attr when it is not T), as
# registered on TF_VERSION; generated, see the module docstring.
KERNELS = types.MappingProxyType(_generated.KERNELS)
DTYPE_ATTR = types.MappingProxyType(_generated.DTYPE_ATTR)
# TensorFlow's own DEVICE_DEFAULT kernels, which serve the plugin's device too.
TF_DEFAULT_KERNELS = types.MappingProxyType(_generated.TF_DEFAULT_KERNELS)
# op -> {dtype: the arguments its kernel keeps in host memory} (generated, as KERNELS).
HOST_MEMORY = types.MappingProxyType({op: types.MappingProxyType(by) for op, by in _generated.HOST_MEMORY.items()})
RESOURCE_VARIABLE_API_SYMBOLS = _generated.RESOURCE_VARIABLE_API_SYMBOLS
RESOURCE_VARIABLE_API_GATE = _generated.RESOURCE_VARIABLE_API_GATE

_RESOURCE_API = (
    "tensorflow-metal-plugin registers its kernel only when TensorFlow exports the resource-variable "
    "kernel C API (TF_GetInputTensorFromVariable, TF_MaybeLockVariableInputMutexesInOrder, ...), which "
    f"TF {TF_VERSION} does not (tensorflow/tensorflow#126374, fixed for 2.22 by #126377)"
)
_SYNC = "; meanwhile every Metal kernel waits for the GPU before returning (TF_METAL_SYNCHRONOUS)"


def _host_reason(op):
    if op in TF_DEFAULT_KERNELS and "float32" in (TF_DEFAULT_KERNELS[op] or ("float32",)):
        return (
            f"{_RESOURCE_API}: TensorFlow's own device-agnostic kernel runs it, updating the variable "
            "from the host through its unified-memory address" + _SYNC
        )
    return f"{_RESOURCE_API}: no GPU kernel, so it runs on the CPU" + _SYNC


# op -> why it runs on the host on TF_VERSION: the kernels the plugin registers only with the
# resource-variable C API, which this TensorFlow lacks.
UNREGISTERED_HOST_OPS = types.MappingProxyType(
    {op: _host_reason(op) for op in _generated.NEEDS_RESOURCE_VARIABLE_API}
)
HOST_OPS = UNREGISTERED_HOST_OPS  # the name before issue 28 (public module)

# Our multi-tensor optimizer ops reach variables through TF's C++ kernel API, which TF 2.21 exports
# (custom_ops/include/tfmetal/resource_variables.h), so their Metal kernels register here too.
_MULTI_TENSOR_METAL = (
    "tfmetal_ext custom op with a Metal kernel (variables through TF's C++ kernel API, which TF 2.21 "
    "exports; not the C API this TensorFlow lacks)"
)

_RNN_FIX = (
    "use tfmetal_ext.layers.{fused} (or tfmetal_ext.convert(model)), or pass use_cudnn=False "
    "(Keras' step loop: no CudnnRNNV3)"
)


def _rnn_reason(name, extra=""):
    return (
        f"stock keras.layers.{name} emits CudnnRNNV3 when a GPU is visible and its arguments allow cuDNN "
        "(use_cudnn 'auto' or True, recurrent_dropout=0, activation tanh, recurrent_activation sigmoid, "
        f"unroll=False, use_bias=True{extra}); tensorflow-metal-plugin has no CudnnRNN kernel and TensorFlow "
        "has no CPU kernel for it, so the train or predict step fails. Fix: " + _RNN_FIX.format(fused="Fused" + name)
    )


UNSUPPORTED_LAYERS = types.MappingProxyType(
    {"LSTM": _rnn_reason("LSTM"), "GRU": _rnn_reason("GRU", ", reset_after=True")}
)

_BF16_PASS = (
    "bfloat16: the plugin has no bfloat16 {op} kernel, so the placer puts those nodes on the CPU and "
    "neither pass fuses them; its graph pass checks no dtype, so a bfloat16 {op} + BiasAdd placed on the "
    "GPU would become a {fused} with no kernel either (the plugin registers it for float32/float16 only)"
)

METAL_PLUGIN = backend(
    "metal_plugin", "metal", "tensorflow-metal-plugin",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu|Sigmoid|Tanh)] float32/half, any filter, with or without an "
            "activation: TF's remapper fuses Conv2D+BiasAdd+Relu itself (not 1x1), the plugin's graph "
            "pass the rest; training: LeakyRelu not fused; no bfloat16 kernels",
            dtypes=F32_F16, acts=PASS_ACTS, train_acts=PASS_TRAIN_ACTS,
            dtype_notes={"bfloat16": _BF16_PASS.format(op="Conv2D", fused=fusion.FUSED_CONV2D)},
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu|Sigmoid|Tanh)] float32/half (the plugin's graph pass; TF's "
            "remapper fuses MatMul on a GPU only with TF_USE_CUBLASLT=1); training: LeakyRelu not fused; "
            "no bfloat16 kernels",
            dtypes=F32_F16, acts=PASS_ACTS, train_acts=PASS_TRAIN_ACTS,
            dtype_notes={"bfloat16": _BF16_PASS.format(op="MatMul", fused=fusion.FUSED_MATMUL)},
        ),
        "matmul_bias_gelu": never(
            "not fused (MatMul + BiasAdd fuse; GELU stays unfused)",
            why_not="the plugin's graph pass absorbs Relu, Relu6, Elu, LeakyRelu, Sigmoid and Tanh only, and TF's "
            "remapper fuses GELU on a GPU only through cuBLASLt",
        ),
        "depthwise_bias_act": never(
            "not fused",
            why_not="the plugin's graph pass fuses Conv2D and MatMul only; TF's remapper fuses "
            "DepthwiseConv2dNative only on a CPU",
        ),
        "conv2d_bias_add_relu": never(
            "only [BiasAdd]",
            why_not="no Conv2D + BiasAdd + Add + Relu fusion (TF's remapper does it only with oneDNN; the plugin's "
            "pass stops at a BiasAdd whose consumer is not an activation)",
        ),
        "conv2d_batchnorm_act": never(
            "not fused", why_not="TF's remapper fuses Conv2D + FusedBatchNorm only on a CPU"
        ),
        "batchnorm_act": Fusion(
            "FusedBatchNorm(V3) [+ Add side input] + Relu, inference only, float32/half (TF's remapper on GPU; "
            "plugin kernel float32/half); training needs cuDNN's persistent batch-norm mode",
            dtypes=F32_F16, acts=("Relu",), requires_act=("Relu",), modes=(PREDICT,),
            train_reason=(
                "training: TF's remapper fuses FusedBatchNorm + Relu on a GPU only with cuDNN's "
                "CUDNN_BATCHNORM_SPATIAL_PERSISTENT mode, which a build without cuDNN (TF's macOS wheel) never has"
            ),
        ),
        "batchnorm_grad_relugrad": never(
            "not fused",
            why_not="TF's remapper fuses FusedBatchNormGrad + ReluGrad only with cuDNN's "
            "CUDNN_BATCHNORM_SPATIAL_PERSISTENT mode (not in a build without cuDNN)",
        ),
        "custom_layer_norm": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_rms_norm": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_batch_norm_act": Fusion(
            "tfmetal_ext custom op, training: batch norm + residual add + activation in one op each way "
            "(the plugin fuses no batch norm in training: no cuDNN)",
            dtypes=F32_F16,
        ),
        "custom_softshrink": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_activation_grad": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_sparse_softmax_cross_entropy": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_gemv": never("tfmetal_ext custom op; not used by the layers here", why_not=fusion.GEMV_METAL_UNMEASURED),
        "custom_attention": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_dropout": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_int8_matmul": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_int8_conv2d": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "multi_tensor_adam": Fusion(_MULTI_TENSOR_METAL, dtypes=F32_F16),
        "multi_tensor_lion": Fusion(_MULTI_TENSOR_METAL, dtypes=F32_F16),
        "multi_tensor_rmsprop": Fusion(_MULTI_TENSOR_METAL, dtypes=F32_F16),
        "cudnn_rnn": never(
            "not fused: no CudnnRNN kernel",
            why_not="tensorflow-metal-plugin has no CudnnRNN kernel (and TensorFlow no CPU kernel): a CudnnRNNV3 "
            "fails the step",
        ),
    },
    kernels=KERNELS,
    kernels_complete=True,
    shared_kernels=TF_DEFAULT_KERNELS,
    dtype_attrs=DTYPE_ATTR,
    host_memory=HOST_MEMORY,
    host_ops=UNREGISTERED_HOST_OPS,
    unsupported_layers=UNSUPPORTED_LAYERS,
    source=__doc__,
)
