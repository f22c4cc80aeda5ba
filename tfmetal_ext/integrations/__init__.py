"""Optional integrations with other Keras libraries, loaded only where that library is in use.

* `tfmetal_ext.integrations.keras_hub` (extra ``[hub]``): conversion planners
  and fusion-first subclasses for keras-hub's attention and RMS-norm layers.

An integration is imported by `load_available()`, which `convert()` calls: only
when its library is already imported (a model can only hold keras-hub layers
once keras-hub is imported), so ``import tfmetal_ext`` never imports keras-hub.
Import the integration module yourself to load a ``.keras`` file holding its
classes before anything else has loaded it.
"""

from __future__ import annotations

import importlib
import sys

# library module name -> the integration module that serves it (one row per integration)
INTEGRATIONS = {
    "keras_hub": "tfmetal_ext.integrations.keras_hub",
}


def load_available():
    """Imports the integration of every library in `INTEGRATIONS` that is already imported.

    Returns:
        The names of the integration modules now loaded.
    """
    loaded = []
    for library, module in INTEGRATIONS.items():
        if library in sys.modules:
            importlib.import_module(module)
            loaded.append(module)
    return loaded


def __getattr__(name):
    """``tfmetal_ext.integrations.keras_hub`` imports the integration (and its library) on first access."""
    module = INTEGRATIONS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(module)
