"""tfmetal_ext.convert: stock Keras models rewritten into fusion-first layers, checked against the stock model.

Every expected value comes from the stock model (its outputs, weights, layer names) or from
Keras itself; the converter's own report is what is being checked.
"""

import re

import numpy as np
import pytest
import keras
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import conversion, devices
from tfmetal_ext.conversion import planners
from tfmetal_ext import layers as fl

L = keras.layers


def _x(shape, seed=0, batch=2):
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype("float32")


def _np(t):
    return keras.ops.convert_to_numpy(keras.ops.cast(t, "float32"))


def _assert_same_outputs(stock, new, x, rtol=1e-4):
    ref = [_np(t) for t in keras.tree.flatten(stock(x, training=False))]
    got = [_np(t) for t in keras.tree.flatten(new(x, training=False))]
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        scale = max(float(np.max(np.abs(a))), 1.0)
        np.testing.assert_allclose(b, a, rtol=0, atol=rtol * scale)


def _covered(report):
    return {s for r in report.rewrites for s in r.source} | set(report.kept_names())


def _assert_report_complete(stock, report):
    """Every stock layer (and Keras operation of the graph) is either rewritten (possibly absorbed) or
    kept with a reason."""
    fn = getattr(stock, "_functional", None) or stock
    names = {l.name for l in fn.operations if not isinstance(l, L.InputLayer)}
    assert _covered(report) == names
    assert all(k.reason for k in report.kept)
    assert len(report.absorbed) == len(set(report.absorbed))


def _assert_names_preserved(stock, new):
    stock_names = {l.name for l in stock.layers}
    assert {l.name for l in new.layers} <= stock_names
    assert [t._keras_history.operation.name for t in new.inputs] == [
        t._keras_history.operation.name for t in stock.inputs]
    assert [t._keras_history.operation.name for t in new.outputs] == [
        t._keras_history.operation.name for t in stock.outputs]
    assert [tuple(t.shape) for t in new.outputs] == [tuple(t.shape) for t in stock.outputs]


def _assert_save_load(new, x, tmp_path):
    path = tmp_path / "converted.keras"
    new.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(l).__name__ for l in loaded.layers] == [type(l).__name__ for l in new.layers]
    for a, b in zip(keras.tree.flatten(new(x, training=False)), keras.tree.flatten(loaded(x, training=False))):
        np.testing.assert_array_equal(_np(a), _np(b))


def _assert_fits(new, x, y, loss="mse"):
    new.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    before = [_np(w) for w in new.trainable_weights]
    hist = new.fit(x, y, epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(hist.history["loss"][0])
    changed = sum(not np.array_equal(b, _np(w)) for b, w in zip(before, new.trainable_weights))
    assert changed >= len(before) // 2


def _count(model, cls):
    return sum(type(l) is cls for l in model.layers)


# ----------------------------------------------------------------------------
# keras.applications


@pytest.mark.slow
def test_resnet50_training_form(tmp_path):
    stock = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                        classifier_activation=None)
    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    assert isinstance(report, tfmetal_ext.ConversionReport) and report.verified
    x = _x((32, 32, 3))
    _assert_same_outputs(stock, new, x)
    _assert_report_complete(stock, report)
    _assert_names_preserved(stock, new)
    # Every Conv2D -> BatchNormalization pair became one ConvBNAct (the conv's name).
    assert _count(new, fl.ConvBNAct) == _count(stock, L.Conv2D) == 53
    assert _count(new, L.BatchNormalization) == 0 and _count(new, L.Conv2D) == 0
    conv, bn = stock.get_layer("conv1_conv"), stock.get_layer("conv1_bn")
    fused = new.get_layer("conv1_conv")
    assert fused.activation == "relu" and report.rewrite_for("conv1_relu").name == "conv1_conv"
    np.testing.assert_array_equal(_np(fused.kernel), _np(conv.kernel))
    np.testing.assert_array_equal(_np(fused.gamma), _np(bn.gamma))
    np.testing.assert_allclose(_np(fused.moving_mean), _np(bn.moving_mean) - _np(conv.bias))
    # The block outputs (Add -> relu) have two consumers upstream of them: kept, with a reason.
    assert {k.class_name for k in report.kept if "conv2_block1_out" == k.name} == {"Activation"}
    _assert_save_load(new, x, tmp_path)
    _assert_fits(new, _x((32, 32, 3), batch=4), np.random.default_rng(1).random((4, 10)).astype("float32"))


