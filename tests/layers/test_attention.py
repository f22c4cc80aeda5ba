"""FusedMultiHeadAttention: a drop-in for keras.layers.MultiHeadAttention over the attention op.

References: the stock layer holding the same weights (outputs, gradients, masks, errors), and a
numpy multi-head attention written here for the plain case.
"""

import importlib
import os
import re
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext.ops
from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers.attention import FusedMultiHeadAttention
from tfmetal_ext.testing import assert_close, error_type

from ._rounding_bound import attention_rounding_bound

MHA = keras.layers.MultiHeadAttention
# The module (the package also exports the `attention` function under that name).
attention_ops = importlib.import_module("tfmetal_ext.ops.attention")


# The quick tier runs the layer on the kernel; the full tier on the reference too (the reference op
# itself against numpy is in tests/ops/test_attention.py's quick tier).
@pytest.fixture(params=["kernel", pytest.param("reference", marks=pytest.mark.full)])
def path(request, monkeypatch):
    """The attention op's kernel (where it is loaded), then its pure-TF reference (always)."""
    if request.param == "kernel":
        if not attention_ops.uses_kernel():
            pytest.skip(f"the {fusion.ATTENTION_OP} kernel is not loaded here: {tfmetal_ext.ops.status()}")
    else:
        monkeypatch.setattr(attention_ops, "uses_kernel", lambda: False)
    return request.param


# ----------------------------------------------------------------------------
# numpy reference (float64): project, softmax(q k^T * scale) masked, combine, project.


def np_mha(layer, q, v, k=None, mask=None):
    k = v if k is None else k
    w = {p.name: [np.asarray(x, np.float64) for x in p.get_weights()] for p in layer._flatten_layers(include_self=False)
         if p.weights}

    def proj(name, x):
        out = np.einsum("btd,dnh->btnh", x, w[name][0])
        return out + w[name][1] if len(w[name]) > 1 else out

    qh, kh, vh = proj("query", q), proj("key", k), proj("value", v)
    s = np.einsum("btnh,bsnh->bnts", qh, kh) / np.sqrt(layer.key_dim)
    if mask is not None:
        s = np.where(mask[:, None], s, -1e9)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", p, vh)
    out = np.einsum("btnh,nho->bto", o, w["attention_output"][0])
    return out + w["attention_output"][1] if len(w["attention_output"]) > 1 else out


# ----------------------------------------------------------------------------
# Stock with the same weights: outputs and gradients (query, value, key, every weight).


