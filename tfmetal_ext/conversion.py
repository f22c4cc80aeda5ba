"""Convert an existing Keras model into one built from tfmetal_ext's fusion-first layers, verified.

>>> model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3))
>>> fused = tfmetal_ext.convert(model)            # training form, verified
>>> print(fused.conversion_report)
>>> deploy = tfmetal_ext.convert(model, inference=True)   # batch norms folded into the convolutions

The converter walks the functional graph of a Functional or Sequential model
(nested models recursively), decides per call of each layer what replaces it,
and rebuilds the graph with the same layer names, input and output names,
trainable flags, dtype policies and weights:

| stock layers | becomes |
|---|---|
| Conv2D (+ Activation/ReLU) | `FusedConv2D` (activation folded in) |
| DepthwiseConv2D (+ Activation/ReLU) | `FusedDepthwiseConv2D` |
| Dense (+ Activation/ReLU) | `FusedDense` |
| Conv2D -> BatchNormalization (-> Activation/ReLU) | `ConvBNAct` (conv bias moved into the moving mean) |
| Conv2D/DepthwiseConv2D -> BatchNormalization (-> act), ``inference=True`` | `FusedConv2D`/`FusedDepthwiseConv2D` with the batch norm folded in |
| BatchNormalization (2-D or 4-D input, last axis) | `FusedBatchNorm` |
| LayerNormalization (last axis) | `FusedLayerNorm` |
| LSTM / GRU (tanh/sigmoid, no recurrent dropout, GRU reset_after) | `FusedLSTM` / `FusedGRU` |
| anything else | kept (a fresh copy with the same config and weights), listed in the report with the reason |

A layer is absorbed into the one before it only when nothing else reads the
tensor between them (no other consumer, not a model output), its own output is
not an output of the top-level model (output names stay), both are called once, and they share
the dtype policy and trainable flag. A shared layer
(called more than once) is converted once and the new layer is shared the
same way; it is never merged with its neighbours.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import warnings

import keras
import numpy as np

logger = logging.getLogger("tfmetal_ext")

__all__ = ["ConversionReport", "Kept", "Rewrite", "VerificationError", "convert"]

# Activation names each target can absorb (they are emitted as one op right after the BiasAdd / batch norm).
_CONV_ACTS = ("relu", "relu6", "elu", "leaky_relu")
_DENSE_ACTS = _CONV_ACTS + ("tanh", "sigmoid", "gelu")
_CONV_BN_ACTS = _CONV_ACTS

# Relative tolerances (max |stock - converted| / max |stock|) of verify, per compute dtype.
OUTPUT_RTOL = {"float32": 1e-4, "float64": 1e-6, "bfloat16": 5e-2, "float16": 2e-2}
# Gradients: ||g_stock - g_new|| / ||g_stock|| per weight must be within the larger of GRAD_RTOL and
# NOISE_FACTOR x the stock model's own rounding noise, measured as the larger relative diff between its
# gradients at (x, y) and (a) the same batch in reverse order (same math, other reduction order) and (b)
# x * (1 + 1e-6 * noise). Training-mode batch norm amplifies rounding going backwards through a deep net:
# ResNet50 and MobileNetV2 (32x32, batch 8) measured 1e-4 to 8e-2 between runs of identical code (threaded
# reduction order changes), with cosine similarities above 0.999; a wrong mapping gives O(1).
GRAD_RTOL = {"float32": 1e-1, "float64": 1e-5, "bfloat16": 3e-1, "float16": 3e-1}
NOISE_FACTOR = 4.0
# Batch norm over two values per channel (batch 2 at 1x1 spatial) has a near-zero, noise-dominated
# gradient; the gradient check uses at least this batch size.
MIN_GRAD_BATCH = 16

NO_COUNTERPART = "no fusion-first counterpart (kept as a copy with the same config and weights)"


# ----------------------------------------------------------------------------
# The report.


@dataclasses.dataclass
class Rewrite:
    """One rewrite: stock layer(s) `source` replaced by layer `name` of class `new_class`."""

    source: tuple
    name: str
    new_class: str
    note: str = ""


@dataclasses.dataclass
class Kept:
    """A layer kept as it is, and why."""

    name: str
    class_name: str
    reason: str


@dataclasses.dataclass
class ConversionReport:
    """What `convert` did.

    Attributes:
        model: name of the converted model.
        inference: whether the deployment (batch norm folded) form was made.
        rewrites: every `Rewrite`, nested models' ones with ``outer/inner`` names.
        kept: every layer kept as it is (`Kept`), with the reason.
        ops_before, ops_after: compute ops per step after grappler, keyed
            ``"train"`` (one `model.fit` step) and ``"predict"`` (one inference
            call), from `tfmetal_ext.inspect.fusion_report(...).num_ops`;
            empty when ops were not counted.
        verified: None when not verified, else True (a mismatch raises).
        max_output_diff: largest relative output difference found by verify.
        max_grad_diff: largest relative gradient difference (training form).
        notes: anything else worth knowing (compile config copied, ...).
    """

    model: str
    inference: bool = False
    rewrites: list = dataclasses.field(default_factory=list)
    kept: list = dataclasses.field(default_factory=list)
    ops_before: dict = dataclasses.field(default_factory=dict)
    ops_after: dict = dataclasses.field(default_factory=dict)
    verified: bool | None = None
    max_output_diff: float | None = None
    max_grad_diff: float | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def absorbed(self):
        """Names of the stock layers that were merged into another layer."""
        return [s for r in self.rewrites for s in r.source[1:]]

    def rewrite_for(self, name):
        """The `Rewrite` whose source includes stock layer `name` (KeyError if none)."""
        for r in self.rewrites:
            if name in r.source:
                return r
        raise KeyError(name)

    def kept_names(self):
        return [k.name for k in self.kept]

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        form = "inference form, batch norms folded" if self.inference else "training form"
        lines = [
            f"Conversion of {self.model!r} ({form}): {len(self.rewrites)} rewrites "
            f"({len(self.absorbed)} layers absorbed), {len(self.kept)} layers kept"
        ]
        for mode, label in (("train", "ops per train step"), ("predict", "ops per inference call")):
            if mode in self.ops_before and mode in self.ops_after:
                b, a = self.ops_before[mode], self.ops_after[mode]
                lines.append(f"{label}: {b} -> {a} ({a / max(b, 1):.2f}x)")
        if self.verified:
            v = f"verified: outputs max rel diff {self.max_output_diff:.2g}"
            if self.max_grad_diff is not None:
                v += f", training gradients max rel diff {self.max_grad_diff:.2g}"
            lines.append(v)
        elif self.verified is None:
            lines.append("not verified (verify=False)")
        if self.rewrites:
            lines.append("rewrites:")
            width = max(len(" + ".join(r.source)) for r in self.rewrites)
            for r in self.rewrites:
                note = f"  ({r.note})" if r.note else ""
                lines.append(f"  {' + '.join(r.source):<{width}} -> {r.name} [{r.new_class}]{note}")
        by_reason = collections.defaultdict(list)
        for k in self.kept:
            by_reason[k.reason].append(k)
        if self.kept:
            lines.append("kept:")
        for reason, kept in by_reason.items():
            if reason == NO_COUNTERPART:
                plain = collections.Counter(k.class_name for k in kept)
                classes = ", ".join(f"{n} x{c}" for n, c in sorted(plain.items()))
                lines.append(f"  {len(kept)} layers with {NO_COUNTERPART}: {classes}")
            elif len(kept) <= 3:
                lines += [f"  {k.name} [{k.class_name}]: {reason}" for k in kept]
            else:
                names = ", ".join(k.name for k in kept[:3])
                lines.append(f"  {len(kept)} layers ({names}, ...) [{kept[0].class_name}]: {reason}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


class VerificationError(AssertionError):
    """The converted model's outputs or gradients differ from the stock model's beyond tolerance,
    or there is nothing to compare (every output of the stock model is NaN or inf).

    Attributes:
        diffs: list of ``(what, relative_diff, tolerance)`` rows, in graph
            order (per layer output, or per weight gradient).
        report: the `ConversionReport` so far.
    """

    def __init__(self, message, diffs=(), report=None):
        super().__init__(message)
        self.diffs = list(diffs)
        self.report = report


# ----------------------------------------------------------------------------
# Layer classification.


def _is_stock(layer, cls):
    return type(layer) is cls


def _policy(layer):
    return layer.dtype_policy.name


def _activation_of(layer):
    """The activation name a standalone activation layer computes, or None if it is not one we fold."""
    L = keras.layers
    if type(layer) is L.Activation:
        from tfmetal_ext.inspect.catalog import activation_name

        return activation_name(layer)
    if type(layer) is L.ReLU:
        if float(layer.negative_slope or 0) != 0 or float(layer.threshold or 0) != 0:
            return None
        if layer.max_value is None:
            return "relu"
        return "relu6" if float(layer.max_value) == 6.0 else None
    if type(layer) is L.LeakyReLU:
        return "leaky_relu" if abs(float(layer.negative_slope) - 0.2) < 1e-12 else None
    if type(layer) is L.ELU:
        return "elu" if float(layer.alpha) == 1.0 else None
    return None


def _own_activation(layer):
    from tfmetal_ext.inspect.catalog import activation_name

    return activation_name(layer)


def _common_kwargs(layer):
    return {"name": layer.name, "dtype": layer.dtype_policy, "trainable": layer.trainable}


def _cfg(layer, keys):
    config = layer.get_config()
    return {k: config[k] for k in keys if k in config}


def _extra_unsupported(layer):
    """Reasons shared by the contraction layers (quantized / LoRA layers)."""
    if getattr(layer, "quantization_mode", None):
        return f"quantized ({layer.quantization_mode}) layers are kept"
    if getattr(layer, "lora_enabled", False):
        return "LoRA-enabled layers are kept"
    return None


_CONV_KEYS = (
    "filters", "kernel_size", "strides", "padding", "data_format", "dilation_rate", "groups", "activation",
    "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer", "bias_regularizer",
    "activity_regularizer", "kernel_constraint", "bias_constraint",
)
_DEPTHWISE_KEYS = (
    "kernel_size", "strides", "padding", "depth_multiplier", "data_format", "dilation_rate", "activation",
    "use_bias", "depthwise_initializer", "bias_initializer", "depthwise_regularizer", "bias_regularizer",
    "activity_regularizer", "depthwise_constraint", "bias_constraint",
)
_DENSE_KEYS = (
    "units", "activation", "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer",
    "bias_regularizer", "kernel_constraint", "bias_constraint",
)
_BN_KEYS = (
    "axis", "momentum", "epsilon", "center", "scale", "beta_initializer", "gamma_initializer",
    "moving_mean_initializer", "moving_variance_initializer", "beta_regularizer", "gamma_regularizer",
    "beta_constraint", "gamma_constraint", "synchronized", "renorm", "renorm_clipping", "renorm_momentum",
)
_LN_KEYS = (
    "axis", "epsilon", "center", "scale", "rms_scaling", "beta_initializer", "gamma_initializer",
    "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint",
)
_RNN_KEYS = (
    "units", "activation", "recurrent_activation", "use_bias", "kernel_initializer", "recurrent_initializer",
    "bias_initializer", "unit_forget_bias", "kernel_regularizer", "recurrent_regularizer", "bias_regularizer",
    "activity_regularizer", "kernel_constraint", "recurrent_constraint", "bias_constraint", "dropout",
    "recurrent_dropout", "seed", "return_sequences", "return_state", "go_backwards", "stateful", "unroll",
    "zero_output_for_mask", "reset_after",
)


def _make(cls, layer, keys, **overrides):
    """``cls`` built from `layer`'s config (`keys`) or a ValueError with the fused layer's own reason."""
    kwargs = _cfg(layer, keys)
    if "activity_regularizer" in keys and layer.activity_regularizer is not None:
        kwargs["activity_regularizer"] = keras.regularizers.serialize(layer.activity_regularizer)
    kwargs.update(_common_kwargs(layer))
    kwargs.update(overrides)
    return cls(**kwargs)


def _rank_axis(axis, rank):
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    return [a + rank if a < 0 else a for a in axes]


def _bn_reason(bn, input_shape):
    """Why `bn` cannot become FusedBatchNorm / join ConvBNAct, or None."""
    rank = len(input_shape)
    if rank not in (2, 4):
        return f"FusedBatchNorm takes 2-D or 4-D inputs (FusedBatchNormV3 is NHWC); this input is {rank}-D"
    if _rank_axis(bn.axis, rank) != [rank - 1]:
        return f"axis={bn.axis} is not the last (channels_last) axis"
    return None


def _ln_reason(ln, input_shape):
    rank = len(input_shape)
    if _rank_axis(ln.axis, rank) != [rank - 1]:
        return f"axis={ln.axis}: FusedLayerNorm normalizes the last axis only"
    return None


# ----------------------------------------------------------------------------
# Weight mapping.


def _np(v):
    return keras.ops.convert_to_numpy(v)


def _same_bits(a, b):
    """Bitwise equality of two variables' values (NaN payloads included, so NaN weights copy too)."""
    a, b = np.asarray(_np(a)), np.asarray(_np(b))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _copy_identical(src, dst, pairs):
    """Copies `src`'s weights into `dst` one by one (same count, names, shapes); asserts bitwise equality."""
    sw, dw = src.weights, dst.weights
    if len(sw) != len(dw):
        raise RuntimeError(
            f"weight layouts differ: {src.name} has {[w.name for w in sw]}, {dst.name} has {[w.name for w in dw]}"
        )
    for a, b in zip(sw, dw):
        if tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"weight {a.path} {tuple(a.shape)} != {b.path} {tuple(b.shape)}")
        b.assign(a.value if hasattr(a, "value") else a)
        if not _same_bits(a, b):
            raise RuntimeError(f"weight {a.path} did not copy exactly into {b.path}")
        if a.trainable and b.trainable:
            pairs.append((a, b))


