"""The test tiers and the quick tier's time budget (tests/_tiers.py), run on small suites of their own."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIERS = Path(__file__).with_name("_tiers.py")

pytestmark = pytest.mark.no_keras

_CONFTEST = textwrap.dedent(
    f"""
    import importlib.util, os
    spec = importlib.util.spec_from_file_location("tiers_under_test", {str(TIERS)!r})
    tiers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiers)
    for name in ("QUICK_BUDGET_SECONDS", "QUICK_TEST_CAP_SECONDS", "CALIBRATION_REFERENCE_SECONDS"):
        if name in os.environ:
            setattr(tiers, name, float(os.environ[name]))
    # The canary's times, in the order it is timed (start of the run, end). Stood in for: these sample
    # suites test the plugin's arithmetic, and the real canary would import Keras in every one of them
    # (test_the_canary_trains_a_keras_model runs it).
    _times = [float(v) for v in os.environ.get("CALIBRATION_TIMES", "1.0").split(",")]
    tiers.calibration_seconds = lambda repeats=5: _times.pop(0) if len(_times) > 1 else _times[0]

    def pytest_addoption(parser):
        tiers.add_options(parser)

    def pytest_configure(config):
        config.pluginmanager.register(tiers, "tiers")
        tiers.register(config)
    """
)


def _suite(tmp_path, body):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return tmp_path


def _run(directory, *args, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("TFMETAL_EXT_TEST_TIER", "TFMETAL_EXT_NO_BUDGET")}
    full_env.update(env)
    # No plugins from the environment (xdist, hypothesis): only the tiers under test.
    full_env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=directory, capture_output=True, text=True,
                          env=full_env, timeout=120)


_PARAMETRIZED = """
    import pytest

    @pytest.mark.parametrize("mode", ["eager", "graph"])
    @pytest.mark.parametrize("case", ["a", "b", "c"])
    @pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
    def test_cross(dtype, case, mode):
        pass

    @pytest.mark.parametrize("bad", ["x", "y", "z", "w"])
    def test_single_axis(bad):
        pass

    @pytest.mark.every_case
    @pytest.mark.parametrize("a", [1, 2])
    @pytest.mark.parametrize("b", [1, 2])
    def test_every(a, b):
        pass

    @pytest.mark.cover_axes("dtype")
    @pytest.mark.parametrize("dtype", ["float32", "float16"])
    def test_dtype_paths(dtype):
        pass

    @pytest.mark.slow
    def test_slow():
        pass

    @pytest.mark.full
    def test_full_only():
        pass
"""


def _collected(result):
    return [line.strip() for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.full  # a sample suite in a subprocess (~11 s); the quick tier keeps the tier-selection and budget tests of this file
def test_quick_tier_keeps_a_covering_sample(tmp_path):
    suite = _suite(tmp_path, _PARAMETRIZED)
    quick = _collected(_run(suite, "--collect-only", "-q"))
    full = _collected(_run(suite, "--collect-only", "-q", "--tier", "full"))
    assert len(full) == 18 + 4 + 4 + 2 + 2
    cross = [n for n in quick if "test_cross" in n]
    # Every case and mode at least once, one dtype suffices: 3 cases x 2 modes need 3 items.
    assert len(cross) == 3, cross
    assert {n.split("[")[1].split("-")[1] for n in cross} == {"a", "b", "c"}
    assert {n.split("[")[1].split("-")[2].rstrip("]") for n in cross} == {"eager", "graph"}
    assert len([n for n in quick if "test_single_axis" in n]) == 4  # each bad argument is a behaviour
    assert len([n for n in quick if "test_every" in n]) == 4
    assert len([n for n in quick if "test_dtype_paths" in n]) == 2
    assert not [n for n in quick if "test_slow" in n or "test_full_only" in n]
    # The same sample on every run.
    assert _collected(_run(suite, "--collect-only", "-q")) == quick
    # A case named on the command line runs whatever the tier.
    named = "test_suite.py::test_cross[bfloat16-c-graph]"
    assert _collected(_run(suite, "--collect-only", "-q", named)) == [named]
    assert _collected(_run(suite, "--collect-only", "-q", "test_suite.py::test_slow")) == ["test_suite.py::test_slow"]


def test_tier_from_the_environment(tmp_path):
    suite = _suite(tmp_path, _PARAMETRIZED)
    assert len(_collected(_run(suite, "--collect-only", "-q", TFMETAL_EXT_TEST_TIER="full"))) == 30
    bad = _run(suite, "--collect-only", "-q", TFMETAL_EXT_TEST_TIER="fast")
    assert bad.returncode != 0 and "TFMETAL_EXT_TEST_TIER=" in bad.stderr + bad.stdout


_SLEEPY = """
    import time

    def test_quick_one():
        time.sleep(0.05)

    def test_slow_one():
        time.sleep(0.6)
