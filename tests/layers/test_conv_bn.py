"""ConvBNAct: equivalence with stock Conv2D + BatchNormalization + Activation, fusion, folding."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import ConvBNAct
from tfmetal_ext.testing import assert_close_scaled as assert_close
from tfmetal_ext.testing import randomize_batch_norm, run_layer_test

# ----------------------------------------------------------------------------
# References: the same computation from stock Keras layers, and numpy folding.

TOL = {"float32": 1e-5, "mixed_bfloat16": 1e-2, "mixed_float16": 1e-2}


def stock_conv_bn_act(layer):
    """Conv2D(use_bias=False) + BatchNormalization + Activation with `layer`'s weights."""
    conv = keras.layers.Conv2D(
        layer.filters, layer.kernel_size, strides=layer.strides, padding=layer.padding, use_bias=False
    )
    bn = keras.layers.BatchNormalization(momentum=layer.momentum, epsilon=layer.epsilon)
    stack = [conv, bn] + ([] if layer.activation == "linear" else [keras.layers.Activation(layer.activation)])
    channels = layer.kernel.shape[2]
    model = keras.Sequential([keras.Input((None, None, channels))] + stack)
    conv.kernel.assign(layer.kernel)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        getattr(bn, name).assign(getattr(layer, name))
    return model, bn


