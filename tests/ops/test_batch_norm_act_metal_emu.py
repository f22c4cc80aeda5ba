"""The batch norm + activation Metal kernels (custom_ops/metal/batch_norm_act.metal) on the Metal emulator.

Every instantiation -- batch_norm_act_stats_float, batch_norm_act_stats_half,
batch_norm_act_stats_bfloat, batch_norm_act_float, batch_norm_act_half,
batch_norm_act_bfloat, batch_norm_act_grad_sums_float, batch_norm_act_grad_sums_half,
batch_norm_act_grad_sums_bfloat, batch_norm_act_grad_float, batch_norm_act_grad_half,
batch_norm_act_grad_bfloat -- is dispatched the way batch_norm_act_metal.mm dispatches it
(the column reductions as norm_metal.h's parameter-gradient pass, the elementwise passes one
thread per element) and compared with numpy float64 (tfmetal_ext.testing) and the CPU kernel,
for every activation, with and without the side input.

Tolerances, as tests/ops/test_batch_norm_act.py derives them: float32 results within
K u (1 + sqrt(M)) of the output scale (u = 2^-24, K = 16: the per-channel sums' rounding over
M rows plus a few elementwise roundings); half / bfloat16 outputs, rounded once from float32,
within that plus half a unit in the last place of T. The sums run in another order than on the
CPU (row lanes of a threadgroup vs row blocks), so results agree to rounding, not bit for bit.
"""

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.testing import compiled_ops, load_emu, norm_param_grad_groups, norm_param_grad_threads

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
TF_DTYPES = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}
MANTISSA = {"float": 23, "half": 10, "bfloat": 7}
MIN_EXP = {"float": -126, "half": -14, "bfloat": -126}
NAMES = ("batch_norm_act_stats", "batch_norm_act", "batch_norm_act_grad_sums", "batch_norm_act_grad")
ACTIVATIONS = list(fusion.BATCH_NORM_ACT_ACTIVATIONS)
CODES = {name: i for i, name in enumerate(ACTIVATIONS)}  # the TFM_BNA_* codes
PARAMS = np.dtype([("rows", "<u4"), ("channels", "<u4"), ("activation", "<i4"), ("has_side", "<u4"),
                   ("alpha", "<f4"), ("epsilon", "<f4"), ("momentum", "<f4"),
                   ("has_moving", "<u4")])  # tfm_batch_norm_act_params
EPSILON = 1e-3
ALPHA = 0.3
U = 2.0 ** -24
K = 16.0
SWEEP_CAP = 128  # threadgroup cap of the emulated reductions (the host's is 1024)
ELEMENT_THREADS = 64

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "batch_norm_act.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as batch_norm_act_metal.mm does it.


def params(rows, channels, activation, has_side, alpha=ALPHA, epsilon=EPSILON):
    return ("bytes", np.array((rows, channels, CODES[activation], int(has_side), alpha, epsilon, 0.99, 0), PARAMS))


def metal_forward(lib, dtype, x, gamma, beta, side, activation, threads=None, cap=SWEEP_CAP, order="linear"):
    rows, channels = x.shape
    y = np.full_like(x, np.nan)
    mean, inv_std, var = (np.full(channels, -7.0, np.float32) for _ in range(3))
    p = params(rows, channels, activation, side is not None)
    if channels:
        lib.run(f"batch_norm_act_stats_{dtype}", [x, mean, inv_std, var, p],
                threadgroups=norm_param_grad_groups(channels), threadgroup=threads or norm_param_grad_threads(rows, cap),
                order=order, seed=3)
    if channels and rows:
        lib.run(f"batch_norm_act_{dtype}", [x, gamma, beta, x if side is None else side, mean, inv_std, y, p],
                grid=rows * channels, threadgroup=ELEMENT_THREADS, order=order, seed=4)
    return y, mean, inv_std, var


