"""FusedLSTM / FusedGRU: equivalence with keras.layers.LSTM / GRU, the CudnnRNNV3 path, graphs, Keras checks.

References are the stock Keras layers (run on CPU), Keras' own cuDNN weight packing, and
`cudnn_rnn_reference`: CudnnRNNV3's semantics written from cuDNN's documented equations and
canonical parameter layout, used in place of the op (which has no CPU kernel) to run the
layers' cuDNN path here.
"""

import dataclasses
import importlib
import os
import re
import tempfile
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import _env, backends, devices, inspect
from tfmetal_ext.backends import _table
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import FusionContext
from tfmetal_ext.inspect.capture import Capture, FunctionGraph
from tfmetal_ext.inspect.report import LayerIndex, build_fusion_report
from tfmetal_ext.layers import FusedGRU, FusedLSTM, recurrent
from tfmetal_ext.ops import _cudnn_params, _recurrence
from tfmetal_ext.testing import assert_close, run_layer_test

keras_tf_rnn = importlib.import_module("keras.src.backend.tensorflow.rnn")  # Keras' cuDNN path

KINDS = {"lstm": (FusedLSTM, keras.layers.LSTM, 2), "gru": (FusedGRU, keras.layers.GRU, 1)}


# ----------------------------------------------------------------------------
# References.


def cudnn_rnn_reference(input, input_h, input_c, params, sequence_lengths, rnn_mode, time_major=False, **_):
    """CudnnRNNV3 (unidirectional, one layer, batch-major) from cuDNN's documented math.

    params: the G input matrices (units, in), the G recurrent ones (units, units),
    then G input and G recurrent biases; LSTM gates i, f, g, o; GRU gates r, z, n with
    n = tanh(W_n x + b_Wn + r * (R_n h + b_Rn)) and h' = (1 - z) n + z h.
    Rows run for their first `sequence_lengths` steps; later outputs are zero.
    """
    assert not time_major
    gates = {"lstm": 4, "gru": 3}[rnn_mode]
    steps, features, units = input.shape[1], input.shape[2], input_h.shape[-1]
    sizes = [units * features] * gates + [units * units] * gates + [units] * (2 * gates)
    pieces = tf.split(params, sizes)
    w = [tf.reshape(p, [units, features]) for p in pieces[:gates]]
    r = [tf.reshape(p, [units, units]) for p in pieces[gates : 2 * gates]]
    bw, br = pieces[2 * gates : 3 * gates], pieces[3 * gates :]
    h = input_h[:, 0]
    c = input_c[:, 0] if rnn_mode == "lstm" else None
    outputs = []
    for t in range(steps):
        valid = (t < sequence_lengths)[:, None]
        xa = [tf.matmul(input[:, t], w[k], transpose_b=True) + bw[k] for k in range(gates)]
        ha = [tf.matmul(h, r[k], transpose_b=True) + br[k] for k in range(gates)]
        if rnn_mode == "lstm":
            i, f = tf.sigmoid(xa[0] + ha[0]), tf.sigmoid(xa[1] + ha[1])
            g, o = tf.tanh(xa[2] + ha[2]), tf.sigmoid(xa[3] + ha[3])
            c_new = f * c + i * g
            h_new = o * tf.tanh(c_new)
            c = tf.where(valid, c_new, c)
        else:
            reset, update = tf.sigmoid(xa[0] + ha[0]), tf.sigmoid(xa[1] + ha[1])
            n = tf.tanh(xa[2] + reset * ha[2])
            h_new = (1 - update) * n + update * h
        h = tf.where(valid, h_new, h)
        outputs.append(tf.where(valid, h_new, tf.zeros_like(h_new)))
    out_c = c[:, None] if c is not None else tf.zeros([0], input.dtype)
    return tf.stack(outputs, axis=1), h[:, None], out_c, tf.zeros([0], input.dtype), tf.zeros([0], tf.int8)


def make_mask(kind, batch, steps, rng):
    """right: padded at the end; left: padded at the start; mixed: anywhere, row 0 fully masked."""
    if kind is None:
        return None
    lengths = rng.integers(1, steps + 1, batch)
    lengths[0] = max(1, steps - 1)
    pos = np.arange(steps)[None]
    if kind == "right":
        return pos < lengths[:, None]
    if kind == "left":
        return pos >= (steps - lengths)[:, None]
    mask = rng.random((batch, steps)) > 0.4
    mask[0] = False
    return mask


