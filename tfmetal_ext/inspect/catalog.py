"""The pattern catalog: every fusion this package targets, per backend and dtype.

Two parts:

* `PATTERNS`: each fusion with the fused op it becomes and the conditions per
  backend (REFERENCE.md sections 1 and 4; the CPU rows re-measured on TF 2.21).
* Layer rules: for a Keras layer and a `FusionContext` (backend, oneDNN,
  dtype, train or predict, XLA), the `Expectation` of what the graph that runs
  should contain, with the reason whenever that is less than the full pattern.
  Later layer families register their own rules with `register_rule`.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A fusion pattern.

    Attributes:
        name: catalog key, e.g. ``"conv2d_bias_act"``.
        description: the unfused subgraph it replaces.
        fused_op: the op the remapper emits.
        support: per backend (``"cpu_onednn"``, ``"cpu"``, ``"cuda"``,
            ``"metal"``), the fused_ops lists and conditions, in words.
    """

    name: str
    description: str
    fused_op: str
    support: dict


PATTERNS = {
    p.name: p
    for p in [
        Pattern(
            "conv2d_bias_act",
            "Conv2D + BiasAdd [+ Relu|Relu6|Elu|LeakyRelu]",
            "_FusedConv2D",
            {
                "cpu_onednn": "[BiasAdd(, act)] float32, bfloat16; training: LeakyRelu not fused (its gradient needs the pre-activation)",
                "cpu": "[BiasAdd(, act)] float32/float64, NHWC; no bfloat16",
                "cuda": "needs an activation; Relu only by default, float32/half, not 1x1 filters",
                "metal": "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half (tensorflow-metal plugin remapper); no bfloat16",
            },
        ),
        Pattern(
            "matmul_bias_act",
            "MatMul + BiasAdd [+ Relu|Relu6|Elu|LeakyRelu|Tanh|Sigmoid]",
            "_FusedMatMul",
            {
                "cpu_onednn": "[BiasAdd(, act)] float32, bfloat16; Tanh and Sigmoid too; training: LeakyRelu not fused",
                "cpu": "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32",
                "cuda": "only with TF_USE_CUBLASLT=1",
                "metal": "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half; relu(bias_add(matmul)) reported to miscompute in graph mode",
            },
        ),
        Pattern(
            "matmul_bias_gelu",
            "MatMul + BiasAdd + GELU subgraph",
            "_FusedMatMul",
            {
                "cpu_onednn": "[BiasAdd, GeluExact|GeluApproximate], inference only",
                "cpu": "not fused",
                "cuda": "half with cuDNN runtime fusion",
                "metal": "not fused",
            },
        ),
        Pattern(
            "depthwise_bias_act",
            "DepthwiseConv2dNative + BiasAdd + act",
            "_FusedDepthwiseConv2dNative",
            {
                "cpu_onednn": "[BiasAdd(, act)] float32, bfloat16",
                "cpu": "not fused",
                "cuda": "not fused",
                "metal": "not fused",
            },
        ),
        Pattern(
            "conv2d_bias_add_relu",
            "Conv2D + BiasAdd + Add(residual) + Relu",
            "_FusedConv2D",
            {
                "cpu_onednn": "[BiasAdd, Add, Relu], inference",
                "cpu": "only [BiasAdd]",
                "cuda": "not fused",
                "metal": "not fused",
            },
        ),
        Pattern(
            "conv2d_batchnorm_act",
            "Conv2D + FusedBatchNormV3 [+ act], inference",
            "_FusedConv2D",
            {
                "cpu_onednn": "[FusedBatchNorm(, act)] float32",
                "cpu": "[FusedBatchNorm(, act)] float32",
                "cuda": "not fused",
                "metal": "not fused",
            },
        ),
        Pattern(
            "batchnorm_act",
            "FusedBatchNormV3 [+ Add side input] + Relu",
            "_FusedBatchNormEx",
            {
                "cpu_onednn": "yes, without side input",
                "cpu": "not fused",
                "cuda": "float32/half; training needs half, NHWC, channels % 4 == 0",
                "metal": "float32/half (kernel present in tensorflow-metal)",
            },
        ),
        Pattern(
            "batchnorm_grad_relugrad",
            "FusedBatchNormGradV3 + ReluGrad",
            "_FusedBatchNormGradEx",
            {
                "cpu_onednn": "not fused",
                "cpu": "not fused",
                "cuda": "training only, half, NHWC, channels % 4 == 0",
                "metal": "not fused",
            },
        ),
        Pattern(
            "batch_norm",
            "Keras BatchNormalization (moments + Rsqrt/Mul/Sub/Add)",
            "",
            {k: "not fused: Keras 3 never emits FusedBatchNormV3" for k in ("cpu_onednn", "cpu", "cuda", "metal")},
        ),
        Pattern(
            "layer_norm",
            "Keras LayerNormalization (moments + Rsqrt + Mul/Add)",
            "",
            {k: "not fused: no remapper pattern on any device" for k in ("cpu_onednn", "cpu", "cuda", "metal")},
        ),
        Pattern(
            "custom_layer_norm",
            "layer norm over the last axis (FusedLayerNorm)",
            "TfmetalExt>LayerNorm",
            {
                "cpu_onednn": "tfmetal_ext custom op: one TfmetalExt>LayerNorm forward, one TfmetalExt>LayerNormGrad backward",
                "cpu": "tfmetal_ext custom op: one TfmetalExt>LayerNorm forward, one TfmetalExt>LayerNormGrad backward",
                "cuda": "no CUDA kernel: the pure-TF reference runs (18 ops fwd+bwd)",
                "metal": "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)",
            },
        ),
        Pattern(
            "custom_softshrink",
            "softshrink activation (Softshrink layer; keras.ops.soft_shrink is several elementwise ops)",
            "TfmetalExt>Softshrink",
            {
                "cpu_onednn": "tfmetal_ext custom op: one TfmetalExt>Softshrink forward, one TfmetalExt>SoftshrinkGrad backward",
                "cpu": "tfmetal_ext custom op: one TfmetalExt>Softshrink forward, one TfmetalExt>SoftshrinkGrad backward",
                "cuda": "no CUDA kernel: the op runs on the CPU (copies each way); use the reference there",
                "metal": "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)",
            },
        ),
        Pattern(
            "multi_tensor_adam",
            "Adam update of every variable of one dtype (FusedAdam(multi_tensor=True))",
            "TfmetalExt>MultiTensorAdam",
            {
                "cpu_onednn": "one op per step and dtype group",
                "cpu": "one op per step and dtype group",
                "cuda": "no CUDA kernel: one ResourceApplyAdam per variable",
                "metal": "Metal kernel where TF exports the resource-variable C API (TF 2.19 yes, 2.21 Linux wheel no); else one ResourceApplyAdam per variable",
            },
        ),
        Pattern(
            "cudnn_rnn",
            "a whole LSTM/GRU recurrence (tanh/sigmoid, no recurrent dropout, GRU reset_after=True)",
            "CudnnRNNV3",
            {
                "cpu_onednn": "no kernel (GPU-only op); FusedLSTM/FusedGRU hoist the input projection into one _FusedMatMul[BiasAdd]",
                "cpu": "no kernel (GPU-only op); the input projection fuses as _FusedMatMul[BiasAdd] (float32)",
                "cuda": "cuDNN: float32, float16, float64 (bfloat16 kernels registered, cuDNN support varies); masks must be right-padded (sequence_lengths)",
                "metal": "tensorflow-metal kernel: float32, float16, bfloat16; emitted as Keras emits it (batch-major, sequence_lengths)",
            },
        ),
    ]
}

