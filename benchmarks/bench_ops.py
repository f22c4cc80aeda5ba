"""Custom ops (tfmetal_ext.ops) against stock Keras, forward+backward, one process.

Sections (each a function returning rows; ``main`` runs them all, or those named
with ``--sections``):

- ``copy``: the machine's copy bandwidth, measured in the same run: numpy
  ``np.copyto`` of a 256 MB float32 array into a preallocated one, on one thread
  and split over all cores, and TF's ``DeepCopy`` op (a real copy on TF's thread
  pool, into a freshly allocated output like any op's) of 64 MB. The best of
  these is the reference bandwidth; GB/s count bytes read + bytes written.
- ``layer_norm``: `FusedLayerNorm` (``TfmetalExt>LayerNorm`` + ``LayerNormGrad``)
  vs `keras.layers.LayerNormalization`, one tf.function giving dx, dgamma and
  dbeta; also the pure-TF reference the layer falls back to. Bytes moved by
  ours: x read and y written forward, dy and x read and dx written backward
  (5 tensors of x's size; the per-row statistics and parameters are small).
- ``softshrink``: `tfmetal_ext.ops.softshrink` vs `keras.ops.soft_shrink` at 16M
  float32 elements, forward+backward (bytes: x, y, dy, x, dx).
- ``batch_norm_act``: `tfmetal_ext.ops.batch_norm_act` (``TfmetalExt>BatchNormAct`` +
  ``BatchNormActGrad``) vs TF's ``FusedBatchNormV3`` (training) + ``Relu`` (+ ``AddV2`` of a
  residual input) and their gradients (``FusedBatchNormGradV3``, ``ReluGrad``), one tf.function
  giving y, dx, dgamma, dbeta (and d side) at 64x32x32x64 float32: the issue-33 target is >= 2x
  on 2 threads. Run it with oneDNN on (TF's default on x86) and with ``TF_ENABLE_ONEDNN_OPTS=0``.
- ``activation_grad``: what a feed-forward's backward pass computes for its activation, y = act(x) and
  dx = dy * act'(x), at 4096x512 float32 (batch 4 x T=1024 x 512, bench_hub's feed-forward): stock =
  TF's autodiff of ``tf.nn.silu`` / ``tf.nn.gelu`` (exact, tanh), ours = the same forward ops and one
  ``TfmetalExt>ActivationGrad``. Ops counted per step.
- ``sparse_softmax_cross_entropy``: the loss of a language model's head, forward and backward
  (the logits' gradient of the mean loss): stock = ``tf.nn.sparse_softmax_cross_entropy_with_logits``
  (TF's op, its gradient a Mul), ours = `tfmetal_ext.ops.sparse_softmax_cross_entropy` (one op each
  way), at 2048x1000, 4096x1000 (bench_hub's heads at T=512 and 1024) and 2048x32000 (a Llama-sized
  vocabulary) float32. Bytes moved by ours: the logits read twice forward (the second pass from
  cache for rows this small), read and the gradient written backward.
- ``multi_tensor_adam``: `FusedAdam(multi_tensor=True)` (one ``TfmetalExt>MultiTensorAdam``
  per step) vs `FusedAdam(multi_tensor=False)` (one ``ResourceApplyAdam`` per variable) vs `keras.optimizers.Adam`,
  one ``optimizer.apply`` step, at 100 variables of 64x64 and 40 of 512x512.

Times are medians of per-round medians; rounds alternate stock and ours so both
share the machine's noise. Ops: compute ops per step in the executed graph.

    .venv/bin/python benchmarks/bench_ops.py [--repeats 15] [--rounds 3] [--sections copy,layer_norm,softshrink]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import median_time, paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmetal_ext import inspect, ops  # noqa: E402
from tfmetal_ext.backends import fusion  # noqa: E402
from tfmetal_ext.layers import FusedLayerNorm  # noqa: E402

COLUMNS = (
    "section", "case", "stock_ms", "ours_ms", "speedup", "reference_ms", "stock_ops", "ours_ops",
    "ours_GBps", "copy_GBps", "of_copy_bandwidth", "unit",
)
MB = 1 << 20


class Context:
    """What the sections share: arguments, and the copy bandwidth once measured."""

    def __init__(self, args):
        self.repeats = args.repeats
        self.rounds = args.rounds
        self.copy_gbps = None

    def alternate(self, *fns):
        """Median of per-round medians for each fn, rounds alternating between them."""
        times = [[] for _ in fns]
        for _ in range(self.rounds):
            for t, fn in zip(times, fns):
                t.append(median_time(fn, repeats=self.repeats))
        return [statistics.median(t) for t in times]


def _gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def _num_ops(fn, *args):
    return inspect.report_from_capture(inspect.capture_function(fn, *args)).num_ops


def _timing_row(section, case, stock_ms, ours_ms, speedup, stock_ops, ours_ops, digits=2):
    """A section's row: the two medians (ms), the speed-up (stock / ours) and the ops of each side."""
    return {
        "section": section,
        "case": case,
        "stock_ms": round(stock_ms, digits),
        "ours_ms": round(ours_ms, digits),
        "speedup": round(speedup, 2),
        "stock_ops": stock_ops,
        "ours_ops": ours_ops,
    }


