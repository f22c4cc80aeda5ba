"""multi_tensor_adam: CPU kernel and pure-TF reference against numpy, bitwise against
ResourceApplyAdam, argument and input errors, one op per call.

The numpy reference repeats TF's ResourceApplyAdam operation by operation, each
result rounded to the variable's dtype (via float32, as Eigen computes half and
bfloat16 ops in float and rounds), so the op must match it bit for bit; a float64
textbook Adam checks that this is Adam at all.
"""

import importlib

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras
from tfmetal_ext import inspect, ops, testing
from tfmetal_ext.ops import _multi_tensor as multi_tensor_common

mta_module = importlib.import_module("tfmetal_ext.ops.multi_tensor_adam")

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
HYPER = dict(lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
# Odd sizes, an empty variable, a scalar, and one larger than a thread-pool block.
SHAPES = [(1,), (31,), (33,), (1000,), (0,), (), (7, 3, 5), (64, 64), (70001,)]


def lib():
    library = ops._loader.load()
    assert library is not None, ops.status()
    return library


# ----------------------------------------------------------------------------
# numpy references


def rounder(dtype):
    """float64 array -> the nearest value of `dtype` (through float32, like Eigen) -> float64."""
    target = NP_DTYPES[dtype]
    return lambda x: np.asarray(x, np.float64).astype(np.float32).astype(target).astype(np.float64)


def np_adam_step(state, g, scalars, dtype, amsgrad=False, decay_rate=None):
    """One step of ResourceApplyAdam(WithAmsgrad), operation by operation in `dtype`."""
    return testing.np_adam_step(state, g, scalars, NP_DTYPES[dtype], amsgrad, decay_rate)


def textbook_adam(var, g, steps, lr=0.01, b1=0.9, b2=0.999, eps=1e-7):
    """Adam in float64 as Kingma & Ba write it ("epsilon hat" form), constant gradient."""
    m = v = np.zeros_like(var)
    for t in range(1, steps + 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        var = var - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    return var


def random_state(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    r = rounder(dtype)
    var = [r(rng.normal(0, 1, s)) for s in shapes]
    m = [r(rng.normal(0, 0.1, s)) for s in shapes]
    v = [r(rng.uniform(0, 0.1, s)) for s in shapes]
    vhat = [r(x + rng.uniform(0, 0.05, x.shape)) for x in v]
    grads = [r(rng.normal(0, 1, s)) for s in shapes]
    return var, m, v, vhat, grads


def tf_variables(arrays, dtype):
    return [tf.Variable(tf.constant(a, DTYPES[dtype])) for a in arrays]


def scalars_for(step, dtype):
    eps = HYPER["epsilon"] if dtype == "float32" else 1e-4  # 1e-7 is subnormal in half
    return [HYPER["lr"], HYPER["beta_1"], HYPER["beta_2"], eps, HYPER["beta_1"] ** step, HYPER["beta_2"] ** step]


def as_f64(variable):
    return tf.cast(variable, tf.float64).numpy()


def run_op(variables, ms, vs, grads, scalars, dtype, vhats=None, decay_rate=None):
    """multi_tensor_adam with the scalars as tensors of `dtype` (as the optimizer passes them)."""
    s = [tf.constant(x, DTYPES[dtype]) for x in scalars]
    rate = None if decay_rate is None else tf.constant(decay_rate, DTYPES[dtype])
    return ops.multi_tensor_adam(variables, ms, vs, grads, *s, vhats=vhats, weight_decay_rate=rate)


# ----------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("amsgrad, decay", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_numpy_bitwise(impl, dtype, amsgrad, decay):
    var, m, v, vhat, grads = random_state(SHAPES, dtype)
    tvars, tms, tvs, tvhats = (tf_variables(x, dtype) for x in (var, m, v, vhat))
    tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]
    rate = 4e-5 if decay else None
    want = [(a, b, c, d) for a, b, c, d in zip(var, m, v, vhat)]
    for step in (1, 2, 3):
        scalars = scalars_for(step, dtype)
        run_op(tvars, tms, tvs, tgrads, scalars, dtype, vhats=tvhats if amsgrad else None, decay_rate=rate)
        want = [np_adam_step(w, g, scalars, dtype, amsgrad, rate) for w, g in zip(want, grads)]
    for i, shape in enumerate(SHAPES):
        got = (tvars[i], tms[i], tvs[i], tvhats[i])
        for k, name in enumerate(("var", "m", "v", "vhat")):
            assert tuple(got[k].shape) == shape
            np.testing.assert_array_equal(as_f64(got[k]), want[i][k], err_msg=f"{name}[{i}] shape={shape}")
    # The variables moved, and stay unchanged where the op must not touch them.
    assert np.abs(as_f64(tvars[3]) - var[3]).max() > 1e-3
    if not amsgrad:
        np.testing.assert_array_equal(as_f64(tvhats[3]), vhat[3])


def test_is_adam(impl):
    # Against float64 Adam from zero moments, 5 steps with a constant gradient.
    # (float32 only: in bfloat16, beta_2=0.999 rounds to 1, and half/bfloat16
    # results are pinned bitwise to TF's own kernel above instead.)
    rng = np.random.default_rng(1)
    w0 = rounder("float32")(rng.normal(0, 1, 500))
    g = rounder("float32")(rng.normal(0, 1, 500))
    tvar = tf.Variable(tf.constant(w0, tf.float32))
    tm, tv = (tf.Variable(tf.zeros(500)) for _ in range(2))
    for step in range(1, 6):
        run_op([tvar], [tm], [tv], [tf.constant(g, tf.float32)], scalars_for(step, "float32"), "float32")
    want = textbook_adam(w0, g, 5)
    np.testing.assert_allclose(as_f64(tvar), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - w0).min() > 0.04  # every element moved about 5 * lr


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("amsgrad, decay", [(False, False), (True, True)])
def test_bitwise_equal_to_resource_apply_adam(dtype, amsgrad, decay):
    # The kernel against TF's own per-variable ops (the pure-TF reference),
    # with non-finite gradients in the mix, over 4 steps, N = 100.
    shapes = [(n % 37 + 1, (n * 7) % 13) for n in range(100)]
    var, m, v, vhat, grads = random_state(shapes, dtype, seed=2)
    grads[5][0, :] = np.inf
    grads[6][0, :] = np.nan
    rate = 1e-3 if decay else None
    results = []
    for reference in ("0", "1"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TFMETAL_EXT_REFERENCE_OPS", reference)
            tvars, tms, tvs, tvhats = (tf_variables(x, dtype) for x in (var, m, v, vhat))
            tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]
            for step in range(1, 5):
                run_op(tvars, tms, tvs, tgrads, scalars_for(step, dtype), dtype,
                       vhats=tvhats if amsgrad else None, decay_rate=rate)
            results.append([[x.numpy() for x in group] for group in (tvars, tms, tvs, tvhats)])
    kernel, reference = results
    bits = np.uint32 if dtype == "float32" else np.uint16
    for k, name in enumerate(("var", "m", "v", "vhat")):
        for i in range(len(shapes)):
            a, b = kernel[k][i], reference[k][i]
            nan = np.isnan(a.astype(np.float32))
            # Same NaNs; every other value in the same bits. (The sign of a
            # NaN is not specified: Eigen's bfloat16 packets make it positive.)
            np.testing.assert_array_equal(nan, np.isnan(b.astype(np.float32)), err_msg=f"{name}[{i}] NaNs differ")
            np.testing.assert_array_equal(a[~nan].view(bits), b[~nan].view(bits), err_msg=f"{name}[{i}] bits differ")
    assert np.isnan(kernel[0][6][0]).all() and np.isnan(kernel[0][5][0]).all()  # inf - inf in m / sqrt(v)


def test_large_input_uses_all_elements(impl):
    # Variables that span thread-pool blocks, with empty ones between them.
    shapes = [(100003,), (0,), (7,), (65537,), (0,), (1,)]
    var, m, v, vhat, grads = random_state(shapes, "float32", seed=3)
    tvars, tms, tvs = (tf_variables(x, "float32") for x in (var, m, v))
    run_op(tvars, tms, tvs, [tf.constant(g, tf.float32) for g in grads], scalars_for(1, "float32"), "float32")
    for i in range(len(shapes)):
        want = np_adam_step((var[i], m[i], v[i], vhat[i]), grads[i], scalars_for(1, "float32"), "float32")
        np.testing.assert_array_equal(as_f64(tvars[i]), want[0])


def test_eager_and_tf_function_agree(impl):
    var, m, v, vhat, grads = random_state([(5, 3), (17,)], "float32", seed=4)
    outs = []
    for mode in ("eager", "function"):
        tvars, tms, tvs = (tf_variables(x, "float32") for x in (var, m, v))
        tgrads = [tf.constant(g, tf.float32) for g in grads]

        def step(tvars=tvars, tms=tms, tvs=tvs, tgrads=tgrads):
            run_op(tvars, tms, tvs, tgrads, scalars_for(1, "float32"), "float32")

        (tf.function(step) if mode == "function" else step)()
        outs.append([x.numpy() for x in tvars + tms + tvs])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_keras_variables_and_indexed_slices(impl):
    var = keras.Variable(np.ones((4, 2), "float32"))
    m, v = keras.Variable(np.zeros((4, 2), "float32")), keras.Variable(np.zeros((4, 2), "float32"))
    grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))
    ops.multi_tensor_adam([var], [m], [v], [grad], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999)
    got = var.numpy()
    assert got[2, 0] == pytest.approx(0.9, abs=1e-5)
    np.testing.assert_array_equal(got[[0, 1, 3]], 1.0)  # zero gradient rows: m = v = 0, no move


