"""The first train step: a wrapper around ``model.train_function``, the step's capture, its reports and summary."""

from __future__ import annotations

import collections

from tfmetal_ext.backends.fusion import STOCK_TO_FUSED
from tfmetal_ext.callbacks._model import find_layer, is_stock

# Fusion-report statuses a summary lists (with "unexpected"); "partial" gets no replacement advice.
_UNFUSED_STATUSES = ("missed", "not fused", "partial", "unexpected")


def layer_advice(layer_class):
    """What to use instead of the stock Keras layer class named `layer_class`, or None."""
    row = STOCK_TO_FUSED.get(layer_class)
    return row.suggestion if row is not None else None


def replacement_advice(layer, path=None):
    """What to use instead of this stock `layer`, or None when nothing replaces it as configured and called.

    The conversion planner decides (the one home of "does this replacement
    accept this layer's configuration and input"): the advice names the class
    ``tfmetal_ext.convert()`` would put in its place, and nothing when
    `convert()` would keep the layer (e.g. a BatchNormalization on an input
    the fused class does not take).
    """
    if layer is None or not is_stock(layer):
        return None
    row = STOCK_TO_FUSED.get(type(layer).__name__)
    if row is None:
        return None
    try:
        from tfmetal_ext.conversion import planners

        plan, _ = planners.plan_sublayer(layer, path or layer.name, inference=False)
    except Exception:  # the planner cannot tell: advise nothing rather than something that may fail
        return None
    if plan is None or plan.rewrite is None:
        return None
    new_class = plan.rewrite.new_class
    return row.suggestion if new_class == row.fused else f"{row.module}.{new_class}"


class TrainStepWrapper:
    """Wraps ``model.train_function`` for one fit and captures its first call.

    Per-step work happens in the wrapper rather than in `on_train_batch_end`:
    a callback with batch-end hooks makes Keras convert every step's logs on
    the main thread, while the wrapper's `after` reads only what it needs,
    can set ``stop_training`` before Keras checks it, and adds its figures to
    the step's logs.

    Args:
        before: called with no argument before every call.
        after: called with the call's logs after every call.
        on_captured: called with the first call's `Capture` when
            `install(..., capture_first=True)`.
    """

    def __init__(self, before, after, on_captured):
        self._before = before
        self._after = after
        self._on_captured = on_captured
        self._installed = None  # (the wrapped function, the wrapper)

    def install(self, model, capture_first):
        """Replaces ``model.train_function`` by the wrapper (nothing when fit made none)."""
        from tfmetal_ext.inspect import capture as capture_mod

        fn = model.train_function
        if fn is None:
            return
        fn = getattr(fn, "_tfmetal_ext_inner", fn)  # left wrapped by a fit that raised
        if capture_first:
            traced = any(f._list_all_concrete_functions() for f in capture_mod._tf_functions(fn))
            if traced:  # cached from an earlier fit: a fresh function is captured when instantiated
                model.make_train_function(force=True)
                fn = model.train_function
        jit = getattr(model, "jit_compile", False) is True
        pending = [capture_first]
        before, after, on_captured = self._before, self._after, self._on_captured

        def train_step_with_checks(iterator):
            before()
            if pending[0]:
                pending[0] = False
                logs, cap = capture_mod.capture_call(fn, iterator, mode="train", jit_compile=jit)
                on_captured(cap)
            else:
                logs = fn(iterator)
            after(logs)
            return logs

        train_step_with_checks._tfmetal_ext_inner = fn
        model.train_function = train_step_with_checks
        self._installed = (model, fn, train_step_with_checks)

    def remove(self):
        """Puts the wrapped function back (unless something replaced the wrapper since)."""
        if self._installed is not None:
            model, fn, wrapper = self._installed
            if model.train_function is wrapper:
                model.train_function = fn
            self._installed = None


# Differences from the prediction listed in the summary (the rest are counted).
_MAX_DIFFERENCES = 10


def _predict(model, plugin):
    from tfmetal_ext import inspect

    return inspect.placement_report(model, mode="train", predict_for=plugin)


def compare_with_prediction(model, placement, caps=None, predict=None):
    """On a Mac: ``(predicted report, notes)`` where the real `placement` differs from the prediction.

    Only on a real Metal backend (not inside `devices.assume_backend`) with a
    known plugin; elsewhere ``(None, [])``. The prediction traces the
    model's train step again (nothing runs; `predict(model, plugin)`). A
    prediction that cannot be made is one note, never an error.
    """
    from tfmetal_ext import devices
    from tfmetal_ext.inspect import predict as predict_mod

    caps = caps or devices.capabilities()
    if caps.backend != "metal" or devices.assumed_backend() is not None or not caps.metal_plugin:
        return None, []
    try:
        predicted = (predict or _predict)(model, caps.metal_plugin)
    except Exception as e:  # arbitrary models: the real report stands on its own
        return None, [f"no placement prediction for {caps.metal_plugin} to compare with "
                      f"({type(e).__name__}: {e})"]
    notes = predict_mod.differences(placement, predicted, limit=_MAX_DIFFERENCES)
    if not notes:
        notes = [f"the real placement matches the {caps.metal_plugin} prediction"]
    return predicted, notes


