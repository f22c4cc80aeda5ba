"""ConvBNAct / ConvBNAct1D / ResidualBlock training with ``TfmetalExt>BatchNormAct`` (issue 33).

Where the backend table's ``custom_batch_norm_act`` row fuses (both Metal tables; a CPU table
where it measured faster), a training step runs conv -> one BatchNormAct (batch norm [+ the
residual add] + activation) forward and one BatchNormActGrad backward. The tests set the row
each way (the CPU rows are measurements of one machine, so every expectation here comes from
the table the test installs, never from this machine's) and compare with stock Keras layers
holding the same weights: outputs, gradients, moving statistics. The reference is Keras' own
Conv2D + BatchNormalization + Activation (+ Add), an independent implementation.
"""

import keras

import tfmetal_ext
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import _env
from tfmetal_ext.backends import fusion, registry
from tfmetal_ext.backends._table import Fusion, never
from tfmetal_ext.inspect import fusion_report
from tfmetal_ext.layers import ConvBNAct, ConvBNAct1D, ResidualBlock
from tfmetal_ext.ops.batch_norm_act import uses_kernel

ROW = "custom_batch_norm_act"
NEEDS_KERNEL = pytest.mark.skipif(
    not uses_kernel(), reason="the op library is not loaded here (no C++ compiler): the layers keep FusedBatchNormV3"
)


@pytest.fixture
def fused_row(table_row):
    table_row(ROW, Fusion("test: used", dtypes=("float32", "float16", "bfloat16")))


@pytest.fixture
def unfused_row(table_row):
    table_row(ROW, never("test: not used", why_not="measured slower in this test's table"))


def _ops_of(fn, *args):
    graph = fn.get_concrete_function(*args).graph.as_graph_def()
    names = [n.op for n in graph.node]
    for f in graph.library.function:
        names += [n.op for n in f.node_def]
    return names


def _stock_bn(layer, shape):
    """Keras BatchNormalization built for `shape` with `layer`'s momentum, epsilon and batch-norm weights."""
    bn = keras.layers.BatchNormalization(momentum=layer.momentum, epsilon=layer.epsilon)
    bn.build(shape)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        getattr(bn, name).assign(getattr(layer, name))
    return bn


def _stock_conv_bn(layer, activation):
    """Keras Conv2D(use_bias=False) + BatchNormalization (+ Activation) with `layer`'s weights."""
    conv = keras.layers.Conv2D(layer.filters, layer.kernel_size, strides=layer.strides, padding=layer.padding,
                               use_bias=False)
    conv.build((None, None, None, layer.kernel.shape[2]))
    conv.kernel.assign(layer.kernel)
    bn = _stock_bn(layer, (None, None, None, layer.filters))
    act = keras.layers.Activation(activation) if activation not in ("linear", None) else None
    return conv, bn, act


