"""Batch and layer normalization that emit one op each way.

Keras 3 never emits a fused normalization op: its BatchNormalization and
LayerNormalization are moments + Rsqrt/Mul/Sub/Add chains that no remapper
pattern matches. These two layers are drop-ins with the same weights:
`FusedBatchNorm` emits `FusedBatchNormV3`, `FusedLayerNorm` the custom op
``TfmetalExt>LayerNorm`` (`tfmetal_ext.ops.layer_norm`).

Layer norm formulations measured (TF 2.21, 2-core x86-64 CPU shared with other
jobs; one forward+backward tf.function step giving dx, dgamma, dbeta; compute
ops after grappler; best of 5 rounds, ms):

| formulation                                     | ops | f32 4096x1024 | f32 64x128x256 | bf16 4096x1024 | bf16 64x128x256 |
|-------------------------------------------------|-----|---------------|----------------|----------------|-----------------|
| keras.layers.LayerNormalization                 |  32 | 26.2          | 9.8            | 21.1           | 7.2             |
| mean, x - mean, mean(square), rsqrt (autodiff)  |  27 | 0.93x Keras (separate run)     |                |                 |
| squared_difference(x, stop_gradient(mean))      |  27 | 0.93x Keras (separate run)     |                |                 |
| same math, hand-written tf.custom_gradient      |  18 | 20.3          | 7.6            | 15.1           | 5.6             |
| FusedBatchNormV3, [1, rows, C, 1] NCHW          |  12 | 24.4          | 10.2           | 15.2           | 8.9             |
| TfmetalExt>LayerNorm + LayerNormGrad (used) [1] |   4 | 3.0           | 1.7            | 4.2            | 2.5             |

[1] `benchmarks/bench_ops.py`, medians of 3 alternating rounds (Keras in the same run: 24.5, 9.5,
25.7, 10.0 ms; the pure-TF reference: 20.3, 7.4, 21.1, 7.3 ms). Its 4 ops are the two custom ops
and the two ReadVariableOps of gamma and beta. Float32 at 4096x1024 moves 80 MB (x, y, dy, x, dx)
at 71% of the copy bandwidth measured in the same run.

The custom op is used wherever the op library is available; without it
(no compiler, ``TFMETAL_EXT_REFERENCE_OPS=1``, or a GPU the library has no
kernel for) `tfmetal_ext.ops.layer_norm` runs its pure-TF reference, the
hand-written custom-gradient form (the fastest composite above).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf
from keras import constraints, initializers, regularizers

from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import Expectation, register_rule
from tfmetal_ext.layers._ops import batch_norm, check_batch_norm_args
from tfmetal_ext.ops.layer_norm import LAYER_NORM_OP, layer_norm, uses_kernel


def _check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"`epsilon` must be a positive number. Received: epsilon={epsilon!r}")
    return float(epsilon)


def _check_last_axis(axis, rank):
    """`axis` normalized to ``rank - 1``, or ValueError."""
    given = axis
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise ValueError(f"Only the last axis can be normalized. Received: axis={given!r}")
        axis = axis[0]
    if axis < 0:
        axis += rank
    if axis != rank - 1:
        raise ValueError(
            f"Only the last axis (channels_last) is supported for rank-{rank} inputs. "
            f"Received: axis={given!r}"
        )
    return axis


def _check_axis_arg(axis):
    value = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`axis` must be an integer (the last axis). Received: axis={axis!r}")
    return value


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedBatchNorm(keras.layers.Layer):
    """Batch normalization as one `FusedBatchNormV3` op; a drop-in for `BatchNormalization`.

    Same weights as `keras.layers.BatchNormalization` (gamma, beta,
    moving_mean, moving_variance, in that order), same moving-statistics
    update (``moving * momentum + batch * (1 - momentum)`` with the biased
    batch variance), same inference behaviour (``trainable=False`` means
    inference mode, also during `fit`). Under mixed precision the input stays
    in the compute dtype and the weights and statistics stay float32.

    What it becomes:

    | device | op                                   | with a following ReLU                                   |
    |--------|--------------------------------------|---------------------------------------------------------|
    | CPU    | FusedBatchNormV3 (+ Grad in training) | `_FusedBatchNormEx` with oneDNN (float32, bfloat16)      |
    | CUDA   | FusedBatchNormV3 (cuDNN)              | `_FusedBatchNormEx`: float32/half; training needs half, C % 4 == 0 |
    | Metal  | FusedBatchNormV3                      | `_FusedBatchNormEx` float32/half                        |

    At inference on CPU (float32) a preceding ``Conv2D(use_bias=False)``
    folds it into `_FusedConv2D[FusedBatchNorm(, Relu)]`. While
    ``tfmetal_ext.configure(avoid_fusions=["fused_batch_norm"])`` is in force
    (set before tracing), it emits moments + Rsqrt/Mul/Add instead of
    FusedBatchNormV3: same statistics and updates, nothing fused.

    Args:
        axis: the channels axis; only the last axis is supported.
        momentum: momentum of the moving averages.
        epsilon: added to the variance; at least 1.001e-5 (cuDNN's minimum).
        center: learn an offset `beta`; when False no beta weight exists.
        scale: learn a scale `gamma`; when False no gamma weight exists.
        beta_initializer, gamma_initializer, moving_mean_initializer,
        moving_variance_initializer: weight initializers.
        beta_regularizer, gamma_regularizer: weight regularizers.
        beta_constraint, gamma_constraint: weight constraints.
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`). The
            stock layer's `renorm`, `renorm_clipping`, `renorm_momentum`,
            `synchronized` and Keras 2's `virtual_batch_size` are accepted at
            their defaults only.

    Input shape:
        ``(batch, channels)`` or ``(batch, height, width, channels)``.

    Output shape:
        Same as the input.

    Raises:
        ValueError: on a bad argument, an axis other than the last, an input
            rank other than 2 or 4, or renorm / virtual batches /
            synchronized statistics.

    Example:

    >>> bn = FusedBatchNorm()
    >>> y = bn(np.random.rand(8, 4, 4, 16).astype("float32"), training=True)
    >>> [w.name for w in bn.weights]
    ['gamma', 'beta', 'moving_mean', 'moving_variance']
    """

    def __init__(
        self,
        axis=-1,
        momentum=0.99,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        unsupported = {
            "renorm": False,
            "renorm_clipping": None,
            "renorm_momentum": 0.99,
            "virtual_batch_size": None,
            "synchronized": False,
        }
        for key, default in unsupported.items():
            value = kwargs.pop(key, default)
            if value != default:
                raise ValueError(
                    f"FusedBatchNorm does not support `{key}` (FusedBatchNormV3 has no such mode); "
                    f"use keras.layers.BatchNormalization. Received: {key}={value!r}"
                )
        super().__init__(**kwargs)
        self.axis = _check_axis_arg(axis)
        self.momentum, self.epsilon = check_batch_norm_args(momentum, epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.moving_mean_initializer = initializers.get(moving_mean_initializer)
        self.moving_variance_initializer = initializers.get(moving_variance_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.gamma = None
        self.beta = None
        self.moving_mean = None
        self.moving_variance = None

    def build(self, input_shape):
        rank = len(input_shape)
        if rank not in (2, 4):
            raise ValueError(
                "FusedBatchNorm takes 2-D (batch, channels) or 4-D NHWC inputs. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.axis = _check_last_axis(self.axis, rank)
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(f"The channels dimension must be known. Received: input_shape={tuple(input_shape)}")
        shape = (int(channels),)
        if self.scale:
            self.gamma = self.add_weight(
                name="gamma", shape=shape, initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer, constraint=self.gamma_constraint,
                trainable=True, autocast=False,
            )
        if self.center:
            self.beta = self.add_weight(
                name="beta", shape=shape, initializer=self.beta_initializer,
                regularizer=self.beta_regularizer, constraint=self.beta_constraint,
                trainable=True, autocast=False,
            )
        self.moving_mean = self.add_weight(
            name="moving_mean", shape=shape, initializer=self.moving_mean_initializer,
            trainable=False, autocast=False,
        )
        self.moving_variance = self.add_weight(
            name="moving_variance", shape=shape, initializer=self.moving_variance_initializer,
            trainable=False, autocast=False,
        )

    def call(self, inputs, training=None):
        x = tf.cast(inputs, self.compute_dtype)
        channels = self.moving_mean.shape[0]
        gamma = self.gamma.value if self.scale else tf.ones([channels], tf.float32)
        beta = self.beta.value if self.center else tf.zeros([channels], tf.float32)
        training = bool(training) and self.trainable
        flat = len(x.shape) == 2
        if flat:  # FusedBatchNormV3 is 4-D only
            x = tf.reshape(x, [-1, 1, 1, channels])
        y, updates = batch_norm(
            x, gamma, beta, self.moving_mean.value, self.moving_variance.value,
            epsilon=self.epsilon, momentum=self.momentum, training=training,
        )
        if updates is not None:
            self.moving_mean.assign(updates[0])
            self.moving_variance.assign(updates[1])
        if flat:
            y = tf.reshape(y, [-1, channels])
        return y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "axis": self.axis,
                "momentum": self.momentum,
                "epsilon": self.epsilon,
                "center": self.center,
                "scale": self.scale,
                "beta_initializer": initializers.serialize(self.beta_initializer),
                "gamma_initializer": initializers.serialize(self.gamma_initializer),
                "moving_mean_initializer": initializers.serialize(self.moving_mean_initializer),
                "moving_variance_initializer": initializers.serialize(self.moving_variance_initializer),
                "beta_regularizer": regularizers.serialize(self.beta_regularizer),
                "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
                "beta_constraint": constraints.serialize(self.beta_constraint),
                "gamma_constraint": constraints.serialize(self.gamma_constraint),
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedLayerNorm(keras.layers.Layer):
    """Layer normalization over the last axis; a drop-in for `LayerNormalization(axis=-1)`.

    Same weights (gamma, beta) and outputs as
    ``keras.layers.LayerNormalization(axis=-1)``; statistics are computed in
    float32 for float16/bfloat16 inputs, the weights stay float32. The whole
    layer is one ``TfmetalExt>LayerNorm`` op (`tfmetal_ext.ops.layer_norm`)
    forward and one ``TfmetalExt>LayerNormGrad`` backward (dx, dgamma and
    dbeta together), against Keras' 32 ops per train step; any epsilon > 0.

    What it becomes (no remapper pattern exists for layer norm anywhere):

    | device | ops per train step                                                    |
    |--------|-----------------------------------------------------------------------|
    | CPU    | TfmetalExt>LayerNorm + TfmetalExt>LayerNormGrad (CPU kernel)           |
    | Metal  | the same two ops (Metal kernel, when the op library has Metal kernels) |
    | CUDA   | no CUDA kernel: the pure-TF reference, 18 ops, on the GPU              |

    Without the op library (no compiler, or ``TFMETAL_EXT_REFERENCE_OPS=1``)
    the layer runs the same pure-TF reference: same results, 18 ops.

    Args:
        axis: the normalized axis; only the last axis is supported.
        epsilon: added to the variance.
        center: learn an offset `beta`.
        scale: learn a scale `gamma`.
        beta_initializer, gamma_initializer: weight initializers.
        beta_regularizer, gamma_regularizer: weight regularizers.
        beta_constraint, gamma_constraint: weight constraints.
        **kwargs: base layer arguments. The stock layer's ``rms_scaling`` is
            accepted only as False.

    Input shape:
        Any rank; the last dimension must be known.

    Output shape:
        Same as the input.

    Raises:
        ValueError: on a bad argument or an axis other than the last.

    Example:

    >>> ln = FusedLayerNorm()
    >>> y = ln(np.random.rand(2, 5, 8).astype("float32"))
    >>> y.shape
    TensorShape([2, 5, 8])
    """

    def __init__(
        self,
        axis=-1,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        rms_scaling = kwargs.pop("rms_scaling", False)
        if rms_scaling:
            raise ValueError(
                "FusedLayerNorm does not support `rms_scaling`; use keras.layers.RMSNormalization. "
                f"Received: rms_scaling={rms_scaling!r}"
            )
        super().__init__(**kwargs)
        self.axis = _check_axis_arg(axis)
        self.epsilon = _check_epsilon(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.gamma = None
        self.beta = None

    def build(self, input_shape):
        self.axis = _check_last_axis(self.axis, len(input_shape))
        if input_shape[-1] is None:
            raise ValueError(f"The last dimension must be known. Received: input_shape={tuple(input_shape)}")
        shape = (int(input_shape[-1]),)
        if self.scale:
            self.gamma = self.add_weight(
                name="gamma", shape=shape, initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer, constraint=self.gamma_constraint,
                trainable=True, autocast=False,
            )
        if self.center:
            self.beta = self.add_weight(
                name="beta", shape=shape, initializer=self.beta_initializer,
                regularizer=self.beta_regularizer, constraint=self.beta_constraint,
                trainable=True, autocast=False,
            )

    def call(self, inputs):
        x = tf.cast(inputs, self.compute_dtype)
        gamma = self.gamma.value if self.scale else None
        beta = self.beta.value if self.center else None
        return layer_norm(x, gamma, beta, self.epsilon)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "axis": self.axis,
                "epsilon": self.epsilon,
                "center": self.center,
                "scale": self.scale,
                "beta_initializer": initializers.serialize(self.beta_initializer),
                "gamma_initializer": initializers.serialize(self.gamma_initializer),
                "beta_regularizer": regularizers.serialize(self.beta_regularizer),
                "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
                "beta_constraint": constraints.serialize(self.beta_constraint),
                "gamma_constraint": constraints.serialize(self.gamma_constraint),
            }
        )
        return config


# ----------------------------------------------------------------------------
# Inspection rules.

REASON_NO_RELU = "FusedBatchNormV3 (one op); no ReLU follows, so no remapper fusion applies"
REASON_FLAT = (
    "2-D input: reshaped to [N, 1, 1, C] around FusedBatchNormV3, and the Reshape back "
    "keeps the ReLU from fusing"
)
REASON_FUSED_LN = (
    "no remapper pattern for layer norm on any device; FusedLayerNorm emits one TfmetalExt>LayerNorm "
    "(+ one TfmetalExt>LayerNormGrad per train step) against Keras' 32 ops"
)
REASON_LN_REFERENCE = (
    "custom ops not in use here (no op library, TFMETAL_EXT_REFERENCE_OPS=1, or no kernel for this "
    "device): FusedLayerNorm runs the pure-TF reference, 18 ops per train step"
)


def _single_consumer(layer):
    outbound = getattr(layer, "_outbound_nodes", [])
    return outbound[0].operation if len(outbound) == 1 else None


def _is_plain_relu(op):
    if isinstance(op, keras.layers.ReLU):
        return not op.max_value and not op.negative_slope and not op.threshold
    if isinstance(op, keras.layers.Activation):
        return catalog.activation_name(op) == "relu"
    return False


def _bias_free_conv_before(layer):
    """The Conv2D feeding only this layer, without bias or activation, or None."""
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(nodes) != 1 or len(nodes[0].parent_nodes) != 1:
        return None
    conv = nodes[0].parent_nodes[0].operation
    if (
        isinstance(conv, keras.layers.Conv2D)
        and not conv.use_bias
        and catalog.activation_name(conv) == "linear"
        and getattr(conv, "data_format", "channels_last") == "channels_last"
        and len(getattr(conv, "_outbound_nodes", [])) == 1
    ):
        return conv
    return None


def _fused_batch_norm_rule(layer, ctx):
    relu = _is_plain_relu(_single_consumer(layer))
    dtype = layer.compute_dtype
    if ctx.xla:
        return Expectation("batchnorm_act", None, None, None, reason=catalog.REASON_XLA)
    if ctx.mode == "predict" and catalog.conv_batch_norm_fuses(ctx, dtype) and _bias_free_conv_before(layer) is not None:
        ops = ("FusedBatchNorm", "Relu") if relu else ("FusedBatchNorm",)
        return Expectation("conv2d_batchnorm_act", "_FusedConv2D", ops, ops)
    if not relu:
        return Expectation("batchnorm_act", None, None, None, reason=REASON_NO_RELU)
    if catalog.input_rank(layer) == 2:
        return Expectation("batchnorm_act", None, None, None, reason=REASON_FLAT)
    training = ctx.mode == "train" and layer.trainable
    channels = layer.moving_mean.shape[0] if layer.moving_mean is not None else 0
    blocked = catalog.dtype_block(ctx, dtype, "batchnorm_act") or catalog.batch_norm_ex_block(
        dataclasses.replace(ctx, mode="train" if training else "predict"), dtype, channels
    )
    if blocked:
        return Expectation("batchnorm_act", None, None, (), reason=blocked)
    return Expectation("batchnorm_act", "_FusedBatchNormEx", (), ())


def _fused_layer_norm_rule(layer, ctx):
    if not catalog.fusion_for(ctx, "custom_layer_norm").fuses or not uses_kernel():
        return Expectation("layer_norm", None, None, None, reason=REASON_LN_REFERENCE)
    if LAYER_NORM_OP in catalog.FUSED_LAYER_OPS:  # the report lists the op as a whole fused layer
        return Expectation("layer_norm", LAYER_NORM_OP, (), ())
    return Expectation("layer_norm", None, None, None, reason=REASON_FUSED_LN)


register_rule(FusedBatchNorm, catalog.unless_avoided("fused_batch_norm", _fused_batch_norm_rule))
register_rule(FusedLayerNorm, catalog.unless_avoided("layer_norm", _fused_layer_norm_rule))
