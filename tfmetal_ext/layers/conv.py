"""Fusion-first 2-D convolutions: Conv2D / DepthwiseConv2dNative -> BiasAdd -> activation."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.layers import _ops


def _conv_output_length(length, kernel, stride, dilation, padding):
    if length is None:
        return None
    if padding == "same":
        return -(-length // stride)
    span = dilation * (kernel - 1) + 1
    return (length - span) // stride + 1 if length >= span else 0


def _conv_output_shape(input_shape, channels, kernel_size, strides, dilation_rate, padding):
    input_shape = tuple(input_shape)
    if len(input_shape) != 4:
        raise ValueError(
            f"Expected a 4-D NHWC input (batch, height, width, channels). "
            f"Received: input_shape={input_shape}"
        )
    spatial = tuple(
        _conv_output_length(n, k, s, d, padding)
        for n, k, s, d in zip(input_shape[1:3], kernel_size, strides, dilation_rate)
    )
    if any(n is not None and n <= 0 for n in spatial):
        raise ValueError(
            f"The input is smaller than the dilated kernel {kernel_size} (dilation_rate="
            f"{dilation_rate}) with padding='valid': the output would be empty. "
            f"Received: input_shape={input_shape}"
        )
    return (input_shape[0],) + spatial + (channels,)


def _input_channels(input_shape):
    if len(input_shape) != 4 or input_shape[-1] is None:
        raise ValueError(
            "Expected a 4-D NHWC input with a known channel dimension. "
            f"Received: input_shape={tuple(input_shape)}"
        )
    return int(input_shape[-1])


class _FusedConvBase(keras.layers.Layer):
    """Arguments, weights and the bias + activation tail shared by the conv layers."""

    def __init__(
        self,
        kernel_size,
        strides,
        padding,
        dilation_rate,
        activation,
        use_bias,
        bias_initializer,
        bias_regularizer,
        activity_regularizer,
        bias_constraint,
        data_format=None,
        **kwargs,
    ):
        activity_regularizer = C.keras_object(
            keras.regularizers.get, activity_regularizer, "activity_regularizer"
        )
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.kernel_size = C.positive_int_tuple(kernel_size, 2, "kernel_size")
        self.strides = C.positive_int_tuple(strides, 2, "strides")
        self.padding = C.padding(padding)
        self.dilation_rate = C.positive_int_tuple(dilation_rate, 2, "dilation_rate")
        C.strides_with_dilation(self.strides, self.dilation_rate)
        self.data_format = C.channels_last(data_format)
        self.activation, self._activation_name = C.resolve_activation(activation)
        self.use_bias = C.boolean(use_bias, "use_bias")
        self.bias_initializer = C.keras_object(keras.initializers.get, bias_initializer, "bias_initializer")
        self.bias_regularizer = C.keras_object(keras.regularizers.get, bias_regularizer, "bias_regularizer")
        self.bias_constraint = C.keras_object(keras.constraints.get, bias_constraint, "bias_constraint")
        self.input_spec = keras.layers.InputSpec(ndim=4)

    @property
    def dilated(self):
        return max(self.dilation_rate) > 1

    def _bias_and_activation(self, outputs):
        if self.use_bias:
            # NHWC: the bias broadcasts over the last axis either way.
            outputs = _ops.add_bias(outputs, self.bias, "conv_bias_relu")
        return C.apply_activation(outputs, self.activation, self._activation_name)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "kernel_size": self.kernel_size,
                "strides": self.strides,
                "padding": self.padding,
                "dilation_rate": self.dilation_rate,
                "activation": C.serialize_activation(self.activation, self._activation_name),
                "use_bias": self.use_bias,
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedConv2D(_FusedConvBase):
    """2-D convolution that emits ``Conv2D -> BiasAdd -> activation`` and nothing else.

    Same math, arguments and weights as `keras.layers.Conv2D` (NHWC,
    ``groups=1``), but the graph holds the exact pattern grappler's remapper
    matches: no Reshape/Squeeze between the convolution and the BiasAdd, and
    the activation as a single TF op. Relu, Relu6, Elu and LeakyRelu (slope
    0.2, as `keras.activations.leaky_relu`) can fuse into the convolution; any
    other activation (tanh, sigmoid, gelu, a callable, ...) is applied unfused
    with `keras.activations` after the BiasAdd.

    What the pattern becomes:

    | backend | fused op |
    |---|---|
    | Metal (tensorflow-metal) | `_FusedConv2D[BiasAdd(, Relu/Relu6/Elu/LeakyRelu)]`, float32/float16, no bfloat16 |
    | CUDA | `_FusedConv2D[BiasAdd, Relu]` only with a Relu, float32/float16, not 1x1 filters |
    | CPU (oneDNN) | `_FusedConv2D[BiasAdd(, act)]`, float32/bfloat16; training: LeakyRelu leaves only `[BiasAdd]` |
    | CPU (no oneDNN) | `_FusedConv2D[BiasAdd(, act)]`, float32/float64 |

    float16 on a CPU without native half fuses nothing. While
    ``tfmetal_ext.configure(avoid_fusions=["conv_bias_relu"])`` is in force
    (set before tracing), the bias is added with AddV2 instead: nothing fuses
    on a GPU, and on CPU with oneDNN the AddV2 still fuses as a BiasAdd.
    ``dilation_rate > 1``
    is emitted as Keras does (SpaceToBatchND + Conv2D + BatchToSpaceND; CPU
    kernels without oneDNN have no dilated Conv2D gradient), so it does not
    fuse.

    Args:
        filters: number of output channels, a positive int.
        kernel_size: int or tuple of 2 ints, the window height and width.
        strides: int or tuple of 2 ints. Not > 1 together with `dilation_rate` > 1.
        padding: ``"valid"`` or ``"same"`` (case-insensitive).
        dilation_rate: int or tuple of 2 ints.
        activation: a Keras activation (name, config or callable); None is linear.
        use_bias: whether to add a bias (and so emit the BiasAdd that fuses).
        kernel_initializer: initializer of the ``(kh, kw, in, filters)`` kernel.
        bias_initializer: initializer of the ``(filters,)`` bias.
        kernel_regularizer: regularizer of the kernel.
        bias_regularizer: regularizer of the bias.
        activity_regularizer: regularizer of the output.
        kernel_constraint: constraint of the kernel.
        bias_constraint: constraint of the bias.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).
            ``data_format`` is accepted only as ``"channels_last"`` and
            ``groups`` only as 1.

    Input shape:
        4-D tensor ``(batch, height, width, channels)``.

    Output shape:
        4-D tensor ``(batch, new_height, new_width, filters)``.

    Returns:
        ``activation(conv2d(inputs, kernel) + bias)``, in the layer's compute dtype.

    Raises:
        ValueError: on an invalid argument (the message ends with
            ``Received: name=value``) or an input that is not 4-D NHWC.

    Example:

    >>> layer = FusedConv2D(8, 3, padding="same", activation="relu")
    >>> layer(np.zeros((2, 16, 16, 3), "float32")).shape
    TensorShape([2, 16, 16, 8])
    """

    def __init__(
        self,
        filters,
        kernel_size,
        strides=1,
        padding="valid",
        dilation_rate=1,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        groups = kwargs.pop("groups", 1)
        if groups != 1:
            raise ValueError(f"FusedConv2D supports only `groups=1`. Received: groups={groups!r}")
        data_format = kwargs.pop("data_format", None)
        super().__init__(
            kernel_size=kernel_size,
            strides=strides,
            padding=padding,
            dilation_rate=dilation_rate,
            activation=activation,
            use_bias=use_bias,
            bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            bias_constraint=bias_constraint,
            data_format=data_format,
            **kwargs,
        )
        self.filters = C.positive_int(filters, "filters")
        self.groups = 1
        self.kernel_initializer = C.keras_object(keras.initializers.get, kernel_initializer, "kernel_initializer")
        self.kernel_regularizer = C.keras_object(keras.regularizers.get, kernel_regularizer, "kernel_regularizer")
        self.kernel_constraint = C.keras_object(keras.constraints.get, kernel_constraint, "kernel_constraint")

    def build(self, input_shape):
        channels = _input_channels(input_shape)
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: channels})
        self.kernel = self.add_weight(
            name="kernel",
            shape=self.kernel_size + (channels, self.filters),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            trainable=True,
        )
        C.add_bias(self, self.filters)

    def call(self, inputs):
        if self.dilated:
            outputs = tf.nn.convolution(
                inputs, self.kernel, strides=self.strides, padding=self.padding.upper(),
                dilations=self.dilation_rate, data_format="NHWC",
            )
        else:
            outputs = tf.nn.conv2d(
                inputs, self.kernel, strides=self.strides, padding=self.padding.upper(), data_format="NHWC"
            )
        return self._bias_and_activation(outputs)

    def compute_output_shape(self, input_shape):
        return _conv_output_shape(
            input_shape, self.filters, self.kernel_size, self.strides, self.dilation_rate, self.padding
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "filters": self.filters,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedDepthwiseConv2D(_FusedConvBase):
    """Depthwise 2-D convolution that emits ``DepthwiseConv2dNative -> BiasAdd -> activation``.

    Same math, arguments and weights as `keras.layers.DepthwiseConv2D` (NHWC;
    the depthwise kernel is named ``kernel``, shape
    ``(kh, kw, in, depth_multiplier)``), with the bias added by a real
    BiasAdd right after the convolution and the activation as one TF op
    (Relu, Relu6, Elu, LeakyRelu with slope 0.2). Other activations are
    applied unfused with `keras.activations` after the BiasAdd.

    What the pattern becomes:

    | backend | fused op |
    |---|---|
    | Metal (tensorflow-metal) | not fused (no fused depthwise kernel) |
    | CUDA | not fused |
    | CPU (oneDNN) | `_FusedDepthwiseConv2dNative[BiasAdd(, act)]`, float32/bfloat16 |
    | CPU (no oneDNN) | not fused |

    With ``configure(avoid_fusions=["conv_bias_relu"])`` the bias is added
    with AddV2 instead of BiasAdd (see `FusedConv2D`).

    ``dilation_rate > 1`` is emitted as Keras does (SpaceToBatchND around the
    convolution: the CPU DepthwiseConv2dNative kernel has no dilation without
    oneDNN) and does not fuse.

    Args:
        kernel_size: int or tuple of 2 ints, the window height and width.
        strides: int or tuple of 2 ints. Not > 1 together with `dilation_rate` > 1.
        padding: ``"valid"`` or ``"same"`` (case-insensitive).
        depth_multiplier: output channels per input channel, a positive int.
        dilation_rate: int or tuple of 2 ints.
        activation: a Keras activation (name, config or callable); None is linear.
        use_bias: whether to add a bias.
        depthwise_initializer: initializer of the depthwise kernel.
        bias_initializer: initializer of the ``(in * depth_multiplier,)`` bias.
        depthwise_regularizer: regularizer of the depthwise kernel.
        bias_regularizer: regularizer of the bias.
        activity_regularizer: regularizer of the output.
        depthwise_constraint: constraint of the depthwise kernel.
        bias_constraint: constraint of the bias.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).
            ``data_format`` is accepted only as ``"channels_last"``.

    Input shape:
        4-D tensor ``(batch, height, width, channels)``.

    Output shape:
        4-D tensor ``(batch, new_height, new_width, channels * depth_multiplier)``.

    Returns:
        ``activation(depthwise_conv2d(inputs, kernel) + bias)``, in the layer's
        compute dtype.

    Raises:
        ValueError: on an invalid argument (the message ends with
            ``Received: name=value``) or an input that is not 4-D NHWC.

    Example:

    >>> layer = FusedDepthwiseConv2D(3, padding="same", depth_multiplier=2, activation="relu6")
    >>> layer(np.zeros((2, 16, 16, 4), "float32")).shape
    TensorShape([2, 16, 16, 8])
    """

    def __init__(
        self,
        kernel_size,
        strides=1,
        padding="valid",
        depth_multiplier=1,
        dilation_rate=1,
        activation=None,
        use_bias=True,
        depthwise_initializer="glorot_uniform",
        bias_initializer="zeros",
        depthwise_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        depthwise_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        data_format = kwargs.pop("data_format", None)
        super().__init__(
            kernel_size=kernel_size,
            strides=strides,
            padding=padding,
            dilation_rate=dilation_rate,
            activation=activation,
            use_bias=use_bias,
            bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            bias_constraint=bias_constraint,
            data_format=data_format,
            **kwargs,
        )
        self.depth_multiplier = C.positive_int(depth_multiplier, "depth_multiplier")
        self.depthwise_initializer = C.keras_object(
            keras.initializers.get, depthwise_initializer, "depthwise_initializer"
        )
        self.depthwise_regularizer = C.keras_object(
            keras.regularizers.get, depthwise_regularizer, "depthwise_regularizer"
        )
        self.depthwise_constraint = C.keras_object(
            keras.constraints.get, depthwise_constraint, "depthwise_constraint"
        )

    def build(self, input_shape):
        channels = _input_channels(input_shape)
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: channels})
        self.kernel = self.add_weight(
            name="kernel",
            shape=self.kernel_size + (channels, self.depth_multiplier),
            initializer=self.depthwise_initializer,
            regularizer=self.depthwise_regularizer,
            constraint=self.depthwise_constraint,
            trainable=True,
        )
        C.add_bias(self, channels * self.depth_multiplier)

    def call(self, inputs):
        strides = (1,) + self.strides + (1,)
        if self.dilated:
            outputs = tf.nn.depthwise_conv2d(
                inputs, self.kernel, strides=strides, padding=self.padding.upper(),
                dilations=self.dilation_rate, data_format="NHWC",
            )
        else:
            # The raw op: exactly one DepthwiseConv2dNative node for the remapper.
            outputs = tf.raw_ops.DepthwiseConv2dNative(
                input=inputs, filter=self.kernel, strides=list(strides),
                padding=self.padding.upper(), data_format="NHWC",
            )
        return self._bias_and_activation(outputs)

    def compute_output_shape(self, input_shape):
        channels = input_shape[-1] * self.depth_multiplier if input_shape[-1] is not None else None
        return _conv_output_shape(
            input_shape, channels, self.kernel_size, self.strides, self.dilation_rate, self.padding
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "depth_multiplier": self.depth_multiplier,
                "depthwise_initializer": keras.initializers.serialize(self.depthwise_initializer),
                "depthwise_regularizer": keras.regularizers.serialize(self.depthwise_regularizer),
                "depthwise_constraint": keras.constraints.serialize(self.depthwise_constraint),
            }
        )
        return config


# ----------------------------------------------------------------------------
# Inspection rules: what these layers should become in the graph that runs.


def _dilation_block(layer, pattern):
    if max(layer.dilation_rate) > 1 and getattr(layer, "use_bias", True):
        act = catalog.act_op(layer)
        ideal = ("BiasAdd",) + ((act,) if act else ())
        return catalog.Expectation(
            pattern, None, None, ideal,
            reason="dilation_rate > 1: emitted with SpaceToBatchND/BatchToSpaceND around the conv, so nothing fuses",
        )
    return None


def _fused_conv2d_rule(layer, ctx):
    return _dilation_block(layer, "conv2d_bias_act") or catalog.conv2d_rule(layer, ctx)


def _fused_depthwise_rule(layer, ctx):
    return _dilation_block(layer, "depthwise_bias_act") or catalog.depthwise_rule(layer, ctx)


catalog.register_rule(FusedConv2D, catalog.unless_avoided("conv_bias_relu", _fused_conv2d_rule))
catalog.register_rule(FusedDepthwiseConv2D, catalog.unless_avoided("conv_bias_relu", _fused_depthwise_rule))
