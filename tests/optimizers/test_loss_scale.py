"""Loss scaling inside the fused optimizers' multi-tensor op (tfmetal_ext.optimizers.loss_scale).

The reference is Keras' own `LossScaleOptimizer` step around the same fused
optimizer (its original ``_tf_apply``, put back for the reference run): the
multi-tensor op unscales with Keras' float32 division and the scale rule is
Keras', so weights, slots, the scale, its counter and ``iterations`` must be
equal bit for bit, through overflowing steps (skipped, scale halved) and
growth (scale doubled). Against stock ``LossScaleOptimizer(keras Adam)`` the
difference is the fused Adam's own (its rounding of ``1 - beta``, see
tests/optimizers/test_optimizers.py) amplified by the float16 forward pass.

Whether the op runs here is read from `tfmetal_ext.ops.status()`, never assumed.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect, ops
from tfmetal_ext.optimizers import FusedAdam, FusedAdamW, FusedLion, FusedRMSprop, loss_scale


@pytest.fixture(autouse=True)
def _the_op_runs_here():
    status = ops.status()
    if devices.capabilities().backend != "cpu":
        pytest.skip("these expectations are written for a CPU backend (GPU backends: pytest -m metal)")
    if not (status.loaded and not status.reference_forced and status.kernels["multi_tensor_adam"]["cpu"]):
        pytest.skip(f"the multi-tensor ops' library is not loaded here: {status}")
    assert loss_scale.installed(), "tfmetal_ext.optimizers did not install the loss-scaled step"


@contextlib.contextmanager
def keras_method(name):
    """Keras' own LossScaleOptimizer method `name` (the one loss_scale replaced) while the block runs."""
    cls = keras.optimizers.LossScaleOptimizer
    ours = getattr(cls, name)
    setattr(cls, name, loss_scale._original[name])
    try:
        yield
    finally:
        setattr(cls, name, ours)


def keras_loss_scaling():
    """Keras' own LossScaleOptimizer step (its original _tf_apply) while the block runs."""
    return keras_method("_tf_apply")


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def fit(optimizer, steps=24, batch_size=8, seed=0):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * batch_size, 12)).astype("float32")
    y = rng.standard_normal((steps * batch_size, 3)).astype("float32")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def state(model):
    """Weights, every optimizer variable (the wrapper's scale and counter, the inner's iterations and slots)."""
    return [np.asarray(w) for w in model.get_weights()] + [np.asarray(v) for v in model.optimizer.variables]


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert g.tobytes() == w.tobytes(), f"state {i} differs: {g.ravel()[:4]} != {w.ravel()[:4]}"


def lso(inner, **kw):
    # A high initial scale overflows float16 in the first steps (skipped, halved), and 3-step growth
    # doubles it again during the run: every branch of Keras' rule runs.
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=kw.pop("initial_scale", 2.0 ** 30),
                                               dynamic_growth_steps=kw.pop("dynamic_growth_steps", 3))


# ----------------------------------------------------------------------------
# The train step: one op, no finite checks


def traced_counts(make_optimizer):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp()
    model.compile(optimizer=make_optimizer(), loss="mse")
    x, y = np.ones((8, 12), "float32"), np.ones((8, 3), "float32")
    return inspect.report_from_capture(inspect.trace_train(model, x, y), model).ops_by_type, model


def test_train_step_has_one_op_and_no_per_gradient_checks():
    ours, model = traced_counts(lambda: FusedAdam(1e-3))
    with keras_loss_scaling():
        stock, _ = traced_counts(lambda: FusedAdam(1e-3))
    n = len(model.trainable_variables)  # 6
    assert model.optimizer.inner_optimizer.loss_scale_form == "in_op"
    # Keras' step: IsFinite + All per gradient, a Pack and an All of the flags, a division per gradient, conds.
    assert stock.get("IsFinite") == n and stock.get("Pack") == 1 and stock.get("All") == n + 1, stock
    assert stock.get("If", 0) + stock.get("StatelessIf", 0) >= 2, stock
    # Ours: the one multi-tensor op does all of it.
    assert ours.get("TfmetalExt>MultiTensorAdam") == 1, ours
    for op in ("IsFinite", "Pack", "All", "If", "StatelessIf", "Switch", "Merge"):
        assert op not in ours, (op, ours)
    assert stock.get("RealDiv", 0) - ours.get("RealDiv", 0) == n  # the per-gradient unscale is gone


# ----------------------------------------------------------------------------
# Equal to Keras' loss scaling around the same optimizer, bit for bit


