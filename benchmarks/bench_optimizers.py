"""Optimizer step: Keras Adam/AdamW/SGD vs FusedAdam/FusedAdamW/FusedSGD, one process.

Two parameter sets: 40 variables of 512x512 (10.5M parameters) and 100 of
64x64 (0.4M). Each step is ``optimizer.apply(grads, variables)`` in a
tf.function with fixed gradients, so only the optimizer is timed. Reports the
median step time (stock and ours measured in alternating rounds), stock/ours
speed-up, compute ops per step from the executed graph, and training ops per
variable.

    .venv/bin/python benchmarks/bench_optimizers.py [--repeats 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import median_time, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmetal_ext import inspect  # noqa: E402
from tfmetal_ext.optimizers import FusedAdam, FusedAdamW, FusedSGD  # noqa: E402

SIZES = {"40 x 512x512": (40, (512, 512)), "100 x 64x64": (100, (64, 64))}
PAIRS = {
    "Adam": (keras.optimizers.Adam, FusedAdam, {}),
    "AdamW": (keras.optimizers.AdamW, FusedAdamW, {}),
    "SGD momentum": (keras.optimizers.SGD, FusedSGD, {"momentum": 0.9}),
    "SGD": (keras.optimizers.SGD, FusedSGD, {}),
}
TRAINING_OPS = ("ResourceApply", "ResourceScatter")


def make_step(cls, kwargs, count, shape, seed=0):
    rng = np.random.default_rng(seed)
    variables = [keras.Variable(rng.standard_normal(shape).astype("float32")) for _ in range(count)]
    grads = [tf.constant(rng.standard_normal(shape).astype("float32") * 1e-3) for _ in range(count)]
    opt = cls(**kwargs)
    opt.build(variables)

    @tf.function
    def step():
        opt.apply(grads, variables)

    step()
    report = inspect.report_from_capture(inspect.capture_function(lambda: opt.apply(grads, variables)))
    train_ops = sum(n for op, n in report.ops_by_type.items() if op.startswith(TRAINING_OPS))
    return step, report.num_ops, train_ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    rows = []
    for size, (count, shape) in SIZES.items():
        for name, (stock_cls, ours_cls, kwargs) in PAIRS.items():
            stock, stock_ops, _ = make_step(stock_cls, kwargs, count, shape)
            ours, ours_ops, ours_train_ops = make_step(ours_cls, kwargs, count, shape)
            stock_ms, ours_ms = [], []
            for _ in range(args.rounds):  # alternate to share the machine's noise
                stock_ms.append(median_time(stock, repeats=args.repeats))
                ours_ms.append(median_time(ours, repeats=args.repeats))
            s, o = statistics.median(stock_ms), statistics.median(ours_ms)
            rows.append(
                {
                    "size": size,
                    "optimizer": name,
                    "stock_ms": round(s, 2),
                    "ours_ms": round(o, 2),
                    "speedup": round(s / o, 2),
                    "stock_ops": stock_ops,
                    "ours_ops": ours_ops,
                    "stock_ops_per_var": round(stock_ops / count, 1),
                    "ours_train_ops_per_var": round(ours_train_ops / count, 2),
                    "ours_ops_per_var": round(ours_ops / count, 2),
                }
            )
            print(rows[-1], flush=True)
    columns = list(rows[0])
    write_results(
        "bench_optimizers",
        rows,
        columns,
        notes=[
            "speedup = stock_ms / ours_ms (median of per-round medians, rounds alternate stock and ours).",
            "ops: compute ops per step in the executed graph (excluding _Arg/_Retval/Const/NoOp/Identity); "
            "ours_train_ops_per_var counts ResourceApply*/ResourceScatter* ops per variable.",
        ],
    )


if __name__ == "__main__":
    main()
