"""keras-hub integration: its transformers' RMS norms and attention on tfmetal_ext's ops (extra ``[hub]``).

keras-hub's models (``LlamaCausalLM``, ``GPT2CausalLM``, ``GemmaCausalLM``, ...)
keep their own layer classes, which `convert()` otherwise keeps whole. This
module registers conversion planners for them, keyed by class like every
planner. Each maps a keras-hub class to a **fusion-first subclass** of it
(a ``retype`` plan): the same constructor arguments, sublayers, weights,
config and cache handling, with only the computation that has a fused op
replaced:

* RMS norms (`HUB_RMS_NORMS`): ``call`` is one ``TfmetalExt>RMSNorm`` op
  forward and one ``TfmetalExt>RMSNormGrad`` backward
  (`tfmetal_ext.ops.rms_norm`), with each class's convention: the scale as
  stored (Llama, Mistral, Qwen, Phi-3, ...) or ``1 + scale`` (Gemma), the
  result in the compute dtype or the input's (Qwen 3).
* Rotary embeddings (`HUB_ROPES`): ``call`` is one ``TfmetalExt>Rope`` op
  forward and one ``TfmetalExt>RopeGrad`` backward (`tfmetal_ext.ops.rope`):
  keras-hub's ``RotaryEmbedding`` (linear, dynamic, YaRN) and Llama's
  (Llama 3 frequency scaling), where the stock layer is a dozen ops each way.
* Attention (`HUB_ATTENTION`): ``_compute_attention`` is the flash-style
  ``TfmetalExt>Attention`` op (`tfmetal_ext.ops.attention`), which never
  stores the query x key score matrix. Projections, rotary embedding, the KV
  cache of ``generate()`` and grouped-query head sharing stay the layer's own
  code, so training and cached decoding both take the op.

* Output heads (`HUB_HEADS`): keras-hub's ``ReversibleEmbedding`` with its
  own output matrix (``tie_weights=False``: Llama, Mistral; the tied ones are
  kept) computes a decoding step's logits (one position per sequence, a few
  sequences) as one ``TfmetalExt>Gemv`` where the backend table takes it
  (`tfmetal_ext.ops.gemv`), and runs the stock code for every other call.
* Decoder blocks (`HUB_DECODERS`): the method that makes the self-attention
  mask (``_compute_self_attention_mask``; Gemma's ``_compute_attention_mask``)
  still returns keras-hub's own ``(batch, q, kv)`` mask, and also hands the fused
  self-attention layer its factors (the keys' padding and the causal
  offset). Where that layer receives this very mask, the op takes the
  padding as a ``(batch, 1, 1, kv)`` mask and computes causality itself, so
  a train step holds no ``(q, kv)`` mask: TF prunes the unused stock one.

Where a layer is configured in a way the op does not compute (Gemma's logit
soft-capping), the planner keeps it and says why; where a call is (an input
dtype or head size the op does not take), the subclass runs the stock code
for that call, and so does a call traced for XLA (``jit_compile=True``, as
keras-hub's own layer tests compile), which has no kernels for the ops. A
query row that attends no key gives what the stock layer gives (zeros from
keras-hub's masked softmax; the values' mean from Keras'
``dot_product_attention``).

The subclasses are registered Keras serializables (``tfmetal_ext>Fused...``)
that keep their base class's ``__name__``, so a converted model's weights are
saved under the stock model's paths: a saved converted backbone or task, which
keras-hub re-makes from its constructor arguments, loads with keras-hub's own
layers and the trained weights (``convert()`` it again for the fused form).
`convert()` imports this module when keras-hub is imported
(`tfmetal_ext.integrations.load_available`).

Usage::

    import keras_hub, tfmetal_ext
    causal_lm = keras_hub.models.LlamaCausalLM(backbone=..., preprocessor=None)
    fused = tfmetal_ext.convert(causal_lm)   # fused.conversion_report: what changed
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import types

import keras
import keras_hub  # noqa: F401  (this module is only imported with keras-hub installed)
import numpy as np
import tensorflow as tf

from tfmetal_ext.conversion import planners
from tfmetal_ext.layers._ops import gemv_rows
from tfmetal_ext.ops._common import FLOAT_DTYPES, stock_code_reason
from tfmetal_ext.ops.attention import MAX_HEAD_DIM as _MAX_HEAD_DIM
from tfmetal_ext.ops.attention import _check_sliding_window, attention
from tfmetal_ext.ops.gemv import gemv
from tfmetal_ext.ops.rms_norm import epsilon_reason, rms_norm
from tfmetal_ext.ops.rope import rope


# ----------------------------------------------------------------------------
# The data: which keras-hub class maps to which fused subclass, with its convention.


@dataclasses.dataclass(frozen=True)
class HubRMSNorm:
    """A keras-hub RMS-norm class: ``y = x / sqrt(mean(x^2) + epsilon) * g`` over the last axis, in float32.

    Attributes:
        path: the class, ``module:ClassName`` under ``keras_hub.src``.
        fused: the fusion-first subclass's name (registered as ``tfmetal_ext>{fused}``).
        weight: the attribute holding the scale variable.
        offset: ``g = offset + scale`` (0 for most, 1 for Gemma's zero-initialized scale).
        output: ``"compute"`` (cast to the layer's compute dtype) or ``"input"`` (to the input's).
    """

    path: str
    fused: str
    weight: str = "scale"
    offset: float = 0.0
    output: str = "compute"


@dataclasses.dataclass(frozen=True)
class HubHead:
    """A keras-hub embedding that is also the output head (``call(x, reverse=True)``: ``x @ W``).

    Attributes:
        path: the class, ``module:ClassName`` under ``keras_hub.src``, or ``keras:layers.ClassName``.
        fused: the fusion-first subclass's name.
    """

    path: str
    fused: str


@dataclasses.dataclass(frozen=True)
class HubAttention:
    """A keras-hub attention class whose ``_compute_attention`` the attention op replaces.

    Attributes:
        path: the class, ``module:ClassName`` under ``keras_hub.src``.
        fused: the fusion-first subclass's name.
        form: which ``_compute_attention`` signature the class has:
            ``"qkv_mask"`` (query, key, value, attention_mask; key/value heads already
            repeated; scale ``_inv_norm_factor``), ``"qkv_mask_window"`` (the same plus
            ``cache_update_index`` and Qwen's optional sliding window), ``"gemma"``
            (Gemma's: key/value heads not repeated, its query normalization, sliding
            window and probability dropout; logit soft-capping is kept stock),
            ``"keras_mha"`` (Keras MultiHeadAttention's, returning ``(output, scores)``).
    """

    path: str
    fused: str
    form: str


@dataclasses.dataclass(frozen=True)
class HubRope:
    """A keras-hub rotary-embedding class whose ``call`` the rope op replaces.

    Attributes:
        path: the class, ``module:ClassName`` under ``keras_hub.src``.
        fused: the fusion-first subclass's name.
        form: ``"rotary"`` (keras-hub's ``RotaryEmbedding``: linear, dynamic and
            YaRN scaling) or ``"llama"`` (``LlamaRotaryEmbedding``: Llama 3's
            frequency scaling when its four factors are set).
    """

    path: str
    fused: str
    form: str


HUB_RMS_NORMS = (
    HubRMSNorm("models.llama.llama_layernorm:LlamaLayerNorm", "FusedLlamaLayerNorm"),
    HubRMSNorm("models.mistral.mistral_layer_norm:MistralLayerNormalization", "FusedMistralLayerNormalization"),
    HubRMSNorm("models.mixtral.mixtral_layer_norm:MixtralLayerNormalization", "FusedMixtralLayerNormalization"),
    HubRMSNorm("models.qwen.qwen_layernorm:QwenLayerNorm", "FusedQwenLayerNorm"),
    HubRMSNorm("models.qwen_moe.qwen_moe_layernorm:QwenMoeLayerNorm", "FusedQwenMoeLayerNorm"),
    HubRMSNorm("models.qwen3.qwen3_layernorm:Qwen3LayerNorm", "FusedQwen3LayerNorm", output="input"),
    HubRMSNorm("models.phi3.phi3_layernorm:Phi3LayerNorm", "FusedPhi3LayerNorm"),
    HubRMSNorm("models.gemma.rms_normalization:RMSNormalization", "FusedGemmaRMSNormalization", offset=1.0),
)

HUB_ATTENTION = (
    HubAttention("models.llama.llama_attention:LlamaAttention", "FusedLlamaAttention", "qkv_mask"),
    HubAttention("models.mistral.mistral_attention:CachedMistralAttention", "FusedCachedMistralAttention",
                 "qkv_mask"),
    HubAttention("models.mixtral.mixtral_attention:CachedMixtralAttention", "FusedCachedMixtralAttention",
                 "qkv_mask"),
    HubAttention("models.phi3.phi3_attention:Phi3Attention", "FusedPhi3Attention", "qkv_mask"),
    HubAttention("models.qwen.qwen_attention:QwenAttention", "FusedQwenAttention", "qkv_mask_window"),
    HubAttention("models.qwen3.qwen3_attention:Qwen3Attention", "FusedQwen3Attention", "qkv_mask_window"),
    HubAttention("models.gemma.gemma_attention:CachedGemmaAttention", "FusedCachedGemmaAttention", "gemma"),
    HubAttention("layers.modeling.cached_multi_head_attention:CachedMultiHeadAttention",
                 "FusedCachedMultiHeadAttention", "keras_mha"),
)


@dataclasses.dataclass(frozen=True)
class HubDecoder:
    """A keras-hub decoder block whose self-attention mask is keras-hub's padding x causal mask.

    Its ``_compute_self_attention_mask`` (arguments ``decoder_sequence``, ``decoder_padding_mask``,
    ``decoder_attention_mask``, ``self_attention_cache``, ``self_attention_cache_update_index``, and
    ``use_causal_mask`` where it has one) returns ``min(merge_padding_and_attention_mask(...),
    compute_causal_mask(...))``, and its ``_self_attention_layer`` takes that mask as is.

    Attributes:
        path: the class, ``module:ClassName`` under ``keras_hub.src``.
        fused: the fusion-first subclass's name.
        window: the attribute of a sliding window the block's own mask applies (Mistral's and
            Mixtral's ``sliding_window``), or None. The factors carry it: the op applies the band
            itself (without a cache), or the inference-time band mask includes it.
        mask_method: the block's method that makes the mask (Gemma's: ``_compute_attention_mask``).
        attention: the block's attribute holding its self-attention layer (Gemma's: ``attention``).
        arguments: ``(block's name, name above)`` for the mask method's arguments named otherwise
            (Gemma's ``x``, ``padding_mask``, ``cache``, ``cache_update_index``; its mask is always causal).
    """

    path: str
    fused: str
    window: str = None
    mask_method: str = "_compute_self_attention_mask"
    attention: str = "_self_attention_layer"
    arguments: tuple = ()


HUB_DECODERS = (
    HubDecoder("layers.modeling.transformer_decoder:TransformerDecoder", "FusedTransformerDecoder"),
    HubDecoder("models.llama.llama_decoder:LlamaTransformerDecoder", "FusedLlamaTransformerDecoder"),
    HubDecoder("models.mistral.mistral_transformer_decoder:MistralTransformerDecoder",
               "FusedMistralTransformerDecoder", window="sliding_window"),
    HubDecoder("models.mixtral.mixtral_decoder:MixtralTransformerDecoder", "FusedMixtralTransformerDecoder",
               window="sliding_window"),
    HubDecoder("models.qwen.qwen_decoder:QwenTransformerDecoder", "FusedQwenTransformerDecoder"),
    HubDecoder("models.qwen3.qwen3_decoder:Qwen3TransformerDecoder", "FusedQwen3TransformerDecoder"),
    HubDecoder("models.gemma.gemma_decoder_block:GemmaDecoderBlock", "FusedGemmaDecoderBlock",
               mask_method="_compute_attention_mask", attention="attention",
               arguments=(("x", "decoder_sequence"), ("padding_mask", "decoder_padding_mask"),
                          ("cache", "self_attention_cache"), ("cache_update_index", "self_attention_cache_update_index"))),
)

HUB_ROPES = (
    HubRope("layers.modeling.rotary_embedding:RotaryEmbedding", "FusedRotaryEmbedding", "rotary"),
    HubRope("models.llama.llama_rotary_embedding:LlamaRotaryEmbedding", "FusedLlamaRotaryEmbedding", "llama"),
)

# keras-hub's output heads with their own matrix: path -> the fusion-first subclass's name.
HUB_HEADS = (
    # Keras' own class (keras-hub's models build it since Keras 3.12), and keras-hub's subclass of it.
    HubHead("keras:layers.ReversibleEmbedding", "FusedReversibleEmbedding"),
    HubHead("layers.modeling.reversible_embedding:ReversibleEmbedding", "FusedHubReversibleEmbedding"),
)

# Classes of the tables that this keras-hub does not have: path -> why (ops.status-style facts).
MISSING = {}
# keras-hub class -> its fusion-first subclass (filled below from the tables).
FUSED = {}


def _resolve(path):
    """The class at `path`: ``module:Name`` under ``keras_hub.src``, or ``keras:dotted.Name`` in Keras."""
    if path.startswith("keras:"):
        obj = keras
        try:
            for part in path[len("keras:"):].split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError as e:
            MISSING[path] = f"not in this Keras ({type(e).__name__}: {e})"
            return None
    module, name = path.split(":")
    try:
        return getattr(importlib.import_module(f"keras_hub.src.{module}"), name)
    except (ImportError, AttributeError) as e:
        MISSING[path] = f"not in this keras-hub ({type(e).__name__}: {e})"
        return None


def _subclass(base, name, namespace, doc):
    """`name`, a subclass of `base` with `namespace`'s methods, registered as ``tfmetal_ext>{name}``.

    Its ``__name__`` stays the base class's: Keras names a model's weights by class name
    (``layers/llama_layer_norm``), so a converted model's file holds the stock model's
    weight paths and loads into either; its ``__qualname__`` and ``fused_name`` are `name`,
    its registered name ``tfmetal_ext>{name}`` and its module this one.
    """
    namespace = dict(namespace, fused_name=name)
    cls = types.new_class(base.__name__, (base,), exec_body=lambda ns: ns.update(namespace))
    cls.__module__ = __name__
    cls.__qualname__ = name
    cls.__doc__ = doc
    globals()[name] = cls
    return keras.saving.register_keras_serializable(package="tfmetal_ext", name=name)(cls)


# ----------------------------------------------------------------------------
# RMS norms.


def _rms_norm_class(spec, base):
    def call(self, x):
        x = tf.convert_to_tensor(x)
        if x.dtype not in FLOAT_DTYPES or x.shape.rank == 0 or stock_code_reason() \
                or epsilon_reason(getattr(self, "epsilon", None)) is not None:
            return base.call(self, x)
        # The scale as the stock call reads it (autocast to the compute dtype under a mixed
        # policy), then float32, the stock computation's dtype.
        gamma = tf.cast(getattr(self, spec.weight), tf.float32)
        if spec.offset:
            gamma = gamma + tf.constant(spec.offset, tf.float32)
        y = rms_norm(x, gamma, epsilon=self.epsilon)
        out = self.compute_dtype if spec.output == "compute" else x.dtype
        return tf.cast(y, out) if y.dtype != tf.as_dtype(out) else y

    doc = (f"`{base.__module__}.{base.__name__}` whose call is one RMS-norm op each way "
           f"(`tfmetal_ext.ops.rms_norm`, scale {'1 + ' if spec.offset else ''}`{spec.weight}`); "
           "the same constructor, weight, config and outputs.")
    return _subclass(base, spec.fused, {"call": call}, doc)


# ----------------------------------------------------------------------------
# Rotary embeddings.


def _rope_arguments(layer, form):
    """`tfmetal_ext.ops.rope`'s keyword arguments for `layer`'s configuration, or None (stock runs)."""
    common = dict(max_wavelength=layer.max_wavelength, sequence_axis=layer.sequence_axis,
                  feature_axis=layer.feature_axis)
    if form == "llama":
        factors = dict(frequency_adjustment_factor=layer.frequency_adjustment_factor,
                       low_freq_factor=layer.low_freq_factor, high_freq_factor=layer.high_freq_factor,
                       pretraining_sequence_length=layer.pretraining_sequence_length)
        if layer.low_freq_factor is None:
            return dict(common, scaling_factor=layer.scaling_factor, rope_type="linear")
        if layer.position_scaling_factor != 1.0:
            return None  # Llama 3 scaling with a position scale: left to the stock layer
        return dict(common, rope_type="llama3", **factors)
    return dict(common, scaling_factor=layer.scaling_factor, rope_type=layer.rope_type,
                beta_fast=layer.beta_fast, beta_slow=layer.beta_slow,
                original_max_position_embeddings=layer.original_max_position_embeddings,
                truncate=layer.truncate, denominator_dim=layer.denominator_dim)


def _rope_class(spec, base):
    def call(self, inputs, start_index=0, positions=None):
        x = tf.convert_to_tensor(inputs)
        kwargs = _rope_arguments(self, spec.form)
        if kwargs is None or x.dtype not in FLOAT_DTYPES or stock_code_reason():
            return base.call(self, inputs, start_index=start_index, positions=positions)
        try:
            y = rope(x, positions, start_index=start_index, **kwargs)
        except ValueError:  # a configuration the op does not take: the stock layer's result (or error)
            return base.call(self, inputs, start_index=start_index, positions=positions)
        return y

    doc = (f"`{base.__module__}.{base.__name__}` whose call is one rope op each way "
           "(`tfmetal_ext.ops.rope`); the same constructor, config and outputs.")
    return _subclass(base, spec.fused, {"call": call}, doc)


# ----------------------------------------------------------------------------
# Attention.


def _call_reason(query, key, value, mask):
    """Why the op cannot take this call (the stock code runs), or None."""
    reason = stock_code_reason()
    if reason:
        return reason
    if any(t.shape.rank != 4 for t in (query, key, value)):
        return "inputs of rank other than 4"
    if query.dtype not in FLOAT_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"{query.dtype.name} inputs"
    dims = (query.shape[-1], value.shape[-1])
    if any(d is None or d > _MAX_HEAD_DIM for d in dims):
        return f"head/value dims {dims}: the attention op takes 1 to {_MAX_HEAD_DIM}"
    if query.shape[2] is None or key.shape[2] is None or query.shape[2] % key.shape[2]:
        return f"{query.shape[2]} query heads over {key.shape[2]} key heads"
    if mask is not None and mask.shape.rank != 3:
        return f"an attention mask of rank {mask.shape.rank} (the layer's masks are (batch, q, kv))"
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class MaskFactors:
    """What a keras-hub decoder block's self-attention mask is made of (`HUB_DECODERS`).

    Attributes:
        mask: the ``(batch, q, kv)`` mask the block computed: the attention layer uses the factors
            only when its ``attention_mask`` is this very tensor.
        keys: keras-hub's ``(batch, 1, kv)`` padding of the keys (``merge_padding_and_attention_mask``
            without a custom mask), or None for none.
        offset: the position of the first query row (the cache update index; 0 without a cache).
        cached: whether the keys are a cache (then ``q`` and ``kv`` lengths may differ).
        window: the block's sliding window (``HubDecoder.window``: query ``i`` attends keys
            ``j > i - window``), or 0 for none.
    """

    mask: object
    keys: object
    offset: object
    cached: bool
    window: int = 0


def _take_factors(layer, attention_mask):
    """The `MaskFactors` its decoder block handed `layer` for this `attention_mask`, or None (and none kept)."""
    factors = layer.__dict__.pop("_tfmetal_mask_factors", None)
    if factors is None or attention_mask is None or factors.mask is not attention_mask:
        return None
    return factors


def _factored_mask(factors, q_len, k_len, window=0):
    """``(causal, mask, window)`` for the op from `factors` and a sliding `window` (0: none): without a
    cache, the op's causal flag and window and the keys' padding as ``(batch, 1, 1, kv)``; with one,
    the rows' band ``offset + i - window < j <= offset + i`` (a ``(q, kv)`` inference-time mask, as
    keras-hub's) with the padding."""
    keys = None if factors.keys is None else tf.expand_dims(tf.cast(factors.keys, tf.bool), 1)
    if not factors.cached:
        return True, keys, window
    rows = tf.range(q_len) + tf.cast(factors.offset, tf.int32)
    cols = tf.range(k_len)[tf.newaxis, :]
    band = cols <= rows[:, tf.newaxis]
    if window:
        band = tf.logical_and(band, cols > rows[:, tf.newaxis] - window)
    band = band[tf.newaxis, tf.newaxis]
    return False, (band if keys is None else tf.logical_and(keys, band)), 0


def _unrepeated(t):
    """The tensor `t` (batch, seq, heads, dim) was made from by ``repeat(x, groups, axis=2)`` (keras-hub's
    layers repeat their key/value heads so before `_compute_attention`), read from the graph, or `t`.

    TensorFlow's repeat is ``Reshape(Tile(ExpandDims(x, 3), [1, 1, 1, groups, 1]))``: each head of `x`
    becomes `groups` consecutive heads, the op's grouped-query layout. Eagerly there is no graph: `t`.
    """
    if not tf.is_symbolic_tensor(t) or not hasattr(t, "op") or t.op.type != "Reshape":
        return t
    tile = t.op.inputs[0]
    if tile.op.type != "Tile" or tile.op.inputs[0].op.type != "ExpandDims":
        return t
    expand = tile.op.inputs[0].op
    x = expand.inputs[0]
    if x.shape.rank != 4 or tf.get_static_value(expand.inputs[1]) not in (3, -2):
        return t
    multiples = tile.op.inputs[1]
    static = tf.get_static_value(multiples)
    if static is None:  # a Pack of 1s but the repeat count
        if multiples.op.type != "Pack" or len(multiples.op.inputs) != 5:
            return t
        static = [tf.get_static_value(m) for m in multiples.op.inputs]
        static[3] = None
    if any(m is None or int(m) != 1 for i, m in enumerate(static) if i != 3):
        return t
    heads, kv_heads = t.shape[2], x.shape[2]
    if heads is None or kv_heads is None or kv_heads < 1 or heads % kv_heads or heads == kv_heads:
        return t
    if static[3] is not None and int(static[3]) * kv_heads != heads:
        return t
    if any(a is not None and b is not None and a != b for a, b in zip(t.shape[:2] + t.shape[3:],
                                                                      x.shape[:2] + x.shape[3:])):
        return t
    return x


def attend(query, key, value, mask, scale, dropout_rate=0.0, seed=None, empty_rows="zero", factors=None,
           window=0):
    """keras-hub's attention on the attention op: ``(batch, seq, heads, dim)`` in and out.

    Key/value heads that are fewer than the query heads (grouped-query
    attention) are shared by consecutive query heads, as keras-hub's layers
    repeat them; the op reads them in place (no repeated copy is made or kept
    for the backward pass). `mask` is keras-hub's ``(batch, q, kv)`` attend
    mask (any dtype, nonzero = attend) or None; with `factors` (`MaskFactors`
    of that mask) the op gets them instead and `mask` is not read. `window`:
    a sliding window the op applies (query ``i`` attends keys ``j`` with
    ``|i - j| < window``, rows counted from the cache offset of `factors`), 0
    for none; without `factors` the caller passes one only where query row 0
    is position 0 (no cache offset). A query row that
    attends no key gives ``empty_rows``: ``"zero"`` (the op's own result; what
    Keras' masked ``Softmax`` layer gives, which keras-hub's layers use) or
    ``"mean"`` (the mean of the values: Keras' ``dot_product_attention``,
    which Keras' MultiHeadAttention uses when it has no dropout).
    """
    if query.shape[2] == key.shape[2] == value.shape[2]:  # heads the layer repeated: the op reads them once
        key_in, value_in = _unrepeated(key), _unrepeated(value)
        if key_in.shape[2] == value_in.shape[2]:
            key, value = key_in, value_in
    groups = query.shape[2] // key.shape[2]
    causal, attend_mask = False, None
    if factors is not None:
        causal, attend_mask, window = _factored_mask(factors, tf.shape(query)[1], tf.shape(key)[1],
                                                     window or factors.window)
    elif mask is not None:
        attend_mask = tf.expand_dims(tf.cast(mask, tf.bool), 1)  # (batch, 1, q, kv)
    kwargs = {"dropout_rate": dropout_rate, "seed": seed} if dropout_rate > 0 else {}
    # (batch, seq, heads, dim) in and out, as keras-hub's projections write and read it: the op works
    # in that layout, so no transposed copy is made or kept for the backward pass.
    out = attention(query, key, value, mask=attend_mask, causal=causal, scale=float(scale), layout="BSHD",
                    sliding_window=int(window) or None, **kwargs)
    if attend_mask is not None and empty_rows == "mean":
        if causal:  # row i attends a key when one of keys 0..i is not padding: (batch, 1, 1, q)
            attended = tf.cumsum(tf.cast(attend_mask, tf.int32), axis=-1) > 0
        else:  # (batch, 1, q, 1)
            attended = tf.reduce_any(attend_mask, axis=-1, keepdims=True)
        attended = tf.transpose(attended, [0, 3, 1, 2] if causal else [0, 2, 1, 3])  # (batch, q, 1, 1)
        mean = tf.cast(tf.reduce_mean(tf.cast(value, tf.float32), axis=1, keepdims=True), value.dtype)
        if groups > 1:  # (batch, 1, kv heads, dim) -> one per query head
            mean = tf.repeat(mean, groups, axis=2)
        out = tf.where(attended, out, mean)
    return out


def _op_window(window):
    """`window` as the attention op's ``sliding_window`` (an int), or None where the op does not take it."""
    try:
        return _check_sliding_window(window) or None
    except ValueError:
        return None


def _window_in_op(window, query, key, factors, cache_update_index):
    """`window` (a layer's sliding window) when the op can apply it, else None (the layer's own band
    mask is made). The op counts rows from the cache offset of `factors`; without factors, from 0: the
    call must then have no offset (no update index, or 0, and as many queries as keys)."""
    window = _op_window(window)
    if window is None:
        return None
    if factors is not None:
        return int(window)
    no_offset = cache_update_index is None or (isinstance(cache_update_index, (int, np.integer))
                                               and int(cache_update_index) == 0)
    same = query.shape[1] is not None and query.shape[1] == key.shape[1]
    return int(window) if no_offset and same else None


# The attribute a fused Gemma attention sets during an uncached call: its rotary embedding skips the
# interleave (see `_attention_class`).
_ROPE_ONLY = "_tfmetal_rope_only"


def _attention_class(spec, base):
    def run(self, query, key, value, attention_mask, factors=None, window=0):
        out = attend(query, key, value, attention_mask, self._inv_norm_factor, factors=factors, window=window)
        return tf.cast(out, self.compute_dtype)

    if spec.form == "qkv_mask":

        def _compute_attention(self, query, key, value, attention_mask=None):
            factors = _take_factors(self, attention_mask)
            if _call_reason(query, key, value, attention_mask) is not None:
                return base._compute_attention(self, query, key, value, attention_mask)
            return run(self, query, key, value, attention_mask, factors)

    elif spec.form == "qkv_mask_window":

        def _compute_attention(self, query, key, value, attention_mask=None, cache_update_index=None):
            factors = _take_factors(self, attention_mask)
            if _call_reason(query, key, value, attention_mask) is not None:
                return base._compute_attention(self, query, key, value, attention_mask, cache_update_index)
            window = 0
            if self.use_sliding_window_attention and attention_mask is not None:
                window = _window_in_op(self.sliding_window_size, query, key, factors, cache_update_index)
                if window is None:
                    # The band the stock (unfused) path applies, made by the layer's own method.
                    attention_mask = self._mask_sliding_window(
                        attention_mask, cache_update_index=cache_update_index if cache_update_index else 0)
                    factors, window = None, 0
            return run(self, query, key, value, attention_mask, factors, window)

    elif spec.form == "gemma":

        def _compute_attention(self, q, k, v, attention_mask, training=False, cache_update_index=0):
            factors = _take_factors(self, attention_mask)
            rate = float(self.dropout) if training and self.dropout else 0.0
            if self.logit_soft_cap is not None or rate >= 1.0 \
                    or _call_reason(q, k, v, attention_mask) is not None:
                return base._compute_attention(self, q, k, v, attention_mask, training=training,
                                               cache_update_index=cache_update_index)
            width = self.head_dim if self.query_head_dim_normalize else self.hidden_dim // self.num_query_heads
            window = 0
            if self.use_sliding_window_attention and attention_mask is not None:
                window = _window_in_op(self.sliding_window_size, q, k, factors, cache_update_index)
                if window is None:
                    attention_mask = self._mask_sliding_window(attention_mask, cache_update_index=cache_update_index)
                    factors, window = None, 0
            # Gemma drops the probabilities (its dropout_layer, on (batch, kv heads, groups, q, kv):
            # the (batch, heads, q, kv) order the op draws in).
            seed = self.dropout_layer.seed_generator if rate > 0 else None
            out = attend(q, k, v, attention_mask, 1.0 / np.sqrt(width), rate, seed, factors=factors, window=window)
            return tf.cast(out, self.compute_dtype)

        # After its rotary embedding Gemma interleaves the two halves of the head dim
        # (``reshape(stack(split(x, 2), -1))``: a Split and a Pack forward, an Unpack and a Concat
        # backward, per query and key). It is one permutation of the head dim of both query and
        # key, and the scores are dot products over that dim, so the attention's output is the same
        # without it (to the summation order). Where the keys stay inside the call (no cache), the
        # layer skips it; a cache keeps Gemma's layout, as it is the call's output.
        call_signature = inspect.signature(base.call)

        @functools.wraps(base.call)  # Keras reads the call's arguments from its signature
        def call(self, *args, **kwargs):
            arguments = call_signature.bind(self, *args, **kwargs).arguments
            previous = self.__dict__.get(_ROPE_ONLY, False)
            object.__setattr__(self, _ROPE_ONLY, arguments.get("cache") is None)
            try:
                return base.call(self, *args, **kwargs)
            finally:
                object.__setattr__(self, _ROPE_ONLY, previous)

        def _apply_rope(self, x, start_index, positions=None):
            if positions is None and self.__dict__.get(_ROPE_ONLY, False):
                return self.rope_layer(x, start_index=start_index)
            # A cache, or vLLM's paged one (`positions`): Gemma's layout.
            return base._apply_rope(self, x, start_index, **({} if positions is None else {"positions": positions}))

        doc = (f"`{base.__module__}.{base.__name__}` whose `_compute_attention` runs the flash-style "
               "attention op (`tfmetal_ext.ops.attention`); projections, rotary embedding and KV cache are "
               "the layer's own, and without a cache the query and key skip Gemma's interleave of the "
               "head dim's halves (a permutation of both: the same scores). The same constructor, "
               "weights, config and outputs.")
        return _subclass(base, spec.fused, {"_compute_attention": _compute_attention, "call": call,
                                            "_apply_rope": _apply_rope}, doc)

    else:  # keras_mha

        def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                               return_attention_scores=False, **kwargs):
            factors = _take_factors(self, attention_mask)
            if return_attention_scores or kwargs.get("use_causal_mask") \
                    or _call_reason(query, key, value, attention_mask) is not None \
                    or tuple(getattr(self, "_attention_axes", None) or (1,)) != (1,):
                return base._compute_attention(
                    self, query, key, value, attention_mask=attention_mask, training=training,
                    return_attention_scores=return_attention_scores, **kwargs)
            # Attention dropout inside the op, at the rate of the stock sublayer that drops the
            # probabilities and from its generator: the same mask.
            layer_rate = float(getattr(self._dropout_layer, "rate", 0.0))
            rate = layer_rate if training and layer_rate > 0 else 0.0
            if rate >= 1.0:
                return base._compute_attention(
                    self, query, key, value, attention_mask=attention_mask, training=training,
                    return_attention_scores=return_attention_scores, **kwargs)
            seed = self._dropout_layer.seed_generator if rate > 0 else None
            # Keras' MultiHeadAttention takes dot_product_attention (rows attending no key: the
            # values' mean) unless it was made with dropout (its masked Softmax layer: zeros).
            empty = "mean" if self._dropout == 0 else "zero"
            out = attend(query, key, value, attention_mask, self._inverse_sqrt_key_dim, rate, seed, empty,
                         factors=factors)
            return tf.cast(out, self.compute_dtype), None

    doc = (f"`{base.__module__}.{base.__name__}` whose `_compute_attention` runs the flash-style "
           "attention op (`tfmetal_ext.ops.attention`); projections, rotary embedding and KV cache are "
           "the layer's own. The same constructor, weights, config and outputs.")
    return _subclass(base, spec.fused, {"_compute_attention": _compute_attention}, doc)


