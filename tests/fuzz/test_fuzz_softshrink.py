"""Hypothesis fuzzing of `tfmetal_ext.ops.softshrink` against a numpy reference.

Both the compiled library path and the pure-TF reference path run (the
``TFMETAL_EXT_REFERENCE_OPS`` switch, as in tests/ops). First piece of the
issue 15 fuzz suite; the subprocess crash harness and tallies are not built yet.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import softshrink


@pytest.fixture(params=["library", "reference"])
def impl(request, monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    return request.param


def _numpy_softshrink(x, lambd):
    return np.where(x > lambd, x - lambd, np.where(x < -lambd, x + lambd, 0.0)).astype(x.dtype)


_arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    elements=st.floats(-1e3, 1e3, width=32),
)


# The impl fixture only sets an env var that is the same for every example.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=_arrays, lambd=st.floats(0.0, 10.0, width=32))
def test_softshrink_matches_numpy(impl, x, lambd):
    got = softshrink(x, lambd=lambd).numpy()
    assert got.shape == x.shape
    np.testing.assert_allclose(got, _numpy_softshrink(x, np.float32(lambd)), rtol=1e-6, atol=1e-6)