def _pair(kwargs, q, v, k=None, rng=None, policy=None):
    if policy:
        kwargs = dict(kwargs, dtype=policy)
    ours, stock = FusedMultiHeadAttention(**kwargs), MHA(**kwargs)
    stock(q, v, k)
    ours(q, v, k)
    assert [(w.path.replace(ours.name, stock.name, 1), w.shape) for w in ours.weights] == [
        (w.path, w.shape) for w in stock.weights
    ]
    assert [(w.name, w.shape) for w in ours.weights] == [(w.name, w.shape) for w in stock.weights]
    rng = rng or np.random.default_rng(0)
    stock.set_weights([w + 0.3 * rng.standard_normal(w.shape).astype(w.dtype) for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    back = MHA.from_config(stock.get_config())
    back(q, v, k)
    back.set_weights(ours.get_weights())
    for a, b in zip(back.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    return ours, stock


def _run(layer, q, v, k=None, graph=False, training=False, **call_kwargs):
    """Output and gradients (query, value, key, every trainable weight) of one call.

    ``v is q`` (and ``k is q`` or None) is self-attention: one tensor is
    passed as query and value (and key), so it gets one gradient, the sum.
    """
    self_attention = v is q and (k is None or k is q)

    def step(*inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            if self_attention:
                x = inputs[0]
                y = layer(x, x, x if k is not None else None, training=training, **call_kwargs)
            else:
                y = layer(inputs[0], inputs[1], inputs[2] if k is not None else None, training=training,
                          **call_kwargs)
            weights = tf.sin(tf.cast(tf.range(tf.size(y)), tf.float32) * 0.37)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.reshape(weights, tf.shape(y)))
        return y, tape.gradient(loss, list(inputs) + layer.trainable_weights)

    fn = tf.function(step) if graph else step
    args = [q] if self_attention else [q, v] + ([k] if k is not None else [])
    y, grads = fn(*[tf.constant(a) for a in args])
    return np.asarray(tf.cast(y, tf.float32)), [np.asarray(tf.cast(g, tf.float32)) for g in grads]


def _check_same(ours, stock, q, v, k=None, policy="float32", graph=False, **call_kwargs):
    y, grads = _run(ours, q, v, k, graph=graph, **call_kwargs)
    y_ref, grads_ref = _run(stock, q, v, k, graph=graph, **call_kwargs)
    assert y.shape == y_ref.shape
    assert_close(y, y_ref, policy)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref, policy)
    return y


def _inputs(rng, b, tq, tk, dq, dv, dk=None):
    q = rng.standard_normal((b, tq, dq)).astype("float32")
    v = rng.standard_normal((b, tk, dv)).astype("float32")
    k = None if dk is None else rng.standard_normal((b, tk, dk)).astype("float32")
    return q, v, k


CONFIGS = {
    "self": (dict(num_heads=2, key_dim=4), (2, 5, 5, 8, 8, None)),
    "cross_key": (dict(num_heads=3, key_dim=4), (2, 5, 7, 8, 6, 5)),
    "value_dim_output_shape": (dict(num_heads=2, key_dim=4, value_dim=6, output_shape=(3, 2)), (2, 4, 6, 8, 8, None)),
    "no_bias_gate": (dict(num_heads=2, key_dim=3, use_bias=False, use_gate=True), (2, 5, 5, 6, 6, None)),
    "self_value_dim": (dict(num_heads=2, key_dim=4, value_dim=3), (2, 5, 5, 8, 8, None)),
    "int_output_shape": (dict(num_heads=1, key_dim=5, output_shape=7), (3, 1, 4, 6, 6, 6)),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_stock(config, graph, path):
    kwargs, dims = CONFIGS[config]
    rng = np.random.default_rng(1)
    q, v, k = _inputs(rng, *dims)
    ours, stock = _pair(kwargs, q, v, k, rng)
    assert ours.unfused_reason is None
    _check_same(ours, stock, q, v, k, graph=graph)
    if q.shape == v.shape and (k is None or k.shape == q.shape):
        # One tensor as query, value (and key): the shared projection MatMul.
        _check_same(ours, stock, q, q, None if k is None else q, graph=graph)


def test_matches_numpy_reference():
    rng = np.random.default_rng(2)
    q, v, _ = _inputs(rng, 2, 4, 6, 8, 8)
    layer = FusedMultiHeadAttention(num_heads=2, key_dim=3)
    layer(q, v)
    layer.set_weights([rng.standard_normal(w.shape).astype("float32") * 0.5 for w in layer.get_weights()])
    mask = rng.random((2, 4, 6)) > 0.4
    mask[:, :, 0] = True
    np.testing.assert_allclose(layer(q, v), np_mha(layer, q, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer(q, v, attention_mask=mask), np_mha(layer, q, v, mask=mask), rtol=1e-5, atol=1e-5)


def _masks(rng, b, tq, tk):
    m3 = rng.random((b, tq, tk)) > 0.5
    m3[0, 1] = False  # a fully masked row: stock gives the mean of the values there
    m4 = rng.random((b, 2, tq, tk)) > 0.3
    m4[1, 0, 2] = False
    return {
        "rank2": rng.random((tq, tk)) > 0.4,
        "rank3": m3,
        "rank4_heads": m4,
        "float": (rng.random((b, tq, tk)) > 0.5).astype("float32"),
        "all_masked": np.zeros((b, tq, tk), bool),
    }


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("mask", ["rank2", "rank3", "rank4_heads", "float", "all_masked"])
def test_attention_mask_matches_stock(mask, causal, path):
    rng = np.random.default_rng(3)
    q, v, _ = _inputs(rng, 2, 5, 6, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4), q, v, rng=rng)
    _check_same(ours, stock, q, v, attention_mask=_masks(rng, 2, 5, 6)[mask], use_causal_mask=causal, graph=True)


@pytest.mark.parametrize("q_len, kv_len", [(5, 5), (6, 3), (3, 7)])
def test_causal_only_matches_stock(q_len, kv_len, path):
    rng = np.random.default_rng(4)
    q, v, _ = _inputs(rng, 2, q_len, kv_len, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4), q, v, rng=rng)
    _check_same(ours, stock, q, v, use_causal_mask=True)
    explicit = np.tril(np.ones((q_len, kv_len), bool))
    np.testing.assert_allclose(ours(q, v, use_causal_mask=True), ours(q, v, attention_mask=explicit), atol=1e-6)


def test_sliding_window_matches_stock():
    rng = np.random.default_rng(5)
    q, v, _ = _inputs(rng, 2, 7, 7, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4, sliding_window=3), q, v, rng=rng)
    for causal in (False, True):
        _check_same(ours, stock, q, v, use_causal_mask=causal)


def _embedded(tokens, dim, seed):
    emb = keras.layers.Embedding(10, dim, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(seed=seed))
    return emb(tokens)


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
def test_keras_masks_match_stock(causal, path):
    """Embedding(mask_zero=True) query, value and key masks; padded query rows are fully masked."""
    q_tok = np.array([[1, 2, 3, 0, 0], [3, 3, 1, 1, 2], [1, 0, 0, 0, 0]])
    v_tok = np.array([[5, 4, 0], [3, 0, 0], [2, 1, 1]])
    k_tok = np.array([[5, 4, 4], [3, 3, 0], [0, 0, 0]])
    rng = np.random.default_rng(6)
    ours = stock = None
    for layer_cls in (MHA, FusedMultiHeadAttention):
        layer = layer_cls(num_heads=2, key_dim=3)
        q, v, k = _embedded(q_tok, 8, 1), _embedded(v_tok, 8, 2), _embedded(k_tok, 8, 3)
        layer(q, v, k)
        if stock is None:
            stock = layer
            stock.set_weights([w + 0.3 * rng.standard_normal(w.shape).astype("float32") for w in stock.get_weights()])
        else:
            ours = layer
            ours.set_weights(stock.get_weights())
    outs = {}
    for layer in (stock, ours):
        q, v, k = _embedded(q_tok, 8, 1), _embedded(v_tok, 8, 2), _embedded(k_tok, 8, 3)
        with tf.GradientTape() as tape:
            tape.watch([q, v, k])
            y = layer(q, v, k, use_causal_mask=causal)
            loss = tf.reduce_sum(y * tf.sin(tf.reshape(tf.range(tf.size(y), dtype=tf.float32), tf.shape(y))))
        grads = tape.gradient(loss, [q, v, k] + layer.trainable_weights)
        outs[layer is ours] = (y, grads, keras.src.backend.get_keras_mask(y))
    (y, grads, m), (y_ref, grads_ref, m_ref) = outs[True], outs[False]
    np.testing.assert_array_equal(m, q_tok != 0)
    np.testing.assert_array_equal(m, m_ref)
    assert_close(np.asarray(y), np.asarray(y_ref), "float32")
    for g, g_ref in zip(grads, grads_ref):
        assert_close(np.asarray(g), np.asarray(g_ref), "float32")


@pytest.mark.parametrize("masked", [False, True], ids=["", "value_mask"])
def test_dropout_training_keeps_one_copy_of_the_attention_output(masked):
    """In training with dropout, the op works in the projections' (batch, seq, heads, dim) layout: no
    Transpose makes or reads its query, key, value or output, and the op's output is the one tensor
    the op's gradient and the output projection's kernel gradient read. A row that attends no key is
    replaced by the output bias after the projection, not by a select before it (a second copy)."""
    if not attention_ops.uses_kernel():
        pytest.skip("no op library here: the attention runs its pure-TF reference")
    rng = np.random.default_rng(31)
    q, v, _ = _inputs(rng, 2, 5, 6, 8, 8)
    layer = FusedMultiHeadAttention(num_heads=2, key_dim=4, dropout=0.3, seed=2)
    kwargs = {"value_mask": np.array([[0] * 6, [1, 1, 0, 1, 1, 1]], bool)} if masked else {}
    layer(q, v, **kwargs)

    def step():
        with tf.GradientTape() as tape:
            y = layer(q, v, training=True, **kwargs)
        return tape.gradient(y, layer.trainable_variables)

    graph = tf.function(step).get_concrete_function().graph
    op = [o for o in graph.get_operations() if o.type == fusion.ATTENTION_OP]
    assert len(op) == 1
    (grad_op,) = [o for o in graph.get_operations() if o.type == fusion.ATTENTION_GRAD_OP]
    assert op[0].get_attr("layout") == b"BSHD" and grad_op.get_attr("layout") == b"BSHD"
    around = {t.name for t in list(op[0].inputs[:3]) + list(op[0].outputs[:1]) + list(grad_op.outputs)}
    transposes = [o for o in graph.get_operations() if o.type == "Transpose"]
    assert not [o for o in transposes if {t.name for t in list(o.inputs) + list(o.outputs)} & around], transposes

    def source(t):  # through reshapes and identities (the custom gradient's IdentityN among them)
        while t.op.type in ("Reshape", "Identity", "IdentityN"):
            t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
        return t

    assert grad_op.inputs[5] is op[0].outputs[0]  # the gradient op reads the op's own output
    matmuls = [o for o in graph.get_operations() if o.type == "MatMul" and source(o.inputs[0]) is op[0].outputs[0]]
    # The output projection and its kernel's gradient read the same tensor.
    assert sorted(m.name.startswith("gradient_tape/") for m in matmuls) == [False, True], matmuls


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("call", ["plain", "mask", "causal", "keras_mask"])
def test_mixed_precision_within_the_derived_rounding_bound(policy, call, path):
    """Under a mixed policy, every output and gradient component is within the rounding bound derived
    for the layer's algorithm (tests/layers/_rounding_bound.py) of the exact (float64) result.

    The bound is the first-order componentwise bound of the rounding to the half type at each place
    the layer rounds: inputs, weights, projection outputs, the attention op's output and its dQ, dK,
    dV (each rounded once: the op computes in float32), the projections' gradients. Its reference is
    a float64 forward and hand-written backward, not TF's autodiff. A component over it means a
    rounding the layer is not supposed to make. (Stock's error is not the measure: its algorithm rounds
    the scores and probabilities too, and on one machine either one can land closer; on an AVX-512
    BF16 CPU ours landed up to 1.9x stock's, within this bound.)
    """
    rng = np.random.default_rng(7)
    b, tq, tk, dim = 2, 5, 6, 8
    q, v, k = _inputs(rng, b, tq, tk, dim, dim, dim)
    kwargs = {"plain": {}, "mask": {"attention_mask": _masks(rng, b, tq, tk)["rank3"]},
              "causal": {"use_causal_mask": True},
              "keras_mask": {"value_mask": np.arange(tk) < np.array([[6], [2]]),
                             "key_mask": np.arange(tk) > np.array([[0], [-1]])}}[call]
    ours, stock = _pair(dict(num_heads=2, key_dim=4), q, v, k, rng, policy=policy)
    y, grads = _run(ours, q, v, k, graph=True, **kwargs)
    # Which keys each query attends: Keras' own combination of the masks.
    combined = stock._compute_attention_mask(
        tf.constant(q), tf.constant(v), value_mask=kwargs.get("value_mask"), key_mask=kwargs.get("key_mask"),
        attention_mask=kwargs.get("attention_mask"), use_causal_mask=kwargs.get("use_causal_mask", False))
    allowed = np.ones((b, tq, tk), bool) if combined is None else np.asarray(combined).astype(bool)
    weights = [w.numpy() for w in ours.trainable_weights]
    params = dict(zip(["Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo"], weights))
    loss_weights = np.sin(np.arange(y.size) * 0.37).reshape(y.shape)  # as _run's loss
    exact, bound = attention_rounding_bound(params, q, k, v, allowed, loss_weights, 4**-0.5, policy.split("_")[1])
    names = ["output", "query", "value", "key"] + [w.path for w in ours.trainable_weights]
    for name, got, want, limit in zip(names, [y] + grads, exact, bound):
        error = np.abs(got.astype(np.float64) - want)
        worst = np.unravel_index(np.argmax(error - limit), error.shape)
        assert (error <= limit).all(), (name, worst, error[worst], limit[worst])
    out = ours(q, v, k, **kwargs)
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in ours.weights)


