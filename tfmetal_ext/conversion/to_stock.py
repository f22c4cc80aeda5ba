"""`to_stock()`: a model built from tfmetal_ext's layers (or converted) as the same model of stock Keras layers.

The inverse of `convert`. The graph walk, the copies of kept and subclassed layers and the
verification are `convert`'s own (`rebuild.Converter`, `copying`, `verify`), run with the planning of
this module (`STOCK`): each tfmetal_ext class goes back to

- its stock class, one to one, where `STOCK_TO_FUSED` names one (read in reverse,
  `planners.stock_class`): the same config where the stock class takes it, the same weights;
- a group of stock layers, where it merged several (`EXPANDERS`, keyed by the tfmetal_ext class:
  `ConvBNAct` -> conv + BatchNormalization + Activation, `ResidualBlock` -> its layers, an Add
  and an Activation), expanded into the graph (inside a subclassed layer, where its call is
  the subclass's own, as one nested Functional model);
- the keras-hub class a retype subclass (``fused_name``) extends;

and a fused optimizer to its Keras class with its state. A layer that `convert` made records the
stock layers it replaced (`provenance`): those come back under their own names and configs.
"""

from __future__ import annotations

import dataclasses
import inspect

import keras
import numpy as np

from tfmetal_ext import layers as fl
from tfmetal_ext.conversion import copying, pipeline, planners, provenance, weights
from tfmetal_ext.conversion.rebuild import Converter
from tfmetal_ext.conversion.report import ConversionReport, Kept, Rewrite
from tfmetal_ext.conversion.verify import make_inputs

L = keras.layers

STOCK_NOTE = "to_stock: every tfmetal_ext layer replaced by stock Keras layers"


# ----------------------------------------------------------------------------
# Expansions: one tfmetal_ext layer as several stock layers.


@dataclasses.dataclass
class Expansion:
    """The stock layers one tfmetal_ext layer becomes, and how they are called and filled.

    Attributes:
        name: the tfmetal_ext layer's name.
        layers: the new stock layers (and Keras operations), in call order.
        chain: each of `layers` is called on the output of the one before (a Sequential can hold them).
        forward: ``forward(x, training) -> y``, calling `layers`.
        fill: ``fill(pairs)``: the weights into the built `layers` (trainable ``(old, new)`` pairs appended).
    """

    name: str
    layers: list
    chain: bool
    forward: object
    fill: object

    def __call__(self, inputs, training=None, **kwargs):
        return self.forward(inputs, training)

    def as_model(self, input_shape):
        """The expansion as one Functional model named after the layer (for a subclass's sublayer)."""
        x = keras.Input(batch_shape=tuple(input_shape))
        return keras.Model(x, self(x), name=self.name)


def _call(layer, x, training):
    if isinstance(layer, keras.layers.Layer) and training is not None:
        return layer(x, training=training)
    return layer(x)


def chain(name, new_layers, fill, call_kwargs=None):
    """An `Expansion` calling `new_layers` one after the other (with `call_kwargs`, one dict per layer,
    the keyword arguments each stock layer was called with, where known)."""

    def forward(x, training):
        for i, layer in enumerate(new_layers):
            x = layer(x, **call_kwargs[i]) if call_kwargs is not None else _call(layer, x, training)
        return x

    return Expansion(name, list(new_layers), all(isinstance(x, keras.layers.Layer) for x in new_layers),
                     forward, fill)


EXPANDERS = {}  # tfmetal_ext class -> fn(layer, source) -> Expansion, or None: the one-to-one path


def register_expander(*classes):
    """Decorator: registers ``fn(layer, source) -> Expansion`` (or None: not an expansion after all)
    for tfmetal_ext layers of `classes`.

    `source` is the layer's `provenance.Source` (None when it has none). Like
    `planners.register_planner`, one expander per class.

    Raises:
        ValueError: if one of `classes` already has an expander.
    """

    def register(fn):
        for cls in classes:
            if cls in EXPANDERS:
                raise ValueError(f"{cls.__name__} already has an expander ({EXPANDERS[cls].__name__}). "
                                 f"Received: classes={classes!r}")
        for cls in classes:
            EXPANDERS[cls] = fn
        return fn

    return register


