"""The int64 and bool gap kernels (custom_ops/metal/gap_int.metal) on the Metal emulator.

Every kernel -- gap_int64_binary, gap_int64_compare, gap_bool_fill, gap_bool_reduce -- is dispatched with the
params the host builds (its GapBroadcastPlan, exported from the emulated library) and compared with
TensorFlow's own CPU kernels (AddV2, Sub, Mul, FloorMod, Maximum, Minimum, the six comparisons, All, Any)
and numpy, exactly: wrap-around, the divisor's sign in FloorMod, INT64_MIN mod -1, broadcasting, reductions
over any set of axes with and without keep_dims, empty inputs.
"""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.ops._gap_plan import BCAST, plan_function
from tfmetal_ext.testing import load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
PARAMS = np.dtype([("b", BCAST), ("op", "<u4"), ("pad", "<u4", 3)])  # tfm_gap_int_params
BINARY = {"AddV2": 0, "Sub": 1, "Mul": 2, "FloorMod": 3, "Maximum": 4, "Minimum": 5}
COMPARE = {"Equal": 10, "NotEqual": 11, "Less": 12, "LessEqual": 13, "Greater": 14, "GreaterEqual": 15}
I64 = np.iinfo(np.int64)

emu = load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_int.metal")


@pytest.fixture(scope="module")
def plan(lib):
    plan_b = plan_function(lib, "tfm_gap_int_plan", PARAMS, field="b")

    def call(*shapes):
        params = plan_b(*shapes)
        assert params is not None
        return params
    return call


def run(lib, name, buffers, params, n):
    p = params.copy()
    p["b"]["n"], p["b"]["start_lo"], p["b"]["start_hi"] = n, 0, 0
    lib.run(name, list(buffers) + [("bytes", p)], grid=n, threadgroup=threadgroup_size_1d(n))


def metal_binary(lib, plan, op, x, y):
    shape = np.broadcast_shapes(x.shape, y.shape)
    compare = op in COMPARE
    z = np.zeros(shape, np.uint8 if compare else np.int64).ravel()
    if z.size:
        params = plan(shape, x.shape, y.shape)
        params["op"] = COMPARE[op] if compare else BINARY[op]
        run(lib, "gap_int64_compare" if compare else "gap_int64_binary",
            [np.ascontiguousarray(x).ravel(), np.ascontiguousarray(y).ravel(), z], params, z.size)
    return z.reshape(shape).astype(bool) if compare else z.reshape(shape)


def metal_reduce(lib, plan, op, x, axes, keep_dims):
    identity = 1 if op == "All" else 0
    axes = sorted({a % x.ndim for a in axes}) if x.ndim else []
    kept = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
    out = np.zeros(int(np.prod(kept)), np.uint8)
    if out.size:
        fill = np.zeros((), PARAMS)
        fill["op"] = identity
        run(lib, "gap_bool_fill", [out], fill, out.size)
        if x.size:
            params = plan(x.shape, kept)
            params["op"] = identity
            run(lib, "gap_bool_reduce", [np.ascontiguousarray(x, np.uint8).ravel(), out], params, x.size)
    shape = kept if keep_dims else tuple(s for d, s in enumerate(x.shape) if d not in axes)
    return out.reshape(shape).astype(bool)


def test_library_registers_every_kernel(lib):
    assert lib.kernels() == sorted(["gap_int64_binary", "gap_int64_compare", "gap_bool_fill", "gap_bool_reduce"])


EDGE = np.array([0, 1, -1, 7, -7, 3, -3, I64.max, I64.min, 2 ** 40, -(2 ** 33)], np.int64)


@pytest.mark.parametrize("op", list(BINARY) + list(COMPARE))
def test_int64_ops_are_tfs(lib, plan, op):
    x = np.repeat(EDGE, EDGE.size).reshape(EDGE.size, EDGE.size)  # every pair of edge values
    y = np.tile(EDGE, EDGE.size).reshape(EDGE.size, EDGE.size)
    if op == "FloorMod":
        y = np.where(y == 0, 5, y)  # a zero divisor is the host's error (below)
    got = metal_binary(lib, plan, op, x, y)
    with tf.device("/CPU:0"):
        want = getattr(tf.raw_ops, op)(x=tf.constant(x), y=tf.constant(y)).numpy()
    np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(1)  # and broadcasting
    a, b = rng.integers(-50, 50, (3, 1, 4)), rng.integers(1, 9, (5, 1))
    with tf.device("/CPU:0"):
        want = getattr(tf.raw_ops, op)(x=tf.constant(a), y=tf.constant(b)).numpy()
    np.testing.assert_array_equal(metal_binary(lib, plan, op, a, b), want)


def test_floor_mod_by_zero_is_tfs_error():
    with pytest.raises(tf.errors.InvalidArgumentError, match="Integer division by zero"):
        with tf.device("/CPU:0"):
            tf.raw_ops.FloorMod(x=tf.constant([1], tf.int64), y=tf.constant([0], tf.int64))


@pytest.mark.parametrize("op", ["All", "Any"])
@pytest.mark.parametrize("shape, axes", [((4, 5), [1]), ((4, 5), [0, 1]), ((3, 4, 5), [0, 2]), ((3, 4, 5), [-1]),
                                         ((6,), []), ((0, 3), [0]), ((2, 0), [1]), ((), [])], ids=str)
@pytest.mark.parametrize("keep_dims", [False, True])
def test_bool_reductions_are_tfs(lib, plan, op, shape, axes, keep_dims):
    rng = np.random.default_rng(len(shape) + len(axes))
    x = rng.random(shape) < (0.97 if op == "All" else 0.03)
    got = metal_reduce(lib, plan, op, x, axes, keep_dims)
    with tf.device("/CPU:0"):
        want = getattr(tf.raw_ops, op)(input=tf.constant(x), axis=tf.constant(axes, tf.int32),
                                       keep_dims=keep_dims).numpy()
    np.testing.assert_array_equal(got, want)
