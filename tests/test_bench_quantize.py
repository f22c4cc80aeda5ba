"""benchmarks/bench_quantize.py: the parts run and write what they claim (int8 ops in the int8 graphs, fewer
weight bytes); the figures themselves are the benchmark's business, not a test's."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _common  # noqa: E402
import bench_quantize  # noqa: E402

from tfmetal_ext.backends import fusion  # noqa: E402


def test_unknown_part_or_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_quantize.main(["--quick", "--parts", "speed"])
    assert "unknown parts ['speed']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_quantize.main(["--quick", "--models", "VGG"])
    assert "models ['VGG']" in capsys.readouterr().err


def test_weight_bytes_counts_each_dtype_size():
    import keras

    layer = keras.layers.Dense(3)
    model = keras.Sequential([keras.Input((5,)), layer])
    assert bench_quantize.weight_bytes(model) == (5 * 3 + 3) * 4
    layer.quantize("int8")  # Keras' own: int8 kernel, float32 bias and scale
    assert bench_quantize.weight_bytes(model) == 5 * 3 + 3 * 4 + 3 * 4


def test_dense_variants_share_the_float_weights():
    models = bench_quantize.dense_variants(16)
    x = np.random.default_rng(0).standard_normal((2, 16)).astype("float32")
    want = models["keras float"](x).numpy()
    np.testing.assert_allclose(models["ours float"](x).numpy(), want, rtol=1e-5, atol=1e-6)
    # int8: within the abs-max quantization error, and not equal to float (they really are quantized).
    for name in ("ours int8", "keras int8"):
        got = models[name](x).numpy()
        assert not np.array_equal(got, want), name
        np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), err_msg=name)


@pytest.mark.slow
def test_quick_run_output(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "RESULTS_DIR", str(tmp_path))
    out = bench_quantize.main(["--quick", "--models", "digits classifier", "--output", "q"])
    (acc,) = out["accuracy"]
    assert acc["model"] == "digits classifier"
    assert 0.0 <= acc["ours_int8_acc"] <= 1.0 and 0.0 <= acc["float_acc"] <= 1.0
    assert acc["ours_int8_bytes"] < acc["float_bytes"]
    assert acc["ours_int8_custom_ops"] >= 1  # the int8 model runs the int8 ops
    lat = out["latency"]
    assert [r["batch"] for r in lat] == list(bench_quantize.BATCHES)
    for row in lat:
        assert fusion.CUSTOM_OPS["int8_matmul"].name in row["ours_int8_op"].split(",")
        assert "_FusedMatMul" in row["ours_float_op"].split(",")
        for key in ("ours_float_ms", "ours_int8_ms", "keras_float_ms", "keras_int8_ms"):
            assert row[key] > 0
    data = json.loads((tmp_path / "q_latency.json").read_text())
    assert data["environment"]["cpu"] and len(data["rows"]) == len(lat)
    assert (tmp_path / "q_accuracy.md").read_text().startswith("# q_accuracy")
