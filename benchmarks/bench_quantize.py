"""int8 weight-only inference against float, one process: accuracy, weight bytes, latency, ops per call.

Three parts (issue 18's targets in brackets; timings depend on the CPU, the results name it):

1. Accuracy and weight bytes [int8 within 1 percentage point of float on held-out data; weight bytes
   <= 0.3x]. Two stock Keras models trained here on scikit-learn's digits (no download; 1437 training
   and 360 held-out images): the quickstart's digits classifier (Conv2D/BatchNormalization/ReLU stem, a
   residual block, a Dense head) and a ResNet-style net (three stages of basic blocks with strided
   projections, global pooling). Each is then converted with
   ``tfmetal_ext.convert(model, inference=True, quantize="int8")`` (batch norms folded, every eligible
   layer int8) and evaluated on the held-out images. Beside it: Keras' own ``model.quantize("int8")`` of
   the stock model (Keras 3.15 quantizes only Dense/EinsumDense/Embedding: its convolutions stay float).
   Weight bytes are the bytes of every weight of the model (int8 kernels 1 byte per element).
2. Ops per inference call [ours int8 <= stock Keras' quantized model], from the executed graph
   (`tfmetal_ext.inspect.fusion_report(...).num_ops`), for the same models.
3. Latency of one Dense layer, 4096 -> 4096 with bias, at batch 1 and 8 [int8 >= 1.5x float
   ``_FusedMatMul`` at batch 1]: ours float (`FusedDense`: ``_FusedMatMul[BiasAdd]``), ours int8
   (``TfmetalExt>Int8MatMul``), Keras' Dense float and Keras' Dense after ``quantize("int8")``, each a
   ``tf.function`` of the layer's inference call on a fixed input, timed in paired rounds (the order
   rotates each round; ratios are medians over rounds of within-round ratios).

    .venv/bin/python benchmarks/bench_quantize.py [--rounds 7] [--repeats 15] [--epochs 12]
    .venv/bin/python benchmarks/bench_quantize.py --quick     # small sizes, one epoch: checks it runs
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from _common import paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext import layers as L  # noqa: E402
from tfmetal_ext.backends import fusion  # noqa: E402

DENSE_SIZE = 4096
QUICK_DENSE_SIZE = 256
BATCHES = (1, 8)
INT8_OPS = frozenset(fusion.CUSTOM_OPS[k].name for k in ("int8_matmul", "int8_conv2d"))


# ----------------------------------------------------------------------------
# Models and data.


def load_digits_split():
    """The quickstart's digits split: 80 % training, 20 % held out, shuffled with seed 0."""
    import quickstart

    return quickstart.load_data()


def digits_classifier():
    """The quickstart's stock-Keras digits classifier."""
    import quickstart

    return quickstart.build_model(stock=True)


# A short training run: with Keras' default 0.99 the moving statistics have not settled after a few
# hundred steps, and the inference-mode accuracy says more about that than about the weights.
BN_MOMENTUM = 0.9


def _basic_block(x, filters, stride, name):
    y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv1")(x)
    y = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_bn2")(y)
    if stride != 1 or x.shape[-1] != filters:
        x = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_proj_bn")(x)
    return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([x, y]))


def resnet_style(widths=(32, 64, 128)):
    """A small ResNet (basic blocks, strided 1x1 projections, global pooling) from stock Keras layers."""
    inputs = keras.Input((8, 8, 1), name="digits")
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    for i, w in enumerate(widths):
        x = _basic_block(x, w, 1 if i == 0 else 2, f"stage{i + 1}a")
        x = _basic_block(x, w, 1, f"stage{i + 1}b")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(128, activation="relu", name="fc")(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet_style")


MODELS = {"digits classifier": digits_classifier, "ResNet-style": resnet_style}


def train(model, data, epochs, seed=0):
    (x_train, y_train), _ = data
    keras.utils.set_random_seed(seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0, shuffle=True)
    return model


def accuracy(model, data):
    _, (x_test, y_test) = data
    logits = model.predict(x_test, batch_size=128, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == y_test))


def weight_bytes(model):
    """Bytes of every weight of `model` (each variable's elements times its dtype's size)."""
    return int(sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.weights))


def keras_int8(model):
    """A copy of `model` quantized by Keras itself (``model.quantize("int8")``: its Dense layers)."""
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns for every layer it cannot quantize (the convs)
        clone.quantize("int8")
    return clone


def accuracy_rows(names, epochs, data):
    rows = []
    _, (x_test, _) = data
    x_ops = x_test[:8]
    for name in names:
        stock = train(MODELS[name](), data, epochs)
        ours_float = tfmetal_ext.convert(stock, inference=True, count_ops=False)
        ours = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
        theirs = keras_int8(stock)
        acc = {k: accuracy(m, data) for k, m in
               (("float", stock), ("ours_float", ours_float), ("ours_int8", ours), ("keras_int8", theirs))}
        size = {k: weight_bytes(m) for k, m in
                (("float", stock), ("ours_float", ours_float), ("ours_int8", ours), ("keras_int8", theirs))}
        reports = {k: tfmetal_ext.inspect.fusion_report(m, x_ops, mode="predict") for k, m in
                   (("float", stock), ("ours_float", ours_float), ("ours_int8", ours), ("keras_int8", theirs))}
        ops = {k: r.num_ops for k, r in reports.items()}
        int8_ops = sum(n for op, n in reports["ours_int8"].ops_by_type.items() if op in INT8_OPS)
        rows.append({
            "model": name,
            "epochs": epochs,
            "float_acc": round(acc["float"], 4),
            "ours_int8_acc": round(acc["ours_int8"], 4),
            "delta_pp": round(100 * (acc["ours_int8"] - acc["float"]), 2),
            "keras_int8_acc": round(acc["keras_int8"], 4),
            "float_bytes": size["float"],
            "ours_int8_bytes": size["ours_int8"],
            "bytes_ratio": round(size["ours_int8"] / size["float"], 3),
            "bytes_ratio_vs_folded": round(size["ours_int8"] / size["ours_float"], 3),
            "keras_int8_bytes_ratio": round(size["keras_int8"] / size["float"], 3),
            "float_ops": ops["float"],
            "ours_float_ops": ops["ours_float"],
            "ours_int8_ops": ops["ours_int8"],
            "keras_int8_ops": ops["keras_int8"],
            "ours_int8_custom_ops": int8_ops,
        })
    return rows


