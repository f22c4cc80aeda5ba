"""layer_norm: CPU kernel and pure-TF reference against numpy; gradients; stability; errors."""

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect, ops, testing

np_layer_norm = testing.np_layer_norm
np_layer_norm_grad = testing.np_layer_norm_grad


# Output tolerance (relative, and absolute on values of order 1): the output
# dtype's rounding; the statistics are float32 for every dtype.
DTYPES = {"float32": (tf.float32, 2e-5), "float16": (tf.float16, 2e-3), "bfloat16": (tf.bfloat16, 1.6e-2)}


def rounded(x, tf_dtype):
    """x rounded to tf_dtype, as float64: the op's actual input."""
    return tf.cast(tf.cast(x, tf_dtype), tf.float64).numpy()


def as64(t):
    return tf.cast(t, tf.float64).numpy()


def inputs(shape, seed=0, scale=2.0, offset=0.5):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = (rng.normal(0, scale, shape) + offset).astype("float32")
    gamma = rng.uniform(0.5, 1.5, c).astype("float32")
    beta = rng.normal(0, 1, c).astype("float32")
    return x, gamma, beta


def assert_close(got, want, tol, what=""):
    scale = float(np.max(np.abs(want))) if np.size(want) else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(scale, 1.0), err_msg=what)


SHAPES = [
    (1,), (31,), (4, 1), (3, 31), (5, 32), (2, 33), (3, 1000), (2, 3, 4), (2, 3, 4, 5), (0, 8), (4, 0), (0,), (2, 0, 3)
]


