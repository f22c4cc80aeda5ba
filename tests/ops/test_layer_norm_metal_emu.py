"""The layer norm Metal kernels (custom_ops/metal/layer_norm.metal) on the Metal emulator.

Every instantiation -- layer_norm_float, layer_norm_half, layer_norm_bfloat,
layer_norm_grad_float, layer_norm_grad_half, layer_norm_grad_bfloat,
layer_norm_param_grad_float, layer_norm_param_grad_half,
layer_norm_param_grad_bfloat -- is dispatched the way layer_norm_metal.mm
dispatches it (dispatchThreadgroups, threadgroup sizes from metal_helper's
ReductionThreadgroupSize) and compared with the CPU kernel and with numpy.
The sums run in another order than on the CPU (threads and SIMD-groups vs 16
lanes), so float32 results agree to rounding, and half/bfloat16 outputs to
one unit in the last place, not bit for bit.

Emulated threadgroups of 1024 threads are slow (each barrier wakes 1024 OS
threads), so the size sweep caps threadgroups at 128 threads and the
threadgroup-size test runs 32, 256 and 1024 on one mid-size shape.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import (compiled_ops, load_emu, norm_param_grad_groups, norm_param_grad_threads,
                                 norm_row_threads)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
FORWARD = {"float": "layer_norm_float", "half": "layer_norm_half", "bfloat": "layer_norm_bfloat"}
GRAD = {"float": "layer_norm_grad_float", "half": "layer_norm_grad_half", "bfloat": "layer_norm_grad_bfloat"}
PARAM_GRAD = {"float": "layer_norm_param_grad_float", "half": "layer_norm_param_grad_half",
              "bfloat": "layer_norm_param_grad_bfloat"}
SHAPES = [(1, 1), (3, 31), (2, 32), (5, 33), (4, 1000), (64, 4096)]
PARAMS = np.dtype([("rows", "<u4"), ("channels", "<u4"), ("epsilon", "<f4")])  # tfm_layer_norm_params
EPSILON = 1e-3
SWEEP_CAP = 128  # threadgroup cap for the size sweep (the host's is 1024)


emu = load_emu()


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "layer_norm.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as layer_norm_metal.mm + norm_metal.h do it.


# The geometry is the host's own C++ (dispatch_geometry.h, through tfmetal_ext.testing).
def row_threads(channels, cap):
    return norm_row_threads(channels, cap)


def param_threads(rows, cap):
    return norm_param_grad_threads(rows, cap)


def metal_forward(lib, dtype, x, gamma, beta, epsilon=EPSILON, threads=None, cap=1024, order="linear"):
    rows, channels = x.shape
    x = np.ascontiguousarray(x)
    y = np.full_like(x, np.nan)
    mean = np.full(rows, np.nan, np.float32)
    rstd = np.full(rows, np.nan, np.float32)
    if rows:  # the host dispatches nothing for rows == 0
        lib.run(FORWARD[dtype], [x, gamma, beta, y, mean, rstd, ("bytes", np.array((rows, channels, epsilon), PARAMS))],
                threadgroups=rows, threadgroup=threads or row_threads(channels, cap), order=order, seed=3)
    return y, mean, rstd


def metal_grad(lib, dtype, dy, x, gamma, mean, rstd, threads=None, param_tg=None, cap=1024, order="linear"):
    """dx, dgamma, dbeta as the host encodes them: param grad (if C > 0), then dx (if rows > 0)."""
    rows, channels = x.shape
    dx = np.full_like(x, np.nan)
    dgamma = np.full(channels, np.nan, np.float32)
    dbeta = np.full(channels, np.nan, np.float32)
    params = ("bytes", np.array((rows, channels, 0.0), PARAMS))
    if channels:
        lib.run(PARAM_GRAD[dtype], [dy, x, mean, rstd, dgamma, dbeta, params],
                threadgroups=norm_param_grad_groups(channels), threadgroup=param_tg or param_threads(rows, cap),
                order=order, seed=5)
    if channels and rows:
        lib.run(GRAD[dtype], [dy, x, gamma, mean, rstd, dx, params], threadgroups=rows,
                threadgroup=threads or row_threads(channels, cap), order=order, seed=7)
    return dx, dgamma, dbeta


# ----------------------------------------------------------------------------
# Inputs and references


def random_case(dtype, rows, channels, seed, offset=3.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 2.0, (rows, channels)).astype(np.float32).astype(DTYPES[dtype])
    dy = rng.normal(0, 1, (rows, channels)).astype(np.float32).astype(DTYPES[dtype])
    gamma = rng.normal(1, 0.2, channels).astype(np.float32)
    beta = rng.normal(0, 0.2, channels).astype(np.float32)
    return x, dy, gamma, beta


def np_forward(x, gamma, beta, epsilon=EPSILON):
    x = x.astype(np.float64)
    mean = x.mean(-1) if x.shape[-1] else np.zeros(x.shape[0])
    var = x.var(-1) if x.shape[-1] else np.zeros(x.shape[0])
    rstd = 1.0 / np.sqrt(var + epsilon)
    return (x - mean[:, None]) * rstd[:, None] * gamma + beta, mean, rstd


def np_grad(dy, x, gamma, mean, rstd):
    dy, x = dy.astype(np.float64), x.astype(np.float64)
    mean, rstd = mean.astype(np.float64)[:, None], rstd.astype(np.float64)[:, None]
    xhat = (x - mean) * rstd
    g = dy * gamma
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0), dy.sum(0)


def cpu_forward(cpu, x, gamma, beta, epsilon=EPSILON):
    return [t.numpy() for t in cpu.tfmetal_ext_layer_norm(tf.constant(x), gamma, beta, epsilon=epsilon)]


def cpu_grad(cpu, dy, x, gamma, mean, rstd):
    return [t.numpy() for t in cpu.tfmetal_ext_layer_norm_grad(tf.constant(dy), tf.constant(x), gamma, mean, rstd)]


def ulp_distance(a, b):
    """Distance in representable 16-bit values (half or bfloat16), +0 == -0."""
    def ordered(v):
        u = np.asarray(v).view(np.uint16).astype(np.int32)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)

    return np.abs(ordered(a) - ordered(b))


def assert_close_output(got, want, dtype, scale=1.0):
    """float32 to rounding noise; half / bfloat16 within one unit in the last place, or
    (near zero, where units are tiny) within float32 rounding noise of `scale`."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == "float":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        far = (ulp_distance(got, want) > 1) & (np.abs(got.astype(np.float64) - want.astype(np.float64)) > 1e-5 * scale)
        assert not far.any(), f"{int(far.sum())} elements more than 1 ulp apart: {got[far][:5]} != {want[far][:5]}"


