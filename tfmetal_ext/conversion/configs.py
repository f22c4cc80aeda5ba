"""Stock layer configurations: what a fused class is built from, and why a configuration cannot be."""

from __future__ import annotations

import keras

CONV_KEYS = (
    "filters", "kernel_size", "strides", "padding", "data_format", "dilation_rate", "groups", "activation",
    "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer", "bias_regularizer",
    "activity_regularizer", "kernel_constraint", "bias_constraint",
)
DEPTHWISE_KEYS = (
    "kernel_size", "strides", "padding", "depth_multiplier", "data_format", "dilation_rate", "activation",
    "use_bias", "depthwise_initializer", "bias_initializer", "depthwise_regularizer", "bias_regularizer",
    "activity_regularizer", "depthwise_constraint", "bias_constraint",
)
DENSE_KEYS = (
    "units", "activation", "use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer",
    "bias_regularizer", "kernel_constraint", "bias_constraint",
)
EINSUM_DENSE_KEYS = (
    "equation", "output_shape", "activation", "bias_axes", "kernel_initializer", "bias_initializer",
    "kernel_regularizer", "bias_regularizer", "activity_regularizer", "kernel_constraint", "bias_constraint",
)
BN_KEYS = (
    "axis", "momentum", "epsilon", "center", "scale", "beta_initializer", "gamma_initializer",
    "moving_mean_initializer", "moving_variance_initializer", "beta_regularizer", "gamma_regularizer",
    "beta_constraint", "gamma_constraint", "synchronized", "renorm", "renorm_clipping", "renorm_momentum",
)
LN_KEYS = (
    "axis", "epsilon", "center", "scale", "rms_scaling", "beta_initializer", "gamma_initializer",
    "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint",
)
MHA_KEYS = (
    "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "output_shape", "attention_axes", "sliding_window",
    "kernel_initializer", "bias_initializer", "kernel_regularizer", "bias_regularizer", "activity_regularizer",
    "kernel_constraint", "bias_constraint", "use_gate", "seed",
)
RMS_NORM_KEYS = ("axis", "epsilon")
DROPOUT_KEYS = ("rate", "noise_shape", "seed")
EMBEDDING_KEYS = (
    "input_dim", "output_dim", "embeddings_initializer", "embeddings_regularizer", "activity_regularizer",
    "embeddings_constraint", "mask_zero", "lora_rank", "lora_alpha",
)
RNN_KEYS = (
    "units", "activation", "recurrent_activation", "use_bias", "kernel_initializer", "recurrent_initializer",
    "bias_initializer", "unit_forget_bias", "kernel_regularizer", "recurrent_regularizer", "bias_regularizer",
    "activity_regularizer", "kernel_constraint", "recurrent_constraint", "bias_constraint", "dropout",
    "recurrent_dropout", "seed", "return_sequences", "return_state", "go_backwards", "stateful", "unroll",
    "zero_output_for_mask", "reset_after",
)


# Constructor arguments that hold an activation (any callable: a Keras or TF function, a lambda).
ACTIVATION_KEYS = ("activation", "recurrent_activation")


def activation_arg(act):
    """An activation as a constructor argument: its Keras name when it has one, else the callable itself.

    A TensorFlow function that is a Keras activation's op (``tf.nn.swish``) gives that name
    (`inspect.catalog.function_activation_name`), so it folds; a lambda or custom function
    stays the callable (which a config cannot carry: Keras cannot deserialize it either).
    """
    from tfmetal_ext.inspect.catalog import function_activation_name

    name = function_activation_name(act)
    return act if name.startswith("custom") else name


def common_kwargs(layer):
    return {"name": layer.name, "dtype": layer.dtype_policy, "trainable": layer.trainable}


def make_layer(cls, layer, keys, **overrides):
    """``cls`` built from `layer`'s config (`keys`), or the ValueError with the fused layer's own reason."""
    config = layer.get_config()
    kwargs = {k: config[k] for k in keys if k in config}
    for k in ACTIVATION_KEYS:
        if k in kwargs and not isinstance(kwargs[k], str):
            kwargs[k] = activation_arg(getattr(layer, k, None))
    if "activity_regularizer" in keys and layer.activity_regularizer is not None:
        kwargs["activity_regularizer"] = keras.regularizers.serialize(layer.activity_regularizer)
    kwargs.update(common_kwargs(layer))
    if getattr(layer, "lora_enabled", False):
        # The fused drop-ins take LoRA as Keras does; the effective alpha is passed explicitly
        # (Keras' own build() re-derives it from the rank).
        kwargs.update(lora_rank=layer.lora_rank, lora_alpha=layer.lora_alpha)
    kwargs.update(overrides)
    return cls(**kwargs)


