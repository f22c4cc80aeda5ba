"""Pure-TF references of the custom ops: same semantics, any device, slower.

Used when ``TFMETAL_EXT_REFERENCE_OPS=1``, when no compiler is available, and
by the tests as the second reference beside numpy.
"""

from __future__ import annotations

import tensorflow as tf


def softshrink(x, lambd):
    """Computed in float32 and rounded once to x's dtype, as the kernels do
    (tfmetal/softshrink.h): in float16/bfloat16 both ``lambd`` and ``x - lambd``
    would otherwise round, up to 2.5% off near the threshold."""
    xf = tf.cast(x, tf.float32)
    lambd = tf.constant(lambd, tf.float32)
    zero = tf.zeros_like(xf)
    inner = tf.where(tf.math.is_nan(xf), xf, zero)  # NaN propagates
    out = tf.where(xf > lambd, xf - lambd, tf.where(xf < -lambd, xf + lambd, inner))
    return tf.cast(out, x.dtype)


def softshrink_grad(dy, x, lambd):
    """The kernels' float32 comparisons against the float32 ``lambd``."""
    xf = tf.cast(x, tf.float32)
    lambd = tf.constant(lambd, tf.float32)
    outside = tf.logical_or(xf > lambd, xf < -lambd)
    nan_x = tf.cast(xf, dy.dtype)  # NaN where x is NaN (the only place it is used)
    return tf.where(outside, dy, tf.where(tf.math.is_nan(xf), nan_x, tf.zeros_like(dy)))


def _layer_norm_stats(xf, epsilon):
    """Per-row float32 (x - mean) and 1 / sqrt(var + epsilon), two-pass."""
    centered = xf - tf.reduce_mean(xf, axis=-1, keepdims=True)
    rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True) + epsilon)
    return centered, rstd


def layer_norm(x, gamma, beta, epsilon):
    """Layer norm over the last axis in float32; gamma and beta are float32 vectors."""
    centered, rstd = _layer_norm_stats(tf.cast(x, tf.float32), epsilon)
    return tf.cast(centered * rstd * gamma + beta, x.dtype)


def layer_norm_grad(dy, x, gamma, epsilon):
    """(dx, dgamma, dbeta) of `layer_norm`; dgamma and dbeta are float32."""
    centered, rstd = _layer_norm_stats(tf.cast(x, tf.float32), epsilon)
    xhat = centered * rstd
    dy = tf.cast(dy, tf.float32)
    g = dy * gamma
    dx = rstd * (
        g - tf.reduce_mean(g, axis=-1, keepdims=True) - xhat * tf.reduce_mean(g * xhat, axis=-1, keepdims=True)
    )
    rows = list(range(x.shape.rank - 1)) if x.shape.rank is not None else tf.range(tf.rank(x) - 1)
    return tf.cast(dx, x.dtype), tf.reduce_sum(dy * xhat, rows), tf.reduce_sum(dy, rows)


def loss_scaled_update(grads, scale, dtype, update, name=None):
    """The multi-tensor ops' loss scaling (tfmetal/loss_scale.h) around `update`, in TF ops.

    `grads` are the loss-scaled gradients (dense, of `dtype`) and `scale` a float32 scalar.
    Returns ``found_non_finite``, a bool scalar: True when an element of a gradient is NaN
    or infinite, and then `update` is not run (nothing is written); else
    ``update(unscaled)`` runs with each gradient divided by `scale` in float32 and
    rounded to `dtype`, as Keras' LossScaleOptimizer unscales before our optimizers
    cast to the variable's dtype.
    """
    with tf.name_scope(name or "loss_scaled_update"):
        finite = [tf.reduce_all(tf.math.is_finite(g)) for g in grads]
        found = tf.logical_not(tf.reduce_all(tf.stack(finite)))

        def apply():
            unscaled = [tf.cast(tf.cast(g, tf.float32) / scale, dtype) for g in grads]
            with tf.control_dependencies([u for u in [update(unscaled)] if u is not None]):
                return tf.constant(False)

        if tf.executing_eagerly():
            if not bool(found):
                apply()
            return found
        return tf.cond(found, lambda: tf.constant(True), apply)


