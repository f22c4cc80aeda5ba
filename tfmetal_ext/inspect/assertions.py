"""Assertions for users' test suites: `assert_fused`, `assert_not_fused`, `assert_no_cpu_fallback`."""

from __future__ import annotations

from tfmetal_ext.inspect.predict import PredictedPlacementReport
from tfmetal_ext.inspect.report import PlacementReport


def assert_fused(report, layer=None, op=None, fused_ops=None):
    """Asserts that a fused node with `op` and exactly `fused_ops` exists (for `layer`).

    Args:
        report: a `FusionReport`.
        layer: a layer name or nested path; None means anywhere in the graph.
        op: the fused op, e.g. ``"_FusedConv2D"``; None accepts any.
        fused_ops: the exact ``fused_ops`` list; None accepts any.

    Raises:
        AssertionError: with the report table, when no such node exists.
    """
    nodes = report.fused_for(layer) if layer else report.fused
    nodes = [n for n in nodes if not n.backward] or nodes
    for n in nodes:
        if (op is None or n.op == op) and (fused_ops is None or list(n.fused_ops) == list(fused_ops)):
            return n
    want = f"{op or 'any fused op'}[{', '.join(fused_ops)}]" if fused_ops is not None else (op or "any fused op")
    have = ", ".join(n.label() for n in nodes) or "no fused node"
    raise AssertionError(
        f"Expected {want} for layer {layer or '(any)'}; found {have}.\n{report}"
    )


def assert_not_fused(report, layer):
    """Asserts that no forward fused node belongs to `layer`; returns its row's reason."""
    nodes = [n for n in report.fused_for(layer) if not n.backward]
    if nodes:
        raise AssertionError(
            f"Expected layer {layer} not to be fused; found {', '.join(n.label() for n in nodes)}.\n{report}"
        )
    try:
        return report.row(layer).reason
    except KeyError:
        return None


def assert_no_cpu_fallback(report):
    """Asserts a `PlacementReport` lists no op that fell back to CPU.

    Raises:
        AssertionError: listing the ops and their layers.
    """
    if not isinstance(report, PlacementReport):
        raise TypeError(f"Expected a PlacementReport. Received: report={type(report).__name__}")
    if report.fallbacks:
        if isinstance(report, PredictedPlacementReport):
            raise AssertionError(
                f"{len(report.fallbacks)} kind(s) of op would not run on the GPU of {report.predicted_for}.\n{report}"
            )
        raise AssertionError(f"{len(report.fallbacks)} op(s) fell back to CPU.\n{report}")