# Ops that are a whole fused layer by themselves (no remapper rewrite involved):
# the fusion report lists them with the remapper's fused nodes. The TfmetalExt>
# ops are this package's custom ops (tfmetal_ext.ops).
FUSED_LAYER_OPS = frozenset(
    {
        "CudnnRNNV3",
        "CudnnRNNBackpropV3",
        "TfmetalExt>LayerNorm",
        "TfmetalExt>LayerNormGrad",
        "TfmetalExt>Softshrink",
        "TfmetalExt>SoftshrinkGrad",
        "TfmetalExt>MultiTensorAdam",
    }
)

# Keras activation name -> the op name in `fused_ops`.
ACTIVATION_OPS = {
    "relu": "Relu",
    "relu6": "Relu6",
    "elu": "Elu",
    "leaky_relu": "LeakyRelu",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "gelu": "GeluExact",
    "gelu_approximate": "GeluApproximate",
}
_CONTRACTION_ACTS = ("Relu", "Relu6", "Elu", "LeakyRelu")
_ONEDNN_MATMUL_ACTS = _CONTRACTION_ACTS + ("Tanh", "Sigmoid")

REASON_XLA = "XLA compiled: grappler not applied"
REASON_HALF_CPU = "float16 on CPU: remapper skips half"
REASON_BN = (
    "BatchNormalization is not fused by Keras 3 (moments + Rsqrt/Mul/Sub/Add, no "
    "FusedBatchNormV3)"
)
REASON_LN = (
    "LayerNormalization is not fused by Keras 3 (moments + Rsqrt + Mul/Add): no "
    "remapper pattern on any device"
)


