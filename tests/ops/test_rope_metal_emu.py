"""The rotary-embedding Metal kernels (custom_ops/metal/rope.metal) on the Metal emulator.

Every instantiation -- rope_float, rope_half, rope_bfloat, rope_grad_float,
rope_grad_half, rope_grad_bfloat -- is dispatched the way rope_metal.mm
dispatches it (dispatchThreads over the feature pairs, the helper's
threadgroup size, chunks whose first pair goes in the params) and compared
with numpy written from the definition (float32 angle, float64 rotation) and
with the CPU kernel (same math from tfmetal/rope.h; the emulator's cos/sin
are the C library's, as the CPU kernel's are, so bit for bit here).
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.testing import compiled_ops, dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
FORWARD = {"float": "rope_float", "half": "rope_half", "bfloat": "rope_bfloat"}
GRAD = {"float": "rope_grad_float", "half": "rope_grad_half", "bfloat": "rope_grad_bfloat"}
ROUNDOFF = {"float": 2.0 ** -24, "half": 2.0 ** -11, "bfloat": 2.0 ** -8}
PARAMS = np.dtype([("count", "<u4"), ("first_lo", "<u4"), ("first_hi", "<u4"), ("half", "<u4"), ("inner", "<u4"),
                   ("sequence", "<u4"), ("position_batch_stride", "<u4"), ("scale", "<f4")])  # tfm_rope_params

emu = load_emu()

pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "rope.metal")


def run(lib, name, x, positions, inv_freq, scale=1.0, chunk=None, out=None):
    """rope_metal.mm's dispatch: x [B, T, ..., D], positions [T] or [1 or B, T]."""
    b, t, half = x.shape[0], x.shape[1], x.shape[-1] // 2
    inner = int(np.prod(x.shape[2:-1]))
    stride = t if positions.ndim == 2 and positions.shape[0] > 1 else 0
    pairs = b * t * inner * half
    flat = np.ascontiguousarray(x).ravel()
    y = np.full_like(flat, np.nan) if out is None else out
    for start, count in dispatch_chunks(pairs, chunk):
        params = np.array((count, start & 0xFFFFFFFF, start >> 32, half, inner, t, stride, scale), PARAMS)
        lib.run(name, [flat, positions.astype(np.float32).ravel(), inv_freq, y, ("bytes", params)], grid=count,
                threadgroup=threadgroup_size_1d(count))
    return y.reshape(x.shape)


def inputs(dtype, shape, seed, batched=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 2, shape).astype(np.float32).astype(DTYPES[dtype])
    positions = (rng.integers(0, 4000, (shape[0], shape[1])) if batched else np.arange(shape[1]) + 5).astype(
        np.float32)
    inv_freq = (10000.0 ** -(np.arange(0, shape[-1], 2) / shape[-1])).astype(np.float32)
    return x, positions, inv_freq


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(list(FORWARD.values()) + list(GRAD.values()))
    for name in lib.kernels():
        assert [p.kind for p in lib.params(name)] == ["pointer"] * 4 + ["reference"]
        assert [p.const for p in lib.params(name)][:4] == [True, True, True, False]
        assert lib.params(name)[4].size == PARAMS.itemsize


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("direction", ["forward", "grad"])
@pytest.mark.parametrize("shape, batched", [((2, 7, 3, 10), False), ((3, 5, 8), True)])
def test_matches_numpy_and_the_cpu_kernel(lib, dtype, direction, shape, batched):
    x, positions, inv_freq = inputs(dtype, shape, seed=len(shape) + len(dtype), batched=batched)
    inverse = direction == "grad"
    name = (GRAD if inverse else FORWARD)[dtype]
    got = run(lib, name, x, positions, inv_freq)
    exact = testing.np_rope(x.astype(np.float64), positions, inv_freq, inverse=inverse)
    half = shape[-1] // 2
    xf = np.abs(x.astype(np.float64))
    mag = np.concatenate([xf[..., :half] + xf[..., half:]] * 2, -1)  # >= |x1 c| + |x2 s|
    u = ROUNDOFF[dtype]
    # Rounded once from float32: within u |y| plus the float32 error (cos/sin, products, sum: < 8 * 2^-24 M).
    assert (np.abs(got.astype(np.float64) - exact) <= u * np.abs(exact) + 8 * 2.0 ** -24 * mag + 1e-7).all()
    cpu = compiled_ops()
    op = cpu.tfmetal_ext_rope_grad if inverse else cpu.tfmetal_ext_rope
    want = op(tf.constant(x), tf.constant(positions), tf.constant(inv_freq)).numpy()
    np.testing.assert_array_equal(bits(got), bits(want))


