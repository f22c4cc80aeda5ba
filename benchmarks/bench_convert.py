"""keras.applications ResNet50 and MobileNetV2, stock vs `tfmetal_ext.convert`ed, in one process.

For each model (weights=None, 96x96x3 inputs, batch 16, 10 classes, float32 by default): compute ops per
train step and per inference call (post-grappler graph, `tfmetal_ext.inspect`), median train-step time
(SGD with momentum, `model.fit`'s own train function) and inference time, and the ratios; the converted
model's train step is timed with keras SGD (as stock) and with tfmetal_ext's FusedSGD. The training
form (`convert(model)`) is timed for both; the inference form (`convert(model, inference=True)`,
batch norms folded) for inference.

    .venv/bin/python benchmarks/bench_convert.py [--rounds 9] [--repeats 5] [--models ResNet50,MobileNetV2] [--size 96] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmetal_ext  # noqa: E402


def _compile(model, optimizer_cls=keras.optimizers.SGD):
    model.compile(optimizer=optimizer_cls(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _train_fn(model, x, y, optimizer_cls=keras.optimizers.SGD):
    _compile(model, optimizer_cls)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # build and trace
    it = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    fn = model.train_function
    return lambda: fn(it)


def _infer_fn(model, x):
    xt = tf.constant(x)
    predict = tf.function(lambda t: model(t, training=False))
    predict(xt)
    return lambda: predict(xt).numpy()


def _ops(model, x, y, mode, optimizer_cls=keras.optimizers.SGD):
    _compile(model, optimizer_cls)
    kw = {"targets": y} if mode == "train" else {}
    return tfmetal_ext.inspect.fusion_report(model, x, mode=mode, **kw).num_ops


def run(name, size, batch, repeats, rounds):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    stock = getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None)
    ours = tfmetal_ext.convert(stock, count_ops=False)
    # The same converted model (same weights), compiled with the package's one-op-per-variable SGD.
    ours_fused_opt = tfmetal_ext.convert(stock, count_ops=False, verify=False)
    deploy = tfmetal_ext.convert(stock, inference=True, count_ops=False)
    r = ours.conversion_report
    res = {
        "stock": dict(train_ops=_ops(stock, x, y, "train"), infer_ops=_ops(stock, x, y, "predict")),
        "ours": dict(train_ops=_ops(ours, x, y, "train"), infer_ops=_ops(ours, x, y, "predict")),
        "deploy": dict(infer_ops=_ops(deploy, x, y, "predict")),
        "fused_opt": dict(train_ops=_ops(ours_fused_opt, x, y, "train", tfmetal_ext.optimizers.FusedSGD)),
    }
    train = {
        "stock": _train_fn(stock, x, y),
        "ours": _train_fn(ours, x, y),
        "fused_opt": _train_fn(ours_fused_opt, x, y, tfmetal_ext.optimizers.FusedSGD),
    }
    infer = {k: _infer_fn(m, x) for k, m in (("stock", stock), ("ours", ours), ("deploy", deploy))}
    fns = {("train", k): fn for k, fn in train.items()}
    fns.update({("infer", k): fn for k, fn in infer.items()})
    times = paired_rounds(fns, rounds=rounds, repeats=repeats)

    def med(phase, k):
        return statistics.median(times[(phase, k)])

    def speedup(phase, k):
        return ratio(times, (phase, "stock"), (phase, k))

    for k in train:
        res[k]["train_ms"] = med("train", k)
    for k in infer:
        res[k]["infer_ms"] = med("infer", k)
    s, o, d, f = res["stock"], res["ours"], res["deploy"], res["fused_opt"]
    return dict(
        model=name, input=f"{size}x{size}x3", batch=batch, policy=keras.mixed_precision.global_policy().name,
        rewrites=len(r.rewrites), absorbed=len(r.absorbed), kept=len(r.kept),
        stock_train_ops=s["train_ops"], ours_train_ops=o["train_ops"], train_ops_ratio=o["train_ops"] / s["train_ops"],
        stock_infer_ops=s["infer_ops"], ours_infer_ops=o["infer_ops"], deploy_infer_ops=d["infer_ops"],
        stock_train_ms=s["train_ms"], ours_train_ms=o["train_ms"], train_speedup=speedup("train", "ours"),
        fused_sgd_train_ops=f["train_ops"], fused_sgd_train_ops_ratio=f["train_ops"] / s["train_ops"],
        fused_sgd_train_ms=f["train_ms"], fused_sgd_train_speedup=speedup("train", "fused_opt"),
        stock_infer_ms=s["infer_ms"], ours_infer_ms=o["infer_ms"], deploy_infer_ms=d["infer_ms"],
        infer_speedup=speedup("infer", "ours"), deploy_infer_speedup=speedup("infer", "deploy"),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant per round")
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds")
    parser.add_argument("--models", default="ResNet50,MobileNetV2")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--policy", default="float32")
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.policy)
    rows = [run(name, args.size, args.batch, args.repeats, args.rounds) for name in args.models.split(",")]
    columns = ["model", "input", "batch", "policy", "rewrites", "absorbed", "kept",
               "stock_train_ops", "ours_train_ops", "train_ops_ratio",
               "stock_infer_ops", "ours_infer_ops", "deploy_infer_ops",
               "stock_train_ms", "ours_train_ms", "train_speedup",
               "fused_sgd_train_ops", "fused_sgd_train_ops_ratio", "fused_sgd_train_ms", "fused_sgd_train_speedup",
               "stock_infer_ms", "ours_infer_ms", "deploy_infer_ms", "infer_speedup", "deploy_infer_speedup"]
    name = "bench_convert" if args.policy == "float32" else f"bench_convert_{args.policy}"
    write_results(name, rows, columns, notes=[
        "ops = compute nodes of the post-grappler graph per step (tfmetal_ext.inspect FusionReport.num_ops)",
        "ours = convert(model) (training form); deploy = convert(model, inference=True) (batch norms folded)",
        "times are medians (ms) across paired rounds (order rotated); speedup = median over rounds of "
        "stock / ours within the round; optimizer "
        "keras SGD(0.01, momentum=0.9) for stock and ours",
        "fused_sgd = the converted model compiled with tfmetal_ext.optimizers.FusedSGD(0.01, momentum=0.9) "
        "(one ResourceApplyKerasMomentum per variable) instead of keras SGD",
        "targets: ResNet50 train_ops_ratio <= 0.60, float32 train_speedup >= 1.3",
        "command: " + " ".join(["python", "benchmarks/bench_convert.py"] + list(argv or sys.argv[1:])),
    ])


if __name__ == "__main__":
    main()
