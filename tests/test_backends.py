"""The backend tables are consistent: every name they hold resolves to something real."""

import dataclasses

import keras
import pytest

from tfmetal_ext import backends, devices, layers, optimizers
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog

pytestmark = pytest.mark.no_keras


def test_every_table_has_a_row_for_every_pattern_that_fuses_somewhere():
    for name, pattern in backends.PATTERNS.items():
        for key, table in backends.TABLES.items():
            if pattern.nowhere:
                assert name not in table.fusions, (key, name)
            else:
                assert name in table.fusions, f"{key} has no row for {name}"
    for table in backends.TABLES.values():
        assert set(table.fusions) <= set(backends.PATTERNS), table.key


def test_rows_name_known_activations_and_dtypes():
    known_acts = set(fusion.ACTIVATION_OPS.values())
    for table in backends.TABLES.values():
        for name, row in table.fusions.items():
            assert set(row.acts) <= known_acts, (table.key, name)
            assert set(row.acts_in("train")) <= set(row.acts), (table.key, name)
            assert set(row.requires_act) <= set(row.acts) or not row.fuses, (table.key, name)
            assert set(row.dtypes) <= {"float16", "bfloat16", "float32", "float64"}, (table.key, name)
            assert set(row.dtypes_in("train")) <= set(row.dtypes), (table.key, name)


def test_stock_to_fused_names_real_classes():
    for stock, row in fusion.STOCK_TO_FUSED.items():
        assert issubclass(getattr(keras.layers, stock), keras.layers.Layer), stock
        assert issubclass(getattr(layers, row.fused), keras.layers.Layer), row.fused
        assert row.suggestion.startswith("tfmetal_ext.layers." + row.fused)
    for stock, row in fusion.OPTIMIZER_TO_FUSED.items():
        assert issubclass(getattr(keras.optimizers, stock), keras.optimizers.Optimizer), stock
        assert issubclass(getattr(optimizers, row.fused), keras.optimizers.Optimizer), row.fused
        assert row.suggestion.startswith(row.qualified + " takes the same arguments and "), row.suggestion


def test_optimizer_advice_names_what_each_runs():
    rows = fusion.OPTIMIZER_TO_FUSED
    # The multi-tensor ones name their op (from CUSTOM_OPS) and what runs where it cannot.
    assert fusion.CUSTOM_OPS["multi_tensor_adam"].name in rows["Adam"].suggestion
    assert fusion.CUSTOM_OPS["multi_tensor_adam"].name in rows["AdamW"].suggestion
    assert fusion.CUSTOM_OPS["multi_tensor_lion"].name in rows["Lion"].suggestion
    assert "one fused op per variable" not in rows["Lion"].suggestion
    assert "nesterov" in rows["SGD"].suggestion


def test_safe_forms_and_custom_ops_point_at_each_other():
    for name, op in fusion.CUSTOM_OPS.items():
        assert op.name.startswith(fusion.CUSTOM_OP_PREFIX)
        assert fusion.SAFE_FORMS[op.safe_form].custom_op == name
        for op_name in op.op_names:
            assert fusion.safe_form_for_op(op_name).name == op.safe_form
            assert op_name in fusion.FUSED_LAYER_OPS
    for form in fusion.SAFE_FORMS.values():
        assert form.implies, form.name
        assert fusion.safe_form_fix(form.name).startswith(f"tfmetal_ext.configure(avoid_fusions=[{form.name!r}])")


def test_contraction_activations_fuse_on_every_backend_that_fuses_convs():
    # ConvBNAct and ResidualBlock accept exactly these: each must be absorbed wherever conv + bias fuses.
    for table in backends.TABLES.values():
        row = table.fusion("conv2d_bias_act")
        if row.fuses and not row.requires_act:
            assert set(fusion.CONTRACTION_ACTIVATION_OPS) <= set(row.acts), table.key


@pytest.mark.parametrize("onednn", [True, False])
def test_support_key_selects_the_cpu_table_by_onednn(onednn):
    caps = dataclasses.replace(devices.capabilities(), backend="cpu", onednn=onednn)
    table = backends.current(caps)
    assert table.key == ("cpu_onednn" if onednn else "cpu")
    assert catalog.FusionContext(backend="cpu", onednn=onednn).support_key == table.key
    # bfloat16 contractions fuse only with oneDNN (TF's own CPU kernels: float32/float64).
    assert ("bfloat16" in table.fusion("conv2d_bias_act").dtypes) is onednn


def test_tables_are_the_five_backends():
    assert set(backends.TABLES) == {"cpu_onednn", "cpu", "cuda", "metal", "metal_plugin"}
    assert backends.TABLES["metal"].device == backends.TABLES["metal_plugin"].device == "metal"


@pytest.mark.parametrize(
    "plugin, key", [(None, "metal"), ("tensorflow-metal", "metal"), ("tensorflow-metal-plugin", "metal_plugin")]
)
def test_support_key_selects_the_metal_table_by_plugin(plugin, key):
    caps = dataclasses.replace(devices.capabilities(), backend="metal", onednn=False, metal_plugin=plugin)
    assert backends.current(caps).key == key
    assert catalog.FusionContext(backend="metal", metal_plugin=plugin).support_key == key


