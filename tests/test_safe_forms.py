"""configure(avoid_fusions=...): the explicit switch to the safe unfused forms.

Each layer family is checked with the switch on against stock Keras (or numpy) with the
same weights, and its graph before grappler is checked for the safe form.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import doctor, inspect, precision
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import (
    ConvBNAct,
    FusedBatchNorm,
    FusedConv2D,
    FusedDense,
    FusedDepthwiseConv2D,
    FusedLayerNorm,
    ResidualBlock,
    Softshrink,
)
from tfmetal_ext.testing import assert_close_scaled, randomize_batch_norm


@pytest.fixture
def avoid():
    """Sets the avoided fusions (float32 policy) for one test; clears them afterwards."""

    def set_avoided(*names):
        return tfmetal_ext.configure("float32", avoid_fusions=names)

    yield set_avoided
    tfmetal_ext.configure("float32", avoid_fusions=())


def graph_ops(fn, *args):
    """Op types of `fn`'s graph before grappler (what the layers emit)."""
    cap = inspect.capture_function(fn, *args)
    return {n.op for fg in cap.functions for n in fg.pre_graph.node}


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# ----------------------------------------------------------------------------
# configure() / recommend() arguments and state


def test_default_is_empty_and_none_keeps(avoid):
    assert precision.avoided_fusions() == frozenset()
    avoid("matmul_bias_relu", "softshrink")
    cfg = tfmetal_ext.configure("float32")  # avoid_fusions=None keeps the set
    assert cfg.avoided_fusions == ("matmul_bias_relu", "softshrink")
    assert precision.avoided_fusions() == {"matmul_bias_relu", "softshrink"}
    assert tfmetal_ext.configure("float32", avoid_fusions=()).avoided_fusions == ()
    assert precision.avoided_fusions() == frozenset()


def test_reasons_say_what_layers_emit(avoid):
    cfg = avoid("matmul_bias_relu", "fused_batch_norm")
    lines = [r for r in cfg.reasons if r.startswith("avoid_fusions:")]
    assert lines == [
        f"avoid_fusions: fused_batch_norm -> {precision.SAFE_FORMS['fused_batch_norm']}",
        f"avoid_fusions: matmul_bias_relu -> {precision.SAFE_FORMS['matmul_bias_relu']}",
    ]
    assert "AddV2" in lines[1] and "avoided_fusions=" in str(cfg)


def test_safe_forms_names():
    assert set(precision.SAFE_FORMS) == {
        "conv_bias_relu", "matmul_bias_relu", "fused_batch_norm", "softshrink", "layer_norm", "multi_tensor_adam",
        "attention",
        "rms_norm",
        "multi_tensor_lion",
        "multi_tensor_rmsprop",
        "int8_matmul",
        "int8_conv2d",
        "dropout",
        "rope",
        "batch_norm_act",
        "activation_grad",
        "sparse_softmax_cross_entropy",
        "gemv",
    }
    assert set(precision.SAFE_FORMS) <= set(doctor.CHECKS)


@pytest.mark.parametrize("bad", [["nope"], ["matmul_bias_relu", 3], "matmul_bias_relu", 5, {"a": 1}])
def test_bad_avoid_fusions(bad):
    with pytest.raises(ValueError, match=r"Received: avoid_fusions="):
        tfmetal_ext.configure("float32", avoid_fusions=bad)
    assert precision.avoided_fusions() == frozenset()


def test_warns_once_when_the_set_changes(avoid, caplog):
    with caplog.at_level(logging.WARNING, logger="tfmetal_ext"):
        avoid("conv_bias_relu")
        avoid("conv_bias_relu")
    records = [r for r in caplog.records if "avoided fusions" in r.getMessage()]
    assert len(records) == 1 and "conv_bias_relu" in records[0].getMessage()


def test_recommend_changes_nothing(avoid):
    keras.mixed_precision.set_global_policy("float32")
    avoid("softshrink")
    last = precision._last_config
    cfg = precision.recommend("mixed_bfloat16", avoid_fusions=["layer_norm"])
    assert cfg.policy == "mixed_bfloat16" and cfg.avoided_fusions == ("layer_norm",)
    assert precision.recommend().avoided_fusions == ("softshrink",)
    assert keras.mixed_precision.global_policy().name == "float32"
    assert precision.avoided_fusions() == {"softshrink"} and precision._last_config is last
    with pytest.raises(ValueError, match=r"Received: avoid_fusions="):
        precision.recommend(avoid_fusions=["nope"])