@dataclasses.dataclass(frozen=True)
class FusionContext:
    """Where and how a graph runs; decides what can fuse.

    Attributes:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        onednn: oneDNN is on (CPU).
        mode: ``"train"`` or ``"predict"``.
        xla: the step is XLA compiled.
        cpu_fp16: the CPU computes float16 natively (then half fuses on CPU).
        cublaslt: ``TF_USE_CUBLASLT=1`` (CUDA MatMul fusions).
    """

    backend: str = "cpu"
    onednn: bool = True
    mode: str = "predict"
    xla: bool = False
    cpu_fp16: bool = False
    cublaslt: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("TF_USE_CUBLASLT", "0") == "1"
    )

    @property
    def support_key(self):
        if self.backend == "cpu":
            return "cpu_onednn" if self.onednn else "cpu"
        return self.backend


@dataclasses.dataclass(frozen=True)
class Expectation:
    """What the executed graph should contain for one layer.

    Attributes:
        pattern: catalog key.
        op: the fused op expected here, or None when nothing can fuse.
        fused_ops: the expected ``fused_ops`` (a prefix match is accepted,
            since a following layer can extend the fusion, e.g. a residual
            Add + Relu).
        ideal_fused_ops: the full pattern's ``fused_ops`` on the best backend.
        reason: why `op`/`fused_ops` fall short of the ideal, else None.
        match_layer: the layer name whose weights the fused node reads
            (defaults to the layer itself).
        note: a caveat worth reading even when fused.
        ideal_op: the fused op of the full pattern when it differs from what
            may fuse here (e.g. ``_FusedBatchNormEx`` while the CPU fuses
            ``_FusedConv2D``); None means `op`.
    """

    pattern: str
    op: str | None
    fused_ops: tuple | None
    ideal_fused_ops: tuple | None
    reason: str | None = None
    match_layer: str | None = None
    note: str | None = None
    ideal_op: str | None = None


_RULES = []  # (layer class, rule function), most specific registered last


def register_rule(layer_cls, rule):
    """Registers ``rule(layer, ctx) -> Expectation | None`` for a layer class.

    Rules registered later win over earlier ones for the same layer, so a
    subclass registered after its base takes precedence.
    """
    _RULES.append((layer_cls, rule))


def expectation(layer, ctx):
    """The `Expectation` for `layer` under `ctx`, or None if no pattern applies.

    A container can give one of its sublayers a role-specific rule by setting
    the sublayer's ``_fusion_rule`` attribute (e.g. the last conv of a
    residual block, whose output feeds the Add); it wins over class rules.
    """
    override = getattr(layer, "_fusion_rule", None)
    if override is not None:
        return override(layer, ctx)
    for cls, rule in reversed(_RULES):
        if isinstance(layer, cls):
            return rule(layer, ctx)
    return None


def avoided_reason(name):
    """The row reason for a pattern switched off by ``configure(avoid_fusions=[name])``."""
    from tfmetal_ext import precision

    return f"avoided by configure(avoid_fusions=[{name!r}]): {precision.SAFE_FORMS[name]}"


# Safe forms that add a bias with AddV2: CPU oneDNN counts a broadcast AddV2
# as a BiasAdd and fuses it anyway (measured on TF 2.19 and 2.21).
_ADDV2_SAFE_FORMS = ("conv_bias_relu", "matmul_bias_relu")


