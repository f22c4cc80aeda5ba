"""tfmetal_ext.ops.rope (TfmetalExt>Rope / RopeGrad) against keras-hub's RotaryEmbedding and numpy.

How close "the stock layer to the last bit" can be, derived here and asserted:

- float32: the op runs the stock layer's exact float32 sequence (one product
  for the angle, cos and sin, two products and a sum per output). The two
  differ only where TensorFlow's cos/sin (Eigen) and the kernel's (libm)
  differ, by an ulp. So: bitwise equal wherever both give the same cos and
  sin for the pair, and elsewhere within |x1| |dc| + |x2| |ds| + 4u (|x1 c| + |x2 s|)
  (u = 2^-24: each side's two products and sum round once each).
- float16 / bfloat16 (mixed precision): the stock layer rounds cos, sin, both
  products and the sum to the compute dtype; the op rounds once. With u the
  dtype's unit roundoff (2^-11, 2^-8) each side is within (2u + u^2)(1 + u) M
  + u |y| of the exact rotation (M = |x1 c| + |x2 s| >= |y|), so they differ by
  at most 4.01 u M, plus half a subnormal step per rounding in float16.
"""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.ops import _common, _reference
from tfmetal_ext.ops import rope

try:  # the stock layers (the references of most tests) are keras-hub's; the op's own tests run without it
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding
    from keras_hub.src.models.llama.llama_rotary_embedding import LlamaRotaryEmbedding
except ImportError:
    RotaryEmbedding = LlamaRotaryEmbedding = None
needs_hub = pytest.mark.skipif(RotaryEmbedding is None, reason="the stock RotaryEmbedding is keras-hub's "
                                                               "(not installed: extra [hub])")

rope_module = importlib.import_module("tfmetal_ext.ops.rope")
U32 = 2.0 ** -24
ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TINY = {"float16": 3 * 2.0 ** -25, "bfloat16": 0.0}

pytestmark = pytest.mark.skipif(not rope_module.uses_kernel(), reason="the op library is not available")


def lib():
    return testing.compiled_ops()


def canonical(a, seq_axis, feat_axis):
    return np.moveaxis(np.asarray(a), (feat_axis, seq_axis), (-1, 1))


def our_cos_sin(x_shape, positions, inv_freq, scale=1.0):
    """The kernel's own cos/sin, read back exactly: x1 = 1, x2 = 0 gives y1 = c, y2 = s."""
    half = inv_freq.size
    batch = 1 if positions.ndim == 1 else positions.shape[0]
    probe = np.concatenate([np.ones((batch, x_shape[1], 1, half), np.float32),
                            np.zeros((batch, x_shape[1], 1, half), np.float32)], -1)
    y = lib().tfmetal_ext_rope(probe, positions, inv_freq, scale=scale).numpy()
    shape = (batch, x_shape[1]) + (1,) * (len(x_shape) - 3) + (half,)
    return y[:, :, 0, :half].reshape(shape), y[:, :, 0, half:].reshape(shape)


def stock_cos_sin(layer, x_canonical, start_index, positions):
    """The stock layer's cos/sin, one per feature: its embedding repeats each angle for both halves,
    and TensorFlow's cos of the two copies need not agree (vectorized and scalar paths)."""
    cos, sin = layer._compute_cos_sin_embedding(x_canonical, start_index, positions)
    return np.asarray(cos, np.float32), np.asarray(sin, np.float32)


def assert_float32_last_bit(got, want, x, c_ours, s_ours, c_stock, s_stock, inverse=False):
    """Bitwise where the cos/sin that enter an output agree; elsewhere within the derived bound.

    c_ours/s_ours: one value per pair; c_stock/s_stock: one per feature (see stock_cos_sin).
    Output j < H uses (c[j], s[j]) forward and (c[j], s[j + H]) backward; output j + H uses
    (c[j + H], s[j + H]) forward and (c[j + H], s[j]) backward.
    """
    half = x.shape[-1] // 2
    x1, x2 = np.abs(x[..., :half].astype(np.float64)), np.abs(x[..., half:].astype(np.float64))
    c_o, s_o = c_ours.astype(np.float64), s_ours.astype(np.float64)
    c_s, s_s = c_stock.astype(np.float64), s_stock.astype(np.float64)
    first, second = slice(0, half), slice(half, None)
    s_first, s_second = (second, first) if inverse else (first, second)
    fractions = []
    for part, sl_s in ((first, s_first), (second, s_second)):
        dc, ds = np.abs(c_o - c_s[..., part]), np.abs(s_o - s_s[..., sl_s])
        a, b = (x1, x2) if part == first else (x2, x1)
        mag = a * np.abs(c_s[..., part]) + b * np.abs(s_s[..., sl_s])
        agree = np.broadcast_to((dc == 0) & (ds == 0), a.shape)
        bound = a * dc + b * ds + 4 * U32 * mag * (1 + 1e-6) + 1e-44
        g, w = got[..., part], want[..., part]
        assert np.array_equal(g[agree].view(np.uint32), w[agree].view(np.uint32)), "differs where cos/sin agree"
        assert (np.abs(g.astype(np.float64) - w) <= bound).all()
        fractions.append(agree.mean())
    return min(fractions)


