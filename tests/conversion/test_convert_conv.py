"""convert(): Conv1D (alone and Conv1D -> BatchNormalization -> act), SeparableConv2D, grouped Conv2D, Embedding.

Expected values come from the stock model (its outputs and weights) and from the fusion table's own rows.
"""

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext import layers as fl
from tfmetal_ext.backends import fusion

L = keras.layers


def _x(shape, seed=0, batch=2):
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype("float32")


def _randomize(model, seed=1):
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.5, c).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, c).astype("float32"))
        elif layer.weights:
            layer.set_weights([w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in layer.get_weights()])


def _same_outputs(stock, new, x):
    np.testing.assert_allclose(np.asarray(new(x, training=False)), np.asarray(stock(x, training=False)),
                               rtol=1e-5, atol=1e-5)


def _rewrites(report):
    return {r.name: r for r in report.rewrites}


def _kept(report):
    return {k.name: k for k in report.kept}


def test_conv1d_with_activation_layer_becomes_one_fused_conv1d():
    inp = keras.Input((24, 3))
    x = L.Conv1D(8, 3, padding="causal", name="c1")(inp)
    x = L.Activation("relu", name="a1")(x)
    out = L.Conv1D(4, 5, strides=2, activation="elu", name="c2")(x)
    stock = keras.Model(inp, out)
    _randomize(stock)
    new = tfmetal_ext.convert(stock)
    report = new.conversion_report
    rw = _rewrites(report)
    assert rw["c1"].new_class == "FusedConv1D" and rw["c1"].source == ("c1", "a1")
    assert rw["c2"].new_class == "FusedConv1D"
    assert type(new.get_layer("c1")) is fl.FusedConv1D and new.get_layer("c1").padding == "causal"
    _same_outputs(stock, new, _x((24, 3)))
    for a, b in zip(stock.get_layer("c2").weights, new.get_layer("c2").weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fused = inspect.fusion_report(new, mode="train")
    inspect.assert_fused(fused, layer="c1", op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd", "Relu"])
    inspect.assert_fused(fused, layer="c2", op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd", "Elu"])


def test_conv1d_stock_forms_are_kept_with_the_layers_own_reason():
    inp = keras.Input((24, 6))
    a = L.Conv1D(6, 3, dilation_rate=2, padding="same", name="dilated")(inp)
    b = L.Conv1D(6, 3, groups=3, padding="same", name="grouped")(inp)
    stock = keras.Model(inp, L.Add()([a, b]))
    report = tfmetal_ext.convert(stock).conversion_report
    kept = _kept(report)
    assert "dilation_rate > 1" in kept["dilated"].reason
    assert "groups=3" in kept["grouped"].reason


@pytest.mark.parametrize("inference", [False, True])
def test_conv1d_batch_norm_relu_becomes_one_block(inference):
    inp = keras.Input((20, 3))
    x = L.Conv1D(8, 3, padding="same", name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    out = L.GlobalAveragePooling1D(name="pool")(L.ReLU(name="relu")(x))
    stock = keras.Model(inp, out)
    _randomize(stock)
    new = tfmetal_ext.convert(stock, inference=inference)  # verifies outputs (and gradients in training form)
    rw = _rewrites(new.conversion_report)["conv"]
    assert rw.source == ("conv", "bn", "relu")
    assert rw.new_class == ("FusedConv1D" if inference else "ConvBNAct1D")
    _same_outputs(stock, new, _x((20, 3)))
    report = inspect.fusion_report(new, mode="predict")
    if inference:
        inspect.assert_fused(report, layer="conv", op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd", "Relu"])
    else:
        inspect.assert_fused(report, layer="conv", op=fusion.FUSED_CONV2D, fused_ops=["FusedBatchNorm", "Relu"])
        assert new.get_layer("conv").fold().__class__ is fl.FusedConv1D
        # Converting the converted model again for inference folds its ConvBNAct1D by fold().
        deploy = tfmetal_ext.convert(new, inference=True, count_ops=False)
        assert type(deploy.get_layer("conv")) is fl.FusedConv1D
        _same_outputs(stock, deploy, _x((20, 3)))


def test_separable_conv2d_with_activation_becomes_fused_separable():
    inp = keras.Input((10, 10, 3))
    x = L.SeparableConv2D(8, 3, padding="same", depth_multiplier=2, name="sep")(inp)
    out = L.GlobalAveragePooling2D(name="pool")(L.ReLU(name="relu")(x))
    stock = keras.Model(inp, out)
    _randomize(stock)
    new = tfmetal_ext.convert(stock)
    rw = _rewrites(new.conversion_report)["sep"]
    assert rw.new_class == "FusedSeparableConv2D" and rw.source == ("sep", "relu")
    _same_outputs(stock, new, _x((10, 10, 3)))
    assert [w.name for w in new.get_layer("sep").weights] == ["depthwise_kernel", "pointwise_kernel", "bias"]
    fused = inspect.fusion_report(new)
    inspect.assert_fused(fused, layer="sep", op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd", "Relu"])


@pytest.mark.parametrize("multiplier", [1, 2])
def test_grouped_conv_with_one_channel_per_group_is_a_depthwise_conv(multiplier):
    channels = 6
    inp = keras.Input((9, 9, channels))
    out = L.Conv2D(channels * multiplier, 3, groups=channels, padding="same", activation="relu", name="g")(inp)
    stock = keras.Model(inp, out)
    _randomize(stock)
    new = tfmetal_ext.convert(stock)  # verifies outputs and the bias gradient
    rw = _rewrites(new.conversion_report)["g"]
    assert rw.new_class == "FusedDepthwiseConv2D" and "kernel reshaped" in rw.note
    layer = new.get_layer("g")
    assert type(layer) is fl.FusedDepthwiseConv2D and layer.depth_multiplier == multiplier
    x = _x((9, 9, channels))
    _same_outputs(stock, new, x)
    # An independent reference: numpy, each output channel c*m+j reads input channel c only.
    kernel = np.asarray(stock.get_layer("g").kernel)  # (3, 3, 1, C*m)
    bias = np.asarray(stock.get_layer("g").bias)
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = np.zeros((2, 9, 9, channels * multiplier), "float64")
    for o in range(channels * multiplier):
        c = o // multiplier
        for i in range(3):
            for j in range(3):
                want[..., o] += padded[:, i:i + 9, j:j + 9, c] * kernel[i, j, 0, o]
    want = np.maximum(want + bias, 0)
    np.testing.assert_allclose(np.asarray(new(x)), want, rtol=1e-5, atol=1e-5)
    # The stock grouped conv runs through XLA (nothing for grappler); the depthwise conv is a
    # DepthwiseConv2dNative that fuses where the backend table says so.
    report = inspect.fusion_report(new)
    assert report.ops_by_type.get("DepthwiseConv2dNative", 0) + report.ops_by_type.get(fusion.FUSED_DEPTHWISE, 0) == 1


def test_other_groupings_are_kept_with_the_reason():
    inp = keras.Input((9, 9, 6))
    stock = keras.Model(inp, L.Conv2D(6, 3, groups=3, name="g3")(inp))
    kept = _kept(tfmetal_ext.convert(stock).conversion_report)
    assert "groups=3 with 6 input channels" in kept["g3"].reason


def test_embedding_becomes_fused_embedding_with_the_same_outputs():
    ids = keras.Input((7,), dtype="int32")
    x = L.Embedding(20, 8, name="emb")(ids)
    stock = keras.Model(ids, L.Dense(4, name="head")(x))
    new = tfmetal_ext.convert(stock)  # verify=True: outputs and gradients checked
    assert type(new.get_layer("emb")) is fl.FusedEmbedding
    assert fusion.STOCK_TO_FUSED["Embedding"].fused == "FusedEmbedding"
    x = np.array([[0, 1, 19, -1, -20, 5, 5]] * 3, "int32")  # negative indices wrap, as stock
    np.testing.assert_array_equal(np.asarray(new(x)), np.asarray(stock(x)))


def test_stock_to_fused_rows_name_the_new_classes():
    assert fusion.STOCK_TO_FUSED["Conv1D"].fused == "FusedConv1D"
    assert fusion.STOCK_TO_FUSED["SeparableConv2D"].fused == "FusedSeparableConv2D"
    for row in ("Conv1D", "SeparableConv2D"):
        assert issubclass(getattr(fl, fusion.STOCK_TO_FUSED[row].fused), getattr(L, row))
