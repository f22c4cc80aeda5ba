"""convert() on keras-hub models: tasks converted whole, tied embeddings kept one object, Gemma, LoRA.

Tiny configs built from the constructors (no presets, no network). References are the stock
keras-hub model itself: its outputs, its greedy tokens, its trainable weights after
``enable_lora``; never the converter's own output. With today's planners most keras-hub layers are
kept (copied); what is tested here is the conversion machinery around them.
"""

import os

import numpy as np
import pytest
import keras

pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install 'tfmetal-ext[hub]')")
import keras_hub  # noqa: E402

import tfmetal_ext  # noqa: E402


def _gpt2(num_layers=1, preprocessor=None):
    keras.utils.set_random_seed(0)
    b = keras_hub.models.GPT2Backbone(vocabulary_size=1000, num_layers=num_layers, num_heads=2, hidden_dim=64,
                                      intermediate_dim=128, max_sequence_length=128)
    return keras_hub.models.GPT2CausalLM(backbone=b, preprocessor=preprocessor)


def _llama(num_layers=1):
    keras.utils.set_random_seed(1)
    b = keras_hub.models.LlamaBackbone(vocabulary_size=1000, num_layers=num_layers, num_query_heads=4,
                                       num_key_value_heads=2, hidden_dim=64, intermediate_dim=128)
    return keras_hub.models.LlamaCausalLM(backbone=b, preprocessor=None)


def _gpt2_preprocessor():
    """A GPT-2 preprocessor from an in-memory byte-pair vocabulary (offline)."""
    vocab = {"<|endoftext|>": 0, "a": 1, "Ġ": 2, "b": 3, "Ġa": 4, "Ġb": 5, "ab": 6}
    tok = keras_hub.models.GPT2Tokenizer(vocabulary=vocab, merges=["Ġ a", "Ġ b", "a b"])
    return keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tok, sequence_length=8)


def _prompt(batch=2, length=8, prompt=3, seed=0):
    ids = np.zeros((batch, length), "int32")
    mask = np.zeros((batch, length), "int32")
    ids[:, :prompt] = np.random.default_rng(seed).integers(1, 1000, (batch, prompt))
    mask[:, :prompt] = 1
    return {"token_ids": ids, "padding_mask": mask}


def _assert_tied_and_independent(stock, new):
    """The backbone's token embedding is one layer in the copy (the backbone's attribute, its graph call
    and the task's output projection), and the copy shares no variable with the stock task."""
    te = new.backbone.token_embedding
    assert te is not stock.backbone.token_embedding
    assert any(op is te for op in new.operations)  # the task graph's reverse (logits) call
    assert any(op is te for op in new.backbone.operations)  # the backbone graph's embedding call
    assert len({id(v) for v in new.weights}) == len({id(v) for v in stock.weights})
    stock_ids = {id(v) for v in stock.weights}
    assert not any(id(v) in stock_ids for v in new.weights)


def _greedy_tokens(model, x, max_length=8):
    return np.asarray(model.generate(x, max_length=max_length, stop_token_ids=None)["token_ids"])


def test_gpt2_causal_lm_converts_whole():
    stock = _gpt2(preprocessor=_gpt2_preprocessor())
    stock.compile(sampler="greedy")
    new = tfmetal_ext.convert(stock, count_ops=False)  # verify: outputs and gradients (tied embedding)
    r = new.conversion_report
    assert r.verified and r.max_grad_diff is not None
    assert type(new) is keras_hub.models.GPT2CausalLM
    assert type(new.backbone) is keras_hub.models.GPT2Backbone and new.backbone is not stock.backbone
    assert new.preprocessor is stock.preprocessor  # untouched: the same object (weightless, nothing to convert)
    assert type(new.sampler).__name__ == "GreedySampler"  # the stock compile's sampler, not Task's default
    _assert_tied_and_independent(stock, new)
    # generate() with greedy sampling: the stock model's tokens (token-id inputs, no preprocessing).
    new.preprocessor = None
    stock_pre, stock.preprocessor = stock.preprocessor, None
    try:
        x = _prompt()
        np.testing.assert_array_equal(_greedy_tokens(new, x), _greedy_tokens(stock, x))
    finally:
        stock.preprocessor = stock_pre


