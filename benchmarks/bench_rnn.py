"""FusedLSTM / FusedGRU vs keras.layers.LSTM / GRU: train step, one process.

For each size and cell: the same model (Input -> RNN(H) -> Dense(1), SGD, MSE)
with the stock layer and with ours, the stock weights copied into ours (checked
by comparing outputs), then per train step (the compiled `model.train_function`
that `fit` runs): compute ops in the post-grappler graph (`num_ops`, as
bench_layers), ops executed per step (a while-loop body counts once per
iteration), and median wall time. Rounds alternate stock / ours and the best
median of each is kept, so drift on a shared host favours neither side.

    .venv/bin/python benchmarks/bench_rnn.py [--repeats 30] [--rounds 3] [--policies float32,mixed_bfloat16]

``--grid`` times the issue's corners instead (batch {32, 256} x T {10, 200} x
units {32, 256}, F = 32, float32, then the SIZES rows): paired rounds in one process
(`_common.paired_rounds`, order rotated each round), speed-up = median over
rounds of stock / ours, and which form `FusedLSTM` / `FusedGRU` chose for the
shape (`tfmetal_ext.backends.Backend.rnn_cpu_form`). The choice is measured with the
fused loop forced (``ours_loop_ms``) as well, so the table shows what the
threshold decided and why:

    .venv/bin/python benchmarks/bench_rnn.py --grid [--rounds 5] [--repeats 3] [--out NAME]
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/bench_rnn.py --grid ...

(results/bench_rnn_grid_onednn.md, results/bench_rnn_grid_no_onednn.md by default: one file per
CPU configuration, each measured in its own process).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import median_time, paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext import layers as fl  # noqa: E402
from tfmetal_ext.inspect.report import NON_COMPUTE_OPS  # noqa: E402

SIZES = ((64, 50, 32, 128), (64, 100, 64, 256))
# The corners, then the SIZES rows (the first is the issue-33 corner: batch 64, T 50, F 32, H 128).
GRID = tuple((b, t, 32, h) for b in (32, 256) for t in (10, 200) for h in (32, 256)) + SIZES
CELLS = (("LSTM", keras.layers.LSTM, fl.FusedLSTM), ("GRU", keras.layers.GRU, fl.FusedGRU))
_LOOP_CONTROL = {"Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond"}


def _model(rnn_cls, steps, features, units):
    inp = keras.Input((steps, features))
    out = keras.layers.Dense(1, name="head")(rnn_cls(units, name="rnn")(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _frames(graph):
    """Node name -> while-loop nesting depth in a lowered GraphDef (0 outside any loop).

    Depth flows along edges (NextIteration back edges ignored): +1 out of an
    Enter, -1 out of an Exit.
    """
    nodes = {n.name: n for n in graph.node}
    preds = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph.node}
    preds = {k: [p for p in v if p in nodes and nodes[p].op != "NextIteration"] for k, v in preds.items()}
    succs = collections.defaultdict(list)
    for name, ps in preds.items():
        for p in ps:
            succs[p].append(name)
    waiting = {name: len(ps) for name, ps in preds.items()}
    depth = collections.defaultdict(int)
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:
        name = ready.pop()
        op = nodes[name].op
        out = depth[name] + (1 if op == "Enter" else -1 if op == "Exit" else 0)
        for nxt in succs[name]:
            depth[nxt] = max(depth[nxt], out)
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    return {k: max(v, 0) for k, v in depth.items()}


def executed_ops(capture, iterations):
    """Compute ops run per step: a node inside a while loop counts `iterations` times.

    Returns ``(compute ops, loop-control nodes)``; loop control (Enter, Merge,
    Switch, NextIteration, Exit, LoopCond) is executor work a while loop adds.
    """
    compute = control = 0
    for fg in capture.functions:
        depth = _frames(fg.graph)
        for node in fg.graph.node:
            times = iterations ** depth.get(node.name, 0)
            if node.op in _LOOP_CONTROL:
                control += times
            elif node.op not in NON_COMPUTE_OPS:
                compute += times
    return compute, control


def _train_fn(model, x, y, static_batch=True):
    """The compiled train step over (x, y) as one batch; `static_batch=False`: traced with batch None,
    as `fit` traces it when the data does not split into full batches."""
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # build and trace
    if static_batch:
        it = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    else:  # batch() without drop_remainder: the element spec's batch is None
        it = iter(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(len(x)))
    fn = model.train_function
    return lambda: fn(it)


def run(name, stock_cls, ours_cls, size, policy, repeats, rounds):
    batch, steps, features, units = size
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, steps, features)).astype("float32")
    y = rng.standard_normal((batch, 1)).astype("float32")
    stock, ours = _model(stock_cls, steps, features, units), _model(ours_cls, steps, features, units)
    ours.set_weights(stock.get_weights())
    tol = 1e-4 if policy == "float32" else 5e-2
    a = np.asarray(stock(x[:8]), "float32")
    b = np.asarray(ours(x[:8]), "float32")
    same = bool(np.allclose(a, b, rtol=tol, atol=tol))
    result = {}
    for side, model in (("stock", stock), ("ours", ours)):
        cap, run_model, notes = tfmetal_ext.inspect.capture_step(model, x, mode="train", targets=y)
        report = tfmetal_ext.inspect.report_from_capture(cap, run_model, notes)
        compute, control = executed_ops(cap, steps)
        result[side] = dict(graph_ops=report.num_ops, exec_ops=compute, loop_ctl=control,
                            fn=_train_fn(model, x, y), ms=float("inf"))
    for _ in range(rounds):
        for side in ("stock", "ours"):
            ms = median_time(result[side]["fn"], warmup=5, repeats=repeats)
            result[side]["ms"] = min(result[side]["ms"], ms)
    s, o = result["stock"], result["ours"]
    return dict(
        cell=name, B=batch, T=steps, F=features, H=units, policy=policy, same_weights=same,
        stock_ms=s["ms"], ours_ms=o["ms"], speedup=s["ms"] / o["ms"],
        stock_graph_ops=s["graph_ops"], ours_graph_ops=o["graph_ops"],
        stock_exec_ops=s["exec_ops"], ours_exec_ops=o["exec_ops"],
        stock_loop_ctl=s["loop_ctl"], ours_loop_ctl=o["loop_ctl"],
    )


def _grid_row(name, stock_cls, ours_cls, size, rounds, repeats, static_batch=True):
    from tfmetal_ext.backends import _table

    batch, steps, features, units = size
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, steps, features)).astype("float32")
    y = rng.standard_normal((batch, 1)).astype("float32")
    stock = _model(stock_cls, steps, features, units)
    ours = _model(ours_cls, steps, features, units)
    ours.set_weights(stock.get_weights())
    fns = {"stock": _train_fn(stock, x, y, static_batch), "ours": _train_fn(ours, x, y, static_batch)}
    fns["ours"]()  # traced for the batch of the timed steps (static or None): the form is chosen here
    form = ours.get_layer("rnn").form
    if form != "fused":  # also time the fused loop this shape did not choose
        with _table.force_cpu_form("fused"):
            loop = _model(ours_cls, steps, features, units)
            loop.set_weights(stock.get_weights())
            fns["ours_loop"] = _train_fn(loop, x, y, static_batch)
            fns["ours_loop"]()
    times = paired_rounds(fns, rounds=rounds, repeats=repeats)
    med = {k: float(np.median(v)) for k, v in times.items()}
    row = dict(cell=name, B=batch if static_batch else f"{batch} (traced None)", T=steps, F=features, H=units,
               form=form,
               stock_ms=med["stock"], ours_ms=med["ours"], speedup=ratio(times, "stock", "ours"))
    if "ours_loop" in times:
        row["ours_loop_ms"] = med["ours_loop"]
        row["loop_speedup"] = ratio(times, "stock", "ours_loop")
    return row


def grid(args):
    rows = []
    sizes = GRID if not args.sizes else [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    for size in sizes:
        for name, stock_cls, ours_cls in CELLS:
            if name in args.cells.split(","):
                rows.append(_grid_row(name, stock_cls, ours_cls, size, args.rounds, args.repeats,
                                      not args.unknown_batch))
                print(rows[-1], flush=True)
    columns = ["cell", "B", "T", "F", "H", "form", "stock_ms", "ours_ms", "speedup", "ours_loop_ms", "loop_speedup"]
    from tfmetal_ext import devices

    default = "bench_rnn_grid_onednn" if devices.capabilities().onednn else "bench_rnn_grid_no_onednn"
    write_results(args.out or default, rows, columns, notes=[
        "train step = the compiled model.train_function (forward, backward, SGD) of Input -> RNN(H) -> Dense(1), float32",
        f"paired rounds in one process (_common.paired_rounds, {args.rounds} rounds x {args.repeats} steps, "
        "order rotated): ms = median over rounds; speedup = median over rounds of stock_ms / ours_ms",
        "form: what FusedLSTM/FusedGRU ran for the shape (layer.form after the timed step was traced with "
        "its batch, static unless the row says 'traced None'; the rule is "
        "tfmetal_ext.backends.Backend.rnn_cpu_form over the rnn_stock regions of the backend table of this "
        "CPU configuration): 'fused' = the hoisted-projection custom-gradient loop, 'stock' = Keras' own "
        "loop and cell math",
        "ours_loop_ms / loop_speedup: the fused loop forced, for shapes where the table chose stock",
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="float32,mixed_bfloat16")
    parser.add_argument("--cells", default="LSTM,GRU")
    parser.add_argument("--sizes", default=None, help="e.g. 64x50x32x128,64x100x64x256")
    parser.add_argument("--grid", action="store_true", help="the batch x T x units corners, paired rounds")
    parser.add_argument("--unknown-batch", action="store_true",
                        help="--grid: trace the timed steps with batch None (fit on data that does not split evenly)")
    parser.add_argument("--out", default=None, help="results name for --grid (default bench_rnn_grid)")
    args = parser.parse_args(argv)
    if args.grid:
        return grid(args)
    sizes = SIZES if not args.sizes else [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    rows = []
    for policy in args.policies.split(","):
        for size in sizes:
            for name, stock_cls, ours_cls in CELLS:
                if name in args.cells.split(","):
                    rows.append(run(name, stock_cls, ours_cls, size, policy, args.repeats, args.rounds))
                    print(rows[-1], flush=True)
    columns = ["cell", "B", "T", "F", "H", "policy", "same_weights", "stock_ms", "ours_ms", "speedup",
               "stock_graph_ops", "ours_graph_ops", "stock_exec_ops", "ours_exec_ops",
               "stock_loop_ctl", "ours_loop_ctl"]
    write_results("bench_rnn", rows, columns, notes=[
        "train step = the compiled model.train_function (forward, backward, SGD) of Input -> RNN(H) -> Dense(1)",
        "ms: best of --rounds medians (rounds alternate stock / ours); speedup = stock_ms / ours_ms",
        "graph_ops: compute nodes of the post-grappler graph (as bench_layers); exec_ops: compute ops "
        "executed per step (a while-loop body counted T times); loop_ctl: while-loop control nodes executed",
        "target from the issue: FusedLSTM >= 1.5x keras.layers.LSTM on CPU at B64 T50 F32 H128",
    ])


if __name__ == "__main__":
    main()