"""


@pytest.mark.full  # a sample suite in a subprocess (~7 s); the quick tier keeps test_the_verdict_and_the_report_use_one_scale (the same budget plugin)
def test_a_slow_quick_test_fails_the_run_where_it_is_written(tmp_path):
    suite = _suite(tmp_path, _SLEEPY)
    # A reference canary time far above this run's (1.0 s): the scale clamps to its lowest, cap 0.15 s.
    result = _run(suite, "-q", "test_suite.py", QUICK_TEST_CAP_SECONDS="0.3", CALIBRATION_REFERENCE_SECONDS="1e9")
    assert result.returncode == 1, result.stdout
    assert "2 passed" in result.stdout
    assert "BUDGET: test_suite.py::test_slow_one took" in result.stdout
    assert "test_quick_one" not in result.stdout.split("BUDGET:", 1)[1]
    ok = _run(suite, "-q", "test_suite.py", QUICK_TEST_CAP_SECONDS="5")
    assert ok.returncode == 0, ok.stdout
    assert "quick tier time budget" in ok.stdout and "BUDGET:" not in ok.stdout
    # The full tier has no budget; nor has a run with TFMETAL_EXT_NO_BUDGET=1.
    assert _run(suite, "-q", "--tier", "full", QUICK_TEST_CAP_SECONDS="0.3").returncode == 0
    assert _run(suite, "-q", QUICK_TEST_CAP_SECONDS="0.3", TFMETAL_EXT_NO_BUDGET="1").returncode == 0


@pytest.mark.full  # runs the sample suite three times; test_the_verdict_and_the_report_use_one_scale exercises the same budget plugin in the quick tier
def test_the_total_is_checked_on_a_whole_run_only(tmp_path):
    suite = _suite(tmp_path, _SLEEPY)
    # Scale clamped to its lowest (0.5): a budget of 0.2 s against 0.65 s of sleeping, on any machine.
    env = dict(QUICK_BUDGET_SECONDS="0.4", QUICK_TEST_CAP_SECONDS="50", CALIBRATION_REFERENCE_SECONDS="1e9")
    whole = _run(suite, "-q", **env)
    assert whole.returncode == 1 and "BUDGET: the quick tier took" in whole.stdout, whole.stdout
    # Under pytest-xdist (as `make test` runs) the controlling process collects nothing, yet holds the budget.
    spread = _run(suite, "-q", "-p", "xdist", "-n", "2", **env)
    assert spread.returncode == 1 and "BUDGET: the quick tier took" in spread.stdout, spread.stdout
    part = _run(suite, "-q", "-k", "slow_one", **env)  # a selection is not held to the whole tier's total
    assert part.returncode == 0, part.stdout
    part = _run(suite, "-q", "test_suite.py::test_slow_one", **env)
    assert part.returncode == 0, part.stdout
    # Each file's time is recorded.
    times = (tmp_path / ".pytest_cache" / "tfmetal_ext" / "quick_tier_times.json").read_text()
    assert "test_suite.py" in times


def test_the_verdict_and_the_report_use_one_scale(tmp_path):
    # The canary is timed at the start and again at the end, the slower time counting. The verdict
    # (the exit status) once used the start time while the report printed the end one: a run
    # failed with no BUDGET line at all. Budget 1.0 s of reference time against ~0.65 s of sleep:
    # over at the start's scale (0.5), within at the end's (1.0).
    suite = _suite(tmp_path, _SLEEPY)
    env = dict(QUICK_BUDGET_SECONDS="1.0", QUICK_TEST_CAP_SECONDS="50", CALIBRATION_REFERENCE_SECONDS="1.0")
    result = _run(suite, "-q", CALIBRATION_TIMES="0.5,1.0", **env)
    assert result.returncode == 0 and "BUDGET:" not in result.stdout, result.stdout
    assert "scale 1.00" in result.stdout, result.stdout
    # Both times fast: over budget, and the failure says so.
    result = _run(suite, "-q", CALIBRATION_TIMES="0.5,0.5", **env)
    assert result.returncode == 1 and "BUDGET: the quick tier took" in result.stdout, result.stdout


def test_the_scale_is_clamped():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiers_scale", TIERS)
    tiers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiers)
    budget = tiers.Budget.__new__(tiers.Budget)
    for measured, want in ((tiers.CALIBRATION_REFERENCE_SECONDS * 1.5, 1.5), (100.0, tiers.SCALE_LIMITS[1]),
                           (1e-9, tiers.SCALE_LIMITS[0])):
        budget.calibration = measured
        assert budget.scale() == pytest.approx(want)


@pytest.mark.full  # every quick-tier run times the canary twice in its controlling process (a broken canary fails make test)
def test_the_canary_trains_a_keras_model():
    import importlib.util
    import math

    spec = importlib.util.spec_from_file_location("tiers_canary", TIERS)
    tiers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiers)
    seconds = tiers.calibration_seconds(repeats=1)
    assert math.isfinite(seconds) and 0 < seconds < 120, seconds
