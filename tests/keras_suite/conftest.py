"""Marks for the Keras suite: which Keras tests apply to a class, and which are gated.

From `baseline.json` (regenerate with ``python -m tests.keras_suite.make_baseline``):

- a test that never builds the class (the file's Conv1D cases, say) does not
  test it: deselected;
- a test listed under the suite's ``identity`` (it checks the class's
  identity, which a drop-in cannot have): xfail (not strict), with the
  listed reason;
- a test Keras' own class does not pass here: skipped or xfail (not
  strict), with Keras' own reason;
- every other test, including tests the baseline has not seen (a newer
  Keras), must pass; tests of the quantization modes our classes hand to
  the stock layer's own code (`STOCK_CALL_MODES`) run in the full tier only,
  and so do all but the first case of each of Keras' parameterized test
  methods (`_sample_parameterized_cases`).
"""

import warnings

import keras
import pytest

from tests.keras_suite import swap


# Quantization modes in which our layers call the stock layer's own quantized code (only int8 and
# LoRA take our fused path): Keras' tests of them run in the full tier only (make test-full, CI).
STOCK_CALL_MODES = ("int4", "float8", "gptq", "awq")
# Classes whose every quantized mode (int8 too) is the stock layer's own code, with nothing of ours in it:
# Keras' quantization tests of them run in the full tier only.
STOCK_QUANTIZATION = ("Embedding",)


def pytest_configure(config):
    # Keras' own conftest skips these on its numpy backend; TensorFlow trains.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras' mark (a backend that can train)")


def _key(item):
    return swap.test_key(item.nodeid)


@pytest.fixture(autouse=True)
def _keras_suite_current_test(request):
    suite, name = _key(request.node)
    swap.set_current_test((suite, name))
    yield
    swap.set_current_test(None)


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if "keras_suite/test_keras_suite.py::" in i.nodeid]
    if not mine or swap.variant() != "ours":
        return
    baseline = swap.load_baseline()
    if baseline is None:
        raise pytest.UsageError(
            f"{swap.BASELINE_PATH} is missing; run `python -m tests.keras_suite.make_baseline`"
        )
    if baseline.get("keras") != keras.__version__:
        warnings.warn(
            f"tests/keras_suite/baseline.json was made with Keras {baseline.get('keras')}, this is "
            f"Keras {keras.__version__}: regenerate it with `python -m tests.keras_suite.make_baseline`",
            stacklevel=1,
        )
    deselected = []
    for item in mine:
        suite, name = _key(item)
        if any(mode in name for mode in STOCK_CALL_MODES) or (
                suite in STOCK_QUANTIZATION and ("int8" in name or "quantiz" in name)):
            # Our classes run stock's own quantized call in these modes: the full tier checks them.
            item.add_marker(pytest.mark.full)
        data = baseline["suites"].get(suite, {})
        if name in data.get("not_applicable", ()):
            deselected.append(item)
            continue
        identity = data.get("identity", {}).get(name)
        if identity is not None:
            item.add_marker(pytest.mark.xfail(reason=f"checks the class's identity: {identity}", strict=False))
            continue
        stock = data.get("tests", {}).get(name)
        if stock is not None and stock["stock"] == "skipped":
            item.add_marker(pytest.mark.skip(reason=f"Keras' own class skips it here: {stock.get('reason', '')}"))
        elif stock is not None and stock["stock"] != "passed":
            item.add_marker(
                pytest.mark.xfail(reason=f"Keras' own class fails it here: {stock.get('reason', '')}", strict=False)
            )
    if deselected:
        chosen = set(map(id, deselected))
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if id(i) not in chosen]
    _sample_parameterized_cases(items)


def _sample_parameterized_cases(items):
    """The quick tier runs one case of each of Keras' parameterized test methods; the full tier, all.

    Keras parameterizes its tests with absl (``test_quantize_int`` becomes
    ``test_quantize_int_int8``, ...): each case is a test method of its own,
    which the tier plugin's covering sample (pytest parameters) cannot see.
    Here a case is recognised by the method absl wrapped (``__wrapped__``);
    the first case of each method, in collection order, stays in the quick
    tier, and the others (other equations, shapes, modes of the same Keras
    test) run in the full tier (``make test-full``, CI). A method that is not
    parameterized always stays.
    """
    seen = set()
    for item in items:
        if "keras_suite/test_keras_suite.py::" not in item.nodeid or item.get_closest_marker("full"):
            continue
        original = getattr(getattr(getattr(item, "obj", None), "__wrapped__", None), "__name__", None)
        if original is None or original == item.name:
            continue
        key = (_key(item)[0], original)
        if key in seen:
            item.add_marker(pytest.mark.full)
        seen.add(key)


@pytest.fixture(autouse=True)
def _fresh_keras_session(request):
    """Overrides tests/conftest.py's: Keras' TestCase.setUp clears the session
    itself, and the garbage collection of ``clear_session()`` costs about a
    second per test here (minutes over the suite)."""
    yield
    keras.backend.clear_session(free_memory=False)