def _bn_parts(bn, channels):
    gamma = _np(bn.gamma).astype("float64") if bn.scale else np.ones(channels)
    beta = _np(bn.beta).astype("float64") if bn.center else np.zeros(channels)
    return gamma, beta, _np(bn.moving_mean).astype("float64"), _np(bn.moving_variance).astype("float64")


def _folded(conv, bn, depthwise):
    """Kernel and bias of `conv` with inference-mode `bn` folded in (float64 math, float32 out)."""
    kernel = _np(conv.kernel).astype("float64")
    out = kernel.shape[2] * kernel.shape[3] if depthwise else kernel.shape[3]
    gamma, beta, mean, var = _bn_parts(bn, out)
    scale = gamma / np.sqrt(var + bn.epsilon)
    bias = _np(conv.bias).astype("float64") if conv.use_bias else np.zeros(out)
    if depthwise:
        kh, kw, cin, dm = kernel.shape
        kernel = (kernel.reshape(kh, kw, cin * dm) * scale).reshape(kh, kw, cin, dm)
    else:
        kernel = kernel * scale
    return kernel.astype("float32"), ((bias - mean) * scale + beta).astype("float32")


# ----------------------------------------------------------------------------
# Graph walk.


class _Graph:
    """Consumers and call counts of one functional graph."""

    def __init__(self, fn, keep_output_names=True):
        self.fn = fn
        self.keep_output_names = keep_output_names
        depths = sorted(fn._nodes_by_depth, reverse=True)
        self.nodes = [n for d in depths for n in fn._nodes_by_depth[d] if n.operation is not None and not n.is_input]
        self.consumers = collections.defaultdict(list)
        for n in self.nodes:
            for kt in n.input_tensors:
                self.consumers[id(kt)].append(n)
        self.outputs = {id(t) for t in fn.outputs}
        self.calls = collections.Counter(id(n.operation) for n in self.nodes)

    def shared(self, layer):
        return self.calls[id(layer)] > 1

    def next_layer(self, node):
        """The node that alone consumes `node`'s single output, when it can be merged into `node`."""
        if len(node.outputs) != 1 or id(node.outputs[0]) in self.outputs:
            return None
        users = self.consumers[id(node.outputs[0])]
        if len(users) != 1:
            return None
        user = users[0]
        if self.keep_output_names and any(id(t) in self.outputs for t in user.outputs):
            return None  # merging it would rename a model output
        args, kwargs = user.arguments.args, user.arguments.kwargs
        if (
            self.shared(user.operation)
            or len(user.input_tensors) != 1
            or len(args) != 1
            or args[0] is not node.outputs[0]
            or {k for k, v in kwargs.items() if v is not None} - {"training"}
            or user.operation.trainable != node.operation.trainable
            or _policy(user.operation) != _policy(node.operation)
        ):
            return None
        return user