def test_rounding_bound_reference_matches_the_float32_layer():
    # The bound's float64 forward and hand-written backward (d = 0) compute the float32 layer's outputs
    # and TF-autodiff gradients, to float32 accuracy: the reference the bound is taken around is right.
    rng = np.random.default_rng(11)
    q, v, k = _inputs(rng, 2, 5, 6, 8, 8, 8)
    mask = _masks(rng, 2, 5, 6)["rank3"]
    layer = MHA(num_heads=2, key_dim=4)
    layer(q, v, k)
    layer.set_weights([w + 0.3 * rng.standard_normal(w.shape).astype("float32") for w in layer.get_weights()])
    y, grads = _run(layer, q, v, k, graph=True, attention_mask=mask)
    params = dict(zip(["Wq", "bq", "Wk", "bk", "Wv", "bv", "Wo", "bo"], [w.numpy() for w in layer.trainable_weights]))
    loss_weights = np.sin(np.arange(y.size) * 0.37).reshape(y.shape)
    exact, bound = attention_rounding_bound(params, q, k, v, mask, loss_weights, 0.5, "bfloat16")
    scale = max(np.abs(w).max() for w in exact)  # the key bias's gradient is 0 (softmax is shift-invariant)
    for got, want, limit in zip([y] + grads, exact, bound):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * scale)
        assert (limit >= 0).all() and limit.max() > 0


