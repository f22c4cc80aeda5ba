"""Fusion-first 2-D convolutions: Conv2D / DepthwiseConv2dNative -> BiasAdd -> activation."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers._contraction import ConvDropIn, bias_and_activation, stock_path_reason


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedConv2D(ConvDropIn, keras.layers.Conv2D):
    """2-D convolution that emits ``Conv2D -> BiasAdd -> activation`` and nothing else.

    A drop-in for `keras.layers.Conv2D`: a subclass with the same arguments
    (``groups``, ``data_format``, ``lora_rank``/``lora_alpha`` and
    `enable_lora` included), weights, config and errors, whose graph holds the
    exact pattern grappler's remapper matches: no Reshape/Squeeze between the
    convolution and the BiasAdd, and the activation as a single TF op. Relu,
    Relu6, Elu and LeakyRelu (slope 0.2, as `keras.activations.leaky_relu`)
    can fuse into the convolution; any other activation (tanh, sigmoid, gelu,
    a callable, ...) is applied unfused after the BiasAdd. With LoRA enabled
    the convolution reads the LoRA-adjusted kernel, as the stock layer does.

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
    ``dilation_rate > 1`` is emitted as Keras does (SpaceToBatchND + Conv2D +
    BatchToSpaceND; CPU kernels without oneDNN have no dilated Conv2D
    gradient), so it does not fuse. ``groups > 1`` and
    ``data_format="channels_first"`` run the stock Keras form (the fusion
    report says why: `fused_path_reason`).

    Args:
        As `keras.layers.Conv2D`.

    Input shape:
        4-D tensor ``(batch, height, width, channels)``.

    Output shape:
        4-D tensor ``(batch, new_height, new_width, filters)``.

    Returns:
        ``activation(conv2d(inputs, kernel) + bias)``, in the layer's compute dtype.

    Raises:
        ValueError: on an invalid argument, as `keras.layers.Conv2D` raises it.

    Example:

    >>> layer = FusedConv2D(8, 3, padding="same", activation="relu")
    >>> layer(np.zeros((2, 16, 16, 3), "float32")).shape
    TensorShape([2, 16, 16, 8])
    """

    @property
    def dilated(self):
        return max(self.dilation_rate) > 1

    def fused_path_reason(self):
        """None when the fused form runs (dilated included), else why the stock form runs."""
        return stock_path_reason(self, dilation=False)

    def call(self, inputs):
        if self.fused_path_reason() is not None or len(inputs.shape) != 4:
            return super().call(inputs)
        if self.dilated:
            outputs = tf.nn.convolution(
                inputs, self.kernel, strides=self.strides, padding=self.padding.upper(),
                dilations=self.dilation_rate, data_format="NHWC",
            )
        else:
            outputs = tf.nn.conv2d(
                inputs, self.kernel, strides=self.strides, padding=self.padding.upper(), data_format="NHWC"
            )
        return bias_and_activation(self, outputs)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedDepthwiseConv2D(ConvDropIn, keras.layers.DepthwiseConv2D):
    """Depthwise 2-D convolution that emits ``DepthwiseConv2dNative -> BiasAdd -> activation``.

    A drop-in for `keras.layers.DepthwiseConv2D`: a subclass with the same
    arguments, weights (the depthwise kernel is named ``kernel``, shape
    ``(kh, kw, in, depth_multiplier)``), config and errors, with the bias added
    by a real BiasAdd right after the convolution and the activation as one
    TF op (Relu, Relu6, Elu, LeakyRelu with slope 0.2). Other activations are
    applied unfused after the BiasAdd.

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
    oneDNN) and does not fuse. ``data_format="channels_first"`` and strides > 1
    together with dilation > 1 run the stock Keras form (`fused_path_reason`).

    Args:
        As `keras.layers.DepthwiseConv2D`.

    Input shape:
        4-D tensor ``(batch, height, width, channels)``.

    Output shape:
        4-D tensor ``(batch, new_height, new_width, channels * depth_multiplier)``.

    Returns:
        ``activation(depthwise_conv2d(inputs, kernel) + bias)``, in the layer's
        compute dtype.

    Raises:
        ValueError: on an invalid argument, as `keras.layers.DepthwiseConv2D` raises it.

    Example:

    >>> layer = FusedDepthwiseConv2D(3, padding="same", depth_multiplier=2, activation="relu6")
    >>> layer(np.zeros((2, 16, 16, 4), "float32")).shape
    TensorShape([2, 16, 16, 8])
    """

    @property
    def dilated(self):
        return max(self.dilation_rate) > 1

    def fused_path_reason(self):
        """None when the fused form runs (dilated included), else why the stock form runs."""
        reason = stock_path_reason(self, dilation=False)
        if reason is None and self.dilated and max(self.strides) > 1:
            reason = "strides > 1 with dilation_rate > 1: the stock form runs (Keras decomposes the convolution)"
        return reason

    def call(self, inputs):
        if self.fused_path_reason() is not None or len(inputs.shape) != 4:
            return super().call(inputs)
        strides = (1,) + tuple(self.strides) + (1,)
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
        return bias_and_activation(self, outputs)


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


def _stock_form_block(layer, pattern):
    reason = layer.fused_path_reason()
    if reason is None:
        return None
    act = catalog.act_op(layer)
    return catalog.Expectation(pattern, None, None, ("BiasAdd",) + ((act,) if act else ()), reason=reason)


def _fused_conv2d_rule(layer, ctx):
    return (
        _stock_form_block(layer, "conv2d_bias_act") or _dilation_block(layer, "conv2d_bias_act")
        or catalog.conv2d_rule(layer, ctx)
    )


def _fused_depthwise_rule(layer, ctx):
    return (
        _stock_form_block(layer, "depthwise_bias_act") or _dilation_block(layer, "depthwise_bias_act")
        or catalog.depthwise_rule(layer, ctx)
    )


catalog.register_rule(FusedConv2D, catalog.unless_avoided("conv_bias_relu", _fused_conv2d_rule))
catalog.register_rule(FusedDepthwiseConv2D, catalog.unless_avoided("conv_bias_relu", _fused_depthwise_rule))