def multi_tensor_adam(var_handles, m_handles, v_handles, vhat_handles, grads, lr, beta1, beta2, epsilon,
                      beta1_power, beta2_power, weight_decay_rate, dtype, name=None):
    """One ``ResourceApplyAdam`` (``...WithAmsgrad`` with vhats) per variable,
    after ``ResourceApplyGradientDescent(delta=var)`` when decaying: the
    per-variable ops TfmetalExt>MultiTensorAdam reproduces bitwise."""
    updates = []
    with tf.name_scope(name or "multi_tensor_adam"):
        for i, (var, m, v, grad) in enumerate(zip(var_handles, m_handles, v_handles, grads)):
            deps = []
            if weight_decay_rate is not None:
                delta = tf.raw_ops.ReadVariableOp(resource=var, dtype=dtype)
                decay = tf.raw_ops.ResourceApplyGradientDescent(var=var, alpha=weight_decay_rate, delta=delta)
                deps = [decay] if decay is not None else []
            with tf.control_dependencies(deps):
                args = dict(var=var, m=m, v=v, beta1_power=beta1_power, beta2_power=beta2_power, lr=lr,
                            beta1=beta1, beta2=beta2, epsilon=epsilon, grad=grad)
                if vhat_handles:
                    updates.append(tf.raw_ops.ResourceApplyAdamWithAmsgrad(vhat=vhat_handles[i], **args))
                else:
                    updates.append(tf.raw_ops.ResourceApplyAdam(**args))
    if tf.executing_eagerly():
        return None
    return tf.group(*updates)


def multi_tensor_lion(var_handles, m_handles, grads, lr, beta1, beta2, weight_decay_rate, dtype, name=None):
    """Keras' ``Lion.update_step`` per variable, op for op in the variables'
    dtype (after ``var -= var * weight_decay_rate`` when decaying): the ops
    TfmetalExt>MultiTensorLion reproduces bitwise::

        var -= lr * sign(m * beta1 + grad * (1 - beta1))
        m = m * beta2 + grad * (1 - beta2)
    """
    updates = []
    with tf.name_scope(name or "multi_tensor_lion"):
        one = tf.constant(1, dtype)
        one_minus_beta1, one_minus_beta2 = one - beta1, one - beta2
        for var, m, grad in zip(var_handles, m_handles, grads):
            deps = []
            if weight_decay_rate is not None:
                value = tf.raw_ops.ReadVariableOp(resource=var, dtype=dtype)
                decay = tf.raw_ops.AssignSubVariableOp(resource=var, value=value * weight_decay_rate)
                deps = [decay] if decay is not None else []
            with tf.control_dependencies(deps):
                m_value = tf.raw_ops.ReadVariableOp(resource=m, dtype=dtype)
                blend = m_value * beta1 + grad * one_minus_beta1
                step = tf.raw_ops.AssignSubVariableOp(resource=var, value=lr * tf.sign(blend))
                new_m = m_value * beta2 + grad * one_minus_beta2
            with tf.control_dependencies([step] if step is not None else []):
                updates.append(tf.raw_ops.AssignVariableOp(resource=m, value=new_m))
    if tf.executing_eagerly():
        return None
    return tf.group(*updates)


def multi_tensor_rmsprop(var_handles, ms_handles, mom_handles, mg_handles, grads, lr, rho, one_minus_rho, momentum,
                         epsilon, weight_decay_rate, dtype, name=None):
    """Keras' ``RMSprop.update_step`` per variable, op for op in the variables'
    dtype (after ``var -= var * weight_decay_rate`` when decaying): the ops
    TfmetalExt>MultiTensorRMSprop reproduces bitwise. `mom_handles` and
    `mg_handles` are empty lists without momentum / centering::

        ms = rho * ms + one_minus_rho * grad**2
        mg = rho * mg + one_minus_rho * grad              (centered)
        inc = lr * grad / sqrt(ms - mg**2 + epsilon)      (centered; else ms + epsilon)
        mom = momentum * mom + inc; var -= mom            (momentum; else var -= inc)
    """
    updates = []
    n = len(var_handles)
    moms = mom_handles or [None] * n
    mgs = mg_handles or [None] * n
    with tf.name_scope(name or "multi_tensor_rmsprop"):
        for var, ms, mom, mg, grad in zip(var_handles, ms_handles, moms, mgs, grads):
            deps = []
            if weight_decay_rate is not None:
                value = tf.raw_ops.ReadVariableOp(resource=var, dtype=dtype)
                decay = tf.raw_ops.AssignSubVariableOp(resource=var, value=value * weight_decay_rate)
                deps = [decay] if decay is not None else []
            with tf.control_dependencies(deps):
                ms_value = tf.raw_ops.ReadVariableOp(resource=ms, dtype=dtype)
                new_ms = rho * ms_value + one_minus_rho * tf.square(grad)
                assigns = [tf.raw_ops.AssignVariableOp(resource=ms, value=new_ms)]
                if mg is not None:
                    mg_value = tf.raw_ops.ReadVariableOp(resource=mg, dtype=dtype)
                    new_mg = rho * mg_value + one_minus_rho * grad
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=mg, value=new_mg))
                    denominator = new_ms - tf.square(new_mg) + epsilon
                else:
                    denominator = new_ms + epsilon
                increment = (lr * grad) / tf.sqrt(denominator)
                if mom is not None:
                    mom_value = tf.raw_ops.ReadVariableOp(resource=mom, dtype=dtype)
                    new_mom = momentum * mom_value + increment
                    assigns.append(tf.raw_ops.AssignVariableOp(resource=mom, value=new_mom))
                    step = new_mom
                else:
                    step = increment
            with tf.control_dependencies([a for a in assigns if a is not None]):
                updates.append(tf.raw_ops.AssignSubVariableOp(resource=var, value=step))
    if tf.executing_eagerly():
        return None
    return tf.group(*updates)


