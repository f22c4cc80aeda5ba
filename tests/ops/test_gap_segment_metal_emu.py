"""The UnsortedSegmentSum gap kernel (custom_ops/metal/gap_segment.metal) on the Metal emulator.

Every instantiation -- gap_unsorted_segment_sum_float, gap_unsorted_segment_sum_half,
gap_unsorted_segment_sum_bfloat -- is dispatched with the row order the host builds (its own GapSegmentOrder,
int32 and int64 ids, exported from the emulated library) and compared bit for bit with TensorFlow's own CPU
kernel, which adds each segment's rows in increasing row order in the data type (half and bfloat16 rounding
after every add), and with a numpy loop doing the same. The host's checks (shapes, num_segments, ids out of
range, negative ids dropped, no id read when data is empty) are compared with TensorFlow's errors, text
included, through the same exports.
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


class HostError(Exception):
    """The host code's InvalidArgument text."""


@pytest.fixture(scope="module")
def host(lib):
    """The host's checks and GapSegmentOrder, as gap_segment_metal.mm runs them (see `Host.prepare`)."""
    so = ctypes.CDLL(str(lib.path))
    orders = {np.dtype(np.int64): so.tfm_gap_segment_order_i64, np.dtype(np.int32): so.tfm_gap_segment_order_i32}
    for fn in orders.values():
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
    check, id_error = so.tfm_gap_segment_check, so.tfm_gap_segment_id_error
    check.restype, id_error.restype = ctypes.c_int, None
    check.argtypes = [ctypes.c_void_p, ctypes.c_int] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                            ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                            ctypes.c_char_p, ctypes.c_int]
    id_error.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_char_p, ctypes.c_int]

    def dims(shape):
        return np.array(list(shape) or [0], np.int64)

    class Host:
        @staticmethod
        def order(ids, num_segments, data_elements=1):
            """(first bad row or -1, offsets, order) for ids of their own dtype."""
            ids = np.ascontiguousarray(ids).ravel()
            offsets, rows = np.zeros(num_segments + 1, np.uint32), np.zeros(max(ids.size, 1), np.uint32)
            bad = orders[ids.dtype](ids.ctypes.data, ids.size, data_elements, num_segments, offsets.ctypes.data,
                                    rows.ctypes.data)
            return bad, offsets, rows

        @staticmethod
        def prepare(data_shape, ids, num):
            """The host code's steps before the GPU: checks, then the order; HostError with TF's text."""
            ids, num = np.asarray(ids), np.asarray(num)
            assert ids.dtype in (np.int32, np.int64) and num.dtype in (np.int32, np.int64)
            message = ctypes.create_string_buffer(4096)
            d, i, n = dims(data_shape), dims(ids.shape), dims(num.shape)
            value = np.zeros(1, np.int64)
            if not check(d.ctypes.data, len(data_shape), i.ctypes.data, ids.ndim, int(ids.dtype == np.int64),
                         n.ctypes.data, num.ndim, num.ctypes.data, int(num.dtype == np.int64), value.ctypes.data,
                         message, len(message)):
                raise HostError(message.value.decode())
            value = int(value[0])
            bad, offsets, rows = Host.order(ids, value, int(np.prod(data_shape)))
            if bad >= 0:
                id_error(i.ctypes.data, ids.ndim, bad, int(ids.ravel()[bad]), value, message, len(message))
                raise HostError(message.value.decode())
            return offsets, rows

    return Host


def metal_segment_sum(lib, host, dtype, data, ids, num_segments, chunk=None):
    ids = np.asarray(ids)
    num = np.asarray(num_segments, np.int64 if isinstance(num_segments, int) else None)
    offsets, rows = host.prepare(data.shape, ids, num)
    num_segments = offsets.size - 1
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
    """Rows added in increasing order, in the data type (one rounding per add); negative ids dropped."""
    tail = data.shape[np.ndim(ids):]
    ids = np.asarray(ids).ravel()
    rows = data.reshape((ids.size, int(np.prod(tail))))
    out = np.zeros((num_segments, rows.shape[1]), data.dtype)
    for i, s in enumerate(ids):
        if s >= 0:
            out[s] = (out[s].astype(np.float32) + rows[i].astype(np.float32)).astype(data.dtype)
    return out.reshape((num_segments,) + tail)


def tf_segment_sum(data, ids, num_segments):
    with tf.device("/CPU:0"):
        return tf.math.unsorted_segment_sum(tf.constant(data), tf.constant(ids), num_segments).numpy()


def tf_error(data_shape, ids, num):
    """TensorFlow's CPU kernel's InvalidArgument message, or None."""
    try:
        with tf.device("/CPU:0"):
            tf.raw_ops.UnsortedSegmentSum(data=tf.ones(data_shape), segment_ids=tf.constant(ids),
                                          num_segments=tf.constant(num))
    except tf.errors.InvalidArgumentError as e:
        return e.message.split("}} ", 1)[-1].split(" [Op:")[0]
    return None


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
                                  ((0, 4), (0,), 3, np.int32), ((6, 0), (6,), 2, np.int64),
                                  ((4, 3), (), 2, np.int32), ((2000, 2), (2000,), 5, np.int64)], ids=str)
def test_segment_sum_is_tfs_bit_for_bit(lib, host, dtype, case):
    data_shape, ids_shape, num_segments, id_dtype = case
    rng = np.random.default_rng(sum(data_shape))
    data = np.asarray(rng.standard_normal(data_shape), np.float32).astype(DTYPES[dtype])
    ids = rng.integers(-1, max(num_segments, 1), ids_shape).astype(id_dtype) if num_segments else \
        np.full(ids_shape, -1, id_dtype)
    got = metal_segment_sum(lib, host, dtype, data, ids, num_segments)
    assert same_bits(got, tf_segment_sum(data, ids, num_segments))
    assert same_bits(got, np_segment_sum(data, ids, num_segments))


