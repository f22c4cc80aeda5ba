"""A projection's input made again in the backward pass (`tfmetal_ext.layers._replay`).

What is checked: which inputs get a replay and from which anchors; that the replayed input is the
forward one bit for bit; that FusedDense / FusedEinsumDense with the replay give the gradients of the
same layer without it (the projection's own gradients bit for bit, the activation's within a derived
bound), under float32, mixed_float16 and LoRA; and that the backward pass no longer reads the
forward product or activation.
"""

import contextlib
import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.layers import FusedDense, FusedEinsumDense, _replay
from tfmetal_ext.ops import rms_norm

EPS32 = 2.0 ** -24
EPS16 = 2.0 ** -11


def _rng(seed):
    return np.random.default_rng(seed)


def _swiglu(g, u):
    return u * keras.activations.silu(g)


def _in_graph(fn, *args):
    return tf.function(fn)(*args)


# ----------------------------------------------------------------------------
# plan(): what is replayed, from what.


def test_plan_replays_a_feed_forward_product_from_its_operands():
    g = tf.constant(_rng(0).standard_normal((4, 6)).astype("float32"))
    u = tf.constant(_rng(1).standard_normal((4, 6)).astype("float32"))

    def run(g, u):
        p = _swiglu(g, u)  # the operands: the function's arguments (computed tensors, not constants)
        replay = _replay.plan(p)
        assert replay is not None
        assert {a.ref() for a in replay.anchors} == {g.ref(), u.ref()}
        assert "Sigmoid" in {op.type for op in replay.ops}
        return p, replay.rebuild([tf.identity(a) for a in replay.anchors])

    p, again = _in_graph(run, g, u)
    np.testing.assert_array_equal(p.numpy(), again.numpy())


@pytest.mark.parametrize("make", [
    lambda x: tf.nn.relu(x),  # one tensor kept either way
    lambda x: x * 2.0,  # a scaling: no product of two computed tensors
    lambda x: tf.cast(tf.reshape(x, [-1]), "float16"),
    lambda x: tf.matmul(x, x, transpose_b=True),  # not elementwise: the input itself is the anchor
])
def test_plan_leaves_chains_with_nothing_to_gain(make):
    x = tf.constant(_rng(2).standard_normal((4, 4)).astype("float32"))

    def run(x):
        assert _replay.plan(make(tf.identity(x))) is None
        return x

    _in_graph(run, x)


def test_plan_is_none_eagerly():
    g = tf.constant(_rng(3).standard_normal((2, 3)).astype("float32"))
    assert _replay.plan(_swiglu(g, g + 1.0)) is None


def test_plan_anchors_a_custom_gradient_it_cannot_replay_at_its_output():
    """An activation over a custom gradient whose forward holds a MatMul: stepping inside would bypass
    that gradient, so its output is the anchor."""
    w = tf.constant(_rng(4).standard_normal((4, 4)).astype("float32"))

    @tf.custom_gradient
    def project(x):
        return tf.matmul(x, w), lambda dy: tf.matmul(dy, w, transpose_b=True)

    x = tf.constant(_rng(5).standard_normal((3, 4)).astype("float32"))

    def run(x):
        h = project(tf.identity(x))
        replay = _replay.plan(_swiglu(h, tf.identity(x)))
        assert replay is not None
        assert h.ref() in {a.ref() for a in replay.anchors}
        assert "MatMul" not in {op.type for op in replay.ops}
        return x

    _in_graph(run, x)


def test_plan_leaves_a_norm_to_its_own_gradient():
    """A norm's output feeds several projections (q, k, v): replaying it into each projection's
    gradient would normalize and differentiate it again per projection. `plan` leaves it
    (`fusion.REPLAY_GAIN_OPS`); `norm_plan` rebuilds it once instead (below)."""
    if not importlib.import_module("tfmetal_ext.ops.rms_norm").uses_kernel():
        pytest.skip("the reference RMS norm (no op library here) is elementwise TF ops, replayed as any chain")
    a = tf.constant(_rng(6).standard_normal((2, 5, 8)).astype("float32"))

    def run(a):
        y = rms_norm(tf.identity(a) * tf.identity(a), tf.ones([8]), epsilon=1e-6)
        assert _replay.plan(y) is None
        return y

    _in_graph(run, a)


