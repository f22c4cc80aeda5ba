"""batch_norm_act: batch norm (batch statistics) + residual add + activation as one op each way
(``TfmetalExt>BatchNormAct``, ``TfmetalExt>BatchNormActGrad``)."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common
from tfmetal_ext.ops.layer_norm import _check_epsilon, _parameter

BATCH_NORM_ACT_OP = fusion.BATCH_NORM_ACT_OP
BATCH_NORM_ACT_GRAD_OP = fusion.BATCH_NORM_ACT_GRAD_OP
ACTIVATIONS = fusion.BATCH_NORM_ACT_ACTIVATIONS


def activation_name(activation):
    """The op's name for `activation` (a Keras activation name, "swish" or None), or ValueError."""
    name = fusion.BATCH_NORM_ACT_ALIASES.get(activation, activation) if _hashable(activation) else activation
    if not isinstance(name, str) or name not in ACTIVATIONS:
        known = ", ".join(repr(a) for a in ACTIVATIONS + tuple(k for k in fusion.BATCH_NORM_ACT_ALIASES if k))
        raise ValueError(f"Argument `activation` must be one of {known} or None. Received: activation={activation!r}")
    return name


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return False
    return True


@tf.autograph.experimental.do_not_convert  # plain graph building; also keeps autograph out of the loader
def batch_norm_act(x, gamma=None, beta=None, side=None, *, activation="relu", epsilon=1e-3, alpha=0.2,
                   moving_mean=None, moving_variance=None, momentum=0.99, name=None):
    """Batch normalization with batch statistics, an optional residual input and an activation.

    ``y = act((x - mean) / sqrt(variance + epsilon) * gamma + beta + side)``
    with the per-channel mean and biased variance of `x` over every axis but
    the last (channels last), as `keras.layers.BatchNormalization` computes
    them in training, followed by the residual add and the activation. The
    statistics are computed in float32 for every input dtype, numerically
    stable (blocked two-pass sums merged by Chan's formula: a channel of 1e4
    + N(0, 1) keeps its variance) and deterministic (a fixed partition of the
    rows, whatever the thread count); `y` is rounded once to `x`'s dtype.

    One custom op forward (``TfmetalExt>BatchNormAct``, which also saves the
    mean and 1/std) and one backward (``TfmetalExt>BatchNormActGrad``: dx,
    dgamma, dbeta and d side in one kernel). CPU kernel here; Metal kernels
    on Apple GPUs. Without the op library, with
    ``TFMETAL_EXT_REFERENCE_OPS=1`` or ``configure(avoid_fusions=["batch_norm_act"])``
    the same math runs as stock TensorFlow ops.

    The returned `mean` and `variance` are for the layer's moving averages:
    they come through `tf.stop_gradient` (no gradient flows through them; the
    gradient of `y` already accounts for the statistics' dependence on `x`).

    With `moving_mean` and `moving_variance` (a layer's moving statistics),
    the op also updates them, as `keras.layers.BatchNormalization` does in
    training: ``moving * momentum + batch * (1 - momentum)`` for the mean and
    the biased variance, in float32. The update is taken only when every
    updated value is finite; otherwise (an inf or NaN in the batch, as in a
    step that loss scaling skips, or an empty batch) the moving statistics
    come back bitwise unchanged. The op then returns the updated moving
    statistics in place of the batch's, as ``tf.compat.v1.nn.fused_batch_norm``
    does with ``exponential_avg_factor``: one op computes statistics, output
    and update, and the caller assigns them.

    Args:
        x: a float32, float16 or bfloat16 tensor of rank >= 2, channels last.
        gamma: the scale, a float vector of `x`'s last dimension, or None for
            1 (``scale=False``); used as float32.
        beta: the offset, likewise, or None for 0 (``center=False``).
        side: None, or a tensor of `x`'s shape and dtype added after the
            normalization, before the activation (a residual connection).
        activation: ``"linear"`` (or None), ``"relu"``, ``"relu6"``,
            ``"elu"``, ``"leaky_relu"`` (slope `alpha`), ``"silu"`` (or
            ``"swish"``: x * sigmoid(x)) or ``"gelu"`` (exact, erf form).
        epsilon: added to the variance, a finite float > 0.
        alpha: leaky_relu's negative slope (Keras' default 0.2).
        moving_mean: None, or the moving mean to update (a float vector of
            `x`'s last dimension, used as float32); give both or neither.
        moving_variance: None, or the moving variance to update, likewise.
        momentum: the moving statistics' momentum, a finite float (Keras'
            default 0.99). Used only with the moving statistics.
        name: optional op name.

    Returns:
        ``(y, mean, variance)``: `y` of `x`'s shape and dtype; `mean` and the
        biased `variance`, float32 vectors of `x`'s last dimension (NaN for an
        empty batch, as Keras' moments). With `moving_mean` and
        `moving_variance`: ``(y, new_moving_mean, new_moving_variance)``.

    Raises:
        ValueError: for a non-float dtype, rank < 2, a `gamma` / `beta` that
            is not a vector of the last dimension, a `side` of another shape
            or dtype, an unknown activation, a bad epsilon, alpha or momentum,
            only one of `moving_mean` / `moving_variance`, or one that is not
            a float vector of the last dimension.

    >>> y, mean, var = batch_norm_act(tf.constant([[1.0], [3.0]]), activation="linear")
    >>> y.numpy().round(3).ravel().tolist(), mean.numpy().tolist(), var.numpy().tolist()
    ([-0.999, 0.999], [2.0], [1.0])
    """
    epsilon = _common.check_float32_representable("epsilon", _check_epsilon(epsilon))
    alpha = _common.check_finite("alpha", alpha)
    activation = activation_name(activation)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank is not None and x.shape.rank < 2:
        raise ValueError(
            "`x` must have rank >= 2 (channels last; the statistics are over the other axes). "
            f"Received: x.shape={x.shape}"
        )
    gamma = _parameter("gamma", gamma, x, 1.0)
    beta = _parameter("beta", beta, x, 0.0)
    if side is not None:
        side = tf.convert_to_tensor(side)
        if side.dtype != x.dtype:
            raise ValueError(
                f"`side` must have the dtype of x ({x.dtype.name}). Received: side.dtype={side.dtype.name}"
            )
        if not side.shape.is_compatible_with(x.shape):
            raise ValueError(f"`side` must have the shape of x ({x.shape}). Received: side.shape={side.shape}")
    moving = _moving(moving_mean, moving_variance, x)
    momentum = _common.check_finite("momentum", momentum) if moving else 0.99
    if not uses_kernel():
        y, mean, variance = _with_reference_gradient(x, gamma, beta, side, activation, epsilon, alpha)
        if moving:
            mean, variance = reference_moving_update(
                tf.stop_gradient(mean), tf.stop_gradient(variance), *moving, momentum
            )
    else:
        lib = _common.library()
        y, mean, _, variance, new_moving = lib.tfmetal_ext_batch_norm_act(
            x, gamma, beta, [] if side is None else [side], moving, activation=activation, alpha=alpha,
            epsilon=epsilon, momentum=momentum, name=name,
        )
        if moving:
            mean, variance = new_moving
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


