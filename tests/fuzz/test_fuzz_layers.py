"""Hypothesis fuzzing of the layers' call against stock Keras layers with the same weights.

Stock Keras is the independent reference here: FusedDense, FusedConv2D,
FusedLayerNorm and FusedBatchNorm (inference) on random shapes, random
weights copied from the stock layer, eager and `tf.function`. Inputs of a rank
the layer cannot take must raise ValueError.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tfmetal_ext.layers import FusedBatchNorm, FusedConv2D, FusedDense, FusedLayerNorm

from ._tally import expect_error, expect_ok, fuzz_settings, MODES

FUZZ = fuzz_settings(8)


def _pair(ours, stock, x, rng):
    stock(x)
    ours(x)
    weights = [rng.normal(size=w.shape).astype("float32") for w in stock.get_weights()]
    if isinstance(stock, keras.layers.BatchNormalization):
        weights[3] = np.abs(weights[3]) + 0.1  # moving variance > 0
    stock.set_weights(weights)
    ours.set_weights(weights)


def _compare(ours, stock, x, mode, tol):
    call = (lambda t: ours(t, training=False)) if mode == "eager" else tf.function(lambda t: ours(t, training=False))
    want = stock(x, training=False).numpy().astype(np.float64)

    def verify(y):
        got = np.asarray(y).astype(np.float64)
        assert got.shape == want.shape, (got.shape, want.shape)
        scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)

    expect_ok(lambda: call(x), verify)


_batch = st.integers(1, 3)
_act = st.sampled_from([None, "relu", "relu6", "elu", "leaky_relu", "tanh"])


@FUZZ
@given(batch=_batch, lead=st.lists(st.integers(1, 3), max_size=2), cin=st.integers(1, 6), units=st.integers(1, 6),
       act=_act, use_bias=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("mode", MODES)
def test_fused_dense_matches_keras_dense(mode, batch, lead, cin, units, act, use_bias, seed):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=[batch, *lead, cin]).astype("float32"))
    ours, stock = FusedDense(units, activation=act, use_bias=use_bias), keras.layers.Dense(units, activation=act, use_bias=use_bias)
    _pair(ours, stock, x, rng)
    _compare(ours, stock, x, mode, 1e-5)


@FUZZ
@given(batch=_batch, h=st.integers(1, 7), w=st.integers(1, 7), cin=st.integers(1, 4), filters=st.integers(1, 4),
       k=st.integers(1, 3), strides=st.integers(1, 2), padding=st.sampled_from(["same", "valid"]), act=_act,
       seed=st.integers(0, 2**16))
@pytest.mark.parametrize("mode", MODES)
def test_fused_conv2d_matches_keras_conv2d(mode, batch, h, w, cin, filters, k, strides, padding, act, seed):
    if padding == "valid" and (k > h or k > w):
        return
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=[batch, h, w, cin]).astype("float32"))
    kw = dict(filters=filters, kernel_size=k, strides=strides, padding=padding, activation=act)
    ours, stock = FusedConv2D(**kw), keras.layers.Conv2D(**kw)
    _pair(ours, stock, x, rng)
    _compare(ours, stock, x, mode, 1e-5)


@FUZZ
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), eps=st.sampled_from([1e-6, 1e-3, 0.1]),
       center=st.booleans(), scale=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("mode", MODES)
def test_fused_layer_norm_matches_keras(mode, shape, eps, center, scale, seed):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(1.0, 3.0, size=shape).astype("float32"))
    kw = dict(epsilon=eps, center=center, scale=scale)
    ours, stock = FusedLayerNorm(**kw), keras.layers.LayerNormalization(**kw)
    _pair(ours, stock, x, rng)
    _compare(ours, stock, x, mode, 1e-4)


@FUZZ
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4), eps=st.sampled_from([1e-3, 0.1]),
       seed=st.integers(0, 2**16))
@pytest.mark.parametrize("mode", MODES)
def test_fused_batch_norm_inference_matches_keras(mode, shape, eps, seed):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=shape).astype("float32"))
    ours, stock = FusedBatchNorm(epsilon=eps), keras.layers.BatchNormalization(epsilon=eps)
    _pair(ours, stock, x, rng)
    _compare(ours, stock, x, mode, 1e-5)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: FusedConv2D(2, 3), [4]),
        (lambda: FusedConv2D(2, 3), [2, 4, 4]),
        (lambda: FusedConv2D(2, 3), [1, 2, 4, 4, 3]),
        (lambda: FusedDense(3), []),
        (lambda: FusedLayerNorm(), []),
        (lambda: FusedBatchNorm(), []),
    ],
)
def test_bad_rank_raises_value_error(make, shape):
    expect_error(lambda: make()(tf.ones(shape)), ValueError)
