"""to_stock(): tfmetal_ext layers back to stock Keras layers.

The references are the stock model itself (`to_stock(convert(m))` must have `m`'s layer configs
and weights), the model of tfmetal_ext layers it is made from (outputs), and a fresh interpreter
where tfmetal_ext cannot be imported (the saved result loads and trains there).
"""

import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import integrations
from tfmetal_ext import layers as fl
from tfmetal_ext import optimizers as fo
from tfmetal_ext.conversion import planners

L = keras.layers


def _randomize(model, seed=0):
    """Every float weight random (variances positive), so a copy that drops or moves one shows."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        if "float" not in str(w.dtype):
            continue
        v = rng.uniform(0.5, 1.5, w.shape) if "variance" in w.name else rng.normal(0.0, 0.3, w.shape)
        w.assign(v.astype(w.dtype))


def _ours(model):
    return [f"{x.name} ({type(x).__name__})" for x in model._flatten_layers(include_self=True, recursive=True)
            if type(x).__module__.startswith("tfmetal_ext.")]


# ----------------------------------------------------------------------------
# One small stock model per group of planners: to_stock(convert(m)) must be m again.


def _vision():
    i = keras.Input((8, 8, 4), name="img")
    h = L.Conv2D(6, 3, padding="same", name="conv")(i)  # with a bias: moved into the moving mean
    h = L.BatchNormalization(name="bn")(h)
    h = L.ReLU(name="relu")(h)  # ConvBNAct
    h = L.DepthwiseConv2D(3, padding="same", name="dw")(h)
    h = L.Activation("relu6", name="dw_act")(h)  # folded into FusedDepthwiseConv2D
    h = L.Conv2D(12, 1, groups=6, name="grouped")(h)  # a depthwise conv, kernel reshaped
    h = L.SeparableConv2D(8, 3, name="sep")(h)
    h = L.LeakyReLU(negative_slope=0.2, name="leaky")(h)
    h = L.Conv2D(8, 1, name="pw")(h)
    h = L.ELU(name="elu")(h)
    h = L.BatchNormalization(name="bn2")(h)  # alone: FusedBatchNorm
    h = L.GlobalAveragePooling2D(name="gap")(h)
    h = L.Dense(16, name="fc", dtype="mixed_float16")(h)
    h = L.Activation("gelu", name="fc_act", dtype="mixed_float16")(h)
    h = L.Dropout(0.1, name="drop")(h)
    m = keras.Model(i, L.Dense(3, name="head")(h), name="vision")
    m.compile(optimizer=keras.optimizers.Adam(2e-3, beta_1=0.8), loss="mse", metrics=["mae"])
    return m


def _sequence():
    tok = keras.Input((6,), dtype="int32", name="tokens")
    h = L.Embedding(50, 8, name="emb")(tok)
    h = L.Conv1D(8, 3, padding="causal", name="c1d")(h)
    h = L.BatchNormalization(name="c1d_bn")(h)
    h = L.Activation("relu", name="c1d_act")(h)  # ConvBNAct1D
    h = L.Conv1D(8, 1, name="pw1d")(h)
    h = L.LayerNormalization(name="ln")(h)
    h = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = L.RMSNormalization(name="rms")(h)
    h = L.EinsumDense("abc,cd->abd", output_shape=(None, 8), bias_axes="d", name="ein")(h)
    h = L.LSTM(8, return_sequences=True, name="lstm")(h)
    h = L.Bidirectional(L.GRU(4, return_sequences=True), name="bi")(h)
    h = L.TimeDistributed(L.Dense(4), name="td")(h)
    return keras.Model(tok, L.GRU(4, name="gru")(h), name="sequence")


# case -> (stock model, the planner classes it exercises)
ROUND_TRIPS = {
    "vision": (_vision, (L.Conv2D, L.BatchNormalization, L.ReLU, L.DepthwiseConv2D, L.Activation,
                         L.SeparableConv2D, L.LeakyReLU, L.ELU, L.Dense, L.Dropout)),
    "sequence": (_sequence, (L.Embedding, L.Conv1D, L.LayerNormalization, L.MultiHeadAttention,
                             L.RMSNormalization, L.EinsumDense, L.LSTM, L.GRU, L.Bidirectional, L.TimeDistributed)),
}
# The planner of already converted blocks acts in the inference form only (their own fold()):
# no stock model makes them, so the round trip starts from them (test_folded_blocks_become_stock_convs).
FOLDED = (fl.ConvBNAct, fl.ConvBNAct1D, fl.ResidualBlock)


def test_every_planner_has_a_round_trip_case():
    assert set(ROUND_TRIPS) == {"vision", "sequence"}  # each one parametrizes the round-trip test
    integrations.load_available()  # the keras-hub planners too (their round trip: test_keras_hub_round_trip)
    covered = {c for _, classes in ROUND_TRIPS.values() for c in classes} | set(FOLDED)
    # The keras-hub integration's classes: keras-hub's own, and Keras' ReversibleEmbedding, which keras-hub's
    # models build (test_keras_hub_round_trip converts and restores a Llama backbone's untied one).
    hub = set(sys.modules["tfmetal_ext.integrations.keras_hub"].FUSED) \
        if "tfmetal_ext.integrations.keras_hub" in sys.modules else set()
    missing = [c.__name__ for c in planners.PLANNERS
               if c not in covered and c not in hub and not c.__module__.startswith("keras_hub.")]
    assert not missing, f"planners without a to_stock round-trip case: {missing}"


def _exercised(m, converted, classes):
    """Each class of `classes` has a layer in `m` that convert rewrote (or, Embedding, kept on purpose)."""
    report = converted.conversion_report
    rewritten = {s for r in report.rewrites for s in r.source} | {s.split("/")[0] for r in report.rewrites
                                                                 for s in r.source}
    kept = set(report.kept_names())
    for cls in classes:
        names = [x.name for x in m.layers if type(x) is cls]
        assert names, f"the case has no {cls.__name__}"
        assert any(n in rewritten or (cls is L.Embedding and n in kept) for n in names), \
            f"convert rewrote no {cls.__name__} of the case: {report}"


def _assert_same_layers(m, s, paths=True):
    """Layer by layer: names, classes, configs (dtype policies, trainable flags) and weights (their
    paths unless `paths` is False: a nested model's rebuilt layers lose its name scope, as in convert)."""
    assert [(x.name, type(x)) for x in s.layers] == [(x.name, type(x)) for x in m.layers]
    key = (lambda w: w.path) if paths else (lambda w: w.name)
    for a, b in zip(m.layers, s.layers):
        assert b.get_config() == a.get_config(), a.name
        assert [key(w) for w in b.weights] == [key(w) for w in a.weights]
        for wa, wb in zip(a.weights, b.weights):
            va, vb = np.asarray(wa.numpy()), np.asarray(wb.numpy())
            if "moving_mean" in wa.path and any(x.name == "bias" for x in _feeding_conv(m, a)):
                # convert stored moving_mean - conv bias; to_stock adds the bias back: float rounding.
                np.testing.assert_allclose(vb, va, rtol=1e-6, atol=1e-7, err_msg=wa.path)
            else:
                assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), wa.path


