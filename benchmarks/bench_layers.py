"""ResNet-20 (CIFAR-shaped, 32x32x3, batch 64): stock Keras layers vs tfmetal_ext layers, one process.

Reports, for float32 and mixed_bfloat16 on this host: compute ops per train step and per inference
call (from the post-grappler graph), median train-step and inference times, and ours/stock ratios,
plus the train step of the same convolutions alone (the ceiling of any gain from the other layers),
and the kernel launches of a one-ResidualBlock train step before and after TfmetalExt>BatchNormAct.

    .venv/bin/python benchmarks/bench_layers.py [--rounds 9] [--repeats 5] [--policies float32,mixed_bfloat16]
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/bench_layers.py --policies float32   # no oneDNN (AVX2 / Mac CPU path)
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
from tfmetal_ext import layers as fl  # noqa: E402

STAGES = (16, 32, 64)
BLOCKS_PER_STAGE = 3


def _identity(name):
    return keras.layers.Identity(name=name)


def stock_resnet20(convs_only=False):
    """The stock model; `convs_only` drops every batch norm and ReLU (the same convolutions, nothing else).

    The convolutions-only step is the floor no change to the other layers can go below: stock
    step time / its step time is the largest speed-up fusing the batch norms and activations can give.
    """
    bn = _identity if convs_only else (lambda name: keras.layers.BatchNormalization(name=name))
    relu = _identity if convs_only else (lambda name: keras.layers.ReLU(name=name))
    inp = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem_conv")(inp)
    x = bn("stem_bn")(x)
    x = relu("stem_relu")(x)
    channels = 16
    for s, filters in enumerate(STAGES):
        for b in range(BLOCKS_PER_STAGE):
            strides = 2 if (b == 0 and s > 0) else 1
            name = f"s{s}b{b}"
            shortcut = x
            y = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False, name=f"{name}_c1")(x)
            y = bn(f"{name}_bn1")(y)
            y = relu(f"{name}_r1")(y)
            y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_c2")(y)
            y = bn(f"{name}_bn2")(y)
            if strides != 1 or channels != filters:
                shortcut = keras.layers.Conv2D(filters, 1, strides=strides, use_bias=False, name=f"{name}_pc")(x)
                shortcut = bn(f"{name}_pbn")(shortcut)
            x = keras.layers.Add(name=f"{name}_add")([y, shortcut])
            x = relu(f"{name}_out")(x)
            channels = filters
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    out = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inp, out, name="resnet20_stock")


def fused_resnet20():
    inp = keras.Input((32, 32, 3))
    x = fl.ConvBNAct(16, 3, name="stem")(inp)
    for s, filters in enumerate(STAGES):
        for b in range(BLOCKS_PER_STAGE):
            strides = 2 if (b == 0 and s > 0) else 1
            x = fl.ResidualBlock(filters, strides=strides, name=f"s{s}b{b}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    out = fl.FusedDense(10, name="logits")(x)
    return keras.Model(inp, out, name="resnet20_fused")


def _copy_weights(stock, ours):
    """Copies the stock model's weights into ours, layer by layer (conv + its BN -> ConvBNAct)."""
    def pair(conv, bn):
        return stock.get_layer(conv).get_weights() + stock.get_layer(bn).get_weights()

    ours.get_layer("stem").set_weights(pair("stem_conv", "stem_bn"))
    for s in range(len(STAGES)):
        for b in range(BLOCKS_PER_STAGE):
            name = f"s{s}b{b}"
            block = ours.get_layer(name)
            weights = pair(f"{name}_c1", f"{name}_bn1") + pair(f"{name}_c2", f"{name}_bn2")
            if block.projection is not None:
                weights += pair(f"{name}_pc", f"{name}_pbn")
            block.set_weights(weights)
    ours.get_layer("logits").set_weights(stock.get_layer("logits").get_weights())
    return True


def _step_fns(model, x, y):
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # build and trace
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    it = iter(ds)
    train_fn = model.train_function
    xt = tf.constant(x)
    predict = tf.function(lambda t: model(t, training=False))
    predict(xt)

    def train():
        train_fn(it)

    def infer():
        predict(xt).numpy()

    return train, infer


