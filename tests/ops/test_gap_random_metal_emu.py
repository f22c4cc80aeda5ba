"""The stateless-random gap kernels (custom_ops/metal/gap_random.metal) on the Metal emulator.

Every instantiation -- gap_random_uniform_float, gap_random_uniform_half, gap_random_uniform_bfloat -- is
dispatched as gap_random_metal.mm dispatches it (one thread per Philox block, chunks of whole blocks with
the counter advanced on the host) and compared bit for bit with TensorFlow's own CPU kernel of
StatelessRandomUniformV2, and with a Philox written in numpy uint64 arithmetic from the definition
(tfmetal_ext.testing.np_philox, independent of tfmetal/philox.h). StatelessRandomGetKeyCounter runs on the
host (all its arguments are in host memory): its shared function is compiled here and compared with TF's
CPU kernel, and so are both ops' argument checks.
"""

import ctypes
import shlex
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
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
# The reference: Philox-4x32-10 in numpy uint64 arithmetic, from the definition (tfmetal_ext.testing).


def np_uniform(n, key, counter, dtype):
    """StatelessRandomUniformV2 with Philox, from the definition: element i is word i % 4 of block i // 4."""
    return testing.np_stateless_uniform(n, key, counter, DTYPES[dtype][2]).astype(DTYPES[dtype][0])


def to_words(counter):
    """Two uint64 -> four uint32 (little-endian)."""
    return [counter[0] & 0xFFFFFFFF, counter[0] >> 32, counter[1] & 0xFFFFFFFF, counter[1] >> 32]


def advance(counter, g):
    """The 128-bit counter (two uint64, low first) plus g."""
    value = (counter[0] | (counter[1] << 64)) + g
    return [value & M64, (value >> 64) & M64]


# ----------------------------------------------------------------------------
# The kernel, dispatched as the host does.


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_random.metal")


def metal_uniform(lib, n, key, counter, dtype, chunk=None):
    np_dtype, _, bits = DTYPES[dtype]
    y = np.full(n, np.nan, np.float32).astype(np_dtype)
    if n == 0:
        return y  # the host returns before encoding: Metal rejects an empty dispatch
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


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 127, 1030])  # 1030: 258 blocks, more than one threadgroup
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
# The host's own C++ (not the kernel): StatelessRandomGetKeyCounter's math
# (tfmetal/gap_random.h) and both ops' argument checks (tfmetal/host_checks.h),
# compiled here and compared with TF's CPU kernels.

