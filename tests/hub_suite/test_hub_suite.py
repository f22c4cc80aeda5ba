"""keras-hub's own test files with our fusion-first subclasses built in place of keras-hub's (see `swap`).

Each keras-hub `TestCase` class appears here as ``<file>__<Class>``, e.g.
``llama_causal_lm_test__LlamaCausalLMTest::test_generate``. Which of them
run, and which are gated to keras-hub's own classes, is decided in
`conftest.py` from `baseline.json`.
"""

import pytest

pytest.importorskip("keras_hub", reason="keras-hub is not installed (extra [hub])")

from tests.hub_suite import swap  # noqa: E402

try:
    _SOURCE = swap.source()
except swap.SourceUnavailable as e:
    pytest.skip(f"keras-hub's test files are not available: {e}", allow_module_level=True)

for _file in swap.TEST_FILES:
    _module = swap.load(_SOURCE, _file)
    if _module is None:
        continue
    for _name, _cls in swap.test_classes(_module).items():
        globals()[f"{swap.file_key(_file)}__{_name}"] = _cls

del _file, _module, _name, _cls