def _feeding_conv(m, bn):
    """The weights of the conv whose output `bn` reads (empty when none)."""
    src = bn.input._keras_history.operation
    return src.weights if isinstance(src, L.Conv1D | L.Conv2D) else []


@pytest.mark.parametrize("case", [
    "vision",
    pytest.param("sequence", marks=pytest.mark.full),  # recurrent layers run eagerly step by step: seconds
])
def test_to_stock_of_convert_is_the_stock_model(case):
    build, classes = ROUND_TRIPS[case]
    m = build()
    _randomize(m)
    converted = tfmetal_ext.convert(m, verify=False, count_ops=False)  # to_stock verifies against it
    _exercised(m, converted, classes)
    s = tfmetal_ext.to_stock(converted)  # verified against the converted model
    assert not _ours(s)
    _assert_same_layers(m, s)
    assert s.get_config() == m.get_config()
    assert s.conversion_report.verified
    if m.compiled:  # convert made the optimizer FusedAdam; to_stock makes it Adam again
        assert type(converted.optimizer).__name__ == "FusedAdam" and type(s.optimizer) is keras.optimizers.Adam
        assert s.get_compile_config() == m.get_compile_config()
    stock_ids = {id(v) for v in converted.weights}
    assert not any(id(v) in stock_ids for v in s.weights)


