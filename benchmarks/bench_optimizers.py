"""Optimizer step: every Keras optimizer against its tfmetal_ext counterpart, with defaults, one process.

Pairs (stock -> ours, same arguments): Adam, AdamW, Lion (ours default to
``multi_tensor="auto"``: one ``TfmetalExt>MultiTensor*`` op per step and
dtype where the op library is loaded), SGD, SGD with momentum, SGD with
Nesterov momentum, RMSprop (default and centered with momentum), Adagrad;
plus ``FusedAdam(multi_tensor=False)`` to show the per-variable form.

Sizes: 100 variables of 64x64 (0.4M parameters), 40 of 512x512 (10.5M).
Each step is ``optimizer.apply(grads, variables)`` in a tf.function with
fixed gradients, so only the optimizer is timed. Stock and ours run in
paired rounds (the order alternates); the speed-up is the median over rounds
of stock/ours within a round. Also reported: compute ops per step from the
executed graph, and training ops per variable (``ResourceApply*``,
``ResourceScatter*``, ``TfmetalExt>MultiTensor*``).

Issue 17's targets: every fused optimizer with defaults >= 1.0x its Keras
counterpart at both sizes, and >= 2x at 10M parameters. Timings depend on the
CPU: the results name it (`_common.environment`).

    .venv/bin/python benchmarks/bench_optimizers.py [--rounds 7] [--repeats 9] [--pairs Adam,Lion]
    .venv/bin/python benchmarks/bench_optimizers.py --quick     # small sizes, seconds: checks it runs
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmetal_ext import inspect  # noqa: E402
from tfmetal_ext.backends.fusion import CUSTOM_OP_PREFIX, OPTIMIZER_TO_FUSED  # noqa: E402

SIZES = {"40 x 512x512": (40, (512, 512)), "100 x 64x64": (100, (64, 64))}
QUICK_SIZES = {"8 x 32x32": (8, (32, 32))}

# name -> (stock class name, arguments both get, extra arguments for ours only). Ours is the
# OPTIMIZER_TO_FUSED row of the stock class.
PAIRS = {
    "Adam": ("Adam", {}, {}),
    "Adam (ours per-variable)": ("Adam", {}, {"multi_tensor": False}),
    "AdamW": ("AdamW", {}, {}),
    "Lion": ("Lion", {}, {}),
    "SGD": ("SGD", {}, {}),
    "SGD momentum": ("SGD", {"momentum": 0.9}, {}),
    "SGD nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}, {}),
    "RMSprop": ("RMSprop", {}, {}),
    "RMSprop centered momentum": ("RMSprop", {"momentum": 0.9, "centered": True}, {}),
    "Adagrad": ("Adagrad", {}, {}),
}
TRAINING_OPS = ("ResourceApply", "ResourceScatter", CUSTOM_OP_PREFIX + "MultiTensor")


def fused_class(stock):
    row = OPTIMIZER_TO_FUSED[stock]
    return getattr(importlib.import_module(row.module), row.fused)


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
    kinds = sorted(op for op in report.ops_by_type if op.startswith(TRAINING_OPS))
    return step, report.num_ops, train_ops, kinds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated pair names")
    parser.add_argument("--quick", action="store_true", help="one small size, 2 rounds: checks the bench runs")
    parser.add_argument("--output", default=None, help="results name (default bench_optimizers[_quick])")
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"unknown pairs {unknown}; known: {list(PAIRS)}")
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds, repeats = (2, 3) if args.quick else (args.rounds, args.repeats)

    rows = []
    for size, (count, shape) in sizes.items():
        for name in names:
            stock_name, kwargs, ours_kwargs = PAIRS[name]
            stock_cls = getattr(keras.optimizers, stock_name)
            ours_cls = fused_class(stock_name)
            stock, stock_ops, stock_train_ops, _ = make_step(stock_cls, kwargs, count, shape)
            ours, ours_ops, ours_train_ops, kinds = make_step(ours_cls, {**kwargs, **ours_kwargs}, count, shape)
            times = paired_rounds({"stock": stock, "ours": ours}, rounds=rounds, repeats=repeats)
            rows.append(
                {
                    "size": size,
                    "optimizer": name,
                    "ours": ours_cls.__name__,
                    "stock_ms": round(statistics.median(times["stock"]), 3),
                    "ours_ms": round(statistics.median(times["ours"]), 3),
                    "speedup": round(ratio(times, "stock", "ours"), 2),
                    "stock_ops": stock_ops,
                    "ours_ops": ours_ops,
                    "stock_ops_per_var": round(stock_ops / count, 1),
                    "ours_ops_per_var": round(ours_ops / count, 2),
                    "ours_train_ops_per_var": round(ours_train_ops / count, 3),
                    "ours_train_ops": " ".join(kinds),
                }
            )
            print(rows[-1], flush=True)
    write_results(
        args.output or ("bench_optimizers_quick" if args.quick else "bench_optimizers"),
        rows,
        list(rows[0]),
        notes=[
            "speedup = median over paired rounds of stock_ms / ours_ms within a round (rounds alternate the "
            "order); stock_ms / ours_ms are medians of the per-round medians.",
            "ops: compute ops per step in the executed graph (excluding _Arg/_Retval/Const/NoOp/Identity); "
            "ours_train_ops_per_var counts ResourceApply* / ResourceScatter* / TfmetalExt>MultiTensor* ops per "
            "variable (1 per variable, or 1 per step and dtype with a multi-tensor op).",
            "targets (issue 17): speedup >= 1.0 at both sizes, >= 2 at 40 x 512x512 (10.5M parameters).",
        ],
    )
    return rows


if __name__ == "__main__":
    main()