def unless_avoided(name, rule):
    """Wraps a layer rule so it reflects ``configure(avoid_fusions=[name])``.

    While `name` (a `tfmetal_ext.precision.SAFE_FORMS` key) is avoided the
    layer emits its safe form: nothing is expected to fuse and the row says
    why, except where the safe form still fuses (an AddV2 bias on CPU with
    oneDNN), where the expectation stays and a note says so.
    """
    from tfmetal_ext import precision

    def wrapped(layer, ctx):
        exp = rule(layer, ctx)
        if exp is None or name not in precision.avoided_fusions():
            return exp
        if name in _ADDV2_SAFE_FORMS and ctx.backend == "cpu" and ctx.onednn:
            note = (
                f"avoided by configure(avoid_fusions=[{name!r}]): the bias is an AddV2, which "
                "oneDNN still fuses as a BiasAdd on CPU"
            )
            return dataclasses.replace(exp, note="; ".join(n for n in (exp.note, note) if n))
        return Expectation(
            exp.pattern, None, None, exp.ideal_fused_ops, reason=avoided_reason(name),
            match_layer=exp.match_layer, ideal_op=exp.ideal_op,
        )

    wrapped.__name__ = getattr(rule, "__name__", "rule")
    wrapped.__doc__ = getattr(rule, "__doc__", None)
    return wrapped


# ----------------------------------------------------------------------------
# Helpers shared by the rules.


def activation_name(layer):
    """The Keras name of a layer's activation (``"linear"`` when none)."""
    import keras

    act = getattr(layer, "activation", None)
    if act is None:
        return "linear"
    try:
        name = keras.activations.serialize(act)
    except (ValueError, TypeError):
        name = getattr(act, "__name__", "custom")
    if isinstance(name, dict):
        name = name.get("config", {}).get("name", "custom") if "config" in name else "custom"
    return name


def _dtype_block(ctx, dtype, cpu_dtypes):
    """A reason the remapper will not touch nodes of `dtype` here, or None."""
    if ctx.xla:
        return REASON_XLA
    if ctx.backend == "cpu":
        if dtype == "float16" and not ctx.cpu_fp16:
            return REASON_HALF_CPU
        if dtype not in cpu_dtypes:
            where = "CPU with oneDNN" if ctx.onednn else "CPU without oneDNN"
            return f"{dtype} on {where}: no fused kernel for this dtype"
    return None


def _contraction_rule(pattern, op, layer, ctx, *, act_op, cpu_acts, gpu_acts_note=None):
    """Expectation for a contraction (+ bias) (+ activation) layer."""
    dtype = layer.compute_dtype
    ideal = ("BiasAdd",) + ((act_op,) if act_op else ())
    if not getattr(layer, "use_bias", True):
        return Expectation(pattern, None, None, ideal, reason="use_bias=False: no BiasAdd to fuse")
    cpu_dtypes = ("float32", "bfloat16") if ctx.onednn else ("float32", "float64")
    if ctx.backend == "cpu" and not ctx.onednn and op == "_FusedMatMul":
        cpu_dtypes = ("float32",)
    blocked = _dtype_block(ctx, dtype, cpu_dtypes)
    if blocked:
        return Expectation(pattern, None, None, ideal, reason=blocked)
    if ctx.backend == "cpu":
        if act_op is None:
            return Expectation(pattern, op, ("BiasAdd",), ideal)
        if act_op not in cpu_acts:
            return Expectation(
                pattern, op, ("BiasAdd",), ideal,
                reason=f"{act_op} has no fused kernel here: applied unfused after the BiasAdd",
            )
        if ctx.mode == "train" and act_op == "LeakyRelu":
            return Expectation(
                pattern, op, ("BiasAdd",), ideal,
                reason="training: LeakyReluGrad needs the pre-activation, so only BiasAdd fuses",
            )
        return Expectation(pattern, op, ideal, ideal)
    if ctx.backend == "metal":
        if dtype == "bfloat16":
            return Expectation(pattern, None, None, ideal, reason="bfloat16 on Metal: no fused kernel")
        if act_op is not None and act_op not in _CONTRACTION_ACTS:
            return Expectation(
                pattern, op, ("BiasAdd",), ideal,
                reason=f"{act_op}: tensorflow-metal fuses only Relu/Relu6/Elu/LeakyRelu",
            )
        note = gpu_acts_note if act_op == "Relu" else None
        return Expectation(pattern, op, ideal, ideal, note=note)
    return None  # CUDA handled by the callers


