"""`MetalCallback`: what a `model.fit` run fuses, where it falls back, and how fast it steps.

The callback is thin: it validates its arguments and drives one part per
concern from its hooks:

* `_findings.Findings`: the train-begin checks;
* `_capture.TrainStepWrapper` / `FirstStepReport`: the wrapped train
  function, the first step's capture, its reports and summary;
* `_timing.StepTimer`: ``step_time_ms``, ``examples_per_second``, ``loss_scale``;
* `_nonfinite.NonFiniteLoss`: stop, warn or ignore on a NaN/Inf loss;
* `_profiling.StepProfiler`: the profiler window and its signposts;

all numbering steps with one `_steps.StepCounter`.
"""

from __future__ import annotations

import os
import types
import warnings

import keras

from tfmetal_ext import devices
from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED, STOCK_TO_FUSED
from tfmetal_ext.callbacks._capture import FirstStepReport, TrainStepWrapper
from tfmetal_ext.callbacks._errors import MetalCallbackError, PerformanceWarning
from tfmetal_ext.callbacks._findings import Findings
from tfmetal_ext.callbacks._model import steps_per_call
from tfmetal_ext.callbacks._nonfinite import MODES as _NONFINITE
from tfmetal_ext.callbacks._nonfinite import NonFiniteLoss
from tfmetal_ext.callbacks._profiling import StepProfiler, profile_window
from tfmetal_ext.callbacks._memory import memory_logs
from tfmetal_ext.callbacks._steps import StepCounter
from tfmetal_ext.callbacks._timing import StepTimer

__all__ = ["MetalCallback", "MetalCallbackError", "PerformanceWarning"]

_REPORTS = ("summary", "full", None)

# Read-only views of the fusion table (its home: tfmetal_ext.backends.fusion), kept under the
# names this module has always exported: stock class name -> what to use instead.
LAYER_REPLACEMENTS = types.MappingProxyType({k: r.suggestion for k, r in STOCK_TO_FUSED.items()})
OPTIMIZER_REPLACEMENTS = types.MappingProxyType({k: r.qualified for k, r in OPTIMIZER_TO_FUSED.items()})
DEFAULT_PROFILE_DIR = "logs"


