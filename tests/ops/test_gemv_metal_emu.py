"""The gemv Metal kernel (custom_ops/metal/gemv.metal) on the Metal emulator.

Every instantiation -- gemv_float, gemv_half, gemv_bfloat -- is dispatched the
way gemv_metal.mm dispatches it (dispatchThreads over a grid of N columns by
the rows of the dispatch, metal_helper's ThreadgroupSize1D along the columns,
whole rows per dispatch with the first row in the params) and compared with

- a float64 numpy product, within the bound of a float32 sum of K fused
  multiply-adds and the rounding to T (derived at ERROR_BOUND below);
- a numpy model of tfmetal/gemv.h's order (+0.0, then one correctly rounded
  float32 fma per k in increasing order, then the bias, then T), bit for bit;
- the CPU kernel of TfmetalExt>Gemv in the op library, bit for bit (the same
  order: that is what the shared header is for).

Shapes stay small: the emulator runs each thread of a threadgroup on an OS thread.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import compiled_ops, dispatch_chunks, load_emu, max_elements_per_dispatch, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
KERNELS = {"float": "gemv_float", "half": "gemv_half", "bfloat": "gemv_bfloat"}
PARAMS = np.dtype([("first_row", "<u4"), ("rows", "<u4"), ("k", "<u4"), ("n", "<u4"),
                   ("has_bias", "<u4")])  # tfm_gemv_params (custom_ops/metal/gemv.h)
CPU_KERNEL_MISSING = "the CPU kernel of TfmetalExt>Gemv is not built"

# ERROR_BOUND: how far a stored output may be from the exact x @ w + b (float64 here).
# With u = 2^-24 (float32) and S = sum_k |x_k w_k|: each of the K fma steps rounds once,
# acc_k = (acc_{k-1} + x_k w_k)(1 + d_k) with |d_k| <= u, so the finished sum is within
# gamma_K S of sum_k x_k w_k (gamma_j = j u / (1 - j u), the bound of recursive summation);
# the bias addition rounds once more, within u (|acc| + |b|) <= u (1 + gamma_K) S + u |b|.
# Together within gamma_{K+1} S + u |b| <= 1.01 (K + 1) u S + u |b| for (K + 1) u <= 0.009.
# Products and partial sums that fall below float32's normal range lose at most 2^-150 a
# step more: (K + 1) 2^-149 covers them. Call that float32 bound e32. The float32 result z
# is then rounded to T once: within TO_T[T] |z| (half 2^-11, bfloat16 2^-8, float32: already
# there) plus half T's subnormal spacing (half 2^-25; bfloat16 has float32's range), with
# |z| <= |exact| + e32. Total: e32 + TO_T[T] (|exact| + e32) + SUBNORMAL_T[T].
U32 = 2.0 ** -24
TO_T = {"float": 0.0, "half": 2.0 ** -11, "bfloat": 2.0 ** -8}
SUBNORMAL_T = {"float": 0.0, "half": 2.0 ** -25, "bfloat": 2.0 ** -134}

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gemv.metal")


def run(lib, name, x, w, bias, has_bias, rows_per_dispatch=None, order="linear"):
    """gemv_metal.mm's dispatch: x [M, K], w [K, N], bias [N] or [0] -> y [M, N] (NaN where never written)."""
    m, k = x.shape
    n = w.shape[1]
    y = np.full((m, n), np.nan, x.dtype)
    if m == 0 or n == 0:
        return y  # the host encodes nothing: Metal (and the emulator) reject an empty grid
    flat = y.reshape(-1)
    # As the host binds them: y stands in for an empty x and w (K == 0) and for the bias without has_bias.
    xs = x.reshape(-1) if x.size else flat
    ws = w.reshape(-1) if w.size else flat
    bs = bias if bias.size else flat
    limit = max_elements_per_dispatch()
    per = rows_per_dispatch or (1 if n >= limit else limit // n)
    for first, rows in dispatch_chunks(m, per):
        params = np.array((first, rows, k, n, int(has_bias)), PARAMS)
        lib.run(name, [xs, ws, bs, flat, ("bytes", params)], grid=(n, rows), threadgroup=threadgroup_size_1d(n),
                order=order)
    return y


def inputs(dtype, m, k, n, seed):
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype]
    x = rng.normal(0, 1, (m, k)).astype(np.float32).astype(t)
    w = rng.normal(0, 1 / np.sqrt(max(k, 1)), (k, n)).astype(np.float32).astype(t)
    bias = rng.normal(0, 1, n).astype(np.float32).astype(t)
    return x, w, bias


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def fma32(a, b, c):
    """float32 fma(a, b, c), rounded once, elementwise.

    a * b of two float32 is exact in float64; the float64 sum is rounded to odd
    (TwoSum's error says which way the exact sum lies when it is not representable),
    and a round-to-odd result with 53 >= 24 + 2 bits rounds to float32 as the exact
    sum would: one correct rounding, as the hardware fma.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        back = s - p
        err = (p - (s - back)) + (c - back)
        even = (s.view(np.uint64) & 1) == 0
        nudge = np.isfinite(s) & (err != 0) & even
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def np_gemv_ordered(x, w, bias, has_bias):
    """tfmetal/gemv.h's rounding in numpy: +0.0, fma per k in increasing order, + bias in float32, then T."""
    m, k = x.shape
    acc = np.zeros((m, w.shape[1]), np.float32)
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    for i in range(k):
        acc = fma32(xf[:, i:i + 1], wf[i:i + 1, :], acc)
    if has_bias:
        with np.errstate(invalid="ignore", over="ignore"):
            acc = acc + bias.astype(np.float32)
    return acc.astype(x.dtype)


