"""The variable update gap kernels (custom_ops/metal/gap_variable.metal) on the Metal emulator.

Every kernel -- gap_assign_update_float, gap_assign_update_half, gap_assign_update_bfloat,
gap_assign_update_int64 -- is dispatched as the host dispatches it (DispatchChunked1D: dispatchThreads with the
helper's threadgroup size, chunks bound at buffer offsets, the variable updated in place) for both ops, and
compared bit for bit with TensorFlow's own CPU kernels (AssignAddVariableOp / AssignSubVariableOp on a
variable placed on the CPU, read back) and with the correctly rounded result (numpy in float64, rounded once).

What is compared (derived in custom_ops/include/tfmetal/gap_variable.h):
- bit patterns everywhere except inside NaNs, where the isnan masks must agree: which NaN comes out (sign and
  payload) is not fixed on either side (x86's default NaN of inf - inf is negative, Eigen's bfloat16 rounding
  makes every NaN canonical, the emulator keeps the operand's payload);
- TF's CPU runs with flush-to-zero and denormals-are-zero: in float and bfloat16 a subnormal operand is read as
  a zero of its sign and a subnormal result is written as one, the kernels keep them. So TF's results are
  compared with the kernels' where no float or bfloat16 subnormal is involved, and everywhere with the kernels'
  result for the flushed operands, flushed; half (no flushing) and int64 everywhere, as they are.
"""

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "custom_ops" / "metal" / "gap_variable.h"
# dtype suffix -> (numpy dtype, TF dtype, unsigned view of the bits)
DTYPES = {"float": (np.float32, tf.float32, np.uint32), "half": (np.float16, tf.float16, np.uint16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16, np.uint16), "int64": (np.int64, tf.int64, np.uint64)}
KERNELS = {"float": "gap_assign_update_float", "half": "gap_assign_update_half",
           "bfloat": "gap_assign_update_bfloat", "int64": "gap_assign_update_int64"}
OPS = {"AssignAddVariableOp": 0, "AssignSubVariableOp": 1}  # TFM_GAP_VARIABLE_ADD / _SUB
PARAMS = np.dtype([("count", "<u4"), ("op", "<u4"), ("pad", "<u4", 2)])  # tfm_gap_variable_params
# Smallest normal of the float types whose subnormals TF's CPU flushes (bfloat16 shares float's range).
FLUSHED = {"float": 2.0 ** -126, "bfloat": 2.0 ** -126}
I64 = np.iinfo(np.int64)

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_variable.metal")


def params(count, op):
    return np.array((count, OPS[op], (0, 0)), PARAMS)


def metal_update(lib, dtype, op, var, value, chunk=None):
    """The kernel over `var` in place (a copy is returned), in chunks bound at element offsets, as the host does."""
    var, value = np.array(var, DTYPES[dtype][0]).ravel(), np.ascontiguousarray(value, DTYPES[dtype][0]).ravel()
    assert var.size == value.size
    for start, count in dispatch_chunks(var.size, chunk):
        lib.run(KERNELS[dtype], [var[start:start + count], value[start:start + count], ("bytes", params(count, op))],
                grid=count, threadgroup=threadgroup_size_1d(count))
    return var


def tf_update(dtype, op, var, value):
    """TF's CPU kernel: the op on a variable placed on the CPU, read back."""
    np_dtype, tf_dtype, _ = DTYPES[dtype]
    with tf.device("/CPU:0"):
        v = tf.Variable(np.asarray(var, np_dtype), dtype=tf_dtype)
        getattr(tf.raw_ops, op)(resource=v.handle, value=tf.constant(np.asarray(value, np_dtype)))
        return v.read_value().numpy()


def exact(dtype, op, var, value):
    """The correctly rounded result: int64 modulo 2^64; floats in float64, rounded once to the type (float64's
    53 bits hold the double rounding innocuous for float32 too: 53 >= 2 * 24 + 2)."""
    np_dtype = DTYPES[dtype][0]
    if dtype == "int64":
        a, b = np.asarray(var, np.int64).view(np.uint64), np.asarray(value, np.int64).view(np.uint64)
        return (a + b if OPS[op] == 0 else a - b).view(np.int64)
    with np.errstate(over="ignore", invalid="ignore"):  # signalling NaNs among the operands
        a, b = np.asarray(var, np_dtype).astype(np.float64), np.asarray(value, np_dtype).astype(np.float64)
        return (a + b if OPS[op] == 0 else a - b).astype(np_dtype)


