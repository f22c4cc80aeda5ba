"""Non-finite float arguments, and ones float32 rounds to 0 or inf, raise ValueError up front."""

import re

import pytest

from tfmetal_ext import layers, ops
from tfmetal_ext.optimizers import FusedAdam, FusedAdamW

_NAN, _INF = float("nan"), float("inf")

_CASES = [
    ("epsilon", lambda v: FusedAdam(epsilon=v)),
    ("epsilon", lambda v: FusedAdamW(epsilon=v)),
    ("weight_decay", lambda v: FusedAdamW(weight_decay=v)),
    ("epsilon", lambda v: layers.FusedBatchNorm(epsilon=v)),
    ("epsilon", lambda v: layers.FusedLayerNorm(epsilon=v)),
    ("lambd", lambda v: ops.softshrink([1.0, -2.0], lambd=v)),
    ("lambd", lambda v: layers.Softshrink(lambd=v)),
]


@pytest.mark.parametrize("value", [_NAN, _INF], ids=["nan", "inf"])
@pytest.mark.parametrize("name, make", _CASES)
def test_non_finite_rejected(name, make, value):
    with pytest.raises(ValueError, match=rf"Received: {name}={re.escape(repr(value))}"):
        make(value)


@pytest.mark.parametrize("value", [1e-50, 1e39])
@pytest.mark.parametrize("name, make", _CASES)
def test_float32_rounding_rejected(name, make, value):
    # Independent fact: float32's largest finite value is about 3.4e38, its
    # smallest positive (subnormal) value about 1.4e-45.
    assert (value > 3.41e38) or (value < 1.4e-45 / 2)
    with pytest.raises(ValueError, match=rf"float32.*Received: {name}={re.escape(repr(value))}"):
        make(value)


@pytest.mark.parametrize("name, make", _CASES)
def test_representable_values_accepted(name, make):
    make(1e-30)  # tiny but a normal float32: no error
