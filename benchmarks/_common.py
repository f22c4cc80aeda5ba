"""Shared benchmark plumbing: median timings, op counts, JSON + Markdown output.

Every benchmark runs the stock Keras/TF baseline and ours in the same process and
reports ratios; nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_time(fn, *, warmup=3, repeats=15):
    """Median wall time of ``fn()`` in milliseconds over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def paired_rounds(fns, *, rounds=9, repeats=5):
    """Times every function of `fns` (key -> fn) once per round, the order rotated each round.

    Returns ``key -> [median ms per round]``. Ratios taken within a round (`ratio`) and medians
    across rounds let drift on a shared host between rounds cancel instead of deciding a ratio.
    """
    times = {k: [] for k in fns}
    keys = list(fns)
    for rnd in range(rounds):
        for k in keys[rnd % len(keys):] + keys[: rnd % len(keys)]:
            times[k].append(median_time(fns[k], warmup=1, repeats=repeats))
    return times


def ratio(times, base, other):
    """Median over rounds of ``times[base] / times[other]`` (a speed-up of `other` over `base`)."""
    return statistics.median(a / b for a, b in zip(times[base], times[other]))


def cpu_model():
    """The CPU's model name (/proc/cpuinfo, else platform) and its fusion-relevant ISA flags."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine(), []
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return name, [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def git_head():
    """`git describe --always --dirty` of this checkout, or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment():
    """Where a benchmark ran: versions, backend, the CPU and its flags, oneDNN, the load when it started."""
    import keras
    import tensorflow as tf

    from tfmetal_ext import devices

    caps = devices.capabilities()
    cpu, flags = cpu_model()
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "backend": caps.backend,
        "onednn": caps.onednn,
        "cpu": cpu,
        "cpu_flags": flags,
        "cpu_bf16": caps.cpu_bf16,
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(unset)"),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }


def write_results(name, rows, columns, notes=()):
    """Writes results/<name>.json and results/<name>.md; prints the Markdown table."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    env = environment()
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "rows": rows, "notes": list(notes)}, f, indent=2)
    lines = [
        f"# {name}",
        "",
        "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    text = "\n".join(lines)
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return text


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def run_json_worker(cmd, timeout, tail_lines=4):
    """Runs ``cmd + ["--out", FILE]`` in a subprocess that writes its result to FILE as JSON.

    Returns ``(result, None)``, or ``(None, error text)`` for a failed, silent or timed-out worker (the
    last `tail_lines` lines of its stderr), so one model's crash never ends a benchmark.
    """
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    try:
        proc = subprocess.run(list(cmd) + ["--out", out], capture_output=True, text=True, timeout=timeout)
        with open(out) as f:
            text = f.read()
        if proc.returncode == 0 and text:
            return json.loads(text), None
        tail = " | ".join((proc.stderr or "").strip().splitlines()[-tail_lines:])
        return None, f"exit {proc.returncode}: {tail}"
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    finally:
        os.unlink(out)
