"""FusedBatchNorm and FusedLayerNorm: equivalence with stock Keras, graphs, Keras-style checks."""

import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext.inspect as ti
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import FusedBatchNorm, FusedLayerNorm
from tfmetal_ext.layers import normalization
from tfmetal_ext.testing import run_layer_test

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "mixed_bfloat16": dict(rtol=1e-2), "mixed_float16": dict(rtol=1e-2)}


def _close(got, want, policy, what):
    got = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(got, "float32")))
    want = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(want, "float32")))
    tol = dict(TOL[policy])
    if policy != "float32":  # relative to the tensor's scale, so values near 0 do not dominate
        tol["atol"] = 1e-2 * float(np.max(np.abs(want)) or 1.0)
    np.testing.assert_allclose(got, want, err_msg=what, **tol)


def _pair(stock_cls, ours_cls, kwargs, shape, policy, seed=0):
    """Builds a stock and a fused layer with the same random weights."""
    rng = np.random.default_rng(seed)
    stock = stock_cls(dtype=policy, **kwargs)
    ours = ours_cls(dtype=policy, **kwargs)
    stock.build(shape)
    ours.build(shape)
    weights = []
    for w in stock.weights:
        value = rng.uniform(0.5, 1.5, w.shape) if "variance" in w.name or "gamma" in w.name else rng.normal(size=w.shape)
        weights.append(value.astype("float32"))
    stock.set_weights(weights)
    ours.set_weights(stock.get_weights())
    return stock, ours


def _forward_backward(layer, x, dy, **call_kw):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, **call_kw)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
    grads = tape.gradient(loss, [x] + list(layer.trainable_variables))
    return y, grads


# ----------------------------------------------------------------------------
# FusedBatchNorm equivalence.

BN_SHAPES = [(8, 6), (4, 5, 6), (4, 3, 3, 6), (2, 3, 2, 2, 6)]


# center/scale variants in float32; the mixed policies run the full layer.
BN_CASES = [("float32", c, s) for c, s in [(True, True), (False, True), (True, False), (False, False)]] + [
    ("mixed_bfloat16", True, True), ("mixed_float16", True, True)
]


@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("policy,center,scale", BN_CASES)
def test_batch_norm_matches_keras(policy, shape, center, scale):
    kwargs = dict(center=center, scale=scale, momentum=0.8)
    stock, ours = _pair(keras.layers.BatchNormalization, FusedBatchNorm, kwargs, shape, policy)
    assert [w.name for w in ours.weights] == [w.name for w in stock.weights]
    assert [tuple(w.shape) for w in ours.weights] == [tuple(w.shape) for w in stock.weights]
    rng = np.random.default_rng(1)
    dy = rng.normal(size=shape).astype("float32")
    for training in (False, True):
        x = (rng.normal(size=shape) * 2 + 0.5).astype("float32")
        y_ref, g_ref = _forward_backward(stock, x, dy, training=training)
        y, g = _forward_backward(ours, x, dy, training=training)
        assert keras.backend.standardize_dtype(y.dtype) == keras.backend.standardize_dtype(y_ref.dtype)
        _close(y, y_ref, policy, f"output, training={training}")
        assert len(g) == len(g_ref)
        for i, (a, b) in enumerate(zip(g, g_ref)):
            _close(a, b, policy, f"gradient {i}, training={training}")
    # Moving statistics over several steps (the step above was the first).
    initial_mean = stock.moving_mean.numpy().copy()
    for step in range(3):
        x = (rng.normal(size=shape) * (step + 1) - step).astype("float32")
        stock(x, training=True)
        ours(x, training=True)
    _close(ours.moving_mean, stock.moving_mean, policy, "moving_mean")
    _close(ours.moving_variance, stock.moving_variance, policy, "moving_variance")
    assert not np.allclose(ours.moving_mean.numpy(), initial_mean)  # the statistics did move
    x = rng.normal(size=shape).astype("float32")
    _close(ours(x, training=False), stock(x, training=False), policy, "inference after training")
    for w in ours.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"


