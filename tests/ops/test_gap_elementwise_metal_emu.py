"""The elementwise gap kernels (custom_ops/metal/gap_elementwise.metal) on the Metal emulator.

Every instantiation -- gap_is_finite_float, gap_is_finite_half, gap_is_finite_bfloat, gap_sigmoid_float,
gap_sigmoid_half, gap_sigmoid_bfloat, gap_sigmoid_grad_float, gap_sigmoid_grad_half, gap_sigmoid_grad_bfloat,
gap_elu_float, gap_elu_half, gap_elu_bfloat, gap_elu_grad_float, gap_elu_grad_half, gap_elu_grad_bfloat,
gap_erfc_float, gap_erfc_half, gap_erfc_bfloat,
gap_fill_1, gap_fill_2, gap_fill_4 -- is dispatched as gap_elementwise_metal.mm dispatches it (dispatchThreads with the
helper's threadgroup size, chunks bound at buffer offsets) and compared with numpy in float64 and with
TensorFlow's own CPU kernel of the op (the kernel it stands in for on a Metal backend that lacks one), in the
quick tier for every dtype. Fill's shape checks (gap_shape_from_dims, which the host code calls) run here
too, against TF's errors.

Agreement with TF's CPU kernels (`AGREEMENT`; derived, and measured over 2.4M inputs, in
custom_ops/include/tfmetal/gap_elementwise.h):
- IsFinite, Fill, ZerosLike, OnesLike: bit for bit (NaN payloads included).
- EluGrad: bit for bit in float; 2 ulps in half/bfloat16 (TF rounds outputs + 1 as well).
- SigmoidGrad: 3 ulps (TF's scalar path associates dy * y first; in half/bfloat16 TF rounds every step).
- Sigmoid: 8 float ulps (TF's float sigmoid is Eigen's approximation, measured within 6.2 ulps of exact,
  ours within 2.35), 3 ulps of half/bfloat16 (TF rounds exp, 1 + e and the quotient, we round once).
- Elu: exp(x) - 1 on both sides, so an absolute difference: 2^-23 in float, one ulp of the type just
  below 1 in half/bfloat16 (TF rounds exp before subtracting).
- Erfc: ours within 7 float ulps of exact (6.9 over every float in [-11, 11]), TF's float kernel within
  x^2 + 4 (it rounds x * x inside exp): x^2 + 11 apart; 1 ulp of half/bfloat16 (both evaluate in float and
  round once).
- Everywhere: TF's CPU flushes subnormal results to zero, the kernels keep them: float's smallest normal
  (2^-126) as an absolute tolerance.
"""

import ctypes
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
HOST = ROOT / "custom_ops" / "metal" / "gap_elementwise_metal.mm"
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
OPS = ("gap_is_finite", "gap_sigmoid", "gap_sigmoid_grad", "gap_elu", "gap_elu_grad", "gap_erfc")
FILLS = {1: "gap_fill_1", 2: "gap_fill_2", 4: "gap_fill_4"}
SIZES = [4099, 1, 31, 33, 1000]  # 4099 (the quick tier's): several threadgroups and a partial one
PARAMS = np.dtype([("n", "<u4")])  # tfm_gap_elementwise_params
FILL_PARAMS = np.dtype([("n", "<u4"), ("bits", "<u4")])  # tfm_gap_fill_params
# Units in the last place of each type (as float64 spacing at 1.0), and just below 1.
ULP = {"float": 2.0 ** -23, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}
BELOW_ONE = {d: u / 2 for d, u in ULP.items()}
FTZ = 2.0 ** -126  # float's smallest normal: TF's CPU flushes results below it to zero

