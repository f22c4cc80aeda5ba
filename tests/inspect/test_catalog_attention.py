"""The catalog's rules for attention and RMS norm: stock MultiHeadAttention / RMSNormalization and their drop-ins.

Expected values are written out from what each layer emits (Keras' MultiHeadAttention: Einsum ->
softmax -> Einsum, nothing for any remapper; FusedMultiHeadAttention: the attention op with MatMul +
BiasAdd projections) and from the backend tables' facts, not from running the rules; the graph tests
compare the rows with a real executed train step.
"""

import importlib

import keras
import numpy as np
import pytest
from keras import layers as L

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext import layers as fl
from tfmetal_ext.backends import _table, fusion
from tfmetal_ext.callbacks import _capture
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import FusionContext

attention_ops = importlib.import_module("tfmetal_ext.ops.attention")  # the module (the package exports the function)
_HAS_RMS = hasattr(fl, "FusedRMSNorm")
needs_rms = pytest.mark.skipif(not (_HAS_RMS and "RMSNormalization" in fusion.STOCK_TO_FUSED),
                               reason="FusedRMSNorm is not exported by tfmetal_ext.layers in this tree")


def ctx(backend="cpu", **kw):
    kw.setdefault("onednn", backend == "cpu")
    kw.setdefault("cublaslt", False)
    if backend == "metal_plugin":
        backend, kw["metal_plugin"] = "metal", "tensorflow-metal-plugin"
    return FusionContext(backend=backend, **kw)


def _mha(cls=L.MultiHeadAttention, shape=(6, 8), **kw):
    layer = cls(2, 4, **kw)
    layer.build((2,) + shape, (2,) + shape)  # built, not called (the tests switch the kernel on and off)
    return layer


@pytest.fixture
def attention_runs(monkeypatch):
    """The attention op runs and is reported as fused here (kernel loaded, table row, registered op)."""
    real = catalog.fusion_for

    def fusion_for(c, pattern):
        if pattern == "custom_attention":
            return _table.Fusion("custom op", dtypes=("float32", "float16", "bfloat16"))
        return real(c, pattern)

    monkeypatch.setattr(catalog, "fusion_for", fusion_for)
    monkeypatch.setattr(attention_ops, "uses_kernel", lambda: True)
    monkeypatch.setattr(catalog, "FUSED_LAYER_OPS", catalog.FUSED_LAYER_OPS | {fusion.ATTENTION_OP})


# ----------------------------------------------------------------------------
# Stock layers: unfused, pointing at the drop-in.


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal", "metal_plugin"])
@pytest.mark.parametrize("mode", ["train", "predict"])
def test_stock_attention_is_unfused_attention_everywhere(backend, mode):
    exp = catalog.expectation(_mha(), ctx(backend, mode=mode))
    assert exp.op is None and exp.pattern == "attention"
    assert exp.reason.startswith("unfused attention -> FusedMultiHeadAttention")
    assert "Einsum" in exp.reason and "Softmax" in exp.reason
    assert exp.ideal_op == fusion.ATTENTION_OP
    # Both Metal kernel lists are complete (the open plugin's from its sdist, Apple's from its wheel) and
    # neither registers Einsum (REFERENCE.md 7 and 10).
    falls_back = "no Einsum kernel" in exp.reason
    assert falls_back == (backend in ("metal", "metal_plugin"))


def test_a_user_subclass_of_attention_reads_as_stock():
    class MyAttention(L.MultiHeadAttention):
        pass

    exp = catalog.expectation(_mha(MyAttention), ctx())
    assert exp.op is None and exp.reason.startswith("unfused attention")


def test_stock_rms_norm_is_unfused_everywhere():
    layer = L.RMSNormalization()
    layer.build((None, 8))
    for backend in ("cpu", "cuda", "metal"):
        exp = catalog.expectation(layer, ctx(backend))
        assert exp.op is None and exp.pattern == "rms_norm"
        assert exp.reason.startswith("unfused RMS norm -> FusedRMSNorm")


# ----------------------------------------------------------------------------
# FusedMultiHeadAttention.


@pytest.mark.parametrize("mode", ["train", "predict"])
def test_fused_attention_expects_the_op_where_it_runs(attention_runs, mode):
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention), ctx(mode=mode))
    assert (exp.op, exp.fused_ops, exp.ideal_fused_ops) == (fusion.ATTENTION_OP, (), ())
    assert exp.reason is None and "projections: MatMul + BiasAdd" in exp.note


def test_fused_attention_on_the_reference_path_is_partial(monkeypatch):
    """No kernel here: the reference runs; the projections' MatMul + BiasAdd still fuse (float32, CPU)."""
    monkeypatch.setattr(attention_ops, "uses_kernel", lambda: False)
    real = catalog.fusion_for
    monkeypatch.setattr(catalog, "fusion_for", lambda c, p: _table.Fusion("custom op", dtypes=("float32",))
                        if p == "custom_attention" else real(c, p))
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention), ctx(mode="train"))
    assert (exp.op, exp.fused_ops) == (fusion.FUSED_MATMUL, ("BiasAdd",))
    assert exp.ideal_op == fusion.ATTENTION_OP and exp.ideal_fused_ops == ()
    assert "pure-TF reference runs" in exp.reason and "only the q/k/v/output projections fuse" in exp.reason


