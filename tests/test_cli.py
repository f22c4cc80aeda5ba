import json

import keras
import pytest

from tfmetal_ext import cli


@pytest.fixture
def saved_model(tmp_path):
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inp)
    x = keras.layers.Flatten()(x)
    out = keras.layers.Dense(5, name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    path = tmp_path / "model.keras"
    model.save(path)
    return path


def test_report_json_on_saved_model(saved_model, capsys):
    assert cli.main(["report", str(saved_model), "--mode", "train", "--batch", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fused = [f for f in data["fusion"]["fused"] if not f["backward"]]
    assert {"op": "_FusedConv2D", "fused_ops": ["BiasAdd", "Relu"], "layer": "conv"}.items() <= fused[0].items()
    assert data["fusion"]["mode"] == "train" and data["fusion"]["num_ops"] > 20
    assert data["placement"]["fallbacks"] == []


def test_report_text_predict(saved_model, capsys):
    assert cli.main(["report", str(saved_model), "--mode", "predict"]) == 0
    out = capsys.readouterr().out
    assert "Fusion report (predict" in out and "_FusedConv2D[BiasAdd, Relu]" in out
    assert "Placement report" in out


def test_report_uncompiled_model_uses_defaults(tmp_path, capsys):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu", name="fc")])
    path = tmp_path / "plain.keras"
    model.save(path)
    assert cli.main(["report", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("clone (optimizer=adam, loss=mse)" in n for n in data["fusion"]["notes"])
    assert data["fusion"]["layers"][0]["status"] == "fused"


def test_report_missing_file(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope.keras")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_report_bad_batch(saved_model):
    with pytest.raises(SystemExit):
        cli.main(["report", str(saved_model), "--batch", "0"])


@pytest.fixture
def saved_lstm_attention(tmp_path):
    inp = keras.Input((6, 8))
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(inp, inp)
    out = keras.layers.LSTM(4, name="lstm")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "seq.keras"
    model.save(path)
    return path


def test_report_predict_for_the_open_plugin(saved_lstm_attention, capsys):
    # Keras' attention emits Einsum (no kernel there: CPU, without tfmetal_ext's gap kernel), stock LSTM
    # CudnnRNNV3 (no kernel anywhere here).
    argv = ["report", str(saved_lstm_attention), "--predict-for", "tensorflow-metal-plugin"]
    assert cli.main(argv + ["--no-gap-kernels"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Predicted placement (train) on tensorflow-metal-plugin")
    rows = [line.split() for line in out.splitlines()]
    assert any(r[:1] == ["Einsum"] and "mha" in r and "falls" in r for r in rows), out
    assert any(r[:1] == ["CudnnRNNV3"] and "lstm" in r and "fails" in r for r in rows), out
    assert "Fusion report" not in out  # this host's fusions say nothing about that backend
    assert cli.main(argv) == 0
    gap_line = next(line for line in capsys.readouterr().out.splitlines() if "tfmetal_ext gap kernels:" in line)
    assert "Einsum(float32)" in gap_line


def test_report_predict_for_json_and_apple(saved_lstm_attention, capsys):
    argv = ["report", str(saved_lstm_attention), "--mode", "predict", "--json", "--no-gap-kernels", "--predict-for"]
    assert cli.main(argv + ["tensorflow-metal-plugin"]) == 0
    data = json.loads(capsys.readouterr().out)["predicted_placement"]
    assert data["mode"] == "predict" and data["predicted_for"] == "tensorflow-metal-plugin"
    assert {"Einsum", "CudnnRNNV3"} <= {m["op"] for m in data["missing"]}
    assert cli.main(argv + ["tensorflow-metal"]) == 0
    data = json.loads(capsys.readouterr().out)["predicted_placement"]
    assert "CudnnRNNV3" not in {e["op"] for e in data["entries"]}  # Apple's plugin has its kernel


def test_report_predict_for_apple_on_macos_12(saved_lstm_attention, capsys):
    argv = ["report", str(saved_lstm_attention), "--json", "--no-gap-kernels", "--predict-for", "tensorflow-metal",
            "--macos", "12.7"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)["predicted_placement"]
    assert any("predicted for macOS 12.7 (as asked)" in n for n in data["notes"]), data["notes"]
    assert "Einsum" in {m["op"] for m in data["missing"]}  # no Einsum kernel in Apple's table either


def test_report_predict_with_and_without_gap_kernels(tmp_path, capsys):
    # REFERENCE.md section 10: Apple's tensorflow-metal has no Elu kernel (its EluGrad is what the train step
    # keeps: the forward Elu fuses into _FusedMatMul); tfmetal_ext registers one.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="elu", name="fc")])
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "elu.keras"
    model.save(path)
    argv = ["report", str(path), "--predict-for", "tensorflow-metal"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    gap_line = next(line for line in out.splitlines() if "on the GPU through tfmetal_ext gap kernels:" in line)
    assert "EluGrad(float32)" in gap_line
    assert not any(line.split()[:1] == ["EluGrad"] for line in out.splitlines()), out
    assert cli.main(argv + ["--no-gap-kernels"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:1] == ["EluGrad"] and "falls" in line for line in out.splitlines()), out
    assert "gap kernels" not in out


@pytest.mark.parametrize("argv, message", [
    (["--macos", "12.7"], "--macos applies to a prediction only"),
    (["--no-gap-kernels"], "--no-gap-kernels applies to a prediction only"),
    (["--predict-for", "tensorflow-metal", "--macos", "twelve"], "Received: macos='twelve'"),
])
def test_report_bad_macos(saved_model, capsys, argv, message):
    assert cli.main(["report", str(saved_model)] + argv) == 2
    assert message in capsys.readouterr().err


def test_report_predict_for_bad_name(saved_model, capsys):
    assert cli.main(["report", str(saved_model), "--predict-for", "cuda"]) == 2
    assert "Received: predict_for='cuda'" in capsys.readouterr().err


def test_version(capsys):
    assert cli.main(["version", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] in ("metal", "cuda", "cpu") and "pairing" in data


def test_version_on_tf_2_21_with_apple_plugin_names_both_routes(capsys):
    import tensorflow as tf

    from tfmetal_ext import devices

    if not tf.__version__.startswith("2.21."):
        pytest.skip(f"the routes below are TF 2.21's; this is TF {tf.__version__}")
    with devices.assume_backend("tensorflow-metal"):
        assert cli.main(["version"]) == 0
    out = capsys.readouterr().out
    assert "known-broken" in out
    assert "pip uninstall -y tensorflow-metal" in out
    assert "tensorflow-metal-plugin==0.4.1" in out
    assert '"tensorflow>=2.16,<2.20" "tensorflow-metal==1.2.*"' in out


def test_doctor_exits_1_on_an_environment_error(monkeypatch, capsys):
    from tfmetal_ext import doctor

    real = doctor.collect

    def broken():
        info = real()
        info.errors.append("both tensorflow-metal and tensorflow-metal-plugin are installed")
        return info

    monkeypatch.setattr(doctor, "collect", broken)
    assert cli.main(["doctor"]) == 1
    assert "both tensorflow-metal and tensorflow-metal-plugin are installed" in capsys.readouterr().out


def _assert_usage_error(code, capsys, *words):
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("case", ["missing_dir", "no_suffix", "a_directory"])
def test_convert_bad_output_exits_2_before_converting(saved_model, tmp_path, capsys, monkeypatch, case):
    from tfmetal_ext import conversion

    def no_conversion(*a, **k):
        raise AssertionError("converted before checking the output")

    monkeypatch.setattr(conversion, "convert", no_conversion)
    out = {
        "missing_dir": tmp_path / "nowhere" / "out.keras",
        "no_suffix": tmp_path / "out.h5",
        "a_directory": tmp_path,
    }[case]
    code = cli.main(["convert", str(saved_model), str(out)])
    _assert_usage_error(code, capsys, str(out.parent if case == "missing_dir" else out))


def test_convert_bad_input_exits_2(tmp_path, capsys):
    out = str(tmp_path / "out.keras")
    _assert_usage_error(cli.main(["convert", str(tmp_path / "nope.keras"), out]), capsys, "nope.keras")
    other = tmp_path / "model.h5"
    other.write_text("x")
    _assert_usage_error(cli.main(["convert", str(other), out]), capsys, "model.h5", ".keras")


def test_build_ops_with_a_file_for_a_cache_exits_2(tmp_path, capsys, monkeypatch):
    from tfmetal_ext.ops import _loader

    blocker = tmp_path / "cache_is_a_file"
    blocker.write_text("x")
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(blocker))

    def build(force=False):  # what the loader does with such a cache: the OS refuses the directory
        raise NotADirectoryError(20, "Not a directory", str(blocker))

    monkeypatch.setattr(_loader, "build", build)
    _assert_usage_error(cli.main(["build-ops"]), capsys, str(blocker), "TFMETAL_EXT_CACHE")