@pytest.mark.slow
def test_resnet50_inference_form_folds_every_batch_norm():
    stock = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                        classifier_activation=None)
    # Non-trivial moving statistics, so a wrong fold shows.
    rng = np.random.default_rng(3)
    for layer in stock.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.1, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
            layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
    new = tfmetal_ext.convert(stock, inference=True, count_ops=False)
    _assert_same_outputs(stock, new, _x((32, 32, 3)))
    _assert_report_complete(stock, new.conversion_report)
    assert _count(new, fl.FusedConv2D) == 53
    assert not any(isinstance(l, (L.BatchNormalization, fl.FusedBatchNorm, fl.ConvBNAct)) for l in new.layers)


@pytest.mark.slow
def test_mobilenetv2_depthwise_and_relu6(tmp_path):
    stock = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10,
                                           classifier_activation=None)
    new = tfmetal_ext.convert(stock, count_ops=False)
    x = _x((32, 32, 3))
    _assert_same_outputs(stock, new, x)
    _assert_report_complete(stock, new.conversion_report)
    _assert_names_preserved(stock, new)
    assert _count(new, fl.FusedDepthwiseConv2D) == _count(stock, L.DepthwiseConv2D) == 17
    # Conv2D -> BN -> ReLU(6.) folds into ConvBNAct(relu6).
    assert new.get_layer("Conv1").activation == "relu6"
    _assert_save_load(new, x, tmp_path)
    _assert_fits(new, _x((32, 32, 3), batch=4), np.random.default_rng(1).random((4, 10)).astype("float32"))
    # Inference form: depthwise + BN + ReLU6 folded into one FusedDepthwiseConv2D.
    deploy = tfmetal_ext.convert(stock, inference=True, count_ops=False)
    _assert_same_outputs(stock, deploy, x)
    dw = deploy.get_layer("expanded_conv_depthwise")
    assert type(dw) is fl.FusedDepthwiseConv2D and dw.use_bias and dw._activation_name == "relu6"


@pytest.mark.slow
def test_efficientnetb0(tmp_path):
    stock = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=10,
                                              classifier_activation=None)
    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    x = _x((32, 32, 3))
    _assert_same_outputs(stock, new, x)
    _assert_report_complete(stock, report)
    _assert_names_preserved(stock, new)
    swish = [k for k in report.kept if k.class_name == "Activation"]
    assert swish and all("silu" in k.reason for k in swish)
    assert {k.class_name for k in report.kept if k.reason == conversion.NO_COUNTERPART} >= {
        "Multiply", "Rescaling", "Normalization"}
    # Every Dropout converts: the classifier's, and the blocks' drop-connect, whose mask is one per sample
    # (noise_shape (None, 1, 1, 1)).
    assert type(new.get_layer("top_dropout")) is fl.FusedDropout
    drops = [layer for layer in stock.layers if type(layer) is L.Dropout]
    assert any(layer.noise_shape == (None, 1, 1, 1) for layer in drops)
    assert all(type(new.get_layer(layer.name)) is fl.FusedDropout for layer in drops)
    assert not [k for k in report.kept if k.class_name == "Dropout"]
    _assert_save_load(new, x, tmp_path)
    _assert_fits(new, _x((32, 32, 3), batch=4), np.random.default_rng(1).random((4, 10)).astype("float32"))


# ----------------------------------------------------------------------------
# Transformer and recurrent models


def _encoder_block():
    inp = keras.Input((6, 16), name="tokens")
    att = L.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(inp, inp)
    x = L.Add(name="res1")([inp, att])
    x = L.LayerNormalization(epsilon=1e-6, name="ln1")(x)
    h = L.Dense(32, name="ff1")(x)
    h = L.Activation("gelu", name="ff1_gelu")(h)
    h = L.Dense(16, name="ff2")(h)
    x = L.Add(name="res2")([x, h])
    x = L.LayerNormalization(epsilon=1e-6, name="ln2")(x)
    x = L.GlobalAveragePooling1D(name="pool")(x)
    out = L.Dense(3, name="logits")(x)
    return keras.Model(inp, out, name="encoder")


