"""The Pack / Unpack gap kernel (custom_ops/metal/gap_stack.metal) on the Metal emulator.

Every instantiation -- gap_stack_copy_1, gap_stack_copy_2, gap_stack_copy_4 (bool; half and bfloat16; float)
-- is dispatched as gap_stack_metal.mm dispatches it (one dispatch per stacked tensor, chunks bound at the
tensor's element) and compared bit for bit with numpy's stack / split and TensorFlow's own CPU kernels of
Pack and Unpack.
"""

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


def metal_pack(lib, values, axis, chunk=None):
    shape = values[0].shape
    axis = axis + len(shape) + 1 if axis < 0 else axis
    out_shape = shape[:axis] + (len(values),) + shape[axis:]
    stack = np.zeros(int(np.prod(out_shape)), values[0].dtype)
    flat = [np.ascontiguousarray(v).ravel() for v in values]
    if stack.size:
        _copies(lib, flat, stack, int(np.prod(shape[axis:])), True, chunk)
    return stack.reshape(out_shape)


def metal_unpack(lib, value, axis, chunk=None):
    axis = axis + value.ndim if axis < 0 else axis
    out_shape = value.shape[:axis] + value.shape[axis + 1:]
    outs = [np.zeros(int(np.prod(out_shape)), value.dtype) for _ in range(value.shape[axis])]
    if outs and outs[0].size:
        _copies(lib, outs, np.ascontiguousarray(value).ravel(), int(np.prod(value.shape[axis + 1:])), False, chunk)
    return [o.reshape(out_shape) for o in outs]


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


def test_library_instantiates_every_element_size(lib):
    assert lib.kernels() == sorted(KERNELS.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis, n", [((2, 3), 0, 3), ((2, 3), 1, 2), ((2, 3), -1, 4), ((5,), 1, 1),
                                            ((), 0, 5), ((4, 0, 2), 1, 3), ((3, 7, 5), 2, 6)], ids=str)
def test_pack_and_unpack_are_tfs_bit_for_bit(lib, dtype, shape, axis, n):
    values = [rand(shape, dtype, seed=k) for k in range(n)]
    got = metal_pack(lib, values, axis)
    with tf.device("/CPU:0"):
        want = tf.stack([tf.constant(v) for v in values], axis=axis).numpy()
        unstacked = [t.numpy() for t in tf.unstack(tf.constant(got), axis=axis)]
    assert same_bits(got, want) and same_bits(got, np.stack(values, axis=axis))
    back = metal_unpack(lib, got, axis)
    assert len(back) == n and all(same_bits(b, u) and same_bits(b, v) for b, u, v in zip(back, unstacked, values))


def test_chunks_continue_each_tensor(lib):
    values = [rand((13, 17), np.float16, seed=k) for k in range(3)]
    assert same_bits(metal_pack(lib, values, 1, chunk=50), np.stack(values, axis=1))
    stack = rand((11, 4, 9), np.float32, seed=9)
    for got, want in zip(metal_unpack(lib, stack, 1, chunk=7), np.moveaxis(stack, 1, 0)):
        assert same_bits(got, want)
