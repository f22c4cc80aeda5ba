"""Keras' int8 quantization API for the contraction layers (FusedDense, FusedConv2D, FusedDepthwiseConv2D).

Weight-only int8 with float activations, Keras' scale convention: an int8
kernel ``q = clip(round(w * kernel_scale), -127, 127)`` with one float
``kernel_scale`` per output channel, so ``w ~= q / kernel_scale``. The
quantizing is `tfmetal_ext.ops.quantize_int8`'s; the contractions are
`tfmetal_ext.ops.int8_matmul` / `int8_conv2d`'s. This module holds what the
three layers share: the argument checks, the quantize step around a layer's
own kernel, the stored order of the variables, and the LoRA merge.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src.dtype_policies import QUANTIZATION_MODES

INT8 = "int8"

# The int8 form stores its variables in stock Dense's order (`variable_serialization_spec`).
SERIALIZATION_SPEC = {None: ("kernel", "bias"), INT8: ("kernel", "bias", "kernel_scale")}


def ops():
    """`tfmetal_ext.ops`, imported on first use (the layers package is imported by it indirectly)."""
    from tfmetal_ext import ops as tops  # noqa: PLC0415

    return tops


def not_int8_error(layer, mode):
    """The error for a quantization mode other than int8: Keras' for an unknown mode, else one naming int8."""
    if mode not in QUANTIZATION_MODES:
        return layer._quantization_mode_error(mode)
    return NotImplementedError(
        f"{type(layer).__name__} implements only the 'int8' quantization mode (weight-only int8 "
        f"through TfmetalExt>Int8MatMul / Int8Conv2D); '{mode}' is not implemented. "
        f"Received: mode={mode!r}"
    )


def _axes(axis, ndim):
    if axis is None:
        return None
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(int(a) % ndim for a in axis))


def _is_keras_default_activation_quantizer(q):
    """`q` is what ``Int8QuantizationConfig()`` holds by default (``AbsMaxQuantizer()``).

    Keras resolves ``quantize("int8")`` and ``model.quantize("int8")`` (which
    passes its resolved config on to every layer) to that config before a
    layer's `quantize` runs, so it cannot be told apart from the same
    quantizer passed explicitly.
    """
    default = keras.quantizers.AbsMaxQuantizer()
    return (
        type(q) is keras.quantizers.AbsMaxQuantizer
        and q.axis in (None, (-1,))
        and tuple(q.value_range) == tuple(default.value_range)
        and float(q.epsilon) == float(default.epsilon)
        and q.output_dtype == default.output_dtype
    )


def _default_weight_quantizer(wq, axes, ndim):
    default = keras.quantizers.AbsMaxQuantizer()
    return (
        type(wq) is keras.quantizers.AbsMaxQuantizer
        and tuple(wq.value_range) == (-127, 127)
        and wq.output_dtype == "int8"
        and float(wq.epsilon) == float(default.epsilon)
        and _axes(wq.axis, ndim) in (None, tuple(sorted(a % ndim for a in axes)))
    )


def weight_only(config, axes, ndim):
    """Whether the fused weight-only int8 form runs `config`.

    It does for None; for Keras' default config, ``Int8QuantizationConfig()``
    (no weight quantizer, Keras' default activation quantizer), which is what
    ``quantize("int8")`` and ``model.quantize("int8")`` resolve to before a
    layer sees it (its activation quantizer is dropped: the activations stay
    float); and for an `Int8QuantizationConfig` with ``activation_quantizer=None``
    and a weight quantizer that is None or Keras' default abs-max int8 one
    (one scale per output channel: `axes` are the kernel axes it reduces
    over). Anything else, a config naming its quantizers in particular, runs
    Keras' own form (`keras_form_reason` says why).
    """
    if config is None:
        return True
    if not isinstance(config, keras.quantizers.Int8QuantizationConfig):
        return False
    aq, wq = config.activation_quantizer, config.weight_quantizer
    if aq is not None:
        return wq is None and _is_keras_default_activation_quantizer(aq)
    return wq is None or _default_weight_quantizer(wq, axes, ndim)


def weight_only_config(config):
    """The config to keep for the weight-only form: `config` without its (default) activation quantizer."""
    if config is None:
        return keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
    if config.activation_quantizer is None:
        return config
    return keras.quantizers.Int8QuantizationConfig(weight_quantizer=config.weight_quantizer, activation_quantizer=None)


def keras_form_reason(layer):
    """Why a quantized `layer` runs Keras' own form of its mode instead of the fused int8 one."""
    mode = layer.quantization_mode
    if mode != INT8:
        return f"quantization mode {mode!r}: no fused form (TfmetalExt>Int8MatMul is int8, weight-only)"
    config = getattr(layer, "quantization_config", None)
    aq = getattr(config, "activation_quantizer", None)
    if aq is not None:
        return (f"int8 with an activation quantizer ({aq!r}): the fused form is weight-only, so this layer "
                "runs Keras' own int8 form, which quantizes its inputs")
    return ("int8 with a weight quantizer other than Keras' default abs-max one "
            f"({getattr(config, 'weight_quantizer', None)!r}): this layer runs Keras' own int8 form")