def test_self_test_result_sets_its_failed_patterns(avoid):
    result = doctor.SelfTestResult("CPU:0", "cpu", [
        doctor.CheckResult("matmul_bias_relu", "FAIL"),
        doctor.CheckResult("conv_bias_relu", "PASS"),
        doctor.CheckResult("layer_norm", "SKIP"),
        doctor.CheckResult("cpu_fallback", "FAIL"),
    ])
    avoid("softshrink")
    cfg = tfmetal_ext.configure("float32", avoid_fusions=result)
    assert cfg.avoided_fusions == ("matmul_bias_relu",)


# ----------------------------------------------------------------------------
# Layers: same outputs as stock Keras, safe form in the graph


def _outputs_and_grads(layer, x, training):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
            loss = tf.reduce_sum(y * tf.cos(y))
        return y, tape.gradient(loss, [x] + layer.trainable_weights)

    y, grads = step(tf.constant(x))
    return y.numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize(
    "ours,stock,pattern,shape",
    [
        (lambda: FusedDense(6, activation="relu"), lambda: keras.layers.Dense(6, activation="relu"),
         "matmul_bias_relu", (5, 7)),
        (lambda: FusedDense(6, activation="elu"), lambda: keras.layers.Dense(6, activation="elu"),
         "matmul_bias_relu", (2, 3, 7)),
        (lambda: FusedConv2D(4, 3, padding="same", activation="relu"),
         lambda: keras.layers.Conv2D(4, 3, padding="same", activation="relu"), "conv_bias_relu", (2, 6, 6, 3)),
        (lambda: FusedDepthwiseConv2D(3, activation="relu6"),
         lambda: keras.layers.DepthwiseConv2D(3, activation="relu6"), "conv_bias_relu", (2, 6, 6, 3)),
    ],
)
def test_contraction_safe_form_matches_keras(avoid, ours, stock, pattern, shape):
    x = _x(shape)
    ref_layer, layer = stock(), ours()
    ref_layer(x)
    layer.build(shape)
    rng = np.random.default_rng(1)
    ref_layer.set_weights([w + rng.standard_normal(w.shape).astype("float32") * 0.3 for w in ref_layer.get_weights()])
    layer.set_weights(ref_layer.get_weights())
    fused_ops = graph_ops(lambda x: layer(x), tf.constant(x))
    assert "BiasAdd" in fused_ops
    y_fused, g_fused = _outputs_and_grads(layer, x, False)

    avoid(pattern)
    safe_ops = graph_ops(lambda x: layer(x), tf.constant(x))
    assert "BiasAdd" not in safe_ops and "AddV2" in safe_ops
    y, grads = _outputs_and_grads(layer, x, False)
    y_ref, grads_ref = _outputs_and_grads(ref_layer, x, False)
    assert_close_scaled(y, y_ref, 1e-5)
    assert_close_scaled(y, y_fused, 1e-5)
    for g, g_ref, g_fused_ in zip(grads, grads_ref, g_fused):
        assert_close_scaled(g, g_ref, 1e-5)
        assert_close_scaled(g, g_fused_, 1e-5)


def _numpy_batch_norm(x, gamma, beta, mean, var, eps):
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


