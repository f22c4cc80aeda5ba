"""Fusion and placement inspection of the graphs TensorFlow actually ran.

>>> report = tfmetal_ext.inspect.fusion_report(model, mode="train")
>>> print(report)
>>> tfmetal_ext.inspect.assert_fused(report, layer="conv1", op="_FusedConv2D",
...                                  fused_ops=["BiasAdd", "Relu"])
"""

from __future__ import annotations

from tfmetal_ext import devices
from tfmetal_ext.inspect import predict
from tfmetal_ext.inspect.assertions import assert_fused, assert_no_cpu_fallback, assert_not_fused
from tfmetal_ext.inspect.capture import (
    Capture,
    capture_call,
    capture_function,
    capture_predict,
    capture_train,
    trace_function,
    trace_predict,
    trace_train,
)
from tfmetal_ext.inspect.catalog import PATTERNS, Expectation, FusionContext, register_rule
from tfmetal_ext.inspect.predict import PredictedOp, PredictedPlacementReport
from tfmetal_ext.inspect.transfers import PredictedTransfer
from tfmetal_ext.inspect.report import (
    FallbackNode,
    FusedNode,
    FusionReport,
    LayerIndex,
    LayerRow,
    OptimizerUpdate,
    PlacementReport,
    build_fusion_report,
    build_placement_report,
)
from tfmetal_ext.inspect.step import (
    DEFAULT_LENGTHS,
    _context,
    batch_size_of,
    capture_step,
    fusion_report,
    placement_from_capture,
    placement_report,
    report_from_capture,
    synthetic_inputs,
    synthetic_targets,
)

# Also importable here, outside __all__: the modules `capture`, `catalog`, `predict`, `report`,
# `step` and `transfers`, the step's parts (`capture_call`, `trace_*`, `synthetic_inputs`, ...) and `devices`.
__all__ = [
    "PATTERNS",
    "Capture",
    "Expectation",
    "FallbackNode",
    "FusedNode",
    "FusionContext",
    "FusionReport",
    "LayerRow",
    "OptimizerUpdate",
    "PlacementReport",
    "PredictedOp",
    "PredictedPlacementReport",
    "PredictedTransfer",
    "assert_fused",
    "assert_no_cpu_fallback",
    "capture_step",
    "fusion_report",
    "placement_report",
    "register_rule",
]
