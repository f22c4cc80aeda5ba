"""What replaces each layer call: the planner registry, keyed by layer class, and the planners.

A planner is ``fn(ctx, node) -> (Plan, reason) | None``: `ctx` is the
`PlanContext` of the graph being walked, `node` one call of a layer of the
class it is registered for. It returns the `Plan` for that call (``reason``
is the `Kept` reason of a kept layer, else None), or None to leave the layer
to the default classification (kept, with the reason). Adding a stock ->
fused mapping is one registration (given its `STOCK_TO_FUSED` row):

>>> @register_planner(keras.layers.UnitNormalization)
... def _unit_norm(ctx, node):
...     return plan_same_weights(ctx, node, keras.layers.UnitNormalization, ("axis",))

Which fused class replaces a stock class comes from
`tfmetal_ext.backends.fusion.STOCK_TO_FUSED`, which activations fold into a
contraction from `tfmetal_ext.backends.fusion` (`CONTRACTION_ACTIVATIONS`,
`ACTIVATION_OPS`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib

import keras

from tfmetal_ext import _saved_names as saved_names
from tfmetal_ext import layers as fl
from tfmetal_ext.backends.fusion import ACTIVATION_OPS, CONTRACTION_ACTIVATIONS, LEAKY_RELU_ALPHA, STOCK_TO_FUSED
from tfmetal_ext.backends.fusion import BATCH_NORM_ACT_ACTIVATIONS
from tfmetal_ext.conversion import configs, weights
from tfmetal_ext.conversion.report import NO_COUNTERPART, Rewrite
from tfmetal_ext.inspect.catalog import activation_name

L = keras.layers

# Activations a FusedConv2D / FusedDepthwiseConv2D / ConvBNAct absorbs (one op right after the
# BiasAdd / batch norm, which every remapper fuses).
CONV_ACTIVATIONS = CONTRACTION_ACTIVATIONS
# FusedDense also emits every other activation of the table as one op after the BiasAdd: those
# that are stock Keras activations (``gelu_approximate`` is FusedDense's own name, no stock layer's).
DENSE_ACTIVATIONS = CONTRACTION_ACTIVATIONS + tuple(
    a for a in ACTIVATION_OPS if a not in CONTRACTION_ACTIVATIONS and hasattr(keras.activations, a)
)

# ----------------------------------------------------------------------------
# The registry.

PLANNERS = {}  # layer class -> planner


def register_planner(*classes):
    """Decorator: registers ``fn(ctx, node)`` as the planner of every call of a layer of `classes`.

    A stock Keras class (defined in ``keras.*``) finds the planner of the
    nearest class in its MRO; any other class only its own, so a user's
    subclass of a stock layer is kept (its call is its own) unless a planner
    is registered for that subclass itself.

    Raises:
        ValueError: if one of `classes` already has a planner.
    """

    def register(fn):
        for cls in classes:
            if cls in PLANNERS:
                raise ValueError(
                    f"{cls.__name__} already has a planner ({PLANNERS[cls].__name__}). Received: classes={classes!r}"
                )
        for cls in classes:
            PLANNERS[cls] = fn
        return fn

    return register


def _is_stock_class(cls):
    return cls.__module__.startswith("keras.")


def planner_for(cls):
    """The planner registered for layer class `cls`, or None."""
    if not _is_stock_class(cls):
        return PLANNERS.get(cls)
    return next((PLANNERS[c] for c in cls.__mro__ if c in PLANNERS), None)


def fused_class(stock):
    """The tfmetal_ext class that replaces stock class `stock` (`STOCK_TO_FUSED`)."""
    replacement = STOCK_TO_FUSED[stock.__name__]
    return getattr(importlib.import_module(replacement.module), replacement.fused)


def stock_class(fused):
    """The stock Keras class that tfmetal_ext class `fused` replaces (`STOCK_TO_FUSED` read in reverse), or None.
    A saved-name alias (`_saved_names`) stands for its fused class."""
    fused = saved_names.unaliased(fused)
    for row in STOCK_TO_FUSED.values():
        if fused.__name__ == row.fused and fused.__module__.startswith(row.module):
            return getattr(keras.layers, row.stock)
    return None


# ----------------------------------------------------------------------------
# Plans.


@dataclasses.dataclass
class Plan:
    kind: str  # "replace" | "retype" (a copy as a subclass) | "keep" (a copy) | "model" (nested) | "op" (keras.ops)
    nodes: list  # the head node, then absorbed nodes
    make: object = None  # () -> new layer (replace); the subclass to copy the layer as (retype)
    copy: object = None  # (new_layer, pairs) -> None, after the new layer is built
    rewrite: Rewrite | None = None
    layer_key: int | None = None  # id of the stock layer whose new layer is shared between calls


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """What a planner knows besides its node: the graph, the form being made, the name prefix."""

    graph: object  # the `graph.Graph` being walked
    inference: bool
    prefix: str = ""  # ``outer/`` inside a nested model

    def label(self, name):
        return f"{self.prefix}{name}"

    def calls(self, layer):
        return self.graph.calls[id(layer)]

    def replace(self, nodes, new_class, make, copy, note=""):
        """A ``replace`` plan of `nodes` (head first) by ``make()``, named after the head."""
        layer = nodes[0].operation
        src = tuple(self.label(n.operation.name) for n in nodes)
        rw = Rewrite(src, self.label(layer.name), new_class, note)
        return Plan("replace", nodes, make=make, copy=copy, rewrite=rw, layer_key=id(layer)), None


def keep(node, reason):
    return Plan("keep", [node], layer_key=id(node.operation)), reason


def retype(ctx, node, cls, note=""):
    """A ``retype`` plan: `node`'s layer copied as `cls`, a method-only tfmetal_ext subclass of its class.

    For layers whose structure stays and whose computation changes (a keras-hub
    attention layer whose ``_compute_attention`` runs the attention op): the copy
    is a kept layer's copy (same constructor arguments, sublayers and state; its
    own sublayers swapped for fusion-first ones where they have planners) whose
    class is then `cls` (`copying.retype`). Reported as a rewrite.
    """
    layer = node.operation
    if not (isinstance(cls, type) and cls.__mro__[1] is type(layer)):
        raise ValueError(f"a retype needs a subclass of {type(layer).__name__}. Received: cls={cls!r}")
    calls = ctx.calls(layer)
    note = note or (f"shared: called {calls} times, converted once" if calls > 1 else "")
    rw = Rewrite((ctx.label(layer.name),), ctx.label(layer.name), getattr(cls, "fused_name", cls.__name__), note)
    return Plan("retype", [node], make=cls, rewrite=rw, layer_key=id(layer)), None


def plan(ctx, node):
    """The `Plan` for `node` (and the reason when it is kept)."""
    layer = node.operation
    if isinstance(layer, keras.Model):
        from keras.src.models.functional import Functional

        walkable = getattr(layer, "_functional", None) is not None if isinstance(layer, keras.Sequential) \
            else isinstance(layer, Functional)
        if walkable:
            return Plan("model", [node], layer_key=id(layer)), None
        return keep(node, f"subclassed model ({type(layer).__name__}): no layer graph to walk")
    if not isinstance(layer, keras.layers.Layer):  # a keras.ops operation in the graph: stateless
        act = activation_of(layer)
        why = (f"activation {act!r} applied as a Keras operation: no fusable layer right before it (or the "
               "pre-activation tensor has other consumers, or it is a model output)") if act in DENSE_ACTIVATIONS \
            else "no fusion-first counterpart"
        return Plan("op", [node], layer_key=id(layer)), (
            f"Keras operation {type(layer).__module__}.{type(layer).__name__}, not a layer (no weights): "
            f"kept as the same computation; {why}")
    planner = planner_for(type(layer))
    planned = planner(ctx, node) if planner is not None else None
    if planned is not None:
        return planned
    if type(layer).__module__.startswith("tfmetal_ext."):
        return keep(node, "already a tfmetal_ext layer")
    if not _is_stock_class(type(layer)):
        base = next((c.__name__ for c in type(layer).__mro__[1:] if _is_stock_class(c)), "Layer")
        return keep(
            node, f"subclassed layer ({type(layer).__module__}.{type(layer).__name__}, a {base} subclass): "
                  "its call is its own, so it is kept (an independent copy)",
        )
    return keep(node, NO_COUNTERPART)


# ----------------------------------------------------------------------------
# Sublayers: calls that are not nodes of a functional graph (inside a subclass or a wrapper).


@dataclasses.dataclass
class CallArguments:
    """The ``arguments`` of a `SyntheticNode`: the layer's input alone, no keyword arguments."""

    args: tuple
    kwargs: dict


