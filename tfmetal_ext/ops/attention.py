"""attention: softmax attention as one op forward (``TfmetalExt>Attention``), one op backward."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common
from tfmetal_ext.ops import dropout as _dropout

ATTENTION_OP = fusion.ATTENTION_OP
ATTENTION_GRAD_OP = fusion.ATTENTION_GRAD_OP

# The kernels keep a query row's head (and a value row) in registers/tiles.
MAX_HEAD_DIM = 256
# Positions and the window are added in 32-bit unsigned arithmetic (tfmetal/attention.h).
_MAX_WINDOW = 2**31 - 1


@tf.autograph.experimental.do_not_convert  # plain graph building; also keeps autograph out of the loader
def attention(query, key, value, *, mask=None, causal=False, scale=None, dropout_rate=0.0, seed=None, name=None,
              heads_last=False, sliding_window=None, layout="BHSD"):
    """Scaled dot-product softmax attention, flash-style.

    ``output = softmax(scale * query @ key^T, masked) @ value`` per batch
    and head, with the softmax over the keys. The kernel never stores the
    (query, key) score matrix: it walks key tiles with an online softmax
    (running max and sum in float32 whatever the input dtype) and saves the
    per-row log-sum-exp, from which the gradient op (``TfmetalExt>AttentionGrad``)
    recomputes the probabilities tile by tile. Memory is
    O(batch * heads * seq * head_dim) in both directions. CPU kernel here; a
    Metal kernel on Apple GPUs.

    A query row that attends no key (every key masked out, or no keys) gives
    an output row of 0 and zero gradients, never NaN.

    Grouped-query attention: `key` and `value` may have fewer heads than
    `query`, a number dividing its heads; query head ``h`` then reads
    key/value head ``h // (heads // kv_heads)``, as if each key/value head
    were repeated for its consecutive query heads (keras-hub's
    ``repeat(key, groups, axis=heads)``), without the repeated copies: the
    gradient of a key/value head is the sum over the query heads that read it.

    Attention dropout (``dropout_rate > 0``) drops the normalized
    probabilities inside the kernels: ``P -> P * mask / (1 - rate)``, the
    softmax itself (and the saved log-sum-exp) of the undropped scores. The
    mask is that of ``tf.nn.experimental.stateless_dropout`` of a
    ``(batch, heads, q_seq, kv_seq)`` tensor of `query`'s dtype with `seed`
    (Philox, counter-based), bit for bit: what `keras.layers.Dropout` draws
    on the softmax output of stock `keras.layers.MultiHeadAttention`. The
    backward op draws it again from the seed: it is never stored.

    Args:
        query: (batch, heads, q_seq, head_dim), float32, float16 or bfloat16
            ((batch, q_seq, heads, head_dim) with ``layout="BSHD"``, and so
            `key`, `value` and the output).
        key: (batch, kv_heads, kv_seq, head_dim), the dtype of `query`;
            `kv_heads` divides `query`'s heads (equal to them without
            grouped-query attention).
        value: (batch, kv_heads, kv_seq, value_dim), the dtype of `query`
            (`value_dim` may differ from `head_dim`).
        mask: None, or a boolean "attend" mask (True = attend, as in Keras)
            broadcastable to (batch, heads, q_seq, kv_seq) with each of its
            dimensions 1 or the full size; a mask of rank < 4 gets leading
            dimensions of 1 (numpy broadcasting), so a (q_seq, kv_seq) mask
            applies to every batch and head. No gradient flows to it.
        causal: query i attends key j only if j <= i (top-left aligned, as
            Keras' `use_causal_mask`), combined with `mask` by AND.
        sliding_window: None, or an int w >= 1: query i attends key j only
            if ``|i - j| < w`` (top-left aligned, combined by AND). With
            `causal`, each query attends itself and the w - 1 keys before
            it: the band of Mistral's, Gemma's and Qwen's sliding-window
            attention, computed in the kernels (no (q_seq, kv_seq) mask is
            made, and key tiles outside the band are skipped).
        scale: the score scale, a finite float > 0; None for 1/sqrt(head_dim).
        dropout_rate: the probability of dropping an attention probability,
            a Python float in [0, 1); 0 (the default) for no dropout.
        seed: the dropout's stateless seed, needed when ``dropout_rate > 0``:
            2 int32 or int64 values (a tensor or a list), or a
            `keras.random.SeedGenerator`, drawn once per call as
            `keras.random.dropout` draws it (see `tfmetal_ext.ops.dropout`).
            Not drawn when ``dropout_rate == 0``.
        name: optional op name.
        heads_last: return the output as (batch, q_seq, heads, value_dim),
            the layout an output projection reads. The gradient then keeps
            that tensor alone (it transposes it back for the gradient op),
            where a transpose after the op would keep both layouts of the
            output alive for the backward pass.
        layout: ``"BHSD"`` (the default: the shapes above) or ``"BSHD"``:
            `query`, `key`, `value` and the output with the sequence axis
            before the heads axis, (batch, seq, heads, dim), the layout a
            projection to heads (`EinsumDense` ``"btd,dnh->btnh"``) writes
            and an output projection reads. The kernels read and write that
            layout in place, so no transposed copy is made in either pass,
            and the values are those of ``"BHSD"`` bit for bit. `mask`
            still broadcasts to (batch, heads, q_seq, kv_seq), and the
            dropout mask is the same.

    Returns:
        A (batch, heads, q_seq, value_dim) tensor of `query`'s dtype
        ((batch, q_seq, heads, value_dim) with `heads_last` or
        ``layout="BSHD"``).

    Raises:
        ValueError: for a dtype other than float32/float16/bfloat16 or
            dtypes that differ, a rank other than 4, dimensions that do not
            agree, key/value heads that do not divide the query heads, a
            head or value dim outside [1, 256], a non-boolean mask
            or one that does not broadcast, a scale that is not a finite
            float > 0, a `sliding_window` that is not None or an int in
            [1, 2^31 - 1], a `dropout_rate` outside [0, 1), a seed that is
            missing (with ``dropout_rate > 0``) or not 2 int32/int64 values,
            or a `layout` other than ``"BHSD"`` and ``"BSHD"``.

    >>> q = tf.constant([[[[1.0, 0.0]]]])
    >>> k = tf.constant([[[[1.0, 0.0], [0.0, 1.0]]]])
    >>> v = tf.constant([[[[1.0], [3.0]]]])
    >>> np.round(attention(q, k, v, scale=math.log(3.0)).numpy(), 4)
    array([[[[1.5]]]], dtype=float32)
    """
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    layout = _check_layout(layout)
    _check_inputs(query, key, value, layout)
    causal = _check_causal(causal)
    if not isinstance(heads_last, bool):
        raise ValueError(f"Argument `heads_last` must be a bool. Received: heads_last={heads_last!r}")
    scale = _check_scale(scale, query.shape[-1])
    window = _check_sliding_window(sliding_window)
    mask = _attend_mask(mask, query, key, layout)
    rate, seed = _check_dropout(dropout_rate, seed)
    dropout = None
    if rate > 0.0:
        threshold, dropout_scale = _dropout.dtype_constants(rate, query.dtype)
        dropout = (seed, threshold, dropout_scale)
    if not uses_kernel():
        if layout == "BSHD":  # the reference computes in (batch, heads, seq, dim)
            query, key, value = (_to_heads_last(t) for t in (query, key, value))
        output = _with_reference_gradient(query, key, value, mask, causal, scale, dropout, window)
        return _to_heads_last(output) if heads_last or layout == "BSHD" else output
    lib = _common.library()
    seeds, attrs = [], dict(causal=causal, scale=scale)
    if layout == "BSHD":  # (batch, seq, heads, dim) in and out: already heads last
        attrs["layout"] = layout
        heads_last = False
    if window:
        attrs["sliding_window"] = window
    if dropout is not None:
        seeds, attrs = [seed], dict(attrs, dropout_rate=threshold, dropout_scale=dropout_scale)
    if heads_last:
        return _heads_last_call(lib, query, key, value, mask, seeds, attrs, name)
    output, _ = lib.tfmetal_ext_attention(query, key, value, mask, seeds, name=name, **attrs)
    return output


def _to_heads_last(x):
    """(batch, heads, seq, dim) <-> (batch, seq, heads, dim)."""
    return tf.transpose(x, [0, 2, 1, 3])


def _unfolded_heads_first(y, dy):
    """`y` (batch, seq, heads, dim) as (batch, heads, seq, dim) once `dy` exists, in a form grappler
    does not fold.

    ``transpose(transpose(output))`` is folded into ``output`` (even through an identity with a
    control dependency, which grappler moves aside), and ``output`` is then kept for the backward
    pass beside `y`. The same permutation on a rank-5 view is not recognised as the inverse; waiting
    for `dy` keeps the executor from making it during the forward pass."""
    with tf.control_dependencies([dy]):
        wide = tf.transpose(tf.expand_dims(y, -1), [0, 2, 1, 3, 4])
    return tf.squeeze(wide, -1)


def _heads_last_call(lib, query, key, value, mask, seeds, attrs, name):
    """The op, its output transposed to (batch, q_seq, heads, value_dim), with a gradient that keeps that
    tensor (and the op's inputs and lse) only: the op's own-layout output is transposed back from it in
    the backward pass instead of being kept alongside."""

    @tf.custom_gradient
    def run(q, k, v):
        output, lse = lib.tfmetal_ext_attention(q, k, v, mask, seeds, name=name, **attrs)
        y = _to_heads_last(output)

        def grad(dy):
            d_q, d_k, d_v = lib.tfmetal_ext_attention_grad(_to_heads_last(dy), q, k, v, mask, _unfolded_heads_first(y, dy),
                                                           lse, seeds, **attrs)
            return d_q, d_k, d_v

        return y, grad

    return run(query, key, value)


def uses_kernel() -> bool:
    """`attention` runs the custom op here (else its pure-TF reference)."""
    if not _common.uses_kernel(ATTENTION_OP):
        return False
    return hasattr(_common.library(), "tfmetal_ext_attention")


# ---------------------------------------------------------------- argument checks


LAYOUTS = ("BHSD", "BSHD")


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"Argument `layout` must be one of {LAYOUTS}. Received: layout={layout!r}")
    return layout


def _axes(layout):
    """The (heads, sequence) axes of query, key and value in `layout`."""
    return (2, 1) if layout == "BSHD" else (1, 2)


def _check_inputs(query, key, value, layout="BHSD"):
    ha, sa = _axes(layout)
    dims = "(batch, seq, heads, head_dim)" if layout == "BSHD" else "(batch, heads, seq, head_dim)"
    for arg, t in (("query", query), ("key", key), ("value", value)):
        _common.check_float(arg, t)
        if t.shape.rank is not None and t.shape.rank != 4:
            raise ValueError(f"`{arg}` must have rank 4 {dims}. Received: {arg}.shape={t.shape}")
    for arg, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise ValueError(
                f"`{arg}` must have the dtype of `query` ({query.dtype.name}). Received: {arg}.dtype={t.dtype.name}"
            )
    q, k, v = (t.shape if t.shape.rank is not None else tf.TensorShape([None] * 4) for t in (query, key, value))

    def disagree(a, b):
        return a is not None and b is not None and a != b

    for arg, s in (("key", k), ("value", v)):
        if disagree(q[0], s[0]):
            raise ValueError(
                f"`{arg}` must have the batch dimension (axis 0) of `query` ({q[0]}). "
                f"Received: query.shape={query.shape}, {arg}.shape={s}"
            )
    for axis, what in ((ha, "number of heads"), (sa, "sequence length")):
        if disagree(k[axis], v[axis]):
            raise ValueError(
                f"`key` and `value` must have the same {what} (axis {axis}). "
                f"Received: key.shape={key.shape}, value.shape={value.shape}"
            )
    kv_heads = k[ha] if k[ha] is not None else v[ha]
    if q[ha] is not None and kv_heads is not None and (kv_heads < 1 or q[ha] % kv_heads) and (q[ha] or kv_heads):
        raise ValueError(
            f"The key/value heads (axis {ha}: {kv_heads}) must divide the query heads ({q[ha]}): each key/value "
            f"head serves heads // kv_heads consecutive query heads. Received: query.shape={query.shape}, "
            f"key.shape={key.shape}"
        )
    if disagree(q[3], k[3]):
        raise ValueError(
            "`query` and `key` must have the same head_dim (axis 3). "
            f"Received: query.shape={query.shape}, key.shape={key.shape}"
        )
    for arg, s in (("query", q), ("value", v)):
        if s[3] is not None and not 1 <= s[3] <= MAX_HEAD_DIM:
            raise ValueError(
                f"The last dimension of `{arg}` must be in [1, {MAX_HEAD_DIM}]. Received: {arg}.shape={s}"
            )


def _check_dropout(dropout_rate, seed):
    """``(rate, seed tensor or None)``: the rate in [0, 1); the seed drawn/checked only when it is used."""
    import keras

    try:
        rate = _dropout.check_rate(dropout_rate)
    except ValueError:
        raise ValueError(
            f"Argument `dropout_rate` must be a float in [0, 1). Received: dropout_rate={dropout_rate!r}"
        ) from None
    if rate == 0.0:
        # As keras.random.dropout: a SeedGenerator is not drawn at rate 0; any other seed is still checked.
        if seed is not None and not isinstance(seed, keras.random.SeedGenerator):
            _dropout.seed_tensor(seed)
        return rate, None
    if seed is None:
        raise ValueError(
            f"Argument `seed` must be given when dropout_rate > 0 (2 int32/int64 values or a "
            f"keras.random.SeedGenerator). Received: dropout_rate={dropout_rate!r}, seed=None"
        )
    return rate, _dropout.seed_tensor(seed)


def _check_causal(causal):
    if not isinstance(causal, bool):
        raise ValueError(f"Argument `causal` must be a bool. Received: causal={causal!r}")
    return causal


def _check_sliding_window(sliding_window):
    """The op's ``sliding_window`` attr: 0 for None, else the int in [1, 2^31 - 1]."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) \
            or not 1 <= int(sliding_window) <= _MAX_WINDOW:
        raise ValueError(
            f"Argument `sliding_window` must be None or an int in [1, {_MAX_WINDOW}]. "
            f"Received: sliding_window={sliding_window!r}"
        )
    return int(sliding_window)


def _check_scale(scale, head_dim):
    if scale is None:
        if head_dim is None:
            raise ValueError(
                "`scale` must be given when query's head_dim (last dimension) is not known statically. "
                f"Received: scale=None, query head_dim={head_dim}"
            )
        return 1.0 / math.sqrt(head_dim)
    value = None
    if not isinstance(scale, (bool, str, bytes)):
        try:
            value = float(scale)
        except (TypeError, ValueError):
            value = None
    if value is None or not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"Argument `scale` must be a finite float > 0. Received: scale={scale!r}")
    return _common.check_float32_representable("scale", value)


def _attend_mask(mask, query, key, layout="BHSD"):
    """The rank-4 boolean mask the op takes ([1, 1, 1, 1] True for no mask)."""
    if mask is None:
        return tf.ones([1, 1, 1, 1], tf.bool)
    mask = tf.convert_to_tensor(mask)
    if mask.dtype != tf.bool:
        raise ValueError(f"`mask` must be a boolean tensor (True = attend). Received: mask.dtype={mask.dtype.name}")
    rank = mask.shape.rank
    if rank is not None and rank > 4:
        raise ValueError(
            f"`mask` must have rank <= 4, broadcastable to (batch, heads, q_seq, kv_seq). Received: mask.shape={mask.shape}"
        )
    if rank is not None and rank < 4:
        mask = tf.reshape(mask, tf.concat([tf.ones([4 - rank], tf.int32), tf.shape(mask)], 0))
    q = query.shape if query.shape.rank is not None else tf.TensorShape([None] * 4)
    k = key.shape if key.shape.rank is not None else tf.TensorShape([None] * 4)
    ha, sa = _axes(layout)
    full = (q[0], q[ha], q[sa], k[sa])
    if mask.shape.rank is not None:
        for axis, (got, want) in enumerate(zip(mask.shape, full)):
            if got is not None and want is not None and got not in (1, want):
                raise ValueError(
                    "`mask` must broadcast to (batch, heads, q_seq, kv_seq) = "
                    f"{tuple(full)}: each dimension 1 or the full size (axis {axis} is {got}). "
                    f"Received: mask.shape={mask.shape}"
                )
    return mask


# ---------------------------------------------------------------- pure-TF reference


def _allowed(mask, causal, q_len, k_len, window=0):
    """The (broadcast) boolean attend mask: mask AND (causal: j <= i) AND (window w: |i - j| < w)."""
    if not causal and not window:
        return mask
    i = tf.range(tf.cast(q_len, tf.int64))[:, tf.newaxis]
    j = tf.range(tf.cast(k_len, tf.int64))[tf.newaxis, :]
    band = tf.ones(tf.stack([q_len, k_len]), tf.bool)
    if causal:
        band = tf.logical_and(band, j <= i)
    if window:
        band = tf.logical_and(band, tf.abs(i - j) < window)
    return tf.logical_and(mask, band)


def _repeat_heads(query, t):
    """`t` (batch, kv_heads, seq, dim) with each head repeated for its query heads (grouped-query)."""
    groups = tf.shape(query)[1] // tf.maximum(tf.shape(t)[1], 1)
    return tf.repeat(t, groups, axis=1)


def _sum_groups(t, like):
    """The gradient of `_repeat_heads`: `t` (batch, heads, seq, dim) summed over the query heads of each
    key/value head of `like` (batch, kv_heads, seq, dim)."""
    shape, kv_heads = tf.shape(t), tf.shape(like)[1]
    groups = shape[1] // tf.maximum(kv_heads, 1)
    wide = tf.reshape(t, tf.stack([shape[0], kv_heads, groups, shape[2], shape[3]]))
    return tf.reduce_sum(wide, axis=2)


def _reference_scores(query, key, mask, causal, scale, window=0):
    """float32 scaled scores, -inf where masked out, and the attend mask (both full-size)."""
    q = tf.cast(query, tf.float32)
    k = _repeat_heads(query, tf.cast(key, tf.float32))
    s = tf.matmul(q, k, transpose_b=True) * scale
    allowed = tf.broadcast_to(_allowed(mask, causal, tf.shape(q)[2], tf.shape(k)[2], window), tf.shape(s))
    return tf.where(allowed, s, tf.constant(-math.inf, tf.float32)), allowed


def _reference_attention(query, key, value, mask, causal, scale, dropout=None, window=0):
    """The op's forward in pure TF (scores materialized): (output of query's dtype, lse float32).

    float32 throughout, the output rounded once to the input dtype. A row
    attending no key gives output 0 and lse -inf. `dropout`: None, or
    ``(seed, rate, scale)`` with rate and scale rounded to query's dtype.
    """
    output, lse = _reference_attention_f32(query, key, value, mask, causal, scale,
                                           _reference_keep(query, key, dropout), window)
    return tf.cast(output, query.dtype), lse


def _reference_keep(query, key, dropout):
    """None, or ``(keep, dropout_scale)``: the [B, H, Tq, Tk] boolean dropout mask of the seed.

    StatelessRandomUniformV2 of the seed's key and counter, in query's dtype,
    on the (batch, heads, q_seq, kv_seq) shape: what the kernels draw (and
    ops.dropout's reference, and TensorFlow's stateless dropout) element by
    element in that flat order.
    """
    if dropout is None:
        return None
    seed, threshold, dropout_scale = dropout
    q, k = tf.shape(query), tf.shape(key)
    shape = tf.stack([q[0], q[1], q[2], k[2]])
    keep = _dropout.reference_uniform(shape, seed, query.dtype) >= tf.constant(threshold, query.dtype)
    return keep, dropout_scale


def _reference_drop(x, keep):
    """x (float32) where kept times the dropout scale, 0 where dropped (a select: the scale may be inf)."""
    if keep is None:
        return x
    keep, dropout_scale = keep
    return tf.where(keep, x * tf.constant(dropout_scale, tf.float32), tf.zeros([], tf.float32))


def _reference_attention_f32(query, key, value, mask, causal, scale, keep=None, window=0):
    s, allowed = _reference_scores(query, key, mask, causal, scale, window)
    m = tf.reduce_max(s, axis=-1, keepdims=True)
    m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))  # an empty row: no shift
    e = tf.where(allowed, tf.exp(s - m), tf.zeros_like(s))
    total = tf.reduce_sum(e, axis=-1, keepdims=True)
    attended = total > 0.0
    p = e / tf.where(attended, total, tf.ones_like(total))
    output = tf.matmul(_reference_drop(p, keep), _repeat_heads(query, tf.cast(value, tf.float32)))
    neg_inf = tf.constant(-math.inf, tf.float32)
    lse = tf.where(attended, m + tf.math.log(tf.where(attended, total, tf.ones_like(total))), neg_inf)
    return output, tf.squeeze(lse, -1)


