"""Deploying: `export(model, path, format=...)` writes a model of tfmetal_ext layers in a format that
runs without tfmetal_ext, and checks it with the format's own runtime in the same call.

While the export traces the model (`portable_forms()`), every tfmetal_ext layer emits stock
TensorFlow ops only: the custom ops' pure-TF references, Keras' own code where the layer has a stock
parent (attention, the keras-hub layers), Keras' own recurrent loop, and the int8 layers' matmul
by the int8 kernel with the accumulator de-quantized (Keras' own weight-only int8 form; the kernel
stays int8 in the artifact). What the custom ops fused in training is left to the target's own compiler to fuse again
(TFLite's FULLY_CONNECTED with its fused activation, ONNX Runtime's and OpenVINO's graph fusions,
Core ML's MIL passes). The formats, their runtimes and tolerances are data: `formats.FORMATS`.

For a `.keras` file that loads without tfmetal_ext, see `tfmetal_ext.to_stock`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

from tfmetal_ext.deploy import formats as _formats
from tfmetal_ext.deploy.formats import FLOAT32_RTOL, FORMATS, Format

# The formats `export(float16=True)` applies to.
FLOAT16_FORMATS = ("litert", "coreml")
# The largest batch a Core ML export takes (its flexible batch axis needs an upper bound).
COREML_MAX_BATCH = 1024

__all__ = ["ExportError", "ExportReport", "FORMATS", "Format", "export", "portable_forms"]


class ExportError(RuntimeError):
    """An export that could not be made, or whose artifact its runtime refused or ran differently.

    Attributes:
        report: the `ExportReport` so far (None when nothing was written).
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class ExportReport:
    """What `export` wrote and how its check went.

    Attributes:
        format: the format's name (a `formats.FORMATS` key).
        path: the artifact's path (a file, or a directory for tf_saved_model / coreml).
        size_bytes: the artifact's size on disk.
        checked_with: the runtime that ran it (`Format.runtime`).
        max_rel_error: max over outputs of max |keras - artifact| / max |keras|; None when the
            runtime cannot run here (Core ML off macOS).
        tolerance: the bound `max_rel_error` was held to.
        ops: the op types the artifact holds (as its runtime lists them).
        int8: the export was of the int8 deployment form.
        float16: the artifact holds float16 weights (LiteRT) or computes in float16 (Core ML).
        note: what else the check says (e.g. that the numeric check needs a Mac).
    """

    format: str
    path: str
    size_bytes: int = 0
    checked_with: str = ""
    max_rel_error: float | None = None
    tolerance: float | None = None
    ops: list = dataclasses.field(default_factory=list)
    int8: bool = False
    float16: bool = False
    note: str = ""

    @property
    def numerically_checked(self):
        return self.max_rel_error is not None

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        if self.max_rel_error is not None:
            err = f"{self.max_rel_error:.3g} (bound {self.tolerance:g})"
        else:
            err = "not checked" if self.tolerance is None else "not run here"
        lines = [
            f"exported {self.format}{' (int8)' if self.int8 else ''}{' (float16)' if self.float16 else ''}: {self.path} ({_human(self.size_bytes)})",
            f"  checked with {self.checked_with}: max relative error {err}",
            f"  ops ({len(self.ops)}): {', '.join(self.ops)}",
        ]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


@contextlib.contextmanager
def portable_forms():
    """Within the block, in this context, tfmetal_ext layers trace to stock TensorFlow ops only.

    For exporting by hand (``with portable_forms(): model.export(...)``, a `tf.function` traced
    inside); `export` uses it. Graphs traced before the block keep what they hold.
    """
    from tfmetal_ext import _env

    with _env.scope(portable=True):
        yield