# Shapes are looped over inside the tests: the suite's per-test teardown
# (keras.backend.clear_session) costs more than these small cases.


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_numpy(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    for shape in SHAPES:
        x, gamma, beta = inputs(shape)
        got = ops.layer_norm(tf.constant(x, tf_dtype), gamma, beta, epsilon=1e-3)
        assert got.dtype == tf_dtype and got.shape == shape
        assert_close(as64(got), np_layer_norm(rounded(x, tf_dtype), gamma, beta, 1e-3), tol, f"shape {shape}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_match_numpy(impl, dtype):
    """dx, dgamma, dbeta; (300, 300) sums dgamma/dbeta over several row blocks."""
    for shape in [(1,), (3, 31), (2, 33), (17, 9), (2, 3, 4, 5), (0, 8), (4, 0), (300, 300)]:
        check_gradients(dtype, shape)


def check_gradients(dtype, shape):
    tf_dtype, tol = DTYPES[dtype]
    x, gamma, beta = inputs(shape, seed=1)
    dy = np.random.default_rng(2).normal(0, 1, shape).astype("float32")
    xt, dyt = tf.constant(x, tf_dtype), tf.constant(dy, tf_dtype)
    g, b = tf.constant(gamma), tf.constant(beta)
    with tf.GradientTape() as tape:
        tape.watch([xt, g, b])
        y = ops.layer_norm(xt, g, b, epsilon=1e-3)
    dx, dgamma, dbeta = tape.gradient(y, [xt, g, b], output_gradients=dyt)
    assert dx.dtype == tf_dtype and dgamma.dtype == tf.float32 and dbeta.dtype == tf.float32
    want_dx, want_dgamma, want_dbeta = np_layer_norm_grad(rounded(dy, tf_dtype), rounded(x, tf_dtype), gamma, 1e-3)
    assert_close(as64(dx), want_dx, tol, f"dx, shape {shape}")
    # Parameter gradients are float32 sums of exactly-known terms: float32 accuracy.
    assert_close(dgamma.numpy(), want_dgamma, 1e-4, f"dgamma, shape {shape}")
    assert_close(dbeta.numpy(), want_dbeta, 1e-4, f"dbeta, shape {shape}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_parameters_get_half_gradients(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    x, gamma, beta = inputs((6, 10), seed=3)
    xt, g, b = tf.constant(x, tf_dtype), tf.constant(gamma, tf_dtype), tf.constant(beta, tf_dtype)
    with tf.GradientTape() as tape:
        tape.watch([g, b])
        y = ops.layer_norm(xt, g, b)
    dgamma, dbeta = tape.gradient(y, [g, b])
    assert dgamma.dtype == tf_dtype and dbeta.dtype == tf_dtype
    _, want_dgamma, want_dbeta = np_layer_norm_grad(np.ones((6, 10)), rounded(x, tf_dtype), as64(g), 1e-3)
    assert_close(as64(dgamma), want_dgamma, tol)
    assert_close(as64(dbeta), want_dbeta, tol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_large_mean_small_variance_stays_accurate(impl, dtype):
    """Rows around 1000 (1e4 in float32) with a spread of a few units in the last place.

    E[x^2] - mean^2 in float32 loses most digits here (mean^2 / var is ~1e6
    for float16, 1e8 for the float32 case); the two-pass float32 statistics
    do not. (For float32 inputs the float32 mean itself bounds the accuracy
    to about ulp(mean) / std: 5e-4 here.)
    """
    tf_dtype, tol = DTYPES[dtype]
    rng = np.random.default_rng(4)
    center, spread = {"float16": (1000.0, 1.0), "bfloat16": (1000.0, 8.0), "float32": (1e4, 1.0)}[dtype]
    tol = max(tol, 1e-3)
    x = rounded(center + rng.normal(0, spread, (8, 1024)), tf_dtype)
    assert np.all(x.std(-1) > 0)  # the spread survives rounding to the dtype
    got = ops.layer_norm(tf.constant(x, tf_dtype), epsilon=1e-6)
    want = np_layer_norm(x, 1.0, 0.0, 1e-6)
    assert_close(as64(got), want, tol)
    np.testing.assert_allclose(as64(got).std(-1), want.std(-1), rtol=tol)


def test_large_input_uses_all_rows(impl):
    x, gamma, beta = inputs((1030, 513), seed=5)
    assert_close(ops.layer_norm(x, gamma, beta).numpy(), np_layer_norm(x, gamma, beta, 1e-3), 2e-5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_stay_in_their_row(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    x, gamma, beta = inputs((5, 7), seed=6)
    x[0, 3], x[1, 0], x[3, 6] = np.nan, np.inf, -np.inf
    dy = np.random.default_rng(7).normal(0, 1, (5, 7)).astype("float32")
    xt, g, b = tf.constant(x, tf_dtype), tf.constant(gamma), tf.constant(beta)
    with tf.GradientTape() as tape:
        tape.watch([xt, g, b])
        y = ops.layer_norm(xt, g, b)
    dx, dgamma, dbeta = tape.gradient(y, [xt, g, b], output_gradients=tf.constant(dy, tf_dtype))
    y, dx = as64(y), as64(dx)
    bad, good = [0, 1, 3], [2, 4]
    assert np.isnan(y[bad]).all() and np.isnan(dx[bad]).all()
    xr = rounded(x[good], tf_dtype)
    assert_close(y[good], np_layer_norm(xr, gamma, beta, 1e-3), tol)
    want_dx, _, want_dbeta = np_layer_norm_grad(rounded(dy[good], tf_dtype), xr, gamma, 1e-3)
    assert_close(dx[good], want_dx, tol)
    assert np.isnan(dgamma.numpy()).all()  # a sum over all rows, the NaN rows included
    assert_close(dbeta.numpy(), rounded(dy, tf_dtype).sum(0), 1e-4)  # dy is finite: dbeta is too


def test_non_contiguous_views(impl):
    base, gamma, beta = inputs((40, 30), seed=8)
    for view in (tf.transpose(tf.constant(base))[:, ::3], tf.constant(base)[::2, 5:25]):
        c = view.shape[-1]
        got = ops.layer_norm(view, gamma[:c], beta[:c])
        assert_close(got.numpy(), np_layer_norm(view.numpy(), gamma[:c], beta[:c], 1e-3), 2e-5)


def test_eager_and_tf_function_agree(impl):
    x, gamma, beta = inputs((3, 4, 9), seed=9)
    eager = ops.layer_norm(x, gamma, beta, epsilon=1e-5)
    static = tf.function(lambda t: ops.layer_norm(t, gamma, beta, epsilon=1e-5))(x)
    # Unknown dimensions: the shape functions and the default gamma/beta of unknown size.
    dynamic = tf.function(
        lambda t: ops.layer_norm(t, epsilon=1e-5), input_signature=[tf.TensorSpec([None, None, None], tf.float32)]
    )
    if impl == "kernel":
        np.testing.assert_array_equal(eager.numpy(), static.numpy())
    else:  # grappler may reorder the reference's reductions
        assert_close(eager.numpy(), static.numpy(), 1e-6)
    assert dynamic.get_concrete_function().structured_outputs.shape.rank == 3
    assert_close(dynamic(x).numpy(), np_layer_norm(x, 1.0, 0.0, 1e-5), 2e-5)


def test_compute_gradient(impl):
    x, gamma, beta = inputs((3, 5), seed=10)
    theoretical, numerical = tf.test.compute_gradient(
        lambda a, g, b: ops.layer_norm(a, g, b, epsilon=1e-2), [tf.constant(x), tf.constant(gamma), tf.constant(beta)],
        delta=1e-2,
    )
    for t, n, what in zip(theoretical, numerical, ("dx", "dgamma", "dbeta")):
        np.testing.assert_allclose(t, n, atol=5e-3, err_msg=what)


def test_defaults_are_unit_scale_and_zero_offset(impl):
    x, _, _ = inputs((4, 6), seed=11)
    assert_close(ops.layer_norm(x).numpy(), np_layer_norm(x, 1.0, 0.0, 1e-3), 2e-5)
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = ops.layer_norm(xt)
    dy = np.ones_like(x) * np.arange(6)
    want_dx, _, _ = np_layer_norm_grad(dy, x, 1.0, 1e-3)
    assert_close(tape.gradient(y, xt, output_gradients=tf.constant(dy, tf.float32)).numpy(), want_dx, 2e-5)


def test_gradient_is_deterministic():
    x, gamma, beta = inputs((600, 300), seed=12)
    lib = ops._loader.load()
    y, mean, rstd = lib.tfmetal_ext_layer_norm(x, gamma, beta, epsilon=1e-3)
    dy = tf.constant(np.random.default_rng(13).normal(0, 1, x.shape).astype("float32"))
    first = [t.numpy() for t in lib.tfmetal_ext_layer_norm_grad(dy, x, gamma, mean, rstd)]
    for _ in range(3):
        for a, b in zip(first, lib.tfmetal_ext_layer_norm_grad(dy, x, gamma, mean, rstd)):
            np.testing.assert_array_equal(a, b.numpy())


_ISA_CASES = textwrap.dedent(
    """
    import sys
    import numpy as np, tensorflow as tf
    from tfmetal_ext import ops
    lib = ops._loader.load()
    rng = np.random.default_rng(16)
    out = {}
    for dtype in ("float32", "float16", "bfloat16"):
        for shape in ((37, 300), (5, 1), (3, 33)):
            x = rng.normal(3.0, 2.0, shape).astype("float32")
            x[0, 0] = np.nan
            g, b = rng.uniform(0.5, 1.5, shape[-1]).astype("float32"), rng.normal(0, 1, shape[-1]).astype("float32")
            xt, dy = tf.constant(x, dtype), tf.constant(rng.normal(0, 1, shape), dtype)
            y, mean, rstd = lib.tfmetal_ext_layer_norm(xt, g, b, epsilon=1e-3)
            grads = lib.tfmetal_ext_layer_norm_grad(dy, xt, g, mean, rstd)
            for i, t in enumerate([y, mean, rstd, *grads]):
                out[f"{dtype}{shape}{i}"] = tf.cast(t, tf.float32).numpy()
    np.savez(sys.argv[1], **out)
    """
)


@pytest.mark.full  # compiles the kernel twice (baseline and AVX2 flags); the quick tier keeps the kernel-vs-numpy tests
def test_baseline_and_avx2_loops_agree_bitwise(tmp_path):
    """The SSE2 baseline loops (also what arm64 runs) give the AVX2 loops' results bit for bit."""
    env = {k: v for k, v in os.environ.items() if k != "TFMETAL_EXT_REFERENCE_OPS"}
    paths = [tmp_path / f"baseline{flag}.npz" for flag in ("1", "0")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ISA_CASES, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "TFMETAL_EXT_CPU_BASELINE": flag, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        for flag, path in zip(("1", "0"), paths)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    results = [np.load(path) for path in paths]
    assert len(results[0].files) == 3 * 3 * 6
    for key in results[0].files:
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)


def test_saved_statistics():
    x, gamma, beta = inputs((5, 12), seed=14, offset=100.0)
    _, mean, rstd = ops._loader.load().tfmetal_ext_layer_norm(x, gamma, beta, epsilon=1e-3)
    xd = x.astype(np.float64)
    np.testing.assert_allclose(mean.numpy(), xd.mean(-1), rtol=1e-6)
    np.testing.assert_allclose(rstd.numpy(), 1 / np.sqrt(xd.var(-1) + 1e-3), rtol=1e-5)
    # Empty rows: mean 0, variance 0.
    empty = tf.zeros([0])
    _, mean, rstd = ops._loader.load().tfmetal_ext_layer_norm(tf.zeros([3, 0]), empty, empty, epsilon=0.25)
    np.testing.assert_array_equal(mean.numpy(), [0, 0, 0])
    np.testing.assert_array_equal(rstd.numpy(), [2, 2, 2])


def test_gpu_without_a_kernel_uses_the_reference(monkeypatch):
    """A visible GPU the library has no kernel for (CUDA, a Mac build without Metal): stay on the GPU."""
    module = importlib.import_module("tfmetal_ext.ops._common")
    ops._loader.load()
    check = module.kernel_for_visible_devices.__wrapped__
    for op in ("TfmetalExt>LayerNorm", "TfmetalExt>Softshrink"):
        assert check(op, "GPU") is True  # no GPU here
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["fake"])
    for op in ("TfmetalExt>LayerNorm", "TfmetalExt>Softshrink"):
        assert check(op, "GPU") is False  # only CPU kernels are registered
        assert check(op, "CPU") is True


def test_kernel_emits_one_op_each_way():
    x = tf.constant(np.random.default_rng(15).normal(0, 1, (4, 8)).astype("float32"))
    gamma, beta = tf.Variable(tf.ones([8])), tf.Variable(tf.zeros([8]))

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = ops.layer_norm(t, gamma, beta)
        return y, tape.gradient(y, [t, gamma, beta])

    counts = inspect.report_from_capture(inspect.capture_function(step, x)).ops_by_type
    assert counts.get("TfmetalExt>LayerNorm") == 1
    assert counts.get("TfmetalExt>LayerNormGrad") == 1
    assert "Rsqrt" not in counts and "Mean" not in counts


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.layer_norm(tf.constant([1, 2])), "Received: x.dtype=int32"),
        (lambda: ops.layer_norm(tf.constant([1.0], tf.float64)), "Received: x.dtype=float64"),
        (lambda: ops.layer_norm(tf.constant(1.0)), r"Received: x.shape=\(\)"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon=0.0), "Received: epsilon=0.0"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon=-1e-3), "Received: epsilon=-0.001"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon=float("nan")), "Received: epsilon=nan"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon=float("inf")), "Received: epsilon=inf"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon="big"), "Received: epsilon='big'"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), epsilon=True), "Received: epsilon=True"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), tf.ones([4])), r"Received: gamma.shape=\(4,\)"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), None, tf.ones([3, 1])), r"Received: beta.shape=\(3, 1\)"),
        (lambda: ops.layer_norm(tf.ones([2, 3]), tf.constant([1, 1, 1])), "Received: gamma.dtype=int32"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_rejects_bad_input_at_run_time():
    lib = ops._loader.load()
    ones = tf.ones([3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="epsilon must be finite and > 0"):
        lib.tfmetal_ext_layer_norm(tf.ones([2, 3]), ones, ones, epsilon=0.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="epsilon must be finite and > 0"):
        lib.tfmetal_ext_layer_norm(tf.ones([2, 3]), ones, ones, epsilon=float("nan"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="gamma must be a vector of the last dimension of x = 4"):
        lib.tfmetal_ext_layer_norm(tf.ones([2, 4]), ones, tf.ones([4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="x must have rank >= 1"):
        lib.tfmetal_ext_layer_norm(tf.constant(1.0), tf.ones([1]), tf.ones([1]))
    _, mean, rstd = lib.tfmetal_ext_layer_norm(tf.ones([2, 3]), ones, ones)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dy and x must have the same shape"):
        lib.tfmetal_ext_layer_norm_grad(tf.ones([2, 4]), tf.ones([2, 3]), ones, mean, rstd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="mean must be a vector of the number of rows of x = 4"):
        lib.tfmetal_ext_layer_norm_grad(tf.ones([4, 3]), tf.ones([4, 3]), ones, mean, tf.ones([4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="rstd must be a vector"):
        lib.tfmetal_ext_layer_norm_grad(tf.ones([2, 3]), tf.ones([2, 3]), ones, mean, tf.ones([2, 1]))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        lib.tfmetal_ext_layer_norm(tf.ones([2, 3], tf.float64), ones, ones)


def test_bad_shapes_fail_at_graph_construction():
    lib = ops._loader.load()

    def concrete(fn, *specs):
        return tf.function(fn).get_concrete_function(*[tf.TensorSpec(s, d) for s, d in specs])

    forward = lambda x, g, b: lib.tfmetal_ext_layer_norm(x, g, b)  # noqa: E731
    with pytest.raises(ValueError, match="gamma must be a vector of the last dimension of x = 8, got shape \\[7\\]"):
        concrete(forward, ([2, 8], tf.float32), ([7], tf.float32), ([8], tf.float32))
    with pytest.raises(ValueError, match="beta must be a vector"):
        concrete(forward, ([2, 8], tf.float32), ([8], tf.float32), ([8, 1], tf.float32))
    with pytest.raises(ValueError, match="x must have rank >= 1"):
        concrete(forward, ([], tf.float32), ([1], tf.float32), ([1], tf.float32))
    # Unknown sizes pass construction and get the row count when it is known.
    fn = concrete(forward, ([None, 3, 8], tf.float32), ([None], tf.float32), ([8], tf.float32))
    assert fn.structured_outputs[1].shape.as_list() == [None]
    fn = concrete(forward, ([5, 3, 8], tf.float16), ([8], tf.float32), ([8], tf.float32))
    assert fn.structured_outputs[1].shape.as_list() == [15]

    grad = lambda dy, x, g, m, r: lib.tfmetal_ext_layer_norm_grad(dy, x, g, m, r)  # noqa: E731
    f32 = tf.float32
    with pytest.raises(ValueError, match="dy and x must have the same shape"):
        concrete(grad, ([2, 8], f32), ([2, 9], f32), ([9], f32), ([2], f32), ([2], f32))
    with pytest.raises(ValueError, match="mean must be a vector of the number of rows of x = 6"):
        concrete(grad, ([2, 3, 8], f32), ([2, 3, 8], f32), ([8], f32), ([5], f32), ([6], f32))
    fn = concrete(grad, ([2, 3, 8], f32), ([None, 3, 8], f32), ([8], f32), ([6], f32), ([6], f32))
    assert [t.shape.as_list() for t in fn.structured_outputs] == [[2, 3, 8], [8], [8]]