def test_transformer_encoder_block(tmp_path):
    stock = _encoder_block()
    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    x = _x((6, 16))
    _assert_same_outputs(stock, new, x)
    _assert_report_complete(stock, report)
    _assert_names_preserved(stock, new)
    assert type(new.get_layer("ln1")) is fl.FusedLayerNorm and new.get_layer("ln1").epsilon == 1e-6
    ff1 = new.get_layer("ff1")
    assert type(ff1) is fl.FusedDense and ff1._activation_name == "gelu"
    assert report.rewrite_for("ff1_gelu").source == ("ff1", "ff1_gelu")
    assert report.rewrite_for("mha").new_class == "FusedMultiHeadAttention"
    assert type(new.get_layer("mha")) is fl.FusedMultiHeadAttention
    for w_stock, w_new in zip(stock.get_layer("mha").weights, new.get_layer("mha").weights):
        np.testing.assert_array_equal(_np(w_stock), _np(w_new))
    _assert_save_load(new, x, tmp_path)
    _assert_fits(new, _x((6, 16), batch=4), np.random.default_rng(1).random((4, 3)).astype("float32"))


def test_lstm_text_classifier(tmp_path):
    inp = keras.Input((12,), dtype="int32", name="ids")
    x = L.Embedding(20, 8, mask_zero=True, name="embed")(inp)
    x = L.GRU(8, return_sequences=True, name="gru")(x)
    x = L.LSTM(16, name="lstm")(x)
    out = L.Dense(1, activation="sigmoid", name="prob")(x)
    stock = keras.Model(inp, out, name="text")
    new = tfmetal_ext.convert(stock, count_ops=False)
    ids = np.random.default_rng(0).integers(1, 20, (4, 12)).astype("int32")
    ids[:, 8:] = 0  # right padding: masked steps
    _assert_same_outputs(stock, new, ids)
    _assert_report_complete(stock, new.conversion_report)
    assert type(new.get_layer("lstm")) is fl.FusedLSTM and type(new.get_layer("gru")) is fl.FusedGRU
    for name in ("lstm", "gru"):
        for a, b in zip(stock.get_layer(name).weights, new.get_layer(name).weights):
            np.testing.assert_array_equal(_np(a), _np(b))
    _assert_save_load(new, ids, tmp_path)
    _assert_fits(new, ids, np.array([0, 1, 1, 0], "float32")[:, None], loss="binary_crossentropy")


def test_unsupported_configurations_are_kept_with_reasons():
    inp = keras.Input((5, 4), name="seq")
    x = L.LSTM(6, recurrent_dropout=0.1, return_sequences=True, name="lstm_rd")(inp)
    x = L.BatchNormalization(name="bn3d")(x)  # 3-D input: mapped (reshaped to NHWC around the fused op)
    x = L.LayerNormalization(axis=1, name="ln_axis1")(x)
    x = L.GRU(4, reset_after=False, name="gru_v1")(x)
    out = L.Dense(2, activation="softmax", name="head")(x)
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    kept = {k.name: k.reason for k in new.conversion_report.kept}
    assert "recurrent dropout" in kept["lstm_rd"]
    assert "bn3d" not in kept and type(new.get_layer("bn3d")) is fl.FusedBatchNorm
    assert "axis" in kept["ln_axis1"]
    assert "reset_after" in kept["gru_v1"]
    assert type(new.get_layer("lstm_rd")) is L.LSTM and type(new.get_layer("gru_v1")) is L.GRU
    assert type(new.get_layer("head")) is fl.FusedDense
    _assert_same_outputs(stock, new, _x((5, 4)))


def test_channels_first_conv_is_kept():
    inp = keras.Input((3, 8, 8))
    x = L.Conv2D(4, 3, data_format="channels_first", name="conv_cf")(inp)
    x = L.BatchNormalization(axis=1, name="bn_cf")(x)
    out = L.Flatten(name="flat")(x)
    stock = keras.Model(inp, out)
    runs_nchw = devices.capabilities().onednn
    if not runs_nchw:
        # TF's own CPU Conv2D (no oneDNN) takes NHWC only: the stock model cannot run, so there is
        # nothing to verify against; the plan must still keep both layers, with their reasons.
        with pytest.raises(tf.errors.UnimplementedError, match="NHWC"):
            stock(_x((3, 8, 8)))
    new = tfmetal_ext.convert(stock, count_ops=False, verify=runs_nchw)
    kept = {k.name: k.reason for k in new.conversion_report.kept}
    assert "channels_last" in kept["conv_cf"] and "axis" in kept["bn_cf"]
    if runs_nchw:
        _assert_same_outputs(stock, new, _x((3, 8, 8)))


