"""The softshrink Metal kernels (custom_ops/metal/softshrink.metal) on the Metal emulator.

Every instantiation -- softshrink_float, softshrink_half, softshrink_bfloat,
softshrink_grad_float, softshrink_grad_half, softshrink_grad_bfloat -- is
dispatched the way softshrink_metal.mm dispatches it (dispatchThreads, the
helper's threadgroup size, chunks bound at buffer offsets) and compared with
the CPU kernel bit for bit (same float math from tfmetal/softshrink.h, one
round-to-nearest-even store per element) and with numpy.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.testing import assert_same_bits, compiled_ops, dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16), "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
FORWARD = {"float": "softshrink_float", "half": "softshrink_half", "bfloat": "softshrink_bfloat"}
GRAD = {"float": "softshrink_grad_float", "half": "softshrink_grad_half", "bfloat": "softshrink_grad_bfloat"}
SIZES = [1, 31, 32, 33, 1000, 100003]
TOLERANCE = {"float": 1e-6, "half": 1e-3, "bfloat": 8e-3}  # against float64 numpy
PARAMS = np.dtype([("n", "<u4"), ("lambd", "<f4")])  # tfm_softshrink_params


emu = load_emu()


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "softshrink.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as softshrink_metal.mm + metal_helper.mm do it.


def dispatch(lib, name, buffers, lambd, chunk=None, uniform=False):
    """Encodes `name` over the 1-D buffers (outputs last) in chunks bound at element offsets."""
    n = buffers[0].size
    for start, count in dispatch_chunks(n, chunk):
        views = [b[start:start + count] for b in buffers]
        params = np.array((count, lambd), PARAMS)
        tg = threadgroup_size_1d(count)
        if uniform:  # dispatchThreadgroups: full threadgroups, threads past the end exist
            lib.run(name, views + [("bytes", params)], threadgroups=-(-count // tg), threadgroup=tg)
        else:
            lib.run(name, views + [("bytes", params)], grid=count, threadgroup=tg)


def metal_forward(lib, dtype, x, lambd, **kw):
    x = np.ascontiguousarray(x).ravel()
    y = np.full_like(x, np.nan)
    dispatch(lib, FORWARD[dtype], [x, y], lambd, **kw)
    return y


def metal_grad(lib, dtype, dy, x, lambd, **kw):
    dy, x = np.ascontiguousarray(dy).ravel(), np.ascontiguousarray(x).ravel()
    dx = np.full_like(x, np.nan)
    dispatch(lib, GRAD[dtype], [dy, x, dx], lambd, **kw)
    return dx


# ----------------------------------------------------------------------------
# References


np_softshrink = testing.np_softshrink
np_softshrink_grad = testing.np_softshrink_grad


def random_input(dtype, n, seed, lambd=0.5):
    """Normal values plus the kinks (+-lambd), +-0 and values just around the kinks."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1.5, n).astype(np.float32)
    special = np.array([lambd, -lambd, 0.0, -0.0, np.nextafter(lambd, 1), np.nextafter(-lambd, -1)], np.float32)
    k = min(n, special.size)
    x[rng.choice(n, k, replace=False)] = special[:k]
    return x.astype(DTYPES[dtype][0])




def cpu_forward(cpu, dtype, x, lambd):
    return cpu.tfmetal_ext_softshrink(tf.constant(x), lambd=lambd).numpy()


def cpu_grad(cpu, dtype, dy, x, lambd):
    return cpu.tfmetal_ext_softshrink_grad(tf.constant(dy), tf.constant(x), lambd=lambd).numpy()


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(list(FORWARD.values()) + list(GRAD.values()))
    for name in FORWARD.values():
        assert [p.kind for p in lib.params(name)] == ["pointer", "pointer", "reference"]
        assert lib.params(name)[2].size == PARAMS.itemsize
    for name in GRAD.values():
        assert [p.const for p in lib.params(name)] == [True, True, False, False]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_cpu_kernel_bit_for_bit_and_numpy(lib, cpu, dtype, n):
    x = random_input(dtype, n, seed=n)
    got = metal_forward(lib, dtype, x, 0.5)
    assert_same_bits(got, cpu_forward(cpu, dtype, x, 0.5))
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got.astype(np.float64), np_softshrink(x, 0.5), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grad_matches_cpu_kernel_bit_for_bit_and_numpy(lib, cpu, dtype, n):
    x = random_input(dtype, n, seed=n + 1)
    dy = np.random.default_rng(n).normal(0, 1, n).astype(DTYPES[dtype][0])
    got = metal_grad(lib, dtype, dy, x, 0.5)
    assert_same_bits(got, cpu_grad(cpu, dtype, dy, x, 0.5))
    np.testing.assert_array_equal(got.astype(np.float64), np_softshrink_grad(dy, x, 0.5))  # dy or 0: exact


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_propagate_like_the_cpu_kernel(lib, cpu, dtype):
    np_dtype = DTYPES[dtype][0]
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.5, -0.5, 0.0, -0.0, 1e4, -1e4, 0.25], np.float32).astype(np_dtype)
    dy = np.array([1, 2, 3, 4, 5, 6, 7, 8, np.nan, np.inf, -np.inf], np.float32).astype(np_dtype)
    y = metal_forward(lib, dtype, x, 0.5)
    assert_same_bits(y, cpu_forward(cpu, dtype, x, 0.5))
    yf = y.astype(np.float32)
    assert np.isnan(yf[:2]).all() and yf[2] == np.inf and yf[3] == -np.inf
    np.testing.assert_array_equal(yf[4:8], 0.0)  # the kinks and zeros map to 0
    dx = metal_grad(lib, dtype, dy, x, 0.5)
    assert_same_bits(dx, cpu_grad(cpu, dtype, dy, x, 0.5))
    dxf = dx.astype(np.float32)
    assert np.isnan(dxf[:2]).all()  # NaN x: NaN gradient
    np.testing.assert_array_equal(dxf[2:4], [3, 4])
    np.testing.assert_array_equal(dxf[4:8], 0.0)  # 0 at the kinks
    assert np.isnan(dxf[8]) and dxf[9] == np.inf and dxf[10] == 0.0  # dy's NaN/Inf pass where |x| > lambd


