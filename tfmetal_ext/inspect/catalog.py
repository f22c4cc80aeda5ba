"""The pattern catalog and the layer rules: what each layer should become in the graph that runs.

* `PATTERNS`: every fusion this package targets, with the fused op it
  becomes and the conditions per backend. The facts live in the backend
  tables (`tfmetal_ext.backends`); this module only reads them.
* Layer rules: for a Keras layer and a `FusionContext` (backend, oneDNN,
  dtype, train or predict, XLA), the `Expectation` of what the graph that runs
  should contain, with the reason whenever that is less than the full pattern.
  Layer families register their own rules with `register_rule`, built from
  the public helpers here (`fusion_for`, `dtype_block`, `contraction_rule`,
  `conv2d_rule`, `dense_rule`, `depthwise_rule`, `input_rank`, `act_op`).
"""

from __future__ import annotations

import dataclasses

from tfmetal_ext import _env, backends
from tfmetal_ext.backends import fusion as _fusion

PATTERNS = backends.PATTERNS
Pattern = backends.Pattern

# Ops that are a whole fused layer by themselves (the fusion report lists
# them with the remapper's fused nodes).
FUSED_LAYER_OPS = _fusion.FUSED_LAYER_OPS

# Keras activation name -> the op name in `fused_ops`.
ACTIVATION_OPS = _fusion.ACTIVATION_OPS

REASON_XLA = "XLA compiled: grappler not applied"
REASON_HALF_CPU = "float16 on CPU: remapper skips half"
REASON_BF16_ONEDNN = (
    "bfloat16 on CPU: oneDNN fuses bfloat16 only on CPUs with AVX512F or AVX_NE_CONVERT, "
    "and this one has neither"
)
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
        onednn_bf16: oneDNN fuses bfloat16 on this CPU (AVX512F or AVX_NE_CONVERT).
        cublaslt: ``TF_USE_CUBLASLT=1`` (CUDA MatMul fusions); by default the
            environment's capabilities say.
        metal_plugin: on Metal, which plugin (``devices.METAL_PLUGINS``);
            None reads as Apple's tensorflow-metal.
        logits_read: ``id()`` of the layers whose activation's input the
            compiled loss reads as logits (see `read_as_logits`); in a train
            step their activation cannot fuse.
        env: the `tfmetal_ext._env.Environment` the rules read (its avoided
            fusions); None: the one in force when a rule reads it.
    """

    backend: str = "cpu"
    onednn: bool = True
    mode: str = "predict"
    xla: bool = False
    cpu_fp16: bool = False
    onednn_bf16: bool = True
    cublaslt: bool = dataclasses.field(default_factory=lambda: _env.current().capabilities.cublaslt)
    logits_read: frozenset = frozenset()  # ids of layers whose pre-activation the loss reads (`read_as_logits`)
    metal_plugin: str | None = None  # with backend "metal": "tensorflow-metal" or "tensorflow-metal-plugin"
    env: _env.Environment | None = None

    @property
    def environment(self):
        """The environment the rules read: `env`, else the one in force now."""
        return self.env if self.env is not None else _env.current()

    @property
    def avoided(self):
        """The fusion patterns avoided (``configure(avoid_fusions=...)``): their layers emit the safe form."""
        return self.environment.avoided

    @property
    def support_key(self):
        return backends.support_key(self.backend, self.onednn, self.metal_plugin)


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
        may_fuse: with ``op=None``, ``(op, fused_ops)`` fusions that are
            right when present but cannot be required: they depend on code the
            rule cannot see (a layer called inside a subclass's own ``call``,
            whose neighbours are in no layer graph). One present (``fused_ops``
            a prefix), the row is "fused"; none, "not fused" with `reason`.
    """

    pattern: str
    op: str | None
    fused_ops: tuple | None
    ideal_fused_ops: tuple | None
    reason: str | None = None
    match_layer: str | None = None
    note: str | None = None
    ideal_op: str | None = None
    may_fuse: tuple = ()


_RULES = []  # (layer class, rule function), most specific registered last


