"""The multi-tensor Adam Metal kernel (custom_ops/metal/multi_tensor_adam.metal) on the Metal emulator.

Every instantiation -- multi_tensor_adam_float, multi_tensor_adam_half,
multi_tensor_adam_bfloat -- is dispatched the way multi_tensor_adam_metal.mm
encodes one op call: the scalar buffers bound once, then one dispatch per
variable (empty variables skipped, chunks bound at buffer offsets). The
results must equal the CPU kernel's (TfmetalExt>MultiTensorAdam on CPU) bit
for bit, for every dtype and for Adam, AMSGrad and decoupled weight decay:
both run tfmetal/adam.h with the same rounding to T after every operation,
and the coefficients computed on the GPU from the scalar tensors equal the
ones the CPU kernel computes on the host.

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

from tfmetal_ext import testing
from tfmetal_ext.testing import (
    compiled_ops,
    dispatch_chunks,
    load_emu,
    metal_multi_tensor_check,
    threadgroup_size_1d,
)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": (np.float32, tf.float32), "half": (np.float16, tf.float16), "bfloat": (ml_dtypes.bfloat16, tf.bfloat16)}
KERNELS = {"float": "multi_tensor_adam_float", "half": "multi_tensor_adam_half", "bfloat": "multi_tensor_adam_bfloat"}
# The finite check of a loss-scaled call, in this library too (spelled out for the coverage check).
CHECK_KERNELS = {"float": "multi_tensor_find_non_finite_float", "half": "multi_tensor_find_non_finite_half",
                 "bfloat": "multi_tensor_find_non_finite_bfloat"}
FLAG_KERNELS = ["multi_tensor_found_reset", "multi_tensor_found_write"]
# tfm_multi_tensor_adam_params
PARAMS = np.dtype([("n", "<u4"), ("amsgrad", "<u4"), ("has_decay", "<u4"), ("has_scale", "<u4")])
# The brief's sizes as the variables of one call, plus an empty one and a 3-D one.
SHAPES = [(1,), (31,), (32,), (0,), (33,), (1000,), (7, 3, 5), (100003,)]
VARIANTS = {"adam": (False, None), "amsgrad": (True, None), "decay": (False, 4e-5), "amsgrad_decay": (True, 4e-5)}


emu = load_emu()


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "multi_tensor_adam.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as multi_tensor_adam_metal.mm + multi_tensor_metal.h do it.


def metal_adam(lib, dtype, state, grads, scalars, amsgrad, decay_rate, chunk=None, scale=None):
    """One op call on the emulator; `state` = (vars, ms, vs, vhats), lists of arrays updated in place.

    With `scale`, the finite check first (`metal_multi_tensor_check`); returns its one-byte
    found_non_finite output (None without a scale)."""
    np_dtype = DTYPES[dtype][0]
    scalar_buffers = [np.array([s], np_dtype) for s in scalars]  # lr .. beta2_power, [[buffer(5..10)]]
    decay_buffer = np.array([decay_rate], np_dtype) if decay_rate is not None else scalar_buffers[0]
    found_out = None
    # scale and found [[buffer(13, 14)]]: the host's placeholder scalars[0] without a scale (not read).
    scale_buffer = found = ("buffer", scalar_buffers[0])
    if scale is not None:
        found, found_out = metal_multi_tensor_check(lib, dtype, grads, chunk)
        scale_buffer = np.array([scale], np.float32)
    var, m, v, vhat = state
    for i, g in enumerate(grads):
        flat = [a.reshape(-1) for a in (var[i], m[i], v[i], vhat[i] if amsgrad else var[i], g)]
        n = g.size
        for start, count in dispatch_chunks(n, chunk):  # nothing for an empty variable
            views = [a[start:start + count] for a in flat]
            params = np.array((count, int(amsgrad), int(decay_rate is not None), int(scale is not None)), PARAMS)
            lib.run(KERNELS[dtype], views + scalar_buffers + [decay_buffer, ("bytes", params), scale_buffer, found],
                    grid=count, threadgroup=threadgroup_size_1d(count))
    return found_out


def cpu_adam(cpu, dtype, state, grads, scalars, amsgrad, decay_rate, scale=None, found=None):
    """The same call through the CPU kernel; returns the updated (vars, ms, vs, vhats).

    With `scale`, the op's found_non_finite output is appended to the list `found`."""
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/CPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        result = cpu.tfmetal_ext_multi_tensor_adam(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            v=[x.handle for x in variables[2]], vhat=[x.handle for x in variables[3]] if amsgrad else [],
            grad=[tf.constant(g) for g in grads], lr=tf.constant(scalars[0], tf_dtype),
            beta1=tf.constant(scalars[1], tf_dtype), beta2=tf.constant(scalars[2], tf_dtype),
            epsilon=tf.constant(scalars[3], tf_dtype), beta1_power=tf.constant(scalars[4], tf_dtype),
            beta2_power=tf.constant(scalars[5], tf_dtype),
            weight_decay_rate=[tf.constant(decay_rate, tf_dtype)] if decay_rate is not None else [],
            scale=[] if scale is None else [tf.constant(scale, tf.float32)])
    if scale is not None:
        found.append(bool(result[0]))
    return [[x.numpy() for x in slot] for slot in variables]


