"""benchmarks/bench_hub.py: a --quick run measures what it says (a converted, verified step with fewer ops)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("keras_hub", reason="keras-hub is not installed (extra [hub])")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.full  # converts and times a backbone in a subprocess (~40 s)
def test_quick_run_writes_rows_with_verified_conversions():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_hub.py"), "--quick",
                           "--families", "llama", "--cases", "train,memory"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(ROOT, "benchmarks", "results", "bench_hub_quick.json")) as f:
        data = json.load(f)
    train = next(r for r in data["rows"] if r["case"] == "train")
    assert train["verified"] is True and "error" not in train
    assert train["ours_ops"] < train["stock_ops"] and train["attention_ops"] == 1
    assert set(train["fallbacks"]) == {"tensorflow-metal", "tensorflow-metal-plugin"}
    memory = next(r for r in data["rows"] if r["case"] == "memory")
    assert memory["stock_mb"] > 0 and memory["ours_mb"] > 0
    assert os.path.exists(os.path.join(ROOT, "benchmarks", "results", "bench_hub_quick.png"))


def test_unknown_family_is_a_usage_error(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_hub

    with pytest.raises(SystemExit) as exit_info:
        bench_hub.main(["--families", "nope"])
    assert exit_info.value.code == 2 and "unknown families/cases ['nope']" in capsys.readouterr().err
