"""Per-step overhead of MetalCallback in `model.fit`, against the same fit without it, in one process.

Three measurements per model:
- step interval: the median time between consecutive train-batch begins of a
  fit (a timer callback that only implements `on_train_batch_begin` is in both
  runs; the fit's first steps, which include tracing and the callback's
  one-time inspection, are skipped), over many rounds alternating plain / with
  the callback, median across rounds; a callback with an empty batch-begin hook
  runs in the same rounds to show the noise and Keras' own dispatch cost;

- hooks: the callback's own per-step work, timed alone: its batch-begin hook and
  train-function wrapper around a step that returns at once (100k calls), as a
  share of the plain step time. End-to-end differences below a few percent are
  within this 2-core host's noise; this figure is not.

The callback is used as users would: its defaults (summary report, fallback
check, non-finite check every step) plus `log_every_n_steps=50`. The op counts
per train step come from the callback's own fusion report and, for the plain
fit, from `tfmetal_ext.inspect.fusion_report` of the same model: the callback
changes no op.

    .venv/bin/python benchmarks/bench_callback.py [--rounds 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext import layers as fl  # noqa: E402

SKIP = 10  # first steps of each fit left out of the interval medians


class BeginTimer(keras.callbacks.Callback):
    """Timestamps of train-batch begins (begin hooks never make Keras synchronize logs)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.times.append(time.perf_counter())


class EmptyCallback(keras.callbacks.Callback):
    """A callback doing nothing per step: what Keras' callback dispatch alone costs, for scale."""

    def on_train_batch_begin(self, batch, logs=None):
        pass


def small_mlp():
    inputs = keras.Input((64,))
    x = fl.FusedDense(128, activation="relu")(inputs)
    outputs = fl.FusedDense(10)(x)
    return keras.Model(inputs, outputs, name="mlp_64_128_10"), (64,), 32


def conv_net():
    inputs = keras.Input((16, 16, 3))
    x = fl.ConvBNAct(32, 3, name="stem")(inputs)
    x = fl.ResidualBlock(32, name="block")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = fl.FusedDense(10)(x)
    return keras.Model(inputs, outputs, name="convnet_16x16"), (16, 16, 3), 32


MODELS = (small_mlp, conv_net)


def _compiled(builder):
    model, shape, batch = builder()
    model.compile(
        optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, shape, batch


def _fit(model, x, y, batch, steps, callback):
    timer = BeginTimer()
    callbacks = [timer] + ([callback] if callback is not None else [])
    start = time.perf_counter()
    model.fit(x[: steps * batch], y[: steps * batch], batch_size=batch, epochs=1, verbose=0,
              shuffle=False, callbacks=callbacks)
    total = time.perf_counter() - start
    intervals = np.diff(timer.times[SKIP:]) * 1e3
    return total, float(np.median(intervals)) if len(intervals) else float("nan")


def hook_cost_us(model, calls=100_000):
    """Microseconds per step of MetalCallback's own per-step work (no step behind it)."""
    import tensorflow as tf

    loss = tf.constant(1.0)
    saved = model.train_function
    model.train_function = lambda iterator: {"loss": loss}
    cb = tfmetal_ext.callbacks.MetalCallback(report=None, check_fallback=False, log_every_n_steps=50)
    cb.set_model(model)
    cb.set_params({"steps": calls})
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    step = model.train_function
    start = time.perf_counter()
    for i in range(calls):
        cb.on_train_batch_begin(i)
        step(None)
    elapsed = time.perf_counter() - start
    cb.on_train_end()
    model.train_function = saved
    return elapsed / calls * 1e6


def bench(builder, rounds, steps):
    model, shape, batch = _compiled(builder)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch,) + shape).astype("float32")
    y = rng.integers(0, 10, size=(steps * batch,)).astype("int32")
    callback = tfmetal_ext.callbacks.MetalCallback(print_fn=lambda *_: None, log_every_n_steps=50)
    runs = {"plain": None, "empty": EmptyCallback(), "callback": callback}
    intervals = {k: [] for k in runs}
    _fit(model, x, y, batch, SKIP + 5, None)  # trace once
    order = list(runs)
    for r in range(rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:  # rotate: no side always runs first
            intervals[name].append(_fit(model, x, y, batch, steps, runs[name])[1])
    plain_ops = tfmetal_ext.inspect.fusion_report(model, mode="train", batch_size=batch).num_ops
    cb_ops = callback.fusion_report.num_ops
    plain = statistics.median(intervals["plain"])
    with_cb = statistics.median(intervals["callback"])
    empty = statistics.median(intervals["empty"])
    hooks = hook_cost_us(model)
    return {
        "model": model.name, "batch": batch, "ops/step plain": plain_ops, "ops/step callback": cb_ops,
        "step plain ms": plain, "step callback ms": with_cb, "end-to-end overhead %": (with_cb / plain - 1.0) * 100.0,
        "empty callback %": (empty / plain - 1.0) * 100.0,
        "hooks us/step": hooks, "hooks % of step": hooks / (plain * 1e3) * 100.0,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    rows = [bench(builder, args.rounds, args.steps) for builder in MODELS]
    columns = [
        "model", "batch", "ops/step plain", "ops/step callback",
        "step plain ms", "step callback ms", "end-to-end overhead %", "empty callback %", "hooks us/step",
        "hooks % of step",
    ]
    write_results(
        "bench_callback", rows, columns,
        notes=[
            f"{args.rounds} alternating rounds of a {args.steps}-step fit per side; step = median gap between "
            f"train-batch begins (first {SKIP} steps of each fit skipped), median across rounds",
            "end-to-end overhead % = callback / plain - 1; this host's noise is several percent either way",
            "empty callback % = the same for a Keras callback with an empty batch-begin hook (noise and dispatch scale)",
            "hooks: the callback's per-step Python work alone (batch-begin hook + train-function wrapper, "
            "non-finite check and log_every_n_steps=50 on), 100k calls",
        ],
    )


if __name__ == "__main__":
    main()
