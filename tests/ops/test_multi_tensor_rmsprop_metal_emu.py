"""The multi-tensor RMSprop Metal kernel (custom_ops/metal/multi_tensor_rmsprop.metal) on the Metal emulator.

Every instantiation -- multi_tensor_rmsprop_float, _half, _bfloat -- is dispatched the
way multi_tensor_rmsprop_metal.mm encodes one op call: the scalar buffers bound once,
then one dispatch per variable (empty variables skipped, chunks bound at buffer offsets,
ms bound in place of the slots a variant does not have). For each of the four variants
(plain, momentum, centered, centered with momentum), with and without decoupled decay,
the results must equal the CPU kernel's (TfmetalExt>MultiTensorRMSprop on CPU) bit for
bit, and a numpy RMSprop written here, op by op in the dtype: both kernels run
tfmetal/rmsprop.h with the same rounding to T after every operation.

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
# Spelled out: the coverage check (tests/ops/test_emulation_harness.py) reads the kernel names from this file.
KERNELS = {"float": "multi_tensor_rmsprop_float", "half": "multi_tensor_rmsprop_half",
           "bfloat": "multi_tensor_rmsprop_bfloat"}
# The finite check of a loss-scaled call, in this library too (spelled out for the coverage check).
CHECK_KERNELS = {"float": "multi_tensor_find_non_finite_float", "half": "multi_tensor_find_non_finite_half",
                 "bfloat": "multi_tensor_find_non_finite_bfloat"}
FLAG_KERNELS = ["multi_tensor_found_reset", "multi_tensor_found_write"]
# tfm_multi_tensor_rmsprop_params
PARAMS = np.dtype([("n", "<u4"), ("has_decay", "<u4"), ("centered", "<u4"), ("has_momentum", "<u4"),
                   ("has_scale", "<u4")])
SHAPES = [(1,), (31,), (32,), (0,), (33,), (1000,), (7, 3, 5), (100003,)]
# (momentum slot, centered)
VARIANTS = {"plain": (False, False), "momentum": (True, False), "centered": (False, True),
            "centered_momentum": (True, True)}
SCALARS = (0.01, 0.9, 1.0 - 0.9, 0.8, 1e-7)  # lr, rho, one_minus_rho (formed in double), momentum, epsilon


emu = load_emu()


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "multi_tensor_rmsprop.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as multi_tensor_rmsprop_metal.mm + multi_tensor_metal.h do it.


def metal_rmsprop(lib, dtype, state, grads, variant, decay_rate, chunk=None, scale=None):
    """One op call on the emulator; `state` = (vars, ms, moms, mgs), lists of arrays updated in place
    (moms / mgs are None for a variant without them).

    With `scale`, the finite check first (`metal_multi_tensor_check`); returns its one-byte
    found_non_finite output (None without a scale)."""
    momentum, centered = VARIANTS[variant]
    np_dtype = DTYPES[dtype][0]
    scalar_buffers = [np.array([s], np_dtype) for s in SCALARS]  # [[buffer(5..9)]]
    decay_buffer = np.array([decay_rate], np_dtype) if decay_rate is not None else scalar_buffers[0]
    found_out = None
    # scale and found [[buffer(12, 13)]]: the host's placeholder scalars[0] without a scale (not read).
    scale_buffer = found = ("buffer", scalar_buffers[0])
    if scale is not None:
        found, found_out = metal_multi_tensor_check(lib, dtype, grads, chunk)
        scale_buffer = np.array([scale], np.float32)
    var, ms, mom, mg = state
    for i, g in enumerate(grads):
        v_flat, ms_flat, g_flat = (a.reshape(-1) for a in (var[i], ms[i], g))
        mom_flat = mom[i].reshape(-1) if momentum else ms_flat  # the host's placeholder: ms
        mg_flat = mg[i].reshape(-1) if centered else ms_flat
        n = g.size
        for start, count in dispatch_chunks(n, chunk):  # nothing for an empty variable
            views = [a[start:start + count] for a in (v_flat, ms_flat, mom_flat, mg_flat, g_flat)]
            params = np.array((count, int(decay_rate is not None), int(centered), int(momentum),
                               int(scale is not None)), PARAMS)
            lib.run(KERNELS[dtype], views + scalar_buffers + [decay_buffer, ("bytes", params), scale_buffer, found],
                    grid=count, threadgroup=threadgroup_size_1d(count))
    return found_out


def cpu_rmsprop(cpu, dtype, state, grads, variant, decay_rate, scale=None, found=None):
    """The same call through the CPU kernel; returns the updated (vars, ms, moms, mgs).

    With `scale`, the op's found_non_finite output is appended to the list `found`."""
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/CPU:0"):
        variables = [None if slot is None else [tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        handles = [[] if slot is None else [x.handle for x in slot] for slot in variables]
        result = cpu.tfmetal_ext_multi_tensor_rm_sprop(
            var=handles[0], ms=handles[1], mom=handles[2], mg=handles[3], grad=[tf.constant(g) for g in grads],
            lr=tf.constant(SCALARS[0], tf_dtype), rho=tf.constant(SCALARS[1], tf_dtype),
            one_minus_rho=tf.constant(SCALARS[2], tf_dtype), momentum=tf.constant(SCALARS[3], tf_dtype),
            epsilon=tf.constant(SCALARS[4], tf_dtype),
            weight_decay_rate=[tf.constant(decay_rate, tf_dtype)] if decay_rate is not None else [],
            scale=[] if scale is None else [tf.constant(scale, tf.float32)])
    if scale is not None:
        found.append(bool(result[0]))
    return [None if slot is None else [x.numpy() for x in slot] for slot in variables]


# ----------------------------------------------------------------------------
# Inputs and references


def random_state(dtype, shapes, seed, variant="centered_momentum"):
    momentum, centered = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype][0]

    def draw(scale, positive=False):
        return [(np.abs(rng.normal(0, scale, s)) if positive else rng.normal(0, scale, s)).astype(np.float32).astype(t)
                for s in shapes]

    var, ms, mom, mg = draw(1), draw(0.5, positive=True), draw(0.01), draw(0.05)
    grads = draw(1)
    return [var, ms, mom if momentum else None, mg if centered else None], grads


def copy_state(state):
    return [None if slot is None else [a.copy() for a in slot] for slot in state]


def np_rmsprop(state, grads, dtype, variant, decay_rate):
    """Keras' RMSprop per tensor, op by op, each result rounded to the dtype (through float32)."""
    momentum, centered = VARIANTS[variant]
    t = DTYPES[dtype][0]

    def r(x):
        return np.asarray(x, np.float32).astype(t).astype(np.float32)

    lr, rho, omr, mom_coef, eps = (np.float32(np.asarray(s, np.float64).astype(t)) for s in SCALARS)
    out = [[], [], [] if momentum else None, [] if centered else None]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for i, g in enumerate(grads):
            var, v, g = (a.astype(np.float32) for a in (state[0][i], state[1][i], g))
            if decay_rate is not None:
                var = r(var - r(var * np.float32(np.asarray(decay_rate, np.float64).astype(t))))
            v = r(r(rho * v) + r(omr * r(g * g)))
            if centered:
                mg = r(r(rho * state[3][i].astype(np.float32)) + r(omr * g))
                denom = r(r(v - r(mg * mg)) + eps)
                out[3].append(mg.astype(t))
            else:
                denom = r(v + eps)
            inc = r(r(lr * g) / r(np.sqrt(denom)))
            if momentum:
                m = r(r(mom_coef * state[2][i].astype(np.float32)) + inc)
                var = r(var - m)
                out[2].append(m.astype(t))
            else:
                var = r(var - inc)
            out[0].append(var.astype(t))
            out[1].append(v.astype(t))
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


SLOTS = ("var", "ms", "mom", "mg")

# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted([*KERNELS.values(), *CHECK_KERNELS.values(), *FLAG_KERNELS])
    for dtype, name in KERNELS.items():
        params = lib.params(name)
        assert len(params) == 14
        assert [p.const for p in params[:5]] == [False, False, False, False, True]  # var, ms, mom, mg, grad
        assert all(p.const and p.size == np.dtype(DTYPES[dtype][0]).itemsize for p in params[5:11])  # scalars
        assert params[11].kind == "reference" and params[11].size == PARAMS.itemsize
        assert [(p.const, p.size) for p in params[12:]] == [(True, 4), (True, 4)]  # scale (float), found (uint)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_call_matches_cpu_kernel_and_numpy_bit_for_bit(lib, cpu, dtype, variant, decay):
    decay_rate = 1e-3 if decay else None
    state, grads = random_state(dtype, SHAPES, seed=len(variant), variant=variant)
    got = copy_state(state)
    metal_rmsprop(lib, dtype, got, grads, variant, decay_rate)
    want = cpu_rmsprop(cpu, dtype, state, grads, variant, decay_rate)
    reference = np_rmsprop(state, grads, dtype, variant, decay_rate)
    for k, slot in enumerate(SLOTS):
        if state[k] is None:
            continue
        for i, shape in enumerate(SHAPES):
            what = f"{slot}[{i}] {shape}"
            assert_same_bits(got[k][i], want[k][i], what)
            assert_same_bits(got[k][i], reference[k][i], what + " vs numpy")
    big = SHAPES.index((100003,))
    # it moved (centered: a random ms below mg**2 makes a few NaNs, as in Keras)
    assert np.nanmax(np.abs(got[0][big].astype(np.float64) - state[0][big].astype(np.float64))) > 1e-3


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_inf_and_zeros_like_the_cpu_kernel(lib, cpu, dtype):
    t = DTYPES[dtype][0]
    for variant in VARIANTS:
        state, grads = random_state(dtype, [(8,)], seed=5, variant=variant)
        grads[0][:] = np.array([np.nan, np.inf, -np.inf, 0, -0.0, 1, -0.0, 2], np.float32).astype(t)
        state[0][0][3] = np.inf  # var
        state[1][0][4] = 0.0     # ms = 0, grad = -0: 0 / sqrt(eps)
        state[1][0][7] = np.nan  # ms
        got = copy_state(state)
        metal_rmsprop(lib, dtype, got, grads, variant, None)
        want = cpu_rmsprop(cpu, dtype, state, grads, variant, None)
        reference = np_rmsprop(state, grads, dtype, variant, None)
        for k, slot in enumerate(SLOTS):
            if state[k] is not None:
                assert_same_bits(got[k][0], want[k][0], f"{variant} {slot}")
                assert_same_bits(got[k][0], reference[k][0], f"{variant} {slot} vs numpy")
        assert np.isnan(got[0][0][[0, 1, 2, 7]].astype(np.float32)).all()  # NaN grad / inf / NaN ms poison var


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    # Variables above 2^30 elements are split into dispatches bound at buffer
    # offsets: 1000-element chunks (the last partial) give the one-dispatch result.
    state, grads = random_state("bfloat", [(100003,)], seed=8)
    one, chunked = copy_state(state), copy_state(state)
    metal_rmsprop(lib, "bfloat", one, grads, "centered_momentum", 1e-3)
    metal_rmsprop(lib, "bfloat", chunked, grads, "centered_momentum", 1e-3, chunk=1000)
    for k in range(4):
        assert_same_bits(chunked[k][0], one[k][0], f"slot {k}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_threads_past_the_end_write_nothing(lib, dtype):
    # dispatchThreadgroups (full threadgroups): threads past n = 33 must leave
    # the sentinels after the variable untouched, in every slot.
    t = DTYPES[dtype][0]
    n, extra = 33, 31
    state, grads = random_state(dtype, [(n + extra,)], seed=9)
    sentinel = copy_state(state)
    scalars = [np.array([s], t) for s in SCALARS]
    args = [state[k][0] for k in range(4)] + [grads[0]] + scalars + [scalars[0]]
    placeholders = [("buffer", scalars[0])] * 2  # scale, found: not read without a scale
    lib.run(KERNELS[dtype], args + [("bytes", np.array((n, 0, 1, 1, 0), PARAMS))] + placeholders, threadgroups=2,
            threadgroup=32)
    for k in range(4):
        assert_same_bits(state[k][0][n:], sentinel[k][0][n:], f"slot {k} past the end")
        assert (bits(state[k][0][:n]) != bits(sentinel[k][0][:n])).any(), f"slot {k} not updated"


def test_unused_slots_are_not_touched(lib):
    # Plain RMSprop with separate sentinel buffers bound as mom and mg: the kernel must not write them.
    state, grads = random_state("float", [(500,)], seed=11)
    mom, mg = state[2][0].copy(), state[3][0].copy()
    scalars = [np.array([s], np.float32) for s in SCALARS]
    args = [state[0][0], state[1][0], state[2][0], state[3][0], grads[0]] + scalars + [scalars[0]]
    lib.run(KERNELS["float"], args + [("bytes", np.array((500, 0, 0, 0, 0), PARAMS)), scalars[0], scalars[0]],
            grid=500, threadgroup=threadgroup_size_1d(500))
    assert_same_bits(state[2][0], mom, "mom")
    assert_same_bits(state[3][0], mg, "mg")


def test_threadgroup_order_does_not_matter(lib):
    state, grads = random_state("float", [(5000,)], seed=10)
    want = copy_state(state)
    metal_rmsprop(lib, "float", want, grads, "centered_momentum", None)
    got = copy_state(state)
    scalars = [np.array([s], np.float32) for s in SCALARS]
    args = [got[k][0] for k in range(4)] + [grads[0]] + scalars + [scalars[0]]
    lib.run(KERNELS["float"], args + [("bytes", np.array((5000, 0, 1, 1, 0), PARAMS)), scalars[0], scalars[0]],
            grid=5000, threadgroup=256, order="shuffle", seed=2)
    for k in range(4):
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
    found_out = metal_rmsprop(lib, dtype, got, up, "centered_momentum", 1e-3, scale=scale)
    metal_rmsprop(lib, dtype, plain, down, "centered_momentum", 1e-3)
    found = []
    want = cpu_rmsprop(cpu, dtype, state, up, "centered_momentum", 1e-3, scale=scale, found=found)
    assert found_out.tolist() == [0] and found == [False]
    for k, slot in enumerate(SLOTS):
        for i, shape in enumerate(LS_SHAPES):
            assert_same_bits(got[k][i], plain[k][i], f"{slot}[{i}] {shape} vs the unscaled call")
            assert_same_bits(got[k][i], want[k][i], f"{slot}[{i}] {shape} vs the CPU kernel")


@pytest.mark.sample_axes("bad")
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_non_finite_gradient_anywhere_writes_nothing(lib, cpu, dtype, bad):
    state, grads = random_state(dtype, LS_SHAPES, seed=22)
    grads[LS_SHAPES.index((7, 3, 5))][6, 2, 4] = bad  # one element in the middle of the list
    got = copy_state(state)
    found_out = metal_rmsprop(lib, dtype, got, grads, "centered_momentum", 1e-3, chunk=1000, scale=1024.0)
    found = []
    want = cpu_rmsprop(cpu, dtype, state, grads, "centered_momentum", 1e-3, scale=1024.0, found=found)
    assert found_out.tolist() == [1] and found == [True]
    for k, slot in enumerate(SLOTS):
        for i in range(len(LS_SHAPES)):
            assert_same_bits(got[k][i], state[k][i], f"{slot}[{i}] untouched on the emulator")
            assert_same_bits(want[k][i], state[k][i], f"{slot}[{i}] untouched by the CPU kernel")


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernel through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernel_matches_the_cpu_kernel_bit_for_bit(cpu, dtype, variant):
    state, grads = random_state(dtype, SHAPES, seed=41, variant=variant)
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [None if slot is None else [tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        assert "GPU" in variables[0][0].device
        handles = [[] if slot is None else [x.handle for x in slot] for slot in variables]
        cpu.tfmetal_ext_multi_tensor_rm_sprop(
            var=handles[0], ms=handles[1], mom=handles[2], mg=handles[3], grad=[tf.constant(g) for g in grads],
            lr=tf.constant(SCALARS[0], tf_dtype), rho=tf.constant(SCALARS[1], tf_dtype),
            one_minus_rho=tf.constant(SCALARS[2], tf_dtype), momentum=tf.constant(SCALARS[3], tf_dtype),
            epsilon=tf.constant(SCALARS[4], tf_dtype), weight_decay_rate=[tf.constant(1e-3, tf_dtype)], scale=[])
    want = cpu_rmsprop(cpu, dtype, state, grads, variant, 1e-3)
    for k, slot in enumerate(SLOTS):
        if state[k] is not None:
            for i in range(len(SHAPES)):
                assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")


@pytest.mark.metal
def test_gpu_kernel_refuses_a_variable_passed_twice(cpu):
    with tf.device("/GPU:0"):
        w = tf.Variable(tf.ones([4]))
        one = tf.constant(0.5)
        with pytest.raises(tf.errors.InvalidArgumentError, match="same variable"):
            cpu.tfmetal_ext_multi_tensor_rm_sprop(var=[w.handle], ms=[w.handle], mom=[], mg=[], grad=[tf.ones([4])],
                                                  lr=one, rho=one, one_minus_rho=one, momentum=one, epsilon=one,
                                                  weight_decay_rate=[], scale=[])


@pytest.mark.metal
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_loss_scaled_kernel_matches_the_cpu_kernel(cpu, dtype, bad):
    state, grads = random_state(dtype, SHAPES, seed=43, variant="plain")
    if bad:
        grads[-1].reshape(-1)[5] = -np.inf
    tf_dtype = DTYPES[dtype][1]
    with tf.device("/GPU:0"):
        variables = [None if slot is None else [tf.Variable(tf.constant(a)) for a in slot] for slot in state]
        handles = [[] if slot is None else [x.handle for x in slot] for slot in variables]
        found = cpu.tfmetal_ext_multi_tensor_rm_sprop(
            var=handles[0], ms=handles[1], mom=handles[2], mg=handles[3], grad=[tf.constant(g) for g in grads],
            lr=tf.constant(SCALARS[0], tf_dtype), rho=tf.constant(SCALARS[1], tf_dtype),
            one_minus_rho=tf.constant(SCALARS[2], tf_dtype), momentum=tf.constant(SCALARS[3], tf_dtype),
            epsilon=tf.constant(SCALARS[4], tf_dtype), weight_decay_rate=[], scale=[tf.constant(512.0)])
    want_found = []
    want = cpu_rmsprop(cpu, dtype, state, grads, "plain", None, scale=512.0, found=want_found)
    assert bool(found[0]) == want_found[0] == bad
    for k, slot in enumerate(SLOTS):
        if state[k] is not None:
            for i in range(len(SHAPES)):
                assert_same_bits(variables[k][i].numpy(), want[k][i], f"{slot}[{i}]")
