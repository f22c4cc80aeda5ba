"""The fusion table: names and maps every part of tfmetal-ext reads.

One home for:

* `ACTIVATION_OPS`: Keras activation name -> the op name in a fused node's
  ``fused_ops`` attribute, and which of them a contraction can absorb
  (`CONTRACTION_ACTIVATIONS`; per backend, the backend tables narrow it);
* the fused-op names the remapper and the Metal plugins emit;
* `CUSTOM_OPS`: this package's custom ops (``TfmetalExt>...``) and their
  gradient ops;
* `STOCK_TO_FUSED` / `OPTIMIZER_TO_FUSED` / `LOSS_TO_FUSED`: which tfmetal_ext class replaces which
  stock Keras class (`convert()` and `MetalCallback` both read it); `STOCK_KEPT`:
  stock classes kept on purpose, and why;
* `SAFE_FORMS`: the patterns ``configure(avoid_fusions=...)`` can switch to
  an unfused form, what that form is, and which fused ops imply it.

Which pattern fuses where (per backend, dtype, mode and capability) lives in
the backend tables beside this module (`tfmetal_ext.backends.cpu`, ``cuda``,
``metal``).
"""

from __future__ import annotations

import dataclasses
import types

# ----------------------------------------------------------------------------
# Activations.

# Keras activation name -> the op name in `fused_ops`.
ACTIVATION_OPS = types.MappingProxyType(
    {
        "relu": "Relu",
        "relu6": "Relu6",
        "elu": "Elu",
        "leaky_relu": "LeakyRelu",
        "tanh": "Tanh",
        "sigmoid": "Sigmoid",
        "gelu": "GeluExact",
        "gelu_approximate": "GeluApproximate",
    }
)

# TensorFlow functions people pass as `activation=` that emit the same op as a Keras
# activation: "tf.<path>" -> that Keras name (Keras' TF backend calls these very functions:
# keras/src/backend/tensorflow/nn.py).
TF_ACTIVATION_FUNCTIONS = types.MappingProxyType(
    {
        "nn.relu": "relu",
        "nn.relu6": "relu6",
        "nn.elu": "elu",
        "nn.leaky_relu": "leaky_relu",
        "nn.tanh": "tanh",
        "math.tanh": "tanh",
        "nn.sigmoid": "sigmoid",
        "math.sigmoid": "sigmoid",
        "nn.gelu": "gelu",
        "nn.silu": "silu",
        "nn.swish": "silu",
        "nn.softmax": "softmax",
        "nn.softplus": "softplus",
        "nn.selu": "selu",
    }
)

# Keras' crossentropy losses on the TF backend compute from the logits when the prediction they
# get is the activation op itself (keras/src/backend/tensorflow/nn.py `_get_logits`: an output
# carrying `_keras_logits`, or one whose op is Sigmoid / Softmax). The activation's input then has
# a second consumer (the loss), so a train step fuses the contraction without the activation:
# `_FusedMatMul[BiasAdd]`, on every backend. Measured on TF 2.21 / Keras 3.15, CPU with and
# without oneDNN: Dense(1, "sigmoid") + binary_crossentropy, float32. Under a mixed policy the
# loss gets a Cast of the output instead, and the activation fuses.
# fused_ops activation name -> the Keras loss functions that read its input.
LOSSES_READING_LOGITS = types.MappingProxyType(
    {
        "Sigmoid": ("binary_crossentropy",),
        "Softmax": ("categorical_crossentropy", "sparse_categorical_crossentropy"),
    }
)

# The activations every remapper (TF's on CPU and GPU, both Metal plugins)
# absorbs into Conv2D/MatMul + BiasAdd. Layers that promise a fused
# activation (ConvBNAct, ResidualBlock) accept exactly these.
CONTRACTION_ACTIVATIONS = ("relu", "relu6", "elu", "leaky_relu")
CONTRACTION_ACTIVATION_OPS = tuple(ACTIVATION_OPS[a] for a in CONTRACTION_ACTIVATIONS)

# keras.activations.leaky_relu's default negative slope (the layers emit
# tf.nn.leaky_relu with it, so the remapper sees the single LeakyRelu op).
LEAKY_RELU_ALPHA = 0.2


def activation_op(name):
    """The ``fused_ops`` name of a Keras activation name (None for ``"linear"``/None)."""
    if name in (None, "linear"):
        return None
    return ACTIVATION_OPS.get(name, name)


