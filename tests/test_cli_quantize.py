"""`tfmetal-ext convert IN OUT --inference --quantize int8`: the saved int8 model loads back and predicts the same."""

import keras
import numpy as np
import pytest

import tfmetal_ext  # noqa: F401  (registers the layers load_model needs)
from tfmetal_ext import cli, conversion

L = keras.layers


@pytest.fixture
def saved_model(tmp_path):
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(4, 3, padding="same", name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(x)
    x = L.GlobalAveragePooling2D(name="pool")(x)
    out = L.Dense(5, name="head")(x)
    model = keras.Model(inp, out)
    bn = model.get_layer("bn")
    rng = np.random.default_rng(0)
    bn.moving_mean.assign(rng.normal(0, 0.3, 4))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 4))
    model.compile(optimizer="adam", loss="mse")
    path = tmp_path / "model.keras"
    model.save(path)
    return path


def _x():
    return np.random.default_rng(1).standard_normal((3, 8, 8, 3)).astype("float32")


def test_convert_quantize_int8_saves_a_model_that_loads_and_predicts_the_same(saved_model, tmp_path, capsys):
    out = tmp_path / "int8.keras"
    assert cli.main(["convert", str(saved_model), str(out), "--inference", "--quantize", "int8", "--no-ops"]) == 0
    text = capsys.readouterr().out
    assert "quantized int8 (weight-only, float activations): 2 layers" in text and f"saved {out}" in text
    loaded = keras.saving.load_model(out)
    assert {loaded.get_layer(n).quantization_mode for n in ("conv", "head")} == {"int8"}
    assert str(loaded.get_layer("conv")._kernel.dtype) == "int8"
    # The same conversion in memory (the CLI's defaults: batch 2, seed 0) predicts what the file does.
    mem = conversion.convert(keras.saving.load_model(saved_model), inference=True, quantize="int8",
                             count_ops=False)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(_x())), keras.ops.convert_to_numpy(mem(_x())))
    # ... and that differs from the float inference form by a quantization error only.
    ref = keras.ops.convert_to_numpy(conversion.convert(keras.saving.load_model(saved_model), inference=True,
                                                        count_ops=False)(_x()))
    got = keras.ops.convert_to_numpy(loaded(_x()))
    assert 0 < np.max(np.abs(got - ref)) <= 0.05 * np.max(np.abs(ref))


def test_quantize_without_inference_is_a_usage_error(saved_model, tmp_path, capsys, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted before checking the arguments")

    monkeypatch.setattr(conversion, "convert", no_conversion)
    code = cli.main(["convert", str(saved_model), str(tmp_path / "o.keras"), "--quantize", "int8"])
    assert code == 2
    assert "--quantize int8 needs --inference" in capsys.readouterr().err


def test_quantize_takes_int8_only(saved_model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", str(saved_model), str(tmp_path / "o.keras"), "--inference", "--quantize", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


@keras.saving.register_keras_serializable(package="test_cli_quantize")
class Bag(keras.Model):
    """A subclass making its sublayers in __init__: Keras re-makes them in float when loading."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = L.Embedding(12, 5, name="emb")
        self.proj = L.EinsumDense("ab,bc->ac", 4, bias_axes="c", name="proj")

    def call(self, x):
        return self.proj(keras.ops.mean(self.emb(x), axis=1))


def test_an_int8_file_that_would_not_load_back_is_refused_and_removed(tmp_path, capsys):
    model = Bag(name="bag")
    model(np.zeros((1, 3), "int32"))
    src, out = tmp_path / "bag.keras", tmp_path / "bag_int8.keras"
    model.save(src)
    assert cli.main(["convert", str(src), str(out), "--inference", "--quantize", "int8", "--no-ops"]) == 1
    captured = capsys.readouterr()
    assert "does not load back" in captured.err and "removed" in captured.err
    assert "inside a subclassed layer or model (emb, proj)" in captured.out  # the report's note says why
    assert not out.exists()
    # The float inference form of the same file converts and saves.
    assert cli.main(["convert", str(src), str(out), "--inference", "--no-ops"]) == 0
    assert out.exists()