def register_rule(layer_cls, rule):
    """Registers ``rule(layer, ctx) -> Expectation | None`` for a layer class.

    Rules registered later win over earlier ones for the same layer, so a
    subclass registered after its base takes precedence.
    """
    _RULES.append((layer_cls, rule))


def has_rule(layer):
    """`layer` has an inspection rule of its own (a ``_fusion_rule`` or a registered class rule)."""
    if getattr(layer, "_fusion_rule", None) is not None:
        return True
    return any(isinstance(layer, cls) for cls, _ in _RULES)


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
    return f"avoided by configure(avoid_fusions=[{name!r}]): {_fusion.SAFE_FORMS[name].description}"


def unless_avoided(name, rule):
    """Wraps a layer rule so it reflects ``configure(avoid_fusions=[name])``.

    While `name` (a `tfmetal_ext.backends.fusion.SAFE_FORMS` key) is avoided
    the layer emits its safe form: nothing is expected to fuse and the row
    says why, except where the safe form still fuses (an AddV2 bias where the
    backend table has ``addv2_bias``: CPU with oneDNN), where the expectation
    stays and a note says so.
    """
    def wrapped(layer, ctx):
        exp = rule(layer, ctx)
        if exp is None or name not in ctx.avoided:
            return exp
        if _fusion.SAFE_FORMS[name].bias_as_addv2 and table(ctx).addv2_bias:
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
# Public helpers for rules: they read the backend tables.


def table(ctx):
    """The `tfmetal_ext.backends.Backend` table that `ctx` selects."""
    return backends.table(ctx.support_key)


def fusion_for(ctx, pattern):
    """The `tfmetal_ext.backends.Fusion` row of `pattern` on the backend of `ctx`."""
    return table(ctx).fusion(pattern)


def where(ctx):
    """How reasons name the backend of `ctx` (``"CPU without oneDNN"``, ``"CUDA"``, ``"Metal"``)."""
    return table(ctx).label


def activation_name(layer):
    """The Keras name of a layer's activation (``"linear"`` when none); never raises.

    A Keras activation gives its own name; a TensorFlow function that is the
    same op (``tf.nn.relu``, ``tf.nn.swish``, ...; `fusion.TF_ACTIVATION_FUNCTIONS`)
    gives the Keras name of that op; any other callable (a lambda, a custom
    function or layer) is ``"custom (<its name>)"``, which no backend fuses.
    """
    return function_activation_name(getattr(layer, "activation", None))


def function_activation_name(act):
    """`activation_name` for an activation given as itself (a callable, a name or None)."""
    if act is None:
        return "linear"
    if isinstance(act, str):
        return act
    name = _fusion.activation_name(act)
    if name is not None:
        return name
    label = getattr(act, "__name__", None) or type(act).__name__
    return f"custom ({label})"


def act_op(layer):
    """The ``fused_ops`` name of a layer's activation, or None when it is linear."""
    return _fusion.activation_op(activation_name(layer))


def dtype_block(ctx, dtype, pattern):
    """A reason the nodes of `pattern` in `dtype` cannot fuse under `ctx`, or None.

    XLA first (grappler never sees the step), then half on a CPU without
    native fp16 (the remapper skips it), then the dtypes the backend table
    lists for the pattern (CPU only: GPU rows give their own reasons).
    """
    if ctx.xla:
        return REASON_XLA
    if ctx.backend != "cpu":
        return None
    t = table(ctx)
    if dtype == "float16" and t.half_needs_native and not ctx.cpu_fp16:
        return REASON_HALF_CPU
    if dtype == "bfloat16" and t.bf16_needs_onednn_isa and not ctx.onednn_bf16:
        return REASON_BF16_ONEDNN
    f = t.fusion(pattern)
    if f.fuses and dtype not in f.dtypes_in(ctx.mode):
        return f"{dtype} on {t.label}: no fused kernel for this dtype"
    return None


def _not_fused_reason(ctx, f):
    return f"{where(ctx)}: {f.why_not or 'not fused'}"


