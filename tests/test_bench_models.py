"""Smoke tests of benchmarks/bench_models.py's harness on tiny models: op counting, failure recording, output."""

import json
import os
import sys

import keras
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_models  # noqa: E402

import tfmetal_ext  # noqa: E402
from tfmetal_ext.conversion import VerificationError  # noqa: E402


def _tiny(batch=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    return dict(model=model, x=rng.standard_normal((batch, 6)).astype("float32"),
                y=rng.standard_normal((batch, 3)).astype("float32"), loss="mse", metrics=[])


def test_train_ops_counts_the_optimizer_the_model_is_compiled_with():
    spec = _tiny()
    model = spec["model"]
    n_stock, rep_stock = bench_models.train_ops(model, spec, keras.optimizers.Adam())
    n_fused, rep_fused = bench_models.train_ops(model, spec, tfmetal_ext.optimizers.FusedAdam(multi_tensor=False))
    # FusedAdam issues one ResourceApplyAdam per trainable variable (four here); Keras' Adam none.
    assert rep_fused.ops_by_type.get("ResourceApplyAdam") == len(model.trainable_variables) == 4
    assert "ResourceApplyAdam" not in rep_stock.ops_by_type
    assert n_fused < n_stock
    assert n_stock == sum(rep_stock.ops_by_type.values())


def test_train_ops_falls_back_to_counting_the_capture(monkeypatch):
    spec = _tiny()
    n_report, _ = bench_models.train_ops(spec["model"], spec, keras.optimizers.Adam())

    def broken(*args, **kwargs):
        raise AttributeError("report builder broke")

    monkeypatch.setattr(tfmetal_ext.inspect, "fusion_report", broken)
    errors = {}
    n_capture, report = bench_models.train_ops(spec["model"], spec, errors=errors)
    assert report is None and "report builder broke" in errors["fusion_report"]
    assert n_capture == n_report
    with pytest.raises(AttributeError):
        bench_models.train_ops(spec["model"], spec)


def test_measure_stock_and_converted():
    row = bench_models.measure("tiny", _tiny, rounds=1, repeats=1)
    assert row["errors"] == {}, row["errors"]
    assert row["verified"] == "yes" and row["shared_vars"] == 0
    for key in ("stock_ops", "ours_ops", "stock_fused_opt_ops", "ours_keras_adam_ops",
                "stock_first_step_s", "ours_first_step_s", "stock_step_ms", "ours_step_ms"):
        assert row[key] > 0, key
    assert row["ops_ratio"] == pytest.approx(row["ours_ops"] / row["stock_ops"])
    assert row["ours_ops"] < row["stock_ops"]  # the fused optimizer alone removes ~26 ops per variable


def test_measure_records_a_refused_conversion(monkeypatch):
    def refuse(model, **kwargs):
        raise ValueError(f"cannot convert this. Received: model={model.name!r}")

    monkeypatch.setattr(tfmetal_ext, "convert", refuse)
    row = bench_models.measure("tiny", _tiny, rounds=1, repeats=1)
    assert row["verified"] == "refused (ValueError)"
    assert "cannot convert this" in row["errors"]["convert"]
    assert row["stock_ops"] > 0 and row["stock_step_ms"] > 0
    assert "ours_ops" not in row and "ops_ratio" not in row


def test_measure_unverified_conversion_is_measured_and_marked(monkeypatch):
    real = tfmetal_ext.convert
    calls = []

    def failing_verify(model, **kwargs):
        calls.append(kwargs.get("verify", True))
        if kwargs.get("verify", True):
            raise VerificationError("outputs differ")
        return real(model, **kwargs)

    monkeypatch.setattr(tfmetal_ext, "convert", failing_verify)
    row = bench_models.measure("tiny", _tiny, rounds=1, repeats=1, split=False)
    assert calls == [True, False]
    assert row["verified"] == "no (VerificationError)" and "outputs differ" in row["errors"]["convert"]
    assert row["ours_ops"] > 0 and "stock_fused_opt_ops" not in row


def test_shared_variables():
    spec = _tiny()
    stock = spec["model"]
    copy = keras.models.clone_model(stock)
    assert bench_models.shared_variables(stock, copy) == 0
    shared = keras.Sequential([keras.Input((6,)), stock.layers[0], keras.layers.Dense(2)])
    assert bench_models.shared_variables(stock, shared) == 2  # kernel and bias of the reused Dense


def test_write_outputs(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_models, "RESULTS_DIR", str(tmp_path))
    args = type("Args", (), dict(quick=True, rounds=1, repeats=1, first_step_rounds=1, argv=["--quick"],
                                 script="bench_models.py"))()
    rows = [dict(model="a", stock_ops=100, ours_ops=60, ops_ratio=0.6, step_ratio=0.9, errors={}),
            dict(model="b", errors={"convert": "ValueError: no"})]
    text = bench_models.write("bench_models_test", rows, args)
    data = json.loads((tmp_path / "bench_models_test.json").read_text())
    assert [r["model"] for r in data["rows"]] == ["a", "b"]
    assert data["environment"]["cpu"] and "onednn" in data["environment"]
    assert "| a |" in text and "b / convert: `ValueError: no`" in text
    assert (tmp_path / "bench_models_test.png").stat().st_size > 1000


# Quick tier: one model (whole-model runs, each a sample of "every builder builds and trains"); the full
# tier builds and runs all of them.
@pytest.mark.sample_axes("name")
@pytest.mark.parametrize("name", sorted(bench_models.MODELS))
def test_example_models_build_and_run(name):
    """Every benchmark model builds and its synthetic batch runs through it (forward only, fast)."""
    keras.utils.set_random_seed(0)
    spec = bench_models.MODELS[name]()
    out = spec["model"](spec["x"][:2])
    assert out.shape[0] == 2
    assert np.isfinite(keras.ops.convert_to_numpy(out)).all()


def test_first_step_takes_fresh_pairs(monkeypatch):
    real, converted = tfmetal_ext.convert, []

    def spy(model, **kwargs):
        converted.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(tfmetal_ext, "convert", spy)
    row = bench_models.measure("tiny", _tiny, split=False, time_steps=False, first_step_rounds=2)
    assert len(converted) == 2 and converted[0] is not converted[1]  # a fresh stock model per round
    assert row["errors"] == {} and row["ours_first_step_s"] > 0
    assert row["first_step_ratio"] == pytest.approx(row["ours_first_step_s"] / row["stock_first_step_s"])


def test_loops_counts_the_while_loops_of_the_step():
    keras.utils.set_random_seed(0)
    rnn = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])
    spec = dict(model=rnn, x=np.ones((2, 5, 3), "float32"), y=np.ones((2, 1), "float32"), loss="mse", metrics=[])
    _, report = bench_models.train_ops(rnn, spec, keras.optimizers.SGD())
    assert bench_models._loops(report) == 2  # the LSTM's time loop, forward and backward
    spec = _tiny()
    _, report = bench_models.train_ops(spec["model"], spec, keras.optimizers.SGD())
    assert bench_models._loops(report) == 0