@dataclasses.dataclass
class SyntheticNode:
    """A call description of a built layer that has no functional node: its build input shape.

    Planners read it like a graph node (``operation``, ``input_tensors``,
    ``outputs``, ``arguments``), so a sublayer is planned by the same registry.
    """

    operation: object
    input_tensors: list
    outputs: list
    arguments: CallArguments

    @classmethod
    def of(cls, layer, input_shape):
        x = keras.KerasTensor(tuple(input_shape), dtype=layer.compute_dtype)
        try:
            outs = keras.tree.flatten(layer.compute_output_spec(x))
        except Exception:  # the output shape is informative only
            outs = []
        return cls(layer, [x], outs, CallArguments((x,), {}))


class NoGraph:
    """The graph stand-in of sublayer planning: nothing to merge with (no call graph is visible)."""

    def __init__(self, calls=None):
        self.calls = calls if calls is not None else collections.Counter()

    def shared(self, layer):
        return self.calls[id(layer)] > 1

    def next_layer(self, node):
        return None


def build_input_shape(layer):
    """The input shape `layer` was built with (its first call argument's), or None."""
    config = layer.get_build_config() if layer.built else None
    if not config:
        return None
    if "input_shape" in config:
        return config["input_shape"]
    shapes = list(config.get("shapes_dict", {}).values())
    return shapes[0] if shapes else None