def metal_grad(lib, dtype, dy, x, gamma, beta, side, mean, inv_std, activation, threads=None, cap=SWEEP_CAP,
               order="linear"):
    rows, channels = x.shape
    dx = np.full_like(x, np.nan)
    dside = np.full_like(x, np.nan)
    dgamma, dbeta = np.full(channels, np.nan, np.float32), np.full(channels, np.nan, np.float32)
    p = params(rows, channels, activation, side is not None)
    s = x if side is None else side
    if channels:
        lib.run(f"batch_norm_act_grad_sums_{dtype}", [dy, x, gamma, beta, s, mean, inv_std, dgamma, dbeta, p],
                threadgroups=norm_param_grad_groups(channels), threadgroup=threads or norm_param_grad_threads(rows, cap),
                order=order, seed=5)
    if channels and rows:
        lib.run(f"batch_norm_act_grad_{dtype}",
                [dy, x, gamma, beta, s, mean, inv_std, dgamma, dbeta, dx, dx if side is None else dside, p],
                grid=rows * channels, threadgroup=ELEMENT_THREADS, order=order, seed=6)
    return dx, dgamma, dbeta, (None if side is None else dside)


# ----------------------------------------------------------------------------
# Inputs, references, tolerances


def random_case(dtype, rows, channels, seed, side=True, offset=0.5):
    rng = np.random.default_rng(seed)
    cast = lambda a: a.astype(np.float32).astype(DTYPES[dtype])  # noqa: E731
    x = cast(rng.normal(offset, 2.0, (rows, channels)))
    dy = cast(rng.normal(0, 1, (rows, channels)))
    s = cast(rng.normal(0, 1, (rows, channels))) if side else None
    gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    beta = rng.normal(0, 0.3, channels).astype(np.float32)
    return x, dy, s, gamma, beta


def f64(a):
    return None if a is None else np.asarray(a, np.float32).astype(np.float64)


