"""tfmetal-ext: Keras 3 extensions that make TensorFlow fuse, on Apple-silicon GPUs and elsewhere.

Public API: `configure`, `Config`, and the submodules `callbacks`, `devices`,
`doctor`, `precision`, `inspect`, `layers`, `ops` and `optimizers`.
"""

from tfmetal_ext import callbacks, devices, doctor, inspect, layers, ops, optimizers, precision
from tfmetal_ext._version import __version__
from tfmetal_ext.precision import Config, configure

__all__ = [
    "Config",
    "__version__",
    "callbacks",
    "configure",
    "devices",
    "doctor",
    "inspect",
    "layers",
    "ops",
    "optimizers",
    "precision",
]