def plan_sublayer(layer, path, inference, calls=None):
    """The one-to-one ``replace`` `Plan` of a built `layer` called outside a functional graph, or None.

    The planner registered for its class is run on a `SyntheticNode` of its build
    input shape with a `NoGraph` context, so nothing is merged into it (no folded
    activation, no ConvBNAct): only a swap the replacement honours whatever call the
    enclosing layer makes. The rewrite is labelled `path`. Returns ``(plan, reason)``:
    ``plan`` None and ``reason`` why when it stays.
    """
    if isinstance(layer, keras.Model) or not isinstance(layer, keras.layers.Layer):
        return None, None
    planner = planner_for(type(layer))
    if planner is None:
        return None, None
    shape = build_input_shape(layer)
    if shape is None:
        if not (layer.built and not layer.weights):
            return None, "not built, so its input shape is unknown"
        shape = ()  # built at construction, weightless (Dropout, activations): planned without a shape
    ctx = PlanContext(NoGraph(calls), inference)
    planned = planner(ctx, SyntheticNode.of(layer, shape))
    if planned is None:
        return None, None
    plan_, reason = planned
    if plan_.kind not in ("replace", "retype") or len(plan_.nodes) != 1:
        return None, reason
    plan_.rewrite.source = (path,)
    plan_.rewrite.name = path
    return plan_, None


# ----------------------------------------------------------------------------
# Activations.


def _op_activations():
    """Keras operation classes (what ``keras.ops.relu(x)`` and ``keras.activations.*`` on a
    KerasTensor put in a graph) -> ``fn(op) -> activation name or None``."""
    from keras.src.ops import nn, numpy as knp

    return {
        nn.Relu: lambda op: "relu",
        nn.Relu6: lambda op: "relu6",
        nn.Sigmoid: lambda op: "sigmoid",
        knp.Tanh: lambda op: "tanh",
        nn.Gelu: lambda op: None if getattr(op, "approximate", True) else "gelu",
        nn.Elu: lambda op: "elu" if float(getattr(op, "alpha", 0.0)) == 1.0 else None,
        nn.Silu: lambda op: "silu",
    }


OP_ACTIVATIONS = _op_activations()


def activation_of(layer):
    """The activation name a standalone activation layer (or Keras activation operation, `OP_ACTIVATIONS`)
    computes, or None if it is not one we fold."""
    if type(layer) in OP_ACTIVATIONS:
        return OP_ACTIVATIONS[type(layer)](layer)
    if type(layer) is L.Activation:
        return activation_name(layer)
    if type(layer) is L.ReLU:
        if float(layer.negative_slope or 0) != 0 or float(layer.threshold or 0) != 0:
            return None
        if layer.max_value is None:
            return "relu"
        return "relu6" if float(layer.max_value) == 6.0 else None
    if type(layer) is L.LeakyReLU:
        return "leaky_relu" if abs(float(layer.negative_slope) - LEAKY_RELU_ALPHA) < 1e-12 else None
    if type(layer) is L.ELU:
        return "elu" if float(layer.alpha) == 1.0 else None
    return None


# ----------------------------------------------------------------------------
# Shared planning steps.


def plan_same_weights(ctx, node, stock, keys, overrides=None):
    """`node`'s layer replaced alone by `stock`'s fused class, the weights copied one to one."""
    layer = node.operation
    cls = fused_class(stock)
    reason = configs.unsupported(layer, cls, keys, overrides)
    if reason:
        return keep(node, reason)
    calls = ctx.calls(layer)
    note = f"shared: called {calls} times, converted once" if calls > 1 else ""
    return ctx.replace([node], cls.__name__, lambda: configs.make_layer(cls, layer, keys, **(overrides or {})),
                       lambda new, pairs: weights.copy_identical(layer, new, pairs), note)


def _absorb_activation(ctx, node, allowed):
    """The activation node right after `node` that can fold into it, and its name (or None, None)."""
    nxt = ctx.graph.next_layer(node)
    act = activation_of(nxt.operation) if nxt is not None else None
    if act in allowed:
        return nxt, act
    return None, None


def plan_contraction(ctx, node, stock, keys, acts):
    """A conv / dense layer replaced by `stock`'s fused class, with the activation after it folded in."""
    layer = node.operation
    cls = fused_class(stock)
    reason = configs.unsupported(layer, cls, keys)
    if reason:
        return keep(node, reason)
    shared = ctx.graph.shared(layer)
    act_node, act = (None, None)
    if not shared and activation_name(layer) == "linear":
        act_node, act = _absorb_activation(ctx, node, acts)
    overrides = {"activation": act} if act else {}
    note = f"shared: called {ctx.calls(layer)} times, converted once" if shared else ""
    if act_node:
        note = f"activation {act!r} folded in"
    own = activation_name(layer)
    if own.startswith("custom"):
        note = (note + "; " if note else "") + f"activation {own} is no fused op: applied unfused after the bias"
    return ctx.replace([node] + ([act_node] if act_node else []), cls.__name__,
                       lambda: configs.make_layer(cls, layer, keys, **overrides),
                       lambda new, pairs: weights.copy_identical(layer, new, pairs), note)