@NEEDS_KERNEL
@pytest.mark.parametrize("activation", ["relu", "relu6", "elu", "leaky_relu", "linear"])
def test_conv_bn_act_trains_as_keras_with_one_op_each_way(fused_row, activation):
    layer = ConvBNAct(6, 3, activation=activation, momentum=0.9)
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 7, 7, 3)), tf.float32)
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, 6))
    layer.beta.assign(np.linspace(-0.3, 0.3, 6))
    conv, bn, act = _stock_conv_bn(layer, activation)
    assert layer.batch_norm_act_reason() is None

    @tf.function
    def ours(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y))
        return y, tape.gradient(loss, [x, layer.kernel, layer.gamma, layer.beta])

    def stock(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = bn(conv(x), training=True)
            y = act(y) if act else y
            loss = tf.reduce_sum(y * tf.sin(y))
        return y, tape.gradient(loss, [x, conv.kernel, bn.gamma, bn.beta])

    names = _ops_of(ours, x)
    assert names.count(fusion.BATCH_NORM_ACT_OP) == 1 and names.count(fusion.BATCH_NORM_ACT_GRAD_OP) == 1
    assert "FusedBatchNormV3" not in names and "FusedBatchNormGradV3" not in names
    # The moving statistics' blend and its finiteness guard are inside the op: the step holds
    # no Mul / Sum / Equal / SelectV2 of its own around it (the loss's Mul and Sum aside).
    assert "Equal" not in names and "SelectV2" not in names, names
    y, grads = ours(x)
    y_ref, grads_ref = stock(x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    # Moving statistics: Keras' formula with the biased batch variance.
    np.testing.assert_allclose(layer.moving_mean, bn.moving_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance, bn.moving_variance, rtol=1e-5, atol=1e-6)


@NEEDS_KERNEL
def test_conv_bn_act_1d_uses_the_op_on_its_4d_tensor(fused_row):
    layer = ConvBNAct1D(5, 3, padding="causal", activation="relu")
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 9, 4)), tf.float32)
    y_fused = layer(x, training=True)
    moving = layer.moving_mean.numpy()
    names = _ops_of(tf.function(lambda t: layer(t, training=True)), x)
    assert fusion.BATCH_NORM_ACT_OP in names and "FusedBatchNormV3" not in names
    # The same layer in its FusedBatchNormV3 form (the op avoided) gives the same output.
    layer.moving_mean.assign(np.zeros(5))
    with _avoid("batch_norm_act"):
        y_stock = layer(x, training=True)
    np.testing.assert_allclose(y_fused, y_stock, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(moving, layer.moving_mean, rtol=1e-5, atol=1e-7)


def _avoid(*names):
    return _env.scope(avoided=frozenset(_env.current().avoided) | frozenset(names))


def _stock_block(block, x):
    """The block as Keras layers with its weights: conv-BN-act, conv-BN, Add(shortcut), act."""
    y = x
    stock = []
    for conv in block.convs:
        stock.append(_stock_conv_bn(conv, conv.activation))
    shortcut_layers = None
    if block.projection is not None:
        shortcut_layers = _stock_conv_bn(block.projection, block.projection.activation)
    act = keras.layers.Activation(block.activation)

    def run(x, training):
        y = x
        for conv, bn, a in stock:
            y = bn(conv(y), training=training)
            y = a(y) if a else y
        s = x
        if shortcut_layers is not None:
            conv, bn, a = shortcut_layers
            s = bn(conv(x), training=training)
            s = a(s) if a else s
        return act(y + s)

    variables = [v for conv, bn, _ in stock for v in (conv.kernel, bn.gamma, bn.beta)]
    moving = [v for _, bn, _ in stock for v in (bn.moving_mean, bn.moving_variance)]
    return run, variables, moving


@NEEDS_KERNEL
@pytest.mark.parametrize("strides", [1, 2])
def test_residual_block_adds_and_activates_inside_the_last_batch_norm(fused_row, strides):
    block = ResidualBlock(8, strides=strides)
    x = tf.constant(np.random.default_rng(2).standard_normal((2, 8, 8, 8 if strides == 1 else 4)), tf.float32)
    block.build(x.shape)
    for conv in block.convs:
        conv.gamma.assign(np.linspace(0.6, 1.4, 8))
        conv.beta.assign(np.linspace(-0.2, 0.2, 8))
    run, stock_vars, stock_moving = _stock_block(block, x)
    ours_vars = [v for conv in block.convs for v in (conv.kernel, conv.gamma, conv.beta)]
    assert block.batch_norm_act_reason() is None

    @tf.function
    def ours(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=True)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x] + ours_vars)

    def stock(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = run(x, True)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x] + stock_vars)

    graph = ours.get_concrete_function(x).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    bna = [n for n in nodes if n.op == fusion.BATCH_NORM_ACT_OP]
    # conv1: batch norm + ReLU; the projection (strides 2): batch norm alone; conv2: batch norm + the
    # shortcut + ReLU.
    want = [["relu"], ["relu", "side"]] + ([["linear"]] if strides == 2 else [])
    assert sorted(fusion.node_fused_ops(n) for n in bna) == sorted(want)
    assert not any(n.op == "Relu" for n in nodes)  # every activation is inside an op
    y, grads = ours(x)
    y_ref, grads_ref = stock(x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    ours_moving = [v for conv in block.convs for v in (conv.moving_mean, conv.moving_variance)]
    for a, b in zip(ours_moving, stock_moving):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@NEEDS_KERNEL
def test_fusion_report_credits_the_op(fused_row):
    inp = keras.Input((8, 8, 8))
    out = ResidualBlock(8, name="block")(inp)
    model = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(out))
    model.compile(optimizer="sgd", loss="mse")
    report = fusion_report(model, mode="train", inputs=np.zeros((2, 8, 8, 8), "float32"), targets=np.zeros((2, 8)))
    text = str(report)
    assert f"{fusion.BATCH_NORM_ACT_OP}[relu, side]" in text
    assert f"{fusion.BATCH_NORM_ACT_OP}[relu]" in text