def random_x(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).normal(0, 2, shape).astype(dtype)


# ----------------------------------------------------------------------------
# Inverse frequencies: keras-hub's, bit for bit.

INV_CASES = [
    dict(max_wavelength=10000, scaling_factor=1.0),
    dict(max_wavelength=500000, scaling_factor=8.0, rope_type="linear"),
    dict(max_wavelength=1e6, scaling_factor=4.0, rope_type="dynamic"),
    dict(max_wavelength=150000, scaling_factor=32.0, rope_type="yarn", truncate=False),
    dict(max_wavelength=10000, scaling_factor=8.0, rope_type="yarn", truncate=True),
    dict(max_wavelength=10000, scaling_factor=1.0, denominator_dim=64),
]
LLAMA_CASES = [(None, None, None, None), (8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (8.0, 2.0, 8.0, 1024)]


@needs_hub
@pytest.mark.every_case
@pytest.mark.parametrize("dim", [128, 96])
@pytest.mark.parametrize("case", range(len(INV_CASES)))
def test_inverse_frequencies_are_keras_hubs_bit_for_bit(case, dim):
    kw = INV_CASES[case]
    want = np.asarray(RotaryEmbedding(**kw)._get_inverse_freq(dim))
    config = rope_module._Config.make(kw["max_wavelength"], kw["scaling_factor"], kw.get("rope_type", "linear"),
                                      32.0, 1.0, 4096, kw.get("truncate", True), kw.get("denominator_dim"),
                                      None, None, None, None)
    got = rope_module._inverse_freq(config, dim)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_hub
@pytest.mark.every_case
@pytest.mark.parametrize("args", LLAMA_CASES, ids=["plain", "llama3.1", "llama3.2", "other"])
def test_llama3_inverse_frequencies_are_llamas_bit_for_bit(args):
    names = rope_module._LLAMA3_ARGS
    want = np.asarray(LlamaRotaryEmbedding(max_wavelength=500000, **dict(zip(names, args)))._get_inverse_freq(128))
    config = rope_module._Config.make(500000, 1.0, "llama3", 32.0, 1.0, 4096, True, None, *args)
    np.testing.assert_array_equal(rope_module._inverse_freq(config, 128).view(np.uint32), want.view(np.uint32))


# ----------------------------------------------------------------------------
# Forward against the stock layers, float32.

FORWARD_CASES = {
    "btd": dict(shape=(2, 33, 64)),
    "btnh": dict(shape=(2, 17, 3, 32), start_index=7),
    "positions_1d": dict(shape=(2, 9, 2, 16), positions=np.arange(100, 109, dtype=np.float32)),
    "positions_2d": dict(shape=(3, 9, 2, 16), positions=np.random.default_rng(1).integers(0, 5000, (3, 9))),
    "axes": dict(shape=(2, 4, 11, 16), sequence_axis=2, feature_axis=-1),
    "axes_feature_first": dict(shape=(2, 16, 3, 11), sequence_axis=3, feature_axis=1),
    "dynamic": dict(shape=(1, 40, 32), kwargs=dict(scaling_factor=4.0, rope_type="dynamic")),
    "yarn": dict(shape=(1, 40, 2, 32), kwargs=dict(scaling_factor=16.0, rope_type="yarn", max_wavelength=150000)),
    "denominator": dict(shape=(1, 12, 2, 32), kwargs=dict(denominator_dim=64)),
}


def stock_and_ours(case, dtype=np.float32, layer=None, our_kwargs=None):
    c = FORWARD_CASES[case]
    kw = c.get("kwargs", {})
    seq_axis, feat_axis = c.get("sequence_axis", 1), c.get("feature_axis", -1)
    layer = layer or RotaryEmbedding(sequence_axis=seq_axis, feature_axis=feat_axis, **kw)
    x = random_x(c["shape"], seed=len(case)).astype(dtype)
    start, positions = c.get("start_index", 0), c.get("positions")
    want = np.asarray(layer(x, start_index=start, positions=positions))
    got = rope(x, positions, start_index=start, sequence_axis=seq_axis, feature_axis=feat_axis,
               **(our_kwargs if our_kwargs is not None else kw)).numpy()
    return layer, x, want, got, (seq_axis, feat_axis, start, positions)


@needs_hub
@pytest.mark.cover_axes("case")
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_float32_is_the_stock_layer_to_the_last_bit(case):
    layer, x, want, got, (seq_axis, feat_axis, start, positions) = stock_and_ours(case)
    xc, wc, gc = canonical(x, seq_axis, feat_axis), canonical(want, seq_axis, feat_axis), canonical(got, seq_axis,
                                                                                                    feat_axis)
    pos_arg = None if positions is None else np.asarray(positions, np.float32)
    c_stock, s_stock = stock_cos_sin(layer, tf.constant(xc), start, pos_arg)
    if pos_arg is None:
        pos_arg = np.arange(xc.shape[1], dtype=np.float32) + np.float32(start)
    inv = rope_module._inverse_freq(rope_module._Config.make(
        layer.max_wavelength, layer.scaling_factor, layer.rope_type, 32.0, 1.0, 4096, True, layer.denominator_dim,
        None, None, None, None), xc.shape[-1])
    scale = rope_module._attention_scale(rope_module._Config.make(
        layer.max_wavelength, layer.scaling_factor, layer.rope_type, 32.0, 1.0, 4096, True, None,
        None, None, None, None), tf.float32)
    c_ours, s_ours = our_cos_sin(xc.shape, pos_arg, inv, scale)
    exact = testing.np_rope(xc, pos_arg, inv, scale)  # float64 rotation of the same float32 angles
    # The op computes the definition's float32 sequence: numpy float32 with its own cos/sin, bitwise.
    np.testing.assert_array_equal(gc.view(np.uint32), testing.np_rope_rotate(xc, c_ours, s_ours).view(np.uint32))
    # And the stock layer's result is the same sequence with TF's cos/sin (our model of the stock layer).
    np.testing.assert_array_equal(wc.view(np.uint32), testing.np_rope_rotate(xc, c_stock, s_stock).view(np.uint32))
    agree = assert_float32_last_bit(gc, wc, xc, c_ours, s_ours, c_stock, s_stock)
    assert agree > 0.5  # most pairs: the two libraries' cos/sin mostly agree
    mag = np.abs(xc).max()
    np.testing.assert_allclose(gc, exact, rtol=0, atol=8 * U32 * mag * 2 * max(1.0, scale))


@needs_hub
def test_llama3_is_the_stock_layer_to_the_last_bit():
    args = dict(frequency_adjustment_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                pretraining_sequence_length=64)
    layer = LlamaRotaryEmbedding(max_wavelength=500000, **args)
    x = random_x((2, 70, 2, 64), seed=3)
    want = np.asarray(layer(x, start_index=3))
    got = rope(x, max_wavelength=500000, start_index=3, rope_type="llama3", **args).numpy()
    c_stock, s_stock = stock_cos_sin(layer, tf.constant(x), 3, None)
    inv = rope_module._inverse_freq(rope_module._Config.make(500000, 1.0, "llama3", 32.0, 1.0, 4096, True, None,
                                                             *args.values()), 64)
    c_ours, s_ours = our_cos_sin(x.shape, np.arange(70, dtype=np.float32) + 3, inv)
    assert_float32_last_bit(got, want, x, c_ours, s_ours, c_stock, s_stock)


# ----------------------------------------------------------------------------
# Mixed precision: the derived bound against the stock layer, and rounding once.


@needs_hub
@pytest.mark.cover_axes("policy")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("case", ["btnh", "positions_2d", "yarn"])
def test_mixed_precision_within_the_derived_bound(policy, case):
    keras.config.set_dtype_policy(policy)
    dtype_name = policy.split("_")[1]
    u, tiny = ROUNDOFF[dtype_name], TINY[dtype_name]
    layer, x, want, got, (seq_axis, feat_axis, start, positions) = stock_and_ours(
        case, dtype=tf.as_dtype(dtype_name).as_numpy_dtype)
    assert got.dtype == want.dtype == x.dtype
    c = FORWARD_CASES[case]
    kw = c.get("kwargs", {})
    pos = np.asarray(positions if positions is not None else np.arange(x.shape[1]) + start, np.float32)
    config = rope_module._Config.make(kw.get("max_wavelength", 10000), kw.get("scaling_factor", 1.0),
                                      kw.get("rope_type", "linear"), 32.0, 1.0, 4096, True, None, None, None, None,
                                      None)
    inv = rope_module._inverse_freq(config, x.shape[-1])
    scale = rope_module._attention_scale(config, tf.as_dtype(dtype_name))
    xf = x.astype(np.float64)
    exact = testing.np_rope(xf, pos, inv, scale)
    half = x.shape[-1] // 2
    c, s = (np.abs(v) for v in _cos_sin64(x, pos, inv, scale))
    x1, x2 = np.abs(xf[..., :half]), np.abs(xf[..., half:])
    mag = np.concatenate([x1 * c + x2 * s, x2 * c + x1 * s], -1)  # |x1 c| + |x2 s| per output
    g, w = got.astype(np.float64), want.astype(np.float64)
    if kw.get("rope_type") == "yarn":  # the stock factor is rounded to the dtype once more, on cos and on sin
        u_stock = 6.01 * u
    else:
        u_stock = 4.01 * u
    assert (np.abs(g - w) <= u_stock * mag + 4 * tiny).all()
    # Ours rounds once: within half an ulp of the float32 result, so u |exact| + float32 error of it.
    assert (np.abs(g - exact) <= u * np.abs(exact) + 8 * U32 * mag + tiny).all()
    # And never less accurate than the stock layer by more than a rounding.
    assert np.abs(g - exact).mean() <= np.abs(w - exact).mean()


def _cos_sin64(x, pos, inv, scale):
    angle = (pos.reshape(-1, x.shape[1])[:, :, None] * inv).astype(np.float64)
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[2:])
    return scale * np.cos(angle), scale * np.sin(angle)