def test_fused_attention_where_the_table_has_no_kernel(monkeypatch):
    """A backend whose table says the op does not run (CUDA: no kernel) gives the table's reason."""
    monkeypatch.setattr(attention_ops, "uses_kernel", lambda: True)
    real = catalog.fusion_for
    monkeypatch.setattr(catalog, "fusion_for", lambda c, p: _table.never("reference", "no CUDA kernel: the reference runs")
                        if p == "custom_attention" else real(c, p))
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention), ctx("cuda"))
    # CUDA fuses MatMul + BiasAdd only with cuBLASLt: nothing fuses.
    assert exp.op is None and "no CUDA kernel" in exp.reason and "TF_USE_CUBLASLT" in exp.reason


def test_fused_attention_without_bias_has_no_projection_fusion(monkeypatch):
    monkeypatch.setattr(attention_ops, "uses_kernel", lambda: False)
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention, use_bias=False), ctx(mode="train"))
    assert exp.op is None and "use_bias=False" in exp.reason


def test_fused_attention_dropout_fuses_in_training_too(attention_runs):
    # Attention dropout runs inside the op: training and inference expect it.
    layer = _mha(fl.FusedMultiHeadAttention, dropout=0.2)
    assert catalog.expectation(layer, ctx(mode="train")).op == fusion.ATTENTION_OP
    assert catalog.expectation(layer, ctx(mode="predict")).op == fusion.ATTENTION_OP


def test_fused_attention_dropout_one_fuses_inference_only(attention_runs):
    layer = _mha(fl.FusedMultiHeadAttention, dropout=1.0)
    train = catalog.expectation(layer, ctx(mode="train"))
    assert train.op is None and "dropout=1.0" in train.reason
    assert train.reason.startswith("the stock MultiHeadAttention computation runs")
    assert catalog.expectation(layer, ctx(mode="predict")).op == fusion.ATTENTION_OP


def test_fused_attention_over_other_axes_runs_stock(attention_runs):
    layer = _mha(fl.FusedMultiHeadAttention, shape=(3, 4, 8), attention_axes=(1, 2))
    exp = catalog.expectation(layer, ctx(mode="predict"))
    assert exp.op is None and exp.reason.startswith("the stock MultiHeadAttention computation runs")
    assert exp.reason.endswith(layer.unfused_reason)


def test_fused_attention_under_xla(attention_runs):
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention), ctx(xla=True))
    assert exp.op is None and exp.reason.startswith(catalog.REASON_XLA)


def test_fused_attention_avoided(attention_runs, monkeypatch):
    if "attention" not in fusion.SAFE_FORMS:
        pytest.skip("no 'attention' safe form in this tree (the op has not joined CUSTOM_OPS)")
    import dataclasses

    from tfmetal_ext import _env

    env = dataclasses.replace(_env.current(), avoided=frozenset({"attention"}))  # the context carries it
    exp = catalog.expectation(_mha(fl.FusedMultiHeadAttention), ctx(env=env))
    assert exp.op == fusion.FUSED_MATMUL and exp.reason.startswith("avoided by configure(avoid_fusions=['attention'])")


# ----------------------------------------------------------------------------
# Rows of real executed train steps, and the callback's advice.


def _encoder(attention_cls, t=8, d=16, **kwargs):
    keras.utils.set_random_seed(0)
    inp = L.Input((t, d))
    a = attention_cls(2, d // 2, **kwargs)(inp, inp)
    x = L.LayerNormalization()(L.Add()([inp, a]))
    model = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling1D()(x)))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _row(report, layer_class):
    (row,) = [r for r in report.layers if r.layer_class == layer_class]
    return row


def test_stock_attention_row_in_a_train_step_and_the_callback_advice():
    model = _encoder(L.MultiHeadAttention)
    fr = inspect.fusion_report(model, mode="train", batch_size=2)
    row = _row(fr, "MultiHeadAttention")
    assert row.status == "not fused" and row.pattern == "attention" and row.actual_op is None
    assert row.reason.startswith("unfused attention -> FusedMultiHeadAttention")
    assert fr.ops_by_type.get("Einsum", 0) >= 2
    assert _capture.replacement_advice(model.layers[1]) == "tfmetal_ext.layers.FusedMultiHeadAttention"
    lines, problems = _capture.summarize(model, [], fr, None)
    (line,) = [s for s in lines if "MultiHeadAttention, attention" in s]
    assert line.strip().startswith("not fused:") and "unfused attention" in line
    assert line.endswith("-> use tfmetal_ext.layers.FusedMultiHeadAttention")
    assert any("FusedMultiHeadAttention" in p for p in problems)


def test_attention_the_converter_keeps_gets_no_advice():
    inp = L.Input((3, 4, 8))
    layer = L.MultiHeadAttention(2, 4, attention_axes=(1, 2))
    keras.Model(inp, layer(inp, inp))
    assert _capture.replacement_advice(layer) is None