# ----------------------------------------------------------------------------
# One Dense layer: float vs int8, ours vs Keras'.


def dense_variants(size, seed=0):
    """name -> a built one-layer model (size -> size, bias), all with the same float kernel and bias."""
    rng = np.random.default_rng(seed)
    kernel = (rng.standard_normal((size, size)) / np.sqrt(size)).astype("float32")
    bias = (0.1 * rng.standard_normal(size)).astype("float32")
    out = {}
    for name, cls, int8 in (("ours float", L.FusedDense, False), ("ours int8", L.FusedDense, True),
                            ("keras float", keras.layers.Dense, False), ("keras int8", keras.layers.Dense, True)):
        layer = cls(size, name="dense")
        model = keras.Sequential([keras.Input((size,)), layer], name=name.replace(" ", "_"))
        layer.set_weights([kernel, bias])
        if int8:
            layer.quantize("int8")
        out[name] = model
    return out


def latency_rows(size, rounds, repeats):
    rows = []
    models = dense_variants(size)
    for batch in BATCHES:
        x = tf.constant(np.random.default_rng(batch).standard_normal((batch, size)).astype("float32"))
        fns, ops, kinds = {}, {}, {}
        for name, model in models.items():
            predict = tf.function(lambda t, m=model: m(t, training=False))
            predict(x)
            fns[name] = (lambda p=predict: p(x).numpy())
            report = tfmetal_ext.inspect.fusion_report(predict, x)
            ops[name] = report.num_ops
            kinds[name] = ",".join(sorted(op for op in report.ops_by_type
                                          if op.startswith(("_Fused", "MatMul", fusion.CUSTOM_OP_PREFIX))))
        times = paired_rounds(fns, rounds=rounds, repeats=repeats)
        med = {k: float(np.median(v)) for k, v in times.items()}
        rows.append({
            "dense": f"{size}x{size}",
            "batch": batch,
            "ours_float_ms": round(med["ours float"], 3),
            "ours_int8_ms": round(med["ours int8"], 3),
            "keras_float_ms": round(med["keras float"], 3),
            "keras_int8_ms": round(med["keras int8"], 3),
            "int8_vs_float_fusedmatmul": round(ratio(times, "ours float", "ours int8"), 2),
            "int8_vs_keras_int8": round(ratio(times, "keras int8", "ours int8"), 2),
            "int8_vs_keras_float": round(ratio(times, "keras float", "ours int8"), 2),
            "ours_float_op": kinds["ours float"],
            "ours_int8_op": kinds["ours int8"],
            "ours_int8_ops": ops["ours int8"],
            "keras_int8_ops": ops["keras int8"],
            "ours_float_ops": ops["ours float"],
        })
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=12, help="training epochs of the accuracy models")
    parser.add_argument("--quick", action="store_true", help="small Dense, one round, one epoch: checks it runs")
    parser.add_argument("--parts", default="accuracy,latency", help="comma-separated: accuracy, latency")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated accuracy models")
    parser.add_argument("--output", default="bench_quantize")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - {"accuracy", "latency"})
    names = [n for n in args.models.split(",") if n]
    unknown_models = sorted(set(names) - set(MODELS))
    if unknown or unknown_models:
        parser.error(f"unknown parts {unknown} / models {unknown_models}")
    if args.quick:
        args.rounds, args.repeats, args.epochs = 1, 3, 1
    size = QUICK_DENSE_SIZE if args.quick else DENSE_SIZE
    out = {}
    if "accuracy" in parts:
        rows = accuracy_rows(names, args.epochs, load_digits_split())
        out["accuracy"] = rows
        _write(f"{args.output}_accuracy", rows, ("model",), ["accuracy rows: held-out accuracy of the stock float model and of "
                     "convert(inference=True, quantize='int8'); bytes_ratio = int8 weight bytes / stock float "
                     "weight bytes (bytes_ratio_vs_folded: / the folded float form); *_ops = compute ops per "
                     "inference call from the executed graph, batch 8"])
    if "latency" in parts:
        rows = latency_rows(size, args.rounds, args.repeats)
        out["latency"] = rows
        _write(f"{args.output}_latency", rows, ("dense", "batch"), [f"latency rows: one Dense {size}->{size} with bias; ms = median of per-round medians; "
                     "ratios = median over rounds of (other / ours int8) within a round: > 1 means ours int8 "
                     "is faster"])
    return out


def _write(name, rows, first, notes):
    columns = list(first) + [k for k in rows[0] if k not in first]
    write_results(name, rows, columns, notes)


if __name__ == "__main__":
    main()