def test_batch_norm_trainable_false_is_inference_mode():
    shape = (4, 2, 2, 5)
    stock, ours = _pair(keras.layers.BatchNormalization, FusedBatchNorm, {}, shape, "float32")
    stock.trainable = False
    ours.trainable = False
    before = [w.copy() for w in ours.get_weights()]
    x = np.random.default_rng(2).normal(size=shape).astype("float32") * 3
    y = ours(x, training=True)
    _close(y, stock(x, training=True), "float32", "trainable=False output")
    _close(y, ours(x, training=False), "float32", "trainable=False equals inference")
    for a, b in zip(ours.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_weights_round_trip_with_stock():
    shape = (4, 3, 3, 6)
    stock, ours = _pair(keras.layers.BatchNormalization, FusedBatchNorm, {}, shape, "float32")
    fresh_stock = keras.layers.BatchNormalization()
    fresh_stock.build(shape)
    fresh_stock.set_weights(ours.get_weights())
    for a, b in zip(fresh_stock.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_fit_updates_moving_stats_like_keras():
    shape = (8, 6)
    rng = np.random.default_rng(3)
    x = (rng.normal(size=shape) * 2 + 1).astype("float32")
    y = rng.normal(size=shape).astype("float32")
    results = []
    for cls in (keras.layers.BatchNormalization, FusedBatchNorm):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input(shape[1:]), cls(momentum=0.5)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# FusedLayerNorm equivalence.


# Argument variants in float32 (epsilon=1e-6: below cuDNN's batch-norm minimum, fine for the custom op).
LN_VARIANTS = ({}, dict(center=False), dict(scale=False), dict(epsilon=1e-6), dict(epsilon=1e-6, center=False, scale=False))
LN_CASES = [("float32", k) for k in LN_VARIANTS] + [
    ("mixed_bfloat16", {}), ("mixed_float16", {}), ("mixed_bfloat16", dict(epsilon=1e-6))
]


@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 8)])
@pytest.mark.parametrize("policy,kwargs", LN_CASES)
def test_layer_norm_matches_keras(policy, shape, kwargs):
    stock, ours = _pair(keras.layers.LayerNormalization, FusedLayerNorm, kwargs, shape, policy)
    assert [w.name for w in ours.weights] == [w.name for w in stock.weights]
    rng = np.random.default_rng(4)
    x = (rng.normal(size=shape) * 3 + 2).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    for training in (False, True):
        y_ref, g_ref = _forward_backward(stock, x, dy, training=training)
        y, g = _forward_backward(ours, x, dy, training=training)
        assert keras.backend.standardize_dtype(y.dtype) == keras.backend.standardize_dtype(y_ref.dtype)
        _close(y, y_ref, policy, "output")
        assert len(g) == len(g_ref)
        for i, (a, b) in enumerate(zip(g, g_ref)):
            _close(a, b, policy, f"gradient {i}")