SHIM = r"""
#include <cstdint>
#include <cstring>
#include <string>
#include "tfmetal/gap_random.h"
#include "tfmetal/host_checks.h"
static int copy_out(const std::string& s, char* out, int cap) {
  std::strncpy(out, s.c_str(), cap - 1);
  out[cap - 1] = 0;
  return static_cast<int>(s.size());
}
extern "C" void key_counter(unsigned long long s0, unsigned long long s1, unsigned int* key, unsigned int* counter) {
  gap_key_counter_from_seed(s0, s1, key, counter);
}
extern "C" int seed_error(const int64_t* dims, int rank, char* out, int cap) {
  return copy_out(tfmetal_ext::SeedShapeError(dims, rank), out, cap);
}
extern "C" int uniform_error(int alg_rank, const int64_t* alg_dims, int alg, const int64_t* key_dims, int key_rank,
                             const int64_t* counter_dims, int counter_rank, const int64_t* shape_dims, int shape_rank,
                             const int64_t* shape, int64_t shape_len, char* out, int cap) {
  return copy_out(tfmetal_ext::StatelessUniformArgsError(alg_rank, alg_dims, alg, key_dims, key_rank, counter_dims,
                                                         counter_rank, shape_dims, shape_rank, shape, shape_len),
                  out, cap);
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the shared host functions cannot be built here")
    out = tmp_path_factory.mktemp("gap_random")
    (out / "shim.cc").write_text(SHIM)
    subprocess.run(shlex.split(compiler) + ["-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(ROOT / "custom_ops" / "include"),
                    str(out / "shim.cc"), "-o", str(out / "shim.so")], check=True, capture_output=True)
    return ctypes.CDLL(str(out / "shim.so"))


@pytest.fixture(scope="module")
def key_counter(shim):
    fn = shim.key_counter
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
    assert (got_key, got_counter) == testing.np_key_counter(seed)


def _dims(t):
    return np.array(t.shape.as_list(), np.int64)


def _message(fn, *args):
    out = ctypes.create_string_buffer(512)
    fn(*args, out, 512)
    return out.value.decode()


def _tf_error(call):
    """TF's CPU kernel's InvalidArgument message for `call`, or "" when it runs."""
    try:
        with tf.device("/CPU:0"):
            call()
    except tf.errors.InvalidArgumentError as e:
        return e.message
    return ""


@pytest.mark.parametrize("seed", [[1, 2, 3], [[1, 2]], 5, [1]])
def test_seed_shape_errors_are_tfs(shim, seed):
    seed = tf.constant(seed, tf.int64)
    dims = _dims(seed)
    ours = _message(shim.seed_error, dims.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(dims.size))
    theirs = _tf_error(lambda: tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed))
    assert ours and ours in theirs, (ours, theirs)


GOOD = {"shape": [3, 2], "key": [5], "counter": [0, 0], "alg": 1}
# One argument (or two) wrong at a time; TF reports the first in its order: alg, key, counter, shape, algorithm.
BAD_ARGS = [
    {"alg": [1]},
    {"key": [5, 6]},
    {"key": [[5]]},
    {"alg": 2, "counter": [0]},
    {"alg": 4},
    {"alg": 0},
    {"alg": 2},
    {"alg": -1},
    {"shape": [[3]]},
    {"shape": [2, -1]},
    {"key": [5, 6], "shape": [-1]},
    {"alg": 2, "shape": [-1]},
    {"counter": [[0, 0]]},
    {},
    {"alg": 3, "counter": [0, 0, 9]},
]


@pytest.mark.parametrize("bad", BAD_ARGS, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()) or "good")
@pytest.mark.parametrize("shape_dtype", [tf.int32, tf.int64])
def test_uniform_argument_errors_are_tfs(shim, bad, shape_dtype):
    args = {**GOOD, **bad}
    shape = tf.constant(args["shape"], shape_dtype)
    key, counter = tf.constant(args["key"], tf.uint64), tf.constant(args["counter"], tf.uint64)
    alg = tf.constant(args["alg"], tf.int32)
    values = shape.numpy().astype(np.int64).ravel() if shape.shape.rank == 1 else np.zeros(0, np.int64)
    dims = [_dims(t) for t in (alg, key, counter, shape)]
    p = [d.ctypes.data_as(ctypes.c_void_p) for d in dims]
    alg_value = int(alg.numpy()) if alg.shape.rank == 0 else 0
    ours = _message(shim.uniform_error, ctypes.c_int(alg.shape.rank), p[0], ctypes.c_int(alg_value),
                    p[1], ctypes.c_int(key.shape.rank), p[2], ctypes.c_int(counter.shape.rank), p[3],
                    ctypes.c_int(shape.shape.rank), values.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(values.size))
    theirs = _tf_error(lambda: tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=alg,
                                                                   dtype=tf.float32))
    if args["alg"] in (1, 3):  # for Philox TF asks for "at least 1" word (see the next test); we ask for its 2
        theirs = theirs.replace("length at least 1;", "length at least 2;")
    assert (ours == "") == (theirs == ""), (ours, theirs)
    assert ours in theirs, (ours, theirs)


def test_a_one_word_philox_counter_is_refused(shim):
    # Documented disagreement: TF's CPU kernel accepts a 1-word counter for Philox and reads a second word past
    # its end (it asks for as many words as the algorithm's id); the gap kernel asks for the 2 words Philox uses.
    one = np.array([1], np.int64)
    p = one.ctypes.data_as(ctypes.c_void_p)
    shape = np.array([3], np.int64)
    ours = _message(shim.uniform_error, ctypes.c_int(0), p, ctypes.c_int(1), p, ctypes.c_int(1), p, ctypes.c_int(1), p,
                    ctypes.c_int(1), shape.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(1))
    assert ours.startswith("counter must be a vector with length at least 2; got shape: [1].")


@pytest.mark.parametrize("shape", [[2 ** 40, 2 ** 40], [2 ** 40, 2 ** 40, -1], [2 ** 62, 2, 0], [2 ** 62, 1, 2],
                                   [-1, 2 ** 40]], ids=str)
def test_uniform_shape_overflow_is_tfs(shim, shape):
    # A shape past 2^63 - 1 elements is TF's error on the host, never an allocation of a wrapped size.
    shape_t = tf.constant(shape, tf.int64)
    key, counter, alg = tf.constant([5], tf.uint64), tf.constant([0, 0], tf.uint64), tf.constant(1, tf.int32)
    values = np.array(shape, np.int64)
    dims = [_dims(t) for t in (alg, key, counter, shape_t)]
    p = [d.ctypes.data_as(ctypes.c_void_p) for d in dims]
    ours = _message(shim.uniform_error, ctypes.c_int(0), p[0], ctypes.c_int(1), p[1], ctypes.c_int(1), p[2],
                    ctypes.c_int(1), p[3], ctypes.c_int(1), values.ctypes.data_as(ctypes.c_void_p),
                    ctypes.c_int64(values.size))
    theirs = _tf_error(lambda: tf.raw_ops.StatelessRandomUniformV2(shape=shape_t, key=key, counter=counter, alg=alg,
                                                                   dtype=tf.float32))
    assert ours and ours in theirs, (ours, theirs)
