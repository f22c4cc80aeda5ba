"""Each format's own runtime: reload an exported artifact, run it, list its op types.

`run(fmt, path, flat_inputs, structure)` returns ``(outputs, ops, note)``: the artifact's flat
outputs (numpy, in the Keras model's output order) or None where this host cannot run the format
(Core ML off macOS), the sorted op types the artifact holds, and a note. A runtime that refuses the
artifact raises `RuntimeRefused` with its own message.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import numpy as np

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_isolated_runner.py")
# Seconds the SavedModel subprocess may take (interpreter + TensorFlow start, load, one call).
SUBPROCESS_TIMEOUT = 600


class RuntimeRefused(RuntimeError):
    """The format's runtime could not load or run the artifact (its message says why)."""


def input_structure(x):
    """``(flat inputs, structure)``: the structure is JSON-able and rebuilt by the runners."""
    if isinstance(x, dict):
        keys = list(x)
        return [np.asarray(x[k]) for k in keys], {"kind": "dict", "keys": keys}
    if isinstance(x, (list, tuple)):
        return [np.asarray(v) for v in x], {"kind": "list", "keys": None}
    return [np.asarray(x)], {"kind": "single", "keys": None}


def input_names(model, structure):
    """The names the runtimes give the inputs of `structure` (`input_structure`'s): a dict's keys, else
    the Keras model's input names, in `flat`'s order."""
    import keras

    if structure["kind"] == "dict":
        return list(structure["keys"])
    return [getattr(t, "name", f"input_{i}") for i, t in enumerate(keras.tree.flatten(model.inputs))]


def run(fmt, path, flat, structure, input_names):
    """Runs the artifact at `path` (format name `fmt`) on `flat` inputs; see the module docstring.

    `input_names` are the Keras model's input names in `flat`'s order (the runtimes name their
    inputs after them).
    """
    return _RUNNERS[fmt](path, flat, structure, input_names)


def _saved_model(path, flat, structure, input_names):
    return run_without_tfmetal_ext("saved_model", path, flat, structure)