# ----------------------------------------------------------------------------
# Graph shapes: nested, shared, subclassed layers, Sequential, dtype policies


@keras.saving.register_keras_serializable(package="tfmetal_ext_tests")
class Scale(L.Layer):
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def test_subclassed_layer_is_kept_and_reported():
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(4, 3, padding="same", name="conv")(inp)
    x = Scale(3.0, name="scale")(x)
    x = L.Activation("relu", name="relu")(x)
    out = L.GlobalAveragePooling2D(name="gap")(x)
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    kept = {k.name: k for k in new.conversion_report.kept}
    assert kept["scale"].class_name == "Scale" and "subclassed" in kept["scale"].reason
    assert type(new.get_layer("scale")) is Scale and new.get_layer("scale") is not stock.get_layer("scale")
    # The subclassed layer sits between conv and relu: nothing is folded across it.
    assert new.get_layer("conv")._activation_name == "linear" and "relu" in kept
    _assert_same_outputs(stock, new, _x((8, 8, 3)))


def test_shared_layer_is_converted_once_and_shared():
    a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
    shared = L.Dense(4, name="shared")
    ya, yb = shared(a), shared(b)
    ya = L.Activation("relu", name="relu_a")(ya)  # not folded: the layer is shared
    out = L.Concatenate(name="cat")([ya, yb])
    stock = keras.Model([a, b], out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    layer = new.get_layer("shared")
    assert type(layer) is fl.FusedDense and len(layer._inbound_nodes) >= 2
    assert _count(new, fl.FusedDense) == 1
    assert "shared" in report.rewrite_for("shared").note and report.rewrite_for("shared").source == ("shared",)
    assert "relu_a" in report.kept_names()
    xs = [_x((6,)), _x((6,), seed=1)]
    _assert_same_outputs(stock, new, xs)
    # One kernel serves both calls in the converted model too.
    assert len(new.trainable_weights) == len(stock.trainable_weights) == 2


def test_shared_conv_is_not_merged_with_its_batch_norm():
    inp = keras.Input((8, 8, 3))
    conv = L.Conv2D(4, 3, padding="same", use_bias=False, name="conv")
    x1 = L.BatchNormalization(name="bn")(conv(inp))
    x2 = conv(L.Activation("relu", name="pre")(inp))
    out = L.Add(name="add")([x1, x2])
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.get_layer("conv")) is fl.FusedConv2D and type(new.get_layer("bn")) is fl.FusedBatchNorm
    _assert_same_outputs(stock, new, _x((8, 8, 3)))


