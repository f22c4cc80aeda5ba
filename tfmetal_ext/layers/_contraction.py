"""Shared pieces of the contraction layers (conv, depthwise conv, dense).

Argument validation with Keras-style messages, and activation handling:
which activations are emitted as the single TF op the remapper fuses, and
how they are written to and read from a layer config.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers._ops import FUSABLE_ACTIVATIONS
from tfmetal_ext.ops._common import gelu_exact

# Activations the layers emit as one TF op, so a remapper pattern can absorb
# them. `linear` emits nothing.
_SINGLE_OP_ACTIVATIONS = {
    **FUSABLE_ACTIVATIONS,
    "tanh": tf.nn.tanh,
    # keras.activations.sigmoid tags the output with its logits (losses use that).
    "sigmoid": keras.activations.sigmoid,
    "gelu": gelu_exact,
}

GELU_APPROXIMATE = "gelu_approximate"


def gelu_approximate(x):
    """GELU with the tanh approximation (``keras.activations.gelu(x, approximate=True)``)."""
    return tf.nn.gelu(x, approximate=True)


def resolve_activation(activation, allow_gelu_approximate=False):
    """Returns ``(callable, name)`` for an activation argument.

    `name` is the Keras name of a built-in activation (``"relu"``,
    ``"linear"``, ...), ``"gelu_approximate"``, or None for anything else
    (applied as given).

    Raises:
        ValueError: if `activation` is not a Keras activation identifier.
    """
    if allow_gelu_approximate and activation == GELU_APPROXIMATE:
        return gelu_approximate, GELU_APPROXIMATE
    try:
        fn = keras.activations.get(activation)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`activation` must be a Keras activation name, config or callable. "
            f"Received: activation={activation!r}"
        ) from e
    # A Keras activation only: a TF function (tf.nn.sigmoid, ...) is applied as given, since the
    # single-op form of its name may differ (keras.activations.sigmoid tags its logits).
    return fn, fusion.activation_name(fn, sources=(fusion.KERAS,))


def serialize_activation(fn, name):
    """The config value of an activation resolved by `resolve_activation`."""
    if name == GELU_APPROXIMATE:
        return GELU_APPROXIMATE
    return keras.activations.serialize(fn)


def apply_activation(x, fn, name, training=None):
    """Applies an activation right after the BiasAdd, as one TF op when possible.

    In a training call (`training` true), an activation of `fusion.RECOMPUTED_ACTIVATIONS` (by
    `name`, or by what a known callable computes) is applied through `recomputed`, so the backward
    pass keeps only its input."""
    if name == "linear":
        return x
    kind = recomputed_name(fn, name) if training else None
    if kind is not None:
        return recomputed(lambda t: apply_activation(t, fn, name), kind)(x)
    if name == GELU_APPROXIMATE:
        return gelu_approximate(x)
    emit = _SINGLE_OP_ACTIVATIONS.get(name)
    return emit(x) if emit is not None else fn(x)


def recomputed_name(fn, name):
    """The `fusion.RECOMPUTED_ACTIVATIONS` name of the activation (`name`, or what callable `fn`
    computes: a Keras, TF or keras-hub function), or None when it is not one of them."""
    if name is None:
        name = fusion.activation_name(fn, sources=(fusion.KERAS, fusion.TF_FUNCTIONS, fusion.KERAS_HUB))
    return name if name in fusion.RECOMPUTED_ACTIVATIONS else None


def recomputed(fn, kind=None):
    """`fn` (an elementwise activation) as a function whose backward pass keeps only its input `x`.

    The forward pass runs `fn` itself (the same ops, the same values), and the activation's
    intermediate tensors (several of the activation's size for a composite like the tanh GELU) are
    freed after it.

    With `kind`, what `fn` computes (a `fusion.ACTIVATION_GRAD_ACTIVATIONS` name), the gradient is
    one ``ops.activation_grad(dy, x, kind)``: ``dy * act'(x)`` in float32, rounded once, where TF's
    autodiff of the same ops makes 3-5 temporaries of the activation's size (and rounds each under a
    mixed policy). Without it, the backward pass runs `fn` again on `x` and takes TF's own gradient
    of that (bit for bit eagerly); the recomputation depends on the incoming gradient, so TF's graph
    optimizer cannot merge it with the forward ops (which would keep their tensors alive again).
    """
    if kind is not None and kind not in fusion.ACTIVATION_GRAD_ACTIVATIONS:
        raise ValueError(
            f"`kind` must be one of {fusion.ACTIVATION_GRAD_ACTIVATIONS} or None. Received: kind={kind!r}"
        )

    @tf.custom_gradient
    def run(x):
        def grad(dy):
            if kind is not None:
                from tfmetal_ext.ops import activation_grad  # lazy: the ops import the layers' helpers

                return activation_grad(dy, x, kind)
            (again,) = waiting_for(dy, [x])
            with tf.GradientTape() as tape:
                tape.watch(again)
                y_again = fn(again)
            return tape.gradient(y_again, again, output_gradients=dy)

        return fn(x), grad

    return run


def recomputed_gated(fn, kind, act_first=True):
    """``fn(gate) * up`` (``up * fn(gate)`` when not `act_first`) whose backward pass is one
    ``ops.gated_activation_grad(dy, gate, up, kind)``.

    `fn` computes the activation `kind` (a `fusion.ACTIVATION_GRAD_ACTIVATIONS` name). The forward
    pass runs `fn` and the product with the same ops as written (the same values); the gradient keeps
    only `gate` and `up`, and needs neither ``fn(gate)`` nor ``dy * up``, which TF's autodiff of the
    product and `recomputed`'s gradient keep or make. `gate` and `up` must have the same shape.
    """
    if kind not in fusion.ACTIVATION_GRAD_ACTIVATIONS:
        raise ValueError(f"`kind` must be one of {fusion.ACTIVATION_GRAD_ACTIVATIONS}. Received: kind={kind!r}")

    @tf.custom_gradient
    def run(gate, up):
        def grad(dy):
            from tfmetal_ext.ops import gated_activation_grad  # lazy: the ops import the layers' helpers

            return gated_activation_grad(dy, gate, up, kind)

        act = fn(gate)
        return (act * up if act_first else up * act), grad

    return run


def waiting_for(dy, tensors):
    """`tensors` as identities that run once gradient `dy` exists: what a backward pass recomputes from.

    Depending on the incoming gradient, the recomputation can neither be merged with the forward ops
    by grappler (which would keep their tensors alive again) nor run during the forward pass."""
    with tf.control_dependencies([dy]):
        return [tf.identity(t) for t in tensors]


def catalog_activation_name(name, fn):
    """The activation name inspection rules use (``"custom"`` for unnamed callables)."""
    if name is not None:
        return name
    return getattr(fn, "__name__", None) or type(fn).__name__


def add_bias_weight(layer, channels):
    """Creates ``layer.bias`` (None when ``layer.use_bias`` is False), as Keras names and shapes it."""
    layer.bias = None
    if layer.use_bias:
        layer.bias = layer.add_weight(
            name="bias",
            shape=(channels,),
            initializer=layer.bias_initializer,
            regularizer=layer.bias_regularizer,
            constraint=layer.bias_constraint,
            trainable=True,
        )


# ----------------------------------------------------------------------------
# Argument validation. Every message ends with "Received: name=value".


def positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return value


def positive_int_tuple(value, n, name):
    """An int or an iterable of `n` ints, all >= 1, as a tuple of `n` ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        values = (value,) * n
    else:
        try:
            values = tuple(value)
        except TypeError:
            values = None
    if (
        values is None
        or len(values) != n
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
    ):
        raise ValueError(
            f"`{name}` must be a positive integer or a tuple of {n} positive integers. "
            f"Received: {name}={value!r}"
        )
    return values


