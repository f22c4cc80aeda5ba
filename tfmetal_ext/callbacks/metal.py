"""`MetalCallback`: what a `model.fit` run fuses, where it falls back, and how fast it steps."""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
import warnings

import keras

from tfmetal_ext import devices, precision
from tfmetal_ext.callbacks._signpost import Signposts

logger = logging.getLogger("tfmetal_ext")

_REPORTS = ("summary", "full", None)
_NONFINITE = ("stop", "warn", "ignore")
DEFAULT_PROFILE_DIR = "logs"

# Stock Keras classes (by class name, module keras.*) -> the tfmetal_ext replacement.
LAYER_REPLACEMENTS = {
    "Conv2D": "tfmetal_ext.layers.FusedConv2D",
    "DepthwiseConv2D": "tfmetal_ext.layers.FusedDepthwiseConv2D",
    "Dense": "tfmetal_ext.layers.FusedDense",
    "BatchNormalization": "tfmetal_ext.layers.FusedBatchNorm (or ConvBNAct after a conv)",
    "LayerNormalization": "tfmetal_ext.layers.FusedLayerNorm",
    "LSTM": "tfmetal_ext.layers.FusedLSTM",
    "GRU": "tfmetal_ext.layers.FusedGRU",
}
OPTIMIZER_REPLACEMENTS = {
    "Adam": "tfmetal_ext.optimizers.FusedAdam",
    "AdamW": "tfmetal_ext.optimizers.FusedAdamW",
    "SGD": "tfmetal_ext.optimizers.FusedSGD",
}
_UNFUSED_STATUSES = ("missed", "not fused", "partial")


class PerformanceWarning(UserWarning):
    """A setting that costs speed on this backend (MetalCallback's train-begin checks)."""


class MetalCallbackError(RuntimeError):
    """Raised by a ``strict=True`` `MetalCallback` (CPU fallback, missed fusion, XLA on Metal)."""


def _is_stock(obj):
    return type(obj).__module__.startswith("keras.")


def _leaf_layers(model):
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return list(model.layers)
    return [l for l in flatten(include_self=False, recursive=True) if not getattr(l, "_layers", None)]


