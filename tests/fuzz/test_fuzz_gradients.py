"""Hypothesis fuzzing of gradients and of mixed precision.

- `tf.GradientTape` gradients (the input and every trainable weight) of
  FusedDense, FusedConv2D, FusedLayerNorm, FusedBatchNorm (training), ConvBNAct
  and FusedConv1D against the stock Keras layer with the same random weights,
  eager and under `tf.function` in every example, zero-size batches included
  where stock Keras takes them (not for batch statistics).
- `ops.softshrink` and `ops.layer_norm` gradients against analytic float64
  numpy gradients written here, library and reference paths, eager and
  `tf.function`.
- mixed_float16 / mixed_bfloat16: output dtype as stock's, values and gradients
  within a half-precision tolerance of the stock layer under the same policy,
  gradients finite.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext import backends, devices
from tfmetal_ext.layers import ConvBNAct, FusedBatchNorm, FusedConv1D, FusedConv2D, FusedDense, FusedLayerNorm
from tfmetal_ext.ops import layer_norm, softshrink

from ._tally import expect_ok, fuzz_settings, MODES
from .test_fuzz_blocks import conv_bn_act_pair
from .test_fuzz_layers import _pair

FUZZ = fuzz_settings(6)
_seed = st.integers(0, 2**16)
# TF 2.21's oneDNN Conv2D returns its input unchanged on a zero-size batch (shape [0, h, w, cin]
# instead of [0, h', w', filters]): stock Conv2D/Conv1D then fail at the bias add, so with oneDNN
# on the conv cases draw batch >= 1. TF_ENABLE_ONEDNN_OPTS=0 gives the right empty output.
_MIN_CONV_BATCH = 1 if devices.capabilities().onednn else 0


def assert_scaled_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def tape_gradients(fn, x, weights, upstream, mode="eager"):
    """d(sum(float32(fn(x)) * upstream)) / d[x, *weights], eagerly or in a tf.function."""

    def grads(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(tf.cast(fn(t), tf.float32) * upstream)
        return tape.gradient(loss, [t] + list(weights))

    out = grads(x) if mode == "eager" else tf.function(grads)(x)
    assert all(g is not None for g in out), [g is None for g in out]
    return [g.numpy() for g in out]


# ----------------------------------------------------------------------------
# Layers against stock Keras (float32).


def _layer_case(kind, draw, rng):
    """(ours, stock, x, training, ours' trainable weights, stock's in the same order) for `kind`."""
    act = draw(st.sampled_from([None, "relu", "elu", "tanh"]))
    if kind == "dense":
        x = rng.normal(size=[draw(st.integers(0, 3)), draw(st.integers(1, 5))])
        units, bias = draw(st.integers(1, 5)), draw(st.booleans())
        ours, stock = FusedDense(units, activation=act, use_bias=bias), keras.layers.Dense(units, activation=act,
                                                                                             use_bias=bias)
        training = False
    elif kind in ("conv2d", "conv1d"):
        spatial = [draw(st.integers(1, 6)) for _ in range(2 if kind == "conv2d" else 1)]
        x = rng.normal(size=[draw(st.integers(_MIN_CONV_BATCH, 2)), *spatial, draw(st.integers(1, 3))])
        kw = dict(filters=draw(st.integers(1, 3)), kernel_size=draw(st.integers(1, 3)),
                  strides=draw(st.integers(1, 2)), padding="same", activation=act)
        ours, stock = ((FusedConv2D(**kw), keras.layers.Conv2D(**kw)) if kind == "conv2d"
                       else (FusedConv1D(**kw), keras.layers.Conv1D(**kw)))
        training = False
    elif kind == "layer_norm":
        x = rng.normal(1.0, 3.0, size=[draw(st.integers(0, 3)), *draw(st.lists(st.integers(1, 4), min_size=1,
                                                                                max_size=2))])
        kw = dict(epsilon=draw(st.sampled_from([1e-3, 0.1])), center=draw(st.booleans()), scale=draw(st.booleans()))
        ours, stock = FusedLayerNorm(**kw), keras.layers.LayerNormalization(**kw)
        training = False
    elif kind == "batch_norm":  # batch statistics: Keras' are NaN on an empty batch, so batch >= 1
        x = rng.normal(1.0, 2.0, size=[draw(st.integers(1, 3)), *draw(st.lists(st.integers(1, 3), max_size=2)),
                                       draw(st.integers(1, 4))])
        eps = draw(st.sampled_from([1e-3, 0.1]))
        ours, stock = FusedBatchNorm(epsilon=eps), keras.layers.BatchNormalization(epsilon=eps)
        training = True
    if kind == "conv_bn_act":
        x = tf.constant(rng.normal(1.0, 2.0, size=[draw(st.integers(1, 2)), draw(st.integers(1, 5)),
                                                  draw(st.integers(1, 5)), draw(st.integers(1, 3))]).astype("float32"))
        kw = dict(filters=draw(st.integers(1, 3)), kernel_size=draw(st.integers(1, 3)),
                  strides=draw(st.integers(1, 2)), activation=draw(st.sampled_from(["relu", "elu", "leaky_relu", None])))
        ours, (call, conv, bn) = conv_bn_act_pair(kw, x, rng)
        return ours, call, x, True, [ours.kernel, ours.gamma, ours.beta], [conv.kernel, bn.gamma, bn.beta]
    x = tf.constant(x.astype("float32"))
    _pair(ours, stock, x, rng)
    return ours, stock, x, training, ours.trainable_weights, stock.trainable_weights


@FUZZ
@given(data=st.data(), seed=_seed)
@pytest.mark.parametrize("kind", ["dense", "conv2d", "layer_norm", "batch_norm", "conv_bn_act", "conv1d"])
def test_layer_gradients_match_stock(kind, data, seed):
    rng = np.random.default_rng(seed)
    ours, stock, x, training, ours_w, stock_w = _layer_case(kind, data.draw, rng)
    assert [w.shape for w in ours_w] == [w.shape for w in stock_w]
    want_y = stock(x, training=training)
    upstream = tf.constant(rng.normal(size=want_y.shape).astype("float32"))
    want = tape_gradients(lambda t: stock(t, training=training), x, stock_w, upstream)
    for mode in MODES:
        def verify(got):
            for g, w in zip(got, want):
                assert_scaled_close(g, w, 1e-4)

        expect_ok(lambda: tape_gradients(lambda t: ours(t, training=training), x, ours_w, upstream, mode), verify)


# ----------------------------------------------------------------------------
# Ops against analytic numpy gradients (float32).


def numpy_layer_norm_grads(x, gamma, dy, epsilon):
    """(dx, dgamma, dbeta) of y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis, float64.

    With xhat = (x - mean) * r, r = 1 / sqrt(var + eps), g = dy * gamma over n values:
    dx = r * (g - mean(g) - xhat * mean(g * xhat)); dgamma = sum(dy * xhat); dbeta = sum(dy) (over rows).
    """
    x, gamma, dy = (np.asarray(a, np.float64) for a in (x, gamma, dy))
    rows = tuple(range(x.ndim - 1))
    if x.shape[-1] == 0:
        return np.zeros_like(x), np.zeros_like(gamma), np.zeros_like(gamma)
    mean = x.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + epsilon)
    xhat = (x - mean) * r
    g = dy * gamma
    dx = r * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=rows), dy.sum(axis=rows)


def _op_gradients(mode, fn, x, params, dy):
    def grads(t, *ps):
        with tf.GradientTape() as tape:
            tape.watch([t, *ps])
            loss = tf.reduce_sum(fn(t, *ps) * dy)
        return tape.gradient(loss, [t, *ps])

    out = grads(x, *params) if mode == "eager" else tf.function(grads)(x, *params)
    return [g.numpy() for g in out]


@FUZZ
@given(data=st.data(), lambd=st.sampled_from([0.0, 0.25, 0.5, 2.0]))
@pytest.mark.parametrize("mode", MODES)
def test_softshrink_gradient_matches_numpy(impl, mode, data, lambd):
    # Away from the kinks at +-lambd, where the derivative is not defined.
    away = st.floats(-6, 6, width=32).filter(lambda v: abs(abs(v) - lambd) > 1e-3)
    x = data.draw(hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
                             elements=away), label="x")
    dy = np.random.default_rng(x.size).normal(size=x.shape).astype("float32")
    want = dy * (np.abs(x) > lambd)

    def verify(got):
        (dx,) = got
        assert dx.shape == x.shape and dx.dtype == np.float32
        np.testing.assert_allclose(dx, want, rtol=1e-6, atol=0)

    expect_ok(lambda: _op_gradients(mode, lambda t: softshrink(t, lambd), tf.constant(x), [], tf.constant(dy)), verify)


@FUZZ
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6), epsilon=st.sampled_from([1e-3, 0.5]),
       seed=_seed)
@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_gradients_match_numpy(impl, mode, shape, epsilon, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 3.0, size=shape).astype("float32")
    gamma = rng.uniform(0.5, 2.0, size=shape[-1:]).astype("float32")
    beta = rng.normal(size=shape[-1:]).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    want = numpy_layer_norm_grads(x, gamma, dy, epsilon)

    def verify(got):
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            assert_scaled_close(g, w, 1e-4)

    params = [tf.constant(gamma), tf.constant(beta)]
    fn = lambda t, g, b: layer_norm(t, g, b, epsilon=epsilon)  # noqa: E731
    expect_ok(lambda: _op_gradients(mode, fn, tf.constant(x), params, tf.constant(dy)), verify)


# ----------------------------------------------------------------------------
# Mixed precision against stock Keras under the same policy.

HALF_TOL = {"mixed_float16": 1e-2, "mixed_bfloat16": 3e-2}
# The ops each stock layer needs in the compute dtype (what the backend table is asked about).
_STOCK_OPS = {"dense": ["MatMul"], "conv2d": ["Conv2D"], "layer_norm": [], "conv_bn_act": ["Conv2D"]}


def _skip_without_half_kernels(kind, policy):
    dtype = keras.DTypePolicy(policy).compute_dtype
    table = backends.current(devices.capabilities())
    lacking = [op for op in _STOCK_OPS[kind] if table.has_kernel(op, dtype) is False]
    if lacking:
        pytest.skip(f"{table.label} has no {dtype} kernel for {lacking}: stock Keras cannot run this either")


@fuzz_settings(4)
@given(data=st.data(), seed=_seed)
@pytest.mark.parametrize("policy", list(HALF_TOL))
@pytest.mark.parametrize("kind", list(_STOCK_OPS))
def test_mixed_precision_matches_stock(kind, policy, data, seed):
    _skip_without_half_kernels(kind, policy)
    keras.mixed_precision.set_global_policy(policy)
    draw, rng, tol = data.draw, np.random.default_rng(seed), HALF_TOL[policy]
    batch, cin, out = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    act = draw(st.sampled_from([None, "relu", "elu"]))
    if kind == "conv_bn_act":
        x = tf.constant(rng.normal(size=[batch, 5, 5, cin]).astype("float32"))
        ours, (stock, conv, bn) = conv_bn_act_pair(dict(filters=out, kernel_size=3, activation=act), x, rng)
        ours_w, stock_w = [ours.kernel, ours.gamma, ours.beta], [conv.kernel, bn.gamma, bn.beta]
    else:
        if kind == "dense":
            x = rng.normal(size=[batch, cin])
            ours, stock = FusedDense(out, activation=act), keras.layers.Dense(out, activation=act)
        elif kind == "conv2d":
            x = rng.normal(size=[batch, 5, 5, cin])
            kw = dict(filters=out, kernel_size=3, padding="same", activation=act)
            ours, stock = FusedConv2D(**kw), keras.layers.Conv2D(**kw)
        else:
            x = rng.normal(1.0, 3.0, size=[batch, cin + 1])
            ours, stock = FusedLayerNorm(), keras.layers.LayerNormalization()
        x = tf.constant(x.astype("float32"))
        _pair(ours, stock, x, rng)
        ours_w, stock_w = ours.trainable_weights, stock.trainable_weights
    assert all(w.dtype == "float32" for w in ours_w)
    for training in (False, True):
        want = stock(x, training=training)

        def verify(y):
            assert y.dtype == want.dtype, (y.dtype, want.dtype)
            assert_scaled_close(y, want, tol)

        expect_ok(lambda: ours(x, training=training), verify)
    upstream = tf.constant(rng.normal(size=want.shape).astype("float32"))
    want_g = tape_gradients(lambda t: stock(t, training=True), x, stock_w, upstream)

    def verify_grads(got):
        for g, w in zip(got, want_g):
            assert np.all(np.isfinite(g))
            assert_scaled_close(g, w, tol)

    expect_ok(lambda: tape_gradients(lambda t: ours(t, training=True), x, ours_w, upstream), verify_grads)
