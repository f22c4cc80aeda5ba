"""A NaN/Inf loss: stop training, warn once, or ignore it."""

from __future__ import annotations

import logging
import math
import warnings

logger = logging.getLogger("tfmetal_ext")

MODES = ("stop", "warn", "ignore")


def is_finite(value):
    """`value` is a finite number (anything that is not a number counts as finite)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True


class NonFiniteLoss:
    """Watches the loss of every call of the train function (one per run).

    Args:
        mode: ``"stop"`` (sets ``model.stop_training``), ``"warn"`` (a
            `RuntimeWarning`) or ``"ignore"``; only the first non-finite loss
            acts.
        print_fn: where the stop message goes (it is also logged).

    Attributes:
        step: the global step (1-based) of the first non-finite loss, or None.
    """

    def __init__(self, mode="stop", print_fn=print):
        self.mode = mode
        self.print_fn = print_fn
        self.step = None

    def check(self, model, logs, steps):
        """Checks the loss in `logs` of the call `steps` (a `StepCounter`) has just run."""
        if self.mode == "ignore" or self.step is not None or not isinstance(logs, dict):
            return
        loss = logs.get("loss")
        if loss is None or is_finite(loss):
            return
        self.step = steps.last
        if steps.first == steps.last:
            where = f"step {steps.last} (step {steps.in_epoch(steps.last)} of the epoch)"
        else:
            where = (
                f"steps {steps.first}-{steps.last} (steps_per_execution={steps.per_call}: the loss is "
                "read once per call)"
            )
        if self.mode == "stop":
            model.stop_training = True
            msg = f"MetalCallback: non-finite loss ({float(loss)}) at {where}; training stopped"
            logger.warning(msg)
            self.print_fn(msg)
        else:
            warnings.warn(f"MetalCallback: non-finite loss ({float(loss)}) at {where}", RuntimeWarning, stacklevel=2)