def _input_and_weight_grads(fn, x, upstream, weights, training):
    """d(sum(fn(x) * upstream)) / d[x, *weights]."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(fn(x, training=training) * upstream)
    return tape.gradient(loss, [x] + weights)


def _pair(kw, policy="float32", channels=3, seed=0):
    keras.mixed_precision.set_global_policy(policy)
    layer = ConvBNAct(**kw)
    layer.build((None, None, None, channels))
    randomize_batch_norm(layer, np.random.default_rng(seed))
    stock, bn = stock_conv_bn_act(layer)
    return layer, stock, bn


CONFIGS = [
    dict(filters=4, kernel_size=3),
    dict(filters=5, kernel_size=3, strides=2, padding="valid", activation="relu6"),
    dict(filters=4, kernel_size=(1, 3), activation="elu"),
    dict(filters=4, kernel_size=1, strides=2, activation="leaky_relu"),
    dict(filters=3, kernel_size=3, activation=None),
    dict(filters=6, kernel_size=1),  # pointwise: a MatMul in CPU training steps
]


# ----------------------------------------------------------------------------
# Equivalence.


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("training", [False, True])
def test_outputs_and_gradients_match_stock(kw, training):
    layer, stock, _ = _pair(kw)
    x = tf.constant(np.random.default_rng(1).normal(size=(2, 7, 7, 3)).astype("float32"))
    upstream = tf.constant(np.random.default_rng(2).normal(size=layer.compute_output_shape(x.shape)), tf.float32)

    def grads(fn, weights):
        return _input_and_weight_grads(fn, x, upstream, weights, training)

    assert_close(layer(x, training=training), stock(x, training=training), 1e-5)
    ours = grads(layer, [layer.kernel, layer.gamma, layer.beta])
    ref = grads(stock, stock.trainable_weights)  # kernel, gamma, beta
    for a, b in zip(ours, ref):
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_moving_statistics_match_stock(policy):
    layer, stock, bn = _pair(dict(filters=4, kernel_size=3, momentum=0.8), policy)
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = rng.normal(1.0, 2.0, size=(4, 6, 6, 3)).astype("float32")
        assert_close(layer(x, training=True), stock(x, training=True), TOL[policy])
    assert_close(layer.moving_mean, bn.moving_mean, TOL[policy])
    assert_close(layer.moving_variance, bn.moving_variance, TOL[policy])
    # The statistics moved: an untouched copy would equal the initial values.
    assert not np.allclose(layer.moving_mean.numpy(), 0.0)
    x = rng.normal(size=(2, 6, 6, 3)).astype("float32")
    assert_close(layer(x, training=False), stock(x, training=False), TOL[policy])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_dtypes_and_gradients(policy):
    layer, stock, _ = _pair(dict(filters=4, kernel_size=3), policy)
    x = tf.constant(np.random.default_rng(4).normal(size=(2, 5, 5, 3)).astype("float32"))
    y = layer(x, training=True)
    assert y.dtype == layer.compute_dtype != "float32"
    assert all(w.dtype == "float32" for w in layer.weights)

    def grads(fn, weights):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(fn(x, training=True), tf.float32) ** 2)
        return tape.gradient(loss, weights)

    for a, b in zip(grads(layer, [layer.kernel, layer.gamma, layer.beta]), grads(stock, stock.trainable_weights)):
        assert_close(a, b, 5e-2)


def test_non_trainable_layer_uses_moving_statistics():
    layer, stock, bn = _pair(dict(filters=4, kernel_size=3))
    layer.trainable = False
    bn.trainable = False  # stock BN then runs in inference mode too
    x = np.random.default_rng(5).normal(size=(2, 5, 5, 3)).astype("float32")
    before = layer.moving_mean.numpy().copy()
    assert_close(layer(x, training=True), stock(x, training=True), 1e-5)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), before)


# ----------------------------------------------------------------------------
# Keras-style layer checks and arguments.


@pytest.mark.parametrize(
    "kw, in_shape, out_shape",
    [
        (dict(filters=4, kernel_size=3), (2, 6, 6, 3), (2, 6, 6, 4)),
        (dict(filters=2, kernel_size=3, strides=2, padding="valid", activation="elu"), (2, 7, 7, 3), (2, 3, 3, 2)),
        (dict(filters=3, kernel_size=(1, 3), strides=(2, 1), activation=None), (2, 5, 5, 2), (2, 3, 5, 3)),
    ],
)
def test_run_layer_test(kw, in_shape, out_shape):
    run_layer_test(
        ConvBNAct, kw, in_shape, expected_output_shape=out_shape,
        expected_num_trainable_weights=3, expected_num_non_trainable_weights=2,
    )


def test_config_is_complete():
    layer = ConvBNAct(
        6, (3, 1), strides=2, padding="valid", activation="relu6", momentum=0.9, epsilon=1e-4,
        kernel_initializer="glorot_uniform", kernel_regularizer="l2", name="cba",
    )
    config = layer.get_config()
    clone = ConvBNAct.from_config(config)
    for attr in ("filters", "kernel_size", "strides", "padding", "activation", "momentum", "epsilon", "name"):
        assert getattr(clone, attr) == getattr(layer, attr), attr
    assert isinstance(clone.kernel_regularizer, keras.regularizers.L2)
    assert isinstance(clone.kernel_initializer, keras.initializers.GlorotUniform)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(filters=0, kernel_size=3), "filters"),
        (dict(filters=2.5, kernel_size=3), "filters"),
        (dict(filters=4, kernel_size=0), "kernel_size"),
        (dict(filters=4, kernel_size=(3, 3, 3)), "kernel_size"),
        (dict(filters=4, kernel_size=3, strides=0), "strides"),
        (dict(filters=4, kernel_size=3, padding="causal"), "padding"),
        (dict(filters=4, kernel_size=3, activation="tanh"), "activation"),
        (dict(filters=4, kernel_size=3, momentum=1.5), "momentum"),
        (dict(filters=4, kernel_size=3, epsilon=0.0), "epsilon"),
    ],
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f"Received: {name}="):
        ConvBNAct(**kw)


# ----------------------------------------------------------------------------
# Fusion in the graph that runs (CPU).


def _model(policy, **kw):
    keras.mixed_precision.set_global_policy(policy)
    inp = keras.Input((8, 8, 4))
    out = ConvBNAct(8, 3, name="cba", **kw)(inp)
    return keras.Model(inp, out)


def test_float32_predict_fuses_conv_batchnorm_relu():
    # TF's own remapper fuses Conv2D + FusedBatchNorm at inference, with oneDNN or without.
    report = inspect.fusion_report(_model("float32"), mode="predict")
    inspect.assert_fused(report, layer="cba", op="_FusedConv2D", fused_ops=["FusedBatchNorm", "Relu"])
    row = report.row("cba")
    assert (row.pattern, row.status, row.reason) == ("conv2d_batchnorm_act", "fused", None)


@pytest.mark.parametrize("activation, act_op", [("relu6", "Relu6"), ("elu", "Elu"), (None, None)])
def test_float32_predict_fuses_other_activations(activation, act_op):
    report = inspect.fusion_report(_model("float32", activation=activation), mode="predict")
    expected = ["FusedBatchNorm"] + ([act_op] if act_op else [])
    inspect.assert_fused(report, layer="cba", op="_FusedConv2D", fused_ops=expected)
    assert report.row("cba").status == "fused"


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
@pytest.mark.parametrize("policy, dtype", [("float32", "float32"), ("mixed_bfloat16", "bfloat16")])
def test_train_step_fuses_batchnorm_relu(onednn, policy, dtype):
    report = inspect.fusion_report(_model(policy), mode="train")
    node = inspect.assert_fused(report, layer="cba", op="_FusedBatchNormEx", fused_ops=[])
    assert node.dtype == dtype
    assert report.row("cba").status == "fused"


def _pointwise_model():
    inp = keras.Input((8, 8, 4))
    return keras.Model(inp, ConvBNAct(8, 1, name="cba")(inp))


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
def test_pointwise_train_step_is_a_matmul_on_cpu():
    # Training: the 1x1 product (forward and both backward products) as MatMul, with oneDNN or
    # without; BN + Relu fuse into _FusedBatchNormEx only with oneDNN (TF's own CPU kernels have none).
    report = inspect.fusion_report(_pointwise_model(), mode="train")
    ops = report.ops_by_type
    assert "Conv2D" not in ops and "Conv2DBackpropFilter" not in ops and "Conv2DBackpropInput" not in ops
    assert ops.get("MatMul", 0) + ops.get("_MklMatMul", 0) >= 2
    if devices.capabilities().onednn:
        inspect.assert_fused(report, layer="cba", op="_FusedBatchNormEx")
    else:
        assert ops.get("FusedBatchNormV3") == 1 and ops.get("FusedBatchNormGradV3") == 1, ops
        assert report.row("cba").status == "not fused", str(report)
    # Inference keeps Conv2D, which fuses with the batch norm.
    predict = inspect.fusion_report(_pointwise_model(), mode="predict")
    inspect.assert_fused(predict, layer="cba", op="_FusedConv2D", fused_ops=["FusedBatchNorm", "Relu"])


def test_pointwise_matmul_with_unknown_spatial_size_matches_stock():
    layer, stock, _ = _pair(dict(filters=5, kernel_size=1, activation="relu6"))
    x = tf.constant(np.random.default_rng(3).normal(size=(2, 5, 6, 3)).astype("float32"))
    spec = tf.TensorSpec((None, None, None, 3), tf.float32)
    ours = tf.function(lambda t: layer(t, training=True), input_signature=[spec])
    ref = tf.function(lambda t: stock(t, training=True), input_signature=[spec])
    assert ours(x).shape == (2, 5, 6, 5)
    assert_close(ours(x), ref(x), 1e-5)


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
def test_train_step_other_activation_not_fused(onednn):
    report = inspect.fusion_report(_model("float32", activation="relu6"), mode="train")
    inspect.assert_not_fused(report, "cba")
    row = report.row("cba")
    assert row.status == "not fused" and "fuses only with Relu" in row.reason


def test_bfloat16_predict_fuses_batchnorm_relu_only(onednn_bf16):
    report = inspect.fusion_report(_model("mixed_bfloat16"), mode="predict")
    inspect.assert_fused(report, layer="cba", op="_FusedBatchNormEx", fused_ops=[])
    row = report.row("cba")
    assert row.status == "partial" and "Conv2D + FusedBatchNorm fuses only in float32" in row.reason


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_float16_on_cpu_not_fused(mode):
    if inspect.devices.capabilities().cpu_fp16:
        pytest.skip("this CPU computes float16 natively, so the remapper fuses half")
    report = inspect.fusion_report(_model("mixed_float16"), mode=mode)
    assert not report.fused_for("cba")
    row = report.row("cba")
    assert row.status == "not fused" and row.reason == catalog.REASON_HALF_CPU


# ----------------------------------------------------------------------------
# Folding into FusedConv2D (inference).


@pytest.mark.parametrize("kw", CONFIGS)
def test_fold_matches_inference(kw):
    from tfmetal_ext.layers import FusedConv2D

    layer, _, _ = _pair(kw)
    folded = layer.fold()
    assert isinstance(folded, FusedConv2D) and folded.built
    assert (folded.strides, folded.padding, folded.kernel_size) == (layer.strides, layer.padding, layer.kernel_size)
    x = np.random.default_rng(6).normal(size=(2, 7, 7, 3)).astype("float32")
    assert_close(folded(x), layer(x, training=False), 1e-5)
    # numpy reference of the folded bias.
    scale = layer.gamma.numpy() / np.sqrt(layer.moving_variance.numpy() + layer.epsilon)
    assert_close(folded.bias, layer.beta.numpy() - layer.moving_mean.numpy() * scale, 1e-6)


def test_fold_unbuilt_raises():
    with pytest.raises(ValueError, match="Received: layer="):
        ConvBNAct(4, 3).fold()


def test_folded_predict_fuses_bias_relu():
    layer, _, _ = _pair(dict(filters=4, kernel_size=3), channels=4)
    model = keras.Sequential([keras.Input((8, 8, 4)), layer.fold(name="folded")])
    report = inspect.fusion_report(model, mode="predict")
    inspect.assert_fused(report, layer="folded", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])


# ----------------------------------------------------------------------------
# ConvBNAct1D: Conv1D -> BatchNormalization -> act on sequences.

from tfmetal_ext.layers import ConvBNAct1D, FusedConv1D  # noqa: E402

CONFIGS_1D = [
    dict(filters=4, kernel_size=3),
    dict(filters=5, kernel_size=3, padding="causal", activation="relu6"),
    dict(filters=4, kernel_size=4, strides=2, padding="valid", activation="elu"),
    dict(filters=4, kernel_size=1, activation=None),
]


def _pair_1d(kw, channels=3, seed=0):
    layer = ConvBNAct1D(**kw)
    layer.build((None, None, channels))
    randomize_batch_norm(layer, np.random.default_rng(seed))
    conv = keras.layers.Conv1D(layer.filters, layer.kernel_size, strides=layer.strides, padding=layer.padding,
                               use_bias=False)
    bn = keras.layers.BatchNormalization(momentum=layer.momentum, epsilon=layer.epsilon)
    stack = [conv, bn] + ([] if layer.activation == "linear" else [keras.layers.Activation(layer.activation)])
    stock = keras.Sequential([keras.Input((None, channels))] + stack)
    conv.kernel.assign(layer.kernel)  # the same (kernel_size, in, filters) layout
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        getattr(bn, name).assign(getattr(layer, name))
    return layer, stock, bn


@pytest.mark.parametrize("kw", CONFIGS_1D)
@pytest.mark.parametrize("training", [False, True])
def test_1d_outputs_gradients_and_moving_statistics_match_stock(kw, training):
    layer, stock, bn = _pair_1d(kw)
    x = tf.constant(np.random.default_rng(1).normal(1.0, 2.0, size=(3, 11, 3)).astype("float32"))
    upstream = tf.constant(np.random.default_rng(2).normal(size=layer.compute_output_shape(x.shape)), tf.float32)

    def grads(fn, weights):
        return _input_and_weight_grads(fn, x, upstream, weights, training)

    ours = grads(layer, [layer.kernel, layer.gamma, layer.beta])
    ref = grads(stock, stock.trainable_weights)
    for a, b in zip(ours, ref):
        assert_close(a, b, 1e-5)
    assert_close(layer.moving_mean, bn.moving_mean, 1e-5)
    assert_close(layer.moving_variance, bn.moving_variance, 1e-5)
    assert_close(layer(x, training=False), stock(x, training=False), 1e-5)


def test_1d_run_layer_test_and_fold():
    run_layer_test(ConvBNAct1D, dict(filters=4, kernel_size=3, padding="causal"), (2, 9, 3),
                   expected_output_shape=(2, 9, 4), expected_num_trainable_weights=3,
                   expected_num_non_trainable_weights=2)
    layer, stock, _ = _pair_1d(dict(filters=4, kernel_size=3, strides=2, activation="relu"))
    folded = layer.fold()
    assert type(folded) is FusedConv1D
    x = np.random.default_rng(5).normal(size=(2, 10, 3)).astype("float32")
    assert_close(folded(x), stock(x, training=False), 1e-5)
    with pytest.raises(ValueError, match="Received: padding="):
        ConvBNAct1D(4, 3, padding="full")
    with pytest.raises(ValueError, match="Received: kernel_size="):
        ConvBNAct1D(4, (3, 3))


def _model_1d(**kw):
    inp = keras.Input((16, 4))
    return keras.Model(inp, ConvBNAct1D(8, 3, name="cba", **kw)(inp))


@pytest.mark.parametrize("padding", ["same", "causal"])
def test_1d_predict_fuses_conv_batchnorm_relu(padding):
    report = inspect.fusion_report(_model_1d(padding=padding), mode="predict")
    inspect.assert_fused(report, layer="cba", op="_FusedConv2D", fused_ops=["FusedBatchNorm", "Relu"])
    assert report.row("cba").status == "fused"


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
def test_1d_train_step_uses_fused_batch_norm():
    report = inspect.fusion_report(_model_1d(), mode="train")
    row = report.row("cba")
    assert report.ops_by_type.get("FusedBatchNormGradV3") == 1
    if catalog.fusion_for(catalog.FusionContext(onednn=devices.capabilities().onednn, mode="train"),
                          "batchnorm_act").fuses:
        inspect.assert_fused(report, layer="cba", op="_FusedBatchNormEx", fused_ops=[])
        assert row.status == "fused"
    else:
        assert row.status == "not fused" and row.reason
