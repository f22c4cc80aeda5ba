"""Step timing: ``step_time_ms``, ``examples_per_second`` and ``loss_scale`` for the epoch and batch logs."""

from __future__ import annotations

import logging
import statistics
import time

import keras

logger = logging.getLogger("tfmetal_ext")


def examples_seen(model):
    """Examples the loss tracker has counted this epoch (Keras weights it by batch size), or None."""
    count = getattr(getattr(model, "_loss_tracker", None), "count", None)
    if count is None:
        return None
    try:
        return float(count.numpy())
    except Exception:  # a custom train_step may leave it unbuilt
        return None


def loss_scale(model):
    """The dynamic loss scale of a `keras.optimizers.LossScaleOptimizer`, or None."""
    opt = getattr(model, "optimizer", None)
    scale = getattr(opt, "dynamic_scale", None) if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None
    return None if scale is None else float(keras.ops.convert_to_numpy(scale))


class StepTimer:
    """Times the calls of the train function; one per run.

    The fit's first step is never timed: it includes tracing and the
    inspection.

    Args:
        log_every_n_steps: every n steps, add the figures since the last
            time to the batch logs (and log them at INFO); None: per epoch only.
    """

    def __init__(self, log_every_n_steps=None):
        self.log_every_n_steps = log_every_n_steps
        self._begins = []  # (first step, perf_counter) of this epoch's calls
        self._train_end = None
        self._epoch_examples = 0.0
        self._interval = None  # (time, examples, step) where the current log interval began

    def epoch_begin(self, model):
        self._begins = []
        self._train_end = None
        self._epoch_examples = examples_seen(model)
        self._interval = None

    def call_begin(self, model, step):
        """A call whose first step is `step` begins."""
        now = time.perf_counter()
        self._begins.append((step, now))
        if self.log_every_n_steps and self._interval is None and step > 1:
            self._interval = (now, examples_seen(model), step)

    def call_end(self, model, first, last, logs):
        """The call of steps `first`..`last` returned `logs`: add the interval's figures when one ends."""
        n = self.log_every_n_steps
        if n and isinstance(logs, dict) and last // n > (first - 1) // n:
            stats = self._interval_stats(model, last)
            if stats:
                logs.update(stats)
                logger.info("step %d: %s", last, ", ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items())))

    def training_done(self):
        """The epoch's training steps have ended (validation runs after them)."""
        if self._train_end is None and self._begins:
            self._train_end = time.perf_counter()

    def epoch_stats(self, model, steps, total=None):
        """The epoch's figures; `steps` is the `StepCounter`, `total` the epoch's step count if known."""
        end = self._train_end if self._train_end is not None else time.perf_counter()
        stats = {}
        durations = self._durations(end, steps.epoch_last(total))
        if durations:
            stats["step_time_ms"] = statistics.median(durations)
            seen = examples_seen(model)
            count = steps.epoch_last(total) - steps.epoch_base
            if seen is not None and count:
                per_step = (seen - (self._epoch_examples or 0.0)) / count
                stats["examples_per_second"] = per_step / (statistics.fmean(durations) / 1e3)
        return self._with_loss_scale(model, stats)

    def _durations(self, end, last):
        """Per-step durations (ms) of this epoch's calls, the fit's first step excluded."""
        out = []
        for i, (step, t) in enumerate(self._begins):
            if i + 1 < len(self._begins):
                t_next, steps = self._begins[i + 1][1], self._begins[i + 1][0] - step
            else:
                t_next, steps = end, last - step + 1
            if step != 1:
                out.append((t_next - t) * 1e3 / max(1, steps))
        return out

    def _interval_stats(self, model, last):
        """Figures since the interval began (never including the fit's first step)."""
        if self._interval is None:
            return {}
        now = time.perf_counter()
        start_time, start_examples, start_step = self._interval
        self._interval = None  # the next interval starts at the next call
        stats = {"step_time_ms": (now - start_time) * 1e3 / (last - start_step + 1)}
        seen = examples_seen(model)
        if seen is not None and start_examples is not None and seen >= start_examples:
            stats["examples_per_second"] = (seen - start_examples) / (now - start_time)
        return self._with_loss_scale(model, stats)

    @staticmethod
    def _with_loss_scale(model, stats):
        scale = loss_scale(model)
        if scale is not None:
            stats["loss_scale"] = scale
        return stats
