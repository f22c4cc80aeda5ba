"""ResidualBlock / FoldedResidualBlock: equivalence with a stock Keras block, fusion, folding."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import FoldedResidualBlock, ResidualBlock
from tfmetal_ext.testing import assert_close_scaled as assert_close
from tfmetal_ext.testing import randomize_batch_norm, run_layer_test

# ----------------------------------------------------------------------------
# Reference: the same block from stock Keras layers (ResNet v1, stride on the 3x3).


_TWINS = {}


def _stock_conv_bn(x, layer, act):
    conv = keras.layers.Conv2D(
        layer.filters, layer.kernel_size, strides=layer.strides, padding="same", use_bias=False
    )
    bn = keras.layers.BatchNormalization(momentum=layer.momentum, epsilon=layer.epsilon)
    y = bn(conv(x))
    conv.kernel.assign(layer.kernel)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        getattr(bn, name).assign(getattr(layer, name))
    _TWINS[id(layer)] = (conv, bn)  # the stock twin of this ConvBNAct
    return keras.layers.Activation(act)(y) if act else y


def _sublayers(block):
    return block.convs + ([block.projection] if block.projection is not None else [])


def ordered_weights(block, names):
    """(ours, stock) weight lists in the same order, e.g. names=("kernel", "gamma", "beta")."""
    ours, ref = [], []
    for layer in _sublayers(block):
        conv, bn = _TWINS[id(layer)]
        for name in names:
            ours.append(getattr(layer, name))
            ref.append(conv.kernel if name == "kernel" else getattr(bn, name))
    return ours, ref


def stock_block(block, channels, bottleneck):
    """A functional model of Conv2D/BatchNormalization/Activation/Add with `block`'s weights."""
    inp = keras.Input((None, None, channels))
    specs = (1, 1, 0) if bottleneck else (1, 0)  # which convs have the activation
    x = inp
    for conv, has_act in zip(block.convs, specs):
        x = _stock_conv_bn(x, conv, block.activation if has_act else None)
    shortcut = inp if block.projection is None else _stock_conv_bn(inp, block.projection, None)
    out = keras.layers.Activation(block.activation)(keras.layers.Add()([x, shortcut]))
    return keras.Model(inp, out)


def randomize(block, rng):
    for conv in _sublayers(block):
        randomize_batch_norm(conv, rng)


# (kwargs, input channels, projection expected)
CASES = [
    (dict(filters=4), 4, False),
    (dict(filters=4, strides=2), 4, True),
    (dict(filters=6), 4, True),
    (dict(filters=2, bottleneck=True), 8, False),
    (dict(filters=2, bottleneck=True, strides=2), 4, True),
    (dict(filters=4, activation="relu6"), 4, False),
]
IDS = ["basic", "basic-stride2", "basic-widen", "bottleneck", "bottleneck-proj", "relu6"]


def _pair(kw, channels, seed=0):
    block = ResidualBlock(**kw)
    block.build((None, None, None, channels))
    randomize(block, np.random.default_rng(seed))
    return block, stock_block(block, channels, kw.get("bottleneck", False))


# ----------------------------------------------------------------------------
# Equivalence.


