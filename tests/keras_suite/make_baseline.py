"""Regenerates `baseline.json`: what Keras' own class passes, and which tests build it.

    python -m tests.keras_suite.make_baseline [pytest args...]

Runs `test_keras_suite.py` twice, each in a process of its own: with Keras'
own class in place (``stock``), and with ``class Bare<Stock>(<stock class>)``
(a registration and a recording ``__new__``, nothing else; ``bare``). Per
suite it records:

- ``tests``: the tests that build the class, each with ``stock`` and
  ``bare`` (``passed``/``failed``/``skipped``) and, where Keras' own class
  does not pass, its one-line ``reason``. What ``stock`` passes, ours must
  pass (conftest.py);
- ``not_applicable``: the tests of that file that never build it (another
  class's cases, e.g. Conv1D in conv_test.py);
- ``identity``: the tests that check the class's identity, which a drop-in
  cannot pass, each with the reason. This list is written by hand and kept
  from the previous file (a test checks that each names a real test that
  Keras' own class passes).

The versions of Keras and TensorFlow it ran with are recorded; conftest.py
warns when they differ from the installed ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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


def run_variant(variant, out_path, argv):
    """In this process: the suite with `variant` swapped in; outcomes (and, for bare, which tests build it) to JSON."""
    os.environ["TFMETAL_EXT_KERAS_SUITE_VARIANT"] = variant
    import pytest

    from tests.keras_suite import swap

    recorder = _Recorder()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--tier", "full",
                        str(swap.BASELINE_PATH.with_name("test_keras_suite.py")), *argv], plugins=[recorder])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return int(code)
    rows = [
        {"suite": suite, "name": name, "outcome": outcome, "reason": reason,
         "builds": suite in swap.instantiated((suite, name))}
        for (suite, name), (outcome, reason) in sorted(recorder.outcomes.items())
    ]
    with open(out_path, "w") as f:
        json.dump(rows, f)
    return 0


def _child(variant, argv):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{variant}.json")
        code = subprocess.call([sys.executable, "-m", "tests.keras_suite.make_baseline", "--variant", variant, out,
                                *argv])
        if code != 0 or not os.path.exists(out):
            raise SystemExit(f"make_baseline: the {variant} run exited with {code}; baseline.json not written")
        with open(out) as f:
            return {(r["suite"], r["name"]): r for r in json.load(f)}


def main(argv=()):
    import keras
    import tensorflow as tf

    from tests.keras_suite import swap

    start = time.perf_counter()
    stock, bare = _child("stock", argv), _child("bare", argv)
    elapsed = time.perf_counter() - start
    previous = swap.load_baseline() or {"suites": {}}
    suites = {}
    for key in sorted(set(stock) | set(bare)):
        suite, name = key
        data = suites.setdefault(suite, {"tests": {}, "not_applicable": [],
                                         "identity": previous["suites"].get(suite, {}).get("identity", {})})
        if not (key in bare and bare[key]["builds"]):
            data["not_applicable"].append(name)
            continue
        entry = {"stock": stock[key]["outcome"] if key in stock else "missing", "bare": bare[key]["outcome"]}
        if key in stock and stock[key]["outcome"] != "passed":
            entry["reason"] = stock[key]["reason"]
        data["tests"][name] = entry
    # A partial run (pytest args selecting some tests) replaces only the suites it ran.
    seconds = round(elapsed, 1)
    if argv and previous.get("keras") == keras.__version__:
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
        tests = data["tests"].values()
        print(f"{suite}: Keras' own class passes {sum(t['stock'] == 'passed' for t in tests)} of {len(tests)}, "
              f"a bare subclass {sum(t['bare'] == 'passed' for t in tests)} "
              f"({len(data['not_applicable'])} tests of the file do not build it; "
              f"{len(data['identity'])} identity checks)")
    print(f"wrote {swap.BASELINE_PATH} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--variant"]:
        sys.exit(run_variant(args[1], args[2], args[3:]))
    sys.exit(main(args))