def subnormal(dtype, x):
    """Where x is a float subnormal once widened (TF flushes those in float and bfloat16)."""
    if dtype not in FLUSHED:
        return np.zeros(np.shape(x), bool)
    f = np.asarray(x).astype(np.float32)
    return (f != 0) & (np.abs(f) < FLUSHED[dtype])


def flush(dtype, x):
    """x with float subnormals replaced by zeros of their sign (x86's FTZ / DAZ)."""
    x = np.array(x)
    tiny = subnormal(dtype, x)
    x[tiny] = np.copysign(np.zeros(1, np.float32), x[tiny].astype(np.float32)).astype(x.dtype)
    return x


def assert_same(dtype, got, want, where=None):
    """Equal bit patterns except inside NaNs (equal isnan masks); only at `where` if given."""
    got, want = np.asarray(got).ravel(), np.asarray(want).ravel()
    assert got.shape == want.shape and got.dtype == want.dtype
    if where is not None:
        got, want = got[where.ravel()], want[where.ravel()]
    view = DTYPES[dtype][2]
    if dtype == "int64":
        np.testing.assert_array_equal(got.view(view), want.view(view))
        return
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    bad = np.flatnonzero(got[~nan].view(view) != want[~nan].view(view))
    assert bad.size == 0, (f"{bad.size} of {got.size} differ, first bits "
                           f"{[hex(v) for v in got[~nan].view(view)[bad[:4]]]} vs "
                           f"{[hex(v) for v in want[~nan].view(view)[bad[:4]]]}")


def check(lib, dtype, op, var, value, chunk=None):
    """The kernel against the exact result and against TF's CPU kernel, bit for bit (module docstring)."""
    var, value = np.asarray(var, DTYPES[dtype][0]), np.asarray(value, DTYPES[dtype][0])
    got = metal_update(lib, dtype, op, var, value, chunk)
    assert_same(dtype, got, exact(dtype, op, var, value))
    want_tf = tf_update(dtype, op, var, value)
    involved = subnormal(dtype, var) | subnormal(dtype, value) | subnormal(dtype, got)
    assert_same(dtype, got, want_tf, where=~involved)
    # With TF's flushing modelled: the kernel on the flushed operands, its result flushed, is TF's everywhere.
    flushed = flush(dtype, metal_update(lib, dtype, op, flush(dtype, var), flush(dtype, value)))
    assert_same(dtype, flushed, want_tf)
    return got, want_tf


def bits(dtype, values):
    return np.array(values, DTYPES[dtype][2]).view(DTYPES[dtype][0])


# Per float dtype: +-0, the smallest and largest subnormals, the smallest normal, 1, the largest finite value,
# +-inf and NaN, as bit patterns of the type.
SPECIAL_BITS = {
    "float": [0x0, 0x80000000, 0x1, 0x80000001, 0x7FFFFF, 0x807FFFFF, 0x800000, 0x80800000, 0x3F800000,
              0xBF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC12345],
    "half": [0x0, 0x8000, 0x1, 0x8001, 0x3FF, 0x83FF, 0x400, 0x8400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00,
             0xFC00, 0x7E00, 0xFE21],
    "bfloat": [0x0, 0x8000, 0x1, 0x8001, 0x7F, 0x807F, 0x80, 0x8080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80,
               0xFF80, 0x7FC0, 0xFFC5],
}

# (var, value) pairs that round to nearest even, exactly at a tie and just off it, and overflow at the top:
# float values of the type, written so that each is exact in it.
TIES = {
    "float": [(1.0, 2.0 ** -24), (1.0 + 2.0 ** -23, 2.0 ** -24), (1.0, -(2.0 ** -25)), (1.0, 2.0 ** -24 + 2.0 ** -47),
              (16777216.0, 1.0), (16777218.0, 1.0), (3.4028234663852886e38, 2.0 ** 103),
              (3.4028234663852886e38, 2.0 ** 102), (3.4028234663852886e38, 3.4028234663852886e38)],
    "half": [(1.0, 2.0 ** -11), (1.0 + 2.0 ** -10, 2.0 ** -11), (1.0, -(2.0 ** -12)), (1.0, 2.0 ** -11 + 2.0 ** -21),
             (2048.0, 1.0), (2050.0, 1.0), (65504.0, 16.0), (65504.0, 8.0), (65504.0, 65504.0),
             (-65504.0, 65504.0), (2.0 ** -14, -(2.0 ** -24)), (2.0 ** -24, 2.0 ** -24)],
    "bfloat": [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (1.0, -(2.0 ** -9)), (1.0, 2.0 ** -8 + 2.0 ** -15),
               (1.0 + 2.0 ** -7, -(2.0 ** -8)), (256.0, 1.0), (258.0, 1.0), (258.0 * 2.0 ** 100, 2.0 ** 100),
               (3.3895313892515355e38, 2.0 ** 119), (3.3895313892515355e38, 2.0 ** 118),
               (3.3895313892515355e38, 3.3895313892515355e38)],
}


