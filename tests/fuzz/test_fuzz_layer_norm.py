"""Hypothesis fuzzing of `tfmetal_ext.ops.layer_norm(x, gamma, beta, epsilon)`.

Ranks 1..4 with empty dimensions, float32/float16/bfloat16, NaN/inf rows,
library and reference paths, eager and `tf.function`, against a float64 numpy
layer norm (written here) on the input as rounded to its dtype. Bad `gamma`
shapes and rank-0 inputs must be rejected.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import layer_norm

from ._tally import expect_error, expect_ok, FLOAT_DTYPES, fuzz_settings, MODES, ulp_tolerance

FUZZ = fuzz_settings(12)
DTYPES = FLOAT_DTYPES
F32_EPS = 2.0**-23


def numpy_layer_norm64(x, gamma, beta, epsilon):
    x = np.asarray(x, np.float64)
    if x.shape[-1] == 0:
        return x.copy()
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma.astype(np.float64) + beta.astype(np.float64)


def tolerance(x, gamma, beta, epsilon, ref, np_dtype):
    """The float32 statistics' error (a few ulps of the row's largest |x| over its std) plus one ulp of the output."""
    n = max(x.shape[-1], 1)
    with np.errstate(invalid="ignore", over="ignore"):
        xmax = np.max(np.abs(x), axis=-1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,))
        var = np.var(x, axis=-1, keepdims=True) if x.shape[-1] else np.zeros_like(xmax)
        stats = 8 * n * F32_EPS * (xmax / np.sqrt(var + epsilon) * np.abs(gamma) + np.abs(beta) + 1.0)
    return 2 * ulp_tolerance(ref, np_dtype) + stats


def run(mode, fn, *args):
    if mode == "function":
        return tf.function(fn)(*args)
    return fn(*args)


_shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6)
_values = st.floats(-50, 50, width=32) | st.sampled_from([math.nan, math.inf, -math.inf, 0.0])


@FUZZ
@given(data=st.data(), epsilon=st.sampled_from([1e-6, 1e-3, 0.5]))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_layer_norm_matches_float64_numpy(impl, mode, dtype, data, epsilon):
    x32 = data.draw(hnp.arrays(np.float32, _shapes, elements=_values), label="x")
    c = x32.shape[-1]
    gamma = data.draw(hnp.arrays(np.float32, (c,), elements=st.floats(-2, 2, width=32)), label="gamma")
    beta = data.draw(hnp.arrays(np.float32, (c,), elements=st.floats(-2, 2, width=32)), label="beta")
    tf_dtype = DTYPES[dtype]
    x = tf.cast(tf.constant(x32), tf_dtype)
    x64 = x.numpy().astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = numpy_layer_norm64(x64, gamma, beta, epsilon)
    bad_row = ~np.all(np.isfinite(x64), axis=-1, keepdims=True) & np.ones_like(x64, bool)

    def verify(y):
        assert y.dtype == tf_dtype and tuple(y.shape) == x32.shape
        got = y.numpy().astype(np.float64)
        # A NaN or infinity in a row makes that row NaN (documented), other rows are untouched.
        assert np.all(np.isnan(got[bad_row])), "a row with NaN/inf is not all NaN"
        tol = tolerance(x64, gamma, beta, epsilon, ref, tf_dtype.as_numpy_dtype)
        good = ~bad_row
        err = np.abs(got - ref)
        assert np.all(err[good] <= tol[good]), (
            f"max error {err[good].max()} (tolerance there {tol[good][np.argmax(err[good] - tol[good])]}), "
            f"{dtype}, shape {x32.shape}, epsilon={epsilon}"
        )

    expect_ok(lambda: run(mode, lambda t: layer_norm(t, gamma, beta, epsilon), x), verify)


@FUZZ
@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5),
    delta=st.sampled_from([-1, 1, 3]),
    which=st.sampled_from(["gamma", "beta"]),
)
@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_rejects_wrong_parameter_length(impl, mode, shape, delta, which):
    x = tf.ones(shape)
    bad = tf.ones([shape[-1] + delta])
    args = {"gamma": bad, "beta": None} if which == "gamma" else {"gamma": None, "beta": bad}
    expect_error(lambda: run(mode, lambda t: layer_norm(t, epsilon=1e-3, **args), x), ValueError)


@pytest.mark.parametrize("which", ["gamma", "beta"])
def test_layer_norm_rejects_wrong_length_at_run_time(impl, which):
    # Under a tf.function with unknown shapes the check can only happen in the kernel / reference.
    fn = tf.function(
        lambda t, p: layer_norm(t, **{which: p}, epsilon=1e-3),
        input_signature=[tf.TensorSpec([None, None]), tf.TensorSpec([None])],
    )
    expect_error(lambda: fn(tf.ones([2, 4]), tf.ones([3])), (ValueError, tf.errors.InvalidArgumentError))


@pytest.mark.parametrize("gamma_shape", [(), (4, 1), (1, 4)])
def test_layer_norm_rejects_non_vector_gamma(impl, gamma_shape):
    expect_error(lambda: layer_norm(tf.ones([2, 4]), tf.ones(gamma_shape), epsilon=1e-3), ValueError)


@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_rejects_rank_0(impl, mode):
    expect_error(lambda: run(mode, lambda t: layer_norm(t, epsilon=1e-3), tf.constant(1.0)), ValueError)


@pytest.mark.parametrize("epsilon", [0.0, -1e-3, math.nan, math.inf, "x", None, True])
def test_layer_norm_rejects_bad_epsilon(impl, epsilon):
    expect_error(lambda: layer_norm(tf.ones([2, 3]), epsilon=epsilon), ValueError)


@pytest.mark.parametrize("dtype", [tf.int32, tf.float64, tf.bool])
def test_layer_norm_rejects_other_dtypes(impl, dtype):
    expect_error(lambda: layer_norm(tf.zeros([2, 3], dtype), epsilon=1e-3), ValueError)
