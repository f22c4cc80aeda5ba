"""Graph building blocks shared by the layers: the exact ops the remapper matches."""

from __future__ import annotations

import math

import tensorflow as tf

from tfmetal_ext import _env
from tfmetal_ext.backends import fusion
from tfmetal_ext.backends._table import TRAIN
from tfmetal_ext.ops._common import check_float32_representable, in_xla_context

# Keras activation name -> the single TF op a remapper absorbs into a
# contraction (+ BiasAdd): one emitter for each of fusion.CONTRACTION_ACTIVATIONS.
# Anything else is applied with keras.activations after the BiasAdd.
_EMITTERS = {
    "relu": tf.nn.relu,
    "relu6": tf.nn.relu6,
    "elu": tf.nn.elu,
    "leaky_relu": lambda x: tf.nn.leaky_relu(x, alpha=fusion.LEAKY_RELU_ALPHA),
}
FUSABLE_ACTIVATIONS = {name: _EMITTERS[name] for name in fusion.CONTRACTION_ACTIVATIONS}


def pattern_avoided(pattern):
    """`pattern` (a `tfmetal_ext.precision.SAFE_FORMS` name) is avoided: emit its safe form.

    Reads the environment's avoided set (`tfmetal_ext._env`) when a layer is
    traced, so ``configure(avoid_fusions=...)`` applies to every graph traced
    after it. For a custom op's name see `tfmetal_ext.ops._common.op_avoided`.
    """
    return pattern in _env.current().avoided


def gemv_rows(shape, row_axes, dtype):
    """Whether a product over `shape`'s first `row_axes` axes (its rows) runs as ``TfmetalExt>Gemv``.

    True for a single-position step, ``[batch, 1, ..., features]`` (a decoding
    step of a sequence model: every row axis after the first is 1), with a
    static batch of at most ``fusion.GEMV_MAX_ROWS`` rows, where this
    backend's table takes the op for `dtype` (row ``fusion.GEMV_PATTERN``:
    the CPU's; not yet either Metal backend's) and its kernel is in use
    (`tfmetal_ext.ops.gemv`). A 2-D input (a classifier's or an MLP's batch)
    keeps MatMul and its remapper fusions, and so does a function XLA
    compiles (the op has no XLA kernel).
    """
    from tfmetal_ext import backends
    from tfmetal_ext.ops.gemv import uses_kernel  # imported late: tfmetal_ext.ops imports the layers' backends

    if row_axes < 2 or shape.rank is None or shape.rank <= row_axes:
        return False
    rows = shape[:row_axes].as_list()
    if rows[0] is None or not 0 < rows[0] <= fusion.GEMV_MAX_ROWS or any(d != 1 for d in rows[1:]):
        return False
    if tf.as_dtype(dtype).name not in backends.current().fusion(fusion.GEMV_PATTERN).dtypes:
        return False
    return uses_kernel() and not in_xla_context()


def bias_add(x, bias, pattern):
    """``BiasAdd(x, bias)``, or ``AddV2(x, bias)`` while `pattern` is avoided.

    A GPU remapper (TF's and tensorflow-metal's) fuses a contraction only with
    a real BiasAdd, so the AddV2 keeps the fused kernel out; on CPU with oneDNN
    a broadcast AddV2 still counts as a BiasAdd and fuses.
    """
    if pattern_avoided(pattern):
        return tf.add(x, bias)
    return tf.nn.bias_add(x, bias)


# cuDNN's CUDNN_BN_MIN_EPSILON: FusedBatchNormV3 on GPU rejects smaller values
# (tf.nn.fused_batch_norm silently clamps to it).
MIN_FUSED_EPSILON = 1.001e-5


def check_batch_norm_args(momentum, epsilon):
    """Validates FusedBatchNormV3 arguments; returns ``(momentum, epsilon)`` as floats.

    Raises:
        ValueError: momentum outside [0, 1], or epsilon not a finite number >= `MIN_FUSED_EPSILON`
            (and float32-representable).
    """
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
        raise ValueError(f"`momentum` must be a number in [0, 1]. Received: momentum={momentum!r}")
    if (
        isinstance(epsilon, bool)
        or not isinstance(epsilon, (int, float))
        or not math.isfinite(epsilon)  # NaN compares False with everything: test it first
        or epsilon < MIN_FUSED_EPSILON
    ):
        raise ValueError(
            f"`epsilon` must be a finite number >= {MIN_FUSED_EPSILON} (cuDNN's minimum for FusedBatchNormV3). "
            f"Received: epsilon={epsilon!r}"
        )
    return float(momentum), check_float32_representable("epsilon", epsilon)


def _bessel_to_biased(x):
    """(n - 1) / n for the n = N * H * W values per channel of NHWC `x` (a constant when static)."""
    dims = x.shape[:3]
    if all(d is not None for d in dims):
        n = float(dims[0] * dims[1] * dims[2])
        return (n - 1.0) / max(n, 1.0)
    shape = tf.shape(x)
    n = tf.cast(shape[0] * shape[1] * shape[2], tf.float32)
    return (n - 1.0) / tf.maximum(n, 1.0)


