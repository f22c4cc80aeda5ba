"""FusedConv1D: a drop-in for keras.layers.Conv1D whose bias and activation fuse into the convolution."""

import keras
import numpy as np
import pytest

from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import FusedConv1D
from tfmetal_ext.testing import check_equivalence, error_type, run_layer_test


CASES = [
    dict(filters=4, kernel_size=3),
    dict(filters=5, kernel_size=3, padding="causal", activation="relu"),
    dict(filters=5, kernel_size=4, strides=2, padding="same", activation="relu6"),
    dict(filters=3, kernel_size=2, strides=3, activation="elu"),
    dict(filters=6, kernel_size=1, activation="leaky_relu"),
    dict(filters=4, kernel_size=3, padding="causal", activation="tanh"),
    dict(filters=4, kernel_size=5, padding="same", activation="gelu", use_bias=False),
    dict(filters=1, kernel_size=3, activation="sigmoid"),
    # The stock form (dilation, groups): the same layer either way.
    dict(filters=4, kernel_size=3, dilation_rate=2, padding="causal", activation="relu"),
    dict(filters=6, kernel_size=3, groups=3, activation="relu"),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_matches_keras_conv1d(kwargs):
    check_equivalence(FusedConv1D(**kwargs), keras.layers.Conv1D(**kwargs), (2, 13, 6))


def test_lora_matches_keras():
    """lora_rank in the constructor and enable_lora(): the same LoRA weights and the same math as stock."""
    kw = dict(filters=4, kernel_size=3, activation="relu", lora_rank=2, lora_alpha=3)
    ours, stock = FusedConv1D(**kw), keras.layers.Conv1D(**kw)
    x = np.random.default_rng(1).standard_normal((2, 9, 5)).astype("float32")
    ours(x), stock(x)
    assert ours.lora_enabled and [w.name for w in ours.trainable_weights] == [w.name for w in stock.trainable_weights]
    check_equivalence(ours, stock, (2, 9, 5))
    late = FusedConv1D(4, 3)
    late(x)
    late.enable_lora(2)
    assert late.lora_enabled and not late._kernel.trainable
    assert FusedConv1D.from_config(ours.get_config()).lora_rank == 2


def test_keras_layer_checks():
    run_layer_test(FusedConv1D, dict(filters=4, kernel_size=3, padding="causal", activation="relu",
                                     kernel_regularizer="l2", bias_constraint="non_neg"),
                   (2, 10, 3), expected_output_shape=(2, 10, 4), expected_num_trainable_weights=2)
    run_layer_test(FusedConv1D, dict(filters=2, kernel_size=2, strides=2, use_bias=False),
                   (2, 10, 3), expected_output_shape=(2, 5, 2), expected_num_trainable_weights=1)
    assert keras.saving.get_registered_name(FusedConv1D) == "tfmetal_ext>FusedConv1D"


BAD_ARGS = [
    dict(filters=0, kernel_size=3),
    dict(filters=4, kernel_size=0),
    dict(filters=4, kernel_size=(3, 3)),
    dict(filters=4, kernel_size=3, strides=0),
    dict(filters=4, kernel_size=3, padding="full"),
    dict(filters=4, kernel_size=3, strides=2, dilation_rate=2),
    dict(filters=4, kernel_size=3, groups=0),
    dict(filters=5, kernel_size=3, groups=2),
    dict(filters=4, kernel_size=3, activation="no_such_activation"),
    dict(filters=4, kernel_size=3, data_format="channels_middle"),
    dict(filters=4, kernel_size=3, no_such_argument=1),
]


def test_bad_arguments_raise_what_stock_raises():
    for kwargs in BAD_ARGS:
        want = error_type(lambda: keras.layers.Conv1D(**kwargs))
        assert want is not None, kwargs
        assert error_type(lambda: FusedConv1D(**kwargs)) is want, kwargs


# ----------------------------------------------------------------------------
# Fusion in the graph that ran: both CPU configurations (the same rows with oneDNN on and off).

# (activation, fused_ops at inference, fused_ops in a train step)
FUSIONS = [
    ("relu", ["BiasAdd", "Relu"], ["BiasAdd", "Relu"]),
    ("relu6", ["BiasAdd", "Relu6"], ["BiasAdd", "Relu6"]),
    ("elu", ["BiasAdd", "Elu"], ["BiasAdd", "Elu"]),
    ("leaky_relu", ["BiasAdd", "LeakyRelu"], ["BiasAdd"]),  # LeakyReluGrad needs the pre-activation
    (None, ["BiasAdd"], ["BiasAdd"]),
]


def _branches(cls, shape=(16, 3), **kw):
    inp = keras.Input(shape)
    outs = [cls(4, 3, activation=act, name=f"l_{act or 'linear'}", **kw)(inp) for act, _, _ in FUSIONS]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("mode", ["predict", "train"])
@pytest.mark.parametrize("padding", ["causal", "same"])
def test_activation_fuses_into_the_conv(mode, padding):
    report = inspect.fusion_report(_branches(FusedConv1D, padding=padding), mode=mode)
    for act, infer_ops, train_ops in FUSIONS:
        name, want = f"l_{act or 'linear'}", (infer_ops if mode == "predict" else train_ops)
        inspect.assert_fused(report, layer=name, op=fusion.FUSED_CONV2D, fused_ops=want)
        row = report.row(name)
        assert row.actual_fused_ops == want
        assert row.status == ("fused" if want == infer_ops else "partial"), row
    assert report.ops_by_type.get("Relu", 0) == 0


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_stock_conv1d_fuses_only_the_bias_and_the_report_says_why(mode):
    report = inspect.fusion_report(_branches(keras.layers.Conv1D), mode=mode)
    for act, _, _ in FUSIONS:
        name = f"l_{act or 'linear'}"
        inspect.assert_fused(report, layer=name, op=fusion.FUSED_CONV2D, fused_ops=["BiasAdd"])
        row = report.row(name)
        if act:
            assert row.status == "partial" and "Squeeze" in row.reason, row
        else:
            assert row.status == "fused", row


def test_fewer_ops_than_stock():
    ours = inspect.fusion_report(_branches(FusedConv1D), mode="train")
    stock = inspect.fusion_report(_branches(keras.layers.Conv1D), mode="train")
    assert ours.num_ops < stock.num_ops


def test_stock_form_is_reported_with_its_reason():
    inp = keras.Input((16, 6))
    outs = [FusedConv1D(4, 3, dilation_rate=2, padding="same", activation="relu", name="dilated")(inp),
            FusedConv1D(6, 3, groups=3, padding="same", activation="relu", name="grouped")(inp)]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    report = inspect.fusion_report(model)
    assert inspect.assert_not_fused(report, "dilated").startswith("dilation_rate > 1")
    assert report.row("grouped").status == "not fused" and "groups=3" in report.row("grouped").reason
    assert FusedConv1D(4, 3, data_format="channels_first").fused_path_reason().startswith("data_format")
