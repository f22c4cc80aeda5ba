"""dropout: the CPU kernel and the pure-TF reference against TensorFlow's stateless dropout and numpy; gradient; errors."""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect, ops, testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.testing import assert_same_bits, float_bits

dropout_ops = importlib.import_module("tfmetal_ext.ops.dropout")  # `ops.dropout` is the function

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}


def stock(x, rate, seed, traced):
    """TensorFlow's own stateless dropout (what keras.layers.Dropout runs), eagerly or traced."""
    fn = lambda t: tf.nn.experimental.stateless_dropout(t, rate, seed=seed)  # noqa: E731
    return (tf.function(fn) if traced else fn)(x)


def ours(x, rate, seed, traced):
    fn = lambda t: ops.dropout(t, rate, seed)  # noqa: E731
    return (tf.function(fn) if traced else fn)(x)


def normal(shape, dtype, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(0, 2, shape).astype("float32"), DTYPES[dtype])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("seed", [[3, 4], (-7, 2 ** 31 - 1), np.array([2 ** 40, -5], np.int64)],
                         ids=["int32", "int32_extremes", "int64"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (5,), (33, 7), (2, 3, 4, 5)])
def test_same_bits_as_tensorflows_stateless_dropout(impl, dtype, shape, seed, traced):
    x = normal(shape, dtype)
    got = ours(x, 0.3, seed, traced)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_same_bits(got.numpy(), stock(x, 0.3, tf.constant(seed), traced).numpy())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_same_bits_as_numpy_philox(dtype):
    x = normal((1003,), dtype, seed=1)
    seed = (12, -34)
    with tf.Graph().as_default():
        rate, scale = dropout_ops.dtype_constants(0.4, DTYPES[dtype])
    want, keep = testing.np_dropout(x.numpy(), seed, rate, scale, testing.UNIFORM_BITS[dtype])
    got = tf.function(lambda t: ops.dropout(t, 0.4, seed))(x)
    assert_same_bits(got.numpy(), want)
    assert 0.3 < 1 - keep.mean() < 0.5


# ----------------------------------------------------------------------------
# noise_shape: a mask of that shape, broadcast over x, as Keras' Dropout and TensorFlow's stateless dropout.


def keras_concrete_noise_shape(x, noise_shape):
    """Keras' rule (keras/src/backend/tensorflow/random.py), with x's static dimensions: None takes x's
    dimension at the same position."""
    return [x.shape[i] if d is None else d for i, d in enumerate(noise_shape)]


def stock_with_noise(x, rate, seed, noise_shape):
    return tf.nn.experimental.stateless_dropout(x, rate, seed=tf.constant(seed),
                                                noise_shape=keras_concrete_noise_shape(x, noise_shape))