def fused_batch_norm(x, gamma, beta, moving_mean, moving_variance, *, epsilon, momentum, training):
    """FusedBatchNormV3 on NHWC `x` with Keras BatchNormalization semantics.

    Returns ``(y, updates)`` where `updates` is None at inference and, in
    training, the pair of new moving mean / variance values computed the way
    Keras does (``moving * momentum + batch * (1 - momentum)`` with the *biased*
    batch variance; FusedBatchNormV3 works with the Bessel-corrected one).
    Scale, offset and statistics are float32; `x` may be float32, float16 or
    bfloat16.
    """
    if training:
        # The op blends the running mean itself: out1 = (1 - f) * moving_mean + f * batch_mean
        # with f = 1 - momentum, exactly Keras' update. Given a zero "old" variance, out2 is
        # f * batch_variance, Bessel-corrected; Keras averages the biased variance, so it is
        # scaled by (n - 1) / n before the blend. Two ops fewer per layer than blending both outside.
        channels = tf.shape(moving_mean)
        y, new_mean, scaled_var, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x,
            scale=gamma,
            offset=beta,
            mean=moving_mean,
            variance=tf.zeros(channels, tf.float32),
            epsilon=epsilon,
            exponential_avg_factor=1.0 - momentum,
            data_format="NHWC",
            is_training=True,
        )
        new_var = moving_variance * momentum + scaled_var * _bessel_to_biased(x)
        return y, (new_mean, new_var)
    y, _, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x,
        scale=gamma,
        offset=beta,
        mean=moving_mean,
        variance=moving_variance,
        epsilon=epsilon,
        data_format="NHWC",
        is_training=False,
    )
    return y, None


def unfused_batch_norm(x, gamma, beta, moving_mean, moving_variance, *, epsilon, momentum, training):
    """`fused_batch_norm`'s math without FusedBatchNormV3: moments + Rsqrt/Mul/Add.

    The safe form for ``configure(avoid_fusions=["fused_batch_norm"])``. Same
    arguments and result as `fused_batch_norm`, with Keras' semantics: batch
    statistics (biased variance) over every axis but the last in training,
    moving statistics otherwise, updates ``moving * momentum + batch * (1 - momentum)``.
    Computed in float32, the output cast back to the dtype of `x`.
    """
    xf = tf.cast(x, tf.float32)
    if training:
        axes = list(range(x.shape.rank - 1))
        mean, variance = tf.nn.moments(xf, axes=axes)
        updates = (
            moving_mean * momentum + mean * (1.0 - momentum),
            moving_variance * momentum + variance * (1.0 - momentum),
        )
    else:
        mean, variance, updates = moving_mean, moving_variance, None
    inv = tf.math.rsqrt(variance + epsilon) * gamma
    y = (xf - mean) * inv + beta
    return tf.cast(y, x.dtype), updates


BATCH_NORM_ACT_PATTERN = "custom_batch_norm_act"  # the backend tables' row (tfmetal_ext.backends)


def batch_norm_act_reason(dtype, activation, training=True, table=None, avoided=None):
    """Why a training step's batch norm + `activation` (+ a residual add) is not one ``TfmetalExt>BatchNormAct``.

    None when it is: in a training step, the backend table's
    ``custom_batch_norm_act`` row fuses `dtype` (measured per backend and
    CPU configuration, see `tfmetal_ext.backends`), the op's kernel runs here
    (op library loaded, no reference forced) and neither ``"batch_norm_act"``
    nor ``"fused_batch_norm"`` is avoided. Inference keeps FusedBatchNormV3
    with the moving statistics (it folds into the convolution).

    `table` and `avoided` default to this process's backend table and
    avoided set; the fusion report passes those of the backend it describes.
    """
    from tfmetal_ext import backends
    from tfmetal_ext.ops.batch_norm_act import activation_name, uses_kernel

    from tfmetal_ext.ops import _common

    if not training:
        return "inference: FusedBatchNormV3 with the moving statistics (folds into the convolution)"
    if _common.in_xla_context():
        return "a function compiled with XLA (the op has no XLA kernel)"
    avoided = _env.current().avoided if avoided is None else avoided
    for name in ("batch_norm_act", "fused_batch_norm"):
        if name in avoided:
            return f"configure(avoid_fusions=[{name!r}]) is set"
    try:
        activation_name(activation)
    except ValueError:
        return f"activation {activation!r}: {fusion.BATCH_NORM_ACT_OP} has no such activation"
    table = backends.current() if table is None else table
    row = table.fusion(BATCH_NORM_ACT_PATTERN)
    if dtype not in row.dtypes_in(TRAIN):
        return f"{table.label}: {row.why_not or row.summary}"
    if not uses_kernel():
        return f"no {fusion.BATCH_NORM_ACT_OP} kernel here (op library not loaded, or the reference is forced)"
    return None


def batch_norm_act(x, gamma, beta, moving_mean, moving_variance, *, epsilon, momentum, activation, side=None):
    """Training-mode batch norm + residual add + activation as one op; ``(y, (new_mean, new_variance))``.

    The op computes the batch statistics (biased variance, float32) and the
    moving statistics' update, Keras' ``moving * momentum + batch * (1 -
    momentum)``, already guarded: on a batch whose update is not finite it
    returns the moving statistics unchanged. The caller assigns the two.
    """
    from tfmetal_ext.ops.batch_norm_act import batch_norm_act as op

    y, new_mean, new_variance = op(
        x, gamma, beta, side, activation=activation, epsilon=epsilon, alpha=fusion.LEAKY_RELU_ALPHA,
        moving_mean=moving_mean, moving_variance=moving_variance, momentum=momentum,
    )
    return y, (new_mean, new_variance)


def batch_norm(x, gamma, beta, moving_mean, moving_variance, *, epsilon, momentum, training):
    """`fused_batch_norm`, or `unfused_batch_norm` while ``"fused_batch_norm"`` is avoided."""
    fn = unfused_batch_norm if pattern_avoided("fused_batch_norm") else fused_batch_norm
    return fn(
        x, gamma, beta, moving_mean, moving_variance, epsilon=epsilon, momentum=momentum, training=training
    )
