"""Attention: tfmetal_ext.ops.attention vs Keras' dot_product_attention, and a transformer encoder converted.

Three cases, stock and ours measured in the same process (the memory case: one fresh process per measurement):

1. ``attention``: one fwd+bwd step (``tf.GradientTape`` inside a ``tf.function``: the output and the
   gradients of q, k, v for a fixed random output cotangent) of ``tfmetal_ext.ops.attention.attention``
   against ``keras.ops.dot_product_attention`` (TF backend), batch 4, 8 heads, head_dim 64,
   T in {256, 1024, 4096}, float32, on the CPU: compute ops per step, median step time and the speed-up.
   Each function gets its native layout, made outside the timed function: ours (batch, heads, seq, dim),
   Keras (batch, seq, heads, dim). ``fused_bthd`` is ours fed Keras' layout, transposing inside the
   step (what a Keras-layout caller pays).
2. ``memory``: the peak memory of that step at T=4096, one fresh subprocess per implementation (see
   ``memory_worker`` for the method).
3. ``encoder``: the train step of a transformer-encoder classifier (token Embedding + a learned
   position embedding, MultiHeadAttention, LayerNormalization, a Dense ffn, GlobalAveragePooling1D,
   a Dense softmax; embed 256, 4 heads, ff 512, T=256, batch 32) against the same model through
   ``tfmetal_ext.convert()``: ops per train step and step time, float32, and mixed_bfloat16 where
   ``tfmetal_ext.devices.capabilities().cpu_bf16`` says the CPU computes bfloat16.

Whether ours ran the custom op or its pure-TF reference (``ops.attention.uses_kernel()``), and whether
convert() mapped the MultiHeadAttention, are part of the output: the figures are of what ran.

    .venv/bin/python benchmarks/bench_attention.py            # full (minutes on 2 cores)
    .venv/bin/python benchmarks/bench_attention.py --quick    # tiny sizes, a few steps (the test runs this)
    .venv/bin/python benchmarks/bench_attention.py --cases attention --seqs 1024
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, environment, git_head, ratio  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext.conversion import VerificationError  # noqa: E402

# The module (tfmetal_ext.ops re-exports the function under the same name): uses_kernel, the op names.
attention_ops = importlib.import_module("tfmetal_ext.ops.attention")

CASES = ("attention", "memory", "encoder")
FULL = dict(batch=4, heads=8, head_dim=64, seqs=(256, 1024, 4096), memory_seq=4096, rounds=5, repeats=3,
            encoder=dict(seq=256, batch=32, vocab=20000, embed=256, heads=4, ff=512, classes=2))
QUICK = dict(batch=2, heads=2, head_dim=16, seqs=(32, 64), memory_seq=64, rounds=2, repeats=2,
             encoder=dict(seq=16, batch=4, vocab=100, embed=32, heads=2, ff=32, classes=2))
# Above this sequence length a step takes seconds: fewer rounds, one step per round.
LONG_SEQ = 2048


# ----------------------------------------------------------------------------
# Environment.


def bench_environment():
    env = environment()
    env["git"] = git_head()
    return env


def kernel_state():
    """Whether ops.attention runs the custom op here, and the op library's status line."""
    uses = bool(attention_ops.uses_kernel())
    return dict(uses_kernel=uses, fused_path="kernel" if uses else "reference (pure TF, scores materialized)",
                ops_status=str(tfmetal_ext.ops.status()))


# ----------------------------------------------------------------------------
# Timing.


def paired_rounds(fns, *, rounds, repeats, warmup=1):
    """Every function of `fns` once per round (order rotated): `warmup` untimed calls, `repeats` timed.

    Returns ``(wall, cpu)``: key -> [median ms per round] of wall time, and of this process's CPU time
    (user + system, all threads). On a shared, overloaded host the wall time of a step includes waiting
    for a core; the CPU time is the work the step did, which the other jobs disturb far less. Ratios
    within a round (`_common.ratio`) let drift between rounds cancel.
    """
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    keys = list(fns)
    for rnd in range(rounds):
        for k in keys[rnd % len(keys):] + keys[: rnd % len(keys)]:
            for _ in range(warmup):
                fns[k]()
            w, c = [], []
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                fns[k]()
                c.append((time.process_time() - c0) * 1e3)
                w.append((time.perf_counter() - w0) * 1e3)
            wall[k].append(statistics.median(w))
            cpu[k].append(statistics.median(c))
    return wall, cpu


