"""FusedConv1D: `keras.layers.Conv1D` that emits ``ExpandDims -> Conv2D -> BiasAdd -> act -> Squeeze``."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.layers import _ops


def stock_path_reason(layer, dilation=True):
    """Why a conv drop-in (a stock conv subclass) runs the stock Keras form, or None for the fused form.

    The fused form is channels_last, ungrouped, unquantized and (when
    `dilation` is True: the dilated stage is the one the bias fuses into)
    undilated; anything else is computed exactly as the stock layer computes it.
    """
    if getattr(layer, "quantization_mode", None):
        return f"quantized ({layer.quantization_mode}): the stock quantized call runs"
    if layer.data_format != "channels_last":
        return "data_format='channels_first': the stock form runs (the remapper's CPU conv fusions need NHWC)"
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
        outputs = _ops.add_bias(outputs, layer.bias, "conv_bias_relu")
    fn, name = C.resolve_activation(layer.activation)
    return C.apply_activation(outputs, fn, name)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedConv1D(keras.layers.Conv1D):
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
