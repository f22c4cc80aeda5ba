"""convert() on transformers: MultiHeadAttention -> FusedMultiHeadAttention, RMSNormalization -> FusedRMSNorm.

The models are the ones people train: the keras.io text classifier (a TransformerBlock subclass with
``self.att = MultiHeadAttention(...)`` and a Sequential feed-forward, a TokenAndPositionEmbedding
subclass), functional encoders with default layer names, Sequential models. Expected values come from
the stock model (its outputs and gradients on the same data) or from the stock layers' own
configuration; never from the converter's output.
"""

import importlib

import numpy as np
import pytest
import keras
import tensorflow as tf
from keras import layers as L

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext import layers as fl
from tfmetal_ext.backends import fusion

attention_ops = importlib.import_module("tfmetal_ext.ops.attention")  # the module (the package exports the function)
_HAS_RMS = hasattr(fl, "FusedRMSNorm") and "RMSNormalization" in fusion.STOCK_TO_FUSED
needs_rms = pytest.mark.skipif(not _HAS_RMS, reason="FusedRMSNorm is not exported by tfmetal_ext.layers in this tree")


def _np(t):
    return np.asarray(keras.ops.convert_to_numpy(t))


def _assert_close(stock, new, x, atol=1e-5, training=False):
    a = [_np(t) for t in keras.tree.flatten(stock(x, training=training))]
    b = [_np(t) for t in keras.tree.flatten(new(x, training=training))]
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_allclose(v, u, atol=atol * max(1.0, float(np.max(np.abs(u)))), rtol=0)


def _gradients(layer, x):
    """d(loss)/d(input) and d(loss)/d(each trainable weight) of `layer` at `x`, a fixed random projection loss."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=False)
        w = tf.constant(np.random.default_rng(1).standard_normal(tuple(y.shape)), y.dtype)
        loss = tf.reduce_sum(y * w)
    gx, gw = tape.gradient(loss, [x, layer.trainable_weights])
    return _np(gx), [_np(g) for g in gw]


def _kernels_run():
    """The attention, layer norm and RMS norm custom ops run here (else their pure-TF references)."""
    return all(importlib.import_module(f"tfmetal_ext.ops.{m}").uses_kernel()
               for m in ("attention", "layer_norm", "rms_norm"))


def _train_ops(model, x, y):
    return inspect.fusion_report(model, mode="train", inputs=x, targets=y).ops_by_type


# ----------------------------------------------------------------------------
# The keras.io text classifier ("Text classification with Transformer"), as written there.


class TransformerBlock(L.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = L.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([L.Dense(ff_dim, activation="relu"), L.Dense(embed_dim)])
        self.layernorm1 = L.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = L.LayerNormalization(epsilon=1e-6)
        self.dropout1 = L.Dropout(rate)
        self.dropout2 = L.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(L.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = L.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = L.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = keras.ops.shape(x)[-1]
        positions = self.pos_emb(keras.ops.arange(start=0, stop=maxlen, step=1))
        return self.token_emb(x) + positions


def text_classifier(maxlen=200, vocab_size=20000, embed_dim=32, num_heads=2, ff_dim=32):
    inputs = L.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = L.GlobalAveragePooling1D()(x)
    x = L.Dropout(0.1)(x)
    x = L.Dense(20, activation="relu")(x)
    x = L.Dropout(0.1)(x)
    outputs = L.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _check_text_classifier(stock, new, x):
    block = stock.layers[2]
    b = new.layers[2]
    assert type(b) is TransformerBlock and b is not block
    assert type(b.att) is fl.FusedMultiHeadAttention and type(block.att) is L.MultiHeadAttention
    assert b.att.name == block.att.name and b.att.unfused_reason is None
    assert [w.path for w in b.att.weights] != [] and len(b.att.weights) == len(block.att.weights)
    for u, v in zip(block.att.weights, b.att.weights):
        assert u.name == v.name and tuple(u.shape) == tuple(v.shape)
        np.testing.assert_array_equal(_np(v), _np(u))
        assert u is not v
    # The report credits the MultiHeadAttention inside the block, by its attribute path.
    report = new.conversion_report
    rw = report.rewrite_for(f"{block.name}/att")
    assert rw is not None and rw.new_class == "FusedMultiHeadAttention" and rw.source == (f"{block.name}/att",)
    assert f"{block.name}/att" not in report.kept_names()
    assert report.verified
    _assert_close(stock, new, x)


def test_text_classifier_block_attention_is_swapped_and_verified():
    """The keras.io model, small (T=16, vocab 100): fast; the issue's size is the slow test below."""
    keras.utils.set_random_seed(1)
    stock = text_classifier(maxlen=16, vocab_size=100)
    x = np.random.default_rng(0).integers(0, 100, (4, 16))
    new = tfmetal_ext.convert(stock, inputs=x, count_ops=False)
    _check_text_classifier(stock, new, x)
    # The block's gradients (input and every weight) match the stock block's.
    e = stock.layers[1](x)
    gx_s, gw_s = _gradients(stock.layers[2], e)
    gx_n, gw_n = _gradients(new.layers[2], e)
    np.testing.assert_allclose(gx_n, gx_s, atol=1e-5 * max(1.0, np.abs(gx_s).max()), rtol=0)
    assert len(gw_s) == len(gw_n)
    for u, v in zip(gw_s, gw_n):
        np.testing.assert_allclose(v, u, atol=1e-5 * max(1.0, np.abs(u).max()), rtol=0)
    # The converted model trains (fit on the copy) and shares nothing with the stock one.
    before = [_np(v).copy() for v in stock.variables]
    new.fit(x, np.array([0, 1, 0, 1]), epochs=1, batch_size=4, verbose=0)
    for v, b in zip(stock.variables, before):
        np.testing.assert_array_equal(_np(v), b, err_msg=v.path)


