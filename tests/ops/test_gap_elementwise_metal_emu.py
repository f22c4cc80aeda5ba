"""The elementwise gap kernels (custom_ops/metal/gap_elementwise.metal) on the Metal emulator.

Every instantiation -- gap_is_finite_float, gap_is_finite_half, gap_is_finite_bfloat, gap_sigmoid_float,
gap_sigmoid_half, gap_sigmoid_bfloat, gap_sigmoid_grad_float, gap_sigmoid_grad_half, gap_sigmoid_grad_bfloat,
gap_elu_float, gap_elu_half, gap_elu_bfloat, gap_elu_grad_float, gap_elu_grad_half, gap_elu_grad_bfloat,
gap_fill_1, gap_fill_2, gap_fill_4 -- is dispatched as gap_elementwise_metal.mm dispatches it (dispatchThreads with the
helper's threadgroup size, chunks bound at buffer offsets) and compared with numpy in float64 and with
TensorFlow's own CPU kernel of the op (the kernel it stands in for on a Metal backend that lacks one).

Agreement with TF's CPU kernels (derived in tfmetal/gap_elementwise.h):
- IsFinite, Fill, ZerosLike, OnesLike: bit for bit.
- EluGrad and SigmoidGrad: TF's operations in the association of its vectorised path; its scalar tail
  associates SigmoidGrad differently (dy * y first), so in float the two can differ by 1 ulp. In
  half/bfloat16 TF rounds after each of its two or three operations and the kernel once: at most 2 ulps of
  the output type.
- TF's CPU kernels flush subnormal results to zero, the kernels keep them: compared with float's smallest
  normal as an absolute tolerance.
- Sigmoid and Elu: TF evaluates exp (and, for sigmoid, a rational approximation) with Eigen's own float
  code, the kernel with the platform's expf. Each is within 2 float ulps of the exact value, so the two
  differ by at most ~4 float ulps in float32; after rounding to half/bfloat16 at most 1 ulp of that type.
  Tested as 8 float32 ulps (a margin of 2) and 1 ulp of half / bfloat16.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
OPS = ("gap_is_finite", "gap_sigmoid", "gap_sigmoid_grad", "gap_elu", "gap_elu_grad")
FILLS = {1: "gap_fill_1", 2: "gap_fill_2", 4: "gap_fill_4"}
SIZES = [1, 31, 33, 1000, 4099]
PARAMS = np.dtype([("n", "<u4")])  # tfm_gap_elementwise_params
FILL_PARAMS = np.dtype([("n", "<u4"), ("bits", "<u4")])  # tfm_gap_fill_params
# Units in the last place of each type (as float64 spacing at 1.0): the tolerances above.
ULP = {"float": 2.0 ** -23, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_elementwise.metal")


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


def metal_fill(lib, n, np_dtype, value, chunk=None):
    size = np.dtype(np_dtype).itemsize
    y = np.full(n * size, 0x55, np.uint8).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])  # garbage first
    bits = int(np.array(value, np_dtype).view(y.dtype))
    for start, count in dispatch_chunks(n, chunk):
        lib.run(FILLS[np.dtype(np_dtype).itemsize], [y[start:start + count], ("bytes", np.array((count, bits), FILL_PARAMS))],
                grid=count, threadgroup=threadgroup_size_1d(count))
    return y.view(np_dtype)


def inputs(dtype, n, seed, scale=4.0):
    """Normal values with the specials (0, -0, NaN, +-inf, huge, tiny, subnormal) mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 80.0, -80.0, 1e-30, -1e-30, 1e-40, -20.0, 20.0], np.float32)
    k = min(n, special.size)
    x[rng.choice(n, k, replace=False)] = special[:k]
    return x.astype(DTYPES[dtype][0])


def tf_cpu(fn, *args):
    with tf.device("/CPU:0"):
        return fn(*[tf.constant(a) for a in args]).numpy()


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


def assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    if got.dtype.kind == "f" or got.dtype == ml_dtypes.bfloat16:
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        view = np.uint32 if got.dtype.itemsize == 4 else np.uint16
        np.testing.assert_array_equal(got[~nan].view(view), want[~nan].view(view))
    else:
        np.testing.assert_array_equal(got, want)


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
    return dy * y * (1 - y)


def np_elu_grad(dy, y):
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    return np.where(y < 0, dy * (y + 1), dy)


# ----------------------------------------------------------------------------


