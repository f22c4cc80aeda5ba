"""batch_norm_act: CPU kernel and pure-TF reference against numpy float64; gradients; errors.

Tolerances (derived, not observed). u = 2^-24, float32's unit roundoff.

- float32 outputs. The statistics are sums of M terms in float32, cut into blocks and merged:
  the rounding errors of such a sum, of random sign, grow like sqrt(M) u times the terms'
  magnitude, so mean, variance and inv_std carry a relative error of a few u sqrt(M). y is
  (x - mean) * inv_std * gamma + beta (+ side) then the activation: a few more roundings of
  order u |y|, and the statistics' error times |xhat gamma| <= the output scale. So
  |y - y64| <= K u (1 + sqrt(M)) * scale, scale = max(1, max |y64|), with K = 16 (a few
  ulps of the elementwise operations, a factor for the sums' constants).
- half / bfloat16 outputs are the float32 value rounded once to T: |y - y64| <= 0.5 ulp_T(|y|)
  + the float32 bound above (inputs are compared as the rounded values the op received).
- gradients: dgamma / dbeta are float32 sums of M terms dpre * xhat / dpre: |error| <=
  K u sqrt(M) sum |terms|; dx = scale (dpre - (dbeta + xhat dgamma) / M) inherits the sums'
  error over M, plus a few ulps of the elementwise work: K u (1 + sqrt(M)) max |dx64|,
  plus 0.5 ulp_T for half / bfloat16.
- A wrong formula (a missing term, the unbiased variance, a wrong derivative) is off by
  O(1) relative: far outside every bound.
"""

import importlib
import math
import os
import subprocess
import sys
import textwrap

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import inspect, ops, testing
from tfmetal_ext.backends import fusion

bna_module = importlib.import_module("tfmetal_ext.ops.batch_norm_act")

U = 2.0 ** -24
K = 16.0
DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7}
ACTIVATIONS = list(fusion.BATCH_NORM_ACT_ACTIVATIONS)


def ulp(v, dtype):
    """Spacing of `dtype`'s values at |v| (its subnormal spacing near 0)."""
    v = np.abs(np.asarray(v, np.float64))
    min_exp = {"float32": -126, "float16": -14, "bfloat16": -126}[dtype]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return np.exp2(np.maximum(e, min_exp) - MANTISSA[dtype])


def f32_bound(rows, scale):
    return K * U * (1.0 + math.sqrt(rows)) * scale


def assert_output(got, want, dtype, rows, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    bound = f32_bound(rows, scale)
    if dtype != "float32":
        bound = bound + 0.5 * ulp(np.maximum(np.abs(got), np.abs(want)), dtype)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()} (bound {np.min(bound)}..{np.max(bound)})"


def assert_sum(got, want, terms_abs_sum, rows, what=""):
    bound = K * U * (1.0 + math.sqrt(rows)) * np.maximum(terms_abs_sum, 1e-30)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def rounded(a, dtype):
    return np.asarray(a, np.float32).astype(NP_DTYPES[dtype]).astype(np.float64)


def case(shape, dtype="float32", seed=0, side=False, offset=0.5):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = rounded(rng.normal(offset, 2.0, shape), dtype)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
    beta = rng.normal(0, 0.3, c).astype(np.float32)
    s = rounded(rng.normal(0, 1, shape), dtype) if side else None
    dy = rounded(rng.normal(0, 1, shape), dtype)
    return x, gamma, beta, s, dy


def tensors(dtype, *arrays):
    return [None if a is None else tf.constant(np.asarray(a, np.float32), DTYPES[dtype]) for a in arrays]