def _bandwidth_columns(ctx, nbytes, ours_ms):
    gbps = _gbps(nbytes, ours_ms)
    row = {"ours_GBps": round(gbps, 1)}
    if ctx.copy_gbps:
        row.update(copy_GBps=round(ctx.copy_gbps, 1), of_copy_bandwidth=round(gbps / ctx.copy_gbps, 2))
    return row


# ----------------------------------------------------------------------------
# Copy bandwidth.


def bench_copy(ctx):
    src = np.random.default_rng(0).random(64 * MB, dtype=np.float32)  # 256 MB
    dst = np.empty_like(src)
    nbytes = 2 * src.nbytes
    threads = os.cpu_count() or 1
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]

    def threaded_copy():
        workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    tf_src = tf.constant(src[: 16 * MB])  # 64 MB
    deep_copy = tf.function(lambda t: tf.raw_ops.DeepCopy(x=t), autograph=False)
    one_ms, all_ms = ctx.alternate(lambda: np.copyto(dst, src), threaded_copy)
    (tf_ms,) = ctx.alternate(lambda: deep_copy(tf_src))
    measured = {
        "np.copyto 256 MB, 1 thread": _gbps(nbytes, one_ms),
        f"np.copyto 256 MB, {threads} threads": _gbps(nbytes, all_ms),
        "tf DeepCopy 64 MB (fresh output)": _gbps(2 * tf_src.numpy().nbytes, tf_ms),
    }
    ctx.copy_gbps = max(measured.values())
    ms = {"np.copyto 256 MB, 1 thread": one_ms, f"np.copyto 256 MB, {threads} threads": all_ms,
          "tf DeepCopy 64 MB (fresh output)": tf_ms}
    rows = [
        {"section": "copy", "case": name, "ours_ms": round(ms[name], 2), "ours_GBps": round(gbps, 1)}
        for name, gbps in measured.items()
    ]
    return rows, [f"copy bandwidth reference: the best copy above, {ctx.copy_gbps:.1f} GB/s (read + write)"]


# ----------------------------------------------------------------------------
# Layer norm.

LAYER_NORM_CASES = [
    ("float32", (4096, 1024)),
    ("float32", (64, 128, 256)),
    ("bfloat16", (4096, 1024)),
    ("bfloat16", (64, 128, 256)),
]


def _layer_norm_step(layer):
    @tf.function(autograph=False)
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x] + layer.trainable_variables, output_gradients=dy)

    return step


def _layer_norm_layers(dtype, shape):
    policy = "float32" if dtype == "float32" else f"mixed_{dtype}"
    rng = np.random.default_rng(0)
    gamma = rng.uniform(0.5, 1.5, shape[-1]).astype("float32")
    beta = rng.normal(size=shape[-1]).astype("float32")
    layers = []
    for cls in (keras.layers.LayerNormalization, FusedLayerNorm):
        layer = cls(dtype=policy)
        layer.build(shape)
        layer.set_weights([gamma, beta])
        layers.append(layer)
    return layers