def test_empty_variable_list_is_a_no_op(impl):
    assert ops.multi_tensor_adam([], [], [], [], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999) is None


def test_only_empty_variables(impl):
    tvars, tms, tvs = ([tf.Variable(tf.zeros((0, 3)))] for _ in range(3))
    run_op(tvars, tms, tvs, [tf.zeros((0, 3))], scalars_for(1, "float32"), "float32")
    assert tvars[0].shape == (0, 3)


def test_pending_read_keeps_its_value():
    # Copy-on-write: a tensor read before the update is not changed by it.
    var = tf.Variable(np.ones(8, "float32"))
    m, v = tf.Variable(np.zeros(8, "float32")), tf.Variable(np.zeros(8, "float32"))
    before = var.read_value()
    ops.multi_tensor_adam([var], [m], [v], [tf.ones(8)], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999)
    np.testing.assert_array_equal(before.numpy(), np.ones(8))
    assert np.all(var.numpy() < 1.0)


# ----------------------------------------------------------------------------
# One op per call


def test_kernel_is_one_op_for_all_variables():
    var, m, v, _, grads = random_state([(16, 16)] * 10, "float32", seed=5)
    tvars, tms, tvs = (tf_variables(x, "float32") for x in (var, m, v))
    tgrads = [tf.constant(g, tf.float32) for g in grads]
    cap = inspect.capture_function(lambda: [run_op(tvars, tms, tvs, tgrads, scalars_for(1, "float32"), "float32")][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("TfmetalExt>MultiTensorAdam") == 1
    assert "ResourceApplyAdam" not in counts


def test_reference_is_one_training_op_per_variable(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    var, m, v, _, grads = random_state([(4,)] * 6, "float32", seed=6)
    tvars, tms, tvs = (tf_variables(x, "float32") for x in (var, m, v))
    tgrads = [tf.constant(g, tf.float32) for g in grads]
    cap = inspect.capture_function(lambda: [run_op(tvars, tms, tvs, tgrads, scalars_for(1, "float32"), "float32")][:0])
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("ResourceApplyAdam") == 6 and "TfmetalExt>MultiTensorAdam" not in counts


def test_kernel_registered_for_cpu_only_here():
    # Devices without a kernel (CUDA, Apple GPUs until the Metal kernel) use
    # the per-variable reference instead of failing placement.
    lib()
    assert multi_tensor_common.has_kernel("/job:localhost/replica:0/task:0/device:CPU:0", mta_module._OP_NAME)
    assert multi_tensor_common.has_kernel("", mta_module._OP_NAME)
    assert not multi_tensor_common.has_kernel("/device:GPU:0", mta_module._OP_NAME)


# ----------------------------------------------------------------------------
# Errors


def _one(dtype=tf.float32, shape=(3,)):
    return tf.Variable(tf.zeros(shape, dtype))


def _call(**overrides):
    """multi_tensor_adam on one float32 variable of shape (3,), with arguments replaced."""
    args = dict(variables=[_one()], ms=[_one()], vs=[_one()], grads=[tf.zeros(3)])
    args.update(overrides)
    return ops.multi_tensor_adam(**args, lr=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7, beta_1_power=0.9,
                                 beta_2_power=0.999)


f16 = tf.float16
BAD_ARGUMENTS = {
    "lengths": (lambda: _call(ms=[_one(), _one()]),
                r"Received: len\(variables\)=1, len\(ms\)=2, len\(vs\)=1, len\(grads\)=1"),
    "vhats_length": (lambda: _call(vhats=[]), r"Received: .*len\(vhats\)=0"),
    "mixed_dtypes": (lambda: _call(variables=[_one(), _one(f16)], ms=[_one(), _one(f16)], vs=[_one(), _one(f16)],
                                   grads=[tf.zeros(3), tf.zeros(3, f16)]), r"Received: variables\[1\].dtype=float16"),
    "slot_dtype": (lambda: _call(ms=[_one(f16)]), r"Received: ms\[0\].dtype=float16"),
    "float64": (lambda: _call(variables=[_one(tf.float64)], ms=[_one(tf.float64)], vs=[_one(tf.float64)],
                              grads=[tf.zeros(3, tf.float64)]), r"Received: variables\[0\].dtype=float64"),
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


def _raw(variables, ms, vs, grads, vhats=(), scalars=None, decay=()):
    s = scalars if scalars is not None else [tf.constant(x) for x in (0.1, 0.9, 0.999, 1e-7, 0.9, 0.999)]
    handles = [[x.handle for x in group] for group in (variables, ms, vs, vhats)]
    return lib().tfmetal_ext_multi_tensor_adam(*handles, grads, *s, list(decay), [])


def test_kernel_rejects_bad_input_and_changes_nothing():
    a, b = _one(), _one(shape=(2, 2))
    ma, mb, va, vb = _one(), _one(shape=(2, 2)), _one(), _one(shape=(2, 2))
    a.assign([1.0, 2.0, 3.0])
    # Shape mismatch in the second variable: an error naming it, and the
    # first variable is left unchanged (everything is checked first).
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variable 1: .*same shape.*grad \[3\]"):
        _raw([a, b], [ma, mb], [va, vb], [tf.ones(3), tf.ones(3)])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variable 0: .*m \[2,2\]"):
        _raw([a], [mb], [va], [tf.ones(3)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"var\[0\] has dtype half but T is float"):
        _raw([_one(tf.float16)], [ma], [va], [tf.ones(3)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"same variable is passed as var\[0\] and m\[0\]"):
        _raw([a], [a], [va], [tf.ones(3)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"beta2_power is not a scalar"):
        bad = [tf.constant(x) for x in (0.1, 0.9, 0.999, 1e-7, 0.9)] + [tf.ones(2)]
        _raw([a], [ma], [va], [tf.ones(3)], scalars=bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"vhat must hold 0 \(Adam\) or N"):
        _raw([a, b], [ma, mb], [va, vb], [tf.ones(3), tf.ones((2, 2))], vhats=[_one()])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])


def test_shape_function_rejects_mismatch_when_tracing():
    a, ma, va = _one(), _one(), _one()

    @tf.function
    def step(g):
        _raw([a], [ma], [va], [g])

    with pytest.raises(ValueError, match="variable 0: var, m, v and grad shapes differ"):
        step.get_concrete_function(tf.TensorSpec([4]))
    step.get_concrete_function(tf.TensorSpec([None]))  # unknown size: checked at run time


def test_same_variable_twice_is_rejected(impl):
    a, b = _one(), _one()
    with pytest.raises(ValueError, match=r"only once.*Received: variables\[1\] is also variables\[0\]"):
        _call(variables=[a, a], ms=[_one(), _one()], vs=[_one(), _one()], grads=[tf.zeros(3), tf.zeros(3)])
    with pytest.raises(ValueError, match=r"only once.*Received: ms\[0\] is also variables\[0\]"):
        _call(variables=[a], ms=[a], vs=[b])
    w = keras.Variable(np.zeros(3, "float32"))
    with pytest.raises(ValueError, match=r"Received: vs\[0\] is also variables\[0\]"):
        _call(variables=[w], vs=[w.value])


def test_run_time_shape_error_changes_no_variable(impl):
    # The last gradient's size is only known when the step runs: the error must
    # come before any update, in the per-variable fallback as in the kernel.
    variables = [_one(shape=(3,)) for _ in range(3)]
    slots = [[_one(shape=(3,)) for _ in range(3)] for _ in range(2)]
    for i, v in enumerate(variables + slots[0] + slots[1]):
        v.assign(np.arange(3, dtype="float32") + i)
    before = [v.numpy().copy() for v in variables + slots[0] + slots[1]]

    @tf.function(input_signature=[tf.TensorSpec([None])])
    def step(last):
        ops.multi_tensor_adam(variables, slots[0], slots[1], [tf.ones(3), tf.ones(3), last], 0.1, 0.9, 0.999,
                              1e-7, 0.9, 0.999)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"grads\[2\]|grads_2_takes_the_shape_of_variables_2|variable 2"):
        step(tf.ones(4))
    for got, want in zip(variables + slots[0] + slots[1], before):
        np.testing.assert_array_equal(got.numpy(), want)
    step(tf.ones(3))  # the right size still trains
    assert not np.array_equal(variables[2].numpy(), before[2])


# ----------------------------------------------------------------------------
# Loss scaling (`scale=`): the finite check first, then the update with grads / scale or nothing


def scaled_grads(grads, scale, dtype):
    """(grads * scale in the dtype, what a loss-scaled step hands the op; those divided by `scale` in
    float32 and rounded to the dtype: the gradients the update must use, as Keras unscales)."""
    t = NP_DTYPES[dtype]
    up = [(np.asarray(g, np.float32) * np.float32(scale)).astype(t) for g in grads]
    down = [(u.astype(np.float32) / np.float32(scale)).astype(t) for u in up]
    return up, down


@pytest.mark.parametrize("scale", [2.0 ** 10, 1000.0, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_is_the_update_with_unscaled_gradients(impl, dtype, scale):
    var, m, v, vhat, grads = random_state(SHAPES, dtype, seed=7)
    up, down = scaled_grads([0.01 * g for g in grads], scale, dtype)
    scalars = scalars_for(2, dtype)
    got = [tf_variables(x, dtype) for x in (var, m, v, vhat)]
    found = ops.multi_tensor_adam(*got[:3], [tf.constant(g) for g in up], *scalars, vhats=got[3],
                                  weight_decay_rate=4e-5, scale=scale)
    assert found.dtype == tf.bool and found.shape == () and not bool(found)
    want = [tf_variables(x, dtype) for x in (var, m, v, vhat)]
    ops.multi_tensor_adam(*want[:3], [tf.constant(g) for g in down], *scalars, vhats=want[3], weight_decay_rate=4e-5)
    for k, name in enumerate(("var", "m", "v", "vhat")):
        for i, shape in enumerate(SHAPES):
            np.testing.assert_array_equal(as_f64(got[k][i]), as_f64(want[k][i]), err_msg=f"{name}[{i}] {shape}")
    assert np.abs(as_f64(got[0][3]) - var[3]).max() > 1e-4  # it moved


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_loss_scale_non_finite_gradient_updates_nothing(impl, dtype, bad):
    # One element of one gradient among many: no variable, slot or decay is written, in a
    # tf.function as eagerly, and the flag says so.
    var, m, v, vhat, grads = random_state(SHAPES, dtype, seed=8)
    grads[6][3, 1, 2] = bad
    for mode in ("eager", "function"):
        tvars = [tf_variables(x, dtype) for x in (var, m, v, vhat)]
        tgrads = [tf.constant(g, DTYPES[dtype]) for g in grads]

        def step(tvars=tvars, tgrads=tgrads):
            return ops.multi_tensor_adam(*tvars[:3], tgrads, *scalars_for(1, dtype), vhats=tvars[3],
                                         weight_decay_rate=1e-3, scale=tf.constant(2.0 ** 15))

        found = (tf.function(step) if mode == "function" else step)()
        assert bool(found), mode
        for k, want in enumerate((var, m, v, vhat)):
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(as_f64(tvars[k][i]), want[i], err_msg=f"{mode} slot {k}[{i}]")


def test_loss_scale_reads_a_variable_and_keeps_signature_without_it(impl):
    # `scale` may be a (Keras) variable; without it the wrapper returns what it always did.
    scale = keras.Variable(np.float32(256.0), trainable=False)
    tvars, tms, tvs = ([tf.Variable(tf.ones(4))] for _ in range(3))
    found = ops.multi_tensor_adam(tvars, tms, tvs, [tf.fill([4], 256.0)], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999,
                                  scale=scale)
    assert not bool(found)
    assert ops.multi_tensor_adam(tvars, tms, tvs, [tf.ones(4)], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999) is None
    assert not bool(ops.multi_tensor_adam([], [], [], [], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999, scale=2.0))


def test_loss_scale_is_one_op_without_finite_checks():
    # The kernel checks, unscales and updates: no IsFinite, no per-gradient division, no cond.
    var, m, v, _, grads = random_state([(16, 16)] * 6, "float32", seed=9)
    tvars, tms, tvs = (tf_variables(x, "float32") for x in (var, m, v))
    tgrads = [tf.constant(g, tf.float32) for g in grads]
    scale = tf.Variable(1024.0)
    cap = inspect.capture_function(
        lambda: ops.multi_tensor_adam(tvars, tms, tvs, tgrads, *scalars_for(1, "float32"), scale=scale))
    counts = inspect.report_from_capture(cap).ops_by_type
    assert counts.get("TfmetalExt>MultiTensorAdam") == 1, counts
    for op in ("IsFinite", "RealDiv", "If", "StatelessIf", "Switch", "ResourceApplyAdam"):
        assert op not in counts, counts


@pytest.mark.parametrize("scale, message", [
    ([1.0, 2.0], r"scale.shape=\(2,\)"), (True, "Received: scale=True"), ("2", "scale.dtype=string")])
def test_loss_scale_bad_arguments(scale, message):
    with pytest.raises(ValueError, match=message):
        _call(scale=scale)


def test_kernel_rejects_a_bad_scale_and_changes_nothing():
    a, ma, va = _one(), _one(), _one()
    a.assign([1.0, 2.0, 3.0])
    s = [tf.constant(x) for x in (0.1, 0.9, 0.999, 1e-7, 0.9, 0.999)]
    raw = lib().tfmetal_ext_multi_tensor_adam
    with pytest.raises(tf.errors.InvalidArgumentError, match="scale is not a scalar"):
        raw([a.handle], [ma.handle], [va.handle], [], [tf.ones(3)], *s, [], [tf.ones(2)])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])
