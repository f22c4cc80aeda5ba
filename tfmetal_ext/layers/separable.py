"""FusedSeparableConv2D: `keras.layers.SeparableConv2D` as DepthwiseConv2dNative, then Conv2D 1x1 + BiasAdd + act."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers._contraction import ConvDropIn, bias_and_activation, stock_path_reason


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedSeparableConv2D(ConvDropIn, keras.layers.SeparableConv2D):
    """Depthwise separable 2-D convolution: depthwise, then pointwise with bias and activation fused.

    A drop-in for `keras.layers.SeparableConv2D`: a subclass with the same
    arguments, weights (``depthwise_kernel`` ``(kh, kw, in, depth_multiplier)``,
    ``pointwise_kernel`` ``(1, 1, in * depth_multiplier, filters)``, ``bias``),
    config and errors. It emits ``DepthwiseConv2dNative -> Conv2D(1x1) ->
    BiasAdd -> act``, the bias a real BiasAdd of the vector (no Reshape), the
    activation one TF op, so the pointwise Conv2D + BiasAdd + act become one
    ``_FusedConv2D`` wherever `FusedConv2D`'s do. (Keras' own form,
    ``tf.nn.separable_conv2d`` then a reshaped bias, fuses the same way on CPU
    but costs a Reshape and a Squeeze more per layer.) The depthwise stage has
    no bias, so nothing fuses into it.

    ``dilation_rate > 1`` runs the depthwise stage as Keras does
    (SpaceToBatchND around it); the pointwise stage fuses all the same. The
    stock form runs instead (and the fusion report says so) for
    ``data_format="channels_first"``, ``strides > 1`` with ``dilation_rate > 1``
    or a quantized layer.

    Args:
        As `keras.layers.SeparableConv2D`.

    Input shape:
        4-D tensor ``(batch, height, width, channels)`` (channels_last).

    Output shape:
        4-D tensor ``(batch, new_height, new_width, filters)``.

    Example:

    >>> layer = FusedSeparableConv2D(8, 3, padding="same", activation="relu")
    >>> layer(np.zeros((2, 16, 16, 4), "float32")).shape
    TensorShape([2, 16, 16, 8])
    """

    def fused_path_reason(self):
        """None when the fused form runs, else why the stock form runs."""
        return _separable_stock_reason(self)

    def call(self, inputs):
        if self.fused_path_reason() is not None or len(inputs.shape) != 4:
            return super().call(inputs)
        strides = [1, *self.strides, 1]
        if max(self.dilation_rate) > 1:
            x = tf.nn.depthwise_conv2d(
                inputs, self.depthwise_kernel, strides=strides, padding=self.padding.upper(),
                dilations=self.dilation_rate, data_format="NHWC",
            )
        else:
            # The raw op: exactly one DepthwiseConv2dNative node (no bias: it fuses nothing by itself).
            x = tf.raw_ops.DepthwiseConv2dNative(
                input=inputs, filter=self.depthwise_kernel, strides=strides,
                padding=self.padding.upper(), data_format="NHWC",
            )
        outputs = tf.nn.conv2d(x, self.pointwise_kernel, strides=1, padding="VALID", data_format="NHWC")
        return bias_and_activation(self, outputs)


def _separable_stock_reason(layer):
    reason = stock_path_reason(layer, dilation=False)
    if reason is None and max(layer.strides) > 1 and max(layer.dilation_rate) > 1:
        reason = "strides > 1 with dilation_rate > 1: the stock form runs (Keras decomposes the depthwise stage)"
    return reason


# ----------------------------------------------------------------------------
# Inspection rules: the pointwise Conv2D + BiasAdd + act (stock SeparableConv2D fuses the same way on CPU).


def _separable_rule(layer, ctx):
    reason = _separable_stock_reason(layer)
    if reason is not None and not reason.startswith("strides > 1"):
        act = catalog.act_op(layer)
        ideal = ("BiasAdd",) + ((act,) if act else ())
        return catalog.Expectation("conv2d_bias_act", None, None, ideal, reason=reason)
    # The pointwise stage is a 1x1 Conv2D: backends that skip 1x1 filters (CUDA) say so.
    return catalog.contraction_rule(
        "conv2d_bias_act", fusion.FUSED_CONV2D, layer, ctx, act=catalog.act_op(layer), one_by_one=True,
        addv2_bias=type(layer) is keras.layers.SeparableConv2D and layer.filters == 1,
    )


catalog.register_rule(keras.layers.SeparableConv2D, _separable_rule)
catalog.register_rule(FusedSeparableConv2D, catalog.unless_avoided("conv_bias_relu", _separable_rule))
