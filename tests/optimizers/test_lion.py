"""FusedLion against keras.optimizers.Lion.

The reference is the stock Keras Lion with the same arguments on an identical
model and data (plus a numpy Lion for one variable). Keras' Lion and both of
our forms compute the same float32 operations in the same order
(``m * b1 + g * (1 - b1)``, ``sign``, ``lr * sign``, ``m * b2 + g * (1 - b2)``,
``1 - b`` rounded in float32), so without weight decay the results are
bitwise equal. With weight decay Keras computes ``var - var * wd * lr`` and
ours ``var - (lr * wd) * var`` (one ``ResourceApplyGradientDescent``, or inside
the multi-tensor op): the product rounds differently by up to an ulp per step,
so those cases are compared to a relative 1e-6 instead.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.optimizers import FusedLion

from .test_optimizers import conv_net, data, max_relative_diff, train

LION_OP = fusion.CUSTOM_OPS["multi_tensor_lion"].name


def assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def compare(kwargs, multi_tensor, steps=100, rtol=0.0, **compile_kw):
    want = train(keras.optimizers.Lion(**kwargs), steps=steps, **compile_kw)
    got = train(FusedLion(**kwargs, multi_tensor=multi_tensor), steps=steps, **compile_kw)
    assert int(got.optimizer.iterations.numpy()) == int(want.optimizer.iterations.numpy()) > 0
    if rtol == 0.0:
        assert_bitwise_equal(got.get_weights(), want.get_weights())
        assert_bitwise_equal([v.numpy() for v in got.optimizer.variables],
                             [v.numpy() for v in want.optimizer.variables])
    else:
        diff = max_relative_diff(got.get_weights(), want.get_weights())
        assert diff <= rtol, f"weights differ from Keras by {diff:.3g} (relative)"
    assert max_relative_diff(got.get_weights(), conv_net().get_weights()) > 1e-3  # it trained
    return got, want


FORMS = [pytest.param(False, id="per_variable"), pytest.param("auto", id="auto")]


@pytest.mark.parametrize("multi_tensor", FORMS)
@pytest.mark.parametrize(
    "kwargs",
    # Quick tier: the defaults and the beta_1=1 edge; the full tier also other betas.
    [{}, pytest.param({"learning_rate": 3e-4, "beta_1": 0.95, "beta_2": 0.98}, marks=pytest.mark.full), {"beta_1": 1.0}],
    ids=["defaults", "betas", "beta_1_one"],
)
def test_matches_keras_bitwise_after_100_steps(kwargs, multi_tensor):
    got, want = compare(kwargs, multi_tensor)
    # Same optimizer variables: names (after the model-specific prefix), order and shapes.
    layout = lambda opt: [(v.name.rsplit("_", 1)[-1], tuple(v.shape)) for v in opt.variables]  # noqa: E731
    assert layout(got.optimizer) == layout(want.optimizer)


@pytest.mark.parametrize("multi_tensor", FORMS)
def test_weight_decay_matches_keras(multi_tensor):
    compare({"weight_decay": 0.05}, multi_tensor, rtol=1e-6)


def test_numpy_lion_single_variable():
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((7,)).astype("float32")
    grads = [rng.standard_normal((7,)).astype("float32") for _ in range(20)]
    w, m = w0.astype(np.float64), np.zeros(7)
    for g in grads:
        w = w - 0.01 * np.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    for mt in (False, "auto"):
        var, opt = keras.Variable(w0), FusedLion(0.01, multi_tensor=mt)
        opt.build([var])
        step = tf.function(lambda g: opt.apply([g], [var]))
        for g in grads:
            step(tf.constant(g))
        # The sign step is exact; float32 only rounds w - lr * sign.
        np.testing.assert_allclose(var.numpy(), w, rtol=0, atol=1e-5)


# Quick tier: each form once (the Keras features are the shared base's; test_optimizers.py runs every
# feature in the quick tier, and the full tier runs every feature in both forms here).
@pytest.mark.sample_axes("kwargs")
@pytest.mark.parametrize("multi_tensor", FORMS)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.003, 10, 0.7)},
        {"clipnorm": 0.05},
        {"global_clipnorm": 0.1},
        {"clipvalue": 0.01},
        {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 7},
        {"gradient_accumulation_steps": 3},
        {"loss_scale_factor": 128.0},
    ],
    ids=["schedule", "clipnorm", "global_clipnorm", "clipvalue", "ema", "accumulation", "loss_scale_factor"],
)
def test_keras_features(kwargs, multi_tensor):
    compare(kwargs, multi_tensor, steps=30)


def test_loss_scale_optimizer_matches_keras():
    want = train(keras.optimizers.LossScaleOptimizer(keras.optimizers.Lion(1e-3)), steps=30)
    got = train(keras.optimizers.LossScaleOptimizer(FusedLion(1e-3)), steps=30)
    assert isinstance(got.optimizer.inner_optimizer, FusedLion)
    assert_bitwise_equal(got.get_weights(), want.get_weights())


@pytest.mark.full  # an XLA-compiled step (~4 s); the quick tier keeps test_optimizers.py's XLA fallback tests
def test_xla_step_uses_keras_math_and_matches(caplog):
    with caplog.at_level("INFO", logger="tfmetal_ext"):
        got, _ = compare({}, "auto", steps=20, jit_compile=True)
    assert got.optimizer.update_form == "per_variable"
    assert "XLA" in got.optimizer.update_form_reason
    assert sum("FusedLion" in r.getMessage() and "XLA" in r.getMessage() for r in caplog.records) == 1


def variables_and_grads(names, dtype="float32"):
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.standard_normal((16, 16)).astype(dtype), name=n) for n in names]
    grads = [tf.constant(rng.standard_normal((16, 16)).astype(dtype)) for _ in names]
    return variables, grads


def op_types(fn):
    return inspect.report_from_capture(inspect.capture_function(fn)).ops_by_type


def test_auto_is_one_op_per_dtype_and_decay_group():
    v32, g32 = variables_and_grads(["kernel_a", "bias_a", "kernel_b"])
    v16, g16 = variables_and_grads(["kernel_c", "bias_c"], "float16")
    opt = FusedLion(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.build(v32 + v16)
    counts = op_types(lambda: opt.apply(g32 + g16, v32 + v16))
    # (float32, decayed), (float32, excluded), (float16, decayed), (float16, excluded)
    assert counts.get(LION_OP) == 4, counts
    assert not [op for op in counts if op.startswith("ResourceApply")], counts
    assert opt.update_form == "multi_tensor" and opt.update_form_reason is None


def test_per_variable_form_builds_the_scalars_once():
    variables, grads = variables_and_grads([f"w{i}" for i in range(10)])
    opt = FusedLion(multi_tensor=False)
    opt.build(variables)
    counts = op_types(lambda: opt.apply(grads, variables))
    assert LION_OP not in counts
    assert counts.get("Sign") == len(variables)
    assert counts.get("AssignSubVariableOp", 0) >= len(variables)
    # Keras builds 1 - beta_1, 1 - beta_2 per variable; ours once per step (two Sub at most,
    # plus the iteration counter's arithmetic).
    assert counts.get("Sub", 0) <= 2, counts
    assert opt.update_form == "per_variable" and opt.update_form_reason == "multi_tensor=False"


def test_sparse_gradients_match_keras():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (240, 5)).astype("int32")
    y = rng.standard_normal((240, 4)).astype("float32")

    def fit(opt):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4),
                                  keras.layers.GlobalAveragePooling1D()])
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights()

    want = fit(keras.optimizers.Lion(0.01))
    for mt in (False, "auto"):
        assert_bitwise_equal(fit(FusedLion(0.01, multi_tensor=mt)), want)


def test_save_load_resume_identically_and_state_loads_into_keras(tmp_path):
    model = conv_net()
    model.compile(optimizer=FusedLion(1e-3, weight_decay=0.01), loss="mse")
    x, y = data(160)
    model.fit(x[:80], y[:80], batch_size=8, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is FusedLion and loaded.optimizer.multi_tensor == "auto"
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    model.fit(x[80:], y[80:], batch_size=8, shuffle=False, verbose=0)
    loaded.fit(x[80:], y[80:], batch_size=8, shuffle=False, verbose=0)
    assert_bitwise_equal(loaded.get_weights(), model.get_weights())

    # The same optimizer variables as Keras' Lion: its state loads into one.
    stock = conv_net()
    stock.compile(optimizer=keras.optimizers.Lion(1e-3), loss="mse")
    stock.optimizer.build(stock.trainable_variables)
    assert len(stock.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(stock.optimizer.variables, model.optimizer.variables):
        assert tuple(a.shape) == tuple(b.shape)
        a.assign(b)


def test_config_round_trip_and_registration():
    opt = FusedLion(0.002, 0.8, 0.95, weight_decay=0.1, clipnorm=1.0, multi_tensor=True)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(clone) is FusedLion
    assert clone.get_config() == opt.get_config()
    assert keras.saving.get_registered_name(FusedLion) == "tfmetal_ext>FusedLion"
    # A config without multi_tensor (a stock Lion's) loads with the default.
    stock_config = keras.optimizers.Lion(0.002).get_config()
    assert FusedLion.from_config(stock_config).multi_tensor == "auto"


def test_positional_arguments_and_defaults_are_keras_own():
    import inspect as pyinspect

    def positional(cls):
        params = list(pyinspect.signature(cls.__init__).parameters.values())[1:]
        return [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

    assert positional(FusedLion) == positional(keras.optimizers.Lion)
    args = (0.01, 0.8, 0.95, 0.05, 2.0)
    want, got = keras.optimizers.Lion(*args).get_config(), FusedLion(*args).get_config()
    for key in ("learning_rate", "beta_1", "beta_2", "weight_decay", "clipnorm"):
        assert got[key] == want[key], key
    assert FusedLion().name.startswith("fused_lion")


@pytest.mark.parametrize("kwargs", [{"beta_1": 0.0}, {"beta_1": 1.5}, {"beta_1": -0.1}])
def test_bad_arguments_raise_keras_own_error(kwargs):
    with pytest.raises(ValueError) as want:
        keras.optimizers.Lion(**kwargs)
    with pytest.raises(ValueError) as got:
        FusedLion(**kwargs)
    assert str(want.value) in str(got.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta_1": "high"}, "Received: beta_1='high'"),
        ({"beta_2": None}, "Received: beta_2=None"),
        ({"beta_2": float("nan")}, "Received: beta_2=nan"),
        ({"multi_tensor": "yes"}, "Received: multi_tensor='yes'"),
        ({"multi_tensor": 1}, "Received: multi_tensor=1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedLion(**kwargs)


_MIRRORED = textwrap.dedent(
    """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tfmetal_ext.optimizers import FusedLion

    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 6)).astype("float32")
    y = rng.standard_normal((320, 2)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def run(make_opt):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(optimizer=make_opt(), loss="mse")
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 20
        for v in model.trainable_variables:  # both replicas hold the same values
            parts = [t.numpy() for t in v.value.values]
            np.testing.assert_array_equal(parts[0], parts[1])
        return model

    want = run(lambda: keras.optimizers.Lion(0.003)).get_weights()
    for mt in (False, "auto"):
        got = run(lambda: FusedLion(0.003, multi_tensor=mt))
        assert got.optimizer.update_form == ("multi_tensor" if mt else "per_variable"), got.optimizer.update_form
        for a, b in zip(got.get_weights(), want):
            np.testing.assert_array_equal(a, b)
    print("MIRRORED LION OK")
    """
)


# Full tier: the quick tier's two-replica run is test_optimizers' multi-tensor FusedAdam.
@pytest.mark.full
def test_mirrored_strategy_two_cpus():
    result = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "MIRRORED LION OK" in result.stdout, result.stderr[-4000:]
