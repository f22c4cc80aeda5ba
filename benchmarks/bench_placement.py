"""What leaves the GPU in each train step, predicted for both Metal backends: stock, stock + import, converted.

For every model of `bench_models.py` (and, with ``--applications``, `bench_applications.py`), under
``mixed_float16`` as `tfmetal_ext.configure()` chooses on Metal (so Keras wraps the optimizer in its
`LossScaleOptimizer`), and for each Metal backend (Apple's ``tensorflow-metal`` 1.2 and the open
``tensorflow-metal-plugin``), three variants of the train step are traced (never run) and judged against
that backend's generated kernel table with `tfmetal_ext.inspect.placement_report(..., predict_for=...)`:

- ``stock``: the stock model with Keras' Adam, the backend alone (``gap_kernels=False``: a process that never
  imported tfmetal_ext);
- ``stock+import``: the same model, counting the GPU kernels tfmetal_ext registers at import for the standard
  ops the backend lacks (`tfmetal_ext.backends.gap_kernels`), and with the Keras forms the import installs
  (`tfmetal_ext.keras_forms`: argmax's -0.0 test in float; the fused loss scaling's routing);
- ``converted``: `tfmetal_ext.convert()` + FusedAdam, with the gap kernels.

Per row: CPU fallbacks per step (nodes that fall back to the CPU, or fail), host ops (ops the backend leaves
to the host on its TensorFlow, e.g. the open plugin's variable assignments on TF 2.21), int32 host ops,
transfers (data edges between host and device memory) and the op kinds behind them, each with its layer.
Targets (issue 30): converted, 0 CPU fallbacks; host ops + transfers <= 2 outside the input pipeline.
The steps are traced with the batch's static shape, as `fit` traces them when the batch size divides the
data; the converted rows also give the transfers with the batch dimension unknown (``dynamic_batch=True``,
as `fit` traces a step with a partial last batch), where the batch-size arithmetic runs in the step.

    .venv/bin/python benchmarks/bench_placement.py [--models mnist_convnet,vit_small] [--applications]

Nothing here runs on a GPU: these are predictions from the backends' kernel tables, device-independent. The
figures do not depend on the CPU they are computed on.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, run_json_worker, write_results  # noqa: E402

BACKENDS = ("tensorflow-metal", "tensorflow-metal-plugin")
VARIANTS = ("stock", "stock+import", "converted")
COLUMNS = ["model", "backend", "variant", "fallbacks", "host_ops", "int32_host", "transfers", "gap_kernels",
           "fallback_ops", "left_on_cpu", "error"]


def _names(entries, top=8):
    counts = collections.Counter()
    for e in entries:
        counts[f"{e.op}({e.dtype})@{e.layer or '(step)'}"] += e.count
    shown = [f"{k} x{v}" if v > 1 else k for k, v in counts.most_common(top)]
    if len(counts) > top:
        shown.append(f"+{len(counts) - top} more")
    return "; ".join(shown)


def measure(name, applications=False):
    """The rows of one model: backend x variant."""
    import keras

    import tfmetal_ext
    from tfmetal_ext import inspect
    from tfmetal_ext import keras_forms
    from tfmetal_ext.optimizers import loss_scale

    import bench_models

    builders = bench_models.APPLICATIONS if applications else bench_models.MODELS
    keras.mixed_precision.set_global_policy("mixed_float16")  # what configure() picks on Metal
    keras.utils.set_random_seed(0)
    spec = builders[name]()
    stock = spec["model"]
    models = {"stock": (stock, keras.optimizers.Adam)}
    try:
        converted = tfmetal_ext.convert(stock, count_ops=False, verify=False)
        models["converted"] = (converted, tfmetal_ext.optimizers.FusedAdam)
    except Exception as e:  # noqa: BLE001 - an arbitrary model: record, go on
        models["converted"] = (None, f"convert() failed: {type(e).__name__}: {e}"[:200])
    rows = []
    for backend in BACKENDS:
        for variant in VARIANTS:
            row = dict(model=name, backend=backend, variant=variant)
            model, opt = models["converted" if variant == "converted" else "stock"]
            if model is None:
                row["error"] = opt
                rows.append(row)
                continue
            if variant == "stock":  # Keras' own LossScaleOptimizer step and argmax, as without tfmetal_ext
                loss_scale.uninstall()
                keras_forms.uninstall()
            try:
                model.compile(optimizer=opt(), loss=spec["loss"], metrics=list(spec["metrics"]))
                r = inspect.placement_report(model, spec["x"], targets=spec["y"], mode="train",
                                             predict_for=backend, gap_kernels=variant != "stock")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                continue
            finally:
                loss_scale.install()
                keras_forms.install()
            row.update(
                fallbacks=sum(e.count for e in r.cpu_fallback + r.fails),
                host_ops=sum(e.count for e in r.host),
                int32_host=sum(e.count for e in r.int32_host),
                transfers=r.transfer_count,
                gap_kernels=sum(e.count for e in r.gap_kernels),
                left_on_cpu=_names(r.missing),
                fallback_ops=_names(r.cpu_fallback + r.fails),
                transfer_kinds=_kinds(r),
            )
            if variant == "converted":  # the same step with the batch dimension unknown (a partial last batch)
                try:
                    d = inspect.placement_report(model, spec["x"], targets=spec["y"], mode="train",
                                                 predict_for=backend, dynamic_batch=True)
                    row.update(transfers_dynamic_batch=d.transfer_count, transfer_kinds_dynamic_batch=_kinds(d))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"dynamic_batch: {type(e).__name__}: {e}"[:200]
            rows.append(row)
    return rows


def _kinds(report, top=8):
    return "; ".join(f"{t.producer}->{t.consumer}@{t.layer or '(step)'} x{t.count}" for t in report.transfers[:top])


def _run_worker(name, applications, timeout=900):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name] + (["--applications"] if applications else [])
    rows, error = run_json_worker(cmd, timeout, tail_lines=3)
    return rows if error is None else [dict(model=name, error=error[:300])]


def chart(rows, path):
    """Fallbacks and transfers per step, per model, for each backend x variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(BACKENDS), figsize=(max(8.0, 1.2 * len(models) * len(BACKENDS)), 7.5),
                             squeeze=False)
    width = 0.8 / len(VARIANTS)
    for col, backend in enumerate(BACKENDS):
        for row_i, (key, label) in enumerate((("fallbacks", "CPU fallbacks per step"),
                                              ("transfers", "host<->device transfers per step"))):
            ax = axes[row_i][col]
            for i, variant in enumerate(VARIANTS):
                vals = []
                for m in models:
                    hit = [r for r in rows if r["model"] == m and r.get("backend") == backend
                           and r.get("variant") == variant]
                    v = hit[0].get(key) if hit else None
                    vals.append(v if isinstance(v, (int, float)) else float("nan"))
                xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(models))]
                ax.bar(xs, vals, width, label=variant)
            ax.set_xticks(range(len(models)))
            ax.set_xticklabels(models, rotation=30, ha="right", fontsize=7)
            ax.set_title(f"{backend}: {label}", fontsize=9)
            if key == "transfers":
                ax.axhline(2, color="grey", linestyle="--", linewidth=0.8, label="target 2")
            ax.legend(fontsize=7)
    fig.suptitle("Predicted train-step placement under mixed_float16 (device-independent)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--applications", action="store_true", help="keras.applications models too")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rows = measure(args.worker, applications=args.applications)
        with open(args.out, "w") as f:
            json.dump(rows, f)
        return 0
    import bench_models

    names = [(n, False) for n in bench_models.MODELS]
    if args.applications:
        names += [(n, True) for n in bench_models.APPLICATIONS]
    if args.models:
        wanted = set(args.models.split(","))
        names = [(n, a) for n, a in names if n in wanted]
    rows = []
    for name, applications in names:
        rows += _run_worker(name, applications)
        print(f"[{name} done]", file=sys.stderr, flush=True)
    converted = [r for r in rows if r.get("variant") == "converted" and "error" not in r]
    notes = [
        "Predicted, not measured: each train step traced here and judged against the backend's generated kernel "
        "table; mixed_float16, Keras' LossScaleOptimizer; stock = backend alone, stock+import and converted count "
        "tfmetal_ext's gap kernels.",
        f"converted rows with 0 CPU fallbacks: {sum(r['fallbacks'] == 0 for r in converted)} of {len(converted)}; "
        f"with host ops + transfers <= 2: {sum(r['host_ops'] + r['transfers'] <= 2 for r in converted)} of "
        f"{len(converted)} (issue 30 targets).",
        "transfers_dynamic_batch (converted rows): the same step traced with the batch dimension unknown, as fit "
        "traces it when the batch size does not divide the data: the batch-size arithmetic (the loss' element "
        "count, the metrics' sample count, the shapes of reduction gradients) is int32 in host memory and meets "
        f"the device. With host ops <= 2 in that form: "
        f"{sum(r['host_ops'] + r.get('transfers_dynamic_batch', 99) <= 2 for r in converted)} of {len(converted)}.",
    ]
    write_results("bench_placement", rows, COLUMNS + ["transfer_kinds", "transfers_dynamic_batch",
                                                      "transfer_kinds_dynamic_batch"], notes)
    chart(rows, os.path.join(RESULTS_DIR, "bench_placement.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