def _common(layer, name=None):
    return {"name": name or layer.name, "dtype": layer.dtype_policy, "trainable": layer.trainable}


def _from_source(source, layer):
    """The stock layers (and operations) of `source`, re-made from their configs; the flag the layer has now."""
    made = []
    for cls, config in source.layers:
        new = cls.from_config(dict(config))
        if isinstance(new, keras.layers.Layer) and new.trainable != layer.trainable:
            new.trainable = layer.trainable
        made.append(new)
    return made


def _assign(dst, value, pairs=None, src=None):
    """`dst` set to `value` (reshaped where only the layout differs); the pair recorded when trainable
    (not for a reshaped one: its gradients differ in layout only)."""
    value = np.asarray(keras.ops.convert_to_numpy(value))
    dst.assign(value.reshape(tuple(dst.shape)))
    if pairs is not None and src is not None and src.trainable and dst.trainable \
            and tuple(src.shape) == tuple(dst.shape):
        pairs.append((src, dst))


@register_expander(fl.ConvBNAct, fl.ConvBNAct1D)
def _conv_bn_act(layer, source, name=None):
    """ConvBNAct(1D) -> Conv2D/Conv1D + BatchNormalization (+ Activation).

    With a `source` (convert made it), the recorded conv, batch norm and activation layer under
    their names and configs; the conv bias convert moved into the moving mean comes back: the
    recorded bias, the moving mean plus that bias (in float64, then float32: equal to the original
    within float rounding; the function is the same, as batch norm subtracts the mean). Without
    one: ``<name>`` (bias-free conv), ``<name>_bn``, ``<name>_act`` (unless linear).
    """
    name = name or layer.name
    if source is not None and len(source.layers) >= 2:
        made = _from_source(source, layer)
        conv, bn = made[0], made[1]
        bias = source.head_bias
    else:
        one_d = isinstance(layer, fl.ConvBNAct1D)
        cls = L.Conv1D if one_d else L.Conv2D
        ser = keras.saving.serialize_keras_object
        conv = cls(layer.filters, layer.kernel_size, strides=layer.strides, padding=layer.padding, use_bias=False,
                   kernel_initializer=ser(layer.kernel_initializer), kernel_regularizer=ser(layer.kernel_regularizer),
                   kernel_constraint=ser(layer.kernel_constraint), **_common(layer, name))
        bn = L.BatchNormalization(
            axis=-1, momentum=layer.momentum, epsilon=layer.epsilon,
            gamma_initializer=ser(layer.gamma_initializer), beta_initializer=ser(layer.beta_initializer),
            moving_mean_initializer=ser(layer.moving_mean_initializer),
            moving_variance_initializer=ser(layer.moving_variance_initializer),
            gamma_regularizer=ser(layer.gamma_regularizer), beta_regularizer=ser(layer.beta_regularizer),
            **_common(layer, f"{name}_bn"))
        made = [conv, bn]
        if layer.activation != "linear":
            made.append(L.Activation(layer.activation, **_common(layer, f"{name}_act")))
        bias = None
    kwargs = source.call_kwargs if source is not None and len(source.layers) >= 2 else None

    def fill(pairs):
        _assign(conv.kernel, layer.kernel.value, pairs, layer.kernel)
        mean = keras.ops.convert_to_numpy(layer.moving_mean).astype("float64")
        if conv.use_bias:
            b = np.zeros(tuple(conv.bias.shape), "float64") if bias is None else np.asarray(bias, "float64")
            _assign(conv.bias, b.astype(conv.bias.dtype))
            mean = mean + b  # convert stored moving_mean - bias: the same function, the original split back
        for mine, theirs in ((bn.gamma, layer.gamma), (bn.beta, layer.beta)):
            _assign(mine, theirs.value, pairs, theirs)
        _assign(bn.moving_mean, mean.astype("float32"))
        _assign(bn.moving_variance, layer.moving_variance.value)

    return chain(name, made, fill, kwargs)