def test_zero_size_batch_and_empty_kv(path):
    rng = np.random.default_rng(8)
    q, v, _ = _inputs(rng, 2, 4, 3, 6, 6)
    ours, stock = _pair(dict(num_heads=2, key_dim=3), q, v, rng=rng)
    for qs, vs in (((0, 4, 6), (0, 3, 6)), ((2, 4, 6), (2, 0, 6))):
        q0, v0 = np.zeros(qs, "float32") + 0.5, np.zeros(vs, "float32")
        for kwargs in ({}, {"use_causal_mask": True}, {"attention_mask": np.ones(qs[:2] + vs[1:2], bool)}):
            y = _check_same(ours, stock, q0, v0, **kwargs)
            assert y.shape == qs


# ----------------------------------------------------------------------------
# The graph: no Einsum in a real model.fit train step; the attention op (or its reference).


def _classifier(layer_cls, vocab=20, length=None, dim=8, mask_zero=True, **mha_kwargs):
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim, mask_zero=mask_zero, name="embed")(tokens)
    x = layer_cls(num_heads=2, key_dim=4, name="mha", **mha_kwargs)(x, x, use_causal_mask=True)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(1, name="head")(x)
    model = keras.Model(tokens, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(rng, n=8, length=6, vocab=20):
    x = rng.integers(1, vocab, (n, length)).astype("int32")
    x[:, 4:] *= rng.integers(0, 2, (n, 1))  # some padded sequences
    return x, rng.standard_normal((n, 1)).astype("float32")


def _op_types(cap, pre=False):
    ops = set()
    for fg in cap.functions:
        graph = fg.pre_graph if pre else fg.graph
        ops.update(n.op for n in graph.node)
        for fdef in graph.library.function:
            ops.update(n.op for n in fdef.node_def)
    return ops


def _mha_nodes(cap):
    """The post-optimization nodes of the ``mha`` layer (forward and gradient) in a captured step."""
    return [n for n in cap.nodes() if re.search(r"(^|/)mha(_\d+)?/", n.name)]


# (sequence length, Embedding(mask_zero=...), the most ops ours may have, as a fraction of stock's)
TRAIN_STEPS = {"padded_dynamic": (None, True, 0.85), "padded_static": (6, True, 0.85), "causal_only": (None, False, 0.7)}


@pytest.mark.parametrize("case", sorted(TRAIN_STEPS))
def test_train_step_has_no_einsum(path, case):
    """A real model.fit train step: no Einsum; the attention op with the kernel; fused projections."""
    length, mask_zero, ratio = TRAIN_STEPS[case]
    rng = np.random.default_rng(9)
    x, y = _data(rng)
    cap = inspect.capture_train(_classifier(FusedMultiHeadAttention, length=length, mask_zero=mask_zero), x, y)
    ops, pre_ops = _op_types(cap), _op_types(cap, pre=True)
    traced = _op_types(
        inspect.trace_train(_classifier(FusedMultiHeadAttention, length=length, mask_zero=mask_zero), x, y)
    )
    assert "Einsum" not in ops | pre_ops | traced
    assert "Softmax" not in ops  # no materialized softmax: the op, or its reference's exp/sum
    if path == "kernel":
        assert {fusion.ATTENTION_OP, fusion.ATTENTION_GRAD_OP} <= ops
    else:
        assert fusion.ATTENTION_OP not in ops and fusion.ATTENTION_GRAD_OP not in ops
    mha = _mha_nodes(cap)
    # Self-attention: one MatMul + BiasAdd for query/key/value (concatenated kernels), one for the output.
    fused = [n for n in mha if n.op == "_FusedMatMul"]
    assert len(fused) == 2, sorted((n.op, n.name) for n in mha if "MatMul" in n.op)
    assert all(n.attr["fused_ops"].list.s == [b"BiasAdd"] for n in fused)
    if path == "kernel":  # (the reference is BatchMatMul + exp/sum pieces)
        assert not [n for n in mha if n.op in ("BatchMatMulV2", "Einsum", "Softmax")]
    stock_cap = inspect.capture_train(_classifier(MHA, length=length, mask_zero=mask_zero), x, y)
    stock_mha = _mha_nodes(stock_cap)
    if length is None:
        assert "Einsum" in _op_types(stock_cap)  # the check can fail: stock emits it
    real = [n for n in mha if n.op != "Const"]
    stock_real = [n for n in stock_mha if n.op != "Const"]
    # The layer's share of the step (ReadVariableOps included): with the op, well under stock's.
    if path == "kernel":
        assert len(real) <= ratio * len(stock_real), (len(real), len(stock_real))


def test_fit_matches_stock():
    rng = np.random.default_rng(10)
    x, y = _data(rng)
    stock = _classifier(MHA)
    ours = _classifier(FusedMultiHeadAttention)
    stock.set_weights([w + 0.2 * rng.standard_normal(w.shape).astype(w.dtype) for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    h_ref = stock.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    h = ours.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(h, h_ref, rtol=1e-5)
    for a, b in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# The exact path and its reasons.


def _is_exact_path(layer, *args, **kwargs):
    """The call runs stock's attention (a Softmax; no attention op, no reference exp/sum)."""
    cap = inspect.capture_function(lambda *a: layer(*a, **kwargs), *args)
    ops = _op_types(cap, pre=True)
    return "Softmax" in ops and fusion.ATTENTION_OP not in ops


def test_return_attention_scores_is_exact_stock():
    rng = np.random.default_rng(11)
    q, v, _ = _inputs(rng, 2, 5, 4, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4), q, v, rng=rng)
    mask = _masks(rng, 2, 5, 4)["rank3"]
    y, s = ours(q, v, attention_mask=mask, return_attention_scores=True)
    y_ref, s_ref = stock(q, v, attention_mask=mask, return_attention_scores=True)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(s, s_ref)
    assert ours.unfused_reason is None  # scores always take the exact path; this is about the others
    assert _is_exact_path(ours, q, v, return_attention_scores=True)
    assert not _is_exact_path(ours, q, v)


def test_dropout_training_is_fused_and_draws_stocks_mask(path):
    """Attention dropout in training runs in the op, from the stock sublayer's seed generator: in the
    same generator state as stock, the same mask, so the same outputs and gradients (eager and
    tf.function), and each call advances the generator once, as stock's does."""
    rng = np.random.default_rng(12)
    q, v, _ = _inputs(rng, 2, 5, 4, 8, 8)
    kwargs = dict(num_heads=2, key_dim=4, dropout=0.5, seed=3)
    ours, stock = _pair(kwargs, q, v, rng=rng)
    assert ours.unfused_reason is None
    for graph in (False, True):
        y = _check_same(ours, stock, q, v, graph=graph, training=True)
        np.testing.assert_array_equal(ours._dropout_layer.seed_generator.state.numpy(),
                                      stock._dropout_layer.seed_generator.state.numpy())
    assert not np.allclose(y, ours(q, v, training=False))  # something is dropped
    assert not _is_exact_path(ours, q, v, training=True)
    assert not _is_exact_path(ours, q, v, training=False)
    # Another draw, another mask; set_random_seed reproduces a run of a layer seeded from it.
    assert not np.allclose(ours(q, v, training=True), ours(q, v, training=True))
    runs = []
    for _ in range(2):
        keras.utils.set_random_seed(21)
        layer = FusedMultiHeadAttention(num_heads=2, key_dim=4, dropout=0.3)
        runs.append([layer(q, v, training=True).numpy() for _ in range(2)])
    np.testing.assert_array_equal(runs[0], runs[1])
    # Inference: stock's dropout path zeroes a fully masked row (not the mean), so must we.
    mask = _masks(rng, 2, 5, 4)["rank3"]
    _check_same(ours, stock, q, v, attention_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_training_with_masks_matches_stock(causal, path):
    """Keras padding masks (rows attending no key: stock zeroes them) and an attention mask, with
    dropout in training, cross-attention with q_seq != kv_seq and value_dim != key_dim."""
    rng = np.random.default_rng(14)
    kwargs = dict(num_heads=2, key_dim=4, value_dim=3, dropout=0.4, seed=5)
    q, v, _ = _inputs(rng, 2, 5, 6, 8, 8)
    ours, stock = _pair(kwargs, q, v, rng=rng)
    value_mask = np.array([[0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 0]], bool)  # batch row 0 attends no key
    y = _check_same(ours, stock, q, v, training=True, value_mask=value_mask, use_causal_mask=causal)
    assert (y[0] == y[0, :1]).all()  # batch row 0: only the output bias
    mask = _masks(rng, 2, 5, 6)["rank3"]
    _check_same(ours, stock, q, v, training=True, attention_mask=mask, use_causal_mask=causal)
    # A padded query row (its mask on the tensor, as Keras propagates it): stock zeroes it.
    inputs = [keras.Input((5, 8)), keras.Input((6, 8))]
    q_mask = np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 0]], bool)
    outs = {}
    for name, layer in (("ours", ours), ("stock", stock)):
        masked_q = keras.layers.Masking(mask_value=0.0)(inputs[0])
        model = keras.Model(inputs, layer(masked_q, inputs[1], value_mask=value_mask, use_causal_mask=causal))
        outs[name] = model([q * q_mask[..., None], v], training=True)
    np.testing.assert_allclose(outs["ours"], outs["stock"], rtol=1e-5, atol=1e-5)
    assert (np.asarray(outs["ours"])[1, 4] == np.asarray(outs["ours"])[0, 0]).all()  # zeroed: the bias


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_dropout_training_under_mixed_precision_matches_stock(policy, path):
    """The mask's uniform numbers come from the compute dtype's mantissa bits, as stock's Dropout
    draws them on the float16/bfloat16 softmax output: the same mask, outputs within rounding."""
    rng = np.random.default_rng(15)
    q, v, _ = _inputs(rng, 2, 6, 7, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4, dropout=0.3, seed=9), q, v, rng=rng, policy=policy)
    y, _ = _run(ours, q, v, training=True)
    y_ref, _ = _run(stock, q, v, training=True)
    # A different mask moves outputs by O(1); rounding by ~1e-2 of their size.
    assert_close(y, y_ref, policy)
    assert ours.compute_dtype == policy.split("_")[1]


