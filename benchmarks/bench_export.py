"""The export matrix (issue 32): every benchmark model x every export format, stock beside ours.

Models: `bench_models.MODELS` (keras.io examples, scaled down) and `bench_models.APPLICATIONS`
(the keras.applications of bench_applications.py). Formats: every row of
`tfmetal_ext.deploy.formats.FORMATS`. For each model, three variants:

- ``stock``: the stock Keras model, written by the peer itself: Keras' own ``model.export`` for the
  formats Keras has (tf_saved_model, litert, onnx, openvino) and coremltools' TF2 converter for
  ``coreml`` (`tfmetal_ext.export`'s coreml route: on a stock model it runs stock ops only). The
  artifact is checked by the same runtimes as ours (`tfmetal_ext.deploy.runtimes.run`: the
  SavedModel in a process without tfmetal_ext, the LiteRT interpreter, onnxruntime, OpenVINO at
  f32, the Core ML op list off macOS) and held to the same bound;
- ``converted``: ``tfmetal_ext.convert(model)`` (the training form a user trains), then
  ``tfmetal_ext.export``;
- ``int8``: the int8 deployment form ``convert(model, inference=True, quantize="int8")``, exported by
  ``tfmetal_ext.export`` (what ``export(model, ..., int8=True)`` does, the conversion made once per
  model instead of once per format); where convert() refuses the model, the cells say why.

Each cell: pass / fail with the one-line reason, the artifact's size, the max relative error
against the Keras model on the model's own synthetic batch (first 2 rows; "not run here" for
Core ML off macOS, with its MIL op count) and the seconds of export + check. The target (issue 32):
wherever the stock model exports and passes, ours does too; the summary line counts the cells where
stock passes and ours fails (must be 0) and lists them.

Each model runs in a process of its own (a crash is recorded, never fatal); a cell that runs longer
than ``--cell-timeout`` seconds is recorded as a timeout and the process restarts at the next cell.

    .venv/bin/python benchmarks/bench_export.py [--quick] [--models a,b] [--formats onnx,litert]
        [--variants stock,converted] [--applications | --all] [--jobs 2] [--out FILE.md] [--json FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import environment  # noqa: E402

VARIANTS = ("stock", "converted", "int8")
QUICK_MODELS = ("mnist_convnet", "conv1d_timeseries")
QUICK_FORMATS = ("tf_saved_model", "onnx")
# Rows of each model's synthetic batch the exports are compared on.
VERIFY_ROWS = 2
CELL_TIMEOUT = 600.0
# How often the driver reads a worker's records.
POLL_SECONDS = 1.0
# What the table cell keeps of a failure's one-line reason (the Failures list keeps all of it).
SHORT_REASON = 130


def model_tables(app_size=None):
    """``(models, applications)``: name -> builder, from bench_models (`app_size`: the applications'
    input side instead of bench_models' default)."""
    import bench_models

    apps = dict(bench_models.APPLICATIONS)
    if app_size:
        apps = {n: bench_models._application(n, size=app_size) for n in apps}
    return dict(bench_models.MODELS), apps


def formats():
    from tfmetal_ext.deploy.formats import FORMATS

    return FORMATS


# ----------------------------------------------------------------------------
# One model's cells (in the worker process).


def _one_line(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _cell(model, variant, fmt, **kw):
    return dict(model=model, variant=variant, format=fmt, **kw)


def _peer_export(stock, fmt, path, x):
    """Keras' own ``model.export`` of the stock model, checked by `runtimes.run` like ours.

    Returns ``(size, max_rel_error, ops, note)``; raises what the export or the runtime raised, or
    `AssertionError` past the float32 bound.
    """
    import keras
    import numpy as np

    from tfmetal_ext.conversion.verify import as_numpy_list
    from tfmetal_ext.deploy import artifact_size, max_rel_error, runtimes
    from tfmetal_ext.deploy.formats import FLOAT32_RTOL

    expected = as_numpy_list(stock(x, training=False))
    stock.export(path, format=fmt, verbose=False)
    size = artifact_size(path)
    flat, structure = runtimes.input_structure(keras.tree.map_structure(np.asarray, x))
    outs, ops, note = runtimes.run(fmt, path, flat, structure, runtimes.input_names(stock, structure))
    if outs is None:
        return size, None, ops, note
    if len(outs) != len(expected):
        raise AssertionError(f"the artifact gives {len(outs)} outputs, the Keras model {len(expected)}")
    err = max_rel_error(expected, outs)
    if not err <= FLOAT32_RTOL:
        raise AssertionError(f"max relative error {err:.3g} > {FLOAT32_RTOL:g} ({runtimes.__name__}.run)")
    return size, err, ops, note


def run_cell(name, variant, fmt, models, x, tmp):
    """One cell: export `models[variant]` (or the peer's route for stock) in `fmt` and check it."""
    import tfmetal_ext
    from tfmetal_ext.deploy import runtimes

    spec = formats()[fmt]
    path = os.path.join(tmp, f"{variant}_{fmt}{spec.suffix or '_dir'}")
    model = models.get(variant)
    if isinstance(model, str):  # the model could not be made: the cell says why
        return _cell(name, variant, fmt, status="n/a" if variant == "int8" else "fail", reason=model, seconds=0.0)
    peer = variant == "stock" and fmt != "coreml"
    route = "keras model.export" if peer else "tfmetal_ext.export"
    start = time.perf_counter()
    try:
        if peer:
            size, err, ops, note = _peer_export(model, fmt, path, x)
            tol = None
        else:
            rep = tfmetal_ext.export(model, path, fmt, inputs=x)
            size, err, ops, note, tol = rep.size_bytes, rep.max_rel_error, rep.ops, rep.note, rep.tolerance
        status, reason = "pass", ""
    except runtimes.RuntimeRefused as e:
        size, err, ops, note, tol, status, reason = None, None, [], "", None, "fail", str(e)
    except Exception as e:  # converters and runtimes raise anything: the cell records it
        size, err, ops, note, tol, status = None, None, [], "", None, "fail"
        reason = _one_line(e)
        report = getattr(e, "report", None)
        if report is not None and report.max_rel_error is not None:
            err = report.max_rel_error
    seconds = time.perf_counter() - start
    for p in (path, path[:-4] + ".bin" if path.endswith(".xml") else None):
        if p and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif p and os.path.exists(p):
            os.remove(p)
    return _cell(name, variant, fmt, status=status, reason=reason, route=route, size_bytes=size,
                 max_rel_error=err, tolerance=tol, numeric=err is not None or status != "pass",
                 n_ops=len(ops), ops=list(ops), note=note, seconds=round(seconds, 2))


def prepare(builder, variants):
    """``(models, x, info)``: the stock model built by `builder` (seeded) and each variant's model, or
    the one-line reason it could not be made (a string in its place)."""
    import keras
    import numpy as np

    import tfmetal_ext

    keras.utils.set_random_seed(0)
    spec = builder()
    stock = spec["model"]
    x = keras.tree.map_structure(lambda a: np.asarray(a)[:VERIFY_ROWS], spec["x"])
    stock(x, training=False)
    models = {"stock": stock}
    info = dict(params=int(stock.count_params()),
                input="x".join(str(d) for d in np.shape(keras.tree.flatten(spec["x"])[0])[1:]))
    for variant, kw in (("converted", {}), ("int8", {"inference": True, "quantize": "int8"})):
        if variant not in variants:
            continue
        start = time.perf_counter()
        try:
            models[variant] = tfmetal_ext.convert(stock, count_ops=False, **kw)
        except Exception as e:
            what = "convert()" if variant == "converted" else "convert(inference=True, quantize='int8')"
            models[variant] = f"{what} refused the model: {_one_line(e)}"
        info[f"{variant}_convert_s"] = round(time.perf_counter() - start, 2)
    return models, x, info


def run_model(name, builder, variants, fmts, emit):
    """Every cell of one model, each passed to `emit(record)` as it starts and ends."""
    with tempfile.TemporaryDirectory(prefix="bench_export_") as tmp:
        try:
            models, x, info = prepare(builder, variants)
        except Exception as e:
            reason = f"the model could not be built: {_one_line(e)}"
            for variant in variants:
                for fmt in fmts:
                    emit(_cell(name, variant, fmt, status="fail", reason=reason, seconds=0.0))
            return
        emit(dict(model=name, info=info))
        for fmt in fmts:
            for variant in variants:
                emit(dict(model=name, variant=variant, format=fmt, start=time.time()))
                emit(run_cell(name, variant, fmt, models, x, tmp))


# ----------------------------------------------------------------------------
# Driver: one worker process per model, watched cell by cell.


def _worker_cmd(name, args, cells, out):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--worker-out", out,
           "--worker-cells", ",".join(f"{v}:{f}" for v, f in cells)]
    if args.app_size:
        cmd += ["--app-size", str(args.app_size)]
    return cmd


def _read_records(path):
    try:
        with open(path) as f:
            return [json.loads(ln) for ln in f if ln.strip().endswith("}")]
    except (OSError, json.JSONDecodeError):
        return []


def drive_model(name, args, cells, log=print):
    """Runs `cells` ((variant, format) pairs) of model `name` in worker processes; returns
    ``(cell records, info)``. A cell that takes over ``args.cell_timeout`` s becomes a timeout and a
    new worker carries on after it; a worker that dies takes the running cell with it as a failure."""
    done, info, todo = {}, {}, list(cells)
    while todo:
        fd, out = tempfile.mkstemp(prefix=f"bench_export_{name}_", suffix=".jsonl")
        os.close(fd)
        err_path = out + ".err"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(_worker_cmd(name, args, todo, out), stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        running, killed = None, None
        while True:
            rc = proc.poll()
            for rec in _read_records(out):
                if "info" in rec:
                    info = rec["info"]
                elif "start" in rec:
                    key = (rec["variant"], rec["format"])
                    if key not in done and (running is None or running[0] != key):
                        running = (key, rec["start"])
                elif "status" in rec:
                    done[(rec["variant"], rec["format"])] = rec
                    if running and running[0] == (rec["variant"], rec["format"]):
                        running = None
            if rc is not None:
                break
            if running and time.time() - running[1] > args.cell_timeout:
                killed = running[0]
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            time.sleep(POLL_SECONDS)
        with open(err_path) as f:
            tail = " | ".join(ln.strip() for ln in f.read().strip().splitlines()[-3:])
        os.unlink(out)
        os.unlink(err_path)
        if killed:
            done[killed] = _cell(name, *killed, status="timeout", seconds=args.cell_timeout,
                                 reason=f"timed out: no result after {args.cell_timeout:.0f} s")
        elif running:  # the worker died inside this cell
            done[running[0]] = _cell(name, *running[0], status="fail", seconds=round(time.time() - running[1], 2),
                                     reason=f"the worker process died (exit {proc.returncode}): {tail}")
        elif rc != 0 and not [c for c in todo if c in done]:
            for c in todo:  # died before any cell (import, build)
                done[c] = _cell(name, *c, status="fail", seconds=0.0,
                                reason=f"the worker process died (exit {rc}): {tail}")
        remaining = [c for c in todo if c not in done]
        if remaining == todo:  # no progress: never loop
            for c in remaining:
                done[c] = _cell(name, *c, status="fail", seconds=0.0, reason=f"not run (worker exit {rc}): {tail}")
            remaining = []
        todo = remaining
        log(f"[{name}: {len(done)}/{len(cells)} cells]")
    return [done[c] for c in cells], info


# ----------------------------------------------------------------------------
# Output.


def _human(n):
    from tfmetal_ext.deploy import _human as human

    return human(n)


# Boilerplate of the routes' and runtimes' messages, dropped from the table's short reasons.
_NOISE = (
    (r"^ExportError: ", ""),
    (r"\. The working route: .*$", ""),
    (r" \(\S+ removed\)$", ""),
    (r"^keras model\.export\(format='\w+'\) failed on TensorFlow [\w.]+: ", "model.export failed: "),
    (r"^coremltools\.convert .*? failed on TensorFlow [\w.]+: ", "coremltools.convert failed: "),
    (r"Select TensorFlow op\(s\), included in the given model, is\(are\) not supported by this interpreter\..*$",
     "Select TF ops (Flex delegate) not supported"),
    (r"Model wasn't fully converted\. Summary: -- No conversion rule found for operations:", "no conversion rule for"),
    (r"( not implemented\.) name: .*$", r"\1"),
    (r" Input x=\".*?\" expects", " expects"),
    (r"\[ONNXRuntimeError\] : \d+ : \w+ : Load model from \S+ failed:", ""),
    (r"This is an invalid model\. In Node, \(.*?\) , Error ", ""),
    (r"Check 'false' failed at \S+ FrontEnd API failed with OpConversionFailure: ", ""),
    (r" To facilitate the conversion of unsupported operations.*$", ""),
)


def _short(text, n=SHORT_REASON):
    """The gist of a one-line reason (the Failures list keeps it whole)."""
    import re

    for pattern, repl in _NOISE:
        text = re.sub(pattern, repl, text)
    return text if len(text) <= n else text[: n - 1] + "…"


def cell_text(c):
    if c is None:
        return ""
    if c["status"] == "pass":
        if c.get("max_rel_error") is None:
            err = f"not run here ({c.get('n_ops', 0)} MIL ops)"
        else:
            err = f"err {c['max_rel_error']:.2g}"
        return f"pass · {_human(c['size_bytes'] or 0)} · {err} · {c['seconds']:.1f} s"
    label = {"fail": "**FAIL**", "timeout": "**TIMEOUT**", "n/a": "n/a"}[c["status"]]
    return f"{label}: {_short(c['reason']).replace('|', '/')} · {c['seconds']:.1f} s"


def regressions(cells):
    """Cells of ours (converted, int8) that fail where the stock cell of the same model and format passes."""
    stock = {(c["model"], c["format"]): c for c in cells if c["variant"] == "stock"}
    out = []
    for c in cells:
        s = stock.get((c["model"], c["format"]))
        if c["variant"] != "stock" and s and s["status"] == "pass" and c["status"] in ("fail", "timeout"):
            out.append(c)
    return out


def summary_lines(cells):
    regs = regressions(cells)
    by = {v: [c for c in regs if c["variant"] == v] for v in VARIANTS if v != "stock"}
    stock_pass = sum(c["variant"] == "stock" and c["status"] == "pass" for c in cells)
    lines = [f"Target (issue 32): cells where stock passes and ours fails: {len(regs)} (must be 0); "
             + ", ".join(f"{v} {len(cs)}" for v, cs in by.items())
             + f"; stock passes {stock_pass} of {sum(c['variant'] == 'stock' for c in cells)} cells"]
    for c in regs:
        lines.append(f"- {c['model']} / {c['format']} / {c['variant']}: {_short(c['reason'], 300)}")
    return lines


def render(cells, infos, args, env):
    """The Markdown report: the matrix, the summary line, every failure's full reason, notes."""
    variants = [v for v in VARIANTS if any(c["variant"] == v for c in cells)]
    index = {(c["model"], c["format"], c["variant"]): c for c in cells}
    models = list(dict.fromkeys(c["model"] for c in cells))
    fmts = list(dict.fromkeys(c["format"] for c in cells))
    head = {"stock": "stock (peer's own route)", "converted": "converted (ours)", "int8": "int8 (ours)"}
    lines = ["# bench_export: model x format", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| model | format | " + " | ".join(head[v] for v in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for m in models:
        inf = infos.get(m, {})
        label = f"{m} ({inf['input']}, {inf['params']:,} params)" if inf.get("params") else m
        for f in fmts:
            lines.append(f"| {label} | {f} | " + " | ".join(cell_text(index.get((m, f, v))) for v in variants) + " |")
    lines += ["", *summary_lines(cells), "", "Cells that pass, per format:", "",
              "| format | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for f in fmts:
        row = [[c for c in cells if c["format"] == f and c["variant"] == v] for v in variants]
        lines.append(f"| {f} | " + " | ".join(f"{sum(c['status'] == 'pass' for c in cs)} of {len(cs)}"
                                               for cs in row) + " |")
    lines.append("")
    fails = [c for c in cells if c["status"] != "pass"]
    if fails:
        lines += ["## Cells that did not pass (full one-line reasons)", ""]
        lines += [f"- {c['model']} / {c['format']} / {c['variant']} ({c['status']}): `{c['reason']}`" for c in fails]
        lines.append("")
    lines += ["## Notes", ""] + [f"- {n}" for n in notes(args, infos)]
    return "\n".join(lines) + "\n"


def notes(args, infos):
    from tfmetal_ext.deploy.formats import FLOAT32_RTOL

    out = [
        "stock = the stock Keras model by the peer's own route: Keras' model.export for tf_saved_model, litert, "
        "onnx, openvino; coremltools' TF2 converter (tfmetal_ext.export's coreml route, stock ops) for coreml. "
        "It is checked with the same runtimes as ours (tfmetal_ext.deploy.runtimes.run) and held to the same "
        f"float32 bound ({FLOAT32_RTOL:g} relative)",
        "converted = tfmetal_ext.convert(model) then tfmetal_ext.export; int8 = convert(model, inference=True, "
        "quantize='int8') then tfmetal_ext.export (as export(..., int8=True) does; compared with the int8 model)",
        f"err = max over outputs of max |keras - artifact| / max |keras| on the model's synthetic batch "
        f"(first {VERIFY_ROWS} rows); 'not run here' = Core ML off macOS (the MIL program's op count instead)",
        "seconds = export + check of the cell (the SavedModel check starts a Python process without tfmetal_ext)",
        f"each model runs in its own process, {args.jobs} at a time; a cell over {args.cell_timeout:.0f} s is a "
        "timeout and the process restarts after it",
    ]
    conv = {m: (i.get("converted_convert_s"), i.get("int8_convert_s")) for m, i in infos.items()}
    if any(v != (None, None) for v in conv.values()):
        out.append("convert() seconds per model (converted, int8; verify=True, not in the cells): " + "; ".join(
            f"{m} {a}, {b}" for m, (a, b) in conv.items()))
    if args.app_size:
        out.append(f"keras.applications built at {args.app_size}x{args.app_size}x3 (--app-size) instead of "
                   "bench_models' default")
    if args.quick:
        out.append(f"--quick: {', '.join(QUICK_MODELS)} and {', '.join(QUICK_FORMATS)} only")
    out.append("command: " + " ".join(["python", "benchmarks/bench_export.py"] + args.argv))
    return out


# ----------------------------------------------------------------------------
# Entry point.


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)} x {', '.join(QUICK_FORMATS)}")
    parser.add_argument("--models", default=None, help="comma-separated names (default: bench_models' MODELS)")
    parser.add_argument("--applications", action="store_true", help="the keras.applications models instead")
    parser.add_argument("--all", action="store_true", help="MODELS and the keras.applications models")
    parser.add_argument("--formats", default=None, help="comma-separated FORMATS names (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: stock, converted, int8")
    parser.add_argument("--app-size", type=int, default=None, help="input side of the applications (default 96)")
    parser.add_argument("--jobs", type=int, default=1, help="models run at once (default 1; at most 2 advised)")
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT, help="seconds per cell (default 600)")
    parser.add_argument("--in-process", action="store_true", help="run here (no worker processes, no timeout)")
    parser.add_argument("--out", default=None, help="write the Markdown report here too")
    parser.add_argument("--json", default=None, help="write the cells as JSON here")
    parser.add_argument("--from-json", default=None, help="render the report of an earlier run's --json file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-cells", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    models, apps = model_tables(args.app_size)
    table = {**models, **apps}
    if args.models:
        names = args.models.split(",")
    elif args.quick:
        names = list(QUICK_MODELS)
    else:
        names = list(table) if args.all else list(apps) if args.applications else list(models)
    fmts = args.formats.split(",") if args.formats else list(QUICK_FORMATS if args.quick else formats())
    variants = [v for v in args.variants.split(",") if v]
    bad = ([f"models {[n for n in names if n not in table]}"] if any(n not in table for n in names) else []) + \
        ([f"formats {[f for f in fmts if f not in formats()]}"] if any(f not in formats() for f in fmts) else []) + \
        ([f"variants {[v for v in variants if v not in VARIANTS]}"] if any(v not in VARIANTS for v in variants)
         else [])
    if bad or not names or not fmts or not variants:
        parser.error(f"unknown or empty {'; '.join(bad) or 'selection'}; choose models from {list(table)}, formats "
                     f"from {list(formats())}, variants from {list(VARIANTS)}")
    return args, table, names, fmts, variants


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args, table, names, fmts, variants = _parse(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        run_args = _parse(data["command"][1:])[0]
        text = render(data["cells"], data["models"], run_args, data["environment"])
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return data["cells"]

    if args.worker:  # one model's cells, each record appended to --worker-out as a JSON line
        cells = [tuple(c.split(":")) for c in args.worker_cells.split(",")]
        lock = threading.Lock()

        def emit(rec):
            with lock, open(args.worker_out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

        keep_v = list(dict.fromkeys(v for v, _ in cells))
        keep_f = list(dict.fromkeys(f for _, f in cells))
        wanted = set(cells)
        run_model(args.worker, table[args.worker], keep_v, keep_f,
                  lambda rec: emit(rec) if "variant" not in rec or (rec["variant"], rec["format"]) in wanted
                  else None)
        return None

    cells_of = [(v, f) for f in fmts for v in variants]
    results, infos = {}, {}
    env = environment()

    def one(name):
        if args.in_process:
            recs = []
            run_model(name, table[name], variants, fmts, recs.append)
            infos[name] = next((r["info"] for r in recs if "info" in r), {})
            results[name] = [r for r in recs if "status" in r]
        else:
            results[name], infos[name] = drive_model(name, args, cells_of, log=lambda s: print(s, file=sys.stderr,
                                                                                                 flush=True))
        done = [c for n in names if n in results for c in results[n]]
        if args.out:
            with open(args.out, "w") as f:
                f.write(render(done, infos, args, env))

    if args.in_process or args.jobs <= 1:
        for n in names:
            one(n)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, names))
    cells = [c for n in names for c in results[n]]
    text = render(cells, infos, args, env)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "cells": cells, "models": infos, "summary": summary_lines(cells),
                       "command": ["benchmarks/bench_export.py"] + argv}, f, indent=2, default=str)
    return cells


if __name__ == "__main__":
    main()
