"""multi_tensor_lion: CPU kernel and pure-TF reference against numpy and bitwise against
keras.optimizers.Lion, signed zeros and NaN, argument and input errors, one op per call.

The numpy reference is Keras' Lion operation by operation (written here): in float32
numpy's float32 arithmetic is TF's; for float16 and bfloat16 every result is rounded to
the dtype (through float32, as Eigen computes half and bfloat16 ops in float and rounds).
Lion's step is lr * sign(...), so a float64 reference would disagree exactly where the
sign of a tiny blend flips: the float32 op order is the right reference.
"""

import importlib

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras
from tfmetal_ext import inspect, ops
from tfmetal_ext.ops import _multi_tensor as multi_tensor_common

mtl_module = importlib.import_module("tfmetal_ext.ops.multi_tensor_lion")

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LR, B1, B2 = 0.01, 0.9, 0.99
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


def np_sign(x):
    """tf.sign: 1, -1, +0 for either zero, NaN for NaN."""
    return np.where(x > 0, np.float32(1), np.where(x < 0, np.float32(-1), np.where(x == 0, np.float32(0), x)))


def np_lion_step(var, m, g, dtype, lr=LR, b1=B1, b2=B2, decay_rate=None):
    """One Keras Lion update_step (after decoupled decay), op by op in `dtype`; float32 arrays in and out."""
    r = rounder(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        var, m, g = (r(a) for a in (var, m, g))
        lr, b1, b2 = (r(np.float32(x)) for x in (lr, b1, b2))
        if decay_rate is not None:
            var = r(var - r(var * r(np.float32(decay_rate))))
        blend = r(r(m * b1) + r(g * r(np.float32(1) - b1)))
        var = r(var - r(lr * np_sign(blend)))
        m = r(r(m * b2) + r(g * r(np.float32(1) - b2)))
    return var, m


def random_state(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    r = rounder(dtype)
    var = [r(rng.normal(0, 1, s)) for s in shapes]
    m = [r(rng.normal(0, 0.1, s)) for s in shapes]
    grads = [r(rng.normal(0, 1, s)) for s in shapes]
    return var, m, grads


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


def run_op(variables, ms, grads, dtype, decay_rate=None, lr=LR):
    """multi_tensor_lion with the scalars as tensors of `dtype` (as an optimizer passes them)."""
    s = [tf.constant(x, DTYPES[dtype]) for x in (lr, B1, B2)]
    rate = None if decay_rate is None else tf.constant(decay_rate, DTYPES[dtype])
    return ops.multi_tensor_lion(variables, ms, grads, *s, weight_decay_rate=rate)


# ----------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("decay", [False, True])
def test_matches_numpy_bitwise(impl, dtype, decay):
    var, m, grads = random_state(SHAPES, dtype)
    tvars, tms = tf_variables(var, dtype), tf_variables(m, dtype)
    tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]
    rate = 1e-3 if decay else None
    want = list(zip(var, m))
    for _ in range(3):
        run_op(tvars, tms, tgrads, dtype, decay_rate=rate)
        want = [np_lion_step(w, mm, g, dtype, decay_rate=rate) for (w, mm), g in zip(want, grads)]
    for i, shape in enumerate(SHAPES):
        assert tuple(tvars[i].shape) == shape
        assert_same(as_f32(tvars[i]), want[i][0], f"var[{i}] {shape}")
        assert_same(as_f32(tms[i]), want[i][1], f"m[{i}] {shape}")
    # Lion moves every element by +-lr per step: 1 or 3 steps' worth after 3 (in float32;
    # half and bfloat16 round var's steps).
    moved = np.abs(as_f32(tvars[3]) - var[3])
    if dtype == "float32" and not decay:
        assert moved.min() > 0.99 * LR and moved.max() < 3.01 * LR
    else:
        assert moved.min() > 0


SHAPES_KERAS = [(3, 4), (17,), (), (0,), (64, 64), (5, 1, 3)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bitwise_equal_to_keras_lion(impl, dtype):
    # keras.optimizers.Lion, several steps, mixed shapes; float16 variables
    # make Keras run every op in half.
    rng = np.random.default_rng(1)
    np_dtype = NP_DTYPES[dtype]
    init = [rng.normal(size=s).astype(np_dtype) for s in SHAPES_KERAS]
    steps = [[rng.normal(size=s).astype(np_dtype) for s in SHAPES_KERAS] for _ in range(5)]
    steps[2][0][0, 0] = 0.0  # a zero gradient somewhere
    kvars = [keras.Variable(a, dtype=dtype) for a in init]
    optimizer = keras.optimizers.Lion(learning_rate=LR, beta_1=B1, beta_2=B2)
    optimizer.build(kvars)
    ours = [tf.Variable(a) for a in init]
    ms = [tf.Variable(np.zeros(s, np_dtype)) for s in SHAPES_KERAS]
    for gs in steps:
        optimizer.apply([tf.constant(g) for g in gs], kvars)
        run_op(ours, ms, [tf.constant(g) for g in gs], dtype)
    momentums = optimizer.variables[2:]  # iterations, learning_rate, then one momentum per variable
    assert len(momentums) == len(kvars)
    for i, shape in enumerate(SHAPES_KERAS):
        assert_same(ours[i].numpy().astype(np.float32), np.asarray(kvars[i].numpy()).astype(np.float32),
                    f"var[{i}] {shape}")
        assert_same(ms[i].numpy().astype(np.float32), np.asarray(momentums[i].numpy()).astype(np.float32),
                    f"m[{i}] {shape}")
    assert not np.array_equal(ours[4].numpy(), init[4])


def test_signed_zeros_and_nan(impl):
    # sign(+-0) = +0 (so var keeps its bits, -0 included), NaN gradients poison var and m.
    var = np.array([1.0, -0.0, 0.0, 2.0, -3.0, 0.5, -0.0, 4.0], np.float32)
    m = np.array([0.0, -0.0, 0.0, -0.0, 0.0, np.nan, 0.0, 1.0], np.float32)
    g = np.array([0.0, -0.0, -0.0, 0.0, np.nan, 1.0, np.inf, -np.inf], np.float32)
    tvar, tm = tf.Variable(var), tf.Variable(m)
    run_op([tvar], [tm], [tf.constant(g)], "float32")
    want_var, want_m = np_lion_step(var, m, g, "float32")
    assert_same(tvar.numpy(), want_var, "var")
    assert_same(tm.numpy(), want_m, "m")
    assert_same(tvar.numpy()[:4], var[:4], "zero blends leave var as it was")
    assert np.signbit(tvar.numpy()[1]) and np.isnan(tvar.numpy()[4:6]).all()
    lr = np.float32(LR)  # +-inf gradients: a step of -+lr
    np.testing.assert_array_equal(tvar.numpy()[6:], [np.float32(0) - lr, np.float32(4) + lr])
    # And exactly what Keras gives.
    kvar = keras.Variable(var)
    opt = keras.optimizers.Lion(learning_rate=LR, beta_1=B1, beta_2=B2)
    opt.build([kvar])
    opt.variables[-1].assign(m)  # iterations, learning_rate, then the momentum
    opt.apply([tf.constant(g)], [kvar])
    assert_same(tvar.numpy(), np.asarray(kvar.numpy()), "var vs Keras")
    assert_same(tm.numpy(), np.asarray(opt.variables[-1].numpy()), "m vs Keras")


def test_subnormals_flush_like_keras(impl):
    # TF runs CPU ops with denormals flushed to zero: a subnormal blend has sign 0
    # (no step) in Keras, and so in the op.
    m = np.array([-2.7605678e-39, 1e-39, 0.0, 0.5], np.float32)
    g = np.array([0.0, 0.0, 1e-39, -1e-39], np.float32)
    tvar, tm = tf.Variable(np.ones(4, np.float32)), tf.Variable(m)
    run_op([tvar], [tm], [tf.constant(g)], "float32")
    kvar = keras.Variable(np.ones(4, np.float32))
    opt = keras.optimizers.Lion(learning_rate=LR, beta_1=B1, beta_2=B2)
    opt.build([kvar])
    opt.variables[-1].assign(m)
    opt.apply([tf.constant(g)], [kvar])
    np.testing.assert_array_equal(tvar.numpy(), np.asarray(kvar.numpy()))
    np.testing.assert_array_equal(tm.numpy(), np.asarray(opt.variables[-1].numpy()))
    np.testing.assert_array_equal(tvar.numpy()[:3], 1.0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("decay", [False, True])
def test_kernel_equals_reference_bitwise(dtype, decay):
    # The kernel against the per-variable Keras ops (the pure-TF reference),
    # with non-finite gradients in the mix, over 4 steps, N = 100.
    shapes = [(n % 37 + 1, (n * 7) % 13) for n in range(100)]
    var, m, grads = random_state(shapes, dtype, seed=2)
    grads[5][0, :] = np.inf
    grads[6][0, :] = np.nan
    grads[7][0, :] = 0.0
    rate = 1e-3 if decay else None
    results = []
    for reference in ("0", "1"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TFMETAL_EXT_REFERENCE_OPS", reference)
            tvars, tms = tf_variables(var, dtype), tf_variables(m, dtype)
            tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]
            for _ in range(4):
                run_op(tvars, tms, tgrads, dtype, decay_rate=rate)
            results.append([[as_f32(x) for x in group] for group in (tvars, tms)])
    kernel, reference = results
    for k, name in enumerate(("var", "m")):
        for i in range(len(shapes)):
            assert_same(kernel[k][i], reference[k][i], f"{name}[{i}]")
    assert np.isnan(kernel[0][6][0]).all() and np.isnan(kernel[1][6][0]).all()  # NaN gradients poison both
    assert np.isinf(kernel[1][5][0]).all() and np.isfinite(kernel[0][5][0]).all()  # inf ones only m


def test_large_input_uses_all_elements(impl):
    # Variables that span thread-pool blocks, with empty ones between them.
    shapes = [(100003,), (0,), (7,), (65537,), (0,), (1,)]
    var, m, grads = random_state(shapes, "float32", seed=3)
    tvars, tms = tf_variables(var, "float32"), tf_variables(m, "float32")
    run_op(tvars, tms, [tf.constant(g) for g in grads], "float32")
    for i in range(len(shapes)):
        want_var, want_m = np_lion_step(var[i], m[i], grads[i], "float32")
        assert_same(tvars[i].numpy(), want_var, f"var[{i}]")
        assert_same(tms[i].numpy(), want_m, f"m[{i}]")


def test_eager_and_tf_function_agree(impl):
    var, m, grads = random_state([(5, 3), (17,)], "float32", seed=4)
    outs = []
    for mode in ("eager", "function"):
        tvars, tms = tf_variables(var, "float32"), tf_variables(m, "float32")
        tgrads = [tf.constant(g) for g in grads]

        def step(tvars=tvars, tms=tms, tgrads=tgrads):
            run_op(tvars, tms, tgrads, "float32", decay_rate=1e-3)

        (tf.function(step) if mode == "function" else step)()
        outs.append([x.numpy() for x in tvars + tms])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    want = np_lion_step(var[0], m[0], grads[0], "float32", decay_rate=1e-3)
    assert_same(outs[0][0], want[0], "var[0]")


def test_graph_mode_returns_the_op(impl):
    tvar, tm = tf.Variable(tf.ones(3)), tf.Variable(tf.zeros(3))
    with tf.Graph().as_default():
        gvar, gm = tf.Variable(tf.ones(3)), tf.Variable(tf.zeros(3))
        op = ops.multi_tensor_lion([gvar], [gm], [tf.ones(3)], LR, B1, B2)
        assert isinstance(op, tf.Operation)
    assert run_op([tvar], [tm], [tf.ones(3)], "float32") is None  # eagerly


def test_keras_variables_and_indexed_slices(impl):
    var = keras.Variable(np.ones((4, 2), "float32"))
    m = keras.Variable(np.zeros((4, 2), "float32"))
    grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))
    ops.multi_tensor_lion([var], [m], [grad], 0.1, B1, B2)
    got = var.numpy()
    np.testing.assert_array_equal(got[2], np.float32(1) - np.float32(0.1))
    np.testing.assert_array_equal(got[[0, 1, 3]], 1.0)  # zero gradient rows: sign(0) = 0, no move
    np.testing.assert_allclose(m.numpy()[2], 1 - B2, rtol=1e-6)


def test_empty_variable_list_is_a_no_op(impl):
    assert ops.multi_tensor_lion([], [], [], LR, B1, B2) is None

    @tf.function
    def step():
        op = ops.multi_tensor_lion([], [], [], LR, B1, B2)
        assert op.type == "NoOp"

    step()


def test_only_empty_variables(impl):
    tvars, tms = [tf.Variable(tf.zeros((0, 3)))], [tf.Variable(tf.zeros((0, 3)))]
    run_op(tvars, tms, [tf.zeros((0, 3))], "float32")
    assert tvars[0].shape == (0, 3)


def test_pending_read_keeps_its_value():
    # Copy-on-write: a tensor read before the update is not changed by it.
    var, m = tf.Variable(np.ones(8, "float32")), tf.Variable(np.zeros(8, "float32"))
    before, m_before = var.read_value(), m.read_value()
    ops.multi_tensor_lion([var], [m], [tf.ones(8)], 0.1, B1, B2)
    np.testing.assert_array_equal(before.numpy(), np.ones(8))
    np.testing.assert_array_equal(m_before.numpy(), np.zeros(8))
    assert np.all(var.numpy() < 1.0)


# ----------------------------------------------------------------------------
# One op per call


def test_kernel_is_one_op_for_all_variables():
    var, m, grads = random_state([(16, 16)] * 10, "float32", seed=5)
    tvars, tms = tf_variables(var, "float32"), tf_variables(m, "float32")
    tgrads = [tf.constant(g) for g in grads]
    cap = inspect.capture_function(lambda: [run_op(tvars, tms, tgrads, "float32")][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("TfmetalExt>MultiTensorLion") == 1
    assert "Sign" not in counts and "AssignSubVariableOp" not in counts


def test_reference_is_keras_ops_per_variable(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    var, m, grads = random_state([(4,)] * 6, "float32", seed=6)
    tvars, tms = tf_variables(var, "float32"), tf_variables(m, "float32")
    tgrads = [tf.constant(g) for g in grads]
    cap = inspect.capture_function(lambda: [run_op(tvars, tms, tgrads, "float32")][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("Sign") == 6 and counts.get("AssignSubVariableOp") == 6
    assert "TfmetalExt>MultiTensorLion" not in counts


def test_avoid_fusions_runs_the_reference(monkeypatch):
    import tfmetal_ext

    var, m, grads = random_state([(4,)] * 3, "float32", seed=7)
    tvars, tms = tf_variables(var, "float32"), tf_variables(m, "float32")
    tgrads = [tf.constant(g) for g in grads]
    tfmetal_ext.configure("float32", avoid_fusions=["multi_tensor_lion"])
    try:
        cap = inspect.capture_function(lambda: [run_op(tvars, tms, tgrads, "float32")][:0])
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    counts = inspect.report_from_capture(cap).ops_by_type
    assert "TfmetalExt>MultiTensorLion" not in counts and counts.get("Sign") == 3


def test_kernel_registered_for_cpu_only_here():
    lib()
    assert multi_tensor_common.has_kernel("/job:localhost/replica:0/task:0/device:CPU:0", mtl_module._OP_NAME)
    assert multi_tensor_common.has_kernel("", mtl_module._OP_NAME)
    assert not multi_tensor_common.has_kernel("/device:GPU:0", mtl_module._OP_NAME)


# ----------------------------------------------------------------------------
# Errors


def _one(dtype=tf.float32, shape=(3,)):
    return tf.Variable(tf.zeros(shape, dtype))


def _call(**overrides):
    """multi_tensor_lion on one float32 variable of shape (3,), with arguments replaced."""
    args = dict(variables=[_one()], ms=[_one()], grads=[tf.zeros(3)])
    args.update(overrides)
    return ops.multi_tensor_lion(**args, lr=0.1, beta_1=0.9, beta_2=0.99)


f16 = tf.float16
BAD_ARGUMENTS = {
    "lengths": (lambda: _call(ms=[_one(), _one()]), r"Received: len\(variables\)=1, len\(ms\)=2, len\(grads\)=1"),
    "grads_length": (lambda: _call(grads=[]), r"Received: .*len\(grads\)=0"),
    "mixed_dtypes": (lambda: _call(variables=[_one(), _one(f16)], ms=[_one(), _one(f16)],
                                   grads=[tf.zeros(3), tf.zeros(3, f16)]), r"Received: variables\[1\].dtype=float16"),
    "slot_dtype": (lambda: _call(ms=[_one(f16)]), r"Received: ms\[0\].dtype=float16"),
    "float64": (lambda: _call(variables=[_one(tf.float64)], ms=[_one(tf.float64)], grads=[tf.zeros(3, tf.float64)]),
                r"Received: variables\[0\].dtype=float64"),
    "grad_dtype": (lambda: _call(grads=[tf.zeros(3, f16)]), r"Received: grads\[0\].dtype=float16"),
    "grad_shape": (lambda: _call(grads=[tf.zeros(4)]),
                   r"Received: grads\[0\].shape=\(4,\), variables\[0\].shape=\(3,\)"),
    "slot_shape": (lambda: _call(ms=[_one(shape=(4,))]), r"Received: grads\[0\].shape=\(3,\), ms\[0\].shape=\(4,\)"),
    "not_a_variable": (lambda: _call(variables=[tf.zeros(3)]), r"Received: variables\[0\]=<tf.Tensor"),
    "not_a_list": (lambda: _call(variables=_one()), r"Received: variables=<tf.Variable"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments(impl, case):
    call, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_same_variable_twice_is_rejected(impl):
    a = _one()
    with pytest.raises(ValueError, match=r"only once.*Received: variables\[1\] is also variables\[0\]"):
        _call(variables=[a, a], ms=[_one(), _one()], grads=[tf.zeros(3), tf.zeros(3)])
    with pytest.raises(ValueError, match=r"only once.*Received: ms\[0\] is also variables\[0\]"):
        _call(variables=[a], ms=[a])
    w = keras.Variable(np.zeros(3, "float32"))
    with pytest.raises(ValueError, match=r"Received: ms\[0\] is also variables\[0\]"):
        _call(variables=[w], ms=[w.value])


def _raw(variables, ms, grads, scalars=None, decay=()):
    s = scalars if scalars is not None else [tf.constant(x) for x in (0.1, 0.9, 0.99)]
    return lib().tfmetal_ext_multi_tensor_lion([x.handle for x in variables], [x.handle for x in ms], grads, *s,
                                               list(decay), [])


def _snapshot(*variables):
    return [v.numpy().copy() for v in variables]


def _assert_unchanged(variables, before):
    for i, (v, want) in enumerate(zip(variables, before)):
        np.testing.assert_array_equal(bits(v.numpy()), bits(want), err_msg=f"variable {i} changed")


KERNEL_ERRORS = {
    # A shape mismatch in the second variable: the first is left unchanged.
    "grad_shape": (lambda a, b, ma, mb: _raw([a, b], [ma, mb], [tf.ones(3), tf.ones(3)]),
                   r"variable 1: var, m and grad must have the same shape, got var \[2,2\], m \[2,2\], grad \[3\]"),
    "m_shape": (lambda a, b, ma, mb: _raw([a, b], [ma, ma], [tf.ones(3), tf.ones((2, 2))]),
                r"same variable is passed as m\[0\] and m\[1\]"),
    "slot_shape": (lambda a, b, ma, mb: _raw([a, b], [ma, _one(shape=(4,))], [tf.ones(3), tf.ones((2, 2))]),
                   r"variable 1: .*m \[4\]"),
    "var_twice": (lambda a, b, ma, mb: _raw([a, a], [ma, mb], [tf.ones(3), tf.ones(3)]),
                  r"same variable is passed as var\[0\] and var\[1\]; every var and m must be a distinct variable"),
    "var_is_m": (lambda a, b, ma, mb: _raw([a, b], [mb, b], [tf.ones(3), tf.ones((2, 2))]),
                 r"same variable is passed as var\[1\] and m\[1\]|same variable is passed as m\[1\] and var\[1\]"),
    "dtype": (lambda a, b, ma, mb: _raw([a, _one(tf.float16, (2, 2))], [ma, mb], [tf.ones(3), tf.ones((2, 2))]),
              r"var\[1\] has dtype half but T is float"),
    "scalar": (lambda a, b, ma, mb: _raw([a, b], [ma, mb], [tf.ones(3), tf.ones((2, 2))],
                                         scalars=[tf.constant(0.1), tf.ones(2), tf.constant(0.99)]),
               r"beta1 is not a scalar"),
    "decay_scalar": (lambda a, b, ma, mb: _raw([a, b], [ma, mb], [tf.ones(3), tf.ones((2, 2))], decay=[tf.ones(3)]),
                     r"weight_decay_rate is not a scalar"),
}


@pytest.mark.parametrize("case", list(KERNEL_ERRORS))
def test_kernel_rejects_bad_input_and_changes_nothing(case):
    call, message = KERNEL_ERRORS[case]
    a, b = _one(), _one(shape=(2, 2))
    ma, mb = _one(), _one(shape=(2, 2))
    for i, v in enumerate((a, b, ma, mb)):
        v.assign(np.arange(v.shape.num_elements(), dtype="float32").reshape(v.shape) + i + 0.5)
    before = _snapshot(a, b, ma, mb)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        call(a, b, ma, mb)
    _assert_unchanged((a, b, ma, mb), before)
    _raw([a, b], [ma, mb], [tf.ones(3), tf.ones((2, 2))])  # the right call still updates
    assert not np.array_equal(a.numpy(), before[0])


def test_shape_function_rejects_mismatch_when_tracing():
    a, ma = _one(), _one()

    @tf.function
    def step(g):
        _raw([a], [ma], [g])

    with pytest.raises(ValueError, match="variable 0: var, m and grad shapes differ"):
        step.get_concrete_function(tf.TensorSpec([4]))
    step.get_concrete_function(tf.TensorSpec([None]))  # unknown size: checked at run time


def test_run_time_shape_error_with_decay_changes_nothing(impl):
    # Inside a tf.function grappler folds an Assert on tf.shape(grad) away when the
    # update consuming grad implies its shape; the decay must still not be written.
    var, m = tf.Variable(np.ones(1, np.float32)), tf.Variable(np.ones(1, np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None])])
    def step(g):
        ops.multi_tensor_lion([var], [m], [g], LR, B1, B2, weight_decay_rate=1e-3)

    with pytest.raises(tf.errors.InvalidArgumentError):
        step(tf.ones(2))
    np.testing.assert_array_equal(var.numpy(), [1.0])
    np.testing.assert_array_equal(m.numpy(), [1.0])


def test_run_time_shape_error_changes_no_variable(impl):
    # The last gradient's size is only known when the step runs: the error must
    # come before any update, in the per-variable fallback as in the kernel.
    variables = [_one(shape=(3,)) for _ in range(3)]
    ms = [_one(shape=(3,)) for _ in range(3)]
    for i, v in enumerate(variables + ms):
        v.assign(np.arange(3, dtype="float32") + i)
    before = _snapshot(*variables, *ms)

    @tf.function(input_signature=[tf.TensorSpec([None])])
    def step(last):
        ops.multi_tensor_lion(variables, ms, [tf.ones(3), tf.ones(3), last], 0.1, 0.9, 0.99, weight_decay_rate=0.01)

    # The kernel names the variable; the fallback's EnsureShape the gradient's expected shape.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variable 2|expected shape \[3\]"):
        step(tf.ones(4))
    _assert_unchanged(variables + ms, before)
    step(tf.ones(3))  # the right size still trains
    assert not np.array_equal(variables[2].numpy(), before[2])


# ----------------------------------------------------------------------------
# Loss scaling (`scale=`): as for multi_tensor_adam (tests/ops/test_multi_tensor_adam.py)


def scaled_grads(grads, scale, dtype):
    """(grads * scale in the dtype; those divided by `scale` in float32, rounded to the dtype)."""
    t = NP_DTYPES[dtype]
    up = [(np.asarray(g, np.float32) * np.float32(scale)).astype(t) for g in grads]
    down = [(u.astype(np.float32) / np.float32(scale)).astype(t) for u in up]
    return up, down


@pytest.mark.parametrize("scale", [2.0 ** 10, 1000.0, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_is_the_update_with_unscaled_gradients(impl, dtype, scale):
    var, m, grads = random_state(SHAPES, dtype, seed=7)
    up, down = scaled_grads([0.01 * g for g in grads], scale, dtype)
    s = [tf.constant(x, DTYPES[dtype]) for x in (LR, B1, B2)]
    got = [tf_variables(x, dtype) for x in (var, m)]
    found = ops.multi_tensor_lion(*got, [tf.constant(g) for g in up], *s, weight_decay_rate=1e-3, scale=scale)
    assert found.dtype == tf.bool and not bool(found)
    want = [tf_variables(x, dtype) for x in (var, m)]
    ops.multi_tensor_lion(*want, [tf.constant(g) for g in down], *s, weight_decay_rate=1e-3)
    for k in range(2):
        for i, shape in enumerate(SHAPES):
            assert_same(as_f32(got[k][i]), as_f32(want[k][i]), f"slot {k}[{i}] {shape}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_non_finite_gradient_updates_nothing(impl, dtype):
    var, m, grads = random_state(SHAPES, dtype, seed=8)
    grads[-1].reshape(-1)[-1] = -np.inf
    for mode in ("eager", "function"):
        tvars = [tf_variables(x, dtype) for x in (var, m)]
        tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]

        def step(tvars=tvars, tgrads=tgrads):
            s = [tf.constant(x, DTYPES[dtype]) for x in (LR, B1, B2)]
            return ops.multi_tensor_lion(*tvars, tgrads, *s, weight_decay_rate=1e-3, scale=tf.constant(8.0))

        assert bool((tf.function(step) if mode == "function" else step)()), mode
        for k, want in enumerate((var, m)):
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(as_f32(tvars[k][i]), want[i].astype(np.float32), err_msg=f"{mode} {k}[{i}]")


def test_loss_scale_is_one_op_without_finite_checks():
    var, m, grads = random_state([(16, 16)] * 6, "float32", seed=9)
    tvars, tms = (tf_variables(x, "float32") for x in (var, m))
    scale = tf.Variable(1024.0)
    cap = inspect.capture_function(
        lambda: ops.multi_tensor_lion(tvars, tms, [tf.constant(g) for g in grads], LR, B1, B2, scale=scale))
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("TfmetalExt>MultiTensorLion") == 1, counts
    assert not {"IsFinite", "RealDiv", "If", "StatelessIf", "Switch"} & set(counts), counts


def test_kernel_rejects_a_bad_scale_and_changes_nothing():
    a, ma = _one(), _one()
    a.assign([1.0, 2.0, 3.0])
    s = [tf.constant(x) for x in (0.1, 0.9, 0.99)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="scale is not a scalar"):
        lib().tfmetal_ext_multi_tensor_lion([a.handle], [ma.handle], [tf.ones(3)], *s, [], [tf.ones(2)])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"scale.shape=\(2,\)"):
        _call(scale=[1.0, 2.0])
