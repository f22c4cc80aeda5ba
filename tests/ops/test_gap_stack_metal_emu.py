"""The Pack / Unpack gap kernel (custom_ops/metal/gap_stack.metal) on the Metal emulator.

Every instantiation -- gap_stack_copy_1, gap_stack_copy_2, gap_stack_copy_4 (bool; half and bfloat16; float)
-- is dispatched as gap_stack_metal.mm dispatches it (one dispatch per stacked tensor, chunks bound at the
tensor's element), with the geometry the host computes (its GapPackCheck / GapUnpackCheck, exported from the
emulated library), and compared bit for bit with numpy's stack / split and TensorFlow's own CPU kernels of
Pack and Unpack. The host's checks are compared with TensorFlow's errors, text included.
"""

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {1: "gap_stack_copy_1", 2: "gap_stack_copy_2", 4: "gap_stack_copy_4"}
VIEWS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
PARAMS = np.dtype([("n", "<u4"), ("pack", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"), ("k", "<u4"),
                   ("n_tensors", "<u4"), ("inner_lo", "<u4"), ("inner_hi", "<u4")])  # tfm_gap_stack_params
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.bool_]

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_stack.metal")


class HostError(Exception):
    """The host code's InvalidArgument text."""


@pytest.fixture(scope="module")
def host(lib):
    """The host's checks: pack(shapes, axis) / unpack(shape, num, axis) -> (axis, inner, per_tensor), or HostError."""
    so = ctypes.CDLL(str(lib.path))
    pack, unpack = so.tfm_gap_pack_check, so.tfm_gap_unpack_check
    pack.restype = unpack.restype = ctypes.c_int
    pack.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p,
                                             ctypes.c_int]
    unpack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_char_p, ctypes.c_int]

    def result(ok, g, message):
        if not ok:
            raise HostError(message.value.decode())
        return tuple(int(v) for v in g)

    def call_pack(shapes, axis):
        ranks = np.array([len(s) for s in shapes], np.int32)
        offsets = np.concatenate([[0], np.cumsum(ranks)[:-1]]).astype(np.int32)
        dims = np.array([d for s in shapes for d in s] or [0], np.int64)
        g, message = np.zeros(3, np.int64), ctypes.create_string_buffer(4096)
        ok = pack(dims.ctypes.data, offsets.ctypes.data, ranks.ctypes.data, len(shapes), axis, g.ctypes.data,
                  message, len(message))
        return result(ok, g, message)

    def call_unpack(shape, num, axis):
        dims = np.array(list(shape) or [0], np.int64)
        g, message = np.zeros(3, np.int64), ctypes.create_string_buffer(4096)
        ok = unpack(dims.ctypes.data, len(shape), num, axis, g.ctypes.data, message, len(message))
        return result(ok, g, message)

    return type("Host", (), {"pack": staticmethod(call_pack), "unpack": staticmethod(call_unpack)})


def _copies(lib, tensors, stack, inner, pack, chunk=None):
    size = stack.dtype.itemsize
    per = tensors[0].size
    chunk = per if chunk is None else chunk
    for k, t in enumerate(tensors):
        for start in range(0, per, chunk):
            count = min(chunk, per - start)
            p = np.array((count, int(pack), start & 0xFFFFFFFF, start >> 32, k, len(tensors), inner & 0xFFFFFFFF,
                          inner >> 32), PARAMS)
            lib.run(KERNELS[size], [t.view(VIEWS[size])[start:start + count], stack.view(VIEWS[size]), ("bytes", p)],
                    grid=count, threadgroup=threadgroup_size_1d(count))


def metal_pack(lib, host, values, axis, chunk=None):
    """Pack as the host code runs it: its checks and geometry, one dispatch per tensor (per chunk)."""
    axis, inner, per_tensor = host.pack([v.shape for v in values], axis)
    shape = values[0].shape
    out_shape = shape[:axis] + (len(values),) + shape[axis:]
    stack = np.zeros(int(np.prod(out_shape)), values[0].dtype)
    if per_tensor:
        _copies(lib, [np.ascontiguousarray(v).ravel() for v in values], stack, inner, True, chunk)
    return stack.reshape(out_shape)


def metal_unpack(lib, host, value, num, axis, chunk=None):
    axis, inner, per_tensor = host.unpack(value.shape, num, axis)
    out_shape = value.shape[:axis] + value.shape[axis + 1:]
    outs = [np.zeros(per_tensor, value.dtype) for _ in range(num)]
    if outs and per_tensor:
        _copies(lib, outs, np.ascontiguousarray(value).ravel(), inner, False, chunk)
    return [o.reshape(out_shape) for o in outs]


def np_stack(values, axis):
    return np.stack(values, axis=axis)


def np_unstack(value, axis):
    return list(np.moveaxis(value, axis, 0))