def test_the_table_decides_and_says_why(unfused_row):
    layer = ConvBNAct(4, 3)
    layer.build((1, 5, 5, 2))
    assert "measured slower in this test's table" in layer.batch_norm_act_reason()
    names = _ops_of(tf.function(lambda t: layer(t, training=True)), tf.zeros((1, 5, 5, 2)))
    assert fusion.BATCH_NORM_ACT_OP not in names and "FusedBatchNormV3" in names
    assert "inference" in layer.batch_norm_act_reason(training=False)


@NEEDS_KERNEL
def test_avoid_fusions_turns_it_off(fused_row):
    layer = ConvBNAct(4, 3)
    layer.build((1, 5, 5, 2))
    with _avoid("batch_norm_act"):
        assert "avoid_fusions=['batch_norm_act']" in layer.batch_norm_act_reason()
        names = _ops_of(tf.function(lambda t: layer(t, training=True)), tf.zeros((1, 5, 5, 2)))
    assert fusion.BATCH_NORM_ACT_OP not in names and "FusedBatchNormV3" in names


@NEEDS_KERNEL
def test_a_non_finite_batch_keeps_the_moving_statistics(fused_row):
    layer = ConvBNAct(3, 1, momentum=0.5)
    x = np.ones((2, 4, 4, 2), "float32")
    x[0, 0, 0, 0] = np.nan
    layer.build(x.shape)
    layer.moving_mean.assign([0.25, 0.5, 0.75])
    layer(x, training=True)
    np.testing.assert_array_equal(layer.moving_mean, [0.25, 0.5, 0.75])
    np.testing.assert_array_equal(layer.moving_variance, [1.0, 1.0, 1.0])


def test_every_table_has_a_row_with_a_reason():
    from tfmetal_ext.layers import _ops

    for key, table in registry.TABLES.items():
        assert ROW in table.fusions, key
        reason = _ops.batch_norm_act_reason("float32", "relu", table=table, avoided=frozenset())
        if not table.fusion(ROW).fuses:
            assert reason.startswith(table.label + ": "), (key, reason)
    assert registry.TABLES["metal"].fusion(ROW).fuses and registry.TABLES["metal_plugin"].fusion(ROW).fuses
    assert not registry.TABLES["cuda"].fusion(ROW).fuses


# ----------------------------------------------------------------------------
# FusedBatchNorm(activation=...): what convert() makes of BatchNormalization -> activation layer.


def _stock_bn_act(layer, activation, shape):
    return _stock_bn(layer, shape), keras.layers.Activation(activation)


@pytest.mark.parametrize("form", ["op", "fused_batch_norm_v3"])
@pytest.mark.parametrize("activation, shape", [("relu", (6, 5, 5, 4)), ("gelu", (6, 7, 4)), ("silu", (9, 4)),
                                               ("leaky_relu", (3, 4, 4, 4))])