def contraction_rule(pattern, op, layer, ctx, *, act=None, one_by_one=False, addv2_bias=False):
    """Expectation for a contraction (+ bias) (+ activation) layer, from the backend table.

    Args:
        pattern: the catalog pattern (``"conv2d_bias_act"``, ...).
        op: the fused op (``"_FusedConv2D"``, ...).
        layer: the layer (its ``use_bias`` and ``compute_dtype`` are read).
        ctx: the `FusionContext`.
        act: the activation's ``fused_ops`` name, or None for linear.
        one_by_one: the filter is 1x1 (some backends do not fuse those).
        addv2_bias: the layer adds its bias with AddV2, not BiasAdd (stock
            Keras does for a one-element bias: ``keras.ops.add`` emits
            ``tf.nn.bias_add`` only for a bias that squeezes to a vector).
    """
    dtype = layer.compute_dtype
    ideal = ("BiasAdd",) + ((act,) if act else ())

    def exp(o, ops, reason=None, note=None):
        return Expectation(pattern, o, ops, ideal, reason=reason, note=note)

    if not getattr(layer, "use_bias", True):
        return exp(None, None, "use_bias=False: no BiasAdd to fuse")
    blocked = dtype_block(ctx, dtype, pattern)
    if blocked:
        return exp(None, None, blocked)
    if addv2_bias and not table(ctx).addv2_bias:
        return exp(
            None, None,
            f"one output channel: Keras adds the one-element bias with AddV2, not BiasAdd, and {where(ctx)} "
            "fuses only a BiasAdd",
        )
    f = fusion_for(ctx, pattern)
    if f.needs and not getattr(ctx, f.needs, False):
        return exp(None, None, _not_fused_reason(ctx, f))
    if not f.fuses:
        return exp(None, None, _not_fused_reason(ctx, f))
    if dtype not in f.dtypes:
        return exp(None, None, f.dtype_notes.get(dtype) or f"{dtype} on {where(ctx)}: no fused kernel for this dtype")
    if f.requires_act and act not in f.requires_act:
        return exp(None, None, f"{where(ctx)}: {op} needs a {'/'.join(f.requires_act)} activation")
    if f.no_1x1 and one_by_one:
        return exp(None, None, f"{where(ctx)}: 1x1 filters are not fused")
    if act is None:
        return exp(op, ("BiasAdd",))
    if act not in f.acts:
        return exp(op, ("BiasAdd",), f"{act} has no fused kernel here: applied unfused after the BiasAdd")
    if act not in f.acts_in(ctx.mode):
        return exp(
            op, ("BiasAdd",),
            f.train_reason or f"training: {act}Grad needs the pre-activation, so only BiasAdd fuses",
        )
    if ctx.mode == "train" and id(layer) in ctx.logits_read:
        return exp(
            op, ("BiasAdd",),
            f"training: the crossentropy loss reads this {act}'s input as logits (Keras' _get_logits), so the "
            "pre-activation has a second consumer and only BiasAdd fuses",
        )
    return exp(op, ideal, note=f.note if act == "Relu" else None)


def _loss_function_name(loss):
    import keras

    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except Exception:
            return loss
    fn = getattr(loss, "fn", loss)  # a Loss object wraps its function
    return getattr(fn, "__name__", None) or getattr(loss, "name", None)


def read_as_logits(model):
    """``id()`` of the output layers whose activation's input the model's compiled loss reads as logits.

    Keras' crossentropy on a sigmoid/softmax prediction computes from the
    logits (`tfmetal_ext.backends.fusion.LOSSES_READING_LOGITS`); that happens
    when the loss receives the activation op itself, i.e. the output layer
    computes in float32 (a mixed policy casts it first).
    """
    if model is None or not getattr(model, "compiled", False):
        return frozenset()
    loss = getattr(model, "loss", None)
    outputs = list(getattr(model, "outputs", None) or [])
    names = list(getattr(model, "output_names", None) or [])
    ids = set()
    for i, out in enumerate(outputs):
        history = getattr(out, "_keras_history", None)
        layer = getattr(history, "operation", None)
        if layer is None or getattr(layer, "compute_dtype", None) != "float32":
            continue
        losses = _fusion.LOSSES_READING_LOGITS.get(act_op(layer))
        if not losses:
            continue
        if isinstance(loss, dict):
            this = loss.get(names[i]) if i < len(names) else None
        elif isinstance(loss, (list, tuple)):
            this = loss[i] if i < len(loss) else None
        else:
            this = loss
        if this is not None and _loss_function_name(this) in losses:
            ids.add(id(layer))
    return frozenset(ids)