def test_converted_attention_row_in_a_train_step():
    stock = _encoder(L.MultiHeadAttention)
    new = tfmetal_ext.convert(stock, count_ops=False)
    fr = inspect.fusion_report(new, mode="train", batch_size=2)
    row = _row(fr, "FusedMultiHeadAttention")
    assert row.path == stock.layers[1].name and row.pattern == "attention"
    assert "Einsum" not in fr.ops_by_type
    c = inspect.catalog.FusionContext(backend="cpu", onednn=fr.onednn, mode="train")
    runs = attention_ops.uses_kernel() and catalog.fusion_for(c, "custom_attention").fuses \
        and fusion.ATTENTION_OP in catalog.FUSED_LAYER_OPS
    if runs:
        assert (row.status, row.actual_op) == ("fused", fusion.ATTENTION_OP), row
        assert fr.ops_by_type.get(fusion.ATTENTION_OP) == 1 and fr.ops_by_type.get(fusion.ATTENTION_GRAD_OP) == 1
    else:  # the reference runs: only the projections fuse
        assert (row.status, row.actual_op) == ("partial", fusion.FUSED_MATMUL), row
    lines, _ = _capture.summarize(new, [], fr, None)
    assert not any("-> use tfmetal_ext.layers.FusedMultiHeadAttention" in s for s in lines)


def test_attention_dropout_row_in_a_train_step_is_the_op():
    """Attention dropout in a real train step: the row expects the op and the graph that ran has it
    (one forward, one gradient), with no Softmax and no Einsum."""
    new = tfmetal_ext.convert(_encoder(L.MultiHeadAttention, dropout=0.2), count_ops=False)
    fr = inspect.fusion_report(new, mode="train", batch_size=2)
    row = _row(fr, "FusedMultiHeadAttention")
    assert "Einsum" not in fr.ops_by_type and "Softmax" not in fr.ops_by_type
    c = inspect.catalog.FusionContext(backend="cpu", onednn=fr.onednn, mode="train")
    if attention_ops.uses_kernel() and catalog.fusion_for(c, "custom_attention").fuses:
        assert (row.status, row.actual_op) == ("fused", fusion.ATTENTION_OP), row
        assert fr.ops_by_type.get(fusion.ATTENTION_OP) == 1 and fr.ops_by_type.get(fusion.ATTENTION_GRAD_OP) == 1
    else:
        assert (row.status, row.actual_op) == ("partial", fusion.FUSED_MATMUL), row


class Block(L.Layer):
    def __init__(self, d):
        super().__init__()
        self.att = L.MultiHeadAttention(2, d // 2)
        self.norm = L.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.att(x, x))


def test_attention_inside_a_subclassed_block_is_credited_to_it():
    keras.utils.set_random_seed(1)
    inp = L.Input((8, 16))
    block = Block(16)
    stock = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling1D()(block(inp))))
    stock.compile(optimizer="sgd", loss="mse")
    path = f"{block.name}/{block.att.name}"
    row = _row(inspect.fusion_report(stock, mode="train", batch_size=2), "MultiHeadAttention")
    assert row.path == path and row.status == "not fused"
    new = tfmetal_ext.convert(stock, count_ops=False)
    fr = inspect.fusion_report(new, mode="train", batch_size=2)
    row = _row(fr, "FusedMultiHeadAttention")
    assert row.path == path and row.status in ("fused", "partial") and row.actual_op is not None
    assert "Einsum" not in fr.ops_by_type


@needs_rms
def test_rms_norm_rows_in_a_train_step():
    keras.utils.set_random_seed(2)
    inp = L.Input((8, 16))
    stock = keras.Model(inp, L.Dense(2)(L.RMSNormalization()(inp)))
    stock.compile(optimizer="sgd", loss="mse")
    row = _row(inspect.fusion_report(stock, mode="train", batch_size=2), "RMSNormalization")
    assert row.status == "not fused" and row.reason.startswith("unfused RMS norm -> FusedRMSNorm")
    assert _capture.replacement_advice(stock.layers[1]) == "tfmetal_ext.layers.FusedRMSNorm"
    new = tfmetal_ext.convert(stock, count_ops=False)
    fr = inspect.fusion_report(new, mode="train", batch_size=2)
    row = _row(fr, "FusedRMSNorm")
    rms_norm_ops = importlib.import_module("tfmetal_ext.ops.rms_norm")
    op = fusion.CUSTOM_OPS["rms_norm"].name
    if rms_norm_ops.uses_kernel() and catalog.fusion_for(FusionContext(onednn=fr.onednn), "custom_rms_norm").fuses:
        assert (row.status, row.actual_op) == ("fused", op)
        # The norm forward, and once more in the backward pass for the Dense's kernel gradient, which
        # no longer keeps the norm's output (`_replay.norm_plan`).
        assert fr.ops_by_type.get(op) == 2
    else:
        assert row.status == "not fused" and row.actual_op is None
