"""The broadcasting gap kernels (custom_ops/metal/gap_broadcast.metal) on the Metal emulator.

Every instantiation -- gap_div_no_nan_float, gap_div_no_nan_half, gap_div_no_nan_bfloat, gap_broadcast_to_1,
gap_broadcast_to_2, gap_broadcast_to_4 -- is dispatched with the params the host builds (the host's own
GapBroadcastPlan, exported from the emulated library) in chunks as gap_broadcast_metal.mm dispatches them, and
compared bit for bit with TensorFlow's own CPU kernels (DivNoNan computes half and bfloat16 in float and
rounds once, as the kernel does) and with numpy.

Why bit for bit, with no tolerance: rounding float's quotient again to half or bfloat16 is the correctly rounded
quotient: double rounding is innocuous for a quotient of p-bit numbers when the intermediate format has at least
2p + 2 bits (24 >= 2 * 11 + 2 for half, 24 >= 2 * 8 + 2 for bfloat16), and the same holds from float64 to float32
(53 >= 50). So numpy's float64 quotient, rounded to float32 and then to the type, is a bitwise reference for all
three.

TF's CPU kernels run with the CPU's flush-to-zero and denormals-are-zero modes on, so float32 and bfloat16
subnormals count as signed zeros, inputs and quotients alike (a subnormal y gives +0); the kernel flushes them
explicitly and np_div_no_nan models it. The quotient of two floats never falls between the largest subnormal
and the midpoint below 2^-126, so whether a flush looks before or after rounding cannot matter.
"""

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
DIV = {"float": "gap_div_no_nan_float", "half": "gap_div_no_nan_half", "bfloat": "gap_div_no_nan_bfloat"}
COPY = {1: "gap_broadcast_to_1", 2: "gap_broadcast_to_2", 4: "gap_broadcast_to_4"}
MAX_DIMS = 8
PARAMS = np.dtype([("n", "<u4"), ("rank", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"),
                   ("dims", "<u4", MAX_DIMS), ("strides0", "<u4", MAX_DIMS), ("strides1", "<u4", MAX_DIMS)])

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_broadcast.metal")


@pytest.fixture(scope="module")
def plan(lib):
    fn = ctypes.CDLL(str(lib.path)).tfm_gap_broadcast_plan
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int] * 3 + [ctypes.c_void_p]

    def call(out, in0, in1=None):
        arrays = [np.ascontiguousarray(s, np.int64) for s in (out, in0, in1 if in1 is not None else ())]
        params = np.zeros((), PARAMS)
        ok = fn(arrays[0].ctypes.data, len(out), arrays[1].ctypes.data, len(in0),
                arrays[2].ctypes.data if in1 is not None else None, len(in1) if in1 is not None else 0,
                params.ctypes.data)
        return params if ok else None
    return call


def dispatch(lib, name, inputs, out, params, chunk=None):
    """One thread per output element, in chunks: the output bound at the chunk, inputs at their start."""
    n = out.size
    chunk = n if chunk is None else chunk
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        p = params.copy()
        p["n"], p["start_lo"], p["start_hi"] = count, start & 0xFFFFFFFF, start >> 32
        lib.run(name, list(inputs) + [out[start:start + count], ("bytes", p)], grid=count,
                threadgroup=threadgroup_size_1d(count))


def metal_div_no_nan(lib, plan, dtype, x, y, chunk=None):
    shape = np.broadcast_shapes(x.shape, y.shape)
    params = plan(shape, x.shape, y.shape)
    z = np.full(int(np.prod(shape)), np.nan, np.float32).astype(x.dtype)
    if z.size:
        dispatch(lib, DIV[dtype], [x.ravel(), y.ravel()], z, params, chunk)
    return z.reshape(shape)


def metal_broadcast_to(lib, plan, x, shape, chunk=None):
    params = plan(shape, x.shape)
    out = np.zeros(int(np.prod(shape)), x.dtype)
    if out.size:
        view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
        dispatch(lib, COPY[x.dtype.itemsize], [x.ravel().view(view)], out.view(view), params, chunk)
    return out.reshape(shape)


# NaN, +-inf, +-0, the largest half, a half subnormal, float (and bfloat16) subnormals, tiny normals.
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, 1e-40, -3e-39, 2e-38, 1e-30]


def values(shape, dtype, seed, zeros=0.2):
    """Random values with zeros and the SPECIALS."""
    rng = np.random.default_rng(seed)
    v = np.asarray(rng.standard_normal(shape) * 3, np.float32)
    v[rng.random(shape) < zeros] = 0.0
    flat = v.reshape(-1)
    k = min(flat.size, len(SPECIALS))
    flat[rng.choice(flat.size, k, replace=False)] = SPECIALS[:k]
    return v.astype(DTYPES[dtype][0])


def view_type(a):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype == bool:
        return np.array_equal(a, b)
    view = view_type(a)
    nan = np.isnan(b.astype(np.float32))
    return np.array_equal(np.isnan(a.astype(np.float32)), nan) and np.array_equal(a[~nan].view(view), b[~nan].view(view))


def np_flush_denormal(v):
    """float32 v with subnormals replaced by zeros of their sign (TF's CPU runs with FTZ/DAZ on)."""
    return np.where(np.abs(v) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), v), v)