def _fmt_ops(op, fused_ops):
    return f"{op}[{', '.join(fused_ops)}]" if fused_ops else op


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

    Every epoch it adds ``step_time_ms`` (median, the fit's first step
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
        placement_report: the `PlacementReport` of that step (or None).
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
        self.profile_steps = self._window(profile_steps)
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
        self._signposts = None
        self._reset()

    # ------------------------------------------------------------------
    # Per-run state.

    @staticmethod
    def _window(profile_steps):
        if profile_steps is None:
            return None
        value = profile_steps
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value, value)
        ok = (
            isinstance(value, (tuple, list))
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
            and value[0] <= value[1]
        )
        if not ok:
            raise ValueError(
                "`profile_steps` must be a positive step number or a pair (start, stop) of "
                f"1-based step numbers with start <= stop. Received: profile_steps={profile_steps!r}"
            )
        return int(value[0]), int(value[1])

    def _reset(self):
        self.fusion_report = None
        self.placement_report = None
        self.findings = []
        self.summary = None
        self.nonfinite_step = None
        self.profiled_steps = []
        self._step = 0  # global 1-based number of the current step
        self._epoch_base = 0
        self._begin_times = []  # (step, perf_counter) of this epoch's batch begins
        self._train_end = None
        self._profiling = False
        self._signpost_token = None
        self._interval_start = None  # (time, examples, step) where the current log interval began
        self._profile_failed = False
        self._wrapped = None
        self._epoch_examples_start = 0.0

    # ------------------------------------------------------------------
    # Train begin: environment, policy, XLA and optimizer checks.

    def on_train_begin(self, logs=None):
        self._reset()
        caps = devices.capabilities()
        self._check_environment(caps)
        self._check_policy(caps)
        self._check_xla(caps)
        self._check_optimizer()
        if self.profile_steps is not None and self._signposts is None:
            self._signposts = Signposts.for_this_host()
        self._install_step_wrapper()

    def _finding(self, text, warn=False):
        self.findings.append(text)
        if warn:
            warnings.warn(f"MetalCallback: {text}", PerformanceWarning, stacklevel=3)

    def _check_environment(self, caps):
        metal = caps.metal_plugin_version or "not installed"
        self._finding(
            f"backend {caps.backend}; TensorFlow {caps.tf_version}, Keras {caps.keras_version}, "
            f"tensorflow-metal {metal} (pairing: {caps.pairing})"
        )
        if caps.pairing == devices.KNOWN_BROKEN:
            self._finding(
                f"TensorFlow {caps.tf_version} with tensorflow-metal {metal} is a known-broken pairing; "
                f"fix: {caps.pairing_fix}",
                warn=True,
            )

    def _check_policy(self, caps):
        model_policy = self.model.dtype_policy.name
        recommended = precision.recommend()
        if model_policy != recommended.policy:
            why = "; ".join(r for r in recommended.reasons if "jit" not in r.lower() and "XLA" not in r)
            self._finding(
                f"dtype policy: model {model_policy}, configure() would choose {recommended.policy} ({why})"
            )
        else:
            self._finding(f"dtype policy: {model_policy} (what configure() chooses here)")
        avoided = sorted(precision.avoided_fusions())
        if avoided:
            self._finding(
                f"avoided fusions (configure(avoid_fusions=...)): {', '.join(avoided)}: "
                "those layers emit their safe unfused form"
            )
        if caps.backend == "metal":
            f32 = [
                l.name
                for l in _leaf_layers(self.model)
                if l.weights and getattr(l.dtype_policy, "compute_dtype", None) == "float32"
            ]
            if f32:
                shown = ", ".join(f32[:5]) + (f", ... ({len(f32)} in all)" if len(f32) > 5 else "")
                self._finding(
                    f"{len(f32)} layer(s) compute in float32 on Metal ({shown}): half kernels are faster; "
                    "call tfmetal_ext.configure() (mixed_float16) before building the model",
                    warn=True,
                )
        elif caps.backend == "cpu":
            computes_half = any(
                getattr(l.dtype_policy, "compute_dtype", None) == "float16" for l in _leaf_layers(self.model)
            )
            if computes_half and not caps.cpu_fp16:
                self._finding(
                    "float16 compute on a CPU without native float16: the remapper skips half nodes, so "
                    "nothing fuses; use mixed_bfloat16 or float32 (tfmetal_ext.configure() picks)",
                    warn=True,
                )

    def _check_xla(self, caps):
        jit = getattr(self.model, "jit_compile", False)
        if caps.backend == "metal" and jit is True:
            text = (
                "jit_compile=True on Metal: tensorflow-metal has no XLA compiler (\"Could not find compiler "
                "for platform METAL\"); compile with jit_compile=False so the remapper fuses"
            )
            if self.strict:
                raise MetalCallbackError(text)
            self._finding(text, warn=True)

    def _check_optimizer(self):
        opt = getattr(self.model, "optimizer", None)
        inner = getattr(opt, "inner_optimizer", opt)  # LossScaleOptimizer wraps the real one
        if inner is None:
            return
        name = type(inner).__name__
        if _is_stock(inner) and name in OPTIMIZER_REPLACEMENTS:
            self._finding(
                f"optimizer: stock keras {name} issues many small ops per variable per step; "
                f"{OPTIMIZER_REPLACEMENTS[name]} takes the same arguments and runs one fused op per variable"
            )

    # ------------------------------------------------------------------
    # Steps: a thin wrapper around the train function `fit` calls.
    #
    # Per-step work happens in the wrapper rather than in `on_train_batch_end`:
    # a callback with batch-end hooks makes Keras convert every step's logs on
    # the main thread, while the wrapper reads only the loss (and only when
    # `on_nonfinite` asks), sets `stop_training` before Keras checks it, and
    # adds its figures to the step's logs.

    def _wants_inspection(self):
        return self.report is not None or self.strict or self.check_fallback

    def _install_step_wrapper(self):
        from tfmetal_ext.inspect import capture as capture_mod

        model = self.model
        fn = model.train_function
        if fn is None:
            return
        fn = getattr(fn, "_tfmetal_ext_inner", fn)  # left wrapped by a fit that raised
        if self._wants_inspection():
            traced = any(f._list_all_concrete_functions() for f in capture_mod._tf_functions(fn))
            if traced:  # cached from an earlier fit: a fresh function is captured when instantiated
                model.make_train_function(force=True)
                fn = model.train_function
        jit = getattr(model, "jit_compile", False) is True
        callback = self
        inspect_first = [self._wants_inspection()]

        def train_step_with_checks(iterator):
            callback._before_step()
            if inspect_first[0]:
                inspect_first[0] = False
                logs, cap = capture_mod.capture_call(fn, iterator, mode="train", jit_compile=jit)
                callback._on_first_step_captured(cap)
            else:
                logs = fn(iterator)
            callback._after_step(logs)
            return logs

        train_step_with_checks._tfmetal_ext_inner = fn
        model.train_function = train_step_with_checks
        self._wrapped = (fn, train_step_with_checks)

    def _unwrap(self):
        if self._wrapped is not None:
            fn, wrapper = self._wrapped
            if self.model.train_function is wrapper:
                self.model.train_function = fn
            self._wrapped = None

    def _on_first_step_captured(self, cap):
        from tfmetal_ext import inspect

        if not cap.functions:
            self._finding("the train step's graph was not captured (instantiated before this fit)")
        else:
            if self.report is not None or self.strict:
                self.fusion_report = inspect.report_from_capture(cap, self.model)
            if self.check_fallback:
                self.placement_report = inspect.placement_from_capture(cap, self.model)
        problems = self._report_first_step()
        if self.strict and problems:
            # The step has run and its state is consistent: leave fit cleanly.
            self._stop_profiler()
            self._unwrap()
            raise MetalCallbackError("strict MetalCallback: " + "; ".join(problems) + "\n" + self.summary)

    def _unfused_rows(self):
        if self.fusion_report is None:
            return []
        return [r for r in self.fusion_report.layers if r.status in _UNFUSED_STATUSES + ("unexpected",)]

    def _replacement(self, layer_class):
        return LAYER_REPLACEMENTS.get(layer_class)

    def _find_layer(self, layer_name):
        for l in _leaf_layers(self.model):
            if layer_name is not None and (l.name == layer_name or layer_name.endswith("/" + l.name)):
                return l
        return None

    def _report_first_step(self):
        lines = ["MetalCallback:"] + [f"  {f}" for f in self.findings]
        strict_problems = []
        fr = self.fusion_report
        if fr is not None:
            counts = {}
            for n in fr.fused:
                if not n.backward:
                    counts[n.label()] = counts.get(n.label(), 0) + 1
            fused = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
            lines.append(f"  train step: {fr.num_ops} ops per step; fused (forward): {fused}")
            for r in self._unfused_rows():
                advice = ""
                stock_layer = self._find_layer(r.path)
                if r.status != "partial" and stock_layer is not None and _is_stock(stock_layer):
                    repl = self._replacement(r.layer_class)
                    if repl:
                        advice = f" -> use {repl}"
                        strict_problems.append(f"{r.path} ({r.layer_class}) is not fused{advice}")
                if r.status == "missed":
                    strict_problems.append(f"{r.path}: expected fusion missing ({r.reason})")
                lines.append(f"  {r.status}: {r.path} ({r.layer_class}, {r.pattern}): {r.reason or ''}{advice}")
            for note in fr.notes:
                lines.append(f"  note: {note}")
        pr = self.placement_report
        if pr is not None:
            if not pr.gpu_present:
                lines.append("  CPU fallback: none possible (no GPU present)")
            elif not pr.fallbacks:
                lines.append("  CPU fallback: none")
            else:
                lines.append(f"  CPU fallback: {len(pr.fallbacks)} op(s) ran on the CPU:")
                for f in pr.fallbacks:
                    layer = self._find_layer(f.layer) if f.layer else None
                    repl = self._replacement(type(layer).__name__) if layer is not None and _is_stock(layer) else None
                    fix = f" -> use {repl}" if repl else " (no tfmetal_ext replacement; the op has no GPU kernel)"
                    lines.append(f"    {f.op} in {f.layer or '(no layer)'}{fix}")
                    strict_problems.append(f"{f.op} in {f.layer or '(no layer)'} fell back to the CPU")
        self.summary = "\n".join(lines)
        if self.report == "summary":
            self._print(self.summary)
        elif self.report == "full":
            self._print("\n".join(lines[: 1 + len(self.findings)]))
            if fr is not None:
                self._print(str(fr))
            if pr is not None:
                self._print(str(pr))
        return strict_problems

    # ------------------------------------------------------------------
    # Steps.

    def on_epoch_begin(self, epoch, logs=None):
        self._begin_times = []
        self._train_end = None
        self._epoch_examples_start = self._examples_seen()
        self._interval_start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._step = self._epoch_base + batch + 1

    def _before_step(self):
        now = time.perf_counter()
        self._begin_times.append((self._step, now))
        if self.log_every_n_steps and self._interval_start is None and self._step > 1:
            self._interval_start = (now, self._examples_seen(), self._step)
        window = self.profile_steps
        if window is not None and not self._profile_failed and window[0] <= self._step <= window[1]:
            if not self._profiling and not self.profiled_steps:
                self._start_profiler()
            if self._profiling:
                self._signpost_token = self._signposts.begin(self._step)

    def _after_step(self, logs):
        step = self._step + self._steps_per_call() - 1  # the last step this call ran
        if self._profiling:
            self._signposts.end(self._signpost_token or 0, self._step)
            self._signpost_token = None
            self.profiled_steps.append(self._step)
            if step >= self.profile_steps[1]:
                self._stop_profiler()
        if self.on_nonfinite != "ignore" and self.nonfinite_step is None and isinstance(logs, dict):
            loss = logs.get("loss")
            if loss is not None and not _finite(loss):
                self._nonfinite(step, float(loss))
        n = self.log_every_n_steps
        if n and isinstance(logs, dict) and step // n > (self._step - 1) // n:
            stats = self._interval_stats(step)
            if stats:
                logs.update(stats)
                logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items())))

    def _steps_per_call(self):
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def _nonfinite(self, step, loss):
        self.nonfinite_step = step
        first = self._step  # the first step of this call (several with steps_per_execution > 1)
        epoch_step = step - self._epoch_base
        if first == step:
            where = f"step {step} (step {epoch_step} of the epoch)"
        else:
            where = (
                f"steps {first}-{step} (steps_per_execution={self._steps_per_call()}: the loss is "
                "read once per call)"
            )
        if self.on_nonfinite == "stop":
            self.model.stop_training = True
            msg = f"MetalCallback: non-finite loss ({loss}) at {where}; training stopped"
            logger.warning(msg)
            self._print(msg)
        else:
            warnings.warn(f"MetalCallback: non-finite loss ({loss}) at {where}", RuntimeWarning, stacklevel=2)

    def on_test_begin(self, logs=None):
        # Validation runs after the epoch's training steps: their end is now.
        if self._train_end is None and self._begin_times:
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        end = self._train_end if self._train_end is not None else time.perf_counter()
        stats = self._epoch_stats(end)
        if logs is not None:
            logs.update(stats)
        if self._begin_times:
            self._epoch_base = self._step_after_epoch()
        self._begin_times = []

    def on_train_end(self, logs=None):
        self._stop_profiler()
        self._unwrap()

    # ------------------------------------------------------------------
    # Timing and loss-scale figures.

    def _examples_seen(self):
        """Examples the loss tracker has counted this epoch (Keras weights it by batch size)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        count = getattr(tracker, "count", None)
        if count is None:
            return None
        try:
            return float(count.numpy())
        except Exception:  # a custom train_step may leave it unbuilt
            return None

    def _step_after_epoch(self):
        last_step, _ = self._begin_times[-1]
        per_call = self._steps_per_call()
        total = self.params.get("steps") if self.params else None
        if total:
            return self._epoch_base + min(total, last_step - self._epoch_base + per_call - 1)
        return last_step + per_call - 1

    def _durations(self, end):
        """Per-step durations (ms) of this epoch's calls, the fit's first step excluded."""
        times = self._begin_times
        out = []
        for i, (step, t) in enumerate(times):
            t_next = times[i + 1][1] if i + 1 < len(times) else end
            steps = (times[i + 1][0] - step) if i + 1 < len(times) else max(
                1, self._step_after_epoch() - step + 1
            )
            if step == 1:
                continue  # tracing + inspection
            out.append((t_next - t) * 1e3 / max(1, steps))
        return out

    def _loss_scale(self):
        opt = getattr(self.model, "optimizer", None)
        scale = getattr(opt, "dynamic_scale", None) if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None
        return None if scale is None else float(keras.ops.convert_to_numpy(scale))

    def _epoch_stats(self, end):
        stats = {}
        durations = self._durations(end)
        if durations:
            step_ms = statistics.median(durations)
            stats["step_time_ms"] = step_ms
            seen = self._examples_seen()
            steps = self._step_after_epoch() - self._epoch_base if self._begin_times else 0
            if seen is not None and steps:
                per_step = (seen - (self._epoch_examples_start or 0.0)) / steps
                stats["examples_per_second"] = per_step / (statistics.fmean(durations) / 1e3)
        scale = self._loss_scale()
        if scale is not None:
            stats["loss_scale"] = scale
        return stats

    def _interval_stats(self, step):
        """Figures since the interval began (never including the fit's first step)."""
        if self._interval_start is None:
            return {}
        now = time.perf_counter()
        start_time, start_examples, start_step = self._interval_start
        self._interval_start = None  # the next interval starts at the next batch begin
        steps = step - start_step + 1
        stats = {"step_time_ms": (now - start_time) * 1e3 / steps}
        seen = self._examples_seen()
        if seen is not None and start_examples is not None and seen >= start_examples:
            stats["examples_per_second"] = (seen - start_examples) / (now - start_time)
        scale = self._loss_scale()
        if scale is not None:
            stats["loss_scale"] = scale
        return stats

    # ------------------------------------------------------------------
    # Profiling.

    def _start_profiler(self):
        import tensorflow as tf

        try:
            tf.profiler.experimental.start(self.profile_dir)
        except Exception as e:  # another profiler session is running, or no profiler in this build
            warnings.warn(f"MetalCallback: could not start the TF profiler: {e}", RuntimeWarning, stacklevel=3)
            self._profile_failed = True
            return
        self._profiling = True
        logger.info("profiling steps %s into %s", self.profile_steps, self.profile_dir)

    def _stop_profiler(self):
        if not self._profiling:
            return
        import tensorflow as tf

        self._profiling = False
        if self._signpost_token is not None:
            self._signposts.end(self._signpost_token, self._step)
            self._signpost_token = None
        try:
            tf.profiler.experimental.stop()
        except Exception as e:  # noqa: BLE001 - never let profiling break training
            warnings.warn(f"MetalCallback: could not stop the TF profiler: {e}", RuntimeWarning, stacklevel=3)


def _finite(value):
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True
