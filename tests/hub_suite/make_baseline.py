"""Regenerates `baseline.json`: what keras-hub's own classes pass, and what ours pass.

    TFMETAL_EXT_KERAS_HUB_SRC=<keras-hub checkout or git dir> python -m tests.hub_suite.make_baseline [pytest args...]

Runs `test_hub_suite.py` twice, each in a process of its own and ungated (no
baseline marks): with keras-hub's own classes (``stock``: what ours must
match) and with ours swapped in (``ours``). Per test file it records:

- ``tests``: each test with ``stock`` and ``ours`` (``passed`` / ``failed``
  / ``skipped``), the one-line ``reason`` where stock does not pass, the
  ``ours_reason`` where ours does not, and ``builds``: our subclasses the
  test built (empty: the test does not exercise the integration, e.g.
  BERT's, whose layers the integration does not replace);
- ``explained``: tests ours fails where stock passes, each with the reason
  (written by hand and kept from the previous file; a test checks each
  names a test stock passes).

The versions it ran with are recorded; conftest.py warns when keras-hub's
differs from the installed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from tests.keras_suite.make_baseline import _one_line  # the same reporting as Keras' suites

UNGATED_ENV = "TFMETAL_EXT_HUB_SUITE_UNGATED"


class _Recorder:
    def __init__(self):
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        from tests.hub_suite import swap

        key = swap.test_key(report.nodeid)
        built = dict(report.user_properties).get("hub_suite_built")
        if built is not None:
            self.outcomes.setdefault(key, ["passed", "", []])[2] = built
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcomes.get(key)
            if previous is not None and previous[0] != "passed":
                return  # keep the first failure (a teardown error after a failed call)
            reason = _one_line(report) if report.outcome != "passed" else ""
            self.outcomes[key] = [report.outcome, reason, previous[2] if previous else []]


def run_variant(variant, out_path, argv):
    """In this process: the suite with `variant`'s classes, ungated; outcomes to JSON."""
    os.environ["TFMETAL_EXT_HUB_SUITE_VARIANT"] = variant
    os.environ[UNGATED_ENV] = "1"
    import pytest

    from tests.hub_suite import swap

    recorder = _Recorder()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--tier", "full",
                        str(swap.BASELINE_PATH.with_name("test_hub_suite.py")), *argv], plugins=[recorder])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return int(code)
    rows = [{"file": f, "name": n, "outcome": o, "reason": r, "builds": b}
            for (f, n), (o, r, b) in sorted(recorder.outcomes.items())]
    with open(out_path, "w") as f:
        json.dump(rows, f)
    return 0


def _child(variant, argv):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{variant}.json")
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "tests.hub_suite.make_baseline", "--variant", variant, out,
                                *argv])
        if code != 0 or not os.path.exists(out):
            raise SystemExit(f"make_baseline: the {variant} run exited with {code}; baseline.json not written")
        with open(out) as f:
            return {(r["file"], r["name"]): r for r in json.load(f)}, round(time.perf_counter() - start, 1)


def main(argv=()):
    import keras
    import keras_hub
    import tensorflow as tf

    from tests.hub_suite import swap

    src = swap.source()  # fails here, with the reason, when the tree is not available
    (stock, stock_s), (ours, ours_s) = _child("stock", argv), _child("ours", argv)
    previous = swap.load_baseline() or {"files": {}}
    files = {}
    for key in sorted(set(stock) | set(ours)):
        file, name = key
        old = previous["files"].get(file, {})
        data = files.setdefault(file, {"tests": {}, "explained": old.get("explained", {})})
        entry = {"stock": stock[key]["outcome"] if key in stock else "missing",
                 "ours": ours[key]["outcome"] if key in ours else "missing",
                 "builds": ours[key]["builds"] if key in ours else []}
        if key in stock and stock[key]["outcome"] != "passed":
            entry["reason"] = stock[key]["reason"]
        if key in ours and ours[key]["outcome"] != "passed" and ours[key]["reason"] != entry.get("reason"):
            entry["ours_reason"] = ours[key]["reason"]
        data["tests"][name] = entry
    if argv and previous.get("keras_hub") == keras_hub.__version__:
        files = {**previous["files"], **files}  # a partial run replaces only the files it ran
    baseline = {
        "keras_hub": keras_hub.__version__,
        "keras_hub_tree": src.version(),
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "generated_by": "TFMETAL_EXT_KERAS_HUB_SRC=... python -m tests.hub_suite.make_baseline",
        "seconds": {"stock": stock_s, "ours": ours_s},
        "files": files,
    }
    swap.BASELINE_PATH.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    for file, data in files.items():
        tests = data["tests"].values()
        count = {v: {o: sum(t[v] == o for t in tests) for o in ("passed", "failed", "skipped")}
                 for v in ("stock", "ours")}
        print(f"{file}: {len(tests)} tests; stock {count['stock']}; ours {count['ours']}; "
              f"{sum(bool(t['builds']) for t in tests)} build our subclasses; {len(data['explained'])} explained")
    print(f"wrote {swap.BASELINE_PATH} (stock {stock_s:.0f} s, ours {ours_s:.0f} s)")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--variant"]:
        sys.exit(run_variant(args[1], args[2], args[3:]))
    sys.exit(main(args))