def unsupported(layer, cls, keys, overrides=None):
    """Why `layer` cannot become `cls` (quantized, LoRA, or a configuration `cls` rejects), or None."""
    if getattr(layer, "quantization_mode", None):
        return f"quantized ({layer.quantization_mode}) layers are kept"
    if getattr(layer, "lora_enabled", False) and not hasattr(cls, "enable_lora"):
        return f"LoRA-enabled layers are kept ({cls.__name__} has no LoRA)"
    try:  # a throwaway instance: does the fused layer accept this configuration?
        make_layer(cls, layer, keys, **(overrides or {}))
    except ValueError as e:
        return f"{cls.__name__} does not support this configuration: {e}"
    return None


def last_axis_only(axis, rank):
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    return [a + rank if a < 0 else a for a in axes] == [rank - 1]


def node_input_shape(node):
    return tuple(node.input_tensors[0].shape) if node.input_tensors else ()


def bn_reason(bn, input_shape):
    """Why `bn` cannot become FusedBatchNorm / join ConvBNAct, or None."""
    rank = len(input_shape)
    if rank < 2:
        return f"FusedBatchNormV3 needs a batch and a channels axis; this input is {rank}-D"
    if not last_axis_only(bn.axis, rank):
        return f"axis={bn.axis} is not the last (channels_last) axis"
    # FusedBatchNorm takes these too, but runs the stock computation for them: nothing to gain.
    if getattr(bn, "renorm", False) or getattr(bn, "synchronized", False):
        return "batch renormalization / synchronized batch norm (FusedBatchNorm would run the stock computation)"
    from tfmetal_ext.layers import _ops

    if float(bn.epsilon) < _ops.MIN_FUSED_EPSILON:
        return f"epsilon={bn.epsilon} is below FusedBatchNormV3's minimum {_ops.MIN_FUSED_EPSILON}"
    return None


def conv_bn_reason(conv, bn):
    """Why a stock Conv2D -> BatchNormalization pair cannot become one ConvBNAct, or None."""
    if max(conv.dilation_rate) > 1:
        return "dilation_rate > 1"
    if not (bn.center and bn.scale):
        return "batch norm without center/scale"
    if bn.beta_constraint is not None or bn.gamma_constraint is not None:
        return "batch norm weight constraints"
    if conv.activity_regularizer is not None:
        return "activity regularizer on the conv"
    if conv.use_bias and (conv.bias_regularizer is not None or conv.bias_constraint is not None):
        return "conv bias with a regularizer or constraint"
    from tfmetal_ext.layers import _ops

    try:
        _ops.check_batch_norm_args(float(bn.momentum), float(bn.epsilon))
    except ValueError as e:
        return str(e)
    if any(getattr(bn, k, None) for k in ("renorm", "synchronized")):
        return "batch renormalization / synchronized batch norm"
    return None


# ---- Conv1D, SeparableConv2D, grouped Conv2D (the planners of tfmetal_ext.layers.conv1d / separable)
CONV1D_KEYS = CONV_KEYS
SEPARABLE_KEYS = (
    "filters", "kernel_size", "strides", "padding", "data_format", "dilation_rate", "depth_multiplier",
    "activation", "use_bias", "depthwise_initializer", "pointwise_initializer", "bias_initializer",
    "depthwise_regularizer", "pointwise_regularizer", "bias_regularizer", "activity_regularizer",
    "depthwise_constraint", "pointwise_constraint", "bias_constraint",
)
# A grouped Conv2D with one input channel per group, as a depthwise conv: Conv2D key -> DepthwiseConv2D key.
GROUPED_AS_DEPTHWISE_KEYS = {
    "kernel_size": "kernel_size", "strides": "strides", "padding": "padding", "data_format": "data_format",
    "dilation_rate": "dilation_rate", "activation": "activation", "use_bias": "use_bias",
    "kernel_initializer": "depthwise_initializer", "bias_initializer": "bias_initializer",
    "kernel_regularizer": "depthwise_regularizer", "bias_regularizer": "bias_regularizer",
    "bias_constraint": "bias_constraint",
}


def grouped_as_depthwise_reason(conv, in_channels):
    """Why a grouped stock Conv2D is not a depthwise conv (one input channel per group), or None."""
    if in_channels is None or conv.groups != in_channels:
        return (
            f"groups={conv.groups} with {in_channels} input channels: a grouped conv is a depthwise conv only "
            "with one input channel per group; other groupings have no fusion-first counterpart (Keras runs "
            "them through an XLA-compiled function)"
        )
    if conv.kernel_constraint is not None:
        return "a kernel constraint: it acts on the (kh, kw, 1, filters) kernel, not on the depthwise layout"
    return None