def edge_pairs(dtype):
    """Every ordered pair of the specials, and the ties."""
    special = bits(dtype, SPECIAL_BITS[dtype])
    var, value = np.repeat(special, special.size), np.tile(special, special.size)
    ties = np.array(TIES[dtype], np.float64)
    with np.errstate(over="ignore"):
        tv, tw = ties[:, 0].astype(DTYPES[dtype][0]), ties[:, 1].astype(DTYPES[dtype][0])
    assert (tv.astype(np.float64) == ties[:, 0]).all() and (tw.astype(np.float64) == ties[:, 1]).all()
    return np.concatenate([var, tv, -tv]), np.concatenate([value, tw, -tw])


def random_pairs(dtype, n, seed):
    """Random values: a third any bit pattern (every class: NaN, inf, subnormal, huge, tiny), a third normal
    values of magnitudes 1e-6..1e6, a third close pairs (cancellation); int64: any, and small."""
    rng = np.random.default_rng(seed)
    np_dtype, _, view = DTYPES[dtype]
    if dtype == "int64":
        a = rng.integers(I64.min, I64.max, n, dtype=np.int64, endpoint=True)
        b = rng.integers(I64.min, I64.max, n, dtype=np.int64, endpoint=True)
        b[: n // 2] = rng.integers(-1000, 1000, n // 2)
        return a, b
    k = n // 3
    raw = rng.integers(0, np.iinfo(view).max, (2, k), dtype=view, endpoint=True).view(np_dtype)
    scale = 10.0 ** rng.uniform(-6, 6, (2, k))
    normal = (rng.standard_normal((2, k)) * scale).astype(np.float32)
    near = rng.standard_normal(n - 2 * k).astype(np.float32)
    near = np.stack([near, near * (1 + rng.uniform(-1e-2, 1e-2, near.size).astype(np.float32))])
    with np.errstate(over="ignore"):
        a = np.concatenate([raw[0], normal[0].astype(np_dtype), near[0].astype(np_dtype)])
        b = np.concatenate([raw[1], normal[1].astype(np_dtype), near[1].astype(np_dtype)])
    return a, b


INT64_EDGES = np.array([0, 1, -1, 2, -2, I64.max, I64.min, I64.max - 1, I64.min + 1, 2 ** 62, -(2 ** 62)], np.int64)


# ----------------------------------------------------------------------------


def test_library_registers_every_kernel(lib):
    assert lib.kernels() == sorted(["gap_assign_update_float", "gap_assign_update_half", "gap_assign_update_bfloat",
                                    "gap_assign_update_int64"])


def test_params_layout_is_the_hosts():
    # 16 bytes: count, op, two words of padding (the header's static_assert), as numpy lays them out here.
    assert PARAMS.itemsize == 16 and [PARAMS.fields[f][1] for f in ("count", "op", "pad")] == [0, 4, 8]
    text = HEADER.read_text()
    struct = re.search(r"struct tfm_gap_variable_params \{(.*?)\};", text, re.S)[1]
    fields = re.findall(r"^\s*(\w+)\s+(\w+)(\[\d+\])?;", struct, re.M)
    assert fields == [("uint32_t", "count", ""), ("uint32_t", "op", ""), ("uint32_t", "pad", "[2]")]
    assert "static_assert(sizeof(tfm_gap_variable_params) == 16," in text
    shared = (ROOT / "custom_ops" / "include" / "tfmetal" / "gap_variable.h").read_text()
    assert "#define TFM_GAP_VARIABLE_ADD 0" in shared and "#define TFM_GAP_VARIABLE_SUB 1" in shared


@pytest.mark.every_case  # each (dtype, op) is its own instantiation and operation
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ["float", "half", "bfloat"])
def test_float_edges_are_tfs_bit_for_bit(lib, dtype, op):
    # Signed zeros (-0 + 0, -0 - 0, 0 - 0, -0 + -0), subnormals, inf - inf and inf + -inf (NaN), NaN operands,
    # overflow to inf (max + max), and ties to even around 1, at the top of the significand and at the overflow.
    var, value = edge_pairs(dtype)
    got, want_tf = check(lib, dtype, op, var, value)
    # The signed zeros, spelled out (also in `check`'s bitwise comparisons).
    zero, neg_zero = DTYPES[dtype][0](0.0), -DTYPES[dtype][0](0.0)
    z = metal_update(lib, dtype, op, [neg_zero, neg_zero, zero, zero], [zero, neg_zero, zero, neg_zero])
    signs = list(np.signbit(z.astype(np.float32)))
    # -0 + 0 = +0, -0 + -0 = -0, 0 + 0 = +0, 0 + -0 = +0; -0 - 0 = -0, -0 - -0 = +0, 0 - 0 = +0, 0 - -0 = +0.
    assert signs == ([False, True, False, False] if op == "AssignAddVariableOp" else [True, False, False, False])
    inf = DTYPES[dtype][0](np.inf)
    nan = metal_update(lib, dtype, op, [inf, inf], [inf if op == "AssignSubVariableOp" else -inf, np.nan])
    assert np.isnan(nan.astype(np.float32)).all()


