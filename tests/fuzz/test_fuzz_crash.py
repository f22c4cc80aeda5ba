"""Crash detection: batches of edge cases run in a child python (with a timeout).

A case that kills the process (a signal: SIGSEGV, SIGABRT, ...) fails the test
naming the case; Python exceptions in the child are clean outcomes. The cases
are in _crash_child.py; the harness checks itself with a case that raises
SIGSEGV on purpose.
"""

import os
import signal
import subprocess
import sys

import pytest

from . import _crash_child
from ._tally import TALLY

TIMEOUT = 120
CASES = [name for name in _crash_child.CASES if not name.startswith("selftest")]


def run_batch(names, reference=False):
    """(returncode, {name: outcome}, the case running when the child died or None)."""
    env = dict(os.environ, TFMETAL_EXT_REFERENCE_OPS="1" if reference else "0")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(_crash_child.__file__), *names],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=repo,
    )
    outcomes, running = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            running = line.split(" ", 1)[1]
        elif line.startswith("DONE "):
            _, name, outcome = line.split(" ", 2)
            outcomes[name] = outcome
            running = None
    return proc.returncode, outcomes, running, proc.stderr


def _signal_name(rc):
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def test_harness_detects_a_crash():
    rc, outcomes, running, _ = run_batch(["softshrink_raw_empty", "selftest_sigsegv", "layer_norm_nan_rows"])
    assert rc == -signal.SIGSEGV and running == "selftest_sigsegv"
    assert "softshrink_raw_empty" in outcomes and "layer_norm_nan_rows" not in outcomes


@pytest.mark.parametrize("reference", [False, True], ids=["library", "reference"])
def test_no_case_crashes_the_process(reference):
    remaining, crashed = list(CASES), []
    while remaining:
        rc, outcomes, running, stderr = run_batch(remaining, reference)
        TALLY["tried"] += len(outcomes) + (1 if running else 0)
        TALLY["clean_errors"] += sum(o.startswith("error:") for o in outcomes.values())
        TALLY["ok"] += sum(o == "ok" for o in outcomes.values())
        if rc < 0 and running:
            TALLY["crashes"] += 1
            crashed.append(f"{running} ({_signal_name(rc)}): {stderr.strip().splitlines()[-3:] if stderr.strip() else ''}")
            remaining = remaining[remaining.index(running) + 1 :]  # go on with the rest of the batch
            continue
        assert rc == 0, f"child exited {rc} outside a case: {stderr[-2000:]}"
        break
    assert not crashed, f"cases that killed the process: {crashed}"
