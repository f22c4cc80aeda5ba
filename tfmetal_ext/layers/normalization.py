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
import math
import warnings

import keras
import tensorflow as tf
from keras import constraints, initializers, regularizers

from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import Expectation, register_rule
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers._ops import MIN_FUSED_EPSILON, batch_norm
from tfmetal_ext.ops._common import all_finite, check_float32_representable
from tfmetal_ext.ops.batch_norm_act import activation_name
from tfmetal_ext.ops.layer_norm import LAYER_NORM_OP, layer_norm, uses_kernel


def _check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"`epsilon` must be a finite positive number. Received: epsilon={epsilon!r}")
    return check_float32_representable("epsilon", epsilon)


def _check_momentum_epsilon(momentum, epsilon):
    """Numbers as the stock layer takes them (an epsilon below FusedBatchNormV3's minimum runs stock)."""
    for name, value in (("momentum", momentum), ("epsilon", epsilon)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"`{name}` must be a number. Received: {name}={value!r}")
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"`momentum` must be a number in [0, 1]. Received: momentum={momentum!r}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"`epsilon` must be a finite positive number. Received: epsilon={epsilon!r}")
    return float(momentum), check_float32_representable("epsilon", epsilon)


def _check_renorm_clipping(clipping):
    """`renorm_clipping` as Keras validates it (keys rmax, rmin, dmax; rmin <= rmax; dmax >= 0)."""
    clipping = dict(clipping or {})
    keys = ["rmax", "rmin", "dmax"]
    if set(clipping) - set(keys):
        raise ValueError(
            f"Received invalid keys for `renorm_clipping` argument: {clipping}. Supported values: {keys}."
        )
    rmax, rmin, dmax = (clipping.get(k) for k in keys)
    if rmax is not None and rmin is not None and rmax < rmin:
        raise ValueError(
            f"rmax should be greater than rmin in the `renorm_clipping` argument. Received: rmax={rmax}, rmin={rmin}."
        )
    if dmax is not None and dmax < 0:
        raise ValueError(f"dmax should be non-negative in the `renorm_clipping` argument. Received: dmax={dmax}.")
    return clipping


def _fresh_initializer(initializer):
    """A new instance of `initializer` (a Keras initializer instance may be single-use)."""
    return initializers.get(initializers.serialize(initializer))


def assign_finite_moving_statistics(variables, values, old_values=None):
    """Assign `values` to the statistics `variables`, or keep them all when one is not finite.

    The new values are assigned only when every element of every one of them
    is finite; a batch with an inf or NaN (the batch of a step that loss
    scaling skips, or any poisoned batch) leaves the variables bitwise
    unchanged (`old_values`, default the variables' current values). One
    home for the guard of the FusedBatchNormV3 and stock forms: `FusedBatchNorm`
    and the `ConvBNAct` layers assign their moving statistics through it
    (``TfmetalExt>BatchNormAct`` guards its own update, by the same rule).
    """
    values = list(values)
    if old_values is None:
        old_values = [v.value for v in variables]
    ok = all_finite(values)  # in ops with float kernels on both Metal backends (SelectV2 too)
    for variable, new, old in zip(variables, values, old_values):
        variable.assign(tf.where(ok, new, old))