def test_folded_blocks_become_stock_convs():
    img, seq = keras.Input((8, 8, 3), name="img"), keras.Input((6, 3), name="seq")
    a = fl.ResidualBlock(4, strides=2, name="res")(fl.ConvBNAct(4, 3, name="cba")(img))
    b = fl.ConvBNAct1D(4, 3, padding="causal", name="cba1d")(seq)
    m = keras.Model([img, seq], [a, b])
    _randomize(m)
    folded = tfmetal_ext.convert(m, inference=True, verify=False, count_ops=False)
    assert {type(x).__name__ for x in folded.layers} >= {"FusedConv2D", "FoldedResidualBlock", "FusedConv1D"}
    s = tfmetal_ext.to_stock(folded)
    assert not _ours(s)
    names = {x.name: type(x) for x in s.layers}
    assert names["cba"] is L.Conv2D and names["cba1d"] is L.Conv1D and names["res_add"] is L.Add
    assert names["res_projection"] is L.Conv2D and names["res_conv1"] is L.Conv2D
    x = [np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype("float32"),
         np.random.default_rng(2).normal(size=(2, 6, 3)).astype("float32")]
    for want, got in zip(m(x, training=False), s(x, training=False)):  # the blocks' own inference outputs
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# A model built from tfmetal_ext's layers, trained with a fused optimizer.


def _ours_model():
    img, seq = keras.Input((8, 8, 3), name="img"), keras.Input((5, 8), name="seq")
    a = fl.ConvBNAct(4, 3, name="stem")(img)
    a = fl.ResidualBlock(4, name="block")(a)
    a = L.GlobalAveragePooling2D(name="pool")(a)
    b = fl.FusedMultiHeadAttention(2, 4, name="attn")(seq, seq)
    b = fl.FusedLayerNorm(name="norm")(b)
    b = L.Flatten(name="flat")(b)
    h = L.Concatenate(name="cat")([a, b])
    out = fl.FusedDense(2, name="head")(fl.FusedDense(8, activation="relu", name="fc")(h))
    m = keras.Model([img, seq], out, name="ours")
    m.compile(optimizer=fo.FusedAdam(learning_rate=1e-3), loss="mse")
    return m


def _batch(seed=0, n=4):
    rng = np.random.default_rng(seed)
    return ([rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.normal(size=(n, 5, 8)).astype("float32")],
            rng.normal(size=(n, 2)).astype("float32"))


def _trained(fit=True):
    """The model after one training step: ``fit``, or (cheaper: no traced train function) one eager step."""
    keras.utils.set_random_seed(0)
    m = _ours_model()
    x, y = _batch()
    if fit:
        m.fit(x, y, batch_size=4, epochs=1, verbose=0)
    else:
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(m(x, training=True) - y))
        m.optimizer.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
    return m, x, y