def test_nested_sequential_block_is_converted_recursively():
    block = keras.Sequential(
        [keras.Input((8, 8, 4)), L.Conv2D(8, 3, padding="same", name="c"), L.BatchNormalization(name="bn"),
         L.ReLU(name="r")], name="block")
    inp = keras.Input((8, 8, 3), name="img")
    x = L.Conv2D(4, 1, name="stem")(inp)
    x = block(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(2, name="head")(x)
    stock = keras.Model(inp, out, name="outer")
    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    inner = new.get_layer("block")
    assert isinstance(inner, keras.Sequential) and inner is not block
    assert [(l.name, type(l)) for l in inner.layers] == [("c", fl.ConvBNAct)]
    assert report.rewrite_for("block/bn").source == ("block/c", "block/bn", "block/r")
    _assert_same_outputs(stock, new, _x((8, 8, 3)))


def test_sequential_model_stays_sequential_with_names_and_trainable_flags():
    stock = keras.Sequential([
        keras.Input((8, 8, 3), name="pixels"),
        L.Conv2D(4, 3, name="conv", trainable=False), L.BatchNormalization(name="bn", trainable=False),
        L.Activation("relu", name="act", trainable=False),
        L.Flatten(name="flat"), L.Dense(5, name="fc"), L.LayerNormalization(name="ln"),
    ], name="seq")
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert isinstance(new, keras.Sequential) and new.name == "seq"
    assert [l.name for l in new.layers] == ["conv", "flat", "fc", "ln"]
    assert new.get_layer("conv").trainable is False and new.get_layer("fc").trainable is True
    assert len(new.trainable_weights) == len(stock.trainable_weights) == 4
    assert len(new.non_trainable_weights) == len(stock.non_trainable_weights) - 1  # the conv bias is gone
    assert new.inputs[0].name == "pixels"
    _assert_same_outputs(stock, new, _x((8, 8, 3)))


def test_mixed_bfloat16_policies_are_kept():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, padding="same", name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    x = L.Dense(8, name="fc")(x)
    x = L.LayerNormalization(name="ln")(x)
    out = L.Dense(2, dtype="float32", name="head")(x)
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    for layer in stock.layers:
        if layer.name in {l.name for l in new.layers}:
            assert new.get_layer(layer.name).dtype_policy.name == layer.dtype_policy.name
    assert new.get_layer("conv").dtype_policy.name == "mixed_bfloat16"
    assert new.get_layer("conv").compute_dtype == "bfloat16" and new.get_layer("head").compute_dtype == "float32"
    assert new.conversion_report.max_output_diff <= conversion.OUTPUT_RTOL["bfloat16"]
    _assert_same_outputs(stock, new, _x((8, 8, 3)), rtol=5e-2)


# ----------------------------------------------------------------------------
# Op counts, verification, bad input


def _small_cnn():
    inp = keras.Input((16, 16, 3))
    x = L.Conv2D(8, 3, padding="same", name="c1")(inp)
    x = L.BatchNormalization(name="bn1")(x)
    x = L.Activation("relu", name="r1")(x)
    x = L.Conv2D(8, 3, padding="same", name="c2")(x)
    x = L.ReLU(name="r2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(4, name="fc")(x)
    return keras.Model(inp, out, name="small_cnn")


def test_report_counts_ops_and_prints_every_rewrite():
    from tfmetal_ext import inspect

    stock = _small_cnn()
    new = tfmetal_ext.convert(stock)
    report = new.conversion_report
    stock_train = inspect.fusion_report(stock, mode="train", optimizer="sgd", loss="mse", batch_size=2).num_ops
    stock_predict = inspect.fusion_report(stock, mode="predict", batch_size=2).num_ops
    assert report.ops_before == {"train": stock_train, "predict": stock_predict}
    assert report.ops_after["train"] < stock_train and report.ops_after["predict"] < stock_predict
    text = str(report)
    assert f"ops per train step: {stock_train} -> {report.ops_after['train']}" in text
    assert re.search(r"c1 \+ bn1 \+ r1 +-> c1 \[ConvBNAct\]", text)
    assert re.search(r"c2 \+ r2 +-> c2 \[FusedConv2D\]", text)
    assert "verified" in text and "GlobalAveragePooling2D x1" in text
    d = report.to_dict()
    assert d["rewrites"][0]["source"] == ("c1", "bn1", "r1") and d["verified"] is True


def test_verify_reports_the_first_layer_that_differs(monkeypatch):
    stock = _small_cnn()
    real = planners.activation_of
    # Sabotage: ReLU layers claim to be relu6, so the folded conv computes something else.
    monkeypatch.setattr(planners, "activation_of",
                        lambda layer: "relu6" if type(layer) is L.ReLU else real(layer))
    stock.get_layer("c2").kernel.assign(np.full((3, 3, 8, 8), 1.0, "float32"))  # outputs above 6
    with pytest.raises(conversion.VerificationError) as info:
        tfmetal_ext.convert(stock, count_ops=False)
    msg = str(info.value)
    assert "First layer that differs: c2 [FusedConv2D] (stock: r2 output)" in msg
    bad = [row[0].split()[0] for row in info.value.diffs if not row[1] <= row[2]]
    assert bad[0] == "c2" and "c1" not in bad
    assert isinstance(info.value, AssertionError)


def test_verify_compares_training_gradients(monkeypatch):
    stock = _small_cnn()
    orig = planners.PLANNERS[L.Conv2D]

    def bad_plan(ctx, node):
        plan, reason = orig(ctx, node)
        if plan.rewrite is not None and plan.rewrite.new_class == "ConvBNAct":
            make = plan.make

            def make_bad():
                layer = make()
                real_call = layer.call
                # Sabotage: moving statistics in training too. Inference outputs stay identical.
                layer.call = lambda inputs, training=False: real_call(inputs, training=False)
                return layer
            plan.make = make_bad
        return plan, reason

    monkeypatch.setitem(planners.PLANNERS, L.Conv2D, bad_plan)
    with pytest.raises(conversion.VerificationError) as info:
        tfmetal_ext.convert(stock, count_ops=False)
    msg = str(info.value)
    assert "training gradients" in msg and "c1/kernel" in msg


def test_verify_refuses_when_every_stock_output_is_nan():
    stock = _small_cnn()
    # A negative moving variance (e.g. from a corrupted checkpoint) makes every inference output NaN.
    stock.get_layer("bn1").moving_variance.assign(np.full((8,), -1.0, "float32"))
    assert np.all(np.isnan(_np(stock(_x((16, 16, 3)), training=False))))
    with pytest.raises(conversion.VerificationError, match="nothing to compare") as info:
        tfmetal_ext.convert(stock, count_ops=False)
    assert "verify=False" in str(info.value)
    new = tfmetal_ext.convert(stock, verify=False, count_ops=False)
    assert new.conversion_report.verified is None and _count(new, fl.ConvBNAct) == 1


def test_verify_with_some_nan_outputs_warns_and_still_catches_a_wrong_conversion(monkeypatch):
    def nan_column_cnn():
        stock = _small_cnn()
        k = _np(stock.get_layer("fc").kernel)
        k[:, 0] = np.nan  # output 0 is NaN, outputs 1..3 are finite
        stock.get_layer("fc").kernel.assign(k)
        return stock

    stock = nan_column_cnn()
    with pytest.warns(RuntimeWarning, match="NaN or inf") as record:
        new = tfmetal_ext.convert(stock, count_ops=False)
    text = " ".join(str(w.message) for w in record)
    assert "2 of 8 output values" in text and "weight gradients" in text  # batch 2, 1 of 4 outputs NaN
    report = new.conversion_report
    assert report.verified is True and any("output values" in n for n in report.notes)
    x = _x((16, 16, 3), batch=4)
    np.testing.assert_array_equal(np.isnan(_np(new(x))), np.isnan(_np(stock(x))))
    ref, got = _np(stock(x, training=False)), _np(new(x, training=False))
    np.testing.assert_allclose(got[:, 1:], ref[:, 1:], rtol=0, atol=1e-4 * np.max(np.abs(ref[:, 1:])))

    # The finite outputs are still compared: the relu6 sabotage is caught despite the NaN column.
    real = planners.activation_of
    monkeypatch.setattr(planners, "activation_of",
                        lambda layer: "relu6" if type(layer) is L.ReLU else real(layer))
    stock = nan_column_cnn()
    stock.get_layer("c2").kernel.assign(np.full((3, 3, 8, 8), 1.0, "float32"))
    with pytest.warns(RuntimeWarning), pytest.raises(conversion.VerificationError, match="c2 \\[FusedConv2D\\]"):
        tfmetal_ext.convert(stock, count_ops=False)


def test_diff_measures_treat_only_matching_non_finite_values_as_equal():
    nan, inf = float("nan"), float("inf")
    assert conversion.verify.rel_diff([1.0, nan, inf], [1.0, nan, inf]) == 0.0
    for b in ([1.0, 2.0, inf], [1.0, nan, -inf], [1.0, nan, 3.0]):
        assert not conversion.verify.rel_diff([1.0, nan, inf], b) <= 1.0
    assert conversion.verify.rel_diff([1.0, 2.0], [1.0, 2.5]) == pytest.approx(0.25)
    assert conversion.verify.rel_l2([3.0, nan, 4.0], [3.0, nan, 4.0]) == 0.0
    assert conversion.verify.rel_l2([3.0, nan, 4.0], [3.0, 0.0, 4.0]) == float("inf")
    assert conversion.verify.rel_l2([3.0, inf, 4.0], [3.0, inf, 4.5]) == pytest.approx(0.1)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.fc = L.Dense(2)

    def call(self, x):
        return self.fc(x)


def test_bad_models_raise_value_error():
    with pytest.raises(ValueError, match="Received: model=.*not built"):
        tfmetal_ext.convert(_Subclassed())  # a subclassed model converts once built (tests/conversion/test_deep.py)
    with pytest.raises(ValueError, match="Received: model=.*not built"):
        tfmetal_ext.convert(keras.Sequential([L.Dense(2)]))
    with pytest.raises(ValueError, match="Received: model="):
        tfmetal_ext.convert(L.Dense(2))
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        tfmetal_ext.convert(_small_cnn(), batch_size=0)


def test_cli_convert(tmp_path, capsys):
    from tfmetal_ext import cli

    src, dst = tmp_path / "in.keras", tmp_path / "out.keras"
    stock = _small_cnn()
    stock.save(src)
    assert cli.main(["convert", str(src), str(dst), "--inference", "--no-ops"]) == 0
    out = capsys.readouterr().out
    assert "inference form" in out and re.search(r"c1 \+ bn1 \+ r1 +-> c1 \[FusedConv2D\]", out)
    loaded = keras.saving.load_model(dst)
    assert type(loaded.get_layer("c1")) is fl.FusedConv2D
    _assert_same_outputs(stock, loaded, _x((16, 16, 3)))
    assert cli.main(["convert", str(tmp_path / "missing.keras"), str(dst)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_inference_form_folds_tfmetal_ext_blocks_of_a_converted_model():
    inp = keras.Input((8, 8, 4))
    x = fl.ConvBNAct(8, 3, name="stem")(inp)
    x = fl.ResidualBlock(8, name="res")(x)
    out = fl.FusedDense(3, name="head")(L.GlobalAveragePooling2D(name="gap")(x))
    trained = keras.Model(inp, out)
    x_in = _x((8, 8, 4), batch=4)
    trained(x_in, training=True)  # moves the moving statistics away from their initial values
    deploy = tfmetal_ext.convert(trained, inference=True, count_ops=False)
    assert type(deploy.get_layer("stem")) is fl.FusedConv2D
    assert type(deploy.get_layer("res")) is fl.FoldedResidualBlock
    assert "already a tfmetal_ext layer" in dict((k.name, k.reason) for k in deploy.conversion_report.kept)["head"]
    _assert_same_outputs(trained, deploy, x_in)


def test_nested_subclassed_model_is_kept():
    inner = _Subclassed()
    inp = keras.Input((3,))
    out = L.Dense(2, name="head")(inner(inp))
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, count_ops=False)
    kept = {k.class_name: k.reason for k in new.conversion_report.kept}
    assert "no layer graph" in kept["_Subclassed"]
    assert type(new.get_layer("head")) is fl.FusedDense
    _assert_same_outputs(stock, new, _x((3,)))


def test_model_outputs_are_never_absorbed():
    stock = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, name="conv"),
                              L.BatchNormalization(name="bn"), L.ReLU(name="out_relu")])
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert [(l.name, type(l)) for l in new.layers] == [("conv", fl.ConvBNAct), ("out_relu", L.ReLU)]
    assert new.outputs[0]._keras_history.operation.name == "out_relu"
    _assert_same_outputs(stock, new, _x((8, 8, 3)))