# ----------------------------------------------------------------------------
# Wrappers: converted through to their inner layers.


def _inner_plan(ctx, wrapper, inner, what):
    """The one-to-one plan of a wrapper's `inner` layer, or (None, the reason it stays)."""
    plan_, reason = plan_sublayer(inner, ctx.label(f"{wrapper.name}/{inner.name}"), ctx.inference)
    if plan_ is None:
        return None, f"{what} {type(inner).__name__} stays stock" + (f": {reason}" if reason else "")
    return plan_, None


def _wrapper_plan(ctx, node, new_class, make):
    wrapper = node.operation
    calls = ctx.calls(wrapper)
    note = f"shared: called {calls} times, converted once" if calls > 1 else ""
    return ctx.replace([node], new_class, make, lambda new, pairs: weights.copy_identical(wrapper, new, pairs), note)


@register_planner(L.Bidirectional)
def _bidirectional(ctx, node):
    """Bidirectional(LSTM/GRU): both directions replaced by their fused classes, the wrapper kept."""
    w = node.operation
    fwd, why = _inner_plan(ctx, w, w.forward_layer, "forward layer")
    bwd, why_b = _inner_plan(ctx, w, w.backward_layer, "backward layer") if fwd else (None, None)
    if fwd is None or bwd is None:
        return keep(node, f"Bidirectional kept: {why or why_b}")
    inner_class = fwd.rewrite.new_class

    def make():
        f, b = fwd.make(), bwd.make()
        return L.Bidirectional(f, merge_mode=w.merge_mode, backward_layer=b, **configs.common_kwargs(w))

    return _wrapper_plan(ctx, node, f"Bidirectional({inner_class})", make)


@register_planner(L.TimeDistributed)
def _time_distributed(ctx, node):
    """TimeDistributed(layer): the inner layer replaced by its fused class (one-to-one), the wrapper kept."""
    w = node.operation
    inner, why = _inner_plan(ctx, w, w.layer, "inner layer")
    if inner is None:
        return keep(node, f"TimeDistributed kept: {why}")
    return _wrapper_plan(ctx, node, f"TimeDistributed({inner.rewrite.new_class})",
                         lambda: L.TimeDistributed(inner.make(), **configs.common_kwargs(w)))


# ----------------------------------------------------------------------------
# The planners.


@register_planner(L.Dense)
def _dense(ctx, node):
    return plan_contraction(ctx, node, L.Dense, configs.DENSE_KEYS, DENSE_ACTIVATIONS)


@register_planner(L.EinsumDense)
def _einsum_dense(ctx, node):
    """EinsumDense as FusedEinsumDense (same weights, LoRA carried over) where its equation is a matrix product.

    Kept, with FusedEinsumDense's own `unfused_reason`, where it would run
    stock's einsum anyway (an equation that is no reshaped MatMul /
    BatchMatMulV2 at this input rank); quantized layers are kept (their
    variables are the quantized form's).
    """
    layer = node.operation
    cls = fused_class(L.EinsumDense)
    reason = configs.unsupported(layer, cls, configs.EINSUM_DENSE_KEYS)
    if reason:
        return keep(node, reason)
    why = _probe_reason(cls, layer, configs.EINSUM_DENSE_KEYS)
    if why:
        return keep(node, f"{cls.__name__} would run the stock computation: {why}")
    return plan_same_weights(ctx, node, L.EinsumDense, configs.EINSUM_DENSE_KEYS)


@register_planner(L.Conv2D)
def _conv2d(ctx, node):
    if node.operation.groups != 1:  # a grouped conv: the Conv1D/SeparableConv2D/grouped section at the end
        return plan_grouped_conv2d(ctx, node)
    reason = _stock_form_reason(ctx, node, L.Conv2D, configs.CONV_KEYS)
    if reason:
        return keep(node, reason)
    return _plan_conv(ctx, node, L.Conv2D, configs.CONV_KEYS)


@register_planner(L.DepthwiseConv2D)
def _depthwise_conv2d(ctx, node):
    reason = _stock_form_reason(ctx, node, L.DepthwiseConv2D, configs.DEPTHWISE_KEYS)
    if reason:
        return keep(node, reason)
    return _plan_conv(ctx, node, L.DepthwiseConv2D, configs.DEPTHWISE_KEYS)