def ulp(v, dtype):
    v = np.abs(np.asarray(v, np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return np.exp2(np.maximum(e, MIN_EXP[dtype]) - MANTISSA[dtype])


def assert_output(got, want, dtype, rows, what=""):
    got, want = f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    bound = K * U * (1.0 + math.sqrt(rows)) * scale
    if dtype != "float":
        bound = bound + 0.5 * ulp(np.maximum(np.abs(got), np.abs(want)), dtype)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def assert_sums(got, want, abs_sum, rows, what=""):
    bound = K * U * (1.0 + math.sqrt(rows)) * np.maximum(abs_sum, 1e-30)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def check_case(lib, dtype, activation, x, dy, side, gamma, beta, threads=None, cap=SWEEP_CAP):
    rows = x.shape[0]
    y, mean, inv_std, var = metal_forward(lib, dtype, x, gamma, beta, side, activation, threads, cap)
    wy, wmean, winv, wvar = testing.np_batch_norm_act(f64(x), gamma, beta, f64(side), activation, EPSILON, ALPHA)
    assert_output(y, wy, dtype, rows, "y")
    scale = max(1.0, float(np.abs(f64(x)).max()))
    np.testing.assert_allclose(mean, wmean, rtol=0, atol=K * U * (1 + math.sqrt(rows)) * scale)
    np.testing.assert_allclose(var, wvar, rtol=K * U * (1 + math.sqrt(rows)), atol=1e-7)
    np.testing.assert_allclose(inv_std, winv, rtol=K * U * (1 + math.sqrt(rows)))
    dx, dgamma, dbeta, dside = metal_grad(lib, dtype, dy, x, gamma, beta, side, mean, inv_std, activation, threads,
                                          cap)
    wdx, wdg, wdb, wds = testing.np_batch_norm_act_grad(f64(dy), f64(x), gamma, beta, f64(side), activation, EPSILON,
                                                        ALPHA)
    xhat = (f64(x) - wmean) * winv
    pre = xhat * gamma + beta + (0.0 if side is None else f64(side))
    dpre = f64(dy) * testing.np_activation_grad(activation, pre, ALPHA)
    assert_sums(dbeta, wdb, np.abs(dpre).sum(0), rows, "dbeta")
    assert_sums(dgamma, wdg, np.abs(dpre * xhat).sum(0), rows, "dgamma")
    assert_output(dx, wdx, dtype, rows, "dx")
    if side is not None:
        assert_output(dside, wds, dtype, rows, "dside")
    return (y, mean, inv_std, var), (dx, dgamma, dbeta, dside)


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    names = [f"{n}_{d}" for n in NAMES for d in DTYPES]
    assert lib.kernels() == sorted(names)
    counts = {"batch_norm_act_stats": 5, "batch_norm_act": 8, "batch_norm_act_grad_sums": 10, "batch_norm_act_grad": 12}
    for name in names:
        params_ = lib.params(name)
        assert len(params_) == counts[name.rsplit("_", 1)[0]], name
        assert params_[-1].kind == "reference" and params_[-1].size == PARAMS.itemsize


@pytest.mark.cover_axes("dtype", "activation")  # each dtype is its own instantiation; each activation its own code
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_instantiation_matches_numpy_and_the_cpu_kernel(lib, cpu, dtype, activation, side):
    x, dy, s, gamma, beta = random_case(dtype, 37, 40, seed=CODES[activation] * 2 + side, side=side)
    (y, mean, inv_std, var), (dx, dgamma, dbeta, dside) = check_case(lib, dtype, activation, x, dy, s, gamma, beta)
    # The CPU kernel from the same inputs: the same values to rounding.
    tx, tdy = tf.constant(x), tf.constant(dy)
    sides = [] if s is None else [tf.constant(s)]
    cy, cmean, cinv, cvar, _ = cpu.tfmetal_ext_batch_norm_act(tx, gamma, beta, sides, [], activation=activation,
                                                              alpha=ALPHA, epsilon=EPSILON)
    np.testing.assert_allclose(mean, cmean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, cvar.numpy(), rtol=1e-5)
    cgrads = cpu.tfmetal_ext_batch_norm_act_grad(tdy, tx, cy, gamma, beta, sides, mean, inv_std, activation=activation,
                                                 alpha=ALPHA, epsilon=EPSILON)
    np.testing.assert_allclose(dbeta, cgrads[2].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgamma, cgrads[1].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,threads", [("float", 32), ("float", 256), ("half", 64), ("bfloat", 128)])
def test_threadgroup_sizes_the_host_can_pick(lib, dtype, threads):
    """More row lanes than rows, and fewer: the lanes' moments merge in order."""
    x, dy, s, gamma, beta = random_case(dtype, 9, 70, seed=threads)
    check_case(lib, dtype, "relu", x, dy, s, gamma, beta, threads=threads)


@pytest.mark.full  # 1024-thread emulated threadgroups are slow; the quick tier keeps the threadgroup-size test
def test_host_sized_reduction_over_many_rows(lib):
    assert norm_param_grad_threads(3000, 1024) == 1024  # what the host picks: 32 row lanes
    x, dy, s, gamma, beta = random_case("float", 3000, 33, seed=11)
    check_case(lib, "float", "gelu", x, dy, s, gamma, beta, cap=1024)


def test_variance_of_a_large_offset_channel(lib):
    """1e4 + N(0, 1): the variance to float32 accuracy (shifted sums, Chan's merge of the lanes)."""
    rng = np.random.default_rng(12)
    x = (1e4 + rng.normal(0, 1, (2000, 4))).astype(np.float32)
    _, mean, _, var = metal_forward(lib, "float", x, np.ones(4, np.float32), np.zeros(4, np.float32), None, "linear")
    want = x.astype(np.float64).var(0)
    np.testing.assert_allclose(var, want, rtol=K * U * (1 + math.sqrt(2000)))
    naive = (x * x).mean(0, dtype=np.float32) - x.mean(0, dtype=np.float32) ** 2
    assert np.max(np.abs(naive / want - 1)) > 100 * K * U * (1 + math.sqrt(2000))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_empty_batch(lib, dtype):
    # rows == 0: only the reductions run: NaN statistics forward, zero dgamma / dbeta backward.
    x = np.zeros((0, 33), DTYPES[dtype])
    gamma, beta = np.ones(33, np.float32), np.zeros(33, np.float32)
    _, mean, inv_std, var = metal_forward(lib, dtype, x, gamma, beta, None, "relu")
    assert np.isnan(mean).all() and np.isnan(var).all() and np.isnan(inv_std).all()
    _, dgamma, dbeta, _ = metal_grad(lib, dtype, x.copy(), x, gamma, beta, None, mean, inv_std, "relu")
    np.testing.assert_array_equal(dgamma, 0.0)
    np.testing.assert_array_equal(dbeta, 0.0)


def test_nan_stays_in_its_channel(lib):
    x, dy, s, gamma, beta = random_case("half", 12, 40, seed=13)
    x[3, 5] = np.nan
    x[7, 33] = np.inf
    y, mean, inv_std, var = metal_forward(lib, "half", x, gamma, beta, s, "silu")
    bad = [5, 33]
    good = [c for c in range(40) if c not in bad]
    assert np.isnan(var[bad]).all() and np.isfinite(var[good]).all()
    assert np.isfinite(y[:, good].astype(np.float32)).all()
    dx, dgamma, dbeta, dside = metal_grad(lib, "half", dy, x, gamma, beta, s, mean, inv_std, "silu")
    assert np.isfinite(dx[:, good].astype(np.float32)).all() and np.isfinite(dgamma[good]).all()
    assert np.isnan(dgamma[bad]).all()


def test_results_do_not_depend_on_threadgroup_order(lib):
    x, dy, s, gamma, beta = random_case("bfloat", 20, 70, seed=14)
    first = metal_forward(lib, "bfloat", x, gamma, beta, s, "leaky_relu")
    again = metal_forward(lib, "bfloat", x, gamma, beta, s, "leaky_relu", order="shuffle")
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    grads = metal_grad(lib, "bfloat", dy, x, gamma, beta, s, first[1], first[2], "leaky_relu")
    grads_again = metal_grad(lib, "bfloat", dy, x, gamma, beta, s, first[1], first[2], "leaky_relu", order="reverse")
    for a, b in zip(grads, grads_again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("shape", [(64, 8, 8, 32), (5, 33), (0, 8), (3, 0)], ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels(cpu, dtype, activation, shape):
    rng = np.random.default_rng(31)
    cast = lambda a: tf.constant(a.astype(np.float32), TF_DTYPES[dtype])  # noqa: E731
    x, dy, s = (cast(rng.normal(0.5, 2.0, shape)) for _ in range(3))
    c = shape[-1]
    gamma, beta = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.normal(0, 0.3, c).astype(np.float32)
    results = {}
    for device in ("/GPU:0", "/CPU:0"):
        with tf.device(device):
            y, mean, inv_std, var, _ = cpu.tfmetal_ext_batch_norm_act(x, gamma, beta, [s], [], activation=activation)
            grads = cpu.tfmetal_ext_batch_norm_act_grad(dy, x, y, gamma, beta, [s], mean, inv_std,
                                                        activation=activation)
        if device == "/GPU:0":
            assert "GPU" in y.device and "GPU" in grads[0].device
        results[device] = [t.numpy().astype(np.float64) for t in (y, mean, var, grads[0], grads[1], grads[2],
                                                                   grads[3][0])]
    rows = int(np.prod(shape[:-1]))
    tol = K * U * (1 + math.sqrt(rows)) + {"float": 0.0, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}[dtype]
    for a, b in zip(results["/GPU:0"], results["/CPU:0"]):
        scale = max(1.0, float(np.nanmax(np.abs(b), initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)