# keras.ops functions people pass as `activation=` that emit the same op as a Keras activation:
# "keras.ops.<name>" -> that Keras name. Only the two the RNN layers accept (keras.ops.gelu, for
# one, defaults to the tanh approximation where keras.activations.gelu does not).
KERAS_OPS_ACTIVATIONS = types.MappingProxyType({"tanh": "tanh", "sigmoid": "sigmoid"})

# keras-hub functions its layers pass as `activation=`: "<module>.<qualname>" -> the Keras name of
# what they compute (keras_hub/src/utils/keras_utils.py: `gelu_approximate` is
# `keras.activations.gelu(x, approximate=True)`; GPT-2's feed-forward uses it).
KERAS_HUB_ACTIVATION_FUNCTIONS = types.MappingProxyType(
    {"keras_hub.src.utils.keras_utils.gelu_approximate": "gelu_approximate"}
)

# Where a known activation callable may come from (`activation_name`'s `sources`).
KERAS, TF_FUNCTIONS, KERAS_OPS, KERAS_HUB = "keras", "tf", "keras_ops", "keras_hub"

# Activations that TF differentiates through several elementwise ops, each keeping a tensor of the
# activation's size for the backward pass (the tanh GELU: x, x**3's input, the tanh, 1 + tanh; 3-4
# [rows, units] tensors). In a training call the contraction layers apply them so that the backward
# pass recomputes them from their input (`layers._contraction.recomputed`): one tensor is kept, and
# the gradient is TF's own (bit for bit eagerly). Single-op activations (relu, tanh, sigmoid, ...)
# and silu (TF's own custom gradient) already keep one tensor.
RECOMPUTED_ACTIVATIONS = frozenset({"gelu", "gelu_approximate"})

# A projection's input rebuilt in the backward pass (`layers._replay`). In a training call inside a
# tf.function, `FusedDense` / `FusedEinsumDense` look at how their input was made: when it is a chain
# of the cheap elementwise ops below over a few tensors that are kept anyway (a feed-forward's
# `silu(gate) * up`, `gelu(pre)`, GeGLU's `gelu(x1) * x2`), the layer's gradient keeps those tensors
# and computes the chain again, instead of keeping the input and every tensor the chain's own
# gradients need. IdentityN (a custom gradient's output, e.g. TF's silu) passes its input through.
REPLAYED_OPS = frozenset(
    {
        "Identity", "Reshape", "Cast", "Mul", "AddV2", "Add", "Sub", "Neg", "RealDiv", "Square", "Pow",
        "Sqrt", "Rsqrt", "Exp", "Tanh", "Sigmoid", "Erf", "Erfc", "Softplus",
    }
)
# The replayed chain saves memory only when it holds a product of two computed tensors (one of these
# ops with two non-constant inputs): each operand is kept for the other's gradient, beside the
# product itself, which the projection keeps. A chain of casts, reshapes, sums, scalings and
# single-op activations (Relu, Tanh: their gradient keeps one tensor, as the projection would)
# gains nothing, and replaying it would cost the MatMul + BiasAdd + activation fusion of the layer
# before it: it is left as it is. Norms are not replayed into their projections' gradients: a norm's
# output feeds several projections (q, k, v; gate, up), each would normalize again and differentiate
# its own copy, and that cost a Llama train step ~10% of its time for 4 MiB per norm (bench_hub,
# T=512 / 1024). REBUILT_NORM_OPS (below) does it differently.
REPLAY_GAIN_OPS = frozenset({"Mul", "RealDiv", "Pow"})
# A replayed product act(gate) * up of two same-shape tensors, act a smooth activation the chain
# finds (ACTIVATION_GRAD_ACTIVATIONS): differentiated by one TfmetalExt>GatedActivationGrad.
GATED_PRODUCT_OPS = frozenset({"Mul"})