def make_pair(kind, kwargs, shape, policy="float32", seed=0):
    """Stock and fused layers with the same random weights, copied stock -> ours, checked ours -> stock."""
    ours_cls, stock_cls, _ = KINDS[kind]
    rng = np.random.default_rng(seed)
    stock, ours = stock_cls(dtype=policy, **kwargs), ours_cls(dtype=policy, **kwargs)
    stock.build(shape)
    ours.build(shape)
    assert [(w.name, tuple(w.shape)) for w in ours.weights] == [(w.name, tuple(w.shape)) for w in stock.weights]
    stock.set_weights([(w + rng.normal(0, 0.3, w.shape)).astype("float32") for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    back = stock_cls(**kwargs)
    back.build(shape)
    back.set_weights(ours.get_weights())
    for a, b in zip(back.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    return stock, ours


def run(layer, x, mask=None, initial_state=None, training=False, eager=False):
    """Outputs and gradients w.r.t. x, the initial states and the weights of a weighted sum of all outputs."""

    def step(x, states):
        with tf.GradientTape() as tape:
            tape.watch(x)
            tape.watch(states)
            kwargs = {"training": training}
            if mask is not None:
                kwargs["mask"] = tf.constant(mask)
            if states:
                kwargs["initial_state"] = list(states)
            out = layer(x, **kwargs)
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            loss = 0.0
            for k, o in enumerate(outs):
                o = tf.cast(o, tf.float32)
                weights = tf.sin(tf.cast(tf.range(tf.size(o)), tf.float32) * 0.37 + k)
                loss += tf.reduce_sum(o * tf.reshape(weights, tf.shape(o)))
        return outs, tape.gradient(loss, [x, *states, *layer.trainable_weights])

    fn = step if eager else tf.function(step)
    states = [tf.constant(s) for s in initial_state or []]
    outs, grads = fn(tf.constant(x), states)
    to_np = lambda t: np.asarray(tf.cast(t, tf.float32))  # noqa: E731
    return [to_np(o) for o in outs], [to_np(g) for g in grads]


def check_equivalence(kind, kwargs, shape, mask=None, init=False, policy="float32", seed=0, eager=False):
    stock, ours = make_pair(kind, kwargs, shape, policy, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal(shape).astype("float32")
    mask = make_mask(mask, shape[0], shape[1], rng)
    states = [rng.standard_normal((shape[0], kwargs["units"])).astype("float32") for _ in range(KINDS[kind][2])]
    states = states if init else None
    got_out, got_grads = run(ours, x, mask, states, eager=eager)
    want_out, want_grads = run(stock, x, mask, states, eager=True)  # the reference: Keras, eagerly
    assert len(got_out) == len(want_out) == (1 + KINDS[kind][2] if kwargs.get("return_state") else 1)
    for g, w in zip(got_out, want_out):
        assert g.shape == w.shape
        assert_close(g, w, policy)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, policy)
    return got_out


# ----------------------------------------------------------------------------
# Equivalence on the CPU path (the loop).

CASES = [
    (dict(units=6), (4, 7, 5), None, False),
    (dict(units=3, return_sequences=True, return_state=True), (3, 1, 4), None, True),
    (dict(units=5, return_sequences=True, go_backwards=True), (3, 7, 5), "right", False),
    (dict(units=4, return_sequences=True, return_state=True), (3, 6, 5), "mixed", True),
    (dict(units=4, go_backwards=True, return_state=True), (3, 6, 5), "left", True),
    (dict(units=4, return_sequences=True, zero_output_for_mask=True), (3, 6, 5), "mixed", False),
    (dict(units=4, zero_output_for_mask=True, go_backwards=True), (3, 6, 5), "right", False),
    (dict(units=5, use_bias=False, return_sequences=True), (2, 5, 3), "left", False),
]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_matches_keras(kind):
    # Cases looped in one test: each test's teardown (clear_session) is the slow part.
    for i, (kwargs, shape, mask, init) in enumerate(CASES):
        check_equivalence(kind, kwargs, shape, mask, init, seed=i)
    check_equivalence(kind, dict(units=4, return_sequences=True), (2, 4, 3), "mixed", False, eager=True)


def test_while_loop_matches_keras(monkeypatch):
    """Sequence lengths beyond MAX_UNROLL (and unknown ones) run a tf.while_loop."""
    monkeypatch.setattr(_recurrence, "MAX_UNROLL", 0)
    for kind in ("lstm", "gru"):
        check_equivalence(kind, dict(units=4, return_sequences=True, go_backwards=True, return_state=True),
                          (3, 6, 5), "mixed", True, seed=3)
        check_equivalence(kind, dict(units=3), (2, 5, 4), "right", False, seed=4)


def _rel(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6))


# Quick tier: one kind (the policy handling is the same code for both); test_matches_keras runs both. The full tier runs each.
@pytest.mark.sample_axes("kind")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_mixed_precision_matches_keras(kind):
    for policy in ("mixed_bfloat16", "mixed_float16"):
        _check_mixed_precision(kind, policy)


def _check_mixed_precision(kind, policy):
    """Outputs within 1e-2 of Keras under the same policy. Gradients: Keras' own half-precision
    gradients are 1-2% off its float32 ones here (bfloat16), so ours are held to the float32
    gradients with the error Keras itself has at that policy (at most twice, or 1e-2)."""
    kwargs, shape = dict(units=8, return_sequences=True), (4, 5, 6)
    stock, ours = make_pair(kind, kwargs, shape, policy)
    exact = KINDS[kind][1](**kwargs)
    exact.build(shape)
    exact.set_weights(stock.get_weights())
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype("float32")
    mask = make_mask("right", shape[0], shape[1], rng)
    (got,), got_grads = run(ours, x, mask)
    (want,), want_grads = run(stock, x, mask)
    (ref,), ref_grads = run(exact, x, mask)
    assert_close(got, want, policy)
    for g, w, r in zip(got_grads, want_grads, ref_grads):
        assert _rel(g, r) <= max(2 * _rel(w, r), 1e-2), (_rel(g, r), _rel(w, r))
    layer = KINDS[kind][0](4, dtype=policy)
    y = layer(np.ones((2, 3, 5), "float32"))
    assert keras.backend.standardize_dtype(y.dtype) == policy.split("_")[1]
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in layer.weights)


def test_dynamic_batch_and_time():
    for kind in ("lstm", "gru"):
        _check_dynamic_batch_and_time(kind)


def _check_dynamic_batch_and_time(kind):
    """Unknown batch and time dimensions: the tf.while_loop, outputs and gradients as Keras."""
    stock, ours = make_pair(kind, dict(units=4, return_sequences=True), (2, 5, 3))
    spec = tf.TensorSpec([None, None, 3], tf.float32)

    def grads(layer):
        @tf.function(input_signature=[spec])
        def f(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(tf.sin(y * 3.0))
            return [y] + tape.gradient(loss, [x] + layer.trainable_weights)

        return f

    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
    f_ours = grads(ours)
    for got, want in zip(f_ours(x), grads(stock)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ops = {op.type for op in f_ours.get_concrete_function().graph.get_operations()}
    assert "While" in ops or "StatelessWhile" in ops


def test_dropout_matches_keras_with_the_same_seed():
    for kind in ("lstm", "gru"):
        stock, ours = make_pair(kind, dict(units=4, dropout=0.4, seed=11), (3, 5, 6))
        x = np.random.default_rng(1).standard_normal((3, 5, 6)).astype("float32")
        got, want = ours(x, training=True), stock(x, training=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(got, ours(x, training=False), atol=1e-3)  # dropout did act in training
        np.testing.assert_allclose(ours(x, training=False), stock(x, training=False), rtol=1e-5, atol=1e-6)


def test_keras_masking_layers():
    """Masks from keras.layers.Masking and Embedding(mask_zero=True) reach the layer as in Keras."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 9, (4, 6))
    tokens[0, 4:] = 0
    tokens[1, :2] = 0
    values = rng.standard_normal((4, 6, 3)).astype("float32")
    values[2, 3:] = 0.0
    for kind in ("lstm", "gru"):
        ours_cls, stock_cls, _ = KINDS[kind]
        for front, x in ((lambda: keras.layers.Embedding(10, 3, mask_zero=True), tokens),
                         (lambda: keras.layers.Masking(0.0), values)):
            models = []
            for cls in (stock_cls, ours_cls):
                inp = keras.Input(x.shape[1:], dtype="int32" if x is tokens else "float32")
                seq = cls(5, return_sequences=True, name="rnn")(front()(inp))
                out = cls(4, go_backwards=True, name="rnn2")(seq)
                models.append(keras.Model(inp, out))
            models[1].set_weights(models[0].get_weights())
            np.testing.assert_allclose(models[1](x), models[0](x), rtol=1e-5, atol=1e-5)


def test_stateful_matches_keras():
    for kind in ("lstm", "gru"):
        ours_cls, stock_cls, _ = KINDS[kind]
        stock, ours = make_pair(kind, dict(units=4, stateful=True, return_sequences=True), (2, 3, 5))
        x = np.random.default_rng(2).standard_normal((2, 3, 5)).astype("float32")
        first, second = ours(x), ours(x)
        np.testing.assert_allclose(first, stock(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(second, stock(x), rtol=1e-5, atol=1e-6)
        assert not np.allclose(first, second)
        ours.reset_state()
        np.testing.assert_allclose(ours(x), first, rtol=1e-6, atol=1e-6)
        assert len(ours.weights) == len(stock.weights)


def test_bidirectional_matches_keras():
    """keras.layers.Bidirectional wraps the fused layers (and sets zero_output_for_mask as for LSTM)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 4)).astype("float32")
    mask = make_mask("right", 3, 5, rng)
    for kind in ("lstm", "gru"):
        ours_cls, stock_cls, _ = KINDS[kind]
        stock = keras.layers.Bidirectional(stock_cls(3, return_sequences=True))
        ours = keras.layers.Bidirectional(ours_cls(3, return_sequences=True))
        stock.build(x.shape)
        ours.build(x.shape)
        ours.set_weights([w + 0.1 for w in stock.get_weights()])
        stock.set_weights(ours.get_weights())
        np.testing.assert_allclose(ours(x, mask=mask), stock(x, mask=mask), rtol=1e-5, atol=1e-6)


# XLA in the full tier (~5 s): the quick tier keeps the graph case and the XLA fallback tests.
@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.full)], ids=["graph", "xla"])
def test_fit_matches_keras(jit_compile):
    """A few SGD steps of model.fit leave the same weights as with the stock layer (also under XLA,
    where the LSTM cell gradient is the composite: XLA has no LSTMBlockCellGrad)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 6, 5)).astype("float32")
    y = rng.standard_normal((16, 2)).astype("float32")
    for kind in ("lstm",) if jit_compile else ("lstm", "gru"):
        ours_cls, stock_cls, _ = KINDS[kind]
        models = []
        for cls in (stock_cls, ours_cls):
            inp = keras.Input((6, 5))
            out = keras.layers.Dense(2)(cls(4, name="rnn")(inp))
            model = keras.Model(inp, out)
            jit = jit_compile and cls is ours_cls  # the reference: Keras' layer without XLA
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit)
            assert model.jit_compile == jit
            models.append(model)
        models[1].set_weights(models[0].get_weights())
        start = [w.copy() for w in models[0].get_weights()]
        for model in models:
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for got, want, before in zip(models[1].get_weights(), models[0].get_weights(), start):
            assert not np.allclose(want, before)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # The trained fused weights, copied into the stock model, predict the same.
        models[0].set_weights(models[1].get_weights())
        np.testing.assert_allclose(models[0].predict(x, verbose=0), models[1].predict(x, verbose=0),
                                   rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# The CudnnRNNV3 path (Metal and CUDA), built and run here against the reference op.


@pytest.fixture
def force_backend(monkeypatch):
    """Sets the environment's backend (its capabilities pinned) for the test."""
    import contextlib
    import dataclasses

    from tfmetal_ext import _env

    with contextlib.ExitStack() as stack:
        def force(name):
            caps = dataclasses.replace(devices.capabilities(), backend=name)
            stack.enter_context(_env.scope(pinned_capabilities=caps))
            monkeypatch.setattr(devices, "_built_with_cuda", lambda: name == "cuda")

        yield force