def error_bound(dtype, x, w, bias, has_bias):
    """ERROR_BOUND (above) for every output, in float64."""
    k = x.shape[1]
    s = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    b = np.abs(bias.astype(np.float64)) if has_bias else 0.0
    exact = x.astype(np.float64) @ w.astype(np.float64) + (bias.astype(np.float64) if has_bias else 0.0)
    e32 = 1.01 * (k + 1) * U32 * s + U32 * b + (k + 1) * 2.0 ** -149
    return exact, e32 + TO_T[dtype] * (np.abs(exact) + e32) + SUBNORMAL_T[dtype]


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(KERNELS.values())
    for name in lib.kernels():
        assert [p.kind for p in lib.params(name)] == ["pointer"] * 4 + ["reference"]
        assert [p.const for p in lib.params(name)][:4] == [True, True, True, False]
        assert lib.params(name)[4].size == PARAMS.itemsize


# K and N not multiples of the unroll (4) or of the threadgroup width (256 for N = 300:
# a full and a partial threadgroup per row); K < 4 runs the remainder loop only.
@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k, n", [(37, 300), (8, 64), (3, 33)])
def test_matches_numpy(lib, dtype, has_bias, m, k, n):
    x, w, bias = inputs(dtype, m, k, n, seed=m * 1000 + k * 10 + len(dtype))
    b = bias if has_bias else bias[:0]
    got = run(lib, KERNELS[dtype], x, w, b, has_bias)
    exact, bound = error_bound(dtype, x, w, bias, has_bias)
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all()
    np.testing.assert_array_equal(bits(got), bits(np_gemv_ordered(x, w, b, has_bias)))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_bias", [False, True])
def test_k_zero_gives_the_bias_or_zero(lib, dtype, has_bias):
    # The loop does not run: +0.0 (never -0.0), plus the bias in float32, so a -0.0 bias gives +0.0.
    t = DTYPES[dtype]
    x, w = np.zeros((3, 0), t), np.zeros((0, 5), t)
    bias = np.array([1.5, -0.0, -2.25, 0.0, 3.0], np.float32).astype(t)
    got = run(lib, KERNELS[dtype], x, w, bias if has_bias else bias[:0], has_bias)
    want = np.broadcast_to(np.float32(0.0) + (bias.astype(np.float32) if has_bias else np.float32(0.0)), (3, 5))
    np.testing.assert_array_equal(bits(got), bits(want.astype(t)))
    assert not np.signbit(got[:, 1]).any()


@pytest.mark.parametrize("m, n", [(0, 7), (4, 0), (0, 0)])
def test_empty_outputs_dispatch_nothing(lib, m, n):
    # The host returns before encoding: Metal rejects an empty dispatch, as the emulator does.
    x, w, bias = inputs("float", m, 5, n, seed=1)
    assert run(lib, KERNELS["float"], x, w, bias, True).shape == (m, n)
    params = np.array((0, max(m, 1), 5, max(n, 1), 1), PARAMS)
    placeholder = np.zeros(8, np.float32)
    with pytest.raises(emu.EmuError, match="empty dispatches"):
        lib.run(KERNELS["float"], [placeholder] * 4 + [("bytes", params)], grid=(n, m), threadgroup=32)


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_propagate(lib, dtype):
    x, w, bias = inputs(dtype, 3, 9, 40, seed=2)
    x[0, 4] = np.nan   # row 0: NaN everywhere
    w[2, 7] = np.inf   # column 7 of rows 1 and 2: +-inf (x[r, 2] != 0)
    x[2, 5] = 0.0
    w[5, 11] = np.inf  # column 11: +-inf in row 1, 0 * inf = NaN in row 2
    bias[20] = np.nan  # column 20: NaN with the bias
    bias[21] = -np.inf  # column 21: -inf with the bias
    for has_bias in (False, True):
        b = bias if has_bias else bias[:0]
        got = run(lib, KERNELS[dtype], x, w, b, has_bias).astype(np.float64)
        with np.errstate(invalid="ignore"):  # elementwise, not BLAS: IEEE 0 * inf and NaN for sure
            exact = (x.astype(np.float64)[:, :, None] * w.astype(np.float64)[None]).sum(1)
            exact = exact + (bias.astype(np.float64) if has_bias else 0.0)
        assert np.isnan(got[0]).all() and np.isnan(got[2, 11]) and np.isinf(got[1:, 7]).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exact))
        inf = np.isinf(exact)
        np.testing.assert_array_equal(got[inf], exact[inf])
        assert np.isfinite(got[~np.isnan(exact) & ~inf]).all()
        if has_bias:
            assert np.isnan(got[:, 20]).all() and (got[1:, 21] == -np.inf).all()