def test_dropout_one_takes_the_exact_path():
    rng = np.random.default_rng(16)
    q, v, _ = _inputs(rng, 2, 5, 4, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4, dropout=1.0, seed=3), q, v, rng=rng)
    assert "dropout=1.0" in ours.unfused_reason
    np.testing.assert_array_equal(ours(q, v, training=True), stock(q, v, training=True))
    assert _is_exact_path(ours, q, v, training=True)
    assert not _is_exact_path(ours, q, v, training=False)


def test_fit_with_dropout_matches_stock(path):
    """model.fit with attention dropout: the op (forward and gradient) in the train step, no Softmax
    and no Einsum, and the same losses and weights as stock (the same masks, step after step)."""
    rng = np.random.default_rng(17)
    x, y = _data(rng)
    stock = _classifier(MHA, dropout=0.25, seed=4)
    ours = _classifier(FusedMultiHeadAttention, dropout=0.25, seed=4)
    stock.set_weights([w + 0.2 * rng.standard_normal(w.shape).astype(w.dtype) for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    h_ref = stock.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    h = ours.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(h, h_ref, rtol=1e-5)
    for a, b in zip(ours.get_weights(), stock.get_weights()):  # generator states included
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    cap = inspect.capture_train(_classifier(FusedMultiHeadAttention, dropout=0.25, seed=4), x, y)
    ops = _op_types(cap) | _op_types(cap, pre=True)
    assert "Einsum" not in ops and "Softmax" not in ops
    if path == "kernel":
        assert {fusion.ATTENTION_OP, fusion.ATTENTION_GRAD_OP} <= ops


def test_custom_attention_axes_and_ranks_are_exact():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 4, 8)).astype("float32")
    ours, stock = _pair(dict(num_heads=2, key_dim=4, attention_axes=(1, 2)), x, x, rng=rng)
    assert "attention_axes" in ours.unfused_reason or "ranks" in ours.unfused_reason
    np.testing.assert_array_equal(ours(x, x), stock(x, x))
    assert "attention_axes=(2,)" in FusedMultiHeadAttention(num_heads=1, key_dim=2, attention_axes=2).unfused_reason
    assert FusedMultiHeadAttention(num_heads=1, key_dim=2, attention_axes=-2).unfused_reason is None
    q, v, _ = _inputs(rng, 2, 4, 4, 8, 8)
    same, stock = _pair(dict(num_heads=2, key_dim=4, attention_axes=1), q, v, rng=rng)
    assert same.unfused_reason is None
    _check_same(same, stock, q, v)