def padding(value):
    mode = value.lower() if isinstance(value, str) else None
    if mode not in ("valid", "same"):
        raise ValueError(f"`padding` must be 'valid' or 'same'. Received: padding={value!r}")
    return mode


def boolean(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def channels_last(value):
    if value is not None and value != "channels_last":
        raise ValueError(
            "Only `data_format='channels_last'` (NHWC) is supported: the remapper's CPU "
            f"conv fusions need NHWC. Received: data_format={value!r}"
        )
    return "channels_last"


def keras_object(getter, value, name):
    """`keras.initializers.get` and friends, with a Keras-style error."""
    try:
        return getter(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"Could not interpret `{name}`. Received: {name}={value!r}") from e


def strides_with_dilation(strides, dilation_rate):
    if max(strides) > 1 and max(dilation_rate) > 1:
        raise ValueError(
            "`strides > 1` is not supported together with `dilation_rate > 1`. "
            f"Received: strides={strides}, dilation_rate={dilation_rate}"
        )


# ----------------------------------------------------------------------------
# Conv drop-ins that subclass the stock Keras conv classes (FusedConv1D, FusedConv2D,
# FusedDepthwiseConv2D, FusedSeparableConv2D): the stock class owns arguments, weights,
# config, LoRA and errors; these pieces decide and emit the fused form.


class ConvDropIn:
    """Mixin of the conv drop-ins: the activation's name as the fused form emits it."""

    @property
    def _activation_name(self):
        """The Keras name of a built-in activation (``"linear"`` for none), or None for any other callable."""
        return resolve_activation(self.activation)[1]


def stock_path_reason(layer, dilation=True):
    """Why a conv drop-in (a stock conv subclass) runs the stock Keras form, or None for the fused form.

    The fused form is channels_last, ungrouped, unquantized and (when
    `dilation` is True: the dilated stage is the one the bias fuses into)
    undilated; anything else is computed exactly as the stock layer computes it.
    """
    if getattr(layer, "quantization_mode", None):
        return f"quantized ({layer.quantization_mode}): the stock quantized call runs"
    if layer.data_format != "channels_last":
        return (
            "data_format='channels_first': the stock form runs (the remapper's CPU conv fusions need "
            "channels_last, NHWC)"
        )
    if getattr(layer, "groups", 1) != 1:
        return (
            f"groups={layer.groups}: the stock form runs (Keras runs grouped convolutions through an "
            "XLA-compiled function, which grappler does not rewrite)"
        )
    if dilation and max(layer.dilation_rate) > 1:
        return "dilation_rate > 1: the stock form runs (SpaceToBatchND around the conv), so nothing fuses"
    return None


def bias_and_activation(layer, outputs):
    """BiasAdd (AddV2 while ``conv_bias_relu`` is avoided) and the activation as one TF op where possible."""
    if layer.use_bias:
        outputs = _ops.bias_add(outputs, layer.bias, "conv_bias_relu")
    fn, name = resolve_activation(layer.activation)
    return apply_activation(outputs, fn, name)