# (ulps, absolute) of the kernels against TF's CPU kernel and against the exact value (numpy, float64),
# per op, for float and for half/bfloat16 ("low"). Derived in tfmetal/gap_elementwise.h:
AGREEMENT = {
    # ours within 2.35 ulps of exact, TF's Eigen approximation within 6.2: 8 apart (7 measured).
    # Low: TF rounds three times (< 2.5 ulps), we once (0.5): 3 (2 measured).
    "gap_sigmoid": {"tf": {"float": (8, FTZ), "low": (3, FTZ)},
                    "numpy": {"float": (3, FTZ), "low": (1, FTZ)}},  # 2.35 / 0.5 measured
    # exp(x) - 1: the subtraction is exact or rounds to the grid of (-1, -0.5], so exp's error is absolute.
    # Float: our expf within half an ulp, TF's vectorised exp about one ulp, of e < 1: 2^-23 (2^-24 measured).
    # Low: TF rounds exp(x) to the type first: one ulp just below 1 (measured equal to it).
    "gap_elu": {"tf": {"float": (0, 2 * BELOW_ONE["float"]), "low": (0, None)},
                "numpy": {"float": (0, BELOW_ONE["float"]), "low": (1, BELOW_ONE["float"])}},
    # TF's scalar path rounds dy * y, ours y * (1 - y): 3 float ulps (2 measured). Low: TF rounds each of
    # three steps, we once: 3 (2 measured). Three float roundings from exact: < 2.5 ulps (2.02 measured).
    "gap_sigmoid_grad": {"tf": {"float": (3, FTZ), "low": (3, FTZ)},
                         "numpy": {"float": (2.5, FTZ), "low": (1, FTZ)}},
    # Float: TF's two roundings, bit for bit. Low: TF rounds outputs + 1 too: 2 ulps (1 measured).
    # Two float roundings from exact: < 1.5 ulps (1.46 measured).
    "gap_elu_grad": {"tf": {"float": (0, FTZ), "low": (2, FTZ)},
                     "numpy": {"float": (1.5, FTZ), "low": (1, FTZ)}},
}

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_elementwise.metal")


def tolerance(op, ref, dtype):
    ulps, atol = AGREEMENT[op][ref]["float" if dtype == "float" else "low"]
    return ulps, BELOW_ONE[dtype] if atol is None else atol


def dispatch(lib, name, buffers, chunk=None):
    """Encodes `name` over 1-D buffers (output last) in chunks bound at element offsets, as the host does."""
    n = buffers[-1].size
    for start, count in dispatch_chunks(n, chunk):
        views = [b[start:start + count] for b in buffers]
        lib.run(name, views + [("bytes", np.array((count,), PARAMS))], grid=count,
                threadgroup=threadgroup_size_1d(count))


def metal_unary(lib, op, dtype, x, **kw):
    x = np.ascontiguousarray(x).ravel()
    y = np.zeros(x.size, np.uint8) if op == "gap_is_finite" else np.full_like(x, np.nan)
    dispatch(lib, f"{op}_{dtype}", [x, y], **kw)
    return y


def metal_binary(lib, op, dtype, a, b):
    a, b = np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel()
    z = np.full_like(a, np.nan)
    dispatch(lib, f"{op}_{dtype}", [a, b, z])
    return z


def value_bits(value, np_dtype):
    """The host's ValueBits: the value's bit pattern in the low bytes of a uint32."""
    v = np.array(value, np_dtype)
    return int(v.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[v.itemsize]))


def metal_fill(lib, n, np_dtype, value, chunk=None):
    size = np.dtype(np_dtype).itemsize
    y = np.full(n * size, 0x55, np.uint8).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])  # garbage first
    bits = value_bits(value, np_dtype)
    for start, count in dispatch_chunks(n, chunk):
        lib.run(FILLS[size], [y[start:start + count], ("bytes", np.array((count, bits), FILL_PARAMS))],
                grid=count, threadgroup=threadgroup_size_1d(count))
    return y.view(np_dtype)


SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 80.0, -80.0, 1e-30, -1e-30, 1e-40, -1e-40, -20.0, 20.0,
                     -88.0, -100.0, 3e38, -3e38], np.float32)