def test_fused_batch_norm_with_activation_trains_as_keras(monkeypatch, table_row, form, activation, shape):
    if form == "op":
        if not uses_kernel():
            pytest.skip("the op library is not loaded here (no C++ compiler)")
        table_row(ROW, Fusion("test: used", dtypes=("float32",)))
    else:
        table_row(ROW, never("test: not used", why_not="measured slower in this test's table"))
    from tfmetal_ext.layers import FusedBatchNorm

    layer = FusedBatchNorm(momentum=0.8, activation=activation)
    x = tf.constant(np.random.default_rng(4).standard_normal(shape) * 2 + 0.5, tf.float32)
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, 4))
    layer.beta.assign(np.linspace(-0.4, 0.4, 4))
    bn, act = _stock_bn_act(layer, activation, x.shape)
    assert (layer.batch_norm_act_reason() is None) == (form == "op")

    @tf.function
    def ours(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.cos(y))
        return y, tape.gradient(loss, [x, layer.gamma, layer.beta])

    def stock(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = act(bn(x, training=True))
            loss = tf.reduce_sum(y * tf.cos(y))
        return y, tape.gradient(loss, [x, bn.gamma, bn.beta])

    names = _ops_of(ours, x)
    assert (fusion.BATCH_NORM_ACT_OP in names) == (form == "op")
    assert ("FusedBatchNormV3" in names) == (form != "op")
    y, grads = ours(x)
    y_ref, grads_ref = stock(x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean, bn.moving_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance, bn.moving_variance, rtol=1e-5, atol=1e-6)
    # Inference: the moving statistics, then the activation.
    np.testing.assert_allclose(layer(x, training=False), act(bn(x, training=False)), rtol=1e-5, atol=1e-5)


def test_fused_batch_norm_activation_argument():
    from tfmetal_ext.layers import FusedBatchNorm

    assert "activation" not in FusedBatchNorm().get_config()  # a plain drop-in keeps BatchNormalization's config
    layer = FusedBatchNorm(activation="swish")
    assert layer.activation == "silu"
    assert FusedBatchNorm.from_config(layer.get_config()).activation == "silu"
    for bad in ("tanh", 3, keras.activations.relu):
        with pytest.raises(ValueError, match="Received: activation="):
            FusedBatchNorm(activation=bad)
    assert "no activation" in FusedBatchNorm().batch_norm_act_reason()


def test_convert_folds_the_activation_after_a_batch_norm_and_to_stock_unfolds_it():
    from tfmetal_ext.layers import FusedBatchNorm

    inp = keras.Input((6, 5))
    x = keras.layers.BatchNormalization(name="bn1")(inp)
    x = keras.layers.Activation("gelu", name="gelu")(x)
    x = keras.layers.BatchNormalization(name="bn2")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.BatchNormalization(name="bn3")(x)
    x = keras.layers.Activation("tanh", name="tanh")(x)  # no such activation in the op: kept apart
    model = keras.Model(inp, x)
    converted = tfmetal_ext.convert(model)  # verifies outputs and gradients against the stock model
    kinds = {layer.name: (type(layer).__name__, getattr(layer, "activation", None)) for layer in converted.layers}
    assert kinds["bn1"] == ("FusedBatchNorm", "gelu") and kinds["bn2"] == ("FusedBatchNorm", "relu")
    assert kinds["bn3"] == ("FusedBatchNorm", "linear") and "tanh" in kinds
    assert "gelu" not in kinds and "relu" not in kinds
    # inference=True keeps the activation layers (the batch norm folds into a conv there, if any).
    inference = tfmetal_ext.convert(model, inference=True)
    assert {"gelu", "relu"} <= {layer.name for layer in inference.layers}
    # A hand-built FusedBatchNorm(activation=...) goes back to BatchNormalization + Activation.
    inp = keras.Input((4, 3))
    hand = keras.Model(inp, FusedBatchNorm(activation="relu6", name="bn")(inp))
    back = tfmetal_ext.to_stock(hand)  # verified against `hand`
    assert [type(layer).__name__ for layer in back.layers[1:]] == ["BatchNormalization", "Activation"]
    assert isinstance(hand.get_layer("bn"), FusedBatchNorm)


@NEEDS_KERNEL
def test_fusion_report_credits_batch_norm_with_activation(fused_row):
    from tfmetal_ext.layers import FusedBatchNorm

    inp = keras.Input((5, 4))
    model = keras.Model(inp, keras.layers.Dense(1)(FusedBatchNorm(activation="gelu", name="bn")(inp)))
    model.compile(optimizer="sgd", loss="mse")
    report = fusion_report(model, mode="train", inputs=np.zeros((2, 5, 4), "float32"), targets=np.zeros((2, 5, 1)))
    row = report.row("bn")
    assert row.status == "fused" and f"{fusion.BATCH_NORM_ACT_OP}[gelu]" in str(report), str(report)
