"""softshrink: CPU kernel and pure-TF reference against numpy; gradient; errors; the layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect, ops, testing
from tfmetal_ext.layers.activations import Softshrink
from tfmetal_ext.testing import run_layer_test


np_softshrink = testing.np_softshrink
np_softshrink_grad = testing.np_softshrink_grad


DTYPES = {"float32": (tf.float32, 1e-6), "float16": (tf.float16, 1e-3), "bfloat16": (tf.bfloat16, 8e-3)}


def rounded(x, tf_dtype):
    """x rounded to tf_dtype, as float64: the op's actual input."""
    return tf.cast(tf.cast(x, tf_dtype), tf.float64).numpy()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (1,), (31,), (32,), (33,), (1000,), (7, 0), (33, 5), (2, 3, 4), (2, 3, 4, 5)])
def test_forward_matches_numpy(impl, dtype, shape):
    tf_dtype, rtol = DTYPES[dtype]
    x = np.random.default_rng(0).normal(0, 1.5, shape).astype("float32")
    got = ops.softshrink(tf.constant(x, tf_dtype), 0.5)
    assert got.dtype == tf_dtype and got.shape == shape
    want = np_softshrink(rounded(x, tf_dtype), 0.5)
    np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), want, rtol=rtol, atol=rtol)


def test_large_input_uses_all_elements(impl):
    x = np.random.default_rng(1).normal(0, 1, (1 << 20) + 3).astype("float32")
    np.testing.assert_allclose(ops.softshrink(x, 0.25).numpy(), np_softshrink(x, 0.25), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_propagate(impl, dtype):
    tf_dtype, _ = DTYPES[dtype]
    x = tf.constant([np.nan, np.inf, -np.inf, 0.5, -0.5, 0.0, -0.0], tf_dtype)
    y = tf.cast(ops.softshrink(x, 0.5), tf.float32).numpy()
    assert np.isnan(y[0])
    assert y[1] == np.inf and y[2] == -np.inf
    np.testing.assert_array_equal(y[3:], [0, 0, 0, 0])  # the kinks and zero map to 0


def test_non_contiguous_views(impl):
    base = tf.constant(np.random.default_rng(2).normal(0, 1, (40, 30)).astype("float32"))
    view = tf.transpose(base)[:, ::3]  # a transposed, strided slice
    np.testing.assert_allclose(ops.softshrink(view, 0.3).numpy(), np_softshrink(view.numpy(), 0.3), rtol=1e-6, atol=1e-7)


def test_eager_and_tf_function_agree(impl):
    x = tf.constant(np.linspace(-2, 2, 101).astype("float32"))
    eager = ops.softshrink(x, 0.7)
    graph = tf.function(lambda t: ops.softshrink(t, 0.7))(x)
    np.testing.assert_array_equal(eager.numpy(), graph.numpy())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradient_matches_numpy(impl, dtype):
    tf_dtype, rtol = DTYPES[dtype]
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(0, 1.5, (17, 9)), tf_dtype)
    dy = tf.constant(rng.normal(0, 1, (17, 9)), tf_dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = ops.softshrink(x, 0.5)
    dx = tape.gradient(y, x, output_gradients=dy)
    assert dx.dtype == tf_dtype
    want = np_softshrink_grad(tf.cast(dy, tf.float64).numpy(), tf.cast(x, tf.float64).numpy(), 0.5)
    np.testing.assert_allclose(tf.cast(dx, tf.float64).numpy(), want, rtol=rtol, atol=rtol)


def test_compute_gradient_away_from_kinks(impl):
    rng = np.random.default_rng(4)
    x = rng.uniform(0.6, 2.0, (6, 5)) * rng.choice([-1, 1], (6, 5))
    x[0, :3] = [0.1, -0.2, 0.0]  # the flat middle
    theoretical, numerical = tf.test.compute_gradient(lambda t: ops.softshrink(t, 0.5), [tf.constant(x, tf.float32)], delta=1e-3)
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=2e-3)