def inputs(dtype, n, seed, scale=4.0):
    """Normal values with the specials (+-0, NaN, +-inf, huge, tiny, subnormal, sigmoid's underflow) mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    k = min(n, SPECIALS.size)
    x[rng.choice(n, k, replace=False)] = SPECIALS[:k]
    with np.errstate(over="ignore"):  # +-3e38 is +-inf in half
        return x.astype(DTYPES[dtype][0])


def sweep(dtype):
    """Where the ops change behaviour: [-100, 100] evenly (sigmoid's saturation, float's underflow below
    -87.3, elu's approach to -1) and magnitudes 1e-45..100 of both signs (subnormals, elu's cancellation
    near 0), with the specials."""
    lin = np.linspace(-100, 100, 20001, dtype=np.float32)
    mag = (10.0 ** np.linspace(-45, 2, 4001)).astype(np.float32)
    with np.errstate(over="ignore"):  # half: above 65504 is inf
        return np.concatenate([lin, mag, -mag, SPECIALS]).astype(DTYPES[dtype][0])


def tf_cpu(fn, *args):
    with tf.device("/CPU:0"):
        return fn(*[tf.constant(a) for a in args]).numpy()


def tf_cpu_scalar_path(fn, *args, width=7, count=160):
    """TF's CPU kernel on `width`-element slices: below one AVX packet, Eigen evaluates them with its scalar
    code, which differs from the vectorised one (SigmoidGrad's association, exp). The first count slices."""
    m = min(args[0].size // width, count) * width
    with tf.device("/CPU:0"):
        parts = [fn(*[tf.constant(a[i:i + width]) for a in args]).numpy() for i in range(0, m, width)]
    return np.concatenate(parts), [a[:m] for a in args]


def ulp_of(w, dtype):
    """The spacing of `dtype`'s values at |w| (at least its smallest normal's)."""
    tiny = {"float": 2.0 ** -126, "half": 2.0 ** -14, "bfloat": 2.0 ** -126}[dtype]
    return 2.0 ** np.floor(np.log2(np.maximum(np.abs(w), tiny))) * ULP[dtype]


def assert_close_ulps(got, want, dtype, ulps, atol=0.0):
    """NaN where want is NaN, infinities equal, elsewhere within `ulps` of the type at `want` (+ `atol`)."""
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    nan = np.isnan(w)
    np.testing.assert_array_equal(np.isnan(g), nan)
    inf = np.isinf(w)
    np.testing.assert_array_equal(g[inf], w[inf])
    ok = ~(nan | inf)
    err = np.abs(g[ok] - w[ok])
    bad = np.flatnonzero(err > ulps * ulp_of(w[ok], dtype) + atol)
    assert bad.size == 0, f"{bad.size} beyond {ulps} ulps + {atol:g}, first {g[ok][bad[:4]]} vs {w[ok][bad[:4]]}"


def assert_agrees(op, dtype, got, want_tf, want_exact):
    assert_close_ulps(got, want_tf, dtype, *tolerance(op, "tf", dtype))
    assert_close_ulps(got, want_exact, dtype, *tolerance(op, "numpy", dtype))


def assert_same_bits(got, want):
    """Equal bit patterns, NaN payloads included (Fill copies the value's bits; so does TF)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(view), want.view(view))


# numpy references (float64).
def np_sigmoid(x):
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def np_elu(x):
    x = x.astype(np.float64)
    return np.where(x < 0, np.expm1(np.minimum(x, 0)), x)


def np_sigmoid_grad(y, dy):
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return dy * y * (1 - y)


def np_elu_grad(dy, y):
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(y < 0, dy * (y + 1), dy)


NP_UNARY = {"gap_sigmoid": np_sigmoid, "gap_elu": np_elu}
TF_UNARY = {"gap_sigmoid": tf.sigmoid, "gap_elu": tf.nn.elu}
NP_BINARY = {"gap_sigmoid_grad": np_sigmoid_grad, "gap_elu_grad": np_elu_grad}
TF_BINARY = {"gap_sigmoid_grad": lambda a, b: tf.raw_ops.SigmoidGrad(y=a, dy=b),
             "gap_elu_grad": lambda a, b: tf.raw_ops.EluGrad(gradients=a, outputs=b)}


def sigmoid_outputs(dtype, n, seed):
    """y for SigmoidGrad: a sigmoid's outputs, with 0 and 1 (TF flushes subnormal ones: none here)."""
    y = np.random.default_rng(seed).random(n).astype(np.float32)
    y[: min(n, 2)] = [0.0, 1.0][: min(n, 2)]
    return y.astype(DTYPES[dtype][0])


def elu_outputs(dtype, n, seed):
    """outputs for EluGrad: an elu's outputs, > -1 (-1 itself only at -inf)."""
    x = inputs(dtype, n, seed, scale=0.7).astype(np.float32)
    x = np.maximum(np.nan_to_num(x, nan=0.5, posinf=1e30, neginf=-0.999), -0.999)
    with np.errstate(over="ignore"):
        return x.astype(DTYPES[dtype][0])


# ----------------------------------------------------------------------------


def test_library_instantiates_every_kernel(lib):
    want = sorted([f"{op}_{d}" for op in OPS for d in DTYPES] + list(FILLS.values()))
    assert lib.kernels() == want


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_is_finite_is_tfs_bit_for_bit(lib, dtype, n):
    x = inputs(dtype, n, seed=n)
    got = metal_unary(lib, "gap_is_finite", dtype, x).astype(bool)
    np.testing.assert_array_equal(got, np.isfinite(x.astype(np.float64)))
    np.testing.assert_array_equal(got, tf_cpu(tf.math.is_finite, x))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sigmoid_and_elu_agree_with_numpy_and_tf(lib, dtype, n):
    x = inputs(dtype, n, seed=n + 1)
    for op in ("gap_sigmoid", "gap_elu"):
        got = metal_unary(lib, op, dtype, x)
        assert_agrees(op, dtype, got, tf_cpu(TF_UNARY[op], x), NP_UNARY[op](x))
    xf = x.astype(np.float32)
    sig = metal_unary(lib, "gap_sigmoid", dtype, x).astype(np.float32)
    elu = metal_unary(lib, "gap_elu", dtype, x).astype(np.float32)
    assert (sig[xf == -np.inf] == 0).all() and (sig[xf == np.inf] == 1).all()
    assert (elu[xf == -np.inf] == -1).all() and (elu[xf == np.inf] == np.inf).all()


def np_erfc(x):
    """erfc in float64 (the standard library's, correctly rounded to within an ulp of float64)."""
    return np.frompyfunc(math.erfc, 1, 1)(np.asarray(x, np.float64)).astype(np.float64)


def erfc_sweep(dtype):
    """[-12, 12] evenly (erfc's range from 2 to below float's subnormals, the branch at |x| = 0.5, the cut at
    10.5), magnitudes 1e-45..12 of both signs, the floats next to +-0.5, and the specials."""
    lin = np.linspace(-12, 12, 24001, dtype=np.float32)
    mag = (10.0 ** np.linspace(-45, np.log10(12), 2001)).astype(np.float32)
    half = np.float32(0.5)
    edges = np.array([np.nextafter(half, 0), half, np.nextafter(half, 1)], np.float32)
    with np.errstate(over="ignore"):
        return np.concatenate([lin, mag, -mag, edges, -edges, SPECIALS]).astype(DTYPES[dtype][0])


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_erfc_agrees_with_exact_and_tf(lib, dtype):
    x = erfc_sweep(dtype)
    got = metal_unary(lib, "gap_erfc", dtype, x).astype(np.float64)
    exact = np_erfc(x)
    # Against exact: 7 float ulps (tfmetal/gap_elementwise.h: 6.9 over every float in [-11, 11]); half and
    # bfloat16 round that float once: within half an ulp plus 7 float ulps, so 1 ulp. Below float's smallest
    # normal the result is subnormal (float) or flushed by neither side: FTZ absolute.
    assert_close_ulps(got, exact, dtype, 7 if dtype == "float" else 1, FTZ)
    want_tf = tf_cpu(tf.math.erfc, x).astype(np.float64)
    if dtype == "float":
        # TF rounds x * x inside exp(-x * x): up to x^2 ulps, plus its approximation's own (4 asserted).
        xf = x.astype(np.float64)
        ok = np.isfinite(want_tf)
        bound = (np.minimum(xf, 12.0) ** 2 + 11.0) * ulp_of(want_tf, dtype) + FTZ
        err = np.abs(got - want_tf)
        assert (err[ok] <= bound[ok]).all(), f"max {np.max(err[ok] / ulp_of(want_tf[ok], dtype)):.1f} ulps from TF"
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want_tf))
    else:
        assert_close_ulps(got, want_tf, dtype, 1, FTZ)
    xf = x.astype(np.float32)
    assert (got[xf == np.inf] == 0).all() and (got[xf == -np.inf] == 2).all() and (got[xf == 0] == 1).all()
    assert np.isnan(got[np.isnan(xf)]).all()


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_agree_with_numpy_and_tf(lib, dtype, n):
    y, dy, outputs = sigmoid_outputs(dtype, n, n + 2), inputs(dtype, n, seed=n + 3), elu_outputs(dtype, n, n + 4)
    got = metal_binary(lib, "gap_sigmoid_grad", dtype, y, dy)
    assert_agrees("gap_sigmoid_grad", dtype, got, tf_cpu(TF_BINARY["gap_sigmoid_grad"], y, dy), np_sigmoid_grad(y, dy))
    got = metal_binary(lib, "gap_elu_grad", dtype, dy, outputs)
    assert_agrees("gap_elu_grad", dtype, got, tf_cpu(TF_BINARY["gap_elu_grad"], dy, outputs), np_elu_grad(dy, outputs))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("op", ["gap_sigmoid", "gap_elu", "gap_sigmoid_grad", "gap_elu_grad"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_whole_range_agrees_with_tfs_two_paths(lib, dtype, op):
    # The bounds hold over every region, not only where normal inputs fall: sigmoid's underflow
    # (subnormal outputs TF flushes), elu's cancellation near 0, saturation, huge gradients. And against
    # both of TF's code paths: the vectorised one (a long tensor) and the scalar one (slices of 7).
    x = sweep(dtype)
    if op in NP_UNARY:
        got = metal_unary(lib, op, dtype, x)
        assert_agrees(op, dtype, got, tf_cpu(TF_UNARY[op], x), NP_UNARY[op](x))
        scalar, (xs,) = tf_cpu_scalar_path(TF_UNARY[op], x[np.random.default_rng(0).permutation(x.size)])
        assert_close_ulps(metal_unary(lib, op, dtype, xs), scalar, dtype, *tolerance(op, "tf", dtype))
        return
    first = x[np.random.default_rng(1).permutation(x.size)]  # dy / gradients: every magnitude
    if op == "gap_sigmoid_grad":
        args = (sigmoid_outputs(dtype, x.size, 2), first)
    else:
        args = (first, elu_outputs(dtype, x.size, 3))
    got = metal_binary(lib, op, dtype, *args)
    assert_agrees(op, dtype, got, tf_cpu(TF_BINARY[op], *args), NP_BINARY[op](*args))
    scalar, sliced = tf_cpu_scalar_path(TF_BINARY[op], *args)
    assert_close_ulps(metal_binary(lib, op, dtype, *sliced), scalar, dtype, *tolerance(op, "tf", dtype))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fill_zeros_ones_are_tfs_bit_for_bit(lib, dtype):
    np_dtype, _ = DTYPES[dtype]
    nan_payload = {"float": np.uint32(0x7FC12345), "half": np.uint16(0x7E21), "bfloat": np.uint16(0x7FC5)}[dtype]
    for value in (0.0, 1.0, -2.5, np.inf, -0.0, 1e-40, nan_payload.view(np_dtype)):
        got = metal_fill(lib, 1037, np_dtype, value)
        with tf.device("/CPU:0"):  # a numpy scalar: eager tf.constant caches Python scalars, and -0.0 == 0.0
            want = tf.fill([1037], tf.constant(np.array(value, np_dtype))).numpy()
        assert_same_bits(got, want)
    x = inputs(dtype, 77, seed=5)
    assert_same_bits(metal_fill(lib, 77, np_dtype, 0.0), tf_cpu(tf.zeros_like, x))
    assert_same_bits(metal_fill(lib, 77, np_dtype, 1.0), tf_cpu(tf.ones_like, x))
    # The 1 OnesLike fills with is this dtype's (LikeCompute's constant).
    assert f"ones ? 0x{value_bits(1.0, np_dtype):x}u : 0u" in HOST.read_text()


def test_zeros_like_int8_is_tfs(lib):
    # ZerosLike's int8 registration fills 1-byte zeros (LikeCompute's constant for TF_INT8).
    x = np.arange(-50, 53, dtype=np.int8)
    assert_same_bits(metal_fill(lib, x.size, np.int8, 0), tf_cpu(tf.zeros_like, x))
    assert_same_bits(metal_fill(lib, x.size, np.int8, 1), tf_cpu(tf.ones_like, x))
    assert "case TF_INT8: bits = ones ? 0x01u : 0u;" in HOST.read_text()


def test_fill_bool_is_tfs(lib):
    for value in (True, False):
        got = metal_fill(lib, 1001, np.bool_, value)
        with tf.device("/CPU:0"):
            want = tf.fill([1001], tf.constant(np.array(value))).numpy()
        np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------
# Fill's shape: gap_shape_from_dims (metal/gap_elementwise.h) is what FillCompute calls, with
# C linkage in the emulator's build. TF's allocation aborts the process on a shape that fails these
# checks, so they must refuse everything TF's CPU kernel refuses, with its text.

SHAPE_CODES = {0: None, 1: "Too many dimensions", 2: "Dimension {d} must be >= 0",
               3: "Shape {shape} would have more than 2**63 - 1 elements"}


def shape_from_dims(lib, dims):
    fn = ctypes.CDLL(str(lib.path)).tfm_gap_shape_from_dims
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    arr = np.ascontiguousarray(dims, np.int64)
    detail = ctypes.c_int64(-12345)
    code = fn(arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), arr.size, ctypes.byref(detail))
    return code, detail.value


@pytest.mark.parametrize("dims", [
    [], [0], [3, 41], [0, 5], [2, 0, 7], [1] * 254, [1] * 255, [2, -3], [-1], [-5, 2 ** 62],
    [2 ** 40, 2 ** 40], [2 ** 40, 2 ** 40, 0], [2 ** 40, 2 ** 40, -1], [2 ** 62, 4], [2 ** 31, 2 ** 31, 2],
    [0, 2 ** 62, 2 ** 62],
], ids=lambda d: str(d) if len(d) < 8 else f"rank{len(d)}")
def test_fill_shape_checks_are_tfs(lib, dims):
    code, detail = shape_from_dims(lib, dims)
    with tf.device("/CPU:0"):
        try:
            # Shape only: TF allocates a succeeding shape, so those are kept small.
            want = tf.raw_ops.Fill(dims=tf.constant(dims, tf.int64), value=tf.constant(1.0)).shape
            error = None
        except tf.errors.InvalidArgumentError as e:
            want, error = None, e.message
    if error is None:
        assert code == 0 and detail == int(np.prod(dims, dtype=np.int64)) == want.num_elements()
        return
    assert code != 0, error
    # TF prints a dimension of -1 as "?" (an unknown dimension); FillCompute does too.
    shape = "[" + ",".join("?" if d == -1 else str(d) for d in dims) + "]"
    assert SHAPE_CODES[code].format(d=detail, shape=shape) in error
    host = HOST.read_text()
    for part in re.split(r"\{\w+\}", SHAPE_CODES[code]):
        assert part.strip(" ]") in host
    assert 'dims[i] == -1 ? std::string("?")' in host


def test_fill_shape_limit_is_int64():
    # At the limit itself (TF would try to allocate these, so without TF): 2**63 - 1 elements pass, one
    # more overflows, whatever the order of the factors.
    biggest = (2 ** 63 - 1) // 7
    assert shape_from_dims(lib_for_shapes(), [7, biggest]) == (0, 7 * biggest)
    assert shape_from_dims(lib_for_shapes(), [biggest, 7]) == (0, 7 * biggest)
    assert shape_from_dims(lib_for_shapes(), [7, biggest + 1])[0] == 3
    assert shape_from_dims(lib_for_shapes(), [2 ** 62, 1]) == (0, 2 ** 62)
    assert shape_from_dims(lib_for_shapes(), [2 ** 62, 2])[0] == 3


def lib_for_shapes():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_elementwise.metal")  # cached: the module's library


def test_fill_accepts_tfs_legacy_forms():
    # TF's CPU kernel takes a scalar `dims` as a vector of one and a `value` of shape [1] as a scalar (in
    # graphs of unknown rank too): FillCompute accepts both, and refuses the rest with TF's text.
    with tf.device("/CPU:0"):
        assert tf.raw_ops.Fill(dims=tf.constant(3), value=tf.constant(2.0)).shape == [3]
        assert tf.raw_ops.Fill(dims=tf.constant([2, 3]), value=tf.constant([2.0])).shape == [2, 3]
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"dims must represent a vector, got shape \[1,2\]"):
            tf.raw_ops.Fill(dims=tf.constant([[1, 2]]), value=tf.constant(2.0))
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"value must represent a scalar, got shape \[2\]"):
            tf.raw_ops.Fill(dims=tf.constant([2]), value=tf.constant([1.0, 2.0]))
    host = HOST.read_text()
    fill = host[host.index("void FillCompute"):]
    assert "TF_NumDims(dims_t.get()) > 1" in fill and "TF_TensorElementCount(dims_t.get())" in fill
    assert "value_rank > 1 || (value_rank == 1 && TF_Dim(value.get(), 0) != 1)" in fill
    assert '"dims must represent a vector, got shape "' in fill and '"value must represent a scalar, got shape "' in fill


