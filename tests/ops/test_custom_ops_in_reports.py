"""A model with Softshrink and FusedLayerNorm: one custom op per layer and direction, reported as fused."""

import keras
import pytest

from tfmetal_ext import inspect, layers, ops


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(32, name="fc1"),
            layers.FusedLayerNorm(name="norm"),
            layers.Softshrink(0.5, name="shrink"),
            keras.layers.Dense(4, name="fc2"),
        ]
    )


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_train_step_has_one_custom_op_per_layer_and_reports_it_fused(policy):
    keras.mixed_precision.set_global_policy(policy)
    assert ops.status().loaded
    report = inspect.fusion_report(model(), mode="train", optimizer="sgd", loss="mse")
    for op in ("TfmetalExt>LayerNorm", "TfmetalExt>LayerNormGrad", "TfmetalExt>Softshrink", "TfmetalExt>SoftshrinkGrad"):
        assert report.ops_by_type.get(op) == 1, (op, report.ops_by_type)
    for name, op in (("norm", "TfmetalExt>LayerNorm"), ("shrink", "TfmetalExt>Softshrink")):
        row = report.row(name)
        assert row.status == "fused", str(report)
        assert row.actual_op == op
    inspect.assert_fused(report, "shrink", op="TfmetalExt>Softshrink")
    assert not inspect.placement_report(model(), mode="train", optimizer="sgd", loss="mse").fallbacks


def test_reference_mode_reports_not_fused(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    report = inspect.fusion_report(model(), mode="train", optimizer="sgd", loss="mse")
    assert not any(op.startswith("TfmetalExt>") for op in report.ops_by_type)
    row = report.row("shrink")
    assert row.status == "not fused" and "reference" in row.reason