# ----------------------------------------------------------------------------
# Rules for stock Keras layers.


def _act_op(layer):
    name = activation_name(layer)
    if name == "linear":
        return None
    return ACTIVATION_OPS.get(name, name)


def _conv2d_rule(layer, ctx):
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return Expectation(
            "conv2d_bias_act", None, None, None,
            reason="channels_first: the remapper's CPU conv fusions need NHWC",
        )
    if getattr(layer, "groups", 1) != 1:
        return None
    act_op = _act_op(layer)
    pattern = "conv2d_bias_act"
    if ctx.backend == "cuda" and not ctx.xla and getattr(layer, "use_bias", True):
        ideal = ("BiasAdd",) + ((act_op,) if act_op else ())
        if act_op != "Relu":
            return Expectation(
                pattern, None, None, ideal,
                reason="CUDA: _FusedConv2D needs a Relu activation (others need cuDNN runtime fusion)",
            )
        if tuple(layer.kernel_size) == (1, 1):
            return Expectation(pattern, None, None, ideal, reason="CUDA: 1x1 filters are not fused")
        if layer.compute_dtype not in ("float32", "float16"):
            return Expectation(pattern, None, None, ideal, reason=f"CUDA: no fused kernel for {layer.compute_dtype}")
        return Expectation(pattern, "_FusedConv2D", ideal, ideal)
    return _contraction_rule(
        pattern, "_FusedConv2D", layer, ctx, act_op=act_op, cpu_acts=_CONTRACTION_ACTS
    )


def _input_rank(layer):
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    for shape in shapes.values():
        try:
            return len(shape)
        except TypeError:
            continue
    return None


def _dense_rule(layer, ctx, *, act_name=None, reshape_blocks=True):
    """Dense rule; `act_name` overrides the activation name, `reshape_blocks=False`
    for layers that keep MatMul + BiasAdd adjacent on rank > 2 inputs."""
    name = act_name or activation_name(layer)
    act_op = None if name == "linear" else ACTIVATION_OPS.get(name, name)
    gelu = act_op in ("GeluExact", "GeluApproximate")
    pattern = "matmul_bias_gelu" if gelu else "matmul_bias_act"
    ideal = ("BiasAdd",) + ((act_op,) if act_op else ())
    rank = _input_rank(layer)
    if reshape_blocks and getattr(layer, "use_bias", True) and rank is not None and rank > 2 and not ctx.xla:
        return Expectation(
            pattern, None, None, ideal,
            reason=f"input rank {rank}: Keras reshapes between MatMul and BiasAdd, so nothing fuses",
        )
    if ctx.backend == "cuda" and not ctx.xla and getattr(layer, "use_bias", True):
        if not ctx.cublaslt:
            return Expectation(pattern, None, None, ideal, reason="CUDA: _FusedMatMul needs TF_USE_CUBLASLT=1")
        return Expectation(pattern, "_FusedMatMul", ideal, ideal)
    if gelu:
        if ctx.backend == "cpu" and ctx.onednn and not ctx.xla and getattr(layer, "use_bias", True):
            blocked = _dtype_block(ctx, layer.compute_dtype, ("float32", "bfloat16"))
            if blocked:
                return Expectation(pattern, None, None, ideal, reason=blocked)
            if ctx.mode == "train":
                return Expectation(
                    pattern, "_FusedMatMul", ("BiasAdd",), ideal,
                    reason="training: the GELU gradient needs the pre-activation, so only BiasAdd fuses",
                )
            return Expectation(pattern, "_FusedMatMul", ideal, ideal)
        exp = _contraction_rule(
            pattern, "_FusedMatMul", layer, ctx, act_op=None, cpu_acts=()
        )
        if exp is not None and exp.op is not None:
            return dataclasses.replace(
                exp, ideal_fused_ops=ideal, reason=f"{name}: fused only by CPU oneDNN; only BiasAdd fuses here"
            )
        return dataclasses.replace(exp, ideal_fused_ops=ideal) if exp else None
    cpu_acts = _ONEDNN_MATMUL_ACTS if ctx.onednn else _CONTRACTION_ACTS
    return _contraction_rule(
        pattern, "_FusedMatMul", layer, ctx, act_op=act_op, cpu_acts=cpu_acts,
        gpu_acts_note=(
            "tensorflow-metal is reported to miscompute relu(bias_add(matmul)) in graph "
            "mode; check with `tfmetal-ext doctor --selftest`"
        ),
    )