@dataclasses.dataclass
class _Plan:
    kind: str  # "replace" | "keep" (a copy) | "reuse" (the stock object) | "model" (nested) | "op" (keras.ops)
    nodes: list  # the head node, then absorbed nodes
    make: object = None  # () -> new layer (replace)
    copy: object = None  # (new_layer, pairs) -> None, after the new layer is built
    rewrite: Rewrite | None = None
    layer_key: int | None = None  # id of the stock layer whose new layer is shared between calls


class _Converter:
    def __init__(self, inference, report, prefix=""):
        self.inference = inference
        self.report = report
        self.prefix = prefix
        self.pairs = []  # (stock variable, new variable) whose gradients must match
        self.new_layers = {}  # id(stock layer) -> new layer, for shared layers

    # --------------------------------------------------------------- planning

    def _label(self, name):
        return f"{self.prefix}{name}"

    @staticmethod
    def _call_kwargs_reason(node, cls):
        """Why a call of `node` cannot be passed to `cls` (a non-None argument its call does not take)."""
        accepted = inspect.signature(cls.call).parameters
        # `training` only matters to layers that take it; the others behave the same either way.
        extra = [k for k, v in node.arguments.kwargs.items()
                 if v is not None and k not in accepted and k != "training"]
        if extra:
            return f"called with {', '.join(extra)}, which {cls.__name__} does not take"
        return None

    def _keep(self, node, reason):
        return _Plan("keep", [node], rewrite=None, layer_key=id(node.operation)), reason

    def plan(self, g, node):
        """The `_Plan` for `node` (and the reason when it is kept)."""
        from tfmetal_ext import layers as fl

        layer = node.operation
        L = keras.layers
        shared = g.shared(layer)
        in_shape = tuple(node.input_tensors[0].shape) if node.input_tensors else ()
        if isinstance(layer, keras.Model):
            from keras.src.models.functional import Functional

            walkable = getattr(layer, "_functional", None) is not None if isinstance(layer, keras.Sequential) \
                else isinstance(layer, Functional)
            if walkable:
                return _Plan("model", [node], layer_key=id(layer)), None
            return self._keep(node, f"subclassed model ({type(layer).__name__}): no layer graph to walk")
        if not isinstance(layer, keras.layers.Layer):  # a keras.ops operation in the graph: stateless
            return _Plan("op", [node], layer_key=id(layer)), None
        if self.inference and type(layer) in (fl.ConvBNAct, fl.ResidualBlock):
            return self._plan_refold(node)
        if _is_stock(layer, L.Conv2D) or _is_stock(layer, L.DepthwiseConv2D):
            return self._plan_conv(g, node, shared, depthwise=_is_stock(layer, L.DepthwiseConv2D))
        if _is_stock(layer, L.Dense):
            return self._plan_contraction(g, node, shared, _DENSE_KEYS, "FusedDense", _DENSE_ACTS)
        if _is_stock(layer, L.BatchNormalization):
            reason = _bn_reason(layer, in_shape)
            if reason:
                return self._keep(node, reason)
            return self._plan_simple(node, "FusedBatchNorm", _BN_KEYS)
        if _is_stock(layer, L.LayerNormalization):
            reason = _ln_reason(layer, in_shape)
            if reason:
                return self._keep(node, reason)
            return self._plan_simple(node, "FusedLayerNorm", _LN_KEYS, overrides={"axis": -1})
        if _is_stock(layer, L.LSTM) or _is_stock(layer, L.GRU):
            name = "FusedLSTM" if _is_stock(layer, L.LSTM) else "FusedGRU"
            keys = tuple(k for k in _RNN_KEYS if k != ("reset_after" if name == "FusedLSTM" else "unit_forget_bias"))
            return self._plan_simple(node, name, keys)
        if type(layer) in (L.Activation, L.ReLU, L.LeakyReLU, L.ELU):
            act = _activation_of(layer)
            if act not in _DENSE_ACTS:
                return self._keep(node, f"activation {act or type(layer).__name__!r} is never fused into a "
                                        "contraction; kept as a separate layer")
            return self._keep(node, f"activation {act!r}: no fusable layer right before it (or the "
                                    "pre-activation tensor has other consumers, or it is a model output)")
        stock = type(layer).__module__.startswith("keras.")
        if type(layer).__module__.startswith("tfmetal_ext."):
            return self._keep(node, "already a tfmetal_ext layer")
        if not stock:
            base = next((c.__name__ for c in type(layer).__mro__[1:] if c.__module__.startswith("keras.")), "Layer")
            return self._keep(
                node, f"subclassed layer ({type(layer).__module__}.{type(layer).__name__}, a {base} subclass): "
                      "its call is its own, so it is kept as is",
            )
        return self._keep(node, NO_COUNTERPART)

    def _try(self, node, cls_name, make):
        """Builds a throwaway instance to learn whether the fused layer accepts this configuration."""
        try:
            make()
        except ValueError as e:
            return f"{cls_name} does not support this configuration: {e}"
        return None

    def _plan_simple(self, node, cls_name, keys, overrides=None):
        from tfmetal_ext import layers as fl

        layer = node.operation
        cls = getattr(fl, cls_name)
        reason = _extra_unsupported(layer)

        def make():
            return _make(cls, layer, keys, **(overrides or {}))

        reason = reason or self._try(node, cls_name, make)
        if reason:
            return self._keep(node, reason)
        note = f"shared: called {self._calls} times, converted once" if self._calls > 1 else ""

        def copy(new, pairs):
            _copy_identical(layer, new, pairs)

        rw = Rewrite((self._label(layer.name),), self._label(layer.name), cls_name, note)
        return _Plan("replace", [node], make=make, copy=copy, rewrite=rw, layer_key=id(layer)), None

    def _absorb_activation(self, g, node, allowed, current="linear"):
        """The activation node right after `node` that can fold into it, and its name."""
        if current != "linear":
            return None, None
        nxt = g.next_layer(node)
        act = _activation_of(nxt.operation) if nxt is not None else None
        if act in allowed:
            return nxt, act
        return None, None

    def _plan_contraction(self, g, node, shared, keys, cls_name, acts, extra_overrides=None):
        from tfmetal_ext import layers as fl

        layer = node.operation
        cls = getattr(fl, cls_name)
        reason = _extra_unsupported(layer)
        reason = reason or self._try(node, cls_name, lambda: _make(cls, layer, keys))
        if reason:
            return self._keep(node, reason)
        act_node, act = (None, None) if shared else self._absorb_activation(g, node, acts, _own_activation(layer))
        overrides = {"activation": act} if act else {}

        def make():
            return _make(cls, layer, keys, **overrides)

        def copy(new, pairs):
            _copy_identical(layer, new, pairs)

        nodes = [node] + ([act_node] if act_node else [])
        note = f"shared: called {g.calls[id(layer)]} times, converted once" if shared else ""
        if act_node:
            note = f"activation {act!r} folded in"
        src = tuple(self._label(n.operation.name) for n in nodes)
        return _Plan("replace", nodes, make=make, copy=copy,
                     rewrite=Rewrite(src, self._label(layer.name), cls_name, note), layer_key=id(layer)), None

    def _plan_conv(self, g, node, shared, depthwise):
        from tfmetal_ext import layers as fl

        layer = node.operation
        keys = _DEPTHWISE_KEYS if depthwise else _CONV_KEYS
        cls_name = "FusedDepthwiseConv2D" if depthwise else "FusedConv2D"
        cls = getattr(fl, cls_name)
        reason = _extra_unsupported(layer) or self._try(node, cls_name, lambda: _make(cls, layer, keys))
        if reason:
            return self._keep(node, reason)
        bn_node = None if shared or _own_activation(layer) != "linear" else g.next_layer(node)
        if bn_node is not None and not (
            _is_stock(bn_node.operation, keras.layers.BatchNormalization)
            and _bn_reason(bn_node.operation, tuple(node.outputs[0].shape)) is None
        ):
            bn_node = None
        if bn_node is None:
            return self._plan_contraction(g, node, shared, keys, cls_name, _CONV_ACTS)
        bn = bn_node.operation
        if self.inference:
            return self._plan_fold(g, node, bn_node, cls, cls_name, keys, depthwise)
        if depthwise:
            return self._plan_contraction(g, node, shared, keys, cls_name, _CONV_ACTS)
        why_not = self._conv_bn_reason(layer, bn)
        if why_not:
            plan, _ = self._plan_contraction(g, node, shared, keys, cls_name, _CONV_ACTS)
            plan.rewrite.note = (plan.rewrite.note + "; " if plan.rewrite.note else "") + f"not ConvBNAct: {why_not}"
            return plan, None
        act_node, act = self._absorb_activation(g, bn_node, _CONV_BN_ACTS)
        nodes = [node, bn_node] + ([act_node] if act_node else [])

        def make():
            return fl.ConvBNAct(
                layer.filters, layer.kernel_size, strides=layer.strides, padding=layer.padding,
                activation=act or "linear", momentum=float(bn.momentum), epsilon=float(bn.epsilon),
                kernel_initializer=keras.initializers.serialize(layer.kernel_initializer),
                kernel_regularizer=keras.regularizers.serialize(layer.kernel_regularizer),
                kernel_constraint=keras.constraints.serialize(layer.kernel_constraint),
                gamma_initializer=keras.initializers.serialize(bn.gamma_initializer),
                beta_initializer=keras.initializers.serialize(bn.beta_initializer),
                moving_mean_initializer=keras.initializers.serialize(bn.moving_mean_initializer),
                moving_variance_initializer=keras.initializers.serialize(bn.moving_variance_initializer),
                gamma_regularizer=keras.regularizers.serialize(bn.gamma_regularizer),
                beta_regularizer=keras.regularizers.serialize(bn.beta_regularizer),
                **_common_kwargs(layer),
            )

        def copy(new, pairs):
            new.kernel.assign(layer.kernel.value)
            for mine, theirs in ((new.gamma, bn.gamma), (new.beta, bn.beta), (new.moving_variance, bn.moving_variance)):
                mine.assign(theirs.value)
            mean = _np(bn.moving_mean)
            if layer.use_bias:
                # Batch norm subtracts the batch mean in training, so the conv bias only shifts the
                # moving mean; keeping the moving mean minus the bias is exact, in training too.
                mean = (mean.astype("float64") - _np(layer.bias).astype("float64")).astype("float32")
            new.moving_mean.assign(mean)
            for a, b in ((layer.kernel, new.kernel), (bn.gamma, new.gamma), (bn.beta, new.beta)):
                if not _same_bits(a, b):
                    raise RuntimeError(f"weight {a.path} did not copy exactly into {b.path}")
                pairs.append((a, b))

        note = "conv bias moved into the moving mean (exact)" if layer.use_bias else ""
        src = tuple(self._label(n.operation.name) for n in nodes)
        rw = Rewrite(src, self._label(layer.name), "ConvBNAct", note)
        return _Plan("replace", nodes, make=make, copy=copy, rewrite=rw, layer_key=id(layer)), None

    @staticmethod
    def _conv_bn_reason(conv, bn):
        if max(conv.dilation_rate) > 1:
            return "dilation_rate > 1"
        if not (bn.center and bn.scale):
            return "batch norm without center/scale"
        if bn.beta_constraint is not None or bn.gamma_constraint is not None:
            return "batch norm weight constraints"
        if conv.activity_regularizer is not None:
            return "activity regularizer on the conv"
        if conv.use_bias and (conv.bias_regularizer is not None or conv.bias_constraint is not None):
            return "conv bias with a regularizer or constraint"
        from tfmetal_ext.layers import _ops

        try:
            _ops.check_batch_norm_args(float(bn.momentum), float(bn.epsilon))
        except ValueError as e:
            return str(e)
        if any(getattr(bn, k, None) for k in ("renorm", "synchronized")):
            return "batch renormalization / synchronized batch norm"
        return None

    def _plan_refold(self, node):
        """A tfmetal_ext ConvBNAct / ResidualBlock in an already converted model: its own `fold()`."""
        layer = node.operation

        def make():
            new = layer.fold(name=layer.name)
            new.trainable = layer.trainable
            return new

        new_class = "FusedConv2D" if type(layer).__name__ == "ConvBNAct" else "FoldedResidualBlock"
        rw = Rewrite((self._label(layer.name),), self._label(layer.name), new_class,
                     f"{type(layer).__name__}.fold(): batch norm folded into kernel and bias (inference only)")
        return _Plan("replace", [node], make=make, copy=lambda new, pairs: None, rewrite=rw,
                     layer_key=id(layer)), None

    def _plan_fold(self, g, node, bn_node, cls, cls_name, keys, depthwise):
        layer, bn = node.operation, bn_node.operation
        act_node, act = self._absorb_activation(g, bn_node, _CONV_ACTS)
        nodes = [node, bn_node] + ([act_node] if act_node else [])
        overrides = {"use_bias": True}
        if act:
            overrides["activation"] = act

        def make():
            return _make(cls, layer, keys, **overrides)

        def copy(new, pairs):
            kernel, bias = _folded(layer, bn, depthwise)
            new.kernel.assign(kernel)
            new.bias.assign(bias)

        src = tuple(self._label(n.operation.name) for n in nodes)
        note = "batch norm folded into kernel and bias (inference only)"
        if act:
            note += f", activation {act!r} folded in"
        rw = Rewrite(src, self._label(layer.name), cls_name, note)
        return _Plan("replace", nodes, make=make, copy=copy, rewrite=rw, layer_key=id(layer)), None

    # --------------------------------------------------------------- building

    def convert_functional(self, fn):
        """Rebuilds functional graph `fn`; returns (new inputs struct, new outputs struct, correspondences)."""
        # A nested model's output names are invisible to the outer graph: only the top level keeps them.
        g = _Graph(fn, keep_output_names=not self.prefix)
        tensors = {}
        new_inputs = []
        for kt in fn.inputs:
            inp_layer = kt._keras_history.operation
            clone = type(inp_layer).from_config(inp_layer.get_config())
            tensors[id(kt)] = clone.output
            new_inputs.append(clone.output)
        absorbed = set()
        corr = []  # (label, class, stock tensor, new tensor)
        for node in g.nodes:
            if id(node) in absorbed:
                continue
            layer = node.operation
            self._calls = g.calls[id(layer)]
            plan, reason = self.plan(g, node)
            if plan.kind == "replace":
                why = self._call_kwargs_reason(node, type(plan.make()))
                if why:
                    plan, reason = self._keep(node, why)
            for n in plan.nodes[1:]:
                absorbed.add(id(n))
            new_layer = self.new_layers.get(plan.layer_key)
            first = new_layer is None
            if first:
                new_layer = self._instantiate(plan, reason)
                self.new_layers[plan.layer_key] = new_layer
            args, kwargs = node.arguments.fill_in(tensors)
            if plan.kind == "replace":
                accepted = inspect.signature(new_layer.call).parameters
                kwargs = {k: v for k, v in kwargs.items() if k in accepted or (v is not None and k != "training")}
            for n in plan.nodes[1:]:
                if "training" in n.arguments.kwargs:
                    kwargs["training"] = n.arguments.kwargs["training"]
            out = new_layer(*args, **kwargs)
            if first:
                self._after_build(plan, new_layer)
            last = plan.nodes[-1]
            for old, new in zip(last.outputs, keras.tree.flatten(out)):
                tensors[id(old)] = new
            label = self._label(new_layer.name)
            if last.operation.name != new_layer.name:
                label += f" (stock: {last.operation.name} output)"
            corr.append((label, type(new_layer).__name__, last.outputs[0], keras.tree.flatten(out)[0]))
        in_struct = keras.tree.pack_sequence_as(fn._inputs_struct, new_inputs)
        out_struct = keras.tree.map_structure(lambda t: tensors[id(t)], fn._outputs_struct)
        return in_struct, out_struct, corr

    def _instantiate(self, plan, reason):
        layer = plan.nodes[0].operation
        if plan.kind == "replace":
            self.report.rewrites.append(plan.rewrite)
            return plan.make()
        if plan.kind == "model":
            sub = _Converter(self.inference, self.report, prefix=f"{self.prefix}{layer.name}/")
            new = sub.convert_model(layer)
            self.pairs += sub.pairs
            return new
        if plan.kind == "op":
            self.report.notes.append(f"{self._label(layer.name)}: Keras operation {type(layer).__name__} reused as is")
            return layer
        # keep: a fresh copy with the same config (weights copied once built), else the layer itself
        self.report.kept.append(Kept(self._label(layer.name), type(layer).__name__, reason))
        try:
            clone = type(layer).from_config(layer.get_config())
        except Exception as e:  # arbitrary user code
            self.report.notes.append(
                f"{self._label(layer.name)}: could not be re-created from its config ({type(e).__name__}: {e}); "
                "the converted model uses the same layer object (shared weights)"
            )
            plan.kind = "reuse"
            return layer
        return clone

    def _after_build(self, plan, new_layer):
        layer = plan.nodes[0].operation
        if plan.kind == "replace":
            plan.copy(new_layer, self.pairs)
        elif plan.kind == "keep":
            try:
                _copy_identical(layer, new_layer, self.pairs)
            except Exception as e:
                raise RuntimeError(
                    f"could not copy the weights of kept layer {self._label(layer.name)!r} into its copy: {e}"
                ) from e
            new_layer.trainable = layer.trainable
        elif plan.kind == "reuse":
            self.pairs += [(w, w) for w in layer.trainable_weights]

    def convert_model(self, model):
        """A converted copy of a Functional or Sequential model (same name)."""
        if isinstance(model, keras.Sequential):
            fn = getattr(model, "_functional", None)
            if fn is None:
                raise ValueError(
                    "Only a built Sequential model (with an Input or called once) can be converted. "
                    f"Received: model={model.name!r} (not built)"
                )
            ins, outs, corr = self.convert_functional(fn)
            inp = fn.inputs[0]._keras_history.operation
            layers = [type(inp).from_config(inp.get_config())]
            seen = set()
            for _, _, _, t in corr:
                new_layer = t._keras_history.operation
                if id(new_layer) not in seen:
                    seen.add(id(new_layer))
                    layers.append(new_layer)
            new = keras.Sequential(layers, name=model.name, trainable=model.trainable)
            self.graph = (ins, corr)
            return new
        from keras.src.models.functional import Functional

        if not isinstance(model, Functional):
            raise ValueError(
                "convert() walks the layer graph of a Functional or Sequential model; a subclassed "
                "model has no graph to walk. Received: "
                f"model={getattr(model, 'name', model)!r} ({type(model).__name__})"
            )
        ins, outs, corr = self.convert_functional(model)
        new = keras.Model(ins, outs, name=model.name, trainable=model.trainable)
        self.graph = (ins, corr)
        return new