def rand(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    v = np.asarray(rng.standard_normal(shape), np.float32)
    v.reshape(-1)[:1] = np.nan
    return v.astype(dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(VIEWS[a.dtype.itemsize]), b.view(VIEWS[b.dtype.itemsize]))


def tf_error(fn):
    """TensorFlow's CPU kernel's InvalidArgument message for `fn()`, or None."""
    try:
        with tf.device("/CPU:0"):
            fn()
    except tf.errors.InvalidArgumentError as e:
        return e.message.split("}} ", 1)[-1].split(" [Op:")[0]
    return None


def test_library_instantiates_every_element_size(lib):
    assert lib.kernels() == sorted(KERNELS.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis, n", [((2, 3), 0, 3), ((2, 3), 1, 2), ((2, 3), -1, 4), ((2, 3), -3, 2),
                                            ((5,), 1, 1), ((), 0, 5), ((), -1, 2), ((4, 0, 2), 1, 3),
                                            ((3, 7, 5), 2, 6)], ids=str)
def test_pack_and_unpack_are_tfs_bit_for_bit(lib, host, dtype, shape, axis, n):
    values = [rand(shape, dtype, seed=k) for k in range(n)]
    got = metal_pack(lib, host, values, axis)
    with tf.device("/CPU:0"):
        want = tf.stack([tf.constant(v) for v in values], axis=axis).numpy()
        unstacked = [t.numpy() for t in tf.unstack(tf.constant(got), axis=axis)]
    assert same_bits(got, want) and same_bits(got, np_stack(values, axis))
    back = metal_unpack(lib, host, got, n, axis)
    assert len(back) == n
    assert all(same_bits(b, u) and same_bits(b, v) for b, u, v in zip(back, unstacked, np_unstack(got, axis)))
    assert all(same_bits(b, v) for b, v in zip(back, values))


def test_unpack_into_no_tensor(lib, host):
    assert host.unpack((3, 0, 2), 0, 1) == (1, 2, 6)  # no output: nothing is dispatched
    assert metal_unpack(lib, host, np.zeros((3, 0, 2), np.float32), 0, 1) == []
    with tf.device("/CPU:0"):
        assert tf.raw_ops.Unpack(value=tf.zeros([3, 0, 2]), num=0, axis=1) == []


def test_chunks_continue_each_tensor(lib, host):
    values = [rand((13, 17), np.float16, seed=k) for k in range(3)]
    assert same_bits(metal_pack(lib, host, values, 1, chunk=50), np_stack(values, 1))
    stack = rand((11, 4, 9), np.float32, seed=9)
    for got, want in zip(metal_unpack(lib, host, stack, 4, 1, chunk=7), np_unstack(stack, 1)):
        assert same_bits(got, want)


def test_hundreds_of_tensors_one_dispatch_each(lib, host):
    # No buffer table to outgrow: N dispatches, each binding one tensor and the stack.
    values = [rand((3, 2), ml_dtypes.bfloat16, seed=k) for k in range(300)]
    for axis in (0, 1, -1):
        got = metal_pack(lib, host, values, axis)
        with tf.device("/CPU:0"):
            assert same_bits(got, tf.stack([tf.constant(v) for v in values], axis=axis).numpy())
        assert all(same_bits(b, v) for b, v in zip(metal_unpack(lib, host, got, 300, axis), values))


PACK_ERRORS = [
    ([(2, 3), (3,)], 0),         # shapes differ
    ([(2, 3), (2, 3), (3, 2)], 1),  # the third differs
    ([(0, 3), (0, 2)], 0),       # empty tensors are compared too
    ([(2, 3), (2, 3)], 3),       # axis past the stack's rank
    ([(2, 3), (2, 3)], -4),
    ([(), ()], 1),
    ([(2, 3), (3,)], 7),         # both: TF names the axis first
]


@pytest.mark.parametrize("shapes, axis", PACK_ERRORS, ids=str)
def test_pack_refuses_what_tf_refuses_with_its_text(host, shapes, axis):
    want = tf_error(lambda: tf.raw_ops.Pack(values=[tf.zeros(s) for s in shapes], axis=axis))
    assert want is not None
    with pytest.raises(HostError) as e:
        host.pack(shapes, axis)
    assert str(e.value) == want


UNPACK_ERRORS = [((2, 3), 3, 0), ((2, 3), 3, -2), ((2, 3), 2, 2), ((2, 3), 2, -3), ((), 1, 0), ((4,), 3, -1)]


@pytest.mark.parametrize("shape, num, axis", UNPACK_ERRORS, ids=str)
def test_unpack_refuses_what_tf_refuses_with_its_text(host, shape, num, axis):
    want = tf_error(lambda: tf.raw_ops.Unpack(value=tf.zeros(shape), num=num, axis=axis))
    assert want is not None
    with pytest.raises(HostError) as e:
        host.unpack(shape, num, axis)
    assert str(e.value) == want