def bench_layer_norm(ctx):
    rows = []
    for dtype, shape in LAYER_NORM_CASES:
        stock_layer, ours_layer = _layer_norm_layers(dtype, shape)
        rng = np.random.default_rng(1)
        x = tf.constant(rng.normal(1.0, 2.0, shape), dtype)
        dy = tf.constant(rng.normal(0.0, 1.0, shape), dtype)
        stock, ours = _layer_norm_step(stock_layer), _layer_norm_step(ours_layer)
        for got, want in zip(ours(x, dy), stock(x, dy)):  # same results before timing anything
            want = tf.cast(want, tf.float32)
            scale = float(tf.reduce_max(tf.abs(want)))
            np.testing.assert_allclose(tf.cast(got, tf.float32), want, rtol=2e-2, atol=2e-2 * scale)
        stock_ms, ours_ms = ctx.alternate(lambda: stock(x, dy), lambda: ours(x, dy))
        os.environ["TFMETAL_EXT_REFERENCE_OPS"] = "1"  # the layer's fallback without the op library
        try:
            reference = _layer_norm_step(ours_layer)
            reference(x, dy)
            (reference_ms,) = ctx.alternate(lambda: reference(x, dy))
        finally:
            del os.environ["TFMETAL_EXT_REFERENCE_OPS"]
        nbytes = 5 * x.shape.num_elements() * x.dtype.size
        row = {
            "section": "layer_norm",
            "case": f"{dtype} {'x'.join(map(str, shape))}",
            "stock_ms": round(stock_ms, 2),
            "ours_ms": round(ours_ms, 2),
            "speedup": round(stock_ms / ours_ms, 2),
            "reference_ms": round(reference_ms, 2),
            "stock_ops": _num_ops(stock, x, dy),
            "ours_ops": _num_ops(ours, x, dy),
        }
        row.update(_bandwidth_columns(ctx, nbytes, ours_ms))
        rows.append(row)
        print(row, flush=True)
    notes = [
        "layer_norm: one step = forward + backward (dx, dgamma, dbeta); ours = FusedLayerNorm "
        "(TfmetalExt>LayerNorm + TfmetalExt>LayerNormGrad); reference_ms = the same layer with "
        "TFMETAL_EXT_REFERENCE_OPS=1 (its pure-TF fallback); bfloat16 = mixed_bfloat16 layers, bf16 x and dy.",
        "layer_norm bytes moved by ours = 5 x size of x (x, y forward; dy, x, dx backward).",
    ]
    return rows, notes


# ----------------------------------------------------------------------------
# Softshrink.


