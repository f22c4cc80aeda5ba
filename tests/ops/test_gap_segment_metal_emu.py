"""The UnsortedSegmentSum gap kernel (custom_ops/metal/gap_segment.metal) on the Metal emulator.

Every instantiation -- gap_unsorted_segment_sum_float, gap_unsorted_segment_sum_half,
gap_unsorted_segment_sum_bfloat -- is dispatched with the row order the host builds (its own GapSegmentOrder,
exported from the emulated library) and compared bit for bit with TensorFlow's own CPU kernel, which adds each
segment's rows in increasing row order in the data type (half and bfloat16 rounding after every add), and
with a numpy loop doing the same. The host's checks (ids out of range, negative ids dropped) are tested on
the same exported function.
"""

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
KERNELS = {d: f"gap_unsorted_segment_sum_{d}" for d in DTYPES}
PARAMS = np.dtype([("n", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"), ("inner", "<u4")])

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_segment.metal")


@pytest.fixture(scope="module")
def order(lib):
    fn = ctypes.CDLL(str(lib.path)).tfm_gap_segment_order_i64
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]

    def call(ids, num_segments):
        ids = np.ascontiguousarray(ids, np.int64).ravel()
        offsets, rows = np.zeros(num_segments + 1, np.uint32), np.zeros(max(ids.size, 1), np.uint32)
        bad = fn(ids.ctypes.data, ids.size, num_segments, offsets.ctypes.data, rows.ctypes.data)
        return bad, offsets, rows
    return call


def metal_segment_sum(lib, order, dtype, data, ids, num_segments, chunk=None):
    bad, offsets, rows = order(ids, num_segments)
    assert bad == -1
    inner = int(np.prod(data.shape[np.ndim(ids):]))
    out = np.full(num_segments * inner, np.nan, np.float32).astype(data.dtype)
    n = out.size
    chunk = max(n, 1) if chunk is None else chunk
    flat = np.ascontiguousarray(data).ravel()
    if flat.size == 0:
        flat = np.zeros(1, data.dtype)  # the host binds some buffer; never read
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        p = np.array((count, start & 0xFFFFFFFF, start >> 32, inner), PARAMS)
        lib.run(KERNELS[dtype], [flat, rows, offsets, out[start:start + count], ("bytes", p)], grid=count,
                threadgroup=threadgroup_size_1d(count))
    return out.reshape((num_segments,) + data.shape[np.ndim(ids):])


def np_segment_sum(data, ids, num_segments):
    """Rows added in increasing order, in the data type (one rounding per add)."""
    tail = data.shape[np.ndim(ids):]
    ids = np.asarray(ids).ravel()
    rows = data.reshape((ids.size, int(np.prod(tail))))
    out = np.zeros((num_segments, rows.shape[1]), data.dtype)
    for i, s in enumerate(ids):
        if s >= 0:
            out[s] = (out[s].astype(np.float32) + rows[i].astype(np.float32)).astype(data.dtype)
    return out.reshape((num_segments,) + tail)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    view = np.uint32 if a.dtype.itemsize == 4 else np.uint16
    nan = np.isnan(b.astype(np.float32))
    return (a.shape == b.shape and np.array_equal(np.isnan(a.astype(np.float32)), nan)
            and np.array_equal(a[~nan].view(view), b[~nan].view(view)))


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(KERNELS.values())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [((300, 7), (300,), 11, np.int32), ((40, 3, 5), (40, 3), 9, np.int64),
                                  ((64,), (64,), 1, np.int32), ((5, 4), (5,), 0, np.int64),
                                  ((0, 4), (0,), 3, np.int32), ((2000, 2), (2000,), 5, np.int64)], ids=str)
def test_segment_sum_is_tfs_bit_for_bit(lib, order, dtype, case):
    data_shape, ids_shape, num_segments, id_dtype = case
    rng = np.random.default_rng(sum(data_shape))
    data = np.asarray(rng.standard_normal(data_shape), np.float32).astype(DTYPES[dtype])
    ids = rng.integers(-1, max(num_segments, 1), ids_shape).astype(id_dtype) if num_segments else \
        np.full(ids_shape, -1, id_dtype)
    got = metal_segment_sum(lib, order, dtype, data, ids, num_segments)
    with tf.device("/CPU:0"):
        want = tf.math.unsorted_segment_sum(tf.constant(data), tf.constant(ids), num_segments).numpy()
    assert same_bits(got, want)
    assert same_bits(got, np_segment_sum(data, ids, num_segments))


def test_nan_and_inf_rows_reach_only_their_segment(lib, order):
    data = np.array([[1.0], [np.nan], [np.inf], [2.0]], np.float32)
    ids = np.array([0, 1, 2, 0])
    got = metal_segment_sum(lib, order, "float", data, ids, 4)
    assert got[0, 0] == 3.0 and np.isnan(got[1, 0]) and got[2, 0] == np.inf and got[3, 0] == 0.0


def test_the_host_order_is_stable_and_drops_negative_ids(order):
    bad, offsets, rows = order([2, 0, -1, 2, 0, 2], 4)
    assert bad == -1
    assert list(offsets) == [0, 2, 2, 5, 5]
    assert list(rows[:5]) == [1, 4, 0, 3, 5]


@pytest.mark.parametrize("ids, first_bad", [([0, 3, 1], 1), ([0, 1, 2 ** 40], 2), ([5], 0)])
def test_ids_out_of_range_are_found_as_tfs_error_names_them(order, ids, first_bad):
    bad, _, _ = order(ids, 3)
    assert bad == first_bad
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"segment_ids\[{first_bad}\] = \d+ is out of range"):
        with tf.device("/CPU:0"):
            tf.math.unsorted_segment_sum(tf.ones([len(ids)]), tf.constant(ids, tf.int64), 3)


def test_chunks_continue_the_global_index(lib, order):
    rng = np.random.default_rng(4)
    data = rng.standard_normal((100, 13)).astype(np.float16)
    ids = rng.integers(0, 7, 100)
    whole = metal_segment_sum(lib, order, "half", data, ids, 7)
    assert same_bits(metal_segment_sum(lib, order, "half", data, ids, 7, chunk=10), whole)