def _moving(moving_mean, moving_variance, x):
    """``[]``, or the moving statistics as float32 vectors of x's last dimension."""
    if (moving_mean is None) != (moving_variance is None):
        raise ValueError(
            "Give both `moving_mean` and `moving_variance`, or neither. Received: "
            f"moving_mean={'None' if moving_mean is None else 'a tensor'}, "
            f"moving_variance={'None' if moving_variance is None else 'a tensor'}"
        )
    if moving_mean is None:
        return []
    return [_parameter("moving_mean", moving_mean, x, 0.0), _parameter("moving_variance", moving_variance, x, 1.0)]




def uses_kernel() -> bool:
    """`batch_norm_act` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(BATCH_NORM_ACT_OP)


# ----------------------------------------------------------------------------
# The pure-TF reference (TFMETAL_EXT_REFERENCE_OPS=1, configure(avoid_fusions=["batch_norm_act"]),
# no op library, or no kernel for the visible GPU). The math of tfmetal/batch_norm_act.h in float32.

_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _axes(x):
    return list(range(x.shape.rank - 1)) if x.shape.rank is not None else tf.range(tf.rank(x) - 1)


def reference_activation_grad(activation, pre, alpha):
    """act'(pre), with TensorFlow's gradient ops' values at the kinks (tfmetal/batch_norm_act.h)."""
    one = tf.ones_like(pre)
    if activation == "relu":
        return tf.where(pre > 0.0, one, tf.zeros_like(pre))
    if activation == "relu6":
        return tf.where(tf.logical_and(pre > 0.0, pre < 6.0), one, tf.zeros_like(pre))
    if activation == "elu":
        return tf.where(pre < 0.0, tf.exp(pre), one)
    if activation == "leaky_relu":
        return tf.where(pre > 0.0, one, one * alpha)
    if activation == "silu":
        s = tf.sigmoid(pre)
        return s * (1.0 + pre * (1.0 - s))
    if activation == "gelu":
        return 0.5 * (1.0 + tf.math.erf(pre * _INV_SQRT2)) + pre * _INV_SQRT_2PI * tf.exp(-0.5 * pre * pre)
    return one