def bench_softshrink(ctx):
    n = 16 * MB
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(0.0, 1.0, n).astype("float32"))
    dy = tf.constant(rng.normal(0.0, 1.0, n).astype("float32"))

    def make(fn):
        @tf.function(autograph=False)
        def step(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return y, tape.gradient(y, x, output_gradients=dy)

        return step

    stock = make(lambda t: keras.ops.soft_shrink(t, 0.5))
    ours = make(lambda t: ops.softshrink(t, 0.5))
    for got, want in zip(ours(x, dy), stock(x, dy)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    stock_ms, ours_ms = ctx.alternate(lambda: stock(x, dy), lambda: ours(x, dy))
    row = _timing_row("softshrink", "float32 16M", stock_ms, ours_ms, stock_ms / ours_ms,
                      _num_ops(stock, x, dy), _num_ops(ours, x, dy))
    row.update(_bandwidth_columns(ctx, 5 * n * 4, ours_ms))
    print(row, flush=True)
    return [row], ["softshrink: one step = y and dx; bytes moved by ours = 5 x 64 MB (x, y; dy, x, dx)."]


# ----------------------------------------------------------------------------
# Batch norm + activation (+ residual add), training.

BATCH_NORM_ACT_SHAPE = (64, 32, 32, 64)


def bench_batch_norm_act(ctx):
    rng = np.random.default_rng(3)
    shape = BATCH_NORM_ACT_SHAPE
    c = shape[-1]
    x = tf.constant(rng.normal(0.5, 2.0, shape).astype("float32"))
    side = tf.constant(rng.normal(0.0, 1.0, shape).astype("float32"))
    dy = tf.constant(rng.normal(0.0, 1.0, shape).astype("float32"))
    gamma = tf.constant(rng.uniform(0.5, 1.5, c).astype("float32"))
    beta = tf.constant(rng.normal(0.0, 0.3, c).astype("float32"))
    eps = 1e-3

    def stock_fn(x, gamma, beta, side):
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=eps, is_training=True)
        return tf.nn.relu(y if side is None else y + side)

    def ours_fn(x, gamma, beta, side):
        return ops.batch_norm_act(x, gamma, beta, side, activation="relu", epsilon=eps)[0]

    def make(fn, with_side):
        @tf.function(autograph=False)
        def step(x, gamma, beta, side, dy):
            s = side if with_side else None
            watched = [x, gamma, beta] + ([side] if with_side else [])
            with tf.GradientTape() as tape:
                tape.watch(watched)
                y = fn(x, gamma, beta, s)
            return [y] + tape.gradient(y, watched, output_gradients=dy)

        return step

    rows = []
    for with_side in (False, True):
        stock, ours = make(stock_fn, with_side), make(ours_fn, with_side)
        args = (x, gamma, beta, side, dy)
        for got, want in zip(ours(*args), stock(*args)):
            got, want = got.numpy(), want.numpy()
            # A pre-activation within rounding of 0 may take the other side of relu's kink in one of
            # them: a few elements of dx differ, and a channel sum (dgamma, dbeta) by such a term.
            tol = (1e-3 if got.ndim > 1 else 2e-2) * max(float(np.abs(want).max()), 1.0)
            far = np.abs(got - want) > tol
            assert far.mean() < 1e-5 or (got.ndim == 1 and not far.any()), f"{int(far.sum())} of {far.size} differ"
        # Paired rounds (the order rotated each round), the speed-up the median of the per-round ratios:
        # load drift on a shared host between rounds cancels.
        times = paired_rounds({"stock": lambda: stock(*args), "ours": lambda: ours(*args)},
                              rounds=max(ctx.rounds, 5), repeats=ctx.repeats)
        stock_ms, ours_ms = (statistics.median(times[k]) for k in ("stock", "ours"))
        row = _timing_row("batch_norm_act", "float32 64x32x32x64 relu" + (" + side" if with_side else ""),
                          stock_ms, ours_ms, ratio(times, "stock", "ours"), _num_ops(stock, *args),
                          _num_ops(ours, *args))
        # Bytes moved by ours: x twice and y forward; dy, x (, side) twice and dx (, dside) backward.
        n = int(np.prod(shape)) * 4
        row.update(_bandwidth_columns(ctx, n * (3 + 5) + (n * 4 if with_side else 0), ours_ms))
        print(row, flush=True)
        rows.append(row)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset: TF's default)")
    notes = [
        "batch_norm_act: one step = y, dx, dgamma, dbeta (, d side) in one tf.function; stock = "
        "FusedBatchNormV3(is_training=True) + Relu (+ AddV2) and their gradients; "
        f"TF_ENABLE_ONEDNN_OPTS={onednn}; intra-op threads {tf.config.threading.get_intra_op_parallelism_threads()} "
        f"(0 = all {os.cpu_count()} cores); issue-33 target >= 2x on 2 threads. speedup = median over paired "
        "rounds of the per-round stock / ours.",
    ]
    return rows, notes


# ----------------------------------------------------------------------------
# Multi-tensor Adam.

MULTI_TENSOR_ADAM_CASES = [(100, (64, 64)), (40, (512, 512))]


def _optimizer_step(make_opt, count, shape):
    """``optimizer.apply`` on `count` float32 variables in a tf.function, fixed gradients."""
    rng = np.random.default_rng(3)
    variables = [keras.Variable(rng.standard_normal(shape).astype("float32")) for _ in range(count)]
    grads = [tf.constant(rng.standard_normal(shape).astype("float32") * 1e-3) for _ in range(count)]
    opt = make_opt()
    opt.build(variables)

    @tf.function
    def step():
        opt.apply(grads, variables)

    step()
    counts = inspect.report_from_capture(inspect.capture_function(lambda: opt.apply(grads, variables)))
    return step, counts, variables


def bench_multi_tensor_adam(ctx):
    from tfmetal_ext.optimizers import FusedAdam

    rows, notes = [], []
    for count, shape in MULTI_TENSOR_ADAM_CASES:
        size = f"{count} x {'x'.join(map(str, shape))} float32"
        keras_step, keras_report, _ = _optimizer_step(keras.optimizers.Adam, count, shape)
        per_var_step, per_var_report, per_var_vars = _optimizer_step(lambda: FusedAdam(multi_tensor=False), count,
                                                                     shape)
        multi_step, multi_report, multi_vars = _optimizer_step(lambda: FusedAdam(multi_tensor=True), count, shape)
        # Same state after the same steps (one warm-up call each): bitwise.
        for a, b in zip(multi_vars, per_var_vars):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        multi_ops = multi_report.ops_by_type.get(fusion.MULTI_TENSOR_ADAM_OP, 0)
        per_var_ops = per_var_report.ops_by_type.get("ResourceApplyAdam", 0)
        assert multi_ops == 1 and per_var_ops == count, (multi_report.ops_by_type, per_var_report.ops_by_type)
        keras_ms, per_var_ms, multi_ms = ctx.alternate(keras_step, per_var_step, multi_step)
        for baseline, ms, report in (("FusedAdam (per-variable)", per_var_ms, per_var_report),
                                     ("keras Adam", keras_ms, keras_report)):
            row = {
                "section": "multi_tensor_adam",
                "case": f"{size}: multi_tensor vs {baseline}",
                "stock_ms": round(ms, 3),
                "ours_ms": round(multi_ms, 3),
                "speedup": round(ms / multi_ms, 2),
                "stock_ops": report.num_ops,
                "ours_ops": multi_report.num_ops,
            }
            rows.append(row)
            print(row, flush=True)
        notes.append(
            f"multi_tensor_adam {size}: per step 1 TfmetalExt>MultiTensorAdam (multi_tensor=True) vs "
            f"{per_var_ops} ResourceApplyAdam (FusedAdam(multi_tensor=False)) vs {keras_report.num_ops} compute ops "
            "(keras Adam)."
        )
    notes.append(
        "multi_tensor_adam: one step = optimizer.apply(grads, variables) in a tf.function with fixed gradients; "
        "stock = the baseline named in the case; multi_tensor and per-variable FusedAdam results checked bitwise "
        "equal."
    )
    return rows, notes


# ----------------------------------------------------------------------------
# Dropout in training: the op (TfmetalExt>Dropout + DropoutGrad) against Keras' Dropout (the CPU
# tables' custom_dropout row quotes these figures).

DROPOUT_SHAPES = ((64, 1600), (64, 128, 256), (32, 197, 192), (8, 64, 64, 32))


def bench_dropout(ctx):
    from tfmetal_ext.ops.dropout import dropout as op

    rows = []
    for shape in DROPOUT_SHAPES:
        x = tf.constant(np.random.default_rng(5).normal(size=shape).astype("float32"))
        stock_layer = keras.layers.Dropout(0.5, seed=1)
        ours_layer = keras.layers.Dropout(0.5, seed=1)  # the same seed state: the op draws Keras' mask

        def make(fn):
            @tf.function(autograph=False)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = fn(x)
                    loss = tf.reduce_sum(y * y)
                return tape.gradient(loss, x)

            return step

        stock = make(lambda t: stock_layer(t, training=True))
        ours = make(lambda t: op(t, 0.5, seed=ours_layer.seed_generator))
        np.testing.assert_array_equal(ours(x).numpy(), stock(x).numpy())  # the same mask, bit for bit
        times = paired_rounds({"stock": lambda: stock(x).numpy(), "ours": lambda: ours(x).numpy()},
                              rounds=max(ctx.rounds, 5), repeats=ctx.repeats)
        row = _timing_row("dropout", f"float32 {'x'.join(map(str, shape))} rate 0.5",
                          statistics.median(times["stock"]), statistics.median(times["ours"]),
                          ratio(times, "stock", "ours"), _num_ops(stock, x), _num_ops(ours, x), digits=3)
        print(row, flush=True)
        rows.append(row)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset: TF's default)")
    return rows, [
        "dropout: one step = dx of sum(dropout(x)^2) in one tf.function; stock = keras.layers.Dropout(0.5) "
        f"(stateless dropout, the mask kept for the backward), ours = {fusion.DROPOUT_OP} + "
        f"{fusion.DROPOUT_GRAD_OP} (the mask drawn again); TF_ENABLE_ONEDNN_OPTS={onednn}. speedup = median "
        "over paired rounds of stock / ours (< 1: the op is slower)."
    ]


# ----------------------------------------------------------------------------
# Activation gradients (a feed-forward's backward pass).

ACTIVATION_GRAD_SHAPE = (4096, 512)
ACTIVATION_GRAD_FORMS = {
    "silu": tf.nn.silu,
    "gelu": lambda t: tf.nn.gelu(t, approximate=False),
    "gelu_approximate": lambda t: tf.nn.gelu(t, approximate=True),
}


def bench_activation_grad(ctx):
    rng = np.random.default_rng(6)
    x = tf.constant(rng.normal(0.0, 2.0, ACTIVATION_GRAD_SHAPE).astype("float32"))
    dy = tf.constant(rng.normal(0.0, 1.0, ACTIVATION_GRAD_SHAPE).astype("float32"))
    rows = []
    for kind in fusion.ACTIVATION_GRAD_ACTIVATIONS:
        act = ACTIVATION_GRAD_FORMS[kind]

        @tf.function(autograph=False)
        def stock(x, dy, act=act):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = act(x)
            return y, tape.gradient(y, x, output_gradients=dy)

        @tf.function(autograph=False)
        def ours(x, dy, act=act, kind=kind):
            return act(x), ops.activation_grad(dy, x, kind)

        # A sanity check of the timed functions, not the op's accuracy test (tests/ops/test_activation_grad.py):
        # TF's tanh-GELU gradient loses ~1e-5 absolute where 1 - tanh(u)^2 cancels (|dy| up to ~5 here).
        for got, want in zip(ours(x, dy), stock(x, dy)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-4)
        times = paired_rounds({"stock": lambda: [t.numpy() for t in stock(x, dy)],
                               "ours": lambda: [t.numpy() for t in ours(x, dy)]},
                              rounds=max(ctx.rounds, 5), repeats=ctx.repeats)
        row = _timing_row("activation_grad", f"{kind} float32 {'x'.join(map(str, ACTIVATION_GRAD_SHAPE))}",
                          statistics.median(times["stock"]), statistics.median(times["ours"]),
                          ratio(times, "stock", "ours"), _num_ops(stock, x, dy), _num_ops(ours, x, dy), digits=3)
        print(row, flush=True)
        rows.append(row)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset: TF's default)")
    return rows, [
        "activation_grad: one step = y = act(x) and dx = dy * act'(x) in one tf.function; stock = TF's autodiff "
        f"of tf.nn.silu / tf.nn.gelu, ours = the same forward and one {fusion.ACTIVATION_GRAD_OP}; "
        f"TF_ENABLE_ONEDNN_OPTS={onednn}. speedup = median over paired rounds of stock / ours."
    ]


# ----------------------------------------------------------------------------

# ----------------------------------------------------------------------------
# Softmax cross-entropy with integer labels (a language model's loss).


def bench_sparse_softmax_cross_entropy(ctx):
    rows_out = []
    for n, classes in ((2048, 1000), (4096, 1000), (2048, 32000)):
        rng = np.random.default_rng(5)
        x = tf.constant(rng.normal(0.0, 3.0, (n, classes)).astype("float32"))
        labels = tf.constant(rng.integers(0, classes, n).astype("int32"))

        def make(fn):
            @tf.function(autograph=False)
            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_mean(fn(labels, x))
                return loss, tape.gradient(loss, x)

            return step

        stock = make(tf.nn.sparse_softmax_cross_entropy_with_logits)
        ours = make(ops.sparse_softmax_cross_entropy)
        for got, want in zip(ours(x), stock(x)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-8)
        stock_ms, ours_ms = ctx.alternate(lambda: stock(x), lambda: ours(x))
        row = _timing_row("sparse_softmax_cross_entropy", f"float32 {n}x{classes}", stock_ms, ours_ms,
                          stock_ms / ours_ms, _num_ops(stock, x), _num_ops(ours, x))
        row.update(_bandwidth_columns(ctx, 3 * n * classes * 4, ours_ms))
        print(row, flush=True)
        rows_out.append(row)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset)")
    return rows_out, [
        "sparse_softmax_cross_entropy: one step = the mean loss and the logits' gradient; stock = "
        f"tf.nn.sparse_softmax_cross_entropy_with_logits, ours = {fusion.SPARSE_XENT_OP} + "
        f"{fusion.SPARSE_XENT_GRAD_OP}; bytes moved by ours = 3 x the logits (read forward, read and written "
        f"backward); TF_ENABLE_ONEDNN_OPTS={onednn}."
    ]


