"""keras-hub's marks, the swap around each test, and the gates, from `baseline.json`.

(regenerate it with ``TFMETAL_EXT_KERAS_HUB_SRC=... python -m tests.hub_suite.make_baseline``):

- keras-hub's own marks: ``large`` tests run (as with keras-hub's
  ``--run_large``; here they are model saving round trips);
  ``extra_large`` ones (presets) skip, and ``kaggle_key_required`` ones
  without a key, as keras-hub's conftest.py skips them;
- a test keras-hub's own classes do not pass here: skipped or xfail (not
  strict), with keras-hub's own reason;
- a test listed under the file's ``explained`` (ours fails where stock
  passes, for the reason given): xfail, not strict;
- every other test, including tests the baseline has not seen (a newer
  keras-hub tree), must pass with our subclasses.

Tier: the files take minutes; all run in the full tier (make test-full)
except `QUICK_FILES`.
"""

import os
import warnings

import keras
import pytest

from tests.hub_suite import swap

# The one cheap file the quick tier runs (the rotary embedding's tests: our rope op in every test).
QUICK_FILES = ("rotary_embedding_test",)

_MINE = "hub_suite/test_hub_suite.py::"


def pytest_configure(config):
    for mark, meaning in swap.KERAS_HUB_MARKS.items():
        config.addinivalue_line("markers", f"{mark}: {meaning}")


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if _MINE in i.nodeid]
    if not mine:
        return
    # `large` tests run (keras-hub's --run_large: in these files, .keras save/load round trips, seconds in
    # all); `extra_large` ones (presets from the network) only with TFMETAL_EXT_KERAS_HUB_RUN=extra_large,
    # by hand: the baseline is made without them.
    run_marked = {"large", *filter(None, os.environ.get("TFMETAL_EXT_KERAS_HUB_RUN", "").split(","))}
    kaggle = all(os.environ.get(k) for k in ("KAGGLE_USERNAME", "KAGGLE_KEY"))
    # The gates apply to our classes; make_baseline runs both variants ungated.
    gated = swap.variant() == "ours" and os.environ.get("TFMETAL_EXT_HUB_SUITE_UNGATED") != "1"
    baseline = swap.load_baseline() if gated else None
    if baseline is not None:
        import keras_hub

        if baseline.get("keras_hub") != keras_hub.__version__:
            warnings.warn(f"tests/hub_suite/baseline.json was made with keras-hub {baseline.get('keras_hub')}, this "
                          f"is {keras_hub.__version__}: regenerate it (python -m tests.hub_suite.make_baseline)",
                          stacklevel=1)
    for item in mine:
        key, name = swap.test_key(item.nodeid)
        if key not in QUICK_FILES:
            item.add_marker(pytest.mark.full)
        for mark in ("large", "extra_large"):
            if item.get_closest_marker(mark) is not None and mark not in run_marked:
                item.add_marker(pytest.mark.skip(reason=swap.KERAS_HUB_MARKS[mark]))
        if item.get_closest_marker("kaggle_key_required") is not None and not kaggle:
            item.add_marker(pytest.mark.skip(reason=swap.KERAS_HUB_MARKS["kaggle_key_required"]))
        if baseline is None:
            continue
        data = baseline["files"].get(key, {})
        explained = data.get("explained", {}).get(name)
        if explained is not None:
            item.add_marker(pytest.mark.xfail(reason=f"ours differs, explained: {explained}", strict=False))
            continue
        stock = data.get("tests", {}).get(name)
        if stock is not None and stock["stock"] == "skipped":
            item.add_marker(pytest.mark.skip(reason=f"keras-hub's own classes skip it here: {stock.get('reason', '')}"))
        elif stock is not None and stock["stock"] != "passed":
            item.add_marker(pytest.mark.xfail(
                reason=f"keras-hub's own classes fail it here: {stock.get('reason', '')}", strict=False))


@pytest.fixture(scope="session")
def _hub_test_data():
    """keras-hub's test data directory (vocabularies), from the same tree as the test files."""
    import shutil

    src = swap.source()
    tmp = swap.temp_dir()
    try:
        yield str(src.export_test_data(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _hub_suite_swap(request, monkeypatch):
    """Our subclasses in place of keras-hub's during each test of the suite (variant ``ours``)."""
    if _MINE not in request.node.nodeid:
        yield
        return
    from keras_hub.src.tests.test_case import TestCase

    data_dir = request.getfixturevalue("_hub_test_data")
    monkeypatch.setattr(TestCase, "get_test_data_dir", lambda self: data_dir)
    if swap.variant() == "stock":
        yield
        return
    from tfmetal_ext.integrations import keras_hub as kh

    with swap.swapped(kh.FUSED) as built:
        yield
        request.node.user_properties.append(("hub_suite_built", sorted(c.__name__ for c in built)))


@pytest.fixture(autouse=True)
def _fresh_keras_session(request):
    """Overrides tests/conftest.py's: its garbage collection costs about a second per test late in a run."""
    yield
    keras.backend.clear_session(free_memory=False)
