import gc
import importlib.util
import os
import pathlib
import time
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

from tfmetal_ext import devices  # noqa: E402


def _load_tiers():
    # By path: the tests directory need not be importable as a package.
    spec = importlib.util.spec_from_file_location("tfmetal_ext_test_tiers", pathlib.Path(__file__).with_name("_tiers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tiers = _load_tiers()


def pytest_addoption(parser):
    _tiers.add_options(parser)


def pytest_configure(config):
    # The tiers (quick: make test; full: make test-full) and the quick tier's time budget.
    config.pluginmanager.register(_tiers, "tfmetal_ext_tiers")
    _tiers.register(config)


_PREBUILD = {}


def pytest_sessionstart(session):
    # The op library is built (or found in the cache) once, before any test: on a fresh machine the
    # build (about 40 s on the 2-core box) would otherwise land on whichever test first uses an op, and
    # on the quick tier's per-test cap. In the controlling process only: the workers start after it and
    # find it built. A build failure is left to the tests (tfmetal_ext.ops.status() reports it there).
    if hasattr(session.config, "workerinput") or os.environ.get("TFMETAL_EXT_REFERENCE_OPS") == "1":
        return
    from tfmetal_ext.ops import _loader

    if _loader.find_compiler() is None:
        return
    start = time.perf_counter()
    try:
        _loader.build()
        _PREBUILD["seconds"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - reported by the tests that load the library
        _PREBUILD["error"] = f"{type(e).__name__}: {e}"


def pytest_terminal_summary(terminalreporter):
    if "seconds" in _PREBUILD:
        terminalreporter.write_line(f"op library built or found before the tests: {_PREBUILD['seconds']:.1f} s")
    elif "error" in _PREBUILD:
        terminalreporter.write_line(f"op library build before the tests failed: {_PREBUILD['error']}")


def pytest_collection_modifyitems(config, items):
    # `metal` tests need the real device: run them on a Mac with `pytest -m metal`.
    if devices.backend() == "metal":
        return
    skip = pytest.mark.skip(reason="needs a Metal GPU (tensorflow-metal on Apple silicon); run `pytest -m metal` on a Mac")
    for item in items:
        if item.get_closest_marker("metal") is not None:
            item.add_marker(skip)


# Every test starts from its own fixed seed (Python, NumPy, TensorFlow and Keras' unseeded
# initializers), so a failure reproduces run to run and CI cannot flake on an unlucky draw.
# Set TFMETAL_EXT_TEST_SEED to another integer to draw a different, equally reproducible set.
TEST_SEED = int(os.environ.get("TFMETAL_EXT_TEST_SEED", "0"))


def pytest_report_header(config):
    return f"tfmetal_ext test seed: TFMETAL_EXT_TEST_SEED={TEST_SEED} (each test: crc32(test id) + seed)"


@pytest.fixture(autouse=True)
def _seeded(request):
    if request.node.get_closest_marker("no_keras") is None:
        keras.utils.set_random_seed((zlib.crc32(request.node.nodeid.encode()) + TEST_SEED) % 2**31)
    yield


@pytest.fixture(autouse=True)
def _restore_global_policy(request):
    """Every test starts and ends with the float32 policy (not `no_keras` tests)."""
    if request.node.get_closest_marker("no_keras") is not None:
        yield
        return
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


_BF16_SKIP = ("oneDNN fuses bfloat16 only on CPUs with AVX512F or AVX_NE_CONVERT (TF's "
              "IsBF16SupportedByOneDNNOnThisCPU), this one has neither; tests/inspect/test_catalog.py checks the "
              "reason the report gives here")


@pytest.fixture
def onednn(request):
    """Skips oneDNN-only fusion checks where oneDNN is off (TF_ENABLE_ONEDNN_OPTS=0, macOS), and their
    bfloat16 cases (a ``mixed_bfloat16`` / ``bfloat16`` parameter) where oneDNN has no bfloat16 here."""
    caps = devices.capabilities()
    if not caps.onednn:
        pytest.skip("this fusion needs oneDNN (x86-64 Linux wheels, TF_ENABLE_ONEDNN_OPTS unset)")
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    if not caps.onednn_bf16 and any(isinstance(v, str) and v in ("mixed_bfloat16", "bfloat16") for v in params):
        pytest.skip(_BF16_SKIP)
    return True


@pytest.fixture
def onednn_bf16(onednn):
    """Skips a bfloat16 fusion check where oneDNN does not fuse bfloat16 (no AVX512F / AVX_NE_CONVERT)."""
    if not devices.capabilities().onednn_bf16:
        pytest.skip(_BF16_SKIP)
    return True


@pytest.fixture(autouse=True)
def _fresh_keras_session(request):
    """Keras' global state reset after each test, and the garbage collected.

    What survives the collection is frozen (`gc.freeze`): the next
    collection then scans only what later tests create. Without it each
    collection walks every object TensorFlow, Keras and earlier tests keep
    alive, and late in a worker's run that took over a second per test, more
    than half of the suite's time (measured: 3675 of 6639 test-seconds).
    Frozen objects are still freed when their last reference goes; only a
    cycle among them is never collected, which a test process can afford.
    """
    yield
    if request.node.get_closest_marker("no_keras") is None:
        keras.backend.clear_session(free_memory=False)
        gc.collect()
        gc.freeze()


@pytest.fixture
def table_row(monkeypatch):
    """``table_row(pattern, row)``: every backend table gets `row` for `pattern` for the test.

    For the layers whose form a table row chooses (``custom_batch_norm_act``, ``custom_dropout``):
    a CPU row is one machine's measurement, so the tests install the row they test rather than
    take this machine's.
    """

    import dataclasses
    import types

    from tfmetal_ext.backends import registry

    def install(pattern, row):
        tables = {key: dataclasses.replace(t, fusions=types.MappingProxyType({**t.fusions, pattern: row}))
                  for key, t in registry.TABLES.items()}
        monkeypatch.setattr(registry, "TABLES", types.MappingProxyType(tables))

    return install