def test_library_instantiates_every_kernel(lib):
    want = sorted([f"{op}_{d}" for op in OPS for d in DTYPES] + list(FILLS.values()))
    assert lib.kernels() == want


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_is_finite_is_tfs_bit_for_bit(lib, dtype, n):
    x = inputs(dtype, n, seed=n)
    got = metal_unary(lib, "gap_is_finite", dtype, x).astype(bool)
    np.testing.assert_array_equal(got, np.isfinite(x.astype(np.float64)))
    np.testing.assert_array_equal(got, tf_cpu(tf.math.is_finite, x))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sigmoid_and_elu_agree_with_numpy_and_tf(lib, dtype, n):
    x = inputs(dtype, n, seed=n + 1)
    sig = metal_unary(lib, "gap_sigmoid", dtype, x)
    elu = metal_unary(lib, "gap_elu", dtype, x)
    # Tolerances, derived in the module docstring and tfmetal/gap_elementwise.h. Elu near 0 is exp(x) - 1 on
    # both sides: exp's error near 1 (half an ulp of 1 in float for the kernel; for TF in half/bfloat16, its
    # exp rounded to the type) survives the subtraction as an absolute error.
    if dtype == "float":
        assert_close_ulps(sig, tf_cpu(tf.sigmoid, x), dtype, 8)
        assert_close_ulps(elu, tf_cpu(tf.nn.elu, x), dtype, 8, atol=2.0 ** -21)  # (covers TF's flushed subnormals)
        assert_close_ulps(sig, np_sigmoid(x), dtype, 4)
        assert_close_ulps(elu, np_elu(x), dtype, 4, atol=2.0 ** -22)
    else:
        assert_close_ulps(sig, tf_cpu(tf.sigmoid, x), dtype, 3)  # TF rounds exp, 1 + e and 1 / (.) each
        assert_close_ulps(elu, tf_cpu(tf.nn.elu, x), dtype, 2, atol=ULP[dtype])
        assert_close_ulps(sig, np_sigmoid(x), dtype, 1)
        assert_close_ulps(elu, np_elu(x), dtype, 1, atol=2.0 ** -22)
    xf = x.astype(np.float32)
    sf = sig.astype(np.float32)
    assert (sf[xf == -np.inf] == 0).all() and (sf[xf == np.inf] == 1).all()
    assert (elu.astype(np.float32)[xf == -np.inf] == -1).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_agree_with_numpy_and_tf(lib, dtype, n):
    rng = np.random.default_rng(n + 2)
    y = rng.random(n).astype(DTYPES[dtype][0])  # a sigmoid's output
    dy = inputs(dtype, n, seed=n + 3)
    got = metal_binary(lib, "gap_sigmoid_grad", dtype, y, dy)
    want = tf_cpu(lambda a, b: tf.raw_ops.SigmoidGrad(y=a, dy=b), y, dy)
    outputs = inputs(dtype, n, seed=n + 4, scale=0.7)  # an elu's output: > -1
    outputs = np.maximum(outputs.astype(np.float32), -0.999).astype(DTYPES[dtype][0])
    got_elu = metal_binary(lib, "gap_elu_grad", dtype, dy, outputs)
    want_elu = tf_cpu(lambda a, b: tf.raw_ops.EluGrad(gradients=a, outputs=b), dy, outputs)
    ftz = 2.0 ** -126  # TF's CPU flushes subnormals
    assert_close_ulps(got, want, dtype, 1 if dtype == "float" else 2, atol=ftz)
    assert_close_ulps(got_elu, want_elu, dtype, 1 if dtype == "float" else 2, atol=ftz)
    assert_close_ulps(got, np_sigmoid_grad(y, dy), dtype, 4 if dtype == "float" else 1)
    assert_close_ulps(got_elu, np_elu_grad(dy, outputs), dtype, 2 if dtype == "float" else 1)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fill_zeros_ones_are_tfs_bit_for_bit(lib, dtype):
    np_dtype, tf_dtype = DTYPES[dtype]
    for value in (0.0, 1.0, -2.5, np.inf, -0.0):
        got = metal_fill(lib, 1037, np_dtype, value)
        with tf.device("/CPU:0"):  # a numpy scalar: eager tf.constant caches Python scalars, and -0.0 == 0.0
            want = tf.fill([1037], tf.constant(np.array(value, np_dtype))).numpy()
        assert_same_bits(got, want)
    x = inputs(dtype, 77, seed=5)
    assert_same_bits(metal_fill(lib, 77, np_dtype, 0.0), tf_cpu(tf.zeros_like, x))
    assert_same_bits(metal_fill(lib, 77, np_dtype, 1.0), tf_cpu(tf.ones_like, x))
    nan = metal_fill(lib, 9, np_dtype, np.nan)
    assert np.isnan(nan.astype(np.float32)).all()


def test_fill_bool_is_tfs(lib):
    for value in (True, False):
        got = metal_fill(lib, 1001, np.bool_, value)
        with tf.device("/CPU:0"):
            want = tf.fill([1001], tf.constant(np.array(value))).numpy()
        np.testing.assert_array_equal(got, want)


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # The host splits tensors larger than one dispatch at buffer offsets: same result with small chunks.
    x = inputs("half", 5003, seed=11)
    assert_same_bits(metal_unary(lib, "gap_sigmoid", "half", x, chunk=1000), metal_unary(lib, "gap_sigmoid", "half", x))
    fill = metal_fill(lib, 5003, np.float32, 3.0, chunk=999)
    assert (fill == 3.0).all()


def test_output_may_alias_the_input(lib):
    # The host forwards x's buffer to y when TF allows it: each thread reads its element before writing it.
    x = inputs("float", 1000, seed=3)
    want = metal_unary(lib, "gap_elu", "float", x)
    inplace = x.copy()
    dispatch(lib, "gap_elu_float", [inplace, inplace])
    assert_same_bits(inplace, want)
