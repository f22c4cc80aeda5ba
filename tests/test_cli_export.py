"""`tfmetal-ext export MODEL.keras OUT --format ...`: a checked artifact, one-line errors, exit codes."""

import os

import keras
import numpy as np
import pytest

import tfmetal_ext  # noqa: F401  (registers the layers load_model needs)
from tfmetal_ext import cli, layers as fl
from tfmetal_ext.deploy import formats

L = keras.layers


@pytest.fixture
def saved_model(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    x = fl.FusedLayerNorm(name="ln")(inp)
    out = fl.FusedDense(4, activation="relu", name="head")(x)
    path = tmp_path / "model.keras"
    keras.Model(inp, out).save(path)
    return path


@pytest.mark.skipif(bool(formats.missing_modules(formats.FORMATS["litert"])), reason="ai-edge-litert is not installed")
def test_export_litert_writes_a_checked_file(saved_model, tmp_path, capsys):
    from ai_edge_litert import interpreter as litert

    out = tmp_path / "model.tflite"
    assert cli.main(["export", str(saved_model), str(out), "--format", "litert"]) == 0
    text = capsys.readouterr().out
    assert "exported litert" in text and "max relative error" in text
    runner = litert.Interpreter(model_path=str(out)).get_signature_runner()
    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    (got,) = runner(**{next(iter(runner.get_input_details())): x}).values()
    ref = keras.saving.load_model(saved_model).predict(x, verbose=0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_export_usage_errors_are_one_line(saved_model, tmp_path, capsys):
    cases = [
        (["export", str(tmp_path / "missing.keras"), str(tmp_path / "m.onnx"), "--format", "onnx"], "no such file"),
        (["export", str(saved_model), str(tmp_path / "m.tflite"), "--format", "onnx"], "add the .onnx suffix"),
        (["export", str(saved_model), str(tmp_path / "no" / "m.onnx"), "--format", "onnx"], "does not exist"),
        (["export", str(saved_model), str(saved_model), "--format", "tf_saved_model"], "exists"),
        (["export", str(tmp_path), str(tmp_path / "m.onnx"), "--format", "onnx"], "must be a .keras file"),
    ]
    for argv, text in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as e:  # argparse: an unknown format
        cli.main(["export", str(saved_model), str(tmp_path / "m.x"), "--format", "tflite"])
    assert e.value.code == 2


def test_export_names_the_extra_when_a_converter_is_missing(saved_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(formats, "missing_modules", lambda fmt: ["onnxruntime (ImportError: none)"])
    assert cli.main(["export", str(saved_model), str(tmp_path / "m.onnx"), "--format", "onnx"]) == 2
    assert "pip install 'tfmetal-ext[export]'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.onnx")


def test_to_stock_usage_errors_are_one_line(saved_model, tmp_path, capsys):
    cases = [
        (["to-stock", str(tmp_path / "missing.keras"), str(tmp_path / "s.keras")], "no such file"),
        (["to-stock", str(saved_model), str(tmp_path / "s.h5")], ".keras"),
        (["to-stock", str(saved_model), str(tmp_path / "no" / "s.keras")], "does not exist"),
    ]
    for argv, text in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err


@pytest.mark.full  # loads the result in a Python process without tfmetal_ext (TensorFlow starts there)
def test_to_stock_saves_a_file_that_loads_without_tfmetal_ext(saved_model, tmp_path, capsys):
    import zipfile

    out = tmp_path / "stock.keras"
    assert cli.main(["to-stock", str(saved_model), str(out)]) == 0
    assert "loaded in a process without tfmetal_ext" in capsys.readouterr().out
    with zipfile.ZipFile(out) as z:
        config = z.read("config.json").decode()
    assert "tfmetal_ext" not in config and "LayerNormalization" in config
    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    ref = keras.saving.load_model(saved_model).predict(x, verbose=0)
    # Stock LayerNormalization's ops against our kernel's: float rounding apart.
    np.testing.assert_allclose(keras.saving.load_model(out).predict(x, verbose=0), ref, rtol=1e-5, atol=1e-6)