# ----------------------------------------------------------------------------
# Output heads: a decoding step's logits as one TfmetalExt>Gemv.


def _head_class(spec, base):
    def call(self, inputs, reverse=False):
        if not reverse or self.tie_weights or self.quantization_mode is not None or stock_code_reason():
            return base.call(self, inputs, reverse=reverse)
        x = tf.convert_to_tensor(inputs)
        kernel = self.reverse_embeddings
        if self.reverse_dtype is not None:
            x = tf.cast(x, self.reverse_dtype)
        if x.dtype not in FLOAT_DTYPES or x.shape.rank is None or not gemv_rows(x.shape, x.shape.rank - 1, x.dtype):
            return base.call(self, inputs, reverse=reverse)
        # The stock call's math: inputs @ the output matrix (cast as the call reads it), then the
        # optional soft cap, with the product as one op.
        logits = gemv(x, tf.cast(kernel, x.dtype))
        if self.logit_soft_cap is not None:
            cap = self.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
        return logits

    doc = (f"`{base.__module__}.{base.__name__}` whose reverse call (the output head) computes a decoding "
           "step's logits, one position per sequence for a few sequences, as one `TfmetalExt>Gemv` "
           "(`tfmetal_ext.ops.gemv`) where the backend table takes it; every other call is the stock one. The "
           "same constructor, weights, config and outputs.")
    return _subclass(base, spec.fused, {"call": call}, doc)