def export(model, path, format="tf_saved_model", *, int8=False, float16=False, verify=True, inputs=None, batch_size=2, seed=0,
           tolerance=None, verbose=False, **kwargs):
    """Exports `model` (built from tfmetal_ext layers or not) to `path` in `format`, checked.

    The model is traced in `portable_forms()` and written by the format's route
    (`formats.FORMATS`): Keras' own ``model.export`` for ``"tf_saved_model"``, ``"litert"``,
    ``"onnx"`` and ``"openvino"``; coremltools' TF2 converter (an ML program) for ``"coreml"``.
    Then, unless ``verify=False``, the artifact is reloaded with the format's runtime
    (``tf.saved_model.load`` in a Python process without tfmetal_ext, the LiteRT interpreter,
    onnxruntime, OpenVINO, Core ML on macOS) and its outputs on the verify inputs compared with the
    Keras model's: within `formats.FLOAT32_RTOL` (1e-5 relative) for a float32 model, within
    `convert()`'s bound of the compute dtype for a mixed-precision one. Off macOS the Core ML check
    reads the converted program's op list back and says the numeric check needs a Mac.

    Args:
        model: a built `keras.Model`.
        path: where to write: a directory for ``tf_saved_model`` and ``coreml`` (``.mlpackage``),
            a file with the format's suffix otherwise (``.tflite``, ``.onnx``, ``.xml``).
        format: a `formats.FORMATS` name.
        int8: export the int8 deployment form: ``convert(model, inference=True,
            quantize="int8")`` (verified against the float inference form there), whose int8
            layers export as a matmul by the int8 kernel with the accumulator de-quantized; the
            check compares with that int8 model.
        float16: LiteRT: float16 weights (the converter's float16 quantization: half the size,
            float32 compute); Core ML: float16 compute precision (Core ML's default for ML
            programs; without it the export computes in float32). Checked within
            `tfmetal_ext.conversion.verify.OUTPUT_RTOL` of float16, the bound a model computing
            in float16 is verified to, which covers rounding the weights alone. Other formats:
            ValueError.
        verify: run the artifact and compare (default); False only writes it.
        inputs: the inputs to compare on (the model's input structure); default: synthetic inputs
            of `batch_size` rows drawn with `seed` (`tfmetal_ext.conversion.verify.make_inputs`).
        tolerance: a relative bound to use instead of the format's.
        verbose: passed to ``model.export``.
        **kwargs: passed to the route (``model.export``'s format options, e.g. LiteRT converter
            settings; ``coremltools.convert`` options for ``"coreml"``).

    Returns:
        An `ExportReport`.

    Raises:
        ValueError: an unknown format, a model that is not a built `keras.Model`, or a `path`
            that cannot be written.
        ImportError: the format's modules are not installed (the message names the extra).
        ExportError: the converter failed (the message names the working route), or the runtime
            refused the artifact or ran it beyond the tolerance (the artifact is removed).
    """
    import keras

    fmt = _formats.get(format)
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    if not model.built:
        raise ValueError(f"`model` must be built (call it once or give it an input shape). Received: model={model!r}")
    path = os.fspath(path)
    _check_path(fmt, path)
    missing = _formats.missing_modules(fmt)
    if missing:
        raise ImportError(
            f"format={fmt.name!r} needs {', '.join(fmt.pip)}; not importable here: {'; '.join(missing)}. "
            "Install them with: pip install 'tfmetal-ext[export]'"
        )
    if float16 and fmt.name not in FLOAT16_FORMATS:
        raise ValueError(f"`float16` applies to {' and '.join(FLOAT16_FORMATS)} exports. "
                         f"Received: float16={float16!r}, format={fmt.name!r}")
    if float16 and fmt.name == "litert":
        import tensorflow as tf

        kwargs = {"optimizations": [tf.lite.Optimize.DEFAULT], "target_spec": {"supported_types": [tf.float16]},
                  **kwargs}
    if fmt.name == "coreml":
        kwargs = {"compute_precision": "float16" if float16 else "float32", **kwargs}
    if int8:
        from tfmetal_ext.conversion import convert

        model = convert(model, inference=True, quantize="int8", verify=verify, count_ops=False,
                        batch_size=batch_size, seed=seed, inputs=inputs)
    x = _inputs(model, inputs, batch_size, seed)
    expected = _keras_outputs(model, x)  # also calls the model once (the ONNX route needs a called model)
    report = ExportReport(fmt.name, path, checked_with=fmt.runtime, int8=bool(int8), float16=bool(float16))
    if float16 and tolerance is None:
        from tfmetal_ext.conversion.verify import OUTPUT_RTOL

        tolerance = OUTPUT_RTOL["float16"]
    _write(model, fmt, path, x, verbose, kwargs)
    report.size_bytes = artifact_size(path)
    if not verify:
        report.note = "not checked (verify=False)"
        return report
    _check(model, fmt, path, x, expected, tolerance, report)
    return report


