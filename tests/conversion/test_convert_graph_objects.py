"""convert() on what public code puts in a graph: Keras operations that are not layers, layers reachable
along two paths (a nested model's layer called again outside it, a tied projection), Functional
subclasses, dict inputs and sequence outputs.

References are the stock model itself (its outputs and gradients on the same data) and numpy written
from the definitions; never the converter's own output.
"""

import numpy as np
import pytest
import keras
import tensorflow as tf
from keras import layers as L

import tfmetal_ext
from tfmetal_ext import layers as fl
from tfmetal_ext.conversion import planners


def _np(t):
    return np.asarray(keras.ops.convert_to_numpy(t), dtype="float64")


def _dense_np(layer, x):
    return x @ _np(layer.kernel) + _np(layer.bias)


# ----------------------------------------------------------------------------
# Keras operations in the graph.


def _swish_model():
    i = keras.Input((6,), name="x")
    h = L.Dense(8, name="d1")(i)
    h = keras.activations.swish(h)  # a Silu operation node, not a layer
    r = keras.ops.relu(L.Dense(8, name="d2")(h))  # a Relu operation right after a Dense: folds into it
    o = L.Dense(3, name="out")(keras.ops.concatenate([h, r], axis=-1))
    return keras.Model(i, o)


def test_operation_nodes_convert_kept_or_mapped():
    keras.utils.set_random_seed(1)
    stock = _swish_model()
    new = tfmetal_ext.convert(stock, count_ops=False)  # used to raise AttributeError: 'Silu' ... 'trainable'
    assert new.conversion_report.verified
    kept = {k.name: k for k in new.conversion_report.kept}
    silu = next(k for k in kept.values() if k.class_name == "Silu")
    assert "Keras operation" in silu.reason and "not a layer" in silu.reason
    assert any(k.class_name == "Concatenate" for k in kept.values())
    # keras.ops.relu after d2 is mapped: d2 becomes FusedDense(relu), the Relu node is absorbed.
    d2 = new.get_layer("d2")
    assert isinstance(d2, fl.FusedDense) and d2.get_config()["activation"] == "relu"
    assert not any(k.class_name == "Relu" for k in kept.values())
    # Outputs from the definitions: swish(x) = x * sigmoid(x).
    x = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    h = _dense_np(stock.get_layer("d1"), x.astype("float64"))
    h = h / (1 + np.exp(-h))
    r = np.maximum(_dense_np(stock.get_layer("d2"), h), 0)
    want = _dense_np(stock.get_layer("out"), np.concatenate([h, r], axis=-1))
    np.testing.assert_allclose(_np(new(x)), want, rtol=1e-4, atol=1e-5)
    # The converted graph shares no operation object with the stock one.
    stock_ops = {id(op) for op in stock.operations}
    assert not any(id(op) in stock_ops for op in new.operations)


def test_every_activation_operation_has_a_reason_or_a_mapping():
    """`OP_ACTIVATIONS` names only what it maps; an unmapped operation is kept with a reason."""
    for cls, name_of in planners.OP_ACTIVATIONS.items():
        op = cls()
        assert planners.activation_of(op) == name_of(op)
    i = keras.Input((4,))
    o = keras.ops.softplus(keras.ops.abs(i) + 1.0)
    stock = keras.Model(i, o)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert {k.class_name for k in new.conversion_report.kept} >= {"Softplus", "Absolute", "Add"}
    assert all(k.reason for k in new.conversion_report.kept)


