"""The ReverseV2 / ReverseSequence gap kernels (custom_ops/metal/gap_reverse.metal) on the Metal emulator.

Every instantiation -- gap_reverse_2, gap_reverse_4, gap_reverse_sequence_2, gap_reverse_sequence_4 (half and
bfloat16; float) -- is dispatched as gap_reverse_metal.mm dispatches it (one thread per output element, chunks
bound at their first output), with the geometry the host computes (its GapReversePlan /
GapReverseSequenceCheck, exported from the emulated library), and compared bit for bit with numpy (np.flip,
and a per-row slice reversal written here) and with TensorFlow's own CPU kernels of the ops. The host's checks
are compared with TensorFlow's errors, text and code included.
"""

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
VIEWS = {2: np.uint16, 4: np.uint32}
REVERSE_PARAMS = np.dtype([("n", "<u4"), ("rank", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"),
                           ("reversed", "<u4"), ("wide", "<u4"), ("pad", "<u4", 2), ("dims", "<u4", 8)])  # tfm_gap_reverse_params
SEQUENCE_PARAMS = np.dtype([("n", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"), ("wide", "<u4"),
                            ("dim_b", "<u4"), ("dim_s", "<u4"), ("stride_b_lo", "<u4"), ("stride_b_hi", "<u4"),
                            ("stride_s_lo", "<u4"), ("stride_s_hi", "<u4"), ("pad", "<u4", 2)])
DTYPES = {"float32": (np.float32, tf.float32), "float16": (np.float16, tf.float16),
          "bfloat16": (ml_dtypes.bfloat16, tf.bfloat16)}
TF_CODES = {3: tf.errors.InvalidArgumentError, 12: tf.errors.UnimplementedError}

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_reverse.metal")


class HostError(Exception):
    """The host code's error: (TF_Code, message)."""


@pytest.fixture(scope="module")
def host(lib):
    so = ctypes.CDLL(str(lib.path))
    plan, seq = so.tfm_gap_reverse_plan, so.tfm_gap_reverse_sequence_plan
    plan.restype = seq.restype = ctypes.c_int
    plan.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    seq.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]

    def call_plan(shape, axes, axis_rank=1):
        dims = np.array(list(shape) or [0], np.int64)
        flat = np.array(np.ravel(axes).tolist() or [0], np.int64)
        p, identity, message = np.zeros(1, REVERSE_PARAMS), ctypes.c_int(0), ctypes.create_string_buffer(512)
        code = plan(dims.ctypes.data, len(shape), axis_rank, flat.ctypes.data, np.size(axes), p.ctypes.data,
                    ctypes.byref(identity), message, 512)
        if code:
            raise HostError(code, message.value.decode())
        return p, bool(identity.value)

    def call_seq(shape, lengths, seq_dim, batch_dim, wide=False, len_rank=1):
        dims = np.array(list(shape) or [0], np.int64)
        flat = np.array(np.ravel(lengths).tolist() or [0], np.int64)
        p, message = np.zeros(1, SEQUENCE_PARAMS), ctypes.create_string_buffer(512)
        code = seq(dims.ctypes.data, len(shape), seq_dim, batch_dim, len_rank, flat.ctypes.data, np.size(lengths),
                   int(wide), p.ctypes.data, message, 512)
        if code:
            raise HostError(code, message.value.decode())
        return p

    return type("Host", (), {"plan": staticmethod(call_plan), "seq": staticmethod(call_seq)})


def _chunks(n, chunk):
    chunk = n if chunk is None else chunk
    return [(s, min(chunk, n - s)) for s in range(0, n, chunk)]


def metal_reverse(lib, host, x, axes, chunk=None):
    """ReverseV2 as the host code runs it: its plan, then one thread per output (per chunk)."""
    p, identity = host.plan(x.shape, axes)
    if identity or x.size == 0:
        return x.copy()
    size = x.dtype.itemsize
    src = np.ascontiguousarray(x).ravel().view(VIEWS[size])
    out = np.zeros(x.size, VIEWS[size])
    for start, count in _chunks(x.size, chunk):
        q = p.copy()
        q["n"], q["start_lo"], q["start_hi"] = count, start & 0xFFFFFFFF, start >> 32
        lib.run(f"gap_reverse_{size}", [src, out[start:start + count], ("bytes", q)], grid=count,
                threadgroup=threadgroup_size_1d(count))
    return out.view(x.dtype).reshape(x.shape)


def metal_reverse_sequence(lib, host, x, lengths, seq_dim, batch_dim, chunk=None):
    lengths = np.asarray(lengths)
    wide = lengths.dtype == np.int64
    p = host.seq(x.shape, lengths.tolist(), seq_dim, batch_dim, wide=wide)
    size = x.dtype.itemsize
    out = np.zeros(x.size, VIEWS[size])
    if x.size == 0:
        return out.view(x.dtype).reshape(x.shape)
    src = np.ascontiguousarray(x).ravel().view(VIEWS[size])
    words = np.ascontiguousarray(lengths).view(np.int32)  # the host's buffer: the tensor's bytes, int32 words
    for start, count in _chunks(x.size, chunk):
        q = p.copy()
        q["n"], q["start_lo"], q["start_hi"] = count, start & 0xFFFFFFFF, start >> 32
        lib.run(f"gap_reverse_sequence_{size}", [src, out[start:start + count], words, ("bytes", q)], grid=count,
                threadgroup=threadgroup_size_1d(count))
    return out.view(x.dtype).reshape(x.shape)


def np_reverse_sequence(x, lengths, seq_dim, batch_dim):
    """From the definition: for each batch entry b, its first lengths[b] steps along seq_dim reversed."""
    out = x.copy()
    for b, n in enumerate(lengths):
        index = [slice(None)] * x.ndim
        index[batch_dim] = b
        index[seq_dim] = slice(0, int(n))
        part = x[tuple(index)]
        axis = seq_dim - (1 if batch_dim < seq_dim else 0)  # seq_dim's position once batch_dim is indexed away
        out[tuple(index)] = np.flip(part, axis=axis)
    return out


def values(shape, dtype, seed=0):
    """Distinct values with NaN, -0.0 and infinities (a copy moves bits, never arithmetic)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf], np.float32)
    x[: min(x.size, 4)] = specials[: min(x.size, 4)]
    return x.astype(DTYPES[dtype][0]).reshape(shape)


def tf_cpu(fn, **kw):
    with tf.device("/CPU:0"):
        return fn(**kw).numpy()


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_library_instantiates_every_kernel(lib):
    assert lib.kernels() == sorted(["gap_reverse_2", "gap_reverse_4", "gap_reverse_sequence_2",
                                    "gap_reverse_sequence_4"])


REVERSE_CASES = [
    ((7,), [0]), ((2, 3, 4), [1]), ((2, 3, 4), [-1]), ((2, 3, 4), [0, 2]), ((2, 3, 4), [0, 1, 2]),
    ((5, 1, 6), [1]),  # only a size-1 axis: the input itself
    ((5, 1, 6), [0, 1]), ((3, 4), []), ((33, 65), [0]), ((4, 0, 3), [2]), ((1, 2, 1, 3, 1, 2, 1, 2), [1, 3, 5]),
    ((2, 2, 2, 2, 2, 2, 2, 2), [0, 2, 4, 6]),  # alternating: eight collapsed dimensions
]


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reverse_is_numpys_and_tfs_bit_for_bit(lib, host, dtype):
    for i, (shape, axes) in enumerate(REVERSE_CASES):
        x = values(shape, dtype, seed=i)
        got = metal_reverse(lib, host, x, axes)
        assert same_bits(got, np.flip(x, axis=tuple(axes)) if axes else x), (shape, axes)
        for axis_dtype in (tf.int32, tf.int64):
            want = tf_cpu(tf.raw_ops.ReverseV2, tensor=tf.constant(x, DTYPES[dtype][1]),
                          axis=tf.constant(axes, axis_dtype))
            assert same_bits(got, want), (shape, axes)


def test_reverse_chunks(lib, host):
    x = values((9, 37, 5), "float32", seed=3)
    assert same_bits(metal_reverse(lib, host, x, [0, 2], chunk=100), np.flip(x, axis=(0, 2)))  # chunks mid-row


def test_index_mappings_above_2_to_the_32(lib, host):
    # Indices at and above 2^32 take the 64-bit branches (the emulator cannot dispatch that many threads):
    # the exported mappings against the exact integer formulas.
    so = ctypes.CDLL(str(lib.path))
    rev, seq = so.tfm_gap_reverse_source, so.tfm_gap_reverse_sequence_source
    rev.restype = seq.restype = ctypes.c_uint64
    rev.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    seq.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
    rows, cols = 2 ** 21, 2 ** 13  # 2^34 elements
    p, _ = host.plan((rows, cols), [0])
    assert int(p["wide"][0]) == 1 and int(host.plan((rows, 2 ** 10), [0])[0]["wide"][0]) == 0
    lengths = np.array([rows - 5, 3], np.int64)
    q = host.seq((2, rows, cols), lengths.tolist(), 1, 0, wide=True)
    rng = np.random.default_rng(0)
    for index in [2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, rows * cols - 1] + rng.integers(0, rows * cols, 20).tolist():
        r, c = divmod(index, cols)
        assert rev(p.ctypes.data, index) == (rows - 1 - r) * cols + c
        for b in (0, 1):
            i = b * rows * cols + index
            s = r if r >= lengths[b] else lengths[b] - 1 - r
            assert seq(q.ctypes.data, i, lengths.ctypes.data) == b * rows * cols + s * cols + c


def test_reverse_plan_collapses_to_runs(host):
    p, identity = host.plan((2, 3, 1, 4, 5), [1, 3])  # size-1 dropped, axes 1 and 3 merge into one run
    assert not identity
    assert p["dims"][0][: int(p["rank"][0])].tolist() == [2, 12, 5] and int(p["reversed"][0]) == 0b010
    assert host.plan((), [])[1] and host.plan((3, 1), [1])[1] and host.plan((3, 4), [])[1]


REVERSE_ERRORS = [
    ((2, 3, 4), [3]), ((2, 3, 4), [-4]), ((2, 3, 4), [1, 1]), ((2, 3, 4), [1, -2]), ((2, 3, 4), [0, 0, 5]),
    ((2, 3, 4), [0, 5]), ((2, 3, 4), [[1]]), ((1,) * 9, []), ((1,) * 9, [9]), ((1,) * 9, [0]),
    ((), [0]), ((), [[0]]),  # a scalar is returned as it is, whatever the axes
]


@pytest.mark.parametrize("shape, axes", REVERSE_ERRORS, ids=lambda v: str(v).replace(" ", ""))
def test_reverse_errors_are_tfs(host, shape, axes):
    axis_rank = np.ndim(axes)
    try:
        want = tf_cpu(tf.raw_ops.ReverseV2, tensor=tf.zeros(shape), axis=tf.constant(axes, tf.int32))
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        with pytest.raises(HostError) as got:
            host.plan(shape, axes, axis_rank=axis_rank)
        code, message = got.value.args
        assert isinstance(e, TF_CODES[code]) and message in e.message, (message, e.message)
        return
    _, identity = host.plan(shape, axes, axis_rank=axis_rank)
    assert identity and want.shape == shape


SEQUENCE_CASES = [
    ((2, 3, 4), [3, 2], 1, 0), ((2, 3, 4), [4, 1], 2, 0), ((2, 3, 4), [0, 1], 1, 0), ((4, 2, 3), [2, 3], 0, 1),
    ((3, 5, 2, 4), [5, 0, 3], 1, 0), ((3, 5, 2, 4), [1, 4, 2, 3], 1, 3), ((6, 33), [33, 1, 0, 17, 32, 5], 1, 0),
    ((0, 3), [], 1, 0), ((2, 0, 3), [0, 0], 1, 0),
]


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reverse_sequence_is_the_definition_and_tfs_bit_for_bit(lib, host, dtype):
    for i, (shape, lengths, seq_dim, batch_dim) in enumerate(SEQUENCE_CASES):
        x = values(shape, dtype, seed=10 + i)
        want_np = np_reverse_sequence(x, lengths, seq_dim, batch_dim)
        for length_dtype in (np.int32, np.int64):
            L = np.array(lengths, length_dtype)
            got = metal_reverse_sequence(lib, host, x, L, seq_dim, batch_dim, chunk=7 if x.size > 20 else None)
            assert same_bits(got, want_np), (shape, lengths, seq_dim, batch_dim)
            want = tf_cpu(tf.raw_ops.ReverseSequence, input=tf.constant(x, DTYPES[dtype][1]),
                          seq_lengths=tf.constant(L), seq_dim=seq_dim, batch_dim=batch_dim)
            assert same_bits(got, want), (shape, lengths, seq_dim, batch_dim)


SEQUENCE_ERRORS = [
    ((2, 3, 4), [4, 2], 1, 0), ((2, 3, 4), [-1, 2], 1, 0), ((2, 3, 4), [3], 1, 0), ((2, 3, 4), [[3, 2]], 1, 0),
    ((2, 3, 4), [3, 2], 0, 0), ((2, 3, 4), [3, 2], 3, 0), ((2, 3, 4), [3, 2], 1, 3), ((2, 3, 4), [3, 2], 1, -1),
    ((2, 3, 4), [3, 2], -1, 0), ((2, 3, 4), [2, 3, 1], 0, 1), ((2,), [1, 1], 0, 0), ((2, 3, 4), [5, -1], 1, 0),
]


@pytest.mark.parametrize("shape, lengths, seq_dim, batch_dim", SEQUENCE_ERRORS, ids=lambda v: str(v).replace(" ", ""))
def test_reverse_sequence_errors_are_tfs(host, shape, lengths, seq_dim, batch_dim):
    with pytest.raises(tf.errors.InvalidArgumentError) as want:
        tf_cpu(tf.raw_ops.ReverseSequence, input=tf.zeros(shape), seq_lengths=tf.constant(lengths, tf.int32),
               seq_dim=seq_dim, batch_dim=batch_dim)
    with pytest.raises(HostError) as got:
        host.seq(shape, lengths, seq_dim, batch_dim, len_rank=np.ndim(lengths))
    code, message = got.value.args
    assert code == 3 and message in want.value.message, (message, want.value.message)