def test_gradient_shape_rules_and_texts_are_tfs():
    # SigmoidGrad (TF's cwise gradient kernel) needs equal element counts only; EluGrad (a
    # BinaryElementWiseOp) equal shapes. The host code checks the same and writes the same text.
    host = HOST.read_text()
    with tf.device("/CPU:0"):
        assert tf.raw_ops.SigmoidGrad(y=tf.ones([2, 3]), dy=tf.ones([6])).shape == [2, 3]
        with pytest.raises(tf.errors.InvalidArgumentError) as e:
            tf.raw_ops.SigmoidGrad(y=tf.ones([2, 3]), dy=tf.ones([5]))
        assert "The two arguments to a cwise op must have same number of elements, got 6 and 5" in e.value.message
        assert '"The two arguments to a cwise op must have same number of elements, got "' in host
        with pytest.raises(tf.errors.InvalidArgumentError) as e:
            tf.raw_ops.EluGrad(gradients=tf.ones([2, 3]), outputs=tf.ones([6]), name="g")
    ours = re.search(r'"Inputs to operation " \+ .*?\+\s*"( of type EluGrad must have the same size and shape\.  '
                     r'Input 0: )" \+\s*ShapeString\(g\) \+ "( != input 1: )"', host, re.S)
    assert ours is not None
    assert re.search(r"Inputs to operation \S+" + re.escape(ours[1]) + r"\[2,3\]" + re.escape(ours[2]) + r"\[6\]",
                     e.value.message)