@pytest.mark.slow
def test_text_classifier_of_the_issue_train_step_ops_drop_and_no_einsum():
    """Issue 16's model: embed 32, 2 heads, ff 32, T=200, vocab 20000, compiled with Adam (its 888-op step)."""
    keras.utils.set_random_seed(0)
    stock = text_classifier()
    x = np.random.default_rng(0).integers(0, 20000, (2, 200))
    y = np.array([0, 1])
    new = tfmetal_ext.convert(stock, inputs=x, count_ops="train")
    _check_text_classifier(stock, new, x)
    report = new.conversion_report
    before, after = report.ops_before["train"], report.ops_after["train"]
    if _kernels_run():
        assert after < before, (before, after)
    else:  # the pure-TF references (TFMETAL_EXT_REFERENCE_OPS=1, no op library) are not fewer ops
        assert before > 0 and after > 0
    stock_ops, new_ops = _train_ops(stock, x, y), _train_ops(new, x, y)
    assert stock_ops.get("Einsum", 0) >= 4  # the stock attention: projections and both score einsums
    assert "Einsum" not in new_ops, new_ops
    if attention_ops.uses_kernel():
        assert new_ops.get(fusion.ATTENTION_OP) == 1 and new_ops.get(fusion.ATTENTION_GRAD_OP) == 1


# ----------------------------------------------------------------------------
# Functional and Sequential models, default layer names.