# ----------------------------------------------------------------------------
# Gradient


@needs_hub
def test_gradient_is_the_stock_layers_to_the_last_bit():
    case = "btnh"
    x = tf.constant(random_x(FORWARD_CASES[case]["shape"], seed=9))
    dy = tf.constant(random_x(FORWARD_CASES[case]["shape"], seed=10))
    layer = RotaryEmbedding()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        want_y = layer(x, start_index=7)
        got_y = rope(x, start_index=7)
    want = tape.gradient(want_y, x, output_gradients=dy).numpy()
    got = tape.gradient(got_y, x, output_gradients=dy).numpy()
    pos = np.arange(x.shape[1], dtype=np.float32) + 7
    inv = rope_module._inverse_freq(rope_module._Config.make(10000, 1.0, "linear", 32.0, 1.0, 4096, True, None,
                                                             None, None, None, None), x.shape[-1])
    c_ours, s_ours = our_cos_sin(x.shape, pos, inv)
    c_stock, s_stock = stock_cos_sin(layer, x, 7, None)
    dyn = dy.numpy()
    np.testing.assert_array_equal(got.view(np.uint32),
                                  testing.np_rope_rotate(dyn, c_ours, s_ours, inverse=True).view(np.uint32))
    np.testing.assert_array_equal(want.view(np.uint32),
                                  testing.np_rope_rotate(dyn, c_stock, s_stock, inverse=True).view(np.uint32))
    assert_float32_last_bit(got, want, dyn, c_ours, s_ours, c_stock, s_stock, inverse=True)


