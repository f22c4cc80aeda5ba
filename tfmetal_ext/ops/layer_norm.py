"""layer_norm: one op forward (``TfmetalExt>LayerNorm``), one op backward."""

from __future__ import annotations

import math

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

LAYER_NORM_OP = fusion.LAYER_NORM_OP
LAYER_NORM_GRAD_OP = fusion.LAYER_NORM_GRAD_OP


@tf.autograph.experimental.do_not_convert  # plain graph building; also keeps autograph out of the loader
def layer_norm(x, gamma=None, beta=None, epsilon=1e-3, name=None):
    """Layer normalization over the last axis of `x`.

    ``y = (x - mean) / sqrt(var + epsilon) * gamma + beta`` with the mean and
    (biased) variance of each row of the last axis, computed in float32 for
    every input dtype with two passes over the row (accurate when the mean is
    large against the spread, as in float16 activations around 1000).

    One custom op forward (``TfmetalExt>LayerNorm``, which also saves the
    per-row mean and 1/std for the gradient) and one backward
    (``TfmetalExt>LayerNormGrad``: dx, dgamma and dbeta in one kernel), where
    `keras.layers.LayerNormalization` is about 30 ops per train step. CPU
    kernel here; a Metal kernel on Apple GPUs.

    `gamma` and `beta` are used as float32 (the op's parameter dtype for
    every `x` dtype, so mixed-precision layers pass their float32 variables
    without a cast); dgamma and dbeta flow back in float32 (cast back to the
    dtype passed in, if another). The gradients are deterministic: the row
    sums use a fixed partition, independent of the thread count.

    A NaN or infinity in a row makes that row's output NaN and leaves the
    other rows alone. A zero-size last axis gives an empty output.

    Args:
        x: a float32, float16 or bfloat16 tensor of rank >= 1.
        gamma: the scale, a float vector of `x`'s last dimension, or None
            for 1.
        beta: the offset, a float vector of `x`'s last dimension, or None
            for 0.
        epsilon: added to the variance, a finite float > 0.
        name: optional op name.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for a non-float dtype, a rank-0 `x`, a `gamma`/`beta`
            that is not a vector of `x`'s last dimension, or an epsilon
            that is not a finite float > 0.

    >>> y = layer_norm(tf.constant([[1.0, 2.0, 3.0]]), epsilon=1e-6)
    >>> np.round(y.numpy(), 4)
    array([[-1.2247,  0.    ,  1.2247]], dtype=float32)
    """
    epsilon = _check_epsilon(epsilon)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank == 0:
        raise ValueError(f"`x` must have rank >= 1 (normalized over its last axis). Received: x.shape={x.shape}")
    gamma = _parameter("gamma", gamma, x, 1.0)
    beta = _parameter("beta", beta, x, 0.0)
    if not uses_kernel():
        return _with_reference_gradient(x, gamma, beta, epsilon)
    lib = _common.library()
    y, _, _ = lib.tfmetal_ext_layer_norm(x, gamma, beta, epsilon=epsilon, name=name)
    return y


def _check_epsilon(epsilon):
    value = None
    if not isinstance(epsilon, bool):
        try:
            value = float(epsilon)
        except (TypeError, ValueError):
            value = None
    if value is None or not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"Argument `epsilon` must be a finite float > 0. Received: epsilon={epsilon!r}")
    return value


def _parameter(name, value, x, default):
    """gamma / beta as a float32 vector of x's last dimension (`default` filled for None)."""
    channels = x.shape[-1] if x.shape.rank is not None else None
    if value is None:
        size = [channels] if channels is not None else tf.shape(x)[-1:]
        return (tf.ones if default else tf.zeros)(size, tf.float32)
    value = tf.convert_to_tensor(value)
    if not value.dtype.is_floating:
        raise ValueError(f"`{name}` must be a float tensor. Received: {name}.dtype={value.dtype.name}")
    if value.shape.rank not in (None, 1) or (
        value.shape.rank == 1 and None not in (channels, value.shape[0]) and value.shape[0] != channels
    ):
        raise ValueError(
            f"`{name}` must be a vector of x's last dimension ({channels}). Received: {name}.shape={value.shape}"
        )
    return tf.cast(value, tf.float32)


def uses_kernel() -> bool:
    """`layer_norm` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(LAYER_NORM_OP)


def _with_reference_gradient(x, gamma, beta, epsilon):
    if _common.portable():
        return _reference.layer_norm(x, gamma, beta, epsilon)

    @tf.custom_gradient
    def fn(x, gamma, beta):
        def grad(dy):
            return _reference.layer_norm_grad(dy, x, gamma, epsilon)

        return _reference.layer_norm(x, gamma, beta, epsilon), grad

    return fn(x, gamma, beta)


@tf.RegisterGradient(LAYER_NORM_OP)
def _layer_norm_grad(op, dy, unused_dmean, unused_drstd):
    # The statistics are internal (layer_norm returns y only): no gradient
    # flows through them.
    lib = _common.library() or _loaded_library()
    x, gamma = op.inputs[0], op.inputs[1]
    dx, dgamma, dbeta = lib.tfmetal_ext_layer_norm_grad(dy, x, gamma, op.outputs[1], op.outputs[2])
    return dx, dgamma, dbeta


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
