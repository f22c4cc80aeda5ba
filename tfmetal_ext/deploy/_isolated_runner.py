"""Loads a saved model and runs it in a Python process WITHOUT tfmetal_ext.

Run as a script (never imported by the package):

    python _isolated_runner.py saved_model SAVED_MODEL_DIR INPUTS.npz OUTPUTS.npz STRUCTURE_JSON
    python _isolated_runner.py keras MODEL.keras INPUTS.npz OUTPUTS.npz STRUCTURE_JSON

``saved_model``: ``tf.saved_model.load`` and its ``serve`` endpoint (Keras' export); ``keras``:
``keras.saving.load_model`` and a call in inference mode.

`tfmetal_ext` is made unimportable before TensorFlow is imported (``sys.modules['tfmetal_ext'] =
None`` and every ``sys.path`` entry holding a ``tfmetal_ext`` package dropped), so neither its
Python code nor its op library can register anything: the SavedModel loads here only if it holds
stock TensorFlow ops (as in TF Serving), a .keras file only if it holds stock Keras objects. Writes the flat outputs ``out_0 ... out_{n-1}`` and the op
types of the loaded graph (``__ops__``); on failure exits 3 with the error on stderr.
"""

import json
import os
import sys


def _block_tfmetal_ext():
    sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "tfmetal_ext"))]
    sys.modules["tfmetal_ext"] = None  # `import tfmetal_ext` now raises ImportError
    try:
        import tfmetal_ext  # noqa: F401
    except ImportError:
        return
    raise SystemExit("tfmetal_ext is still importable: the check would prove nothing")


def _op_types(fn):
    """Op types of `fn`'s graphs and the functions they call (call ops themselves left out)."""
    ops = set()
    for cf in getattr(fn, "concrete_functions", ()):
        gd = cf.graph.as_graph_def()
        nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
        ops.update(n.op for n in nodes)
    return sorted(ops - {"PartitionedCall", "StatefulPartitionedCall", "Placeholder", "NoOp", "Identity"})


def main(argv):
    mode, path, inputs_path, outputs_path, structure = argv
    _block_tfmetal_ext()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    structure = json.loads(structure)
    data = np.load(inputs_path)
    flat = [data[f"in_{i}"] for i in range(len(data.files))]
    if structure["kind"] == "single":
        args = flat[0]
    elif structure["kind"] == "dict":
        args = dict(zip(structure["keys"], flat))
    else:
        args = list(flat)
    try:
        if mode == "keras":
            import keras

            loaded = keras.saving.load_model(path)
            result, fn = loaded(args, training=False), None
        else:
            loaded = tf.saved_model.load(path)
            result, fn = loaded.serve(args), loaded.serve
    except Exception as e:  # report the runtime's own error, whatever its type
        print(f"{type(e).__name__}: {' '.join(str(e).split())[:800]}", file=sys.stderr)
        return 3
    outs = [np.asarray(t) for t in tf.nest.flatten(result)]
    np.savez(outputs_path, __ops__=np.array(_op_types(fn) if fn is not None else [], dtype=str),
             **{f"out_{i}": o for i, o in enumerate(outs)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