def _reference_statistics(xf, epsilon):
    axes = _axes(xf)
    mean = tf.reduce_mean(xf, axes)
    variance = tf.reduce_mean(tf.math.squared_difference(xf, mean), axes)  # two-pass: stable
    return mean, variance, tf.math.rsqrt(variance + epsilon)


def _reference_pre(xf, mean, inv_std, gamma, beta, side):
    pre = (xf - mean) * (inv_std * gamma) + beta
    return pre if side is None else pre + tf.cast(side, tf.float32)


def reference_batch_norm_act(x, gamma, beta, side, activation, epsilon, alpha):
    """``(y, mean, inv_std, variance)`` of the op, in TensorFlow ops (float32 statistics)."""
    xf = tf.cast(x, tf.float32)
    mean, variance, inv_std = _reference_statistics(xf, epsilon)
    pre = _reference_pre(xf, mean, inv_std, gamma, beta, side)
    return tf.cast(_common.reference_activate(pre, activation, alpha), x.dtype), mean, inv_std, variance


def reference_moving_update(mean, variance, moving_mean, moving_variance, momentum):
    """The op's moving-statistics update in TensorFlow ops (tfmetal/batch_norm_act.h ``bna_blend``).

    ``moving * momentum + batch * (1 - momentum)`` in float32 (the batch's
    weight rounded in float32, as the kernels), kept only when all of it is
    finite (`_common.all_finite`: kernels on both Metal backends).
    """
    m = np.float32(momentum)
    kept = tf.constant(m, tf.float32)
    weight = tf.constant(np.float32(1.0) - m, tf.float32)
    new_mean = moving_mean * kept + mean * weight
    new_variance = moving_variance * kept + variance * weight
    ok = _common.all_finite([new_mean, new_variance])
    return tf.where(ok, new_mean, moving_mean), tf.where(ok, new_variance, moving_variance)


def reference_batch_norm_act_grad(dy, x, gamma, beta, side, mean, inv_std, activation, alpha):
    """``(dx, dgamma, dbeta, dside)`` of the op from its saved statistics (dside None without a side)."""
    xf = tf.cast(x, tf.float32)
    pre = _reference_pre(xf, mean, inv_std, gamma, beta, side)
    dpre = tf.cast(dy, tf.float32) * reference_activation_grad(activation, pre, alpha)
    axes = _axes(xf)
    xhat = (xf - mean) * inv_std
    dbeta = tf.reduce_sum(dpre, axes)
    dgamma = tf.reduce_sum(dpre * xhat, axes)
    count = tf.cast(tf.reduce_prod(tf.shape(xf)[:-1]), tf.float32)
    dx = (inv_std * gamma) * (dpre - (dbeta + xhat * dgamma) / count)
    dside = None if side is None else tf.cast(dpre, x.dtype)
    return tf.cast(dx, x.dtype), dgamma, dbeta, dside


def _with_reference_gradient(x, gamma, beta, side, activation, epsilon, alpha):
    if _common.portable():
        y, mean, _, variance = reference_batch_norm_act(x, gamma, beta, side, activation, epsilon, alpha)
        return y, mean, variance

    def forward(x, gamma, beta, side):
        y, mean, inv_std, variance = reference_batch_norm_act(x, gamma, beta, side, activation, epsilon, alpha)

        def grad(dy, unused_dmean, unused_dvariance):
            dx, dgamma, dbeta, dside = reference_batch_norm_act_grad(
                dy, x, gamma, beta, side, mean, inv_std, activation, alpha
            )
            return (dx, dgamma, dbeta) if side is None else (dx, dgamma, dbeta, dside)

        return (y, mean, variance), grad

    if side is None:
        return tf.custom_gradient(lambda x, gamma, beta: forward(x, gamma, beta, None))(x, gamma, beta)
    return tf.custom_gradient(forward)(x, gamma, beta, side)


@tf.RegisterGradient(BATCH_NORM_ACT_OP)
def _batch_norm_act_grad(op, dy, *unused_statistics_grads):
    # The statistics (and the moving statistics' update) are outputs for the moving averages
    # (batch_norm_act returns them through stop_gradient): dy carries the whole gradient, the
    # statistics' dependence on x included; the moving statistics get none.
    lib = _common.library() or _loaded_library()
    n = op.get_attr("N")
    x, gamma, beta = op.inputs[0], op.inputs[1], op.inputs[2]
    sides = list(op.inputs[3:3 + n])
    dx, dgamma, dbeta, dsides = lib.tfmetal_ext_batch_norm_act_grad(
        dy, x, op.outputs[0], gamma, beta, sides, op.outputs[1], op.outputs[2],
        activation=op.get_attr("activation"), alpha=op.get_attr("alpha"), epsilon=op.get_attr("epsilon"),
    )
    return [dx, dgamma, dbeta] + list(dsides) + [None] * op.get_attr("M")


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