def _keras_cudnn_params(kind, kernel, recurrent_kernel, bias, monkeypatch, cuda_build):
    """The params Keras' own cuDNN path passes to CudnnRNNV3 (the op replaced by a recorder)."""
    seen = {}

    def record(**kw):
        seen.update(kw)
        return cudnn_rnn_reference(**kw)

    monkeypatch.setattr(tf.raw_ops, "CudnnRNNV3", record)
    build_info = dict(tf.sysconfig.get_build_info(), is_cuda_build=cuda_build)
    monkeypatch.setattr(tf.sysconfig, "get_build_info", lambda: build_info)
    x = tf.zeros([2, 3, kernel.shape[0]])
    h = tf.zeros([2, recurrent_kernel.shape[0]])
    if kind == "lstm":
        keras_tf_rnn._cudnn_lstm(x, h, h, kernel, recurrent_kernel, bias, None, False, False, True)
    else:
        keras_tf_rnn._cudnn_gru(x, h, kernel, recurrent_kernel, bias, None, False, False, True)
    monkeypatch.undo()
    return seen["params"].numpy()


def test_cudnn_params_match_keras_packing(monkeypatch):
    """Keras packs GRU gates for cuDNN only in a CUDA build (Metal runs under a non-CUDA one)."""
    for cuda_build in (True, False):
        _check_cudnn_params(cuda_build, monkeypatch)