def test_gradient_matches_finite_differences_and_positions_get_none():
    x = tf.constant(random_x((1, 5, 2, 8), seed=11).astype(np.float64).astype(np.float32))
    positions = tf.constant([3.0, 1.0, 4.0, 1.0, 5.0])
    theoretical, numerical = tf.test.compute_gradient(lambda v: rope(v, positions, max_wavelength=100), [x],
                                                      delta=1e-2)
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=2e-3, atol=2e-3)
    with tf.GradientTape() as tape:
        tape.watch(positions)
        y = rope(x, positions)
    assert tape.gradient(y, positions) is None


def test_gradient_of_a_rotation_is_its_inverse():
    # dx = R^T dy exactly in float64 numpy of the definition, and R^T R x == x (to rounding).
    x = random_x((2, 6, 3, 10), seed=12)
    dy = random_x((2, 6, 3, 10), seed=13)
    pos = np.arange(6, dtype=np.float32)
    inv = rope_module._inverse_freq(rope_module._Config.make(10000, 1.0, "linear", 32.0, 1.0, 4096, True, None,
                                                             None, None, None, None), 10)
    dx = lib().tfmetal_ext_rope_grad(dy, pos, inv).numpy()
    np.testing.assert_allclose(dx, testing.np_rope(dy, pos, inv, inverse=True), rtol=0, atol=1e-5)
    back = lib().tfmetal_ext_rope_grad(lib().tfmetal_ext_rope(x, pos, inv), pos, inv).numpy()
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------
# Graphs, decoding, the reference, empty inputs, errors