@pytest.mark.parametrize("shape", [(4, 5, 5, 6), (16, 6)])
def test_batch_norm_safe_form_matches_keras(avoid, shape):
    avoid("fused_batch_norm")
    x = _x(shape) * 2.0 + 0.5
    ours, stock = FusedBatchNorm(momentum=0.9), keras.layers.BatchNormalization(momentum=0.9)
    stock(x)
    ours.build(shape)
    randomize_batch_norm(stock, np.random.default_rng(2))
    ours.set_weights(stock.get_weights())
    ops = graph_ops(lambda x: ours(x, training=True), tf.constant(x))
    assert not {"FusedBatchNormV3", "FusedBatchNormGradV3"} & ops
    ours.set_weights(stock.get_weights())  # the capture ran one training step
    for training in (True, False):
        y, grads = _outputs_and_grads(ours, x, training)
        y_ref, grads_ref = _outputs_and_grads(stock, x, training)
        assert_close_scaled(y, y_ref, 1e-5)
        for g, g_ref in zip(grads, grads_ref):
            assert_close_scaled(g, g_ref, 1e-4)
        for w, w_ref in zip(ours.get_weights(), stock.get_weights()):  # moving statistics, Keras' update
            assert_close_scaled(w, w_ref, 1e-5)
    # Inference against numpy with the updated moving statistics.
    gamma, beta, mean, var = ours.get_weights()
    assert_close_scaled(ours(x, training=False).numpy(), _numpy_batch_norm(x, gamma, beta, mean, var, 1e-3), 1e-5)