def _residual(layer, conv_expansion, name):
    """A residual block's stock layers: each conv's, the projection's, an Add and the Activation."""
    convs = [conv_expansion(c, f"{name}_{c.name}") for c in layer.convs]
    projection = conv_expansion(layer.projection, f"{name}_projection") if layer.projection is not None else None
    add = L.Add(**_common(layer, f"{name}_add"))
    act = L.Activation(layer.activation, **_common(layer, f"{name}_act"))
    parts = convs + ([projection] if projection is not None else [])

    def forward(x, training):
        y = x
        for c in convs:
            y = c(y, training)
        shortcut = x if projection is None else projection(x, training)
        return act(add([y, shortcut]))

    def fill(pairs):
        for p in parts:
            p.fill(pairs)

    made = [m for p in parts for m in p.layers] + [add, act]
    return Expansion(name, made, False, forward, fill)


@register_expander(fl.ResidualBlock)
def _residual_block(layer, source, name=None):
    """ResidualBlock -> per conv ``<block>_convN`` + ``_bn`` (+ ``_act``), the projection's, ``<block>_add``,
    ``<block>_act`` (the block's own layers under ``<block>_`` names; the weights the same)."""
    return _residual(layer, lambda c, n: _conv_bn_act(c, None, n), name or layer.name)


@register_expander(fl.FoldedResidualBlock)
def _folded_residual_block(layer, source, name=None):
    """FoldedResidualBlock -> per conv a Conv2D with bias ``<block>_convN``, ``<block>_add``, ``<block>_act``."""

    def one(conv, n):
        new = stock_layer(conv, None, name=n)
        return chain(n, [new], lambda pairs: weights.copy_identical(conv, new, pairs))

    return _residual(layer, one, name or layer.name)


@register_expander(fl.Softshrink)
def _softshrink(layer, source, name=None):
    """Softshrink -> ``Activation("soft_shrink")`` (threshold 0.5), else Keras' ``ops.soft_shrink`` in the graph."""
    name = name or layer.name
    if float(layer.lambd) == 0.5:
        return chain(name, [L.Activation("soft_shrink", **_common(layer, name))], lambda pairs: None)
    from keras.src.ops.nn import SoftShrink

    return chain(name, [SoftShrink(threshold=float(layer.lambd))], lambda pairs: None)


@register_expander(fl.FusedBatchNorm)
def _fused_batch_norm(layer, source, name=None):
    """FusedBatchNorm with an activation (made by hand) -> BatchNormalization ``<name>`` + Activation ``<name>_act``.

    None otherwise: without an activation it is one BatchNormalization, and one
    convert made from a BatchNormalization and an activation layer gets those
    recorded layers back.
    """
    if layer.activation == "linear" or (source is not None and len(source.layers) > 1):
        return None
    name = name or layer.name
    bn = stock_layer(layer, None, name=name)
    act = L.Activation(layer.activation, **_common(layer, f"{name}_act"))
    return chain(name, [bn, act], lambda pairs: _fill_one(layer, bn, pairs))


def _with_source(layer, source):
    """A layer convert merged with the layers after it (a folded activation layer): those layers again."""
    made = _from_source(source, layer)

    def fill(pairs):
        _fill_one(layer, made[0], pairs)

    return chain(layer.name, made, fill, source.call_kwargs)


def expansion_of(layer):
    """The `Expansion` of tfmetal_ext `layer` when it becomes several stock layers (or an operation), else None."""
    source = provenance.of(layer)
    fn = EXPANDERS.get(type(layer))
    expansion = fn(layer, source) if fn is not None else None
    if expansion is not None:
        return expansion
    if source is not None and len(source.layers) > 1 and _recorded_stock(source):
        return _with_source(layer, source)
    return None