def activation_name(act, sources=(KERAS, TF_FUNCTIONS)):
    """The Keras name of activation `act` when it is a known one, else None (its op: `activation_op`).

    The one place that says whether an activation callable is known. `act` is
    a callable or None (``"linear"``); it is known, by `sources`, when it is
    ``KERAS``: a Keras activation itself (``keras.activations.get(its
    __name__)`` is it); ``TF_FUNCTIONS``: a TensorFlow function of
    `TF_ACTIVATION_FUNCTIONS`; ``KERAS_OPS``: a function of
    `KERAS_OPS_ACTIVATIONS`; ``KERAS_HUB``: a keras-hub function of
    `KERAS_HUB_ACTIVATION_FUNCTIONS` (matched by module and name, so keras-hub
    is never imported here). Any other callable (a lambda, a custom function
    or layer) is unknown.
    """
    if act is None:
        return "linear"
    if KERAS in sources:
        import keras  # lazy: this module is data, read before the frameworks load

        name = getattr(act, "__name__", None)
        if isinstance(name, str):
            try:
                if keras.activations.get(name) is act:
                    return name
            except Exception:  # not a Keras activation name
                pass
    if TF_FUNCTIONS in sources:
        import tensorflow as tf

        for path, name in TF_ACTIVATION_FUNCTIONS.items():
            if _attribute(tf, path) is act:
                return name
    if KERAS_OPS in sources:
        import keras

        for path, name in KERAS_OPS_ACTIVATIONS.items():
            if _attribute(keras.ops, path) is act:
                return name
    if KERAS_HUB in sources:
        where = f"{getattr(act, '__module__', '')}.{getattr(act, '__qualname__', '')}"
        if where in KERAS_HUB_ACTIVATION_FUNCTIONS:
            return KERAS_HUB_ACTIVATION_FUNCTIONS[where]
    return None