# ----------------------------------------------------------------------------
# Inputs and references


def scalars_for(step, dtype):
    eps = 1e-7 if dtype == "float" else 1e-4  # 1e-7 is subnormal in half
    return [0.01, 0.9, 0.999, eps, 0.9 ** step, 0.999 ** step]


def random_state(dtype, shapes, seed):
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype][0]
    var = [rng.normal(0, 1, s).astype(np.float32).astype(t) for s in shapes]
    m = [rng.normal(0, 0.1, s).astype(np.float32).astype(t) for s in shapes]
    v = [rng.uniform(0, 0.1, s).astype(np.float32).astype(t) for s in shapes]
    vhat = [(x.astype(np.float32) + rng.uniform(-0.05, 0.05, s).clip(0)).astype(np.float32).astype(t)
            for x, s in zip(v, shapes)]
    grads = [rng.normal(0, 1, s).astype(np.float32).astype(t) for s in shapes]
    return [var, m, v, vhat], grads


def copy_state(state):
    return [[a.copy() for a in slot] for slot in state]


def np_adam(state, grads, scalars, dtype, amsgrad, decay_rate):
    """ResourceApplyAdam(WithAmsgrad) per tensor, operation by operation, each result rounded to the dtype."""
    out = [[], [], [], []]
    for *tensor_state, g in zip(*state, grads):
        for k, a in enumerate(testing.np_adam_step(tensor_state, g, scalars, DTYPES[dtype][0], amsgrad, decay_rate)):
            out[k].append(a)
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
        assert len(params) == 15
        assert [p.const for p in params[:5]] == [False, False, False, False, True]  # var, m, v, vhat, grad
        assert all(p.const and p.size == np.dtype(DTYPES[dtype][0]).itemsize for p in params[5:12])  # scalars
        assert params[12].kind == "reference" and params[12].size == PARAMS.itemsize
        assert [(p.const, p.size) for p in params[13:]] == [(True, 4), (True, 4)]  # scale (float), found (uint)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_call_matches_cpu_kernel_and_numpy_bit_for_bit(lib, cpu, dtype, variant):
    amsgrad, decay_rate = VARIANTS[variant]
    state, grads = random_state(dtype, SHAPES, seed=len(variant))
    scalars = scalars_for(3, dtype)
    got = copy_state(state)
    metal_adam(lib, dtype, got, grads, scalars, amsgrad, decay_rate)
    want = cpu_adam(cpu, dtype, state, grads, scalars, amsgrad, decay_rate)
    reference = np_adam(state, grads, scalars, dtype, amsgrad, decay_rate)
    for k, slot in enumerate(("var", "m", "v", "vhat")):
        for i, shape in enumerate(SHAPES):
            what = f"{slot}[{i}] {shape}"
            assert_same_bits(got[k][i], want[k][i], what)
            np.testing.assert_array_equal(got[k][i].astype(np.float64), reference[k][i], err_msg=what)
    big = SHAPES.index((100003,))
    assert np.abs(got[0][big].astype(np.float64) - state[0][big].astype(np.float64)).max() > 1e-3  # it moved
    if not amsgrad:  # vhat is bound to var's buffer as a placeholder: never written
        for i in range(len(SHAPES)):
            assert_same_bits(got[3][i], state[3][i], f"vhat[{i}] untouched")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_propagate_like_the_cpu_kernel(lib, cpu, dtype):
    t = DTYPES[dtype][0]
    state, grads = random_state(dtype, [(8,)], seed=5)
    grads[0][:] = np.array([np.nan, np.inf, -np.inf, 0, 0, 1, -1, 2], np.float32).astype(t)
    state[0][0][3] = np.inf  # var
    state[1][0][5] = np.nan  # m
    state[2][0][4] = 0       # v = 0 and grad = 0: the update divides 0 by epsilon
    state[1][0][4] = 0
    state[3][0][6] = np.inf  # vhat
    for amsgrad, decay in ((False, None), (True, 1e-3)):
        got = copy_state(state)
        metal_adam(lib, dtype, got, grads, scalars_for(1, dtype), amsgrad, decay)
        want = cpu_adam(cpu, dtype, state, grads, scalars_for(1, dtype), amsgrad, decay)
        for k, slot in enumerate(("var", "m", "v", "vhat")):
            assert_same_bits(got[k][0], want[k][0], f"{slot} amsgrad={amsgrad}")
        assert np.isnan(got[0][0][:3].astype(np.float32)).all()  # NaN / Inf gradients poison var
        if decay is None:  # m = v = grad = 0: a step of 0 / epsilon, var stays
            assert_same_bits(got[0][0][4:5], state[0][0][4:5], "var with m = v = grad = 0")


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # Variables above 2^30 elements are split into dispatches bound at buffer
    # offsets: 1000-element chunks (the last partial) give the one-dispatch result.
    state, grads = random_state("bfloat", [(100003,)], seed=8)
    one, chunked = copy_state(state), copy_state(state)
    metal_adam(lib, "bfloat", one, grads, scalars_for(2, "bfloat"), True, 4e-5)
    metal_adam(lib, "bfloat", chunked, grads, scalars_for(2, "bfloat"), True, 4e-5, chunk=1000)
    for k in range(4):
        assert_same_bits(chunked[k][0], one[k][0], f"slot {k}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_threads_past_the_end_write_nothing(lib, dtype):
    # dispatchThreadgroups (full threadgroups): threads past n = 33 must leave
    # the sentinels after the variable untouched.
    t = DTYPES[dtype][0]
    n, extra = 33, 31
    state, grads = random_state(dtype, [(n + extra,)], seed=9)
    sentinel = copy_state(state)
    scalars = [np.array([s], t) for s in scalars_for(1, dtype)]
    args = [state[0][0], state[1][0], state[2][0], state[3][0], grads[0]] + scalars + [scalars[0]]
    placeholders = [("buffer", scalars[0])] * 2  # scale, found: not read without a scale
    lib.run(KERNELS[dtype], args + [("bytes", np.array((n, 1, 0, 0), PARAMS))] + placeholders, threadgroups=2,
            threadgroup=32)
    for k in range(4):
        assert_same_bits(state[k][0][n:], sentinel[k][0][n:], f"slot {k} past the end")
    # m moved inside (in bfloat16, var's and v's steps can be below half an ulp).
    assert (bits(state[1][0][:n]) != bits(sentinel[1][0][:n])).all(), "m not updated"


def test_threadgroup_order_does_not_matter(lib):
    state, grads = random_state("float", [(5000,)], seed=10)
    want = copy_state(state)
    metal_adam(lib, "float", want, grads, scalars_for(1, "float"), False, None)
    got = copy_state(state)
    flat = [got[0][0], got[1][0], got[2][0], got[0][0], grads[0]]
    scalars = [np.array([s], np.float32) for s in scalars_for(1, "float")]
    lib.run(KERNELS["float"], flat + scalars + [scalars[0], ("bytes", np.array((5000, 0, 0, 0), PARAMS)),
                                                scalars[0], scalars[0]], grid=5000,
            threadgroup=256, order="shuffle", seed=2)
    for k in range(3):
        assert_same_bits(got[k][0], want[k][0], f"slot {k}")


# ----------------------------------------------------------------------------
# Loss scaling: the finite check, then the updates gated on it.

# Odd sizes, an empty and a 3-D variable, and one the 1000-element chunks of the tests cross.
LS_SHAPES = [(1,), (31,), (0,), (33,), (7, 3, 5), (2500,)]


def scaled(grads, scale, dtype):
    """`grads` times `scale` in the dtype (what a loss-scaled step's gradients are), and back: the
    unscaled gradients the kernel must use, float32 division rounded to the dtype (as Keras unscales)."""
    t = DTYPES[dtype][0]
    up = [(g.astype(np.float32) * np.float32(scale)).astype(t) for g in grads]
    down = [(u.astype(np.float32) / np.float32(scale)).astype(t) for u in up]
    return up, down


@pytest.mark.sample_axes("scale")
@pytest.mark.parametrize("scale", [2.0 ** 12, 1000.0, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scaled_call_is_the_update_with_unscaled_gradients(lib, cpu, dtype, scale):
    # All finite: found_non_finite is false, and the update is the plain one with grads / scale,
    # bit for bit, on the emulator and the CPU kernel (scale 1: the plain update with the same grads).
    state, grads = random_state(dtype, LS_SHAPES, seed=21)
    up, down = scaled([g * DTYPES[dtype][0](0.01) for g in grads], scale, dtype)  # keep g * scale finite
    scalars = scalars_for(2, dtype)
    got, plain = copy_state(state), copy_state(state)
    found_out = metal_adam(lib, dtype, got, up, scalars, True, 4e-5, scale=scale)
    metal_adam(lib, dtype, plain, down, scalars, True, 4e-5)
    found = []
    want = cpu_adam(cpu, dtype, state, up, scalars, True, 4e-5, scale=scale, found=found)
    assert found_out.tolist() == [0] and found == [False]
    for k, slot in enumerate(("var", "m", "v", "vhat")):
        for i, shape in enumerate(LS_SHAPES):
            assert_same_bits(got[k][i], plain[k][i], f"{slot}[{i}] {shape} vs the unscaled call")
            assert_same_bits(got[k][i], want[k][i], f"{slot}[{i}] {shape} vs the CPU kernel")
    if scale == 1.0:
        for i in range(len(LS_SHAPES)):
            assert_same_bits(up[i], grads[i] * DTYPES[dtype][0](0.01), f"grads[{i}] unchanged by scale 1")


@pytest.mark.sample_axes("bad")
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_non_finite_gradient_anywhere_writes_nothing(lib, cpu, dtype, bad):
    # One element of one gradient among many (the last element of the largest, in its last
    # 1000-element chunk): every variable and slot keeps its bits, on the emulator and the CPU kernel.
    state, grads = random_state(dtype, LS_SHAPES, seed=22)
    big = LS_SHAPES.index((2500,))
    grads[big].reshape(-1)[-1] = bad
    got = copy_state(state)
    found_out = metal_adam(lib, dtype, got, grads, scalars_for(3, dtype), True, 4e-5, chunk=1000, scale=1024.0)
    found = []
    want = cpu_adam(cpu, dtype, state, grads, scalars_for(3, dtype), True, 4e-5, scale=1024.0, found=found)
    assert found_out.tolist() == [1] and found == [True]
    for k, slot in enumerate(("var", "m", "v", "vhat")):
        for i in range(len(LS_SHAPES)):
            assert_same_bits(got[k][i], state[k][i], f"{slot}[{i}] untouched on the emulator")
            assert_same_bits(want[k][i], state[k][i], f"{slot}[{i}] untouched by the CPU kernel")


def test_the_check_finds_one_element_whatever_the_threadgroup_order(lib):
    # The atomic flag: one NaN among 5000 elements, threadgroups in shuffled order; a fresh
    # (garbage) temp is cleared first, so all-finite gradients give 0.
    for where in (0, 2500, 4999, None):
        g = np.ones(5000, ml_dtypes.bfloat16)
        if where is not None:
            g[where] = np.nan
        found, out = metal_multi_tensor_check(lib, "bfloat", [np.zeros(0, ml_dtypes.bfloat16), g], order="shuffle",
                                              seed=where or 1)
        assert out.tolist() == [int(where is not None)] and found.tolist() == [int(where is not None)], where


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernel through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernel_matches_the_cpu_kernel_bit_for_bit(cpu, dtype, variant):
    amsgrad, decay_rate = VARIANTS[variant]
    state, grads = random_state(dtype, SHAPES, seed=41)
    scalars = scalars_for(2, dtype)
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        assert "GPU" in variables[0][0].device
        cpu.tfmetal_ext_multi_tensor_adam(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            v=[x.handle for x in variables[2]], vhat=[x.handle for x in variables[3]] if amsgrad else [],
            grad=[tf.constant(g) for g in grads], lr=tf.constant(scalars[0], tf_dtype),
            beta1=tf.constant(scalars[1], tf_dtype), beta2=tf.constant(scalars[2], tf_dtype),
            epsilon=tf.constant(scalars[3], tf_dtype), beta1_power=tf.constant(scalars[4], tf_dtype),
            beta2_power=tf.constant(scalars[5], tf_dtype),
            weight_decay_rate=[tf.constant(decay_rate, tf_dtype)] if decay_rate is not None else [], scale=[])
    want = cpu_adam(cpu, dtype, state, grads, scalars, amsgrad, decay_rate)
    for k, slot in enumerate(("var", "m", "v", "vhat")):
        for i in range(len(SHAPES)):
            assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")


@pytest.mark.metal
def test_gpu_kernel_refuses_a_variable_passed_twice(cpu):
    with tf.device("/GPU:0"):
        w = tf.Variable(tf.ones([4]))
        m = tf.Variable(tf.zeros([4]))
        one = tf.constant(0.5)
        with pytest.raises(tf.errors.InvalidArgumentError, match="same variable"):
            cpu.tfmetal_ext_multi_tensor_adam(var=[w.handle], m=[m.handle], v=[w.handle], vhat=[],
                                              grad=[tf.ones([4])], lr=one, beta1=one, beta2=one, epsilon=one,
                                              beta1_power=one, beta2_power=one, weight_decay_rate=[], scale=[])


@pytest.mark.metal
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_loss_scaled_kernel_matches_the_cpu_kernel(cpu, dtype, bad):
    # The finite check and the gated update in one encoder on the GPU: the CPU kernel's flag and bits.
    state, grads = random_state(dtype, SHAPES, seed=43)
    if bad:
        grads[-1].reshape(-1)[5] = np.inf
    scalars = scalars_for(2, dtype)
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [[tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        found = cpu.tfmetal_ext_multi_tensor_adam(
            var=[x.handle for x in variables[0]], m=[x.handle for x in variables[1]],
            v=[x.handle for x in variables[2]], vhat=[], grad=[tf.constant(g) for g in grads],
            lr=tf.constant(scalars[0], tf_dtype), beta1=tf.constant(scalars[1], tf_dtype),
            beta2=tf.constant(scalars[2], tf_dtype), epsilon=tf.constant(scalars[3], tf_dtype),
            beta1_power=tf.constant(scalars[4], tf_dtype), beta2_power=tf.constant(scalars[5], tf_dtype),
            weight_decay_rate=[tf.constant(4e-5, tf_dtype)], scale=[tf.constant(512.0)])
    want_found = []
    want = cpu_adam(cpu, dtype, state, grads, scalars, False, 4e-5, scale=512.0, found=want_found)
    assert bool(found[0]) == want_found[0] == bad
    for k, slot in enumerate(("var", "m", "v")):
        for i in range(len(SHAPES)):
            assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")
