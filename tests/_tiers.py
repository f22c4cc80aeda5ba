"""The two test tiers, and the quick tier's time budget (a pytest plugin; tests/conftest.py registers it).

``make test`` runs the **quick** tier, ``make test-full`` the **full** tier
(``--tier full``). The full tier is every test and every parametrized case.
The quick tier leaves out, and the full tier runs:

- tests marked ``slow`` (whole-model runs, examples, subprocess clusters) or
  ``full`` (a test whose behaviour another quick test already proves),
  and the fuzz suite (``tests/fuzz``);
- the surplus combinations of a parametrized test. Of a test's cases it
  keeps a covering sample: every value of every parameter (each dtype, each
  activation, each bad argument, ``kernel`` and ``reference``) appears in at
  least one kept case, and only the cross product is trimmed. Greedy set
  cover in collection order, so the sample is the same on every machine.
  The parameters named in ``SAMPLE_AXES`` (dtype, mixed-precision policy,
  shape, activation, sizes) are samples of one behaviour: the quick tier
  needs one value of each of those, not every value, as the issue that set
  up the tiers asks (one representative dtype, shape and activation per
  behaviour). A test adds names with ``@pytest.mark.sample_axes("n", ...)``,
  or insists on every value of one with ``@pytest.mark.cover_axes("dtype")``
  (where the values are different code paths); one whose combinations are
  themselves the behaviour under test keeps them all with
  ``@pytest.mark.every_case``.

A case named on the command line (``path::test[id]``) always runs, and so
do the ``metal`` tests (what a Mac checks with ``pytest -m metal``; they skip
elsewhere).

The budget. In the quick tier each file's time (setup + call + teardown of
its tests, summed over the workers) is recorded. When the whole quick tier
ran, the run fails if the total exceeds ``QUICK_BUDGET_SECONDS``, and any
quick test fails the run when it alone takes more than
``QUICK_TEST_CAP_SECONDS``; both are seconds on the reference machine (the
2-core AVX2 CI box), scaled by a calibration canary (a small Keras model
trained for a few steps) timed at the start and the end of the run against its
time there (``CALIBRATION_REFERENCE_SECONDS``), so a faster
machine gets a tighter budget and a slower one a looser one. The per-file
times are written to ``.pytest_cache/tfmetal_ext/quick_tier_times.json``.
``TFMETAL_EXT_NO_BUDGET=1`` turns the check off (profilers, debuggers).
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

TIER_ENV = "TFMETAL_EXT_TEST_TIER"
TIERS = ("quick", "full")

# Seconds of test time (summed over the xdist workers: 2 on the reference box)
# that the quick tier may take on the reference machine. There, `make test`'s
# wall time was 0.5 x test-seconds + 23 s (worker start-up, collection, the
# scheduler's tail: 892 test-seconds in 469 s), so 1040 test-seconds is about
# 9 minutes: 10 minutes with the +-10% this box's noise shows.
QUICK_BUDGET_SECONDS = 1040.0
# One quick test may take at most this long on the reference machine: a
# slower one belongs in the full tier (mark it `full` or `slow`).
QUICK_TEST_CAP_SECONDS = 30.0
# The calibration canary's time on the reference machine (the 2-core AVX2 box, TF's own kernels, as
# its `make test` runs), carried over from another box through the tests themselves: the quick tier
# at 72714d1 took 434 s of pytest on the AVX2 box (fresh clone, README's figure of 2026-12-05) and
# 398 s on a 2-core Intel Xeon (Ice Lake, AVX-512; TF_ENABLE_ONEDNN_OPTS=0, fresh venv, idle,
# 2026-12-07), where `calibration_seconds()` read 0.172-0.183 s (median 0.176) over eight runs:
# 0.176 x 434 / 398 = 0.192. One run on each box, so trust it to about 10%.
CALIBRATION_REFERENCE_SECONDS = 0.192
# Between these the scale is taken as measured; outside, clamped (a canary
# timed under a burst of load must not waive the budget).
SCALE_LIMITS = (0.5, 2.0)


# Parameter names whose values sample one behaviour (see the module docstring).
SAMPLE_AXES = frozenset({
    "dtype", "dtypes", "policy", "activation", "act",
    "shape", "shapes", "input_shape", "in_shape", "out_shape", "output_shape", "gamma_shape",
    "n", "size", "sizes", "seed", "seeds", "channels", "threads", "tg", "q_len", "kv_len", "n_weights",
})


def _canary(x, y) -> float:
    """Seconds for one unit of the work the quick tier is made of.

    A small Keras model (dense, layer norm) is built, compiled and trained for
    two steps, so its train step is traced, rewritten by grappler and run as
    small kernels, and its predict step too; then a little NumPy: what most
    quick tests do, in about the same proportions (tracing dominates both).
    """
    import keras

    keras.backend.clear_session(free_memory=False)  # Keras' names and state as a test finds them (no gc pass)
    start = time.perf_counter()
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    out = np.asarray(model.predict_on_batch(x))
    for _ in range(40):
        out = np.tanh(out * 0.5 + 0.1)
    seconds = time.perf_counter() - start
    keras.backend.clear_session(free_memory=False)  # nor does the first test after it find the canary's
    return seconds


def calibration_seconds(repeats: int = 5) -> float:
    """The median over `repeats` of the canary (`_canary`): a Keras train step traced and run, in this process.

    Why a Keras canary and not a pure Python/NumPy loop, which this was until
    2026-12-07: the loop did not track the tests from one CPU to another. On an
    Intel Xeon (Ice Lake) box it read 0.20-0.28 s, 1.45-2x the AVX2 reference
    box's 0.138, while the same commit's quick tier ran 8% faster there than on
    the reference box (398 against 434 s of pytest); on an AMD EPYC (Zen 5) box
    it read 0.088-0.12 s (0.65x) while the tests there ran no faster than on the
    Xeon, so `make test` failed its budget there with every test passing. Its
    matrix product also ran at the mercy of OpenBLAS' threads. The canary is the
    tests' own kind of work, so its ratio between two machines is close to the
    tests' ratio; `CALIBRATION_REFERENCE_SECONDS` says how its reference was
    carried over to the reference box.
    """
    import statistics

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.integers(0, 4, 16)
    _canary(x, y)  # the first run pays for one-time imports and Keras' first trace
    return statistics.median(_canary(x, y) for _ in range(repeats))


def add_options(parser):
    """The ``--tier`` option (called from tests/conftest.py's pytest_addoption)."""
    group = parser.getgroup("tfmetal_ext")
    group.addoption(
        "--tier", choices=TIERS, default=None,
        help=f"quick (make test; the default, or ${TIER_ENV}) or full (make test-full): see tests/_tiers.py",
    )


def tier(config) -> str:
    value = config.getoption("--tier") or os.environ.get(TIER_ENV, "quick")
    if value not in TIERS:
        raise pytest.UsageError(f"{TIER_ENV} must be one of {TIERS}. Received: {TIER_ENV}={value!r}")
    return value


def pytest_configure(config):
    config.addinivalue_line("markers", "full: runs in the full tier only (make test-full); see tests/_tiers.py")
    config.addinivalue_line("markers", "every_case: the quick tier keeps every parametrized case of this test")
    config.addinivalue_line(
        "markers", "sample_axes(*names): the quick tier needs one value of these parameters, not each"
    )
    config.addinivalue_line("markers", "cover_axes(*names): the quick tier runs every value of these parameters")


def _group_key(item):
    return (item.nodeid.split("::")[0], getattr(item.cls, "__name__", None), getattr(item, "originalname", item.name))


def _value_key(value):
    # Equal hashable values are one value; others are one value per object (a
    # parametrize list's values are shared by every case built from them).
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value).__name__, value)