def test_half_sums_round_after_every_add_as_tf_does(lib, host):
    # 2048 + 1 + 1 in half: each add rounds back to 2048 (the spacing there is 2), while a float
    # accumulator would give 2050. TF's CPU kernel rounds every add; so does the kernel.
    data = np.array([[2048.0], [1.0], [1.0]], np.float16)
    ids = np.array([0, 0, 0], np.int32)
    got = metal_segment_sum(lib, host, "half", data, ids, 1)
    assert got[0, 0] == 2048.0 and same_bits(got, tf_segment_sum(data, ids, 1))


def test_nan_and_inf_rows_reach_only_their_segment(lib, host):
    data = np.array([[1.0], [np.nan], [np.inf], [2.0]], np.float32)
    ids = np.array([0, 1, 2, 0])
    got = metal_segment_sum(lib, host, "float", data, ids, 4)
    assert got[0, 0] == 3.0 and np.isnan(got[1, 0]) and got[2, 0] == np.inf and got[3, 0] == 0.0


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_the_host_order_is_stable_and_drops_negative_ids(host, id_dtype):
    bad, offsets, rows = host.order(np.array([2, 0, -1, 2, 0, 2], id_dtype), 4)
    assert bad == -1
    assert list(offsets) == [0, 2, 2, 5, 5]
    assert list(rows[:5]) == [1, 4, 0, 3, 5]


def test_chunks_continue_the_global_index(lib, host):
    rng = np.random.default_rng(4)
    data = rng.standard_normal((100, 13)).astype(np.float16)
    ids = rng.integers(0, 7, 100)
    whole = metal_segment_sum(lib, host, "half", data, ids, 7)
    assert same_bits(metal_segment_sum(lib, host, "half", data, ids, 7, chunk=10), whole)


@pytest.mark.full
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_vocabulary_sized_embedding_gradient(lib, host, dtype):
    # An Embedding's gradient: 32000 segments, most empty, a padding id repeated across the batch.
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 32000, (8, 512)).astype(np.int32)
    ids[:, 400:] = 0
    data = rng.standard_normal((8, 512, 4)).astype(DTYPES[dtype])
    got = metal_segment_sum(lib, host, dtype, data, ids, 32000)
    assert same_bits(got, tf_segment_sum(data, ids, 32000))


def i32(v):
    return np.array(v, np.int32)


def i64(v):
    return np.array(v, np.int64)


# (data shape, ids, num_segments): each refused by TF's CPU kernel; the host must say the same.
REFUSED = [
    ((3,), i32([0, 3, 1]), i32(3)),                     # an id = num_segments
    ((3,), i64([0, 1, 2 ** 40]), i64(3)),               # int64 beyond int32
    ((3,), i64([0, -2 ** 40, 2 ** 33]), i32(3)),        # a negative id is dropped, not refused
    ((2, 3), i32([[0, 1, 1], [1, 9, 0]]), i32(2)),      # rank 2 ids: TF names the element [1,1]
    ((2, 2, 2), i64([[[0, 1], [1, 0]], [[1, 1], [0, 2]]]), i64(2)),
    ((4, 2), i32(5), i32(2)),                           # scalar ids
    ((3,), i32([0, 1, 1]), i32(-1)),                    # num_segments negative
    ((3,), i64([0, 1, 1]), i64(-2 ** 40)),
    ((3,), i32([0, 1, 1]), i64(2 ** 31)),               # taken in the ids' type: -2^31
    ((3,), i32([0, 1, 1]), i64(-2 ** 40)),              # taken in the ids' type: 0 segments
    ((3, 2), i32([0, 1]), i32(2)),                      # ids' shape not a prefix of data's
    ((3,), i64([0, 1, 2, 3]), i32(2)),
    ((3,), i32([0, 1, 1]), i32([2])),                   # num_segments not a scalar
    ((3, 2), i32([0, 1]), i32(-1)),                     # both: TF names the shapes first
    ((3,), i32([0, 0, 0]), i64(0)),                     # no segment at all
]


@pytest.mark.parametrize("data_shape, ids, num", REFUSED, ids=str)
def test_the_host_refuses_what_tf_refuses_with_its_text(host, data_shape, ids, num):
    want = tf_error(data_shape, ids, num)
    assert want is not None
    with pytest.raises(HostError) as e:
        host.prepare(data_shape, ids, num)
    assert str(e.value) == want


def test_num_segments_is_taken_in_the_ids_type(lib, host):
    # TF's CPU kernel casts num_segments to the ids' type: int32 ids and 2^32 + 3 segments make 3.
    data, ids, num = np.ones((3, 2), np.float16), i32([0, 2, 2]), i64(2 ** 32 + 3)
    with tf.device("/CPU:0"):
        want = tf.raw_ops.UnsortedSegmentSum(data=data, segment_ids=ids, num_segments=num).numpy()
    got = metal_segment_sum(lib, host, "half", data, ids, num)
    assert want.shape == (3, 2) and same_bits(got, want)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_no_id_is_read_when_data_is_empty(lib, host, id_dtype):
    # TF's CPU kernel returns zeros before its check when data has no element.
    ids = np.array([0, 7], id_dtype)
    assert tf_error((2, 0), ids, i32(2)) is None
    got = metal_segment_sum(lib, host, "float", np.zeros((2, 0), np.float32), ids, 2)
    assert got.shape == (2, 0)
    with pytest.raises(HostError):
        host.prepare((2, 1), ids, i32(2))
