"""FusedConv1D: `keras.layers.Conv1D` that emits ``ExpandDims -> Conv2D -> BiasAdd -> act -> Squeeze``."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers._contraction import ConvDropIn, bias_and_activation, stock_path_reason


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedConv1D(ConvDropIn, keras.layers.Conv1D):
    """1-D convolution whose bias and activation fuse into the convolution.

    A drop-in for `keras.layers.Conv1D`: a subclass with the same arguments
    (``padding="causal"``, ``groups``, ``dilation_rate``, ``data_format``,
    ``lora_rank``/``lora_alpha`` and `enable_lora`), the same weights
    (``kernel`` of shape ``(kernel_size, in, filters)``, ``bias``), config and
    errors. Keras' TF backend runs a Conv1D as ``ExpandDims -> Conv2D ->
    Squeeze -> BiasAdd -> act``: the remapper then fuses only the BiasAdd
    (its Conv2D + Squeeze + BiasAdd pattern), never the activation. This
    layer adds the bias and applies the activation on the 4-D tensor,
    ``ExpandDims -> Conv2D -> BiasAdd -> act -> Squeeze``, so Conv2D +
    BiasAdd + act become one ``_FusedConv2D`` wherever `FusedConv2D`'s do
    (Relu, Relu6, Elu, LeakyRelu with slope 0.2; any other activation is
    applied after the fused BiasAdd).

    The stock form runs instead (and the fusion report says so) for
    ``data_format="channels_first"``, ``groups > 1``, ``dilation_rate > 1``,
    a quantized layer, or an input of rank other than 3.

    Args:
        As `keras.layers.Conv1D`.

    Input shape:
        3-D tensor ``(batch, steps, channels)`` (channels_last).

    Output shape:
        3-D tensor ``(batch, new_steps, filters)``.

    Example:

    >>> layer = FusedConv1D(8, 3, padding="causal", activation="relu")
    >>> layer(np.zeros((2, 16, 4), "float32")).shape
    TensorShape([2, 16, 8])
    """

    def fused_path_reason(self):
        """None when the fused form runs, else why the stock form runs."""
        return stock_path_reason(self)

    def call(self, inputs):
        if self.fused_path_reason() is not None or len(inputs.shape) != 3:
            return super().call(inputs)
        padding = self.padding
        if padding == "causal":
            inputs = tf.pad(inputs, self._compute_causal_padding())
            padding = "valid"
        x = tf.expand_dims(inputs, 1)  # (batch, 1, steps, channels): NHWC with height 1
        kernel = tf.expand_dims(self.kernel, 0)  # (1, k, in, filters)
        outputs = tf.nn.conv2d(
            x, kernel, strides=(1, 1, self.strides[0], 1), padding=padding.upper(), data_format="NHWC"
        )
        outputs = bias_and_activation(self, outputs)
        return tf.squeeze(outputs, axis=1)


# ----------------------------------------------------------------------------
# Inspection rules: stock Conv1D (Conv2D + Squeeze + BiasAdd fuses, the activation does not) and FusedConv1D.


def _stock_form_expectation(layer, reason):
    act = catalog.act_op(layer)
    ideal = ("BiasAdd",) + ((act,) if act else ())
    return catalog.Expectation("conv2d_bias_act", None, None, ideal, reason=reason)


def _fused_conv1d_rule(layer, ctx):
    reason = layer.fused_path_reason()
    if reason is not None:
        return _stock_form_expectation(layer, reason)
    return catalog.contraction_rule(
        "conv2d_bias_act", fusion.FUSED_CONV2D, layer, ctx, act=catalog.act_op(layer),
        one_by_one=tuple(layer.kernel_size) == (1,),
    )


def _stock_conv1d_rule(layer, ctx):
    """Stock Conv1D: ``Conv2D -> Squeeze -> BiasAdd`` fuses as ``_FusedConv2D[BiasAdd]``; the activation stays apart."""
    reason = stock_path_reason(layer)
    if reason is not None:
        return _stock_form_expectation(layer, reason.replace(": the stock form runs", ""))
    act = catalog.act_op(layer)
    exp = catalog.contraction_rule(
        "conv2d_bias_act", fusion.FUSED_CONV2D, layer, ctx, act=None, one_by_one=tuple(layer.kernel_size) == (1,),
        addv2_bias=layer.filters == 1,  # keras.ops.add emits BiasAdd only for a vector bias
    )
    if exp.op is None:
        return catalog.Expectation(exp.pattern, None, None, exp.ideal_fused_ops if not act else ("BiasAdd", act),
                                   reason=exp.reason)
    why = (
        f"Keras emits Conv2D -> Squeeze -> BiasAdd: the remapper fuses the BiasAdd across the Squeeze, "
        f"not the {act} after it (tfmetal_ext.layers.FusedConv1D fuses it)"
    ) if act else None
    return catalog.Expectation(exp.pattern, exp.op, ("BiasAdd",), ("BiasAdd",) + ((act,) if act else ()), reason=why)


catalog.register_rule(keras.layers.Conv1D, _stock_conv1d_rule)
catalog.register_rule(FusedConv1D, catalog.unless_avoided("conv_bias_relu", _fused_conv1d_rule))