@pytest.mark.parametrize("op", ["IsFinite", "Sigmoid", "Elu", "SigmoidGrad", "EluGrad", "ZerosLike", "OnesLike",
                                "Fill"])
def test_empty_tensors_give_empty_outputs_without_a_dispatch(op):
    # TF's CPU kernel gives an empty output of the input's shape (Fill: of dims); the host code allocates
    # it and returns before encoding, as Metal refuses an empty dispatch, and the chunking has no chunk.
    x = tf.zeros([0, 3])
    args = {"Fill": dict(dims=tf.constant([4, 0]), value=tf.constant(1.0)),
            "SigmoidGrad": dict(y=x, dy=x), "EluGrad": dict(gradients=x, outputs=x),
            "Elu": dict(features=x)}.get(op, dict(x=x))
    with tf.device("/CPU:0"):
        out = getattr(tf.raw_ops, op)(**args)
    assert out.shape.num_elements() == 0 and out.shape == ([4, 0] if op == "Fill" else [0, 3])
    assert dispatch_chunks(0) == []
    host = HOST.read_text()
    for fn in re.findall(r"\n(?:void|bool) \w+\(.*?\n}\n", host, re.S):
        if "EncodeKernel(" in fn:
            guard = fn.find("if (n == 0) return;")
            assert 0 <= guard < fn.index("EncodeKernel("), fn[:80]


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # The host splits tensors larger than one dispatch at buffer offsets: same result with small chunks.
    x = inputs("half", 5003, seed=11)
    assert_same_bits(metal_unary(lib, "gap_sigmoid", "half", x, chunk=1000), metal_unary(lib, "gap_sigmoid", "half", x))
    fill = metal_fill(lib, 5003, np.float32, 3.0, chunk=999)
    assert (fill == 3.0).all()


