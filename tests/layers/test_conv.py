"""FusedConv2D and FusedDepthwiseConv2D: equivalence with the stock Keras layers, fusion, Keras checks."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.layers import FusedConv2D, FusedDepthwiseConv2D
from tfmetal_ext.testing import assert_close, outputs_and_gradients, run_layer_test

# ----------------------------------------------------------------------------
# Reference: the stock Keras layer with the same weights, run in a tf.function
# (so grappler runs on both graphs), outputs and gradients w.r.t. input and weights.


def check_equivalence(ours, stock, input_shape, policy="float32", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(input_shape).astype("float32")
    stock(x)
    ours.build(input_shape)
    assert [w.shape for w in ours.weights] == [w.shape for w in stock.weights]
    assert [w.name for w in ours.weights] == [w.name for w in stock.weights]
    # Non-zero bias so the BiasAdd matters; copy stock -> ours, then check ours -> stock too.
    stock.set_weights([w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    fresh = type(stock).from_config(stock.get_config())
    fresh.build(input_shape)
    fresh.set_weights(ours.get_weights())
    for a, b in zip(fresh.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    for w in ours.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"
    for training in (True, False):
        y, grads = outputs_and_gradients(ours, x, training)
        y_ref, grads_ref = outputs_and_gradients(stock, x, training)
        assert y.shape == y_ref.shape
        assert_close(y, y_ref, policy)
        assert len(grads) == len(grads_ref)
        for g, g_ref in zip(grads, grads_ref):
            assert_close(g, g_ref, policy)


CONV_CASES = [
    dict(filters=4, kernel_size=3),
    dict(filters=5, kernel_size=3, strides=2, padding="same", activation="relu"),
    dict(filters=3, kernel_size=(3, 2), strides=(2, 1), padding="valid", activation="relu6"),
    dict(filters=4, kernel_size=3, dilation_rate=2, padding="same", activation="elu"),
    dict(filters=4, kernel_size=(2, 3), dilation_rate=(1, 2), activation="leaky_relu"),
    dict(filters=6, kernel_size=1, padding="same", activation="leaky_relu"),
    dict(filters=4, kernel_size=3, padding="same", activation="tanh"),
    dict(filters=4, kernel_size=5, padding="same", activation="gelu"),
    dict(filters=4, kernel_size=3, use_bias=False, activation="sigmoid"),
    dict(filters=4, kernel_size=3, padding="same", activation="swish"),
]


@pytest.mark.parametrize("kwargs", CONV_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_conv2d_matches_keras(kwargs):
    check_equivalence(FusedConv2D(**kwargs), keras.layers.Conv2D(**kwargs), (2, 9, 7, 3))


DEPTHWISE_CASES = [
    dict(kernel_size=3),
    dict(kernel_size=3, strides=2, padding="same", activation="relu"),
    dict(kernel_size=(3, 2), strides=(1, 2), depth_multiplier=2, activation="relu6"),
    dict(kernel_size=3, dilation_rate=2, padding="same", activation="elu"),
    dict(kernel_size=3, padding="same", depth_multiplier=3, activation="leaky_relu"),
    dict(kernel_size=5, padding="same", activation="tanh"),
    dict(kernel_size=3, use_bias=False, activation="gelu"),
]


@pytest.mark.parametrize("kwargs", DEPTHWISE_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_depthwise_matches_keras(kwargs):
    strides = kwargs.get("strides", 1)
    if not devices.capabilities().onednn and isinstance(strides, tuple) and len(set(strides)) > 1:
        # TF's own CPU depthwise kernel (no oneDNN) takes equal row and column strides only: the
        # stock layer fails, and the drop-in must fail the same way rather than compute something else.
        x = np.ones((2, 9, 7, 3), "float32")
        for layer in (keras.layers.DepthwiseConv2D(**kwargs), FusedDepthwiseConv2D(**kwargs)):
            with pytest.raises(tf.errors.InvalidArgumentError, match="equal length strides"):
                layer(x)
        return
    check_equivalence(FusedDepthwiseConv2D(**kwargs), keras.layers.DepthwiseConv2D(**kwargs), (2, 9, 7, 3))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "ours, stock, kwargs",
    [
        (FusedConv2D, keras.layers.Conv2D, dict(filters=4, kernel_size=3, padding="same", activation="relu")),
        (FusedConv2D, keras.layers.Conv2D, dict(filters=4, kernel_size=3, strides=2, activation="gelu")),
        (FusedDepthwiseConv2D, keras.layers.DepthwiseConv2D, dict(kernel_size=3, depth_multiplier=2, activation="elu")),
    ],
)
def test_mixed_precision_matches_keras(policy, ours, stock, kwargs):
    keras.mixed_precision.set_global_policy(policy)
    layer = ours(**kwargs)
    assert layer.compute_dtype == policy.split("_")[1] and layer.variable_dtype == "float32"
    check_equivalence(layer, stock(**kwargs), (2, 9, 7, 3), policy=policy)
    out = layer(np.ones((1, 9, 7, 3), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]


def test_compute_output_shape_matches_keras_and_keeps_unknown_dims():
    for kwargs in CONV_CASES:
        for shape in [(2, 9, 7, 3), (None, 11, 6, 3), (None, None, 8, 3)]:
            want = keras.layers.Conv2D(**kwargs).compute_output_shape(shape)
            assert FusedConv2D(**kwargs).compute_output_shape(shape) == tuple(want), (kwargs, shape)
    for kwargs in DEPTHWISE_CASES:
        for shape in [(2, 9, 7, 3), (None, 11, 6, 3), (None, None, 8, 3)]:
            want = keras.layers.DepthwiseConv2D(**kwargs).compute_output_shape(shape)
            assert FusedDepthwiseConv2D(**kwargs).compute_output_shape(shape) == tuple(want), (kwargs, shape)


# ----------------------------------------------------------------------------
# Fusion in the graph that actually ran.


def _model(layer, shape=(8, 8, 3)):
    inp = keras.Input(shape)
    model = keras.Model(inp, layer(inp))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _use_policy(policy, request):
    if policy == "mixed_bfloat16":
        request.getfixturevalue("onednn")  # bfloat16 fusion kernels are oneDNN's
    keras.mixed_precision.set_global_policy(policy)
    return "float32" if policy == "float32" else "bfloat16"


# (activation, fused_ops at inference, fused_ops in training)
CONV_FUSIONS = [
    ("relu", ["BiasAdd", "Relu"], ["BiasAdd", "Relu"]),
    ("relu6", ["BiasAdd", "Relu6"], ["BiasAdd", "Relu6"]),
    ("elu", ["BiasAdd", "Elu"], ["BiasAdd", "Elu"]),
    ("leaky_relu", ["BiasAdd", "LeakyRelu"], ["BiasAdd"]),  # LeakyReluGrad needs the pre-activation
    (None, ["BiasAdd"], ["BiasAdd"]),
]


def _branches(make_layer, shape=(8, 8, 3)):
    """One model, one parallel branch per activation: a single capture checks them all."""
    inp = keras.Input(shape)
    outs = [make_layer(act, f"l_{act or 'linear'}")(inp) for act, _, _ in CONV_FUSIONS]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_conv2d_fuses(policy, mode, request):
    dtype = _use_policy(policy, request)
    model = _branches(lambda act, name: FusedConv2D(4, 3, padding="same", activation=act, name=name))
    report = inspect.fusion_report(model, mode=mode)
    for act, infer_ops, train_ops in CONV_FUSIONS:
        name, want = f"l_{act or 'linear'}", (infer_ops if mode == "predict" else train_ops)
        node = inspect.assert_fused(report, layer=name, op="_FusedConv2D", fused_ops=want)
        assert node.dtype == dtype
        row = report.row(name)
        assert row.actual_fused_ops == want
        assert row.status == ("fused" if want == infer_ops else "partial"), row
        if row.status == "partial":
            assert "pre-activation" in row.reason


def test_conv2d_graph_has_no_reshape_or_squeeze_unlike_keras():
    ours = inspect.fusion_report(_model(FusedConv2D(4, 3, activation="relu", name="conv")))
    stock = inspect.fusion_report(_model(keras.layers.Conv2D(4, 3, activation="relu", name="conv")))
    for report in (ours, stock):
        inspect.assert_fused(report, layer="conv", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])
    assert stock.ops_by_type.get("Reshape", 0) + stock.ops_by_type.get("Squeeze", 0) > 0
    assert ours.ops_by_type.get("Reshape", 0) == 0 and ours.ops_by_type.get("Squeeze", 0) == 0
    assert ours.num_ops < stock.num_ops


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_conv2d_unfusable_activation_is_partial(mode):
    report = inspect.fusion_report(_model(FusedConv2D(4, 3, activation="tanh", name="conv")), mode=mode)
    inspect.assert_fused(report, layer="conv", op="_FusedConv2D", fused_ops=["BiasAdd"])
    row = report.row("conv")
    assert row.status == "partial" and "Tanh" in row.reason
    assert report.ops_by_type.get("Tanh") == 1


def test_conv2d_dilated_and_biasless_report_not_fused():
    report = inspect.fusion_report(_model(FusedConv2D(4, 3, dilation_rate=2, activation="relu", name="dil")))
    assert inspect.assert_not_fused(report, "dil").startswith("dilation_rate > 1")
    assert report.row("dil").status == "not fused"
    report = inspect.fusion_report(_model(FusedConv2D(4, 3, use_bias=False, activation="relu", name="nob")))
    assert "use_bias=False" in inspect.assert_not_fused(report, "nob")


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_depthwise_fuses_with_onednn(policy, mode, onednn, request):
    dtype = _use_policy(policy, request)
    model = _branches(
        lambda act, name: FusedDepthwiseConv2D(3, padding="same", depth_multiplier=2, activation=act, name=name)
    )
    report = inspect.fusion_report(model, mode=mode)
    for act, infer_ops, _ in CONV_FUSIONS:
        name = f"l_{act or 'linear'}"
        # Measured on TF 2.21: LeakyRelu never joins the depthwise fusion, even at inference.
        want = ["BiasAdd"] if act == "leaky_relu" else infer_ops
        node = inspect.assert_fused(report, layer=name, op="_FusedDepthwiseConv2dNative", fused_ops=want)
        assert node.dtype == dtype
        row = report.row(name)
        assert row.status == ("partial" if act == "leaky_relu" else "fused"), row


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_mixed_float16_on_cpu_fuses_nothing(mode):
    if devices.capabilities().cpu_fp16:
        pytest.skip("this CPU has native float16 (AVX512_FP16/AMX_FP16/AVX_NE_CONVERT): half fuses here")
    keras.mixed_precision.set_global_policy("mixed_float16")
    inp = keras.Input((8, 8, 3))
    outs = [FusedConv2D(4, 3, activation="relu", name="conv")(inp),
            FusedDepthwiseConv2D(3, activation="relu", name="dw")(inp)]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    assert report.fused == []
    for name in ("conv", "dw"):
        row = report.row(name)
        assert row.status == "not fused" and row.reason == "float16 on CPU: remapper skips half"
    assert report.ops_by_type.get("Conv2D") == 1 and report.ops_by_type.get("DepthwiseConv2dNative") == 1


# ----------------------------------------------------------------------------
# Keras layer checks and argument validation.


@pytest.mark.parametrize(
    "kwargs, input_shape, output_shape, n_weights",
    [
        (dict(filters=4, kernel_size=3, activation="relu"), (2, 7, 6, 3), (2, 5, 4, 4), 2),
        (dict(filters=2, kernel_size=(1, 3), strides=2, padding="same", use_bias=False,
              kernel_regularizer="l2", kernel_constraint="max_norm"), (2, 7, 6, 3), (2, 4, 3, 2), 1),
        (dict(filters=3, kernel_size=3, dilation_rate=2, activation="gelu",
              kernel_initializer="he_normal", bias_initializer="ones", activity_regularizer="l1"),
         (2, 7, 6, 3), (2, 3, 2, 3), 2),
    ],
)
def test_conv2d_keras_layer_checks(kwargs, input_shape, output_shape, n_weights):
    run_layer_test(FusedConv2D, kwargs, input_shape, expected_output_shape=output_shape,
                   expected_num_trainable_weights=n_weights)


@pytest.mark.parametrize(
    "kwargs, input_shape, output_shape, n_weights",
    [
        (dict(kernel_size=3, activation="relu6"), (2, 7, 6, 3), (2, 5, 4, 3), 2),
        (dict(kernel_size=3, strides=2, padding="same", depth_multiplier=2, use_bias=False,
              depthwise_regularizer="l2", depthwise_constraint="non_neg"), (2, 7, 6, 3), (2, 4, 3, 6), 1),
        (dict(kernel_size=2, activation="leaky_relu", depthwise_initializer="he_uniform",
              bias_regularizer="l1", bias_constraint="unit_norm"), (2, 7, 6, 3), (2, 6, 5, 3), 2),
    ],
)
def test_depthwise_keras_layer_checks(kwargs, input_shape, output_shape, n_weights):
    run_layer_test(FusedDepthwiseConv2D, kwargs, input_shape, expected_output_shape=output_shape,
                   expected_num_trainable_weights=n_weights)


def test_config_is_complete_and_matches_keras_keys():
    kwargs = dict(filters=4, kernel_size=3, activation="relu", kernel_regularizer="l2")
    ours = FusedConv2D(**kwargs).get_config()
    stock = keras.layers.Conv2D(**kwargs).get_config()
    assert set(stock) - {"data_format", "groups"} <= set(ours)
    for key in ("activation", "kernel_initializer", "kernel_regularizer", "bias_initializer", "strides"):
        assert ours[key] == stock[key], key
    dw = FusedDepthwiseConv2D(3, activation="elu").get_config()
    stock = keras.layers.DepthwiseConv2D(3, activation="elu").get_config()
    assert set(stock) - {"data_format"} <= set(dw)
    assert keras.saving.get_registered_name(FusedConv2D) == "tfmetal_ext>FusedConv2D"
    assert keras.saving.get_registered_name(FusedDepthwiseConv2D) == "tfmetal_ext>FusedDepthwiseConv2D"


CONV_BAD_ARGS = [
    dict(filters=0, kernel_size=3),
    dict(filters=2.5, kernel_size=3),
    dict(filters=4, kernel_size=(3, 0)),
    dict(filters=4, kernel_size=(3, 3, 3)),
    dict(filters=4, kernel_size=3, strides=0),
    dict(filters=4, kernel_size=3, padding="causal"),
    dict(filters=4, kernel_size=3, dilation_rate=-1),
    dict(filters=4, kernel_size=3, strides=2, dilation_rate=2),
    dict(filters=4, kernel_size=3, activation="no_such_activation"),
    dict(filters=4, kernel_size=3, kernel_initializer="no_such_init"),
    dict(filters=4, kernel_size=3, data_format="channels_middle"),
    dict(filters=4, kernel_size=3, groups=0),
    dict(filters=5, kernel_size=3, groups=2),
    dict(filters=4, kernel_size=3, lora_rank=2, kernel_constraint="non_neg", input_shape=None),
    dict(filters=4, kernel_size=3, no_such_argument=1),
]
DEPTHWISE_BAD_ARGS = [
    dict(kernel_size=0),
    dict(kernel_size=3, depth_multiplier=0),
    dict(kernel_size=3, strides=(1, 2, 3)),
    dict(kernel_size=3, padding=None),
    dict(kernel_size=3, padding="causal"),
    dict(kernel_size=3, depthwise_regularizer="no_such_reg"),
    dict(kernel_size=3, data_format="channels_middle"),
    dict(kernel_size=3, lora_rank=2),  # DepthwiseConv2D has no LoRA
]


def _failure(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - comparing the exceptions themselves
        return type(e), str(e).replace("FusedConv2D", "Conv2D").replace("FusedDepthwiseConv2D", "DepthwiseConv2D")
    return None


# The same exception type and message as the stock class, for every bad argument (a drop-in
# fails where the stock layer fails, the way it fails).
@pytest.mark.parametrize(
    "ours, stock, cases",
    [(FusedConv2D, keras.layers.Conv2D, CONV_BAD_ARGS),
     (FusedDepthwiseConv2D, keras.layers.DepthwiseConv2D, DEPTHWISE_BAD_ARGS)],
    ids=["conv", "depthwise"],
)
def test_bad_arguments_fail_as_stock_fails(ours, stock, cases):
    for kwargs in cases:
        kwargs = {k: v for k, v in kwargs.items() if k != "input_shape"}

        def make(cls):
            layer = cls(**kwargs)
            if kwargs.get("kernel_constraint"):
                layer.build((1, 8, 8, 3))  # LoRA with a kernel constraint fails when LoRA is enabled
            return layer

        want = _failure(lambda: make(stock))
        assert want is not None, kwargs
        assert _failure(lambda: make(ours)) == want, kwargs


def test_lora_matches_keras():
    """lora_rank/lora_alpha in the constructor and enable_lora(): the same weights and math as stock Conv2D."""
    kw = dict(filters=4, kernel_size=3, padding="same", activation="relu", lora_rank=2, lora_alpha=4)
    ours, stock = FusedConv2D(**kw), keras.layers.Conv2D(**kw)
    check_equivalence(ours, stock, (2, 7, 7, 3))
    assert ours.lora_enabled and not ours._kernel.trainable
    assert [w.name for w in ours.trainable_weights] == [w.name for w in stock.trainable_weights]
    assert FusedConv2D.from_config(ours.get_config()).get_config() == ours.get_config()
    late = FusedConv2D(4, 3, activation="relu", name="late")
    model = _model(late)
    late.enable_lora(3)
    report = inspect.fusion_report(model)  # the LoRA-adjusted kernel still feeds the fused conv
    inspect.assert_fused(report, layer="late", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])


@pytest.mark.parametrize("kwargs", [dict(filters=6, kernel_size=3, groups=3, activation="relu"),
                                    dict(filters=3, kernel_size=3, groups=3, padding="same")])
def test_grouped_conv_runs_the_stock_form(kwargs):
    check_equivalence(FusedConv2D(**kwargs), keras.layers.Conv2D(**kwargs), (2, 8, 8, 6))
    assert "groups=3" in FusedConv2D(**kwargs).fused_path_reason()
    assert FusedConv2D(4, 3, data_format="channels_first").fused_path_reason().startswith("data_format")
    assert FusedConv2D(4, 3, dilation_rate=2).fused_path_reason() is None  # dilated: our own (unfused) form


def test_rejects_bad_input_shapes():
    with pytest.raises(ValueError):
        FusedConv2D(2, 3)(np.zeros((2, 5, 3), "float32"))
    want = _failure(lambda: keras.layers.Conv2D(2, 3, dilation_rate=3).compute_output_shape((1, 6, 6, 3)))
    assert want is not None and _failure(
        lambda: FusedConv2D(2, 3, dilation_rate=3).compute_output_shape((1, 6, 6, 3))) == want