def test_layer_norm_matches_numpy_reference():
    x = np.random.default_rng(5).normal(size=(3, 7)).astype("float32") * 4 + 1
    mean = x.mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(FusedLayerNorm()(x).numpy(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Graphs and fusion rows.


def _bn_model(norm, relu=True, conv_bias=True, image=True, policy=None):
    if image:
        layers = [keras.Input((4, 4, 8)), keras.layers.Conv2D(8, 1, use_bias=conv_bias, name="conv")]
    else:
        layers = [keras.Input((8,)), keras.layers.Dense(8, name="dense_in")]
    layers.append(norm(name="bn"))
    if relu:
        layers.append(keras.layers.ReLU(name="relu"))
    layers += [keras.layers.Flatten(), keras.layers.Dense(1, name="head")]
    return keras.Sequential(layers)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_batch_norm_relu_becomes_fused_batch_norm_ex(onednn, policy, mode):
    keras.mixed_precision.set_global_policy(policy)
    report = ti.fusion_report(_bn_model(FusedBatchNorm), mode=mode)
    node = ti.assert_fused(report, layer="bn", op="_FusedBatchNormEx")
    assert node.dtype == ("bfloat16" if policy == "mixed_bfloat16" else "float32")
    assert "FusedBatchNormV3" not in report.ops_by_type  # the one BN op became the fused one
    row = report.row("bn")
    assert (row.pattern, row.status, row.reason) == ("batchnorm_act", "fused", None)
    if mode == "train":
        assert report.ops_by_type.get("FusedBatchNormGradV3") == 1


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_batch_norm_graph_is_one_op_and_smaller_than_keras(policy, mode):
    keras.mixed_precision.set_global_policy(policy)
    ours = ti.fusion_report(_bn_model(FusedBatchNorm, relu=False), mode=mode)
    stock = ti.fusion_report(_bn_model(keras.layers.BatchNormalization, relu=False), mode=mode)
    assert ours.ops_by_type.get("FusedBatchNormV3") == 1
    assert "FusedBatchNormV3" not in stock.ops_by_type
    assert ours.num_ops < stock.num_ops
    if mode == "train":
        assert ours.ops_by_type.get("FusedBatchNormGradV3") == 1
        assert stock.num_ops - ours.num_ops >= 10
    row = ours.row("bn")
    assert (row.status, row.reason) == ("not fused", normalization.REASON_NO_RELU)
    assert row.actual_op is None


def test_batch_norm_under_mixed_float16_on_cpu_gives_reason():
    if ti.devices.capabilities().cpu_fp16:
        pytest.skip("this CPU computes float16 natively, so half nodes fuse")
    keras.mixed_precision.set_global_policy("mixed_float16")
    report = ti.fusion_report(_bn_model(FusedBatchNorm), mode="train")
    assert report.ops_by_type.get("FusedBatchNormV3") == 1 and "_FusedBatchNormEx" not in report.ops_by_type
    row = report.row("bn")
    assert (row.status, row.reason) == ("not fused", catalog.REASON_HALF_CPU)


def test_batch_norm_2d_relu_does_not_fuse():
    report = ti.fusion_report(_bn_model(FusedBatchNorm, image=False), mode="train")
    assert report.ops_by_type.get("FusedBatchNormV3") == 1
    assert "_FusedBatchNormEx" not in report.ops_by_type
    row = report.row("bn")
    assert (row.status, row.reason) == ("not fused", normalization.REASON_FLAT.format(rank=2))


def test_bias_free_conv_folds_batch_norm_at_inference():
    report = ti.fusion_report(_bn_model(FusedBatchNorm, conv_bias=False), mode="predict")
    ti.assert_fused(report, layer="bn", op="_FusedConv2D", fused_ops=["FusedBatchNorm", "Relu"])
    row = report.row("bn")
    assert (row.pattern, row.status) == ("conv2d_batchnorm_act", "fused")


def _ln_model(norm, epsilon=1e-3):
    return keras.Sequential(
        [keras.Input((5, 8)), keras.layers.Dense(8), norm(epsilon=epsilon, name="ln"), keras.layers.Dense(1)]
    )


@pytest.mark.parametrize("epsilon", [1e-3, 1e-6])
def test_layer_norm_train_step_has_fewer_ops_than_keras(epsilon):
    ours = ti.fusion_report(_ln_model(FusedLayerNorm, epsilon), mode="train")
    stock = ti.fusion_report(_ln_model(keras.layers.LayerNormalization, epsilon), mode="train")
    assert stock.num_ops - ours.num_ops >= 25  # Keras' ~32 layer-norm ops against our 2
    assert "FusedBatchNormV3" not in ours.ops_by_type
    row = ours.row("ln")
    if normalization.LAYER_NORM_OP in catalog.FUSED_LAYER_OPS:
        assert (row.status, row.actual_op) == ("fused", normalization.LAYER_NORM_OP)
    else:
        assert (row.status, row.reason) == ("not fused", normalization.REASON_FUSED_LN)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_layer_norm_train_step_is_one_op_each_way(policy):
    keras.mixed_precision.set_global_policy(policy)
    report = ti.fusion_report(_ln_model(FusedLayerNorm), mode="train", optimizer="sgd", loss="mse")
    assert report.ops_by_type.get("TfmetalExt>LayerNorm") == 1
    assert report.ops_by_type.get("TfmetalExt>LayerNormGrad") == 1
    for stock_op in ("FusedBatchNormV3", "FusedBatchNormGradV3", "Rsqrt", "SquaredDifference"):  # Mean: the loss
        assert stock_op not in report.ops_by_type


def test_layer_norm_reference_fallback_matches_keras(monkeypatch):
    """Without the op library the layer runs the pure-TF reference: same results, no custom op."""
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    shape = (6, 8)
    stock, ours = _pair(keras.layers.LayerNormalization, FusedLayerNorm, {}, shape, "float32")
    rng = np.random.default_rng(6)
    x = (rng.normal(size=shape) * 3 + 2).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    y_ref, g_ref = _forward_backward(stock, x, dy)
    y, g = _forward_backward(ours, x, dy)
    _close(y, y_ref, "float32", "output")
    for i, (a, b) in enumerate(zip(g, g_ref)):
        _close(a, b, "float32", f"gradient {i}")
    report = ti.fusion_report(_ln_model(FusedLayerNorm), mode="train", optimizer="sgd", loss="mse")
    assert not any(op.startswith("TfmetalExt>") for op in report.ops_by_type)
    row = report.row("ln")
    assert (row.status, row.reason) == ("not fused", normalization.REASON_LN_REFERENCE)


def test_rules_for_other_backends():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _bn_model(FusedBatchNorm)
    bn = model.get_layer("bn")
    cuda_train = catalog.expectation(bn, catalog.FusionContext(backend="cuda", mode="train"))
    assert cuda_train.op == "_FusedBatchNormEx"  # half, 8 channels
    metal = catalog.expectation(bn, catalog.FusionContext(backend="metal", mode="predict"))
    assert metal.op == "_FusedBatchNormEx"
    keras.mixed_precision.set_global_policy("float32")
    bn32 = _bn_model(FusedBatchNorm).get_layer("bn")
    cuda32 = catalog.expectation(bn32, catalog.FusionContext(backend="cuda", mode="train"))
    assert cuda32.op is None and "float16" in cuda32.reason
    no_dnn = catalog.expectation(bn32, catalog.FusionContext(backend="cpu", onednn=False, mode="train"))
    assert no_dnn.op is None and "oneDNN" in no_dnn.reason


# ----------------------------------------------------------------------------
# Keras-style layer checks.


@pytest.mark.parametrize(
    "kwargs,shape,trainable",
    [({}, (4, 3, 3, 6), 2), (dict(center=False, momentum=0.9), (5, 6), 1), (dict(scale=False, center=False), (4, 2, 2, 3), 0)],
)
def test_batch_norm_layer(kwargs, shape, trainable):
    run_layer_test(
        FusedBatchNorm, kwargs, shape, expected_output_shape=shape,
        expected_num_trainable_weights=trainable, expected_num_non_trainable_weights=2,
    )


@pytest.mark.parametrize(
    "kwargs,shape,trainable",
    [({}, (4, 6), 2), (dict(epsilon=1e-6, center=False), (2, 3, 5), 1), (dict(gamma_regularizer="l2"), (2, 2, 2, 4), 2)],
)
def test_layer_norm_layer(kwargs, shape, trainable):
    run_layer_test(
        FusedLayerNorm, kwargs, shape, expected_output_shape=shape,
        expected_num_trainable_weights=trainable, expected_num_non_trainable_weights=0,
    )


# ----------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(
    "kwargs",
    [dict(virtual_batch_size=4), dict(momentum=1.5), dict(epsilon=0), dict(epsilon=-1.0), dict(axis="x")],
)
def test_batch_norm_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received: " + next(iter(kwargs))):
        FusedBatchNorm(**kwargs)


@pytest.mark.parametrize(
    "clipping,message",
    [({"random_key": 1.0}, "Received invalid keys"), ({"rmax": 0.0, "rmin": 1.0}, "rmax should be"),
     ({"rmax": 1.0, "dmax": -1.0}, "dmax should be non-negative")],
)
def test_batch_norm_bad_renorm_clipping_as_keras(clipping, message):
    with pytest.raises(ValueError, match=message):
        keras.layers.BatchNormalization(renorm=True, renorm_clipping=clipping)
    with pytest.raises(ValueError, match=message):
        FusedBatchNorm(renorm=True, renorm_clipping=clipping)


@pytest.mark.parametrize("axis,shape", [(2, (2, 4)), (-3, (2, 4)), (4, (2, 3, 3, 4))])
def test_batch_norm_axis_out_of_bounds_at_build(axis, shape):
    with pytest.raises(ValueError, match="Received: axis="):
        FusedBatchNorm(axis=axis).build(shape)


# ----------------------------------------------------------------------------
# The rest of the stock contract: masks, and what runs the stock computation.


def _train_and_infer(stock, ours, x, **call_kw):
    for training in (True, False):
        _close(ours(x, training=training, **call_kw), stock(x, training=training, **call_kw), "float32",
               f"output, training={training}, {call_kw and 'masked'}")
    for a, b, w in zip(ours.get_weights(), stock.get_weights(), stock.weights):
        _close(a, b, "float32", w.name)


@pytest.mark.parametrize("shape", [(6, 7, 4), (3, 4, 5, 4)])
def test_batch_norm_masked_training_uses_masked_moments_as_keras(shape):
    # Before: the mask was dropped, the moments taken over masked steps too.
    stock, ours = _pair(keras.layers.BatchNormalization, FusedBatchNorm, dict(momentum=0.5), shape, "float32")
    rng = np.random.default_rng(4)
    x = (rng.normal(size=shape) * 2 + 1).astype("float32")
    mask = rng.random(shape[:-1]) > 0.4
    x[~mask] = 50.0  # masked steps far off: taking them into the moments would show
    assert ours.stock_form_reason(len(shape), training=True, masked=True) is not None
    _train_and_infer(stock, ours, x, mask=tf.constant(mask))


def test_batch_norm_mask_of_wrong_rank():
    layer = FusedBatchNorm()
    with pytest.raises(ValueError, match="mask.shape="):
        layer(np.zeros((2, 3, 4), "float32"), training=True, mask=np.ones((2,), bool))


def test_normalization_masks_pass_through_as_keras():
    # Before: FusedBatchNorm / FusedLayerNorm dropped the mask of a Masking layer.
    x = np.random.default_rng(5).normal(size=(3, 6, 4)).astype("float32")
    x[:, 4:] = 0.0
    for stock_cls, ours_cls in ((keras.layers.BatchNormalization, FusedBatchNorm),
                                (keras.layers.LayerNormalization, FusedLayerNorm)):
        masks = []
        for cls in (stock_cls, ours_cls):
            inp = keras.Input((6, 4))
            out = cls()(keras.layers.Masking()(inp))
            masks.append(out._keras_mask)
            assert cls().supports_masking
        assert masks[1] is not None and tuple(masks[1].shape) == tuple(masks[0].shape)
        stock_cls_mask = keras.Model(inp, out).layers[-1].compute_mask(x, tf.constant(x[..., 0] != 0))
        np.testing.assert_array_equal(np.asarray(stock_cls_mask), x[..., 0] != 0)


def test_batch_norm_masked_model_fit_matches_keras():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(8, 5, 3)).astype("float32")
    x[:, 3:] = 0.0
    y = rng.normal(size=(8, 5, 3)).astype("float32")
    results = []
    for cls in (keras.layers.BatchNormalization, FusedBatchNorm):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.Masking(), cls(momentum=0.5)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,shape",
    [(dict(axis=1), (4, 3, 3, 6)), (dict(axis=-2), (5, 6, 3)), (dict(axis=0), (4, 3)), (dict(renorm=True), (8, 5)),
     (dict(renorm=True, renorm_clipping={"rmax": 3.0, "rmin": 0.3, "dmax": 5.0}, renorm_momentum=0.8), (8, 3, 5)),
     (dict(epsilon=1e-7), (6, 4)), (dict(synchronized=True), (6, 4))],
)
def test_batch_norm_stock_computation_matches_keras(kwargs, shape):
    # Before: each of these was refused with a ValueError.
    stock, ours = _pair(keras.layers.BatchNormalization, FusedBatchNorm, kwargs, shape, "float32")
    assert [w.name for w in ours.weights] == [w.name for w in stock.weights]
    assert ours.stock_form_reason(len(shape)) is not None
    x = (np.random.default_rng(7).normal(size=shape) * 2 + 0.5).astype("float32")
    for _ in range(2):
        _train_and_infer(stock, ours, x)
    config = ours.get_config()
    assert {k: config[k] for k in ("renorm", "synchronized", "renorm_momentum")} == {
        k: stock.get_config()[k] for k in ("renorm", "synchronized", "renorm_momentum")}


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_batch_norm_3d_is_one_fused_batch_norm(mode):
    # Before: a 3-D (batch, steps, channels) input raised in build.
    inp = keras.Input((12, 8))
    h = keras.layers.Conv1D(8, 3, padding="same", use_bias=False)(inp)
    out = FusedBatchNorm(name="bn")(h)
    model = keras.Model(inp, out)
    report = ti.fusion_report(model, inputs=np.random.rand(4, 12, 8).astype("float32"), mode=mode)
    assert report.ops_by_type.get("FusedBatchNormV3", 0) + report.ops_by_type.get("_FusedBatchNormEx", 0) >= 1
    assert report.ops_by_type.get("Rsqrt", 0) == 0  # no moments chain: the fused op ran