@pytest.mark.parametrize("kw, channels, projection", CASES, ids=IDS)
@pytest.mark.parametrize("training", [False, True])
def test_matches_stock_block(kw, channels, projection, training):
    block, stock = _pair(kw, channels)
    assert (block.projection is not None) == projection
    assert len(block.weights) == len(stock.weights)
    x = tf.constant(np.random.default_rng(1).normal(size=(2, 6, 6, channels)).astype("float32"))
    assert_close(block(x, training=training), stock(x, training=training), 1e-5)

    def grads(fn, weights):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(fn(x, training=training)))
        return tape.gradient(loss, [x] + weights)

    ours, ref = ordered_weights(block, ("kernel", "gamma", "beta"))
    assert len(ours) == len(block.trainable_weights) == len(stock.trainable_weights)
    for a, b in zip(grads(block, ours), grads(stock, ref)):
        assert_close(a, b, 1e-5)
    # Moving statistics: updated the same way in training, untouched at inference.
    for a, b in zip(*ordered_weights(block, ("moving_mean", "moving_variance"))):
        assert_close(a, b, 1e-5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_matches_stock(policy):
    keras.mixed_precision.set_global_policy(policy)
    block, stock = _pair(dict(filters=4, strides=2), 4)
    x = np.random.default_rng(2).normal(size=(2, 6, 6, 4)).astype("float32")
    for training in (True, False):
        y = block(x, training=training)
        assert y.dtype == block.compute_dtype
        assert_close(y, stock(x, training=training), 1e-2)
    assert all(w.dtype == "float32" for w in block.weights)


@pytest.mark.parametrize("kw, channels, projection", CASES, ids=IDS)
def test_fold_matches_inference(kw, channels, projection):
    block, _ = _pair(kw, channels)
    folded = block.fold(name="folded")
    assert isinstance(folded, FoldedResidualBlock) and folded.built
    assert (folded.projection is not None) == projection
    x = np.random.default_rng(3).normal(size=(2, 6, 6, channels)).astype("float32")
    assert_close(folded(x), block(x, training=False), 1e-5)


def test_fold_bfloat16_matches_inference():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    block, _ = _pair(dict(filters=4), 4)
    x = np.random.default_rng(4).normal(size=(2, 6, 6, 4)).astype("float32")
    assert_close(block.fold()(x), block(x, training=False), 3e-2)


def test_fold_unbuilt_raises():
    with pytest.raises(ValueError, match="Received: layer="):
        ResidualBlock(4).fold()


# ----------------------------------------------------------------------------
# Keras-style layer checks and arguments.


@pytest.mark.parametrize(
    "kw, in_shape, out_shape, trainable, non_trainable",
    [
        (dict(filters=3), (2, 6, 6, 3), (2, 6, 6, 3), 6, 4),
        (dict(filters=4, strides=2), (2, 5, 5, 3), (2, 3, 3, 4), 9, 6),
        (dict(filters=2, bottleneck=True, strides=2), (2, 6, 6, 3), (2, 3, 3, 8), 12, 8),
    ],
)
def test_run_layer_test(kw, in_shape, out_shape, trainable, non_trainable):
    run_layer_test(
        ResidualBlock, kw, in_shape, expected_output_shape=out_shape,
        expected_num_trainable_weights=trainable, expected_num_non_trainable_weights=non_trainable,
    )


def test_run_layer_test_folded():
    run_layer_test(
        FoldedResidualBlock, dict(filters=2, bottleneck=True, strides=2), (2, 6, 6, 3),
        expected_output_shape=(2, 3, 3, 8), expected_num_trainable_weights=8,
    )


def test_config_round_trip():
    block = ResidualBlock(5, strides=2, bottleneck=True, activation="elu", momentum=0.9, epsilon=1e-4, name="b")
    clone = ResidualBlock.from_config(block.get_config())
    for attr in ("filters", "strides", "bottleneck", "activation", "momentum", "epsilon", "name", "out_channels"):
        assert getattr(clone, attr) == getattr(block, attr), attr
    assert clone.out_channels == 20


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(filters=0), "filters"),
        (dict(filters=4, strides=0), "strides"),
        (dict(filters=4, strides=(2, 2)), "strides"),
        (dict(filters=4, bottleneck="yes"), "bottleneck"),
        (dict(filters=4, activation="tanh"), "activation"),
        (dict(filters=4, momentum=-0.1), "momentum"),
        (dict(filters=4, epsilon=1e-9), "epsilon"),
    ],
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f"Received: {name}="):
        ResidualBlock(**kw)


# ----------------------------------------------------------------------------
# Fusion in the graph that runs (CPU).


def _model(policy, folded=False, **kw):
    keras.mixed_precision.set_global_policy(policy)
    inp = keras.Input((8, 8, 4))
    block = ResidualBlock(name="blk", **kw)
    model = keras.Model(inp, block(inp))
    if folded:
        model = keras.Sequential([keras.Input((8, 8, 4)), block.fold(name="blk")])
    return model


