"""The Einsum gap kernel's equation allowlist (`gap_kernels.EINSUM_EQUATIONS`) and what reads it.

The list is generated (scripts/gen_einsum_equations.py traces the train steps of Keras' and keras-hub's
attention and projection layers); the full tier recomputes it. The planner's acceptance of every entry
is checked beside the kernel (tests/ops/test_gap_einsum_metal_emu.py); here: the prediction counts an
Einsum as on the GPU exactly when its equation is listed, and says why when it is not; the doctor's
self-test case uses a listed equation (an unlisted one would run on the CPU on both sides).
"""

import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect
from tfmetal_ext.backends import gap_kernels, registry

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_einsum_equations", ROOT / "scripts" / "gen_einsum_equations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_allowlist_is_what_the_layers_emit():
    pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install 'tfmetal-ext[hub]')")
    gen = _generator()
    text, block, rejected = gen.generate()
    assert text == gen.MODULE.read_text(), \
        "EINSUM_EQUATIONS is out of date: python scripts/gen_einsum_equations.py --write"
    # What is left out is left out for the planner's reason (EinsumDense's documented ellipsis form).
    assert rejected and all("ellipsis" in why for why, _ in rejected.values())


def test_the_generator_keeps_only_what_the_planner_accepts():
    gen = _generator()
    reason = {"ab,bc->ac": None, "...a,ab->...b": "an ellipsis", "abc,cde->abde": None}.get
    accepted, rejected = gen.allowlist({"one": {"ab,bc->ac", "...a,ab->...b"}, "two": {"abc,cde->abde",
                                                                                      "...a,ab->...b"}}, reason)
    assert accepted == ("ab,bc->ac", "abc,cde->abde")
    assert rejected == {"...a,ab->...b": ("an ellipsis", ["one", "two"])}
    block = gen.render(accepted)
    assert block.startswith(gen.BEGIN) and block.rstrip().endswith(gen.END) and '    "abc,cde->abde",' in block


def test_the_einsum_row():
    kernel = gap_kernels.GAP_KERNELS["Einsum"]
    assert kernel.family == "gap_einsum" and kernel.dtypes == gap_kernels.FLOATS
    assert kernel.string_attrs["equation"] is gap_kernels.EINSUM_EQUATIONS
    # Both Metal backends lack Einsum: every float dtype is planned on both.
    for key in ("metal", "metal_plugin"):
        assert gap_kernels.registered(gap_kernels.plan(key, enabled=True))["Einsum"] == gap_kernels.FLOATS


@pytest.mark.parametrize("key", ["metal", "metal_plugin"])
def test_covers_only_listed_equations(key):
    table = registry.table(key)
    listed = gap_kernels.EINSUM_EQUATIONS[0]
    assert gap_kernels.covers(table, "Einsum", {"T": "float16"}, strings={"equation": listed})
    assert not gap_kernels.covers(table, "Einsum", {"T": "float16"}, strings={"equation": "ab,cb->ac"})
    assert not gap_kernels.covers(table, "Einsum", {"T": "float16"})  # the equation unknown: not counted
    assert not gap_kernels.covers(table, "Einsum", {"T": "float64"}, strings={"equation": listed})
    refusal = gap_kernels.GAP_KERNELS["Einsum"].refusal({"equation": "ab,cb->ac"})
    assert f"takes only its {len(gap_kernels.EINSUM_EQUATIONS)} listed equations" in refusal
    assert "'ab,cb->ac'" in refusal


def test_the_doctor_checks_a_listed_equation():
    from tfmetal_ext.doctor import checks

    for dtype in gap_kernels.FLOATS:
        _, kwargs = checks.REGISTRY["gap_kernels"].case()["Einsum"](dtype)
        assert kwargs["equation"] in gap_kernels.EINSUM_EQUATIONS


class _Transposed(keras.layers.Layer):
    """x @ w.T written as an einsum Keras does not emit (not in the allowlist)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(3, shape[-1]), name="w")

    def call(self, x):
        return tf.einsum("ab,cb->ac", x, self.w)


@pytest.mark.parametrize("predict_for", ["tensorflow-metal-plugin", "tensorflow-metal"])
def test_prediction_counts_listed_einsums_on_the_gpu_and_names_the_rest(predict_for):
    # Unknown sequence length: the projections stay Einsum (a known length turns them into MatMul).
    inp = keras.Input((None, 8))
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inp, _Transposed()(x))
    model.compile("sgd", "mse")
    x, y = np.ones((2, 5, 8), "float32"), np.ones((2, 3), "float32")
    ours = inspect.placement_report(model, x, targets=y, mode="train", predict_for=predict_for)
    alone = inspect.placement_report(model, x, targets=y, mode="train", predict_for=predict_for, gap_kernels=False)
    assert any(e.op == "Einsum" for e in alone.missing) and any(e.op == "Einsum" for e in ours.gap_kernels)
    left = [e for e in ours.missing if e.op == "Einsum"]
    assert left and all("takes only its" in e.reason and "'ab,cb->ac'" in e.reason for e in left), str(ours)
    assert all(e.layer and "transposed" in e.layer for e in left), str(ours)
    assert sum(e.count for e in ours.gap_kernels if e.op == "Einsum") >= 6  # 4 projections, their gradients