def _depthwise_rule(layer, ctx):
    act_op = _act_op(layer)
    pattern = "depthwise_bias_act"
    ideal = ("BiasAdd",) + ((act_op,) if act_op else ())
    if not getattr(layer, "use_bias", True):
        return Expectation(pattern, None, None, ideal, reason="use_bias=False: no BiasAdd to fuse")
    if ctx.backend != "cpu" or not ctx.onednn:
        where = "CPU without oneDNN" if ctx.backend == "cpu" else ctx.backend
        return Expectation(pattern, None, None, ideal, reason=f"{where}: no fused depthwise kernel")
    # Measured on TF 2.21 oneDNN: LeakyRelu does not fuse into the depthwise conv.
    return _contraction_rule(
        pattern, "_FusedDepthwiseConv2dNative", layer, ctx, act_op=act_op,
        cpu_acts=("Relu", "Relu6", "Elu"),
    )


def _batchnorm_rule(layer, ctx):
    return Expectation("batch_norm", None, None, None, reason=REASON_BN)


def _layernorm_rule(layer, ctx):
    return Expectation("layer_norm", None, None, None, reason=REASON_LN)


def _residual_rule(layer, ctx):
    """An Add whose only consumer is a ReLU and one of whose inputs is a linear biased Conv2D."""
    conv = _residual_conv(layer)
    if conv is None:
        return None
    pattern = "conv2d_bias_add_relu"
    ideal = ("BiasAdd", "Add", "Relu")
    blocked = _dtype_block(ctx, conv.compute_dtype, ("float32", "bfloat16"))
    if blocked:
        return Expectation(pattern, None, None, ideal, reason=blocked, match_layer=conv.name)
    if ctx.backend != "cpu" or not ctx.onednn:
        where = "CPU without oneDNN" if ctx.backend == "cpu" else ctx.backend
        return Expectation(
            pattern, None, None, ideal, match_layer=conv.name,
            reason=f"{where}: no Conv2D+BiasAdd+Add+Relu fusion",
        )
    if ctx.mode == "train":
        return Expectation(
            pattern, "_FusedConv2D", ("BiasAdd",), ideal, match_layer=conv.name,
            reason=(
                "training step: the remapper fuses the residual Add+Relu into the conv only "
                "in some graphs (seen both ways on TF 2.21); BiasAdd fuses either way"
            ),
        )
    return Expectation(pattern, "_FusedConv2D", ideal, ideal, match_layer=conv.name)


def _residual_conv(add_layer):
    import keras

    nodes = getattr(add_layer, "_inbound_nodes", [])
    outbound = getattr(add_layer, "_outbound_nodes", [])
    if len(nodes) != 1 or len(outbound) != 1:
        return None
    consumer = outbound[0].operation
    is_relu = isinstance(consumer, keras.layers.ReLU) and not consumer.max_value and not consumer.negative_slope and not consumer.threshold
    if isinstance(consumer, keras.layers.Activation):
        is_relu = activation_name(consumer) == "relu"
    if not is_relu:
        return None
    parents = [n.operation for n in nodes[0].parent_nodes]
    if len(parents) != 2:
        return None
    for op in parents:
        if (
            type(op) is keras.layers.Conv2D
            and op.use_bias
            and activation_name(op) == "linear"
            and len(getattr(op, "_outbound_nodes", [])) == 1
        ):
            return op
    return None


def _register_keras_rules():
    import keras

    register_rule(keras.layers.Conv2D, _conv2d_rule)
    register_rule(keras.layers.Conv2DTranspose, lambda layer, ctx: None)
    register_rule(keras.layers.DepthwiseConv2D, _depthwise_rule)
    register_rule(keras.layers.Dense, _dense_rule)
    register_rule(keras.layers.BatchNormalization, _batchnorm_rule)
    register_rule(keras.layers.LayerNormalization, _layernorm_rule)
    register_rule(keras.layers.Add, _residual_rule)


_register_keras_rules()