class MetalCallback(keras.callbacks.Callback):
    """Checks and reports how a `model.fit` run uses the device.

    At train begin it checks the backend and the TensorFlow / tensorflow-metal
    pairing, the model's dtype policy against what `tfmetal_ext.configure()`
    would choose, XLA on Metal, and the optimizer; it then inspects the real
    train step (the first step ``fit`` runs, captured as it runs: nothing extra
    is computed, so training results are unchanged) and reports ops per step,
    fused and unfused patterns with reasons, and ops that fell back to the CPU
    with their layer and the replacement to use. The summary is printed after
    the first step.

    Every epoch it adds ``memory_mb`` (the host's current RSS in MB, from
    /proc/self/statm; the peak RSS where there is no /proc), on a GPU also
    ``gpu_memory_mb`` and ``gpu_peak_memory_mb`` (TF's allocator figures), and
    ``step_time_ms`` (median, the fit's first step
    excluded: it includes tracing and the inspection), ``examples_per_second``
    and, with a `keras.optimizers.LossScaleOptimizer`, ``loss_scale`` to the
    epoch logs, so they reach `History` and any `TensorBoard` / `CSVLogger`
    listed *after* this callback.

    Args:
        report: ``"summary"`` (a few lines), ``"full"`` (the full
            `FusionReport` and `PlacementReport`) or None (print nothing; the
            reports are still made when `strict` or `check_fallback` needs them).
        check_fallback: inspect placement: list ops that ran on the CPU while a
            GPU was present.
        on_nonfinite: on a NaN/Inf loss, ``"stop"`` training
            (``model.stop_training``), ``"warn"`` once, or ``"ignore"``. The
            step is named. Checking reads the loss every step, like Keras'
            `TerminateOnNaN`.
        log_every_n_steps: also add ``step_time_ms``, ``examples_per_second``
            (and ``loss_scale``) to the batch logs every n steps, and log them
            at INFO level on the ``tfmetal_ext`` logger. None: per epoch only.
        profile_steps: ``(start, stop)`` global step numbers (1-based,
            inclusive) or a single step: record a TF profiler trace of that
            window into `profile_dir` (open it with TensorBoard's Profile tab).
            On macOS each step in the window is also an os_signpost interval
            (subsystem ``tfmetal_ext``), visible in Instruments beside the GPU
            work; elsewhere the signposts are a no-op.
        profile_dir: where the trace goes; default ``"logs"`` (TensorBoard's
            default log_dir).
        strict: raise `MetalCallbackError` on CPU fallback, on an expected
            fusion that is missing or a stock layer left unfused where a
            tfmetal_ext layer would fuse, and on ``jit_compile=True`` on Metal
            (otherwise these are reported, and the XLA case warned about).
        print_fn: where report lines go; default `print`.

    Attributes:
        fusion_report: the `FusionReport` of the first train step (or None).
        placement_report: the `PlacementReport` of that step (or None). On a
            Mac its notes say where it differs from the predicted placement
            for the same plugin (`tfmetal_ext.inspect.placement_report(...,
            predict_for=...)`).
        predicted_placement_report: that prediction (a
            `PredictedPlacementReport`), on a Mac only; else None.
        findings: the train-begin findings, one string each.
        summary: the text printed after the first step.
        nonfinite_step: the global step (1-based) of the first non-finite
            loss, or None.
        profiled_steps: the steps the profiler window covered.

    Example:

    >>> model.fit(x, y, epochs=3, callbacks=[tfmetal_ext.callbacks.MetalCallback()])
    """

    def __init__(
        self,
        report="summary",
        check_fallback=True,
        on_nonfinite="stop",
        log_every_n_steps=None,
        profile_steps=None,
        profile_dir=None,
        strict=False,
        print_fn=None,
    ):
        super().__init__()
        if report not in _REPORTS:
            raise ValueError(f"`report` must be 'summary', 'full' or None. Received: report={report!r}")
        if not isinstance(check_fallback, bool):
            raise ValueError(f"`check_fallback` must be a bool. Received: check_fallback={check_fallback!r}")
        if on_nonfinite not in _NONFINITE:
            raise ValueError(
                f"`on_nonfinite` must be 'stop', 'warn' or 'ignore'. Received: on_nonfinite={on_nonfinite!r}"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                "`log_every_n_steps` must be None or a positive integer. "
                f"Received: log_every_n_steps={log_every_n_steps!r}"
            )
        if not isinstance(strict, bool):
            raise ValueError(f"`strict` must be a bool. Received: strict={strict!r}")
        if print_fn is not None and not callable(print_fn):
            raise ValueError(f"`print_fn` must be callable or None. Received: print_fn={print_fn!r}")
        self.report = report
        self.check_fallback = check_fallback
        self.on_nonfinite = on_nonfinite
        self.log_every_n_steps = log_every_n_steps
        self.profile_steps = profile_window(profile_steps)
        if profile_dir is not None and self.profile_steps is None:
            raise ValueError(
                "`profile_dir` is set but `profile_steps` is None: nothing would be profiled. "
                f"Received: profile_dir={profile_dir!r}, profile_steps=None"
            )
        if profile_dir is not None and not isinstance(profile_dir, (str, os.PathLike)):
            raise ValueError(f"`profile_dir` must be a path. Received: profile_dir={profile_dir!r}")
        self.profile_dir = os.fspath(profile_dir) if profile_dir is not None else DEFAULT_PROFILE_DIR
        self.strict = strict
        self._print = print_fn or print
        self._profiler = StepProfiler(self.profile_steps, self.profile_dir)
        self._reset()

    # ------------------------------------------------------------------
    # Per-run state: one instance serves several fits.

    def _reset(self):
        # The parts are made from the public attributes as they are now, so changes between fits apply.
        self.fusion_report = None
        self.placement_report = None
        self.predicted_placement_report = None
        self.summary = None
        self._warned = False
        self._findings = Findings(strict=self.strict)
        self.findings = self._findings.lines
        self._steps = StepCounter()
        self._timer = StepTimer(self.log_every_n_steps)
        self._nonfinite = NonFiniteLoss(self.on_nonfinite, self._print)
        self._inspection = FirstStepReport(self.report, self.check_fallback, self.strict, self._print)
        self._wrapper = TrainStepWrapper(self._before_step, self._after_step, self._on_first_step_captured)
        # The profiler keeps its loaded signposts across runs; only its window and directory follow.
        self._profiler.window, self._profiler.log_dir = self.profile_steps, self.profile_dir

    @property
    def nonfinite_step(self):
        """The global step (1-based) of the first non-finite loss of the last run, or None."""
        return self._nonfinite.step

    @property
    def profiled_steps(self):
        """The steps the profiler window covered in the last run."""
        return self._profiler.steps

    # ------------------------------------------------------------------
    # Hooks.

    def on_train_begin(self, logs=None):
        self._reset()
        try:
            self._findings.check(self.model, devices.capabilities())
        except MetalCallbackError:
            raise
        except Exception as e:  # the callback's own checks must never stop training
            self._inspection_failed("the train-begin checks", e)
        try:
            self._iterations_at_begin = int(self.model.optimizer.iterations.numpy())
        except Exception:
            self._iterations_at_begin = 0
        self._profiler.train_begin()
        self._wrapper.install(self.model, capture_first=self._inspection.wanted)

    def _steps_run(self):
        """Train steps this fit has run so far (the optimizer's iterations), or None.

        None under a `LossScaleOptimizer`: a step it skips (non-finite
        gradients, routine in the first steps of mixed_float16) does not count
        in `iterations`, so the calls' own ranges number the steps there.
        """
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return None
        try:
            return int(optimizer.iterations.numpy()) - self._iterations_at_begin
        except Exception:  # no optimizer yet, or not a Keras one: fall back to counting calls
            return None

    def on_epoch_begin(self, epoch, logs=None):
        self._timer.epoch_begin(self.model)

    def on_train_batch_begin(self, batch, logs=None):
        self._steps.batch_begin(batch, steps_per_call(self.model))

    def on_test_begin(self, logs=None):
        self._timer.training_done()  # validation runs after the epoch's training steps

    def on_epoch_end(self, epoch, logs=None):
        total = self.params.get("steps") if self.params else None
        stats = self._timer.epoch_stats(self.model, self._steps, total)
        stats.update(memory_logs())
        if logs is not None:
            logs.update(stats)
        self._steps.epoch_end(total, self._steps_run(), whole_last_call=True)

    def on_train_end(self, logs=None):
        self._profiler.stop()
        self._wrapper.remove()

    # ------------------------------------------------------------------
    # Around each call of the train function (see `TrainStepWrapper`).

    def _before_step(self):
        self._timer.call_begin(self.model, self._steps.first)
        self._profiler.call_begin(self._steps.first)

    def _after_step(self, logs):
        if self._steps.per_call > 1:  # only a call of several steps can be cut short by the data's end
            self._steps.call_end(self._steps_run())
        first, last = self._steps.first, self._steps.last
        self._profiler.call_end(first, last)
        self._nonfinite.check(self.model, logs, self._steps)
        self._timer.call_end(self.model, first, last, logs)

    def _inspection_failed(self, what, error):
        text = (
            f"MetalCallback: {what} failed ({type(error).__name__}: {error}); training goes on without "
            "them. Please report this with the model."
        )
        self._findings.add(text)
        if not self._warned:
            self._warned = True
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def _on_first_step_captured(self, cap):
        try:
            self.fusion_report, self.placement_report = self._inspection.reports(cap, self.model, self._findings)
            self.predicted_placement_report = self._inspection.predicted
            problems = self._report_first_step()
        except Exception as e:  # the step itself has run; only the inspection failed
            self.fusion_report = self.placement_report = None
            self._inspection_failed("the inspection of the first train step", e)
            return
        if self.strict and problems:
            # The step has run and its state is consistent: leave fit cleanly.
            self._profiler.stop()
            self._wrapper.remove()
            raise MetalCallbackError("strict MetalCallback: " + "; ".join(problems) + "\n" + self.summary)

    def _report_first_step(self):
        """Prints the first step's summary (or reports); returns the problems `strict` raises on."""
        self.summary, problems = self._inspection.publish(
            self.model, self.findings, self.fusion_report, self.placement_report
        )
        return problems
