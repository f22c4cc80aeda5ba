"""The broadcasting gap kernels (custom_ops/metal/gap_broadcast.metal) on the Metal emulator.

Every instantiation -- gap_div_no_nan_float, gap_div_no_nan_half, gap_div_no_nan_bfloat,
gap_div_no_nan_contiguous_float, gap_div_no_nan_contiguous_half, gap_div_no_nan_contiguous_bfloat,
gap_broadcast_to_1, gap_broadcast_to_2, gap_broadcast_to_4 -- is dispatched as gap_broadcast_metal.mm dispatches
it: the output shape, the errors, the params and the choice of variant come from the host's own C++ (the plan
and the contiguity test exported from the emulated library; TF's shape rules from
tfmetal/gap_broadcast_checks.h, built on its own), in chunks of dispatch_geometry.h's sizes. Results are
compared bit for bit with TensorFlow's CPU kernels (tf.math.divide_no_nan, tf.broadcast_to) and with numpy, and
the host's error texts with TF's.

Why bit for bit, with no tolerance: the kernel divides in float and rounds once to the output type, and so does
TF's CPU kernel (Eigen computes half and bfloat16 division in float). Rounding float's quotient again to half or
bfloat16 is the correctly rounded quotient: double rounding is innocuous for a quotient of p-bit numbers when the
intermediate format has at least 2p + 2 bits (24 >= 2 * 11 + 2 for half, 24 >= 2 * 8 + 2 for bfloat16), and the
same holds from float64 to float32 (53 >= 50). So numpy's float64 quotient, rounded to float32 and then to the
type, is a bitwise reference for all three.

TF's CPU kernels run with the CPU's flush-to-zero and denormals-are-zero modes on, so float32 and bfloat16
subnormals count as signed zeros, inputs and quotients alike (a subnormal y gives +0); the kernel flushes them
explicitly and np_div_no_nan models it. The quotient of two floats never falls between the largest subnormal
and the midpoint below 2^-126, so whether a flush looks before or after rounding cannot matter.
"""