# ----------------------------------------------------------------------------
# Case 1: attention fwd+bwd.


def _to_bthd(t):
    return tf.transpose(t, [0, 2, 1, 3])


def fused_step(q, k, v, d_out):
    """Ours, (batch, heads, seq, dim): (output, d_query, d_key, d_value)."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = attention_ops.attention(q, k, v)
    return (out, *tape.gradient(out, [q, k, v], output_gradients=d_out))


def fused_bthd_step(q, k, v, d_out):
    """Ours fed Keras' (batch, seq, heads, dim) layout, transposing inside the step."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = _to_bthd(attention_ops.attention(_to_bthd(q), _to_bthd(k), _to_bthd(v)))
    return (out, *tape.gradient(out, [q, k, v], output_gradients=d_out))


def stock_step(q, k, v, d_out):
    """keras.ops.dot_product_attention, (batch, seq, heads, dim): (output, d_query, d_key, d_value)."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = keras.ops.dot_product_attention(q, k, v)
    return (out, *tape.gradient(out, [q, k, v], output_gradients=d_out))


STEPS = {"stock": (stock_step, "bthd"), "fused": (fused_step, "bhtd"), "fused_bthd": (fused_bthd_step, "bthd")}


def attention_inputs(batch, heads, seq, head_dim, seed=0):
    """(q, k, v, d_out) in (batch, heads, seq, dim) and the same tensors in (batch, seq, heads, dim)."""
    rng = np.random.default_rng(seed)
    bhtd = tuple(tf.constant(rng.standard_normal((batch, heads, seq, head_dim)).astype("float32"))
                 for _ in range(4))
    return bhtd, tuple(_to_bthd(t) for t in bhtd)


def _max_abs_diff(fused, stock):
    """Largest |ours - stock| over the output and the three gradients (ours in (b, h, t, d))."""
    return max(float(tf.reduce_max(tf.abs(_to_bthd(a) - b))) for a, b in zip(fused, stock))


def _count(report, *names):
    return sum(report.ops_by_type.get(n, 0) for n in names)


def score_bytes(batch, heads, seq):
    """Bytes of one float32 (batch, heads, seq, seq) score matrix."""
    return 4 * batch * heads * seq * seq


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_attention(seq, cfg, rounds, repeats):
    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    row = dict(seq=seq, batch=b, heads=h, head_dim=d, dtype="float32", errors={})
    # The stock step keeps several (b, h, T, T) float32 tensors alive at once (logits, probabilities
    # and their gradients); refuse a size the machine cannot hold rather than push it into swap or OOM.
    need, avail = 6 * score_bytes(b, h, seq), _mem_available()
    if avail is not None and need > 0.8 * avail:
        row["errors"]["skipped"] = (f"needs ~{need / 2**30:.1f} GiB (6 score matrices), "
                                    f"{avail / 2**30:.1f} GiB available")
        return row
    bhtd, bthd = attention_inputs(b, h, seq, d)
    # A long step takes a minute on a loaded 2-core box: its ops are counted on a T=LONG_SEQ step (the
    # same graph), and the Keras-layout variant of ours is left out.
    count_seq = min(seq, LONG_SEQ)
    small = attention_inputs(b, h, count_seq, d) if count_seq != seq else (bhtd, bthd)
    row["ops_counted_at_seq"] = count_seq
    fns, results = {}, {}
    for name, (step, layout) in STEPS.items():
        if name == "fused_bthd" and seq > LONG_SEQ:
            continue
        fn = tf.function(step)
        args = bhtd if layout == "bhtd" else bthd
        try:
            results[name] = fn(*args)  # trace + first run
            report = tfmetal_ext.inspect.fusion_report(fn, small[0] if layout == "bhtd" else small[1])
        except Exception as e:  # noqa: BLE001 - a failing variant is recorded, the others go on
            row["errors"][name] = _first_line(e)
            continue
        row[f"{name}_ops"] = report.num_ops
        row[f"{name}_einsum_ops"] = _count(report, "Einsum")
        row[f"{name}_attention_ops"] = _count(report, attention_ops.ATTENTION_OP, attention_ops.ATTENTION_GRAD_OP)
        fns[name] = (lambda f, a: (lambda: f(*a)))(fn, args)
    if "fused" in results and "stock" in results:
        row["max_abs_diff"] = _max_abs_diff(results["fused"], results["stock"])
    if "stock" in results and "fused_bthd" in results:
        row["max_abs_diff_bthd"] = max(float(tf.reduce_max(tf.abs(a - c)))
                                       for a, c in zip(results["fused_bthd"], results["stock"]))
    del results
    warmup = 1
    if seq > LONG_SEQ:  # a step takes many seconds; each variant already ran once
        rounds, repeats, warmup = min(rounds, 3), 1, 0
    row["rounds"], row["repeats"] = rounds, repeats
    if not fns:
        return row
    times, cpu = paired_rounds(fns, rounds=rounds, repeats=repeats, warmup=warmup)
    for name in fns:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_cpu_ms"] = statistics.median(cpu[name])
    if "stock" in fns:
        for name in ("fused", "fused_bthd"):
            if name in fns:
                row[f"{name}_speedup"] = ratio(times, "stock", name)
                row[f"{name}_cpu_speedup"] = ratio(cpu, "stock", name)
                row[f"{name}_ops_ratio"] = row[f"{name}_ops"] / row["stock_ops"]
    return row


# ----------------------------------------------------------------------------
# Case 2: peak memory of the step, one fresh process per implementation.


def _rss_bytes():
    """The current resident set size (Linux /proc/self/statm), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _status_bytes(field):
    """A ``kB`` field of /proc/self/status (``VmHWM``, ``VmData``, ...) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss():
    """Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); True if it did."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes():
    """This process's peak RSS: VmHWM on Linux, else ru_maxrss (bytes on macOS, KiB elsewhere).

    Not ru_maxrss on Linux: a process started by fork + exec inherits its parent's ru_maxrss when that
    is larger (the bench's parent has itself run a T=4096 stock step), while VmHWM is its own.
    """
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_worker(impl, seq, cfg, limit_bytes=None):
    """Measures one step's peak memory in this (fresh) process.

    Method: the step is a ``tf.function`` with a (None, None, None, head_dim) input signature, traced,
    optimized and run once at T=16 first (kernels loaded, allocator warm), so the measured call only
    executes. The T-sized inputs are made, the peak RSS is reset to the current RSS (Linux
    /proc/self/clear_refs "5") and the current RSS read (``before``), the step runs once at T, and the
    peak RSS (VmHWM; ru_maxrss where there is no /proc) is read (``peak``). ``step = peak - before``:
    the memory the step itself added at its peak (inputs excluded; outputs and gradients included).
    With `limit_bytes`, RLIMIT_DATA is set to the process's data size + `limit_bytes` before the step,
    so a step that would exhaust the machine fails (ResourceExhaustedError) instead.
    """
    step, layout = STEPS[impl]
    d = cfg["head_dim"]
    spec = tf.TensorSpec([None, None, None, d], tf.float32)
    fn = tf.function(step, input_signature=[spec] * 4)
    small_bhtd, small_bthd = attention_inputs(cfg["batch"], cfg["heads"], min(seq, 16), d)
    fn(*(small_bhtd if layout == "bhtd" else small_bthd))
    shape = (cfg["batch"], cfg["heads"], seq, d) if layout == "bhtd" else (cfg["batch"], seq, cfg["heads"], d)
    args = [tf.random.stateless_normal(shape, seed=[i, 0]) for i in range(4)]
    if limit_bytes:
        data = _status_bytes("VmData")
        if data is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (data + int(limit_bytes), resource.RLIM_INFINITY))
    peak_before = _peak_rss_bytes()
    reset = _reset_peak_rss()
    before = _rss_bytes()
    start = time.perf_counter()
    outputs = fn(*args)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    del outputs
    mib = 2.0 ** 20
    return dict(impl=impl, seq=seq, batch=cfg["batch"], heads=cfg["heads"], head_dim=d,
                peak_reset=reset, peak_before_mb=peak_before / mib,
                before_mb=before / mib if before is not None else None,
                peak_mb=peak / mib, step_mb=(peak - before) / mib if before is not None else None,
                step_s=seconds, uses_kernel=bool(attention_ops.uses_kernel()),
                input_mb=4 * int(np.prod(shape)) * 4 / mib,
                score_matrix_mb=score_bytes(cfg["batch"], cfg["heads"], seq) / mib)