def _recorded_stock(source):
    """The stock Keras class of `source`'s head (the layer convert replaced), or None."""
    cls = source.layers[0][0] if source is not None else None
    return cls if cls is not None and cls.__module__.startswith("keras.") else None


def stock_class_of(layer):
    """The stock class tfmetal_ext `layer` becomes one to one: the recorded one (a grouped Conv2D that
    convert made a depthwise conv), else `planners.stock_class`; None when it has none."""
    source = provenance.of(layer)
    if source is not None and len(source.layers) == 1 and _recorded_stock(source):
        return source.layers[0][0]
    return planners.stock_class(type(layer))


# ----------------------------------------------------------------------------
# One to one.


def _base_keys():
    return set(keras.layers.Layer(name="probe").get_config())


def stock_layer(layer, source=None, name=None):
    """The unbuilt stock layer tfmetal_ext `layer` stands for (`planners.stock_class`), same config.

    With a one-layer `source`, its recorded class and config (the stock layer convert replaced,
    whose weights are this layer's, reshaped where convert changed the layout); else the layer's
    config restricted to what the stock constructor takes.

    Raises:
        ValueError: `layer`'s class has no stock counterpart, or its config does not make one
            (the message says which).
    """
    cls = planners.stock_class(type(layer)) if source is None else stock_class_of(layer)
    if cls is None:
        raise ValueError(f"{type(layer).__name__} has no stock Keras counterpart. Received: layer={layer.name!r}")
    if source is not None and len(source.layers) == 1 and source.layers[0][0] is cls:
        config = dict(source.layers[0][1])
        config.update(name=name or layer.name, trainable=layer.trainable)
    else:
        accepted = set(inspect.signature(cls.__init__).parameters) | _base_keys()
        config = {k: v for k, v in layer.get_config().items() if k in accepted}
        config["name"] = name or layer.name
    policy = layer.dtype_policy
    if _dequantize(layer, cls):
        policy = keras.dtype_policies.get(policy.name.split("_from_", 1)[1])
        config["dtype"] = keras.saving.serialize_keras_object(policy)
        config.pop("quantization_config", None)
    try:
        new = cls.from_config(config)
    except Exception as e:
        raise ValueError(f"{layer.name!r} ({type(layer).__name__}) has no stock {cls.__name__} form: its config "
                         f"does not make one ({type(e).__name__}: {e}). Received: layer={layer.name!r}") from e
    if new.dtype_policy.name != policy.name:
        new.dtype_policy = policy
    return new


def _dequantize(layer, cls):
    """True for an int8 `layer` whose stock class has no int8 form of its own (Keras' Conv2D and
    DepthwiseConv2D have no ``quantize``): the stock layer is float, its kernel de-quantized."""
    return getattr(layer, "quantization_mode", None) == "int8" and getattr(cls, "quantize", None) in (
        None, keras.layers.Layer.quantize)


def _dequantized_kernel(layer):
    """``q / kernel_scale`` per output channel (the last axis; a depthwise kernel's last two), float32:
    what the int8 ops' reference computes with (Cast, RealDiv)."""
    q = np.asarray(keras.ops.convert_to_numpy(layer._kernel)).astype("float32")
    scale = np.asarray(keras.ops.convert_to_numpy(layer.kernel_scale)).astype("float32")
    return (q.reshape(-1, scale.size) / scale).reshape(q.shape)