def run(policy, repeats, rounds):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 64).astype("int32")
    stock, ours = stock_resnet20(), fused_resnet20()
    same = _copy_weights(stock, ours)
    if same:
        a = stock(x[:8], training=False).numpy().astype("float32")
        b = ours(x[:8], training=False).numpy().astype("float32")
        tol = 1e-4 if policy == "float32" else 5e-2
        same = bool(np.allclose(a, b, rtol=tol, atol=tol))
    ops, fns = {}, {}
    for name, model in (("stock", stock), ("ours", ours), ("convs", stock_resnet20(convs_only=True))):
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        ops[name] = (tfmetal_ext.inspect.fusion_report(model, x, mode="train", targets=y).num_ops,
                     tfmetal_ext.inspect.fusion_report(model, x, mode="predict").num_ops)
        train, infer = _step_fns(model, x, y)
        fns[("train", name)] = train
        if name != "convs":
            fns[("infer", name)] = infer
    times = paired_rounds(fns, rounds=rounds, repeats=repeats)

    def med(key):
        return statistics.median(times[key])

    (s_train, s_infer), (o_train, o_infer) = ops["stock"], ops["ours"]
    return [dict(
        policy=policy, same_weights=same,
        stock_train_ops=s_train, ours_train_ops=o_train, train_ops_ratio=o_train / s_train,
        stock_infer_ops=s_infer, ours_infer_ops=o_infer,
        stock_train_ms=med(("train", "stock")), ours_train_ms=med(("train", "ours")),
        train_speedup=ratio(times, ("train", "stock"), ("train", "ours")),
        convs_only_train_ms=med(("train", "convs")),
        train_speedup_ceiling=ratio(times, ("train", "stock"), ("train", "convs")),
        stock_infer_ms=med(("infer", "stock")), ours_infer_ms=med(("infer", "ours")),
        infer_speedup=ratio(times, ("infer", "stock"), ("infer", "ours")),
    )]


# Nodes of a train step that launch no GPU kernel: a resource read is a handle lookup, and the
# input pipeline runs on the host. Every other compute node is one kernel launch on Metal (a custom
# op's several dispatches share one command encoder; see custom_ops/metal/batch_norm_act_metal.mm).
NOT_LAUNCHES = ("ReadVariableOp", "IteratorGetNext", "OptionalFromValue")


def block_launches(avoid):
    """Kernel launches of a one-ResidualBlock float32 train step (16 channels, SGD, MSE), counted from
    its post-grappler graph: with `avoid` the FusedBatchNormV3 form ("batch_norm_act" avoided,
    the form before TfmetalExt>BatchNormAct), else the form the layers choose here."""
    policy = keras.mixed_precision.global_policy().name
    tfmetal_ext.configure("float32", avoid_fusions=["batch_norm_act"] if avoid else [])
    try:
        x = np.random.default_rng(0).standard_normal((8, 16, 16, 16)).astype("float32")
        inp = keras.Input((16, 16, 16))
        model = keras.Model(inp, fl.ResidualBlock(16)(inp))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        counts = tfmetal_ext.inspect.fusion_report(model, x, mode="train", targets=np.zeros_like(x)).ops_by_type
    finally:
        tfmetal_ext.configure(policy, avoid_fusions=[])
    return sum(n for op, n in counts.items() if op not in NOT_LAUNCHES)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds (order rotated)")
    parser.add_argument("--policies", default="float32,mixed_bfloat16")
    args = parser.parse_args(argv)
    rows = []
    for policy in args.policies.split(","):
        rows += run(policy, args.repeats, args.rounds)
    before, after = block_launches(avoid=True), block_launches(avoid=False)
    for row in rows:
        row.update(block_launches_fbn=before, block_launches=after, block_launches_ratio=after / before)
    columns = ["policy", "same_weights", "stock_train_ops", "ours_train_ops", "train_ops_ratio",
               "stock_infer_ops", "ours_infer_ops", "stock_train_ms", "ours_train_ms", "train_speedup",
               "convs_only_train_ms", "train_speedup_ceiling",
               "stock_infer_ms", "ours_infer_ms", "infer_speedup",
               "block_launches_fbn", "block_launches", "block_launches_ratio"]
    name = "bench_layers" if tfmetal_ext.devices.capabilities().onednn else "bench_layers_no_onednn"
    write_results(name, rows, columns, notes=[
        "ops = compute nodes of the post-grappler graph per step (excluding _Arg/_Retval/Const/NoOp/Identity)",
        "times are medians (ms) across paired rounds (every variant once per round, order rotated); "
        "speedup = median over rounds of stock / ours within the round; "
        "targets (issue 33): train_ops_ratio <= 0.5, float32 train_speedup >= 1.5 (oneDNN), >= 1.3 (no oneDNN); "
        "block_launches_ratio <= 0.7",
        "block_launches = kernel launches of a one-ResidualBlock train step (SGD, MSE): its compute nodes "
        "without ReadVariableOp and the input pipeline; _fbn = the FusedBatchNormV3 form (batch_norm_act "
        "avoided), the form before TfmetalExt>BatchNormAct",
        "convs_only = the stock model without its batch norms and ReLUs (the same convolutions alone); "
        "train_speedup_ceiling = stock / convs_only, the most fusing everything but the convolutions can give",
    ])


if __name__ == "__main__":
    main()
