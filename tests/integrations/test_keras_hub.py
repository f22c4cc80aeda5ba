"""The keras-hub integration: fusion-first subclasses of keras-hub's RMS norms and attention layers.

References are keras-hub's own layers (the stock code path of the same weights); tolerances are
derived in each test. Tiny configurations built from the constructors (no presets, no network).
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (extra [hub])")

import tfmetal_ext  # noqa: E402
from tfmetal_ext import inspect  # noqa: E402
from tfmetal_ext.conversion import planners  # noqa: E402
from tfmetal_ext.integrations import keras_hub as kh  # noqa: E402

U32 = 2.0 ** -24  # float32 unit roundoff


def _class(path):
    if path.startswith("keras:"):  # a Keras class keras-hub's models build (keras.layers.ReversibleEmbedding)
        obj = keras
        for part in path[len("keras:"):].split("."):
            obj = getattr(obj, part)
        return obj
    module, name = path.split(":")
    return getattr(__import__(f"keras_hub.src.{module}", fromlist=[name]), name)


def _retyped_copy(layer, build_input):
    """A fresh layer of `layer`'s class with its weights, then made its fusion-first subclass."""
    copy = type(layer).from_config(layer.get_config()) if type(layer).__name__ != "LlamaAttention" \
        else type(layer)(num_query_heads=layer.num_query_heads, num_key_value_heads=layer.num_key_value_heads,
                         dtype=layer.dtype_policy)
    copy(*build_input)
    copy.set_weights(layer.get_weights())
    object.__setattr__(copy, "__class__", kh.FUSED[type(layer)])
    return copy


def _half_ulp(y):
    """One float16 ulp at |y| (normal range; the subnormal spacing below it)."""
    return np.spacing(np.abs(y).astype(np.float16)).astype(np.float32)


# ----------------------------------------------------------------------------
# The tables.


def test_every_table_row_resolves_and_has_a_registered_subclass():
    for spec in kh.HUB_RMS_NORMS + kh.HUB_ROPES + kh.HUB_ATTENTION + kh.HUB_DECODERS + kh.HUB_HEADS:
        base = _class(spec.path)
        fused = kh.FUSED[base]
        assert fused.fused_name == fused.__qualname__ == spec.fused and fused.__mro__[1] is base
        assert fused.__name__ == base.__name__  # weights saved under the stock class's paths
        assert planners.planner_for(base) is not None
        assert keras.saving.get_registered_object(f"tfmetal_ext>{spec.fused}") is fused
    assert not kh.MISSING


@pytest.mark.full  # a fresh interpreter importing TF and keras-hub (~8 s); the table test above loads it here
def test_integration_loads_only_when_keras_hub_is_imported(tmp_path):
    import subprocess
    import sys

    code = ("import sys, tfmetal_ext, tfmetal_ext.integrations as I; "
            "print('keras_hub' in sys.modules, I.load_available()); import keras_hub; print(I.load_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "False []"
    assert lines[-1] == "['tfmetal_ext.integrations.keras_hub']"


def test_a_retype_needs_a_direct_subclass():
    layer = keras.layers.Dense(2)
    node = planners.SyntheticNode.of(layer, ())
    ctx = planners.PlanContext(planners.NoGraph(), False)
    with pytest.raises(ValueError, match="subclass of Dense"):
        planners.retype(ctx, node, keras.layers.EinsumDense)


# ----------------------------------------------------------------------------
# RMS norms.


@pytest.mark.parametrize("spec", kh.HUB_RMS_NORMS, ids=lambda s: s.fused)
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_rms_norm_matches_the_stock_layer(spec, policy):
    base = _class(spec.path)
    rng = np.random.default_rng(0)
    d = 48
    stock = base(dtype=policy) if "head_dim" not in base.__init__.__code__.co_varnames else base(dtype=policy)
    x = (rng.standard_normal((3, 5, d)) * 3).astype("float32")
    stock(x)
    w = getattr(stock, spec.weight)
    w.assign(rng.uniform(-1, 2, w.shape).astype("float32"))
    fused = _retyped_copy(stock, (x,))

    def run(layer):
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(tf.range(d), tf.float32))
        return y, tape.gradient(loss, [xt, getattr(layer, spec.weight)])

    y_s, g_s = run(stock)
    y_f, g_f = run(fused)
    assert y_f.dtype == y_s.dtype
    y_s, y_f = np.asarray(y_s, np.float32), np.asarray(y_f, np.float32)
    if policy == "float32":
        # Both compute in float32; they differ in the order of the d-term mean square (at most
        # d roundings of relative size u), in rsqrt (2 ulps) and the two products: |dy| <= (d + 6) u |y|.
        assert np.all(np.abs(y_f - y_s) <= (d + 6) * U32 * np.abs(y_s))
    else:
        # The same float32 values (within the bound above) rounded to float16: at most one half ulp apart.
        assert np.all(np.abs(y_f - y_s) <= _half_ulp(y_s))
    for a, b in zip(g_f, g_s):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # Gradients: the same terms in another order (the op's backward sums each row and column once).
        tol = (8 * d * U32 if policy == "float32" else 2.0 ** -9) * np.max(np.abs(b))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)