def _fill_one(layer, new, pairs):
    """`layer`'s weights into its stock `new` (built): one to one by order, bitwise (a grouped conv's
    depthwise kernel reshaped back); a dropout's or attention's seed state carried over."""
    if _dequantize(layer, type(new)):
        _assign(new.kernel, _dequantized_kernel(layer).reshape(tuple(new.kernel.shape)))
        if getattr(layer, "use_bias", False):
            _assign(new.bias, layer.bias.value, pairs, layer.bias)
        return
    old_w, new_w = layer.weights, new.weights
    if len(old_w) != len(new_w) or any(int(np.prod(a.shape)) != int(np.prod(b.shape)) for a, b in zip(old_w, new_w)):
        raise RuntimeError(f"weight layouts differ: {layer.name} has {[(w.name, tuple(w.shape)) for w in old_w]}, "
                           f"stock {new.name} has {[(w.name, tuple(w.shape)) for w in new_w]}")
    for a, b in zip(old_w, new_w):
        if b.trainable != a.trainable:
            b.trainable = a.trainable
        _assign(b, a.value, pairs, a)
    for holder in (lambda m: m, lambda m: getattr(m, "_dropout_layer", None)):
        mine, theirs = (getattr(holder(m), "seed_generator", None) for m in (new, layer))
        if mine is not None and theirs is not None:
            mine.state.assign(theirs.state.value)


# ----------------------------------------------------------------------------
# The planning `Converter` runs with.


def _retype_base(layer):
    cls = type(layer)
    return cls.__mro__[1] if copying.is_ours(layer) and hasattr(cls, "fused_name") else None


def _retype_rewrite(layer, label):
    base = _retype_base(layer)
    return Rewrite((label,), label, base.__name__, f"{type(layer).fused_name} -> {base.__module__}.{base.__name__}")


class _StockPlanning:
    """`Converter`'s planning for `to_stock`: what replaces each call and each sublayer."""

    @staticmethod
    def plan(ctx, node):
        layer = node.operation
        if isinstance(layer, keras.Model) or not isinstance(layer, keras.layers.Layer):
            return planners.plan(ctx, node)  # a nested model (walked) or a Keras operation (kept)
        label = ctx.label(layer.name)
        if type(layer) in (L.Bidirectional, L.TimeDistributed):
            return _wrapper(ctx, node)
        if not copying.is_ours(layer):
            return planners.keep(node, "no tfmetal_ext class: copied unchanged" + (
                "" if copying._is_stock(layer) else " (a subclass: its tfmetal_ext sublayers swapped)"))
        expansion = expansion_of(layer)
        if expansion is not None:
            what = " + ".join(type(x).__name__ for x in expansion.layers)
            rw = Rewrite((label,), label, what, "as " + ", ".join(getattr(x, "name", "?") for x in expansion.layers))
            return planners.Plan("expand", [node], make=lambda: expansion,
                                 copy=lambda new, pairs: new.fill(pairs), rewrite=rw, layer_key=id(layer)), None
        cls = stock_class_of(layer)
        if cls is not None:
            source = provenance.of(layer)
            return ctx.replace([node], cls.__name__, lambda: stock_layer(layer, source),
                               lambda new, pairs: _fill_one(layer, new, pairs))
        base = _retype_base(layer)
        if base is not None:
            return planners.Plan("retype", [node], make=base, rewrite=_retype_rewrite(layer, label),
                                 layer_key=id(layer)), None
        return planners.keep(node, f"tfmetal_ext class {type(layer).__name__} has no stock counterpart: kept")

    @staticmethod
    def plan_sublayer(layer, path, inference, calls=None):
        if isinstance(layer, keras.Model) or not isinstance(layer, keras.layers.Layer) or not copying.is_ours(layer):
            return None, None
        base = _retype_base(layer)
        if base is not None:
            return planners.Plan("retype", [], make=base, rewrite=_retype_rewrite(layer, path)), None
        expansion = expansion_of(layer)
        if expansion is not None:
            shape = planners.build_input_shape(layer)
            if shape is None:
                return None, "not built, so its input shape is unknown"
            rw = Rewrite((path,), path, "Functional",
                         "as a nested model of " + " + ".join(type(x).__name__ for x in expansion.layers))
            return planners.Plan("replace", [], make=lambda: expansion.as_model(shape),
                                 copy=lambda new, pairs: expansion.fill(pairs), rewrite=rw), None
        cls = stock_class_of(layer)
        if cls is None:
            return None, f"tfmetal_ext class {type(layer).__name__} has no stock counterpart: kept"
        rw = Rewrite((path,), path, cls.__name__)
        return planners.Plan("replace", [], make=lambda: stock_layer(layer, provenance.of(layer)),
                             copy=lambda new, pairs: _fill_one(layer, new, pairs), rewrite=rw), None