@pytest.mark.full
def test_llama_causal_lm_generates_counts_and_round_trips(tmp_path):
    stock = _llama(num_layers=2)
    stock.compile(sampler="greedy")
    new = tfmetal_ext.convert(stock)  # op counts of a [B, T, V] output with dict inputs
    r = new.conversion_report
    assert r.verified
    assert r.ops_before["train"] > r.ops_after["train"] > 0
    assert type(new) is keras_hub.models.LlamaCausalLM and type(new.backbone) is keras_hub.models.LlamaBackbone
    _assert_tied_and_independent(stock, new)
    x = _prompt(length=10)
    np.testing.assert_array_equal(_greedy_tokens(new, x, 10), _greedy_tokens(stock, x, 10))
    # save() / load: the task class comes back with the same outputs.
    path = os.path.join(tmp_path, "llama.keras")
    new.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras_hub.models.LlamaCausalLM
    np.testing.assert_allclose(loaded.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    # save_to_preset() / from_preset(): a local preset directory (no network).
    preset = os.path.join(tmp_path, "llama_preset")
    new.save_to_preset(preset)
    again = keras_hub.models.LlamaCausalLM.from_preset(preset, preprocessor=None)
    np.testing.assert_allclose(again.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    # save_weights() / load_weights() between two converted tasks.
    weights = os.path.join(tmp_path, "llama.weights.h5")
    new.save_weights(weights)
    other = tfmetal_ext.convert(_llama(num_layers=2), verify=False, count_ops=False)
    other.load_weights(weights)
    np.testing.assert_allclose(other.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)


def test_decoding_steps_run_each_projection_as_one_gemv():
    """generate()'s cached step (one token per sequence, batch 2): every projection of the converted
    Llama decoder, and its output head, is one TfmetalExt>Gemv; the step's logits and cache are stock's."""
    import tensorflow as tf

    from tfmetal_ext.backends import fusion
    from tfmetal_ext.ops.gemv import uses_kernel as gemv_uses_kernel

    if not gemv_uses_kernel():
        pytest.skip("the op library is not loaded here (TFMETAL_EXT_REFERENCE_OPS or no compiler)")
    stock = _llama()
    x = _prompt(length=10)
    new = tfmetal_ext.convert(stock, inputs=x, count_ops=False)
    ids = tf.constant(x["token_ids"])
    token, index = ids[:, 3:4], tf.constant(3)
    outs = {}
    for name, model in (("stock", stock), ("new", new)):
        _, cache = model._build_cache(ids)
        step = tf.function(lambda t, c, i, m=model: m.call_with_cache(t, c, i))
        graph = step.get_concrete_function(token, cache, index).graph
        outs[name] = (step(token, cache, index), [op.type for op in graph.get_operations()])
    (logits, _, cache), types = outs["new"]
    (stock_logits, _, stock_cache), _ = outs["stock"]
    # q, k, v, output; gate, up, down: 7 in the one layer; and the head (Llama's untied ReversibleEmbedding).
    assert types.count(fusion.GEMV_OP) == 8
    assert "MatMul" not in types and "Einsum" not in types
    np.testing.assert_allclose(logits.numpy(), stock_logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cache.numpy(), stock_cache.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.full
def test_gpt2_causal_lm_save_load(tmp_path):
    """GPT-2's graph-level LayerNormalization and Dropout become FusedLayerNorm and FusedDropout; the
    .keras file keys them under the stock class names, so it loads into the stock GPT2CausalLM that
    from_config rebuilds (it used to be refused), and weights move between stock and converted both ways."""
    stock = _gpt2()
    new = tfmetal_ext.convert(stock, count_ops=False, verify=False)
    final_norm = new.backbone.layers[-1]
    assert isinstance(final_norm, tfmetal_ext.layers.FusedLayerNorm)
    assert type(final_norm).__name__ == "LayerNormalization"  # the saved-name alias
    x = _prompt(length=8)
    path = os.path.join(tmp_path, "gpt2.keras")
    new.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras_hub.models.GPT2CausalLM
    assert type(loaded.backbone.layers[-1]) is keras.layers.LayerNormalization  # stock layers, as from_config makes
    np.testing.assert_allclose(loaded.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    # A stock model's weights file loads into the converted one, and the converted one's into a stock one.
    stock_w, new_w = os.path.join(tmp_path, "stock.weights.h5"), os.path.join(tmp_path, "new.weights.h5")
    stock.save_weights(stock_w)
    other = tfmetal_ext.convert(_gpt2(), count_ops=False, verify=False)
    for v in other.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    other.load_weights(stock_w)
    np.testing.assert_allclose(other.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    new.save_weights(new_w)
    fresh = _gpt2()
    for v in fresh.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    fresh.load_weights(new_w)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-5)


@pytest.mark.full
def test_bert_and_vit_classifiers_save_load(tmp_path):
    """BERT's embedding LayerNormalization and pooled Dense, and the classifier heads, are replaced at
    graph level: the converted tasks' .keras files load into the stock task classes."""
    keras.utils.set_random_seed(5)
    bb = keras_hub.models.BertBackbone(vocabulary_size=1000, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=32)
    bert = keras_hub.models.BertTextClassifier(backbone=bb, num_classes=3, preprocessor=None)
    vb = keras_hub.models.ViTBackbone(image_shape=(16, 16, 3), patch_size=8, num_layers=1, num_heads=2,
                                      hidden_dim=32, mlp_dim=64)
    vit = keras_hub.models.ViTImageClassifier(backbone=vb, num_classes=3, preprocessor=None)
    rng = np.random.default_rng(0)
    bert_x = {"token_ids": rng.integers(1, 1000, (2, 8)).astype("int32"),
              "segment_ids": np.zeros((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    vit_x = rng.normal(size=(2, 16, 16, 3)).astype("float32")
    for name, stock, x in (("bert", bert, bert_x), ("vit", vit, vit_x)):
        new = tfmetal_ext.convert(stock, count_ops=False, verify=False)
        graph_level = list(new.layers) + list(new.backbone.layers)
        assert any(tfmetal_ext.conversion.copying.is_ours(layer) for layer in graph_level), name
        path = os.path.join(tmp_path, f"{name}.keras")
        new.save(path)
        loaded = keras.saving.load_model(path)
        assert type(loaded) is type(stock)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4,
                                   atol=1e-5, err_msg=name)


@pytest.mark.full
def test_gpt2_causal_lm_two_layers_generate():
    stock = _gpt2(num_layers=2)
    stock.compile(sampler="greedy")
    new = tfmetal_ext.convert(stock)
    assert new.conversion_report.ops_before["train"] > new.conversion_report.ops_after["train"]
    x = _prompt(length=12, seed=3)
    np.testing.assert_array_equal(_greedy_tokens(new, x, 12), _greedy_tokens(stock, x, 12))


@pytest.mark.full
def test_gemma_backbone_converts():
    keras.utils.set_random_seed(2)
    stock = keras_hub.models.GemmaBackbone(vocabulary_size=1000, num_layers=2, num_query_heads=2,
                                           num_key_value_heads=1, hidden_dim=64, intermediate_dim=128, head_dim=32)
    new = tfmetal_ext.convert(stock, count_ops=False)  # used to fail: "cannot add new elements of state"
    assert new.conversion_report.verified and type(new) is keras_hub.models.GemmaBackbone
    x = _prompt(length=6)
    np.testing.assert_allclose(new(x), stock(x), rtol=1e-4, atol=1e-5)


@pytest.mark.full
def test_bert_text_classifier_converts_on_random_inputs():
    keras.utils.set_random_seed(3)
    b = keras_hub.models.BertBackbone(vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=64,
                                      intermediate_dim=128, max_sequence_length=64)
    stock = keras_hub.models.BertTextClassifier(backbone=b, num_classes=3, preprocessor=None)
    new = tfmetal_ext.convert(stock, count_ops=False)  # no inputs=: segment ids need [0, 2)
    assert new.conversion_report.verified
    assert type(new) is keras_hub.models.BertTextClassifier and type(new.backbone) is keras_hub.models.BertBackbone
    assert new.preprocessor is None


@pytest.mark.full
def test_vit_image_classifier_converts():
    keras.utils.set_random_seed(4)
    b = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=2,
                                     hidden_dim=64, mlp_dim=128)
    stock = keras_hub.models.ViTImageClassifier(backbone=b, num_classes=3, preprocessor=None)
    new = tfmetal_ext.convert(stock, count_ops=False)
    assert new.conversion_report.verified
    assert type(new) is keras_hub.models.ViTImageClassifier and type(new.backbone) is keras_hub.models.ViTBackbone


def _lora_trained(model, x, y):
    """``(trainable paths, paths of the weights one fit step changed)``."""
    trainable = sorted(v.path for v in model.trainable_weights)
    before = {id(v): (v.path, np.array(v.numpy())) for v in model.weights}
    model.fit(x, y, epochs=1, batch_size=2, verbose=0)
    changed = sorted(p for v in model.weights for p, old in [before[id(v)]] if not np.array_equal(old, v.numpy()))
    return trainable, changed


@pytest.mark.full
@pytest.mark.parametrize("when", ["before", "after"])
def test_enable_lora_before_and_after_convert(when):
    x = _prompt(length=8)
    y = np.random.default_rng(5).integers(0, 1000, (2, 8)).astype("int32")
    ref = _gpt2()
    ref.backbone.enable_lora(4)
    ref_trainable, ref_changed = _lora_trained(ref, x, y)  # the stock model's own LoRA set
    stock = _gpt2()
    if when == "before":
        stock.backbone.enable_lora(4)
    new = tfmetal_ext.convert(stock, count_ops=False)
    if when == "after":
        new.backbone.enable_lora(4)
    trainable, changed = _lora_trained(new, x, y)
    assert trainable == ref_trainable and any("lora_kernel" in p for p in trainable)
    assert changed == ref_changed
    assert all("lora" in p or p.endswith("/bias") for p in changed)
