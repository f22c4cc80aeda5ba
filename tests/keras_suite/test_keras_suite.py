"""Keras' own tests for each replaced class, with our class swapped in (see `swap`).

Each Keras `TestCase` class appears here as ``<Stock>__<KerasClass>``, e.g.
``Dense__DenseTest::test_dense_basics``. Which of them run, and which are
gated to Keras' own class, is decided in `conftest.py` from `baseline.json`.
"""

from tests.keras_suite import swap

_VARIANT = swap.variant()

for _suite in swap.SUITES.values():
    _module = swap.load(
        _suite, swap.swapped_class(_suite, _VARIANT), f"keras_suite_{_VARIANT}.{_suite.stock}"
    )
    for _name, _cls in swap.test_classes(_module).items():
        globals()[f"{_suite.stock}__{_name}"] = _cls

del _suite, _module, _name, _cls
