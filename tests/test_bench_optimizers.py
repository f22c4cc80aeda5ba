"""benchmarks/bench_optimizers.py: every pair runs, ours is the table's fused class, one training op per
variable (or per step with a multi-tensor op) in the rows it writes."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _common  # noqa: E402
import bench_optimizers  # noqa: E402

from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED  # noqa: E402


def test_every_pair_is_a_table_row():
    # The bench compares what convert() and MetalCallback recommend: the OPTIMIZER_TO_FUSED rows.
    for stock, _, _ in bench_optimizers.PAIRS.values():
        assert stock in OPTIMIZER_TO_FUSED
    assert {stock for stock, _, _ in bench_optimizers.PAIRS.values()} == set(OPTIMIZER_TO_FUSED)


def test_unknown_pair_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_optimizers.main(["--quick", "--pairs", "Adamax"])
    assert "unknown pairs ['Adamax']" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_output(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "RESULTS_DIR", str(tmp_path))
    rows = bench_optimizers.main(["--quick", "--output", "opt_quick"])
    (count, _), = bench_optimizers.QUICK_SIZES.values()
    assert [r["optimizer"] for r in rows] == list(bench_optimizers.PAIRS)
    for row in rows:
        stock = bench_optimizers.PAIRS[row["optimizer"]][0]
        assert row["ours"] == OPTIMIZER_TO_FUSED[stock].fused
        assert row["stock_ms"] > 0 and row["ours_ms"] > 0 and row["speedup"] > 0
        # One training op per variable, or one per step for the 8 float32 variables together.
        assert row["ours_train_ops_per_var"] in (1.0, round(1 / count, 3)), row
        assert row["ours_ops"] < row["stock_ops"], row
    per_variable = next(r for r in rows if r["optimizer"] == "Adam (ours per-variable)")
    assert per_variable["ours_train_ops"] == "ResourceApplyAdam"
    data = json.loads((tmp_path / "opt_quick.json").read_text())
    assert data["environment"]["cpu"] and "cpu_flags" in data["environment"]
    assert len(data["rows"]) == len(rows)
    assert (tmp_path / "opt_quick.md").read_text().startswith("# opt_quick")