def test_lora_enabled_layers_convert_with_their_adapters():
    # The drop-ins take LoRA, so a LoRA-enabled Conv2D / Dense becomes the fused class with the
    # same four variables (kernel frozen, adapters trainable), bitwise; a LoRA layer that is kept
    # is copied variable by variable (Keras' save/load would merge the adapters into the kernel).
    L = keras.layers
    inp = keras.Input((8, 8, 4))
    x = L.Conv2D(4, 3, name="c")(inp)
    x = L.Conv2D(6, 3, groups=2, name="grouped")(x)  # two input channels per group: kept
    out = L.Dense(3, name="d")(L.Flatten()(x))
    stock = keras.Model(inp, out)
    stock.get_layer("c").enable_lora(2)
    stock.get_layer("grouped").enable_lora(2)
    stock.get_layer("d").enable_lora(2, lora_alpha=4.0)
    rng = np.random.default_rng(3)
    for w in stock.weights:  # non-zero adapters, so a dropped or zeroed one shows
        w.assign(rng.standard_normal(tuple(w.shape)).astype("float32") * 0.1)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.get_layer("c")) is fl.FusedConv2D and type(new.get_layer("d")) is fl.FusedDense
    assert new.conversion_report.verified
    for name in ("c", "grouped", "d"):
        a, b = stock.get_layer(name), new.get_layer(name)
        assert b.lora_enabled and b.lora_rank == 2 and b.lora_alpha == a.lora_alpha
        assert [(w.name, w.trainable) for w in b.weights] == [(w.name, w.trainable) for w in a.weights]
        for u, v in zip(a.weights, b.weights):
            assert u is not v
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), keras.ops.convert_to_numpy(u))
    x = rng.standard_normal((2, 8, 8, 4)).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(new(x)), keras.ops.convert_to_numpy(stock(x)),
                               rtol=1e-5, atol=1e-5)
