"""Fixtures shared by the op tests."""

import pytest

from tfmetal_ext import ops


@pytest.fixture(params=["kernel", "reference"])
def impl(request, monkeypatch):
    """Runs a test with the compiled kernel and with the pure-TF reference."""
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    if request.param == "kernel":
        assert ops.status().loaded, ops.status()
    return request.param