@pytest.mark.parametrize("lambd", [0.0, 3.0])
def test_other_thresholds(lib, cpu, lambd):
    x = random_input("float", 1000, seed=7, lambd=lambd)
    assert_same_bits(metal_forward(lib, "float", x, lambd), cpu_forward(cpu, "float", x, lambd))
    dy = np.ones_like(x)
    assert_same_bits(metal_grad(lib, "float", dy, x, lambd), cpu_grad(cpu, "float", dy, x, lambd))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_output_may_alias_the_input(lib, dtype):
    # The host forwards x's buffer to y (dy's to dx) when TF allows it.
    x = random_input(dtype, 1000, seed=3)
    dy = np.random.default_rng(3).normal(0, 1, 1000).astype(DTYPES[dtype][0])
    want_y, want_dx = metal_forward(lib, dtype, x, 0.5), metal_grad(lib, dtype, dy, x, 0.5)
    inplace = x.copy()
    dispatch(lib, FORWARD[dtype], [inplace, inplace], 0.5)
    assert_same_bits(inplace, want_y)
    inplace = dy.copy()
    dispatch(lib, GRAD[dtype], [inplace, x, inplace], 0.5)
    assert_same_bits(inplace, want_dx)


@pytest.mark.full  # 2^30-element chunking emulated (~6 s); multi_tensor_adam's emulator file keeps the same check in the quick tier
def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # The host splits tensors of more than 2^30 elements into dispatches bound
    # at buffer offsets; the kernel indexes from its buffer's start. Same
    # result with 1000-element chunks (last one partial) as in one dispatch.
    x = random_input("half", 100003, seed=11)
    dy = np.random.default_rng(11).normal(0, 1, x.size).astype(np.float16)
    assert_same_bits(metal_forward(lib, "half", x, 0.5, chunk=1000), metal_forward(lib, "half", x, 0.5))
    assert_same_bits(metal_grad(lib, "half", dy, x, 0.5, chunk=1000), metal_grad(lib, "half", dy, x, 0.5))


@pytest.mark.parametrize("name", [FORWARD["bfloat"], GRAD["bfloat"]])
def test_threads_past_the_end_write_nothing(lib, name):
    # With dispatchThreadgroups every threadgroup is full: the 31 threads past
    # n = 33 must not touch the sentinel elements after the tensor's end.
    n, extra = 33, 31
    x = np.concatenate([random_input("bfloat", n, seed=5), np.full(extra, 7, ml_dtypes.bfloat16)])
    out = np.full(n + extra, 9, ml_dtypes.bfloat16)
    args = [x, out] if name == FORWARD["bfloat"] else [x.copy(), x, out]
    lib.run(name, args + [("bytes", np.array((n, 0.5), PARAMS))], threadgroups=2, threadgroup=32)
    np.testing.assert_array_equal(out[n:].astype(np.float32), 9.0)
    assert not np.isnan(out[:n].astype(np.float32)).any()


@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_threadgroup_order_does_not_matter(lib, order):
    x = random_input("float", 5000, seed=13)
    want = metal_forward(lib, "float", x, 0.5)
    y = np.full_like(x, np.nan)
    lib.run(FORWARD["float"], [x, y, ("bytes", np.array((x.size, 0.5), PARAMS))], grid=x.size,
            threadgroup=threadgroup_size_1d(x.size), order=order, seed=1)
    assert_same_bits(y, want)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(cpu, dtype):
    x = random_input(dtype, 100003, seed=17)
    dy = np.random.default_rng(17).normal(0, 1, x.size).astype(DTYPES[dtype][0])
    with tf.device("/GPU:0"):
        y = cpu.tfmetal_ext_softshrink(tf.constant(x), lambd=0.5)
        dx = cpu.tfmetal_ext_softshrink_grad(tf.constant(dy), tf.constant(x), lambd=0.5)
    assert "GPU" in y.device and "GPU" in dx.device
    assert_same_bits(y.numpy(), cpu_forward(cpu, dtype, x, 0.5))
    assert_same_bits(dx.numpy(), cpu_grad(cpu, dtype, dy, x, 0.5))