class FirstStepReport:
    """The fusion and placement reports of the captured step, and the summary made from them.

    Args:
        report: ``"summary"``, ``"full"`` or None (see `MetalCallback`).
        check_fallback: make the placement report.
        strict: make the fusion report even when nothing is printed.
        print_fn: where the printed lines go.
    """

    def __init__(self, report="summary", check_fallback=True, strict=False, print_fn=print):
        self.report = report
        self.check_fallback = check_fallback
        self.strict = strict
        self.print_fn = print_fn
        self.predicted = None  # the PredictedPlacementReport compared with on a Mac

    @property
    def wanted(self):
        """The first step needs capturing: something is printed or checked."""
        return self.report is not None or self.strict or self.check_fallback

    def reports(self, cap, model, findings):
        """``(fusion_report, placement_report)`` of `cap`; None where not asked for or not captured.

        A step that was not captured is noted in `findings` (a `Findings`).
        """
        from tfmetal_ext import inspect

        if not cap.functions:
            findings.add("the train step's graph was not captured (instantiated before this fit)")
            return None, None
        fusion = inspect.report_from_capture(cap, model) if self.report is not None or self.strict else None
        placement = inspect.placement_from_capture(cap, model) if self.check_fallback else None
        self.predicted = None
        if placement is not None:
            self.predicted, notes = compare_with_prediction(model, placement)
            placement.notes.extend(notes)
        return fusion, placement

    def publish(self, model, findings, fusion_report, placement_report):
        """Prints the summary (or the full reports) as `report` asks; returns ``(summary, strict problems)``."""
        lines, problems = summarize(model, findings, fusion_report, placement_report)
        summary = "\n".join(lines)
        if self.report == "summary":
            self.print_fn(summary)
        elif self.report == "full":
            self.print_fn("\n".join(lines[: 1 + len(findings)]))
            for report in (fusion_report, placement_report):
                if report is not None:
                    self.print_fn(str(report))
        return summary, problems


def summarize(model, findings, fusion_report, placement_report):
    """The summary's lines (a header, `findings`, then the reports') and what `strict` raises on."""
    lines = ["MetalCallback:"] + [f"  {f}" for f in findings]
    problems = []
    if fusion_report is not None:
        lines += _fusion_lines(model, fusion_report, problems)
    if placement_report is not None:
        lines += _placement_lines(model, placement_report, problems)
    return lines, problems


def _stock_advice(model, path):
    return replacement_advice(find_layer(model, path), path)


def _fusion_lines(model, fr, problems):
    counts = {}
    for n in fr.fused:
        if not n.backward:
            counts[n.label()] = counts.get(n.label(), 0) + 1
    fused = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
    lines = [f"  train step: {fr.num_ops} ops per step; fused (forward): {fused}"]
    if getattr(fr, "optimizer_update", None) is not None:
        lines.append(f"  optimizer update: {fr.optimizer_update}")
    for r in fr.layers:
        if r.status not in _UNFUSED_STATUSES:
            continue
        advice = ""
        repl = replacement_advice(find_layer(model, r.path), r.path) if r.status != "partial" else None
        if repl:
            advice = f" -> use {repl}"
            problems.append(f"{r.path} ({r.layer_class}) is not fused{advice}")
        if r.status == "missed":
            problems.append(f"{r.path}: expected fusion missing ({r.reason})")
        lines.append(f"  {r.status}: {r.path} ({r.layer_class}, {r.pattern}): {r.reason or ''}{advice}")
    lines += [f"  note: {note}" for note in fr.notes]
    return lines


def round_trip_line(pr, top=6):
    """``"  N CPU round trips per step: Op in layer, ..."``: each op that ran on the CPU while the GPU waited.

    An op without a GPU kernel between GPU ops costs a copy out, a wait and a
    copy back every step; the line names the ops (most frequent first).
    """
    counts = collections.Counter(f"{f.op} in {f.layer or '(step)'}" for f in pr.fallbacks)
    n = len(pr.fallbacks)
    shown = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.most_common(top))
    more = f", and {len(counts) - top} more" if len(counts) > top else ""
    return f"  {n} CPU round trip{'' if n == 1 else 's'} per step: {shown}{more}"


def _placement_lines(model, pr, problems):
    notes = [f"  placement note: {n}" for n in pr.notes]
    if not pr.gpu_present:
        return ["  CPU fallback: none possible (no GPU present)"] + notes
    if not pr.fallbacks:
        return ["  CPU fallback: none", "  0 CPU round trips per step"] + notes
    lines = [round_trip_line(pr), f"  CPU fallback: {len(pr.fallbacks)} op(s) ran on the CPU:"]
    for f in pr.fallbacks:
        repl = _stock_advice(model, f.layer) if f.layer else None
        fix = f" -> use {repl}" if repl else " (no tfmetal_ext replacement; the op has no GPU kernel)"
        where = f"{f.op} in {f.layer or '(no layer)'}"
        lines.append(f"    {where}{fix}")
        problems.append(f"{where} fell back to the CPU")
    return lines + notes
