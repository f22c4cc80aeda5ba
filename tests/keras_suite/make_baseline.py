"""Regenerates `baseline.json`: what a bare subclass of each stock class passes.

    python -m tests.keras_suite.make_baseline [pytest args...]

Runs `test_keras_suite.py` with ``class Bare<Stock>(<stock class>)`` (only a
registration and a recording ``__new__``) swapped in, and records per suite:

- ``tests``: the tests that build the bare class, each with ``bare``
  (``passed``/``failed``/``skipped``) and, unless passed, the one-line
  ``reason``: the bare subclass's error, i.e. what gates the test to Keras'
  own class;
- ``not_applicable``: the tests of that file that never build it (another
  class's cases, e.g. Conv1D in conv_test.py).

The versions of Keras and TensorFlow it ran with are recorded; conftest.py
warns when they differ from the installed ones.
"""

from __future__ import annotations

import json
import os
import sys
import time


class _Recorder:
    def __init__(self):
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        from tests.keras_suite import swap

        key = swap.test_key(report.nodeid)
        if report.when == "call" or report.outcome != "passed":
            if key in self.outcomes and self.outcomes[key][0] != "passed":
                return  # keep the first failure (a teardown error after a failed call)
            reason = ""
            if report.outcome != "passed":
                reason = _one_line(report)
            self.outcomes[key] = (report.outcome, reason)


def _one_line(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, message)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def main(argv=()):
    os.environ["TFMETAL_EXT_KERAS_SUITE_VARIANT"] = "bare"
    import pytest
    import keras
    import tensorflow as tf

    from tests.keras_suite import swap

    recorder = _Recorder()
    start = time.perf_counter()
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(swap.BASELINE_PATH.with_name("test_keras_suite.py")),
                        *argv], plugins=[recorder])
    elapsed = time.perf_counter() - start
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        print(f"make_baseline: pytest exited with {code!r}; baseline.json not written", file=sys.stderr)
        return int(code)
    suites = {}
    for (suite, name), (outcome, reason) in sorted(recorder.outcomes.items()):
        data = suites.setdefault(suite, {"bare_class": f"Bare{suite}", "tests": {}, "not_applicable": []})
        if suite in swap.instantiated((suite, name)):
            entry = {"bare": outcome}
            if reason:
                entry["reason"] = reason
            data["tests"][name] = entry
        else:
            data["not_applicable"].append(name)
    # A partial run (pytest args selecting some tests) replaces only the suites it ran.
    previous = swap.load_baseline() if argv else None
    seconds = round(elapsed, 1)
    if previous and previous.get("keras") == keras.__version__:
        suites = {**previous["suites"], **suites}
        seconds = previous.get("seconds")  # the time of the last full run
    baseline = {
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "generated_by": "python -m tests.keras_suite.make_baseline",
        "seconds": seconds,
        "suites": suites,
    }
    swap.BASELINE_PATH.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    for suite, data in suites.items():
        passed = sum(t["bare"] == "passed" for t in data["tests"].values())
        print(f"{suite}: bare subclass passes {passed} of {len(data['tests'])} "
              f"({len(data['not_applicable'])} tests of the file do not build it)")
    print(f"wrote {swap.BASELINE_PATH} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