def test_our_model_becomes_stock_with_its_optimizer_state(tmp_path):
    m, x, y = _trained(fit=False)
    s = tfmetal_ext.to_stock(m)
    assert not _ours(s)
    names = {x.name: type(x) for x in s.layers}
    assert names["stem"] is L.Conv2D and names["stem_bn"] is L.BatchNormalization and names["stem_act"] is L.Activation
    assert names["block_conv1"] is L.Conv2D and names["block_add"] is L.Add and names["block_act"] is L.Activation
    assert names["attn"] is L.MultiHeadAttention and names["norm"] is L.LayerNormalization
    assert names["fc"] is L.Dense and s.get_layer("fc").get_config()["activation"] == "relu"
    # The optimizer: Keras' Adam with the fused one's config and state.
    assert type(s.optimizer) is keras.optimizers.Adam and int(s.optimizer.iterations) == 1
    assert s.conversion_report.optimizer == ("FusedAdam", "Adam")
    assert float(s.optimizer.learning_rate) == pytest.approx(1e-3)
    fused_slots = {v.path.split("/")[-1]: v for v in m.optimizer.variables}
    stock_slots = {v.path.split("/")[-1]: v for v in s.optimizer.variables}
    kernel = m.get_layer("head").kernel
    slot = next(k for k in fused_slots if k.endswith("_momentum") and fused_slots[k].shape == kernel.shape)
    mine = next(v for k, v in stock_slots.items() if k.endswith("_momentum") and v.shape == kernel.shape)
    assert np.any(fused_slots[slot].numpy() != 0) and np.array_equal(mine.numpy(), fused_slots[slot].numpy())
    want = np.asarray(m(x, training=False))
    np.testing.assert_allclose(np.asarray(s(x, training=False)), want, rtol=1e-5, atol=1e-6)
    # Its .keras file names no tfmetal_ext class and loads back with Keras alone.
    path = str(tmp_path / "stock.keras")
    s.save(path)
    with zipfile.ZipFile(path) as z:
        assert "tfmetal_ext" not in z.read("config.json").decode()
    loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.iterations) == 1
    np.testing.assert_allclose(np.asarray(loaded(x, training=False)), want, rtol=1e-5, atol=1e-6)


_NO_TFMETAL = r"""
import sys
sys.modules["tfmetal_ext"] = None  # importing it fails
import os
# Every entry holding the package goes (the repo, an editable install's path); site-packages stays.
sys.path = [p for p in sys.path if p and not os.path.isdir(os.path.join(p, "tfmetal_ext"))]
try:
    import tfmetal_ext
except ImportError:
    pass
else:
    raise SystemExit("tfmetal_ext importable")
import numpy as np, keras
m = keras.saving.load_model({path!r})
x = [np.load({x0!r}), np.load({x1!r})]
np.testing.assert_allclose(m.predict(x, verbose=0), np.load({want!r}), rtol=1e-5, atol=1e-6)
assert int(m.optimizer.iterations) == 1, int(m.optimizer.iterations)
h = m.fit(x, np.load({y!r}), batch_size=4, epochs=1, verbose=0)
assert np.isfinite(h.history["loss"][0]) and int(m.optimizer.iterations) == 2
print("OK", type(m.optimizer).__name__, sorted({{type(l).__name__ for l in m.layers}}))
"""


@pytest.mark.full
def test_saved_stock_model_loads_and_trains_without_tfmetal_ext(tmp_path):
    m, x, y = _trained()
    s = tfmetal_ext.to_stock(m)
    files = {k: str(tmp_path / f"{k}.npy") for k in ("x0", "x1", "y", "want")}
    for k, v in zip(("x0", "x1", "y", "want"), (x[0], x[1], y, m.predict(x, verbose=0))):
        np.save(files[k], v)
    path = str(tmp_path / "stock.keras")
    s.save(path)
    env = dict(os.environ, PYTHONPATH="")
    code = _NO_TFMETAL.format(path=path, **files)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK Adam" in out.stdout and "ConvBNAct" not in out.stdout


# ----------------------------------------------------------------------------
# int8, subclasses, Sequential, bad input.