def test_conv_bn_act_safe_form_matches_keras(avoid):
    avoid("fused_batch_norm")
    shape = (4, 6, 6, 3)
    x = _x(shape)
    ours = ConvBNAct(5, 3, momentum=0.9)
    stock = keras.Sequential([
        keras.Input(shape[1:]), keras.layers.Conv2D(5, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(momentum=0.9), keras.layers.ReLU(),
    ])
    ours.build(shape)
    randomize_batch_norm(stock.layers[1], np.random.default_rng(3))
    ours.set_weights(stock.get_weights())
    assert "FusedBatchNormV3" not in graph_ops(lambda x: ours(x, training=True), tf.constant(x))
    ours.set_weights(stock.get_weights())
    for training in (True, False):
        y, grads = _outputs_and_grads(ours, x, training)
        y_ref, grads_ref = _outputs_and_grads(stock, x, training)
        assert_close_scaled(y, y_ref, 1e-5)
        for g, g_ref in zip(grads, grads_ref):
            assert_close_scaled(g, g_ref, 1e-4)
        for w, w_ref in zip(ours.get_weights(), stock.get_weights()):
            assert_close_scaled(w, w_ref, 1e-5)


def test_residual_blocks_safe_forms_match_fused(avoid):
    shape = (2, 6, 6, 4)
    x = _x(shape)
    block = ResidualBlock(4)
    block(x)
    for conv in block.convs:
        randomize_batch_norm(conv, np.random.default_rng(4))
    folded = block.fold()
    weights = block.get_weights()
    y_fused, _ = _outputs_and_grads(block, x, True)
    y_folded = folded(x).numpy()
    block.set_weights(weights)

    avoid("fused_batch_norm", "conv_bias_relu")
    assert "FusedBatchNormV3" not in graph_ops(lambda x: block(x, training=True), tf.constant(x))
    block.set_weights(weights)
    folded_ops = graph_ops(lambda x: folded(x), tf.constant(x))
    assert "BiasAdd" not in folded_ops and "AddV2" in folded_ops
    y, _ = _outputs_and_grads(block, x, True)
    assert_close_scaled(y, y_fused, 1e-5)
    assert_close_scaled(folded(x).numpy(), y_folded, 1e-5)
    block.set_weights(weights)  # the training step moved the statistics
    assert_close_scaled(block(x, training=False).numpy(), folded(x).numpy(), 1e-4)


def test_layer_norm_and_softshrink_use_the_reference(avoid):
    x = _x((3, 8))
    ln, stock = FusedLayerNorm(epsilon=1e-3), keras.layers.LayerNormalization(epsilon=1e-3)
    stock(x)
    ln.build(x.shape)
    ln.set_weights([w + 0.5 for w in stock.get_weights()])
    stock.set_weights(ln.get_weights())
    shrink = Softshrink(0.5)
    avoid("layer_norm", "softshrink")
    ops = graph_ops(lambda x: shrink(ln(x)), tf.constant(x))
    assert not {op for op in ops if op.startswith("TfmetalExt>")}
    y, grads = _outputs_and_grads(ln, x, False)
    y_ref, grads_ref = _outputs_and_grads(stock, x, False)
    assert_close_scaled(y, y_ref, 1e-5)
    for g, g_ref in zip(grads, grads_ref):
        assert_close_scaled(g, g_ref, 1e-4)
    s = shrink(tf.constant(x)).numpy()
    np.testing.assert_allclose(s, np.where(x > 0.5, x - 0.5, np.where(x < -0.5, x + 0.5, 0.0)), atol=1e-6)


def test_multi_tensor_adam_falls_back_per_variable(avoid, caplog):
    avoid("multi_tensor_adam")
    shapes = [(3, 4), (5,)]
    variables = [tf.Variable(_x(s, i)) for i, s in enumerate(shapes)]
    grads = [tf.constant(_x(s, 10 + i)) for i, s in enumerate(shapes)]
    ref = keras.optimizers.Adam(0.01)
    ref_vars = [tf.Variable(v.numpy()) for v in variables]
    opt = tfmetal_ext.optimizers.FusedAdam(0.01, multi_tensor=True)
    with caplog.at_level(logging.WARNING, logger="tfmetal_ext"):
        for _ in range(2):
            opt.apply_gradients(zip(grads, variables))
            ref.apply_gradients(zip(grads, ref_vars))
    assert any("uses one op per variable" in r.getMessage() and "avoid_fusions" in r.getMessage()
               for r in caplog.records)
    for v, r in zip(variables, ref_vars):
        assert_close_scaled(v.numpy(), r.numpy(), 1e-5)

    ms = [tf.Variable(tf.zeros(s)) for s in shapes]
    vs = [tf.Variable(tf.zeros(s)) for s in shapes]

    def update(*g):
        tfmetal_ext.ops.multi_tensor_adam(variables, ms, vs, list(g), 0.01, 0.9, 0.999, 1e-7, 0.9, 0.999)

    ops = graph_ops(update, *grads)
    assert "TfmetalExt>MultiTensorAdam" not in ops and "ResourceApplyAdam" in ops


# ----------------------------------------------------------------------------
# Inspection rows


def _row(model, layer, mode="predict"):
    return inspect.fusion_report(model, mode=mode, batch_size=4).row(layer)


def test_report_row_for_avoided_batch_norm(avoid):
    avoid("fused_batch_norm")
    inp = keras.Input((6, 6, 3))
    x = ConvBNAct(4, 3, name="cba")(inp)
    out = keras.layers.ReLU()(FusedBatchNorm(name="bn")(x))
    model = keras.Model(inp, out)
    for mode in ("predict", "train"):
        report = inspect.fusion_report(model, mode=mode, batch_size=4, optimizer="sgd", loss="mse")
        for name in ("cba", "bn"):
            row = report.row(name)
            assert row.status == "not fused", row
            assert row.reason.startswith("avoided by configure(avoid_fusions=['fused_batch_norm'])")


def test_report_row_for_avoided_matmul_on_this_cpu(avoid, onednn):
    avoid("matmul_bias_relu")
    model = keras.Sequential([keras.Input((7,)), FusedDense(5, activation="relu", name="fc")])
    row = _row(model, "fc")
    # oneDNN counts the broadcast AddV2 as a BiasAdd: it still fuses, and the row says why.
    assert row.status == "fused" and row.actual_fused_ops == ["BiasAdd", "Relu"]
    assert "avoided by configure(avoid_fusions=['matmul_bias_relu'])" in row.note


@pytest.mark.parametrize("ctx", [
    catalog.FusionContext(backend="metal", onednn=False),
    catalog.FusionContext(backend="cuda", onednn=False),
    catalog.FusionContext(backend="cpu", onednn=False),
])
def test_expectation_on_other_backends(avoid, ctx):
    dense, conv = FusedDense(5, activation="relu"), FusedConv2D(4, 3, activation="relu")
    dense.build((None, 7))
    conv.build((None, 6, 6, 3))
    before = catalog.expectation(conv, ctx)
    avoid("matmul_bias_relu", "conv_bias_relu")
    for layer, name in ((dense, "matmul_bias_relu"), (conv, "conv_bias_relu")):
        exp = catalog.expectation(layer, ctx)
        assert exp.op is None and exp.reason.startswith(f"avoided by configure(avoid_fusions=[{name!r}])")
    assert catalog.expectation(conv, ctx).ideal_fused_ops == before.ideal_fused_ops
