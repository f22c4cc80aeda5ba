"""The multi-tensor Lion Metal kernel (custom_ops/metal/multi_tensor_lion.metal) on the Metal emulator.

Every instantiation -- multi_tensor_lion_float, multi_tensor_lion_half,
multi_tensor_lion_bfloat -- is dispatched the way multi_tensor_lion_metal.mm
encodes one op call: the scalar buffers bound once, then one dispatch per
variable (empty variables skipped, chunks bound at buffer offsets). The
results must equal the CPU kernel's (TfmetalExt>MultiTensorLion on CPU) bit
for bit, and a numpy Lion written here, op by op in the dtype, for every dtype
with and without decoupled weight decay: both kernels run tfmetal/lion.h with
the same rounding to T after every operation.

With a loss scale, the call is first the finite check of
multi_tensor_check.h (multi_tensor_found_reset, multi_tensor_find_non_finite_float
/ _half / _bfloat, multi_tensor_found_write), then the same dispatches reading
its flag: a non-finite element in any gradient writes nothing, else the update
equals the unscaled one with grads / scale (and the CPU kernel's) bit for bit.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import (
    compiled_ops,
    dispatch_chunks,
    load_emu,
    metal_multi_tensor_check,
    threadgroup_size_1d,
)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16), "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
KERNELS = {"float": "multi_tensor_lion_float", "half": "multi_tensor_lion_half", "bfloat": "multi_tensor_lion_bfloat"}
# The finite check of a loss-scaled call, in this library too (spelled out for the coverage check).
CHECK_KERNELS = {"float": "multi_tensor_find_non_finite_float", "half": "multi_tensor_find_non_finite_half",
                 "bfloat": "multi_tensor_find_non_finite_bfloat"}
FLAG_KERNELS = ["multi_tensor_found_reset", "multi_tensor_found_write"]
PARAMS = np.dtype([("n", "<u4"), ("has_decay", "<u4"), ("has_scale", "<u4")])  # tfm_multi_tensor_lion_params
SHAPES = [(1,), (31,), (32,), (0,), (33,), (1000,), (7, 3, 5), (100003,)]
VARIANTS = {"lion": None, "decay": 1e-3}
SCALARS = (0.01, 0.9, 0.99)  # lr, beta_1, beta_2


emu = load_emu()


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "multi_tensor_lion.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as multi_tensor_lion_metal.mm + multi_tensor_metal.h do it.


def metal_lion(lib, dtype, state, grads, scalars, decay_rate, chunk=None, scale=None):
    """One op call on the emulator; `state` = (vars, ms), lists of arrays updated in place.

    With `scale`, the finite check first (`metal_multi_tensor_check`); returns its one-byte
    found_non_finite output (None without a scale)."""
    np_dtype = DTYPES[dtype][0]
    scalar_buffers = [np.array([s], np_dtype) for s in scalars]  # lr, beta1, beta2: [[buffer(3..5)]]
    decay_buffer = np.array([decay_rate], np_dtype) if decay_rate is not None else scalar_buffers[0]
    found_out = None
    # scale and found [[buffer(8, 9)]]: the host's placeholder scalars[0] without a scale (not read).
    scale_buffer = found = ("buffer", scalar_buffers[0])
    if scale is not None:
        found, found_out = metal_multi_tensor_check(lib, dtype, grads, chunk)
        scale_buffer = np.array([scale], np.float32)
    var, m = state
    for i, g in enumerate(grads):
        flat = [a.reshape(-1) for a in (var[i], m[i], g)]
        n = g.size
        for start, count in dispatch_chunks(n, chunk):  # nothing for an empty variable
            views = [a[start:start + count] for a in flat]
            params = np.array((count, int(decay_rate is not None), int(scale is not None)), PARAMS)
            lib.run(KERNELS[dtype], views + scalar_buffers + [decay_buffer, ("bytes", params), scale_buffer, found],
                    grid=count, threadgroup=threadgroup_size_1d(count))
    return found_out


def cpu_lion(cpu, dtype, state, grads, scalars, decay_rate, scale=None, found=None):
    """The same call through the CPU kernel; returns the updated (vars, ms).

    With `scale`, the op's found_non_finite output is appended to the list `found`."""
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/CPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        result = cpu.tfmetal_ext_multi_tensor_lion(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            grad=[tf.constant(g) for g in grads], lr=tf.constant(scalars[0], tf_dtype),
            beta1=tf.constant(scalars[1], tf_dtype), beta2=tf.constant(scalars[2], tf_dtype),
            weight_decay_rate=[tf.constant(decay_rate, tf_dtype)] if decay_rate is not None else [],
            scale=[] if scale is None else [tf.constant(scale, tf.float32)])
    if scale is not None:
        found.append(bool(result[0]))
    return [[x.numpy() for x in slot] for slot in variables]


