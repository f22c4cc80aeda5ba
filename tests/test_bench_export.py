"""benchmarks/bench_export.py: the matrix's cells, its summary line (stock passes, ours fails), and the
worker driver's timeout and crash records."""

import json
import os
import sys
import textwrap

import keras
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_export  # noqa: E402


def _tiny():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    return dict(model=model, x=x, y=np.zeros((4, 3), "float32"), loss="mse", metrics=[])


def _tables(monkeypatch, builders):
    monkeypatch.setattr(bench_export, "model_tables", lambda app_size=None: (dict(builders), {}))


def test_real_cells_of_a_tiny_model(monkeypatch, capsys, tmp_path):
    """LiteRT (the fastest route): stock by Keras' own export, converted by ours; both run and match."""
    _tables(monkeypatch, {"tiny": _tiny})
    out = tmp_path / "m.md"
    cells = bench_export.main(["--models", "tiny", "--formats", "litert", "--variants", "stock,converted",
                               "--in-process", "--out", str(out), "--json", str(tmp_path / "m.json")])
    by = {c["variant"]: c for c in cells}
    assert set(by) == {"stock", "converted"}
    assert by["stock"]["route"] == "keras model.export" and by["converted"]["route"] == "tfmetal_ext.export"
    for c in cells:
        assert c["status"] == "pass", c
        assert c["size_bytes"] > 1000 and 0 <= c["max_rel_error"] <= 1e-5
        assert "FULLY_CONNECTED" in c["ops"]
    text = out.read_text()
    assert text.strip() in capsys.readouterr().out  # the same report on stdout
    row = next(ln for ln in text.splitlines() if ln.startswith("| tiny"))
    assert row.count("pass ·") == 2 and "| litert |" in row
    assert "cells where stock passes and ours fails: 0 (must be 0)" in text
    data = json.loads((tmp_path / "m.json").read_text())
    assert len(data["cells"]) == 2 and data["summary"][0].startswith("Target (issue 32)")


def _fake_cell(name, variant, fmt, models, x, tmp):
    # stock passes everywhere; converted fails litert; int8 is not available for this model.
    if variant == "int8":
        return bench_export._cell(name, variant, fmt, status="n/a", reason="quantize refused", seconds=0.0)
    if variant == "converted" and fmt == "litert":
        return bench_export._cell(name, variant, fmt, status="fail", seconds=1.0,
                                  reason="ExportError: Custom ops: TfmetalExt>LayerNorm. The working route: x")
    return bench_export._cell(name, variant, fmt, status="pass", reason="", size_bytes=2048, max_rel_error=None
                              if fmt == "coreml" else 3e-7, n_ops=4, ops=[], seconds=0.5)


def test_summary_counts_cells_where_stock_passes_and_ours_fails(monkeypatch, capsys):
    _tables(monkeypatch, {"tiny": _tiny})
    monkeypatch.setattr(bench_export, "prepare", lambda builder, variants: ({}, None, {}))
    monkeypatch.setattr(bench_export, "run_cell", _fake_cell)
    cells = bench_export.main(["--models", "tiny", "--formats", "litert,onnx,coreml", "--in-process"])
    assert len(cells) == 9
    text = capsys.readouterr().out
    assert "cells where stock passes and ours fails: 1 (must be 0); converted 1, int8 0; " \
           "stock passes 3 of 3 cells" in text
    assert "- tiny / litert / converted: Custom ops: TfmetalExt>LayerNorm" in text
    rows = {ln.split(" | ")[1]: ln for ln in text.splitlines() if ln.startswith("| tiny")}
    assert set(rows) == {"litert", "onnx", "coreml"}
    assert "**FAIL**: Custom ops: TfmetalExt>LayerNorm · 1.0 s" in rows["litert"]
    assert "working route" not in rows["litert"] and "ExportError" not in rows["litert"]
    assert "not run here (4 MIL ops)" in rows["coreml"] and "err 3e-07" in rows["onnx"]
    assert "n/a: quantize refused" in rows["onnx"]


