"""A window of steps recorded by the TF profiler, each step an os_signpost interval on macOS."""

from __future__ import annotations

import logging
import warnings

from tfmetal_ext.callbacks._signpost import Signposts

logger = logging.getLogger("tfmetal_ext")


def profile_window(profile_steps):
    """``(start, stop)`` from a step number or a pair of 1-based step numbers; None stays None.

    Raises:
        ValueError: not a positive step number or a pair with start <= stop.
    """
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


class StepProfiler:
    """Profiles the calls whose first step falls in `window` (once per run).

    Never lets profiling break training: a profiler that cannot start or stop
    is warned about and the run goes on.

    Args:
        window: ``(start, stop)`` global steps (see `profile_window`), or None.
        log_dir: where the trace goes (TensorBoard's Profile tab reads it).

    Attributes:
        steps: the steps the window covered in this run.
    """

    def __init__(self, window, log_dir):
        self.window = window
        self.log_dir = log_dir
        self._signposts = None  # loaded once (on macOS a small dylib is built on first use)
        self.reset()

    def reset(self):
        """Forgets the last run."""
        self.steps = []
        self._running = False
        self._failed = False
        self._open = None  # (signpost token, step) of the interval in progress

    def train_begin(self):
        """A run begins: forget the last one and, with a window, load the signposts."""
        self.reset()
        if self.window is not None and self._signposts is None:
            self._signposts = Signposts.for_this_host()

    def call_begin(self, step):
        """A call whose first step is `step` begins: start the profiler or a signpost when in the window."""
        if self.window is None or self._failed or not self.window[0] <= step <= self.window[1]:
            return
        if not self._running and not self.steps:
            self._start()
        if self._running:
            self._open = (self._signposts.begin(step), step)

    def call_end(self, first, last):
        """The call of steps `first`..`last` has run: close its signpost; past the window, stop."""
        if not self._running:
            return
        self._end_signpost()
        self.steps.append(first)
        if last >= self.window[1]:
            self.stop()

    def stop(self):
        """Stops the profiler if it runs (at the window's end, at train end, or before a strict error)."""
        if not self._running:
            return
        import tensorflow as tf

        self._running = False
        self._end_signpost()
        try:
            tf.profiler.experimental.stop()
        except Exception as e:  # noqa: BLE001 - never let profiling break training
            warnings.warn(f"MetalCallback: could not stop the TF profiler: {e}", RuntimeWarning, stacklevel=3)

    def _start(self):
        import tensorflow as tf

        try:
            tf.profiler.experimental.start(self.log_dir)
        except Exception as e:  # another profiler session is running, or no profiler in this build
            warnings.warn(f"MetalCallback: could not start the TF profiler: {e}", RuntimeWarning, stacklevel=4)
            self._failed = True
            return
        self._running = True
        logger.info("profiling steps %s into %s", self.window, self.log_dir)

    def _end_signpost(self):
        if self._open is not None:
            token, step = self._open
            self._signposts.end(token, step)
            self._open = None