def _plan_conv(ctx, node, stock, keys):
    """A conv, merged with the batch norm after it when there is one (ConvBNAct, or folded)."""
    layer = node.operation
    cls = fused_class(stock)
    reason = configs.unsupported(layer, cls, keys)
    if reason:
        return keep(node, reason)
    bn_node = None if ctx.graph.shared(layer) or activation_name(layer) != "linear" else ctx.graph.next_layer(node)
    if bn_node is None or not (
        type(bn_node.operation) is L.BatchNormalization
        and configs.bn_reason(bn_node.operation, tuple(node.outputs[0].shape)) is None
    ):
        return plan_contraction(ctx, node, stock, keys, CONV_ACTIVATIONS)
    if ctx.inference:
        return _plan_fold(ctx, node, bn_node, cls, keys)
    if stock is not L.Conv2D:
        return plan_contraction(ctx, node, stock, keys, CONV_ACTIVATIONS)
    why_not = configs.conv_bn_reason(layer, bn_node.operation)
    if why_not:
        plan_, _ = plan_contraction(ctx, node, stock, keys, CONV_ACTIVATIONS)
        plan_.rewrite.note = (plan_.rewrite.note + "; " if plan_.rewrite.note else "") + f"not ConvBNAct: {why_not}"
        return plan_, None
    return _plan_conv_bn(ctx, node, bn_node)


def _plan_conv_bn(ctx, node, bn_node, block=None):
    """Conv -> BatchNormalization (-> activation) as one conv-BN block (training form).

    `block` is the block class (``ConvBNAct`` for a Conv2D, ``ConvBNAct1D``
    for a Conv1D); both take the conv's and the batch norm's arguments.
    """
    block = block or fl.ConvBNAct
    layer, bn = node.operation, bn_node.operation
    act_node, act = _absorb_activation(ctx, bn_node, CONV_ACTIVATIONS)

    def make():
        return block(
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
            **configs.common_kwargs(layer),
        )

    note = "conv bias moved into the moving mean (exact)" if layer.use_bias else ""
    return ctx.replace([node, bn_node] + ([act_node] if act_node else []), block.__name__, make,
                       lambda new, pairs: weights.copy_conv_bn(layer, bn, new, pairs), note)


def _plan_fold(ctx, node, bn_node, cls, keys):
    """Conv -> BatchNormalization (-> activation) as one fused conv with the batch norm folded in."""
    layer, bn = node.operation, bn_node.operation
    act_node, act = _absorb_activation(ctx, bn_node, CONV_ACTIVATIONS)
    overrides = {"use_bias": True}
    note = "batch norm folded into kernel and bias (inference only)"
    if act:
        overrides["activation"] = act
        note += f", activation {act!r} folded in"
    return ctx.replace([node, bn_node] + ([act_node] if act_node else []), cls.__name__,
                       lambda: configs.make_layer(cls, layer, keys, **overrides),
                       lambda new, pairs: weights.copy_folded(layer, bn, new), note)


# The activations FusedBatchNorm(activation=...) applies (those of TfmetalExt>BatchNormAct).
BN_ACTIVATIONS = tuple(a for a in BATCH_NORM_ACT_ACTIVATIONS if a != "linear")


@register_planner(L.BatchNormalization)
def _batch_norm(ctx, node):
    """BatchNormalization as FusedBatchNorm, with the activation layer after it folded in (training form).

    The folded activation lets a training step run batch norm + activation
    as one ``TfmetalExt>BatchNormAct`` where the backend table says so; the
    layer emits FusedBatchNormV3 + the activation op elsewhere, the graph the
    two stock layers would give. ``inference=True`` keeps them apart.
    """
    bn = node.operation
    reason = configs.bn_reason(bn, configs.node_input_shape(node))
    if reason:
        return keep(node, reason)
    act_node, act = (None, None)
    if not ctx.inference and not ctx.graph.shared(bn):
        act_node, act = _absorb_activation(ctx, node, BN_ACTIVATIONS)
    if act_node is None:
        return plan_same_weights(ctx, node, L.BatchNormalization, configs.BN_KEYS)
    cls = fused_class(L.BatchNormalization)
    reason = configs.unsupported(bn, cls, configs.BN_KEYS, {"activation": act})
    if reason:
        return keep(node, reason)
    return ctx.replace([node, act_node], cls.__name__,
                       lambda: configs.make_layer(cls, bn, configs.BN_KEYS, activation=act),
                       lambda new, pairs: weights.copy_identical(bn, new, pairs), f"activation {act!r} folded in")


@register_planner(L.LayerNormalization)
def _layer_norm(ctx, node):
    ln = node.operation
    if not configs.last_axis_only(ln.axis, len(configs.node_input_shape(node))):
        return keep(node, f"axis={ln.axis}: FusedLayerNorm normalizes the last axis only")
    return plan_same_weights(ctx, node, L.LayerNormalization, configs.LN_KEYS, overrides={"axis": -1})