def run_without_tfmetal_ext(mode, path, flat, structure):
    """``(outputs, ops, note)`` of the model at `path` loaded in a Python process without tfmetal_ext.

    `mode`: ``"saved_model"`` (``tf.saved_model.load``, its ``serve`` endpoint) or ``"keras"``
    (``keras.saving.load_model`` of a .keras file). Raises `RuntimeRefused` with the last line of
    the process's error when it cannot load or run it.
    """
    what = "tf.saved_model.load" if mode == "saved_model" else "keras.saving.load_model"
    with tempfile.TemporaryDirectory(prefix="tfmetal_ext_export_") as tmp:
        src, dst = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "outputs.npz")
        np.savez(src, **{f"in_{i}": a for i, a in enumerate(flat)})
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        try:
            proc = subprocess.run(
                [sys.executable, "-I", _RUNNER, mode, os.path.abspath(path), src, dst, json.dumps(structure)],
                capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=env, cwd=tmp,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeRefused(f"{what} did not finish within {SUBPROCESS_TIMEOUT} s") from None
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise RuntimeRefused(
                f"{what} in a process without tfmetal_ext failed: " + (lines[-1] if lines else
                                                                       f"exit {proc.returncode}")
            )
        data = np.load(dst)
        outs = [data[f"out_{i}"] for i in range(len(data.files) - 1)]
        ops = [str(o) for o in data["__ops__"]]
    return outs, ops, "loaded in a Python process without tfmetal_ext"


def _litert(path, flat, structure, input_names):
    from ai_edge_litert import interpreter as litert

    try:
        it = litert.Interpreter(model_path=path)
        runner = it.get_signature_runner()
        names = list(runner.get_input_details())
        feed = _by_name(names, input_names, flat)
        result = runner(**feed)
    except Exception as e:  # the interpreter raises ValueError / RuntimeError with its own text
        raise RuntimeRefused(f"the LiteRT interpreter refused it: {' '.join(str(e).split())[:600]}") from None
    outs = [result[k] for k in sorted(result, key=_trailing_int)]
    ops = sorted({d["op_name"] for d in it._get_ops_details()} - {"DELEGATE"})
    return outs, ops, ""


def _onnx(path, flat, structure, input_names):
    import onnx
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        feed = _by_name(names, input_names, flat)
        outs = sess.run(None, feed)
    except Exception as e:  # onnxruntime's Fail / InvalidGraph / InvalidArgument
        raise RuntimeRefused(f"onnxruntime refused it: {' '.join(str(e).split())[:600]}") from None
    ops = sorted({n.op_type for n in onnx.load(path, load_external_data=False).graph.node})
    return [np.asarray(o) for o in outs], ops, ""


def _openvino(path, flat, structure, input_names):
    import openvino as ov

    try:
        core = ov.Core()
        model = core.read_model(path)
        names = [i.get_any_name() for i in model.inputs]
        feed = _by_name(names, input_names, flat)
        # The CPU plugin infers in bfloat16 by default where the CPU has AVX512_BF16 or AMX: pinned
        # to float32, the precision a float32 export is documented and checked at.
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        result = compiled([feed[n] for n in names])
    except Exception as e:  # openvino raises RuntimeError with its own text
        raise RuntimeRefused(f"OpenVINO refused it: {' '.join(str(e).split())[:600]}") from None
    # The TF frontend also exposes dead-end tensors as results; the model's own outputs are the
    # serving function's `Identity`, `Identity_1`, ... tensors.
    # One result per output index: a tensor can reach several results (the same values).
    picked = {}
    for port in compiled.outputs:
        m = [n for n in port.get_names() if re.fullmatch(r"Identity(_\d+)?(:0)?", n)]
        if m:
            picked.setdefault(_trailing_int(m[0].split(":")[0]), result[port])
    outs = [picked[k] for k in sorted(picked)] or [result[p] for p in compiled.outputs]
    ops = sorted({o.get_type_name() for o in model.get_ordered_ops()} - {"Parameter", "Result", "Constant"})
    return [np.asarray(o) for o in outs], ops, ""


def _coreml(path, flat, structure, input_names):
    import coremltools as ct

    try:
        mlmodel = ct.models.MLModel(path, skip_model_load=platform.system() != "Darwin")
    except Exception as e:  # coremltools raises several types for an unreadable package
        raise RuntimeRefused(f"coremltools could not read it: {' '.join(str(e).split())[:600]}") from None
    spec = mlmodel.get_spec()
    ops = _mil_ops(spec)
    if platform.system() != "Darwin":
        return None, ops, "Core ML predicts on macOS only: the numeric check needs a Mac (pytest -m metal)"
    in_names = [i.name for i in spec.description.input]
    out_names = [o.name for o in spec.description.output]
    try:
        result = mlmodel.predict(_by_name(in_names, input_names, flat))
    except Exception as e:  # Core ML's own errors
        raise RuntimeRefused(f"Core ML refused it: {' '.join(str(e).split())[:600]}") from None
    return [np.asarray(result[n]) for n in out_names], ops, "predicted with Core ML"


def _mil_ops(spec):
    """Op types of an ML program spec's main function."""
    ops = set()
    prog = spec.mlProgram
    for fn in prog.functions.values():
        for block in fn.block_specializations.values():
            ops.update(op.type for op in block.operations)
    return sorted(ops - {"const"})


def _by_name(names, input_names, flat):
    """`flat` keyed by the runtime's input `names`: by the Keras input names, else in order."""
    if len(names) != len(flat):
        raise RuntimeRefused(f"the artifact takes {len(names)} inputs, the model {len(flat)}")

    def norm(n):
        return re.sub(r"(:\d+)$", "", n).split("serving_default_")[-1]

    wanted = {norm(n): i for i, n in enumerate(input_names)}
    if len(wanted) == len(flat) and all(norm(n) in wanted for n in names):
        return {n: flat[wanted[norm(n)]] for n in names}
    return dict(zip(names, flat))


def _trailing_int(name):
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else 0


_RUNNERS = {
    "tf_saved_model": _saved_model,
    "litert": _litert,
    "onnx": _onnx,
    "openvino": _openvino,
    "coreml": _coreml,
}