NOISE_SHAPES = [(None, 1, 1, 1), (1, 5, 1, 3), (6, 1, None, 1), (1, 3), (), (None, None, None, None)]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("noise_shape", NOISE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_noise_shape_same_bits_as_tensorflows_stateless_dropout(impl, dtype, noise_shape, traced):
    x = normal((6, 5, 4, 3), dtype, seed=4)
    fn = lambda t: ops.dropout(t, 0.4, [5, -6], noise_shape=noise_shape)  # noqa: E731
    got = (tf.function(fn) if traced else fn)(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_same_bits(got.numpy(), stock_with_noise(x, 0.4, [5, -6], noise_shape).numpy())
    if noise_shape == (None, 1, 1, 1):  # one decision per sample: each sample all kept or all dropped
        dropped = (float_bits(got) == 0).reshape(6, -1)
        assert set(dropped.all(axis=1) | ~dropped.any(axis=1)) == {True}


def test_noise_shape_gradient_is_stocks(impl):
    x = normal((8, 3, 5), "float32", seed=5)
    dy = normal((8, 3, 5), "float32", seed=6)

    def grad(fn):
        @tf.function
        def step(t):
            with tf.GradientTape() as tape:
                tape.watch(t)
                y = fn(t)
            return y, tape.gradient(y, t, output_gradients=dy)
        return step(x)

    y_o, g_o = grad(lambda t: ops.dropout(t, 0.5, [1, 2], noise_shape=(None, 1, None)))
    y_s, g_s = grad(lambda t: stock_with_noise(t, 0.5, [1, 2], (None, 1, None)))
    assert_same_bits(y_o.numpy(), y_s.numpy())
    assert_same_bits(g_o.numpy(), g_s.numpy())
    dropped = float_bits(g_o) == 0
    assert dropped.any() and not dropped.all()
    np.testing.assert_array_equal(dropped[:, 0], dropped[:, 1])  # the mask is shared along axis 1


def test_noise_shape_non_finite_dropped_to_plus_zero(impl):
    x = tf.constant(np.tile(np.array([np.nan, np.inf, -np.inf, -0.0, -3.0], np.float32), (40, 1)))
    got = ops.dropout(x, 0.5, [9, 9], noise_shape=(None, 1))
    assert_same_bits(got.numpy(), stock_with_noise(x, 0.5, [9, 9], (None, 1)).numpy())
    rows = float_bits(got)
    dropped = (rows == 0).all(axis=1)
    assert dropped.any() and not dropped.all()  # whole rows of NaN, inf and -0 dropped to +0


def test_noise_shape_with_an_unknown_batch(impl):
    x = normal((7, 4), "float16", seed=7)
    fn = tf.function(lambda t: ops.dropout(t, 0.25, [3, 4], noise_shape=(None, 1)),
                     input_signature=[tf.TensorSpec([None, 4], tf.float16)])
    want = tf.nn.experimental.stateless_dropout(x, 0.25, seed=tf.constant([3, 4]), noise_shape=[7, 1])
    assert_same_bits(fn(x).numpy(), want.numpy())


def test_noise_shape_graph_draws_the_noise_shape_with_the_op():
    x = tf.ones([4, 6, 6, 2])

    def step(t, seed):  # the seed an argument, as a SeedGenerator's draw is: nothing folds into a constant
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = ops.dropout(t, 0.3, seed, noise_shape=(None, 1, 1, 1))
        return tape.gradient(y, t)

    counts = inspect.report_from_capture(inspect.capture_function(step, x, tf.constant([1, 2]))).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1, counts
    assert not {"StatelessRandomGetKeyCounter", "StatelessRandomUniformV2", fusion.DROPOUT_GRAD_OP} & set(counts)


@pytest.mark.parametrize(
    "noise_shape,message",
    [("bad", "must be a list or tuple"), ((1.5, 1), "must be a list or tuple"), ((0, 1), "must be a list or tuple"),
     ((True, 1), "must be a list or tuple"), ((1, 1, 1), "at most the rank"), ((1, 2), "must broadcast")],
)
def test_bad_noise_shape(noise_shape, message):
    with pytest.raises(ValueError, match=message + ".*Received: noise_shape="):
        ops.dropout(tf.ones([4, 3]), 0.5, [1, 2], noise_shape=noise_shape)


_LEVEL_CASE = """
import sys
import numpy as np
import tensorflow as tf
from tfmetal_ext import ops, testing
import importlib
dropout_ops = importlib.import_module("tfmetal_ext.ops.dropout")
assert ops.status().cpu_level == sys.argv[1], ops.status().cpu_level
for dtype in (tf.float32, tf.float16, tf.bfloat16):
    x = tf.constant(np.random.default_rng(1).normal(0, 2, (1003,)).astype("float32"), dtype)
    with tf.Graph().as_default():
        rate, scale = dropout_ops.dtype_constants(0.4, dtype)
    want, _ = testing.np_dropout(x.numpy(), (12, -34), rate, scale, testing.UNIFORM_BITS[dtype.name])
    got = ops.dropout(x, 0.4, (12, -34)).numpy()
    testing.assert_same_bits(got, want)
print("ok")
"""


@pytest.mark.full  # a TF import in a subprocess per level
@pytest.mark.parametrize("level", ["baseline", "avx2"])
def test_lower_cpu_levels_draw_the_same_mask(level):
    """The Philox lanes of a CPU below this one's level (cpu/philox_lanes.h: portable, AVX2), in a fresh
    process capped with TFMETAL_EXT_CPU_LEVEL, against numpy's Philox, bit for bit."""
    from tfmetal_ext import devices

    if level == "avx2" and not devices.capabilities().cpu_avx512:
        pytest.skip("no AVX-512 on this CPU: its AVX2 code is what the rest of this file runs")
    from tests.ops._cpu_levels import run_at_level

    assert run_at_level(_LEVEL_CASE, level, level).stdout.split()[-1] == "ok"


def test_kernel_and_reference_agree_bit_for_bit(monkeypatch):
    # The reference draws its mask with StatelessRandomUniformV2 from the same key and counter.
    x = normal((4, 257), "float16", seed=2)
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "0")
    kernel = ops.dropout(x, 0.25, [5, 6])
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    reference = ops.dropout(x, 0.25, [5, 6])
    assert_same_bits(kernel.numpy(), reference.numpy())


def test_rounded_constants_follow_tensorflow_in_both_modes(impl):
    # TensorFlow rounds a Python float to float16 through float32 when eager, directly in a graph: rates
    # just above a float16 tie round differently, and the masks differ; ours follows in both modes.
    tie = 0.5 + 2.0 ** -12 + 2.0 ** -40  # float32: the tie 0.5 + 2^-12 (to even: 0.5); float64: above it
    x = tf.ones([4096], tf.float16)
    seed = tf.constant([1, 1])
    eager, traced = ops.dropout(x, tie, seed), tf.function(lambda t: ops.dropout(t, tie, seed))(x)
    assert not np.array_equal(float_bits(eager), float_bits(traced))
    assert_same_bits(eager.numpy(), stock(x, tie, seed, False).numpy())
    assert_same_bits(traced.numpy(), stock(x, tie, seed, True).numpy())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_non_finite_values(impl, dtype):
    x = tf.constant(np.tile(np.array([np.nan, np.inf, -np.inf, -0.0, 3.0], np.float32), 50), DTYPES[dtype])
    got = ours(x, 0.5, [9, 9], True)
    assert_same_bits(got.numpy(), stock(x, 0.5, tf.constant([9, 9]), True).numpy())
    g = tf.cast(got, tf.float32).numpy()
    dropped = float_bits(got) == 0
    assert dropped.any() and not dropped.all()  # dropped NaN and infinities are +0
    np.testing.assert_array_equal(np.isnan(g[~dropped]), np.isnan(tf.cast(x, tf.float32).numpy()[~dropped]))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_empty(impl, shape):
    x = tf.zeros(shape)
    got = ops.dropout(x, 0.5, [1, 2])
    assert got.shape == shape and got.dtype == tf.float32
    grad = tf.function(lambda t: tf.gradients(ops.dropout(t, 0.5, [1, 2]), t)[0])(x)
    assert grad.shape == shape


def test_rate_zero_returns_the_input():
    x = tf.constant([1.0, np.nan])
    assert ops.dropout(x, 0.0, [1, 2]) is x
    assert ops.dropout(x, 0, [1, 2]) is x
    generator = keras.random.SeedGenerator(5)
    before = generator.state.numpy()
    assert ops.dropout(x, 0.0, generator) is x
    np.testing.assert_array_equal(generator.state.numpy(), before)  # not drawn, as Keras does not draw it
    with pytest.raises(ValueError, match="Received: seed=None"):
        ops.dropout(x, 0.0, None)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # TensorFlow's float16 scale: 2^20 -> inf
@pytest.mark.parametrize("rate", [0.999, 1 - 2 ** -20])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rate_close_to_one(impl, dtype, rate):
    x = tf.ones([20000], DTYPES[dtype])
    got = ours(x, rate, [3, 1], True)
    assert_same_bits(got.numpy(), stock(x, rate, tf.constant([3, 1]), True).numpy())
    kept = tf.cast(got, tf.float32).numpy()
    assert np.count_nonzero(kept) < 60  # 0.1% of 20000 at most
    if dtype == "float32" and rate == 0.999:
        assert np.count_nonzero(kept) > 0
        np.testing.assert_allclose(kept[kept != 0], 1000.0, rtol=1e-6)


def test_gradient_is_the_same_mask_times_scale(impl):
    x = normal((31, 9), "float32", seed=4)
    dy = normal((31, 9), "float32", seed=5)
    seed = tf.constant([21, 22], tf.int64)

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.dropout(x, 0.4, seed)
        return y, tape.gradient(y, x, output_gradients=dy)

    y, dx = step(x, dy)
    keep = y.numpy() != 0
    np.testing.assert_array_equal(dx.numpy()[~keep], 0.0)
    np.testing.assert_array_equal(dx.numpy()[keep], (dy.numpy() * np.float32(1 / 0.6))[keep])
    # bitwise TensorFlow's gradient of its own dropout
    with tf.GradientTape() as tape:
        tape.watch(x)
        ys = tf.nn.experimental.stateless_dropout(x, 0.4, seed=seed)
    assert_same_bits(dx.numpy(), tape.gradient(ys, x, output_gradients=dy).numpy())


def test_compute_gradient(impl):
    x = tf.constant(np.random.default_rng(6).normal(0, 1, (5, 7)), tf.float32)
    theoretical, numerical = tf.test.compute_gradient(lambda t: ops.dropout(t, 0.3, [1, 2]), [x], delta=1e-2)
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-3)


