"""multi_tensor_rmsprop: CPU kernel and pure-TF reference against numpy and bitwise against
keras.optimizers.RMSprop (plain, momentum, centered, centered with momentum), NaN / inf,
subnormals, argument and input errors, one op per call.

The numpy reference is Keras' RMSprop.update_step operation by operation (written here):
float32 numpy arithmetic is TF's; for float16 and bfloat16 each float32 result is rounded
to the dtype (Eigen computes half and bfloat16 ops in float and rounds). Python scalars
become the dtype the way TF converts them (numpy's double -> dtype), and ``1 - rho`` is
formed in double first, as Keras' ``1 - self.rho`` is.
"""

import importlib

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras
from tfmetal_ext import inspect, ops
from tfmetal_ext.ops import _multi_tensor as multi_tensor_common

mtr_module = importlib.import_module("tfmetal_ext.ops.multi_tensor_rmsprop")

OP = "TfmetalExt>MultiTensorRMSprop"
DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LR, RHO, MOMENTUM, EPS = 0.01, 0.9, 0.8, 1e-7
# (momentum slot, centered)
VARIANTS = {"plain": (False, False), "momentum": (True, False), "centered": (False, True),
            "centered_momentum": (True, True)}
# Odd sizes, an empty variable, a scalar, and one larger than a thread-pool block.
SHAPES = [(1,), (31,), (33,), (1000,), (0,), (), (7, 3, 5), (64, 64), (70001,)]


def lib():
    library = ops._loader.load()
    assert library is not None, ops.status()
    return library


# ----------------------------------------------------------------------------
# numpy reference


def rounder(dtype):
    """float32 array -> the nearest value of `dtype` -> float32 (identity for float32)."""
    target = NP_DTYPES[dtype]
    return lambda x: np.asarray(x, np.float32).astype(target).astype(np.float32)


def to_dtype(value, dtype):
    """A Python float as TF converts it to `dtype` (from double), as float32."""
    return np.float32(np.asarray(value, np.float64).astype(NP_DTYPES[dtype]))


def np_rmsprop_step(state, g, dtype, momentum=False, centered=False, lr=LR, rho=RHO, mom_coef=MOMENTUM, eps=EPS,
                    decay_rate=None):
    """One Keras RMSprop update_step (after decoupled decay), op by op in `dtype`.

    `state` is (var, velocity, momentum or None, average_gradient or None), float32 arrays;
    returns the new state.
    """
    r = rounder(dtype)
    var, v, m, mg = state
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = r(g)
        lr_t, rho_t, omr = (to_dtype(x, dtype) for x in (lr, rho, 1.0 - rho))
        mom_t, eps_t = to_dtype(mom_coef, dtype), to_dtype(eps, dtype)
        if decay_rate is not None:
            var = r(var - r(var * to_dtype(decay_rate, dtype)))
        v = r(r(rho_t * v) + r(omr * r(g * g)))
        if centered:
            mg = r(r(rho_t * mg) + r(omr * g))
            denom = r(r(v - r(mg * mg)) + eps_t)
        else:
            denom = r(v + eps_t)
        inc = r(r(lr_t * g) / r(np.sqrt(denom)))
        if momentum:
            m = r(r(mom_t * m) + inc)
            var = r(var - m)
        else:
            var = r(var - inc)
    return var, v, m, mg


