import pytest

from tfmetal_ext import _env


@pytest.fixture
def fused_batch_norm_v3_form():
    """ConvBNAct / ResidualBlock train with FusedBatchNormV3 (+ Add + act), not TfmetalExt>BatchNormAct.

    For the tests of that form's fusions: which form a backend trains with is its table's
    ``custom_batch_norm_act`` row (tests/layers/test_batch_norm_act_layers.py tests both).
    """
    with _env.scope(avoided=frozenset(_env.current().avoided) | {"batch_norm_act"}):
        yield

