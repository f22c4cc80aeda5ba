"""keras-hub transformers: convert() + a fused optimizer against stock keras-hub + Keras Adam.

Tiny configurations built from the constructors (no presets, no network): 2 layers, hidden 256,
intermediate 512, 4 query heads (2 key/value heads where the family has grouped-query attention),
vocabulary 1000. For each family, stock and ours measured in the same process:

1. ``train``: the fine-tuning step of the backbone with a token-level Dense head (sparse
   cross-entropy), compiled with Keras Adam, against ``tfmetal_ext.convert()`` of the same compiled
   model (FusedAdam): compute ops per train step (``inspect.fusion_report``), ``Einsum`` ops left in
   the converted step, the median step time at T (paired rounds, the order rotated each round) and
   the speed-up, whether convert() verified (outputs and gradients), and the predicted CPU fallbacks
   per step on both Metal backends (``placement_report(predict_for=...)``; a prediction from the
   backends' kernel tables, not a Mac measurement).
2. ``memory``: the peak memory of one train step at T=1024, one fresh subprocess per model, two
   ways: the process's peak RSS above its RSS before the step (VmHWM reset before the step; see
   ``bench_attention.memory_worker``), and TensorFlow's CPU allocator's peak bytes in use above
   those in use before it (``tf.config.experimental.get_memory_info``: the tensors alone).
3. ``generate``: ``CausalLM.generate()`` with the greedy sampler (GPT-2, Llama; preprocessor=None,
   token ids in), prompt 32 tokens, 64 generated: whether the tokens equal stock's, the prefill time
   (``generate`` to prompt + 1 token) and decode tokens/s (the rest), stock and ours, in paired
   rounds (the order rotated each round); the speed-ups are medians of per-round ratios.

Writes results/bench_hub.{json,md,png}. Timings are of this machine (see the environment line);
op counts are device-independent.

    .venv/bin/python benchmarks/bench_hub.py                    # all families, T=512 (minutes)
    .venv/bin/python benchmarks/bench_hub.py --quick            # tiny sizes (the test runs this)
    .venv/bin/python benchmarks/bench_hub.py --families llama --cases train
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, environment, git_head, paired_rounds, ratio, write_results  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext import inspect  # noqa: E402

FAMILIES = ("gpt2", "llama", "mistral", "qwen", "gemma", "bert")
GENERATE_FAMILIES = ("gpt2", "llama")
CASES = ("train", "memory", "generate")
BACKENDS = ("tensorflow-metal", "tensorflow-metal-plugin")
FULL = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, vocab=1000, batch=4, seq=512,
            memory_seq=1024, prompt=32, new_tokens=64, rounds=5, repeats=3, generate_rounds=11, generate_repeats=5)
QUICK = dict(hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1, vocab=100, batch=2, seq=16,
             memory_seq=32, prompt=4, new_tokens=4, rounds=2, repeats=2, generate_rounds=2, generate_repeats=2)


def backbone(family, cfg, max_len=2048):
    import keras_hub

    M = keras_hub.models
    common = dict(vocabulary_size=cfg["vocab"], num_layers=cfg["layers"], hidden_dim=cfg["hidden"],
                  intermediate_dim=cfg["intermediate"])
    gqa = dict(num_query_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"])
    if family == "gpt2":
        return M.GPT2Backbone(num_heads=cfg["heads"], max_sequence_length=max_len, **common)
    if family == "bert":
        return M.BertBackbone(num_heads=cfg["heads"], max_sequence_length=max_len, **common)
    if family == "llama":
        return M.LlamaBackbone(**gqa, **common)
    if family == "mistral":
        return M.MistralBackbone(**gqa, **common)
    if family == "qwen":
        return M.QwenBackbone(**gqa, **common)
    if family == "gemma":
        return M.GemmaBackbone(**gqa, head_dim=cfg["hidden"] // cfg["heads"], **common)
    raise ValueError(f"unknown family. Received: family={family!r}")


def inputs(family, cfg, seq, seed=0):
    rng = np.random.default_rng(seed)
    b = cfg["batch"]
    x = {"token_ids": rng.integers(1, cfg["vocab"], (b, seq)).astype("int32"),
         "padding_mask": np.ones((b, seq), "int32")}
    if family == "bert":
        x["segment_ids"] = np.zeros((b, seq), "int32")
    y = rng.integers(0, cfg["vocab"], (b, seq)).astype("int32")
    return x, y


def train_model(family, cfg):
    """The backbone with a token-level Dense head, compiled with Keras Adam (what a fine-tune compiles)."""
    keras.utils.set_random_seed(0)
    bb = backbone(family, cfg)
    ins = {k: keras.Input((None,), dtype="int32", name=k) for k in bb.input}
    h = bb(ins)
    h = h["sequence_output"] if isinstance(h, dict) else h
    model = keras.Model(ins, keras.layers.Dense(cfg["vocab"], name="head")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _train_fn(model, x, y):
    model.make_train_function()
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    it = iter(data)
    fn = model.train_function
    fn(it)
    return lambda: fn(it)


def _fallbacks(model, x, y):
    out = {}
    for backend in BACKENDS:
        try:
            rep = inspect.placement_report(model, x, targets=y, mode="train", predict_for=backend)
            counts = {}
            for e in rep.cpu_fallback + rep.fails:
                key = f"{e.op}({e.dtype})@{e.layer or '(step)'}"
                counts[key] = counts.get(key, 0) + e.count
            out[backend] = [f"{k} x{v}" for k, v in sorted(counts.items())]
        except Exception as e:  # a prediction failure is reported, never fatal
            out[backend] = f"prediction failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def run_train(family, cfg):
    x, y = inputs(family, cfg, cfg["seq"])
    stock = train_model(family, cfg)
    row = dict(case="train", family=family, seq=cfg["seq"], batch=cfg["batch"])
    try:
        ours = tfmetal_ext.convert(stock, inputs=x)
    except Exception as e:
        row["error"] = f"convert failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    report = ours.conversion_report
    row["verified"] = report.verified
    row["rewrites"] = len(report.rewrites)
    ops_s = inspect.fusion_report(stock, mode="train", inputs=x, targets=y).ops_by_type
    ops_o = inspect.fusion_report(ours, mode="train", inputs=x, targets=y).ops_by_type
    row.update(stock_ops=sum(ops_s.values()), ours_ops=sum(ops_o.values()), einsum_ours=ops_o.get("Einsum", 0),
               attention_ops=ops_o.get("TfmetalExt>Attention", 0))
    row["ops_ratio"] = row["ours_ops"] / row["stock_ops"]
    times = paired_rounds({"stock": _train_fn(stock, x, y), "ours": _train_fn(ours, x, y)},
                          rounds=cfg["rounds"], repeats=cfg["repeats"])
    row.update(stock_ms=statistics.median(times["stock"]), ours_ms=statistics.median(times["ours"]),
               speedup=ratio(times, "stock", "ours"))
    row["fallbacks"] = _fallbacks(ours, x, y)
    return row


def memory_worker(family, impl, cfg):
    """One train step's peak memory in this fresh process (the step traced and run at T=16 first)."""
    from bench_attention import _peak_rss_bytes, _reset_peak_rss, _rss_bytes

    model = train_model(family, cfg)
    if impl == "ours":
        small, _ = inputs(family, cfg, 16)
        model = tfmetal_ext.convert(model, inputs=small, verify=False, count_ops=False)
    spec = {k: tf.TensorSpec([None, None], tf.int32) for k in inputs(family, cfg, 16)[0]}
    opt = model.optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[spec, tf.TensorSpec([None, None], tf.int32)])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    step(*inputs(family, cfg, 16))
    x, y = inputs(family, cfg, cfg["memory_seq"])
    reset = _reset_peak_rss()
    before = _rss_bytes()
    try:  # TF's CPU allocator keeps statistics only with oneDNN on (TF_ENABLE_ONEDNN_OPTS=0: "Cannot reset")
        tf.config.experimental.reset_memory_stats("CPU:0")
        resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except ValueError:
        resident = None
    step(x, y)
    mib = 2.0 ** 20
    tf_peak_mb = None if resident is None else (tf.config.experimental.get_memory_info("CPU:0")["peak"] - resident) / mib
    # Two views of one step: the process's peak RSS above its RSS before the step (what the machine
    # gave the process, malloc's free lists included), and TensorFlow's own CPU allocator: its peak
    # bytes in use above what was in use before the step (the tensors alone; deterministic).
    return dict(family=family, impl=impl, seq=cfg["memory_seq"], peak_reset=reset,
                step_mb=(_peak_rss_bytes() - before) / mib,
                tf_peak_mb=tf_peak_mb)