def _probe_reason(cls, layer, keys, overrides=None):
    """Why `cls` made from stock `layer` would not fuse (its ``unfused_reason`` once built as `layer` was), or None.

    The probe is a throwaway instance built with the stock layer's build
    shapes, so reasons that depend on the input ranks are seen too; a weight
    layout that differs from the stock layer's (names or shapes) is a reason
    as well, since the weights could not be copied one to one.
    """
    try:
        probe = configs.make_layer(cls, layer, keys, **(overrides or {}))
        config = layer.get_build_config()
        if config:
            probe.build_from_config(config)
    except (ValueError, TypeError) as e:
        return f"{cls.__name__} could not be built as the stock layer was: {e}"
    mine = [(w.name, tuple(w.shape)) for w in probe.weights]
    theirs = [(w.name, tuple(w.shape)) for w in layer.weights]
    if mine != theirs:
        return f"{cls.__name__}'s weights {mine} differ from the stock layer's {theirs}"
    return getattr(probe, "unfused_reason", None)


def _projections(mha):
    names = ("_query_dense", "_key_dense", "_value_dense", "_output_dense", "_gate_dense")
    return [d for d in (getattr(mha, n, None) for n in names) if d is not None]


@register_planner(L.MultiHeadAttention)
def _multi_head_attention(ctx, node):
    """MultiHeadAttention as FusedMultiHeadAttention (same weights), unless the fused layer would run stock.

    Kept, with the fused layer's own `unfused_reason`, where it would run the
    exact stock computation anyway: rank != 3 inputs, custom attention axes,
    head dims beyond the op's, float64, and (training form only) attention
    ``dropout=1.0`` (rates below 1 run inside the op); also a call with
    ``return_attention_scores=True``, and quantized or LoRA projections.
    """
    if "MultiHeadAttention" not in STOCK_TO_FUSED:  # no fusion-first class yet: the default (kept)
        return None
    layer = node.operation
    cls = fused_class(L.MultiHeadAttention)
    if node.arguments.kwargs.get("return_attention_scores"):
        return keep(node, "called with return_attention_scores=True: FusedMultiHeadAttention would run the "
                          "stock computation (the scores are the matrix the attention op never stores)")
    if any(getattr(d, "quantization_mode", None) for d in _projections(layer)):
        return keep(node, "quantized projections are kept (FusedMultiHeadAttention would run the stock call)")
    if any(getattr(d, "lora_enabled", False) for d in _projections(layer)):
        return keep(node, "LoRA-enabled projections are kept (FusedMultiHeadAttention has no LoRA of its own)")
    overrides = {"flash_attention": getattr(layer, "_flash_attention", None)}
    reason = configs.unsupported(layer, cls, configs.MHA_KEYS, overrides)
    if reason:
        return keep(node, reason)
    # Dropout (rate 1 only) stops only the training form from fusing: the inference form has none.
    probe_overrides = dict(overrides, dropout=0.0) if ctx.inference else overrides
    why = _probe_reason(cls, layer, configs.MHA_KEYS, probe_overrides)
    if why:
        return keep(node, f"{cls.__name__} would run the stock computation: {why}")
    calls = ctx.calls(layer)
    note = f"shared: called {calls} times, converted once" if calls > 1 else ""
    def copy(new, pairs):
        weights.copy_identical(layer, new, pairs)
        # Attention dropout draws from the dropout sublayer's generator: the converted layer's
        # masks continue the stock layer's sequence (the op draws stock's mask).
        mine, theirs = (getattr(getattr(m, "_dropout_layer", None), "seed_generator", None) for m in (new, layer))
        if mine is not None and theirs is not None:
            mine.state.assign(theirs.state.value)

    return ctx.replace([node], cls.__name__, lambda: configs.make_layer(cls, layer, configs.MHA_KEYS, **overrides),
                       copy, note)


@register_planner(L.RMSNormalization)
def _rms_norm(ctx, node):
    """RMSNormalization as FusedRMSNorm (same scale weight) over the last axis; other axes kept."""
    if "RMSNormalization" not in STOCK_TO_FUSED:  # no fusion-first class yet: the default (kept)
        return None
    layer = node.operation
    rank = len(configs.node_input_shape(node))
    if not configs.last_axis_only(layer.axis, rank):
        return keep(node, f"axis={layer.axis}: FusedRMSNorm normalizes the last axis only")
    cls = fused_class(L.RMSNormalization)
    reason = configs.unsupported(layer, cls, configs.RMS_NORM_KEYS)
    if reason:
        return keep(node, reason)
    why = _probe_reason(cls, layer, configs.RMS_NORM_KEYS)
    if why:
        return keep(node, f"{cls.__name__} would run the stock computation: {why}")
    return plan_same_weights(ctx, node, L.RMSNormalization, configs.RMS_NORM_KEYS)