import ctypes
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
SUFFIX = {np.dtype(np.float32): "float", np.dtype(np.float16): "half", np.dtype(ml_dtypes.bfloat16): "bfloat"}
KERNELS = ["gap_div_no_nan_float", "gap_div_no_nan_half", "gap_div_no_nan_bfloat",
           "gap_div_no_nan_contiguous_float", "gap_div_no_nan_contiguous_half", "gap_div_no_nan_contiguous_bfloat",
           "gap_broadcast_to_1", "gap_broadcast_to_2", "gap_broadcast_to_4"]
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
MAX_DIMS = 8
PARAMS = np.dtype([("n", "<u4"), ("rank", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"),
                   ("dims", "<u4", MAX_DIMS), ("strides0", "<u4", MAX_DIMS), ("strides1", "<u4", MAX_DIMS)])
COPY, FORWARD, ERROR = 0, 1, 2  # GapBroadcastToAction
CAPACITY = 8192  # bytes of error text

emu = load_emu()
pytestmark = pytest.mark.no_keras


# ----------------------------------------------------------------------------
# numpy references


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


def np_broadcast_to(x, shape):
    return np.broadcast_to(x, shape)


# ----------------------------------------------------------------------------
# The host's C++ and its dispatch, mirrored


class Host:
    """The host code's C++ through ctypes: the plan and variant (gap_broadcast.metal's exports) and TF's
    shape rules with their messages (tfmetal/gap_broadcast_checks.h, an emulator build of its own)."""

    def __init__(self, kernels, checks):
        k, c = ctypes.CDLL(str(kernels.path)), ctypes.CDLL(str(checks.path))
        self._plan = k.tfm_gap_broadcast_plan
        self._plan.restype = ctypes.c_int
        self._plan.argtypes = [ctypes.c_void_p, ctypes.c_int] * 3 + [ctypes.c_void_p]
        self._contiguous = k.tfm_gap_broadcast_contiguous
        self._contiguous.restype = ctypes.c_int
        self._contiguous.argtypes = [ctypes.c_void_p]
        self._binary = c.tfm_gap_binary_shape
        self._binary.restype = ctypes.c_int
        self._binary.argtypes = [ctypes.c_void_p, ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_char_p,
                                                                        ctypes.c_int]
        self._to = c.tfm_gap_broadcast_to_check
        self._to.restype = ctypes.c_int
        self._to.argtypes = [ctypes.c_void_p, ctypes.c_int] * 3 + [ctypes.c_char_p, ctypes.c_int]

    @staticmethod
    def _i64(shape):
        return np.ascontiguousarray(np.asarray(shape, np.int64).reshape(-1))

    def plan(self, out, in0, in1=None):
        """GapBroadcastPlan's tfm_gap_bcast_params, or None when it refuses."""
        a, b = self._i64(out), self._i64(in0)
        c = self._i64(in1 if in1 is not None else ())
        params = np.zeros((), PARAMS)
        ok = self._plan(a.ctypes.data, a.size, b.ctypes.data, b.size, c.ctypes.data if in1 is not None else None,
                        c.size, params.ctypes.data)
        return params if ok else None

    def contiguous(self, params):
        return bool(self._contiguous(params.ctypes.data))

    def binary_shape(self, x_shape, y_shape):
        """DivNoNan's (output shape, "") or (None, TF's message)."""
        x, y = self._i64(x_shape), self._i64(y_shape)
        out = np.zeros(max(x.size, y.size, 1), np.int64)
        error = ctypes.create_string_buffer(CAPACITY)
        rank = self._binary(x.ctypes.data, x.size, y.ctypes.data, y.size, out.ctypes.data, error, CAPACITY)
        return (None, error.value.decode()) if rank < 0 else (tuple(int(d) for d in out[:rank]), "")

    def broadcast_to_check(self, in_shape, shape, shape_dims=None):
        """BroadcastTo's (action, TF's message) for an input shape and the shape argument's values."""
        x, s = self._i64(in_shape), self._i64(shape)
        dims = self._i64((s.size,) if shape_dims is None else shape_dims)
        error = ctypes.create_string_buffer(CAPACITY)
        action = self._to(x.ctypes.data, x.size, dims.ctypes.data, dims.size, s.ctypes.data, s.size, error, CAPACITY)
        return action, error.value.decode()


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_broadcast.metal")


@pytest.fixture(scope="module")
def host(lib):
    return Host(lib, emu.build(ROOT / "custom_ops" / "include" / "tfmetal" / "gap_broadcast_checks.h"))


def run_chunk(lib, name, inputs, out, params, start):
    """One dispatch as DispatchBroadcast encodes it: len(out) threads, the chunk's first index in the params."""
    p = params.copy()
    p["n"], p["start_lo"], p["start_hi"] = out.size, start & 0xFFFFFFFF, start >> 32
    lib.run(name, list(inputs) + [out, ("bytes", p)], grid=out.size, threadgroup=threadgroup_size_1d(out.size))


def metal_div_no_nan(lib, host, x, y, chunk=None):
    """DivNoNanCompute (gap_broadcast_metal.mm) on the emulator: (z, kernel name or None if nothing ran)."""
    shape, error = host.binary_shape(x.shape, y.shape)
    assert not error, error
    z = np.full(int(np.prod(shape)), np.nan, np.float32).astype(x.dtype)  # NaN: an element never written shows
    if z.size == 0:
        return z.reshape(shape), None
    params = host.plan(shape, x.shape, y.shape)
    assert params is not None
    contiguous = host.contiguous(params)
    name = f"gap_div_no_nan_{'contiguous_' if contiguous else ''}{SUFFIX[x.dtype]}"
    xf, yf = x.reshape(-1), y.reshape(-1)
    for start, count in dispatch_chunks(z.size, chunk):
        inputs = [xf[start:start + count], yf[start:start + count]] if contiguous else [xf, yf]
        run_chunk(lib, name, inputs, z[start:start + count], params, start)
    return z.reshape(shape), name


def metal_broadcast_to(lib, host, x, shape, chunk=None):
    """BroadcastToCompute on the emulator: the output (the input itself when forwarded)."""
    action, error = host.broadcast_to_check(x.shape, shape)
    assert action != ERROR, error
    if action == FORWARD:
        return x
    out = np.zeros(int(np.prod(shape)), x.dtype)
    if out.size:
        params = host.plan(shape, x.shape)
        bits = BITS[x.dtype.itemsize]
        xf, of = x.reshape(-1).view(bits), out.view(bits)
        for start, count in dispatch_chunks(out.size, chunk):
            run_chunk(lib, f"gap_broadcast_to_{x.dtype.itemsize}", [xf], of[start:start + count], params, start)
    return out.reshape(shape)


# ----------------------------------------------------------------------------
# helpers


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


def same_bits(a, b):
    """Equal shapes and bits (any NaN matches any NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == bool:
        return np.array_equal(a, b)
    bits = BITS[a.dtype.itemsize]
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return np.array_equal(nan_a, nan_b) and np.array_equal(a[~nan_a].view(bits), b[~nan_b].view(bits))


def tf_div_no_nan(x, y):
    with tf.device("/CPU:0"):
        return tf.math.divide_no_nan(tf.constant(x), tf.constant(y)).numpy()


def tf_message(error):
    """TF's own text of an op error, without the function-node prefix and the op suffix."""
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", error.message)
    return text[:text.index(" [Op:")]


# ----------------------------------------------------------------------------
# DivNoNan


def test_library_instantiates_every_kernel(lib):
    assert lib.kernels() == sorted(KERNELS)


# Broadcasting in either operand or both, ranks 0 to 6, sizes beyond one threadgroup (256 threads) first.
BROADCASTS = [((3, 1, 40), (5, 1)), ((7,), ()), ((), (5,)), ((), ()), ((3, 1), (1, 300)), ((2, 3, 1, 5), (3, 4, 1)),
              ((2, 1, 3, 1, 4), (1, 5, 1, 2, 4)), ((2, 3, 1, 1, 4, 3), (1, 1, 5, 2, 4, 3)), ((1,) * 9, (2,) + (1,) * 8)]


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_broadcasting_is_tfs_bit_for_bit(lib, host, dtype, shapes):
    x, y = values(shapes[0], dtype, 1), values(shapes[1], dtype, 2, zeros=0.3)
    got, name = metal_div_no_nan(lib, host, x, y)
    assert name == f"gap_div_no_nan_{dtype}"  # the broadcasting kernel (scalar / scalar included)
    assert same_bits(got, tf_div_no_nan(x, y)) and same_bits(got, np_div_no_nan(x, y))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("shapes", [((5, 77), (5, 77)), ((1, 6, 1), (6, 1))], ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_of_one_shape_takes_the_contiguous_variant(lib, host, dtype, shapes):
    x, y = values(shapes[0], dtype, 3), values(shapes[1], dtype, 4, zeros=0.3)
    got, name = metal_div_no_nan(lib, host, x, y)
    assert name == f"gap_div_no_nan_contiguous_{dtype}"
    assert same_bits(got, tf_div_no_nan(x, y)) and same_bits(got, np_div_no_nan(x, y))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_special_values_are_tfs(lib, host, dtype):
    # Every pair of specials, through both kernels: x NaN/inf with y == +-0 gives +0 (TF's CPU kernel masks the
    # quotient to all-zero bits), a NaN y gives NaN, inf / inf NaN, a finite x / inf a signed 0, subnormals zeros.
    np_t = DTYPES[dtype][0]
    x = np.array(SPECIALS, np.float32).astype(np_t)[:, None]
    y = np.array(SPECIALS + [-3.0, 2.0 ** -20], np.float32).astype(np_t)[None, :]
    want = tf_div_no_nan(x, y)
    got, name = metal_div_no_nan(lib, host, x, y)
    assert name == f"gap_div_no_nan_{dtype}" and same_bits(got, want) and same_bits(got, np_div_no_nan(x, y))
    xs, ys = (np.ascontiguousarray(a) for a in np.broadcast_arrays(x, y))
    got, name = metal_div_no_nan(lib, host, xs, ys)
    assert name == f"gap_div_no_nan_contiguous_{dtype}" and same_bits(got, want)
    zero_y = np_flush_denormal(ys.astype(np.float32)) == 0
    assert not got[zero_y].view(BITS[got.dtype.itemsize]).any()  # +0 bits, for y == -0, subnormal y, NaN x too
    assert np.isnan(got[:, 0].astype(np.float32)).all()  # y NaN (SPECIALS[0])


@pytest.mark.full
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_div_no_nan_on_random_bit_patterns_is_tfs(lib, host, dtype):
    # Every exponent, subnormals, NaN payloads: the rounding argument of the module docstring, tried.
    np_t = DTYPES[dtype][0]
    rng = np.random.default_rng(7)
    size = np.dtype(np_t).itemsize
    x, y = (rng.integers(0, 2 ** (8 * size), 6000, dtype=np.uint64).astype(BITS[size]).view(np_t) for _ in range(2))
    got, _ = metal_div_no_nan(lib, host, x, y)
    assert same_bits(got, tf_div_no_nan(x, y)) and same_bits(got, np_div_no_nan(x, y))


def test_div_no_nan_beyond_tfs_five_dimensions(lib, host):
    # TF's CPU kernel refuses a broadcast that stays above 5 dimensions after collapsing; the kernel takes up to
    # 8 (GAP_KERNELS' note), so this one is held against numpy alone.
    x, y = values((2, 1, 3, 1, 2, 1, 2), "half", 5), values((1, 4, 1, 3, 1, 2, 1), "half", 6)
    with pytest.raises(tf.errors.UnimplementedError, match="is not supported yet"):
        tf_div_no_nan(x, y)
    got, name = metal_div_no_nan(lib, host, x, y)
    assert name == "gap_div_no_nan_half" and same_bits(got, np_div_no_nan(x, y))


def test_div_no_nan_empty_output_is_tfs_shape(lib, host):
    for xs, ys in [((0, 3), (3,)), ((0,), (1,)), ((2, 0, 1), (5,))]:
        x, y = np.ones(xs, np.float32), np.ones(ys, np.float32)
        got, name = metal_div_no_nan(lib, host, x, y)
        assert name is None and got.shape == tf_div_no_nan(x, y).shape  # nothing dispatched


@pytest.mark.every_case
@pytest.mark.parametrize("shapes", [((2, 3), (4,)), ((3,), (0,)), ((2, 1, 3), (4, 2)), ((5, 4), (1, 3, 4, 2))],
                         ids=str)
def test_div_no_nan_incompatible_shapes_are_tfs_error(host, shapes):
    shape, error = host.binary_shape(*shapes)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        tf_div_no_nan(np.ones(shapes[0], np.float32), np.ones(shapes[1], np.float32))
    assert shape is None and error == tf_message(raised.value)


# ----------------------------------------------------------------------------
# BroadcastTo

TO_CASES = [((3, 1, 5), (2, 3, 4, 5)), ((), (4, 3)), ((1, 300), (3, 300)), ((5,), (1, 5)), ((1,), (0, 7)),
            ((2, 1, 3), (4, 2, 5, 3)), ((3, 1, 2), (2, 1, 2, 3, 4, 2)), ((6,), (6,)), ((2, 1), (2, 1)), ((), ())]


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("case", TO_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.bool_])
def test_broadcast_to_is_tfs_bit_for_bit(lib, host, dtype, case):
    in_shape, shape = case
    rng = np.random.default_rng(3)
    x = np.asarray(rng.standard_normal(in_shape) > 0 if dtype == np.bool_ else rng.standard_normal(in_shape)
                   ).astype(dtype)
    got = metal_broadcast_to(lib, host, x, shape)
    with tf.device("/CPU:0"):
        want = tf.broadcast_to(tf.constant(x), shape).numpy()
    assert same_bits(got, want) and same_bits(got, np_broadcast_to(x, shape))
    assert (got is x) == (tuple(in_shape) == tuple(shape))  # equal shapes forward the input, as TF does


def test_broadcast_to_beyond_tfs_five_dimensions(lib, host):
    x = np.arange(8, dtype=np.float16).reshape((2, 1) * 3)
    with pytest.raises(tf.errors.UnimplementedError, match="is not supported yet"):
        with tf.device("/CPU:0"):
            tf.broadcast_to(tf.constant(x), (2,) * 6)
    assert same_bits(metal_broadcast_to(lib, host, x, (2,) * 6), np_broadcast_to(x, (2,) * 6))


BIG = 2 ** 40
# (input shape, the shape argument's values, its own shape if not a vector of them)
TO_CHECKS = [((3,), [1]), ((3,), [2, 1]), ((0,), [1]), ((2, 3), [4]), ((1, 3), [3]), ((2, 3), [3, 3]),
             ((3,), [0, 2]), ((0,), [3]), ((3,), [-1]), ((3,), [2, -3]), ((), [0, -1]), ((), [1] * 255),
             ((), [-1] + [1] * 253), ((), [BIG, BIG, -1]), ((), [BIG, BIG, -5]), ((), [BIG, -5, BIG]),
             ((2, 3), [2 ** 62, 4, 0]), ((3,), [[3]]), ((3,), 3), ((2,), np.zeros((2, 0))),
             ((), [0, 2 ** 62, 2 ** 62]), ((2, 1), [2, 0]), ((1,), [1, 1]), ((2, 0), [2, 0]), ((), [0])]


@pytest.mark.every_case
@pytest.mark.parametrize("case", TO_CHECKS, ids=lambda c: f"{c[0]}->{np.asarray(c[1]).tolist()}"[:40])
def test_broadcast_to_checks_are_tfs(host, case):
    # TF's order and texts: the shape argument a vector, TensorShape's limits (254 dimensions, none negative, at
    # most 2^63 - 1 elements, -1 printed "?"), equal shapes forwarded, the ranks, then BCast's two errors.
    in_shape, shape = case
    values_ = np.asarray(shape, np.int64)
    action, error = host.broadcast_to_check(in_shape, values_.reshape(-1), shape_dims=values_.shape)
    try:
        with tf.device("/CPU:0"):
            want = tf.raw_ops.BroadcastTo(input=tf.zeros(in_shape), shape=tf.constant(values_))
    except tf.errors.InvalidArgumentError as e:
        assert (action, error) == (ERROR, tf_message(e))
    else:
        assert action == (FORWARD if tuple(values_.reshape(-1)) == tuple(in_shape) else COPY), error
        assert tuple(want.shape) == tuple(values_)


# ----------------------------------------------------------------------------
# The index mapping


def test_chunks_continue_the_global_index(lib, host):
    x, y = values((37, 1, 29), "half", 5), values((13, 1), "half", 6)
    whole, _ = metal_div_no_nan(lib, host, x, y)
    assert same_bits(metal_div_no_nan(lib, host, x, y, chunk=1000)[0], whole)
    a, b = values((41, 23), "bfloat", 7), values((41, 23), "bfloat", 8)
    chunked, name = metal_div_no_nan(lib, host, a, b, chunk=333)  # the inputs bound at each chunk too
    assert name == "gap_div_no_nan_contiguous_bfloat" and same_bits(chunked, np_div_no_nan(a, b))
    c = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    assert same_bits(metal_broadcast_to(lib, host, c, (5, 3, 7, 4), chunk=97), np_broadcast_to(c, (5, 3, 7, 4)))


def test_indices_beyond_2_to_the_32(lib, host):
    # Outputs of more than 2^32 elements: a chunk straddling 2^32 runs 32-bit and 64-bit index arithmetic side by
    # side. The dimensions are not powers of two, so an index cut to 32 bits would read the wrong elements.
    start, count = 2 ** 32 - 150, 300
    index = np.arange(start, start + count, dtype=np.uint64)
    x, y = values((1, 1, 1000), "float", 9), values((1, 999, 1), "float", 10)
    shape = (5000, 999, 1000)
    params = host.plan(shape, x.shape, y.shape)
    z = np.zeros(count, np.float32)
    run_chunk(lib, "gap_div_no_nan_float", [x.reshape(-1), y.reshape(-1)], z, params, start)
    want = np_div_no_nan(x.reshape(-1)[index % 1000], y.reshape(-1)[(index // 1000) % 999])
    assert same_bits(z, want)
    b = np.arange(999, dtype=np.uint16).reshape(999, 1)
    params = host.plan((5_000_000, 999, 1), b.shape)
    out = np.zeros(count, np.uint16)
    run_chunk(lib, "gap_broadcast_to_2", [b.reshape(-1)], out, params, start)
    assert np.array_equal(out, b.reshape(-1)[index % 999])


def test_the_plan_collapses_dimensions_and_refuses_too_many(host):
    p = host.plan((4, 5, 6), (4, 5, 6), (4, 5, 6))
    assert p["rank"] == 1 and p["dims"][0] == 120 and p["strides0"][0] == p["strides1"][0] == 1
    assert host.contiguous(p) and host.contiguous(host.plan((1, 6, 1), (6, 1), (1, 6, 1)))
    p = host.plan((4, 5, 6), (4, 5, 6), (1, 5, 6))  # the second input repeats a 30-element block
    assert p["rank"] == 2 and list(p["dims"][:2]) == [4, 30] and list(p["strides1"][:2]) == [0, 1]
    assert not host.contiguous(p) and not host.contiguous(host.plan((), (), ()))
    p = host.plan((1, 1, 7), (7,))
    assert p["rank"] == 1 and p["dims"][0] == 7
    p = host.plan((3, 4, 5), (3, 1, 5), (3, 1, 5))  # a broadcast dimension between two kept ones stays apart
    assert p["rank"] == 3 and list(p["strides0"][:3]) == [5, 0, 1]
    alternating = (2,) * 10  # broadcast pattern alternating over 10 dimensions: nothing merges
    assert host.plan(alternating, (2, 1) * 5, (1, 2) * 5) is None
    assert host.plan((2,) * 8, (2, 1) * 4, (1, 2) * 4) is not None  # 8 stays within the kernel's limit
