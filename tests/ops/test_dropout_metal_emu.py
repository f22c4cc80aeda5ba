"""The dropout Metal kernel (custom_ops/metal/dropout.metal) on the Metal emulator.

Every instantiation -- dropout_float, dropout_half, dropout_bfloat -- is dispatched as dropout_metal.mm
dispatches it (one thread per Philox block, chunks of whole blocks told the stream position of their
first block, the seed read from a device buffer as 2 int32 or 4 words of 2 int64) and compared bit for
bit with the CPU kernels of TfmetalExt>Dropout and TfmetalExt>DropoutGrad (the one kernel serves both
ops), with TensorFlow's own stateless dropout, and with numpy (tfmetal_ext.testing.np_dropout: Philox in
numpy uint64 arithmetic from the definition).
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.ops.dropout import dtype_constants
from tfmetal_ext.testing import assert_same_bits, compiled_ops, float_bits, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32, 23), "half": (np.float16, tf.float16, 10),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16, 7)}
KERNELS = {"float": "dropout_float", "half": "dropout_half", "bfloat": "dropout_bfloat"}
PARAMS = np.dtype([("n", "<u4"), ("blocks", "<u4"), ("first_block", "<u4", 2), ("seed_is_int64", "<u4"),
                   ("mantissa_bits", "<u4"), ("rate", "<f4"), ("scale", "<f4")])  # tfm_dropout_params

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "dropout.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as dropout_metal.mm does it.


def seed_buffer(seed, seed_dtype):
    """The seed tensor's bytes as the kernel's `device const uint*` reads them."""
    return np.ascontiguousarray(np.asarray(seed, seed_dtype)).view(np.uint32).copy()


def metal_dropout(lib, dtype, x, seed, seed_dtype, rate, scale, chunk=None, out=None):
    x = np.ascontiguousarray(x).ravel()
    n = x.size
    y = np.full_like(x, np.nan) if out is None else out
    if n == 0:
        return y  # the host returns before encoding: Metal rejects an empty dispatch
    chunk = (1 << 30) if chunk is None else chunk  # whole blocks: a multiple of 4
    seeds = seed_buffer(seed, seed_dtype)
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        blocks = -(-count // 4)
        first = start // 4
        params = np.array((count, blocks, (first & 0xFFFFFFFF, first >> 32), int(seed_dtype == np.int64),
                           DTYPES[dtype][2], rate, scale), PARAMS)
        lib.run(KERNELS[dtype], [x[start:start + count], seeds, y[start:start + count], ("bytes", params)],
                grid=blocks, threadgroup=threadgroup_size_1d(blocks))
    return y


def constants(rate, dtype):
    """The wrapper's (rate, scale) for `dtype`, as a traced step rounds them."""
    with tf.Graph().as_default():
        return dtype_constants(rate, DTYPES[dtype][1])


def cpu_dropout(cpu, x, seed, seed_dtype, rate, scale, grad=False):
    op = cpu.tfmetal_ext_dropout_grad if grad else cpu.tfmetal_ext_dropout
    with tf.device("/CPU:0"):
        return op(tf.constant(x), tf.constant(seed, tf.as_dtype(seed_dtype)), rate=rate, scale=scale).numpy()


def random_input(dtype, n, seed):
    return np.random.default_rng(seed).normal(0, 2, n).astype(np.float32).astype(DTYPES[dtype][0])




# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(KERNELS.values())
    for name in KERNELS.values():
        assert [p.kind for p in lib.params(name)] == ["pointer", "pointer", "pointer", "reference"]
        assert [p.const for p in lib.params(name)][:3] == [True, True, False]
        assert lib.params(name)[3].size == PARAMS.itemsize


SEEDS = [((7, 42), np.int32), ((-3, 2 ** 31 - 1), np.int32), ((2 ** 40 + 5, -(2 ** 50)), np.int64)]