def test_float32_predict():
    # Conv2D + FusedBatchNorm fuse at inference with oneDNN or without; the side input fuses on neither.
    report = inspect.fusion_report(_model("float32", strides=2, filters=8), mode="predict")
    inspect.assert_fused(report, layer="blk/conv1", op="_FusedConv2D", fused_ops=["FusedBatchNorm", "Relu"])
    inspect.assert_fused(report, layer="blk/projection", op="_FusedConv2D", fused_ops=["FusedBatchNorm"])
    inspect.assert_fused(report, layer="blk/conv2", op="_FusedConv2D", fused_ops=["FusedBatchNorm"])
    assert report.row("blk/conv1").status == "fused"
    tail = report.row("blk/conv2")
    assert tail.status == "partial" and "no FusedBatchNormV3 + side input kernel" in tail.reason


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_train_step(onednn, policy):
    report = inspect.fusion_report(_model(policy, bottleneck=True, filters=2, strides=2), mode="train")
    for conv in ("blk/conv1", "blk/conv2"):
        inspect.assert_fused(report, layer=conv, op="_FusedBatchNormEx", fused_ops=[])
        assert report.row(conv).status == "fused"
    for conv, why in (("blk/conv3", "side input"), ("blk/projection", "fuses only with Relu")):
        inspect.assert_not_fused(report, conv)
        row = report.row(conv)
        assert row.status == "not fused" and why in row.reason


def test_bfloat16_predict(onednn_bf16):
    report = inspect.fusion_report(_model("mixed_bfloat16", filters=4), mode="predict")
    inspect.assert_fused(report, layer="blk/conv1", op="_FusedBatchNormEx", fused_ops=[])
    assert report.row("blk/conv1").status == "partial"
    assert report.row("blk/conv2").status == "not fused"
    assert not [f for f in report.fused_for("blk") if f.op == "_FusedConv2D"]


@pytest.mark.parametrize("policy, dtype", [("float32", "float32"), ("mixed_bfloat16", "bfloat16")])
@pytest.mark.parametrize("kw", [dict(filters=4), dict(filters=2, bottleneck=True, strides=2)], ids=["basic", "bottleneck"])
def test_folded_predict_fuses_bias_add_relu(onednn, policy, dtype, kw):
    report = inspect.fusion_report(_model(policy, folded=True, **kw), mode="predict")
    last = "blk/conv3" if kw.get("bottleneck") else "blk/conv2"
    node = inspect.assert_fused(report, layer=last, op="_FusedConv2D", fused_ops=["BiasAdd", "Add", "Relu"])
    assert node.dtype == dtype
    inspect.assert_fused(report, layer="blk/conv1", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])
    row = report.row(last)
    assert (row.pattern, row.status) == ("conv2d_bias_add_relu", "fused")
    assert all(r.status == "fused" for r in report.layers)


@pytest.mark.parametrize("folded", [False, True])
def test_float16_on_cpu_not_fused(folded):
    if inspect.devices.capabilities().cpu_fp16:
        pytest.skip("this CPU computes float16 natively, so the remapper fuses half")
    report = inspect.fusion_report(_model("mixed_float16", folded=folded, filters=4), mode="predict")
    assert not report.fused
    for row in report.layers:
        assert row.status == "not fused" and row.reason == catalog.REASON_HALF_CPU, row


@pytest.mark.usefixtures("fused_batch_norm_v3_form")
def test_gpu_expectations_name_batchnorm_ex_with_side_input():
    """On Metal/CUDA the tail BN + Add + Relu should become _FusedBatchNormEx (catalog only: no GPU here)."""
    block = ResidualBlock(4)
    block.build((None, 8, 8, 4))
    tail = block.convs[-1]
    metal = catalog.expectation(tail, catalog.FusionContext(backend="metal", mode="predict"))
    assert (metal.op, metal.pattern, metal.reason) == ("_FusedBatchNormEx", "batchnorm_act", None)
    cuda_train = catalog.expectation(tail, catalog.FusionContext(backend="cuda", mode="train"))
    assert cuda_train.op is None and "float16" in cuda_train.reason
    cpu = catalog.expectation(tail, catalog.FusionContext(backend="cpu", mode="train"))
    assert cpu.op is None and "fold()" in cpu.reason