def test_multi_output_and_keyword_operations():
    """Operations with several outputs (split, unstack), keyword arguments and tensor lists."""
    keras.utils.set_random_seed(2)
    i = keras.Input((6, 4))
    a, b = keras.ops.split(i, 2, axis=-1)
    s = keras.ops.sum(a, axis=1)
    u = keras.ops.unstack(b, axis=1)
    m = keras.ops.where(s > 0, s, keras.ops.zeros_like(s))
    t = keras.ops.reshape(keras.ops.stack(u[:2], axis=1), (-1, 4))
    o = L.Dense(3, name="head")(keras.ops.concatenate([m, t], -1))
    stock = keras.Model(i, [o, keras.ops.softmax(o)])
    new = tfmetal_ext.convert(stock, count_ops=False)
    ops = {op.name for op in stock.operations if not isinstance(op, keras.layers.Layer)}
    kept = {k.name: k.reason for k in new.conversion_report.kept}
    assert ops <= set(kept) and all("Keras operation" in kept[n] for n in ops)
    x = np.random.default_rng(1).standard_normal((3, 6, 4)).astype("float32")
    xa, xb = x[..., :2], x[..., 2:]
    sm = xa.sum(axis=1)
    feat = np.concatenate([np.where(sm > 0, sm, 0), xb[:, :2].reshape(-1, 4)], -1).astype("float64")
    logits = _dense_np(stock.get_layer("head"), feat)
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    got = new(x)
    np.testing.assert_allclose(_np(got[0]), logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_np(got[1]), soft / soft.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------
# Identity: a layer reachable along two paths stays one object.


class Encoder(keras.Model):
    """A Functional subclass (like a keras-hub backbone): attributes point at its graph's layers."""

    def __init__(self, vocab=50, dim=8, **kwargs):
        self.embed = L.Embedding(vocab, dim, name="embed")
        self.proj = L.Dense(dim, name="proj")
        self.norm = L.LayerNormalization(name="norm")
        ids = keras.Input((None,), dtype="int32", name="token_ids")
        mask = keras.Input((None,), dtype="int32", name="padding_mask")
        h = self.proj(self.embed(ids))
        h = h * keras.ops.expand_dims(keras.ops.cast(mask, h.dtype), -1)
        super().__init__({"token_ids": ids, "padding_mask": mask}, self.norm(h), **kwargs)
        self.vocab = vocab
        self.tag = {"kind": "encoder"}


class TiedProjection(L.Layer):
    """Logits from an embedding's own table (a tied output projection), as a layer holding the embedding."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


class TiedLM(keras.Model):
    """A task around it (a keras-hub CausalLM's shape): the encoder's embedding is the output projection."""

    def __init__(self, encoder, **kwargs):
        self.encoder = encoder
        self.helper = L.Identity(name="helper")  # held, never called: a stateless object outside the graph
        h = encoder(encoder.input)
        logits = TiedProjection(encoder.embed, name="tied")(h)
        super().__init__(encoder.input, logits, **kwargs)


def _tied_lm():
    keras.utils.set_random_seed(3)
    enc = Encoder(name="encoder")
    ids = enc.input["token_ids"]
    inputs = enc.input
    h = enc(inputs)
    # The embedding layer is called inside the encoder graph and again outside it (reverse use).
    out = L.Dense(enc.embed.input_dim, name="head")(h)
    again = enc.embed(ids)
    return keras.Model(inputs, {"logits": out, "embedded": again}, name="lm"), enc


def _batch(b=2, t=5, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((b, t), "int32")
    mask[0, -2:] = 0
    return {"token_ids": rng.integers(0, vocab, (b, t)).astype("int32"), "padding_mask": mask}


def test_layer_called_in_nested_model_and_outside_is_one_object():
    stock, enc = _tied_lm()
    new = tfmetal_ext.convert(stock, count_ops="train")
    r = new.conversion_report
    assert r.verified
    new_enc = new.get_layer("encoder")
    # The same class, with its attributes pointing at the new graph's layers.
    assert type(new_enc) is Encoder and new_enc is not enc
    assert new_enc.embed is next(op for op in new.operations if op.name == "embed")
    assert new_enc.embed is next(op for op in new_enc.operations if op.name == "embed")
    assert new_enc.embed is not enc.embed
    assert isinstance(new_enc.proj, fl.FusedDense) and new_enc.proj is new_enc.get_layer("proj")
    assert new_enc.vocab == 50 and new_enc.tag == {"kind": "encoder"} and new_enc.tag is not enc.tag
    # One embedding variable, used by both calls: the model holds as many variables as the stock one.
    assert len({id(v) for v in new.weights}) == len({id(v) for v in stock.weights})
    stock_vars = {id(v) for v in stock.weights}
    assert not any(id(v) in stock_vars for v in new.weights)
    # Dict inputs and a [B, T, V] output: the op counter made its targets (a train count exists).
    assert r.ops_before.get("train") and r.ops_after.get("train")
    # Gradients of a shared variable sum both uses: against the stock model on the same data.
    x = _batch()
    for m in (stock, new):
        with tf.GradientTape() as tape:
            y = m(x, training=True)
            loss = tf.reduce_sum(y["logits"] ** 2) + tf.reduce_sum(y["embedded"])
        m._g = tape.gradient(loss, m.get_layer("encoder").embed.embeddings.value)
    np.testing.assert_allclose(_np(new._g), _np(stock._g), rtol=1e-4, atol=1e-5)


def test_functional_subclass_task_keeps_class_and_tied_weights():
    keras.utils.set_random_seed(4)
    enc = Encoder(name="encoder")
    stock = TiedLM(enc, name="tied_lm")
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new) is TiedLM and type(new.encoder) is Encoder
    assert new.encoder is new.get_layer("encoder")  # attribute and graph: one object
    assert new.get_layer("tied").embedding is new.encoder.embed  # the tied table: one layer, one variable
    assert len({id(v) for v in new.weights}) == len({id(v) for v in stock.weights})
    assert new.helper is stock.helper  # weightless, outside the graph: the same object (documented)
    x = _batch(seed=1)
    np.testing.assert_allclose(_np(new(x)), _np(stock(x)), rtol=1e-4, atol=1e-5)
    assert new.conversion_report.verified  # its gradient check covers the tied embedding


def test_kept_layer_holding_a_graph_layer_shares_it():
    """A kept (subclassed) layer that holds a layer also called in the graph: the copy holds the new one."""
    keras.utils.set_random_seed(5)
    ids = keras.Input((4,), dtype="int32")
    emb = L.Embedding(30, 6, name="emb")
    h = L.Dense(6, name="mix")(emb(ids))
    proj = TiedProjection(emb, name="tied")
    stock = keras.Model(ids, proj(h))
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert new.conversion_report.verified
    assert new.get_layer("tied").embedding is new.get_layer("emb")
    assert len(new.weights) == len(stock.weights)


@pytest.mark.full
def test_swish_model_op_counts():
    stock = _swish_model()
    new = tfmetal_ext.convert(stock)
    r = new.conversion_report
    # Both models' steps are counted (the operation nodes trace in both), and the Relu op folded into
    # d2 leaves no separate activation in the converted inference step.
    assert r.ops_before["train"] > 0 and r.ops_after["train"] > 0
    assert 0 < r.ops_after["predict"] <= r.ops_before["predict"]
    assert not any("not counted" in n for n in r.notes)


class VariableTied(L.Layer):
    """A projection holding another layer's variable itself (not the layer): a variable-level tie."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.table))


def test_variable_shared_by_two_layers_is_one_variable():
    keras.utils.set_random_seed(6)
    ids = keras.Input((4,), dtype="int32")
    emb = L.Embedding(30, 6, name="emb")
    h = L.LayerNormalization(name="norm")(emb(ids))
    stock = keras.Model(ids, VariableTied(emb.embeddings, name="tied")(h))
    new = tfmetal_ext.convert(stock, count_ops=False)  # the gradient check sums both uses of the table
    assert new.conversion_report.verified
    assert new.get_layer("tied").table is new.get_layer("emb").embeddings
    assert new.get_layer("tied").table is not emb.embeddings
    assert len({id(v) for v in new.weights}) == len({id(v) for v in stock.weights})


# ----------------------------------------------------------------------------
# A Functional subclass's .keras file: its from_config rebuilds stock layers.


class MergeNet(keras.Model):
    """A Functional subclass whose graph has a Dense followed by an Activation layer (convert() merges them)."""

    def __init__(self, units=4, **kwargs):
        x = keras.Input((3,))
        h = L.Activation("relu", name="act")(L.Dense(units, name="d")(x))
        super().__init__(x, L.Dense(2, name="out")(h), **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name}


def test_functional_subclass_file_loads_into_the_stock_class(tmp_path):
    """Encoder's graph-level Dense and LayerNormalization become FusedDense and FusedLayerNorm, saved
    under the stock names: the .keras file loads through Encoder's from_config (stock layers) with the
    same outputs, a stock Encoder's weights file loads into the converted one, and the aliased layers
    stay the fused classes everywhere this package looks (isinstance, to_stock, quantize, serialization)."""
    keras.utils.set_random_seed(6)
    stock = Encoder(name="encoder")
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new) is Encoder and isinstance(new.proj, fl.FusedDense) and isinstance(new.norm, fl.FusedLayerNorm)
    assert [type(x).__name__ for x in new.layers] == [type(x).__name__ for x in stock.layers]
    assert not any("does not load" in n for n in new.conversion_report.notes)
    x = _batch(seed=2)
    path = str(tmp_path / "encoder.keras")
    new.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Encoder": Encoder})
    assert type(loaded) is Encoder and type(loaded.norm) is L.LayerNormalization
    np.testing.assert_allclose(_np(loaded(x)), _np(stock(x)), rtol=1e-5, atol=1e-6)
    # Weights both ways between a stock and a converted Encoder.
    stock_w = str(tmp_path / "stock.weights.h5")
    stock.save_weights(stock_w)
    other = tfmetal_ext.convert(Encoder(name="encoder"), count_ops=False, verify=False)
    other.load_weights(stock_w)
    np.testing.assert_allclose(_np(other(x)), _np(stock(x)), rtol=1e-5, atol=1e-6)
    # The alias is the fused class to the rest of the package.
    back = tfmetal_ext.to_stock(new)
    assert type(back.proj) is L.Dense and type(back.norm) is L.LayerNormalization
    np.testing.assert_allclose(_np(back(x)), _np(stock(x)), rtol=1e-5, atol=1e-6)
    cfg = keras.saving.serialize_keras_object(new.norm)
    assert type(keras.saving.deserialize_keras_object(cfg)) is fl.FusedLayerNorm
    new.proj.quantize("int8")  # FusedDense's own quantize (a subclass would raise NotImplementedError)
    assert new.proj.quantization_mode == "int8"


def test_functional_subclass_with_merged_layers_says_its_file_does_not_load():
    keras.utils.set_random_seed(7)
    stock = MergeNet(name="merge_net")
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert type(new) is MergeNet and isinstance(new.get_layer("d"), fl.FusedDense)
    notes = [n for n in new.conversion_report.notes if "does not load into MergeNet" in n]
    assert len(notes) == 1 and "Activation" in notes[0], new.conversion_report.notes


@keras.saving.register_keras_serializable(package="tfmetal_ext_tests")
class FeedForwardBlock(L.Layer):
    """keras.io's TransformerBlock shape: a Sequential of Dense layers built in __init__ (its layers list
    is keyed by class name in a saved file), plus a norm held as an attribute."""

    def __init__(self, dim=8, hidden=16, **kwargs):
        super().__init__(**kwargs)
        self.ffn = keras.Sequential([L.Dense(hidden, activation="gelu"), L.Dense(dim)])
        self.norm = L.LayerNormalization(epsilon=1e-6)
        self.dim, self.hidden = dim, hidden

    def call(self, x):
        return self.norm(x + self.ffn(x))

    def get_config(self):
        return dict(super().get_config(), dim=self.dim, hidden=self.hidden)


@keras.saving.register_keras_serializable(package="tfmetal_ext_tests")
class HoldsItsSequential(L.Layer):
    """A layer whose config records its Sequential: the load re-makes the Sequential's own (fused) classes."""

    def __init__(self, ffn=None, **kwargs):
        super().__init__(**kwargs)
        self.ffn = keras.saving.deserialize_keras_object(ffn) if isinstance(ffn, dict) else ffn or \
            keras.Sequential([L.Dense(8, activation="relu"), L.Dense(8)])

    def call(self, x):
        return self.ffn(x)

    def get_config(self):
        return dict(super().get_config(), ffn=keras.saving.serialize_keras_object(self.ffn))


@pytest.mark.parametrize("block", [FeedForwardBlock, HoldsItsSequential])
def test_kept_layer_with_a_sequential_saves_and_loads(tmp_path, block):
    """A kept subclassed layer's Sequential of swapped Dense layers: the converted model's .keras file
    loads (the block re-made from its config) with the converted model's outputs, whether the block's
    constructor makes stock Dense layers again (FeedForwardBlock: the swapped ones are saved under
    ``dense``) or its config records the fused ones (HoldsItsSequential: they stay ``fused_dense``)."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((5, 8))
    stock = keras.Model(inputs, L.Dense(3)(block(name="block")(inputs)))
    new = tfmetal_ext.convert(stock, count_ops=False)
    inner = new.get_layer("block").ffn.layers
    assert all(isinstance(x, fl.FusedDense) for x in inner)
    path = str(tmp_path / "m.keras")
    new.save(path)
    loaded = keras.saving.load_model(path)
    x = np.random.default_rng(9).standard_normal((2, 5, 8)).astype("float32")
    np.testing.assert_allclose(_np(loaded(x)), _np(new(x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(loaded(x)), _np(stock(x)), rtol=1e-5, atol=1e-6)