def test_other_reasons():
    assert "key_dim=300" in FusedMultiHeadAttention(num_heads=1, key_dim=300).unfused_reason
    assert "float64" in FusedMultiHeadAttention(num_heads=1, key_dim=2, dtype="float64").unfused_reason
    assert "flash_attention" in FusedMultiHeadAttention(num_heads=1, key_dim=2, flash_attention=True).unfused_reason

    class Sub(FusedMultiHeadAttention):
        def _compute_attention(self, *args, **kwargs):
            return super()._compute_attention(*args, **kwargs)

    assert "_compute_attention" in Sub(num_heads=1, key_dim=2).unfused_reason
    x = np.ones((1, 3, 4), "float32")
    flash = FusedMultiHeadAttention(num_heads=1, key_dim=2, flash_attention=True)
    assert error_type(lambda: flash(x, x)) is error_type(lambda: MHA(num_heads=1, key_dim=2, flash_attention=True)(x, x))


@pytest.mark.parametrize("activity", [None, "l2"], ids=["shared_matmul", "activity_regularizer"])
def test_lora_and_activity_regularizer_match_stock(activity):
    """LoRA-enabled projections (merged kernels) in the shared QKV MatMul, and with activity losses."""
    rng = np.random.default_rng(14)
    q, v, _ = _inputs(rng, 2, 3, 3, 4, 4)
    ours, stock = _pair(dict(num_heads=2, key_dim=4, use_bias=False, activity_regularizer=activity), q, v, rng=rng)
    for layer in (ours, stock):
        layer.query_dense.enable_lora(2, b_initializer="ones")
        layer.value_dense.enable_lora(2, b_initializer="ones")
    for a, b in zip(ours.weights, stock.weights):
        a.assign(b)
    _check_same(ours, stock, q, q)  # self-attention: one MatMul for query, key and value unless regularized
    _check_same(ours, stock, q, v)
    ours(q, v), stock(q, v)
    assert len(ours.losses) == len(stock.losses) == (4 if activity else 0)
    np.testing.assert_allclose(sorted(map(float, ours.losses)), sorted(map(float, stock.losses)), rtol=1e-5)