# ----------------------------------------------------------------------------
# Activations with a one-op gradient inside the chain.


def _hub_gelu_approximate(x):
    keras_utils = pytest.importorskip("keras_hub.src.utils.keras_utils", reason="keras-hub is not installed")
    return keras_utils.gelu_approximate(x)


def _layers_gelu(name):
    from tfmetal_ext.layers import _contraction as C

    return lambda x: C.apply_activation(x, None, name, training=True)


ACTIVATION_FORMS = {
    "tf.nn.silu": ("silu", tf.nn.silu),
    "keras.silu": ("silu", keras.activations.silu),
    "keras.swish": ("silu", keras.activations.swish),
    "tf.nn.gelu": ("gelu", tf.nn.gelu),
    "keras.gelu": ("gelu", keras.activations.gelu),
    "tf.nn.gelu(approximate)": ("gelu_approximate", lambda x: tf.nn.gelu(x, approximate=True)),
    "keras.gelu(approximate)": ("gelu_approximate", lambda x: keras.activations.gelu(x, approximate=True)),
    "keras_hub.gelu_approximate": ("gelu_approximate", _hub_gelu_approximate),
    "FusedDense gelu (training)": ("gelu", _layers_gelu("gelu")),
    "FusedDense gelu_approximate (training)": ("gelu_approximate", _layers_gelu("gelu_approximate")),
}


@pytest.mark.parametrize("form", sorted(ACTIVATION_FORMS))
@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16", marks=pytest.mark.full)])  # quick: float32
def test_plan_finds_the_activation_of_each_form(form, dtype):
    kind, act = ACTIVATION_FORMS[form]
    g = tf.constant(_rng(20).standard_normal((4, 6)).astype(dtype))
    u = tf.constant(_rng(21).standard_normal((4, 6)).astype(dtype))

    def run(g, u):
        gate = tf.identity(g)
        p = act(gate) * tf.identity(u)
        replay = _replay.plan(p)
        assert replay is not None
        assert [(k, x.ref()) for _, k, _, x in replay.activations] == [(kind, gate.ref())]
        return p, replay.rebuild([tf.identity(a) for a in replay.anchors])

    p, again = _in_graph(run, g, u)
    np.testing.assert_array_equal(p.numpy(), again.numpy())  # the form's own ops, made again


@pytest.mark.parametrize("act", [
    lambda x: x * tf.sigmoid(1.702 * x),  # the sigmoid GELU: not one of the forms
    lambda x: 0.5 * x * (1.0 + tf.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),  # a hand-written tanh GELU
    lambda x: tf.sigmoid(x) * x,  # silu with the operands swapped: other ops than TF's
])
def test_plan_replays_other_activations_through_tfs_gradient(act):
    """An activation written otherwise is replayed op by op (TF's gradient), never taken for a form."""
    g = tf.constant(_rng(22).standard_normal((4, 6)).astype("float32"))

    def run(g):
        p = act(tf.identity(g)) * tf.identity(g + 1.0)
        replay = _replay.plan(p)
        assert replay is not None and replay.activations == ()
        return p

    _in_graph(run, g)


def test_plan_activation_input_must_be_one_tensor():
    """A form's ops over two different tensors (``x * sigmoid(beta * y)``) are no silu of either."""
    g = tf.constant(_rng(23).standard_normal((4, 6)).astype("float32"))

    def run(g):
        a, b = tf.identity(g), tf.identity(g * 2.0)
        p = a * tf.sigmoid(1.0 * b) * tf.identity(g + 1.0)
        replay = _replay.plan(p)
        assert replay is not None and replay.activations == ()
        return p

    _in_graph(run, g)