def test_int8_layers_become_keras_int8_layers():
    i = keras.Input((6, 6, 3), name="img")
    h = L.Conv2D(4, 3, name="conv")(i)
    h = L.Flatten(name="flat")(h)
    h = L.Dense(8, activation="relu", name="fc")(h)
    m = keras.Model(i, L.Dense(2, name="head")(h))
    _randomize(m)
    q = tfmetal_ext.convert(m, inference=True, quantize="int8", verify=False, count_ops=False)
    s = tfmetal_ext.to_stock(q)
    assert not _ours(s)
    for name in ("fc", "head"):
        layer, theirs = s.get_layer(name), q.get_layer(name)
        assert type(layer) is L.Dense and layer.dtype_policy.name == "int8_from_float32"
        assert layer.quantization_mode == "int8"
        assert [(w.name, str(w.dtype)) for w in layer.weights] == [(w.name, str(w.dtype)) for w in theirs.weights]
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(layer.weights, theirs.weights))
    # Keras' Conv2D has no int8 form: a float Conv2D with the kernel de-quantized (q / scale per filter).
    conv, theirs = s.get_layer("conv"), q.get_layer("conv")
    assert type(conv) is L.Conv2D and conv.dtype_policy.name == "float32" and not conv.quantization_mode
    q8, scale = theirs._kernel.numpy().astype("float64"), theirs.kernel_scale.numpy().astype("float64")
    np.testing.assert_allclose(conv.kernel.numpy(), q8 / scale, rtol=1e-6)
    assert np.array_equal(conv.bias.numpy(), theirs.bias.numpy())
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(s.predict(x, verbose=0), q.predict(x, verbose=0), rtol=1e-5, atol=1e-5)


class _Block(L.Layer):
    """A subclassed layer holding tfmetal_ext sublayers (attribute and list)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = fl.ConvBNAct(4, 3, name="conv")
        self.dense = [fl.FusedDense(3, name="d0"), fl.FusedLayerNorm(name="n0")]

    def call(self, x, training=False):
        h = keras.ops.mean(self.conv(x, training=training), axis=(1, 2))
        return self.dense[1](self.dense[0](h))


class _StockBlock(L.Layer):
    """A stock subclassed layer: convert swaps its sublayers one to one, to_stock swaps them back."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = L.Dense(6, name="proj")
        self.norms = [L.LayerNormalization(axis=2, epsilon=1e-5, name="norm")]

    def call(self, x):
        return self.norms[0](self.proj(x))


def test_subclass_and_nested_model_round_trip():
    inner = keras.Sequential([keras.Input((6, 6, 3)), L.Conv2D(4, 3, name="c"), L.BatchNormalization(name="b"),
                              L.ReLU(name="r"), L.GlobalAveragePooling2D(name="g")], name="inner")
    img, seq = keras.Input((6, 6, 3), name="img"), keras.Input((5, 4), name="seq")
    m = keras.Model([img, seq], [inner(img), _StockBlock(name="blk")(seq)], name="outer")
    _randomize(m)
    converted = tfmetal_ext.convert(m, verify=False, count_ops=False)  # to_stock verifies against it
    blk = converted.get_layer("blk")
    # blk.norms is a list, which a .keras file keys by class name, and blk's constructor makes stock
    # norms again on load: the FusedLayerNorm there is its saved-name alias (named LayerNormalization).
    assert type(blk.proj).__name__ == "FusedDense" and isinstance(blk.norms[0], fl.FusedLayerNorm)
    assert type(blk.norms[0]).__name__ == "LayerNormalization"
    assert blk.norms[0].get_config()["axis"] in (-1, [-1])  # convert's FusedLayerNorm: the last axis
    assert [type(x).__name__ for x in converted.get_layer("inner").layers] == ["ConvBNAct", "GlobalAveragePooling2D"]
    s = tfmetal_ext.to_stock(converted)
    assert not _ours(s)
    _assert_same_layers(m.get_layer("inner"), s.get_layer("inner"), paths=False)
    assert type(s.get_layer("inner")) is keras.Sequential
    a, b = m.get_layer("blk"), s.get_layer("blk")
    for x, y in ((a.proj, b.proj), (a.norms[0], b.norms[0])):  # the stock configs (axis=2), the same weights
        assert type(y) is type(x) and y.get_config() == x.get_config()
        assert all(np.array_equal(u.numpy(), v.numpy()) for u, v in zip(x.weights, y.weights))