# ----------------------------------------------------------------------------
# Keras layer contract: config, serialization, errors.


def test_config_serialization_and_save_load():
    kwargs = dict(num_heads=2, key_dim=3, value_dim=5, output_shape=(4,), use_gate=True, sliding_window=3,
                  kernel_regularizer="l2", bias_constraint="non_neg", seed=1)
    ours = FusedMultiHeadAttention(**kwargs)
    stock_config = MHA(**kwargs).get_config()
    config = ours.get_config()
    assert {k: v for k, v in config.items() if k != "name"} == {k: v for k, v in stock_config.items() if k != "name"}
    assert FusedMultiHeadAttention.from_config(config).get_config() == config
    assert keras.saving.get_registered_name(FusedMultiHeadAttention) == "tfmetal_ext>FusedMultiHeadAttention"

    x = np.random.default_rng(15).standard_normal((2, 5, 6)).astype("float32")
    inp = keras.Input((5, 6))
    model = keras.Model(inp, ours(inp, inp, use_causal_mask=True))
    ref = model(x)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer(ours.name)) is FusedMultiHeadAttention
    np.testing.assert_array_equal(loaded(x), ref)


def test_symbolic_shapes_and_dynamic_lengths():
    layer = FusedMultiHeadAttention(num_heads=2, key_dim=4, output_shape=(3, 2))
    q, v = keras.Input((None, 6)), keras.Input((None, 5))
    out = layer(q, v)
    assert tuple(out.shape) == (None, None, 3, 2)
    _, scores = layer(q, v, return_attention_scores=True)
    assert len(scores.shape) == 4

    @tf.function(input_signature=[tf.TensorSpec([None, None, 6]), tf.TensorSpec([None, None, 5])])
    def f(q, v):
        y = layer(q, v, use_causal_mask=True)
        assert y.shape.as_list() == [None, None, 3, 2]
        return y

    assert f(tf.ones((2, 7, 6)), tf.ones((2, 3, 5))).shape == (2, 7, 3, 2)