def batch_norm_ex_block(ctx, dtype, channels):
    """A reason FusedBatchNormV3 + Relu cannot become ``_FusedBatchNormEx`` here, or None.

    Checks the backend table's dtypes (narrower in training on CUDA) and the
    channel multiple a training step needs; the caller has checked XLA, half
    on CPU and the activation.
    """
    f = fusion_for(ctx, "batchnorm_act")
    if not f.fuses:
        return f"{where(ctx)}: {f.why_not or 'no _FusedBatchNormEx kernel'}"
    if dtype not in f.dtypes:
        return f"{dtype} on {where(ctx)}: no _FusedBatchNormEx kernel"
    if ctx.mode not in f.modes:
        return f"{where(ctx)}: {f.train_reason or f'not fused in {ctx.mode}'}"
    if ctx.mode == "train":
        if dtype not in f.dtypes_in("train") or (channels or 0) % f.train_channels_multiple:
            need = "/".join(f.dtypes_in("train"))
            return (
                f"{where(ctx)} training: _FusedBatchNormEx needs {need} and channels % "
                f"{f.train_channels_multiple} == 0"
            )
    return None


def conv_batch_norm_fuses(ctx, dtype):
    """Conv2D + FusedBatchNormV3 fuse into one ``_FusedConv2D`` here (inference only)."""
    f = fusion_for(ctx, "conv2d_batchnorm_act")
    return not ctx.xla and f.fuses and ctx.mode in f.modes and dtype in f.dtypes


# ----------------------------------------------------------------------------
# Rules for stock Keras layers.


def _one_element_bias(layer, size):
    return type(layer).__module__.startswith("keras.") and size == 1


def conv2d_rule(layer, ctx):
    """Conv2D (+ BiasAdd) (+ activation)."""
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return Expectation(
            "conv2d_bias_act", None, None, None,
            reason="channels_first: the remapper's CPU conv fusions need NHWC",
        )
    groups = getattr(layer, "groups", 1)
    if groups != 1:
        ideal = ("BiasAdd",) + ((act_op(layer),) if act_op(layer) else ())
        return Expectation(
            "conv2d_bias_act", None, None, ideal,
            reason=(
                f"groups={groups}: Keras' TensorFlow backend runs a grouped convolution as an XLA-compiled "
                "function (TF's CPU Conv2D kernel has no groups), which grappler's remapper does not fuse into"
            ),
        )
    return contraction_rule(
        "conv2d_bias_act", _fusion.FUSED_CONV2D, layer, ctx, act=act_op(layer),
        one_by_one=tuple(getattr(layer, "kernel_size", ())) == (1, 1),
        addv2_bias=_one_element_bias(layer, getattr(layer, "filters", None)),
    )