# ----------------------------------------------------------------------------
# A decoding step's projections: a few rows times a weight matrix.


def bench_gemv(ctx):
    """Chains of 16 products (x @ W then @ P, alternating, so each reads the last one's output) in one
    tf.function, stock MatMul (+ BiasAdd, which the remapper makes one _FusedMatMul) against
    TfmetalExt>Gemv; per-product times."""
    rows_out = []
    chain = 16
    for bias in (False, True):
        for m in (1, 4, 8, 16):
            for k, n in ((256, 512), (512, 256), (1024, 1024)):
                rng = np.random.default_rng(9)
                x = tf.constant(rng.normal(0.0, 0.1, (m, k)).astype("float32"))
                w = tf.Variable(rng.normal(0.0, 1.0 / np.sqrt(k), (k, n)).astype("float32"))
                p = tf.Variable(rng.normal(0.0, 1.0 / np.sqrt(n), (n, k)).astype("float32"))
                bw = tf.constant(rng.normal(0.0, 0.1, n).astype("float32")) if bias else None
                bp = tf.constant(rng.normal(0.0, 0.1, k).astype("float32")) if bias else None

                def make(product):
                    @tf.function(autograph=False)
                    def run(x):
                        for _ in range(chain // 2):
                            x = product(product(x, w, bw), p, bp)
                        return x

                    return run

                def stock_product(x, w, b):
                    y = tf.linalg.matmul(x, w)
                    return y if b is None else tf.nn.bias_add(y, b)

                stock, ours = make(stock_product), make(ops.gemv)
                np.testing.assert_allclose(ours(x).numpy(), stock(x).numpy(), rtol=1e-4, atol=1e-5)
                stock_ms, ours_ms = ctx.alternate(lambda: stock(x), lambda: ours(x))
                case = f"float32 {m}x{k}x{n}{' +bias' if bias else ''}"
                row = _timing_row("gemv", case, stock_ms / chain * 1e3, ours_ms / chain * 1e3, stock_ms / ours_ms,
                                  _num_ops(stock, x), _num_ops(ours, x))
                row["unit"] = "us per product"
                print(row, flush=True)
                rows_out.append(row)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset)")
    return rows_out, [
        f"gemv: stock = MatMul (+ BiasAdd: one _FusedMatMul after the remapper), ours = {fusion.GEMV_OP}; "
        f"stock_ms / ours_ms of these rows are microseconds per product, from a chain of {chain} products on "
        "variables in one function (the op counts are the chain's); the layers use the op for a decoding "
        f"step's rows, up to fusion.GEMV_MAX_ROWS = {fusion.GEMV_MAX_ROWS}; TF_ENABLE_ONEDNN_OPTS={onednn}."
    ]


SECTIONS = {"copy": bench_copy, "layer_norm": bench_layer_norm, "softshrink": bench_softshrink,
            "batch_norm_act": bench_batch_norm_act, "multi_tensor_adam": bench_multi_tensor_adam,
            "dropout": bench_dropout, "activation_grad": bench_activation_grad,
            "sparse_softmax_cross_entropy": bench_sparse_softmax_cross_entropy, "gemv": bench_gemv}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from: " + ", ".join(SECTIONS))
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    status = ops.status()
    if not status.loaded:
        raise SystemExit(f"the op library is not loaded: {status}")
    ctx = Context(args)
    start = time.monotonic()
    rows, notes = [], [str(status)]
    for name in names:
        section_rows, section_notes = SECTIONS[name](ctx)
        rows += section_rows
        notes += section_notes
    notes.append(
        "speedup = stock_ms / ours_ms; of_copy_bandwidth = ours_GBps / copy_GBps; "
        f"medians of {args.rounds} alternating rounds x {args.repeats} calls; total {time.monotonic() - start:.0f} s."
    )
    write_results("bench_ops", rows, list(COLUMNS), notes=notes)


if __name__ == "__main__":
    main()