@register_planner(L.Dropout)
def _dropout(ctx, node):
    """Dropout as FusedDropout (same arguments), its seed generator's state carried over: the same masks.

    Kept, with the fused layer's own `config_reason`, where it would run the
    exact stock call on every backend (rate 1, a noise_shape that fixes a
    dimension). Where only this backend's table keeps Keras' call (CPUs), it is
    converted: the layer then runs Keras' call here and the op on a Mac.
    """
    if "Dropout" not in STOCK_TO_FUSED:  # no fusion-first class yet: the default (kept)
        return None
    layer = node.operation
    cls = fused_class(L.Dropout)
    if type(layer) is not L.Dropout:  # SpatialDropout1D/2D/3D: a mask shape of their own, not in the config
        return keep(node, f"{type(layer).__name__} subclasses Dropout with a mask shape of its own; "
                          f"{cls.__name__} replaces Dropout itself only")
    reason = configs.unsupported(layer, cls, configs.DROPOUT_KEYS)
    if reason:
        return keep(node, reason)
    why = configs.make_layer(cls, layer, configs.DROPOUT_KEYS).config_reason  # weightless: no build needed
    if why:
        return keep(node, f"{cls.__name__} would run the stock computation: {why}")
    calls = ctx.calls(layer)
    note = f"shared: called {calls} times, converted once" if calls > 1 else ""

    def copy(new, pairs):  # no weights; the random sequence continues from the stock layer's state
        mine, theirs = getattr(new, "seed_generator", None), getattr(layer, "seed_generator", None)
        if mine is not None and theirs is not None:
            mine.state.assign(theirs.state.value)

    return ctx.replace([node], cls.__name__, lambda: configs.make_layer(cls, layer, configs.DROPOUT_KEYS), copy, note)


def _rnn_stock_only(layer):
    """Why FusedLSTM/FusedGRU would only run the stock form for `layer` (so it is kept), or None."""
    if layer.recurrent_dropout:
        return "recurrent dropout: the fused layer would run the stock form (nothing to gain)"
    if layer.unroll:
        return "unroll=True: the fused layer would run the stock form (nothing to gain)"
    if getattr(layer, "reset_after", True) is False:
        return "reset_after=False: the fused layer would run the stock form (nothing to gain)"
    return None


@register_planner(L.LSTM)
def _lstm(ctx, node):
    reason = _rnn_stock_only(node.operation)
    if reason:
        return keep(node, reason)
    return plan_same_weights(ctx, node, L.LSTM, tuple(k for k in configs.RNN_KEYS if k != "reset_after"))


@register_planner(L.GRU)
def _gru(ctx, node):
    reason = _rnn_stock_only(node.operation)
    if reason:
        return keep(node, reason)
    return plan_same_weights(ctx, node, L.GRU, tuple(k for k in configs.RNN_KEYS if k != "unit_forget_bias"))


@register_planner(L.Activation, L.ReLU, L.LeakyReLU, L.ELU)
def _activation(ctx, node):
    """A standalone activation layer no contraction absorbed: kept, saying why."""
    layer = node.operation
    act = activation_of(layer)
    if act not in DENSE_ACTIVATIONS:
        return keep(node, f"activation {act or type(layer).__name__!r} is never fused into a "
                          "contraction; kept as a separate layer")
    return keep(node, f"activation {act!r}: no fusable layer right before it (or the "
                      "pre-activation tensor has other consumers, or it is a model output)")


@register_planner(fl.ConvBNAct, fl.ConvBNAct1D, fl.ResidualBlock)
def _refold(ctx, node):
    """A ConvBNAct / ConvBNAct1D / ResidualBlock of an already converted model: its own `fold()`."""
    if not ctx.inference:
        return None
    layer = node.operation

    def make():
        new = layer.fold(name=layer.name)
        new.trainable = layer.trainable
        return new

    new_class = {
        fl.ConvBNAct: fused_class(L.Conv2D).__name__,
        fl.ConvBNAct1D: fused_class(L.Conv1D).__name__,
        fl.ResidualBlock: fl.FoldedResidualBlock.__name__,
    }[type(layer)]
    return ctx.replace([node], new_class, make, lambda new, pairs: None,
                       f"{type(layer).__name__}.fold(): batch norm folded into kernel and bias (inference only)")


# ---- Conv1D, SeparableConv2D, grouped Conv2D (planners of tfmetal_ext.layers.conv1d / separable / conv)


def _stock_form_reason(ctx, node, stock, keys):
    """Why `node`'s layer stays: its fused class would run the stock form anyway (that class says why), or None."""
    layer = node.operation
    try:
        probe = configs.make_layer(fused_class(stock), layer, keys)
    except ValueError:
        return None  # plan_contraction reports the fused class's own reason
    reason = probe.fused_path_reason()
    rank = len(configs.node_input_shape(node))
    if reason is None and rank != layer.rank + 2:
        reason = f"input rank {rank}: the fused form takes rank {layer.rank + 2} inputs only"
    return reason and f"{type(probe).__name__} would run the stock form: {reason}"


