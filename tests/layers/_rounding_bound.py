"""A derived bound on the rounding error of multi-head attention under a mixed (half / bfloat16) policy.

What it bounds. FusedMultiHeadAttention under ``mixed_float16`` / ``mixed_bfloat16`` computes in the
half type: its inputs and weights are rounded to it, each projection's output is rounded, the
attention op computes in float32 and rounds its output once (forward: O; backward: dQ, dK, dV), and
the gradients TF computes for the projections (MatMul, BiasAdd grads) are rounded once each. Every
such rounding to nearest gives ``fl(x) = x (1 + d)`` with ``|d| <= u``, ``u = 2**-p`` for a type of
p significand bits (bfloat16: p = 8, u = 2**-8; float16: p = 11, u = 2**-11).

How. The layer's forward and backward are written out here in float64 (the backward by hand, not by
TF's autodiff: an independent reference), with a factor ``(1 + d_s)`` at every rounding site s. For
each output or gradient component g, to first order in the d's,

    |g_rounded - g_exact| <= u * sum_s |dg/dd_s|          (at d = 0)

(the linearized componentwise bound of forward error analysis; Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., sections 3.1 and 3.5). The sites are a superset of where the layer
rounds (a MatMul output and its BiasAdd output both count, though TF fuses them into one rounding):
extra sites only add non-negative terms, so the bound stays a bound. Float32 accumulation inside an
op (contraction length n <= 8 here) adds at most ``gamma_n = n 2**-24 / (1 - n 2**-24)`` relative to
the terms' absolute sum: under ``2**-21``, which is counted by widening u by it. The second-order
remainder is at most ``(k u')**2``-relative with k <= 12 sites on any path (``k u' <= 0.047`` for
bfloat16): ``SLACK`` covers it.

What a component that exceeds it means: a rounding the algorithm was not supposed to make (say, the
attention op rounding its scores or probabilities to the half type, or accumulating in it).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

SIGNIFICAND_BITS = {"float16": 11, "bfloat16": 8}
# Second-order remainder of the linearization: (k u)^2 / (k u) = k u <= 0.047 for k = 12 sites, u = 2^-8.
SLACK = 1.05
# Float32 accumulation over a contraction of length n <= 8 (gamma_n), relative to |terms|.
F32_ACCUMULATION = 8 * 2.0**-24 / (1 - 8 * 2.0**-24)


def unit_roundoff(dtype: str) -> float:
    return 2.0 ** -SIGNIFICAND_BITS[dtype] + F32_ACCUMULATION


class _Sites:
    """The rounding perturbations d_s, created on a first pass and read on the second."""

    def __init__(self):
        self.deltas = {}
        self.recording = True

    def __call__(self, name, x):
        if self.recording:
            self.deltas[name] = tf.zeros_like(x)
            return x
        return x * (1.0 + self.deltas[name])


def _forward_backward(sites, p, xq, xk, xv, allowed, dy_weights, scale):
    """Outputs [y, dq, dv, dk, dWq, dbq, dWk, dbk, dWv, dbv, dWo, dbo], float64, with rounding sites."""
    r = sites
    xq_, xk_, xv_ = r("xq", xq), r("xk", xk), r("xv", xv)
    w = {n: r(n, p[n]) for n in ("Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo")}

    def project(x, kernel, bias, name):
        m = r(name + "_matmul", tf.einsum("btd,dhe->bhte", x, w[kernel]))
        return r(name, m + w[bias][None, :, None, :])

    q, k, v = project(xq_, "Wq", "bq", "Q"), project(xk_, "Wk", "bk", "K"), project(xv_, "Wv", "bv", "V")
    # The attention op: float32 inside (no site), output rounded once. A row that attends no key gets
    # the mean of the values (the stock semantics), computed and rounded in the layer.
    mask = tf.constant(allowed[:, None], tf.bool)  # (b, 1, tq, tk)
    s = scale * tf.einsum("bhqe,bhke->bhqk", q, k)
    s = tf.where(mask, s, tf.constant(-np.inf, tf.float64))
    attended = tf.reduce_any(mask, axis=-1, keepdims=True)
    s_safe = tf.where(attended, s, tf.zeros_like(s))
    prob = tf.where(mask, tf.nn.softmax(s_safe, axis=-1), tf.zeros_like(s))
    o_att = tf.einsum("bhqk,bhkv->bhqv", prob, v)
    mean_v = tf.reduce_mean(v, axis=2, keepdims=True)
    o = r("O", tf.where(attended, o_att, tf.broadcast_to(mean_v, tf.shape(o_att))))
    y_m = r("Y_matmul", tf.einsum("bhqv,hvo->bqo", o, w["Wo"]))
    y = r("Y", y_m + w["bo"])

    # Backward of loss = sum(cast(y, f32) * dy_weights): the gradient reaches y rounded to the half type.
    g_y = r("gY", tf.constant(dy_weights, tf.float64))
    g_ym = r("gY_matmul", g_y)
    g_bo = r("gbo", tf.reduce_sum(g_y, axis=[0, 1]))
    g_wo = r("gWo", tf.einsum("bhqv,bqo->hvo", o, g_ym))
    g_o = r("gO", tf.einsum("bqo,hvo->bhqv", g_ym, w["Wo"]))
    # The op's backward (float32 inside, each of dQ, dK, dV rounded once); it reads its own rounded
    # output O for D = rowsum(dO * O), as FlashAttention's backward does.
    g_att = tf.where(attended, g_o, tf.zeros_like(g_o))
    g_mean = tf.where(attended, tf.zeros_like(g_o), g_o)
    tk = tf.cast(tf.shape(v)[2], tf.float64)
    g_v = tf.einsum("bhqk,bhqv->bhkv", prob, g_att) + tf.reduce_sum(g_mean, axis=2, keepdims=True) / tk
    d_p = tf.einsum("bhqv,bhkv->bhqk", g_att, v)
    d_row = tf.reduce_sum(g_att * o, axis=-1, keepdims=True)
    d_s = prob * (d_p - d_row)
    g_q = r("gQ", scale * tf.einsum("bhqk,bhke->bhqe", d_s, k))
    g_k = r("gK", scale * tf.einsum("bhqk,bhqe->bhke", d_s, q))
    g_v = r("gV", g_v)

    def project_back(g, x, kernel, name):
        g_m = r("g" + name + "_matmul", g)
        g_b = r("gb" + name, tf.reduce_sum(g, axis=[0, 2]))
        g_w = r("gW" + name, tf.einsum("btd,bhte->dhe", x, g_m))
        g_x = r("gx" + name, tf.einsum("bhte,dhe->btd", g_m, w[kernel]))
        return g_x, g_w, g_b

    dq, dwq, dbq = project_back(g_q, xq_, "Wq", "q")
    dk, dwk, dbk = project_back(g_k, xk_, "Wk", "k")
    dv, dwv, dbv = project_back(g_v, xv_, "Wv", "v")
    return [y, dq, dv, dk, dwq, dbq, dwk, dbk, dwv, dbv, g_wo, g_bo]


def attention_rounding_bound(params, xq, xk, xv, allowed, dy_weights, scale, dtype):
    """The exact (float64) outputs and the first-order rounding bound of each, componentwise.

    Args:
        params: float32 weights by name: Wq (d, h, e), bq (h, e), Wk, bk, Wv (d, h, ev), bv,
            Wo (h, ev, do), bo (do,).
        xq, xk, xv: the query (b, tq, d), key and value (b, tk, d) inputs.
        allowed: (b, tq, tk) boolean, which keys each query attends (Keras' combined mask).
        dy_weights: (b, tq, do) the loss's weights (loss = sum(y * dy_weights)).
        scale: the score scale (1 / sqrt(key_dim)).
        dtype: ``"bfloat16"`` or ``"float16"``.

    Returns:
        ``(exact, bound)``: lists of float64 arrays in the order y, d query, d value, d key, d Wq,
        d bq, d Wk, d bk, d Wv, d bv, d Wo, d bo.
    """
    u = unit_roundoff(dtype)
    as64 = lambda a: tf.constant(np.asarray(a, np.float64))  # noqa: E731
    p = {n: as64(a) for n, a in params.items()}
    args = (p, as64(xq), as64(xk), as64(xv), np.asarray(allowed, bool), np.asarray(dy_weights, np.float64),
            float(scale))
    sites = _Sites()
    _forward_backward(sites, *args)
    sites.recording = False
    names = list(sites.deltas)
    deltas = [sites.deltas[n] for n in names]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(deltas)
        sites.deltas = dict(zip(names, deltas))
        outs = _forward_backward(sites, *args)
        flat = tf.concat([tf.reshape(o, [-1]) for o in outs], axis=0)
    jacobians = tape.jacobian(flat, deltas, experimental_use_pfor=True)
    total = sum(tf.reduce_sum(tf.abs(tf.reshape(j, [tf.shape(flat)[0], -1])), axis=1) for j in jacobians)
    bound = SLACK * u * total.numpy()
    exact, start = [], 0
    bounds = []
    for o in outs:
        n = int(np.prod(o.shape))
        exact.append(o.numpy())
        bounds.append(bound[start:start + n].reshape(o.shape))
        start += n
    return exact, bounds
