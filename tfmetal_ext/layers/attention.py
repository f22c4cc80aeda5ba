"""FusedMultiHeadAttention: keras.layers.MultiHeadAttention over the flash-style attention op."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.layers.core.einsum_dense import EinsumDense

from tfmetal_ext.layers import _ops
from tfmetal_ext.ops._common import stock_code_reason
from tfmetal_ext.ops.attention import MAX_HEAD_DIM, attention

_STOCK = keras.layers.MultiHeadAttention
_OP_DTYPES = ("float32", "float16", "bfloat16")
# EinsumDense equations the stock build gives rank-3 inputs (the only ones the fast path reads):
# the q/k/v projections (batch, seq, dim) x (dim, heads, head_dim), and the output projection
# (batch, seq, heads, value_dim) x (heads, value_dim, *output_shape).
_PROJECTION_EQUATION = "abc,cde->abde"
_OUTPUT_LETTERS = "efghijklmnopqrstuvwxyz"


def _output_equation(n_out):
    out = _OUTPUT_LETTERS[:n_out]
    return f"abcd,cd{out}->ab{out}"


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedMultiHeadAttention(_STOCK):
    """`keras.layers.MultiHeadAttention` whose attention is one fused op forward and one backward.

    A drop-in: the same constructor arguments, call signature, sublayers
    (``query``, ``key``, ``value``, ``attention_output`` and, with
    ``use_gate=True``, ``gate`` EinsumDense layers), weights, names and
    config, so ``set_weights(stock.get_weights())`` works both ways and a
    ``.keras`` file round-trips. Keras masks (``Embedding(mask_zero=True)``)
    of the query, value and key are combined as Keras combines them and the
    query's mask is set on the output.

    The fast path (rank-3 inputs ``(batch, seq, features)``, attention over
    the sequence axis, no returned scores; with or without attention
    dropout):

    - each projection is ``MatMul -> BiasAdd`` on a 2-D view of its
      EinsumDense kernel (the same variable reshaped): the remapper fuses it
      into ``_FusedMatMul[BiasAdd]``. Projections of one input tensor share
      one MatMul on their kernels side by side (self-attention ``mha(x, x)``:
      query, key and value in one; ``mha(q, v)``: key and value), split into
      heads by one Reshape, Transpose and Split; the weights stay the
      sublayers' own, the gradient reaches each through the Concat. A
      sublayer with an activity regularizer keeps its own MatMul;
    - the core is `tfmetal_ext.ops.attention.attention` (``TfmetalExt>Attention``
      forward, ``TfmetalExt>AttentionGrad`` backward: tiled online softmax,
      the score matrix never stored). Padding masks (``(batch, seq)`` query,
      value and key masks, as ``Embedding(mask_zero=True)`` propagates them)
      and ``use_causal_mask`` reach it as a ``(batch, 1, 1, kv_seq)`` key
      mask and its ``causal`` attribute, so no ``(q_seq, kv_seq)`` mask is
      built either; with an ``attention_mask`` or a ``sliding_window`` it
      gets the boolean mask Keras builds (`_compute_attention_mask`);
    - attention ``dropout`` in a training call runs inside the op too (its
      ``dropout_rate``; the backward op draws the mask again from the seed,
      no mask is stored). The seed is drawn from the stock sublayer's own
      generator (``_dropout_layer.seed_generator``, seeded by ``seed``) as
      its Dropout draws it, and the op's mask is TensorFlow's stateless
      dropout mask of the ``(batch, heads, q_seq, kv_seq)`` scores in the
      compute dtype, bit for bit: the same dropped probabilities as the
      stock layer in the same generator state, so outputs and gradients
      agree with stock to float rounding and ``keras.utils.set_random_seed``
      reproduces a run;
    - the output projection is ``MatMul -> BiasAdd`` again.

    No ``Einsum`` runs in the train step. Stock Keras emits ``Einsum``
    (which neither Metal backend has a kernel for, so it falls back to the
    CPU), a materialized ``(batch, heads, q_seq, kv_seq)`` float32 softmax,
    and another ``Einsum``. Where the fused pattern runs: the attention op on
    Metal (GPU kernel) and on CPU (CPU kernel); ``_FusedMatMul[BiasAdd]`` on
    Metal (both backends' graph passes), on CPU with and without oneDNN
    (float32; bfloat16 with oneDNN), on CUDA only with ``TF_USE_CUBLASLT=1``.

    A query row whose every key is masked out gives what stock gives: the
    mean of the values (stock's masked softmax is uniform there) when
    ``dropout == 0``, and 0 when ``dropout > 0`` (stock's other path zeroes
    such rows), in training and inference calls, with stock's gradients.

    The exact path (`keras.layers.MultiHeadAttention.call` on this layer's
    weights: the stock result, nothing fused) runs for:

    - ``return_attention_scores=True``, always (the scores are the
      materialized matrix the op never stores);
    - attention ``dropout=1.0`` in a training call (stock's Dropout returns
      zeros; the op takes rates below 1; inference calls take the fast
      path), and a training flag that is a tensor with ``dropout > 0``;
    - custom ``attention_axes`` or inputs of rank other than 3 (anything but
      attention over the one sequence axis of ``(batch, seq, features)``);
    - ``flash_attention=True`` (Keras' TensorFlow backend rejects it: the
      stock call raises the stock error), a compute dtype the op has no
      kernel for (float64), quantized projections, a subclass that overrides
      `_compute_attention`, and inputs whose static shapes the built
      projections cannot take (so the error is stock's).

    `unfused_reason` says which, or None. Verified here on CPU against the
    stock layer: outputs and gradients (input and every weight) for self-
    and cross-attention, q_seq != kv_seq, value_dim != key_dim,
    output_shape, use_bias=False, use_gate, every mask kind, causal,
    mixed_float16/mixed_bfloat16, eager and in ``model.fit``, zero-size
    batches, attention dropout in training (the same seed state as stock:
    the same mask); no ``Einsum`` in a real ``model.fit`` train step. The Metal
    kernel of the op is checked through the emulator by the op's own tests,
    not on a GPU here.

    Args:
        num_heads, key_dim, value_dim, dropout, use_bias, output_shape,
        attention_axes, sliding_window, flash_attention, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, use_gate,
        seed: as `keras.layers.MultiHeadAttention`.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        As `keras.layers.MultiHeadAttention`: ``query``, ``value``, ``key``,
        ``query_mask``, ``value_mask``, ``key_mask``, ``attention_mask``,
        ``return_attention_scores``, ``training``, ``use_causal_mask``.

    Input shape:
        query ``(batch, q_seq, q_dim)``, value ``(batch, kv_seq, v_dim)``,
        key ``(batch, kv_seq, k_dim)`` (other ranks take the exact path).

    Output shape:
        ``(batch, q_seq, q_dim)``, or ``(batch, q_seq, *output_shape)``.

    Returns:
        The attention output, and with ``return_attention_scores=True`` also
        the ``(batch, heads, q_seq, kv_seq)`` scores (exact path).

    Raises:
        ValueError: what `keras.layers.MultiHeadAttention` raises, on the
            same arguments and shapes.

    Example:

    >>> layer = FusedMultiHeadAttention(num_heads=2, key_dim=8)
    >>> x = np.zeros((4, 10, 16), "float32")
    >>> layer(x, x, use_causal_mask=True).shape
    TensorShape([4, 10, 16])
    """

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        key_shape = value_shape if key_shape is None else key_shape
        self._input_ranks = (len(query_shape), len(value_shape), len(key_shape))

    @property
    def unfused_reason(self):
        """Why some call with ``return_attention_scores=False`` runs the exact stock path, or None.

        None means every such call takes the fast path (attention op, MatMul +
        BiasAdd projections). ``return_attention_scores=True`` always takes
        the exact path, whatever this says.
        """
        return self._structural_reason() or self._dropout_reason()

    def _dropout_rate(self):
        """The rate stock's dropout applies: its Dropout sublayer's (``dropout`` until built).

        Stock picks its path by ``dropout > 0`` but drops with ``_dropout_layer``'s rate, so a rate
        changed on the sublayer (convert's verification sets it to 0) changes both alike.
        """
        return getattr(getattr(self, "_dropout_layer", None), "rate", self._dropout)

    def _dropout_reason(self):
        # Attention dropout runs inside the op (its dropout_rate) for rates below 1; stock's Dropout
        # turns rate 1 into zeros, which the op does not take.
        if self._dropout > 0 and self._dropout_rate() >= 1.0:
            return (
                f"dropout={self._dropout_rate()}: a training call takes the exact path (stock's Dropout "
                "returns zeros; the attention op's dropout_rate is below 1; inference calls are fused)"
            )
        return None

    def _structural_reason(self, ranks=None):
        """The reason that does not depend on a call's flags (scores, training), or None."""
        if type(self)._compute_attention is not _STOCK._compute_attention:
            return "a subclass overrides _compute_attention: the stock call runs so that the override is used"
        if self._flash_attention:
            return (
                "flash_attention=True: Keras' TensorFlow backend rejects it, so the stock call runs "
                "(and raises Keras' error)"
            )
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        if dtype not in _OP_DTYPES:
            return f"compute dtype {dtype}: the attention op has float32, float16 and bfloat16 kernels only"
        for arg, dim in (("key_dim", self._key_dim), ("value_dim", self._value_dim)):
            if dim > MAX_HEAD_DIM:
                return f"{arg}={dim}: the attention op takes head dims up to {MAX_HEAD_DIM}"
        ranks = ranks or getattr(self, "_input_ranks", None)
        if ranks is not None and ranks != (3, 3, 3):
            return (
                f"inputs of ranks {ranks} (query, value, key): the attention op attends over the one "
                "sequence axis of rank-3 (batch, seq, features) inputs"
            )
        axes = self._attention_axes
        if axes is not None and tuple(axes) not in ((1,), (-2,)):
            return (
                f"attention_axes={axes}: the attention op attends over the one sequence axis of "
                "rank-3 (batch, seq, features) inputs"
            )
        if self.built:
            projections = [self._query_dense, self._key_dense, self._value_dense]
            projections += [self._gate_dense] if self._use_gate else []
            if any(getattr(p, "quantization_mode", None) for p in projections + [self._output_dense]):
                return "quantized projections: the stock call runs their quantized kernels"
            n_out = len(self._output_shape) if self._output_shape else 1
            if not all(isinstance(p, EinsumDense) and p.equation == _PROJECTION_EQUATION for p in projections):
                return "projections that are not the stock rank-3 EinsumDense layers"
            out = self._output_dense
            if not (isinstance(out, EinsumDense) and out.equation == _output_equation(n_out)):
                return "an output projection that is not the stock rank-3 EinsumDense layer"
        return None

    def _call_reason(self, query, value, key, return_attention_scores, training):
        """Why this call runs the exact stock path, or None for the fast path."""
        reason = stock_code_reason()
        if reason:
            return reason
        if return_attention_scores:
            return "return_attention_scores=True: the scores are the matrix the attention op never stores"
        ranks = (len(query.shape), len(value.shape), len(key.shape))
        reason = self._structural_reason(ranks)
        if reason:
            return reason
        if self._dropout > 0 and not (isinstance(training, bool) or training is None):
            return f"dropout={self._dropout} with a symbolic training flag: the exact path"
        if self._dropout > 0 and training and self._dropout_reason():
            return self._dropout_reason()
        pairs = [(query, self._query_dense), (key, self._key_dense), (value, self._value_dense)]
        for x, dense in pairs:
            if x.shape[-1] is not None and x.shape[-1] != dense.kernel.shape[0]:
                return "an input whose last dimension the built projection cannot take (stock's error)"
        if None not in (key.shape[1], value.shape[1]) and key.shape[1] != value.shape[1]:
            return "key and value of different lengths (stock's error)"
        return None

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        key_or_value = value if key is None else key
        if self._call_reason(query, value, key_or_value, return_attention_scores, training) is not None:
            return super().call(
                query, value, key=key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                training=training, use_causal_mask=use_causal_mask,
            )
        key = key_or_value
        # As the stock call: the query's mask is read from the tensor (the masks are handled here,
        # not propagated into the sublayers), the value and key masks come in as arguments.
        query_mask = keras_backend.get_keras_mask(query)
        for x in (query, value, key):
            keras_backend.set_keras_mask(x, None)

        masks = [None if m is None else tf.convert_to_tensor(m) for m in (query_mask, value_mask, key_mask)]
        # Padding masks (rank 2: (batch, seq)) and causal only: the op takes a (batch, 1, 1, kv) key mask
        # and its causal attribute, never a (q, kv) matrix; which query rows attend no key (stock
        # gives them the mean of the values) comes from the masks directly. Otherwise Keras'
        # combined mask, as the stock call builds it.
        factored = (attention_mask is None and self._sliding_window is None
                    and all(m is None or m.shape.rank == 2 for m in masks))
        if factored:
            causal = bool(use_causal_mask)
            mask, attended = _factored_masks(*masks, causal, tf.shape(query)[1], tf.shape(value)[1])
        else:
            causal = False
            mask = self._compute_attention_mask(
                query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                attention_mask=attention_mask, use_causal_mask=use_causal_mask,
            )
            attended = None
            if mask is not None:
                mask = tf.cast(mask, tf.bool)  # no op for a boolean mask
                if mask.shape.rank == 2:  # (q, kv) -> (1, 1, q, kv)
                    mask = mask[None, None]
                elif mask.shape.rank == 3:  # (batch, q, kv) -> (batch, 1, q, kv)
                    mask = tf.expand_dims(mask, -3)

        dtype = self.compute_dtype
        query, value, key = (tf.cast(x, dtype) for x in (query, value, key))
        q_dims, kv_dims = _dims(query), _dims(value)
        q, k, v = self._project_heads(query, key, value, q_dims, kv_dims)

        rate = self._dropout_rate() if self._dropout > 0 and training else 0.0
        # The op works in (batch, seq, heads, dim), the layout the projections write and the output
        # MatMul reads: no transposed copy in either pass, one output copy kept for the backward
        # pass (the op's gradient and the kernel's read the same).
        if rate > 0:
            # The stock sublayer's generator, drawn once as its Dropout would draw it: the same mask.
            out = attention(q, k, v, mask=mask, causal=causal, scale=self._inverse_sqrt_key_dim,
                            dropout_rate=rate, seed=self._dropout_layer.seed_generator, layout="BSHD")
        else:
            out = attention(q, k, v, mask=mask, causal=causal, scale=self._inverse_sqrt_key_dim, layout="BSHD")
        zero_rows = None
        if self._dropout == 0 and (attended is not None or mask is not None):
            if attended is None:  # (batch, 1 or heads, q, 1) -> heads last
                attended = tf.transpose(tf.reduce_any(mask, axis=-1, keepdims=True), [0, 2, 1, 3])
            else:  # (batch, q or 1) -> (batch, q or 1, 1, 1)
                attended = attended[:, :, None, None]
            out = tf.where(attended, out, _mean_value(v, kv_dims[1]))
        elif attended is not None:
            # Stock's dropout path zeroes a row that attends no key (the op's own 0 where its mask
            # says so; a query-masked row is not masked in the op's key mask). A zero row projects
            # to the output bias exactly (0 * kernel sums to 0), so the row is replaced after the
            # projection: a select before it would be a second copy of the output, kept for the
            # kernel's gradient beside the op's.
            zero_rows = attended

        # (batch, q, heads, value_dim) -> (batch * q, heads * value_dim) for the output MatMul.
        flat = tf.reshape(out, [-1, self._num_heads * self._value_dim])
        if self._use_gate:
            flat = flat * self._matmul_bias(self._gate_dense, self._flat(query), q_dims[0])
        y = self._matmul_bias(self._output_dense, flat, q_dims[0])
        out_dims = list(self._output_dense.kernel.shape[2:])
        y = tf.reshape(y, q_dims[:2] + out_dims)
        if zero_rows is not None:  # (batch, q or 1) -> (batch, q or 1, 1, ...)
            y = tf.where(zero_rows[(slice(None), slice(None)) + (None,) * len(out_dims)], y, self._zero_row_output())
        y.set_shape(query.shape[:2].concatenate(out_dims))
        if query_mask is not None:
            keras_backend.set_keras_mask(y, query_mask)
        return y

    # ------------------------------------------------------------------
    # Fast-path pieces.

    def _project_heads(self, query, key, value, q_dims, kv_dims):
        """The (batch, seq, heads, head_dim) query, key and value.

        Projections of the same input tensor (self-attention: query, key and
        value; ``MHA(q, v)``: key and value) share one MatMul + BiasAdd on
        their concatenated kernels, its output split into heads by one
        Reshape and one Split. The kernels stay the
        sublayers' own variables (concatenated per step, the gradient split
        back), so weights and names are stock's.
        """
        named = {"query": (query, self._query_dense, q_dims), "key": (key, self._key_dense, kv_dims),
                 "value": (value, self._value_dense, kv_dims)}
        groups = []  # [input, dims, [names]] in first-use order
        for name, (x, dense, dims) in named.items():
            # A sublayer with an activity regularizer keeps its own MatMul (its loss is of its output).
            share = dense.activity_regularizer is None
            group = next((g for g in groups if share and g[0] is x and g[3]), None)
            if group is None:
                groups.append([x, dims, [name], share])
            else:
                group[2].append(name)
        heads = {}
        for x, dims, names, _ in groups:
            denses = [named[n][1] for n in names]
            head_dims = [d.kernel.shape[-1] for d in denses]
            flat = self._flat(x)
            if len(denses) == 1:
                y = self._matmul_bias(denses[0], flat, dims[0])
                heads[names[0]] = _split_heads(y, dims, self._num_heads, head_dims[0])
                continue
            kernel, bias = _concat_projections(denses, self.compute_dtype)
            y = tf.matmul(flat, kernel)
            if bias is not None:
                y = _ops.bias_add(y, bias, "matmul_bias_relu")
            if len(set(head_dims)) == 1:
                # (b*t, n*h*d) -> (b, t, n*h, d) -> n x (b, t, h, d)
                parts = tf.split(_split_heads(y, dims, len(denses) * self._num_heads, head_dims[0]),
                                 len(denses), axis=2)
            else:
                parts = [
                    _split_heads(part, dims, self._num_heads, d)
                    for part, d in zip(tf.split(y, [self._num_heads * d for d in head_dims], axis=1), head_dims)
                ]
            heads.update(zip(names, parts))
        return heads["query"], heads["key"], heads["value"]

    @staticmethod
    def _flat(x):
        """(batch, seq, dim) -> (batch * seq, dim)."""
        return tf.reshape(x, [-1, x.shape[-1]])

    def _zero_row_output(self):
        """What the output projection makes of a zero row: its bias (0 without one), in the output's shape."""
        dense = self._output_dense
        if dense.bias is None:
            return tf.zeros([], self.compute_dtype)
        bias = tf.cast(dense.bias, self.compute_dtype)
        out_dims = list(dense.kernel.shape[2:])
        return bias if bias.shape.as_list() == out_dims else tf.reshape(bias, out_dims)

    def _matmul_bias(self, dense, flat, batch):
        """``activation(BiasAdd(MatMul(flat, kernel_2d), bias_1d))`` for an EinsumDense sublayer.

        The 2-D kernel and 1-D bias are reshapes of the sublayer's own
        variables (its ``kernel`` property: LoRA merged in, as its call does),
        so gradients reach the same variables.
        """
        kernel = tf.cast(dense.kernel, self.compute_dtype)
        if kernel.shape.rank != 2:
            kernel = tf.reshape(kernel, [flat.shape[-1], -1])
        y = tf.matmul(flat, kernel)
        if dense.bias is not None:
            bias = tf.cast(dense.bias, self.compute_dtype)
            if bias.shape.rank != 1:
                bias = tf.reshape(bias, [-1])
            y = _ops.bias_add(y, bias, "matmul_bias_relu")
        if dense.activation is not None and dense.activation is not keras.activations.linear:
            y = tf.sigmoid(y) if dense.activation is keras.activations.sigmoid else dense.activation(y)
        if dense.activity_regularizer is not None:
            # The stock sublayer call adds activity_regularizer(output) / batch as a loss; its
            # (batch, seq, ...) output holds the elements of this 2-D one.
            loss = dense.activity_regularizer(y)
            dense.add_loss(tf.math.divide_no_nan(loss, tf.cast(batch, loss.dtype)))
        return y


def _dims(x):
    """[batch, seq]: static ints where known, else scalar tensors (one Shape op)."""
    dims = list(x.shape[:2])
    if None in dims:
        shape = tf.shape(x)
        dims = [shape[i] if d is None else d for i, d in enumerate(dims)]
    return dims


def _split_heads(flat, dims, heads, head_dim):
    """(batch * seq, heads * head_dim) -> (batch, seq, heads, head_dim).

    The batch and seq are given (not -1), so an empty sequence reshapes too.
    """
    return tf.reshape(flat, [dims[0], dims[1], heads, head_dim])


def _concat_projections(denses, dtype):
    """The 2-D kernel and 1-D bias of projections of one input, side by side (query, key, value order)."""
    kernels = [d.kernel for d in denses]
    same = len({k.shape[-1] for k in kernels}) == 1
    if same:
        # (dim, heads, d) x n -> (dim, n * heads, d) -> (dim, n * heads * d): one Concat, one Reshape.
        kernel = tf.reshape(tf.concat(kernels, axis=1), [kernels[0].shape[0], -1])
    else:
        kernel = tf.concat([tf.reshape(k, [k.shape[0], -1]) for k in kernels], axis=1)
    kernel = tf.cast(kernel, dtype)
    if denses[0].bias is None:
        return kernel, None
    if same:  # (heads, d) x n -> (n * heads, d) -> (n * heads * d,)
        bias = tf.reshape(tf.concat([d.bias for d in denses], axis=0), [-1])
    else:
        bias = tf.concat([tf.reshape(d.bias, [-1]) for d in denses], axis=0)
    return kernel, tf.cast(bias, dtype)


def _factored_masks(query_mask, value_mask, key_mask, causal, q_len, kv_len):
    """The op's mask from (batch, seq) padding masks, and which query rows attend some key.

    Returns ``(mask, attended)``: mask None or the (batch, 1, 1, kv) AND of
    the value and key masks; attended None (every row attends a key) or a
    boolean broadcastable to (batch, q): the query mask, AND some
    unmasked key (with ``causal``: some unmasked key j <= i, i.e. the first
    unmasked key is at most i). These are the rows stock's combined mask
    leaves with at least one attended key.
    """
    kv = None
    for m in (value_mask, key_mask):
        if m is not None:
            m = tf.cast(m, tf.bool)
            kv = m if kv is None else tf.logical_and(kv, m)
    attended = None if query_mask is None else tf.cast(query_mask, tf.bool)  # (batch, q)
    if kv is not None:
        if causal:  # (batch, 1): the first unmasked key (kv_len for none); row i needs it at most i
            first = tf.reduce_min(tf.where(kv, tf.range(kv_len), kv_len), axis=-1, keepdims=True)
            has_key = tf.logical_and(tf.range(q_len) >= first, first < kv_len)  # (batch, q)
        else:
            has_key = tf.reduce_any(kv, axis=-1, keepdims=True)  # (batch, 1)
        attended = has_key if attended is None else tf.logical_and(attended, has_key)
        kv = kv[:, None, None, :]
    return kv, attended


def _mean_value(v, kv_len):
    """(batch, kv, heads, d) -> the (batch, 1, heads, d) mean over the keys (0 with no keys).

    Stock's masked softmax is uniform over all keys in a row that attends
    none (every score replaced by the same large negative number); the op
    gives 0 there.
    """
    if isinstance(kv_len, int) and kv_len > 0:
        return tf.reduce_mean(v, axis=1, keepdims=True)
    total = tf.reduce_sum(v, axis=1, keepdims=True)
    return total / tf.cast(tf.maximum(kv_len, 1), v.dtype)