STOCK = _StockPlanning()


def _wrapper(ctx, node):
    """Bidirectional / TimeDistributed of tfmetal_ext layers: the same wrapper of their stock classes."""
    w = node.operation
    inner = [w.forward_layer, w.backward_layer] if isinstance(w, L.Bidirectional) else [w.layer]
    if not any(copying.is_ours(x) for x in inner):
        return planners.keep(node, "no tfmetal_ext class: copied unchanged")

    def make():
        made = [stock_layer(x) if copying.is_ours(x) else copying.construct(x, x.name) for x in inner]
        if isinstance(w, L.Bidirectional):
            return L.Bidirectional(made[0], merge_mode=w.merge_mode, backward_layer=made[1], **_common(w))
        return L.TimeDistributed(made[0], **_common(w))

    def copy(new, pairs):
        weights.copy_identical(w, new, pairs)

    inner_names = ", ".join((planners.stock_class(type(x)) or type(x)).__name__ for x in inner)
    return ctx.replace([node], f"{type(w).__name__}({inner_names})", make, copy)


# ----------------------------------------------------------------------------
# Optimizers.


def stock_optimizer(optimizer):
    """``(stock optimizer or None, fused class name)``: a fused optimizer (`OPTIMIZER_TO_FUSED` read in
    reverse; inside a LossScaleOptimizer too) as its Keras class made from the same config, unbuilt."""
    from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED

    wrapper = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    inner = wrapper.inner_optimizer if wrapper is not None else optimizer
    row = next((r for r in OPTIMIZER_TO_FUSED.values()
                if type(inner).__name__ == r.fused and type(inner).__module__.startswith(r.module)), None)
    if row is None:
        return None, None
    cls = getattr(keras.optimizers, row.stock)
    accepted = set(cls().get_config())
    new = cls.from_config({k: v for k, v in inner.get_config().items() if k in accepted})
    if wrapper is not None:
        outer = wrapper.get_config()
        outer.pop("inner_optimizer", None)
        new = type(wrapper).from_config({**outer, "inner_optimizer": keras.saving.serialize_keras_object(new)})
    return new, row.fused


def _slot_lists(opt):
    """Attribute name -> list of per-variable slot variables of a built Keras optimizer."""
    n = len(getattr(opt, "_trainable_variables", ()))
    return {k: v for k, v in vars(opt).items()
            if n and isinstance(v, (list, tuple)) and len(v) == n and all(isinstance(x, keras.Variable) for x in v)
            and not k.startswith("_trainable_variables")}


def carry_optimizer_state(old, new, variables, pairs):
    """`old`'s state (iterations, slots) into `new`, built on `variables`; slots matched through `pairs`
    (``(old variable, new variable)``); a new variable with no old one (a restored conv bias) starts at zero."""
    for o, n in ((old, new),) + (((old.inner_optimizer, new.inner_optimizer),)
                                 if isinstance(old, keras.optimizers.LossScaleOptimizer) else ()):
        if not o.built:
            continue
        if not n.built:
            n.build(variables)
        index = {id(b): n._get_variable_index(b) for _, b in pairs if n._var_key(b) in n._trainable_variables_indices}
        mine, theirs = _slot_lists(n), _slot_lists(o)
        for i, v in enumerate(o._trainable_variables):
            b = next((b for a, b in pairs if a is v), None)
            if b is None or id(b) not in index:
                continue
            for attr, slots in theirs.items():
                if attr in mine:
                    mine[attr][index[id(b)]].assign(slots[i].value)
        n.iterations.assign(o.iterations.value)
        for attr in ("_loss_scale", "dynamic_scale", "step_counter"):
            a, b = getattr(o, attr, None), getattr(n, attr, None)
            if isinstance(a, keras.Variable) and isinstance(b, keras.Variable):
                b.assign(a.value)