def test_rms_norm_subclass_is_one_op_each_way_and_serializes():
    base = _class("models.llama.llama_layernorm:LlamaLayerNorm")
    layer = kh.FUSED[base](epsilon=1e-5, name="norm")
    x = tf.random.normal((2, 4, 8))
    layer(x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, layer.scale])

    ops = {op.type for op in step.get_concrete_function(x).graph.get_operations()}
    assert "TfmetalExt>RMSNorm" in ops and "TfmetalExt>RMSNormGrad" in ops
    assert "Rsqrt" not in ops
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(again) is type(layer) and again.epsilon == 1e-5


def test_gemma_rms_norm_uses_one_plus_scale():
    base = _class("models.gemma.rms_normalization:RMSNormalization")
    stock = base(epsilon=1e-6)
    x = np.array([[3.0, 4.0]], "float32")
    stock(x)
    stock.scale.assign([0.5, -1.0])
    fused = _retyped_copy(stock, (x,))
    # rms = sqrt((9 + 16) / 2); y = x / rms * (1 + scale), from the definition.
    rms = math.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(np.asarray(fused(x)), [[3 / rms * 1.5, 0.0]], rtol=2e-7, atol=1e-7)


# ----------------------------------------------------------------------------
# Rotary embeddings.


@pytest.mark.parametrize("path, kwargs", [
    ("layers.modeling.rotary_embedding:RotaryEmbedding", {}),
    ("layers.modeling.rotary_embedding:RotaryEmbedding", {"max_wavelength": 500, "scaling_factor": 4.0}),
    ("layers.modeling.rotary_embedding:RotaryEmbedding", {"rope_type": "yarn", "scaling_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
    ("models.llama.llama_rotary_embedding:LlamaRotaryEmbedding", {}),
    ("models.llama.llama_rotary_embedding:LlamaRotaryEmbedding", {
        "frequency_adjustment_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "pretraining_sequence_length": 64}),
], ids=["rotary", "rotary_scaled", "yarn", "llama", "llama3"])
def test_rope_matches_the_stock_layer(path, kwargs):
    base = _class(path)
    stock = base(**kwargs)
    fused = kh.FUSED[base](**kwargs)
    x = np.random.default_rng(5).standard_normal((2, 9, 3, 16)).astype("float32")
    for call in ({}, {"start_index": 5}, {"positions": np.arange(3, 12, dtype="float32")}):
        y_s, y_f = np.asarray(stock(x, **call)), np.asarray(fused(x, **call))
        # y = x1 cos - x2 sin (and x2 cos + x1 sin) in float32: cos and sin may differ by an ulp (2u)
        # between TF's and the op's, plus the products' and the sum's roundings: <= 10 u max|x|.
        np.testing.assert_allclose(y_f, y_s, rtol=0, atol=10 * U32 * 2 * float(np.max(np.abs(x))))


def test_llama3_rope_with_a_position_scale_is_kept():
    base = _class("models.llama.llama_rotary_embedding:LlamaRotaryEmbedding")
    layer = base(position_scaling_factor=2.0, frequency_adjustment_factor=8.0, low_freq_factor=1.0,
                 high_freq_factor=4.0, pretraining_sequence_length=64)
    layer(np.zeros((1, 2, 4), "float32"))
    node = planners.SyntheticNode.of(layer, (1, 2, 4))
    plan, reason = planners.planner_for(base)(planners.PlanContext(planners.NoGraph(), False), node)
    assert plan.kind == "keep" and "position_scaling_factor" in reason


# ----------------------------------------------------------------------------
# Attention.


def _llama_attention(policy="float32"):
    base = _class("models.llama.llama_attention:LlamaAttention")
    return base(num_query_heads=4, num_key_value_heads=2, dtype=policy)


def test_llama_attention_matches_stock_in_training_and_cached_decoding():
    keras.utils.set_random_seed(0)
    b, t, d = 2, 7, 32
    stock = _llama_attention()
    x = np.random.default_rng(1).standard_normal((b, t, d)).astype("float32")
    mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    mask[1, :, 5:] = False  # padding: keys 5, 6 of the second sequence
    mask[1, 0, :] = False  # a query row that attends no key (stock: zeros, from its masked Softmax layer)
    stock(x, attention_mask=mask)
    fused = _retyped_copy(stock, (x,))
    fused(x, attention_mask=mask)
    y_s, y_f = stock(x, attention_mask=mask), fused(x, attention_mask=mask)
    # float32 both ways, t <= 7 terms per softmax row and output: (2t + 8) u of the largest value.
    scale = float(np.max(np.abs(y_s)))
    np.testing.assert_allclose(np.asarray(y_f), np.asarray(y_s), rtol=0, atol=(2 * t + 8) * U32 * scale * 4)

    # Cached decoding, as generate() calls it: one new token at index 3 against a cache of 7.
    head = d // 4
    cache = np.random.default_rng(2).standard_normal((b, 2, t, 2, head)).astype("float32")
    step_mask = np.zeros((b, 1, t), bool)
    step_mask[:, :, :4] = True
    xs = x[:, 3:4]
    out_s, cache_s = stock(xs, attention_mask=step_mask, cache=cache, cache_update_index=3)
    out_f, cache_f = fused(xs, attention_mask=step_mask, cache=cache, cache_update_index=3)
    np.testing.assert_array_equal(np.asarray(cache_f), np.asarray(cache_s))
    np.testing.assert_allclose(np.asarray(out_f), np.asarray(out_s), rtol=0,
                               atol=(2 * t + 8) * U32 * float(np.max(np.abs(out_s))) * 4)


def _decoder_pair(family, **kwargs):
    """(stock decoder block, its converted copy: the fused decoder subclass holding the fused attention)."""
    keras.utils.set_random_seed(3)
    if family == "gpt2":
        stock = keras_hub.layers.TransformerDecoder(intermediate_dim=32, num_heads=2, dropout=0.0, **kwargs)
    elif family == "mistral":
        stock = _class("models.mistral.mistral_transformer_decoder:MistralTransformerDecoder")(
            intermediate_dim=32, num_query_heads=2, num_key_value_heads=1, **kwargs)
    else:
        stock = _class("models.llama.llama_decoder:LlamaTransformerDecoder")(
            intermediate_dim=32, num_query_heads=4, num_key_value_heads=2, **kwargs)
    seq = keras.Input((None, 16))
    pad = keras.Input((None,), dtype="int32")
    model = keras.Model([seq, pad], stock(seq, decoder_padding_mask=pad))
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    fused = next(x for x in new.layers if type(x).__mro__[1] is type(stock))
    assert type(fused) is kh.FUSED[type(stock)] and type(fused._self_attention_layer).__name__ == \
        type(stock._self_attention_layer).__name__
    return stock, fused


def _reachable_shapes(graph, fetches):
    """Static shapes of every tensor the fetches depend on (what the step runs after TF's pruning)."""
    seen, todo, shapes = set(), [t.op for t in fetches], []
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        shapes += [t.shape.as_list() if t.shape.rank is not None else None for t in op.outputs]
        todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return shapes


def _block_step_matches_stock(stock, fused, x, t, **call):
    """One step (outputs, then gradients of a fixed projection of them for x and the weights) of the
    fused decoder block against the stock one, within (2t + 8) u x 32 of each tensor's scale (the
    callers derive the bound); returns the graph of the fused block's step."""

    def step(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, **call)
            loss = tf.reduce_sum(y * tf.cos(tf.range(16, dtype=tf.float32)))
        return [y] + tape.gradient(loss, [x] + layer.trainable_variables)

    got, want = tf.function(lambda: step(fused))(), tf.function(lambda: step(stock))()
    # Gradients whose true value is 0 (the key bias: softmax ignores a shift of a row's scores) are
    # rounding noise on both sides: every tensor is compared on the scale of the largest gradient.
    grad_scale = max(float(np.max(np.abs(w))) for w in want[1:])
    for i, (g, w) in enumerate(zip(got, want)):
        scale = float(np.max(np.abs(w))) if i == 0 else grad_scale
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=(2 * t + 8) * U32 * scale * 4 * 8)
    return tf.function(lambda: step(fused)).get_concrete_function().graph


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_decoder_hands_mask_factors_to_the_op(family):
    """The fused decoder block's attention gets keras-hub's padding x causal mask as factors: the op's
    causal flag and a (batch, 1, 1, kv) padding mask, and Mistral's sliding window (4 of 9 keys here) as
    the op's own band. Grouped-query heads (Llama 4 over 2, Mistral 2 over 1) reach the op unrepeated.
    Its outputs and gradients are the stock block's,
    with padded keys and a row that attends no key: float32, the block's accumulation lengths summed
    along its chain (norm 16, projections 16, softmax rows 2t + 8 at t = 9 keys, output 16, norm 16,
    feed-forward 16 and 32: L = 138) bound the forward difference by L u of the largest value and the
    backward by about 2L u; the test allows 32 (2t + 8) u = 832 u, 3x that. The train step depends on
    no (q, kv) tensor; cached decoding (one token at index 5 of a cache of 9) takes the band j <= 5 and
    gives the stock block's output (Mistral's: within the window, keys 2..5)."""
    stock, fused = _decoder_pair(family, **({"sliding_window": 4} if family == "mistral" else {}))
    b, t = 2, 9
    x = tf.constant(np.random.default_rng(4).standard_normal((b, t, 16)).astype("float32"))
    pad = np.ones((b, t), "int32")
    pad[1, 6:] = 0  # padded keys
    pad[1, 0] = 0  # row 0 of the second sequence attends no key (its only key is padding)
    pad = tf.constant(pad)

    graph = _block_step_matches_stock(stock, fused, x, t, decoder_padding_mask=pad, training=True)
    ops = {op.type: op for op in graph.get_operations()}
    attn = [op for op in graph.get_operations() if op.type == "TfmetalExt>Attention"]
    assert attn and all(op.get_attr("causal") for op in attn)
    assert all(op.inputs[3].shape.as_list() == [b, 1, 1, t] for op in attn)
    assert [op.get_attr("sliding_window") for op in attn] == [4 if family == "mistral" else 0] * len(attn)
    kv_heads = {"llama": 2, "gpt2": 2, "mistral": 1}[family]
    assert all(_op_kv_heads(op) == kv_heads for op in attn), "the key heads reach the op unrepeated"
    # In the projections' (batch, seq, heads, dim) layout: no Transpose makes the op's inputs or reads its output.
    assert all(op.get_attr("layout") == b"BSHD" for op in attn)
    assert not [op for op in attn for t in op.inputs[:3] if t.op.type == "Transpose"]
    assert not [c for op in attn for c in op.outputs[0].consumers() if c.type == "Transpose"]
    shapes = _reachable_shapes(graph, graph.outputs)
    assert not [sh for sh in shapes if sh and len(sh) >= 2 and sh[-2:] == [t, t]], "a (q, kv) tensor in the step"
    assert "TfmetalExt>AttentionGrad" in ops

    # Cached decoding: the stock block and ours on the same cache.
    xs = x[:, 5:6]
    if family == "gpt2":
        cache = tf.random.stateless_normal((b, 2, t, 2, 8), seed=[1, 2])
    elif family == "mistral":
        cache = tf.random.stateless_normal((b, 2, t, 1, 8), seed=[1, 2])
    else:
        cache = tf.random.stateless_normal((b, 2, t, 2, 4), seed=[1, 2])
    out_s, cache_s = stock(xs, self_attention_cache=cache, self_attention_cache_update_index=5)
    out_f, cache_f = fused(xs, self_attention_cache=cache, self_attention_cache_update_index=5)
    np.testing.assert_allclose(np.asarray(cache_f), np.asarray(cache_s), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out_f), np.asarray(out_s), rtol=0,
                               atol=(2 * t + 8) * U32 * float(np.max(np.abs(out_s))) * 4 * 8)
    # The attention layer took the factors of this call and keeps none (no tensor of a finished call).
    assert "_tfmetal_mask_factors" not in vars(fused._self_attention_layer)


@pytest.mark.parametrize("window", [0, pytest.param(4, marks=pytest.mark.full)])  # the quick tier's time budget
def test_gemma_decoder_hands_mask_factors_to_the_op(window):
    """Gemma's block makes its mask in ``_compute_attention_mask`` (its own argument names) and holds its
    attention as ``attention``: the op still gets the causal flag, a (batch, 1, 1, kv) padding mask and
    the sliding window (4 of 9 keys), so it skips the key tiles above the diagonal and the step keeps no
    (q, kv) mask for the backward pass; the uncached step has no interleave of the head dim's halves.
    Outputs and gradients are the stock block's within the bound of
    test_decoder_hands_mask_factors_to_the_op (the same chain lengths), and cached decoding (one token
    at index 5 of a cache of 9) the stock block's output."""
    keras.utils.set_random_seed(3)
    kwargs = {"use_sliding_window_attention": True, "sliding_window_size": window} if window else {}
    stock = _class("models.gemma.gemma_decoder_block:GemmaDecoderBlock")(
        hidden_dim=16, intermediate_dim=32, head_dim=4, num_query_heads=4, num_key_value_heads=2, **kwargs)
    seq = keras.Input((None, 16))
    pad_in = keras.Input((None,), dtype="int32")
    model = keras.Model([seq, pad_in], stock(seq, padding_mask=pad_in))
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    fused = next(x for x in new.layers if type(x).__mro__[1] is type(stock))
    assert type(fused) is kh.FUSED[type(stock)] and type(fused.attention) is kh.FUSED[type(stock.attention)]
    b, t = 2, 9
    x = tf.constant(np.random.default_rng(4).standard_normal((b, t, 16)).astype("float32"))
    pad = np.ones((b, t), "int32")
    pad[1, 6:] = 0
    pad[1, 0] = 0  # row 0 of the second sequence attends no key
    pad = tf.constant(pad)

    graph = _block_step_matches_stock(stock, fused, x, t, padding_mask=pad)
    attn = [op for op in graph.get_operations() if op.type == "TfmetalExt>Attention"]
    assert attn and all(op.get_attr("causal") for op in attn)
    assert all(op.inputs[3].shape.as_list() == [b, 1, 1, t] for op in attn)
    assert [op.get_attr("sliding_window") for op in attn] == [window] * len(attn)
    grads = [op for op in graph.get_operations() if op.type == "TfmetalExt>AttentionGrad"]
    assert grads and all(op.inputs[4].shape.as_list() == [b, 1, 1, t] for op in grads), \
        "the backward pass keeps the padding mask only"
    # Without a cache, the query and key skip Gemma's interleave of the head dim's halves (the same
    # permutation of both: the scores above match stock's); the cached call below keeps it in the cache.
    kinds = {op.type for op in graph.get_operations()}
    assert not kinds & {"Pack", "Unpack", "Split", "SplitV", "ConcatV2"}, kinds & {"Pack", "Unpack", "Split"}

    cache = tf.random.stateless_normal((b, 2, t, 2, 4), seed=[1, 2])
    xs = x[:, 5:6]
    out_s, cache_s = stock(xs, padding_mask=pad, cache=cache, cache_update_index=5)
    out_f, cache_f = fused(xs, padding_mask=pad, cache=cache, cache_update_index=5)
    np.testing.assert_allclose(np.asarray(cache_f), np.asarray(cache_s), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out_f), np.asarray(out_s), rtol=0,
                               atol=(2 * t + 8) * U32 * float(np.max(np.abs(out_s))) * 4 * 8)
    assert "_tfmetal_mask_factors" not in vars(fused.attention)


def test_decoder_keeps_the_stock_mask_where_it_is_not_padding_times_causal():
    """A custom decoder_attention_mask (with or without Mistral's sliding window): no factors, the op gets
    keras-hub's mask itself (and the outputs are the stock block's)."""
    b, t = 2, 9
    x = tf.constant(np.random.default_rng(5).standard_normal((b, t, 16)).astype("float32"))
    custom = np.tril(np.ones((t, t), "int32"))[None].repeat(b, 0)
    custom[:, :, 0] = 0
    custom[:, 0, 0] = 1
    for family, kwargs, call in (("llama", {}, {"decoder_attention_mask": tf.constant(custom)}),
                                 ("mistral", {"sliding_window": 4}, {"decoder_attention_mask": tf.constant(custom)})):
        stock, fused = _decoder_pair(family, **kwargs)
        graph = tf.function(lambda: fused(x, training=True, **call)).get_concrete_function().graph
        attn = [op for op in graph.get_operations() if op.type == "TfmetalExt>Attention"]
        assert attn and not any(op.get_attr("causal") for op in attn), family
        y_s, y_f = stock(x, **call), fused(x, **call)
        np.testing.assert_allclose(np.asarray(y_f), np.asarray(y_s), rtol=0,
                                   atol=(2 * t + 8) * U32 * float(np.max(np.abs(y_s))) * 4 * 8, err_msg=family)


def test_attention_subclass_runs_the_op_and_no_score_matrix():
    stock = _llama_attention()
    x = tf.random.normal((2, 6, 32))
    stock(x)
    fused = _retyped_copy(stock, (x,))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = fused(x, training=True)
        return tape.gradient(y, fused.trainable_variables)

    ops = [op.type for op in step.get_concrete_function(x).graph.get_operations()]
    assert "TfmetalExt>Attention" in ops and "TfmetalExt>AttentionGrad" in ops
    assert "Softmax" not in ops  # the (q, kv) probabilities are never materialized


def test_cached_multi_head_attention_dropout_draws_the_stock_mask():
    base = _class("layers.modeling.cached_multi_head_attention:CachedMultiHeadAttention")
    keras.utils.set_random_seed(3)
    stock = base(num_heads=2, key_dim=8, dropout=0.5)
    x = np.random.default_rng(4).standard_normal((2, 5, 16)).astype("float32")
    mask = np.tril(np.ones((5, 5), bool))[None].repeat(2, 0)
    stock(x, x, attention_mask=mask)
    fused = _retyped_copy(stock, (x, x))
    state = stock._dropout_layer.seed_generator.state.numpy()
    fused._dropout_layer.seed_generator.state.assign(state)
    y_s = stock(x, x, attention_mask=mask, training=True)
    y_f = fused(x, x, attention_mask=mask, training=True)
    # Same dropped probabilities (else entries differ by O(1)); float32 rounding otherwise.
    np.testing.assert_allclose(np.asarray(y_f), np.asarray(y_s), rtol=0,
                               atol=32 * U32 * 4 * float(np.max(np.abs(y_s))))


def _traced_ops(fn, *args):
    return {op.type for op in fn.get_concrete_function(*args).graph.get_operations()}


def test_functions_compiled_with_xla_run_the_stock_code():
    # The ops have no XLA kernels: under jit_compile=True (keras-hub's own layer tests train that
    # way) each subclass runs its stock computation, which XLA compiles; the same values as stock.
    x = np.random.default_rng(6).standard_normal((2, 6, 32)).astype("float32")
    norm = _class("models.llama.llama_layernorm:LlamaLayerNorm")(epsilon=1e-5)
    rotary = _class("layers.modeling.rotary_embedding:RotaryEmbedding")()
    attention = _llama_attention()
    cases = [(norm, (x,)), (rotary, (x.reshape(2, 6, 4, 8),)), (attention, (x,))]
    for stock, args in cases:
        stock(*args)
        fused = _retyped_copy(stock, args)
        graph_fn = tf.function(lambda *a, layer=fused: layer(*a))
        xla_fn = tf.function(lambda *a, layer=fused: layer(*a), jit_compile=True)
        assert any(t.startswith("TfmetalExt>") for t in _traced_ops(graph_fn, *args)), type(fused).__name__
        assert not any(t.startswith("TfmetalExt>") for t in _traced_ops(xla_fn, *args)), type(fused).__name__
        y_s = np.asarray(stock(*args))
        # XLA compiles the stock code: the stock result up to XLA's own reassociation (float32, <= 32 terms).
        np.testing.assert_allclose(np.asarray(xla_fn(*args)), y_s, rtol=0,
                                   atol=64 * U32 * float(np.max(np.abs(y_s))))


def test_gemma_soft_capping_is_kept_with_the_reason():
    base = _class("models.gemma.gemma_attention:CachedGemmaAttention")
    layer = base(head_dim=8, num_query_heads=2, num_key_value_heads=1, logit_soft_cap=50.0)
    layer(np.zeros((1, 3, 16), "float32"), attention_mask=np.ones((1, 3, 3), bool))
    node = planners.SyntheticNode.of(layer, (1, 3, 16))
    plan, reason = planners.planner_for(base)(planners.PlanContext(planners.NoGraph(), False), node)
    assert plan.kind == "keep" and "soft-capping" in reason


# ----------------------------------------------------------------------------
# convert() on backbones.


def _ids(vocab=1000, b=2, t=16):
    rng = np.random.default_rng(0)
    pm = np.ones((b, t), "int32")
    pm[1, t - 4:] = 0
    return {"token_ids": rng.integers(1, vocab, (b, t)).astype("int32"), "padding_mask": pm}


@pytest.mark.full  # a two-layer Llama converted and verified (~6 s); the quick tier keeps tests/conversion/test_convert_hub.py's GPT-2 CausalLM conversion
def test_llama_backbone_converts_and_verifies():
    keras.utils.set_random_seed(1)
    bb = keras_hub.models.LlamaBackbone(vocabulary_size=1000, num_layers=2, num_query_heads=4,
                                        num_key_value_heads=2, hidden_dim=64, intermediate_dim=128)
    x = _ids()
    new = tfmetal_ext.convert(bb, inputs=x)
    report = new.conversion_report
    made = {r.new_class for r in report.rewrites}
    assert {"FusedLlamaAttention", "FusedLlamaLayerNorm"} <= made
    assert sum(r.new_class == "FusedLlamaAttention" for r in report.rewrites) == 2
    assert report.verified  # outputs and training gradients against the stock backbone
    ops = inspect.fusion_report(new, mode="train", inputs=x,
                                targets=np.zeros((2, 16, 64), "float32")).ops_by_type
    # Five norms forward (two per layer, the final one); each layer's two feed projections, whose kernel
    # gradients make their output again once per norm (`_replay.norm_plan`) instead of keeping it. The
    # backbone's output has no projection after it here.
    assert ops.get("TfmetalExt>Attention") == 2 and ops.get("TfmetalExt>RMSNorm") == 5 + 4
    assert ops.get("TfmetalExt>RMSNormGrad") == 5
    assert ops.get("TfmetalExt>Rope") == 4  # query and key of each layer
    assert not {"Softmax", "Einsum", "Cos", "Sin"} & set(ops)


@pytest.mark.full
@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen", "bert", "gemma"])
def test_backbones_convert_and_verify(family):
    keras.utils.set_random_seed(1)
    M = keras_hub.models
    small = dict(vocabulary_size=1000, num_layers=2, hidden_dim=64, intermediate_dim=128)
    x = _ids()
    if family == "gpt2":
        bb, fused = M.GPT2Backbone(num_heads=2, max_sequence_length=64, **small), "FusedCachedMultiHeadAttention"
    elif family == "mistral":
        bb = M.MistralBackbone(num_query_heads=4, num_key_value_heads=2, sliding_window=8, **small)
        fused = "FusedCachedMistralAttention"
    elif family == "qwen":
        bb, fused = M.QwenBackbone(num_query_heads=4, num_key_value_heads=2, **small), "FusedQwenAttention"
    elif family == "gemma":
        bb = M.GemmaBackbone(num_query_heads=4, num_key_value_heads=1, head_dim=16, **small)
        fused = "FusedCachedGemmaAttention"
    else:
        bb = M.BertBackbone(num_heads=2, max_sequence_length=64, **small)
        x["segment_ids"] = np.zeros((2, 16), "int32")
        fused = None  # BERT's encoder holds Keras' own MultiHeadAttention: FusedMultiHeadAttention
    new = tfmetal_ext.convert(bb, inputs=x)
    report = new.conversion_report
    assert report.verified
    made = [r.new_class for r in report.rewrites]
    assert made.count(fused or "FusedMultiHeadAttention") == 2, made


def test_converted_backbone_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(2)
    # Mistral: keras-hub 0.32's Llama decoder cannot save (its get_config reads an attribute it never sets).
    bb = keras_hub.models.MistralBackbone(vocabulary_size=500, num_layers=1, num_query_heads=2,
                                          num_key_value_heads=1, hidden_dim=32, intermediate_dim=64)
    x = _ids(500, t=8)
    new = tfmetal_ext.convert(bb, inputs=x, verify=False, count_ops=False)
    path = tmp_path / "mistral.keras"
    new.save(path)
    again = keras.saving.load_model(path)
    # The backbone is re-made from its constructor arguments, so its layers load as keras-hub's own
    # (convert() again for the fused ones), with the converted model's weights and outputs.
    assert type(again) is keras_hub.models.MistralBackbone
    np.testing.assert_allclose(np.asarray(again(x)), np.asarray(new(x)), rtol=0, atol=1e-5)
    fused_again = tfmetal_ext.convert(again, inputs=x, count_ops=False)
    assert "FusedMistralLayerNormalization" in {r.new_class for r in fused_again.conversion_report.rewrites}


# Quick tier: one family (the full tier runs each; Gemma's decoder block hands the window in
# test_gemma_decoder_hands_mask_factors_to_the_op's full-tier case too).
@pytest.mark.sample_axes("family")
@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_sliding_window_layers_hand_the_window_to_the_op(family):
    """Qwen's and Gemma's sliding-window attention (window 5 of 16 tokens) runs as the op's own band (its
    sliding_window attr) instead of the layer's (q, kv) band mask; the converted backbone verifies
    (outputs and gradients against the stock one) and the key/value heads reach the op unrepeated."""
    keras.utils.set_random_seed(2)
    M = keras_hub.models
    small = dict(vocabulary_size=1000, num_layers=2, hidden_dim=64, intermediate_dim=128)
    if family == "qwen":
        bb = M.QwenBackbone(num_query_heads=4, num_key_value_heads=2, use_sliding_window_attention=True,
                            sliding_window_size=5, **small)
        windowed, kv_heads = [5, 5], 2
    else:  # Gemma slides in every other layer
        bb = M.GemmaBackbone(num_query_heads=4, num_key_value_heads=2, head_dim=16,
                             use_sliding_window_attention=True, sliding_window_size=5, **small)
        windowed, kv_heads = [5, 0], 2
    x = _ids()
    new = tfmetal_ext.convert(bb, inputs=x)
    assert new.conversion_report.verified

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            y = new(inputs, training=True)
        return tape.gradient(tf.reduce_sum(y), new.trainable_variables)

    graph = step.get_concrete_function({k: tf.constant(v) for k, v in x.items()}).graph
    attn = [op for op in graph.get_operations() if op.type == "TfmetalExt>Attention"]
    assert sorted(op.get_attr("sliding_window") for op in attn) == sorted(windowed)
    assert all(_op_kv_heads(op) == kv_heads for op in attn)
    assert not [op for op in graph.get_operations() if op.type == "MatrixBandPart"], "the layer's band mask was made"


def _op_kv_heads(op):
    """The key heads an attention op reads (its key's heads axis in the op's layout)."""
    return op.inputs[1].shape.as_list()[2 if op.get_attr("layout") == b"BSHD" else 1]


def test_unrepeated_reads_through_keras_and_tf_repeat_only():
    """`_unrepeated` finds the tensor a heads-axis repeat was made from (keras.ops.repeat and tf.repeat:
    each head repeated consecutively, the op's grouped-query layout) and nothing else."""
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, None, 2, 4])])
    def f(x):
        seen["keras"] = kh._unrepeated(keras.ops.repeat(x, 3, axis=2)) is x
        seen["tf"] = kh._unrepeated(tf.repeat(x, 2, axis=2)) is x
        seen["sequence axis"] = kh._unrepeated(tf.repeat(x, 2, axis=1)) is x
        seen["tiled"] = kh._unrepeated(tf.tile(x, [1, 1, 2, 1])) is x  # heads 0 1 0 1: not the op's layout
        seen["plain"] = kh._unrepeated(x * 2.0) is x
        return x

    f.get_concrete_function()
    assert seen == {"keras": True, "tf": True, "sequence axis": False, "tiled": False, "plain": False}
    x = tf.ones([1, 1, 2, 4])
    assert kh._unrepeated(tf.repeat(x, 2, axis=2)).shape == (1, 1, 4, 4)  # eagerly: no graph, the tensor itself


