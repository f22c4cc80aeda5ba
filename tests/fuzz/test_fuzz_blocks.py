"""Hypothesis fuzzing of the composite layers against stock Keras stacks with the same weights.

ConvBNAct and ConvBNAct1D against Conv2D/Conv1D(use_bias=False) +
BatchNormalization + Activation; ResidualBlock (basic and bottleneck, stride 1
and 2, identity or projection shortcut) against a ResNet v1 block of stock
layers written here; FoldedResidualBlock (``block.fold()``) against the block
at inference. Each example checks inference, then one training call: its
output and the moving statistics it leaves must equal stock's. Eager and
`tf.function`. Inputs of a bad rank and bad constructor arguments must raise
ValueError.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tfmetal_ext.layers import ConvBNAct, ConvBNAct1D, FoldedResidualBlock, ResidualBlock
from tfmetal_ext.testing import randomize_batch_norm

from ._tally import expect_error, expect_ok, fuzz_settings, MODES

FUZZ = fuzz_settings(6)
_seed = st.integers(0, 2**16)
_act = st.sampled_from(["relu", "relu6", "elu", "leaky_relu", None])
_momentum = st.sampled_from([0.0, 0.5, 0.99])
_epsilon = st.sampled_from([1e-3, 0.1])


# ----------------------------------------------------------------------------
# Stock twins.


def randomize(layer, rng):
    """Random kernel, gamma, beta and moving statistics (moving variance > 0) on a built ConvBNAct."""
    layer.kernel.assign(rng.normal(size=layer.kernel.shape).astype("float32"))
    randomize_batch_norm(layer, rng)


def stock_twin(layer, x, conv_cls, **conv_kw):
    """`conv_cls`(use_bias=False) + BatchNormalization (+ Activation), built on `x`, holding `layer`'s weights.

    Returns (callable(x, training), conv, bn); `conv_kw` are the conv's geometry.
    """
    conv = conv_cls(layer.filters, use_bias=False, **conv_kw)
    bn = keras.layers.BatchNormalization(momentum=layer.momentum, epsilon=layer.epsilon)
    act = None if layer.activation == "linear" else keras.layers.Activation(layer.activation)

    def call(t, training=False):
        y = bn(conv(t), training=training)
        return y if act is None else act(y)

    call(x)
    conv.kernel.assign(layer.kernel)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        getattr(bn, name).assign(getattr(layer, name))
    return call, conv, bn


def conv_bn_act_pair(kw, x, rng, one_d=False):
    """A built, randomized ConvBNAct(1D)(**kw) and its stock twin (call, conv, bn)."""
    layer = (ConvBNAct1D if one_d else ConvBNAct)(**kw)
    layer.build(tuple(x.shape))
    randomize(layer, rng)
    conv_cls = keras.layers.Conv1D if one_d else keras.layers.Conv2D
    geometry = dict(strides=1, padding="same")  # ConvBNAct's documented defaults (Conv2D's padding is "valid")
    geometry.update({k: kw[k] for k in ("kernel_size", "strides", "padding") if k in kw})
    return layer, stock_twin(layer, x, conv_cls, **geometry)


def _scaled_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def _caller(fn, mode, training):
    call = lambda t: fn(t, training=training)  # noqa: E731
    return call if mode == "eager" else tf.function(call)


def check_inference_then_training(ours, stock, x, mode, stat_pairs, tol=1e-5):
    """Inference output; then one training call: its output, then every (ours, stock) moving statistic."""
    want = stock(x, training=False).numpy()
    expect_ok(lambda: _caller(ours, mode, False)(x), lambda y: _scaled_close(y, want, tol))
    got = _caller(ours, mode, True)(x)
    want = stock(x, training=True).numpy()

    def verify(y):
        _scaled_close(y, want, 10 * tol)  # the batch variance can be tiny: 1/sqrt(var + eps) amplifies
        for a, b in stat_pairs:
            _scaled_close(a.numpy(), b.numpy(), tol)

    expect_ok(lambda: got, verify)


# ----------------------------------------------------------------------------
# ConvBNAct / ConvBNAct1D.


@FUZZ
@given(batch=st.integers(1, 3), h=st.integers(1, 7), w=st.integers(1, 7), cin=st.integers(1, 4),
       filters=st.integers(1, 4), k=st.integers(1, 3), strides=st.integers(1, 2),
       padding=st.sampled_from(["same", "valid"]), act=_act, momentum=_momentum, epsilon=_epsilon, seed=_seed)
@pytest.mark.parametrize("mode", MODES)
def test_conv_bn_act_matches_stock(mode, batch, h, w, cin, filters, k, strides, padding, act, momentum, epsilon,
                                   seed):
    if padding == "valid":
        h, w = max(h, k), max(w, k)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(1.0, 2.0, size=[batch, h, w, cin]).astype("float32"))
    kw = dict(filters=filters, kernel_size=k, strides=strides, padding=padding, activation=act, momentum=momentum,
              epsilon=epsilon)
    layer, (stock, _, bn) = conv_bn_act_pair(kw, x, rng)
    stats = [(layer.moving_mean, bn.moving_mean), (layer.moving_variance, bn.moving_variance)]
    check_inference_then_training(layer, stock, x, mode, stats)


@FUZZ
@given(batch=st.integers(1, 3), steps=st.integers(1, 9), cin=st.integers(1, 4), filters=st.integers(1, 4),
       k=st.integers(1, 4), strides=st.integers(1, 2), padding=st.sampled_from(["same", "valid", "causal"]),
       act=_act, momentum=_momentum, epsilon=_epsilon, seed=_seed)
@pytest.mark.parametrize("mode", MODES)
def test_conv_bn_act_1d_matches_stock(mode, batch, steps, cin, filters, k, strides, padding, act, momentum, epsilon,
                                      seed):
    if padding == "valid":
        steps = max(steps, k)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(1.0, 2.0, size=[batch, steps, cin]).astype("float32"))
    kw = dict(filters=filters, kernel_size=k, strides=strides, padding=padding, activation=act, momentum=momentum,
              epsilon=epsilon)
    layer, (stock, _, bn) = conv_bn_act_pair(kw, x, rng, one_d=True)
    stats = [(layer.moving_mean, bn.moving_mean), (layer.moving_variance, bn.moving_variance)]
    check_inference_then_training(layer, stock, x, mode, stats)


# ----------------------------------------------------------------------------
# ResidualBlock / FoldedResidualBlock.


def stock_block(block, x):
    """A ResNet v1 block of stock layers (stride on the 3x3; 1x1 projection when the shape changes).

    Written from the architecture, not from the block's sublayers: only the weights come from
    `block` (paired in order: residual convs, then the projection). Returns (call, stats pairs).
    """
    f, s, act = block.filters, block.strides, block.activation
    if block.bottleneck:
        specs = [(1, 1, act), (3, s, act), (1, 1, None)]
        out = 4 * f
    else:
        specs = [(3, s, act), (3, 1, None)]
        out = f
    ours = list(block.convs)
    assert len(ours) == len(specs)
    project = s != 1 or x.shape[-1] != out
    assert (block.projection is not None) == project
    twins, stats = [], []
    t = x
    for layer, (k, stride, a) in zip(ours, specs):
        assert (layer.filters, layer.activation) == (out if layer is ours[-1] else f, a or "linear")
        call, _, bn = stock_twin(layer, t, keras.layers.Conv2D, kernel_size=k, strides=stride, padding="same")
        twins.append(call)
        stats += [(layer.moving_mean, bn.moving_mean), (layer.moving_variance, bn.moving_variance)]
        t = call(t)
    shortcut = None
    if project:
        p = block.projection
        shortcut, _, bn = stock_twin(p, x, keras.layers.Conv2D, kernel_size=1, strides=s, padding="same")
        stats += [(p.moving_mean, bn.moving_mean), (p.moving_variance, bn.moving_variance)]
    merge = keras.layers.Activation(act)

    def call(t, training=False):
        y = t
        for twin in twins:
            y = twin(y, training=training)
        return merge(keras.layers.add([y, t if shortcut is None else shortcut(t, training=training)]))

    return call, stats


def _block(filters, strides, bottleneck, act, momentum, x, rng):
    block = ResidualBlock(filters, strides=strides, bottleneck=bottleneck, activation=act, momentum=momentum)
    block.build(tuple(x.shape))
    for layer in block.convs + ([block.projection] if block.projection is not None else []):
        randomize(layer, rng)
    return block


_block_args = dict(
    batch=st.integers(1, 2), h=st.integers(1, 6), w=st.integers(1, 6), cin=st.integers(1, 8),
    filters=st.integers(1, 4), strides=st.integers(1, 2), bottleneck=st.booleans(),
    act=st.sampled_from(["relu", "relu6", "elu", "leaky_relu"]), momentum=_momentum, seed=_seed,
)


@FUZZ
@given(**_block_args)
@pytest.mark.parametrize("mode", MODES)
def test_residual_block_matches_stock(mode, batch, h, w, cin, filters, strides, bottleneck, act, momentum, seed):
    if seed % 2 and not bottleneck:
        cin = filters  # half the examples on the identity shortcut (stride 1 then)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=[batch, h, w, cin]).astype("float32"))
    block = _block(filters, strides, bottleneck, act, momentum, x, rng)
    stock, stats = stock_block(block, x)
    check_inference_then_training(block, stock, x, mode, stats)


@FUZZ
@given(**_block_args)
@pytest.mark.parametrize("mode", MODES)
def test_folded_residual_block_matches_inference(mode, batch, h, w, cin, filters, strides, bottleneck, act, momentum,
                                                  seed):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=[batch, h, w, cin]).astype("float32"))
    block = _block(filters, strides, bottleneck, act, momentum, x, rng)
    folded = block.fold()
    assert isinstance(folded, FoldedResidualBlock)
    want = block(x, training=False).numpy()
    call = folded if mode == "eager" else tf.function(folded)
    expect_ok(lambda: call(x), lambda y: _scaled_close(y, want, 1e-5))


# ----------------------------------------------------------------------------
# Bad ranks and bad arguments.


def _folded(shape):
    block = ResidualBlock(2)
    block.build(shape)
    return block.fold()


# One test per list (every case through expect_error): each test costs a Keras session reset.
_BAD_RANKS = [
    (lambda: ConvBNAct(2, 3), [4]),
    (lambda: ConvBNAct(2, 3), [2, 4, 3]),
    (lambda: ConvBNAct(2, 3), [1, 2, 4, 4, 3]),
    (lambda: ConvBNAct1D(2, 3), [4, 3]),
    (lambda: ConvBNAct1D(2, 3), [1, 4, 4, 3]),
    (lambda: ResidualBlock(2), [2, 4, 2]),
    (lambda: ResidualBlock(2, bottleneck=True), [1, 2, 4, 4, 2]),
    (lambda: _folded((None, 4, 4, 2)), [2, 4, 2]),
]


def test_bad_rank_raises_value_error():
    for make, shape in _BAD_RANKS:
        expect_error(lambda: make()(tf.ones(shape)), ValueError)


_bad_int = st.one_of(st.integers(-4, 0), st.sampled_from([2.5, "3", None, True]))


@fuzz_settings(8)
@given(which=st.sampled_from(["filters", "kernel_size", "strides"]), bad=_bad_int,
       cls=st.sampled_from([ConvBNAct, ConvBNAct1D]))
def test_conv_bn_act_bad_ints_raise_value_error(which, bad, cls):
    kw = dict(filters=2, kernel_size=3, strides=1)
    kw[which] = bad
    expect_error(lambda: cls(**kw), ValueError)


@fuzz_settings(8)
@given(which=st.sampled_from(["filters", "strides"]), bad=_bad_int, bottleneck=st.booleans())
def test_residual_block_bad_ints_raise_value_error(which, bad, bottleneck):
    kw = dict(filters=2, strides=1, bottleneck=bottleneck)
    kw[which] = bad
    expect_error(lambda: ResidualBlock(**kw), ValueError)


_BAD_ARGUMENTS = [
    lambda: ConvBNAct(2, 3, padding="causal"),
    lambda: ConvBNAct(2, 3, activation="tanh"),
    lambda: ConvBNAct(2, 3, momentum=1.5),
    lambda: ConvBNAct(2, 3, momentum=float("nan")),
    lambda: ConvBNAct(2, 3, epsilon=0.0),
    lambda: ConvBNAct(2, (3, 3, 3)),
    lambda: ConvBNAct1D(2, 3, padding="full"),
    lambda: ConvBNAct1D(2, (3, 3)),
    lambda: ConvBNAct1D(2, 3, activation="sigmoid"),
    lambda: ResidualBlock(2, activation="tanh"),
    lambda: ResidualBlock(2, activation=None),
    lambda: ResidualBlock(2, strides=(2, 2)),
    lambda: ResidualBlock(2, bottleneck="yes"),
    lambda: ResidualBlock(2, momentum=-0.1),
    lambda: ResidualBlock(2, epsilon=1e-9),
    lambda: FoldedResidualBlock(0),
    lambda: FoldedResidualBlock(2, activation="gelu"),
    lambda: ResidualBlock(2).fold(),  # not built
]


def test_bad_constructor_arguments_raise_value_error():
    for make in _BAD_ARGUMENTS:
        expect_error(make, ValueError)


# `_ops.check_batch_norm_args` once let NaN (which fails every comparison) and inf (which passes
# `>= minimum`) through, to NaN or constant outputs, while FusedBatchNorm rejected both; 1e39
# rounds to inf in float32, the kernel's attr type.
@pytest.mark.parametrize(
    "make",
    [lambda e: ConvBNAct(2, 3, epsilon=e), lambda e: ConvBNAct1D(2, 3, epsilon=e), lambda e: ResidualBlock(2, epsilon=e)],
    ids=["ConvBNAct", "ConvBNAct1D", "ResidualBlock"],
)
def test_non_finite_epsilon_raises_value_error(make):
    for epsilon in (float("nan"), float("inf"), 1e39):
        expect_error(lambda: make(epsilon), ValueError)