def input_rank(layer):
    """The rank of the layer's (first) input when it was built, or None."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    for shape in shapes.values():
        try:
            return len(shape)
        except TypeError:
            continue
    return None


def dense_rule(layer, ctx, *, act_name=None, reshape_blocks=True):
    """Dense (+ BiasAdd) (+ activation, GELU included).

    Args:
        act_name: overrides the layer's activation name.
        reshape_blocks: rank > 2 inputs are reshaped between MatMul and
            BiasAdd (stock Keras), so nothing fuses; False for layers that keep
            them adjacent.
    """
    name = act_name or activation_name(layer)
    act = _fusion.activation_op(name)
    gelu = act in ("GeluExact", "GeluApproximate")
    pattern = "matmul_bias_gelu" if gelu else "matmul_bias_act"
    ideal = ("BiasAdd",) + ((act,) if act else ())
    rank = input_rank(layer)
    if reshape_blocks and getattr(layer, "use_bias", True) and rank is not None and rank > 2 and not ctx.xla:
        return Expectation(
            pattern, None, None, ideal,
            reason=f"input rank {rank}: Keras reshapes between MatMul and BiasAdd, so nothing fuses",
        )
    if gelu and not fusion_for(ctx, pattern).fuses:
        # No GELU fusion here: at best MatMul + BiasAdd fuse, the GELU stays apart.
        exp = contraction_rule(
            "matmul_bias_act", _fusion.FUSED_MATMUL, layer, ctx, act=None,
            addv2_bias=_one_element_bias(layer, layer.units),
        )
        exp = dataclasses.replace(exp, pattern=pattern, ideal_fused_ops=ideal)
        if exp.op is not None:
            return dataclasses.replace(exp, reason=f"{name}: fused only by CPU oneDNN; only BiasAdd fuses here")
        return exp
    return contraction_rule(
        pattern, _fusion.FUSED_MATMUL, layer, ctx, act=act, addv2_bias=_one_element_bias(layer, layer.units)
    )


def depthwise_rule(layer, ctx):
    """DepthwiseConv2D (+ BiasAdd) (+ activation)."""
    return contraction_rule("depthwise_bias_act", _fusion.FUSED_DEPTHWISE, layer, ctx, act=act_op(layer))


def _stock_rnn_rule(layer, ctx):
    """Stock LSTM/GRU: CudnnRNNV3 where Keras picks cuDNN (a GPU, cuDNN-compatible arguments), else a loop.

    Keras picks cuDNN on any logical GPU, Metal included; on a backend whose
    table says it has no CudnnRNNV3 kernel (the open tensorflow-metal-plugin;
    TF has no CPU kernel either) that step fails: the row says so, with the
    table's `unsupported_layers` reason where it has one, and the fix.
    """
    if ctx.xla:
        return Expectation("cudnn_rnn", None, None, (), reason=REASON_XLA, ideal_op=_fusion.CUDNN_RNN)
    cudnn_ok = getattr(layer, "use_cudnn", "auto") is not False and _cudnn_compatible(layer)
    if ctx.backend in ("cuda", "metal") and cudnn_ok:
        t = table(ctx)
        compute = getattr(layer, "compute_dtype", None)
        if ctx.backend == "metal" and (
            not t.fusion("cudnn_rnn").fuses or t.has_kernel(_fusion.CUDNN_RNN, compute) is False
        ):
            name = type(layer).__name__
            fused = _fusion.STOCK_TO_FUSED.get(name)
            fix = f"{fused.qualified} (tfmetal_ext.convert() swaps it) or use_cudnn=False" if fused else (
                "use_cudnn=False"
            )
            # The table's reason carries its fix (`Backend.unsupported_layers`).
            reason = t.unsupported_layers.get(name) or (
                f"{name} emits {_fusion.CUDNN_RNN} on any GPU, and {t.label} has no kernel for it "
                f"(TF has no CPU kernel either): the step fails; fix: {fix}"
            )
            return Expectation("cudnn_rnn", None, None, (), reason=reason, ideal_op=_fusion.CUDNN_RNN)
        return Expectation("cudnn_rnn", _fusion.CUDNN_RNN, (), ())
    if ctx.backend == "cpu":
        reason = f"{type(layer).__name__} on CPU: a while loop of unfused per-step ops (CudnnRNNV3 is GPU-only)"
    else:
        reason = "arguments cuDNN cannot run (or use_cudnn=False): the generic loop runs"
    return Expectation("cudnn_rnn", None, None, (), reason=reason, ideal_op=_fusion.CUDNN_RNN)


def _cudnn_compatible(layer):
    """Keras' own test for the cuDNN path (`keras.src.layers.rnn` ``cudnn_ok``), read off the layer."""
    cell = getattr(layer, "cell", layer)
    ok = activation_name(cell) == "tanh"
    ok = ok and function_activation_name(getattr(cell, "recurrent_activation", None)) == "sigmoid"
    ok = ok and not getattr(layer, "unroll", False) and getattr(cell, "use_bias", True)
    if hasattr(cell, "reset_after"):
        ok = ok and cell.reset_after
    return ok and not getattr(cell, "recurrent_dropout", 0)