def _check_cudnn_params(cuda_build, monkeypatch):
    rng = np.random.default_rng(5)
    units, features = 3, 5
    r = lambda *s: tf.constant(rng.standard_normal(s).astype("float32"))  # noqa: E731
    w, u, b = r(features, 4 * units), r(units, 4 * units), r(4 * units)
    want = _keras_cudnn_params("lstm", w, u, b, monkeypatch, cuda_build)
    np.testing.assert_array_equal(_cudnn_params.lstm_cudnn_params(w, u, b, units).numpy(), want)
    w, u, b = r(features, 3 * units), r(units, 3 * units), r(2, 3 * units)
    want = _keras_cudnn_params("gru", w, u, b, monkeypatch, cuda_build)
    np.testing.assert_array_equal(_cudnn_params.gru_cudnn_params(w, u, b, units, swap_gates=cuda_build).numpy(), want)
    assert want.size == 3 * units * (features + units) + 6 * units


CUDNN_CASES = [
    (dict(units=4, return_sequences=True, return_state=True), (3, 4, 5), None, True),
    (dict(units=3, return_sequences=True), (3, 4, 4), "right", False),
    (dict(units=3, return_sequences=True, go_backwards=True, return_state=True), (3, 4, 4), "right", True),
    (dict(units=3, go_backwards=True, zero_output_for_mask=True), (3, 4, 4), "right", False),
    (dict(units=3, return_sequences=True, zero_output_for_mask=True, use_bias=False), (3, 4, 4), "right", False),
    (dict(units=3, return_sequences=True), (2, 4, 3), "mixed", True),  # not right-padded: the loop runs
]


# Quick tier: one kind through the cuDNN path (the same code for both; the full tier runs each).
@pytest.mark.sample_axes("kind")
@pytest.mark.parametrize("kind, backend", [("lstm", "cuda"), ("gru", "cuda")])
def test_cudnn_path_matches_keras(kind, backend, force_backend, monkeypatch):
    """The layers forced onto the CudnnRNNV3 path, the op replaced by the cuDNN reference, match Keras on CPU.

    Checks the parameter packing's meaning (cuDNN's layout and gate order) and the
    handling of sequence lengths, go_backwards and Keras' outputs at masked steps.
    Metal takes the same code path (`test_gpu_graph_uses_cudnn`); its GRU packing is
    Keras' packing there (`test_cudnn_params_match_keras_packing`), and which gate
    order tensorflow-metal's kernel reads is checked only on a Mac (`-m metal`).
    """
    calls = []

    def op(**kw):
        calls.append(kw["rnn_mode"])
        return cudnn_rnn_reference(**kw)

    references = []
    for kwargs, shape, mask, init in CUDNN_CASES:
        stock, _ = make_pair(kind, kwargs, shape)
        rng = np.random.default_rng(7)
        x = rng.standard_normal(shape).astype("float32")
        m = make_mask(mask, shape[0], shape[1], rng)
        states = [rng.standard_normal((shape[0], kwargs["units"])).astype("float32") for _ in range(KINDS[kind][2])]
        references.append((stock.get_weights(), x, m, states if init else None,
                           run(stock, x, m, states if init else None, eager=True)))
    force_backend(backend)
    monkeypatch.setattr(tf.raw_ops, "CudnnRNNV3", op)
    for i, ((kwargs, shape, *_), (weights, x, m, states, (want_out, want_grads))) in enumerate(
        zip(CUDNN_CASES, references)
    ):
        ours = KINDS[kind][0](**kwargs)
        ours.build(shape)
        assert ours.supports_jit is False
        ours.set_weights(weights)
        # Eager keeps the test fast; the last two cases also run as a tf.function (both cond branches traced).
        for eager in (True, False) if i >= len(CUDNN_CASES) - 2 else (True,):
            got_out, got_grads = run(ours, x, m, states, eager=eager)
            for g, w in zip(got_out + got_grads, want_out + want_grads):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert calls and set(calls) == {kind}


def _graph_ops(concrete):
    graph = concrete.graph.as_graph_def()
    ops = [n.op for n in graph.node]
    for fn in graph.library.function:
        ops += [n.op for n in fn.node_def]
    return ops