def assert_close_to_numpy(got, want, dtype, scale=1.0):
    tol = {"float": 2e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale)


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(list(FORWARD.values()) + list(GRAD.values()) + list(PARAM_GRAD.values()))
    for name in list(FORWARD.values()) + list(GRAD.values()) + list(PARAM_GRAD.values()):
        params = lib.params(name)
        assert len(params) == 7 and params[6].kind == "reference" and params[6].size == PARAMS.itemsize


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_cpu_kernel_and_numpy(lib, cpu, dtype, shape):
    x, _, gamma, beta = random_case(dtype, *shape, seed=shape[1])
    y, mean, rstd = metal_forward(lib, dtype, x, gamma, beta, cap=SWEEP_CAP)
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, gamma, beta)
    np.testing.assert_allclose(mean, cpu_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    assert_close_output(y, cpu_y, dtype, scale=4.0)
    want_y, want_mean, want_rstd = np_forward(x, gamma, beta)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, want_rstd, rtol=2e-5)
    assert_close_to_numpy(y, want_y, dtype, scale=4.0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad_matches_cpu_kernel_and_numpy(lib, cpu, dtype, shape):
    x, dy, gamma, beta = random_case(dtype, *shape, seed=shape[0] * 7 + shape[1])
    _, mean, rstd = cpu_forward(cpu, x, gamma, beta)  # the same statistics into both gradients
    dx, dgamma, dbeta = metal_grad(lib, dtype, dy, x, gamma, mean, rstd, cap=SWEEP_CAP)
    cpu_dx, cpu_dgamma, cpu_dbeta = cpu_grad(cpu, dy, x, gamma, mean, rstd)
    want_dx, want_dgamma, want_dbeta = np_grad(dy, x, gamma, mean, rstd)
    rows = shape[0]
    # Sums of `rows` terms of size ~1: rounding noise grows with the row count.
    np.testing.assert_allclose(dgamma, cpu_dgamma, rtol=1e-5, atol=1e-6 * rows)
    np.testing.assert_allclose(dbeta, cpu_dbeta, rtol=1e-5, atol=1e-6 * rows)
    np.testing.assert_allclose(dgamma, want_dgamma, rtol=1e-5, atol=2e-6 * rows)
    np.testing.assert_allclose(dbeta, want_dbeta, rtol=1e-5, atol=2e-6 * rows)
    # dx = rstd * (g - mean(g) - xhat * mean(g xhat)) cancels: compare on the scale of its terms.
    scale = float(np.abs(want_dx).max(initial=0.0)) + 1e-3
    if dtype == "float":
        np.testing.assert_allclose(dx, cpu_dx, rtol=1e-5, atol=1e-5 * scale)
    else:  # float results a rounding apart may round to neighbouring values
        np.testing.assert_allclose(dx.astype(np.float64), cpu_dx.astype(np.float64), rtol=0,
                                   atol={"half": 2e-3, "bfloat": 1.6e-2}[dtype] * scale)
    assert_close_to_numpy(dx, want_dx, dtype, scale=scale)


# Host picks for (5, 1000): 256 threads per row, 256-thread param grad (5 row lanes rounded up to 8).
@pytest.mark.parametrize("dtype,threads", [("float", 32), ("float", 256), ("float", 1024), ("half", 32),
                                           ("half", 256), ("bfloat", 32), ("bfloat", 256)])
def test_threadgroup_sizes_the_host_can_pick(lib, cpu, dtype, threads):
    # The host sizes threadgroups from the pipeline's maxTotalThreadsPerThreadgroup
    # (32 .. 1024): every size gives the CPU kernel's results. (5, 1000): a row
    # is not a multiple of any threadgroup size; 32 columns blocks, last one partial.
    assert row_threads(1000, 1024) == 256 and param_threads(5, 1024) == 256  # what the host would pick
    x, dy, gamma, beta = random_case(dtype, 5, 1000, seed=threads)
    y, mean, rstd = metal_forward(lib, dtype, x, gamma, beta, threads=threads)
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, gamma, beta)
    np.testing.assert_allclose(mean, cpu_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    assert_close_output(y, cpu_y, dtype, scale=4.0)
    dx, dgamma, dbeta = metal_grad(lib, dtype, dy, x, gamma, cpu_mean, cpu_rstd, threads=threads, param_tg=threads)
    cpu_dx, cpu_dgamma, cpu_dbeta = cpu_grad(cpu, dy, x, gamma, cpu_mean, cpu_rstd)
    np.testing.assert_allclose(dgamma, cpu_dgamma, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dbeta, cpu_dbeta, rtol=1e-5, atol=1e-5)
    scale = float(np.abs(cpu_dx.astype(np.float64)).max())
    tol = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(dx.astype(np.float64), cpu_dx.astype(np.float64), rtol=0, atol=tol * scale)


@pytest.mark.full  # the largest emulated dispatch (~8 s); the quick tier keeps the host-sized shapes below it
def test_host_sized_largest_shape_in_one_1024_thread_dispatch(lib, cpu):
    # What the host really dispatches for (64, 4096): 1024 threads per row.
    assert row_threads(4096, 1024) == 1024
    x, _, gamma, beta = random_case("float", 64, 4096, seed=99)
    y, mean, rstd = metal_forward(lib, "float", x, gamma, beta)
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, gamma, beta)
    np.testing.assert_allclose(mean, cpu_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    np.testing.assert_allclose(y, cpu_y, rtol=1e-5, atol=4e-5)


def test_large_mean_against_small_spread(lib, cpu):
    # Two passes (shifted sum, then squared deviations): the variance stays
    # accurate where E[x^2] - mean^2 would cancel to garbage.
    rng = np.random.default_rng(4)
    x = (1000.0 + rng.normal(0, 0.01, (4, 1000))).astype(np.float32)
    gamma, beta = np.ones(1000, np.float32), np.zeros(1000, np.float32)
    y, mean, rstd = metal_forward(lib, "float", x, gamma, beta, epsilon=1e-8, cap=SWEEP_CAP)
    want_y, want_mean, want_rstd = np_forward(x, gamma, beta, epsilon=1e-8)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-4)  # one pass: no correct digit
    np.testing.assert_allclose(rstd, cpu_forward(cpu, x, gamma, beta, epsilon=1e-8)[2], rtol=1e-4)
    # y is off by at most the float32 rounding of the mean (ulp(1000) / 2 = 3e-5) times rstd (100).
    np.testing.assert_allclose(y, want_y, rtol=0, atol=0.005)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_poison_only_their_row(lib, cpu, dtype):
    x, dy, gamma, beta = random_case(dtype, 6, 33, seed=21)
    x[1, 5] = np.nan
    x[2, 0] = np.inf  # the row's first value: the shift itself
    x[3, 32] = -np.inf
    y, mean, rstd = metal_forward(lib, dtype, x, gamma, beta, cap=SWEEP_CAP)
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, gamma, beta)
    for got, want in ((y, cpu_y), (mean, cpu_mean), (rstd, cpu_rstd)):
        got, want = got.astype(np.float32), want.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    assert np.isnan(y[1:4].astype(np.float32)).all()
    clean = [0, 4, 5]
    assert np.isfinite(y[clean].astype(np.float32)).all()
    assert_close_output(y[clean], cpu_y[clean], dtype, scale=4.0)
    dx, dgamma, dbeta = metal_grad(lib, dtype, dy, x, gamma, cpu_mean, cpu_rstd, cap=SWEEP_CAP)
    cpu_dx, cpu_dgamma, cpu_dbeta = cpu_grad(cpu, dy, x, gamma, cpu_mean, cpu_rstd)
    for got, want in ((dx, cpu_dx), (dgamma, cpu_dgamma), (dbeta, cpu_dbeta)):
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32)))
    assert np.isfinite(dx[clean].astype(np.float32)).all() and np.isfinite(dbeta).all()


