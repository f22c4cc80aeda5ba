"""Hypothesis fuzzing of `tfmetal_ext.ops.softshrink` against a numpy reference.

Both the compiled library path and the pure-TF reference path run (the
``TFMETAL_EXT_REFERENCE_OPS`` switch, as in tests/ops), eager and under
`tf.function`, for float32, float16 and bfloat16 with NaN and infinities in the
input. Expected values: float64 numpy on the input as rounded to its dtype,
within one ulp of the dtype. Non-float dtypes and bad `lambd` must raise
ValueError.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import softshrink

from ._tally import expect_error, expect_ok, FLOAT_DTYPES, fuzz_settings, MODES, ulp_tolerance

FUZZ = fuzz_settings(15)
DTYPES = FLOAT_DTYPES


def numpy_softshrink64(x, lambd):
    x = np.asarray(x, np.float64)
    # NaN propagates (documented; Keras' soft_shrink maps it to 0).
    return np.where(np.isnan(x), np.nan, np.where(x > lambd, x - lambd, np.where(x < -lambd, x + lambd, 0.0)))


def run(mode, fn, *args):
    if mode == "function":
        return tf.function(fn)(*args)
    return fn(*args)


_shapes = hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4)
_values = st.floats(-1e3, 1e3, width=32) | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0])


@FUZZ
@given(data=st.data(), lambd=st.floats(0.0, 10.0, width=32))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_softshrink_matches_float64_numpy(impl, mode, dtype, data, lambd):
    x32 = data.draw(hnp.arrays(np.float32, _shapes, elements=_values), label="x")
    tf_dtype = DTYPES[dtype]
    x = tf.cast(tf.constant(x32), tf_dtype)
    x_rounded = x.numpy().astype(np.float64)
    # The kernel gets lambd as a float32 attr.
    ref = numpy_softshrink64(x_rounded, float(np.float32(lambd)))

    def verify(y):
        assert y.dtype == tf_dtype and tuple(y.shape) == x32.shape
        got = y.numpy().astype(np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"NaN positions, lambd={lambd}")
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(got[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
        tol = ulp_tolerance(ref[finite], tf_dtype.as_numpy_dtype)
        err = np.abs(got[finite] - ref[finite])
        assert np.all(err <= tol), f"max error {err.max() if err.size else 0} > 1 ulp of {dtype}, lambd={lambd}"

    expect_ok(lambda: run(mode, lambda t: softshrink(t, lambd=lambd), x), verify)


@FUZZ
@given(lambd=st.floats(0.125, 10.0, width=32), rel=hnp.arrays(np.float32, 16, elements=st.floats(-0.0625, 0.0625, width=32)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softshrink_near_the_threshold(impl, dtype, lambd, rel):
    # |x| within 6.25% of lambd: where rounding lambd or x - lambd to a half dtype shows (49b2dcb).
    tf_dtype = DTYPES[dtype]
    signs = np.where(np.arange(16) % 2, 1.0, -1.0)
    x = tf.cast(tf.constant((signs * lambd * (1 + rel)).astype(np.float32)), tf_dtype)
    ref = numpy_softshrink64(x.numpy().astype(np.float64), float(np.float32(lambd)))

    def verify(y):
        err = np.abs(y.numpy().astype(np.float64) - ref)
        assert np.all(err <= ulp_tolerance(ref, tf_dtype.as_numpy_dtype)), f"max error {err.max()}, lambd={lambd}"

    expect_ok(lambda: softshrink(x, lambd=lambd), verify)


@FUZZ
@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    dtype=st.sampled_from([tf.int32, tf.int64, tf.int8, tf.uint8, tf.float64, tf.bool, tf.complex64]),
)
@pytest.mark.parametrize("mode", MODES)
def test_softshrink_rejects_other_dtypes(impl, mode, shape, dtype):
    x = tf.zeros(shape, dtype)
    expect_error(lambda: run(mode, lambda t: softshrink(t, lambd=0.5), x), ValueError)


@pytest.mark.parametrize("lambd", [-1.0, -1e-30, math.nan, math.inf, -math.inf, 1e39, "a", None])
@pytest.mark.parametrize("mode", MODES)
def test_softshrink_rejects_bad_lambd(impl, mode, lambd):
    x = tf.constant([1.0, -2.0])
    expect_error(lambda: run(mode, lambda t: softshrink(t, lambd=lambd), x), ValueError)