def _attribute(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


# ----------------------------------------------------------------------------
# Op names.

FUSED_CONV2D = "_FusedConv2D"
FUSED_MATMUL = "_FusedMatMul"
FUSED_DEPTHWISE = "_FusedDepthwiseConv2dNative"
FUSED_BATCH_MATMUL = "_FusedBatchMatMulV2"
FUSED_BATCH_NORM_EX = "_FusedBatchNormEx"
FUSED_BATCH_NORM_GRAD_EX = "_FusedBatchNormGradEx"
FUSED_BATCH_NORM = "FusedBatchNormV3"
FUSED_BATCH_NORM_GRAD = "FusedBatchNormGradV3"
CUDNN_RNN = "CudnnRNNV3"
CUDNN_RNN_GRAD = "CudnnRNNBackpropV3"


@dataclasses.dataclass(frozen=True)
class CustomOp:
    """One of this package's custom ops.

    Attributes:
        name: the registered op name (``"TfmetalExt>Softshrink"``).
        grad: the gradient op's name, or None when the op has none.
        safe_form: its `SAFE_FORMS` key (the pure-TF reference runs instead).
        backward: the op is itself a gradient, made only by backward passes (inside a custom
            gradient, whose ops TF names outside its ``gradient_tape/`` scope).
        variants: further op names of the same family (the same math header, kernels file,
            table row and `ops.status()` entry).
    """

    name: str
    grad: str | None
    safe_form: str
    backward: bool = False
    variants: tuple = ()  # further ops of the same kernels, row and status entry

    @property
    def op_names(self):
        return (self.name,) + ((self.grad,) if self.grad else ()) + self.variants


CUSTOM_OPS = types.MappingProxyType(
    {
        "softshrink": CustomOp("TfmetalExt>Softshrink", "TfmetalExt>SoftshrinkGrad", "softshrink"),
        "layer_norm": CustomOp("TfmetalExt>LayerNorm", "TfmetalExt>LayerNormGrad", "layer_norm"),
        "multi_tensor_adam": CustomOp("TfmetalExt>MultiTensorAdam", None, "multi_tensor_adam"),
        "multi_tensor_lion": CustomOp("TfmetalExt>MultiTensorLion", None, "multi_tensor_lion"),
        "multi_tensor_rmsprop": CustomOp("TfmetalExt>MultiTensorRMSprop", None, "multi_tensor_rmsprop"),
        "attention": CustomOp("TfmetalExt>Attention", "TfmetalExt>AttentionGrad", "attention"),
        "rms_norm": CustomOp("TfmetalExt>RMSNorm", "TfmetalExt>RMSNormGrad", "rms_norm"),
        # Weight-only int8 contractions; their gradients are registered in Python (tfmetal_ext.ops.int8).
        "int8_matmul": CustomOp("TfmetalExt>Int8MatMul", None, "int8_matmul"),
        "int8_conv2d": CustomOp("TfmetalExt>Int8Conv2D", None, "int8_conv2d"),
        # Dropout with a counter-based (Philox) mask the gradient op regenerates from the seed.
        "dropout": CustomOp("TfmetalExt>Dropout", "TfmetalExt>DropoutGrad", "dropout"),
        # Rotary position embedding (keras-hub's RotaryEmbedding); the gradient turns dy back.
        "rope": CustomOp("TfmetalExt>Rope", "TfmetalExt>RopeGrad", "rope"),
        # Batch norm with batch statistics + optional residual add + activation; one gradient op.
        "batch_norm_act": CustomOp("TfmetalExt>BatchNormAct", "TfmetalExt>BatchNormActGrad", "batch_norm_act"),
        # dy * act'(x) of a smooth activation (silu, gelu) in one op: itself a gradient (the backward
        # of a feed-forward's activation); its own gradient is registered in Python. Its gated variant
        # is the backward of act(gate) * up.
        "activation_grad": CustomOp("TfmetalExt>ActivationGrad", None, "activation_grad", backward=True,
                                    variants=("TfmetalExt>GatedActivationGrad",)),
        # Softmax cross-entropy with integer labels (Keras' SparseCategoricalCrossentropy from logits);
        # the gradient op makes the softmax again from two per-row statistics.
        "sparse_softmax_cross_entropy": CustomOp("TfmetalExt>SparseSoftmaxCrossEntropy",
                                                 "TfmetalExt>SparseSoftmaxCrossEntropyGrad",
                                                 "sparse_softmax_cross_entropy"),
        # A few rows times a weight matrix (a decoding step's projections), each weight read once;
        # its gradient is registered in Python (tfmetal_ext.ops.gemv: MatMuls).
        "gemv": CustomOp("TfmetalExt>Gemv", None, "gemv"),
    }
)
CUSTOM_OP_PREFIX = "TfmetalExt>"

SOFTSHRINK_OP = CUSTOM_OPS["softshrink"].name
SOFTSHRINK_GRAD_OP = CUSTOM_OPS["softshrink"].grad
LAYER_NORM_OP = CUSTOM_OPS["layer_norm"].name
LAYER_NORM_GRAD_OP = CUSTOM_OPS["layer_norm"].grad
MULTI_TENSOR_ADAM_OP = CUSTOM_OPS["multi_tensor_adam"].name
MULTI_TENSOR_LION_OP = CUSTOM_OPS["multi_tensor_lion"].name
MULTI_TENSOR_RMSPROP_OP = CUSTOM_OPS["multi_tensor_rmsprop"].name
RMS_NORM_OP = CUSTOM_OPS["rms_norm"].name
RMS_NORM_GRAD_OP = CUSTOM_OPS["rms_norm"].grad
ATTENTION_OP = CUSTOM_OPS["attention"].name
ATTENTION_GRAD_OP = CUSTOM_OPS["attention"].grad
INT8_MATMUL_OP = CUSTOM_OPS["int8_matmul"].name
INT8_CONV2D_OP = CUSTOM_OPS["int8_conv2d"].name
DROPOUT_OP = CUSTOM_OPS["dropout"].name
DROPOUT_GRAD_OP = CUSTOM_OPS["dropout"].grad
ROPE_OP = CUSTOM_OPS["rope"].name
ROPE_GRAD_OP = CUSTOM_OPS["rope"].grad
BATCH_NORM_ACT_OP = CUSTOM_OPS["batch_norm_act"].name
BATCH_NORM_ACT_GRAD_OP = CUSTOM_OPS["batch_norm_act"].grad
ACTIVATION_GRAD_OP = CUSTOM_OPS["activation_grad"].name
GATED_ACTIVATION_GRAD_OP = CUSTOM_OPS["activation_grad"].variants[0]
SPARSE_XENT_OP = CUSTOM_OPS["sparse_softmax_cross_entropy"].name
SPARSE_XENT_GRAD_OP = CUSTOM_OPS["sparse_softmax_cross_entropy"].grad
GEMV_OP = CUSTOM_OPS["gemv"].name

# The most rows (the product of all but the last input axis) for which FusedDense and
# FusedEinsumDense run a product as TfmetalExt>Gemv instead of MatMul, where the backend table's
# GEMV_PATTERN row has the dtype: the op has no blocking over rows (each row is one more pass of
# multiply-adds over the weights it holds in cache), so past a few rows MatMul's packed GEMM is
# faster (bench_ops' gemv section measures both).
GEMV_MAX_ROWS = 4
# The backend tables' row for that choice ("custom_gemv"), and why both Metal backends' rows say no.
GEMV_PATTERN = "custom_gemv"
GEMV_METAL_UNMEASURED = (
    "FusedDense and FusedEinsumDense keep MatMul (the backend's kernel) for a decoding step's rows on Metal: "
    "TfmetalExt>Gemv's Metal kernel gives the CPU kernel's bits (emulator, doctor --selftest) but its speed "
    "against the backend's MatMul has not been measured on a Mac; tfmetal_ext.ops.gemv runs it when called"
)

# Norm ops whose own backward pass keeps their input and statistics, not their output: a projection
# of their output (the layer's kernel gradient would keep it) makes it again in the backward pass
# from the norm's inputs, once per norm and backward graph for all its projections, and hands its
# gradient to the norm's output as usual (the norm's own gradient op runs once, on the sum). The
# norm kernels are deterministic: the same bits as the forward pass's output.
REBUILT_NORM_OPS = frozenset({RMS_NORM_OP, LAYER_NORM_OP})

# The `activation` attribute of TfmetalExt>BatchNormAct, in the order of the TFM_BNA_* codes of
# custom_ops/include/tfmetal/batch_norm_act.h (Keras activation names; "linear" is none; "gelu" is
# the exact erf form). BATCH_NORM_ACT_ALIASES maps the other names Keras accepts for them.
BATCH_NORM_ACT_ACTIVATIONS = ("linear", "relu", "relu6", "elu", "leaky_relu", "silu", "gelu")
BATCH_NORM_ACT_ALIASES = types.MappingProxyType({None: "linear", "swish": "silu"})

# The `activation` attribute of TfmetalExt>ActivationGrad, in the order of the TFM_ACTGRAD_* codes of
# custom_ops/include/tfmetal/activation_grad.h ("gelu" is the exact erf form, "gelu_approximate" the
# tanh form). ACTIVATION_GRAD_ALIASES maps the other names Keras accepts for them.
ACTIVATION_GRAD_ACTIVATIONS = ("silu", "gelu", "gelu_approximate")
ACTIVATION_GRAD_ALIASES = types.MappingProxyType({"swish": "silu"})

# The `activation` attribute of the int8 ops, in the order of the TFM_INT8_* codes of
# custom_ops/include/tfmetal/int8.h (Keras activation names; "linear" is none).
INT8_ACTIVATIONS = (
    "linear", "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid",
)

# Ops that are a whole fused layer by themselves (no remapper rewrite
# involved): the fusion report lists them beside the remapper's fused nodes.
FUSED_LAYER_OPS = frozenset(
    {CUDNN_RNN, CUDNN_RNN_GRAD} | {n for op in CUSTOM_OPS.values() for n in op.op_names}
)


def node_fused_ops(node):
    """What a fused node absorbed, as reports name it: a list of op or activation names.

    The remapper's nodes carry it in their ``fused_ops`` attribute.
    ``TfmetalExt>BatchNormAct`` (and its gradient) carries it in its
    ``activation`` attribute and its side-input count: ``["relu", "side"]``
    for batch norm + residual add + Relu. Other nodes: ``[]``.
    """
    if node.op in (BATCH_NORM_ACT_OP, BATCH_NORM_ACT_GRAD_OP) and "activation" in node.attr:
        return [node.attr["activation"].s.decode()] + (["side"] if node.attr["N"].i else [])
    if "fused_ops" in node.attr:
        return [s.decode() for s in node.attr["fused_ops"].list.s]
    return []


# Op types that only a backward pass makes: the custom ops' gradient ops, and the custom ops that are
# gradients themselves. Reports tell backward nodes by these as well as by their name scope.
BACKWARD_OPS = frozenset(
    {op.grad for op in CUSTOM_OPS.values() if op.grad} | {op.name for op in CUSTOM_OPS.values() if op.backward}
)


def is_fused_op(op):
    """`op` is a fused node type: a remapper ``_Fused*`` op or one of `FUSED_LAYER_OPS`."""
    return op.startswith("_Fused") or op in FUSED_LAYER_OPS


# ----------------------------------------------------------------------------
# Stock Keras class -> tfmetal_ext class.


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A tfmetal_ext class that replaces a stock Keras class.

    Attributes:
        stock: the stock class name in ``keras.layers`` / ``keras.optimizers``.
        fused: the tfmetal_ext class name in ``tfmetal_ext.layers`` /
            ``tfmetal_ext.optimizers``.
        advice: what to tell a user of the stock class (defaults to the
            fused class's full name).
    """

    stock: str
    fused: str
    module: str = "tfmetal_ext.layers"
    advice: str | None = None

    @property
    def qualified(self):
        return f"{self.module}.{self.fused}"

    @property
    def suggestion(self):
        return self.advice or self.qualified


def _table(*rows):
    return types.MappingProxyType({r.stock: r for r in rows})


STOCK_TO_FUSED = _table(
    Replacement("Conv2D", "FusedConv2D"),
    Replacement("DepthwiseConv2D", "FusedDepthwiseConv2D"),
    Replacement(
        "Conv1D", "FusedConv1D",
        advice="tfmetal_ext.layers.FusedConv1D (or ConvBNAct1D before a batch norm)",
    ),
    Replacement("SeparableConv2D", "FusedSeparableConv2D"),
    Replacement("Dense", "FusedDense"),
    Replacement("EinsumDense", "FusedEinsumDense"),
    Replacement(
        "BatchNormalization", "FusedBatchNorm",
        advice="tfmetal_ext.layers.FusedBatchNorm (or ConvBNAct after a conv)",
    ),
    Replacement("LayerNormalization", "FusedLayerNorm"),
    Replacement("LSTM", "FusedLSTM"),
    Replacement("GRU", "FusedGRU"),
    Replacement("MultiHeadAttention", "FusedMultiHeadAttention"),
    Replacement("RMSNormalization", "FusedRMSNorm"),
    Replacement("Dropout", "FusedDropout"),
    Replacement(
        "Embedding", "FusedEmbedding",
        advice="tfmetal_ext.layers.FusedEmbedding (its index arithmetic in int64, which stays in GPU memory)",
    ),
)

# Stock classes deliberately without a replacement: class name -> why (convert() reports it as the kept reason).
# None today: Embedding, once here, has FusedEmbedding (its lookup's int32 index arithmetic left the GPU).
STOCK_KEPT = types.MappingProxyType({})


def _optimizer(stock, fused, runs):
    """An `OPTIMIZER_TO_FUSED` row; its advice is the class, "takes the same arguments", and what it runs."""
    module = "tfmetal_ext.optimizers"
    return Replacement(stock, fused, module=module, advice=f"{module}.{fused} takes the same arguments and {runs}")


def _multi_tensor_runs(key, per_variable):
    return (f"updates all variables of a dtype with one {CUSTOM_OPS[key].name} per step where that op's "
            f"kernel runs (else {per_variable})")


OPTIMIZER_TO_FUSED = _table(
    _optimizer("Adam", "FusedAdam", _multi_tensor_runs("multi_tensor_adam", "one ResourceApplyAdam per variable")),
    _optimizer("AdamW", "FusedAdamW", _multi_tensor_runs(
        "multi_tensor_adam", "one ResourceApplyAdam and one decay op per variable")),
    _optimizer("SGD", "FusedSGD", "runs one fused op per variable (momentum and nesterov included)"),
    _optimizer("RMSprop", "FusedRMSprop", _multi_tensor_runs(
        "multi_tensor_rmsprop",
        "one ResourceApplyRMSProp per variable, ResourceApplyCenteredRMSProp when centered")),
    _optimizer("Adagrad", "FusedAdagrad",
               "runs one ResourceApplyAdagradV2 per variable where it rounds as Keras does (else Keras' math "
               "with its scalars once per step)"),
    _optimizer("Lion", "FusedLion", _multi_tensor_runs(
        "multi_tensor_lion", "Keras' update math as elementwise ops, its scalars built once per step")),
)

# Stock Keras losses with a fused class: `convert()` compiles a compiled model's copy with it (the same
# config), `to_stock()` maps it back (`conversion.pipeline.mapped_losses`), and MetalCallback advises it.
LOSS_TO_FUSED = _table(
    Replacement(
        "SparseCategoricalCrossentropy", "FusedSparseCategoricalCrossentropy", module="tfmetal_ext.losses",
        advice=("tfmetal_ext.losses.FusedSparseCategoricalCrossentropy takes the same arguments and runs "
                f"{CUSTOM_OPS['sparse_softmax_cross_entropy'].name} (one op each way, two statistics per row "
                "kept) where Keras would run SparseSoftmaxCrossEntropyWithLogits"),
    ),
)
# Keras' string names of those losses (``compile(loss="sparse_categorical_crossentropy")``): the stock
# class with its default arguments, as Keras resolves the name.
LOSS_NAMES = types.MappingProxyType({"sparse_categorical_crossentropy": "SparseCategoricalCrossentropy"})


# ----------------------------------------------------------------------------
# Safe forms: configure(avoid_fusions=[name]).


@dataclasses.dataclass(frozen=True)
class SafeForm:
    """An unfused form the layers and ops emit while a pattern is avoided.

    Attributes:
        name: the `configure(avoid_fusions=...)` name.
        description: what the layers and ops emit instead.
        implies: fused op names whose failure (or CPU fallback) this safe
            form fixes.
        bias_as_addv2: the safe form adds a bias with AddV2 (which CPU
            oneDNN still counts as a BiasAdd and fuses).
        custom_op: the `CUSTOM_OPS` key when the safe form replaces a custom
            op by its pure-TF reference.
    """

    name: str
    description: str
    implies: tuple = ()
    bias_as_addv2: bool = False
    custom_op: str | None = None


def _safe_forms(*forms):
    return types.MappingProxyType({f.name: f for f in forms})


SAFE_FORMS = _safe_forms(
    SafeForm(
        "conv_bias_relu",
        "FusedConv2D, FusedDepthwiseConv2D, ConvBNAct.fold() and FoldedResidualBlock add the bias with "
        "AddV2 instead of BiasAdd (conv + AddV2 + act): no _FusedConv2D on a GPU",
        implies=(FUSED_CONV2D,),
        bias_as_addv2=True,
    ),
    SafeForm(
        "matmul_bias_relu",
        "FusedDense adds the bias with AddV2 instead of BiasAdd (MatMul + AddV2 + act): "
        "no _FusedMatMul on a GPU",
        implies=(FUSED_MATMUL,),
        bias_as_addv2=True,
    ),
    SafeForm(
        "fused_batch_norm",
        "FusedBatchNorm and ConvBNAct (so ResidualBlock) normalize with moments + Rsqrt/Mul/Add "
        "instead of FusedBatchNormV3 (same statistics and moving-average update)",
        implies=(FUSED_BATCH_NORM, FUSED_BATCH_NORM_GRAD, FUSED_BATCH_NORM_EX),
    ),
    SafeForm(
        "softshrink",
        f"tfmetal_ext.ops.softshrink (Softshrink) runs its pure-TF reference instead of {SOFTSHRINK_OP}",
        implies=CUSTOM_OPS["softshrink"].op_names,
        custom_op="softshrink",
    ),
    SafeForm(
        "layer_norm",
        f"tfmetal_ext.ops.layer_norm (FusedLayerNorm) runs its pure-TF reference instead of {LAYER_NORM_OP}",
        implies=CUSTOM_OPS["layer_norm"].op_names,
        custom_op="layer_norm",
    ),
    SafeForm(
        "attention",
        "tfmetal_ext.ops.attention (FusedMultiHeadAttention) runs its pure-TF reference (MatMul, masked "
        "Softmax, MatMul: the score matrix is materialized; attention dropout by StatelessRandomUniformV2 "
        f"of its shape, the same mask) instead of {ATTENTION_OP}",
        implies=CUSTOM_OPS["attention"].op_names,
        custom_op="attention",
    ),
    SafeForm(
        "multi_tensor_adam",
        "tfmetal_ext.ops.multi_tensor_adam and FusedAdam(multi_tensor=True) update with one "
        f"ResourceApplyAdam per variable instead of {MULTI_TENSOR_ADAM_OP}",
        implies=CUSTOM_OPS["multi_tensor_adam"].op_names,
        custom_op="multi_tensor_adam",
    ),
    SafeForm(
        "multi_tensor_lion",
        "tfmetal_ext.ops.multi_tensor_lion (FusedLion) updates each variable with Keras' Lion ops "
        f"(Mul, AddV2, Sign, AssignSubVariableOp, AssignVariableOp) instead of {MULTI_TENSOR_LION_OP}",
        implies=CUSTOM_OPS["multi_tensor_lion"].op_names,
        custom_op="multi_tensor_lion",
    ),
    SafeForm(
        "multi_tensor_rmsprop",
        "tfmetal_ext.ops.multi_tensor_rmsprop (FusedRMSprop) updates each variable with Keras' RMSprop ops "
        f"(Mul, Square, AddV2, Sqrt, RealDiv, Assign*VariableOp) instead of {MULTI_TENSOR_RMSPROP_OP}",
        implies=CUSTOM_OPS["multi_tensor_rmsprop"].op_names,
        custom_op="multi_tensor_rmsprop",
    ),
    SafeForm(
        "rms_norm",
        f"tfmetal_ext.ops.rms_norm (FusedRMSNorm) runs its pure-TF reference instead of {RMS_NORM_OP}",
        implies=CUSTOM_OPS["rms_norm"].op_names,
        custom_op="rms_norm",
    ),
    SafeForm(
        "int8_matmul",
        "tfmetal_ext.ops.int8_matmul (quantized FusedDense, 1x1 FusedConv2D) de-quantizes the kernel (Cast, "
        f"RealDiv) and runs MatMul + BiasAdd + activation instead of {INT8_MATMUL_OP}",
        implies=CUSTOM_OPS["int8_matmul"].op_names,
        custom_op="int8_matmul",
    ),
    SafeForm(
        "int8_conv2d",
        "tfmetal_ext.ops.int8_conv2d (quantized FusedConv2D) de-quantizes the kernel (Cast, RealDiv) and runs "
        f"Conv2D + BiasAdd + activation instead of {INT8_CONV2D_OP}",
        implies=CUSTOM_OPS["int8_conv2d"].op_names,
        custom_op="int8_conv2d",
    ),
    SafeForm(
        "dropout",
        "tfmetal_ext.ops.dropout (FusedDropout) runs its pure-TF reference (StatelessRandomGetKeyCounter, "
        "StatelessRandomUniformV2, GreaterEqual, Mul, SelectV2: the same mask; the gradient keeps it) instead "
        f"of {DROPOUT_OP}",
        implies=CUSTOM_OPS["dropout"].op_names,
        custom_op="dropout",
    ),
    SafeForm(
        "rope",
        "tfmetal_ext.ops.rope runs its pure-TF reference (Cos, Sin, Mul, Sub, AddV2 on the halves; the same "
        f"float32 math) instead of {ROPE_OP}",
        implies=CUSTOM_OPS["rope"].op_names,
        custom_op="rope",
    ),
    SafeForm(
        "batch_norm_act",
        "tfmetal_ext.ops.batch_norm_act runs its pure-TF reference (Mean, SquaredDifference, Rsqrt, Mul, "
        f"AddV2 and the activation's ops; the same float32 statistics) instead of {BATCH_NORM_ACT_OP}",
        implies=CUSTOM_OPS["batch_norm_act"].op_names,
        custom_op="batch_norm_act",
    ),
    SafeForm(
        "activation_grad",
        "tfmetal_ext.ops.activation_grad runs its pure-TF reference (Cast, Exp, Erf, Mul, AddV2, RealDiv, "
        f"SelectV2: the same float32 formula) instead of {ACTIVATION_GRAD_OP}",
        implies=CUSTOM_OPS["activation_grad"].op_names,
        custom_op="activation_grad",
    ),
    SafeForm(
        "sparse_softmax_cross_entropy",
        "tfmetal_ext.ops.sparse_softmax_cross_entropy (FusedSparseCategoricalCrossentropy) runs its pure-TF "
        "reference (Max, Exp, Sum, Log, GatherV2; the gradient Exp, OneHot, Mul: the same float32 formula) "
        f"instead of {SPARSE_XENT_OP}",
        implies=CUSTOM_OPS["sparse_softmax_cross_entropy"].op_names,
        custom_op="sparse_softmax_cross_entropy",
    ),
    SafeForm(
        "gemv",
        "tfmetal_ext.ops.gemv (FusedDense and FusedEinsumDense on a decoding step's rows) runs MatMul + BiasAdd "
        f"instead of {GEMV_OP}",
        implies=CUSTOM_OPS["gemv"].op_names,
        custom_op="gemv",
    ),
)


def safe_form_for_op(op):
    """The `SafeForm` that avoids fused op `op`, or None."""
    for form in SAFE_FORMS.values():
        if op in form.implies:
            return form
    return None


def safe_form_fix(name):
    """The fix for a failed or falling-back pattern `name` (a `SAFE_FORMS` key)."""
    return (
        f"tfmetal_ext.configure(avoid_fusions=[{name!r}]) before building the model: "
        f"{SAFE_FORMS[name].description}"
    )