def run_memory(seq, cfg, quick, timeout):
    """One subprocess per implementation (stock, fused); rows with the peak and the fused/stock ratio."""
    avail = _mem_available()
    # The limit lets a child fail cleanly instead of exhausting a shared machine.
    limit = int(0.75 * avail) if avail else None
    rows = []
    for impl in ("stock", "fused"):
        with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", impl, "--seq", str(seq), "--out", out]
        if quick:
            cmd.append("--quick")
        if limit:
            cmd += ["--limit-bytes", str(limit)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            with open(out) as f:
                text = f.read()
            if proc.returncode == 0 and text:
                rows.append(json.loads(text))
            else:
                tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])[-500:]
                rows.append(dict(impl=impl, seq=seq, errors={"process": f"exit {proc.returncode}: {tail}"}))
        except subprocess.TimeoutExpired:
            rows.append(dict(impl=impl, seq=seq, errors={"process": f"timed out after {timeout:.0f} s"}))
        finally:
            os.unlink(out)
    by = {r["impl"]: r for r in rows}
    if by["stock"].get("step_mb") and by["fused"].get("step_mb") is not None:
        by["fused"]["step_ratio"] = by["fused"]["step_mb"] / by["stock"]["step_mb"]
        by["fused"]["peak_ratio"] = by["fused"]["peak_mb"] / by["stock"]["peak_mb"]
    for r in rows:
        r["limit_mb"] = limit / 2.0 ** 20 if limit else None
    return rows