@needs_hub
def test_cached_decoding_inside_tf_function_with_a_tensor_start_index():
    layer = RotaryEmbedding()
    x = random_x((2, 1, 4, 16), seed=14)

    @tf.function(input_signature=[tf.TensorSpec([2, None, 4, 16]), tf.TensorSpec([], tf.int32)])
    def step(x, index):
        return rope(x, start_index=index)

    for index in (0, 5, 127):
        np.testing.assert_array_equal(step(x, index).numpy(), rope(x, start_index=index).numpy())
        np.testing.assert_allclose(step(x, index).numpy(), layer(x, start_index=index), rtol=0, atol=4e-6 * 8)
    ops = {n.op for n in step.get_concrete_function().graph.as_graph_def().node}
    assert rope_module.ROPE_OP in ops and "Einsum" not in ops and "Cos" not in ops


def test_reference_form_matches_the_op():
    x = random_x((2, 9, 2, 16), seed=15)
    pos = np.arange(9, dtype=np.float32) * 3
    inv = rope_module._inverse_freq(rope_module._Config.make(10000, 2.0, "linear", 32.0, 1.0, 4096, True, None,
                                                             None, None, None, None), 16)
    want = testing.np_rope(x, pos, inv)
    np.testing.assert_allclose(_reference.rope(tf.constant(x), pos, inv).numpy(), want, rtol=0, atol=3e-5)
    np.testing.assert_allclose(_reference.rope(tf.constant(x), pos, inv, inverse=True).numpy(),
                               testing.np_rope(x, pos, inv, inverse=True), rtol=0, atol=3e-5)
    with _avoided("rope"):
        assert not rope_module.uses_kernel()
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = rope(xt, pos, scaling_factor=2.0)
        np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=3e-5)
        np.testing.assert_allclose(tape.gradient(y, xt).numpy(),
                                   testing.np_rope(np.ones_like(x), pos, inv, inverse=True), rtol=0, atol=3e-5)


def _avoided(name):
    import contextlib

    import tfmetal_ext

    @contextlib.contextmanager
    def ctx():
        tfmetal_ext.configure("float32", avoid_fusions=[name])
        try:
            yield
        finally:
            tfmetal_ext.configure("float32", avoid_fusions=[])

    return ctx()


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8), (2, 5, 2, 0)])
def test_empty_inputs(shape):
    x = tf.zeros(shape)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = rope(x)
    assert y.shape == shape and tape.gradient(y, x).shape == shape


@pytest.mark.parametrize("kwargs, match", [
    (dict(rope_type="su"), r"rope_type.*\['dynamic', 'linear', 'llama3', 'yarn'\].*Received: rope_type='su'"),
    (dict(max_wavelength=0), "max_wavelength"),
    (dict(scaling_factor=float("nan")), "scaling_factor"),
    (dict(rope_type="llama3", low_freq_factor=1.0), "all or none"),
    (dict(rope_type="llama3", scaling_factor=2.0), "no `scaling_factor`"),
    (dict(low_freq_factor=1.0), "llama3' only"),
    (dict(sequence_axis=3), "sequence_axis"),
    (dict(sequence_axis=-1), "must differ"),
    (dict(sequence_axis=0), "batch axis"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope(tf.zeros((1, 4, 2, 8)), **kwargs)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"even size.*Received: x.shape=\(1, 4, 7\)"):
        rope(tf.zeros((1, 4, 7)))
    with pytest.raises(ValueError, match="must be float32"):
        rope(tf.zeros((1, 4, 8), tf.int32))
    op = lib().tfmetal_ext_rope
    x, pos, inv = np.zeros((2, 4, 8), np.float32), np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    cases = [
        ((np.zeros((2, 4, 7), np.float32), pos, np.ones(3, np.float32)), "must be even"),
        ((x, np.arange(5, dtype=np.float32), inv), "positions must have shape"),
        ((x, np.zeros((3, 4), np.float32), inv), "positions must have shape"),
        ((x, pos, np.ones(5, np.float32)), "inv_freq must be a vector of half the last dimension of x = 4"),
        ((np.zeros((4, 8), np.float32), pos, inv), "rank"),
    ]
    for args, match in cases:
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
            op(*args)
        # The kernel's own check, past shape inference (unknown shapes in a graph).
        fn = tf.function(op.__call__ if hasattr(op, "__call__") else op,
                         input_signature=[tf.TensorSpec(None, tf.float32)] * 3)
        with pytest.raises(tf.errors.InvalidArgumentError, match=match.split(" = ")[0]):
            fn(*args)
