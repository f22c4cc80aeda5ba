"""rms_norm: CPU kernel and pure-TF reference against numpy; gradients; errors."""

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import inspect, ops

# The module (tfmetal_ext.ops.rms_norm is the function there).
rms_norm_module = importlib.import_module("tfmetal_ext.ops.rms_norm")


# Output tolerance (relative, and absolute on values of order 1): the output
# dtype's rounding; the statistics are float32 for every dtype.
DTYPES = {"float32": (tf.float32, 2e-5), "float16": (tf.float16, 2e-3), "bfloat16": (tf.bfloat16, 1.6e-2)}


def np_rms_norm(x, gamma, epsilon):
    """Written out here, independently of the package: float64."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        ms = float(np.sum(row * row)) / row.size if row.size else 0.0
        out[idx] = row / np.sqrt(ms + epsilon) * gamma
    return out


def np_rms_norm_grad(dy, x, gamma, epsilon):
    """dx from the Jacobian of one row (d y_i / d x_j), dgamma = sum of dy * x / rms."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    gamma = np.broadcast_to(np.asarray(gamma, np.float64), x.shape[-1:])
    dx = np.zeros_like(x)
    dgamma = np.zeros(x.shape[-1])
    c = x.shape[-1]
    for idx in np.ndindex(x.shape[:-1]):
        row, d = x[idx], dy[idx]
        if c == 0:
            continue
        r = 1.0 / np.sqrt(float(np.sum(row * row)) / c + epsilon)
        # y_i = x_i r g_i;  d y_i / d x_j = g_i (r delta_ij - x_i r^3 x_j / c)
        jac = gamma[:, None] * (r * np.eye(c) - np.outer(row, row) * r**3 / c)
        dx[idx] = d @ jac
        dgamma += d * row * r
    return dx, dgamma


def rounded(x, tf_dtype):
    """x rounded to tf_dtype, as float64: the op's actual input."""
    return tf.cast(tf.cast(x, tf_dtype), tf.float64).numpy()


def as64(t):
    return tf.cast(t, tf.float64).numpy()


def inputs(shape, seed=0, scale=2.0, offset=0.5):
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, scale, shape) + offset).astype("float32")
    gamma = rng.uniform(0.5, 1.5, shape[-1]).astype("float32")
    return x, gamma


def assert_close(got, want, tol, what=""):
    scale = float(np.max(np.abs(want))) if np.size(want) else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(scale, 1.0), err_msg=what)


SHAPES = [(1,), (31,), (4, 1), (3, 31), (5, 32), (2, 33), (3, 1000), (2, 3, 4), (2, 3, 4, 5), (0, 8), (4, 0), (0,),
          (2, 0, 3)]