def _encoder(norm, causal=False, t=12, d=16, heads=2, ff=24, rms=False):
    inp = L.Input((t, d))
    x = norm()(inp)
    a = L.MultiHeadAttention(heads, d // heads)(x, x, use_causal_mask=causal)
    x = L.Add()([inp, a])
    h = norm()(x)
    h = L.Dense(ff, activation="gelu")(h)
    h = L.Dense(d)(h)
    x = L.Add()([x, h])
    out = L.Dense(3)(L.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


def _x(shape, seed=0, batch=4):
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype("float32")


@pytest.mark.parametrize("causal", [False, True])
def test_functional_encoder_default_names(causal):
    keras.utils.set_random_seed(2)
    stock = _encoder(lambda: L.LayerNormalization(epsilon=1e-5), causal=causal)
    x = _x((12, 16))
    new = tfmetal_ext.convert(stock, count_ops=False)
    mha = [l for l in stock.layers if type(l) is L.MultiHeadAttention]
    (converted,) = [l for l in new.layers if isinstance(l, L.MultiHeadAttention)]
    assert type(converted) is fl.FusedMultiHeadAttention and converted.name == mha[0].name
    rw = new.conversion_report.rewrite_for(mha[0].name)
    assert rw.new_class == "FusedMultiHeadAttention" and rw.source == (mha[0].name,)
    _assert_close(stock, new, x)
    # No Einsum runs in the converted model's train step; the stock one has them.
    y = np.zeros((4, 3), "float32")
    for m in (stock, new):
        m.compile(optimizer="sgd", loss="mse")
    assert "Einsum" in _train_ops(stock, x, y)
    assert "Einsum" not in _train_ops(new, x, y)


@needs_rms
def test_functional_encoder_with_rms_normalization():
    keras.utils.set_random_seed(3)
    stock = _encoder(lambda: L.RMSNormalization(epsilon=1e-5), causal=True)
    for layer in stock.layers:  # non-trivial scales, so a mixed-up weight shows
        if isinstance(layer, L.RMSNormalization):
            layer.scale.assign(np.random.default_rng(5).uniform(0.5, 1.5, layer.scale.shape).astype("float32"))
    x = _x((12, 16))
    new = tfmetal_ext.convert(stock, count_ops="train")
    stock_rms = [l for l in stock.layers if type(l) is L.RMSNormalization]
    new_rms = [l for l in new.layers if isinstance(l, L.RMSNormalization)]
    assert len(new_rms) == 2 and all(type(l) is fl.FusedRMSNorm for l in new_rms)
    for s, n in zip(stock_rms, new_rms):
        assert n.name == s.name and float(n.epsilon) == float(s.epsilon)
        np.testing.assert_array_equal(_np(n.scale), _np(s.scale))
        assert new.conversion_report.rewrite_for(s.name).new_class == "FusedRMSNorm"
    assert any(type(l) is fl.FusedMultiHeadAttention for l in new.layers)
    _assert_close(stock, new, x)
    report = new.conversion_report
    before, after = report.ops_before["train"], report.ops_after["train"]
    if _kernels_run():
        assert after < before, (before, after)
    else:  # the pure-TF references (TFMETAL_EXT_REFERENCE_OPS=1, no op library) are not fewer ops
        assert before > 0 and after > 0


@needs_rms
def test_sequential_rms_norm_and_an_axis_it_does_not_take():
    keras.utils.set_random_seed(4)
    stock = keras.Sequential([keras.Input((6, 8)), L.Dense(8), L.RMSNormalization(), L.Dense(4),
                              L.RMSNormalization(axis=[1, 2])])
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert isinstance(new, keras.Sequential)
    kinds = [type(l) for l in new.layers]
    assert kinds[1] is fl.FusedRMSNorm and kinds[3] is L.RMSNormalization
    kept = {k.name: k.reason for k in new.conversion_report.kept}
    assert "axis=[1, 2]" in kept[stock.layers[3].name] and "last axis only" in kept[stock.layers[3].name]
    _assert_close(stock, new, _x((6, 8)))


def test_masks_from_an_embedding_reach_the_converted_attention():
    """Embedding(mask_zero=True): Keras propagates the padding mask into MultiHeadAttention's call."""
    keras.utils.set_random_seed(5)
    inp = L.Input((10,), dtype="int32")
    e = L.Embedding(30, 16, mask_zero=True)(inp)
    a = L.MultiHeadAttention(2, 8)(e, e)
    out = L.Dense(2)(L.GlobalAveragePooling1D()(L.Add()([e, a])))
    stock = keras.Model(inp, out)
    x = np.random.default_rng(0).integers(1, 30, (4, 10))
    for row, length in enumerate((10, 7, 3, 1)):  # padded to 10
        x[row, length:] = 0
    new = tfmetal_ext.convert(stock, inputs=x, count_ops=False)
    assert any(type(l) is fl.FusedMultiHeadAttention for l in new.layers)
    _assert_close(stock, new, x)


def test_a_shared_attention_layer_is_converted_once():
    keras.utils.set_random_seed(6)
    inp = L.Input((8, 16))
    mha = L.MultiHeadAttention(4, 4, value_dim=6, output_shape=(16,))
    y = mha(mha(inp, inp), inp)
    stock = keras.Model(inp, L.Dense(2)(L.Flatten()(y)))
    new = tfmetal_ext.convert(stock, count_ops=False)
    converted = [l for l in new.layers if isinstance(l, L.MultiHeadAttention)]
    assert len(converted) == 1 and type(converted[0]) is fl.FusedMultiHeadAttention
    rw = new.conversion_report.rewrite_for(mha.name)
    assert "shared: called 2 times" in rw.note
    _assert_close(stock, new, _x((8, 16)))


# ----------------------------------------------------------------------------
# Kept, with the fused layer's reason, where it would run the stock computation anyway.


def _kept_reason(report, name):
    return {k.name: k.reason for k in report.kept}.get(name)


def test_attention_over_other_axes_is_kept_with_the_reason():
    keras.utils.set_random_seed(7)
    inp = L.Input((4, 5, 8))
    mha = L.MultiHeadAttention(2, 4, attention_axes=(1, 2))
    stock = keras.Model(inp, mha(inp, inp))
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.layers[1]) is L.MultiHeadAttention
    reason = _kept_reason(new.conversion_report, mha.name)
    assert reason.startswith("FusedMultiHeadAttention would run the stock computation")
    assert "attention_axes" in reason or "ranks" in reason
    _assert_close(stock, new, _x((4, 5, 8)))


def test_returned_scores_are_kept_with_the_reason():
    inp = L.Input((6, 8))
    mha = L.MultiHeadAttention(2, 4)
    out, scores = mha(inp, inp, return_attention_scores=True)
    stock = keras.Model(inp, [out, scores])
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert "return_attention_scores=True" in _kept_reason(new.conversion_report, mha.name)
    _assert_close(stock, new, _x((6, 8)))


def test_attention_dropout_is_converted_and_draws_stocks_masks():
    """Attention dropout runs inside the op: the training form converts too, and (the dropout
    sublayer's seed-generator state carried over) its training calls draw stock's masks."""
    keras.utils.set_random_seed(8)
    inp = L.Input((6, 8))
    mha = L.MultiHeadAttention(2, 4, dropout=0.25)
    stock = keras.Model(inp, mha(inp, inp))
    mha._dropout_layer.seed_generator.state.assign([5, 3])  # not the initial state: it must be copied
    train_form = tfmetal_ext.convert(stock, count_ops=False)
    assert type(train_form.layers[1]) is fl.FusedMultiHeadAttention
    assert train_form.conversion_report.rewrite_for(mha.name).new_class == "FusedMultiHeadAttention"
    x = _x((6, 8))
    for _ in range(2):
        np.testing.assert_allclose(train_form(x, training=True), stock(x, training=True), rtol=1e-5, atol=1e-5)
    deploy = tfmetal_ext.convert(stock, inference=True, count_ops=False)
    assert type(deploy.layers[1]) is fl.FusedMultiHeadAttention
    _assert_close(stock, deploy, _x((6, 8)))


def test_attention_dropout_one_is_kept_for_training():
    inp = L.Input((6, 8))
    mha = L.MultiHeadAttention(2, 4, dropout=1.0)
    stock = keras.Model(inp, mha(inp, inp))
    reason = _kept_reason(tfmetal_ext.convert(stock, count_ops=False).conversion_report, mha.name)
    assert reason is not None and "dropout=1.0" in reason
    assert type(tfmetal_ext.convert(stock, inference=True, count_ops=False).layers[1]) is fl.FusedMultiHeadAttention


def test_a_user_subclass_of_attention_is_kept():
    class MyAttention(L.MultiHeadAttention):
        pass

    inp = L.Input((6, 8))
    mha = MyAttention(2, 4)
    stock = keras.Model(inp, mha(inp, inp))
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new.layers[1]) is MyAttention and new.layers[1] is not mha
    assert "subclassed layer" in _kept_reason(new.conversion_report, mha.name)


