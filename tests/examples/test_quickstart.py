"""`make demo` runs examples/quickstart.py: keep it running end to end."""

import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quickstart_runs_and_prints_a_fusion_report():
    pytest.importorskip("sklearn", reason="examples need the [examples] extra (scikit-learn)")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "test accuracy after 2 epochs" in out
    acc = float(out.split("test accuracy after 2 epochs:")[1].split()[0])
    assert acc > 0.5  # 10 classes: chance is 0.1
    assert "Fusion report (train" in out and "Placement report" in out
    # The MetalCallback's summary, printed after the first step, and its per-epoch logs.
    summary = out[out.index("MetalCallback:"):out.index("test accuracy")]
    assert "backend " in summary and "ops per step" in summary and "CPU fallback" in summary
    assert "median step time" in out and "examples/s" in out
    assert "_FusedMatMul[BiasAdd, Relu]" in out
    # Batch norm + ReLU in training: TfmetalExt>BatchNormAct where the backend table's row takes the
    # policy's compute dtype (float32 on both CPU tables); else the stock graph, which oneDNN's remapper
    # fuses into _FusedBatchNormEx (bfloat16 where configure() picks it).
    from tfmetal_ext.layers._ops import batch_norm_act_reason

    policy = out.split("policy=", 1)[1].split()[0]
    compute = keras.mixed_precision.Policy(policy).compute_dtype
    if batch_norm_act_reason(compute, "relu") is None:
        assert "TfmetalExt>BatchNormAct[relu" in out
    elif "oneDNN=on" in out:
        assert "_FusedBatchNormEx" in out
    line = next(l for l in out.splitlines() if l.startswith("ops per train step: stock Keras"))
    stock_ops = int(line.split("stock Keras ")[1].split(",")[0])
    ours_ops = int(line.split("tfmetal_ext ")[1].split()[0])
    assert ours_ops < stock_ops