# ----------------------------------------------------------------------------
# Verification.


def _agree(a, b):
    """Where two arrays hold exactly the same value, NaN with NaN and +inf with +inf included."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _warn_partial(report, note, stacklevel):
    """A verification that could only compare part of the values: a report note and a RuntimeWarning."""
    report.notes.append(note)
    warnings.warn(f"convert(verify=True): {note}.", RuntimeWarning, stacklevel=stacklevel + 1)


def _rel_diff(a, b):
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    # One-sided non-finite values give NaN or inf, which fail every tolerance.
    with np.errstate(invalid="ignore"):
        err = np.where(_agree(a, b), 0.0, np.abs(a - b))
    return float(np.max(err) / max(float(np.max(np.abs(np.where(np.isfinite(a), a, 0.0)))), 1e-6))


def _check_finite(ref, model, report):
    """Verification means little where the stock model's own outputs are NaN or inf: say so, or refuse."""
    bad = sum(int(np.sum(~np.isfinite(r))) for r in ref)
    total = sum(r.size for r in ref)
    if not bad:
        return
    if bad == total:
        raise VerificationError(
            f"convert(verify=True): cannot verify the conversion: every output value of {model.name!r} on "
            "the synthetic verification inputs is NaN or inf (in the stock model itself), so there is "
            "nothing to compare. Check the model's weights (e.g. moving statistics after a diverged run), "
            "or pass verify=False to convert without checking.",
            diffs=[], report=report,
        )
    _warn_partial(report, f"{bad} of {total} output values of {model.name!r} on the synthetic verification "
                  "inputs are NaN or inf (in the stock model itself); there the conversion was only checked "
                  "to give the same non-finite values", stacklevel=4)