# ----------------------------------------------------------------------------
# Inputs and references


def random_state(dtype, shapes, seed):
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype][0]
    var = [rng.normal(0, 1, s).astype(np.float32).astype(t) for s in shapes]
    m = [rng.normal(0, 0.1, s).astype(np.float32).astype(t) for s in shapes]
    grads = [rng.normal(0, 1, s).astype(np.float32).astype(t) for s in shapes]
    return [var, m], grads


def copy_state(state):
    return [[a.copy() for a in slot] for slot in state]


def np_lion(state, grads, scalars, dtype, decay_rate):
    """Keras' Lion per tensor, op by op, each result rounded to the dtype (through float32)."""
    t = DTYPES[dtype][0]

    def r(x):
        return np.asarray(x, np.float32).astype(t).astype(np.float32)

    def sign(x):  # tf.sign: +0 for either zero, NaN stays NaN
        return np.where(x > 0, np.float32(1), np.where(x < 0, np.float32(-1), np.where(x == 0, np.float32(0), x)))

    lr, b1, b2 = (r(np.float32(s)) for s in scalars)
    out = [[], []]
    with np.errstate(invalid="ignore", over="ignore"):
        for var, m, g in zip(*state, grads):
            var, m, g = (a.astype(np.float32) for a in (var, m, g))
            if decay_rate is not None:
                var = r(var - r(var * r(np.float32(decay_rate))))
            blend = r(r(m * b1) + r(g * r(np.float32(1) - b1)))
            var = r(var - r(lr * sign(blend)))
            m = r(r(m * b2) + r(g * r(np.float32(1) - b2)))
            out[0].append(var.astype(t))
            out[1].append(m.astype(t))
    return out


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
    differ = np.flatnonzero(bits(got)[~nan] != bits(want)[~nan])
    assert differ.size == 0, f"{what}: {differ.size} elements differ, first {got[~nan][differ[:3]]} != " \
                             f"{want[~nan][differ[:3]]}"


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted([*KERNELS.values(), *CHECK_KERNELS.values(), *FLAG_KERNELS])
    for dtype, name in KERNELS.items():
        params = lib.params(name)
        assert len(params) == 10
        assert [p.const for p in params[:3]] == [False, False, True]  # var, m, grad
        assert all(p.const and p.size == np.dtype(DTYPES[dtype][0]).itemsize for p in params[3:7])  # scalars
        assert params[7].kind == "reference" and params[7].size == PARAMS.itemsize
        assert [(p.const, p.size) for p in params[8:]] == [(True, 4), (True, 4)]  # scale (float), found (uint)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_call_matches_cpu_kernel_and_numpy_bit_for_bit(lib, cpu, dtype, variant):
    decay_rate = VARIANTS[variant]
    state, grads = random_state(dtype, SHAPES, seed=len(variant))
    got = copy_state(state)
    metal_lion(lib, dtype, got, grads, SCALARS, decay_rate)
    want = cpu_lion(cpu, dtype, state, grads, SCALARS, decay_rate)
    reference = np_lion(state, grads, SCALARS, dtype, decay_rate)
    for k, slot in enumerate(("var", "m")):
        for i, shape in enumerate(SHAPES):
            what = f"{slot}[{i}] {shape}"
            assert_same_bits(got[k][i], want[k][i], what)
            assert_same_bits(got[k][i], reference[k][i], what + " vs numpy")
    big = SHAPES.index((100003,))
    assert np.abs(got[0][big].astype(np.float64) - state[0][big].astype(np.float64)).max() > 1e-3  # it moved


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_signed_zeros_nan_and_inf_like_the_cpu_kernel(lib, cpu, dtype):
    t = DTYPES[dtype][0]
    state, grads = random_state(dtype, [(8,)], seed=5)
    grads[0][:] = np.array([np.nan, np.inf, -np.inf, 0, -0.0, 1, -0.0, 2], np.float32).astype(t)
    state[0][0][3] = np.inf  # var
    state[0][0][4] = -0.0    # var = -0, m = -0, grad = -0: sign(-0) = +0, var keeps its -0
    state[1][0][4] = -0.0
    state[1][0][3] = 0.0     # m = grad = 0: no step
    state[1][0][5] = np.nan  # m
    state[1][0][6] = 0.0
    for decay in (None, 1e-3):
        got = copy_state(state)
        metal_lion(lib, dtype, got, grads, SCALARS, decay)
        want = cpu_lion(cpu, dtype, state, grads, SCALARS, decay)
        for k, slot in enumerate(("var", "m")):
            assert_same_bits(got[k][0], want[k][0], f"{slot} decay={decay}")
            assert_same_bits(got[k][0], np_lion(state, grads, SCALARS, dtype, decay)[k][0], f"{slot} vs numpy")
        assert np.isnan(got[0][0][[0, 5]].astype(np.float32)).all()  # NaN gradient or momentum poisons var
        if decay is None:
            assert_same_bits(got[0][0][4:5], state[0][0][4:5], "var = -0 with a zero blend")
            assert_same_bits(got[0][0][6:7], state[0][0][6:7], "var with m = 0, grad = -0")


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # Variables above 2^30 elements are split into dispatches bound at buffer
    # offsets: 1000-element chunks (the last partial) give the one-dispatch result.
    state, grads = random_state("bfloat", [(100003,)], seed=8)
    one, chunked = copy_state(state), copy_state(state)
    metal_lion(lib, "bfloat", one, grads, SCALARS, 1e-3)
    metal_lion(lib, "bfloat", chunked, grads, SCALARS, 1e-3, chunk=1000)
    for k in range(2):
        assert_same_bits(chunked[k][0], one[k][0], f"slot {k}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_threads_past_the_end_write_nothing(lib, dtype):
    # dispatchThreadgroups (full threadgroups): threads past n = 33 must leave
    # the sentinels after the variable untouched.
    t = DTYPES[dtype][0]
    n, extra = 33, 31
    state, grads = random_state(dtype, [(n + extra,)], seed=9)
    sentinel = copy_state(state)
    scalars = [np.array([s], t) for s in SCALARS]
    args = [state[0][0], state[1][0], grads[0]] + scalars + [scalars[0]]
    placeholders = [("buffer", scalars[0])] * 2  # scale, found: not read without a scale
    lib.run(KERNELS[dtype], args + [("bytes", np.array((n, 0, 0), PARAMS))] + placeholders, threadgroups=2,
            threadgroup=32)
    for k in range(2):
        assert_same_bits(state[k][0][n:], sentinel[k][0][n:], f"slot {k} past the end")
    assert (bits(state[1][0][:n]) != bits(sentinel[1][0][:n])).all(), "m not updated"


def test_threadgroup_order_does_not_matter(lib):
    state, grads = random_state("float", [(5000,)], seed=10)
    want = copy_state(state)
    metal_lion(lib, "float", want, grads, SCALARS, None)
    got = copy_state(state)
    scalars = [np.array([s], np.float32) for s in SCALARS]
    lib.run(KERNELS["float"], [got[0][0], got[1][0], grads[0]] + scalars
            + [scalars[0], ("bytes", np.array((5000, 0, 0), PARAMS)), scalars[0], scalars[0]],
            grid=5000, threadgroup=256, order="shuffle", seed=2)
    for k in range(2):
        assert_same_bits(got[k][0], want[k][0], f"slot {k}")


# ----------------------------------------------------------------------------
# Loss scaling: the finite check, then the updates gated on it.

# Odd sizes, an empty and a 3-D variable, and one the 1000-element chunks of the tests cross.
LS_SHAPES = [(1,), (31,), (0,), (33,), (7, 3, 5), (2500,)]


def scaled(grads, scale, dtype):
    """`grads` times `scale` in the dtype (a loss-scaled step's gradients), and the unscaled gradients
    the kernel must use: float32 division rounded to the dtype (as Keras unscales)."""
    t = DTYPES[dtype][0]
    up = [(g.astype(np.float32) * np.float32(scale)).astype(t) for g in grads]
    down = [(u.astype(np.float32) / np.float32(scale)).astype(t) for u in up]
    return up, down


@pytest.mark.sample_axes("scale")
@pytest.mark.parametrize("scale", [2.0 ** 12, 1000.0, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scaled_call_is_the_update_with_unscaled_gradients(lib, cpu, dtype, scale):
    state, grads = random_state(dtype, LS_SHAPES, seed=21)
    up, down = scaled([g * DTYPES[dtype][0](0.01) for g in grads], scale, dtype)
    got, plain = copy_state(state), copy_state(state)
    found_out = metal_lion(lib, dtype, got, up, SCALARS, 1e-3, scale=scale)
    metal_lion(lib, dtype, plain, down, SCALARS, 1e-3)
    found = []
    want = cpu_lion(cpu, dtype, state, up, SCALARS, 1e-3, scale=scale, found=found)
    assert found_out.tolist() == [0] and found == [False]
    for k, slot in enumerate(("var", "m")):
        for i, shape in enumerate(LS_SHAPES):
            assert_same_bits(got[k][i], plain[k][i], f"{slot}[{i}] {shape} vs the unscaled call")
            assert_same_bits(got[k][i], want[k][i], f"{slot}[{i}] {shape} vs the CPU kernel")


@pytest.mark.sample_axes("bad")
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_non_finite_gradient_anywhere_writes_nothing(lib, cpu, dtype, bad):
    state, grads = random_state(dtype, LS_SHAPES, seed=22)
    grads[0][0] = bad  # the first gradient's only element; the others are finite
    got = copy_state(state)
    found_out = metal_lion(lib, dtype, got, grads, SCALARS, 1e-3, chunk=1000, scale=1024.0)
    found = []
    want = cpu_lion(cpu, dtype, state, grads, SCALARS, 1e-3, scale=1024.0, found=found)
    assert found_out.tolist() == [1] and found == [True]
    for k, slot in enumerate(("var", "m")):
        for i in range(len(LS_SHAPES)):
            assert_same_bits(got[k][i], state[k][i], f"{slot}[{i}] untouched on the emulator")
            assert_same_bits(want[k][i], state[k][i], f"{slot}[{i}] untouched by the CPU kernel")


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernel through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernel_matches_the_cpu_kernel_bit_for_bit(cpu, dtype, variant):
    decay_rate = VARIANTS[variant]
    state, grads = random_state(dtype, SHAPES, seed=41)
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        assert "GPU" in variables[0][0].device
        cpu.tfmetal_ext_multi_tensor_lion(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            grad=[tf.constant(g) for g in grads], lr=tf.constant(SCALARS[0], tf_dtype),
            beta1=tf.constant(SCALARS[1], tf_dtype), beta2=tf.constant(SCALARS[2], tf_dtype),
            weight_decay_rate=[tf.constant(decay_rate, tf_dtype)] if decay_rate is not None else [], scale=[])
    want = cpu_lion(cpu, dtype, state, grads, SCALARS, decay_rate)
    for k, slot in enumerate(("var", "m")):
        for i in range(len(SHAPES)):
            assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")


@pytest.mark.metal
def test_gpu_kernel_refuses_a_variable_passed_twice(cpu):
    with tf.device("/GPU:0"):
        w = tf.Variable(tf.ones([4]))
        one = tf.constant(0.5)
        with pytest.raises(tf.errors.InvalidArgumentError, match="same variable"):
            cpu.tfmetal_ext_multi_tensor_lion(var=[w.handle], m=[w.handle], grad=[tf.ones([4])], lr=one, beta1=one,
                                              beta2=one, weight_decay_rate=[], scale=[])


@pytest.mark.metal
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_loss_scaled_kernel_matches_the_cpu_kernel(cpu, dtype, bad):
    state, grads = random_state(dtype, SHAPES, seed=43)
    if bad:
        grads[-1].reshape(-1)[5] = np.nan
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        found = cpu.tfmetal_ext_multi_tensor_lion(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            grad=[tf.constant(g) for g in grads], lr=tf.constant(SCALARS[0], tf_dtype),
            beta1=tf.constant(SCALARS[1], tf_dtype), beta2=tf.constant(SCALARS[2], tf_dtype),
            weight_decay_rate=[], scale=[tf.constant(512.0)])
    want_found = []
    want = cpu_lion(cpu, dtype, state, grads, SCALARS, None, scale=512.0, found=want_found)
    assert bool(found[0]) == want_found[0] == bad
    for k, slot in enumerate(("var", "m")):
        for i in range(len(SHAPES)):
            assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")