def not_weight_only_error(layer, config):
    """NotImplementedError for a layer with no Keras int8 form (the convs) and a config the fused form does not run.

    Stock Keras convolutions have no quantization at all, so `model.quantize`
    skips such a layer with Keras' warning, as it skips a stock conv.
    """
    return NotImplementedError(
        f"{type(layer).__name__}'s int8 form is weight-only with Keras' default abs-max weight quantizer, "
        "and stock Keras has no int8 form of this layer to fall back to. "
        f"Received: quantization_config={config!r}"
    )


def check_config(layer, config, axes, ndim):
    """The weight-only `Int8QuantizationConfig` to keep for a layer with no Keras int8 form (the convs).

    Args:
        config: None, or the `keras.quantizers.QuantizationConfig` given.
        axes: the kernel axes the scale reduces over (every axis but the output one).
        ndim: the kernel's rank.

    Raises:
        ValueError: not an int8 config.
        NotImplementedError: a config the weight-only form does not run
            (`not_weight_only_error`).
    """
    if config is not None and not isinstance(config, keras.quantizers.Int8QuantizationConfig):
        raise ValueError(
            f"{type(layer).__name__} takes an int8 quantization config (keras.quantizers."
            f"Int8QuantizationConfig) or None. Received: quantization_config={config!r}"
        )
    if not weight_only(config, axes, ndim):
        raise not_weight_only_error(layer, config)
    return weight_only_config(config)


def quantize_kernel(kernel, axes, channels):
    """``(q int8 numpy, scale float32 numpy of `channels`)`` from a float kernel (`ops.quantize_int8`)."""
    q, scale = ops().quantize_int8(kernel, axis=tuple(axes))
    q = np.asarray(keras.ops.convert_to_numpy(q)).astype(np.int8)
    scale = np.asarray(keras.ops.convert_to_numpy(scale)).reshape((channels,))
    return q, scale


def quantize_in_place(layer, kernel, axes, channels, mode, config, drop_float_kernel):
    """The quantize step of the three layers, after their checks.

    The int8 weights of the float `kernel` (`quantize_kernel`), then the float
    kernel dropped (`drop_float_kernel()`), the int8 variables built
    (``layer.quantized_build``) and set, and the policy switched (`set_policy`).
    """
    q, scale = quantize_kernel(kernel, axes, channels)
    kernel_shape = tuple(kernel.shape)
    layer.quantization_config = config
    drop_float_kernel()
    layer.quantized_build(kernel_shape, mode, config)
    layer._kernel.assign(q)
    layer.kernel_scale.assign(scale)
    set_policy(layer)


def add_int8_weights(layer, kernel_shape, channels):
    """Creates ``layer._kernel`` (int8) and ``layer.kernel_scale`` (the output channels), non-trainable.

    `kernel_scale` is not autocast: the ops read it as float32 under mixed
    policies (Keras' stock layer divides by a scale cast to the compute dtype).
    """
    layer._kernel = layer.add_weight(
        name="kernel", shape=tuple(kernel_shape), initializer="zeros", dtype="int8", trainable=False
    )
    layer.kernel_scale = layer.add_weight(
        name="kernel_scale", shape=(channels,), initializer="ones", trainable=False, autocast=False
    )


def scale_f32(layer):
    """``layer.kernel_scale`` as a float32 tensor."""
    scale = tf.convert_to_tensor(layer.kernel_scale)
    return scale if scale.dtype == tf.float32 else tf.cast(scale, tf.float32)


def dequantized(layer, dtype=None, shape=None):
    """The float kernel ``q / kernel_scale`` (Cast, RealDiv) in `dtype` (default: the compute dtype)."""
    dtype = dtype or layer.compute_dtype
    scale = tf.cast(tf.convert_to_tensor(layer.kernel_scale), dtype)
    if shape is not None:
        scale = tf.reshape(scale, shape)
    return tf.cast(tf.convert_to_tensor(layer._kernel), dtype) / scale


def set_policy(layer):
    """After quantizing: ``int8_from_<policy>``, unless the layer already has a quantized policy."""
    if layer.dtype_policy.quantization_mode is None:
        layer.dtype_policy = keras.dtype_policies.get(f"{INT8}_from_{layer.dtype_policy.name}")


def check_store(layer, store, names):
    if len(store.keys()) != len(names):
        raise ValueError(
            f"Layer '{layer.name}' expected {len(names)} variables, but received {len(store.keys())} "
            f"variables during loading. Expected: {list(names)}. Received: store keys={sorted(store.keys())}"
        )


def stored_names(layer):
    """The names stored for `layer`'s mode in `SERIALIZATION_SPEC` order (no bias without one)."""
    mode = layer.quantization_mode
    if mode not in SERIALIZATION_SPEC:
        raise layer._quantization_mode_error(mode)
    return [n for n in SERIALIZATION_SPEC[mode] if n != "bias" or layer.bias is not None]