def test_empty_rows_write_the_cpu_kernels_statistics(lib, cpu):
    # C == 0: the host still dispatches one threadgroup per row; each writes
    # mean 0 and rstd = 1 / sqrt(epsilon), as the CPU kernel does.
    x = np.zeros((3, 0), np.float32)
    empty = np.zeros(0, np.float32)
    y, mean, rstd = metal_forward(lib, "float", x, empty, empty)
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, empty, empty)
    assert y.shape == cpu_y.shape == (3, 0)
    np.testing.assert_array_equal(mean, cpu_mean)
    np.testing.assert_array_equal(rstd, cpu_rstd)
    np.testing.assert_array_equal(mean, 0.0)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(EPSILON), rtol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_no_rows_give_zero_parameter_gradients(lib, cpu, dtype):
    # rows == 0: the host dispatches only layer_norm_param_grad, which must
    # overwrite dgamma and dbeta (NaN-filled here) with zeros.
    x = np.zeros((0, 33), DTYPES[dtype])
    gamma = np.ones(33, np.float32)
    none = np.zeros(0, np.float32)
    dx, dgamma, dbeta = metal_grad(lib, dtype, x.copy(), x, gamma, none, none)
    cpu_dx, cpu_dgamma, cpu_dbeta = cpu_grad(cpu, x.copy(), x, gamma, none, none)
    assert dx.shape == cpu_dx.shape == (0, 33)
    np.testing.assert_array_equal(dgamma, cpu_dgamma)
    np.testing.assert_array_equal(dbeta, cpu_dbeta)
    np.testing.assert_array_equal(dgamma, 0.0)


