"""tfmetal-ext: Keras 3 extensions that make TensorFlow fuse, on Apple-silicon GPUs and elsewhere.

Public API: `configure`, `Config`, `convert` (returns a converted model whose
`conversion_report` is a `ConversionReport`), and the submodules `callbacks`, `devices`,
`backends` (what each backend has and fuses, as data), `conversion`, `deploy` (`export`: SavedModel, LiteRT, ONNX, OpenVINO, Core ML), `distribute`
(multi-worker `fit_compat`), `doctor`, `precision`, `inspect`, `layers`, `ops` and `optimizers`.

Importing it on macOS arm64 with a Metal plugin installed loads the op library, which registers
GPU kernels for the standard ops that backend has none for ("gap kernels", see
`tfmetal_ext.backends.gap_kernels`; ``TFMETAL_EXT_GAP_KERNELS_ENABLE=0`` turns that off). Elsewhere
the import loads nothing. On every host the import also puts Keras' ``argmax`` / ``argmin`` in a
form whose -0.0 test stays in floating point (`tfmetal_ext.keras_forms`: the same indices, no int32
ops a GPU would run on the host; ``TFMETAL_EXT_KERAS_FORMS=0`` keeps Keras' own).
"""

from tfmetal_ext import backends, callbacks, devices, inspect, layers, losses, ops, optimizers, precision
from tfmetal_ext import distribute, doctor, integrations
from tfmetal_ext._version import __version__
from tfmetal_ext.precision import Config, configure
from tfmetal_ext import conversion
from tfmetal_ext.conversion import ConversionReport, convert
from tfmetal_ext.conversion import to_stock
from tfmetal_ext import deploy
from tfmetal_ext.deploy import export

# On a Mac, the import registers the GPU kernels our op library has for standard ops the
# Metal backend lacks (tfmetal_ext.backends.gap_kernels): stock Keras models get them too.
ops._loader.load_for_gap_kernels()

# Keras' argmax / argmin (every accuracy metric's) with their -0.0 test in float, not through int32.
from tfmetal_ext import keras_forms  # noqa: E402

keras_forms.install()

__all__ = [
    "Config",
    "ConversionReport",
    "__version__",
    "backends",
    "callbacks",
    "configure",
    "conversion",
    "convert",
    "deploy",
    "devices",
    "distribute",
    "doctor",
    "export",
    "inspect",
    "keras_forms",
    "layers",
    "losses",
    "ops",
    "optimizers",
    "precision",
    "to_stock",
]