# ----------------------------------------------------------------------------
# Decoder blocks: the self-attention mask's factors handed to the fused attention layer.


def _decoder_class(spec, base):
    from keras_hub.src.layers.modeling.transformer_layer_utils import merge_padding_and_attention_mask

    method = getattr(base, spec.mask_method)
    signature = inspect.signature(method)
    renamed = dict(spec.arguments)

    def factors_of(self, mask, args):
        if mask is None or args.get("decoder_attention_mask") is not None or not args.get("use_causal_mask", True):
            return None  # a custom (q, kv) mask, or no causality: the stock mask as it is
        cache = args.get("self_attention_cache")
        window = getattr(self, spec.window, None) if spec.window else None
        if window is not None and _op_window(window) is None:
            return None  # a band the op does not take: the stock mask
        keys = merge_padding_and_attention_mask(args["decoder_sequence"], args.get("decoder_padding_mask"), None)
        index = args.get("self_attention_cache_update_index")
        return MaskFactors(mask, keys, 0 if index is None else index, cache is not None, _op_window(window) or 0)

    def compute_mask(self, *args, **kwargs):
        mask = method(self, *args, **kwargs)
        attention = getattr(self, spec.attention, None)
        if hasattr(type(attention), "fused_name") and type(attention).__mro__[1] in FUSED:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {renamed.get(k, k): v for k, v in bound.arguments.items()}
            object.__setattr__(attention, "_tfmetal_mask_factors", factors_of(self, mask, arguments))
        return mask

    doc = (f"`{base.__module__}.{base.__name__}` whose self-attention mask also reaches its fused attention "
           "layer as factors (the keys' padding, causality, the cache offset), so the attention op computes "
           "causality itself and no (q, kv) mask is kept for the backward pass. The same constructor, weights, "
           "config and outputs.")
    compute_mask.__name__ = compute_mask.__qualname__ = spec.mask_method
    return _subclass(base, spec.fused, {spec.mask_method: compute_mask}, doc)


