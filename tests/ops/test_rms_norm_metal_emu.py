"""The RMS norm Metal kernels (custom_ops/metal/rms_norm.metal) on the Metal emulator.

Every instantiation -- rms_norm_float, rms_norm_half, rms_norm_bfloat,
rms_norm_grad_float, rms_norm_grad_half, rms_norm_grad_bfloat,
rms_norm_param_grad_float, rms_norm_param_grad_half,
rms_norm_param_grad_bfloat -- is dispatched the way rms_norm_metal.mm
dispatches it (dispatchThreadgroups, threadgroup sizes from metal_helper's
ReductionThreadgroupSize) and compared with the CPU kernel and with numpy.
The sums run in another order than on the CPU (threads and SIMD-groups vs 16
lanes), so float32 results agree to rounding and half/bfloat16 outputs to one
unit in the last place, not bit for bit.

Emulated 1024-thread threadgroups are slow (each barrier wakes 1024 OS
threads): the size sweep caps threadgroups at 128 threads, and the
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
FORWARD = {"float": "rms_norm_float", "half": "rms_norm_half", "bfloat": "rms_norm_bfloat"}
GRAD = {"float": "rms_norm_grad_float", "half": "rms_norm_grad_half", "bfloat": "rms_norm_grad_bfloat"}
PARAM_GRAD = {"float": "rms_norm_param_grad_float", "half": "rms_norm_param_grad_half",
              "bfloat": "rms_norm_param_grad_bfloat"}
SHAPES = [(1, 1), (3, 31), (2, 32), (5, 33), (4, 1000), (40, 2048)]
PARAMS = np.dtype([("rows", "<u4"), ("channels", "<u4"), ("epsilon", "<f4")])  # tfm_rms_norm_params
EPSILON = 1e-5
SWEEP_CAP = 128  # threadgroup cap for the size sweep (the host's is 1024)


emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "rms_norm.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as rms_norm_metal.mm + norm_metal.h do it.


# The geometry is the host's own C++ (dispatch_geometry.h, through tfmetal_ext.testing).
def row_threads(channels, cap):
    return norm_row_threads(channels, cap)


def param_threads(rows, cap):
    return norm_param_grad_threads(rows, cap)


def metal_forward(lib, dtype, x, gamma, epsilon=EPSILON, threads=None, cap=1024, order="linear"):
    rows, channels = x.shape
    x = np.ascontiguousarray(x)
    y = np.full_like(x, np.nan)
    rstd = np.full(rows, np.nan, np.float32)
    if rows:  # the host dispatches nothing for rows == 0
        lib.run(FORWARD[dtype], [x, gamma, y, rstd, ("bytes", np.array((rows, channels, epsilon), PARAMS))],
                threadgroups=rows, threadgroup=threads or row_threads(channels, cap), order=order, seed=3)
    return y, rstd


def metal_grad(lib, dtype, dy, x, gamma, rstd, threads=None, param_tg=None, cap=1024, order="linear"):
    """dx, dgamma as the host encodes them: param grad (if C > 0), then dx (if rows > 0)."""
    rows, channels = x.shape
    dx = np.full_like(x, np.nan)
    dgamma = np.full(channels, np.nan, np.float32)
    params = ("bytes", np.array((rows, channels, 0.0), PARAMS))
    if channels:
        lib.run(PARAM_GRAD[dtype], [dy, x, rstd, dgamma, params], threadgroups=norm_param_grad_groups(channels),
                threadgroup=param_tg or param_threads(rows, cap), order=order, seed=5)
    if channels and rows:
        lib.run(GRAD[dtype], [dy, x, gamma, rstd, dx, params], threadgroups=rows,
                threadgroup=threads or row_threads(channels, cap), order=order, seed=7)
    return dx, dgamma


# ----------------------------------------------------------------------------
# Inputs and references


def random_case(dtype, rows, channels, seed, offset=0.5):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 2.0, (rows, channels)).astype(np.float32).astype(DTYPES[dtype])
    dy = rng.normal(0, 1, (rows, channels)).astype(np.float32).astype(DTYPES[dtype])
    gamma = rng.normal(1, 0.2, channels).astype(np.float32)
    return x, dy, gamma


def np_forward(x, gamma, epsilon=EPSILON):
    x = x.astype(np.float64)
    ms = (x * x).mean(-1) if x.shape[-1] else np.zeros(x.shape[0])
    rstd = 1.0 / np.sqrt(ms + epsilon)
    return x * rstd[:, None] * gamma, rstd


def np_grad(dy, x, gamma, rstd):
    dy, x = dy.astype(np.float64), x.astype(np.float64)
    rstd = rstd.astype(np.float64)[:, None]
    xhat = x * rstd
    g = dy * gamma
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(0)


def cpu_forward(cpu, x, gamma, epsilon=EPSILON):
    return [t.numpy() for t in cpu.tfmetal_ext_rms_norm(tf.constant(x), gamma, epsilon=epsilon)]


def cpu_grad(cpu, dy, x, gamma, rstd):
    return [t.numpy() for t in cpu.tfmetal_ext_rms_norm_grad(tf.constant(dy), tf.constant(x), gamma, rstd)]


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
    names = list(FORWARD.values()) + list(GRAD.values()) + list(PARAM_GRAD.values())
    assert lib.kernels() == sorted(names)
    counts = {"rms_norm_": 5, "rms_norm_grad_": 6, "rms_norm_param_grad_": 5}
    for name in names:
        params = lib.params(name)
        prefix = next(p for p in sorted(counts, key=len, reverse=True) if name.startswith(p))
        assert len(params) == counts[prefix], name
        assert params[-1].kind == "reference" and params[-1].size == PARAMS.itemsize


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_cpu_kernel_and_numpy(lib, cpu, dtype, shape):
    x, _, gamma = random_case(dtype, *shape, seed=shape[1])
    y, rstd = metal_forward(lib, dtype, x, gamma, cap=SWEEP_CAP)
    cpu_y, cpu_rstd = cpu_forward(cpu, x, gamma)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    assert_close_output(y, cpu_y, dtype, scale=4.0)
    want_y, want_rstd = np_forward(x, gamma)
    np.testing.assert_allclose(rstd, want_rstd, rtol=2e-5)
    assert_close_to_numpy(y, want_y, dtype, scale=4.0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad_matches_cpu_kernel_and_numpy(lib, cpu, dtype, shape):
    x, dy, gamma = random_case(dtype, *shape, seed=shape[0] * 7 + shape[1])
    _, rstd = cpu_forward(cpu, x, gamma)  # the same statistics into both gradients
    dx, dgamma = metal_grad(lib, dtype, dy, x, gamma, rstd, cap=SWEEP_CAP)
    cpu_dx, cpu_dgamma = cpu_grad(cpu, dy, x, gamma, rstd)
    want_dx, want_dgamma = np_grad(dy, x, gamma, rstd)
    rows = shape[0]
    # Sums of `rows` terms of size ~1: rounding noise grows with the row count.
    np.testing.assert_allclose(dgamma, cpu_dgamma, rtol=1e-5, atol=1e-6 * rows)
    np.testing.assert_allclose(dgamma, want_dgamma, rtol=1e-5, atol=2e-6 * rows)
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
    assert row_threads(1000, 1024) == 256 and param_threads(5, 1024) == 256  # what the host would pick
    x, dy, gamma = random_case(dtype, 5, 1000, seed=threads)
    y, rstd = metal_forward(lib, dtype, x, gamma, threads=threads)
    cpu_y, cpu_rstd = cpu_forward(cpu, x, gamma)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    assert_close_output(y, cpu_y, dtype, scale=4.0)
    dx, dgamma = metal_grad(lib, dtype, dy, x, gamma, cpu_rstd, threads=threads, param_tg=threads)
    cpu_dx, cpu_dgamma = cpu_grad(cpu, dy, x, gamma, cpu_rstd)
    np.testing.assert_allclose(dgamma, cpu_dgamma, rtol=1e-5, atol=1e-5)
    scale = float(np.abs(cpu_dx.astype(np.float64)).max())
    tol = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(dx.astype(np.float64), cpu_dx.astype(np.float64), rtol=0, atol=tol * scale)


def test_host_sized_largest_shape_in_one_1024_thread_dispatch(lib, cpu):
    assert row_threads(4096, 1024) == 1024
    x, _, gamma = random_case("float", 16, 4096, seed=99)
    y, rstd = metal_forward(lib, "float", x, gamma)
    cpu_y, cpu_rstd = cpu_forward(cpu, x, gamma)
    np.testing.assert_allclose(rstd, cpu_rstd, rtol=1e-5)
    np.testing.assert_allclose(y, cpu_y, rtol=1e-5, atol=4e-5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_poison_only_their_row(lib, cpu, dtype):
    x, dy, gamma = random_case(dtype, 6, 33, seed=21)
    x[1, 5] = np.nan
    x[2, 0] = np.inf
    x[3, 32] = -np.inf
    y, rstd = metal_forward(lib, dtype, x, gamma, cap=SWEEP_CAP)
    cpu_y, cpu_rstd = cpu_forward(cpu, x, gamma)
    for got, want in ((y, cpu_y), (rstd, cpu_rstd)):
        got, want = got.astype(np.float32), want.astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    # A NaN poisons its row; an infinity makes rstd 0: its row's finite values give 0, it gives NaN.
    yf = y.astype(np.float32)
    assert np.isnan(yf[1]).all() and (rstd[2:4] == 0).all()
    assert np.isnan(yf[2, 0]) and (yf[2, 1:] == 0).all() and np.isnan(yf[3, 32]) and (yf[3, :32] == 0).all()
    clean = [0, 4, 5]
    assert np.isfinite(y[clean].astype(np.float32)).all()
    assert_close_output(y[clean], cpu_y[clean], dtype, scale=4.0)
    dx, dgamma = metal_grad(lib, dtype, dy, x, gamma, cpu_rstd, cap=SWEEP_CAP)
    cpu_dx, cpu_dgamma = cpu_grad(cpu, dy, x, gamma, cpu_rstd)
    for got, want in ((dx, cpu_dx), (dgamma, cpu_dgamma)):
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32)))
    assert np.isfinite(dx[clean].astype(np.float32)).all()


def test_empty_rows_write_the_cpu_kernels_statistics(lib, cpu):
    # C == 0: one threadgroup per row still runs; each writes rstd = 1 / sqrt(epsilon).
    x = np.zeros((3, 0), np.float32)
    empty = np.zeros(0, np.float32)
    y, rstd = metal_forward(lib, "float", x, empty)
    cpu_y, cpu_rstd = cpu_forward(cpu, x, empty)
    assert y.shape == cpu_y.shape == (3, 0)
    np.testing.assert_array_equal(rstd, cpu_rstd)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(EPSILON), rtol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_no_rows_give_zero_parameter_gradients(lib, cpu, dtype):
    # rows == 0: only rms_norm_param_grad runs; it must overwrite dgamma (NaN-filled here) with zeros.
    x = np.zeros((0, 33), DTYPES[dtype])
    gamma = np.ones(33, np.float32)
    none = np.zeros(0, np.float32)
    dx, dgamma = metal_grad(lib, dtype, x.copy(), x, gamma, none)
    cpu_dx, cpu_dgamma = cpu_grad(cpu, x.copy(), x, gamma, none)
    assert dx.shape == cpu_dx.shape == (0, 33)
    np.testing.assert_array_equal(dgamma, cpu_dgamma)
    np.testing.assert_array_equal(dgamma, 0.0)


def test_results_do_not_depend_on_threadgroup_order(lib):
    # Deterministic: no atomics, each threadgroup owns its rows / columns.
    x, dy, gamma = random_case("half", 9, 100, seed=8)
    first = metal_forward(lib, "half", x, gamma, cap=SWEEP_CAP)
    again = metal_forward(lib, "half", x, gamma, cap=SWEEP_CAP, order="shuffle")
    np.testing.assert_array_equal(first[0].view(np.uint16), again[0].view(np.uint16))
    np.testing.assert_array_equal(first[1], again[1])
    grads = metal_grad(lib, "half", dy, x, gamma, first[1], cap=SWEEP_CAP)
    grads_again = metal_grad(lib, "half", dy, x, gamma, first[1], cap=SWEEP_CAP, order="reverse")
    for a, b in zip(grads, grads_again):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("shape", [(5, 33), (64, 4096), (0, 8), (3, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels(cpu, dtype, shape):
    x, dy, gamma = random_case(dtype, *shape, seed=31)
    with tf.device("/GPU:0"):
        y, rstd = cpu.tfmetal_ext_rms_norm(tf.constant(x), gamma, epsilon=EPSILON)
        dx, dgamma = cpu.tfmetal_ext_rms_norm_grad(tf.constant(dy), tf.constant(x), gamma, rstd)
    assert "GPU" in y.device and "GPU" in dx.device
    cpu_y, cpu_rstd = cpu_forward(cpu, x, gamma)
    np.testing.assert_allclose(rstd.numpy(), cpu_rstd, rtol=1e-5)
    assert_close_output(y.numpy(), cpu_y, dtype, scale=4.0)
    cpu_dx, cpu_dgamma = cpu_grad(cpu, dy, x, gamma, rstd.numpy())
    np.testing.assert_allclose(dgamma.numpy(), cpu_dgamma, rtol=1e-5, atol=1e-6 * max(shape[0], 1))
    scale = float(np.abs(cpu_dx.astype(np.float64)).max(initial=0.0)) + 1e-3
    tol = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(dx.numpy().astype(np.float64), cpu_dx.astype(np.float64), rtol=0, atol=tol * scale)