def run(x, gamma, beta, side, dy, dtype, activation, epsilon=1e-3, alpha=0.2):
    """y, mean, variance and the gradients (dx, dgamma, dbeta, dside) through ops.batch_norm_act."""
    xt, st, dyt = tensors(dtype, x, side, dy)
    gt, bt = tf.constant(gamma), tf.constant(beta)
    watched = [xt, gt, bt] + ([st] if st is not None else [])
    with tf.GradientTape() as tape:
        tape.watch(watched)
        y, mean, var = ops.batch_norm_act(xt, gt, bt, st, activation=activation, epsilon=epsilon, alpha=alpha)
    grads = tape.gradient(y, watched, output_gradients=dyt)
    assert y.dtype == DTYPES[dtype] and mean.dtype == var.dtype == tf.float32
    return (y, mean, var), grads


def check_against_numpy(x, gamma, beta, side, dy, dtype, activation, epsilon=1e-3, alpha=0.2):
    (y, mean, var), grads = run(x, gamma, beta, side, dy, dtype, activation, epsilon, alpha)
    rows = int(np.prod(x.shape[:-1]))
    wy, wmean, _, wvar = testing.np_batch_norm_act(x, gamma, beta, side, activation, epsilon, alpha)
    assert_output(y, wy, dtype, rows, "y")
    xs = np.max(np.abs(x), initial=0.0)
    np.testing.assert_allclose(mean.numpy(), wmean, rtol=0, atol=f32_bound(rows, max(xs, 1.0)))
    np.testing.assert_allclose(var.numpy(), wvar, rtol=f32_bound(rows, 1.0), atol=f32_bound(rows, 1.0) * 1e-3)
    wdx, wdg, wdb, wds = testing.np_batch_norm_act_grad(dy, x, gamma, beta, side, activation, epsilon, alpha)
    dx, dgamma, dbeta = grads[:3]
    assert dx.dtype == DTYPES[dtype] and dgamma.dtype == dbeta.dtype == tf.float32
    _, _, inv_std, _ = testing.np_batch_norm_act(x, gamma, beta, side, "linear", epsilon)
    pre = (x - wmean) * inv_std * gamma + beta + (0 if side is None else side)
    dpre = dy * testing.np_activation_grad(activation, pre, alpha)
    axes = tuple(range(x.ndim - 1))
    assert_sum(dbeta.numpy(), wdb, np.abs(dpre).sum(axes), rows, "dbeta")
    assert_sum(dgamma.numpy(), wdg, np.abs(dpre * (x - wmean) * inv_std).sum(axes), rows, "dgamma")
    assert_output(dx, wdx, dtype, rows, "dx")
    if side is not None:
        assert grads[3].dtype == DTYPES[dtype]
        assert_output(grads[3], wds, dtype, rows, "dside")


# ----------------------------------------------------------------------------
# The references