def _rel_l2(a, b):
    """||a - b|| / ||a|| over the finite entries of `a`; inf unless `b` has the same non-finite entries."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    fin = np.isfinite(a)
    if not np.all(fin):
        if not np.all(_agree(a, b)[~fin]):
            return float("inf")
        a, b = a[fin], b[fin]
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), 1e-12))


def _as_list(y):
    """Flat list of numpy arrays (floating outputs as float32)."""
    out = []
    for t in keras.tree.flatten(y):
        if "float" in str(getattr(t, "dtype", "")):
            t = keras.ops.cast(t, "float32")
        out.append(keras.ops.convert_to_numpy(t))
    return out


def _tol(table, policy_name, tolerance):
    if tolerance is not None:
        return float(tolerance)
    compute = keras.mixed_precision.Policy(policy_name).compute_dtype
    return table.get(compute, table["float32"])


@contextlib.contextmanager
def _no_dropout(*models):
    """Sets every dropout rate in `models` to 0 for the duration (both sides must be deterministic)."""
    saved = []
    for m in models:
        for layer in m._flatten_layers(include_self=True, recursive=True):
            for attr in ("rate", "dropout", "recurrent_dropout"):
                value = getattr(type(layer), attr, None)
                if isinstance(value, property):
                    continue
                v = layer.__dict__.get(attr)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                    saved.append((layer, attr, v))
                    object.__setattr__(layer, attr, 0.0)
    try:
        yield
    finally:
        for layer, attr, v in saved:
            object.__setattr__(layer, attr, v)


def _layer_diffs(model, new, stock_graph, x, tol):
    """Per-layer relative output diffs in graph order (inference mode)."""
    ins, corr = stock_graph
    stock_fn = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    rows = []
    try:
        a = keras.Model(stock_fn.input, [c[2] for c in corr])(x, training=False)
        b = keras.Model(ins, [c[3] for c in corr])(x, training=False)
    except Exception as e:  # intermediate models are best effort
        return [(f"(per-layer outputs unavailable: {e})", float("nan"), tol)]
    for (label, cls, _, _), ya, yb in zip(corr, _as_list(a), _as_list(b)):
        name, _, rest = label.partition(" ")
        rows.append((f"{name} [{cls}]{' ' + rest if rest else ''}", _rel_diff(ya, yb), tol))
    return rows


def _verify(model, new, conv, report, inference, batch_size, tolerance, seed):
    import tensorflow as tf

    from tfmetal_ext.inspect import synthetic_inputs, synthetic_targets

    x = synthetic_inputs(model, batch_size=batch_size, seed=seed)
    tol = _tol(OUTPUT_RTOL, model.dtype_policy.name, tolerance)
    ref = _as_list(model(x, training=False))
    _check_finite(ref, model, report)
    got = _as_list(new(x, training=False))
    worst = max(_rel_diff(a, b) for a, b in zip(ref, got))
    report.max_output_diff = worst
    if not worst <= tol:
        rows = _layer_diffs(model, new, conv.graph, x, tol)
        bad = [r for r in rows if not r[1] <= r[2]]
        lines = [f"  {w:<48} rel diff {d:.3g}" for w, d, _ in rows if not d <= tol][:25]
        first = bad[0][0] if bad else "(no single layer output differs; see the model outputs)"
        raise VerificationError(
            f"convert(verify=True): outputs of {model.name!r} and its conversion differ by {worst:.3g} "
            f"(relative to the largest output; tolerance {tol:g}). First layer that differs: {first}.\n"
            "Per-layer output diffs above tolerance (inference mode):\n" + "\n".join(lines),
            diffs=rows, report=report,
        )
    if inference:
        return
    # One training step's gradients: MSE against random targets, dropout off on both sides.
    gbatch = max(batch_size, MIN_GRAD_BATCH)
    x = synthetic_inputs(model, batch_size=gbatch, seed=seed)
    y = synthetic_targets(model, batch_size=gbatch, seed=seed + 1)
    ys = [tf.constant(t) for t in keras.tree.flatten(y)]
    gtol = _tol(GRAD_RTOL, model.dtype_policy.name, None if tolerance is None else tolerance * 20)
    stock_vars = [a for a, _ in conv.pairs]
    new_vars = [b for _, b in conv.pairs]
    state = [(v, tf.identity(v.value)) for v in model.weights + new.weights]

    def grads(m, variables, inputs, targets=None):
        with tf.GradientTape() as tape:
            out = keras.tree.flatten(m(inputs, training=True))
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, "float32") - t))
                             for o, t in zip(out, targets or ys)])
        return tape.gradient(loss, [v.value for v in variables])

    rng = np.random.default_rng(seed + 2)
    x_pert = keras.tree.map_structure(
        lambda v: (v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(v.dtype)
        if np.issubdtype(v.dtype, np.floating) else v, x)
    ys_rev = [t[::-1] for t in ys]
    x_rev = keras.tree.map_structure(lambda v: v[::-1], x)
    try:
        with _no_dropout(model, new):
            g_ref = grads(model, stock_vars, x)
            g_new = grads(new, new_vars, x)
            g_pert = grads(model, stock_vars, x_pert)
            g_perm = grads(model, stock_vars, x_rev, ys_rev)
    finally:
        for v, value in state:
            v.assign(value)
    rows, clean, nonfinite = [], [], []
    for a, b, ga, gb, gp, gq in zip(stock_vars, new_vars, g_ref, g_new, g_pert, g_perm):
        if ga is None and gb is None:
            continue
        ga, gb, gp, gq = (np.zeros(a.shape) if g is None else _np(g) for g in (ga, gb, gp, gq))
        if not np.all(np.isfinite(ga)):
            nonfinite.append(a.path)
        noise = max(_rel_l2(ga, gp), _rel_l2(ga, gq))
        noise = noise if np.isfinite(noise) else float("inf")
        rows.append((a.path, _rel_l2(ga, gb), max(gtol, NOISE_FACTOR * noise)))
        if noise <= gtol:
            clean.append(rows[-1][1])
    # Weights whose true gradient is ~0 (e.g. a batch norm beta feeding another batch norm) are all noise.
    report.max_grad_diff = max(clean, default=0.0)
    if len(clean) < len(rows):
        report.notes.append(
            f"{len(rows) - len(clean)} of {len(rows)} weight gradients are dominated by rounding noise in the "
            "stock model itself (true gradient ~0); compared against that noise only"
        )
    if nonfinite:
        _warn_partial(report, f"{len(nonfinite)} of {len(rows)} weight gradients of the stock model itself "
                      f"have NaN or inf entries (first: {nonfinite[0]}); only their finite entries were compared",
                      stacklevel=3)
    bad = [r for r in rows if not r[1] <= r[2]]
    if bad:
        lines = [f"  {w:<48} rel diff {d:.3g} (tolerance {t:.3g})" for w, d, t in bad][:25]
        raise VerificationError(
            f"convert(verify=True): training gradients of {model.name!r} and its conversion differ "
            f"(||g_stock - g_converted|| / ||g_stock|| above max({gtol:g}, {NOISE_FACTOR:g} x the stock "
            "gradients' own rounding noise)). First weight that differs: "
            f"{bad[0][0]}.\nPer-weight gradient diffs above tolerance:\n" + "\n".join(lines),
            diffs=rows, report=report,
        )


# ----------------------------------------------------------------------------
# Op counts.


def _count_ops(model, batch_size, report, key):
    from tfmetal_ext import inspect

    counts = {}
    for mode in ("train", "predict"):
        kw = {"batch_size": batch_size}
        if mode == "train" and not getattr(model, "compiled", False):
            kw.update(optimizer="adam", loss="mse")
        try:
            counts[mode] = inspect.fusion_report(model, mode=mode, **kw).num_ops
        except Exception as e:  # counting is informative only
            report.notes.append(f"{key} ops per {mode} step not counted: {type(e).__name__}: {e}")
    return counts


# ----------------------------------------------------------------------------
# Entry point.


def convert(model, inference=False, verify=True, *, count_ops=True, batch_size=2, tolerance=None, seed=0):
    """Returns an equivalent model built from tfmetal_ext's fusion-first layers.

    Walks the layer graph of a Functional or Sequential model (nested models
    recursively) and rewrites Conv2D, DepthwiseConv2D, Dense,
    Conv2D -> BatchNormalization (-> Activation) chains, BatchNormalization,
    LayerNormalization, LSTM and GRU into `tfmetal_ext.layers`, folding
    separate activation layers into the layer before them when nothing else
    reads the pre-activation tensor. Layer names, input/output names,
    trainable flags, dtype policies and weights are preserved (weights copied
    bitwise where the mapping is the identity). Layers that cannot be
    converted are kept (copied) and listed with the reason. A compiled model's
    compile configuration is applied to the result.

    Args:
        model: a built `keras.Model` made with the functional API or a
            `keras.Sequential`.
        inference: also fold batch norms into the preceding convolution's
            kernel and bias (the deployment form; not for training).
        verify: run both models on random inputs of the model's input spec
            (inference mode) and, for the training form, compare one training
            step's gradients (MSE against random targets, dropout off);
            raises `VerificationError` on a mismatch. Where the stock
            model's own outputs or gradients are NaN or inf, the converted
            model must give the same non-finite values and the finite ones
            are compared (with a `RuntimeWarning` and a report note); if every
            output is non-finite there is nothing to compare and it raises.
        count_ops: count compute ops per train step and per inference call
            of both models with `tfmetal_ext.inspect.fusion_report` (costs a
            few seconds for big models; uncompiled models are counted with
            Adam and MSE).
        batch_size: batch size of the random inputs of verify and op counts.
        tolerance: relative tolerance of verify's output comparison
            (gradients: 20x), instead of the per-dtype defaults in
            `OUTPUT_RTOL` / `GRAD_RTOL`.
        seed: seed of the random inputs.

    Returns:
        The converted `keras.Model` (a `keras.Sequential` for a Sequential
        input); its `conversion_report` attribute holds the
        `ConversionReport`.

    Raises:
        ValueError: if `model` is not a built Functional or Sequential model
            (``... Received: model=...``).
        VerificationError: (an `AssertionError`) when verify finds outputs or
            gradients that differ beyond tolerance (the message lists the
            per-layer or per-weight differences), or when every output of
            the stock model on the verification inputs is NaN or inf.

    Example:

    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
    ...                           keras.layers.BatchNormalization(), keras.layers.ReLU(),
    ...                           keras.layers.Flatten()])
    >>> fused = tfmetal_ext.convert(model, count_ops=False)
    >>> [type(l).__name__ for l in fused.layers]
    ['ConvBNAct', 'Flatten']
    """
    from keras.src.models.functional import Functional

    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected a Functional or Sequential keras.Model. Received: model={model!r}")
    if isinstance(model, keras.Sequential) and getattr(model, "_functional", None) is None:
        raise ValueError(
            "Only a built Sequential model (with an Input, or called once) can be converted. "
            f"Received: model={model.name!r} (not built)"
        )
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ValueError(
            "convert() walks the layer graph of a Functional or Sequential model; a subclassed model "
            f"has no graph to walk. Received: model={model.name!r} ({type(model).__name__})"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not tolerance > 0):
        raise ValueError(f"`tolerance` must be a positive number or None. Received: tolerance={tolerance!r}")
    report = ConversionReport(model=model.name, inference=bool(inference))
    conv = _Converter(bool(inference), report)
    new = conv.convert_model(model)
    if getattr(model, "compiled", False):
        try:
            new.compile_from_config(model.get_compile_config())
            report.notes.append("compiled with the source model's compile config (fresh optimizer state)")
        except Exception as e:  # custom losses / metrics may not deserialize
            report.notes.append(f"not compiled: the compile config could not be applied ({e})")
    if inference:
        report.notes.append("inference form: batch norms are folded; train the training form instead")
    if verify:
        _verify(model, new, conv, report, bool(inference), batch_size, tolerance, seed)
        report.verified = True
    if count_ops:
        report.ops_before = _count_ops(model, batch_size, report, "stock")
        report.ops_after = _count_ops(new, batch_size, report, "converted")
    object.__setattr__(new, "conversion_report", report)  # plain attribute, not tracked by Keras
    logger.info("%s", report)
    return new