def random_state(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    r = rounder(dtype)
    var = [r(rng.normal(0, 1, s)) for s in shapes]
    v = [r(rng.uniform(0, 0.5, s)) for s in shapes]
    m = [r(rng.normal(0, 0.01, s)) for s in shapes]
    mg = [r(rng.normal(0, 0.05, s)) for s in shapes]
    grads = [r(rng.normal(0, 1, s)) for s in shapes]
    return var, v, m, mg, grads


def tf_variables(arrays, dtype):
    return [tf.Variable(tf.constant(a, DTYPES[dtype])) for a in arrays]


def as_f32(variable):
    return tf.cast(variable, tf.float32).numpy()


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_same(got, want, what):
    """Same NaNs, every other value in the same bits (float32 arrays; a NaN's sign is not specified)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaNs differ")
    np.testing.assert_array_equal(bits(got[~nan]), bits(want[~nan]), err_msg=f"{what}: bits differ")


class State:
    """tf.Variables for var, velocity and (per variant) momentum / average gradient."""

    def __init__(self, arrays, dtype, momentum, centered):
        var, v, m, mg, grads = arrays
        self.dtype, self.momentum, self.centered = dtype, momentum, centered
        self.var, self.v = tf_variables(var, dtype), tf_variables(v, dtype)
        self.m = tf_variables(m, dtype) if momentum else None
        self.mg = tf_variables(mg, dtype) if centered else None
        self.grads = [tf.constant(g, DTYPES[dtype]) for g in grads]

    def step(self, decay_rate=None, grads=None):
        """multi_tensor_rmsprop with lr as a tensor of the dtype (as the optimizer passes it)."""
        rate = None if decay_rate is None else tf.constant(decay_rate, DTYPES[self.dtype])
        return ops.multi_tensor_rmsprop(self.var, self.v, grads if grads is not None else self.grads,
                                        tf.constant(LR, DTYPES[self.dtype]), RHO, MOMENTUM, EPS,
                                        momentums=self.m, average_gradients=self.mg, weight_decay_rate=rate)

    def values(self):
        groups = [self.var, self.v, self.m or [None] * len(self.var), self.mg or [None] * len(self.var)]
        return [[None if x is None else as_f32(x) for x in group] for group in groups]


def np_state(arrays, momentum, centered):
    var, v, m, mg, _ = arrays
    return [(a, b, c if momentum else None, d if centered else None) for a, b, c, d in zip(var, v, m, mg)]


def assert_state(state, want, what):
    names = ("var", "velocity", "momentum", "average_gradient")
    got = state.values()
    for i in range(len(want)):
        for k, name in enumerate(names):
            if want[i][k] is None:
                continue
            assert_same(got[k][i], want[i][k], f"{what}: {name}[{i}]")


# ----------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_numpy_bitwise(impl, dtype, variant):
    momentum, centered = VARIANTS[variant]
    arrays = random_state(SHAPES, dtype)
    state = State(arrays, dtype, momentum, centered)
    want = np_state(arrays, momentum, centered)
    for _ in range(3):
        state.step()
        want = [np_rmsprop_step(s, g, dtype, momentum, centered) for s, g in zip(want, arrays[4])]
    for i, shape in enumerate(SHAPES):
        assert tuple(state.var[i].shape) == shape
    assert_state(state, want, variant)
    assert not np.array_equal(as_f32(state.var[3]), arrays[0][3])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decay_matches_numpy_bitwise(impl, dtype):
    arrays = random_state(SHAPES[:4], dtype, seed=8)
    state = State(arrays, dtype, True, True)
    want = np_state(arrays, True, True)
    for _ in range(2):
        state.step(decay_rate=1e-2)
        want = [np_rmsprop_step(s, g, dtype, True, True, decay_rate=1e-2) for s, g in zip(want, arrays[4])]
    assert_state(state, want, "decay")


SHAPES_KERAS = [(3, 4), (17,), (), (0,), (64, 64), (5, 1, 3)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bitwise_equal_to_keras_rmsprop(impl, dtype, variant):
    # keras.optimizers.RMSprop, several steps, mixed shapes; float16 variables make
    # Keras run every op in half.
    momentum, centered = VARIANTS[variant]
    rng = np.random.default_rng(1)
    np_dtype = NP_DTYPES[dtype]
    init = [rng.normal(size=s).astype(np_dtype) for s in SHAPES_KERAS]
    steps = [[rng.normal(size=s).astype(np_dtype) for s in SHAPES_KERAS] for _ in range(5)]
    steps[2][0][0, 0] = 0.0  # a zero gradient somewhere
    kvars = [keras.Variable(a, dtype=dtype) for a in init]
    optimizer = keras.optimizers.RMSprop(learning_rate=LR, rho=RHO, momentum=MOMENTUM if momentum else 0.0,
                                         epsilon=EPS, centered=centered)
    optimizer.build(kvars)
    zeros = [np.zeros(s, np.float32) for s in SHAPES_KERAS]
    state = State((init, zeros, zeros, zeros, zeros), dtype, momentum, centered)
    for gs in steps:
        optimizer.apply([tf.constant(g) for g in gs], kvars)
        state.step(grads=[tf.constant(g) for g in gs])
    slots = {"velocity": optimizer._velocities, "momentum": optimizer._momentums,
             "average_gradient": optimizer._average_gradients}
    got = state.values()
    for i, shape in enumerate(SHAPES_KERAS):
        assert_same(got[0][i], np.asarray(kvars[i].numpy()).astype(np.float32), f"var[{i}] {shape}")
        assert_same(got[1][i], np.asarray(slots["velocity"][i].numpy()).astype(np.float32), f"velocity[{i}]")
        if momentum:
            assert_same(got[2][i], np.asarray(slots["momentum"][i].numpy()).astype(np.float32), f"momentum[{i}]")
        if centered:
            assert_same(got[3][i], np.asarray(slots["average_gradient"][i].numpy()).astype(np.float32),
                        f"average_gradient[{i}]")
    assert not np.array_equal(got[0][4], init[4].astype(np.float32))


def test_one_minus_rho_is_formed_in_double():
    # float32: Keras' 1 - 0.9 is 0.1f; 1 - 0.9f would be 0.10000002f. After one step from a
    # zero velocity the velocity is (1 - rho) * g^2 exactly for g = 1.
    var, v = tf.Variable(np.ones(1, np.float32)), tf.Variable(np.zeros(1, np.float32))
    ops.multi_tensor_rmsprop([var], [v], [tf.ones(1)], LR, 0.9, 0.0, EPS)
    assert v.numpy()[0] == np.float32(0.1) != np.float32(1) - np.float32(0.9)
    # An explicit one_minus_rho is used as given.
    v2 = tf.Variable(np.zeros(1, np.float32))
    ops.multi_tensor_rmsprop([tf.Variable(np.ones(1, np.float32))], [v2], [tf.ones(1)], LR, 0.9, 0.0, EPS,
                             one_minus_rho=tf.constant(0.25))
    assert v2.numpy()[0] == np.float32(0.25)


def test_non_finite_gradients(impl):
    # NaN gradients poison var and its slots; +-inf ones give inf velocity, then lr * inf / inf = NaN, as Keras.
    var = np.array([1.0, -2.0, 0.5, 3.0, 0.0], np.float32)
    g = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    for variant, (momentum, centered) in VARIANTS.items():
        arrays = ([var], [np.zeros(5, np.float32)], [np.zeros(5, np.float32)], [np.zeros(5, np.float32)], [g])
        state = State(arrays, "float32", momentum, centered)
        state.step()
        want = [np_rmsprop_step(s, g, "float32", momentum, centered) for s in np_state(arrays, momentum, centered)]
        assert_state(state, want, variant)
        kvar = keras.Variable(var)
        opt = keras.optimizers.RMSprop(learning_rate=LR, rho=RHO, momentum=MOMENTUM if momentum else 0.0,
                                       epsilon=EPS, centered=centered)
        opt.apply([tf.constant(g)], [kvar])
        assert_same(state.values()[0][0], np.asarray(kvar.numpy()), f"{variant} vs Keras")
        assert np.isnan(state.values()[0][0][:3]).all()
        np.testing.assert_array_equal(state.values()[0][0][3:], var[3:])  # zero gradients: no move


def test_subnormals_flush_like_keras(impl):
    # TF runs CPU ops with denormals flushed to zero; so does the kernel.
    g = np.array([1e-39, -1e-39, 3e-20, 0.5], np.float32)
    v = np.array([1e-39, 0.0, 0.0, 1e-39], np.float32)
    tvar, tv = tf.Variable(np.ones(4, np.float32)), tf.Variable(v)
    ops.multi_tensor_rmsprop([tvar], [tv], [tf.constant(g)], LR, RHO, 0.0, EPS)
    kvar = keras.Variable(np.ones(4, np.float32))
    opt = keras.optimizers.RMSprop(learning_rate=LR, rho=RHO, epsilon=EPS)
    opt.build([kvar])
    opt._velocities[0].assign(v)
    opt.apply([tf.constant(g)], [kvar])
    np.testing.assert_array_equal(tvar.numpy(), np.asarray(kvar.numpy()))
    np.testing.assert_array_equal(tv.numpy(), np.asarray(opt._velocities[0].numpy()))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", ["plain", "centered_momentum"])
def test_kernel_equals_reference_bitwise(dtype, variant):
    # The kernel against the per-variable Keras ops (the pure-TF reference), with
    # non-finite gradients in the mix, over 3 steps, N = 100, with decay.
    momentum, centered = VARIANTS[variant]
    shapes = [(n % 37 + 1, (n * 7) % 13) for n in range(100)]
    arrays = random_state(shapes, dtype, seed=2)
    arrays[4][5][0, :] = np.inf
    arrays[4][6][0, :] = np.nan
    arrays[4][7][0, :] = 0.0
    results = []
    for reference in ("0", "1"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TFMETAL_EXT_REFERENCE_OPS", reference)
            state = State(arrays, dtype, momentum, centered)
            for _ in range(3):
                state.step(decay_rate=1e-3)
            results.append(state.values())
    kernel, reference = results
    for k in range(4):
        for i in range(len(shapes)):
            if kernel[k][i] is not None:
                assert_same(kernel[k][i], reference[k][i], f"group {k} [{i}]")
    assert np.isnan(kernel[0][6][0]).all() and np.isnan(kernel[1][6][0]).all()  # NaN gradients poison both


def test_large_input_uses_all_elements(impl):
    # Variables that span thread-pool blocks, with empty ones between them.
    shapes = [(100003,), (0,), (7,), (65537,), (0,), (1,)]
    arrays = random_state(shapes, "float32", seed=3)
    state = State(arrays, "float32", True, False)
    state.step()
    want = [np_rmsprop_step(s, g, "float32", True, False) for s, g in zip(np_state(arrays, True, False), arrays[4])]
    assert_state(state, want, "large")


def test_eager_and_tf_function_agree(impl):
    arrays = random_state([(5, 3), (17,)], "float32", seed=4)
    outs = []
    for mode in ("eager", "function"):
        state = State(arrays, "float32", True, True)
        step = (lambda: state.step(decay_rate=1e-3)) if mode == "eager" else tf.function(
            lambda: [state.step(decay_rate=1e-3)][:0])
        step()
        outs.append(state.values())
    for k in range(4):
        for a, b in zip(outs[0][k], outs[1][k]):
            if impl == "kernel":
                np.testing.assert_array_equal(a, b)
            else:
                # Inside a tf.function grappler rewrites the reference's (Keras') x / sqrt(y)
                # into x * rsqrt(y), whose CPU kernel is not correctly rounded: 1-2 ulps.
                np.testing.assert_allclose(a, b, rtol=5e-7, atol=0)


def test_graph_mode_returns_the_op(impl):
    with tf.Graph().as_default():
        gvar, gv = tf.Variable(tf.ones(3)), tf.Variable(tf.zeros(3))
        op = ops.multi_tensor_rmsprop([gvar], [gv], [tf.ones(3)], LR, RHO, 0.0, EPS)
        assert isinstance(op, tf.Operation)
    tvar, tv = tf.Variable(tf.ones(3)), tf.Variable(tf.zeros(3))
    assert ops.multi_tensor_rmsprop([tvar], [tv], [tf.ones(3)], LR, RHO, 0.0, EPS) is None  # eagerly


def test_keras_variables_and_indexed_slices(impl):
    var = keras.Variable(np.ones((4, 2), "float32"))
    v = keras.Variable(np.zeros((4, 2), "float32"))
    grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))
    ops.multi_tensor_rmsprop([var], [v], [grad], 0.1, RHO, 0.0, EPS)
    got = var.numpy()
    assert np.all(got[2] < 0.7)  # 1 - 0.1 / sqrt(0.1 + eps)
    np.testing.assert_array_equal(got[[0, 1, 3]], 1.0)  # zero gradient rows: no move


def test_empty_variable_list_is_a_no_op(impl):
    assert ops.multi_tensor_rmsprop([], [], [], LR, RHO, 0.0, EPS) is None

    @tf.function
    def step():
        op = ops.multi_tensor_rmsprop([], [], [], LR, RHO, 0.0, EPS)
        assert op.type == "NoOp"

    step()


def test_pending_read_keeps_its_value():
    # Copy-on-write: a tensor read before the update is not changed by it.
    var, v = tf.Variable(np.ones(8, "float32")), tf.Variable(np.zeros(8, "float32"))
    before, v_before = var.read_value(), v.read_value()
    ops.multi_tensor_rmsprop([var], [v], [tf.ones(8)], 0.1, RHO, 0.0, EPS)
    np.testing.assert_array_equal(before.numpy(), np.ones(8))
    np.testing.assert_array_equal(v_before.numpy(), np.zeros(8))
    assert np.all(var.numpy() < 1.0)


# ----------------------------------------------------------------------------
# One op per call


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_is_one_op_for_all_variables(variant):
    momentum, centered = VARIANTS[variant]
    state = State(random_state([(16, 16)] * 10, "float32", seed=5), "float32", momentum, centered)
    cap = inspect.capture_function(lambda: [state.step(decay_rate=1e-3)][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get(OP) == 1
    assert not {"Sqrt", "Rsqrt", "AssignSubVariableOp"} & set(counts)


def test_reference_is_keras_ops_per_variable(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    state = State(random_state([(4,)] * 6, "float32", seed=6), "float32", False, False)
    cap = inspect.capture_function(lambda: [state.step()][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    # Rsqrt: grappler turns Keras' x / sqrt(y) into x * rsqrt(y), for Keras' own optimizer too.
    assert counts.get("Rsqrt") == 6 and counts.get("AssignSubVariableOp") == 6
    assert OP not in counts


def test_avoid_fusions_runs_the_reference(monkeypatch):
    import tfmetal_ext

    state = State(random_state([(4,)] * 3, "float32", seed=7), "float32", False, True)
    tfmetal_ext.configure("float32", avoid_fusions=["multi_tensor_rmsprop"])
    try:
        cap = inspect.capture_function(lambda: [state.step()][:0])
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    counts = inspect.report_from_capture(cap).ops_by_type
    assert OP not in counts and counts.get("Rsqrt") == 3


def test_kernel_registered_for_cpu_only_here():
    lib()
    assert multi_tensor_common.has_kernel("/job:localhost/replica:0/task:0/device:CPU:0", mtr_module._OP_NAME)
    assert multi_tensor_common.has_kernel("", mtr_module._OP_NAME)
    assert not multi_tensor_common.has_kernel("/device:GPU:0", mtr_module._OP_NAME)


# ----------------------------------------------------------------------------
# Errors


def _one(dtype=tf.float32, shape=(3,)):
    return tf.Variable(tf.zeros(shape, dtype))


def _call(**overrides):
    """multi_tensor_rmsprop on one float32 variable of shape (3,), with arguments replaced."""
    args = dict(variables=[_one()], velocities=[_one()], grads=[tf.zeros(3)])
    args.update(overrides)
    return ops.multi_tensor_rmsprop(**args, lr=0.1, rho=0.9, momentum=0.0, epsilon=1e-7)


f16 = tf.float16
BAD_ARGUMENTS = {
    "lengths": (lambda: _call(velocities=[_one(), _one()]),
                r"Received: len\(variables\)=1, len\(velocities\)=2, len\(grads\)=1"),
    "momentums_length": (lambda: _call(momentums=[]), r"Received: .*len\(momentums\)=0"),
    "average_gradients_length": (lambda: _call(average_gradients=[_one(), _one()]),
                                 r"Received: .*len\(average_gradients\)=2"),
    "grads_length": (lambda: _call(grads=[]), r"Received: .*len\(grads\)=0"),
    "mixed_dtypes": (lambda: _call(variables=[_one(), _one(f16)], velocities=[_one(), _one(f16)],
                                   grads=[tf.zeros(3), tf.zeros(3, f16)]), r"Received: variables\[1\].dtype=float16"),
    "slot_dtype": (lambda: _call(momentums=[_one(f16)]), r"Received: momentums\[0\].dtype=float16"),
    "float64": (lambda: _call(variables=[_one(tf.float64)], velocities=[_one(tf.float64)],
                              grads=[tf.zeros(3, tf.float64)]), r"Received: variables\[0\].dtype=float64"),
    "grad_dtype": (lambda: _call(grads=[tf.zeros(3, f16)]), r"Received: grads\[0\].dtype=float16"),
    "grad_shape": (lambda: _call(grads=[tf.zeros(4)]),
                   r"Received: grads\[0\].shape=\(4,\), variables\[0\].shape=\(3,\)"),
    "slot_shape": (lambda: _call(average_gradients=[_one(shape=(4,))]),
                   r"Received: grads\[0\].shape=\(3,\), average_gradients\[0\].shape=\(4,\)"),
    "not_a_variable": (lambda: _call(variables=[tf.zeros(3)]), r"Received: variables\[0\]=<tf.Tensor"),
    "not_a_list": (lambda: _call(velocities=_one()), r"Received: velocities=<tf.Variable"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments(impl, case):
    call, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_same_variable_twice_is_rejected(impl):
    a = _one()
    with pytest.raises(ValueError, match=r"only once.*Received: variables\[1\] is also variables\[0\]"):
        _call(variables=[a, a], velocities=[_one(), _one()], grads=[tf.zeros(3), tf.zeros(3)])
    with pytest.raises(ValueError, match=r"only once.*Received: momentums\[0\] is also velocities\[0\]"):
        v = _one()
        _call(velocities=[v], momentums=[v])
    w = keras.Variable(np.zeros(3, "float32"))
    with pytest.raises(ValueError, match=r"Received: average_gradients\[0\] is also variables\[0\]"):
        _call(variables=[w], average_gradients=[w.value])


def _raw(variables, ms, grads, mom=(), mg=(), scalars=None, decay=()):
    s = scalars if scalars is not None else [tf.constant(x) for x in (0.1, 0.9, 0.1, 0.5, 1e-7)]
    return mtr_module._raw_op(lib())([x.handle for x in variables], [x.handle for x in ms],
                                     [x.handle for x in mom], [x.handle for x in mg], grads, *s, list(decay), [])


def _snapshot(*variables):
    return [v.numpy().copy() for v in variables]


def _assert_unchanged(variables, before):
    for i, (v, want) in enumerate(zip(variables, before)):
        np.testing.assert_array_equal(bits(v.numpy()), bits(want), err_msg=f"variable {i} changed")


G2 = [tf.ones(3), tf.ones((2, 2))]
KERNEL_ERRORS = {
    # A problem with the second variable: the first is left unchanged.
    "grad_shape": (lambda a, b, va, vb, ma, mb: _raw([a, b], [va, vb], [tf.ones(3), tf.ones(3)], [ma, mb]),
                   r"variable 1: var, ms, mom and grad must have the same shape, got var \[2,2\], ms \[2,2\], "
                   r"mom \[2,2\], grad \[3\]"),
    "mg_shape": (lambda a, b, va, vb, ma, mb: _raw([a, b], [va, vb], G2, mg=[ma, _one(shape=(4,))]),
                 r"variable 1: var, ms, mg and grad .*mg \[4\]"),
    "ms_twice": (lambda a, b, va, vb, ma, mb: _raw([a, b], [va, va], [tf.ones(3), tf.ones((2, 2))]),
                 r"same variable is passed as ms\[0\] and ms\[1\]"),
    "var_is_mom": (lambda a, b, va, vb, ma, mb: _raw([a, b], [va, vb], G2, mom=[ma, b]),
                   r"same variable is passed as (var\[1\] and mom\[1\]|mom\[1\] and var\[1\]); "
                   r"every var, ms and mom must be a distinct variable"),
    "dtype": (lambda a, b, va, vb, ma, mb: _raw([a, _one(tf.float16, (2, 2))], [va, vb], G2),
              r"var\[1\] has dtype half but T is float"),
    "scalar": (lambda a, b, va, vb, ma, mb: _raw(
        [a, b], [va, vb], G2, scalars=[tf.constant(0.1), tf.constant(0.9), tf.constant(0.1), tf.constant(0.0),
                                       tf.ones(2)]),
        r"epsilon is not a scalar"),
    "decay_scalar": (lambda a, b, va, vb, ma, mb: _raw([a, b], [va, vb], G2, decay=[tf.ones(3)]),
                     r"weight_decay_rate is not a scalar"),
}


@pytest.mark.parametrize("case", list(KERNEL_ERRORS))
def test_kernel_rejects_bad_input_and_changes_nothing(case):
    call, message = KERNEL_ERRORS[case]
    a, b = _one(), _one(shape=(2, 2))
    va, vb = _one(), _one(shape=(2, 2))
    ma, mb = _one(), _one(shape=(2, 2))
    every = (a, b, va, vb, ma, mb)
    for i, v in enumerate(every):
        v.assign(np.arange(v.shape.num_elements(), dtype="float32").reshape(v.shape) + i + 0.5)
    before = _snapshot(*every)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        call(*every)
    _assert_unchanged(every, before)
    _raw([a, b], [va, vb], G2, [ma, mb])  # the right call still updates
    assert not np.array_equal(a.numpy(), before[0])


def test_raw_op_refuses_a_partial_slot_list():
    a, b = _one(), _one()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=r"mom must hold 0 or N = 2"):
        _raw([a, b], [_one(), _one()], [tf.ones(3), tf.ones(3)], mom=[_one()])


def test_shape_function_rejects_mismatch_when_tracing():
    a, va = _one(), _one()

    @tf.function
    def step(g):
        _raw([a], [va], [g])

    with pytest.raises(ValueError, match="variable 0: var, its slots and grad shapes differ"):
        step.get_concrete_function(tf.TensorSpec([4]))
    step.get_concrete_function(tf.TensorSpec([None]))  # unknown size: checked at run time


def test_run_time_shape_error_changes_no_variable(impl):
    # The last gradient's size is only known when the step runs: the error must come
    # before any update (decay included), in the per-variable fallback as in the kernel.
    variables = [_one(shape=(3,)) for _ in range(3)]
    vs = [_one(shape=(3,)) for _ in range(3)]
    moms = [_one(shape=(3,)) for _ in range(3)]
    for i, v in enumerate(variables + vs + moms):
        v.assign(np.arange(3, dtype="float32") + i)
    before = _snapshot(*variables, *vs, *moms)

    @tf.function(input_signature=[tf.TensorSpec([None])])
    def step(last):
        ops.multi_tensor_rmsprop(variables, vs, [tf.ones(3), tf.ones(3), last], 0.1, 0.9, 0.5, 1e-7,
                                 momentums=moms, weight_decay_rate=0.01)

    # The kernel names the variable; the fallback's EnsureShape the gradient's expected shape.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variable 2|expected shape \[3\]"):
        step(tf.ones(4))
    _assert_unchanged(variables + vs + moms, before)


# ----------------------------------------------------------------------------
# Loss scaling (`scale=`): as for multi_tensor_adam (tests/ops/test_multi_tensor_adam.py)


def scaled_grads(grads, scale, dtype):
    """(grads * scale in the dtype; those divided by `scale` in float32, rounded to the dtype)."""
    t = NP_DTYPES[dtype]
    up = [(np.asarray(g, np.float32) * np.float32(scale)).astype(t) for g in grads]
    down = [(u.astype(np.float32) / np.float32(scale)).astype(t) for u in up]
    return up, down


def _rmsprop_call(state, grads, dtype, **kw):
    var, v, m, mg = state
    return ops.multi_tensor_rmsprop(var, v, grads, LR, RHO, MOMENTUM, EPS, momentums=m, average_gradients=mg,
                                    weight_decay_rate=1e-3, **kw)


@pytest.mark.parametrize("scale", [2.0 ** 10, 1000.0, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_is_the_update_with_unscaled_gradients(impl, dtype, scale):
    var, v, m, mg, grads = random_state(SHAPES, dtype, seed=7)
    up, down = scaled_grads([0.01 * g for g in grads], scale, dtype)
    got = [tf_variables(x, dtype) for x in (var, v, m, mg)]
    found = _rmsprop_call(got, [tf.constant(g) for g in up], dtype, scale=scale)
    assert found.dtype == tf.bool and not bool(found)
    want = [tf_variables(x, dtype) for x in (var, v, m, mg)]
    _rmsprop_call(want, [tf.constant(g) for g in down], dtype)
    for k in range(4):
        for i, shape in enumerate(SHAPES):
            assert_same(as_f32(got[k][i]), as_f32(want[k][i]), f"slot {k}[{i}] {shape}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_non_finite_gradient_updates_nothing(impl, dtype):
    var, v, m, mg, grads = random_state(SHAPES, dtype, seed=8)
    grads[0][0] = np.nan
    for mode in ("eager", "function"):
        tvars = [tf_variables(x, dtype) for x in (var, v, m, mg)]
        tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]

        def step(tvars=tvars, tgrads=tgrads):
            return _rmsprop_call(tvars, tgrads, dtype, scale=tf.constant(8.0))

        assert bool((tf.function(step) if mode == "function" else step)()), mode
        for k, want in enumerate((var, v, m, mg)):
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(as_f32(tvars[k][i]), want[i].astype(np.float32), err_msg=f"{mode} {k}[{i}]")


def test_loss_scale_is_one_op_without_finite_checks():
    var, v, _, _, grads = random_state([(16, 16)] * 6, "float32", seed=9)
    tvars, tvs = (tf_variables(x, "float32") for x in (var, v))
    scale = tf.Variable(1024.0)
    cap = inspect.capture_function(
        lambda: ops.multi_tensor_rmsprop(tvars, tvs, [tf.constant(g) for g in grads], LR, RHO, 0.0, EPS, scale=scale))
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("TfmetalExt>MultiTensorRMSprop") == 1, counts
    assert not {"IsFinite", "RealDiv", "If", "StatelessIf", "Switch"} & set(counts), counts


def test_kernel_rejects_a_bad_scale_and_changes_nothing():
    a, va = _one(), _one()
    a.assign([1.0, 2.0, 3.0])
    s = [tf.constant(x) for x in (0.1, 0.9, 0.1, 0.5, 1e-7)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="scale is not a scalar"):
        mtr_module._raw_op(lib())([a.handle], [va.handle], [], [], [tf.ones(3)], *s, [], [tf.ones(2)])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"scale.shape=\(2,\)"):
        _call(scale=[1.0, 2.0])