def test_rules_name_the_stock_computation():
    keras.mixed_precision.set_global_policy("float32")
    ctx = catalog.FusionContext(backend="cpu", mode="train")
    for layer, shape in ((FusedBatchNorm(renorm=True), (4, 6)), (FusedBatchNorm(axis=1), (2, 3, 4)),
                         (FusedLayerNorm(axis=1), (2, 3, 4))):
        keras.Sequential([keras.Input(shape[1:]), layer])
        exp = catalog.expectation(layer, ctx)
        assert exp.op is None and "stock" in exp.reason


@pytest.mark.parametrize("kwargs,shape", [(dict(axis=1), (2, 3, 4)), (dict(axis=[1, 2]), (2, 3, 4)),
                                          (dict(axis=-2), (3, 5, 2)), (dict(rms_scaling=True), (2, 4))])
def test_layer_norm_stock_computation_matches_keras(kwargs, shape):
    # Before: each of these was refused with a ValueError.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock, ours = _pair(keras.layers.LayerNormalization, FusedLayerNorm, kwargs, shape, "float32")
    assert [tuple(w.shape) for w in ours.weights] == [tuple(w.shape) for w in stock.weights]
    assert ours.stock_form_reason() is not None
    x = np.random.default_rng(8).normal(size=shape).astype("float32")
    dy = np.random.default_rng(9).normal(size=shape).astype("float32")
    y_ref, g_ref = _forward_backward(stock, x, dy)
    y, g = _forward_backward(ours, x, dy)
    _close(y, y_ref, "float32", "output")
    for a, b in zip(g, g_ref):
        _close(a, b, "float32", "gradient")
    assert ours.get_config()["axis"] == stock.get_config()["axis"]