def test_kernel_records_are_consistent():
    for table in backends.TABLES.values():
        if table.kernels_complete:
            assert table.kernels is not None, table.key
        assert not set(table.host_ops) & set(table.kernels or {}), table.key
        assert not set(table.missing_kernels) & set(table.kernels or {}), table.key
        for name in table.unsupported_layers:
            assert issubclass(getattr(keras.layers, name), keras.layers.Layer), (table.key, name)
        for dtypes in (table.kernels or {}).values():
            assert isinstance(dtypes, tuple), table.key


def test_unknown_table_key_is_a_clear_error():
    with pytest.raises(ValueError, match="Received: key='tpu'"):
        backends.table("tpu")


def test_callback_replacement_views_keep_their_published_values():
    # The names and values MetalCallback's module has exported since it was written.
    from tfmetal_ext.callbacks import metal

    assert dict(metal.LAYER_REPLACEMENTS) == {
        "Conv2D": "tfmetal_ext.layers.FusedConv2D",
        "DepthwiseConv2D": "tfmetal_ext.layers.FusedDepthwiseConv2D",
        "Conv1D": "tfmetal_ext.layers.FusedConv1D (or ConvBNAct1D before a batch norm)",
        "SeparableConv2D": "tfmetal_ext.layers.FusedSeparableConv2D",
        "Dense": "tfmetal_ext.layers.FusedDense",
        "EinsumDense": "tfmetal_ext.layers.FusedEinsumDense",
        "BatchNormalization": "tfmetal_ext.layers.FusedBatchNorm (or ConvBNAct after a conv)",
        "LayerNormalization": "tfmetal_ext.layers.FusedLayerNorm",
        "LSTM": "tfmetal_ext.layers.FusedLSTM",
        "GRU": "tfmetal_ext.layers.FusedGRU",
        "MultiHeadAttention": "tfmetal_ext.layers.FusedMultiHeadAttention",
        "RMSNormalization": "tfmetal_ext.layers.FusedRMSNorm",
        "Dropout": "tfmetal_ext.layers.FusedDropout",
        "Embedding": "tfmetal_ext.layers.FusedEmbedding (its index arithmetic in int64, which stays in GPU memory)",
    }
    assert dict(metal.OPTIMIZER_REPLACEMENTS) == {
        "Adam": "tfmetal_ext.optimizers.FusedAdam",
        "AdamW": "tfmetal_ext.optimizers.FusedAdamW",
        "SGD": "tfmetal_ext.optimizers.FusedSGD",
        "RMSprop": "tfmetal_ext.optimizers.FusedRMSprop",
        "Adagrad": "tfmetal_ext.optimizers.FusedAdagrad",
        "Lion": "tfmetal_ext.optimizers.FusedLion",
    }


def test_rnn_stock_regions_hold_by_their_bounds():
    region = backends.RnnStock("r", min_batch=256, min_steps=50, max_units=32, dtypes=("float32",))
    assert region.holds(256, 50, 32, "float32") and region.holds(1024, 200, 8, "float32")
    # each bound can fail alone
    assert not region.holds(255, 50, 32, "float32")
    assert not region.holds(256, 49, 32, "float32")
    assert not region.holds(256, 50, 33, "float32")
    assert not region.holds(256, 50, 32, "bfloat16")
    # an unknown batch or length meets no batch or length bound; an unbounded one holds for it
    assert not region.holds(None, 50, 32) and not region.holds(256, None, 32)
    assert backends.RnnStock("any batch", min_steps=200).holds(None, 200, 512, "bfloat16")


@pytest.mark.parametrize("key", ["cpu_onednn", "cpu"])
def test_rnn_cpu_form_reads_the_regions_of_its_own_table(key):
    table = backends.table(key)
    assert table.rnn_stock, "each CPU table carries its own measured rule"
    for cell, regions in table.rnn_stock.items():
        assert cell in ("lstm", "gru") and regions
        for region in regions:
            assert "oneDNN" in region.reason  # says which configuration it was measured on
            batch, steps = region.min_batch or 4, region.min_steps or 3
            units = region.max_units or region.min_units or 8
            assert table.rnn_cpu_form(cell, batch, steps, units, "float32") == "stock"
            assert table.rnn_stock_region(cell, batch, steps, units, "float32") is region
            if region.min_batch:  # one below the bound, or unknown: not this region
                for below in (region.min_batch - 1, None):
                    assert table.rnn_stock_region(cell, below, steps, units, "float32") is not region
        # a small shape runs the fused form everywhere
        assert table.rnn_cpu_form(cell, 4, 3, 8, "float32") == "fused"
    # a table without a rule: the fused form; a rule for one table only: read from that table
    bare = dataclasses.replace(table, rnn_stock=None)
    assert bare.rnn_cpu_form("lstm", 4096, 1000, 8) == "fused"
    other = backends.table("cpu" if key == "cpu_onednn" else "cpu_onednn")
    assert table.rnn_stock is not other.rnn_stock