@pytest.mark.parametrize("chain", ["act(g) * u", "u * act(g)", "act(g * u)"])
@pytest.mark.parametrize("form", ["tf.nn.silu", "keras.gelu(approximate)", "FusedDense gelu (training)"])
def test_replayed_backward_differentiates_the_activation_in_one_op(form, chain):
    """The train step's backward pass differentiates the chain's activation with one op and none of
    TF's gradient ops for its inner ops: ``TfmetalExt>GatedActivationGrad`` where the activation is a
    factor of the product (a gated feed-forward; it also takes the product's gradient), else
    ``TfmetalExt>ActivationGrad``."""
    if not importlib.import_module("tfmetal_ext.ops.activation_grad").uses_kernel():
        pytest.skip("no op library here: ops.activation_grad runs its pure-TF reference")
    from tfmetal_ext.backends import fusion

    _, act = ACTIVATION_FORMS[form]
    make = {"act(g) * u": lambda g, u: act(g) * u, "u * act(g)": lambda g, u: u * act(g),
            "act(g * u)": lambda g, u: act(g * u)}[chain]
    layer = FusedDense(5)
    layer.build((2, 7, 12))
    g, u, dy = _operands("float32")

    def run(g, u):
        with tf.GradientTape() as tape:
            tape.watch([g, u])
            y = layer(make(g, u), training=True)
        return tape.gradient(y, [g, u] + layer.trainable_variables, output_gradients=dy)

    graph = tf.function(run).get_concrete_function(g, u).graph
    types = [op.type for op in graph.get_operations()]
    gated = chain != "act(g * u)"
    assert types.count(fusion.GATED_ACTIVATION_GRAD_OP) == int(gated), types
    assert types.count(fusion.ACTIVATION_GRAD_OP) == int(not gated), types
    assert not {"SigmoidGrad", "TanhGrad"} & set(types), types
    # The activation's own transcendental: the forward pass's and the replay's (for the kernel's
    # gradient), none for its derivative.
    assert sum(types.count(t) for t in ("Sigmoid", "Tanh", "Erfc")) == 2, types
    with _replay_plans(False):
        plain = tf.function(run)(g, u)
    got = tf.function(run)(g, u)
    for a, b in zip(got, plain):  # the activation's gradient within the layer tests' float32 bounds
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_broadcast_gated_product_keeps_the_separate_gradients():
    """``silu(g) * w`` with w broadcast along the rows (a per-channel gate): no GatedActivationGrad
    (its operands must have one shape), the activation's ActivationGrad instead; the gradients are
    those of the unreplayed layer within its bound."""
    if not importlib.import_module("tfmetal_ext.ops.activation_grad").uses_kernel():
        pytest.skip("no op library here: ops.activation_grad runs its pure-TF reference")
    from tfmetal_ext.backends import fusion

    layer = FusedDense(5)
    layer.build((2, 7, 12))
    g, _, dy = _operands("float32")
    w = tf.constant(_rng(30).standard_normal(12).astype("float32"))

    def run(g, w):
        with tf.GradientTape() as tape:
            tape.watch([g, w])
            y = layer(tf.nn.silu(g) * w, training=True)
        return tape.gradient(y, [g, w] + layer.trainable_variables, output_gradients=dy)

    types = [op.type for op in tf.function(run).get_concrete_function(g, w).graph.get_operations()]
    assert fusion.GATED_ACTIVATION_GRAD_OP not in types and types.count(fusion.ACTIVATION_GRAD_OP) == 1, types
    got = tf.function(run)(g, w)
    with _replay_plans(False):
        plain = tf.function(run)(g, w)
    assert got[1].shape == (12,)
    for a, b in zip(got, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# The layers: gradients with and without the replay.


def _layer(kind, units, dtype=None):
    if kind == "dense":
        return FusedDense(units, use_bias=True, dtype=dtype)
    return FusedEinsumDense("btf,fd->btd", output_shape=(None, units), bias_axes="d", dtype=dtype)


@contextlib.contextmanager
def _replay_plans(replay, found=None):
    """Within: `_replay.plan` as it is (`replay`) or finding nothing; each answer appended to `found`."""
    original = _replay.plan

    def plan(t, **kw):
        answer = original(t, **kw) if replay else None
        if found is not None:
            found.append(answer)
        return answer

    _replay.plan = plan
    try:
        yield
    finally:
        _replay.plan = original


def _step(layer, g, u, dy, replay):
    """Outputs and gradients (g, u, then the layer's trainable variables) of ``layer(silu(g) * u)``
    in a training call in a tf.function, with or without the replay."""

    def run(g, u):
        with tf.GradientTape() as tape:
            tape.watch([g, u])
            gg = tf.cast(tf.nn.silu(tf.cast(g, "float32")), g.dtype)  # keras-hub's Llama: silu in float32
            y = layer(u * gg, training=True)
        grads = tape.gradient(y, [g, u] + layer.trainable_variables, output_gradients=dy)
        return [y] + grads

    with _replay_plans(replay):
        return [np.asarray(tf.cast(t, "float32")) for t in tf.function(run)(g, u)]


def _operands(dtype, shape=(2, 7, 12), units=5, seed=10):
    g = tf.cast(_rng(seed).standard_normal(shape).astype("float32") * 2, dtype)
    u = tf.cast(_rng(seed + 1).standard_normal(shape).astype("float32"), dtype)
    dy = tf.cast(_rng(seed + 2).standard_normal(shape[:-1] + (units,)).astype("float32"), dtype)
    return g, u, dy


def _silu_gradient_bound(g, u, dp, eps):
    """Elementwise bound on |dg(replay) - dg(TF)|: the two differ only in how silu's derivative is
    formed (TF's custom gradient sigma * (1 + g (1 - sigma)) against autodiff of g * sigma, i.e.
    sigma + g sigma (1 - sigma)), each a handful of roundings of terms bounded by sigma + |g| sigma
    (1 - sigma) <= 1 + |g|, times ds = dp * u. 16 roundings of eps cover both formulas."""
    return 16 * eps * np.abs(dp * u) * (1 + np.abs(g)) + 1e-30


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_layer_gradients_match_the_unreplayed_layer(kind):
    g, u, dy = _operands("float32")
    layer = _layer(kind, 5)
    layer.build((2, 7, 12))
    with_replay = _step(layer, g, u, dy, replay=True)
    without = _step(layer, g, u, dy, replay=False)
    y, dg, du, dkernel, dbias = with_replay
    # The forward pass and the projection's own gradients: the same ops on bit-equal inputs.
    np.testing.assert_array_equal(y, without[0])
    np.testing.assert_array_equal(dbias, without[4])
    np.testing.assert_allclose(dkernel, without[3], rtol=8 * EPS32 * 12, atol=0)
    np.testing.assert_allclose(du, without[2], rtol=8 * EPS32, atol=0)
    kernel = np.asarray(layer.kernel).reshape(12, 5)
    dp = np.asarray(dy).reshape(-1, 5) @ kernel.T
    bound = _silu_gradient_bound(np.asarray(g).reshape(-1, 12), np.asarray(u).reshape(-1, 12), dp, EPS32)
    assert np.all(np.abs(dg.reshape(-1, 12) - without[1].reshape(-1, 12)) <= bound)


def test_layer_gradients_under_mixed_float16():
    """The replay runs in the backward pass under the layer's autocast scope: float16 kernel reads,
    as in the forward pass. The half-precision results may differ by one half rounding of each
    result (the float32 silu chain differs as above, then is cast once)."""
    g, u, dy = _operands("float16")
    layer = _layer("dense", 5, dtype="mixed_float16")
    layer.build((2, 7, 12))
    with_replay = _step(layer, g, u, dy, replay=True)
    without = _step(layer, g, u, dy, replay=False)
    np.testing.assert_array_equal(with_replay[0], without[0])
    for a, b in zip(with_replay[1:], without[1:]):
        scale = np.max(np.abs(b)) + 1e-30
        assert np.max(np.abs(a - b)) <= 2 * EPS16 * scale, (np.max(np.abs(a - b)), scale)


def test_lora_gradients_reach_the_adapters_through_the_replay():
    g, u, dy = _operands("float32")
    layer = _layer("dense", 5)
    layer.build((2, 7, 12))
    layer.enable_lora(2)
    layer.lora_kernel_b.assign(_rng(20).standard_normal((2, 5)).astype("float32"))
    assert [v.name for v in layer.trainable_variables] == ["bias", "lora_kernel_a", "lora_kernel_b"]
    with_replay = _step(layer, g, u, dy, replay=True)
    without = _step(layer, g, u, dy, replay=False)
    np.testing.assert_array_equal(with_replay[0], without[0])
    for a, b in zip(with_replay[3:], without[3:]):
        assert np.any(a != 0)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_backward_pass_reads_neither_the_product_nor_the_activation(kind):
    """Without the replay, the projection's kernel gradient reads the product and the product's
    gradient reads the activation; with it, both feed the forward pass only."""
    g, u, dy = _operands("float32")
    layer = _layer(kind, 5)
    layer.build((2, 7, 12))
    seen = {}

    def graph(replay):
        def run(g, u):
            with tf.GradientTape() as tape:
                tape.watch([g, u])
                s = tf.nn.silu(g)
                p = u * s
                seen["s"], seen["p"] = s, p
                y = layer(p, training=True)
            return tape.gradient(y, [g, u] + layer.trainable_variables, output_gradients=dy)

        with _replay_plans(replay):
            graph = tf.function(run).get_concrete_function(g, u).graph
        readers = [c.name for t in (seen["s"], seen["p"]) for c in graph.get_tensor_by_name(t.name).consumers()]
        return [name for name in readers if name.startswith("gradient_tape/")]

    assert graph(replay=False), "the check must see the backward readers without the replay"
    assert graph(replay=True) == []


@pytest.mark.parametrize("activation", ["gelu", "gelu_approximate"])
def test_gelu_feed_forward_second_projection_replays_the_gelu(activation):
    """GPT-2 / BERT / ViT's feed-forward: Dense(gelu) -> Dense. The second projection replays the GELU
    from the first one's pre-activation (exact GELU is Erfc-based, the tanh one Pow/Tanh-based), and
    the gradients are the unreplayed step's: both are TF's autodiff of the same GELU ops (the first
    layer recomputes it in its own backward pass without the replay), so only grappler's rewrites of
    the two graphs may round differently (a few float32 ulps of each sum of 24 products)."""
    rng = _rng(30)
    x = tf.constant(rng.standard_normal((2, 6, 8)).astype("float32"))
    dy = tf.constant(rng.standard_normal((2, 6, 5)).astype("float32"))
    first, second = FusedDense(24, activation=activation), FusedDense(5)
    first.build((2, 6, 8))
    second.build((2, 6, 24))
    planned = []

    def step(replay):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = second(first(x, training=True), training=True)
            return [y] + tape.gradient(y, [x] + first.trainable_variables + second.trainable_variables,
                                       output_gradients=dy)

        with _replay_plans(replay, planned):
            return [t.numpy() for t in tf.function(run)(x)]

    with_replay = step(True)
    assert planned[-1] is not None and "Mul" in {op.type for op in planned[-1].ops}
    without = step(False)
    np.testing.assert_array_equal(with_replay[0], without[0])
    for a, b in zip(with_replay[1:], without[1:]):
        np.testing.assert_allclose(a, b, rtol=64 * EPS32 * 24, atol=64 * EPS32 * np.max(np.abs(b)))


# ----------------------------------------------------------------------------
# norm_plan(): a norm's output made again once for all its projections' kernel gradients.

from tfmetal_ext.backends import fusion  # noqa: E402
from tfmetal_ext.ops import layer_norm  # noqa: E402


def _norms_use_kernels():
    for name in ("rms_norm", "layer_norm"):
        if not importlib.import_module(f"tfmetal_ext.ops.{name}").uses_kernel():
            pytest.skip("the norms run their pure-TF references here (no op library): nothing to rebuild")


@contextlib.contextmanager
def _norm_plans(enabled):
    original = _replay.norm_plan
    _replay.norm_plan = original if enabled else (lambda t: None)
    try:
        yield
    finally:
        _replay.norm_plan = original


def _norm(kind, x, gamma, beta):
    if kind == "rms":
        return rms_norm(x, gamma, epsilon=1e-6)
    return layer_norm(x, gamma, beta, epsilon=1e-5)


def _norm_step(kind, layers, x, gamma, beta, dys, enabled, seen=None):
    """Gradients (x, gamma, beta, then each layer's variables) of the layers' outputs over one norm of
    x, in a tf.function, with or without the rebuild; the concrete graph in ``seen["graph"]``."""

    def run(x, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y = _norm(kind, x, gamma, beta)
            outs = [layer(y, training=True) for layer in layers]
            if seen is not None:
                seen["y"] = y
        variables = [v for layer in layers for v in layer.trainable_variables]
        return tape.gradient(outs, [x, gamma, beta] + variables, output_gradients=dys)

    with _norm_plans(enabled):
        fn = tf.function(run)
        if seen is not None:
            seen["graph"] = fn.get_concrete_function(x, gamma, beta).graph
        return [np.asarray(t) for t in fn(x, gamma, beta)]


def _norm_case(kind, seed=30):
    rng = _rng(seed)
    x = tf.constant(rng.standard_normal((2, 9, 16)).astype("float32") * 2)
    gamma = tf.constant(rng.standard_normal(16).astype("float32"))
    beta = tf.constant(rng.standard_normal(16).astype("float32"))
    layers = [_layer("dense", 6), _layer("einsum", 4), _layer("dense", 6)]
    for layer in layers:
        layer.build((2, 9, 16))
    dys = [tf.constant(rng.standard_normal((2, 9, u)).astype("float32")) for u in (6, 4, 6)]
    return layers, x, gamma, beta, dys


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_rebuild_gives_the_same_gradients(kind):
    """The rebuilt norm output is the forward one bit for bit (a deterministic kernel on the same
    inputs): with one projection every gradient is the same bit for bit; with three, the projections'
    own gradients are, and the norm's input gradients differ only by the order TF adds the three input
    gradients in (bounded below)."""
    _norms_use_kernels()
    layers, x, gamma, beta, dys = _norm_case(kind)
    one = _norm_step(kind, layers[:1], x, gamma, beta, dys[:1], True)
    for a, b in zip(one, _norm_step(kind, layers[:1], x, gamma, beta, dys[:1], False)):
        np.testing.assert_array_equal(a, b)
    with_rebuild = _norm_step(kind, layers, x, gamma, beta, dys, True)
    without = _norm_step(kind, layers, x, gamma, beta, dys, False)
    assert len(with_rebuild) == len(without) == 3 + 2 + 2 + 2
    for a, b in zip(with_rebuild[3:], without[3:]):
        np.testing.assert_array_equal(a, b)
    # The bound. The norm's output gradient g is a sum of three float32 terms dX_i = dy_i W_i^T; either
    # order is within 2u sum_i |dX_i| of the exact sum (Higham's gamma_2), so the two differ by at most
    # e = 4u sum_i |dX_i| per element. The norm's gradient is linear in g: per row, dx = rstd (gamma g -
    # xhat mean(gamma g xhat)) (RMS; the layer norm also subtracts mean(gamma g)), so |ddx_i| <= rstd
    # max|gamma| max|e| (2 + |xhat_i| max|xhat|); dgamma sums e |xhat| over rows and dbeta sums e.
    xs = np.asarray(x, np.float64).reshape(-1, 16)
    g64 = np.asarray(gamma, np.float64)
    e = 4 * EPS32 * sum(np.abs(np.asarray(dy, np.float64).reshape(-1, dy.shape[-1]) @
                               np.abs(np.asarray(layer.kernel, np.float64).reshape(16, -1)).T)
                        for dy, layer in zip(dys, layers))
    centered = xs - (xs.mean(axis=1, keepdims=True) if kind == "layer" else 0.0)
    rstd = 1.0 / np.sqrt((centered ** 2).mean(axis=1, keepdims=True) + (1e-5 if kind == "layer" else 1e-6))
    xhat = centered * rstd
    emax = e.max(axis=1, keepdims=True)
    bound_dx = rstd * np.abs(g64).max() * emax * (2 + np.abs(xhat) * np.abs(xhat).max(axis=1, keepdims=True))
    dx = np.abs(with_rebuild[0].reshape(-1, 16) - without[0].reshape(-1, 16))
    assert np.all(dx <= 2 * bound_dx + 1e-30), (dx.max(), bound_dx.min())
    assert np.all(np.abs(with_rebuild[1] - without[1]) <= 2 * (e * np.abs(xhat)).sum(axis=0) + 1e-30)
    if kind == "layer":
        assert np.all(np.abs(with_rebuild[2] - without[2]) <= 2 * e.sum(axis=0) + 1e-30)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_output_feeds_the_forward_pass_only_and_is_rebuilt_once(kind):
    """Without the rebuild the projections' kernel gradients read the norm's output; with it, only
    forward ops do, one more norm op runs (for all three projections) and the norm's own gradient op
    still runs once."""
    _norms_use_kernels()
    layers, x, gamma, beta, dys = _norm_case(kind)
    norm_op = fusion.RMS_NORM_OP if kind == "rms" else fusion.LAYER_NORM_OP
    grad_op = fusion.RMS_NORM_GRAD_OP if kind == "rms" else fusion.LAYER_NORM_GRAD_OP

    def inspect(enabled):
        seen = {}
        _norm_step(kind, layers, x, gamma, beta, dys, enabled, seen)
        graph = seen["graph"]
        # The norm's output and the reshapes of it the projections make (views of the same buffer).
        tensors, readers = [graph.get_tensor_by_name(seen["y"].name)], []
        while tensors:
            for c in tensors.pop().consumers():
                readers.append(c.name)
                if c.type in ("Reshape", "Identity") and not c.name.startswith("gradient_tape/"):
                    tensors.extend(c.outputs)
        types = [op.type for op in graph.get_operations()]
        return [r for r in readers if r.startswith("gradient_tape/")], types.count(norm_op), types.count(grad_op)

    readers, norms, grads = inspect(False)
    assert readers and norms == 1 and grads == 1
    readers, norms, grads = inspect(True)
    assert readers == [] and norms == 2 and grads == 1


def test_norm_plan_finds_the_norm_through_a_cast_and_a_reshape():
    _norms_use_kernels()
    x = tf.constant(_rng(40).standard_normal((2, 3, 8)).astype("float32"))

    def run(x):
        y = rms_norm(tf.identity(x), tf.ones([8]), epsilon=1e-6)
        t = tf.reshape(tf.cast(y, "float16"), [-1, 8])
        rebuild = _replay.norm_plan(t)
        assert rebuild is not None and rebuild.norm.type == fusion.RMS_NORM_OP
        assert [op.type for op in rebuild.passthrough] == ["Cast", "Reshape"]
        assert _replay.norm_plan(y * 2.0) is None  # a product of the output is not the output
        return t, rebuild.rebuild([tf.identity(a) for a in rebuild.anchors], tf.zeros([]))

    t, again = _in_graph(run, x)
    np.testing.assert_array_equal(t.numpy(), again.numpy())


def test_norm_plan_is_none_eagerly_and_for_other_producers():
    _norms_use_kernels()
    x = tf.constant(_rng(41).standard_normal((2, 8)).astype("float32"))
    assert _replay.norm_plan(rms_norm(x, tf.ones([8]))) is None

    def run(x):
        assert _replay.norm_plan(tf.nn.relu(x)) is None
        return x

    _in_graph(run, x)