def _compile_stock(model, new, conv, report):
    """A compiled `model`'s compile config on `new`: a fused optimizer as its Keras class with its state, a
    fused loss as its Keras class (`pipeline.mapped_losses`)."""
    if not getattr(model, "compiled", False):
        return
    config = model.get_compile_config()
    opt = getattr(model, "optimizer", None)
    stock, fused = stock_optimizer(opt) if isinstance(opt, keras.optimizers.Optimizer) else (None, None)
    if stock is not None:
        config = {**config, "optimizer": keras.saving.serialize_keras_object(stock)}
    if config.get("loss") is not None:
        config = {**config, "loss": pipeline.mapped_losses(config["loss"], False, report.notes)}
    try:
        pipeline._compile_from_config(new, config)
    except Exception as e:  # custom losses / metrics may not deserialize
        report.notes.append(f"not compiled: the compile config could not be applied ({e})")
        return
    if stock is not None:
        report.optimizer = (fused, type(stock.inner_optimizer if hasattr(stock, "inner_optimizer") else stock).__name__)
    if isinstance(opt, keras.optimizers.Optimizer) and isinstance(new.optimizer, keras.optimizers.Optimizer):
        carry_optimizer_state(opt, new.optimizer, new.trainable_variables, conv.pairs)
        report.notes.append(f"compiled with the source model's compile config; optimizer "
                            f"{type(new.optimizer).__name__} with its state (iterations "
                            f"{int(keras.ops.convert_to_numpy(new.optimizer.iterations))}, slots)")


# ----------------------------------------------------------------------------
# to_stock.


