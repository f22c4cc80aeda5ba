"""Predicted placement on Apple's tensorflow-metal, whose kernel table is generated from its wheel.

The issue's three models: a keras-hub Llama fine-tune, the keras.io text-classification transformer and a
ConvBNAct model. With the complete table no compute op is "unknown", and every op that would leave the GPU
names its op, dtype and layer. Expected ops come from REFERENCE.md section 10 (what the wheel registers),
not from running the prediction.
"""

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext import layers as L

APPLE = "tensorflow-metal"


def _predict(model, x, y, **kw):
    # These tests read the backend's own table: tfmetal_ext's gap kernels are left out (tests/test_gap_kernels.py).
    kw.setdefault("gap_kernels", False)
    return inspect.placement_report(model, x, targets=y, mode="train", predict_for=APPLE, **kw)


def _check_named(report):
    assert report.table_complete and not report.unknown, str(report)
    text = str(report)
    for e in report.missing:
        assert e.op and e.dtype and e.reason, e
        # A layer path, "optimizer <name>", "loss", or none: an op of Keras' own step outside every layer
        # (its counter, the metrics), which the report prints as "(step)".
        shown = e.layer or "(step)"
        assert any(e.op in line and shown in line for line in text.splitlines()), (e, text)


def _text_transformer():
    # keras.io "Text classification with Transformer", as written there (smaller sizes).
    class TransformerBlock(keras.layers.Layer):
        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
            super().__init__()
            self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)])
            self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = keras.layers.Dropout(rate)
            self.dropout2 = keras.layers.Dropout(rate)

        def call(self, inputs):
            attn = self.dropout1(self.att(inputs, inputs))
            out1 = self.layernorm1(inputs + attn)
            return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))

    class TokenAndPositionEmbedding(keras.layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
            self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

        def call(self, x):
            positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
            return self.token_emb(x) + self.pos_emb(positions)

    inputs = keras.layers.Input(shape=(12,))
    x = TokenAndPositionEmbedding(12, 50, 16)(inputs)
    x = TransformerBlock(16, 2, 16)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, np.ones((4, 12), "float32"), np.ones((4,), "int32")


def test_text_transformer_has_no_unknown_op_and_names_its_fallbacks():
    model, x, y = _text_transformer()
    report = _predict(model, x, y)
    _check_named(report)
    missing = {(e.op, e.layer) for e in report.missing}
    # REFERENCE.md 10: no Einsum (the attention's), no StatelessRandomGetKeyCounter (each Dropout's seed).
    assert ("Einsum", "transformer_block/multi_head_attention") in missing, str(report)
    key_counter = [e for e in report.missing if e.op == "StatelessRandomGetKeyCounter"]
    assert {e.layer.split("/")[-1].rsplit("_", 1)[0] for e in key_counter} == {"dropout"}, str(report)
    # ...while the LayerNormalization, Softmax and MatMul of the block have kernels there.
    assert not {"Softmax", "MatMul", "BatchMatMulV2", "Mean", "Rsqrt"} & {e.op for e in report.missing}


def test_convbnact_model_leaves_the_gpu_only_for_the_step_counter():
    inp = keras.Input((12, 12, 3))
    x = L.ConvBNAct(8, 3, activation="relu")(inp)
    x = L.ConvBNAct(8, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, L.FusedDense(4)(x))
    model.compile(tfmetal_ext.optimizers.FusedSGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = _predict(model, np.ones((2, 12, 12, 3), "float32"), np.ones((2,), "int32"))
    _check_named(report)
    # Conv2D, FusedBatchNormV3 (+ grad), Relu, BiasAdd, MatMul and the loss all have float32 kernels; only
    # the int64 iteration counter's AddV2 has none (the table registers AddV2 for float types only).
    assert [(e.op, e.dtype) for e in report.missing] == [("AddV2", "int64")], str(report)


def test_keras_hub_llama_has_no_unknown_op_and_names_its_fallbacks():
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install 'tfmetal-ext[hub]')")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16,
    )
    inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
    model = keras.Model(inputs, keras.layers.Dense(64)(backbone(inputs)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = {"token_ids": np.ones((2, 6), "int32"), "padding_mask": np.ones((2, 6), "int32")}
    report = _predict(model, x, np.ones((2, 6), "int32"))
    _check_named(report)
    rotary = {e.op for e in report.missing if e.layer and "rotary_embedding" in e.layer}
    # REFERENCE.md 10: no Pack or Unpack kernel (the rotary embedding's), nor Sin / Cos. Its Einsum (positions
    # x inverse frequencies) has no kernel either, but at this static length it is an op of constants that
    # grappler folds before the step runs, so it is not listed (test_predict_placement's folding tests).
    assert {"Pack", "Unpack"} <= rotary, str(report)
    assert "Einsum" not in rotary, str(report)
    # The causal mask's bool BroadcastTo (no kernel there either) is likewise constant at a static length.
    assert not any(e.op == "BroadcastTo" for e in report.missing), str(report)


def test_macos_12_loses_the_gated_random_kernels():
    model, x, y = _text_transformer()
    newer, older = _predict(model, x, y, macos="13.0"), _predict(model, x, y, macos=(12, 7))
    assert not [e for e in newer.missing if e.op == "StatelessRandomUniformV2"], str(newer)
    gated = [e for e in older.missing if e.op == "StatelessRandomUniformV2"]
    # REFERENCE.md 10: those kernels register only when MPSGraph has its GRU API (macOS 13 or later).
    assert gated and all("macOS 12.7" in e.reason and "macOS 13" in e.reason for e in gated), str(older)
    assert any("predicted for macOS 12.7 (as asked)" in n for n in older.notes), older.notes


@pytest.mark.parametrize("bad", ["twelve", "12.x", -3, (12, "a")])
def test_bad_macos(bad):
    with pytest.raises(ValueError, match="Received: macos="):
        inspect.placement_report(lambda t: t * 2.0, np.ones((2,), "float32"), predict_for=APPLE, macos=bad)


def test_macos_needs_a_prediction():
    with pytest.raises(ValueError, match="predict_for"):
        inspect.placement_report(lambda t: t * 2.0, np.ones((2,), "float32"), macos="13.0")