@pytest.mark.every_case  # each (dtype, op) is its own instantiation and operation
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_random_values_are_tfs_bit_for_bit(lib, dtype, op):
    var, value = random_pairs(dtype, 3000, seed=len(dtype) + OPS[op])
    check(lib, dtype, op, var, value)


@pytest.mark.parametrize("op", list(OPS))
def test_int64_wraps_around_as_tf(lib, op):
    var, value = np.repeat(INT64_EDGES, INT64_EDGES.size), np.tile(INT64_EDGES, INT64_EDGES.size)  # every pair
    got, want_tf = check(lib, "int64", op, var, value)
    if op == "AssignAddVariableOp":
        assert metal_update(lib, "int64", op, [I64.max, I64.min], [1, I64.min]).tolist() == [I64.min, 0]
    else:
        assert metal_update(lib, "int64", op, [I64.min, 0], [1, I64.min]).tolist() == [I64.max, I64.min]


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_several_threadgroups_and_chunks(lib, dtype):
    # 1000 elements: threadgroups of the helper's size, the last one partial; then the same tensor in chunks
    # bound at element offsets (a small chunk in place of the host's 2^30), as DispatchChunked1D binds them.
    n = 1000
    assert threadgroup_size_1d(n) < n
    var, value = random_pairs(dtype, n, seed=7)
    for op in OPS:
        whole, _ = check(lib, dtype, op, var, value)
        chunks = dispatch_chunks(n, 384)
        assert [c for _, c in chunks] == [384, 384, 232]
        assert_same(dtype, metal_update(lib, dtype, op, var, value, chunk=384), whole)


def test_threads_past_count_write_nothing(lib):
    # The guard reads count from the params' first word: whole threadgroups over more threads than count leave
    # the elements past it as they were (and op, the second word, picks the subtraction).
    n, count = 256, 200
    var = np.arange(n, dtype=np.float32)
    value = np.full(n, 0.5, np.float32)
    out = var.copy()
    lib.run("gap_assign_update_float", [out, value, ("bytes", params(count, "AssignSubVariableOp"))],
            threadgroups=n // 64, threadgroup=64)
    np.testing.assert_array_equal(out[:count], var[:count] - 0.5)
    np.testing.assert_array_equal(out[count:], var[count:])


@pytest.mark.parametrize("op", list(OPS))
def test_empty_variable_is_never_dispatched(op):
    # TF's CPU kernel leaves an empty variable empty; the host's chunking has no chunk for it (Metal refuses
    # an empty dispatch), so nothing is encoded and no kernel runs.
    for dtype in DTYPES:
        empty = np.zeros((0, 3), DTYPES[dtype][0])
        assert tf_update(dtype, op, empty, empty).shape == (0, 3)
        assert metal_update(None, dtype, op, empty, empty).size == 0  # no chunk: the library is never called
    assert dispatch_chunks(0) == []
