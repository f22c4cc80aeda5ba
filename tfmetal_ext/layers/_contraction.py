"""Shared pieces of the contraction layers (conv, depthwise conv, dense).

Argument validation with Keras-style messages, and activation handling:
which activations are emitted as the single TF op the remapper fuses, and
how they are written to and read from a layer config.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.layers._ops import FUSABLE_ACTIVATIONS

# Activations the layers emit as one TF op, so a remapper pattern can absorb
# them. `linear` emits nothing.
_SINGLE_OP_ACTIVATIONS = {
    **FUSABLE_ACTIVATIONS,
    "tanh": tf.nn.tanh,
    # keras.activations.sigmoid tags the output with its logits (losses use that).
    "sigmoid": keras.activations.sigmoid,
    "gelu": lambda x: tf.nn.gelu(x, approximate=False),
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
    name = getattr(fn, "__name__", None)
    try:
        builtin = name is not None and keras.activations.get(name) is fn
    except ValueError:
        builtin = False
    return fn, (name if builtin else None)


def serialize_activation(fn, name):
    """The config value of an activation resolved by `resolve_activation`."""
    if name == GELU_APPROXIMATE:
        return GELU_APPROXIMATE
    return keras.activations.serialize(fn)


def apply_activation(x, fn, name):
    """Applies an activation right after the BiasAdd, as one TF op when possible."""
    if name == "linear":
        return x
    if name == GELU_APPROXIMATE:
        return gelu_approximate(x)
    emit = _SINGLE_OP_ACTIVATIONS.get(name)
    return emit(x) if emit is not None else fn(x)


def catalog_activation_name(name, fn):
    """The activation name inspection rules use (``"custom"`` for unnamed callables)."""
    if name is not None:
        return name
    return getattr(fn, "__name__", None) or type(fn).__name__


def add_bias(layer, channels):
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