def test_kernel_emits_one_op_each_way():
    x = tf.constant(np.ones((4, 4), "float32"))

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = ops.softshrink(t, 0.5)
        return y, tape.gradient(y, t)

    counts = inspect.report_from_capture(inspect.capture_function(step, x)).ops_by_type
    assert counts.get("TfmetalExt>Softshrink") == 1
    assert counts.get("TfmetalExt>SoftshrinkGrad") == 1


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: ops.softshrink(tf.constant([1, 2]), 0.5), ValueError, "Received: x.dtype=int32"),
        (lambda: ops.softshrink(tf.constant([1.0], tf.float64), 0.5), ValueError, "Received: x.dtype=float64"),
        (lambda: ops.softshrink(tf.constant([1.0]), -0.1), ValueError, "Received: lambd=-0.1"),
        (lambda: ops.softshrink(tf.constant([1.0]), float("nan")), ValueError, "Received: lambd=nan"),
        (lambda: ops.softshrink(tf.constant([1.0]), "big"), ValueError, "Received: lambd='big'"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_kernel_rejects_bad_input():
    lib = ops._loader.load()
    with pytest.raises(tf.errors.InvalidArgumentError, match="lambd must be finite and >= 0"):
        lib.tfmetal_ext_softshrink(tf.constant([1.0]), lambd=-1.0)
    with pytest.raises(tf.errors.InvalidArgumentError):
        lib.tfmetal_ext_softshrink_grad(tf.ones([3]), tf.ones([4]), lambd=0.5)
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        lib.tfmetal_ext_softshrink(tf.constant([1], tf.int32))

    @tf.function
    def mismatched(a, b):
        return lib.tfmetal_ext_softshrink_grad(a, b)

    with pytest.raises(ValueError, match="Dimension 0 in both shapes must be equal|must be equal"):
        mismatched.get_concrete_function(tf.TensorSpec([3]), tf.TensorSpec([4]))


# ----------------------------------------------------------------------------
# The layer.


def test_layer_matches_keras_soft_shrink_on_finite_values():
    x = np.random.default_rng(5).normal(0, 1, (8, 16)).astype("float32")
    np.testing.assert_allclose(Softshrink(0.4)(x).numpy(), keras.ops.soft_shrink(x, 0.4).numpy(), rtol=1e-6)


def test_layer_keras_checks():
    run_layer_test(Softshrink, {"lambd": 0.3}, input_shape=(4, 6), expected_output_shape=(4, 6), expected_num_trainable_weights=0)


def test_layer_bad_argument():
    with pytest.raises(ValueError, match="Received: lambd=-1"):
        Softshrink(-1)


def test_layer_in_train_step_is_one_op_each_way():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, name="d"), Softshrink(0.5, name="shrink"), keras.layers.Dense(1)])
    report = inspect.fusion_report(model, mode="train", optimizer="sgd", loss="mse")
    assert report.ops_by_type.get("TfmetalExt>Softshrink") == 1
    assert report.ops_by_type.get("TfmetalExt>SoftshrinkGrad") == 1
    # The layer owns no other compute op (Keras' soft_shrink is several).
    stock = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), keras.layers.Activation("soft_shrink"), keras.layers.Dense(1)])
    stock_report = inspect.fusion_report(stock, mode="train", optimizer="sgd", loss="mse")
    assert report.num_ops < stock_report.num_ops - 4


@pytest.mark.parametrize("dtype,ulp", [("float16", 2.0**-10), ("bfloat16", 2.0**-7)])
def test_half_precision_near_the_threshold_rounds_once(impl, dtype, ulp):
    # lambd = 0.3 is not a float16/bfloat16 value: rounding it (or x - lambd) to the
    # input dtype before subtracting puts results just past the threshold percent off.
    # Both paths compute in float32 and round once, so each result is within one
    # ulp of the float64 answer for the (rounded) input.
    tf_dtype = DTYPES[dtype][0]
    x = np.concatenate([np.linspace(0.3, 0.36, 401), -np.linspace(0.3, 0.36, 401)])
    xin = rounded(x, tf_dtype)
    got = tf.cast(ops.softshrink(tf.constant(xin, tf_dtype), 0.3), tf.float64).numpy()
    want = np_softshrink(xin, np.float64(np.float32(0.3)))
    err = np.abs(got - want)
    assert np.all(err <= np.abs(want) * ulp + 1e-7), (impl, float(np.max(err / np.maximum(np.abs(want), 1e-30))))
