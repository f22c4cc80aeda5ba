"""The export formats, as data: how each is made, what it needs, what checks it, how close it must be.

`FORMATS` is the one table `tfmetal_ext.export`, the CLI's ``export``, the benchmark matrix
(`benchmarks/bench_export.py`) and README's "Deploying" read. A row names:

* `route`: how the artifact is made (Keras' own ``model.export`` for the formats it has on the
  TensorFlow backend; coremltools' TF2 converter on a concrete function for Core ML);
* `modules` / `pip`: the Python modules the export and its check import, and the pip
  distributions that provide them (all in the ``[export]`` extra);
* `runtime`: what reloads the artifact to compare its outputs with the Keras model's;
* `suffix`: the file suffix Keras or the runtime expects ("" for a directory).

Tolerances: `FLOAT32_RTOL` is the documented precision of a float32 export (1e-5 of the output's
largest magnitude: the runtimes reorder sums and fuse multiply-adds, nothing else). A model whose
compute dtype is 16-bit is compared with `tfmetal_ext.conversion.verify.OUTPUT_RTOL` of that dtype,
the bound `convert()` verifies against.
"""

from __future__ import annotations

import dataclasses
import types

FLOAT32_RTOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Format:
    """One export format: see the module docstring."""

    name: str
    suffix: str
    route: str
    runtime: str
    modules: tuple
    pip: tuple
    note: str = ""


def _table(*rows):
    return types.MappingProxyType({r.name: r for r in rows})


FORMATS = _table(
    Format(
        "tf_saved_model", "", "keras model.export(format='tf_saved_model')",
        "tf.saved_model.load in a Python process without tfmetal_ext", (), (),
        note="TF Serving and every TensorFlow runtime load it",
    ),
    Format(
        "litert", ".tflite", "keras model.export(format='litert') (TFLite converter, builtin ops only)",
        "ai_edge_litert.interpreter", ("ai_edge_litert",), ("ai-edge-litert",),
    ),
    Format(
        "onnx", ".onnx", "keras model.export(format='onnx') (tf2onnx)", "onnxruntime (CPUExecutionProvider)",
        ("tf2onnx", "onnx", "onnxruntime"), ("tf2onnx", "onnx", "onnxruntime"),
        note="from ONNX, Apple's tools go on to an MPSGraphPackage",
    ),
    Format(
        "openvino", ".xml", "keras model.export(format='openvino')", "openvino (CPU plugin)",
        ("openvino",), ("openvino",),
    ),
    Format(
        "coreml", ".mlpackage", "coremltools.convert on the serving function (ML program)",
        "coremltools MLModel.predict on macOS; elsewhere the converted MIL program's op list",
        ("coremltools",), ("coremltools",),
        note="Core ML predicts on macOS only: off macOS the numeric check is left to a Mac (pytest -m metal)",
    ),
)


def get(name):
    """The `Format` called `name`.

    Raises:
        ValueError: no such format.
    """
    if name not in FORMATS:
        raise ValueError(f"`format` must be one of {', '.join(FORMATS)}. Received: format={name!r}")
    return FORMATS[name]


def missing_modules(fmt):
    """The modules of `fmt` that do not import here (their import errors kept short)."""
    import importlib

    missing = []
    for mod in fmt.modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # an ImportError, or a broken wheel raising anything at import
            missing.append(f"{mod} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    return missing
