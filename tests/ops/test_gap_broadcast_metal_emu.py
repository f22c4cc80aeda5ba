"""The broadcasting gap kernels (custom_ops/metal/gap_broadcast.metal) on the Metal emulator.

Every instantiation -- gap_div_no_nan_float, gap_div_no_nan_half, gap_div_no_nan_bfloat, gap_broadcast_to_1,
gap_broadcast_to_2, gap_broadcast_to_4 -- is dispatched with the params the host builds (the host's own
GapBroadcastPlan, exported from the emulated library) in chunks as gap_broadcast_metal.mm dispatches them, and
compared bit for bit with TensorFlow's own CPU kernels (DivNoNan computes half and bfloat16 in float and
rounds once, as the kernel does) and with numpy.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tests.ops._gap_plan import BCAST, plan_function
from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
DIV = {"float": "gap_div_no_nan_float", "half": "gap_div_no_nan_half", "bfloat": "gap_div_no_nan_bfloat"}
COPY = {1: "gap_broadcast_to_1", 2: "gap_broadcast_to_2", 4: "gap_broadcast_to_4"}
PARAMS = BCAST  # tfm_gap_bcast_params

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_broadcast.metal")


@pytest.fixture(scope="module")
def plan(lib):
    return plan_function(lib, "tfm_gap_broadcast_plan", PARAMS)


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


def values(shape, dtype, seed, zeros=0.2):
    rng = np.random.default_rng(seed)
    v = np.asarray(rng.standard_normal(shape) * 3, np.float32)
    v[rng.random(shape) < zeros] = 0.0
    flat = v.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-30, 65504.0], np.float32)
    k = min(flat.size, specials.size)
    flat[rng.choice(flat.size, k, replace=False)] = specials[:k]
    return v.astype(DTYPES[dtype][0])


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype == bool:
        return np.array_equal(a, b)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    nan = np.isnan(b.astype(np.float32))
    return np.array_equal(np.isnan(a.astype(np.float32)), nan) and np.array_equal(a[~nan].view(view), b[~nan].view(view))


def np_div_no_nan(x, y):
    x, y = x.astype(np.float64), y.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y == 0, 0.0, x / y)


SHAPES = [((), ()), ((7,), ()), ((), (5,)), ((33,), (33,)), ((4, 1, 6), (5, 1)), ((2, 3, 1, 5), (3, 4, 1)),
          ((1,) * 9, (2,) + (1,) * 8), ((0, 3), (3,)), ((2, 1, 3, 1, 2, 1, 2), (1, 4, 1, 3, 1, 2, 1))]


def test_library_instantiates_every_kernel(lib):
    assert lib.kernels() == sorted(list(DIV.values()) + list(COPY.values()))


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_is_tfs_bit_for_bit(lib, plan, dtype, shapes):
    x, y = values(shapes[0], dtype, 1), values(shapes[1], dtype, 2, zeros=0.3)
    got = metal_div_no_nan(lib, plan, dtype, x, y)
    try:
        with tf.device("/CPU:0"):
            want = tf.math.divide_no_nan(tf.constant(x), tf.constant(y)).numpy()
        assert same_bits(got, want)
    except tf.errors.UnimplementedError:
        # TF's CPU kernel refuses broadcasts that stay above 5 dimensions after collapsing (the 7-dimension
        # alternating case); the kernel takes up to 8. Checked against numpy alone below.
        assert len(shapes[0]) == 7
    exact = np_div_no_nan(x, y).astype(DTYPES[dtype][0])  # one rounding of the float64 quotient
    # The kernel divides in float: for float32 outputs that is the correctly rounded quotient; for half and
    # bfloat16 the float quotient is rounded again, which can differ from one rounding by 1 ulp (double rounding).
    tol = {"float": 0, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}[dtype]
    g, e = got.astype(np.float64), exact.astype(np.float64)
    fin = np.isfinite(e)
    assert np.array_equal(np.isnan(g), np.isnan(e))
    assert (np.abs(g[fin] - e[fin]) <= tol * np.maximum(np.abs(e[fin]), 2.0 ** -14)).all()


def test_div_no_nan_zero_divisor_gives_zero_whatever_x(lib, plan):
    x = np.array([np.nan, np.inf, -1.0, 0.0, 2.0, 1.0], np.float32)
    y = np.array([0.0, -0.0, 0.0, 0.0, np.nan, np.inf], np.float32)
    got = metal_div_no_nan(lib, plan, "float", x, y)
    assert np.array_equal(got[:4].view(np.uint32), np.zeros(4, np.uint32))  # +0, even for NaN x and y == -0
    assert np.isnan(got[4]) and got[5] == 0.0


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