def np_div_no_nan(x, y):
    """TF's DivNoNan: in float32 with subnormal inputs as signed zeros, +0 where y == 0 (either sign, whatever x),
    else x / y with a subnormal quotient as a signed zero, rounded once to x's dtype (the float64 quotient rounded
    to float32, then to x's dtype: both roundings innocuous, see the module docstring)."""
    x32, y32 = np_flush_denormal(x.astype(np.float32)), np_flush_denormal(y.astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        q = (x32.astype(np.float64) / y32.astype(np.float64)).astype(np.float32)
        return np.where(y32 == 0, np.float32(0), np_flush_denormal(q)).astype(x.dtype)


def tf_div_no_nan(x, y):
    with tf.device("/CPU:0"):
        return tf.math.divide_no_nan(tf.constant(x), tf.constant(y)).numpy()


SHAPES = [((), ()), ((7,), ()), ((), (5,)), ((33,), (33,)), ((4, 1, 6), (5, 1)), ((2, 3, 1, 5), (3, 4, 1)),
          ((1,) * 9, (2,) + (1,) * 8), ((0, 3), (3,)), ((2, 1, 3, 1, 2, 1, 2), (1, 4, 1, 3, 1, 2, 1))]


def test_library_instantiates_every_kernel(lib):
    assert lib.kernels() == sorted(list(DIV.values()) + list(COPY.values()))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_is_tfs_bit_for_bit(lib, plan, dtype, shapes):
    x, y = values(shapes[0], dtype, 1), values(shapes[1], dtype, 2, zeros=0.3)
    got = metal_div_no_nan(lib, plan, dtype, x, y)
    try:
        assert same_bits(got, tf_div_no_nan(x, y))
    except tf.errors.UnimplementedError:
        # TF's CPU kernel refuses broadcasts that stay above 5 dimensions after collapsing (the 7-dimension
        # alternating case); the kernel takes up to 8. Checked against numpy alone below.
        assert len(shapes[0]) == 7
    assert same_bits(got, np_div_no_nan(x, y))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_special_values_are_tfs(lib, plan, dtype):
    # Every pair of specials: x NaN/inf with y == +-0 gives +0 (TF's CPU kernel masks the quotient to all-zero
    # bits), a NaN y gives NaN, inf / inf NaN, a finite x / inf a signed 0, subnormals zeros.
    np_t = DTYPES[dtype][0]
    x = np.array(SPECIALS, np.float32).astype(np_t)[:, None]
    y = np.array(SPECIALS + [-3.0, 2.0 ** -20], np.float32).astype(np_t)[None, :]
    got = metal_div_no_nan(lib, plan, dtype, x, y)
    assert same_bits(got, tf_div_no_nan(x, y)) and same_bits(got, np_div_no_nan(x, y))
    zero_y = np.broadcast_to(np_flush_denormal(y.astype(np.float32)) == 0, got.shape)
    assert not got[zero_y].view(view_type(got)).any()  # +0 bits, for y == -0, subnormal y, NaN x too
    assert np.isnan(got[:, 0].astype(np.float32)).all()  # y NaN (SPECIALS[0])


@pytest.mark.full
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_on_random_bit_patterns_is_tfs(lib, plan, dtype):
    # Every exponent, subnormals, NaN payloads: the rounding argument of the module docstring, tried.
    np_t = DTYPES[dtype][0]
    rng = np.random.default_rng(7)
    view = view_type(np.zeros(1, np_t))
    x, y = (rng.integers(0, 2 ** (8 * view().itemsize), 6000, dtype=np.uint64).astype(view).view(np_t)
            for _ in range(2))
    got = metal_div_no_nan(lib, plan, dtype, x, y)
    assert same_bits(got, tf_div_no_nan(x, y)) and same_bits(got, np_div_no_nan(x, y))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.bool_])
@pytest.mark.parametrize("case", [((3, 1, 5), (2, 3, 4, 5)), ((), (4, 3)), ((1,), (0, 7)), ((6,), (6,)),
                                  ((2, 1), (2, 1))], ids=str)
def test_broadcast_to_is_tfs_bit_for_bit(lib, plan, dtype, case):
    in_shape, shape = case
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(in_shape) > 0) if dtype == np.bool_ else rng.standard_normal(in_shape).astype(dtype)
    got = metal_broadcast_to(lib, plan, np.asarray(x), shape)
    with tf.device("/CPU:0"):
        want = tf.broadcast_to(tf.constant(x), shape).numpy()
    assert same_bits(got, want) and same_bits(got, np.broadcast_to(x, shape))


def test_chunks_continue_the_global_index(lib, plan):
    x, y = values((37, 1, 29), "half", 5), values((13, 1), "half", 6)
    whole = metal_div_no_nan(lib, plan, "half", x, y)
    assert same_bits(metal_div_no_nan(lib, plan, "half", x, y, chunk=1000), whole)
    b = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    assert same_bits(metal_broadcast_to(lib, plan, b, (5, 3, 7, 4), chunk=97), np.broadcast_to(b, (5, 3, 7, 4)))


def test_the_plan_collapses_dimensions_and_refuses_too_many(plan):
    p = plan((4, 5, 6), (4, 5, 6), (4, 5, 6))
    assert p["rank"] == 1 and p["dims"][0] == 120 and p["strides0"][0] == p["strides1"][0] == 1
    p = plan((4, 5, 6), (4, 5, 6), (1, 5, 6))  # the second input repeats a 30-element block
    assert p["rank"] == 2 and list(p["dims"][:2]) == [4, 30] and list(p["strides1"][:2]) == [0, 1]
    p = plan((1, 1, 7), (7,))
    assert p["rank"] == 1 and p["dims"][0] == 7
    alternating = (2,) * 10  # broadcast pattern alternating over 10 dimensions: nothing merges
    assert plan(alternating, (2, 1) * 5, (1, 2) * 5) is None