# ----------------------------------------------------------------------------
# Steps.


def _check_path(fmt, path):
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"the directory to export into does not exist: {parent}. Received: path={path!r}")
    if fmt.suffix and not path.endswith(fmt.suffix):
        raise ValueError(f"a {fmt.name} export is a {fmt.suffix} file (its runtime expects the suffix). "
                         f"Received: path={path!r}")
    if fmt.suffix and fmt.suffix != ".mlpackage" and os.path.isdir(path):
        raise ValueError(f"`path` is a directory; a {fmt.name} export is a file. Received: path={path!r}")


def _inputs(model, inputs, batch_size, seed):
    if inputs is not None:
        return inputs
    from tfmetal_ext.conversion.verify import make_inputs

    try:
        return make_inputs(model, batch_size, seed)
    except ValueError as e:  # no synthetic batch for this model (strings, unknown shapes)
        raise ValueError(
            f"export() needs a batch to check the artifact with and cannot make one ({e}); pass "
            "export(..., inputs=x), a batch the model accepts. Received: inputs=None"
        ) from None


def _keras_outputs(model, x):
    from tfmetal_ext.conversion.verify import as_numpy_list

    return as_numpy_list(model(x, training=False))


def _write(model, fmt, path, x, verbose, kwargs):
    try:
        with portable_forms():
            if fmt.name == "coreml":
                _write_coreml(model, path, x, kwargs)
            else:
                model.export(path, format=fmt.name, verbose=verbose, **kwargs)
    except (ImportError, ValueError, TypeError) as e:
        if isinstance(e, ImportError) or "Received" in str(e):
            raise
        raise ExportError(_route_failed(fmt, e)) from e
    except Exception as e:  # converters raise anything (ConverterError, NotImplementedError, RuntimeError)
        raise ExportError(_route_failed(fmt, e)) from e


def _route_failed(fmt, e):
    import tensorflow as tf

    text = " ".join(str(e).split())[:600]
    if fmt.name == "coreml" and "gather" in text and "int8" in text:
        return (f"{fmt.route} failed: coremltools' gather takes no int8 table, so an int8 Embedding (Keras' "
                f"own, which convert(quantize='int8') makes) does not convert; Keras' own int8 model fails the "
                f"same. The working route: export the float model with float16=True (half the size), or "
                f"format='tf_saved_model' / 'onnx' with int8. ({type(e).__name__}: {text[:300]})")
    other = "tf_saved_model" if fmt.name != "tf_saved_model" else "onnx"
    return (f"{fmt.route} failed on TensorFlow {tf.__version__}: {type(e).__name__}: {text}. The working route: "
            f"export format={other!r} (checked the same way) and convert that artifact with the target's tools")