def test_results_do_not_depend_on_threadgroup_order(lib):
    # Deterministic: no atomics, each threadgroup owns its rows / columns.
    x, dy, gamma, beta = random_case("half", 9, 100, seed=8)
    first = metal_forward(lib, "half", x, gamma, beta, cap=SWEEP_CAP)
    again = metal_forward(lib, "half", x, gamma, beta, cap=SWEEP_CAP, order="shuffle")
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
                                      b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32))
    mean, rstd = first[1], first[2]
    grads = metal_grad(lib, "half", dy, x, gamma, mean, rstd, cap=SWEEP_CAP)
    grads_again = metal_grad(lib, "half", dy, x, gamma, mean, rstd, cap=SWEEP_CAP, order="reverse")
    for a, b in zip(grads, grads_again):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("shape", [(5, 33), (64, 4096), (0, 8), (3, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels(cpu, dtype, shape):
    x, dy, gamma, beta = random_case(dtype, *shape, seed=31)
    with tf.device("/GPU:0"):
        y, mean, rstd = cpu.tfmetal_ext_layer_norm(tf.constant(x), gamma, beta, epsilon=EPSILON)
        dx, dgamma, dbeta = cpu.tfmetal_ext_layer_norm_grad(tf.constant(dy), tf.constant(x), gamma, mean, rstd)
    assert "GPU" in y.device and "GPU" in dx.device
    cpu_y, cpu_mean, cpu_rstd = cpu_forward(cpu, x, gamma, beta)
    np.testing.assert_allclose(mean.numpy(), cpu_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd.numpy(), cpu_rstd, rtol=1e-5)
    assert_close_output(y.numpy(), cpu_y, dtype, scale=4.0)
    cpu_dx, cpu_dgamma, cpu_dbeta = cpu_grad(cpu, dy, x, gamma, mean.numpy(), rstd.numpy())
    np.testing.assert_allclose(dgamma.numpy(), cpu_dgamma, rtol=1e-5, atol=1e-6 * max(shape[0], 1))
    np.testing.assert_allclose(dbeta.numpy(), cpu_dbeta, rtol=1e-5, atol=1e-6 * max(shape[0], 1))
    scale = float(np.abs(cpu_dx.astype(np.float64)).max(initial=0.0)) + 1e-3
    tol = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(dx.numpy().astype(np.float64), cpu_dx.astype(np.float64), rtol=0, atol=tol * scale)
