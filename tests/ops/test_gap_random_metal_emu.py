"""The stateless-random gap kernels (custom_ops/metal/gap_random.metal) on the Metal emulator.

Every instantiation -- gap_random_uniform_float, gap_random_uniform_half, gap_random_uniform_bfloat -- is
dispatched as gap_random_metal.mm dispatches it (one thread per Philox block, chunks of whole blocks with
the counter advanced on the host) and compared bit for bit with TensorFlow's own CPU kernel of
StatelessRandomUniformV2, and with a Philox written here in Python integers (independent of
tfmetal/philox.h). StatelessRandomGetKeyCounter runs on the host (all its arguments are in host memory):
its shared function is compiled here and compared with TF's CPU kernel.
"""

import ctypes
import shlex
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.ops import _loader
from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32, 23), "half": (np.float16, tf.float16, 10),
          "bfloat": (ml_dtypes.bfloat16, tf.bfloat16, 7)}
KERNELS = {"float": "gap_random_uniform_float", "half": "gap_random_uniform_half",
           "bfloat": "gap_random_uniform_bfloat"}
PARAMS = np.dtype([("n", "<u4"), ("blocks", "<u4"), ("counter", "<u4", 4), ("key", "<u4", 2),
                   ("mantissa_bits", "<u4"), ("pad", "<u4")])  # tfm_gap_uniform_params
M64 = (1 << 64) - 1

emu = load_emu()
pytestmark = pytest.mark.no_keras


# ----------------------------------------------------------------------------
# Philox-4x32-10 in Python integers (Salmon et al. 2011; TF's constants).


def philox(counter_words, key_words):
    c, (k0, k1) = list(counter_words), key_words
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def to_words(counter):
    """Two uint64 -> four uint32 (little-endian)."""
    return [counter[0] & 0xFFFFFFFF, counter[0] >> 32, counter[1] & 0xFFFFFFFF, counter[1] >> 32]


def advance(counter, g):
    """The 128-bit counter (two uint64, low first) plus g."""
    value = (counter[0] | (counter[1] << 64)) + g
    return [value & M64, (value >> 64) & M64]


def np_uniform(n, key, counter, dtype):
    """StatelessRandomUniformV2 with Philox, from the definition."""
    bits = DTYPES[dtype][2]
    words = []
    for g in range(-(-n // 4)):
        words += philox(to_words(advance(counter, g)), [key & 0xFFFFFFFF, key >> 32])
    vals = np.array([(w & ((1 << bits) - 1)) / float(1 << bits) for w in words[:n]], np.float64)
    return vals.astype(DTYPES[dtype][0])


# ----------------------------------------------------------------------------
# The kernel, dispatched as the host does.


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_random.metal")


def metal_uniform(lib, n, key, counter, dtype, chunk=None):
    np_dtype, _, bits = DTYPES[dtype]
    y = np.full(n, np.nan, np.float32).astype(np_dtype)
    chunk = n if chunk is None else chunk
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        c = to_words(advance(counter, start // 4))  # the host's tfm_philox_skip to the chunk's first block
        params = np.array((count, -(-count // 4), c, (key & 0xFFFFFFFF, key >> 32), bits, 0), PARAMS)
        blocks = -(-count // 4)
        lib.run(KERNELS[dtype], [y[start:start + count], ("bytes", params)], grid=blocks,
                threadgroup=threadgroup_size_1d(blocks))
    return y


def tf_uniform(n, key, counter, dtype, alg=1):
    with tf.device("/CPU:0"):
        return tf.raw_ops.StatelessRandomUniformV2(
            shape=[n], key=tf.constant([key], tf.uint64), counter=tf.constant(counter, tf.uint64),
            alg=alg, dtype=DTYPES[dtype][1]).numpy()


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    view = np.uint32 if a.dtype.itemsize == 4 else np.uint16
    return a.shape == b.shape and np.array_equal(a.view(view), b.view(view))


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(KERNELS.values())


@pytest.mark.parametrize("n", [1, 3, 4, 5, 127, 1030])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_uniform_is_tfs_bit_for_bit(lib, dtype, n):
    key, counter = 0x0123456789ABCDEF, [0xFFFFFFFFFFFFFFF0, 7]  # the low word carries into the high one
    got = metal_uniform(lib, n, key, counter, dtype)
    assert same_bits(got, tf_uniform(n, key, counter, dtype))
    assert same_bits(got, np_uniform(n, key, counter, dtype))
    g = got.astype(np.float64)
    assert (g >= 0).all() and (g < 1).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_auto_select_is_philox_and_chunks_continue_the_stream(lib, dtype):
    key, counter = 42, [M64 - 2, M64]  # the whole 128-bit counter wraps around
    want = tf_uniform(1001, key, counter, dtype, alg=3)
    assert same_bits(metal_uniform(lib, 1001, key, counter, dtype), want)
    assert same_bits(metal_uniform(lib, 1001, key, counter, dtype, chunk=100), want)  # chunks of whole blocks


# ----------------------------------------------------------------------------
# StatelessRandomGetKeyCounter: the header's host function against TF's CPU kernel.

SHIM = r"""
#include "tfmetal/gap_random.h"
extern "C" void key_counter(unsigned long long s0, unsigned long long s1, unsigned int* key, unsigned int* counter) {
  gap_key_counter_from_seed(s0, s1, key, counter);
}
"""


@pytest.fixture(scope="module")
def key_counter(tmp_path_factory):
    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the shared host function cannot be built here")
    out = tmp_path_factory.mktemp("gap_random")
    (out / "shim.cc").write_text(SHIM)
    subprocess.run(shlex.split(compiler) + ["-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(ROOT / "custom_ops" / "include"),
                    str(out / "shim.cc"), "-o", str(out / "shim.so")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out / "shim.so"))
    fn = lib.key_counter
    fn.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p]

    def call(seed0, seed1):
        key, counter = np.zeros(2, np.uint32), np.zeros(4, np.uint32)
        fn(seed0 & M64, seed1 & M64, key.ctypes.data, counter.ctypes.data)
        return int(key[0]) | (int(key[1]) << 32), [int(counter[0]) | (int(counter[1]) << 32),
                                                   int(counter[2]) | (int(counter[3]) << 32)]
    return call


SEEDS = [(7, 42), (-1, 3), (0, 0), (2 ** 31 - 1, -(2 ** 31))]


@pytest.mark.parametrize("seed, seed_dtype", [(s, d) for s in SEEDS for d in (tf.int32, tf.int64)]
                         + [((2 ** 40, -(2 ** 50)), tf.int64)])
def test_key_counter_is_tfs(key_counter, seed, seed_dtype):
    with tf.device("/CPU:0"):
        key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.constant(seed, seed_dtype))
    got_key, got_counter = key_counter(*seed)  # int32 seeds widen with their sign, as the host code does
    assert got_key == int(key.numpy()[0]) and got_counter == [int(c) for c in counter.numpy()]
    # and from the definition: one Philox block of the seed under TF's fixed key.
    mix = philox(to_words([seed[0] & M64, seed[1] & M64]), [0x3EC8F720, 0x02461E29])
    assert got_key == mix[0] | (mix[1] << 32) and got_counter == [0, mix[2] | (mix[3] << 32)]
