"""ResNet v1 residual blocks whose add + ReLU lands where the remapper fuses it."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers.conv_bn import ConvBNAct

_ACTIVATIONS = fusion.CONTRACTION_ACTIVATIONS
EXPANSION = 4  # bottleneck output channels = EXPANSION * filters (ResNet-50/101/152)


def _check_common(filters, strides, activation):
    if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
        raise ValueError(f"`filters` must be a positive integer. Received: filters={filters!r}")
    if isinstance(strides, bool) or not isinstance(strides, int) or strides < 1:
        raise ValueError(f"`strides` must be a positive integer. Received: strides={strides!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {_ACTIVATIONS}. Received: activation={activation!r}")


def _merge(y, shortcut, activation):
    # Add with the residual branch's last op as input 0 and the activation reading the Add
    # directly: the shape of FusedBatchNormV3 + side input + Relu (GPU) and of
    # Conv2D + BiasAdd + Add + Relu (CPU oneDNN).
    return _ops.FUSABLE_ACTIVATIONS[activation](tf.add(y, shortcut))


class _BaseResidualBlock(keras.layers.Layer):
    """Arguments, sublayer construction and shapes shared by the residual blocks.

    Subclasses provide ``_conv(filters, kernel_size, strides, activation, name)``
    (the conv sublayer type) and ``_tail_rule()`` (the fusion rule of the last
    conv, the one feeding the Add).
    """

    _tfmetal_container = True  # fusion reports list the sublayers (see inspect.report.LayerIndex)

    def __init__(self, filters, strides=1, bottleneck=False, activation="relu", **kwargs):
        super().__init__(**kwargs)
        _check_common(filters, strides, activation)
        if not isinstance(bottleneck, bool):
            raise ValueError(f"`bottleneck` must be a bool. Received: bottleneck={bottleneck!r}")
        self.filters = filters
        self.strides = strides
        self.bottleneck = bottleneck
        self.activation = activation
        self.out_channels = filters * EXPANSION if bottleneck else filters
        self.input_spec = keras.layers.InputSpec(ndim=4)

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(f"The channel dimension of the input must be known. Received: input_shape={input_shape}")
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: channels})
        self.convs = _block_convs(self, self._conv)
        self.convs[-1]._fusion_rule = self._tail_rule()
        self.projection = None
        if _needs_projection(self.strides, channels, self.out_channels):
            self.projection = self._conv(self.out_channels, 1, self.strides, None, "projection")
        _build_chain(self.convs, self.projection, input_shape)

    def compute_output_shape(self, input_shape):
        return _output_shape(input_shape, self.strides, self.out_channels)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "filters": self.filters,
                "strides": self.strides,
                "bottleneck": self.bottleneck,
                "activation": self.activation,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class ResidualBlock(_BaseResidualBlock):
    """A ResNet v1 residual block built from `ConvBNAct`.

    Basic block (``bottleneck=False``): 3x3 conv-BN-act, 3x3 conv-BN, add the
    shortcut, act; ``filters`` output channels. Bottleneck block
    (``bottleneck=True``): 1x1 conv-BN-act, 3x3 conv-BN-act, 1x1 conv-BN, add,
    act; ``4 * filters`` output channels (the ResNet-50 expansion). The stride
    sits on the 3x3 conv (ResNet v1.5, as torchvision), not on the first 1x1.
    The shortcut is the identity, or a 1x1 conv + BN projection when
    ``strides != 1`` or the channel count changes.

    The last batch norm's output goes straight into the Add and the Add
    straight into the activation, which is what the remapper matches:

    | backend | predict | train step |
    |---|---|---|
    | Metal, CUDA | tail: `_FusedBatchNormEx` with side input (BN + Add + Relu) | same, CUDA: half, C % 4 == 0 |
    | CPU + oneDNN, float32 | convs: `_FusedConv2D[FusedBatchNorm(, Relu)]`; add + relu unfused | `_FusedBatchNormEx` for each conv-BN-relu; tail unfused |
    | CPU + oneDNN, bfloat16 | `_FusedBatchNormEx` for each conv-BN-relu; tail unfused | same |
    | CPU, `fold()`ed | tail: `_FusedConv2D[BiasAdd, Add, Relu]`, others `_FusedConv2D[BiasAdd, Relu]` | inference only |

    Folding: `fold()` returns a new inference-only `FoldedResidualBlock`
    whose convolutions carry the batch norms in kernel and bias (the CPU has
    no BN + side input kernel, but it fuses conv + bias + add + relu).

    Args:
        filters: convolution filters, a positive integer (the block outputs
            ``4 * filters`` channels when ``bottleneck``).
        strides: stride of the block (an int >= 1), applied by the 3x3 conv
            and the projection.
        bottleneck: bottleneck (1x1-3x3-1x1) instead of basic (3x3-3x3).
        activation: ``"relu"`` (the only one fused with the add),
            ``"relu6"``, ``"elu"`` or ``"leaky_relu"``.
        momentum: batch norm momentum.
        epsilon: batch norm epsilon.
        kernel_initializer: initializer of every convolution kernel.
        kernel_regularizer: regularizer of every convolution kernel.
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``).

    Input shape:
        4D tensor ``(batch, height, width, channels)``.

    Output shape:
        4D tensor ``(batch, ceil(height / strides), ceil(width / strides),
        filters or 4 * filters)``.

    Raises:
        ValueError: on an invalid argument.

    >>> block = ResidualBlock(8, strides=2)
    >>> block(tf.zeros([2, 8, 8, 4])).shape
    TensorShape([2, 4, 4, 8])
    """

    def __init__(
        self,
        filters,
        strides=1,
        bottleneck=False,
        activation="relu",
        momentum=0.99,
        epsilon=1e-3,
        kernel_initializer="he_normal",
        kernel_regularizer=None,
        **kwargs,
    ):
        super().__init__(filters, strides, bottleneck, activation, **kwargs)
        self.momentum, self.epsilon = _ops.check_batch_norm_args(momentum, epsilon)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def _conv(self, filters, kernel_size, strides, activation, name):
        return ConvBNAct(
            filters, kernel_size, strides=strides, activation=activation, momentum=self.momentum,
            epsilon=self.epsilon, kernel_initializer=self.kernel_initializer,
            kernel_regularizer=self.kernel_regularizer, name=name, dtype=self.dtype_policy,
        )

    def _tail_rule(self):
        return catalog.unless_avoided("fused_batch_norm", _tail_rule)

    def batch_norm_act_reason(self, training=True):
        """None when the last conv's batch norm, the add and the activation run as one ``TfmetalExt>BatchNormAct``.

        Else why they run as FusedBatchNormV3, Add and the activation (see
        `ConvBNAct.batch_norm_act_reason`).
        """
        return self.convs[-1].batch_norm_act_reason(training, activation=self.activation)

    def call(self, inputs, training=False):
        x = inputs
        for conv in self.convs[:-1]:
            x = conv(x, training=training)
        shortcut = inputs if self.projection is None else self.projection(inputs, training=training)
        if training and self.batch_norm_act_reason(training) is None:
            # The add and the activation join the last batch norm: one op forward, one backward.
            return self.convs[-1](x, training=training, side=shortcut, side_activation=self.activation)
        y = self.convs[-1](x, training=training)
        return _merge(y, shortcut, self.activation)

    def fold(self, name=None):
        """An inference-only `FoldedResidualBlock` equal to this block in inference mode.

        Each conv + batch norm becomes a `FusedConv2D` with the batch norm
        (moving statistics) folded into kernel and bias, so on CPU with oneDNN
        the last conv, the add and the activation fuse into
        ``_FusedConv2D[BiasAdd, Add, Relu]``.

        Args:
            name: name of the new block (default: this block's name + ``"_folded"``).

        Returns:
            A built `FoldedResidualBlock` with the folded weights set.

        Raises:
            ValueError: if the block is not built.
        """
        if not self.built:
            raise ValueError(f"Only a built block can be folded. Received: layer={self.name!r} (not built)")
        folded = FoldedResidualBlock(
            self.filters, strides=self.strides, bottleneck=self.bottleneck, activation=self.activation,
            name=name or f"{self.name}_folded", dtype=self.dtype_policy,
        )
        folded.build((None, None, None, self.input_spec.axes[-1]))
        pairs = list(zip(self.convs, folded.convs))
        if self.projection is not None:
            pairs.append((self.projection, folded.projection))
        for src, dst in pairs:
            kernel, bias = src.folded_weights()
            dst.kernel.assign(kernel)
            dst.bias.assign(bias)
        return folded

    def get_config(self):
        config = super().get_config()
        ser = keras.saving.serialize_keras_object
        config.update(
            {
                "momentum": self.momentum,
                "epsilon": self.epsilon,
                "kernel_initializer": ser(self.kernel_initializer),
                "kernel_regularizer": ser(self.kernel_regularizer),
            }
        )
        return config


def _needs_projection(strides, channels, out_channels):
    return strides != 1 or channels != out_channels


def _block_convs(block, make):
    """The residual branch: (filters, kernel, strides, activation, name) per conv, made by `make`."""
    f, s, act = block.filters, block.strides, block.activation
    if block.bottleneck:
        specs = [(f, 1, 1, act, "conv1"), (f, 3, s, act, "conv2"), (f * EXPANSION, 1, 1, None, "conv3")]
    else:
        specs = [(f, 3, s, act, "conv1"), (f, 3, 1, None, "conv2")]
    convs = [make(*spec) for spec in specs]
    convs[-1]._residual_activation = act  # read by the tail's fusion rule
    return convs


def _build_chain(convs, projection, input_shape):
    shape = tuple(input_shape)
    for conv in convs:
        conv.build(shape)
        shape = conv.compute_output_shape(shape)
    if projection is not None:
        projection.build(tuple(input_shape))


def _output_shape(input_shape, strides, channels):
    size = [None if d is None else -(-d // strides) for d in input_shape[1:3]]
    return (input_shape[0], size[0], size[1], channels)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FoldedResidualBlock(_BaseResidualBlock):
    """Inference-only `ResidualBlock` with every batch norm folded into its conv.

    Made by `ResidualBlock.fold()`. Each conv is a `FusedConv2D` (conv +
    BiasAdd [+ act]); the last one's BiasAdd feeds the Add, the Add feeds the
    activation:

    | backend | predict |
    |---|---|
    | Metal | `_FusedConv2D[BiasAdd, Relu]` for the inner convs, `[BiasAdd]` for the last; add + relu unfused |
    | CUDA | inner 3x3 convs `_FusedConv2D[BiasAdd, Relu]`; add + relu unfused |
    | CPU + oneDNN (float32, bfloat16) | last conv + add + relu: `_FusedConv2D[BiasAdd, Add, Relu]`; inner `[BiasAdd, Relu]` |

    Calling it in training mode gives the same (inference) output: it has no
    batch statistics.

    Args:
        filters: as `ResidualBlock`.
        strides: as `ResidualBlock`.
        bottleneck: as `ResidualBlock`.
        activation: as `ResidualBlock`.
        **kwargs: base layer arguments.

    Input shape:
        4D tensor ``(batch, height, width, channels)``.

    Output shape:
        As `ResidualBlock`.

    Raises:
        ValueError: on an invalid argument.

    >>> block = ResidualBlock(8)
    >>> _ = block(tf.zeros([2, 8, 8, 8]))
    >>> block.fold()(tf.zeros([2, 8, 8, 8])).shape
    TensorShape([2, 8, 8, 8])
    """

    def _conv(self, filters, kernel_size, strides, activation, name):
        from tfmetal_ext.layers.conv import FusedConv2D  # lazy: sibling module

        return FusedConv2D(
            filters, kernel_size, strides=strides, padding="same", activation=activation, use_bias=True,
            name=name, dtype=self.dtype_policy,
        )

    def _tail_rule(self):
        return catalog.unless_avoided("conv_bias_relu", _folded_tail_rule)

    def call(self, inputs):
        x = inputs
        for conv in self.convs:
            x = conv(x)
        shortcut = inputs if self.projection is None else self.projection(inputs)
        return _merge(x, shortcut, self.activation)


# ----------------------------------------------------------------------------
# Fusion rules for the blocks' last convolution (the one feeding the Add).


def _tail_rule(layer, ctx):
    """Last ConvBNAct of a ResidualBlock: FusedBatchNormV3 + Add(shortcut) + act (or all three as one custom op)."""
    from tfmetal_ext.layers.normalization import batch_norm_act_expectation

    custom = batch_norm_act_expectation(layer, ctx, layer._residual_activation, side=True)
    if custom is not None:
        return custom
    act_op = catalog.ACTIVATION_OPS[layer._residual_activation]
    pattern = "batchnorm_act"
    ideal = ()  # _FusedBatchNormEx (num_side_inputs=1) has no fused_ops attribute
    ideal_op = fusion.FUSED_BATCH_NORM_EX

    def exp(op, fused_ops, reason=None):
        return catalog.Expectation(pattern, op, fused_ops, ideal, reason=reason, ideal_op=ideal_op)

    dtype = layer.compute_dtype
    blocked = catalog.dtype_block(ctx, dtype, pattern)
    if blocked:
        return exp(None, None, blocked)
    bn = catalog.fusion_for(ctx, pattern)
    if act_op != "Relu":
        return exp(None, None, f"{act_op}: FusedBatchNormV3 + Add fuses only with Relu")
    if not (bn.fuses and bn.side_input):
        why = (
            f"{catalog.where(ctx)}: no FusedBatchNormV3 + side input kernel; fold() the block for "
            "_FusedConv2D[BiasAdd, Add, Relu]"
        )
        if ctx.mode == "predict" and catalog.conv_batch_norm_fuses(ctx, dtype):
            return exp(fusion.FUSED_CONV2D, ("FusedBatchNorm",), why + "; conv + batch norm fuse, add + relu stay separate")
        return exp(None, None, why)
    blocked = catalog.batch_norm_ex_block(ctx, dtype, layer.filters)
    if blocked:
        return exp(None, None, blocked)
    return exp(fusion.FUSED_BATCH_NORM_EX, ())


def _folded_tail_rule(layer, ctx):
    """Last FusedConv2D of a FoldedResidualBlock: Conv2D + BiasAdd + Add(shortcut) + act."""
    act = catalog.ACTIVATION_OPS[layer._residual_activation]
    return catalog.residual_rule(layer, ctx, act, inference_only=True)
