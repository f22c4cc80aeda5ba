"""Hypothesis fuzzing of `tfmetal_ext.ops.int8_matmul` / `int8_conv2d` against float64 numpy.

Both the compiled library and the pure-TF reference run (the ``impl`` fixture), eager
and under `tf.function`, for float32, float16 and bfloat16, with random sizes (empty
ones included), activations, strides, dilations and padding. Expected values: float64
numpy of Keras' int8 convention (w = q / scale) on the inputs as rounded to their dtype,
within the output dtype's rounding plus the float32 accumulation error. Bad scales must
raise InvalidArgumentError, bad arguments ValueError.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tfmetal_ext import ops

from ._tally import FLOAT_DTYPES, MODES, expect_error, expect_ok, fuzz_settings

FUZZ = fuzz_settings(12)
RTOL = {"float32": 1e-5, "float16": 1.5e-3, "bfloat16": 1e-2}
ACTS = ["linear", "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid"]


def np_act(z, act):
    if act == "relu":
        return np.maximum(z, 0.0)
    if act == "relu6":
        return np.clip(z, 0.0, 6.0)
    if act == "elu":
        return np.where(z < 0, np.expm1(np.minimum(z, 0.0)), z)
    if act == "leaky_relu":
        return np.where(z < 0, 0.2 * z, z)
    if act == "gelu":
        return 0.5 * z * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(z / math.sqrt(2.0)))
    if act == "gelu_approximate":
        return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    if act == "tanh":
        return np.tanh(z)
    if act == "sigmoid":
        with np.errstate(over="ignore"):  # exp(-z) -> inf gives 0, as wanted
            return 1.0 / (1.0 + np.exp(-z))
    return z


def np_conv(x, w, strides, same, dilations):
    (b, h, wd, _), (kh, kw, _, co) = x.shape, w.shape
    sizes, pads = [], []
    for size, k, s, d in ((h, kh, strides[0], dilations[0]), (wd, kw, strides[1], dilations[1])):
        eff = (k - 1) * d + 1
        o = -(-size // s) if same else max(0, (size - eff) // s + 1)
        sizes.append(o)
        pads.append(max((o - 1) * s + eff - size, 0) // 2 if same else 0)
    y = np.zeros((b, sizes[0], sizes[1], co))
    for oy in range(sizes[0]):
        for ox in range(sizes[1]):
            for a in range(kh):
                for e in range(kw):
                    iy, ix = oy * strides[0] - pads[0] + a * dilations[0], ox * strides[1] - pads[1] + e * dilations[1]
                    if 0 <= iy < h and 0 <= ix < wd:
                        y[:, oy, ox] += x[:, iy, ix] @ w[a, e]
    return y


def run(mode, fn, *args):
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


def close(got, ref, bound, dtype):
    got = tf.cast(got, tf.float64).numpy()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    tol = RTOL[dtype] * np.abs(ref) + 2e-6 * (bound + 1.0)
    assert np.all(err <= tol), f"max err {err.max()}"


def _inputs(rng, x_shape, q_shape, tf_dtype, has_bias):
    x = tf.cast(tf.constant(rng.standard_normal(x_shape) * 2.0, tf.float32), tf_dtype)
    q = rng.integers(-127, 128, q_shape).astype(np.int8)
    scale = rng.uniform(1.0, 100.0, q_shape[-1]).astype(np.float32)
    b = tf.cast(tf.constant(rng.standard_normal(q_shape[-1]), tf.float32), tf_dtype) if has_bias else None
    return x, q, scale, b


@FUZZ
@given(m=st.integers(0, 11), k=st.integers(0, 80), n=st.integers(0, 70), lead=st.integers(0, 2),
       act=st.sampled_from(ACTS), has_bias=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_int8_matmul_matches_numpy(impl, mode, dtype, m, k, n, lead, act, has_bias, seed):
    rng = np.random.default_rng(seed)
    x_shape = (2,) * lead + (m, k)
    x, q, scale, b = _inputs(rng, x_shape, (k, n), FLOAT_DTYPES[dtype], has_bias)
    w = q.astype(np.float64) / scale.astype(np.float64)
    xf = x.numpy().astype(np.float64)
    z = xf @ w + (b.numpy().astype(np.float64) if has_bias else 0.0)
    ref, bound = np_act(z, act), np.abs(xf) @ np.abs(w)

    expect_ok(lambda: run(mode, lambda t: ops.int8_matmul(t, q, scale, b, activation=act), x),
              lambda y: close(y, ref, bound, dtype))


@FUZZ
@given(b=st.integers(0, 2), h=st.integers(1, 7), w=st.integers(1, 7), cin=st.integers(1, 5), cout=st.integers(1, 20),
       kh=st.integers(1, 3), kw=st.integers(1, 3), strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)), padding=st.sampled_from(["same", "valid"]),
       act=st.sampled_from(ACTS), has_bias=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_int8_conv2d_matches_numpy(impl, dtype, b, h, w, cin, cout, kh, kw, strides, dilations, padding, act,
                                   has_bias, seed):
    rng = np.random.default_rng(seed)
    x, q, scale, bias = _inputs(rng, (b, h, w, cin), (kh, kw, cin, cout), FLOAT_DTYPES[dtype], has_bias)
    wf = q.astype(np.float64) / scale.astype(np.float64)
    xf = x.numpy().astype(np.float64)
    same = padding == "same"
    z = np_conv(xf, wf, strides, same, dilations) + (bias.numpy().astype(np.float64) if has_bias else 0.0)
    ref, bound = np_act(z, act), np_conv(np.abs(xf), np.abs(wf), strides, same, dilations)

    expect_ok(lambda: ops.int8_conv2d(x, q, scale, bias, strides=strides, padding=padding, dilation_rate=dilations,
                                      activation=act),
              lambda y: close(y, ref, bound, dtype))


@FUZZ
@given(bad=st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf]), at=st.integers(0, 4))
def test_int8_matmul_rejects_bad_scales(impl, bad, at):
    scale = np.full(5, 30.0, np.float32)
    scale[at] = bad
    q = np.ones((3, 5), np.int8)
    expect_error(lambda: ops.int8_matmul(tf.ones([2, 3]), q, scale), tf.errors.InvalidArgumentError)


@FUZZ
@given(kwargs=st.sampled_from([{"strides": (0, 1)}, {"strides": (1, 2, 3)}, {"dilation_rate": -1},
                               {"padding": "causal"}, {"activation": "softmax"}, {"strides": 1.5}]))
def test_int8_conv2d_rejects_bad_arguments(impl, kwargs):
    q, scale = np.ones((1, 1, 2, 3), np.int8), np.ones(3, np.float32)
    expect_error(lambda: ops.int8_conv2d(tf.ones([1, 4, 4, 2]), q, scale, **kwargs), ValueError)
