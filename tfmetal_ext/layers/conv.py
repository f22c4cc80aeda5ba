"""Fusion-first 2-D convolutions: Conv2D / DepthwiseConv2dNative -> BiasAdd -> activation."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _quantize as Q
from tfmetal_ext.layers._contraction import (
    ConvDropIn,
    apply_activation,
    bias_and_activation,
    resolve_activation,
    stock_path_reason,
)


class _Int8Conv:
    """Keras' int8 quantization API for the conv drop-ins (stock Keras 3.15 convs have none).

    Subclasses set `_int8_axes` (the kernel axes the scale reduces over) and
    implement `_int8_channels`, `_add_int8_kernel` and `_int8_call`. Variables
    of the int8 form: an int8 kernel (non-trainable) and ``kernel_scale``,
    float32, one per output channel; stored as kernel, bias, kernel_scale.
    """

    _int8_axes = (0, 1, 2)

    def _int8_unsupported(self):
        """Why this layer has no int8 form, or None."""
        if self.data_format != "channels_last":
            return "data_format='channels_first' (the int8 form is NHWC)"
        if getattr(self, "groups", 1) != 1:
            return f"groups={self.groups} (the int8 convolution has no groups)"
        if getattr(self, "lora_enabled", False):
            return "LoRA is enabled (LoRA on an int8 convolution is not implemented)"
        return None

    def _int8_not_implemented(self, reason):
        return NotImplementedError(
            f"{type(self).__name__} has no int8 form for this configuration: {reason}. "
            f"Received: data_format={self.data_format!r}, groups={getattr(self, 'groups', 1)}, "
            f"lora_enabled={getattr(self, 'lora_enabled', False)}"
        )

    @property
    def variable_serialization_spec(self):
        """The stored variable names per quantization mode, in store order (as Keras' Dense)."""
        return {mode: list(names) for mode, names in Q.SERIALIZATION_SPEC.items()}

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the kernel to int8 in place (Keras' API; see `FusedDense.quantize`).

        Raises:
            ValueError: Keras' checks (unbuilt, already quantized, unknown
                mode, float16 compute dtype) or a config the form does not
                implement (an activation quantizer, a non-default weight quantizer).
            NotImplementedError: a subclass with `type_check`, a mode other
                than int8, or a configuration the int8 form does not run
                (channels_first, groups > 1, LoRA enabled; `model.quantize`
                skips such layers with Keras' warning).
        """
        if type_check and type(self) not in (FusedConv2D, FusedDepthwiseConv2D):
            raise self._not_implemented_error(self.quantize)
        if mode != Q.INT8:
            raise Q.not_int8_error(self, mode)
        reason = self._int8_unsupported()
        if reason is not None:
            raise self._int8_not_implemented(reason)
        kernel = self._kernel
        config = Q.check_config(self, config, axes=self._int8_axes, ndim=len(kernel.shape))
        Q.quantize_in_place(self, kernel, self._int8_axes, self._int8_channels(kernel.shape), mode, config,
                            self._drop_float_kernel)

    def quantized_build(self, kernel_shape, mode, config=None):
        if mode != Q.INT8:
            raise Q.not_int8_error(self, mode)
        reason = self._int8_unsupported()
        if reason is not None:
            raise self._int8_not_implemented(reason)
        self._int8_build(kernel_shape, config)
        self._is_quantized = True

    def _int8_build(self, kernel_shape, config=None):
        self.inputs_quantizer = None  # weight-only: the inputs stay float
        channels = self._int8_channels(kernel_shape)
        self._add_int8_kernel(kernel_shape)
        self.kernel_scale = self.add_weight(
            name="kernel_scale", shape=(channels,), initializer="ones", trainable=False, autocast=False
        )

    def _int8_input_spec(self, input_shape):
        """Sets the input spec as the stock conv's build does; returns the input channels."""
        input_channel = input_shape[-1] if self.data_format == "channels_last" else input_shape[1]
        channel_axis = -1 if self.data_format == "channels_last" else 1
        self.input_spec = keras.layers.InputSpec(min_ndim=self.rank + 2, axes={channel_axis: input_channel})
        return input_channel

    def _build_int8(self, input_shape, kernel_shape, bias_channels):
        """`build` under an ``int8_from_*`` policy: the int8 kernel and scale, then the bias."""
        self.quantized_build(kernel_shape, mode=self.quantization_mode, config=getattr(self, "quantization_config", None))
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias", shape=(bias_channels,), initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint, trainable=True,
                dtype=self.dtype,
            )
        self.built = True

    def save_own_variables(self, store):
        if self.quantization_mode is None:
            return super().save_own_variables(store)
        if not self.built:
            return
        values = {"kernel": self._kernel, "bias": self.bias, "kernel_scale": self.kernel_scale}
        for i, name in enumerate(Q.stored_names(self)):
            store[str(i)] = keras.ops.convert_to_numpy(values[name])

    def load_own_variables(self, store):
        if self.quantization_mode is None:
            return super().load_own_variables(store)
        if not self.built:
            return
        names = Q.stored_names(self)
        Q.check_store(self, store, names)
        targets = {"kernel": self._kernel, "bias": self.bias, "kernel_scale": self.kernel_scale}
        for i, name in enumerate(names):
            targets[name].assign(store[str(i)])

    def _int8_epilogue(self, run):
        """`run(bias, act)` with the activation in the op where the op has it, else applied after."""
        _, name = resolve_activation(self.activation)
        if name in fusion.INT8_ACTIVATIONS:
            return run(self.bias if self.use_bias else None, name)
        return apply_activation(run(self.bias if self.use_bias else None, None), self.activation, name)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedConv2D(_Int8Conv, ConvDropIn, keras.layers.Conv2D):
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

    int8: `quantize` (``"int8"``, ``model.quantize("int8")``, a dtype policy
    ``"int8_from_<policy>"``), which stock Conv2D lacks in Keras 3.15, stores
    the kernel as int8 with a float ``kernel_scale`` per filter (Keras' abs-max
    scheme, `tfmetal_ext.ops.quantize_int8`; stored as kernel, bias,
    kernel_scale) and runs one ``TfmetalExt>Int8Conv2D`` per call (a 1x1
    stride-1 filter: one ``TfmetalExt>Int8MatMul`` over the channels), bias
    and activation in the op. Weight-only: the activations stay float; the
    int8 kernel and scale are not trainable, gradients reach the inputs and
    the bias. ``groups > 1``, ``channels_first`` and LoRA have no int8 form
    (NotImplementedError, so ``model.quantize`` skips the layer with Keras'
    warning).

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

    # int8 (Keras' quantization API; stock Conv2D has none in Keras 3.15).

    def build(self, input_shape):
        if not self.quantization_mode:
            return super().build(input_shape)
        input_channel = self._int8_input_spec(input_shape)
        if input_channel % self.groups != 0:
            raise ValueError(
                "The number of input channels must be evenly divisible by the number of groups. "
                f"Received groups={self.groups}, but the input has {input_channel} channels "
                f"(full input shape is {input_shape})."
            )
        self.compute_output_shape(input_shape)
        kernel_shape = tuple(self.kernel_size) + (input_channel // self.groups, self.filters)
        self._build_int8(input_shape, kernel_shape, self.filters)

    def _int8_channels(self, kernel_shape):
        return int(kernel_shape[-1])

    def _add_int8_kernel(self, kernel_shape):
        self._kernel = self.add_weight(
            name="kernel", shape=tuple(kernel_shape), initializer="zeros", dtype="int8", trainable=False
        )

    def _drop_float_kernel(self):
        del self._kernel

    @property
    def _int8_as_matmul(self):
        """A 1x1, stride-1 filter: the convolution is a MatMul over the channels (TfmetalExt>Int8MatMul)."""
        return tuple(self.kernel_size) == (1, 1) and tuple(self.strides) == (1, 1)

    def _int8_call(self, inputs):
        tops = Q.ops()
        scale = Q.scale_f32(self)
        if self._int8_as_matmul:
            kernel = tf.reshape(self._kernel, self._kernel.shape[2:])
            return self._int8_epilogue(
                lambda bias, act: tops.int8_matmul(inputs, kernel, scale, bias=bias, activation=act)
            )
        return self._int8_epilogue(
            lambda bias, act: tops.int8_conv2d(
                inputs, self._kernel, scale, bias=bias, strides=self.strides, padding=self.padding,
                dilation_rate=self.dilation_rate, activation=act,
            )
        )

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
class FusedDepthwiseConv2D(_Int8Conv, ConvDropIn, keras.layers.DepthwiseConv2D):
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

    int8: `quantize` as `FusedConv2D` (stock DepthwiseConv2D has none in
    Keras 3.15): an int8 ``kernel`` (also readable as ``_kernel``) and a float
    ``kernel_scale`` of the ``in * depth_multiplier`` output channels. The
    kernel is small, so each call de-quantizes it (Cast, RealDiv) and runs the
    float pattern above. channels_first and strides > 1 with dilation > 1
    have no int8 form (NotImplementedError).

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
        return self._fused(inputs, self.kernel)

    def _fused(self, inputs, kernel):
        strides = (1,) + tuple(self.strides) + (1,)
        if self.dilated:
            outputs = tf.nn.depthwise_conv2d(
                inputs, kernel, strides=strides, padding=self.padding.upper(),
                dilations=self.dilation_rate, data_format="NHWC",
            )
        else:
            # The raw op: exactly one DepthwiseConv2dNative node for the remapper.
            outputs = tf.raw_ops.DepthwiseConv2dNative(
                input=inputs, filter=kernel, strides=list(strides),
                padding=self.padding.upper(), data_format="NHWC",
            )
        return bias_and_activation(self, outputs)

    # int8 (Keras' quantization API; stock DepthwiseConv2D has none in Keras 3.15). The int8 kernel
    # keeps the stock attribute name (`kernel`); `_kernel` reads it, as on the other layers.

    _int8_axes = (0, 1)

    @property
    def _kernel(self):
        return self.kernel

    def _int8_unsupported(self):
        reason = super()._int8_unsupported()
        if reason is None and self.dilated and max(self.strides) > 1:
            reason = "strides > 1 with dilation_rate > 1 (Keras decomposes that convolution)"
        return reason

    def build(self, input_shape):
        if not self.quantization_mode:
            return super().build(input_shape)
        input_channel = self._int8_input_spec(input_shape)
        self.compute_output_shape(input_shape)
        kernel_shape = tuple(self.kernel_size) + (input_channel, self.depth_multiplier)
        self._build_int8(input_shape, kernel_shape, input_channel * self.depth_multiplier)

    def _int8_channels(self, kernel_shape):
        return int(kernel_shape[-2]) * int(kernel_shape[-1])  # Cin * depth_multiplier output channels

    def _add_int8_kernel(self, kernel_shape):
        self.kernel = self.add_weight(
            name="kernel", shape=tuple(kernel_shape), initializer="zeros", dtype="int8", trainable=False
        )

    def _drop_float_kernel(self):
        del self.kernel

    def _int8_call(self, inputs):
        # The kernel is small: de-quantize it (Cast, RealDiv) and run the float layer's fused pattern
        # (DepthwiseConv2dNative -> BiasAdd -> activation). Output channel c * depth_multiplier + m
        # has scale index c * depth_multiplier + m, so the scale reshapes to the kernel's last two axes.
        kernel = Q.dequantized(self, dtype=tf.float32, shape=self.kernel.shape[-2:])
        if inputs.dtype != tf.float32:
            kernel = tf.cast(kernel, inputs.dtype)
        return self._fused(inputs, kernel)


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


_conv2d_float_rule = catalog.unless_avoided("conv_bias_relu", _fused_conv2d_rule)
_depthwise_float_rule = catalog.unless_avoided("conv_bias_relu", _fused_depthwise_rule)


def _int8_note(layer):
    _, name = resolve_activation(layer.activation)
    return None if name in fusion.INT8_ACTIVATIONS else "this activation runs after the op"


def _conv2d_rule(layer, ctx):
    if layer.quantization_mode != Q.INT8:
        return _conv2d_float_rule(layer, ctx)
    if layer._int8_as_matmul:  # 1x1, stride 1: one TfmetalExt>Int8MatMul over the channels
        reference = catalog.contraction_rule(
            "matmul_bias_act", fusion.FUSED_MATMUL, layer, ctx, act=catalog.act_op(layer)
        )
        return catalog.int8_rule(layer, ctx, "matmul", note=_int8_note(layer), reference=reference)
    reference = _dilation_block(layer, "conv2d_bias_act") or catalog.conv2d_rule(layer, ctx)
    return catalog.int8_rule(layer, ctx, "conv2d", note=_int8_note(layer), reference=reference)


def _int8_depthwise_rule(layer, ctx):
    exp = _dilation_block(layer, "depthwise_bias_act") or catalog.depthwise_rule(layer, ctx)
    note = "int8: the kernel is de-quantized (Cast, RealDiv) before the DepthwiseConv2dNative"
    return dataclasses.replace(exp, note="; ".join(n for n in (exp.note, note) if n))


_depthwise_int8_rule = catalog.unless_avoided("conv_bias_relu", _int8_depthwise_rule)


def _depthwise_rule(layer, ctx):
    if layer.quantization_mode == Q.INT8:
        return _depthwise_int8_rule(layer, ctx)
    return _depthwise_float_rule(layer, ctx)


catalog.register_rule(FusedConv2D, _conv2d_rule)
catalog.register_rule(FusedDepthwiseConv2D, _depthwise_rule)