def test_second_order_gradient():
    x = normal((64,), "float32", seed=7)

    @tf.function
    def f(x):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(ops.dropout(x, 0.5, [4, 4]) ** 2)
            g = inner.gradient(y, x)
            total = tf.reduce_sum(g)
        return g, outer.gradient(total, x)

    g, gg = f(x)
    keep = g.numpy() != 0
    np.testing.assert_allclose(gg.numpy()[keep], 8.0, rtol=1e-6)  # d/dx sum(2 * 4 x) over kept, scale 2
    np.testing.assert_array_equal(gg.numpy()[~keep], 0.0)


def test_kernel_emits_one_op_each_way():
    def step(t, dy, seed):  # arguments, not constants: nothing to fold
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = ops.dropout(t, 0.5, seed)
        return y, tape.gradient(y, t, output_gradients=dy)

    counts = inspect.report_from_capture(
        inspect.capture_function(step, tf.ones([4, 4]), tf.ones([4, 4]), tf.constant([1, 2]))).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1 and counts.get(fusion.DROPOUT_GRAD_OP) == 1
    assert not {"StatelessRandomUniformV2", "SelectV2", "GreaterEqual"} & set(counts)


def test_seed_generator_draws_as_keras_does():
    # A SeedGenerator is drawn and reduced to int32 as keras.random.dropout does: same numbers, and the
    # generator advances the same way.
    x = tf.ones([300])
    mine, theirs = keras.random.SeedGenerator(123), keras.random.SeedGenerator(123)
    for _ in range(2):
        assert_same_bits(ops.dropout(x, 0.5, mine).numpy(), keras.random.dropout(x, 0.5, seed=theirs).numpy())
    np.testing.assert_array_equal(mine.state.numpy(), theirs.state.numpy())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.dropout(tf.ones([2]), 1.0, [1, 2]), "Received: rate=1.0"),
        (lambda: ops.dropout(tf.ones([2]), -0.1, [1, 2]), "Received: rate=-0.1"),
        (lambda: ops.dropout(tf.ones([2]), 1.5, [1, 2]), "Received: rate=1.5"),
        (lambda: ops.dropout(tf.ones([2]), float("nan"), [1, 2]), "Received: rate=nan"),
        (lambda: ops.dropout(tf.ones([2]), True, [1, 2]), "Received: rate=True"),
        (lambda: ops.dropout(tf.ones([2]), tf.constant(0.5), [1, 2]), "Received: rate=<tf.Tensor"),
        (lambda: ops.dropout(tf.ones([2]), "0.5", [1, 2]), "Received: rate='0.5'"),
        (lambda: ops.dropout(tf.constant([1, 2]), 0.5, [1, 2]), "Received: x.dtype=int32"),
        (lambda: ops.dropout(tf.ones([2], tf.float64), 0.5, [1, 2]), "Received: x.dtype=float64"),
        (lambda: ops.dropout(tf.ones([2]), 0.5, None), "Received: seed=None"),
        (lambda: ops.dropout(tf.ones([2]), 0.5, 42), "Received: seed=42"),
        (lambda: ops.dropout(tf.ones([2]), 0.5, [1, 2, 3]), r"Received: seed.shape=\(3,\)"),
        (lambda: ops.dropout(tf.ones([2]), 0.5, [1.0, 2.0]), "Received: seed.dtype=float32"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_rejects_bad_input():
    lib = ops._loader.load()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rate must be in \[0, 1\]"):
        lib.tfmetal_ext_dropout(tf.ones([3]), tf.constant([1, 2]), rate=1.5, scale=2.0)
    for scale in (float("nan"), 0.0, -2.0):
        with pytest.raises(tf.errors.InvalidArgumentError, match="scale must be > 0"):
            lib.tfmetal_ext_dropout_grad(tf.ones([3]), tf.constant([1, 2]), rate=0.5, scale=scale)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"seed must have shape \[2\], not \[3\]"):
        lib.tfmetal_ext_dropout(tf.ones([3]), tf.constant([1, 2, 3]), rate=0.5, scale=2.0)

    @tf.function
    def unknown_seed(x, seed):
        return lib.tfmetal_ext_dropout(x, seed, rate=0.5, scale=2.0)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"seed must have shape \[2\], not \[3\]"):
        unknown_seed.get_concrete_function(tf.TensorSpec([3]), tf.TensorSpec([None], tf.int64))(
            tf.ones([3]), tf.constant([1, 2, 3], tf.int64))
    known_seed = tf.function(lambda x, seed: lib.tfmetal_ext_dropout(x, seed, rate=0.5, scale=2.0))
    with pytest.raises(ValueError, match=r"seed must have shape \[2\], not \[4\]"):
        known_seed.get_concrete_function(tf.TensorSpec([3]), tf.TensorSpec([4], tf.int64))


def test_avoid_fusions_runs_the_reference():
    import tfmetal_ext

    try:
        tfmetal_ext.configure("float32", avoid_fusions=["dropout"])
        assert not dropout_ops.uses_kernel()
        counts = inspect.report_from_capture(inspect.capture_function(
            lambda t, seed: ops.dropout(t, 0.5, seed), tf.ones([8]), tf.constant([1, 2]))).ops_by_type
        assert fusion.DROPOUT_OP not in counts and counts.get("StatelessRandomUniformV2") == 1
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=[])
