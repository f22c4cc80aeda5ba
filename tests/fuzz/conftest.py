import json
import os
import tempfile

import pytest

from ._tally import TALLY


@pytest.fixture(params=["library", "reference"])
def impl(request, monkeypatch):
    """Runs a fuzz test on the compiled library and on the pure-TF references."""
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    return request.param


def _report_path():
    """The JSON report's path; under pytest-xdist each worker writes its own (``.gw0.json``, ...),
    whose tallies add up to the run's (the controller process runs no fuzz case)."""
    path = os.environ.get("TFMETAL_EXT_FUZZ_REPORT") or os.path.join(tempfile.gettempdir(), "tfmetal_ext_fuzz_report.json")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        root, ext = os.path.splitext(path)
        path = f"{root}.{worker}{ext or '.json'}"
    return path


@pytest.fixture(scope="session", autouse=True)
def _fuzz_report():
    """At session end: the tallies as JSON in $TFMETAL_EXT_FUZZ_REPORT (default: the temp dir)."""
    yield
    with open(_report_path(), "w") as f:
        json.dump(TALLY, f, indent=2, sort_keys=True)


def pytest_terminal_summary(terminalreporter):
    if TALLY["tried"]:
        summary = ", ".join(f"{k}={v}" for k, v in TALLY.items())
        terminalreporter.write_line(f"fuzz tallies: {summary} (JSON: {_report_path()})")
