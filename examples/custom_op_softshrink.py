"""A softshrink activation as one custom op instead of several small ones.

`keras.ops.soft_shrink` is a handful of elementwise ops forward (compare, select,
add, ...) and more backward: each is a separate kernel launch on a GPU, and on
Metal an op without a GPU kernel falls back to the CPU. `tfmetal_ext.layers.Softshrink`
is one `TfmetalExt>Softshrink` op forward and one `TfmetalExt>SoftshrinkGrad`
backward, with a CPU kernel and (on Apple GPUs) a Metal kernel.

This script builds the same small model both ways, checks they compute the same
thing, and prints ops per train step and the placement report of each.

    python examples/custom_op_softshrink.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext import inspect  # noqa: E402
from tfmetal_ext.layers.activations import Softshrink  # noqa: E402


def build(custom_op):
    keras.utils.set_random_seed(0)
    act = Softshrink(0.5, name="shrink") if custom_op else keras.layers.Activation(
        "soft_shrink", name="shrink"  # keras.activations.soft_shrink, threshold 0.5
    )
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, name="fc1"), act, keras.layers.Dense(10, name="fc2")],
        name="custom_op" if custom_op else "stock",
    )


def main():
    print(tfmetal_ext.ops.status())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype("float32")
    y = rng.standard_normal((256, 10)).astype("float32")
    stock, ours = build(False), build(True)
    ours.set_weights(stock.get_weights())
    diff = np.abs(stock.predict(x, verbose=0) - ours.predict(x, verbose=0)).max()
    print(f"max |stock - custom op| on the same weights: {diff:.2e}")

    reports = {}
    for model in (stock, ours):
        model.compile(optimizer=tfmetal_ext.optimizers.FusedSGD(0.01), loss="mse")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        fusion = inspect.fusion_report(model, x[:64], mode="train", targets=y[:64])
        placement = inspect.placement_report(model, x[:64], mode="train", targets=y[:64])
        shrink_ops = {op: n for op, n in fusion.ops_by_type.items() if "Softshrink" in op}
        reports[model.name] = fusion.num_ops
        print(f"\n== {model.name}: {fusion.num_ops} ops per train step; softshrink ops: {shrink_ops or 'none (unfused)'}")
        print(placement)
    print(f"\nops per train step: stock {reports['stock']}, custom op {reports['custom_op']}")


if __name__ == "__main__":
    main()
