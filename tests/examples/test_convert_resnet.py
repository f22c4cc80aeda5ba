"""examples/convert_resnet.py: convert, train and fold keras.applications.ResNet50 end to end."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_convert_resnet_example_runs(tmp_path):
    out_path = tmp_path / "deploy.keras"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "convert_resnet.py"), "--out", str(out_path)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Conversion of 'resnet50' (training form): 54 rewrites" in out
    before, after = map(int, re.search(r"ops per train step: (\d+) -> (\d+)", out).groups())
    assert after < before
    assert "verified: outputs max rel diff" in out
    loss = float(re.search(r"one epoch: loss ([0-9.]+)", out).group(1))
    assert loss == loss and loss < 1e3  # finite
    assert "deployment form: 53 folded layers" in out and "ConvBNAct" not in out.split("deployment form")[1]
    assert "deployment outputs finite: True" in out
    # The folded model matches the trained one (convert's own inference check, 1e-4 relative) ...
    fold_diff = float(re.search(r"folded vs trained max rel diff ([0-9.e+-]+)", out).group(1))
    assert fold_diff <= 1e-4
    # ... and the saved file restores it: the same weights bit for bit, the same outputs.
    assert "reloaded weights identical: True" in out and out_path.exists()
    reload_diff = float(re.search(r"reloaded weights identical: True; outputs max rel diff ([0-9.e+-]+)", out).group(1))
    assert reload_diff <= 1e-6