@register_planner(L.Conv1D)
def _conv1d(ctx, node):
    """Conv1D as FusedConv1D (+ the activation after it), or Conv1D -> BatchNormalization (-> act) as one block.

    Training form: ConvBNAct1D (ExpandDims -> Conv2D -> FusedBatchNormV3 -> act
    -> Squeeze); inference form: a FusedConv1D with the batch norm folded in.
    """
    layer = node.operation
    reason = _stock_form_reason(ctx, node, L.Conv1D, configs.CONV1D_KEYS)
    if reason:
        return keep(node, reason)
    unsupported = configs.unsupported(layer, fused_class(L.Conv1D), configs.CONV1D_KEYS)
    bn_node = None if unsupported or ctx.graph.shared(layer) or activation_name(layer) != "linear" \
        else ctx.graph.next_layer(node)
    bn = bn_node.operation if bn_node is not None else None
    if type(bn) is not L.BatchNormalization or not configs.last_axis_only(bn.axis, 3):
        return plan_contraction(ctx, node, L.Conv1D, configs.CONV1D_KEYS, CONV_ACTIVATIONS)
    if ctx.inference:
        return _plan_fold(ctx, node, bn_node, fused_class(L.Conv1D), configs.CONV1D_KEYS)
    why_not = configs.conv_bn_reason(layer, bn)
    if why_not:
        plan_, _ = plan_contraction(ctx, node, L.Conv1D, configs.CONV1D_KEYS, CONV_ACTIVATIONS)
        plan_.rewrite.note = (plan_.rewrite.note + "; " if plan_.rewrite.note else "") + f"not ConvBNAct1D: {why_not}"
        return plan_, None
    return _plan_conv_bn(ctx, node, bn_node, fl.ConvBNAct1D)




@register_planner(L.SeparableConv2D)
def _separable_conv2d(ctx, node):
    """SeparableConv2D (+ the activation after it) as FusedSeparableConv2D (pointwise conv + bias + act fused)."""
    reason = _stock_form_reason(ctx, node, L.SeparableConv2D, configs.SEPARABLE_KEYS)
    if reason:
        return keep(node, reason)
    return plan_contraction(ctx, node, L.SeparableConv2D, configs.SEPARABLE_KEYS, CONV_ACTIVATIONS)


def plan_grouped_conv2d(ctx, node):
    """A grouped Conv2D with one input channel per group, as a FusedDepthwiseConv2D; other groupings kept.

    With ``groups == in_channels`` and ``filters = in_channels * m``, output
    channel ``c * m + j`` reads input channel ``c`` only: a depthwise conv with
    ``depth_multiplier=m`` whose kernel is the grouped kernel reshaped,
    ``(kh, kw, 1, C * m) -> (kh, kw, C, m)`` (exact). Keras runs the grouped
    form through an XLA-compiled function, which grappler never sees.
    """
    layer = node.operation
    shape = configs.node_input_shape(node)
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return keep(node, configs.unsupported(layer, fl.FusedDepthwiseConv2D, ()))
    why = (
        "data_format='channels_first': FusedDepthwiseConv2D is NHWC" if layer.data_format != "channels_last"
        else configs.grouped_as_depthwise_reason(layer, shape[-1] if len(shape) == 4 else None)
    )
    if why:
        return keep(node, why)
    config = layer.get_config()
    kwargs = {dw: config[k] for k, dw in configs.GROUPED_AS_DEPTHWISE_KEYS.items()}
    if layer.activity_regularizer is not None:
        kwargs["activity_regularizer"] = keras.regularizers.serialize(layer.activity_regularizer)
    multiplier = layer.filters // layer.groups
    shared = ctx.graph.shared(layer)
    act_node, act = (None, None)
    if not shared and activation_name(layer) == "linear":
        act_node, act = _absorb_activation(ctx, node, CONV_ACTIVATIONS)
    if act:
        kwargs["activation"] = act

    def make():
        return fl.FusedDepthwiseConv2D(depth_multiplier=multiplier, **kwargs, **configs.common_kwargs(layer))

    def copy(new, pairs):
        kernel = weights.to_numpy(layer.kernel)
        new.kernel.assign(kernel.reshape(new.kernel.shape))
        if layer.use_bias:
            new.bias.assign(layer.bias.value)
            pairs.append((layer.bias, new.bias))  # the kernels' gradients differ in layout only

    note = f"groups={layer.groups} == input channels: a depthwise conv (depth_multiplier={multiplier}), kernel reshaped"
    if act_node:
        note += f"; activation {act!r} folded in"
    elif shared:
        note += f"; shared: called {ctx.calls(layer)} times, converted once"
    return ctx.replace([node] + ([act_node] if act_node else []), fl.FusedDepthwiseConv2D.__name__, make, copy, note)


@register_planner(L.Embedding)
def _embedding(ctx, node):
    """Embedding as FusedEmbedding (same weights, LoRA ones included); quantized ones and Keras' own
    subclasses (a reversible output head, whose other calls differ) are kept."""
    layer = node.operation
    if "Embedding" not in STOCK_TO_FUSED:  # no fusion-first class: the default (kept)
        return None
    if type(layer) is not L.Embedding:
        return keep(node, f"{type(layer).__name__} subclasses Embedding with calls of its own; "
                          f"{fused_class(L.Embedding).__name__} replaces Embedding itself only")
    return plan_same_weights(ctx, node, L.Embedding, configs.EMBEDDING_KEYS)
