"""The swap machinery itself: what the Keras test files see, and a baseline that is current."""

import keras
import pytest

from tfmetal_ext.backends import fusion
from tests.keras_suite import swap


def test_every_replaced_class_has_its_keras_suite():
    # Each stock class the fusion table replaces (layers, optimizers and losses) is
    # checked against Keras' own tests for it.
    replaced = set(fusion.STOCK_TO_FUSED) | set(fusion.OPTIMIZER_TO_FUSED) | set(fusion.LOSS_TO_FUSED)
    assert set(swap.SUITES) == replaced, (
        "a fusion-table row without its Keras suite (or a suite without a row): add a `Suite` to "
        "tests/keras_suite/swap.py and run `python -m tests.keras_suite.make_baseline -k '<Stock>__'`. "
        f"Rows without a suite: {sorted(replaced - set(swap.SUITES))}; "
        f"suites without a row: {sorted(set(swap.SUITES) - replaced)}"
    )


def test_the_view_swaps_only_inside_the_loaded_file():
    dense = swap.SUITES["Dense"]
    module = swap.load(dense, dense.ours, "keras_suite_check.Dense")
    assert module.layers.Dense is dense.ours
    # Other names are Keras' own, and Keras itself is untouched.
    assert module.layers.Conv2D is keras.src.layers.Conv2D
    assert keras.src.layers.Dense is dense.stock_class is keras.layers.Dense
    adam = swap.SUITES["Adam"]
    module = swap.load(adam, adam.ours, "keras_suite_check.Adam")
    assert module.Adam is adam.ours
    assert keras.optimizers.Adam is adam.stock_class


def test_the_bare_subclass_is_only_a_subclass():
    suite = swap.SUITES["Conv2D"]
    bare = swap.bare_class(suite)
    assert bare.__bases__ == (suite.stock_class,)
    assert set(vars(bare)) <= {"__new__", "__module__", "__qualname__", "__doc__"}
    layer = bare(4, 3, padding="same", name="c")
    assert layer.get_config() == keras.layers.Conv2D(4, 3, padding="same", name="c").get_config()


def test_baseline_is_current():
    # baseline.json lists exactly the tests of the installed Keras' files;
    # after a Keras upgrade: `python -m tests.keras_suite.make_baseline`.
    baseline = swap.load_baseline()
    assert baseline is not None
    assert baseline["keras"] == keras.__version__, "regenerate: python -m tests.keras_suite.make_baseline"
    assert set(baseline["suites"]) == set(swap.SUITES)
    for stock, suite in swap.SUITES.items():
        module = swap.load(suite, suite.stock_class, f"keras_suite_check.names.{stock}")
        names = {
            f"{cls_name}::{attr}"
            for cls_name, cls in swap.test_classes(module).items()
            for attr in dir(cls)
            if attr.startswith("test")
        }
        data = baseline["suites"][stock]
        recorded = set(data["tests"]) | set(data["not_applicable"])
        assert names == recorded, f"{stock}: regenerate: python -m tests.keras_suite.make_baseline"
        assert data["tests"], f"{stock}: no Keras test builds the class"


def test_identity_entries_are_reasoned_tests_keras_own_class_passes():
    # An identity exception must name a test of the file that builds the class and that Keras' own
    # class passes (else it is gated already), with the reason it checks identity.
    for stock, data in swap.load_baseline()["suites"].items():
        for name, reason in data.get("identity", {}).items():
            assert data["tests"].get(name, {}).get("stock") == "passed", (stock, name)
            assert isinstance(reason, str) and len(reason) > 20, (stock, name, reason)


def test_what_keras_own_class_passes_is_the_bar():
    # Every test that builds the class: Keras' own class's outcome is recorded, and the bar is not
    # lowered to what a bare subclass passes (Keras' own quantize refuses subclasses, ours does not).
    for stock, data in swap.load_baseline()["suites"].items():
        for name, entry in data["tests"].items():
            assert entry["stock"] in ("passed", "failed", "skipped"), (stock, name, entry)
    dense = swap.load_baseline()["suites"]["Dense"]["tests"]
    assert dense["DenseTest::test_quantize_int_int4"] == {"stock": "passed", "bare": "failed"}
