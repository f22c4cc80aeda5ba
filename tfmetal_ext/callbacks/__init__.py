"""Keras callbacks: `MetalCallback` checks, inspects and times a `model.fit` run.

>>> model.fit(x, y, callbacks=[tfmetal_ext.callbacks.MetalCallback()])
"""

from tfmetal_ext.callbacks.metal import MetalCallback, MetalCallbackError, PerformanceWarning

__all__ = ["MetalCallback", "MetalCallbackError", "PerformanceWarning"]