def _batchnorm_rule(layer, ctx):
    return Expectation("batch_norm", None, None, None, reason=REASON_BN)


def _layernorm_rule(layer, ctx):
    return Expectation("layer_norm", None, None, None, reason=REASON_LN)


def _residual_rule(layer, ctx):
    """An Add whose only consumer is a ReLU and one of whose inputs is a linear biased Conv2D."""
    conv = _residual_conv(layer)
    if conv is None:
        return None
    return residual_rule(conv, ctx, "Relu", match_layer=conv.name)


def residual_rule(conv, ctx, act, *, match_layer=None, inference_only=False):
    """Conv2D + BiasAdd + Add(shortcut) + `act`, for the conv feeding a residual Add.

    Args:
        conv: the conv layer (its ``compute_dtype`` is read).
        act: the activation after the Add (``fused_ops`` name).
        match_layer: the layer whose weights the fused node reads, when not
            the one the row is for.
        inference_only: the block exists only for inference (a folded
            block), so a train step is not expected to fuse the Add.
    """
    pattern = "conv2d_bias_add_relu"
    ideal = ("BiasAdd", "Add", act)

    def exp(op, ops, reason=None):
        return Expectation(pattern, op, ops, ideal, reason=reason, match_layer=match_layer)

    blocked = dtype_block(ctx, conv.compute_dtype, pattern)
    if blocked:
        return exp(None, None, blocked)
    f = fusion_for(ctx, pattern)
    bias_only = fusion_for(ctx, "conv2d_bias_act")
    if not f.fuses:
        if (
            inference_only and bias_only.fuses and not bias_only.requires_act
            and conv.compute_dtype in bias_only.dtypes
        ):
            return exp(_fusion.FUSED_CONV2D, ("BiasAdd",), f"{where(ctx)}: only Conv2D + BiasAdd fuse")
        return exp(None, None, _not_fused_reason(ctx, f))
    if act not in f.acts:
        return exp(_fusion.FUSED_CONV2D, ("BiasAdd",), f"{act}: Conv2D + BiasAdd + Add fuses only with Relu")
    if ctx.mode not in f.modes:
        reason = (
            "a folded block is inference-only; in a train step only BiasAdd is sure to fuse"
            if inference_only else f.train_reason
        )
        return exp(_fusion.FUSED_CONV2D, f.train_partial, reason)
    return exp(_fusion.FUSED_CONV2D, ideal)


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


# ----------------------------------------------------------------------------
# Attention and RMS norm: the stock layers and their fusion-first drop-ins (which subclass them,
# so one rule per stock class serves both).

REASON_ATTENTION = (
    "unfused attention -> FusedMultiHeadAttention: Keras' MultiHeadAttention emits Einsum projections and "
    "scores (Einsum or BatchMatMulV2) -> Mul -> [SelectV2 mask] -> float32 Softmax -> Einsum or BatchMatMulV2, "
    "with the (batch, heads, q_seq, kv_seq) scores materialized forward and backward; no remapper pattern on "
    "any device"
)
REASON_RMS = (
    "unfused RMS norm -> FusedRMSNorm: Keras' RMSNormalization emits Square -> Mean -> AddV2 -> Rsqrt -> Mul "
    "-> Mul (and their gradients); no remapper pattern on any device"
)


def _is_fusion_first(layer):
    return type(layer).__module__.startswith("tfmetal_ext.") and hasattr(layer, "unfused_reason")


