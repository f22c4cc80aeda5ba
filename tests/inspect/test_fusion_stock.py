"""Fusion verification on stock Keras models (TF remapper, CPU rows of the backend tables).

Each test builds the stock Keras pattern, captures the graph that ran, and asserts the exact
fused op and `fused_ops`, plus a negative twin that must not fuse.
"""

import keras
import pytest

from tfmetal_ext import devices, inspect
from tfmetal_ext.inspect import catalog

POLICIES = ["float32", "mixed_bfloat16"]


def _conv_dense_model(conv_act="relu", dense_act="relu", conv_bias=True):
    inp = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, activation=conv_act, use_bias=conv_bias, name="conv")(inp)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation=dense_act, name="fc")(x)
    out = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_conv_and_dense_relu_fuse(policy, mode):
    keras.mixed_precision.set_global_policy(policy)
    report = inspect.fusion_report(_conv_dense_model(), mode=mode)
    caps = devices.capabilities()
    if policy == "mixed_bfloat16" and not caps.onednn_bf16:
        # TF's own CPU kernels (no oneDNN: AVX2-only CPUs, TF_ENABLE_ONEDNN_OPTS=0, macOS) fuse
        # float32 only, and oneDNN fuses bfloat16 only with AVX512F or AVX_NE_CONVERT: the graph
        # has no fused node and every row says why.
        why = "bfloat16 on CPU without oneDNN" if not caps.onednn else catalog.REASON_BF16_ONEDNN
        assert report.fused == []
        for name in ("conv", "fc", "head"):
            row = report.row(name)
            assert row.status == "not fused" and row.reason.startswith(why), row
        return
    conv = inspect.assert_fused(report, layer="conv", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])
    fc = inspect.assert_fused(report, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])
    want = "float32" if policy == "float32" else "bfloat16"
    assert conv.dtype == want and fc.dtype == want
    assert conv.layer == "conv" and fc.layer == "fc"
    assert report.row("conv").status == "fused"
    assert report.row("fc").status == "fused"
    assert report.row("head").actual_fused_ops == ["BiasAdd"]


def test_negative_no_bias_and_linear_do_not_match_relu_pattern():
    report = inspect.fusion_report(_conv_dense_model(conv_bias=False, dense_act=None), mode="predict")
    with pytest.raises(AssertionError, match="Expected _FusedConv2D"):
        inspect.assert_fused(report, layer="conv", op="_FusedConv2D")
    with pytest.raises(AssertionError, match=r"_FusedMatMul\[BiasAdd, Relu\]"):
        inspect.assert_fused(report, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])
    inspect.assert_fused(report, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd"])
    row = report.row("conv")
    assert row.status == "not fused" and "use_bias=False" in row.reason


def _residual_model():
    inp = keras.Input((10, 10, 8))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inp)
    x = keras.layers.Add(name="add")([x, inp])
    x = keras.layers.ReLU(name="relu")(x)
    out = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("policy", POLICIES)
def test_residual_add_relu_fuses_into_conv(policy, onednn):
    keras.mixed_precision.set_global_policy(policy)
    report = inspect.fusion_report(_residual_model(), mode="predict")
    node = inspect.assert_fused(report, layer="conv", op="_FusedConv2D", fused_ops=["BiasAdd", "Add", "Relu"])
    assert "relu" in node.layers  # the fused node takes the name of the pattern's last node
    assert report.row("add").status == "fused"
    assert report.num_ops == sum(report.ops_by_type.values())
    assert "Relu" not in report.ops_by_type and "AddV2" not in report.ops_by_type


def test_negative_residual_with_second_consumer_does_not_fuse():
    inp = keras.Input((10, 10, 8))
    conv = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inp)
    added = keras.layers.Add(name="add")([conv, inp])
    x = keras.layers.ReLU(name="relu")(added)
    out = keras.layers.Concatenate()([x, added])  # the pre-activation has another consumer
    report = inspect.fusion_report(keras.Model(inp, out), mode="predict")
    with pytest.raises(AssertionError):
        inspect.assert_fused(report, layer="conv", op="_FusedConv2D", fused_ops=["BiasAdd", "Add", "Relu"])


def _norm_model():
    inp = keras.Input((6, 6, 4))
    x = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    out = keras.layers.Flatten()(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_keras_batchnorm_and_layernorm_are_not_fused_with_reason(mode):
    report = inspect.fusion_report(_norm_model(), mode=mode)
    for layer, why in [("bn", "BatchNormalization is not fused by Keras 3"),
                       ("ln", "LayerNormalization is not fused by Keras 3")]:
        reason = inspect.assert_not_fused(report, layer)
        assert why in reason
        assert report.row(layer).status == "not fused"
    assert "FusedBatchNormV3" not in report.ops_by_type
    assert not any(f.op == "_FusedBatchNormEx" for f in report.fused)
    with pytest.raises(AssertionError):
        inspect.assert_fused(report, layer="bn")


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_mixed_float16_on_cpu_is_reported_not_fused(mode):
    from tfmetal_ext import devices

    if devices.capabilities().cpu_fp16:
        pytest.skip("this CPU has native float16 (AVX512_FP16/AMX_FP16/AVX_NE_CONVERT): half fuses here")
    keras.mixed_precision.set_global_policy("mixed_float16")
    report = inspect.fusion_report(_conv_dense_model(), mode=mode)
    assert report.policy == "mixed_float16"
    assert report.fused == []
    for layer in ("conv", "fc", "head"):
        row = report.row(layer)
        assert row.status == "not fused" and row.reason == "float16 on CPU: remapper skips half"
    with pytest.raises(AssertionError, match="no fused node"):
        inspect.assert_fused(report, layer="conv", op="_FusedConv2D")
    assert report.ops_by_type.get("Conv2D") == 1 and report.ops_by_type.get("BiasAdd", 0) >= 3


def test_dense_gelu_fuses_at_inference_but_only_bias_in_training(onednn):
    model = _conv_dense_model(dense_act="gelu")
    infer = inspect.fusion_report(model, mode="predict")
    inspect.assert_fused(infer, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd", "GeluExact"])
    train = inspect.fusion_report(model, mode="train")
    inspect.assert_fused(train, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd"])
    row = train.row("fc")
    assert row.status == "partial" and "pre-activation" in row.reason


def test_xla_compiled_step_is_reported():
    model = _conv_dense_model()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    report = inspect.fusion_report(model, mode="train")
    assert report.xla is True
    assert report.row("conv").reason == "XLA compiled: grappler not applied"