# ----------------------------------------------------------------------------
# Case 3: a transformer-encoder classifier, stock and converted.


@keras.saving.register_keras_serializable(package="bench_attention")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned (seq, embed) position embedding to its (batch, seq, embed) input."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=tuple(input_shape[1:]), initializer="glorot_uniform",
                                          name="embeddings")

    def call(self, x):
        return x + keras.ops.cast(self.embeddings, x.dtype)


def encoder_classifier(seq, vocab, embed, heads, ff, classes, **_):
    """One post-norm transformer-encoder block on token + position embeddings, mean-pooled, softmax head."""
    inp = keras.Input((seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, embed, name="token_embedding")(inp)
    x = PositionEmbedding(name="position_embedding")(x)
    a = keras.layers.MultiHeadAttention(heads, embed // heads, name="mha")(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln1")(keras.layers.Add(name="add1")([x, a]))
    f = keras.layers.Dense(ff, activation="relu", name="ffn1")(x)
    f = keras.layers.Dense(embed, name="ffn2")(f)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln2")(keras.layers.Add(name="add2")([x, f]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    out = keras.layers.Dense(classes, activation="softmax", name="classifier")(x)
    return keras.Model(inp, out, name="encoder_classifier")


def _first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _compile(model, optimizer):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())


def _train_ops(model, x, y, optimizer):
    _compile(model, optimizer)
    return tfmetal_ext.inspect.fusion_report(model, x, mode="train", targets=y)


def _train_fn(model, x, y, optimizer):
    _compile(model, optimizer)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # build and trace
    it = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    fn = model.train_function
    return lambda: fn(it)


def run_encoder(policy, cfg, rounds, repeats):
    row = dict(policy=policy, seq=cfg["seq"], batch=cfg["batch"], embed=cfg["embed"], heads=cfg["heads"],
               ff=cfg["ff"], errors={})
    previous = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"])).astype("int32")
        y = rng.integers(0, cfg["classes"], cfg["batch"]).astype("int32")
        stock = encoder_classifier(**cfg)
        ours = None
        try:
            ours = tfmetal_ext.convert(stock, count_ops=False)
            row["verified"] = "yes"
        except VerificationError as e:
            row["verified"] = "no (VerificationError)"
            row["errors"]["convert"] = _first_line(e)
            ours = tfmetal_ext.convert(stock, count_ops=False, verify=False)
        except Exception as e:  # noqa: BLE001 - a refused conversion is recorded; stock is still measured
            row["verified"] = f"refused ({type(e).__name__})"
            row["errors"]["convert"] = _first_line(e)
        reports = {"stock": _train_ops(stock, x, y, keras.optimizers.Adam()),
                   "stock_fused_adam": _train_ops(stock, x, y, tfmetal_ext.optimizers.FusedAdam())}
        fns = {"stock": _train_fn(stock, x, y, keras.optimizers.Adam())}
        if ours is not None:
            report = ours.conversion_report
            row["rewrites"], row["kept"] = len(report.rewrites), len(report.kept)
            row["mha_layer"] = type(ours.get_layer("mha")).__name__
            reports["ours"] = _train_ops(ours, x, y, tfmetal_ext.optimizers.FusedAdam())
            reports["ours_keras_adam"] = _train_ops(ours, x, y, keras.optimizers.Adam())
            fns["ours"] = _train_fn(ours, x, y, tfmetal_ext.optimizers.FusedAdam())
        for name, rep in reports.items():
            row[f"{name}_ops"] = rep.num_ops
            if name in ("stock", "ours"):
                row[f"{name}_einsum_ops"] = _count(rep, "Einsum")
                row[f"{name}_attention_ops"] = _count(rep, attention_ops.ATTENTION_OP, attention_ops.ATTENTION_GRAD_OP)
            if name != "stock":
                row[f"{name}_ops_ratio"] = rep.num_ops / row["stock_ops"]
        times, cpu = paired_rounds(fns, rounds=rounds, repeats=repeats)
        row["stock_ms"] = statistics.median(times["stock"])
        row["stock_cpu_ms"] = statistics.median(cpu["stock"])
        if "ours" in fns:
            row["ours_ms"] = statistics.median(times["ours"])
            row["ours_cpu_ms"] = statistics.median(cpu["ours"])
            row["speedup"] = ratio(times, "stock", "ours")
            row["cpu_speedup"] = ratio(cpu, "stock", "ours")
        row["rounds"], row["repeats"] = rounds, repeats
    except Exception as e:  # noqa: BLE001 - recorded in the row, the rest of the run goes on
        row["errors"]["encoder"] = _first_line(e)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return row


# ----------------------------------------------------------------------------
# Output.

ATTENTION_COLUMNS = ["seq", "batch", "heads", "head_dim", "stock_ops", "fused_ops", "fused_ops_ratio",
                     "stock_einsum_ops", "fused_attention_ops", "stock_ms", "fused_ms", "fused_speedup",
                     "stock_cpu_ms", "fused_cpu_ms", "fused_cpu_speedup", "fused_bthd_ms", "fused_bthd_speedup",
                     "max_abs_diff"]
MEMORY_COLUMNS = ["impl", "seq", "uses_kernel", "peak_reset", "before_mb", "peak_mb", "step_mb", "step_ratio",
                  "peak_ratio", "score_matrix_mb", "step_s"]
ENCODER_COLUMNS = ["policy", "verified", "mha_layer", "rewrites", "kept", "stock_ops", "ours_ops", "ours_ops_ratio",
                   "ours_keras_adam_ops", "stock_fused_adam_ops", "stock_einsum_ops", "ours_einsum_ops",
                   "ours_attention_ops", "stock_ms", "ours_ms", "speedup", "stock_cpu_ms", "ours_cpu_ms",
                   "cpu_speedup"]


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def _table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def notes(args, state):
    out = [
        f"ours = tfmetal_ext.ops.attention.attention, uses_kernel()={state['uses_kernel']}: it ran the "
        f"{state['fused_path']} here",
        "attention: one fwd+bwd step (tf.GradientTape inside tf.function: output and d_query, d_key, d_value for a "
        "fixed random cotangent), float32, CPU; stock = keras.ops.dot_product_attention (TF backend, Einsum + "
        "Softmax, (b, t, h, d)), ours given (b, h, t, d); both layouts made outside the timed function; "
        "fused_bthd = ours fed (b, t, h, d), transposing inside the step; max_abs_diff = largest |ours - stock| "
        "over the output and the three gradients",
        "ops = compute nodes per step of the post-grappler graph (tfmetal_ext.inspect FusionReport.num_ops: no "
        "_Arg/_Retval/Const/NoOp/Identity)",
        "times: median ms across paired rounds (every variant once per round after one warm-up call, order "
        "rotated); speedup = median over rounds of stock / ours within the round; *_cpu_ms / cpu_speedup: the "
        "same for the process's CPU time (user + system, all threads: the work done, less disturbed by other "
        f"jobs than wall time); T > {LONG_SEQ}: at most 3 rounds of 1 step, no warm-up call, ops counted on "
        f"a T={LONG_SEQ} step of the same function (ops_counted_at_seq), no fused_bthd",
        "memory: one fresh process per implementation; the step is a tf.function with a (None, None, None, d) "
        "signature traced and run once at T=16 first; then the T-sized inputs are made, the peak RSS reset to the "
        "current RSS (/proc/self/clear_refs 5; peak_reset) and RSS read (before_mb), the step run once, the peak "
        "RSS read (VmHWM; not ru_maxrss, which a child inherits from its parent on Linux) (peak_mb); "
        "step_mb = peak_mb - before_mb (the step's own peak: "
        "intermediates, outputs and gradients; inputs excluded); step_ratio = fused / stock of step_mb; "
        "score_matrix_mb = one float32 (b, h, T, T) matrix; a child may not grow its data segment past 75% of "
        "the memory available at the start (RLIMIT_DATA), so a step too big fails instead of exhausting the box",
        "encoder: stock = the Keras model with keras Adam; ours = tfmetal_ext.convert(stock) with "
        "tfmetal_ext.optimizers.FusedAdam (ours_keras_adam / stock_fused_adam: the layers' and the optimizer's "
        "shares); mha_layer = the class convert() left at the MultiHeadAttention's place; step = model.fit's own "
        "train function",
        "targets (issue 16): attention fused_speedup >= 2 at T=1024; memory step_ratio <= 1/8 at T=4096; "
        "encoder ours_ops_ratio <= 0.5 and speedup >= 1.5 (float32)",
        "the machine is a shared 2-core VM with other jobs running: times are noisy (load_avg_1min in the "
        "environment); op counts are exact",
    ]
    if args.quick:
        out.append("--quick: tiny sizes and a few steps (a smoke run): no figure of it means anything")
    out.append("command: " + " ".join(["python", "benchmarks/bench_attention.py"] + args.argv))
    return out


def write(path_base, result):
    """Writes <path_base>.json and .md; returns the Markdown text."""
    os.makedirs(os.path.dirname(path_base), exist_ok=True)
    with open(path_base + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    env, state = result["environment"], result["kernel"]
    lines = [f"# {os.path.basename(path_base)}", "",
             f"CPU: {env['cpu']} ({env['cpu_count']} cores; flags {', '.join(env['cpu_flags']) or 'none'}; "
             f"cpu_bf16={env['cpu_bf16']}; oneDNN {'on' if env['onednn'] else 'off'})", "",
             f"ops.attention.uses_kernel() = {state['uses_kernel']} (ours ran the {state['fused_path']}); "
             f"{state['ops_status']}", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k not in ("cpu", "cpu_flags")), ""]
    for case, columns, title in (("attention", ATTENTION_COLUMNS, "Attention fwd+bwd (float32, CPU)"),
                                 ("memory", MEMORY_COLUMNS, "Peak memory of the step (MiB, fresh process each)"),
                                 ("encoder", ENCODER_COLUMNS, "Transformer-encoder classifier train step")):
        if case not in result["cases"]:
            continue
        rows = result[case]
        lines += [f"## {title}", ""] + _table(rows, columns) + [""]
        lines += [f"- {case} {r.get('policy', r.get('seq'))}"
                  + (f" {r['impl']}" if "impl" in r else "") + f": {k}: {v}"
                  for r in rows for k, v in r.get("errors", {}).items()]
        lines += [f"- encoder {s['policy']}: skipped: {s['reason']}" for s in result.get("skipped", [])
                  if case == "encoder"]
        lines.append("")
    lines += [f"- {n}" for n in result["notes"]]
    text = "\n".join(lines) + "\n"
    with open(path_base + ".md", "w") as f:
        f.write(text)
    return text


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few steps (smoke run)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    parser.add_argument("--seqs", default=None, help="attention sequence lengths (default 256,1024,4096)")
    parser.add_argument("--memory-seq", type=int, default=None, help="memory case T (default 4096)")
    parser.add_argument("--policies", default=None,
                        help="encoder policies (default float32, plus mixed_bfloat16 if capabilities().cpu_bf16)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per memory subprocess")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other cases' rows of an existing results file (rerun some cases only)")
    parser.add_argument("--memory-worker", choices=("stock", "fused"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--limit-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    cfg = QUICK if args.quick else FULL

    if args.memory_worker:
        row = memory_worker(args.memory_worker, args.seq, cfg, args.limit_bytes)
        with open(args.out, "w") as f:
            json.dump(row, f)
        return row

    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"Unknown case(s) {unknown}; choose from {CASES}")
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(cfg["seqs"])
    rounds = args.rounds or cfg["rounds"]
    repeats = args.repeats or cfg["repeats"]
    caps = tfmetal_ext.devices.capabilities()
    if args.policies:
        policies = args.policies.split(",")
    else:
        policies = ["float32"] + (["mixed_bfloat16"] if caps.cpu_bf16 else [])
    state = kernel_state()
    result = dict(environment=bench_environment(), kernel=state, cases=cases, attention=[], memory=[],
                  encoder=[], skipped=[], notes=notes(args, state))
    if "mixed_bfloat16" not in policies and "encoder" in cases:
        result["skipped"].append(dict(policy="mixed_bfloat16", reason=(
            f"capabilities().cpu_bf16 is False on this CPU ({result['environment']['cpu']}, flags "
            f"{result['environment']['cpu_flags']}): bfloat16 would be emulated; --policies to force")))
    name = "attention_quick" if args.quick else "attention"
    base = os.path.join(args.results_dir, name)
    if args.merge and os.path.exists(base + ".json"):
        with open(base + ".json") as f:
            previous = json.load(f)
        kept = [c for c in previous.get("cases", []) if c not in cases]
        for c in kept:
            result[c] = previous.get(c, [])
        if "encoder" in kept:
            result["skipped"] = previous.get("skipped", [])
        result["cases"] = [c for c in CASES if c in cases or c in kept]
        result["notes"].append(f"--merge: the {', '.join(kept) or 'no'} case(s) are from the previous run "
                               f"(environment then: {previous.get('environment')})")
    print(f"CPU: {result['environment']['cpu']}; ops.attention.uses_kernel() = {state['uses_kernel']}",
          file=sys.stderr, flush=True)
    for case in cases:
        start = time.perf_counter()
        if case == "attention":
            for seq in seqs:
                result["attention"].append(run_attention(seq, cfg, rounds, repeats))
                write(base, result)
        elif case == "memory":
            result["memory"] = run_memory(args.memory_seq or cfg["memory_seq"], cfg, args.quick, args.timeout)
        else:
            for policy in policies:
                result["encoder"].append(run_encoder(policy, cfg["encoder"], rounds, repeats))
                write(base, result)
        write(base, result)
        print(f"[{case}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    print(write(base, result))
    return result


if __name__ == "__main__":
    main()