def _reference_attention_grad(d_output, query, key, value, mask, output, lse, causal, scale, keep=None, window=0):
    """The gradient op in pure TF: (d_query, d_key, d_value) in the input dtype.

    The contract's formulas: p = exp(s - lse) (0 where masked or lse = -inf),
    Dr = sum(dO * O), ds = p * (dO . v - Dr), dQ = scale * ds @ k,
    dK = scale * ds^T @ q, dV = p^T @ dO (summed over each key/value head's
    query heads with grouped-query attention); float32, rounded once. With
    dropout (`keep` from `_reference_keep`) O is the dropped output,
    dO . v and p in dV are dropped by the same mask.
    """
    s, allowed = _reference_scores(query, key, mask, causal, scale, window)
    lse = tf.expand_dims(lse, -1)
    live = tf.logical_and(allowed, tf.math.is_finite(lse))
    p = tf.where(live, tf.exp(s - tf.where(tf.math.is_finite(lse), lse, tf.zeros_like(lse))), tf.zeros_like(s))
    d_out = tf.cast(d_output, tf.float32)
    q = tf.cast(query, tf.float32)
    k, v = (_repeat_heads(query, tf.cast(t, tf.float32)) for t in (key, value))
    dr = tf.reduce_sum(d_out * tf.cast(output, tf.float32), axis=-1, keepdims=True)
    dp = _reference_drop(tf.matmul(d_out, v, transpose_b=True), keep)
    ds = p * (dp - dr)
    d_query = tf.matmul(ds, k) * scale
    d_key = _sum_groups(tf.matmul(ds, q, transpose_a=True) * scale, key)
    d_value = _sum_groups(tf.matmul(_reference_drop(p, keep), d_out, transpose_a=True), value)
    return tuple(tf.cast(t, query.dtype) for t in (d_query, d_key, d_value))