def test_numpy_references_agree():
    """The test's loop-and-Jacobian numpy against tfmetal_ext.testing's vectorized one (the doctor's)."""
    from tfmetal_ext import testing

    x, gamma = inputs((3, 7), seed=20)
    dy = np.random.default_rng(21).normal(0, 1, x.shape)
    np.testing.assert_allclose(np_rms_norm(x, gamma, 1e-3), testing.np_rms_norm(x, gamma, 1e-3), rtol=1e-12)
    for a, b in zip(np_rms_norm_grad(dy, x, gamma, 1e-3), testing.np_rms_norm_grad(dy, x, gamma, 1e-3)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_numpy(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    for shape in SHAPES:
        x, gamma = inputs(shape)
        got = ops.rms_norm(tf.constant(x, tf_dtype), gamma, epsilon=1e-5)
        assert got.dtype == tf_dtype and got.shape == shape
        assert_close(as64(got), np_rms_norm(rounded(x, tf_dtype), gamma, 1e-5), tol, f"shape {shape}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_match_numpy(impl, dtype):
    """dx, dgamma; (300, 300) sums dgamma over several row blocks."""
    for shape in [(1,), (3, 31), (2, 33), (17, 9), (2, 3, 4, 5), (0, 8), (4, 0), (300, 40)]:
        tf_dtype, tol = DTYPES[dtype]
        x, gamma = inputs(shape, seed=1)
        dy = np.random.default_rng(2).normal(0, 1, shape).astype("float32")
        xt, dyt, g = tf.constant(x, tf_dtype), tf.constant(dy, tf_dtype), tf.constant(gamma)
        with tf.GradientTape() as tape:
            tape.watch([xt, g])
            y = ops.rms_norm(xt, g, epsilon=1e-3)
        dx, dgamma = tape.gradient(y, [xt, g], output_gradients=dyt)
        assert dx.dtype == tf_dtype and dgamma.dtype == tf.float32
        want_dx, want_dgamma = np_rms_norm_grad(rounded(dy, tf_dtype), rounded(x, tf_dtype), gamma, 1e-3)
        assert_close(as64(dx), want_dx, tol, f"dx, shape {shape}")
        assert_close(dgamma.numpy(), want_dgamma, 1e-4, f"dgamma, shape {shape}")


def test_many_row_blocks_in_dgamma():
    """(1000, 300): the kernel's dgamma is summed over 16 row blocks (the reference in one reduction)."""
    x, gamma = inputs((1000, 300), seed=22)
    dy = np.random.default_rng(23).normal(0, 1, x.shape).astype("float32")
    lib = ops._loader.load()
    _, rstd = lib.tfmetal_ext_rms_norm(x, gamma, epsilon=1e-6)
    dx, dgamma = lib.tfmetal_ext_rms_norm_grad(dy, x, gamma, rstd)
    xd = x.astype(np.float64)
    r = 1 / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rstd.numpy(), r[:, 0], rtol=1e-5)
    np.testing.assert_allclose(dgamma.numpy(), (dy * xd * r).sum(0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gamma_gets_a_half_gradient(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    x, gamma = inputs((6, 10), seed=3)
    xt, g = tf.constant(x, tf_dtype), tf.constant(gamma, tf_dtype)
    with tf.GradientTape() as tape:
        tape.watch(g)
        y = ops.rms_norm(xt, g)
    dgamma = tape.gradient(y, g)
    assert dgamma.dtype == tf_dtype
    _, want = np_rms_norm_grad(np.ones((6, 10)), rounded(x, tf_dtype), as64(g), 1e-6)
    assert_close(as64(dgamma), want, tol)


def test_large_input_uses_all_rows(impl):
    x, gamma = inputs((1030, 513), seed=5)
    assert_close(ops.rms_norm(x, gamma).numpy(), np_rms_norm(x, gamma, 1e-6), 2e-5)


def test_epsilon_matters_for_small_rows(impl):
    """A row of tiny values: epsilon dominates the mean square (the op does not drop it)."""
    x = np.full((2, 4), 1e-3, np.float32)
    got = ops.rms_norm(x, epsilon=1e-6).numpy()
    assert_close(got, np_rms_norm(x, 1.0, 1e-6), 2e-5)
    assert abs(got[0, 0] - 1e-3 / np.sqrt(1e-6 + 1e-6)) < 1e-4  # not 1.0


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_stay_in_their_row(impl, dtype):
    tf_dtype, tol = DTYPES[dtype]
    x, gamma = inputs((5, 7), seed=6)
    x[0, 3], x[1, 0], x[3, 6] = np.nan, np.inf, -np.inf
    dy = np.random.default_rng(7).normal(0, 1, (5, 7)).astype("float32")
    xt, g = tf.constant(x, tf_dtype), tf.constant(gamma)
    with tf.GradientTape() as tape:
        tape.watch([xt, g])
        y = ops.rms_norm(xt, g)
    dx, dgamma = tape.gradient(y, [xt, g], output_gradients=tf.constant(dy, tf_dtype))
    y, dx = as64(y), as64(dx)
    bad, good = [0, 1, 3], [2, 4]
    # As the stock computation (and numpy): a NaN makes its row NaN; an infinity makes the mean
    # square inf and rstd 0, so the row's finite values give 0 and the infinity itself NaN.
    assert np.isnan(y[0]).all()
    assert np.isnan(y[1, 0]) and np.isnan(y[3, 6]) and (y[1, 1:] == 0).all() and (y[3, :6] == 0).all()
    assert np.isnan(dx[bad]).all()
    xr = rounded(x[good], tf_dtype)
    assert_close(y[good], np_rms_norm(xr, gamma, 1e-6), tol)
    assert_close(dx[good], np_rms_norm_grad(rounded(dy[good], tf_dtype), xr, gamma, 1e-6)[0], tol)
    assert np.isnan(dgamma.numpy()).all()  # a sum over all rows, the NaN rows included


def test_non_contiguous_views(impl):
    base, gamma = inputs((40, 30), seed=8)
    for view in (tf.transpose(tf.constant(base))[:, ::3], tf.constant(base)[::2, 5:25]):
        c = view.shape[-1]
        assert_close(ops.rms_norm(view, gamma[:c]).numpy(), np_rms_norm(view.numpy(), gamma[:c], 1e-6), 2e-5)


def test_eager_and_tf_function_agree(impl):
    x, gamma = inputs((3, 4, 9), seed=9)
    eager = ops.rms_norm(x, gamma, epsilon=1e-5)
    static = tf.function(lambda t: ops.rms_norm(t, gamma, epsilon=1e-5))(x)
    # Unknown dimensions: the shape functions and the default gamma of unknown size.
    dynamic = tf.function(
        lambda t: ops.rms_norm(t, epsilon=1e-5), input_signature=[tf.TensorSpec([None, None, None], tf.float32)]
    )
    if impl == "kernel":
        np.testing.assert_array_equal(eager.numpy(), static.numpy())
    else:  # grappler may reorder the reference's reductions
        assert_close(eager.numpy(), static.numpy(), 1e-6)
    assert dynamic.get_concrete_function().structured_outputs.shape.rank == 3
    assert_close(dynamic(x).numpy(), np_rms_norm(x, 1.0, 1e-5), 2e-5)

    @tf.function
    def grads(t, g):
        with tf.GradientTape() as tape:
            tape.watch([t, g])
            y = ops.rms_norm(t, g, epsilon=1e-5)
        return tape.gradient(y, [t, g], output_gradients=tf.ones_like(y) * 0.5)

    dx, dgamma = grads(tf.constant(x), tf.constant(gamma))
    want_dx, want_dgamma = np_rms_norm_grad(np.full(x.shape, 0.5), x, gamma, 1e-5)
    assert_close(dx.numpy(), want_dx, 2e-5)
    assert_close(dgamma.numpy(), want_dgamma, 1e-4)


def test_compute_gradient(impl):
    x, gamma = inputs((3, 5), seed=10)
    theoretical, numerical = tf.test.compute_gradient(
        lambda a, g: ops.rms_norm(a, g, epsilon=1e-2), [tf.constant(x), tf.constant(gamma)], delta=1e-2
    )
    for t, n, what in zip(theoretical, numerical, ("dx", "dgamma")):
        np.testing.assert_allclose(t, n, atol=5e-3, err_msg=what)


def test_default_gamma_is_one(impl):
    x, _ = inputs((4, 6), seed=11)
    assert_close(ops.rms_norm(x).numpy(), np_rms_norm(x, 1.0, 1e-6), 2e-5)
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y = ops.rms_norm(xt)
    dy = np.ones_like(x) * np.arange(6)
    want_dx, _ = np_rms_norm_grad(dy, x, 1.0, 1e-6)
    assert_close(tape.gradient(y, xt, output_gradients=tf.constant(dy, tf.float32)).numpy(), want_dx, 2e-5)


def test_gradient_is_deterministic():
    x, gamma = inputs((600, 300), seed=12)
    lib = ops._loader.load()
    _, rstd = lib.tfmetal_ext_rms_norm(x, gamma, epsilon=1e-6)
    dy = tf.constant(np.random.default_rng(13).normal(0, 1, x.shape).astype("float32"))
    first = [t.numpy() for t in lib.tfmetal_ext_rms_norm_grad(dy, x, gamma, rstd)]
    for _ in range(3):
        for a, b in zip(first, lib.tfmetal_ext_rms_norm_grad(dy, x, gamma, rstd)):
            np.testing.assert_array_equal(a, b.numpy())


_THREADS_CASE = textwrap.dedent(
    """
    import sys
    import numpy as np, tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[2]))
    from tfmetal_ext import ops
    lib = ops._loader.load()
    rng = np.random.default_rng(16)
    x = rng.normal(0.5, 2.0, (900, 200)).astype("float32")
    g = rng.uniform(0.5, 1.5, 200).astype("float32")
    dy = rng.normal(0, 1, x.shape).astype("float32")
    y, rstd = lib.tfmetal_ext_rms_norm(x, g)
    dx, dgamma = lib.tfmetal_ext_rms_norm_grad(dy, x, g, rstd)
    np.savez(sys.argv[1], y=y.numpy(), rstd=rstd.numpy(), dx=dx.numpy(), dgamma=dgamma.numpy())
    """
)


@pytest.mark.full  # rebuilds and runs the kernel at several thread counts in subprocesses; the quick tier keeps the fixed-partition tests
def test_results_do_not_depend_on_the_thread_count(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TFMETAL_EXT_REFERENCE_OPS"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    paths = [tmp_path / f"t{threads}.npz" for threads in ("1", "2")]
    procs = [subprocess.Popen([sys.executable, "-c", _THREADS_CASE, str(path), threads], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for path, threads in zip(paths, ("1", "2"))]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    results = [np.load(path) for path in paths]
    for key in ("y", "rstd", "dx", "dgamma"):
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)


def test_saved_statistics():
    x, gamma = inputs((5, 12), seed=14, offset=100.0)
    _, rstd = ops._loader.load().tfmetal_ext_rms_norm(x, gamma, epsilon=1e-3)
    xd = x.astype(np.float64)
    np.testing.assert_allclose(rstd.numpy(), 1 / np.sqrt((xd * xd).mean(-1) + 1e-3), rtol=1e-5)
    # Empty rows: a zero mean square.
    y, rstd = ops._loader.load().tfmetal_ext_rms_norm(tf.zeros([3, 0]), tf.zeros([0]), epsilon=0.25)
    assert y.shape == (3, 0)
    np.testing.assert_array_equal(rstd.numpy(), [2, 2, 2])


def test_kernel_emits_one_op_each_way():
    x = tf.constant(np.random.default_rng(15).normal(0, 1, (4, 8)).astype("float32"))
    gamma = tf.Variable(tf.ones([8]))

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = ops.rms_norm(t, gamma)
        return y, tape.gradient(y, [t, gamma])

    counts = inspect.report_from_capture(inspect.capture_function(step, x)).ops_by_type
    assert counts.get("TfmetalExt>RMSNorm") == 1
    assert counts.get("TfmetalExt>RMSNormGrad") == 1
    assert "Rsqrt" not in counts and "Mean" not in counts


def test_avoid_fusions_runs_the_reference():
    x, gamma = inputs((4, 8), seed=17)
    assert rms_norm_module.uses_kernel()
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["rms_norm"])
        assert not rms_norm_module.uses_kernel()
        counts = inspect.report_from_capture(inspect.capture_function(lambda t: ops.rms_norm(t, gamma), x)).ops_by_type
        assert "TfmetalExt>RMSNorm" not in counts and counts.get("Rsqrt") == 1
        assert_close(ops.rms_norm(x, gamma).numpy(), np_rms_norm(x, gamma, 1e-6), 2e-5)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    assert rms_norm_module.uses_kernel()


def test_reference_switch(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    x, gamma = inputs((4, 8), seed=18)
    assert not rms_norm_module.uses_kernel()
    counts = inspect.report_from_capture(inspect.capture_function(lambda t: ops.rms_norm(t, gamma), x)).ops_by_type
    assert "TfmetalExt>RMSNorm" not in counts


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.rms_norm(tf.constant([1, 2])), "Received: x.dtype=int32"),
        (lambda: ops.rms_norm(tf.constant([1.0], tf.float64)), "Received: x.dtype=float64"),
        (lambda: ops.rms_norm(tf.constant(1.0)), r"Received: x.shape=\(\)"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon=0.0), "Received: epsilon=0.0"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon=-1e-3), "Received: epsilon=-0.001"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon=float("nan")), "Received: epsilon=nan"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon=float("inf")), "Received: epsilon=inf"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon="big"), "Received: epsilon='big'"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), epsilon=True), "Received: epsilon=True"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), tf.ones([4])), r"Received: gamma.shape=\(4,\)"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), tf.ones([3, 1])), r"Received: gamma.shape=\(3, 1\)"),
        (lambda: ops.rms_norm(tf.ones([2, 3]), tf.constant([1, 1, 1])), "Received: gamma.dtype=int32"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_rejects_bad_input_at_run_time():
    lib = ops._loader.load()
    ones = tf.ones([3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="epsilon must be finite and > 0"):
        lib.tfmetal_ext_rms_norm(tf.ones([2, 3]), ones, epsilon=0.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="epsilon must be finite and > 0"):
        lib.tfmetal_ext_rms_norm(tf.ones([2, 3]), ones, epsilon=float("nan"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="gamma must be a vector of the last dimension of x = 4"):
        lib.tfmetal_ext_rms_norm(tf.ones([2, 4]), ones)
    with pytest.raises(tf.errors.InvalidArgumentError, match="x must have rank >= 1"):
        lib.tfmetal_ext_rms_norm(tf.constant(1.0), tf.ones([1]))
    _, rstd = lib.tfmetal_ext_rms_norm(tf.ones([2, 3]), ones)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dy and x must have the same shape"):
        lib.tfmetal_ext_rms_norm_grad(tf.ones([2, 4]), tf.ones([2, 3]), ones, rstd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="rstd must be a vector of the number of rows of x = 4"):
        lib.tfmetal_ext_rms_norm_grad(tf.ones([4, 3]), tf.ones([4, 3]), ones, rstd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="gamma must be a vector"):
        lib.tfmetal_ext_rms_norm_grad(tf.ones([2, 3]), tf.ones([2, 3]), tf.ones([2]), rstd)
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError)):
        lib.tfmetal_ext_rms_norm(tf.ones([2, 3], tf.float64), ones)


def test_bad_shapes_fail_at_graph_construction():
    lib = ops._loader.load()

    def concrete(fn, *specs):
        return tf.function(fn).get_concrete_function(*[tf.TensorSpec(s, d) for s, d in specs])

    forward = lambda x, g: lib.tfmetal_ext_rms_norm(x, g)  # noqa: E731
    with pytest.raises(ValueError, match="gamma must be a vector of the last dimension of x = 8, got shape \\[7\\]"):
        concrete(forward, ([2, 8], tf.float32), ([7], tf.float32))
    with pytest.raises(ValueError, match="x must have rank >= 1"):
        concrete(forward, ([], tf.float32), ([1], tf.float32))
    fn = concrete(forward, ([None, 3, 8], tf.float32), ([None], tf.float32))
    assert fn.structured_outputs[1].shape.as_list() == [None]
    fn = concrete(forward, ([5, 3, 8], tf.bfloat16), ([8], tf.float32))
    assert fn.structured_outputs[1].shape.as_list() == [15]

    grad = lambda dy, x, g, r: lib.tfmetal_ext_rms_norm_grad(dy, x, g, r)  # noqa: E731
    f32 = tf.float32
    with pytest.raises(ValueError, match="dy and x must have the same shape"):
        concrete(grad, ([2, 8], f32), ([2, 9], f32), ([9], f32), ([2], f32))
    with pytest.raises(ValueError, match="rstd must be a vector of the number of rows of x = 6"):
        concrete(grad, ([2, 3, 8], f32), ([2, 3, 8], f32), ([8], f32), ([5], f32))
    fn = concrete(grad, ([2, 3, 8], f32), ([None, 3, 8], f32), ([8], f32), ([6], f32))
    assert [t.shape.as_list() for t in fn.structured_outputs] == [[2, 3, 8], [8]]
