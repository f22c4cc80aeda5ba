"""rms_norm: one op forward (``TfmetalExt>RMSNorm``), one op backward."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common
from tfmetal_ext.ops.layer_norm import _check_epsilon, _parameter

RMS_NORM_OP = fusion.RMS_NORM_OP
RMS_NORM_GRAD_OP = fusion.RMS_NORM_GRAD_OP


def epsilon_reason(epsilon):
    """Why `epsilon` is not an epsilon the RMS-norm op takes (a finite float > 0, also in float32), or None."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        return f"epsilon={epsilon!r}: the RMS-norm op takes a finite float > 0"
    with np.errstate(over="ignore", under="ignore"):
        eps32 = float(np.float32(epsilon))  # the kernel's float32 attr
    if not (math.isfinite(eps32) and eps32 > 0.0):
        return f"epsilon={epsilon!r}: the RMS-norm op takes a finite float > 0 (in float32)"
    return None


@tf.autograph.experimental.do_not_convert  # plain graph building; also keeps autograph out of the loader
def rms_norm(x, gamma=None, epsilon=1e-6, name=None):
    """Root-mean-square normalization over the last axis of `x`.

    ``y = x / sqrt(mean(x^2) + epsilon) * gamma`` with the mean square of
    each row of the last axis, computed in float32 for every input dtype (no
    mean is subtracted, no offset added: Zhang & Sennrich's RMSNorm, as
    `keras.layers.RMSNormalization` computes it).

    One custom op forward (``TfmetalExt>RMSNorm``, which also saves the
    per-row 1/rms for the gradient) and one backward
    (``TfmetalExt>RMSNormGrad``: dx and dgamma in one kernel). CPU kernel
    here; a Metal kernel on Apple GPUs.

    `gamma` is used as float32 (the op's parameter dtype for every `x`
    dtype, so mixed-precision layers can pass their float32 variable without
    a cast); dgamma flows back in float32 (cast back to the dtype passed in,
    if another). The gradient is deterministic: the row sums use a fixed
    partition, independent of the thread count.

    A NaN in a row makes that row's output NaN; an infinity makes the row's
    mean square infinite, so its finite values give 0 and the infinity NaN
    (as the unfused computation). Other rows are left alone; the row's
    gradient is NaN. A zero-size last axis gives an empty output.

    Args:
        x: a float32, float16 or bfloat16 tensor of rank >= 1.
        gamma: the scale, a float vector of `x`'s last dimension, or None
            for 1.
        epsilon: added to the mean square, a finite float > 0.
        name: optional op name.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for a non-float dtype, a rank-0 `x`, a `gamma` that is
            not a vector of `x`'s last dimension, or an epsilon that is not a
            finite float > 0.

    >>> y = rms_norm(tf.constant([[3.0, 4.0]]), epsilon=1e-6)
    >>> np.round(y.numpy(), 4)
    array([[0.8485, 1.1314]], dtype=float32)
    """
    epsilon = _check_epsilon(epsilon)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank == 0:
        raise ValueError(f"`x` must have rank >= 1 (normalized over its last axis). Received: x.shape={x.shape}")
    gamma = _parameter("gamma", gamma, x, 1.0)
    if not uses_kernel():
        return _with_reference_gradient(x, gamma, epsilon)
    lib = _common.library()
    y, _ = lib.tfmetal_ext_rms_norm(x, gamma, epsilon=epsilon, name=name)
    return y


def uses_kernel() -> bool:
    """`rms_norm` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(RMS_NORM_OP)


# ----------------------------------------------------------------------------
# The pure-TF reference (TFMETAL_EXT_REFERENCE_OPS=1, configure(avoid_fusions=["rms_norm"]),
# no op library, or no kernel for the visible GPU).


def _reference_rstd(xf, epsilon):
    """Per-row float32 1 / sqrt(mean(x^2) + epsilon), keepdims."""
    return tf.math.rsqrt(tf.reduce_mean(tf.square(xf), axis=-1, keepdims=True) + epsilon)


def reference_rms_norm(x, gamma, epsilon):
    """RMS norm over the last axis in float32; gamma is a float32 vector."""
    xf = tf.cast(x, tf.float32)
    return tf.cast(xf * _reference_rstd(xf, epsilon) * gamma, x.dtype)


def reference_rms_norm_grad(dy, x, gamma, epsilon):
    """(dx, dgamma) of `reference_rms_norm`; dgamma is float32."""
    xf = tf.cast(x, tf.float32)
    rstd = _reference_rstd(xf, epsilon)
    xhat = xf * rstd
    dy = tf.cast(dy, tf.float32)
    g = dy * gamma
    dx = rstd * (g - xhat * tf.reduce_mean(g * xhat, axis=-1, keepdims=True))
    rows = list(range(x.shape.rank - 1)) if x.shape.rank is not None else tf.range(tf.rank(x) - 1)
    return tf.cast(dx, x.dtype), tf.reduce_sum(dy * xhat, rows)


def _with_reference_gradient(x, gamma, epsilon):
    if _common.portable():
        return reference_rms_norm(x, gamma, epsilon)

    @tf.custom_gradient
    def fn(x, gamma):
        def grad(dy):
            return reference_rms_norm_grad(dy, x, gamma, epsilon)

        return reference_rms_norm(x, gamma, epsilon), grad

    return fn(x, gamma)


@tf.RegisterGradient(RMS_NORM_OP)
def _rms_norm_grad(op, dy, unused_drstd):
    # rstd is internal (rms_norm returns y only): no gradient flows through it.
    lib = _common.library() or _loaded_library()
    x, gamma = op.inputs[0], op.inputs[1]
    dx, dgamma = lib.tfmetal_ext_rms_norm_grad(dy, x, gamma, op.outputs[1])
    return dx, dgamma


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