def _bn_activation(activation):
    """FusedBatchNorm's activation name (``"linear"`` for None): TfmetalExt>BatchNormAct's names, or ValueError."""
    return activation_name(activation)


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

    One difference: a training call whose new moving statistics are not all
    finite (an inf or NaN in the batch) assigns nothing, and the moving mean
    and variance (and renorm's statistics) stay bitwise as they were. Stock
    Keras assigns them, and they stay NaN for good: under ``mixed_float16``
    the `LossScaleOptimizer` skips the overflowing step's weight update, but
    the batch norm has already updated its statistics during the forward pass,
    so every later inference gives NaN. The guard applies always, not only
    under loss scaling: the layer cannot tell whether a skipped step follows,
    and moving statistics poisoned by one bad batch are never useful. The
    batch's own output is unchanged (non-finite, so the loss shows the bad
    batch). It costs a few elementwise ops on the channel vectors; the train
    graph keeps its one FusedBatchNormV3.

    What it becomes:

    | device | op                                   | with a following ReLU                                   |
    |--------|--------------------------------------|---------------------------------------------------------|
    | CPU    | FusedBatchNormV3 (+ Grad in training) | `_FusedBatchNormEx` with oneDNN (float32, bfloat16)      |
    | CUDA   | FusedBatchNormV3 (cuDNN)              | `_FusedBatchNormEx`: float32/half; training needs half, C % 4 == 0 |
    | Metal  | FusedBatchNormV3                      | `_FusedBatchNormEx` float32/half                        |

    Inputs of rank 2, 3 (``(batch, steps, channels)``: Conv1D and sequence
    models) and 5 are reshaped to 4-D NHWC around the one FusedBatchNormV3
    (``(N, C)`` -> ``(N, 1, 1, C)``, ``(N, T, C)`` -> ``(N, T, 1, C)``,
    ``(N, D, H, W, C)`` -> ``(N, D, H*W, C)``): the same per-channel statistics.
    Masks are honoured as Keras does: a masked training call computes the
    batch moments over the unmasked steps only, and the mask passes through
    (``supports_masking``). What FusedBatchNormV3 cannot compute runs the
    stock computation (`keras.layers.BatchNormalization.call` on this layer's
    weights, the exact stock result, nothing fused; `stock_form_reason` and
    the fusion report say why): a masked training call, ``renorm``,
    ``synchronized``, an axis other than the last, an epsilon below 1.001e-5.

    ``activation`` (an extension; `convert()` sets it when an activation
    layer follows a BatchNormalization): in a training step where the
    backend table's ``custom_batch_norm_act`` row says so (both Metal
    backends; CPU where it measured faster), the batch norm and the
    activation run as one ``TfmetalExt>BatchNormAct`` forward and one
    ``TfmetalExt>BatchNormActGrad`` backward (`batch_norm_act_reason` says
    why not elsewhere); otherwise FusedBatchNormV3 then the activation op,
    which is what a following ReLU layer would compute.

    At inference on CPU (float32) a preceding ``Conv2D(use_bias=False)``
    folds it into `_FusedConv2D[FusedBatchNorm(, Relu)]`. While
    ``tfmetal_ext.configure(avoid_fusions=["fused_batch_norm"])`` is in force
    (set before tracing), it emits moments + Rsqrt/Mul/Add instead of
    FusedBatchNormV3: same statistics and updates, nothing fused.

    Args:
        axis: the channels axis; only the last axis runs fused.
        momentum: momentum of the moving averages, in [0, 1].
        epsilon: added to the variance, > 0; below 1.001e-5 (cuDNN's
            minimum for FusedBatchNormV3) the stock computation runs.
        center: learn an offset `beta`; when False no beta weight exists.
        scale: learn a scale `gamma`; when False no gamma weight exists.
        beta_initializer, gamma_initializer, moving_mean_initializer,
        moving_variance_initializer: weight initializers.
        beta_regularizer, gamma_regularizer: weight regularizers.
        beta_constraint, gamma_constraint: weight constraints.
        renorm, renorm_clipping, renorm_momentum: batch renormalization, as
            Keras (its extra statistics, stock computation).
        synchronized: all-reduce the statistics across replicas, as Keras
            (stock computation).
        activation: applied after the normalization: None or ``"linear"``
            (the default: exactly `BatchNormalization`), ``"relu"``,
            ``"relu6"``, ``"elu"``, ``"leaky_relu"`` (slope 0.2),
            ``"silu"`` (``"swish"``) or ``"gelu"`` (exact).
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`).
            Keras 2's `virtual_batch_size` is accepted as None only.

    Call arguments:
        inputs: the tensor to normalize, any rank >= 2 with the channels
            axis known.
        training: batch statistics (and moving-statistics updates) when true
            and the layer is trainable.
        mask: ``inputs.shape[:-1]`` booleans; masked steps are left out of
            the batch moments.

    Output shape:
        Same as the input.

    Raises:
        ValueError: on a bad argument, an axis out of bounds, a mask of the
            wrong rank, or `virtual_batch_size`.

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
        renorm=False,
        renorm_clipping=None,
        renorm_momentum=0.99,
        synchronized=False,
        activation=None,
        **kwargs,
    ):
        virtual_batch_size = kwargs.pop("virtual_batch_size", None)
        if virtual_batch_size is not None:
            raise ValueError(
                "`virtual_batch_size` is a Keras 2 argument that keras.layers.BatchNormalization "
                f"(Keras 3) does not have either. Received: virtual_batch_size={virtual_batch_size!r}"
            )
        super().__init__(**kwargs)
        self.axis = _check_axis_arg(axis)
        self.momentum, self.epsilon = _check_momentum_epsilon(momentum, epsilon)
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
        self.synchronized = bool(synchronized)
        self.activation = _bn_activation(activation)
        self.renorm = bool(renorm)
        self.renorm_clipping = _check_renorm_clipping(renorm_clipping) if self.renorm else renorm_clipping
        self.renorm_momentum = renorm_momentum
        if (self.renorm or self.synchronized) and _STOCK_BN_HELPERS is None:
            raise ValueError(
                "This Keras version's BatchNormalization has no batch-renormalization helpers to run; "
                f"use keras.layers.BatchNormalization. Received: renorm={renorm!r}, synchronized={synchronized!r}"
            )
        self.supports_masking = True
        self.gamma = None
        self.beta = None
        self.moving_mean = None
        self.moving_variance = None
        self._reduction_axes = None

    def build(self, input_shape):
        rank = len(input_shape)
        axis = self.axis + rank if self.axis < 0 else self.axis
        if not 0 <= axis < rank:
            raise ValueError(
                f"Axis {self.axis} is out of bounds for input shape {tuple(input_shape)}. "
                f"Received: axis={self.axis}"
            )
        channels = input_shape[axis]
        if channels is None:
            raise ValueError(f"The normalized axis must be known. Received: input_shape={tuple(input_shape)}")
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
        if self.renorm:
            # Batch renormalization's extra statistics, named and initialized as Keras does;
            # the stock computation runs (see `stock_form_reason`).
            variance_init = self.moving_variance_initializer

            def stddev_initializer(shape, dtype=None):
                return tf.sqrt(_fresh_initializer(variance_init)(shape, dtype=dtype))

            self.moving_stddev = self.add_weight(
                name="moving_stddev", shape=shape, initializer=stddev_initializer,
                trainable=False, autocast=False,
            )
            self.renorm_mean = self.add_weight(
                name="renorm_mean", shape=shape, initializer=_fresh_initializer(self.moving_mean_initializer),
                trainable=False, autocast=False,
            )
            self.renorm_stddev = self.add_weight(
                name="renorm_stddev", shape=shape, initializer=stddev_initializer,
                trainable=False, autocast=False,
            )
        self.input_spec = keras.layers.InputSpec(ndim=rank, axes={self.axis: int(channels)})
        self._reduction_axes = [a for a in range(rank) if a != axis]

    def stock_form_reason(self, rank=None, training=True, masked=False):
        """Why a call runs the stock computation instead of FusedBatchNormV3, or None.

        The stock computation is `keras.layers.BatchNormalization.call` on this
        layer's own weights: the exact stock result, nothing fused. It runs for
        batch renormalization, synchronized statistics, a normalized axis other
        than the last, an epsilon below cuDNN's FusedBatchNormV3 minimum, an
        input of rank < 2, and for a masked training call (masked moments).
        """
        if self.renorm:
            return "renorm=True (batch renormalization): no fused op computes it"
        if self.synchronized:
            return "synchronized=True: the statistics are all-reduced across replicas"
        if self.epsilon < MIN_FUSED_EPSILON:
            return f"epsilon={self.epsilon} is below FusedBatchNormV3's minimum {MIN_FUSED_EPSILON}"
        if rank is not None:
            if rank < 2:
                return f"a {rank}-D input: FusedBatchNormV3 needs a batch and a channels axis"
            axis = self.axis + rank if self.axis < 0 else self.axis
            if axis != rank - 1:
                return f"axis={self.axis} is not the last (channels_last) axis of a {rank}-D input"
        if masked and training and self.trainable:
            return "a masked training call: the batch moments skip masked steps (FusedBatchNormV3 cannot)"
        return None

    def call(self, inputs, training=None, mask=None):
        rank = len(inputs.shape)
        if mask is not None and len(mask.shape) != rank - 1:
            raise ValueError(
                "The mask must have one dimension less than the inputs. "
                f"Received: mask.shape={tuple(mask.shape)}, inputs.shape={tuple(inputs.shape)}"
            )
        if self.stock_form_reason(rank, bool(training), mask is not None) is not None:
            if not (training and self.trainable):
                return self._activate(keras.layers.BatchNormalization.call(self, inputs, training=training, mask=mask))
            # The stock computation assigns its statistics itself: put the old ones back
            # when the new ones are not finite, as the fused path does.
            stats = self.non_trainable_weights
            old = [tf.identity(v.value) for v in stats]
            y = keras.layers.BatchNormalization.call(self, inputs, training=training, mask=mask)
            assign_finite_moving_statistics(stats, [v.value for v in stats], old)
            return self._activate(y)
        x = tf.cast(inputs, self.compute_dtype)
        channels = self.moving_mean.shape[0]
        gamma = self.gamma.value if self.scale else tf.ones([channels], tf.float32)
        beta = self.beta.value if self.center else tf.zeros([channels], tf.float32)
        training = bool(training) and self.trainable
        if training and self.batch_norm_act_reason(training) is None:
            # Any rank, channels last: the op needs no reshape. Its moving-statistics update is
            # already guarded (unchanged on a non-finite batch).
            y, (new_mean, new_variance) = _ops.batch_norm_act(
                x, gamma, beta, self.moving_mean.value, self.moving_variance.value, epsilon=self.epsilon,
                momentum=self.momentum, activation=self.activation,
            )
            self.moving_mean.assign(new_mean)
            self.moving_variance.assign(new_variance)
            return y
        shape = None
        if rank != 4:
            # FusedBatchNormV3 is 4-D NHWC: (N, C) -> (N, 1, 1, C), (N, T, C) -> (N, T, 1, C),
            # (N, D, H, W, C) -> (N, D, H*W, C). The per-channel statistics are the same.
            shape = tf.shape(x)
            if rank == 2:
                four = [-1, 1, 1, channels]
            elif rank == 3:
                four = tf.stack([shape[0], shape[1], 1, channels])
            else:
                four = tf.stack([shape[0], shape[1], tf.reduce_prod(shape[2:-1]), channels])
            x = tf.reshape(x, four)
        y, updates = batch_norm(
            x, gamma, beta, self.moving_mean.value, self.moving_variance.value,
            epsilon=self.epsilon, momentum=self.momentum, training=training,
        )
        if updates is not None:
            assign_finite_moving_statistics((self.moving_mean, self.moving_variance), updates)
        if shape is not None:
            y = tf.reshape(y, shape)
            y.set_shape(inputs.shape)
        return self._activate(y)

    def batch_norm_act_reason(self, training=True):
        """None when a training call runs batch norm + `activation` as one ``TfmetalExt>BatchNormAct``, else why not.

        The backend table's ``custom_batch_norm_act`` row decides (see
        `tfmetal_ext.layers._ops.batch_norm_act_reason`); a layer without an
        activation keeps FusedBatchNormV3 (one op each way already).
        """
        if self.activation == "linear":
            return "no activation: FusedBatchNormV3 is already one op each way"
        return _ops.batch_norm_act_reason(self.compute_dtype, self.activation, bool(training) and self.trainable)

    def _activate(self, y):
        if self.activation == "linear":
            return y
        emit = _ops.FUSABLE_ACTIVATIONS.get(self.activation)  # the op a following ReLU layer would emit
        return emit(y) if emit is not None else keras.activations.get(self.activation)(y)

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
                "synchronized": self.synchronized,
                "renorm": self.renorm,
                "renorm_clipping": self.renorm_clipping,
                "renorm_momentum": self.renorm_momentum,
            }
        )
        if self.activation != "linear":  # a plain drop-in keeps BatchNormalization's config
            config["activation"] = self.activation
        return config


# The stock computation FusedBatchNorm falls back to (`stock_form_reason`) is
# keras.layers.BatchNormalization.call run on FusedBatchNorm's own weights; these are
# the stock helpers that call uses, bound to FusedBatchNorm (None if this Keras lacks one).
_STOCK_BN_HELPERS = {
    name: getattr(keras.layers.BatchNormalization, name, None)
    for name in ("_moments", "_renorm_correction_and_moments", "_compose_transforms", "_update_renorm_statistics")
}
if any(fn is None for fn in _STOCK_BN_HELPERS.values()):  # pragma: no cover - another Keras
    _STOCK_BN_HELPERS = None
else:
    for _name, _fn in _STOCK_BN_HELPERS.items():
        setattr(FusedBatchNorm, _name, _fn)


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
    the layer runs the same pure-TF reference: same results, 18 ops. Masks
    pass through (``supports_masking``, as Keras). Normalized axes other than
    the last alone and ``rms_scaling=True`` run the stock computation
    (`keras.layers.LayerNormalization.call` on this layer's weights; nothing
    fused, `stock_form_reason` and the report say why).

    Args:
        axis: the normalized axis or axes (an int or a list of ints); the
            last axis alone runs fused.
        epsilon: added to the variance.
        center: learn an offset `beta`.
        scale: learn a scale `gamma`.
        beta_initializer, gamma_initializer: weight initializers.
        beta_regularizer, gamma_regularizer: weight regularizers.
        beta_constraint, gamma_constraint: weight constraints.
        **kwargs: base layer arguments, and the stock layer's deprecated
            ``rms_scaling`` (stock computation, with Keras' warning).

    Input shape:
        Any rank; the last dimension must be known.

    Output shape:
        Same as the input.

    Raises:
        ValueError: on a bad argument or an axis out of bounds.
        TypeError: an axis that is not an int or a list of ints (as Keras).

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
            warnings.warn(
                "`rms_scaling=True` is deprecated in Keras (it scales by the variance, not the root "
                "mean square; keras.layers.RMSNormalization is the correct layer). FusedLayerNorm "
                "runs the stock computation for it, nothing fused.",
                stacklevel=2,
            )
        super().__init__(**kwargs)
        if isinstance(axis, (list, tuple)) and all(isinstance(a, int) and not isinstance(a, bool) for a in axis):
            self.axis = list(axis)
        elif isinstance(axis, int) and not isinstance(axis, bool):
            self.axis = axis
        else:
            raise TypeError(
                f"Expected an int or a list/tuple of ints for the argument 'axis'. Received: axis={axis!r}"
            )
        self.epsilon = _check_epsilon(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.rms_scaling = bool(rms_scaling)
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.supports_masking = True
        self.gamma = None
        self.beta = None
        self._rank = None

    def build(self, input_shape):
        rank = len(input_shape)
        axes = sorted(self.axis) if isinstance(self.axis, list) else [self.axis]
        for a in axes:
            if not -rank <= a < rank:
                raise ValueError(
                    f"Axis {a} is out of bounds for input shape {tuple(input_shape)}. Received: axis={self.axis}"
                )
        shape = tuple(input_shape[a] for a in axes)
        if any(d is None for d in shape):
            raise ValueError(f"The normalized axes must be known. Received: input_shape={tuple(input_shape)}")
        shape = tuple(int(d) for d in shape)
        self.axis = axes  # as Keras' LayerNormalization keeps it after build
        self._rank = rank
        if self.scale or self.rms_scaling:
            self.gamma = self.add_weight(
                name="gamma", shape=shape, initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer, constraint=self.gamma_constraint,
                trainable=True, autocast=False,
            )
        if self.center and not self.rms_scaling:
            self.beta = self.add_weight(
                name="beta", shape=shape, initializer=self.beta_initializer,
                regularizer=self.beta_regularizer, constraint=self.beta_constraint,
                trainable=True, autocast=False,
            )

    def stock_form_reason(self, rank=None):
        """Why this layer runs the stock computation instead of the layer-norm op, or None.

        The stock computation is `keras.layers.LayerNormalization.call` on this
        layer's weights (``keras.ops.layer_normalization``): the exact stock
        result. It runs for ``rms_scaling=True`` and for normalized axes other
        than the last one alone.
        """
        if self.rms_scaling:
            return "rms_scaling=True (deprecated in Keras): the stock computation"
        rank = rank if rank is not None else self._rank
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        if rank is not None and sorted(a + rank if a < 0 else a for a in axes) != [rank - 1]:
            return f"axis={self.axis}: the layer-norm op normalizes the last axis alone"
        return None

    def call(self, inputs):
        if self.stock_form_reason(len(inputs.shape)) is not None:
            return keras.layers.LayerNormalization.call(self, inputs)
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
                "rms_scaling": self.rms_scaling,
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
REASON_UNSEEN = (
    "FusedBatchNormV3 (one op); called inside its parent layer's own call, where neither a ReLU "
    "after it nor a bias-free conv before it fused with it"
)
REASON_FLAT = (
    "{rank}-D input: reshaped to 4-D NHWC around FusedBatchNormV3, and the Reshape back "
    "keeps the ReLU from fusing"
)
REASON_STOCK_BN = "the stock BatchNormalization computation runs (nothing fused): {why}"
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


def batch_norm_act_expectation(layer, ctx, activation, side=False):
    """The fusion report's expectation when a training step runs ``TfmetalExt>BatchNormAct`` for `layer`, or None.

    `layer` is a `ConvBNAct` or `FusedBatchNorm`; `activation` the one the op
    applies (a `ResidualBlock`'s for its last conv, with `side`: the residual
    add).
    Decided by `tfmetal_ext.layers._ops.batch_norm_act_reason` for the
    backend table and avoided set of `ctx`, as the layer decides when traced.
    """
    if ctx.mode != "train" or not layer.trainable or ctx.xla:
        return None
    reason = _ops.batch_norm_act_reason(
        layer.compute_dtype, activation, True, table=catalog.table(ctx), avoided=ctx.avoided
    )
    if reason is not None:
        return None
    fused = (activation_name(activation),) + (("side",) if side else ())
    return catalog.Expectation(_ops.BATCH_NORM_ACT_PATTERN, fusion.BATCH_NORM_ACT_OP, fused, fused)


def _fused_batch_norm_rule(layer, ctx):
    rank = catalog.input_rank(layer)
    why = layer.stock_form_reason(rank, training=ctx.mode == "train")
    if why is not None:
        return Expectation("batchnorm_act", None, None, None, reason=REASON_STOCK_BN.format(why=why))
    if layer.activation != "linear":
        custom = batch_norm_act_expectation(layer, ctx, layer.activation)
        if custom is not None:
            return custom
    relu = layer.activation == "relu" or (layer.activation == "linear" and _is_plain_relu(_single_consumer(layer)))
    # Called only inside a parent layer's own call (a subclassed block): no layer graph says what
    # feeds it or what follows it.
    unseen = not getattr(layer, "_inbound_nodes", None)
    dtype = layer.compute_dtype
    if ctx.xla:
        return Expectation("batchnorm_act", None, None, None, reason=catalog.REASON_XLA)
    conv_fuses = ctx.mode == "predict" and catalog.conv_batch_norm_fuses(ctx, dtype)
    if conv_fuses and _bias_free_conv_before(layer) is not None:
        ops = ("FusedBatchNorm", "Relu") if relu else ("FusedBatchNorm",)
        return Expectation("conv2d_batchnorm_act", fusion.FUSED_CONV2D, ops, ops)
    training = ctx.mode == "train" and layer.trainable
    channels = layer.moving_mean.shape[0] if layer.moving_mean is not None else 0
    blocked = catalog.dtype_block(ctx, dtype, "batchnorm_act") or catalog.batch_norm_ex_block(
        dataclasses.replace(ctx, mode="train" if training else "predict"), dtype, channels
    )
    if unseen and not relu:
        # What fuses depends on the parent's code: a bias-free conv before it (inference), a
        # ReLU after it. Either is right when present; neither can be required.
        may = ((fusion.FUSED_CONV2D, ("FusedBatchNorm",)),) if conv_fuses else ()
        if not blocked and rank in (None, 4):
            may += ((fusion.FUSED_BATCH_NORM_EX, ()),)
        return Expectation("batchnorm_act", None, None, None, reason=REASON_UNSEEN, may_fuse=may)
    if not relu:
        return Expectation("batchnorm_act", None, None, None, reason=REASON_NO_RELU)
    if rank is not None and rank != 4:
        return Expectation("batchnorm_act", None, None, None, reason=REASON_FLAT.format(rank=rank))
    if blocked:
        return Expectation("batchnorm_act", None, None, (), reason=blocked)
    return Expectation("batchnorm_act", fusion.FUSED_BATCH_NORM_EX, (), ())


def _fused_layer_norm_rule(layer, ctx):
    why = layer.stock_form_reason(catalog.input_rank(layer))
    if why is not None:
        return Expectation("layer_norm", None, None, None, reason=f"the stock LayerNormalization computation runs: {why}")
    if not catalog.fusion_for(ctx, "custom_layer_norm").fuses or not uses_kernel():
        return Expectation("layer_norm", None, None, None, reason=REASON_LN_REFERENCE)
    if LAYER_NORM_OP in catalog.FUSED_LAYER_OPS:  # the report lists the op as a whole fused layer
        return Expectation("layer_norm", LAYER_NORM_OP, (), ())
    return Expectation("layer_norm", None, None, None, reason=REASON_FUSED_LN)


register_rule(FusedBatchNorm, catalog.unless_avoided("fused_batch_norm", _fused_batch_norm_rule))
register_rule(FusedLayerNorm, catalog.unless_avoided("layer_norm", _fused_layer_norm_rule))