def test_scale_multiplies_cos_and_sin(lib):
    x, positions, inv_freq = inputs("float", (1, 6, 2, 8), seed=3)
    got = run(lib, FORWARD["float"], x, positions, inv_freq, scale=1.25)
    np.testing.assert_allclose(got, testing.np_rope(x, positions, inv_freq, scale=1.25), rtol=0, atol=1e-5)


def test_chunks_cover_every_pair_once(lib):
    # The host splits more than 2^30 pairs into dispatches that carry their first pair.
    x, positions, inv_freq = inputs("half", (3, 11, 5, 12), seed=4, batched=True)
    whole = run(lib, FORWARD["half"], x, positions, inv_freq)
    np.testing.assert_array_equal(bits(run(lib, FORWARD["half"], x, positions, inv_freq, chunk=37)), bits(whole))


def test_output_may_alias_the_input(lib):
    x, positions, inv_freq = inputs("bfloat", (2, 4, 3, 8), seed=5)
    want = run(lib, GRAD["bfloat"], x, positions, inv_freq)
    inplace = np.ascontiguousarray(x).ravel().copy()
    params = np.array((inplace.size // 2, 0, 0, 4, 3, 4, 0, 1.0), PARAMS)
    lib.run(GRAD["bfloat"], [inplace, positions, inv_freq, inplace, ("bytes", params)], grid=inplace.size // 2,
            threadgroup=32)
    np.testing.assert_array_equal(bits(inplace.reshape(x.shape)), bits(want))


def test_threads_past_the_end_write_nothing(lib):
    x, positions, inv_freq = inputs("float", (1, 3, 1, 8), seed=6)
    pairs = 12
    y = np.full(x.size + 8, 9.0, np.float32)
    params = np.array((pairs, 0, 0, 4, 1, 3, 0, 1.0), PARAMS)
    lib.run(FORWARD["float"], [x.ravel(), positions, inv_freq, y, ("bytes", params)], threadgroups=1, threadgroup=32)
    np.testing.assert_array_equal(y[x.size:], 9.0)
    assert not np.isnan(y[:x.size]).any()


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels_to_an_ulp_of_cos(dtype):
    # Metal's precise cos/sin need not be the C library's bit for bit: within the float32 rotation's bound.
    cpu = compiled_ops()
    x, positions, inv_freq = inputs(dtype, (2, 64, 4, 64), seed=7)
    args = (tf.constant(x), tf.constant(positions), tf.constant(inv_freq))
    with tf.device("/GPU:0"):
        y, dx = cpu.tfmetal_ext_rope(*args), cpu.tfmetal_ext_rope_grad(*args)
    assert "GPU" in y.device and "GPU" in dx.device
    for got, inverse in ((y, False), (dx, True)):
        exact = testing.np_rope(x.astype(np.float64), positions, inv_freq, inverse=inverse)
        u = ROUNDOFF[dtype]
        mag = np.abs(x.astype(np.float64)).max()
        assert (np.abs(got.numpy().astype(np.float64) - exact) <= u * np.abs(exact) + 16 * 2.0 ** -24 * mag * 2).all()