@pytest.mark.parametrize("kwargs", [dict(epsilon=0.0), dict(epsilon=-1.0)])
def test_layer_norm_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received: " + next(iter(kwargs))):
        FusedLayerNorm(**kwargs).build((2, 3, 4))


@pytest.mark.parametrize("axis", [1.5, "x", {"axis": -1}])
def test_layer_norm_bad_axis_type_is_type_error_as_keras(axis):
    with pytest.raises(TypeError):
        keras.layers.LayerNormalization(axis=axis)
    with pytest.raises(TypeError, match="Expected an int or a list/tuple of ints for the argument 'axis'"):
        FusedLayerNorm(axis=axis)


@pytest.mark.parametrize("axis", [3, -4])
def test_layer_norm_axis_out_of_bounds(axis):
    with pytest.raises(ValueError, match="Received: axis="):
        FusedLayerNorm(axis=axis).build((2, 3, 4))


# ----------------------------------------------------------------------------
# Non-finite guard: a poisoned batch (a step loss scaling skips) keeps the moving statistics.


def _two_branch_model(ours, seed=0):
    """Input -> (batch norm | conv + batch norm) -> pooled, concatenated -> Dense(1) in float32.

    Each batch norm sees the input (or a conv of it) directly, so its batch statistics
    depend only on the initial weights and are the same for ours and stock.
    """
    from tfmetal_ext.layers import ConvBNAct

    inputs = keras.Input((6, 6, 3))
    if ours:
        a = FusedBatchNorm(name="bn")(inputs)
        b = ConvBNAct(4, 3, activation="relu", name="conv_bn")(inputs)
    else:
        a = keras.layers.BatchNormalization(name="bn")(inputs)
        b = keras.layers.Conv2D(4, 3, use_bias=False, padding="same", name="conv")(inputs)
        b = keras.layers.Activation("relu")(keras.layers.BatchNormalization(name="conv_bn")(b))
    pooled = keras.layers.Concatenate()(
        [keras.layers.GlobalAveragePooling2D()(a), keras.layers.GlobalAveragePooling2D()(b)]
    )
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    for w in model.weights:  # the same values for the same weight in both models, whatever the order
        key = w.path.replace("conv/", "conv_bn/")
        w.assign(np.random.default_rng(zlib.crc32(key.encode())).uniform(0.5, 1.5, w.shape).astype("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _moving_stats(model):
    """bn/moving_mean, bn/moving_variance, conv_bn/moving_mean, conv_bn/moving_variance."""
    stats = [w for w in model.weights if "moving_" in w.path]
    return [np.array(keras.ops.convert_to_numpy(w)) for w in sorted(stats, key=lambda w: w.path)]


def test_batch_norm_keeps_moving_stats_on_a_skipped_mixed_float16_step():
    keras.mixed_precision.set_global_policy("mixed_float16")
    ours, stock = _two_branch_model(ours=True), _two_branch_model(ours=False)
    for model in (ours, stock):  # Keras 3 compile wraps the optimizer under mixed_float16
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 6, 6, 3)).astype("float32")
    y = rng.normal(size=(4, 1)).astype("float32")
    poisoned = x.copy()
    poisoned[0, 2, 3, 1] = np.inf

    before = _moving_stats(ours)
    gamma_before = ours.get_layer("bn").gamma.numpy()
    assert len(before) == 4
    ours.train_on_batch(poisoned, y)
    stock.train_on_batch(poisoned, y)
    # The step was skipped (the trainable weights did not move) ...
    np.testing.assert_array_equal(ours.get_layer("bn").gamma.numpy(), gamma_before)
    # ... and our moving statistics are bitwise unchanged, where stock Keras' become non-finite.
    for got, want in zip(_moving_stats(ours), before):
        np.testing.assert_array_equal(got, want)
    assert all(not np.isfinite(s).all() for s in _moving_stats(stock))

    # A finite batch then updates them as stock does (fresh stock model: its stats are poisoned).
    stock = _two_branch_model(ours=False)
    ours.train_on_batch(x, y)
    stock.train_on_batch(x, y)
    for got, want, old in zip(_moving_stats(ours), _moving_stats(stock), before):
        assert not np.array_equal(got, old)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # Independent reference for the first batch norm: moving = 0.99 * old + 0.01 * batch (biased variance).
    x16 = x.astype("float16").astype("float64").reshape(-1, 3)
    np.testing.assert_allclose(_moving_stats(ours)[0], 0.99 * before[0] + 0.01 * x16.mean(0), atol=1e-6)
    np.testing.assert_allclose(_moving_stats(ours)[1], 0.99 * before[1] + 0.01 * x16.var(0), atol=1e-6)


