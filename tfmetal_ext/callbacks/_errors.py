"""The warning and error classes `MetalCallback` issues (re-exported by `tfmetal_ext.callbacks`)."""


class PerformanceWarning(UserWarning):
    """A setting that costs speed on this backend (MetalCallback's train-begin checks)."""


class MetalCallbackError(RuntimeError):
    """Raised by a ``strict=True`` `MetalCallback` (CPU fallback, missed fusion, XLA on Metal)."""


# Named as before the callback was split into parts (tracebacks, pickles); metal.py re-exports both.
PerformanceWarning.__module__ = MetalCallbackError.__module__ = "tfmetal_ext.callbacks.metal"