def to_stock(model, verify=True, *, inputs=None, batch_size=2, seed=0, tolerance=None):
    """Returns the same model built from stock Keras layers: no tfmetal_ext class left in it.

    The inverse of `tfmetal_ext.convert`, for models trained with tfmetal_ext's layers (a ``.keras``
    file of the result loads where tfmetal_ext is not installed). Walks the graph of a Functional
    or Sequential model (nested ones too; a subclassed model or layer is copied and its tracked
    tfmetal_ext sublayers swapped one to one) and replaces:

    | tfmetal_ext | becomes |
    |---|---|
    | a `STOCK_TO_FUSED` class (`FusedDense`, `FusedConv2D`, `FusedLayerNorm`, `FusedLSTM`, `FusedMultiHeadAttention`, `FusedDropout`, ...) | its stock class, same config and weights (bitwise), int8 layers as Keras' own int8 layers (dtype policy ``int8_from_float32``, int8 kernel + ``kernel_scale``) |
    | `ConvBNAct` / `ConvBNAct1D` | Conv2D / Conv1D + BatchNormalization (+ Activation): three graph layers |
    | `ResidualBlock` / `FoldedResidualBlock` | its convs' stock layers, an Add and an Activation, in the graph |
    | `Softshrink` | ``Activation("soft_shrink")`` (threshold 0.5), else Keras' ``ops.soft_shrink`` |
    | a keras-hub retype subclass (``fused_name``) | the keras-hub class it extends |
    | a fused optimizer (`OPTIMIZER_TO_FUSED`) | its Keras class with the same config and state (iterations, slots) |
    | anything else | an independent copy (same config and state) |

    A layer `convert` made (training form) comes back as the stock layers it replaced, under their
    names and configs (`provenance`): ``to_stock(convert(m))`` has `m`'s config. The one mapping
    that is not an identity: a conv bias `convert` moved into a `ConvBNAct`'s moving mean comes
    back as the recorded bias and the moving mean plus it, equal to the original weights within
    float rounding (the function is the same: batch norm subtracts the mean). Without a record (a
    model built from tfmetal_ext's layers, or loaded from a file) the stock layers of a merged layer
    are named ``<name>`` (the conv), ``<name>_bn``, ``<name>_act``; a residual block's
    ``<block>_conv1``, ..., ``<block>_projection``, ``<block>_add``, ``<block>_act``. Inside a
    subclassed layer (whose call is its own) a merged layer becomes one nested Functional model of
    those layers. A Sequential stays a Sequential unless a residual block is expanded in it
    (then Functional). Layer names, trainable flags and dtype policies are kept; the result never
    shares a variable with `model`. A compiled model's compile config is applied to the result.

    Args:
        model: a built `keras.Model` (functional, `keras.Sequential`, or subclassed: built or with
            ``inputs=``).
        verify: compare outputs (inference mode) and one training step's gradients with `model`'s
            on random inputs (`tfmetal_ext.conversion.verify`, convert's check); raises
            `VerificationError` on a mismatch.
        inputs: verification data (a batch, as `model` takes it) instead of random inputs.
        batch_size: batch size of the random inputs.
        seed: seed of the random inputs.
        tolerance: relative tolerance of the output comparison (gradients: 20x), instead of the
            per-dtype defaults.

    Returns:
        The stock `keras.Model` (a `keras.Sequential` for a Sequential input); its
        `conversion_report` attribute is a `ConversionReport` whose rewrites list each tfmetal_ext
        layer and the stock class(es) it became (``report.optimizer``: ``(fused, stock)`` names).

    Raises:
        ValueError: if `model` is not a built `keras.Model` (``... Received: model=...``), or a
            layer cannot be copied or has no stock form (the message names it).
        VerificationError: when verify finds outputs or gradients that differ beyond tolerance.

    Example:

    >>> model = keras.Sequential([keras.Input((8, 8, 3)), tfmetal_ext.layers.ConvBNAct(4, 3), keras.layers.Flatten()])
    >>> stock = tfmetal_ext.to_stock(model)
    >>> [type(l).__name__ for l in stock.layers]
    ['Conv2D', 'BatchNormalization', 'Activation', 'Flatten']
    """
    opts = pipeline.ConvertOptions.from_args(model, False, verify, None, False, batch_size, tolerance, seed, inputs,
                                             False)
    if opts.subclassed and not model.built:
        model(inputs, training=False)
    report = ConversionReport(model=model.name)
    conv = Converter(False, report, planning=STOCK)
    if opts.subclassed:
        new, kind, swaps = conv.copy_deep(model, model.name)
        report.kept.append(Kept(model.name, type(model).__name__, "subclassed model: its call is its own; "
                                f"{len(swaps)} sublayer(s) swapped for stock ones"))
        x = make_inputs(model, batch_size, seed, inputs)
        new(keras.tree.map_structure(lambda v: np.asarray(v)[:1], x), training=False)
        copying.transfer_state(model, new, conv.pairs, swaps, model.name)
    else:
        new = conv.convert_model(model)
    left = sorted({type(x).__name__ for x in new._flatten_layers(include_self=True, recursive=True) if copying.is_ours(x)})
    report.notes.append(STOCK_NOTE if not left else
                        f"to_stock: tfmetal_ext classes with no stock form are left ({', '.join(left)}): "
                        "the result still needs tfmetal_ext")
    _compile_stock(model, new, conv, report)
    if opts.verify:
        pipeline.check(model, new, conv, report, opts, None)
    object.__setattr__(new, "conversion_report", report)
    return new


to_stock.__module__ = "tfmetal_ext.conversion"  # its documented home, which re-exports it
