"""FusedSeparableConv2D: a drop-in for keras.layers.SeparableConv2D, pointwise conv + bias + act fused."""

import keras
import pytest

from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import FusedSeparableConv2D
from tfmetal_ext.testing import check_equivalence, error_type, run_layer_test


CASES = [
    dict(filters=4, kernel_size=3),
    dict(filters=5, kernel_size=3, padding="same", activation="relu"),
    dict(filters=6, kernel_size=3, strides=2, padding="same", depth_multiplier=2, activation="relu6"),
    dict(filters=3, kernel_size=(3, 2), activation="elu", use_bias=False),
    dict(filters=4, kernel_size=3, padding="same", activation="leaky_relu", depth_multiplier=3),
    dict(filters=4, kernel_size=3, padding="same", activation="swish"),
    dict(filters=1, kernel_size=3, activation="sigmoid"),
    dict(filters=4, kernel_size=3, dilation_rate=2, padding="same", activation="relu"),  # the stock form
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_matches_keras_separable_conv2d(kwargs):
    check_equivalence(FusedSeparableConv2D(**kwargs), keras.layers.SeparableConv2D(**kwargs), (2, 9, 8, 3))


def test_keras_layer_checks():
    run_layer_test(
        FusedSeparableConv2D,
        dict(filters=4, kernel_size=3, padding="same", activation="relu", depth_multiplier=2,
             depthwise_regularizer="l2", pointwise_constraint="non_neg", bias_initializer="ones"),
        (2, 8, 8, 3), expected_output_shape=(2, 8, 8, 4), expected_num_trainable_weights=3,
    )
    run_layer_test(FusedSeparableConv2D, dict(filters=2, kernel_size=2, strides=2, use_bias=False),
                   (2, 8, 8, 3), expected_output_shape=(2, 4, 4, 2), expected_num_trainable_weights=2)
    assert keras.saving.get_registered_name(FusedSeparableConv2D) == "tfmetal_ext>FusedSeparableConv2D"


BAD_ARGS = [
    dict(filters=0, kernel_size=3),
    dict(filters=4, kernel_size=0),
    dict(filters=4, kernel_size=3, strides=0),
    dict(filters=4, kernel_size=3, depth_multiplier=0),
    dict(filters=4, kernel_size=3, padding="causal"),
    dict(filters=4, kernel_size=3, activation="no_such_activation"),
    dict(filters=4, kernel_size=3, pointwise_initializer="no_such_init"),
    dict(filters=4, kernel_size=3, no_such_argument=1),
]


def test_bad_arguments_raise_what_stock_raises():
    for kwargs in BAD_ARGS:
        want = error_type(lambda: keras.layers.SeparableConv2D(**kwargs))
        assert want is not None, kwargs
        assert error_type(lambda: FusedSeparableConv2D(**kwargs)) is want, kwargs


# ----------------------------------------------------------------------------
# Fusion in the graph that ran (the same rows with oneDNN on and off).

FUSIONS = [
    ("relu", ["BiasAdd", "Relu"], ["BiasAdd", "Relu"]),
    ("relu6", ["BiasAdd", "Relu6"], ["BiasAdd", "Relu6"]),
    ("elu", ["BiasAdd", "Elu"], ["BiasAdd", "Elu"]),
    ("leaky_relu", ["BiasAdd", "LeakyRelu"], ["BiasAdd"]),
    (None, ["BiasAdd"], ["BiasAdd"]),
]


def _branches(cls, shape=(8, 8, 3)):
    inp = keras.Input(shape)
    outs = [cls(4, 3, padding="same", activation=act, name=f"l_{act or 'linear'}")(inp) for act, _, _ in FUSIONS]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_pointwise_bias_and_activation_fuse(mode):
    ours = inspect.fusion_report(_branches(FusedSeparableConv2D), mode=mode)
    stock = inspect.fusion_report(_branches(keras.layers.SeparableConv2D), mode=mode)
    for report in (ours, stock):
        for act, infer_ops, train_ops in FUSIONS:
            name, want = f"l_{act or 'linear'}", (infer_ops if mode == "predict" else train_ops)
            inspect.assert_fused(report, layer=name, op=fusion.FUSED_CONV2D, fused_ops=want)
            row = report.row(name)
            assert row.status == ("fused" if want == infer_ops else "partial"), row
        assert report.ops_by_type.get("DepthwiseConv2dNative") == len(FUSIONS)
    # No bias Reshape / Squeeze around the pointwise stage.
    assert ours.ops_by_type.get("Reshape", 0) == 0 and ours.ops_by_type.get("Squeeze", 0) == 0
    assert ours.num_ops < stock.num_ops


@pytest.mark.parametrize("cls", [FusedSeparableConv2D, keras.layers.SeparableConv2D])
def test_dilated_depthwise_stage_still_lets_the_pointwise_stage_fuse(cls):
    inp = keras.Input((8, 8, 3))
    model = keras.Model(inp, cls(4, 3, dilation_rate=2, activation="relu", name="dil")(inp))
    report = inspect.fusion_report(model)
    inspect.assert_fused(report, layer="dil", op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd", "Relu"])
    assert report.row("dil").status == "fused"
    assert report.ops_by_type.get("SpaceToBatchND") == 1


def test_channels_first_runs_the_stock_form_and_says_so():
    layer = FusedSeparableConv2D(4, 3, data_format="channels_first")
    assert layer.fused_path_reason().startswith("data_format")