def rope(x, positions, inv_freq, scale=1.0, inverse=False):
    """The kernels' float32 rotation (tfmetal/rope.h), rounded once to x's dtype.

    x is [batch, seq, ..., features]; positions [seq] or [batch, seq] float32;
    `inverse` turns back (the gradient).
    """
    xf = tf.cast(x, tf.float32)
    positions = tf.reshape(positions, [-1, tf.shape(positions)[-1]])  # [1 or batch, seq]
    angle = positions[:, :, None] * inv_freq  # one float32 product, as keras-hub's einsum
    c, s = tf.cos(angle), tf.sin(angle)
    if scale != 1.0:
        c, s = c * scale, s * scale
    inner = tf.rank(xf) - 3
    shape = tf.concat([tf.shape(c)[:2], tf.ones([inner], tf.int32), tf.shape(c)[2:]], 0)
    c, s = tf.reshape(c, shape), tf.reshape(s, shape)
    x1, x2 = tf.split(xf, 2, axis=-1)
    if inverse:
        y1, y2 = x1 * c + x2 * s, x2 * c - x1 * s
    else:
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    return tf.cast(tf.concat([y1, y2], -1), x.dtype)


# The activation_grad math (tfmetal/activation_grad.h), once, in float32 TF ops.
_ACTIVATION_GRAD_SATURATION = 128.0  # TFM_ACTGRAD_SATURATION
_SQRT_2_OVER_PI = 0.79788456080286536
_GELU_TANH_K = 0.044715


def _saturated(xf):
    """x clamped to +-128 (TFM_ACTGRAD_SATURATION); NaN stays NaN."""
    sat = tf.constant(_ACTIVATION_GRAD_SATURATION, xf.dtype)
    return tf.where(xf > sat, sat, tf.where(xf < -sat, -sat, xf))


def activation_derivative(xf, activation):
    """act'(x) of float32 `xf` as the kernels compute it: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_approximate"``.

    Differentiable (the op's second-order gradient is its autodiff). x beyond +-128 (+-inf
    included) is taken at +-128, where every derivative is exactly 1 or 0 in float32; NaN stays NaN.
    """
    v = _saturated(xf)
    one, half = tf.constant(1.0, xf.dtype), tf.constant(0.5, xf.dtype)
    if activation == "silu":
        s = one / (one + tf.exp(-v))
        return s * (one + v * (one - s))
    if activation == "gelu":
        cdf = half * (one + tf.math.erf(v * tf.constant(0.70710678118654752, xf.dtype)))
        return cdf + v * tf.constant(0.39894228040143268, xf.dtype) * tf.exp(-half * v * v)
    if activation == "gelu_approximate":
        c, k = tf.constant(_SQRT_2_OVER_PI, xf.dtype), tf.constant(_GELU_TANH_K, xf.dtype)
        v2 = v * v
        u = c * v * (one + k * v2)
        # |u| as a select, not Abs: Abs's gradient at 0 is 0, the select's takes the u >= 0 branch, so
        # the autodiff (the op's second-order gradient) is right at x = 0 too.
        abs_u = tf.where(u < 0, -u, u)
        e = tf.exp(tf.constant(-2.0, xf.dtype) * abs_u)  # sigmoid(2u) = 0.5 (1 + tanh u), without cancellation
        r = one / (one + e)
        s = tf.where(u < 0, e * r, r)
        return s + tf.constant(2.0, xf.dtype) * v * (e * r * r) * c * (one + tf.constant(3.0, xf.dtype) * k * v2)
    raise ValueError(f"Unknown activation for activation_grad's reference. Received: activation={activation!r}")