# ----------------------------------------------------------------------------
# The output head: a decoding step's logits as one TfmetalExt>Gemv.


def _head_pair(**kwargs):
    keras.utils.set_random_seed(4)
    stock = keras.layers.ReversibleEmbedding(50, 16, tie_weights=False, **kwargs)
    stock.build((None, None))
    stock.reverse_embeddings.assign(tf.random.normal(stock.reverse_embeddings.shape))
    return stock, _retyped_copy(stock, np.zeros((1, 3), "int32"))


@pytest.mark.parametrize("kwargs", [{}, dict(logit_soft_cap=5.0), dict(reverse_dtype="float32")],
                         ids=["plain", "soft_cap", "reverse_dtype"])
def test_head_decoding_step_is_one_gemv_with_the_stock_logits(kwargs):
    from tfmetal_ext.backends import fusion
    from tfmetal_ext.ops.gemv import uses_kernel

    if not uses_kernel():
        pytest.skip("the op library is not loaded here (TFMETAL_EXT_REFERENCE_OPS or no compiler)")
    stock, fused = _head_pair(**kwargs)
    assert type(fused) is kh.FUSED[type(stock)]
    for shape, routed in (((2, 1, 16), True), ((2, 5, 16), False), ((2, 16), False)):
        x = tf.constant(np.random.default_rng(1).normal(size=shape), tf.float32)
        types = _traced_ops(tf.function(lambda x: fused(x, reverse=True)), x)
        assert (fusion.GEMV_OP in types) == routed, shape
        # One float32 sum of 16 products per logit in another order than TF's MatMul: a few ulps.
        np.testing.assert_allclose(fused(x, reverse=True).numpy(), stock(x, reverse=True).numpy(),
                                   rtol=1e-5, atol=1e-5)
    ids = tf.constant([[1, 7, 49]])
    np.testing.assert_array_equal(fused(ids).numpy(), stock(ids).numpy())  # the embedding itself is stock's


def test_head_with_tied_weights_is_kept_with_the_reason():
    ids = keras.Input((None,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(50, 16, tie_weights=True, name="tied")
    h = emb(ids)
    model = keras.Model(ids, emb(h, reverse=True))
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    assert type(new.get_layer("tied")) is keras.layers.ReversibleEmbedding
    assert any(k.name == "tied" and "tied weights" in k.reason for k in new.conversion_report.kept)
