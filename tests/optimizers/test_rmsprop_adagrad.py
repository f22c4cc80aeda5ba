"""FusedRMSprop / FusedAdagrad (and FusedSGD with Nesterov momentum) against the Keras optimizers of the same name.

The reference is the stock Keras optimizer with the same arguments on an
identical model and data in the same process (plus numpy for Adagrad's
epsilon placement). The model, data and "relative difference" helpers are
test_optimizers.py's.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.optimizers.test_optimizers import (
    apply_steps,
    assert_same_training,
    conv_net,
    data,
    fit_embedding,
    max_relative_diff,
    op_types,
    train,
    variables_and_grads,
)
from tfmetal_ext import devices, inspect
from tfmetal_ext.optimizers import FusedAdagrad, FusedRMSprop, FusedSGD
from tfmetal_ext.optimizers.adagrad import epsilon_placement_error

PLUGIN = "tensorflow-metal-plugin"

PAIRS = {
    "rmsprop": (keras.optimizers.RMSprop, FusedRMSprop),
    "adagrad": (keras.optimizers.Adagrad, FusedAdagrad),
    "sgd": (keras.optimizers.SGD, FusedSGD),
}

CASES = [
    ("rmsprop", {}),
    ("rmsprop", {"momentum": 0.9}),
    ("rmsprop", {"centered": True}),
    ("rmsprop", {"centered": True, "momentum": 0.9}),
    ("adagrad", {"learning_rate": 0.01}),
    ("adagrad", {"learning_rate": 0.01, "initial_accumulator_value": 0.0}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
]
CASE_IDS = ["rmsprop", "rmsprop_momentum", "centered", "centered_momentum", "adagrad", "adagrad_acc0", "nesterov"]


def make(name, kwargs, which):
    stock, ours = PAIRS[name]
    return (ours if which == "ours" else stock)(**kwargs)


def layout(opt):
    return [(v.name, tuple(v.shape), v.dtype) for v in opt.variables]


# ----------------------------------------------------------------------------
# Equivalence: 100 steps of a real model, f32.


@pytest.mark.sample_axes("kwargs")  # one configuration per optimizer in the quick tier, every one in the full tier
@pytest.mark.parametrize("name, kwargs", CASES, ids=CASE_IDS)
def test_matches_keras_after_100_steps(name, kwargs):
    got, want = assert_same_training(make(name, kwargs, "stock"), make(name, kwargs, "ours"))
    # (The models' own names differ: sequential, sequential_1.)
    assert [(n.rsplit("_", 1)[-1], s, d) for n, s, d in layout(got.optimizer)] == \
        [(n.rsplit("_", 1)[-1], s, d) for n, s, d in layout(want.optimizer)]
    slots = [v.numpy() for v in got.optimizer.variables]
    ref_slots = [v.numpy() for v in want.optimizer.variables]
    assert max_relative_diff(slots[1:], ref_slots[1:]) <= 1e-5  # learning rate and the slots


def test_optimizer_variables_are_keras_own():
    variables, _ = variables_and_grads(2)
    for kwargs, slots in [({}, ["velocity"]), ({"momentum": 0.5}, ["velocity", "momentum"]),
                          ({"centered": True}, ["velocity", "average_gradient"]),
                          ({"centered": True, "momentum": 0.5}, ["velocity", "momentum", "average_gradient"])]:
        ours, stock = FusedRMSprop(**kwargs), keras.optimizers.RMSprop(**kwargs)
        ours.build(variables)
        stock.build(variables)
        assert layout(ours) == layout(stock)
        names = [v.name for v in ours.variables[2:]]
        assert len(names) == 2 * len(slots)
        assert all(n.endswith("_" + slot) for n, slot in zip(names[::2], slots)), names
    ours, stock = FusedAdagrad(initial_accumulator_value=0.3), keras.optimizers.Adagrad(initial_accumulator_value=0.3)
    ours.build(variables)
    stock.build(variables)
    assert layout(ours) == layout(stock)
    np.testing.assert_array_equal(ours.variables[2].numpy(), np.full((16, 16), 0.3, "float32"))


def test_adagrad_epsilon_inside_the_square_root_with_tiny_accumulators():
    # initial_accumulator_value=0 and gradients of 1e-6: sqrt(acc + eps) is ~3e-4 where
    # sqrt(acc) + eps is ~1e-6, so TF's ResourceApplyAdagradV2 would step ~300x further.
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(500).astype("float32")
    grads = [(rng.standard_normal(500) * 1e-6).astype("float32") for _ in range(20)]
    lr, eps = 0.1, 1e-7
    w, acc = w0.astype(np.float64), np.zeros(500)
    for g in grads:  # Keras' Adagrad in float64
        acc += g.astype(np.float64) ** 2
        w -= lr * g / np.sqrt(acc + eps)
    opt = FusedAdagrad(lr, initial_accumulator_value=0.0, epsilon=eps)
    assert "epsilon outside the square root" in opt.composite_reason("float32")
    got = apply_steps(opt, w0, grads)
    keras_result = apply_steps(keras.optimizers.Adagrad(lr, initial_accumulator_value=0.0, epsilon=eps), w0, grads)
    assert np.linalg.norm(got - w) / np.linalg.norm(w - w0) < 1e-4
    np.testing.assert_allclose(got, keras_result, rtol=0, atol=1e-7)
    # The one-op form really is that far off here (why it is not used).
    var, accum = tf.Variable(w0), tf.Variable(np.zeros(500, "float32"))
    for g in grads:
        tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=accum.handle, lr=lr, epsilon=eps, grad=g)
    assert np.linalg.norm(var.numpy() - w) / np.linalg.norm(w - w0) > 10


def test_adagrad_placement_error_bound():
    # Checked against a dense float64 sweep of accumulator values.
    for a0, eps in [(0.1, 1e-7), (0.0, 1e-7), (1.0, 1e-7), (0.01, 1e-6), (4.0, 1e-3)]:
        a = np.concatenate([[a0], a0 + np.geomspace(1e-12, 1e8, 200000)])
        ratio = np.sqrt(a + eps) / (np.sqrt(a) + eps) - 1
        want = np.inf if a0 == 0 else np.max(np.abs(ratio))
        got = epsilon_placement_error(a0, eps)
        assert got == want if a0 == 0 else abs(got - want) <= 0.03 * want, (a0, eps, got, want)
    assert FusedAdagrad().composite_reason("float32") is None  # the defaults: 1.8e-7 < 2 float32 ulps
    assert FusedAdagrad(initial_accumulator_value=1e-3).composite_reason("float32") is not None


def test_float16_variables_match_keras():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((64,)).astype("float16")
    grads = [rng.standard_normal((64,)).astype("float16") for _ in range(10)]
    for stock, ours in [(lambda: keras.optimizers.RMSprop(0.01), lambda: FusedRMSprop(0.01)),
                        (lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
                         lambda: FusedRMSprop(0.01, momentum=0.5, centered=True)),
                        (lambda: keras.optimizers.Adagrad(0.05), lambda: FusedAdagrad(0.05)),
                        (lambda: keras.optimizers.SGD(0.05, 0.9, True), lambda: FusedSGD(0.05, 0.9, True))]:
        results = []
        for opt in (stock(), ours()):
            var = keras.Variable(w0, dtype="float16")
            for g in grads:
                opt.apply([tf.constant(g)], [var])  # eager
            results.append(var.numpy().astype(np.float32))
        np.testing.assert_allclose(results[1], results[0], rtol=2e-2, atol=2e-3)
        assert np.abs(results[1] - w0).max() > 0.02


@pytest.mark.parametrize("stock, ours", [
    (lambda: keras.optimizers.RMSprop(0.01), lambda: FusedRMSprop(0.01)),
    (lambda: keras.optimizers.Adagrad(0.1), lambda: FusedAdagrad(0.1)),
    (lambda: keras.optimizers.SGD(0.1, 0.5, True), lambda: FusedSGD(0.1, 0.5, True)),
], ids=["rmsprop", "adagrad", "nesterov"])
# Quick tier: one (tests/optimizers/test_sparse_gradients.py runs RMSprop and Adagrad on repeated rows).
@pytest.mark.sample_axes("stock", "ours")
def test_sparse_gradients_match_keras(stock, ours):
    # Distinct rows per batch: Keras' sparse update is its dense one (every velocity row decays).
    rng = np.random.default_rng(0)
    x = np.stack([rng.permutation(50)[:40].reshape(8, 5) for _ in range(30)]).reshape(240, 5).astype("int32")
    y = rng.standard_normal((240, 4)).astype("float32")
    assert max_relative_diff(fit_embedding(ours(), x, y), fit_embedding(stock(), x, y)) <= 1e-5


# ----------------------------------------------------------------------------
# Keras optimizer features.

_SLOW = pytest.mark.slow
FEATURE_CASES = [
    pytest.param("rmsprop", {}, id="rmsprop"),
    pytest.param("rmsprop", {"centered": True, "momentum": 0.5}, id="centered_momentum", marks=_SLOW),
    pytest.param("adagrad", {}, id="adagrad"),
    pytest.param("adagrad", {"initial_accumulator_value": 0.0}, id="adagrad_acc0", marks=_SLOW),
    pytest.param("sgd", {"momentum": 0.9, "nesterov": True}, id="nesterov"),
]

# RMSprop normalises each step by the gradient's running RMS, which makes a
# trajectory sensitive to rounding: the TF kernel forms 1 - rho in the
# variable's dtype (1 - 0.9f = 0.10000002, Keras 0.1f), and over 25 steps with
# clipvalue=0.001 that moves the weights by 1.4e-5 (relative) from Keras',
# where Keras itself moves by 1.1e-5 when rho changes by one float32 ulp
# (centered with momentum: 3.4e-5). Elsewhere 1e-5 holds.
def rtol(name, kwargs=None):
    return 1e-4 if name == "rmsprop" and "clipvalue" in (kwargs or {}) else 1e-5


# Quick tier: one case. Keras' features (schedules, clipping, EMA, weight decay) reach every fused
# optimizer through the shared base (optimizers/_base.py); test_optimizers.py::test_keras_features runs
# each feature in the quick tier, and the full tier runs every optimizer with every feature here.
@pytest.mark.sample_axes("name", "base", "kwargs")
@pytest.mark.parametrize("name, base", FEATURE_CASES)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.01, 5, 0.7)},
        {"clipnorm": 0.05},
        {"clipvalue": 0.001},
        {"global_clipnorm": 0.1},
        {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 7},
        {"weight_decay": 0.05},
    ],
    ids=["schedule", "clipnorm", "clipvalue", "global_clipnorm", "ema", "weight_decay"],
)
def test_keras_features(name, base, kwargs):
    assert_same_training(make(name, {**base, **kwargs}, "stock"), make(name, {**base, **kwargs}, "ours"), steps=25,
                         rtol=rtol(name, kwargs))


# Quick tier: one optimizer (the LossScaleOptimizer wrapping is the shared base's; the full tier runs each).
@pytest.mark.sample_axes("name", "base")
@pytest.mark.parametrize("name, base", FEATURE_CASES)
def test_loss_scale_optimizer(name, base):
    # Wrapped explicitly (float32 model): the same trajectory as the wrapped stock optimizer.
    assert_same_training(keras.optimizers.LossScaleOptimizer(make(name, base, "stock"), initial_scale=2.0**8),
                         keras.optimizers.LossScaleOptimizer(make(name, base, "ours"), initial_scale=2.0**8),
                         steps=15, rtol=rtol(name))
    # mixed_float16 wraps it. (The float16 forward pass makes the trajectory
    # chaotic under a normalising optimizer: only that it trains is checked.)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        got = train(make(name, base, "ours"), steps=5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(got.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(got.optimizer.inner_optimizer, PAIRS[name][1])
    assert all(np.isfinite(w).all() for w in got.get_weights())
    # An explicit wrapper skips a non-finite step and then trains.
    var = keras.Variable(np.ones(4, "float32"))
    opt = keras.optimizers.LossScaleOptimizer(make(name, base, "ours"), initial_scale=2.0**10)
    step = tf.function(lambda g: opt.apply([g], [var]))
    step(tf.constant([np.inf, 1.0, 1.0, 1.0], tf.float32))
    np.testing.assert_array_equal(var.numpy(), np.ones(4))
    step(tf.ones(4))
    assert np.all(var.numpy() < 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name, base", FEATURE_CASES)
def test_xla_compiled_train_step(name, base):
    assert_same_training(make(name, base, "stock"), make(name, base, "ours"), steps=20, jit_compile=True)


# ----------------------------------------------------------------------------
# One op per variable.


@pytest.mark.parametrize(
    "opt, train_op",
    [
        (lambda: FusedRMSprop(multi_tensor=False), "ResourceApplyRMSProp"),
        (lambda: FusedRMSprop(momentum=0.9, multi_tensor=False), "ResourceApplyRMSProp"),
        (lambda: FusedRMSprop(centered=True, multi_tensor=False), "ResourceApplyCenteredRMSProp"),
        (lambda: FusedRMSprop(centered=True, momentum=0.9, multi_tensor=False), "ResourceApplyCenteredRMSProp"),
        (lambda: FusedAdagrad(), "ResourceApplyAdagradV2"),
        (lambda: FusedSGD(momentum=0.9, nesterov=True), "ResourceApplyKerasMomentum"),
    ],
)
def test_one_training_op_per_variable(opt, train_op):
    variables, grads = variables_and_grads()
    opt = opt()
    opt.build(variables)
    cap = inspect.capture_function(lambda: opt.apply(grads, variables))
    counts = op_types(cap)
    assert counts.get(train_op, 0) == len(variables), counts
    assert sum(n for op, n in counts.items() if op.startswith("ResourceApply")) == len(variables), counts
    assert inspect.report_from_capture(cap).num_ops <= len(variables) + 12, counts


def test_adagrad_with_tiny_accumulator_is_elementwise_and_fewer_ops_than_keras():
    variables, grads = variables_and_grads()
    counts = {}
    for opt in (FusedAdagrad(initial_accumulator_value=0.0), keras.optimizers.Adagrad(initial_accumulator_value=0.0)):
        opt.build(variables)
        cap = inspect.capture_function(lambda: opt.apply(grads, variables))
        counts[type(opt).__name__] = (op_types(cap), inspect.report_from_capture(cap).num_ops)
    ours, ours_n = counts["FusedAdagrad"]
    assert not [op for op in ours if op.startswith("ResourceApply")], ours
    assert ours.get("AssignAddVariableOp") == len(variables)
    assert ours_n < counts["Adagrad"][1]


# ----------------------------------------------------------------------------
# The hidden momentum buffer of FusedRMSprop(momentum=0).


def test_scratch_buffer_is_not_optimizer_state(tmp_path):
    model = conv_net()
    model.compile(optimizer=FusedRMSprop(0.01, multi_tensor=False), loss="mse")
    x, y = data(40)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    opt = model.optimizer
    buffers = [b for b in opt._scratch.buffers if b is not None]
    assert len(buffers) == len(model.trainable_variables)
    assert [tuple(b.shape) for b in buffers] == [tuple(v.shape) for v in model.trainable_variables]
    assert np.abs(buffers[0].numpy()).max() > 0  # it is what the op wrote into
    # Not an optimizer variable.
    stock = keras.optimizers.RMSprop(0.01)
    stock.build(model.trainable_variables)
    assert layout(opt) == layout(stock)
    scratch_ids = {id(b) for b in buffers}
    assert not scratch_ids & {id(getattr(v, "value", v)) for v in opt.variables}
    # Not in the .keras file's optimizer state.
    store, stock_store = {}, {}
    opt.save_own_variables(store)
    stock.save_own_variables(stock_store)
    assert sorted(store) == sorted(stock_store)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert len(loaded.optimizer.variables) == len(stock.variables)
    # Not in a tf.train.Checkpoint of the optimizer.
    names = [n for n, _ in tf.train.list_variables(tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ck")))]
    stock_names = [n for n, _ in tf.train.list_variables(
        tf.train.Checkpoint(optimizer=stock).save(str(tmp_path / "ck_stock")))]
    assert len(names) == len(stock_names), (names, stock_names)
    assert not [n for n in names if "scratch" in n]


def test_nan_gradient_on_one_variable_leaves_the_others_as_keras():
    rng = np.random.default_rng(0)
    w = [rng.standard_normal((8,)).astype("float32") for _ in range(3)]
    grads = [[rng.standard_normal((8,)).astype("float32") for _ in range(3)] for _ in range(12)]
    grads[4][1][2] = np.nan  # step 5, variable 1
    results = []
    for opt in (FusedRMSprop(0.01), keras.optimizers.RMSprop(0.01)):
        variables = [keras.Variable(v) for v in w]
        step = tf.function(lambda gs: opt.apply(gs, variables))
        for gs in grads:
            step([tf.constant(g) for g in gs])
        results.append([v.numpy() for v in variables])
    ours, stock = results
    for i in (0, 2):
        np.testing.assert_allclose(ours[i], stock[i], rtol=1e-5)
        assert np.all(np.isfinite(ours[i]))
    assert np.isnan(ours[1]).sum() == np.isnan(stock[1]).sum() > 0


def test_restoring_state_after_a_nan_step_resumes_as_keras(tmp_path):
    # A NaN step poisons the variable and its velocity in both; restoring the
    # weights and optimizer state saved before it (what BackupAndRestore does)
    # must resume cleanly, which needs the hidden buffer cleared too.
    x, y = data(80)
    bad_y = y.copy()
    bad_y[0, 0] = np.nan
    results = []
    for make_opt in (lambda: FusedRMSprop(0.01), lambda: keras.optimizers.RMSprop(0.01)):
        model = conv_net()
        model.compile(optimizer=make_opt(), loss="mse")
        model.fit(x[:40], y[:40], batch_size=8, shuffle=False, verbose=0)
        path = str(tmp_path / f"{type(model.optimizer).__name__}.keras")
        model.save(path)
        model.fit(x[40:48], bad_y[:8], batch_size=8, shuffle=False, verbose=0)
        assert np.isnan(model.get_weights()[0]).all()
        reloaded = keras.models.load_model(path)
        model.set_weights(reloaded.get_weights())
        store = {}
        reloaded.optimizer.save_own_variables(store)
        model.optimizer.load_own_variables(store)
        model.fit(x[40:], y[40:], batch_size=8, shuffle=False, verbose=0)
        results.append(model.get_weights())
    assert all(np.isfinite(w).all() for w in results[0])
    assert max_relative_diff(results[0], results[1]) <= 1e-5


# ----------------------------------------------------------------------------
# The composite form (open tensorflow-metal-plugin on TF 2.21: no ResourceApply* kernels).


@pytest.mark.parametrize("name, kwargs", CASES, ids=CASE_IDS)
def test_composite_form_matches_keras(name, kwargs):
    keras.utils.set_random_seed(0)
    variables, grads = variables_and_grads(3)
    stock_vars = [keras.Variable(v.numpy()) for v in variables]
    initial = [v.numpy() for v in variables]
    with devices.assume_backend(PLUGIN):
        opt = make(name, kwargs, "ours")
        assert opt.composite_reason("float32") is not None
        opt.build(variables)
        cap = inspect.capture_function(lambda: opt.apply(grads, variables))
        assert not [op for op in op_types(cap) if op.startswith("ResourceApply")], op_types(cap)
        step = tf.function(lambda: opt.apply(grads, variables))
        for _ in range(9):
            step()
    if isinstance(opt, FusedRMSprop):
        assert not [b for b in opt._scratch.buffers if b is not None]  # no hidden buffer for this form
    stock = make(name, kwargs, "stock")
    stock_step = tf.function(lambda: stock.apply(grads, stock_vars))
    for _ in range(10):
        stock_step()
    got = [v.numpy() for v in variables + list(opt.variables)]
    want = [v.numpy() for v in stock_vars + list(stock.variables)]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert max_relative_diff(got[:3], initial) > 1e-4  # it trained


# ----------------------------------------------------------------------------
# tf.distribute.MirroredStrategy over two logical CPUs (a fresh process).

_MIRRORED = textwrap.dedent(
    """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tfmetal_ext.optimizers import FusedAdagrad, FusedRMSprop, FusedSGD

    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 6)).astype("float32")
    y = rng.standard_normal((320, 2)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def run(make_opt):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
            model.compile(optimizer=make_opt(), loss="mse")
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        return model

    for stock, ours in [
        (lambda: keras.optimizers.RMSprop(0.01), lambda: FusedRMSprop(0.01)),
        (lambda: keras.optimizers.RMSprop(0.01), lambda: FusedRMSprop(0.01, multi_tensor=False)),
        (lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
         lambda: FusedRMSprop(0.01, momentum=0.5, centered=True)),
        (lambda: keras.optimizers.Adagrad(0.05), lambda: FusedAdagrad(0.05)),
        (lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.0),
         lambda: FusedAdagrad(0.05, initial_accumulator_value=0.0)),
        (lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
         lambda: FusedSGD(0.05, momentum=0.9, nesterov=True)),
    ]:
        want, got = run(stock), run(ours)
        assert int(got.optimizer.iterations.numpy()) == 20
        if isinstance(got.optimizer, FusedRMSprop):
            want_form = "multi_tensor" if got.optimizer.multi_tensor == "auto" else "per_variable"
            assert got.optimizer.update_form == want_form, got.optimizer.update_form_reason
        for a, b in zip(got.get_weights(), want.get_weights()):
            rel = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert rel <= 1e-5, (type(got.optimizer).__name__, rel)
        for v in got.trainable_variables:
            parts = [t.numpy() for t in v.value.values]
            np.testing.assert_array_equal(parts[0], parts[1])
        scratch = getattr(got.optimizer, "_scratch", None)
        if getattr(got.optimizer, "update_form", None) == "multi_tensor":
            # One TfmetalExt>MultiTensorRMSprop per replica: no hidden buffer made.
            assert scratch is None or not [b for b in scratch.buffers if b is not None]
        elif scratch is not None and got.optimizer.momentum == 0:
            # One buffer per replica, on that replica's device, written by that replica's update.
            for b in scratch.buffers:
                devs = sorted(c.device for c in b.values)
                assert len(devs) == 2 and devs[0] != devs[1], devs
                np.testing.assert_array_equal(b.values[0].numpy(), b.values[1].numpy())
                assert np.abs(b.values[1].numpy()).max() > 0
    print("MIRRORED OK")
    """
)


@pytest.mark.slow
def test_mirrored_strategy_two_cpus():
    result = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "MIRRORED OK" in result.stdout, result.stderr[-4000:]


# ----------------------------------------------------------------------------
# Saving, loading, configs, arguments.


# Quick tier: one optimizer (saving and Keras' state layout are the shared base's; the full tier runs each).
@pytest.mark.sample_axes("name", "kwargs")
@pytest.mark.parametrize("name, kwargs", [
    pytest.param(name, kwargs, id=i, marks=() if i in ("rmsprop", "adagrad", "nesterov") else _SLOW)
    for (name, kwargs), i in zip(CASES, CASE_IDS)])
def test_keras_file_round_trip_and_state_interchange(tmp_path, name, kwargs):
    x, y = data(160)
    model = conv_net()
    model.compile(optimizer=make(name, kwargs, "ours"), loss="mse")
    model.fit(x[:80], y[:80], batch_size=8, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Our state into the stock class, and the stock class's back into ours.
    store = {}
    model.optimizer.save_own_variables(store)
    stock = conv_net()
    stock.set_weights(model.get_weights())
    stock.compile(optimizer=make(name, kwargs, "stock"), loss="mse")
    stock.optimizer.build(stock.trainable_variables)
    stock.optimizer.load_own_variables(store)
    back = {}
    stock.optimizer.save_own_variables(back)
    ours = conv_net()
    ours.set_weights(model.get_weights())
    ours.compile(optimizer=make(name, kwargs, "ours"), loss="mse")
    ours.optimizer.build(ours.trainable_variables)
    ours.optimizer.load_own_variables(back)
    for m in (model, loaded, stock, ours):
        m.fit(x[80:], y[80:], batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in loaded.get_weights()]),
                                  np.concatenate([w.ravel() for w in model.get_weights()]))
    assert max_relative_diff(ours.get_weights(), stock.get_weights()) <= 1e-5
    assert int(ours.optimizer.iterations.numpy()) == 20


@pytest.mark.parametrize("opt", [FusedRMSprop(0.002, 0.8, 0.3, 1e-6, True, 0.01), FusedAdagrad(0.02, 0.0, 1e-5),
                                 FusedSGD(0.3, 0.5, True)], ids=["rmsprop", "adagrad", "nesterov"])
def test_config_round_trip(opt):
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(clone) is type(opt)
    assert clone.get_config() == opt.get_config()
    assert type(opt).from_config(opt.get_config()).get_config() == opt.get_config()


def _positional(cls):
    import inspect as pyinspect

    params = list(pyinspect.signature(cls.__init__).parameters.values())[1:]
    return [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("name, args", [("rmsprop", (0.01, 0.8, 0.3, 1e-6, True, 0.05, 2.0)),
                                        ("adagrad", (0.01, 0.2, 1e-6, 0.05, 2.0))])
def test_positional_arguments_are_keras_own(name, args):
    stock, ours = PAIRS[name]
    assert _positional(ours) == _positional(stock)
    want, got = stock(*args).get_config(), ours(*args).get_config()
    for key in ("learning_rate", "rho", "momentum", "epsilon", "centered", "initial_accumulator_value",
                "weight_decay", "clipnorm"):
        assert got.get(key) == want.get(key), key


def test_default_names_follow_keras_naming():
    # Keras names an unnamed optimizer after its class ("rm_sprop" for RMSprop).
    assert keras.optimizers.RMSprop().name.startswith("rm_sprop")
    assert FusedRMSprop().name.startswith("fused_rm_sprop")
    assert FusedAdagrad().name.startswith("fused_adagrad")
    assert FusedRMSprop(name="mine").name == "mine"


@pytest.mark.parametrize(
    "make_opt, message",
    [
        (lambda: FusedRMSprop(rho=1.5), "Received: rho=1.5"),
        (lambda: FusedRMSprop(rho="x"), "Received: rho='x'"),
        (lambda: FusedRMSprop(momentum=-0.1), "Received: momentum=-0.1"),
        (lambda: FusedRMSprop(momentum=True), "Received: momentum=True"),
        (lambda: FusedRMSprop(epsilon=-1.0), "Received: epsilon=-1.0"),
        (lambda: FusedRMSprop(centered="yes"), "Received: centered='yes'"),
        (lambda: FusedAdagrad(initial_accumulator_value=-0.1), "Received: initial_accumulator_value=-0.1"),
        (lambda: FusedAdagrad(initial_accumulator_value=float("nan")), "Received: initial_accumulator_value=nan"),
        (lambda: FusedAdagrad(epsilon=-1e-7), "Received: epsilon=-1e-07"),
        (lambda: FusedAdagrad(epsilon="small"), "Received: epsilon='small'"),
    ],
)
def test_bad_arguments(make_opt, message):
    with pytest.raises(ValueError, match=message):
        make_opt()


# Quick tier: one optimizer (gradient accumulation is the shared base's; the full tier runs each).
@pytest.mark.sample_axes("name", "base")
@pytest.mark.parametrize("name, base", [("rmsprop", {}), ("adagrad", {}), ("sgd", {"momentum": 0.9, "nesterov": True})])
def test_gradient_accumulation_and_loss_scale_factor(name, base):
    kwargs = {**base, "gradient_accumulation_steps": 3, "loss_scale_factor": 64.0}
    got, _ = assert_same_training(make(name, kwargs, "stock"), make(name, kwargs, "ours"), steps=15)
    assert int(got.optimizer.iterations.numpy()) == 5  # one update per 3 batches


# ----------------------------------------------------------------------------
# FusedRMSprop's multi-tensor default: one TfmetalExt>MultiTensorRMSprop per dtype group and step.

MT_OP = "TfmetalExt>MultiTensorRMSprop"
RMSPROP_VARIANTS = [{}, {"momentum": 0.9}, {"centered": True}, {"centered": True, "momentum": 0.9}]
RMSPROP_VARIANT_IDS = ["plain", "momentum", "centered", "centered_momentum"]


def _bitwise(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if a.dtype == np.float32:
            a, b = a.view(np.uint32), b.view(np.uint32)
        assert np.array_equal(a, b), (
            f"{what}[{i}]: {np.count_nonzero(a != b)} of {a.size} elements differ")


# Quick tier: plain, centered with momentum (both of the op's optional slots) and weight decay; the
# full tier also momentum alone and centered alone.
@pytest.mark.parametrize("kwargs", [
    pytest.param(k, marks=pytest.mark.full) if i in ("momentum", "centered") else pytest.param(k, id=i)
    for k, i in zip(RMSPROP_VARIANTS + [{"weight_decay": 0.05, "momentum": 0.5}], RMSPROP_VARIANT_IDS + ["weight_decay"])
], ids=RMSPROP_VARIANT_IDS + ["weight_decay"])
def test_multi_tensor_default_is_bitwise_keras_over_100_steps(kwargs):
    # Eager steps: Keras' RMSprop runs its ops as written (in a tf.function grappler turns its
    # x / sqrt(y) into x * rsqrt(y), TF's CPU Rsqrt not being correctly rounded; the next test).
    rng = np.random.default_rng(3)
    shapes = [(6, 5), (5,), (3, 3, 2), ()]
    init = [rng.standard_normal(s).astype("float32") for s in shapes]
    steps = [[rng.standard_normal(s).astype("float32") for s in shapes] for _ in range(100)]
    results = []
    for opt in (FusedRMSprop(0.01, **kwargs), keras.optimizers.RMSprop(0.01, **kwargs)):
        variables = [keras.Variable(a) for a in init]
        for gs in steps:
            opt.apply([tf.constant(g) for g in gs], variables)
        results.append(([v.numpy() for v in variables], [v.numpy() for v in opt.variables]))
        if isinstance(opt, FusedRMSprop):
            assert opt.update_form == "multi_tensor", opt.update_form_reason
            assert not [b for b in opt._scratch.buffers if b is not None]
    (ours, our_slots), (stock, stock_slots) = results
    _bitwise(ours, stock, "variables")
    _bitwise(our_slots, stock_slots, "optimizer variables")
    assert max_relative_diff(ours, init) > 1e-3  # it trained


@pytest.fixture
def no_grappler_arithmetic():
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    yield
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": True})


@pytest.mark.parametrize("kwargs", RMSPROP_VARIANTS[:2], ids=RMSPROP_VARIANT_IDS[:2])
def test_multi_tensor_fit_is_bitwise_keras_without_the_rsqrt_rewrite(no_grappler_arithmetic, kwargs):
    # model.fit, 100 steps: with grappler's x / sqrt(y) -> x * rsqrt(y) rewrite off, Keras' fit runs
    # Keras' ops as written and equals the op bit for bit. (Centered variants are left out: in
    # Keras' fit graph, and only there, its centered step differs from its own eager step by an ulp
    # in a few weights after one step, slots equal; the op equals the eager step, test above.)
    want = train(keras.optimizers.RMSprop(0.01, **kwargs))
    got = train(FusedRMSprop(0.01, **kwargs))
    assert got.optimizer.update_form == "multi_tensor"
    _bitwise(got.get_weights(), want.get_weights(), "weights")
    _bitwise([v.numpy() for v in got.optimizer.variables], [v.numpy() for v in want.optimizer.variables], "slots")


def test_multi_tensor_is_one_op_per_dtype_and_decay_group():
    rng = np.random.default_rng(0)
    v32 = [keras.Variable(rng.standard_normal((8, 8)).astype("float32"), name=n) for n in ("kernel_a", "bias_a", "k_b")]
    v16 = [keras.Variable(rng.standard_normal((4,)).astype("float16"), name=n) for n in ("kernel_c", "bias_c")]
    grads = [tf.ones(v.shape, v.dtype) for v in v32 + v16]
    for kwargs, want in [({}, 2), ({"weight_decay": 0.1}, 4), ({"centered": True, "momentum": 0.5}, 2)]:
        opt = FusedRMSprop(**kwargs)
        if "weight_decay" in kwargs:
            opt.exclude_from_weight_decay(var_names=["bias"])
        opt.build(v32 + v16)
        counts = op_types(inspect.capture_function(lambda: opt.apply(grads, v32 + v16)))
        assert counts.get(MT_OP) == want, (kwargs, counts)
        assert not [op for op in counts if op.startswith("ResourceApply")], counts
        assert "Sqrt" not in counts and "Rsqrt" not in counts
        assert opt.update_form == "multi_tensor" and opt.update_form_reason is None
        assert not [b for b in opt._scratch.buffers if b is not None]  # no hidden buffer on the default form


def test_multi_tensor_default_trains_like_keras_in_fit():
    # With grappler's defaults Keras' fit uses x * rsqrt(y): close, not bitwise.
    got, want = assert_same_training(keras.optimizers.RMSprop(0.01), FusedRMSprop(0.01), steps=50)
    assert got.optimizer.update_form == "multi_tensor"
    assert not [b for b in got.optimizer._scratch.buffers if b is not None]


@pytest.mark.full  # an XLA-compiled step (~4 s); the quick tier keeps test_multi_tensor_auto.py's XLA fallback with one info line
def test_xla_step_falls_back_with_one_info_line(caplog):
    with caplog.at_level("INFO", logger="tfmetal_ext"):
        got, _ = assert_same_training(keras.optimizers.RMSprop(0.01), FusedRMSprop(0.01), steps=10, jit_compile=True)
    assert got.optimizer.update_form == "per_variable"
    assert "XLA" in got.optimizer.update_form_reason
    lines = [r for r in caplog.records if "FusedRMSprop" in r.getMessage() and "XLA" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "INFO"
    # The per-variable form traced: its hidden buffers exist now.
    assert all(b is not None for b in got.optimizer._scratch.buffers)


def test_avoid_fusions_and_explicit_true_fall_back():
    import tfmetal_ext

    variables, grads = variables_and_grads(2)
    tfmetal_ext.configure("float32", avoid_fusions=["multi_tensor_rmsprop"])
    try:
        opt = FusedRMSprop(multi_tensor=True)
        opt.build(variables)
        counts = op_types(inspect.capture_function(lambda: opt.apply(grads, variables)))
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    assert MT_OP not in counts and counts.get("ResourceApplyRMSProp") == len(variables)
    assert "avoid_fusions" in opt.update_form_reason


@pytest.mark.parametrize("value", ["yes", 1, None, 0.5])
def test_multi_tensor_argument_is_checked(value):
    with pytest.raises(ValueError, match=r"Received: multi_tensor="):
        FusedRMSprop(multi_tensor=value)


def test_multi_tensor_in_config():
    for value in (True, False, "auto"):
        opt = FusedRMSprop(0.01, multi_tensor=value)
        assert opt.get_config()["multi_tensor"] == value
        assert FusedRMSprop.from_config(opt.get_config()).multi_tensor == value
    assert FusedRMSprop().multi_tensor == "auto"