def run_memory(family, cfg, quick):
    row = dict(case="memory", family=family, seq=cfg["memory_seq"], batch=cfg["batch"])
    for impl in ("stock", "ours"):
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", family, impl]
        if quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        if proc.returncode or line is None:
            row["error"] = f"{impl} worker failed: {proc.stderr.strip().splitlines()[-1:]}"
            return row
        result = json.loads(line)
        row[f"{impl}_mb"] = result["step_mb"]
        row[f"{impl}_tf_mb"] = result["tf_peak_mb"]
    row["memory_ratio"] = row["ours_mb"] / row["stock_mb"] if row["stock_mb"] else None
    row["tf_memory_ratio"] = row["ours_tf_mb"] / row["stock_tf_mb"] if row["stock_tf_mb"] and row["ours_tf_mb"] is not None else None
    return row


def causal_lm(family, cfg):
    import keras_hub

    keras.utils.set_random_seed(0)
    bb = backbone(family, cfg)
    cls = {"gpt2": keras_hub.models.GPT2CausalLM, "llama": keras_hub.models.LlamaCausalLM}[family]
    lm = cls(backbone=bb, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def _generate(lm, x):
    return np.asarray(lm.generate(x, stop_token_ids=None)["token_ids"])


def run_generate(family, cfg):
    row = dict(case="generate", family=family, prompt=cfg["prompt"], new_tokens=cfg["new_tokens"])
    total = cfg["prompt"] + cfg["new_tokens"]
    rng = np.random.default_rng(1)
    ids = np.zeros((1, total), "int32")
    ids[:, :cfg["prompt"]] = rng.integers(1, cfg["vocab"], (1, cfg["prompt"]))
    mask = np.zeros((1, total), "int32")
    mask[:, :cfg["prompt"]] = 1
    x = {"token_ids": ids, "padding_mask": mask}
    prefill = {"token_ids": ids[:, :cfg["prompt"] + 1], "padding_mask": mask[:, :cfg["prompt"] + 1]}
    stock = causal_lm(family, cfg)
    try:
        ours = tfmetal_ext.convert(stock, inputs=x)
        if not isinstance(ours, type(stock)):
            raise TypeError(f"convert() returned {type(ours).__name__}, not {type(stock).__name__}")
        ours.compile(sampler="greedy")
    except Exception as e:
        row["error"] = f"convert failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    tok_s, tok_o = _generate(stock, x), _generate(ours, x)
    row["same_tokens"] = bool(np.array_equal(tok_s, tok_o))
    fns = {}
    for name, lm in (("stock", stock), ("ours", ours)):
        _generate(lm, prefill)  # traced
        _generate(lm, x)
        fns[f"{name}_prefill"] = (lambda m: lambda: _generate(m, prefill))(lm)
        fns[f"{name}_all"] = (lambda m: lambda: _generate(m, x))(lm)
    # Paired rounds (the order rotated each round): per round and model, the decode phase is the
    # rest of the tokens, whole generate() minus prefill; speed-ups are medians of per-round ratios.
    times = paired_rounds(fns, rounds=cfg["generate_rounds"], repeats=cfg["generate_repeats"])
    decode = {}
    for name in ("stock", "ours"):
        pre, full = times[f"{name}_prefill"], times[f"{name}_all"]
        row[f"{name}_prefill_ms"] = statistics.median(pre)
        # None when the decode phase is lost in the timing noise (generate() barely longer than prefill).
        decode[name] = [a - b for a, b in zip(full, pre)] if statistics.median(full) > 1.05 * statistics.median(pre) \
            else None
        row[f"{name}_decode_tok_s"] = ((cfg["new_tokens"] - 1) / (statistics.median(decode[name]) / 1e3)
                                       if decode[name] else None)
    if decode["stock"] and decode["ours"]:
        row["decode_speedup"] = statistics.median(a / b for a, b in zip(decode["stock"], decode["ours"]))
    row["prefill_speedup"] = ratio(times, "stock_prefill", "ours_prefill")
    row["generate_rounds"] = cfg["generate_rounds"]
    return row


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r["case"] == "train" and "speedup" in r]
    if not train:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = np.arange(len(train))
    ax.bar(xs - 0.2, [r["ops_ratio"] for r in train], 0.4, label="train-step ops (ours / stock)")
    ax.bar(xs + 0.2, [r["speedup"] for r in train], 0.4, label="step speed-up (stock / ours time)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, [r["family"] for r in train])
    ax.set_title(f"keras-hub fine-tuning step, T={train[0]['seq']} (CPU; see bench_hub.md)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--memory-worker", nargs=2, metavar=("FAMILY", "IMPL"))
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.memory_worker:
        print(json.dumps(memory_worker(*args.memory_worker, cfg)))
        return 0
    families = [f for f in args.families.split(",") if f]
    cases = [c for c in args.cases.split(",") if c]
    bad = [f for f in families if f not in FAMILIES] + [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown families/cases {bad}; families: {FAMILIES}, cases: {CASES}")
    rows = []
    for family in families:
        if "train" in cases:
            rows.append(run_train(family, cfg))
        if "memory" in cases:
            rows.append(run_memory(family, cfg, args.quick))
        if "generate" in cases and family in GENERATE_FAMILIES:
            rows.append(run_generate(family, cfg))
        print(json.dumps(rows[-1], default=str), flush=True)
    columns = ["case", "family", "seq", "verified", "stock_ops", "ours_ops", "ops_ratio", "einsum_ours",
               "stock_ms", "ours_ms", "speedup", "stock_mb", "ours_mb", "memory_ratio", "stock_tf_mb", "ours_tf_mb",
               "tf_memory_ratio", "same_tokens",
               "stock_prefill_ms", "ours_prefill_ms", "stock_decode_tok_s", "ours_decode_tok_s",
               "decode_speedup", "error"]
    notes = [f"git {git_head()}", "config: " + json.dumps(cfg)]
    for r in rows:
        if "fallbacks" in r:
            for backend, ops in r["fallbacks"].items():
                notes.append(f"{r['family']} train step, predicted CPU fallbacks on {backend}: "
                             f"{', '.join(ops) if isinstance(ops, list) and ops else ops or 'none'}")
    # A --quick run (the tests') writes beside the full table, not over it.
    name = "bench_hub_quick" if args.quick else "bench_hub"
    write_results(name, rows, columns, notes)
    chart(rows, os.path.join(RESULTS_DIR, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