def test_lora_projections_are_kept():
    inp = L.Input((6, 8))
    mha = L.MultiHeadAttention(2, 4)
    stock = keras.Model(inp, mha(inp, inp))
    mha._query_dense.enable_lora(2)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert "LoRA" in _kept_reason(new.conversion_report, mha.name)
    _assert_close(stock, new, _x((6, 8)))


@pytest.fixture
def mixed_bfloat16():
    saved = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(saved)


def test_mixed_bfloat16_attention_converts(mixed_bfloat16):
    keras.utils.set_random_seed(9)
    inp = L.Input((6, 8))
    mha = L.MultiHeadAttention(2, 4)
    stock = keras.Model(inp, L.Dense(2, dtype="float32")(mha(inp, inp)))
    new = tfmetal_ext.convert(stock, count_ops=False)
    converted = new.layers[1]
    assert type(converted) is fl.FusedMultiHeadAttention and converted.dtype_policy.name == "mixed_bfloat16"
    assert all(w.dtype == "float32" for w in converted.weights)
    _assert_close(stock, new, _x((6, 8)), atol=3e-2)


class DecoderBlock(L.Layer):
    """A pre-norm causal decoder block in the Llama style: RMS norms and attention held in attributes."""

    def __init__(self, d, heads, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = L.RMSNormalization(epsilon=1e-5)
        self.attn = L.MultiHeadAttention(heads, d // heads, use_bias=False)
        self.norm2 = L.RMSNormalization(epsilon=1e-5)
        self.mlp = [L.Dense(2 * d, activation="silu"), L.Dense(d)]

    def call(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, use_causal_mask=True)
        h = self.norm2(x)
        for layer in self.mlp:
            h = layer(h)
        return x + h


@needs_rms
def test_rms_norms_and_causal_attention_inside_a_subclassed_block():
    keras.utils.set_random_seed(10)
    inp = L.Input((9, 16))
    block = DecoderBlock(16, 4)
    stock = keras.Model(inp, L.Dense(5)(block(inp)))
    block.norm1.scale.assign(np.linspace(0.5, 1.5, 16).astype("float32"))
    new = tfmetal_ext.convert(stock, count_ops=False)
    b = new.layers[1]
    assert type(b) is DecoderBlock and b is not block
    assert type(b.norm1) is fl.FusedRMSNorm and type(b.norm2) is fl.FusedRMSNorm
    assert type(b.attn) is fl.FusedMultiHeadAttention and not b.attn._use_bias
    np.testing.assert_array_equal(_np(b.norm1.scale), _np(block.norm1.scale))
    names = {r.name: r.new_class for r in new.conversion_report.rewrites}
    assert names[f"{block.name}/norm1"] == "FusedRMSNorm" and names[f"{block.name}/attn"] == "FusedMultiHeadAttention"
    assert names[f"{block.name}/mlp/0"] == "FusedDense"
    x = _x((9, 16))
    _assert_close(stock, new, x)
    gx_s, gw_s = _gradients(block, x)
    gx_n, gw_n = _gradients(b, x)
    np.testing.assert_allclose(gx_n, gx_s, atol=1e-5 * max(1.0, np.abs(gx_s).max()), rtol=0)
    for u, v in zip(gw_s, gw_n):
        np.testing.assert_allclose(v, u, atol=1e-5 * max(1.0, np.abs(u).max()), rtol=0)
