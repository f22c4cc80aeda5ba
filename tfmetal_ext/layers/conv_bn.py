"""ConvBNAct (and ConvBNAct1D): Conv2D (no bias) -> FusedBatchNormV3 -> activation, in one layer."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers.normalization import assign_finite_moving_statistics, batch_norm_act_expectation

_ACTIVATIONS = fusion.CONTRACTION_ACTIVATIONS + ("linear",)
_PADDINGS = ("same", "valid")


def _pair(value, name):
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    try:
        value = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        value = ()
    if len(value) != 2 or any(v < 1 for v in value):
        return None
    return value


def fold_batch_norm(kernel, bias, gamma, beta, mean, variance, epsilon):
    """Kernel and bias of a convolution (or matmul) followed by an inference-mode batch norm, as one.

    With ``s = gamma / sqrt(variance + epsilon)``: ``kernel * s`` and
    ``(bias - mean) * s + beta``, computed in float64. The batch norm's channels
    are the kernel's trailing, contiguous output channels: the last axis of a
    Conv2D or Dense kernel, ``in * multiplier`` of a depthwise kernel.

    Args:
        kernel: the contraction's kernel (array or variable).
        bias: its bias, or None when it has none.
        gamma: the batch norm's scale, or None (``scale=False``: ones).
        beta: its offset, or None (``center=False``: zeros).
        mean: its moving mean.
        variance: its moving variance.
        epsilon: its epsilon.

    Returns:
        ``(kernel, bias)`` as numpy float32 arrays, the kernel in its own shape.

    >>> import numpy as np
    >>> k, b = fold_batch_norm(np.ones((1, 1, 2, 3)), None, None, None, np.zeros(3), np.ones(3), 0.0)
    >>> b.tolist()
    [0.0, 0.0, 0.0]
    """
    import numpy as np

    def f64(value):
        return keras.ops.convert_to_numpy(value).astype("float64")

    kernel, mean = f64(kernel), f64(mean)
    channels = mean.shape[-1]
    gamma = np.ones(channels) if gamma is None else f64(gamma)
    beta = np.zeros(channels) if beta is None else f64(beta)
    scale = gamma / np.sqrt(f64(variance) + epsilon)
    folded = (kernel.reshape(-1, channels) * scale).reshape(kernel.shape)
    shift = -mean if bias is None else f64(bias) - mean
    return folded.astype("float32"), (shift * scale + beta).astype("float32")


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class ConvBNAct(keras.layers.Layer):
    """2D convolution without bias, batch normalization and an activation, fused.

    Emits ``Conv2D -> FusedBatchNormV3 -> act`` (Keras' own
    `BatchNormalization` never emits FusedBatchNormV3, so a stock
    Conv2D/BatchNormalization/ReLU stack fuses nothing). Numerically it is
    ``Conv2D(use_bias=False)`` + ``BatchNormalization`` + ``Activation`` with
    the same weights: batch statistics in training, moving statistics at
    inference, moving statistics updated the Keras way, except on a batch
    whose statistics are not finite (a step loss scaling skips): the moving
    statistics stay as they were, where Keras' become NaN (see
    `FusedBatchNorm`).

    What it fuses into (grappler remapper; measured on CPU, TF 2.21):

    | backend | predict (inference) | train step |
    |---|---|---|
    | Metal | `_FusedBatchNormEx` (BN + Relu), float32/half | `_FusedBatchNormEx`, half |
    | CUDA | `_FusedBatchNormEx` (BN + Relu), float32/half | `_FusedBatchNormEx`, half, C % 4 == 0 |
    | CPU + oneDNN | `_FusedConv2D[FusedBatchNorm, act]` float32; bfloat16: `_FusedBatchNormEx` | `_FusedBatchNormEx` (Relu), float32/bfloat16 |

    On CPU, float16 is not fused (the remapper skips half). In a CPU train
    step a 1x1, stride-1 convolution runs as one MatMul (its backward as two
    MatMuls): the same product, faster there than Conv2D and its backprop
    kernels with oneDNN (5-15%) and without (3-49%). `fold()` turns
    the layer into a `FusedConv2D` with the batch norm folded into kernel and
    bias (`_FusedConv2D[BiasAdd, act]` wherever conv + bias fuses).
    ``tfmetal_ext.configure(avoid_fusions=["fused_batch_norm"])`` (set before
    tracing) replaces FusedBatchNormV3 by moments + Rsqrt/Mul/Add, the same
    math unfused.

    Args:
        filters: number of output channels, a positive integer.
        kernel_size: an int or a pair of ints.
        strides: an int or a pair of ints.
        padding: ``"same"`` or ``"valid"``.
        activation: ``"relu"``, ``"relu6"``, ``"elu"``, ``"leaky_relu"``
            (slope 0.2, like `keras.activations.leaky_relu`), or
            ``None``/``"linear"``.
        momentum: moving statistics momentum, in [0, 1].
        epsilon: added to the variance, > 0 (FusedBatchNormV3 needs at least
            1.001e-5).
        kernel_initializer: initializer of the convolution kernel.
        kernel_regularizer: regularizer of the convolution kernel.
        kernel_constraint: constraint of the convolution kernel.
        gamma_initializer, beta_initializer, moving_mean_initializer,
            moving_variance_initializer: batch norm initializers.
        gamma_regularizer, beta_regularizer: batch norm regularizers.
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``).

    Input shape:
        4D tensor ``(batch, height, width, channels)`` (channels_last).

    Output shape:
        4D tensor ``(batch, new_height, new_width, filters)``.

    Raises:
        ValueError: on an invalid argument.

    >>> layer = ConvBNAct(16, 3)
    >>> layer(tf.zeros([2, 8, 8, 3])).shape
    TensorShape([2, 8, 8, 16])
    """

    def __init__(
        self,
        filters,
        kernel_size,
        strides=1,
        padding="same",
        activation="relu",
        momentum=0.99,
        epsilon=1e-3,
        kernel_initializer="he_normal",
        kernel_regularizer=None,
        kernel_constraint=None,
        gamma_initializer="ones",
        beta_initializer="zeros",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        gamma_regularizer=None,
        beta_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"`filters` must be a positive integer. Received: filters={filters!r}")
        ks = _pair(kernel_size, "kernel_size")
        if ks is None:
            raise ValueError(
                f"`kernel_size` must be a positive int or a pair of them. Received: kernel_size={kernel_size!r}"
            )
        st = _pair(strides, "strides")
        if st is None:
            raise ValueError(f"`strides` must be a positive int or a pair of them. Received: strides={strides!r}")
        pad = padding.lower() if isinstance(padding, str) else padding
        if pad not in _PADDINGS:
            raise ValueError(f"`padding` must be one of {_PADDINGS}. Received: padding={padding!r}")
        act = "linear" if activation is None else activation
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {_ACTIVATIONS} or None. Received: activation={activation!r}"
            )
        momentum, epsilon = _ops.check_batch_norm_args(momentum, epsilon)
        self.filters = filters
        self.kernel_size = ks
        self.strides = st
        self.padding = pad
        self.activation = act
        self.momentum = momentum
        self.epsilon = epsilon
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.moving_mean_initializer = keras.initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = keras.initializers.get(moving_variance_initializer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.input_spec = keras.layers.InputSpec(ndim=4)

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(f"The channel dimension of the input must be known. Received: input_shape={input_shape}")
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: channels})
        self.kernel = self.add_weight(
            name="kernel",
            shape=self.kernel_size + (channels, self.filters),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        # Like BatchNormalization: float32 and never autocast, FusedBatchNormV3 wants float32 scale/offset/stats.
        bn = dict(shape=(self.filters,), dtype="float32", autocast=False)
        self.gamma = self.add_weight(
            name="gamma", initializer=self.gamma_initializer, regularizer=self.gamma_regularizer, **bn
        )
        self.beta = self.add_weight(
            name="beta", initializer=self.beta_initializer, regularizer=self.beta_regularizer, **bn
        )
        self.moving_mean = self.add_weight(
            name="moving_mean", initializer=self.moving_mean_initializer, trainable=False, **bn
        )
        self.moving_variance = self.add_weight(
            name="moving_variance", initializer=self.moving_variance_initializer, trainable=False, **bn
        )

    def _pointwise_as_matmul(self, training):
        """A 1x1, stride-1 convolution in a training step runs as one MatMul where the backend table says so.

        On CPU, with oneDNN or without, MatMul's forward and both backward
        products beat Conv2D / Conv2DBackpropInput / Conv2DBackpropFilter for
        the same 1x1 product (the figures are in `tfmetal_ext.backends.cpu`).
        Inference keeps Conv2D: Conv2D + FusedBatchNormV3 fuses into
        `_FusedConv2D[FusedBatchNorm, ...]` there. GPU backends keep Conv2D
        (cuDNN and the Metal plugins have their own 1x1 kernels).
        """
        from tfmetal_ext import backends

        return (
            training
            and self.kernel_size == (1, 1)
            and self.strides == (1, 1)
            and backends.current().pointwise_train_as_matmul
        )

    def conv(self, inputs, training=False):
        """The bias-free convolution alone (what feeds FusedBatchNormV3)."""
        if self._pointwise_as_matmul(training):
            kernel = tf.cast(tf.reshape(self.kernel, (-1, self.filters)), self.compute_dtype)
            out = tf.matmul(tf.reshape(inputs, (-1, kernel.shape[0])), kernel)
            height, width = inputs.shape[1], inputs.shape[2]
            if height is not None and width is not None:  # constant target shape: no shape ops
                out = tf.reshape(out, (-1, height, width, self.filters))
            else:
                out = tf.reshape(out, tf.concat([tf.shape(inputs)[:3], [self.filters]], 0))
            out.set_shape(inputs.shape[:3].concatenate([self.filters]))
            return out
        return tf.nn.conv2d(
            inputs, tf.cast(self.kernel, self.compute_dtype), strides=(1,) + self.strides + (1,),
            padding=self.padding.upper(),
        )

    def batch_norm(self, x, training=False):
        """FusedBatchNormV3 of `x` (unfused while avoided); in training also assigns the moving statistics."""
        training = bool(training) and self.trainable
        y, updates = _ops.batch_norm(
            x, self.gamma, self.beta, self.moving_mean, self.moving_variance,
            epsilon=self.epsilon, momentum=self.momentum, training=training,
        )
        if updates is not None:
            assign_finite_moving_statistics((self.moving_mean, self.moving_variance), updates)
        return y

    def batch_norm_act_reason(self, training=True, activation=None):
        """None when a training step normalizes, (adds,) and activates in one ``TfmetalExt>BatchNormAct``.

        Else why it runs FusedBatchNormV3 and a separate activation: see
        `tfmetal_ext.layers._ops.batch_norm_act_reason` (the backend table's
        ``custom_batch_norm_act`` row decides, per backend and CPU
        configuration, from measurements). `activation` defaults to this
        layer's (a `ResidualBlock` passes its own for the last conv).
        """
        training = bool(training) and self.trainable
        return _ops.batch_norm_act_reason(self.compute_dtype, activation or self.activation, training)

    def conv_batch_norm_act(self, inputs, side=None, activation=None):
        """Training step: conv, then batch norm + `side` + activation as one ``TfmetalExt>BatchNormAct``.

        The moving statistics are updated as in `batch_norm` (Keras'
        formula, kept on a non-finite step). Call only where
        `batch_norm_act_reason` is None.
        """
        x = self.conv(inputs, training=True)
        y, (new_mean, new_variance) = _ops.batch_norm_act(
            x, self.gamma, self.beta, self.moving_mean.value, self.moving_variance.value, epsilon=self.epsilon,
            momentum=self.momentum, activation=activation or self.activation,
            side=None if side is None else tf.cast(side, x.dtype),
        )
        # The op's update is already guarded (unchanged on a non-finite batch).
        self.moving_mean.assign(new_mean)
        self.moving_variance.assign(new_variance)
        return y

    def call(self, inputs, training=False, side=None, side_activation=None):
        # `side` / `side_activation`: a ResidualBlock's shortcut and activation for its last conv, passed
        # only where `batch_norm_act_reason(True, side_activation)` is None (through __call__, so the op
        # is in this layer's name scope and the fusion report credits this layer).
        training = bool(training) and self.trainable
        if side is not None:
            return self.conv_batch_norm_act(inputs, side=side, activation=side_activation)
        if training and self.batch_norm_act_reason(training) is None:
            return self.conv_batch_norm_act(inputs)
        y = self.batch_norm(self.conv(inputs, training=training), training=training)
        if self.activation == "linear":
            return y
        # The activation op must read FusedBatchNormV3's output 0 directly to fuse.
        return _ops.FUSABLE_ACTIVATIONS[self.activation](y)

    def compute_output_shape(self, input_shape):
        dims = []
        for size, k, s in zip(input_shape[1:3], self.kernel_size, self.strides):
            if size is None:
                dims.append(None)
            elif self.padding == "same":
                dims.append(-(-size // s))
            else:
                dims.append((size - k) // s + 1)
        return (input_shape[0], dims[0], dims[1], self.filters)

    def folded_weights(self):
        """Kernel and bias with the batch norm (moving statistics) folded in, as numpy float32."""
        return fold_batch_norm(
            self.kernel, None, self.gamma, self.beta, self.moving_mean, self.moving_variance, self.epsilon
        )

    def fold(self, name=None):
        """An inference-only `FusedConv2D` equal to this layer in inference mode.

        The batch norm is folded into the convolution:
        ``kernel * gamma / sqrt(var + eps)`` and ``beta - mean * gamma / sqrt(var + eps)``.

        Args:
            name: name of the new layer (default: this layer's name + ``"_folded"``).

        Returns:
            A built `tfmetal_ext.layers.FusedConv2D` with the folded weights set.

        Raises:
            ValueError: if this layer is not built.
        """
        if not self.built:
            raise ValueError(f"Only a built layer can be folded. Received: layer={self.name!r} (not built)")
        kernel, bias = self.folded_weights()
        conv = self._folded_class()(
            self.filters, self.kernel_size, strides=self.strides, padding=self.padding,
            activation=None if self.activation == "linear" else self.activation, use_bias=True,
            name=name or f"{self.name}_folded", dtype=self.dtype_policy,
        )
        conv.build((None,) * (len(kernel.shape) - 1) + (kernel.shape[-2],))  # (batch, spatial..., in)
        conv.kernel.assign(kernel)
        conv.bias.assign(bias)
        return conv

    def _folded_class(self):
        from tfmetal_ext.layers.conv import FusedConv2D  # lazy: sibling module

        return FusedConv2D

    def get_config(self):
        config = super().get_config()
        ser = keras.saving.serialize_keras_object
        config.update(
            {
                "filters": self.filters,
                "kernel_size": self.kernel_size,
                "strides": self.strides,
                "padding": self.padding,
                "activation": self.activation,
                "momentum": self.momentum,
                "epsilon": self.epsilon,
                "kernel_initializer": ser(self.kernel_initializer),
                "kernel_regularizer": ser(self.kernel_regularizer),
                "kernel_constraint": ser(self.kernel_constraint),
                "gamma_initializer": ser(self.gamma_initializer),
                "beta_initializer": ser(self.beta_initializer),
                "moving_mean_initializer": ser(self.moving_mean_initializer),
                "moving_variance_initializer": ser(self.moving_variance_initializer),
                "gamma_regularizer": ser(self.gamma_regularizer),
                "beta_regularizer": ser(self.beta_regularizer),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class ConvBNAct1D(ConvBNAct):
    """1-D convolution without bias, batch normalization and an activation, fused: `ConvBNAct` for sequences.

    Numerically ``Conv1D(use_bias=False)`` + ``BatchNormalization`` +
    ``Activation`` with the same weights (the kernel is a Conv1D kernel,
    ``(kernel_size, in, filters)``). Emits ``ExpandDims -> Conv2D ->
    FusedBatchNormV3 -> act -> Squeeze``: the batch norm and the activation
    run on the 4-D ``(batch, 1, steps, filters)`` tensor, so the same fusions
    as `ConvBNAct` form (``_FusedConv2D[FusedBatchNorm, act]`` at inference
    on CPU, ``_FusedBatchNormEx`` where the backend fuses batch norm + Relu).
    Keras' own Conv1D -> BatchNormalization fuses nothing (its batch norm
    never emits FusedBatchNormV3).

    Args:
        filters: number of output channels, a positive integer.
        kernel_size: an int (or a 1-tuple).
        strides: an int (or a 1-tuple).
        padding: ``"same"``, ``"valid"`` or ``"causal"``.
        **kwargs: as `ConvBNAct` (activation, momentum, epsilon,
            initializers, regularizers, constraint, base layer arguments).

    Input shape:
        3-D tensor ``(batch, steps, channels)`` (channels_last).

    Output shape:
        3-D tensor ``(batch, new_steps, filters)``.

    Raises:
        ValueError: on an invalid argument.

    >>> layer = ConvBNAct1D(16, 3, padding="causal")
    >>> layer(tf.zeros([2, 8, 3])).shape
    TensorShape([2, 8, 16])
    """

    def __init__(self, filters, kernel_size, strides=1, padding="same", **kwargs):
        from tfmetal_ext.layers import _contraction as C

        (k,) = C.positive_int_tuple(kernel_size, 1, "kernel_size")
        (s,) = C.positive_int_tuple(strides, 1, "strides")
        pad = padding.lower() if isinstance(padding, str) else padding
        if pad not in _PADDINGS + ("causal",):
            raise ValueError(f"`padding` must be one of {_PADDINGS + ('causal',)}. Received: padding={padding!r}")
        super().__init__(filters, (1, k), strides=(1, s), padding="valid" if pad == "causal" else pad, **kwargs)
        self.kernel_size, self.strides, self.padding = (k,), (s,), pad
        self.input_spec = keras.layers.InputSpec(ndim=3)

    def build(self, input_shape):
        super().build(input_shape)  # the kernel is kernel_size + (channels, filters): Conv1D's layout
        self.input_spec = keras.layers.InputSpec(ndim=3, axes={-1: input_shape[-1]})

    def conv(self, inputs, training=False):
        """The bias-free convolution alone, on the 4-D ``(batch, 1, steps, channels)`` tensor."""
        padding = self.padding
        if padding == "causal":
            inputs = tf.pad(inputs, [[0, 0], [self.kernel_size[0] - 1, 0], [0, 0]])
            padding = "valid"
        kernel = tf.cast(tf.expand_dims(self.kernel, 0), self.compute_dtype)
        return tf.nn.conv2d(
            tf.expand_dims(inputs, 1), kernel, strides=(1, 1, self.strides[0], 1), padding=padding.upper()
        )

    def call(self, inputs, training=False):
        return tf.squeeze(super().call(inputs, training=training), axis=1)

    def compute_output_shape(self, input_shape):
        size, k, s = input_shape[1], self.kernel_size[0], self.strides[0]
        if size is not None:
            size = -(-size // s) if self.padding in ("same", "causal") else (size - k) // s + 1
        return (input_shape[0], size, self.filters)

    def fold(self, name=None):
        """An inference-only `FusedConv1D` equal to this layer in inference mode (batch norm folded in).

        Raises:
            ValueError: if this layer is not built.
        """
        return super().fold(name)

    def _folded_class(self):
        from tfmetal_ext.layers.conv1d import FusedConv1D  # lazy: sibling module

        return FusedConv1D


# ----------------------------------------------------------------------------
# Inspection rule: what ConvBNAct should become (measured on CPU, TF 2.21).


def _conv_bn_act_rule(layer, ctx):
    custom = batch_norm_act_expectation(layer, ctx, layer.activation)
    if custom is not None:
        return custom
    act_op = catalog.ACTIVATION_OPS.get(layer.activation)  # None for linear
    dtype = layer.compute_dtype
    if ctx.mode == "predict":
        pattern, ideal_op = "conv2d_batchnorm_act", fusion.FUSED_CONV2D
        ideal = ("FusedBatchNorm",) + ((act_op,) if act_op else ())
    else:
        pattern, ideal_op, ideal = "batchnorm_act", fusion.FUSED_BATCH_NORM_EX, ()

    def exp(op, fused_ops, reason=None):
        return catalog.Expectation(pattern, op, fused_ops, ideal, reason=reason, ideal_op=ideal_op)

    blocked = catalog.dtype_block(ctx, dtype, "batchnorm_act")
    if blocked:
        return exp(None, None, blocked)
    if ctx.mode == "predict" and catalog.conv_batch_norm_fuses(ctx, dtype):
        return exp(fusion.FUSED_CONV2D, ideal)
    bn = catalog.fusion_for(ctx, "batchnorm_act")
    if not bn.fuses:
        return exp(None, None, f"{catalog.where(ctx)}: {dtype} conv + batch norm is not fused in {ctx.mode}")
    why = None
    if ctx.mode == "predict":
        cb = catalog.fusion_for(ctx, "conv2d_batchnorm_act")
        why = (
            f"{dtype}: Conv2D + FusedBatchNorm fuses only in {'/'.join(cb.dtypes)}" if cb.fuses
            else f"{catalog.where(ctx)}: {cb.why_not}"
        )
    if act_op not in bn.requires_act:
        relu_only = f"{act_op or 'no activation'}: FusedBatchNormV3 fuses only with Relu (_FusedBatchNormEx)"
        return exp(None, None, "; ".join(r for r in (why if ctx.backend == "cpu" else None, relu_only) if r))
    blocked = catalog.batch_norm_ex_block(ctx, dtype, layer.filters)
    if blocked:
        return exp(None, None, blocked)
    return exp(fusion.FUSED_BATCH_NORM_EX, (), why)


catalog.register_rule(ConvBNAct, catalog.unless_avoided("fused_batch_norm", _conv_bn_act_rule))
