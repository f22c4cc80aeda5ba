"""Global step numbers across a fit's epochs, per call of the train function."""

from __future__ import annotations


class StepCounter:
    """Numbers a fit's steps from 1 across epochs.

    One call of the train function runs `per_call` steps
    (``steps_per_execution``): `first` to `last`.
    """

    def __init__(self):
        self.first = 0  # the first step of the current call
        self.per_call = 1
        self.epoch_base = 0  # steps run in the epochs before this one
        self._began = False  # a call began this epoch

    def batch_begin(self, batch, per_call):
        """Keras' `batch` (0-based within the epoch) begins a call of `per_call` steps."""
        self.first = self.epoch_base + batch + 1
        self.per_call = per_call
        self._began = True

    @property
    def last(self):
        """The last step the current call runs."""
        return self.first + self.per_call - 1

    def in_epoch(self, step):
        """`step`'s 1-based number within its epoch."""
        return step - self.epoch_base

    def epoch_last(self, total=None):
        """The epoch's last step so far: the current call's, cut at the epoch's `total` steps."""
        if total:
            return self.epoch_base + min(total, self.last - self.epoch_base)
        return self.last

    def _step_count(self, ran):
        """`ran` as an int when it can be the fit's step count now (inside the current call's range), else None."""
        if ran is None or not self._began:
            return None
        ran = int(ran)
        return ran if self.first <= ran <= self.last else None

    def call_end(self, ran=None):
        """The current call has returned; `ran` is the fit's steps so far, when known.

        A call that the data cut short (a finite dataset ending inside a
        ``steps_per_execution`` call) ran fewer than `per_call` steps: with
        `ran` its range ends at the last step that ran (a `ran` outside
        the call's range is not a step count and is ignored).
        """
        ran = self._step_count(ran)
        if ran is not None:
            self.per_call = ran - self.first + 1

    def epoch_end(self, total=None, ran=None, whole_last_call=False):
        """Closes the epoch (of `total` steps, when known): the next numbers follow on.

        `ran` is the steps the fit has run so far, when known (the optimizer's
        iterations): Keras' last call of an epoch runs a whole
        ``steps_per_execution`` even past ``steps_per_epoch`` while the data
        lasts, and fewer when the data runs out, so `total` alone can't tell
        where the next epoch starts. Without `ran`, `whole_last_call` takes the
        last call as run whole (Keras' rule while the data lasts); otherwise
        the epoch ends at `total`. A `ran` outside the last call's range is
        not a step count (a custom train step that never applies
        ``model.optimizer``, or applies it twice) and is ignored.
        """
        ran = self._step_count(ran)
        if ran is not None:
            self.epoch_base = ran
        elif self._began:
            self.epoch_base = self.last if whole_last_call else self.epoch_last(total)
        self._began = False