def _custom_op_block(ctx, layer, pattern, op, uses_kernel, safe_form):
    """Why custom op `op` of `pattern` does not run for `layer` under `ctx`, or None (it runs, and is reported)."""
    if ctx.xla:
        return REASON_XLA
    if safe_form in _fusion.SAFE_FORMS and safe_form in ctx.avoided:
        return avoided_reason(safe_form)
    f = fusion_for(ctx, pattern)
    if not f.fuses:
        return _not_fused_reason(ctx, f)
    dtype = layer.compute_dtype
    if dtype not in f.dtypes_in(ctx.mode):
        return f"{dtype} on {where(ctx)}: no {op} kernel for this dtype"
    if not uses_kernel():
        return (f"custom ops not in use here (no op library, TFMETAL_EXT_REFERENCE_OPS=1, or no kernel for "
                f"this device): the pure-TF reference runs instead of {op}")
    if op not in FUSED_LAYER_OPS:
        return f"{op} is not registered as a custom op of this package (backends.fusion.CUSTOM_OPS)"
    return None


REASON_STOCK_INT8 = (
    "stock Keras int8 (quantize('int8')): its inputs are quantized too and the int8 MatMul/Conv is followed "
    "by Cast, RealDiv and the bias/activation ops, which no remapper pattern fuses; the tfmetal_ext layer "
    "runs one TfmetalExt>Int8MatMul / Int8Conv2D"
)


def int8_rule(layer, ctx, kind="matmul", *, note=None, reference=None):
    """A quantized (int8) tfmetal_ext contraction: one ``TfmetalExt>Int8MatMul`` (`kind` ``"matmul"``) or
    ``TfmetalExt>Int8Conv2D`` (``"conv2d"``) per call, bias and activation in the op.

    The op reads the layer's int8 kernel, so the report credits it to the
    layer. Where it does not run (XLA, ``configure(avoid_fusions=["int8_matmul"])``,
    no op library or kernel for the dtype/device) the pure-TF reference runs
    (de-quantized kernel, then the float contraction + BiasAdd + activation):
    `reference` is the float layer's `Expectation` of that form; the row
    then says why the int8 op is not there.
    """
    import importlib

    int8_ops = importlib.import_module("tfmetal_ext.ops.int8")
    op = _fusion.INT8_MATMUL_OP if kind == "matmul" else _fusion.INT8_CONV2D_OP
    pattern = f"custom_int8_{kind}"
    blocked = _custom_op_block(ctx, layer, pattern, op, lambda: int8_ops.int8_uses_kernel(kind), f"int8_{kind}")
    if blocked is None:
        return Expectation(pattern, op, (), (), note=note)
    if reference is None:
        return Expectation(pattern, None, None, (), reason=blocked, ideal_op=op, note=note)
    why = "; ".join(r for r in (f"{blocked} (the reference is the float form)", reference.reason) if r)
    return dataclasses.replace(reference, reason=why, ideal_op=op, note=note)


def stock_int8_rule(layer, ctx):
    """A stock Keras layer quantized: int8 fuses nothing, with the reason; another mode (int4, float8, gptq,
    awq) de-quantizes its kernel and may fuse the float contraction (`keras_quantized_rule`); None when
    not quantized."""
    mode = getattr(layer, "quantization_mode", None)
    if mode is None or _is_fusion_first(layer):
        return None
    if mode != "int8":
        return keras_quantized_rule(layer, ctx, f"a stock {type(layer).__name__}; tfmetal_ext has no fused {mode} form")
    return Expectation(f"custom_int8_{'conv2d' if 'Conv' in type(layer).__name__ else 'matmul'}", None, None, (),
                       reason=REASON_STOCK_INT8)


def keras_quantized_rule(layer, ctx, reason):
    """A tfmetal_ext drop-in running Keras' own form of its quantization mode (int4, float8, gptq, awq, or
    int8 with quantizers the fused form does not run). No fused op is expected; where that form
    de-quantizes its kernel and then runs the float contraction, the remapper may still fuse that (a
    `may_fuse`). The row says which form ran and why, fused or not."""
    mode = getattr(layer, "quantization_mode", None)
    conv = "Conv" in type(layer).__name__
    text = f"Keras' own {mode} form runs: {reason}"
    return Expectation(
        f"custom_int8_{'conv2d' if conv else 'matmul'}", None, None, (), reason=text, note=text,
        ideal_op=(_fusion.INT8_CONV2D_OP if conv else _fusion.INT8_MATMUL_OP) if mode == "int8" else None,
        may_fuse=((_fusion.FUSED_CONV2D if conv else _fusion.FUSED_MATMUL, ()),),
    )