def activation_grad(dy, x, activation):
    """dy * act'(x) in float32, rounded once to x's dtype (TfmetalExt>ActivationGrad)."""
    xf = tf.cast(x, tf.float32)
    return tf.cast(tf.cast(dy, tf.float32) * activation_derivative(xf, activation), x.dtype)


def activation_factor(xf, activation):
    """f(x) of act(x) = x * f(x) for float32 `xf`, at x clamped to +-128 (exactly 1 or 0 beyond)."""
    v = _saturated(xf)
    one, half = tf.constant(1.0, xf.dtype), tf.constant(0.5, xf.dtype)
    if activation == "silu":
        return tf.math.sigmoid(v)
    if activation == "gelu":
        return half * (one + tf.math.erf(v * tf.constant(0.70710678118654752, xf.dtype)))
    if activation == "gelu_approximate":
        c, k = tf.constant(_SQRT_2_OVER_PI, xf.dtype), tf.constant(_GELU_TANH_K, xf.dtype)
        return tf.math.sigmoid(tf.constant(2.0, xf.dtype) * c * v * (one + k * v * v))
    raise ValueError(f"Unknown activation for gated_activation_grad's reference. Received: activation={activation!r}")


def gated_activation_grad_terms(dyf, gf, uf, activation):
    """(dy * up * act'(gate), dy * act(gate)) in the inputs' float dtype: the kernels' formula (float32
    there). Differentiable: the op's second-order gradient is its autodiff."""
    return (dyf * uf) * activation_derivative(gf, activation), dyf * (gf * activation_factor(gf, activation))


def gated_activation_grad(dy, gate, up, activation):
    """(dy * up * act'(gate), dy * act(gate)) in float32, each rounded once (TfmetalExt>GatedActivationGrad)."""
    d_gate, d_up = gated_activation_grad_terms(*(tf.cast(t, tf.float32) for t in (dy, gate, up)), activation)
    return tf.cast(d_gate, gate.dtype), tf.cast(d_up, gate.dtype)


def sparse_softmax_cross_entropy_stats(logits):
    """``(float32 logits, row max, row sum of exp(x - max))`` of logits [rows, classes]
    (tfmetal/sparse_xent.h's statistics; TF's max propagates a NaN the kernels skip, which changes
    only the statistics of a row whose loss is NaN either way)."""
    xf = tf.cast(logits, tf.float32)
    row_max = tf.reduce_max(xf, axis=-1)
    row_sum = tf.reduce_sum(tf.exp(xf - row_max[:, None]), axis=-1)
    return xf, row_max, row_sum


def sparse_softmax_cross_entropy(logits, labels):
    """``(loss, row_max, row_sum)`` of TfmetalExt>SparseSoftmaxCrossEntropy: logits [rows, classes],
    labels [rows]; ``loss = log(sum) - (x_label - max)`` in float32, rounded once to the logits' dtype.
    A label outside [0, classes) fails in TF's gather on the CPU."""
    xf, row_max, row_sum = sparse_softmax_cross_entropy_stats(logits)
    label_logit = tf.gather(xf, labels, batch_dims=1)
    loss = tf.math.log(row_sum) - (label_logit - row_max)
    return tf.cast(loss, logits.dtype), row_max, row_sum


def sparse_softmax_cross_entropy_grad(dloss, logits, labels, row_max, row_sum):
    """``(exp(x - max) * (1 / sum) - one_hot(label)) * dloss`` in float32, rounded once (the kernels'
    formula, tfmetal/sparse_xent.h)."""
    xf = tf.cast(logits, tf.float32)
    p = tf.exp(xf - row_max[:, None]) * (1.0 / row_sum)[:, None]
    one_hot = tf.one_hot(labels, tf.shape(xf)[-1], dtype=tf.float32)
    return tf.cast((p - one_hot) * tf.cast(dloss, tf.float32)[:, None], logits.dtype)