def test_output_may_alias_the_first_input(lib):
    # The host forwards the first input's buffer to the output when TF allows it: each thread reads its
    # elements before writing.
    x = inputs("float", 1000, seed=3)
    want = metal_unary(lib, "gap_elu", "float", x)
    inplace = x.copy()
    dispatch(lib, "gap_elu_float", [inplace, inplace])
    assert_same_bits(inplace, want)
    y, dy = sigmoid_outputs("bfloat", 1000, 4), inputs("bfloat", 1000, seed=5)
    want = metal_binary(lib, "gap_sigmoid_grad", "bfloat", y, dy)
    inplace = y.copy()
    dispatch(lib, "gap_sigmoid_grad_bfloat", [inplace, dy, inplace])
    assert_same_bits(inplace, want)


# ----------------------------------------------------------------------------
# Bitcast: no kernel runs, the host code views the input's buffer as `type` with the shape
# tfmetal/host_checks.h's BitcastShape gives. That rule, compiled here, against TF's CPU kernel.

BITCAST_SHIM = r"""
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "tfmetal/host_checks.h"
extern "C" int bitcast_shape(int in_type, long long in_size, int out_type, long long out_size, const int64_t* dims,
                             int rank, int64_t* out_dims, int* out_rank, char* message, int cap) {
  std::vector<int64_t> out;
  const std::string error = tfmetal_ext::BitcastShape(in_type, in_size, out_type, out_size, dims, rank, &out);
  std::strncpy(message, error.c_str(), cap - 1);
  message[cap - 1] = 0;
  *out_rank = static_cast<int>(out.size());
  for (size_t i = 0; i < out.size(); ++i) out_dims[i] = out[i];
  return error.empty() ? 0 : 1;
}
"""