class _Projections:
    """What `contraction_rule` reads of a MultiHeadAttention's q/k/v/output projections."""

    def __init__(self, mha):
        self.use_bias = bool(getattr(mha, "_use_bias", True))
        self.compute_dtype = mha.compute_dtype


def attention_rule(layer, ctx):
    """MultiHeadAttention: unfused (stock); FusedMultiHeadAttention: the attention op + MatMul/BiasAdd projections."""
    import importlib

    # The module, not `tfmetal_ext.ops.attention` the function the package exports under its name.
    attention_ops = importlib.import_module("tfmetal_ext.ops.attention")
    op = _fusion.ATTENTION_OP
    if not _is_fusion_first(layer):
        reason = REASON_ATTENTION
        t = table(ctx)
        if ctx.backend == "metal" and t.has_kernel("Einsum") is False:
            reason += f"; {t.label} has no Einsum kernel, so the einsums fall back to the CPU"
        return Expectation("attention", None, None, (), reason=reason, ideal_op=op)
    # Attention dropout runs inside the op (training calls fuse too); only dropout=1.0 stops training
    # calls from fusing (`unfused_reason` says so), and inference calls fuse whatever the rate.
    structural = getattr(layer, "_structural_reason", None)
    why = structural() if ctx.mode != "train" and callable(structural) else layer.unfused_reason
    if why:
        return Expectation("attention", None, None, (), reason=f"the stock MultiHeadAttention computation runs: {why}",
                           ideal_op=op)
    blocked = _custom_op_block(ctx, layer, "custom_attention", op, attention_ops.uses_kernel, "attention")
    proj = contraction_rule("matmul_bias_act", _fusion.FUSED_MATMUL, _Projections(layer), ctx)
    if blocked is None:
        note = ("projections: MatMul + BiasAdd, " + (f"fused into {proj.op}" if proj.op else f"unfused ({proj.reason})"))
        return Expectation("attention", op, (), (), note=note)
    if proj.op is not None:  # the projections still fuse: the row is partial
        return Expectation("attention", proj.op, proj.fused_ops, (), ideal_op=op,
                           reason=f"{blocked}; only the q/k/v/output projections fuse (MatMul + BiasAdd)")
    return Expectation("attention", None, None, (), ideal_op=op,
                       reason=f"{blocked}; the projections do not fuse either ({proj.reason})")


def rms_norm_rule(layer, ctx):
    """Stock RMSNormalization: unfused, pointing at FusedRMSNorm (which registers its own rule)."""
    if _is_fusion_first(layer):
        return None  # not reached for FusedRMSNorm: its own rule (tfmetal_ext.layers.rms_norm) wins
    return Expectation("rms_norm", None, None, None, reason=REASON_RMS)


def _register_keras_rules():
    import keras

    register_rule(keras.layers.Conv2D, conv2d_rule)
    register_rule(keras.layers.Conv2DTranspose, lambda layer, ctx: None)
    register_rule(keras.layers.DepthwiseConv2D, depthwise_rule)
    register_rule(keras.layers.Dense, lambda layer, ctx: stock_int8_rule(layer, ctx) or dense_rule(layer, ctx))
    register_rule(keras.layers.BatchNormalization, _batchnorm_rule)
    register_rule(keras.layers.LayerNormalization, _layernorm_rule)
    register_rule(keras.layers.LSTM, _stock_rnn_rule)
    register_rule(keras.layers.GRU, _stock_rnn_rule)
    register_rule(keras.layers.Add, _residual_rule)
    register_rule(keras.layers.MultiHeadAttention, attention_rule)
    register_rule(keras.layers.RMSNormalization, rms_norm_rule)


_register_keras_rules()