@pytest.mark.parametrize("seed, seed_dtype", SEEDS, ids=["int32", "int32_negative", "int64"])
@pytest.mark.parametrize("n", [1, 3, 5, 33, 1030, 4099])  # 1030: 258 blocks, more than one threadgroup
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_the_cpu_kernel_tensorflow_and_numpy_bit_for_bit(lib, cpu, dtype, n, seed, seed_dtype):
    rate, scale = constants(0.3, dtype)
    x = random_input(dtype, n, n)
    got = metal_dropout(lib, dtype, x, seed, seed_dtype, rate, scale)
    assert_same_bits(got, cpu_dropout(cpu, x, seed, seed_dtype, rate, scale))
    want, keep = testing.np_dropout(x, seed, rate, scale, DTYPES[dtype][2])
    assert_same_bits(got, want)
    with tf.device("/CPU:0"):  # TensorFlow's own dropout, traced (as model.fit runs it)
        stock = tf.function(lambda t: tf.nn.experimental.stateless_dropout(
            t, 0.3, seed=tf.constant(seed, tf.as_dtype(seed_dtype))))(tf.constant(x)).numpy()
    assert_same_bits(got, stock)
    if n > 1000:
        assert 0.2 < 1 - keep.mean() < 0.4


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_gradient_op_runs_the_same_kernel_on_dy(lib, cpu, dtype):
    rate, scale = constants(0.5, dtype)
    dy = random_input(dtype, 1001, 3)
    seed = (11, -12)
    got = metal_dropout(lib, dtype, dy, seed, np.int64, rate, scale)
    assert_same_bits(got, cpu_dropout(cpu, dy, seed, np.int64, rate, scale, grad=True))
    # and the forward's mask: dx is nonzero exactly where y kept x
    y = cpu_dropout(cpu, np.ones_like(dy), seed, np.int64, rate, scale)
    np.testing.assert_array_equal(got.astype(np.float32) != 0, y.astype(np.float32) != 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_non_finite_values_dropped_to_zero_or_kept(lib, cpu, dtype):
    np_dtype = DTYPES[dtype][0]
    x = np.tile(np.array([np.nan, np.inf, -np.inf, -0.0, 1e4], np.float32), 40).astype(np_dtype)
    rate, scale = constants(0.5, dtype)
    got = metal_dropout(lib, dtype, x, (1, 2), np.int32, rate, scale)
    assert_same_bits(got, cpu_dropout(cpu, x, (1, 2), np.int32, rate, scale))
    _, keep = testing.np_dropout(x, (1, 2), rate, scale, DTYPES[dtype][2])
    assert keep.any() and not keep.all()
    gf = got.astype(np.float32)
    assert (float_bits(got)[~keep] == 0).all()  # dropped: +0, NaN and infinities included
    np.testing.assert_array_equal(np.isnan(gf[keep]), np.isnan(x.astype(np.float32)[keep]))


@pytest.mark.parametrize("rate", [0.0, 0.999], ids=["rate0", "rate_near_1"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_extreme_rates(lib, cpu, dtype, rate):
    r, scale = constants(rate, dtype)
    x = random_input(dtype, 4099, 5)
    got = metal_dropout(lib, dtype, x, (5, 6), np.int64, r, scale)
    assert_same_bits(got, cpu_dropout(cpu, x, (5, 6), np.int64, r, scale))
    if rate == 0.0:
        assert_same_bits(got, x)  # everything kept, times 1
    else:
        kept = np.count_nonzero(got.astype(np.float32))
        assert kept < 40  # about 0.1% of 4099
        if dtype == "bfloat":
            assert r == 1.0 and kept == 0  # bfloat16 rounds 0.999 to 1: TensorFlow drops everything too


def test_chunks_continue_the_stream(lib):
    # The host splits tensors of more than 2^30 elements into dispatches bound at buffer offsets, each
    # told its first block; chunks of 100 elements (25 blocks, last one partial) give the one-dispatch result.
    rate, scale = constants(0.4, "half")
    x = random_input("half", 5003, 9)
    whole = metal_dropout(lib, "half", x, (3, 4), np.int64, rate, scale)
    assert_same_bits(metal_dropout(lib, "half", x, (3, 4), np.int64, rate, scale, chunk=100), whole)


def test_output_may_alias_the_input(lib):
    rate, scale = constants(0.3, "float")
    x = random_input("float", 1001, 1)
    want = metal_dropout(lib, "float", x, (8, 9), np.int32, rate, scale)
    inplace = x.copy()
    metal_dropout(lib, "float", inplace, (8, 9), np.int32, rate, scale, out=inplace)
    assert_same_bits(inplace, want)


def test_threads_past_the_end_write_nothing(lib):
    # dispatchThreadgroups: full threadgroups; the threads past ceil(33 / 4) = 9 blocks must not write.
    n, extra = 33, 31
    x = random_input("bfloat", n + extra, 2)
    out = np.full(n + extra, 9, ml_dtypes.bfloat16)
    rate, scale = constants(0.3, "bfloat")
    params = np.array((n, 9, (0, 0), 0, 7, rate, scale), PARAMS)
    lib.run(KERNELS["bfloat"], [x, seed_buffer((1, 2), np.int32), out, ("bytes", params)], threadgroups=2,
            threadgroup=32)
    np.testing.assert_array_equal(out[n:].astype(np.float32), 9.0)
    assert not np.isnan(out[:n].astype(np.float32)).any()


@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_threadgroup_order_does_not_matter(lib, order):
    rate, scale = constants(0.3, "float")
    x = random_input("float", 5000, 13)
    want = metal_dropout(lib, "float", x, (1, 1), np.int64, rate, scale)
    y = np.full_like(x, np.nan)
    params = np.array((x.size, 1250, (0, 0), 1, 23, rate, scale), PARAMS)
    lib.run(KERNELS["float"], [x, seed_buffer((1, 1), np.int64), y, ("bytes", params)], grid=1250,
            threadgroup=threadgroup_size_1d(1250), order=order, seed=1)
    assert_same_bits(y, want)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernel through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(cpu, dtype):
    rate, scale = constants(0.3, dtype)
    x = random_input(dtype, 100003, 17)
    for seed, seed_dtype in SEEDS:
        with tf.device("/GPU:0"):
            s = tf.constant(seed, tf.as_dtype(seed_dtype))
            y = cpu.tfmetal_ext_dropout(tf.constant(x), s, rate=rate, scale=scale)
            dx = cpu.tfmetal_ext_dropout_grad(tf.constant(x), s, rate=rate, scale=scale)
        assert "GPU" in y.device and "GPU" in dx.device
        assert_same_bits(y.numpy(), cpu_dropout(cpu, x, seed, seed_dtype, rate, scale))
        assert_same_bits(dx.numpy(), y.numpy())