def test_subclassed_sublayers_and_sequential():
    i = keras.Input((6, 6, 3))
    m = keras.Model(i, _Block(name="blk")(i))
    _randomize(m)
    s = tfmetal_ext.to_stock(m)
    blk = s.get_layer("blk")
    assert type(blk) is _Block and type(blk.dense[0]) is L.Dense and type(blk.dense[1]) is L.LayerNormalization
    assert isinstance(blk.conv, keras.Model) and [type(x).__name__ for x in blk.conv.layers[1:]] == [
        "Conv2D", "BatchNormalization", "Activation"]
    assert not _ours(s)
    seq = keras.Sequential([keras.Input((4,)), fl.FusedDense(3, name="a"), fl.FusedDropout(0.5, name="b"),
                            fl.Softshrink(0.5, name="c")], name="seq")
    t = tfmetal_ext.to_stock(seq)
    assert type(t) is keras.Sequential and [type(x).__name__ for x in t.layers] == ["Dense", "Dropout", "Activation"]
    assert t.get_layer("c").get_config()["activation"] == "soft_shrink"
    # A residual block's Add is no chain of layers: that Sequential comes back Functional, saying so.
    res = keras.Sequential([keras.Input((4, 4, 2)), fl.ResidualBlock(2, name="res")], name="res_seq")
    u = tfmetal_ext.to_stock(res, verify=False)
    assert not isinstance(u, keras.Sequential) and u.get_layer("res_add") is not None
    assert any("returned as a Functional model" in n for n in u.conversion_report.notes)


def test_loss_scale_optimizer_keeps_wrapping_the_stock_class_with_its_state():
    i = keras.Input((4,))
    m = keras.Model(i, fl.FusedDense(2, name="d")(i))
    m.compile(optimizer=keras.optimizers.LossScaleOptimizer(fo.FusedSGD(momentum=0.9)), loss="mse")
    m.optimizer.build(m.trainable_variables)
    m.optimizer.apply([keras.ops.ones_like(v) for v in m.trainable_variables], m.trainable_variables)
    s = tfmetal_ext.to_stock(m, verify=False)
    outer, inner = s.optimizer, s.optimizer.inner_optimizer
    assert type(outer) is keras.optimizers.LossScaleOptimizer and type(inner) is keras.optimizers.SGD
    assert inner.momentum == pytest.approx(0.9) and int(inner.iterations) == int(m.optimizer.inner_optimizer.iterations)
    assert float(outer.dynamic_scale) == float(m.optimizer.dynamic_scale)
    theirs = [v.numpy() for v in m.optimizer.inner_optimizer.variables if "momentum" in v.name]
    mine = [v.numpy() for v in inner.variables if "momentum" in v.name]
    assert len(mine) == 2 and all(np.array_equal(a, b) for a, b in zip(mine, theirs))
    assert any(np.any(a != 0) for a in theirs)


def test_bad_input():
    with pytest.raises(ValueError, match="Received: model="):
        tfmetal_ext.to_stock(object())
    with pytest.raises(ValueError, match="Received: model="):
        tfmetal_ext.to_stock(keras.Sequential([fl.FusedDense(2)]))


# ----------------------------------------------------------------------------
# keras-hub.


@pytest.mark.full
def test_keras_hub_round_trip():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(1)
    stock = keras_hub.models.LlamaBackbone(vocabulary_size=200, num_layers=1, num_query_heads=4,
                                           num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
    converted = tfmetal_ext.convert(stock, count_ops=False)
    assert _ours(converted)
    assert type(converted.token_embedding).__qualname__ == "FusedReversibleEmbedding"  # the untied head
    s = tfmetal_ext.to_stock(converted)
    assert not _ours(s) and type(s) is type(stock)
    def classes(m):
        # (a weightless rotary embedding keras-hub names itself gets a fresh automatic name in a copy)
        return sorted((type(x).__module__, type(x).__name__) for x in m._flatten_layers())

    assert classes(s) == classes(stock)
    theirs = {w.path: w for w in stock.weights}
    assert sorted(w.path for w in s.weights) == sorted(theirs)
    assert all(np.array_equal(w.numpy(), theirs[w.path].numpy()) for w in s.weights)
    x = {"token_ids": np.random.default_rng(0).integers(1, 200, (2, 6)).astype("int32"),
         "padding_mask": np.ones((2, 6), "int32")}
    np.testing.assert_allclose(np.asarray(s(x)), np.asarray(stock(x)), rtol=1e-5, atol=1e-5)