def _train_graph(layer, shape, mask=None):
    """The traced (not run) graph of a forward + backward step."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, mask=mask))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    return _graph_ops(step.get_concrete_function(tf.TensorSpec(shape, tf.float32)))


@pytest.mark.full  # the CUDA graph built for inspection (~6 s); the quick tier keeps test_cudnn_path_matches_keras
def test_gpu_graph_uses_cudnn(force_backend):
    for backend in ("metal", "cuda"):
        force_backend(backend)
        _check_gpu_graph()


def _check_gpu_graph():
    for cls in (FusedLSTM, FusedGRU):
        ops = _train_graph(cls(8, return_sequences=True), (4, 5, 6))
        assert ops.count("CudnnRNNV3") == 1 and ops.count("CudnnRNNBackpropV3") == 1
        assert "While" not in ops and "MatMul" not in ops
        mask = tf.constant(make_mask("right", 4, 5, np.random.default_rng(0)))
        ops = _train_graph(cls(8), (4, 5, 6), mask)
        assert "CudnnRNNV3" in ops and ("If" in ops or "StatelessIf" in ops)  # loop fallback for other masks
        # The fallback loop on a GPU uses the composite cell gradient (no LSTMBlockCellGrad on Metal).
        assert "LSTMBlockCellGrad" not in ops
        ops = _train_graph(cls(8, use_cudnn=False), (4, 5, 6))
        assert "CudnnRNNV3" not in ops


def test_cpu_graph_has_minimal_step():
    """On CPU: no CudnnRNNV3; per unrolled LSTM step one MatMul, three Sigmoid and two Tanh forward and
    one LSTMBlockCellGrad and one MatMul backward; dU and the input projection are single MatMuls."""
    steps = 6
    ops = _train_graph(FusedLSTM(8), (4, steps, 5))
    assert "CudnnRNNV3" not in ops and "While" not in ops
    assert not [op for op in ops if op.startswith("TensorList")]
    assert ops.count("LSTMBlockCellGrad") == steps
    assert ops.count("Sigmoid") == 3 * steps and ops.count("Tanh") == 2 * steps
    # h@U and dz@U^T per step; projection, its dW and dX, and dU once.
    assert ops.count("MatMul") == 2 * steps + 4
    ops = _train_graph(FusedGRU(8), (4, steps, 5))
    assert ops.count("MatMul") == 4 * steps + 8  # 2 projections with their dW and dX, dU_zr, dU_h
    assert ops.count("Sigmoid") == steps and ops.count("Tanh") == steps


def test_cpu_while_body_has_minimal_step():
    spec = tf.TensorSpec([4, None, 5], tf.float32)
    layer = FusedLSTM(8)

    @tf.function(input_signature=[spec])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    graph = step.get_concrete_function().graph.as_graph_def()
    bodies = [f for f in graph.library.function if "body" in f.signature.name]
    per_body = [[n.op for n in f.node_def] for f in bodies]
    forward = [ops for ops in per_body if "Sigmoid" in ops]
    backward = [ops for ops in per_body if "LSTMBlockCellGrad" in ops]
    assert len(forward) == 1 and len(backward) == 1
    assert forward[0].count("MatMul") == 1 and forward[0].count("Sigmoid") == 3 and forward[0].count("Tanh") == 2
    assert backward[0].count("MatMul") == 1 and backward[0].count("LSTMBlockCellGrad") == 1


# ----------------------------------------------------------------------------
# Inspection.


def test_fusion_report_on_cpu_lists_the_layer_with_its_reason():
    inp = keras.Input((6, 5))
    out = FusedGRU(4, name="gru")(FusedLSTM(4, return_sequences=True, name="lstm")(inp))
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(out))
    for mode in ("predict", "train"):
        report = inspect.fusion_report(model, mode=mode)
        for name, cls in (("lstm", "FusedLSTM"), ("gru", "FusedGRU")):
            row = report.row(name)
            assert row.layer_class == cls and row.pattern == "cudnn_rnn"
            assert "no fused RNN kernel on CPU" in row.reason and cls in row.reason
            assert row.actual_op == "_FusedMatMul" and row.actual_fused_ops[:1] == ["BiasAdd"]
            assert row.status == "partial"
        assert "CudnnRNNV3" not in report.ops_by_type
        assert "gru" in str(report) and "no fused RNN kernel on CPU" in str(report)


def test_catalog_expects_cudnn_on_gpus(monkeypatch):
    monkeypatch.setattr(devices, "_built_with_cuda", lambda: True)
    layer = FusedLSTM(4)
    for backend in ("metal", "cuda"):
        exp = catalog.expectation(layer, FusionContext(backend=backend, onednn=False, cublaslt=False))
        assert (exp.pattern, exp.op, exp.reason) == ("cudnn_rnn", "CudnnRNNV3", None)
    exp = catalog.expectation(FusedGRU(4, use_cudnn=False), FusionContext(backend="metal", onednn=False))
    assert exp.op is None and "use_cudnn=False" in exp.reason
    exp = catalog.expectation(FusedLSTM(4, use_bias=False), FusionContext(backend="cpu"))
    assert exp.op is None and "use_bias=False" in exp.reason
    exp = catalog.expectation(layer, FusionContext(backend="cpu", xla=True))
    assert exp.op is None and exp.reason == catalog.REASON_XLA
    assert catalog.PATTERNS["cudnn_rnn"].fused_op == "CudnnRNNV3"


def test_report_counts_cudnn_node_as_the_layers_fusion():
    """On Metal/CUDA the executed graph's CudnnRNNV3 node is the layer's fused node."""
    inp = keras.Input((5, 3))
    model = keras.Model(inp, FusedLSTM(4, name="lstm")(inp))
    graph = tf.compat.v1.GraphDef()
    node = graph.node.add(name="StatefulPartitionedCall/functional_1/lstm_1/CudnnRNNV3", op="CudnnRNNV3")
    node.input.extend(["functional_1/lstm_1/transpose", "functional_1/lstm_1/ExpandDims"])
    cap = Capture([FunctionGraph("f", graph, [], graph)], mode="predict")
    report = build_fusion_report(cap, LayerIndex(model), FusionContext(backend="metal", onednn=False))
    row = report.row("lstm")
    assert (row.status, row.actual_op) == ("fused", "CudnnRNNV3")


# ----------------------------------------------------------------------------
# Keras layer checks, config, arguments.


LAYER_CHECKS = [
    (FusedLSTM, dict(units=3), (2, 4, 5), (2, 3)),
    (FusedLSTM, dict(units=3, return_sequences=True, go_backwards=True, kernel_regularizer="l2",
                     recurrent_constraint="max_norm", unit_forget_bias=False), (2, 4, 5), (2, 4, 3)),
    (FusedGRU, dict(units=3, return_sequences=True, dropout=0.2, seed=3), (2, 4, 5), (2, 4, 3)),
    (FusedGRU, dict(units=2, use_bias=False, activity_regularizer="l1"), (2, 1, 5), (2, 2)),
]


def test_keras_layer_checks():
    """Config round trip, symbolic/eager shapes, weight counts, .keras save/load, one fit step, mixed_float16."""
    for cls, kwargs, input_shape, output_shape in LAYER_CHECKS:
        n_weights = 3 if kwargs.get("use_bias", True) else 2
        run_layer_test(cls, kwargs, input_shape, expected_output_shape=output_shape,
                       expected_num_trainable_weights=n_weights)


def test_return_state_shapes_mask_and_save_load():
    inp = keras.Input((None, 4))
    masked = keras.layers.Masking()(inp)
    seq, h, c = FusedLSTM(3, return_sequences=True, return_state=True, name="lstm")(masked)
    out, h2 = FusedGRU(2, return_state=True, name="gru")(seq, initial_state=keras.layers.Dense(2)(h))
    model = keras.Model(inp, [out, h2, c])
    assert [tuple(t.shape) for t in (seq, h, c, out, h2)] == [(None, None, 3), (None, 3), (None, 3), (None, 2), (None, 2)]
    layer = model.get_layer("lstm")
    assert layer.compute_output_shape((2, 5, 4)) == ((2, 5, 3), (2, 3), (2, 3))
    mask = tf.constant([[True, False]])
    assert layer.compute_mask(None, mask)[0] is mask and layer.compute_mask(None, mask)[1:] == [None, None]
    x = np.random.default_rng(0).standard_normal((2, 5, 4)).astype("float32")
    x[1, 3:] = 0.0
    want = [np.asarray(t) for t in model(x)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rnn.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    for got, w in zip(loaded(x), want):
        np.testing.assert_array_equal(np.asarray(got), w)
    assert type(loaded.get_layer("lstm")) is FusedLSTM and type(loaded.get_layer("gru")) is FusedGRU


def test_config_round_trip_and_keras_configs():
    for cls, stock_cls, extra in ((FusedLSTM, keras.layers.LSTM, {"unit_forget_bias": False}),
                                  (FusedGRU, keras.layers.GRU, {})):
        kwargs = dict(units=5, return_sequences=True, go_backwards=True, dropout=0.1, seed=2,
                      kernel_initializer="he_normal", bias_regularizer="l2", zero_output_for_mask=True, **extra)
        config = cls(**kwargs).get_config()
        assert cls.from_config(config).get_config() == config
        stock = stock_cls(**kwargs).get_config()
        assert set(stock) <= set(config)
        for key in stock:
            if key not in ("name", "dtype"):
                assert config[key] == stock[key], key
        # A stock config builds the fused layer (drop-in).
        assert cls.from_config(stock).get_config()["units"] == 5
        assert keras.saving.get_registered_name(cls) == f"tfmetal_ext>{cls.__name__}"


def test_initial_weights_follow_keras():
    """unit_forget_bias: forget-gate bias starts at one; GRU bias (2, 3*units) starts at zero."""
    lstm = FusedLSTM(3)
    lstm.build((2, 4, 5))
    np.testing.assert_array_equal(lstm.bias.numpy(), [0] * 3 + [1] * 3 + [0] * 6)
    lstm = FusedLSTM(3, unit_forget_bias=False, bias_initializer="ones")
    lstm.build((2, 4, 5))
    np.testing.assert_array_equal(lstm.bias.numpy(), np.ones(12))
    gru = FusedGRU(3)
    gru.build((2, 4, 5))
    assert gru.bias.shape == (2, 9) and not gru.bias.numpy().any()
    q = gru.recurrent_kernel.numpy()  # orthogonal, as Keras' default
    np.testing.assert_allclose(q @ q.T, np.eye(3), atol=1e-5)


BAD_ARGS = [
    (dict(units=0), "units"),
    (dict(units=-2), "units"),
    (dict(units="4"), "units"),
    (dict(units=4, activation="relu"), "activation"),
    (dict(units=4, recurrent_activation="hard_sigmoid"), "recurrent_activation"),
    (dict(units=4, recurrent_dropout=1.0), "recurrent_dropout"),
    (dict(units=4, unroll=1), "unroll"),
    (dict(units=4, implementation="2"), "implementation"),
    (dict(units=4, dropout=1.0), "dropout"),
    (dict(units=4, dropout=-0.1), "dropout"),
    (dict(units=4, use_cudnn="yes"), "use_cudnn"),
    (dict(units=4, go_backwards=1), "go_backwards"),
    (dict(units=4, seed=1.5), "seed"),
    (dict(units=4, kernel_initializer="no_such_init"), "kernel_initializer"),
]


def test_bad_arguments():
    for cls in (FusedLSTM, FusedGRU):
        for kwargs, name in BAD_ARGS + ([(dict(units=4, reset_after=1), "reset_after")] if cls is FusedGRU else []):
            with pytest.raises(ValueError) as info:
                cls(**kwargs)
            assert re.search(rf"Received: {name}=[^\n]*$", str(info.value)), (cls, kwargs, str(info.value))


def test_bad_inputs():
    x = np.zeros((2, 3, 4), "float32")
    for cls in (FusedLSTM, FusedGRU):
        with pytest.raises(ValueError):
            cls(3)(np.zeros((2, 4), "float32"))
        with pytest.raises(ValueError):
            cls(3)(np.zeros((2, 3, 4, 1), "float32"))
    with pytest.raises(ValueError, match=r"Received: initial_state shapes=\[\(2, 3\)\]"):
        FusedLSTM(3)(x, initial_state=[np.zeros((2, 3), "float32")])  # needs h and c
    with pytest.raises(ValueError, match="initial_state shapes"):
        FusedLSTM(3)(x, initial_state=[np.zeros((2, 5), "float32")] * 2)
    with pytest.raises(ValueError, match="initial_state shapes"):
        FusedGRU(3)(x, initial_state=np.zeros((4, 3), "float32"))  # batch 4 != 2
    with pytest.raises(ValueError, match="static batch size"):
        FusedGRU(3, stateful=True)(keras.Input((3, 4)))
    with pytest.raises(ValueError, match=r"Received: use_cudnn=True"):
        FusedGRU(3, use_cudnn=True)(x)  # no GPU here


# ----------------------------------------------------------------------------
# On a Mac: tensorflow-metal's CudnnRNNV3 against Keras on the CPU.


@pytest.mark.metal
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_metal_device_matches_keras_on_cpu(kind):
    kwargs = dict(units=16, return_sequences=True, return_state=True)
    _, ours = make_pair(kind, kwargs, (8, 12, 10))
    stock = KINDS[kind][1](use_cudnn=False, **kwargs)  # Keras' own loop, on the CPU
    stock.build((8, 12, 10))
    stock.set_weights(ours.get_weights())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12, 10)).astype("float32")
    mask = make_mask("right", 8, 12, rng)
    with tf.device("/CPU:0"):
        want_out, want_grads = run(stock, x, mask)
    got_out, got_grads = run(ours, x, mask)
    for g, w in zip(got_out + got_grads, want_out + want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# The rest of the stock contract: implementation, unroll, recurrent dropout, and the stock form
# where the fused loop was measured slower.

STOCK_FORM_CASES = [
    (dict(units=4, return_sequences=True, return_state=True), (3, 6, 5), "mixed", True),
    (dict(units=4, go_backwards=True, return_state=True), (3, 6, 5), "left", True),
    (dict(units=4, return_sequences=True, zero_output_for_mask=True, go_backwards=True), (3, 6, 5), "mixed", False),
    (dict(units=5, use_bias=False), (2, 5, 3), None, False),
]


# Quick tier: one kind (the stock form is Keras' own cell for both); test_matches_keras runs both. The full tier runs each.
@pytest.mark.sample_axes("kind")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_stock_form_matches_keras(kind):
    with _table.force_cpu_form("stock"):
        for i, (kwargs, shape, mask, init) in enumerate(STOCK_FORM_CASES):
            check_equivalence(kind, kwargs, shape, mask, init, seed=20 + i)


# Quick tier: one kind (the arguments pass through the same code for both); test_matches_keras runs both. The full tier runs each.
@pytest.mark.sample_axes("kind")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unroll_and_implementation_match_keras(kind):
    # Before: unroll=True and implementation=1|2 were refused.
    for i, kwargs in enumerate([dict(units=4, unroll=True, return_sequences=True), dict(units=3, implementation=1),
                                dict(units=3, implementation=2, go_backwards=True)]):
        check_equivalence(kind, kwargs, (3, 5, 4), "mixed", False, seed=30 + i)
    layer = KINDS[kind][0](3, implementation=1)
    assert layer.get_config()["implementation"] == 1
    layer = KINDS[kind][0](3, unroll=True)
    layer(np.zeros((2, 4, 3), "float32"))
    assert layer.form == "stock" and "unroll" in layer.stock_form_reason()
    unrolled = KINDS[kind][0](3, unroll=True)
    fn = tf.function(lambda x: unrolled(x), input_signature=[tf.TensorSpec((None, None, 3), tf.float32)])
    with pytest.raises(ValueError, match="time dimension"):
        fn.get_concrete_function()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_dropout_runs_the_stock_form(kind):
    # Before: recurrent_dropout > 0 was refused.
    stock, ours = make_pair(kind, dict(units=4, recurrent_dropout=0.4, return_sequences=True), (3, 6, 5), "float32", 40)
    x = np.random.default_rng(41).standard_normal((3, 6, 5)).astype("float32")
    assert "recurrent_dropout" in ours.stock_form_reason()
    np.testing.assert_allclose(np.asarray(ours(x, training=False)), np.asarray(stock(x, training=False)),
                               rtol=1e-5, atol=1e-5)
    dropped = np.asarray(ours(x, training=True))
    assert ours.form == "stock" and not np.allclose(dropped, np.asarray(ours(x, training=False)))
    assert ours.get_config()["implementation"] == 1  # as Keras' cells switch to with recurrent dropout


def _inside(region, units=3):
    """A (batch, steps, units) shape inside an `RnnStock` region (small where it leaves a bound open)."""
    return region.min_batch or 4, region.min_steps or 3, region.max_units or region.min_units or units


def _first_region(kind, table=None):
    regions = ((table or backends.current()).rnn_stock or {}).get(kind)
    return regions[0] if regions else None


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_backend_table_picks_the_form_per_static_shape(kind):
    region = _first_region(kind)
    cls = KINDS[kind][0]
    shapes = {"small": (4, 3, 2)}
    if region is not None:
        shapes["inside"] = _inside(region, units=2)
    for label, (batch, steps, units) in shapes.items():
        inp = keras.Input(batch_shape=(batch, steps, 2))
        layer = cls(units, name="rnn")
        model = keras.Model(inp, layer(inp))
        want = "stock" if label == "inside" else "fused"
        assert (layer.stock_form_reason(batch, steps=steps) is None) == (want == "fused"), label
        row = inspect.fusion_report(model, mode="predict").row("rnn")
        assert layer.form == want, label
        if want == "stock":
            assert "stock" in row.reason and f"batch {batch}" in row.reason and region.reason in row.reason
            # no fused recurrence; Keras' GRU step may still get TF's own _FusedMatMul[BiasAdd]
            assert row.actual_op is None or "RNN" not in row.actual_op
        else:
            assert "stock" not in (row.reason or "")
    # an unknown batch (a fit step traced on data that does not split evenly) meets no batch bound
    layer = cls(2)
    tf.function(layer, input_signature=[tf.TensorSpec((None, 3, 2), tf.float32)]).get_concrete_function()
    assert layer.form == "fused"


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no_onednn"])
def test_the_form_follows_the_table_of_the_cpu_configuration(onednn, monkeypatch):
    # devices.capabilities().onednn picks the table; the rule is read from it, not assumed.
    caps = dataclasses.replace(devices.capabilities(), backend="cpu", onednn=onednn, metal_plugin=None)
    key = "cpu_onednn" if onednn else "cpu"
    mine = backends.RnnStock("measured here", min_steps=7, max_units=5)  # no batch bound
    patched = dataclasses.replace(backends.table(key), rnn_stock=types.MappingProxyType({"lstm": (mine,)}))
    monkeypatch.setattr(backends.registry, "TABLES", types.MappingProxyType({**backends.TABLES, key: patched}))
    with _env.scope(pinned_capabilities=caps):
        assert backends.current() is patched
        layer = FusedLSTM(5)
        for batch in (3, None):  # no batch bound: it holds for an unknown batch too
            why = layer.stock_form_reason(batch, steps=7)
            assert why is not None and "measured here" in why and patched.label in why
        assert layer.stock_form_reason(3, steps=6) is None and FusedLSTM(6).stock_form_reason(3, steps=7) is None
        assert FusedGRU(5).stock_form_reason(3, steps=7) is None  # the rule is per cell
    with _env.scope(pinned_capabilities=caps):  # unpatched: each region of the real table, with its reason
        monkeypatch.undo()
        table = backends.current()
        assert table.key == key
        for kind, regions in table.rnn_stock.items():
            for region in regions:
                batch, steps, units = _inside(region)
                why = KINDS[kind][0](units).stock_form_reason(batch, steps=steps)
                assert why is not None and region.reason in why, (kind, region)


def test_stock_form_at_the_rule_matches_keras():
    region = _first_region("lstm")
    if region is None:
        pytest.skip("this backend table has no LSTM stock-form rule")
    batch, steps, units = _inside(region)
    assert backends.current().rnn_cpu_form("lstm", batch, steps, units) == "stock"
    assert FusedLSTM(units).stock_form_reason(batch, steps=steps) is not None
    check_equivalence("lstm", dict(units=units, return_sequences=True), (batch, steps, 2), "right", False, seed=50)


def test_gru_reset_after_false_runs_the_stock_form():
    # Before: reset_after=False was refused.
    for i, kwargs in enumerate([dict(units=4, reset_after=False, return_sequences=True),
                                dict(units=3, reset_after=False, go_backwards=True, return_state=True)]):
        check_equivalence("gru", kwargs, (3, 5, 4), "mixed", i == 1, seed=60 + i)
    layer = FusedGRU(3, reset_after=False)
    layer.build((2, 4, 5))
    assert layer.bias.shape == (9,) and "reset_after" in layer.stock_form_reason()
    assert FusedGRU.from_config(layer.get_config()).reset_after is False


# ----------------------------------------------------------------------------
# The open tensorflow-metal-plugin (no CudnnRNNV3 kernel): the loop in its GPU form.


# Quick tier: one kind of the open plugin's loop form (the full tier, CI's make test-full, runs each).
@pytest.mark.sample_axes("kind")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_open_plugin_form_matches_keras(kind, monkeypatch):
    """Under assume_backend("tensorflow-metal-plugin") the layers run the loop with Split/ConcatV2 lists
    and float masks (`Backend.rnn_list_form`); outputs and gradients still equal keras.layers.LSTM/GRU on CPU.
    Before: the CudnnRNNV3 form, which has no kernel there (nor on this CPU)."""
    with devices.assume_backend("tensorflow-metal-plugin"):
        assert recurrent._implementation("metal", "float32") == "loop"
        for i, (kwargs, shape, mask, init) in enumerate(CASES):
            check_equivalence(kind, kwargs, shape, mask, init, seed=20 + i)
        _check_mixed_precision(kind, "mixed_float16")
        monkeypatch.setattr(_recurrence, "MAX_UNROLL", 0)  # the while loop, with its float mask TensorArray
        check_equivalence(kind, dict(units=4, return_sequences=True, go_backwards=True, return_state=True),
                          (3, 6, 5), "mixed", True, seed=3)
        check_equivalence(kind, dict(units=3, zero_output_for_mask=True), (2, 5, 4), "left", False, seed=4)