@pytest.mark.parametrize(
    "avoid, kwargs",
    [(False, {}), (True, {}), (False, dict(epsilon=1e-6)), (False, dict(renorm=True))],
    ids=["fused", "unfused", "stock", "stock-renorm"],
)
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_batch_norm_keeps_moving_stats_on_a_non_finite_batch_without_loss_scaling(avoid, kwargs, bad):
    from tfmetal_ext import _env

    with _env.scope(avoided=frozenset({"fused_batch_norm"}) if avoid else frozenset()):  # what the layer reads
        bn = FusedBatchNorm(moving_mean_initializer="ones", moving_variance_initializer="ones", **kwargs)
        x = np.random.default_rng(2).normal(size=(4, 3, 3, 5)).astype("float32")
        bn.build(x.shape)
        assert (bn.stock_form_reason(4) is None) == (not kwargs)
        before = [w.numpy() for w in bn.non_trainable_weights]
        poisoned = x.copy()
        poisoned[1, 0, 2, 4] = bad
        step = tf.function(lambda t: bn(t, training=True))
        y = step(tf.constant(poisoned))
        assert not np.isfinite(y.numpy()[..., 4]).all()  # the output shows the bad batch
        for got, want in zip(bn.non_trainable_weights, before):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=got.path)
        step(tf.constant(x))
        flat = x.astype("float64").reshape(-1, 5)
        np.testing.assert_allclose(bn.moving_mean.numpy(), 0.99 + 0.01 * flat.mean(0), atol=1e-6)
        if not kwargs.get("renorm"):  # batch renormalization blends the variance through its stddev
            np.testing.assert_allclose(bn.moving_variance.numpy(), 0.99 + 0.01 * flat.var(0), atol=1e-6)
        assert all(np.isfinite(w.numpy()).all() and not np.array_equal(w.numpy(), old)
                   for w, old in zip(bn.non_trainable_weights, before))