def test_rows_in_several_dispatches(lib):
    # The host dispatches whole rows, as many as fit in 2^30 threads: smaller chunks here, each
    # carrying its first row, in shuffled threadgroup order, give the same bits as one dispatch.
    x, w, bias = inputs("half", 5, 13, 70, seed=3)
    whole = run(lib, KERNELS["half"], x, w, bias, True)
    for per in (1, 2):
        chunked = run(lib, KERNELS["half"], x, w, bias, True, rows_per_dispatch=per, order="shuffle")
        np.testing.assert_array_equal(bits(chunked), bits(whole))


def test_threads_past_the_end_write_nothing(lib):
    # Whole threadgroups (dispatchThreadgroups) overhang the grid on both axes: only y is written.
    x, w, bias = inputs("float", 2, 6, 40, seed=4)
    y = np.full(2 * 40 + 16, 9.0, np.float32)
    params = np.array((0, 2, 6, 40, 1), PARAMS)
    lib.run(KERNELS["float"], [x.reshape(-1), w.reshape(-1), bias, y, ("bytes", params)], threadgroups=(2, 3),
            threadgroup=(32, 1))
    np.testing.assert_array_equal(y[80:], 9.0)
    np.testing.assert_array_equal(bits(y[:80].reshape(2, 40)), bits(np_gemv_ordered(x, w, bias, True)))


def test_the_model_rounds_each_step_once():
    # The numpy model's fma is one rounding, as the kernels' is. Not a float32 product then a sum:
    # (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46, which a rounded product loses the 2^-46 of.
    a = np.array([1 + 2.0 ** -23], np.float32)
    assert fma32(a, a, np.array([-(1 + 2.0 ** -22)], np.float32))[0] == np.float32(2.0 ** -46)
    # Nor float64 then float32: 1 + 2^-23 - 2^-24 (1 - 2^-30) is 2^-54 above the float32 tie
    # 1 + 2^-24, so it rounds up; float64 rounds it onto the tie, which float32 then rounds to even.
    x = np.array([-(1 + 2.0 ** -15)], np.float32)
    w = np.array([(1 - 2.0 ** -15) * 2.0 ** -24], np.float32)
    c = np.array([1 + 2.0 ** -23], np.float32)
    assert (x.astype(np.float64) * w + c).astype(np.float32)[0] == np.float32(1.0)
    assert fma32(x, w, c)[0] == np.float32(1 + 2.0 ** -23)


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("m, k, n", [(3, 37, 300), (1, 0, 6)])
def test_bit_for_bit_with_the_cpu_kernel(lib, dtype, has_bias, m, k, n):
    cpu = compiled_ops()
    if not hasattr(cpu, "tfmetal_ext_gemv"):
        pytest.skip(CPU_KERNEL_MISSING)
    x, w, bias = inputs(dtype, m, k, n, seed=5 + k)
    b = bias if has_bias else bias[:0]
    got = run(lib, KERNELS[dtype], x, w, b, has_bias)
    want = cpu.tfmetal_ext_gemv(tf.constant(x), tf.constant(w), tf.constant(b), has_bias=has_bias).numpy()
    np.testing.assert_array_equal(bits(got), bits(want))


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernel through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernel_matches_the_cpu_kernel_bit_for_bit(dtype):
    # Metal's fma rounds once (fast math is off), so the GPU's sums are the CPU's, step for step.
    cpu = compiled_ops()
    x, w, bias = inputs(dtype, 4, 517, 1000, seed=6)
    args = (tf.constant(x), tf.constant(w), tf.constant(bias))
    with tf.device("/GPU:0"):
        got = cpu.tfmetal_ext_gemv(*args, has_bias=True)
    with tf.device("/CPU:0"):
        want = cpu.tfmetal_ext_gemv(*args, has_bias=True)
    assert "GPU" in got.device and "CPU" in want.device
    want = want.numpy()
    np.testing.assert_array_equal(bits(got.numpy()), bits(want))