@pytest.mark.parametrize(
    "case",
    ["bad_num_heads", "bad_key_dim", "bad_output_shape", "kv_mismatch", "wrong_last_dim", "bad_mask"],
)
def test_errors_match_stock(case):
    x, y = np.ones((2, 4, 8), "float32"), np.ones((2, 3, 8), "float32")

    def make(cls):
        if case == "bad_num_heads":
            return lambda: cls(num_heads=0, key_dim=2)
        if case == "bad_key_dim":
            return lambda: cls(num_heads=2, key_dim=1.5)
        if case == "bad_output_shape":
            return lambda: cls(num_heads=2, key_dim=2, output_shape=8.0)
        layer = cls(num_heads=2, key_dim=2)
        layer(x, y)
        if case == "kv_mismatch":
            return lambda: layer(x, y, np.ones((2, 5, 8), "float32"))
        if case == "wrong_last_dim":
            return lambda: layer(np.ones((2, 4, 7), "float32"), y)
        return lambda: layer(x, y, attention_mask=np.ones((2, 3, 3), bool))

    want = error_type(make(MHA))
    assert want is not None
    got = error_type(make(FusedMultiHeadAttention))
    assert got is want or (issubclass(got, (ValueError, tf.errors.InvalidArgumentError))
                           and issubclass(want, (ValueError, tf.errors.InvalidArgumentError))), (got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["", "dropout_inference"])
@pytest.mark.parametrize("q_len, kv_len", [(5, 5), (6, 3), (3, 7)])
def test_padding_masks_match_stock(q_len, kv_len, causal, dropout, path):
    """(batch, seq) query/value/key masks: the op gets a (batch, 1, 1, kv) key mask, never a (q, kv) one.

    Rows that attend no key (a padded query, every key padded, or with
    causal every key up to the row padded) are stock's: the mean of the
    values, or 0 on stock's dropout path (inference here).
    """
    rng = np.random.default_rng(16)
    q, v, k = _inputs(rng, 4, q_len, kv_len, 8, 8, 8)
    ours, stock = _pair(dict(num_heads=2, key_dim=4, dropout=dropout, seed=1), q, v, k, rng=rng)
    value_mask = rng.random((4, kv_len)) > 0.4
    value_mask[0] = False  # every key padded
    value_mask[1, 0] = False  # with causal, row 0 of batch 1 attends no key
    value_mask[2] = True
    key_mask = rng.random((4, kv_len)) > 0.2
    key_mask[2] = True
    for kwargs in ({"value_mask": value_mask}, {"value_mask": value_mask, "key_mask": key_mask}):
        _check_same(ours, stock, q, v, k, use_causal_mask=causal, graph=True, **kwargs)
    # The query's mask comes on the tensor (as Keras propagates it): through a functional model.
    inputs = [keras.Input((q_len, 8)), keras.Input((kv_len, 8)), keras.Input((kv_len, 8))]
    q_mask = rng.random((4, q_len)) > 0.3
    outs = {}
    for name, layer in (("ours", ours), ("stock", stock)):
        masked_q = keras.layers.Masking(mask_value=0.0)(inputs[0])
        model = keras.Model(inputs, layer(masked_q, inputs[1], inputs[2], value_mask=value_mask,
                                          use_causal_mask=causal))
        outs[name] = model([q * q_mask[..., None], v, k])
    np.testing.assert_allclose(outs["ours"], outs["stock"], rtol=1e-5, atol=1e-5)
    if path == "kernel":  # the op's mask input is (batch, 1, 1, kv): no (q, kv) matrix is built
        fn = tf.function(lambda a, b, c: ours(a, b, c, value_mask=value_mask, use_causal_mask=causal))
        graph = fn.get_concrete_function(tf.constant(q), tf.constant(v), tf.constant(k)).graph
        op = [o for o in graph.get_operations() if o.type == fusion.ATTENTION_OP]
        assert len(op) == 1 and op[0].get_attr("causal") == causal
        assert op[0].inputs[3].shape.as_list() == [4, 1, 1, kv_len]