BITCAST_DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.int32, tf.int64]
BITCAST_SHAPES = [[], [1], [2], [4], [3, 2], [2, 4], [0, 2], [0, 4], [2, 0], [5, 1], [2, 3, 4]]


@pytest.fixture(scope="module")
def bitcast_shape(tmp_path_factory):
    import shlex
    import subprocess

    from tfmetal_ext.ops import _loader

    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the host's shape rule cannot be built here")
    out = tmp_path_factory.mktemp("bitcast")
    (out / "shim.cc").write_text(BITCAST_SHIM)
    subprocess.run(shlex.split(compiler) + ["-std=c++17", "-O1", "-shared", "-fPIC", "-I",
                    str(ROOT / "custom_ops" / "include"), str(out / "shim.cc"), "-o", str(out / "shim.so")],
                   check=True, capture_output=True)
    fn = ctypes.CDLL(str(out / "shim.so")).bitcast_shape
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]

    def call(in_dtype, out_dtype, shape):
        dims = np.array(shape, np.int64)
        out_dims, out_rank = np.zeros(len(shape) + 1, np.int64), ctypes.c_int(0)
        message = ctypes.create_string_buffer(256)
        failed = fn(in_dtype.as_datatype_enum, in_dtype.size, out_dtype.as_datatype_enum, out_dtype.size,
                    dims.ctypes.data if len(shape) else None, len(shape), out_dims.ctypes.data,
                    ctypes.byref(out_rank), message, 256)
        return (None, message.value.decode()) if failed else (out_dims[:out_rank.value].tolist(), "")
    return call


@pytest.mark.every_case
@pytest.mark.parametrize("out_dtype", BITCAST_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("in_dtype", BITCAST_DTYPES, ids=lambda d: d.name)
def test_bitcast_shape_and_errors_are_tfs(bitcast_shape, in_dtype, out_dtype):
    for shape in BITCAST_SHAPES:
        got_shape, got_error = bitcast_shape(in_dtype, out_dtype, shape)
        try:
            with tf.device("/CPU:0"):
                want = tf.raw_ops.Bitcast(input=tf.zeros(shape, in_dtype), type=out_dtype)
        except tf.errors.InvalidArgumentError as e:
            assert got_shape is None and got_error in e.message, (shape, got_error, e.message)
            continue
        assert got_error == "" and got_shape == want.shape.as_list(), (shape, got_shape, want.shape)
