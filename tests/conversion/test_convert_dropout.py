"""convert(): Dropout becomes FusedDropout, verified, its seed state carried over (the same masks as stock)."""

import importlib

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import layers as fl

L = keras.layers

drop_op_module = importlib.import_module("tfmetal_ext.ops.dropout")  # `ops.dropout` is the function



def _x(shape, seed=0, batch=4):
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype("float32")


def _model(*dropouts):
    inp = keras.Input((12,), name="x")
    h = L.Dense(16, activation="relu", name="d1")(inp)
    for i, drop in enumerate(dropouts):
        h = drop(h) if i == 0 else L.Dense(16, name=f"d{i + 1}b")(drop(h))
    return keras.Model(inp, L.Dense(3, name="head")(h), name="net")


def test_dropout_becomes_fused_dropout_and_verifies():
    stock = _model(L.Dropout(0.3, seed=7, name="drop"))
    x = _x((12,))
    stock(x, training=True)  # advance the stock seed state: the converted layer continues from it
    new = tfmetal_ext.convert(stock, count_ops=False)  # verify=True: outputs and gradients checked
    report = new.conversion_report
    drop = new.get_layer("drop")
    assert type(drop) is fl.FusedDropout and drop.rate == 0.3 and drop.seed == 7
    assert any(r.new_class == "FusedDropout" and r.source == ("drop",) for r in report.rewrites)
    np.testing.assert_array_equal(drop.seed_generator.state.numpy(),
                                  stock.get_layer("drop").seed_generator.state.numpy())
    for _ in range(2):  # training calls: the very masks of the stock model
        np.testing.assert_array_equal(np.asarray(new(x, training=True)), np.asarray(stock(x, training=True)))
    np.testing.assert_array_equal(np.asarray(new(x, training=False)), np.asarray(stock(x, training=False)))


def test_dropout_the_fused_layer_would_not_run_is_kept():
    stock = _model(L.Dropout(1.0, name="all"))
    new = tfmetal_ext.convert(stock, count_ops=False)
    kept = {k.name: k.reason for k in new.conversion_report.kept}
    assert "rate=1.0" in kept["all"]
    assert type(new.get_layer("all")) is L.Dropout


@pytest.mark.parametrize("cls,shape", [(L.SpatialDropout1D, (6, 4)), (L.SpatialDropout2D, (5, 5, 4)),
                                       (L.SpatialDropout3D, (3, 3, 3, 4))])
def test_spatial_dropout_is_kept_with_its_per_channel_masks(cls, shape):
    inp = keras.Input(shape)
    stock = keras.Model(inp, L.Dense(3, name="head")(cls(0.5, seed=2, name="sd")(inp)))
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.get_layer("sd")) is cls
    assert "mask shape of its own" in {k.name: k.reason for k in new.conversion_report.kept}["sd"]
    x = _x(shape, batch=3)
    got = np.asarray(new.get_layer("sd")(x, training=True))
    np.testing.assert_array_equal(got, np.asarray(stock.get_layer("sd")(x, training=True)))
    dropped = got.reshape(3, -1, shape[-1]) == 0
    assert set((dropped.all(axis=1) | ~dropped.any(axis=1)).ravel()) == {True}  # whole channels dropped


def test_dropout_with_a_shared_mask_converts_with_the_stock_masks():
    stock = _model(L.Dropout(0.3, noise_shape=(1, None), seed=5, name="shared_mask"))
    new = tfmetal_ext.convert(stock, count_ops=False)  # verify=True: outputs and gradients checked
    assert type(new.get_layer("shared_mask")) is fl.FusedDropout
    assert new.get_layer("shared_mask").noise_shape == (1, None)
    x = _x((12,), batch=6)
    for _ in range(2):  # training calls: the very masks of the stock model, one shared by the batch
        got = np.asarray(new(x, training=True))
        np.testing.assert_array_equal(got, np.asarray(stock(x, training=True)))


class _Block(keras.layers.Layer):
    """A subclassed layer holding a Dropout attribute (keras-hub / Keras examples style)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(8)
        self.dropout = L.Dropout(0.25, seed=3)

    def call(self, x, training=False):
        return self.dropout(self.dense(x), training=training)


def test_a_subclassed_layers_dropout_is_swapped_with_its_seed_state():
    inp = keras.Input((5,))
    stock = keras.Model(inp, L.Dense(2)(_Block(name="block")(inp)))
    x = _x((5,), seed=1)
    stock(x, training=True)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.get_layer("block").dropout) is fl.FusedDropout
    np.testing.assert_array_equal(np.asarray(new(x, training=True)), np.asarray(stock(x, training=True)))


def test_converted_on_a_cpu_the_layer_runs_the_op_there():
    """Both CPU tables use the op (its CPU kernel measured faster than Keras' dropout there): the
    converted layer runs TfmetalExt>Dropout on a CPU, with the stock model's numbers bit for bit."""
    from tfmetal_ext import backends, inspect
    from tfmetal_ext.backends import fusion

    if not backends.current().key.startswith("cpu"):
        pytest.skip(f"this process's backend is {backends.current().key}, not a CPU table")
    stock = _model(L.Dropout(0.3, seed=7, name="drop"))
    new = tfmetal_ext.convert(stock, count_ops=False)
    drop = new.get_layer("drop")
    assert type(drop) is fl.FusedDropout and drop.config_reason is None
    if not drop_op_module.uses_kernel():
        pytest.skip("the op library is not in use here: the layer runs the pure-TF reference")
    assert drop.unfused_reason is None
    x = _x((12,))
    np.testing.assert_array_equal(np.asarray(new(x, training=True)), np.asarray(stock(x, training=True)))
    counts = inspect.report_from_capture(inspect.capture_function(lambda t: new(t, training=True), x)).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1 and "StatelessRandomUniformV2" not in counts