def _axes(item):
    """{parameter name: a key of its value} of a parametrized item, else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return {name: _value_key(value) for name, value in callspec.params.items()}


def covering_sample(items) -> set:
    """ids of the items of one test function that cover every (parameter, value) pair.

    Greedy set cover: repeatedly the case that covers the most pairs not yet
    covered (the first such in collection order). Axes named in the
    function's ``sample_axes`` mark need only one value.
    """
    if len(items) <= 1:
        return {id(i) for i in items}
    sampled = set(SAMPLE_AXES)
    marker = items[0].get_closest_marker("sample_axes")
    sampled |= set(marker.args) if marker else set()
    marker = items[0].get_closest_marker("cover_axes")
    sampled -= set(marker.args) if marker else set()
    cases = []
    for item in items:
        axes = _axes(item) or {}
        pairs = {(name, value) for name, value in axes.items() if name not in sampled}
        pairs |= {(name, "any") for name in axes if name in sampled}
        cases.append((item, pairs))
    needed = set().union(*(p for _, p in cases))
    kept = set()
    while needed:
        best, best_gain = None, 0
        for item, pairs in cases:
            gain = len(pairs & needed)
            if gain > best_gain:
                best, best_gain = (item, pairs), gain
        item, pairs = best
        kept.add(id(item))
        needed -= pairs
    return kept


def _named_on_command_line(config):
    return {a.replace(os.sep, "/") for a in config.args if "::" in a}


def quick_selection(config, items):
    """(kept, left_out) for the quick tier, in collection order."""
    named = _named_on_command_line(config)
    groups = collections.defaultdict(list)
    for item in items:
        groups[_group_key(item)].append(item)
    sampled = {}
    for members in groups.values():
        if members[0].get_closest_marker("every_case") is not None or _axes(members[0]) is None:
            sampled.update((id(m), True) for m in members)
            continue
        kept = covering_sample(members)
        sampled.update((id(m), id(m) in kept) for m in members)
    kept, left = [], []
    for item in items:
        path = item.nodeid.split("::")[0]
        full_only = (
            item.get_closest_marker("slow") is not None
            or item.get_closest_marker("full") is not None
            or path.startswith("tests/fuzz/")
            or not sampled[id(item)]
        )
        if item.get_closest_marker("metal") is not None:
            full_only = False
        if full_only and not any(item.nodeid == n or item.nodeid.endswith("/" + n) for n in named):
            left.append(item)
        else:
            kept.append(item)
    return kept, left


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if tier(config) == "full":
        return
    kept, left = quick_selection(config, items)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


# ----------------------------------------------------------------------------
# The budget.


def whole_run(config) -> bool:
    """True when this run is the whole quick tier (only such a run is held to the total).

    Decided from the command line, not from collection: under pytest-xdist the controlling
    process, which holds the budget, collects nothing.
    """
    root = Path(str(config.rootpath))
    args = [Path(a.split("::")[0]) for a in config.args]
    whole = all((a if a.is_absolute() else Path(str(config.invocation_params.dir)) / a).resolve() in (root, root / "tests")
                for a in args)
    return whole and not config.getoption("keyword") and not config.getoption("markexpr") \
        and not config.getoption("lf", False) and not config.getoption("deselect", None)


class Budget:
    """Collects test times in the controlling process (xdist or not)."""

    def __init__(self, config):
        self.config = config
        self.per_file = collections.Counter()
        self.per_test = collections.Counter()
        self.calibration = None
        self._recalibrated = False
        self.complete = False

    def scale(self) -> float:
        low, high = SCALE_LIMITS
        return min(high, max(low, self.calibration / CALIBRATION_REFERENCE_SECONDS))

    @pytest.hookimpl
    def pytest_sessionstart(self, session):
        self.calibration = calibration_seconds()
        self.complete = whole_run(self.config)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.per_file[path] += report.duration
        self.per_test[report.nodeid] += report.duration

    def problems(self):
        scale = self.scale()
        found = []
        over = [(t, n) for n, t in self.per_test.items() if t > QUICK_TEST_CAP_SECONDS * scale]
        for t, n in sorted(over, reverse=True):
            found.append(
                f"{n} took {t:.1f} s, over the quick tier's cap of {QUICK_TEST_CAP_SECONDS * scale:.1f} s "
                f"({QUICK_TEST_CAP_SECONDS:.0f} s on the reference box x {scale:.2f}): make it faster, or mark it "
                "`full` (with what still proves its behaviour in the quick tier) or `slow`"
            )
        total = sum(self.per_file.values())
        if self.complete and total > QUICK_BUDGET_SECONDS * scale:
            found.append(
                f"the quick tier took {total:.0f} test-seconds, over its budget of {QUICK_BUDGET_SECONDS * scale:.0f} "
                f"({QUICK_BUDGET_SECONDS:.0f} on the reference box x {scale:.2f}); the slowest files are listed above"
            )
        return found

    def write_times(self):
        cache = Path(str(self.config.rootpath)) / ".pytest_cache" / "tfmetal_ext"
        try:
            cache.mkdir(parents=True, exist_ok=True)
            data = {
                "calibration_seconds": round(self.calibration, 4),
                "scale": round(self.scale(), 3),
                "complete": self.complete,
                "total_seconds": round(sum(self.per_file.values()), 1),
                "files": {k: round(v, 2) for k, v in self.per_file.most_common()},
            }
            (cache / "quick_tier_times.json").write_text(json.dumps(data, indent=1))
        except OSError:
            pass

    def recalibrate(self):
        # Timed again once the workers are done: load that came during the run and stayed (another
        # job on the machine) slows the tests and this canary alike. The slower of the two counts.
        # Once, before the verdict (pytest_sessionfinish), so the verdict and the report below
        # use the same scale.
        if not self._recalibrated:
            self.calibration = max(self.calibration, calibration_seconds())
            self._recalibrated = True

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        self.recalibrate()
        total = sum(self.per_file.values())
        tr = terminalreporter
        tr.section("quick tier time budget")
        tr.write_line(
            f"calibration canary {self.calibration:.3f} s (reference {CALIBRATION_REFERENCE_SECONDS:.3f} s): "
            f"scale {self.scale():.2f}; tests took {total:.0f} test-seconds "
            f"(budget {QUICK_BUDGET_SECONDS * self.scale():.0f}{'' if self.complete else ', checked on a whole run'})"
        )
        for path, seconds in self.per_file.most_common(10):
            tr.write_line(f"  {seconds:7.1f} s  {path}")
        self.write_times()
        for line in self.problems():
            tr.write_line("BUDGET: " + line, red=True, bold=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        # Runs before the terminal summary (the terminal reporter writes it after every
        # sessionfinish implementation): the recalibration must come first, or the verdict would
        # use the start-of-run scale while the summary prints the final one.
        self.recalibrate()
        if self.problems() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def register(config):
    """Registers the budget in the controlling process of a quick-tier run."""
    if tier(config) != "quick" or os.environ.get("TFMETAL_EXT_NO_BUDGET") == "1":
        return
    if hasattr(config, "workerinput"):  # an xdist worker: the controller holds the budget
        return
    config.pluginmanager.register(Budget(config), "tfmetal_ext_budget")
