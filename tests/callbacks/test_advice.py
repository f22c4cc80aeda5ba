"""MetalCallback on models as examples write them (issue 13, defects 2, 4 and 8)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import layers as fl
from tfmetal_ext.callbacks import MetalCallback

L = keras.layers


def _fit(model, x, y, **cb_kwargs):
    cb = MetalCallback(print_fn=lambda s: None, **cb_kwargs)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb])
    return cb, history


def _accepts(layer, x):
    try:
        layer(x)
        return True
    except Exception:
        return False


def _bn_3d_model():
    inp = keras.Input((10, 6))
    x = L.BatchNormalization(name="bn3d")(L.Conv1D(8, 3, activation="relu")(inp))
    out = L.Dense(3, name="head")(L.GlobalAveragePooling1D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="mse")
    return model


def test_batch_norm_advice_follows_what_the_fused_class_accepts():
    model = _bn_3d_model()
    cb, _ = _fit(model, np.zeros((8, 10, 6), "float32"), np.zeros((8, 3), "float32"))
    line = next(l for l in cb.summary.splitlines() if "bn3d" in l)
    accepts = _accepts(fl.FusedBatchNorm(), np.ones((2, 10, 8), "float32"))
    assert ("FusedBatchNorm" in line) == accepts, cb.summary


def test_no_advice_for_a_layer_convert_keeps():
    # axis=1 on a 4-D input: no fused batch norm normalizes that axis with FusedBatchNormV3.
    inp = keras.Input((4, 6, 6))
    x = L.BatchNormalization(axis=1, name="bn_axis1")(inp)
    model = keras.Model(inp, L.Dense(2)(L.Flatten()(x)))
    model.compile(optimizer="adam", loss="mse")
    converted = tfmetal_ext.convert(model, verify=False)
    replaced = type(converted.get_layer("bn_axis1")).__module__.startswith("tfmetal_ext")
    cb, _ = _fit(model, np.zeros((8, 4, 6, 6), "float32"), np.zeros((8, 2), "float32"))
    line = next(l for l in cb.summary.splitlines() if "bn_axis1" in l)
    assert ("-> use" in line) == replaced, cb.summary


@pytest.mark.full  # a model fitted for the advice (~4 s); the quick tier keeps the other advice rules of this file
def test_sigmoid_head_with_crossentropy_is_not_a_strict_problem():
    # The bidirectional-LSTM classifier's head: Dense(1, sigmoid) trained with binary crossentropy.
    inp = keras.Input((None,), dtype="int32")
    x = L.Bidirectional(L.LSTM(4))(L.Embedding(30, 8)(inp))
    model = tfmetal_ext.convert(keras.Model(inp, L.Dense(1, activation="sigmoid")(x)), verify=False)
    model.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(), loss="binary_crossentropy")
    x = np.random.default_rng(0).integers(0, 30, (8, 12))
    cb, _ = _fit(model, x, np.ones((8, 1), "float32"))
    assert "missed" not in cb.summary, cb.summary


def test_callable_activations_and_keras_ops_in_the_callback():
    inp = keras.Input((8,))
    a = L.Dense(8, activation=tf.nn.swish)(inp)
    b = L.Dense(8, activation=lambda t: t * 2.0)(inp)
    x = keras.ops.relu(keras.ops.add(a, b))
    model = keras.Model(inp, L.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    cb, history = _fit(model, np.zeros((8, 8), "float32"), np.zeros((8, 1), "float32"))
    assert cb.fusion_report is not None and len(history.history["loss"]) == 2
    assert "missed" not in cb.summary, cb.summary


def _raising_rule(layer, ctx):
    raise RuntimeError("rule broke")


def test_a_failing_inspection_warns_once_and_training_goes_on():
    inp = keras.Input((8,))
    dense = L.Dense(4, activation="relu")
    dense._fusion_rule = _raising_rule  # the model's inspection raises
    model = keras.Model(inp, L.Dense(1)(dense(inp)))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 8), "float32"), np.ones((8, 1), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb, history = _fit(model, x, y, strict=True)
    assert len(history.history["loss"]) == 2  # fit ran to the end
    ours = [w for w in caught if "MetalCallback" in str(w.message) and "rule broke" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert cb.fusion_report is None
    assert any("rule broke" in f for f in cb.findings)
    assert "step_time_ms" in history.history  # the other parts kept working


def test_train_begin_check_failure_does_not_stop_fit(monkeypatch):
    from tfmetal_ext.callbacks import _findings

    def broken(self, model, caps):
        raise KeyError("no such policy")

    monkeypatch.setattr(_findings.Findings, "_policy", broken)
    inp = keras.Input((8,))
    model = keras.Model(inp, L.Dense(1)(inp))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(RuntimeWarning, match="no such policy"):
        cb, history = _fit(model, np.ones((8, 8), "float32"), np.ones((8, 1), "float32"))
    assert len(history.history["loss"]) == 2 and cb.fusion_report is not None


# ----------------------------------------------------------------------------
# Issue 14: stock layers the backend cannot run.


def _rnn_model(*rnns):
    inp = keras.Input((6, 4))
    x = inp
    for layer in rnns:
        x = layer(x)
    return keras.Model(inp, L.Dense(1)(x))


def _findings(model, plugin, strict=False):
    from tfmetal_ext import devices
    from tfmetal_ext.callbacks._findings import Findings

    found = Findings(strict=strict)
    with devices.assume_backend(plugin), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found.check(model, devices.capabilities())
    return found.lines, [str(w.message) for w in caught]


def test_stock_lstm_and_gru_are_reported_as_failing_on_the_open_plugin_with_the_fix():
    from tfmetal_ext import backends

    reasons = backends.TABLES["metal_plugin"].unsupported_layers
    assert set(reasons) >= {"LSTM", "GRU"}  # the table's data, which the callback reads
    model = _rnn_model(L.LSTM(3, return_sequences=True, name="enc"), L.Bidirectional(L.GRU(2), name="bi"))
    lines, warned = _findings(model, "tensorflow-metal-plugin")
    lstm = [l for l in lines if "keras.layers.LSTM" in l]
    gru = [l for l in lines if "keras.layers.GRU" in l]
    assert len(lstm) == 1 and "(enc)" in lstm[0] and reasons["LSTM"] in lstm[0], lines
    assert len(gru) == 1 and "2 stock" in gru[0] and reasons["GRU"] in gru[0], lines  # both directions
    assert "FusedLSTM" in lstm[0] and "FusedGRU" in gru[0]  # the fix
    assert sum("fail on tensorflow-metal-plugin" in w for w in warned) == 2
    assert any(l.startswith("backend metal") and "tensorflow-metal-plugin" in l for l in lines)
    with pytest.raises(tfmetal_ext.callbacks.MetalCallbackError, match="(?s)FusedGRU.*FusedLSTM"):
        _findings(model, "tensorflow-metal-plugin", strict=True)


def test_no_failure_reported_where_the_layer_runs():
    # Keras' own loop (use_cudnn=False, or arguments cuDNN cannot take) runs on the plugin; Apple's has CudnnRNNV3.
    ok = _rnn_model(
        L.LSTM(3, use_cudnn=False, return_sequences=True),
        L.GRU(2, recurrent_dropout=0.1, return_sequences=True),
        fl.FusedLSTM(2),
    )
    lines, _ = _findings(ok, "tensorflow-metal-plugin")
    assert not [l for l in lines if " fail on " in l], lines
    lines, _ = _findings(_rnn_model(L.LSTM(3)), "tensorflow-metal")
    assert not [l for l in lines if " fail on " in l], lines