# ----------------------------------------------------------------------------
# Planners.


def _plan_rms_norm(ctx, node):
    layer = node.operation
    why = epsilon_reason(getattr(layer, "epsilon", None))
    if why:
        return planners.keep(node, f"{why}: the stock computation is kept")
    return planners.retype(ctx, node, FUSED[type(layer)])


def _plan_rope(ctx, node):
    layer = node.operation
    spec = next(r for r in HUB_ROPES if FUSED.get(type(layer)) is not None and r.fused == FUSED[type(layer)].fused_name)
    if _rope_arguments(layer, spec.form) is None:
        return planners.keep(node, "Llama 3 frequency scaling with position_scaling_factor != 1: the stock "
                                   "rotary embedding is kept")
    return planners.retype(ctx, node, FUSED[type(layer)])


def _plan_attention(ctx, node):
    layer = node.operation
    if getattr(layer, "logit_soft_cap", None) is not None:
        return planners.keep(node, "logit soft-capping (tanh of the scores) is not computed by the attention op: "
                                   "the stock attention is kept")
    return planners.retype(ctx, node, FUSED[type(layer)])


def _plan_head(ctx, node):
    layer = node.operation
    if layer.tie_weights:
        return planners.keep(node, "tied weights: the head reads the embeddings transposed, which TfmetalExt>Gemv "
                                   "does not; the stock layer is kept")
    if layer.quantization_mode is not None:
        return planners.keep(node, f"quantization mode {layer.quantization_mode!r}: the stock layer is kept")
    return planners.retype(ctx, node, FUSED[type(layer)])


def _plan_decoder(ctx, node):
    return planners.retype(ctx, node, FUSED[type(node.operation)])


def _register():
    for spec in HUB_RMS_NORMS:
        base = _resolve(spec.path)
        if base is not None:
            FUSED[base] = _rms_norm_class(spec, base)
            planners.register_planner(base)(_plan_rms_norm)
    for spec in HUB_ROPES:
        base = _resolve(spec.path)
        if base is not None:
            FUSED[base] = _rope_class(spec, base)
            planners.register_planner(base)(_plan_rope)
    for spec in HUB_ATTENTION:
        base = _resolve(spec.path)
        if base is not None:
            FUSED[base] = _attention_class(spec, base)
            planners.register_planner(base)(_plan_attention)
    for spec in HUB_DECODERS:
        base = _resolve(spec.path)
        if base is not None:
            FUSED[base] = _decoder_class(spec, base)
            planners.register_planner(base)(_plan_decoder)
    for spec in HUB_HEADS:
        base = _resolve(spec.path)
        if base is not None:
            FUSED[base] = _head_class(spec, base)
            planners.register_planner(base)(_plan_head)


_register()
