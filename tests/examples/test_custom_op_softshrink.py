"""examples/custom_op_softshrink.py runs end to end and tells its story with real numbers."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_softshrink_example():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "custom_op_softshrink.py")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    diff = float(re.search(r"max \|stock - custom op\| on the same weights: (\S+)", out).group(1))
    assert diff < 1e-5
    assert "'TfmetalExt>Softshrink': 1, 'TfmetalExt>SoftshrinkGrad': 1" in out
    stock, ours = map(int, re.search(r"ops per train step: stock (\d+), custom op (\d+)", out).groups())
    assert ours < stock
    assert out.count("Placement report (train)") == 2
