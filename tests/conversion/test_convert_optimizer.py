"""convert() compiles the converted model with the fused optimizer of a stock one (OPTIMIZER_TO_FUSED),
from the same config, fresh state; a config the fused class cannot take keeps the stock optimizer."""

import importlib

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED


def small_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def xy(n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype("float32")
    return x, (x[:, :2] * 0.5 - x[:, 2:4]).astype("float32")


def fused_class(stock):
    row = OPTIMIZER_TO_FUSED[stock]
    return getattr(importlib.import_module(row.module), row.fused)


CASES = {
    "adam": (lambda: keras.optimizers.Adam(0.01, beta_2=0.99), "Adam", {"beta_2": 0.99}),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.005, rho=0.8), "RMSprop", {"rho": 0.8}),
    "adagrad": (lambda: keras.optimizers.Adagrad(0.1), "Adagrad", {}),
    "sgd_nesterov": (lambda: keras.optimizers.SGD(0.02, momentum=0.9, nesterov=True), "SGD",
                     {"momentum": 0.9, "nesterov": True}),
    "lion": (lambda: keras.optimizers.Lion(0.001, beta_1=0.95), "Lion", {"beta_1": 0.95}),
}


def convert_compiled(optimizer):
    model = small_model()
    model.compile(optimizer=optimizer, loss="mse")
    return model, tfmetal_ext.convert(model, verify=False, count_ops=False)


def assert_trains(model):
    x, y = xy()
    before = float(model.evaluate(x, y, verbose=0))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    after = float(model.evaluate(x, y, verbose=0))
    assert after < before, (before, after)


@pytest.mark.parametrize("case", list(CASES))
def test_stock_optimizer_becomes_the_fused_class(case):
    make, stock, args = CASES[case]
    source, new = convert_compiled(make())
    cls = fused_class(stock)
    assert type(new.optimizer) is cls
    report = new.conversion_report
    assert report.optimizer == (stock, cls.__name__)
    assert any(f"stock {stock} replaced by {OPTIMIZER_TO_FUSED[stock].qualified}" in n for n in report.notes)
    assert f"optimizer: {stock} -> {cls.__name__}" in str(report)
    # Same arguments as the source's optimizer ...
    want = source.optimizer.get_config()
    got = new.optimizer.get_config()
    for key in ("learning_rate", *args):
        assert got[key] == pytest.approx(want[key]), key
    # ... fresh state, a distinct optimizer, and it trains.
    assert new.optimizer is not source.optimizer
    assert int(new.optimizer.iterations.numpy()) == 0
    assert_trains(new)


def test_loss_scale_optimizer_keeps_wrapping_the_fused_one():
    source, new = convert_compiled(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                                       initial_scale=1024.0))
    assert isinstance(new.optimizer, keras.optimizers.LossScaleOptimizer)
    assert type(new.optimizer.inner_optimizer) is tfmetal_ext.optimizers.FusedAdam
    assert float(new.optimizer.get_config()["initial_scale"]) == 1024.0
    assert new.conversion_report.optimizer == ("Adam", "FusedAdam")
    assert any("inside its LossScaleOptimizer" in n for n in new.conversion_report.notes)
    assert_trains(new)


def test_fused_or_unlisted_optimizers_are_kept():
    _, new = convert_compiled(tfmetal_ext.optimizers.FusedAdam(0.01))
    assert type(new.optimizer) is tfmetal_ext.optimizers.FusedAdam and new.conversion_report.optimizer is None
    _, new = convert_compiled(keras.optimizers.Adamax(0.01))  # no fused class
    assert type(new.optimizer) is keras.optimizers.Adamax and new.conversion_report.optimizer is None


def test_a_config_the_fused_class_refuses_keeps_the_stock_optimizer():
    # keras.optimizers.Adam accepts beta_1=1.0 (degenerate, m never moves); FusedAdam refuses it.
    _, new = convert_compiled(keras.optimizers.Adam(0.01, beta_1=1.0))
    assert type(new.optimizer) is keras.optimizers.Adam
    assert new.conversion_report.optimizer is None
    notes = [n for n in new.conversion_report.notes if n.startswith("optimizer: kept the stock Adam")]
    assert notes and "beta_1" in notes[0], new.conversion_report.notes


def test_uncompiled_model_has_no_optimizer_row():
    new = tfmetal_ext.convert(small_model(), verify=False, count_ops=False)
    assert new.conversion_report.optimizer is None
    assert "optimizer:" not in str(new.conversion_report)