@pytest.mark.parametrize("reason, short", [
    ("ExportError: keras model.export(format='openvino') failed on TensorFlow 2.21.0: OpConversionFailure: Check "
     "'false' failed at src/frontends/common_translators/src/unconverted_ops_report.cpp:151: FrontEnd API failed with "
     "OpConversionFailure: Model wasn't fully converted. Summary: -- No conversion rule found for operations: "
     "TensorList To facilitate the conversion of unsupported operations, refer to Frontend Extension documentation: "
     "https://docs.openvino.ai/x.html. The working route: export format='tf_saved_model' (checked the same way)",
     "model.export failed: OpConversionFailure: no conversion rule for TensorList"),
    ("ExportError: onnxruntime refused it: [ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model from /tmp/a.onnx "
     "failed:This is an invalid model. In Node, (\"g/Erfc\", Erfc, \"\", -1) : (\"t:0\": tensor(float),) -> "
     "(\"g/Erfc:0\",) , Error No Op registered for Erfc with domain_version of 15 (/tmp/a.onnx removed)",
     "onnxruntime refused it: No Op registered for Erfc with domain_version of 15"),
    ("ExportError: coremltools.convert on the serving function (ML program) failed on TensorFlow 2.21.0: "
     "NotImplementedError: Conversion for TF op 'Erfc' not implemented. name: \"g/Erfc\" op: \"Erfc\"",
     "coremltools.convert failed: NotImplementedError: Conversion for TF op 'Erfc' not implemented."),
])
def test_short_reason_keeps_the_gist(reason, short):
    assert bench_export._short(reason) == short
    assert len(bench_export._short("x" * 500)) == bench_export.SHORT_REASON


def test_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        bench_export.main(["--models", "nope", "--formats", "onnx,tflite"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "models ['nope']" in err and "formats ['tflite']" in err
    with pytest.raises(SystemExit):
        bench_export.main(["--variants", "stock,fp16"])


def test_quick_selection():
    args, table, names, fmts, variants = bench_export._parse(["--quick"])
    assert names == list(bench_export.QUICK_MODELS) and fmts == list(bench_export.QUICK_FORMATS)
    assert variants == list(bench_export.VARIANTS)
    assert all(n in table for n in names)
    _, _, names, fmts, _ = bench_export._parse(["--all"])
    assert {"mnist_convnet", "ResNet50V2"} <= set(names) and len(fmts) == 5


def test_driver_records_a_timeout_and_a_crash_then_carries_on(monkeypatch, tmp_path):
    """A fake worker: hangs in (stock, onnx), dies in (converted, onnx), passes the rest."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, time
        out, cells = sys.argv[1], sys.argv[2].split(",")
        def emit(rec):
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\\n")
        for c in cells:
            v, f = c.split(":")
            emit(dict(model="m", variant=v, format=f, start=time.time()))
            if (v, f) == ("stock", "onnx"):
                time.sleep(60)
            if (v, f) == ("converted", "onnx"):
                os._exit(7)
            emit(dict(model="m", variant=v, format=f, status="pass", reason="", seconds=0.0))
    """))
    monkeypatch.setattr(bench_export, "_worker_cmd",
                        lambda name, args, cells, out: [sys.executable, str(script), out,
                                                        ",".join(f"{v}:{f}" for v, f in cells)])
    monkeypatch.setattr(bench_export, "POLL_SECONDS", 0.05)
    args = type("Args", (), dict(cell_timeout=0.6, app_size=None))()
    cells = [("stock", "litert"), ("stock", "onnx"), ("converted", "onnx"), ("int8", "onnx")]
    recs, _ = bench_export.drive_model("m", args, cells, log=lambda s: None)
    assert [(r["variant"], r["format"]) for r in recs] == cells
    assert [r["status"] for r in recs] == ["pass", "timeout", "fail", "pass"]
    assert "timed out" in recs[1]["reason"] and "exit 7" in recs[2]["reason"]


@pytest.mark.full  # one benchmark model in a worker process, three variants, two formats (~40 s)
def test_worker_run_of_a_benchmark_model(tmp_path, capsys):
    cells = bench_export.main(["--models", "mnist_convnet", "--formats", "onnx,litert", "--json",
                               str(tmp_path / "r.json")])
    assert {(c["variant"], c["format"]) for c in cells} == {(v, f) for v in bench_export.VARIANTS
                                                            for f in ("onnx", "litert")}
    for c in cells:
        assert c["status"] == "pass" and c["max_rel_error"] <= 1e-5 and c["size_bytes"] > 0, c
    sizes = {(c["variant"], c["format"]): c["size_bytes"] for c in cells}
    assert sizes[("int8", "litert")] < 0.5 * sizes[("stock", "litert")]  # LiteRT keeps the int8 kernels
    assert "cells where stock passes and ours fails: 0 (must be 0)" in capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    # 3*3*1*32 + 32 + 3*3*32*64 + 64 + 5*5*64*10 + 10: the two convolutions and the Dense head
    assert data["models"]["mnist_convnet"]["params"] == 34826