def test_numpy_reference_matches_keras_batch_normalization():
    """testing.np_batch_norm_act against the stock layer in training + keras.activations (float64)."""
    x, gamma, beta, side, _ = case((4, 5, 6), seed=1, side=True)
    layer = keras.layers.BatchNormalization(epsilon=1e-3, dtype="float64")
    layer.build(x.shape)
    layer.gamma.assign(gamma.astype(np.float64))
    layer.beta.assign(beta.astype(np.float64))
    normalized = layer(x, training=True)
    for activation in ACTIVATIONS:
        fn = keras.activations.get(activation)
        want = fn(normalized + side).numpy() if activation != "gelu" else keras.activations.gelu(
            normalized + side, approximate=False).numpy()
        # Keras' leaky_relu slope is float32(0.2) (as is the op's alpha attr).
        got, mean, _, var = testing.np_batch_norm_act(x, gamma, beta, side, activation, 1e-3, float(np.float32(0.2)))
        # Keras' float64 gelu uses float32 constants (1 / sqrt(2)): agreement to float32 rounding there.
        tol = 1e-6 if activation == "gelu" else 1e-9
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=activation)
    np.testing.assert_allclose(mean, x.mean((0, 1)), rtol=1e-12)
    np.testing.assert_allclose(var, x.var((0, 1)), rtol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_numpy_gradient_matches_a_tape_of_plain_tensorflow(activation):
    """np_batch_norm_act_grad against tf.GradientTape through tf.nn.moments + keras.activations (float64)."""
    x, gamma, beta, side, dy = case((3, 7, 5), seed=2, side=True)
    xt, gt, bt, st = (tf.constant(a, tf.float64) for a in (x, gamma, beta, side))
    with tf.GradientTape() as tape:
        tape.watch([xt, gt, bt, st])
        mean, var = tf.nn.moments(xt, axes=[0, 1])
        pre = (xt - mean) * tf.math.rsqrt(var + 1e-3) * gt + bt + st
        act = keras.activations.get(activation)
        y = keras.activations.gelu(pre, approximate=False) if activation == "gelu" else act(pre)
    want = tape.gradient(y, [xt, gt, bt, st], output_gradients=tf.constant(dy))
    got = testing.np_batch_norm_act_grad(dy, x, gamma, beta, side, activation, 1e-3, float(np.float32(0.2)))
    tol = 1e-6 if activation == "gelu" else 1e-9  # Keras' float64 gelu has float32 constants
    for g, w, what in zip(got, want, ("dx", "dgamma", "dbeta", "dside")):
        np.testing.assert_allclose(g, w.numpy(), rtol=tol, atol=tol * 0.1, err_msg=what)


# ----------------------------------------------------------------------------
# Kernel and reference path against numpy


@pytest.mark.cover_axes("dtype")  # each dtype is its own kernel instantiation
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_numpy(impl, dtype, activation, side):
    x, gamma, beta, s, dy = case((2, 9, 11, 13), dtype, seed=3, side=side)
    check_against_numpy(x, gamma, beta, s, dy, dtype, activation, alpha=0.3)


@pytest.mark.full  # several row blocks and channel chunks; the quick tier keeps test_matches_numpy
@pytest.mark.parametrize("shape", [(4096, 3), (300, 700), (1, 5), (7, 1), (2, 3, 4, 257)], ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sizes_match_numpy(dtype, shape):
    for activation in ("relu", "gelu"):
        x, gamma, beta, s, dy = case(shape, dtype, seed=4, side=True)
        check_against_numpy(x, gamma, beta, s, dy, dtype, activation)


def test_many_blocks_and_chunks():
    """(2100, 300): 4 row blocks x 2 channel chunks in the kernel's partition."""
    x, gamma, beta, s, dy = case((2100, 300), seed=5, side=True)
    check_against_numpy(x, gamma, beta, s, dy, "float32", "relu6")


def test_variance_of_a_large_offset_channel():
    """1e4 + N(0, 1): the variance to float32 accuracy (the naive E[x^2] - E[x]^2 in float32 loses it all)."""
    rng = np.random.default_rng(6)
    x = (1e4 + rng.normal(0, 1, (4096, 4))).astype(np.float32)
    _, mean, var = ops.batch_norm_act(x, activation="linear")
    want = x.astype(np.float64).var(0)
    rows = x.shape[0]
    bound = f32_bound(rows, 1.0)  # relative
    np.testing.assert_allclose(var.numpy(), want, rtol=bound)
    np.testing.assert_allclose(mean.numpy(), x.astype(np.float64).mean(0), rtol=K * U)
    naive = (x * x).mean(0, dtype=np.float32) - x.mean(0, dtype=np.float32) ** 2
    assert np.max(np.abs(naive / want - 1.0)) > 100 * bound  # the test would catch the naive formula


@pytest.mark.parametrize("activation", [None, "swish", "relu"])
def test_aliases_and_default_parameters(impl, activation):
    x = case((5, 6), seed=7)[0].astype(np.float32)
    y, mean, var = ops.batch_norm_act(x, activation=activation)
    name = {None: "linear", "swish": "silu"}.get(activation, activation)
    wy, wmean, _, wvar = testing.np_batch_norm_act(x, np.ones(6), np.zeros(6), None, name, 1e-3)
    assert_output(y, wy, "float32", 5)
    np.testing.assert_allclose(var.numpy(), wvar, rtol=1e-5)


def test_statistics_carry_no_gradient(impl):
    x = tf.constant(case((4, 3), seed=8)[0], tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        _, mean, var = ops.batch_norm_act(x)
    assert tape.gradient(mean, x) is None and tape.gradient(var, x) is None


# ----------------------------------------------------------------------------
# Edge cases


def test_empty_inputs(impl):
    # C == 0: every output empty.
    y, mean, var = ops.batch_norm_act(tf.zeros([3, 0]))
    assert y.shape == (3, 0) and mean.shape == var.shape == (0,)
    # M == 0: y empty; mean and variance NaN (Keras' moments of an empty batch); zero parameter gradients.
    x = tf.zeros([0, 4, 3])
    gamma, beta = tf.ones([3]), tf.zeros([3])
    with tf.GradientTape() as tape:
        tape.watch([x, gamma, beta])
        y, mean, var = ops.batch_norm_act(x, gamma, beta, tf.zeros([0, 4, 3]))
    dx, dgamma, dbeta = tape.gradient(y, [x, gamma, beta])
    assert y.shape == dx.shape == (0, 4, 3)
    assert np.isnan(mean.numpy()).all() and np.isnan(var.numpy()).all()
    np.testing.assert_array_equal(dgamma.numpy(), 0.0)
    np.testing.assert_array_equal(dbeta.numpy(), 0.0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_stay_in_their_channel(impl, dtype):
    x, gamma, beta, s, dy = case((6, 5, 4), dtype, seed=9, side=True)
    x[1, 2, 0] = np.nan
    x[3, 1, 2] = np.inf
    (y, mean, var), grads = run(x, gamma, beta, s, dy, dtype, "relu")
    y = tf.cast(y, tf.float32).numpy()
    dx = tf.cast(grads[0], tf.float32).numpy()
    assert np.isnan(mean.numpy()[[0]]).all() and np.isnan(var.numpy()[[0, 2]]).all()
    good = [1, 3]
    assert np.isfinite(y[..., good]).all() and np.isfinite(dx[..., good]).all()
    assert np.isfinite(grads[1].numpy()[good]).all() and np.isfinite(grads[2].numpy()[good]).all()
    clean = x[..., good]
    wy = testing.np_batch_norm_act(clean, gamma[good], beta[good], s[..., good], "relu")[0]
    assert_output(y[..., good], wy, dtype, 30)
    wdx = testing.np_batch_norm_act_grad(dy[..., good], clean, gamma[good], beta[good], s[..., good], "relu")[0]
    assert_output(dx[..., good], wdx, dtype, 30)


def test_eager_and_tf_function_agree(impl):
    x, gamma, beta, s, dy = case((3, 4, 9), seed=10, side=True)
    x, s = x.astype(np.float32), s.astype(np.float32)
    eager = ops.batch_norm_act(x, gamma, beta, s, activation="silu")
    static = tf.function(lambda t: ops.batch_norm_act(t, gamma, beta, s, activation="silu"))(x)
    dynamic = tf.function(lambda t: ops.batch_norm_act(t, activation="gelu"),
                          input_signature=[tf.TensorSpec([None, None, None], tf.float32)])
    for a, b in zip(eager, static):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    out = dynamic.get_concrete_function().structured_outputs
    assert out[0].shape.rank == 3 and out[1].shape.rank == 1
    assert_output(dynamic(x)[0], testing.np_batch_norm_act(x, np.ones(9), np.zeros(9), None, "gelu")[0], "float32", 12)


def test_compute_gradient(impl):
    x, gamma, beta, s, _ = case((4, 3), seed=11, side=True)
    theoretical, numerical = tf.test.compute_gradient(
        lambda a, g, b, t: ops.batch_norm_act(a, g, b, t, activation="silu", epsilon=1e-2)[0],
        [tf.constant(x, tf.float32), tf.constant(gamma), tf.constant(beta), tf.constant(s, tf.float32)], delta=1e-2,
    )
    for t, n, what in zip(theoretical, numerical, ("dx", "dgamma", "dbeta", "dside")):
        np.testing.assert_allclose(t, n, atol=5e-3, err_msg=what)


def test_results_are_deterministic():
    x, gamma, beta, s, dy = case((3000, 40), seed=12, side=True)
    lib = ops._loader.load()
    first = None
    for _ in range(3):
        y, mean, inv_std, var, _ = lib.tfmetal_ext_batch_norm_act(x.astype(np.float32), gamma, beta,
                                                                   [s.astype(np.float32)], [], activation="gelu")
        grads = lib.tfmetal_ext_batch_norm_act_grad(dy.astype(np.float32), x.astype(np.float32), y, gamma, beta,
                                                    [s.astype(np.float32)], mean, inv_std, activation="gelu")
        got = [t.numpy() for t in (y, mean, inv_std, var, grads[0], grads[1], grads[2], grads[3][0])]
        if first is None:
            first = got
        for a, b in zip(first, got):
            np.testing.assert_array_equal(a, b)


_THREADS_CASE = textwrap.dedent(
    """
    import sys
    import numpy as np, tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[2]))
    from tfmetal_ext import ops
    lib = ops._loader.load()
    rng = np.random.default_rng(16)
    x = rng.normal(0.5, 2.0, (5000, 300)).astype("float32")
    s = rng.normal(0, 1, x.shape).astype("float32")
    g = rng.uniform(0.5, 1.5, 300).astype("float32")
    b = rng.normal(0, 1, 300).astype("float32")
    dy = rng.normal(0, 1, x.shape).astype("float32")
    y, mean, inv_std, var, _ = lib.tfmetal_ext_batch_norm_act(x, g, b, [s], [], activation="relu")
    dx, dg, db, ds = lib.tfmetal_ext_batch_norm_act_grad(dy, x, y, g, b, [s], mean, inv_std, activation="relu")
    np.savez(sys.argv[1], y=y.numpy(), mean=mean.numpy(), var=var.numpy(), dx=dx.numpy(), dg=dg.numpy(),
             db=db.numpy())
    """
)


@pytest.mark.full  # subprocesses at 1 and 2 threads; the quick tier keeps test_results_are_deterministic
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
    for key in ("y", "mean", "var", "dx", "dg", "db"):
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)


# ----------------------------------------------------------------------------
# Graph form, switches


def test_kernel_emits_one_op_each_way():
    x = tf.constant(case((4, 8), seed=13)[0], tf.float32)
    side = tf.constant(case((4, 8), seed=14)[0], tf.float32)
    gamma, beta = tf.Variable(tf.ones([8])), tf.Variable(tf.zeros([8]))

    def step(t, s):
        with tf.GradientTape() as tape:
            tape.watch([t, s])
            y, _, _ = ops.batch_norm_act(t, gamma, beta, s)
        return y, tape.gradient(y, [t, s, gamma, beta])

    counts = inspect.report_from_capture(inspect.capture_function(step, x, side)).ops_by_type
    assert counts.get(fusion.BATCH_NORM_ACT_OP) == 1 and counts.get(fusion.BATCH_NORM_ACT_GRAD_OP) == 1
    assert "Relu" not in counts and "ReluGrad" not in counts and "Mean" not in counts


def test_avoid_fusions_runs_the_reference():
    x = case((4, 8), seed=15)[0].astype(np.float32)
    assert bna_module.uses_kernel()
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["batch_norm_act"])
        assert not bna_module.uses_kernel()
        counts = inspect.report_from_capture(
            inspect.capture_function(lambda t: ops.batch_norm_act(t)[0], x)).ops_by_type
        assert fusion.BATCH_NORM_ACT_OP not in counts and counts.get("Relu") == 1
        assert_output(ops.batch_norm_act(x)[0], testing.np_batch_norm_act(x, 1.0, 0.0)[0], "float32", 4)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    assert bna_module.uses_kernel()


def test_reference_switch_and_portable_form(monkeypatch):
    from tfmetal_ext.ops import _common

    x = case((4, 8), seed=16)[0].astype(np.float32)
    want = testing.np_batch_norm_act(x, 1.0, 0.0)[0]
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    assert not bna_module.uses_kernel()
    counts = inspect.report_from_capture(inspect.capture_function(lambda t: ops.batch_norm_act(t)[0], x)).ops_by_type
    assert fusion.BATCH_NORM_ACT_OP not in counts and "Mean" in counts
    # Traced for export: the reference without its custom-gradient wrapper.
    monkeypatch.setattr(_common, "portable", lambda: True)

    def no_wrapper(*args, **kwargs):
        raise AssertionError("tf.custom_gradient used in portable mode")

    monkeypatch.setattr(tf, "custom_gradient", no_wrapper)
    assert_output(ops.batch_norm_act(x)[0], want, "float32", 4)


def test_activation_names_are_the_kernels():
    """fusion.BATCH_NORM_ACT_ACTIVATIONS (the one Python list) is the op's attribute's list."""
    from tensorflow.python.framework import op_def_registry

    ops._loader.load()
    for op in (fusion.BATCH_NORM_ACT_OP, fusion.BATCH_NORM_ACT_GRAD_OP):
        attr = next(a for a in op_def_registry.get(op).attr if a.name == "activation")
        assert tuple(v.decode() for v in attr.allowed_values.list.s) == fusion.BATCH_NORM_ACT_ACTIVATIONS


# ----------------------------------------------------------------------------
# The moving statistics' update (moving inputs, new_moving outputs)


def _moving(channels, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 0.5, channels).astype(np.float32), rng.uniform(0.5, 2.0, channels).astype(np.float32)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("momentum", [0.99, 0.9, 0.0, 1.0])
def test_kernel_updates_the_moving_statistics_as_keras(dtype, momentum):
    """new = moving * momentum + batch * (1 - momentum) in float32 (numpy float32, the same
    two products and one sum, so bit for bit), from the batch statistics the op returns; and
    the batch statistics are those of the call without moving statistics."""
    x, gamma, beta, s, _ = case((300, 24), seed=31, side=True)
    x, s = x.astype(NP_DTYPES[dtype]), s.astype(NP_DTYPES[dtype])
    mm, mv = _moving(24, 32)
    lib = ops._loader.load()
    t = lambda a: tf.constant(a, DTYPES[dtype])  # noqa: E731
    y, mean, _, var, new = lib.tfmetal_ext_batch_norm_act(t(x), gamma, beta, [t(s)], [mm, mv], momentum=momentum)
    want = testing.np_moving_update(mean.numpy(), var.numpy(), mm, mv, momentum)
    np.testing.assert_array_equal(new[0].numpy(), want[0])
    np.testing.assert_array_equal(new[1].numpy(), want[1])
    y0, mean0, _, var0, none = lib.tfmetal_ext_batch_norm_act(t(x), gamma, beta, [t(s)], [])
    assert none == []
    for a, b in ((y, y0), (mean, mean0), (var, var0)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # And against the float64 statistics of the definition, through the wrapper.
    _, m64, _, v64 = testing.np_batch_norm_act(rounded(x, dtype), gamma, beta, rounded(s, dtype), "relu")
    _, got_mean, got_var = ops.batch_norm_act(t(x), gamma, beta, t(s), moving_mean=mm, moving_variance=mv,
                                              momentum=momentum)
    want64 = (mm * momentum + m64 * (1 - momentum), mv * momentum + v64 * (1 - momentum))
    np.testing.assert_allclose(got_mean, want64[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_var, want64[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize(
    "poison",
    ["nan in x", "inf in x", "empty batch", "update overflows"],
)
def test_a_non_finite_update_keeps_the_moving_statistics_bitwise(monkeypatch, impl, poison):
    if impl == "reference":
        monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    assert bna_module.uses_kernel() == (impl == "kernel")
    x = case((40, 6), seed=33)[0].astype(np.float32)
    mm, mv = _moving(6, 34)
    momentum = 0.9
    if poison == "nan in x":
        x[7, 2] = np.nan
    elif poison == "inf in x":
        x[0, 5] = -np.inf
    elif poison == "empty batch":
        x = x[:0]
    else:  # every input finite, one channel's updated variance beyond float32's range
        mv[3], momentum = np.float32(3e38), 2.0
    y, new_mean, new_var = ops.batch_norm_act(x, moving_mean=mm, moving_variance=mv, momentum=momentum)
    np.testing.assert_array_equal(new_mean.numpy(), mm)
    np.testing.assert_array_equal(new_var.numpy(), mv)  # every channel kept, not only the poisoned one


def test_reference_update_is_the_kernels():
    """The pure-TF reference's update (TFMETAL_EXT_REFERENCE_OPS) is the kernel's rule: the same
    float32 operations on the same batch statistics give the same bits."""
    x, gamma, beta, _, _ = case((200, 10), seed=35)
    x = x.astype(np.float32)
    mm, mv = _moving(10, 36)
    lib = ops._loader.load()
    _, mean, _, var, new = lib.tfmetal_ext_batch_norm_act(x, gamma, beta, [], [mm, mv], momentum=0.95)
    got = bna_module.reference_moving_update(mean, var, tf.constant(mm), tf.constant(mv), 0.95)
    np.testing.assert_array_equal(got[0].numpy(), new[0].numpy())
    np.testing.assert_array_equal(got[1].numpy(), new[1].numpy())


def test_moving_statistics_get_no_gradient_and_add_no_ops():
    x = tf.constant(case((16, 8), seed=37)[0], tf.float32)
    gamma = tf.Variable(tf.ones([8]))
    mm, mv = tf.Variable(tf.zeros([8])), tf.Variable(tf.ones([8]))

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y, new_mean, new_var = ops.batch_norm_act(t, gamma, moving_mean=mm, moving_variance=mv, momentum=0.9)
            loss = tf.reduce_sum(y) + tf.reduce_sum(new_mean) + tf.reduce_sum(new_var)
        mm.assign(new_mean)
        mv.assign(new_var)
        return tape.gradient(loss, [t, gamma, mm, mv])

    counts = inspect.report_from_capture(inspect.capture_function(step, x)).ops_by_type
    assert counts.get(fusion.BATCH_NORM_ACT_OP) == 1 and counts.get(fusion.BATCH_NORM_ACT_GRAD_OP) == 1
    # The blend and its guard are in the op: no Mul / Equal / SelectV2 around it.
    assert not {"Mul", "Equal", "SelectV2", "IsFinite"} & set(counts), counts
    grads = step(x)
    assert grads[2] is None and grads[3] is None
    # The gradient of y alone (the statistics' outputs carry none).
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(ops.batch_norm_act(x, gamma)[0])
    np.testing.assert_allclose(grads[0], tape.gradient(loss, x), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.batch_norm_act(tf.constant([[1, 2]])), "Received: x.dtype=int32"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3], tf.float64)), "Received: x.dtype=float64"),
        (lambda: ops.batch_norm_act(tf.ones([3])), r"Received: x.shape=\(3,\)"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), tf.ones([4])), r"Received: gamma.shape=\(4,\)"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), None, tf.ones([2])), r"Received: beta.shape=\(2,\)"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), side=tf.ones([2, 4])), r"Received: side.shape=\(2, 4\)"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), side=tf.ones([2, 3], tf.float16)), "Received: side.dtype=float16"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), activation="tanh"), "Received: activation='tanh'"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), activation=["relu"]), r"Received: activation=\['relu'\]"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), epsilon=0.0), "Received: epsilon=0.0"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), epsilon=float("nan")), "Received: epsilon=nan"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), epsilon=1e-50), "Received: epsilon=1e-50"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), alpha=float("inf")), "Received: alpha=inf"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), alpha="x"), "Received: alpha='x'"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), moving_mean=tf.zeros([3])),
         "Received: moving_mean=a tensor, moving_variance=None"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), moving_mean=tf.zeros([2]), moving_variance=tf.ones([3])),
         r"Received: moving_mean.shape=\(2,\)"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), moving_mean=tf.zeros([3]), moving_variance=tf.ones([3], tf.int32)),
         "Received: moving_variance.dtype=int32"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), moving_mean=tf.zeros([3]), moving_variance=tf.ones([3]),
                                    momentum=float("nan")), "Received: momentum=nan"),
        (lambda: ops.batch_norm_act(tf.ones([2, 3]), moving_mean=tf.zeros([3]), moving_variance=tf.ones([3]),
                                    momentum=1e39), "Received: momentum=1e\\+39"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_rejects_bad_input_at_run_time():
    lib = ops._loader.load()
    x, ones, zeros = tf.ones([2, 3]), tf.ones([3]), tf.zeros([3])
    err = tf.errors.InvalidArgumentError
    with pytest.raises(err, match="epsilon must be finite and > 0"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [], [], epsilon=0.0)
    with pytest.raises(err, match="gamma must be a vector of the last dimension of x = 4"):
        lib.tfmetal_ext_batch_norm_act(tf.ones([2, 4]), ones, tf.zeros([4]), [], [])
    with pytest.raises(err, match="beta must be a vector of the last dimension of x = 3"):
        lib.tfmetal_ext_batch_norm_act(x, ones, tf.zeros([2]), [], [])
    with pytest.raises(err, match="side must have the shape of x"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [tf.ones([3, 2])], [])
    with pytest.raises(err, match="x must have rank >= 2"):
        lib.tfmetal_ext_batch_norm_act(tf.ones([3]), ones, zeros, [], [])
    with pytest.raises(err, match="at most one side input"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [x, x], [])
    with pytest.raises(err, match="moving_variance must be a vector of the last dimension of x = 3"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [], [zeros, tf.ones([4])])
    with pytest.raises(err, match=r"moving must be empty or \(moving_mean, moving_variance\), got 1"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [], [zeros])
    with pytest.raises(err, match="momentum must be finite"):
        lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [], [zeros, ones], momentum=float("inf"))
    y, mean, inv_std, _, _ = lib.tfmetal_ext_batch_norm_act(x, ones, zeros, [], [])
    with pytest.raises(err, match="dy must have the shape of x"):
        lib.tfmetal_ext_batch_norm_act_grad(tf.ones([2, 4]), x, y, ones, zeros, [], mean, inv_std)
    with pytest.raises(err, match="inv_std must be a vector of the last dimension of x = 3"):
        lib.tfmetal_ext_batch_norm_act_grad(x, x, y, ones, zeros, [], mean, tf.ones([4]))
    with pytest.raises(err, match="side must have the shape of x"):
        lib.tfmetal_ext_batch_norm_act_grad(x, x, y, ones, zeros, [tf.ones([2])], mean, inv_std)


def test_bad_shapes_fail_at_graph_construction():
    lib = ops._loader.load()
    f32 = tf.float32

    def concrete(fn, *specs):
        return tf.function(fn).get_concrete_function(*[tf.TensorSpec(s, f32) for s in specs])

    forward = lambda x, g, b, s: lib.tfmetal_ext_batch_norm_act(x, g, b, [s], [])  # noqa: E731
    with pytest.raises(ValueError, match="gamma must be a vector of the last dimension of x = 8, got shape \\[7\\]"):
        concrete(forward, [2, 8], [7], [8], [2, 8])
    with pytest.raises(ValueError, match="side must have the shape of x"):
        concrete(forward, [2, 8], [8], [8], [3, 8])
    with pytest.raises(ValueError, match="x must have rank >= 2"):
        concrete(forward, [8], [8], [8], [8])
    fn = concrete(forward, [None, 3, 8], [None], [8], [5, None, None])
    assert [t.shape.as_list() for t in fn.structured_outputs[:4]] == [[5, 3, 8], [8], [8], [8]]