def _with_reference_gradient(query, key, value, mask, causal, scale, dropout=None, window=0):
    keep = _reference_keep(query, key, dropout)
    if _common.portable():
        output, _ = _reference_attention_f32(query, key, value, mask, causal, scale, keep, window)
        return tf.cast(output, query.dtype)

    @tf.custom_gradient
    def fn(query, key, value):
        output, lse = _reference_attention_f32(query, key, value, mask, causal, scale, keep, window)

        def grad(d_output):
            return _reference_attention_grad(d_output, query, key, value, mask, output, lse, causal, scale, keep,
                                             window)

        return tf.cast(output, query.dtype), grad

    return fn(query, key, value)


# ---------------------------------------------------------------- registered gradient


@tf.RegisterGradient(ATTENTION_OP)
def _attention_grad(op, d_output, unused_d_lse):
    # lse is internal (attention returns the output only): no gradient flows
    # through it, and none to the boolean mask.
    # The seed list (0 or 1 tensors) and the dropout attrs go to the gradient op, which
    # draws the forward's mask again. A graph written before they existed has neither:
    # its node's defaults (no seed, rate 0) are read as such.
    lib = _common.library() or _loaded_library()
    query, key, value, mask = op.inputs[:4]
    seeds = list(op.inputs[4:])
    d_query, d_key, d_value = lib.tfmetal_ext_attention_grad(
        d_output,
        query,
        key,
        value,
        mask,
        op.outputs[0],
        op.outputs[1],
        seeds,
        causal=op.get_attr("causal"),
        sliding_window=_attr_or(op, "sliding_window", 0),
        scale=op.get_attr("scale"),
        dropout_rate=_attr_or(op, "dropout_rate", 0.0),
        dropout_scale=_attr_or(op, "dropout_scale", 1.0),
        layout=_string_attr(_attr_or(op, "layout", "BHSD")),
    )
    return (d_query, d_key, d_value, None) + (None,) * len(seeds)


def _string_attr(value):
    return value.decode() if isinstance(value, bytes) else value


def _attr_or(op, name, default):
    try:
        return op.get_attr(name)
    except ValueError:  # a node without the attr (it has the registered default then)
        return default


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