def _write_coreml(model, path, x, kwargs):
    import coremltools as ct
    import keras
    import tensorflow as tf

    flat = keras.tree.flatten(x)
    specs = [tf.TensorSpec([None, *np_shape[1:]], tf.as_dtype(np_dtype))
             for np_shape, np_dtype in ((a.shape, a.dtype) for a in (_np(t) for t in flat))]

    def serve(*args):
        return model(keras.tree.pack_sequence_as(x, list(args)), training=False)

    fn = tf.function(serve).get_concrete_function(*specs)
    # Batch sizes 1 to COREML_MAX_BATCH (an ML program needs a finite bound; pass `inputs=` to
    # coremltools for others): the other axes as the verify inputs have them.
    names = [a.name.split(":")[0] for a in fn.inputs]
    types_ = [ct.TensorType(name=n, shape=ct.Shape([ct.RangeDim(1, COREML_MAX_BATCH, default=int(s.shape[0] or 1)),
                                                     *[int(d) for d in s.shape[1:]]]))
              for n, s in zip(names, (_np(t) for t in flat))]
    precision = {"float16": ct.precision.FLOAT16, "float32": ct.precision.FLOAT32}.get(
        kwargs.get("compute_precision"), kwargs.get("compute_precision"))
    kw = {"convert_to": "mlprogram", "minimum_deployment_target": ct.target.macOS13, "inputs": types_,
          **kwargs, "compute_precision": precision}
    mlmodel = ct.convert([fn], source="tensorflow", **kw)
    mlmodel.save(path)


def _np(t):
    import numpy as np

    return np.asarray(t)


def output_tolerance(model):
    """The relative bound an exported or reloaded `model` is held to (see `formats`)."""
    import keras

    from tfmetal_ext.conversion.verify import OUTPUT_RTOL

    policy = getattr(model, "dtype_policy", None)
    compute = keras.mixed_precision.Policy(policy.name).compute_dtype if policy is not None else "float32"
    return FLOAT32_RTOL if compute == "float32" else OUTPUT_RTOL.get(compute, FLOAT32_RTOL)


def _check(model, fmt, path, x, expected, tolerance, report):
    import keras

    from tfmetal_ext.deploy import runtimes

    flat, structure = runtimes.input_structure(keras.tree.map_structure(_np, x))
    names = runtimes.input_names(model, structure)
    report.tolerance = float(tolerance) if tolerance is not None else output_tolerance(model)
    try:
        outs, ops, note = runtimes.run(fmt.name, path, flat, structure, names)
    except runtimes.RuntimeRefused as e:
        _remove(path)
        raise ExportError(f"{e} ({path} removed)", report) from None
    report.ops, report.note = list(ops), note
    if outs is None:
        return
    if len(outs) != len(expected):
        _remove(path)
        raise ExportError(f"the {fmt.name} artifact gives {len(outs)} outputs, the Keras model {len(expected)} "
                          f"({path} removed)", report)
    report.max_rel_error = max_rel_error(expected, outs)
    if not report.max_rel_error <= report.tolerance:  # NaN fails too
        _remove(path)
        raise ExportError(
            f"the {fmt.name} artifact run with {fmt.runtime} differs from the Keras model: max relative error "
            f"{report.max_rel_error:.3g} > {report.tolerance:g} ({path} removed)", report)


def max_rel_error(expected, outs):
    """Max over outputs of max |keras - artifact| / max |keras| (`verify.rel_diff`); the artifact's
    outputs reshaped where only unit axes differ (Core ML and OpenVINO may keep or drop them)."""
    import numpy as np

    from tfmetal_ext.conversion.verify import rel_diff

    errs = []
    for e, o in zip(expected, outs):
        o = np.asarray(o, dtype="float64")
        errs.append(rel_diff(e, o.reshape(e.shape) if o.shape != e.shape and o.size == e.size else o))
    return max(errs) if errs else 0.0


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
    # OpenVINO writes the weights beside the .xml.
    if path.endswith(".xml") and os.path.exists(path[:-4] + ".bin"):
        os.remove(path[:-4] + ".bin")


def artifact_size(path):
    """Bytes on disk of an artifact (a directory's files; an OpenVINO .xml with its .bin)."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    total = os.path.getsize(path) if os.path.exists(path) else 0
    if path.endswith(".xml") and os.path.exists(path[:-4] + ".bin"):
        total += os.path.getsize(path[:-4] + ".bin")
    return total


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"