FUSED = {
    "adam": lambda: FusedAdam(1e-2, amsgrad=True),
    "adamw": lambda: FusedAdamW(1e-2, weight_decay=0.05),
    "lion": lambda: FusedLion(1e-3, weight_decay=0.01),
    "rmsprop": lambda: FusedRMSprop(1e-3, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("name", [
    "adam", pytest.param("adamw", marks=pytest.mark.full), pytest.param("lion", marks=pytest.mark.full),
    pytest.param("rmsprop", marks=pytest.mark.full)])
def test_fit_equals_keras_loss_scaling_bitwise(name):
    got = fit(lso(FUSED[name]()))
    with keras_loss_scaling():
        want = fit(lso(FUSED[name]()))
    inner = got.optimizer.inner_optimizer
    assert inner.loss_scale_form == "in_op" and want.optimizer.inner_optimizer.loss_scale_form is None
    assert_bitwise(state(got), state(want))
    # The run went through every branch: skipped steps, halving and doubling.
    steps = 24
    assert 0 < int(inner.iterations.numpy()) < steps
    assert float(got.optimizer.dynamic_scale.numpy()) < 2.0 ** 30


def test_fit_matches_stock_adam_within_tolerance():
    # Against stock LossScaleOptimizer(keras Adam): FusedAdam follows Keras' Adam to ~1e-7 per step in
    # float32, but a float16 forward pass turns any weight difference into whole float16 ulps of the
    # activations (2^-11 relative) now and then; 20 steps stay within 1e-3 relative, as
    # test_optimizers.test_mixed_float16_wraps_in_loss_scale_optimizer bounds it for Keras' own wrapping.
    got = fit(lso(FusedAdam(1e-3), initial_scale=2.0 ** 15, dynamic_growth_steps=2000), steps=20)
    want = fit(lso(keras.optimizers.Adam(1e-3), initial_scale=2.0 ** 15, dynamic_growth_steps=2000), steps=20)
    assert got.optimizer.inner_optimizer.loss_scale_form == "in_op"
    assert int(got.optimizer.iterations.numpy()) == int(want.optimizer.iterations.numpy()) == 20
    assert float(got.optimizer.dynamic_scale.numpy()) == float(want.optimizer.dynamic_scale.numpy())
    for g, w in zip(got.get_weights(), want.get_weights()):
        diff = np.linalg.norm(g.astype(np.float64) - w) / max(np.linalg.norm(w.astype(np.float64)), 1e-30)
        assert diff <= 1e-3


# ----------------------------------------------------------------------------
# One step at a time: skip, halve, count, double


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_steps_follow_keras_rule(dtype, mode):
    # Variables of `dtype` (their gradients too): an infinity or a NaN in one gradient of four skips the
    # step (nothing written, iterations unchanged) and halves the scale; finite steps count up to the
    # growth interval and double it. Each step equals Keras' path bit for bit.
    rng = np.random.default_rng(0)
    shapes = [(5, 3), (7,), (2, 2, 2), (11,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    bad = {1: np.inf, 4: np.nan}  # step -> the value put into gradient 2
    grads = []
    for step in range(7):
        g = [rng.standard_normal(s).astype(np.float32) * 64.0 for s in shapes]
        if step in bad:
            g[2].reshape(-1)[3] = bad[step]
        grads.append(g)

    def run():
        variables = [keras.Variable(a, dtype=dtype) for a in init]
        # beta_2 = 0.9: 0.999 is 1.0 in bfloat16, and Adam would not move at all
        opt = keras.optimizers.LossScaleOptimizer(FusedAdam(0.05, beta_2=0.9), initial_scale=2.0 ** 6,
                                                  dynamic_growth_steps=2)
        opt.build(variables)
        step = (lambda g: opt.apply(g, variables))
        if mode == "function":
            step = tf.function(step)
        trace = []
        for g in grads:
            step([tf.constant(x, dtype) for x in g])
            trace.append((float(opt.dynamic_scale.numpy()), int(opt.step_counter.numpy()),
                          int(opt.iterations.numpy())))
        return opt, [np.asarray(v) for v in variables + list(opt.variables)], trace

    opt, got, got_trace = run()
    with keras_loss_scaling():
        _, want, want_trace = run()
    assert opt.inner_optimizer.loss_scale_form == "in_op"
    assert got_trace == want_trace
    # 64 -> inf: 32 (skip) -> 32, 32 -> doubled 64 -> nan: 32 (skip) -> ...
    assert [t[0] for t in got_trace[:2]] == [64.0, 32.0] and got_trace[1][2] == got_trace[0][2]
    assert max(t[0] for t in got_trace[2:]) == 64.0  # grown back after two finite steps
    assert_bitwise(got, want)
    moved = [np.abs(np.asarray(g, np.float32) - w).max() for g, w in zip(got[:len(init)], init)]
    assert min(moved) > 0.05


# ----------------------------------------------------------------------------
# Where Keras' loss scaling stays


@pytest.mark.parametrize("make, why", [
    (lambda: FusedAdam(1e-3, clipnorm=1.0), "clipnorm=1.0"),
    pytest.param(lambda: FusedAdam(1e-3, multi_tensor=False), "multi_tensor=False", marks=pytest.mark.full),
    # biases left out of the decay (below): two op groups
    pytest.param(lambda: FusedAdamW(1e-3), "2 groups", marks=pytest.mark.full),
])
def test_keras_loss_scaling_where_the_op_cannot_take_the_step(make, why, caplog):
    opt = make()
    if isinstance(opt, FusedAdamW):
        opt.exclude_from_weight_decay(var_names=["bias"])
    with caplog.at_level("INFO", logger="tfmetal_ext"):
        counts, model = traced_counts(lambda: opt)
    inner = model.optimizer.inner_optimizer
    assert inner.loss_scale_form == "keras" and why in inner.loss_scale_form_reason
    assert counts.get("IsFinite") == len(model.trainable_variables)
    logged = any("uses Keras' loss scaling" in r.getMessage() for r in caplog.records)
    assert logged == (opt.multi_tensor is not False)  # an explicit multi_tensor=False is not worth a line


@pytest.mark.full
def test_keras_loss_scaling_still_trains_and_skips():
    # The fallback is Keras' step around our optimizer: still correct.
    got = fit(lso(FusedAdam(1e-2, clipnorm=1.0)))
    with keras_loss_scaling():
        want = fit(lso(FusedAdam(1e-2, clipnorm=1.0)))
    assert got.optimizer.inner_optimizer.loss_scale_form == "keras"
    assert_bitwise(state(got), state(want))


def test_other_optimizers_are_untouched():
    counts, model = traced_counts(lambda: keras.optimizers.Adam(1e-3))
    assert counts.get("IsFinite") == len(model.trainable_variables)


# ----------------------------------------------------------------------------
# Keras' own finite check, with a sparse gradient checked on its values


def keras_check_finite():
    """Keras' own LossScaleOptimizer.check_finite while the block runs."""
    return keras_method("check_finite")


def embedding_fit(steps=12, batch_size=8, inf_at=None):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    model.compile(optimizer=lso(keras.optimizers.Adam(1e-2)), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, (steps * batch_size, 6)).astype("int32")
    y = rng.standard_normal((steps * batch_size, 2)).astype("float32")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def test_sparse_gradient_is_checked_without_a_dense_mask():
    assert loss_scale._original["check_finite"] is not None, "check_finite was not installed"
    ours = embedding_fit()
    counts = inspect.report_from_capture(
        inspect.trace_train(ours, np.zeros((8, 6), "int32"), np.zeros((8, 2), "float32")), ours).ops_by_type
    assert "TensorScatterUpdate" not in counts, counts
    with keras_check_finite():
        stock = embedding_fit()
        stock_counts = inspect.report_from_capture(
            inspect.trace_train(stock, np.zeros((8, 6), "int32"), np.zeros((8, 2), "float32")), stock).ops_by_type
    assert stock_counts.get("TensorScatterUpdate") == 1, stock_counts  # Keras densifies the embedding's mask
    # The same flag every step, through the overflowing first steps (skipped, halved) and growth.
    assert float(np.asarray(ours.optimizer.dynamic_scale)) < 2.0 ** 30
    assert_bitwise(state(ours), state(stock))


@pytest.mark.parametrize("values, want", [
    ([[1.0, 2.0], [3.0, 4.0]], True), ([[1.0, np.inf], [3.0, 4.0]], False), ([[np.nan, 2.0], [3.0, 4.0]], False),
    (np.zeros((0, 2)), True)])
def test_check_finite_equals_keras_on_sparse_dense_and_none(values, want):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    sparse = tf.IndexedSlices(tf.constant(values, tf.float16), tf.range(len(values)) * 2, tf.constant([7, 2]))
    dense = tf.constant([0.5, -1.0], tf.float16)
    for grads in ([sparse], [dense, None, sparse], [None, dense]):
        got = bool(opt.check_finite(grads))
        with keras_check_finite():
            assert got == bool(opt.check_finite(grads))
        assert got == (want if any(g is sparse for g in grads) else True)


# ----------------------------------------------------------------------------
# The install


def test_install_is_guarded_by_keras_source(monkeypatch):
    class NotKeras(keras.optimizers.LossScaleOptimizer):
        def _tf_apply(self, grads, trainable_variables=None):
            return None

    assert loss_scale.keras_rule_matches()
    assert not loss_scale.keras_rule_matches(NotKeras)  # its own source lacks the rule
    loss_scale.uninstall()
    try:
        assert keras.optimizers.LossScaleOptimizer._tf_apply is not loss_scale._tf_apply
        monkeypatch.setenv(loss_scale.ENV, "0")
        assert loss_scale.install() is False and not loss_scale.installed()
        monkeypatch.setenv(loss_scale.ENV, "1")
    finally:
        assert loss_scale.install() is True
    assert keras.optimizers.LossScaleOptimizer._tf_apply is loss_scale._tf_apply
    assert keras.optimizers.LossScaleOptimizer.check_finite is loss_scale.check_finite
    assert loss_scale.keras_check_matches() and not loss_scale.keras_check_matches(NotKeras)
    assert loss_scale.install() is True  # idempotent
