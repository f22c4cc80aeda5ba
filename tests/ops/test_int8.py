"""int8_matmul / int8_conv2d: CPU kernel and pure-TF reference against numpy; gradients; errors."""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import ops
from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import int8 as int8_ops

ACTIVATIONS = ("linear", "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid")
# Relative tolerance of the output dtype's rounding (float32: the accumulation).
DTYPES = {"float32": (tf.float32, 1e-5), "float16": (tf.float16, 1.5e-3), "bfloat16": (tf.bfloat16, 1e-2)}
ALPHA = 0.2


# ----------------------------------------------------------------------------
# numpy float64 references, written here independently of the package.


def np_activate(z, activation):
    z = np.asarray(z, np.float64)
    if activation == "linear":
        return z
    if activation == "relu":
        return np.maximum(z, 0.0)
    if activation == "relu6":
        return np.minimum(np.maximum(z, 0.0), 6.0)
    if activation == "elu":
        return np.where(z < 0, np.expm1(np.minimum(z, 0.0)), z)
    if activation == "leaky_relu":
        return np.where(z < 0, ALPHA * z, z)
    if activation == "gelu":
        return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    if activation == "gelu_approximate":
        return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    if activation == "tanh":
        return np.tanh(z)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    raise AssertionError(activation)


def np_dequantize(q, scale):
    return np.asarray(q, np.float64) / np.asarray(scale, np.float64)


def np_conv2d(x, w, strides, padding, dilations):
    """NHWC x HWIO, float64, TF's VALID / SAME output sizes and padding."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    (b, h, wd, _), (kh, kw, _, co) = x.shape, w.shape
    out, pads = [], []
    for size, k, s, d in ((h, kh, strides[0], dilations[0]), (wd, kw, strides[1], dilations[1])):
        eff = (k - 1) * d + 1
        o = -(-size // s) if padding == "same" else max(0, (size - eff) // s + 1)
        need = max((o - 1) * s + eff - size, 0) if padding == "same" else 0
        out.append(o)
        pads.append(need // 2)
    y = np.zeros((b, out[0], out[1], co))
    for oy in range(out[0]):
        for ox in range(out[1]):
            for a in range(kh):
                for e in range(kw):
                    iy, ix = oy * strides[0] - pads[0] + a * dilations[0], ox * strides[1] - pads[1] + e * dilations[1]
                    if 0 <= iy < h and 0 <= ix < wd:
                        y[:, oy, ox, :] += x[:, iy, ix, :] @ w[a, e]
    return y


def weights(rng, shape):
    q = rng.integers(-127, 128, size=shape).astype(np.int8)
    scale = rng.uniform(20.0, 80.0, shape[-1]).astype(np.float32)
    return q, scale


def rounded(a, dtype):
    """`a` as rounded to `dtype`, back as float64."""
    return tf.cast(tf.cast(tf.constant(a, tf.float32), dtype), tf.float64).numpy()


def assert_close(got, ref, bound, rtol):
    """|got - ref| <= rtol * |ref| + float32 accumulation error (relative to sum |x| |w|) per element."""
    got = tf.cast(got, tf.float64).numpy()
    assert got.shape == ref.shape
    tol = rtol * np.abs(ref) + 2e-6 * (bound + 1.0)
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max err {err.max()} (worst excess {(err - tol).max()})"


# ----------------------------------------------------------------------------
# Forward against numpy.


@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_matches_numpy(impl, dtype, activation, has_bias):
    tf_dtype, rtol = DTYPES[dtype]
    rng = np.random.default_rng(1)
    q, scale = weights(rng, (37, 19))
    x = rounded(rng.standard_normal((5, 37)), tf_dtype)
    b = rounded(rng.standard_normal(19), tf_dtype) if has_bias else None
    y = ops.int8_matmul(tf.cast(x, tf_dtype), q, scale, None if b is None else tf.cast(b, tf_dtype),
                        activation=None if activation == "linear" else activation)
    assert y.dtype == tf_dtype and y.shape == (5, 19)
    w = np_dequantize(q, scale)
    z = x @ w + (b if b is not None else 0.0)
    assert_close(y, np_activate(z, activation), np.abs(x) @ np.abs(w), rtol)


@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1, 1), (3, 1, 17), (1, 4096 // 64, 7), (7, 300, 130), (13, 70, 64), (9, 260, 33), (1, 37, 1000),
     (70, 20, 19)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_odd_sizes(impl, dtype, m, k, n):
    # N not a multiple of the vector widths (8, 16, 64), K = 1, K across blocks, M across row groups.
    tf_dtype, rtol = DTYPES[dtype]
    rng = np.random.default_rng(m * 1000 + k + n)
    q, scale = weights(rng, (k, n))
    x = rounded(rng.standard_normal((m, k)), tf_dtype)
    b = rounded(rng.standard_normal(n), tf_dtype)
    y = ops.int8_matmul(tf.cast(x, tf_dtype), q, scale, tf.cast(b, tf_dtype), activation="relu")
    w = np_dequantize(q, scale)
    assert_close(y, np_activate(x @ w + b, "relu"), np.abs(x) @ np.abs(w), rtol)


def test_matmul_empty_inputs(impl):
    rng = np.random.default_rng(2)
    q, scale = weights(rng, (4, 5))
    y = ops.int8_matmul(tf.zeros([0, 4]), q, scale, tf.ones([5]))
    assert y.shape == (0, 5)
    q0, scale0 = weights(rng, (4, 0))
    assert ops.int8_matmul(tf.ones([3, 4]), q0, scale0).shape == (3, 0)
    # K = 0: the sum is empty, y = act(bias).
    y = ops.int8_matmul(tf.zeros([2, 0]), np.zeros((0, 3), np.int8), np.ones(3, np.float32),
                        tf.constant([-1.0, 0.5, 2.0]), activation="relu")
    np.testing.assert_array_equal(y.numpy(), [[0.0, 0.5, 2.0]] * 2)


@pytest.mark.parametrize("shape", [(2, 3, 37), (2, 1, 3, 37), (4, 37)])
def test_matmul_nd_inputs(impl, shape):
    rng = np.random.default_rng(3)
    q, scale = weights(rng, (37, 11))
    x = rng.standard_normal(shape).astype(np.float32)
    y = ops.int8_matmul(x, q, scale, activation="tanh")
    assert y.shape == shape[:-1] + (11,)
    w = np_dequantize(q, scale)
    assert_close(y, np_activate(x.astype(np.float64) @ w, "tanh"), np.abs(x) @ np.abs(w), 1e-5)


def test_matmul_unknown_batch_in_a_function(impl):
    rng = np.random.default_rng(4)
    q, scale = weights(rng, (37, 11))
    fn = tf.function(lambda x: ops.int8_matmul(x, q, scale, activation="gelu"),
                     input_signature=[tf.TensorSpec([None, None, 37], tf.float32)])
    x = rng.standard_normal((3, 2, 37)).astype(np.float32)
    y = fn(x)
    assert y.shape == (3, 2, 11)
    assert fn.get_concrete_function().structured_outputs.shape.as_list() == [None, None, 11]
    w = np_dequantize(q, scale)
    assert_close(y, np_activate(x.astype(np.float64) @ w, "gelu"), np.abs(x) @ np.abs(w), 1e-5)


CONV_CASES = [
    ("valid", (1, 1), (1, 1)),
    ("same", (1, 1), (1, 1)),
    ("same", (2, 2), (1, 1)),
    ("valid", (2, 1), (1, 1)),
    ("same", (1, 2), (2, 1)),
    ("valid", (1, 1), (2, 2)),
    ("same", (3, 2), (1, 2)),
]


@pytest.mark.parametrize("padding, strides, dilations", CONV_CASES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_conv2d_matches_numpy(impl, dtype, padding, strides, dilations):
    tf_dtype, rtol = DTYPES[dtype]
    rng = np.random.default_rng(5)
    q, scale = weights(rng, (3, 3, 5, 7))
    x = rounded(rng.standard_normal((2, 9, 8, 5)), tf_dtype)
    b = rounded(rng.standard_normal(7), tf_dtype)
    y = ops.int8_conv2d(tf.cast(x, tf_dtype), q, scale, tf.cast(b, tf_dtype), strides=strides, padding=padding,
                        dilation_rate=dilations, activation="leaky_relu")
    w = np_dequantize(q, scale)
    ref = np_activate(np_conv2d(x, w, strides, padding, dilations) + b, "leaky_relu")
    bound = np_conv2d(np.abs(x), np.abs(w), strides, padding, dilations)
    assert y.dtype == tf_dtype
    assert_close(y, ref, bound, rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_conv2d_activations(impl, activation):
    rng = np.random.default_rng(6)
    q, scale = weights(rng, (2, 3, 4, 20))  # Cout 20: a 16-wide pass and a tail
    x = rng.standard_normal((1, 6, 7, 4))
    y = ops.int8_conv2d(x.astype(np.float32), q, scale, strides=1, padding="SAME", activation=activation)
    w = np_dequantize(q, scale)
    ref = np_activate(np_conv2d(x.astype(np.float32), w, (1, 1), "same", (1, 1)), activation)
    assert_close(y, ref, np_conv2d(np.abs(x), np.abs(w), (1, 1), "same", (1, 1)), 1e-5)


def test_conv2d_odd_and_empty_sizes(impl):
    rng = np.random.default_rng(7)
    # 1x1 kernel, Cin = 1, many output pixels (several row groups), Cout = 1.
    q, scale = weights(rng, (1, 1, 1, 1))
    x = rng.standard_normal((3, 11, 13, 1)).astype(np.float32)
    y = ops.int8_conv2d(x, q, scale)
    np.testing.assert_allclose(y.numpy(), x * (float(q[0, 0, 0, 0]) / scale[0]), rtol=1e-6)
    # A kernel larger than the input with VALID padding: empty output; an empty batch too.
    q, scale = weights(rng, (5, 5, 2, 3))
    assert ops.int8_conv2d(tf.ones([1, 3, 3, 2]), q, scale).shape == (1, 0, 0, 3)
    assert ops.int8_conv2d(tf.ones([0, 6, 6, 2]), q, scale, padding="same").shape == (0, 6, 6, 3)


# ----------------------------------------------------------------------------
# Gradients: the op's registered gradient against tf.GradientTape on the pure-TF reference.


def _grads(fn, x, b):
    with tf.GradientTape() as tape:
        tape.watch([x, b])
        y = fn(x, b)
        yf = tf.cast(y, tf.float32)
        loss = tf.reduce_sum(0.37 * yf + tf.square(yf))  # dy = 0.37 + 2 y: varies per element
    return tape.gradient(loss, [x, b])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matmul_gradients_match_the_reference(activation):
    assert int8_ops.uses_kernel("matmul")
    rng = np.random.default_rng(8)
    q, scale = weights(rng, (23, 13))
    x = tf.constant(rng.standard_normal((2, 3, 23)), tf.float32)
    b = tf.constant(rng.standard_normal(13), tf.float32)
    got = _grads(lambda x, b: ops.int8_matmul(x, q, scale, b, activation=activation), x, b)

    def reference(x, b):
        y = int8_ops.reference_int8_matmul(tf.reshape(x, [-1, 23]), q, scale, b, activation)
        return tf.reshape(y, [2, 3, 13])

    want = _grads(reference, x, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu", "leaky_relu", "sigmoid"])
@pytest.mark.parametrize("padding, strides, dilations", [CONV_CASES[1], CONV_CASES[2], CONV_CASES[4], CONV_CASES[5]])
def test_conv2d_gradients_match_the_reference(activation, padding, strides, dilations):
    assert int8_ops.uses_kernel("conv2d")
    rng = np.random.default_rng(9)
    q, scale = weights(rng, (3, 2, 3, 5))
    x = tf.constant(rng.standard_normal((2, 7, 8, 3)), tf.float32)
    b = tf.constant(rng.standard_normal(5), tf.float32)
    kw = dict(strides=strides, padding=padding, dilation_rate=dilations, activation=activation)
    got = _grads(lambda x, b: ops.int8_conv2d(x, q, scale, b, **kw), x, b)
    want = _grads(lambda x, b: int8_ops.reference_int8_conv2d(x, q, scale, b, strides, padding, dilations,
                                                               activation), x, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_keep_the_dtype_and_skip_kernel_and_scale(dtype):
    tf_dtype = DTYPES[dtype][0]
    rng = np.random.default_rng(10)
    q, scale = weights(rng, (8, 4))
    x = tf.cast(rng.standard_normal((3, 8)), tf_dtype)
    b = tf.cast(rng.standard_normal(4), tf_dtype)
    qt, st = tf.constant(q), tf.constant(scale)
    with tf.GradientTape() as tape:
        tape.watch([x, b, st])  # (an int8 tensor cannot be watched: no gradient either way)
        y = ops.int8_matmul(x, qt, st, b, activation="gelu")
    dx, db, dq, ds = tape.gradient(y, [x, b, qt, st])
    assert dx.dtype == tf_dtype and db.dtype == tf_dtype
    assert dq is None and ds is None


# ----------------------------------------------------------------------------
# The kernel's InvalidArgumentError on bad input (the raw op, below the Python checks).


def _raw():
    return ops._loader.load()


def _mm(x, q, s, b, **attrs):
    return _raw().tfmetal_ext_int8_mat_mul(x, q, s, b, **attrs)


def _conv(x, q, s, b, **attrs):
    return _raw().tfmetal_ext_int8_conv2d(x, q, s, b, **attrs)


Q23 = np.ones((2, 3), np.int8)
S3 = np.ones(3, np.float32)
E = np.zeros(0, np.float32)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: _mm(np.ones((2, 2, 2), np.float32), Q23, S3, E), "x must be a matrix"),
        (lambda: _mm(np.ones((4, 2), np.float32), np.ones((2, 3, 1), np.int8), S3, E), "kernel must be a matrix"),
        (lambda: _mm(np.ones((4, 5), np.float32), Q23, S3, E), "K"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, np.ones(4, np.float32), E), "kernel_scale"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, S3, np.ones(2, np.float32), has_bias=True), "bias"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, S3, np.ones(3, np.float32)), "bias"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, np.array([1, 0, 1], np.float32), E), "finite and > 0"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, np.array([1, -2, 1], np.float32), E), "finite and > 0"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, np.array([1, np.inf, 1], np.float32), E), "finite and > 0"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, np.array([1, np.nan, 1], np.float32), E), "finite and > 0"),
        (lambda: _mm(np.ones((4, 2), np.float32), Q23, S3, E, activation="swish"), "activation must be one of"),
        (lambda: _conv(np.ones((2, 4, 4), np.float32), np.ones((1, 1, 4, 3), np.int8), S3, E), "NHWC"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), Q23, S3, E), "HWIO"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 4, 3), np.int8), S3, E), "Cin"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3[:2], E),
         "kernel_scale"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), -S3, E), "finite"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3, E, strides=[1]),
         "strides"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3, E, strides=[1, 0]),
         "strides"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3, E,
                       dilations=[1, 1, 1]), "dilations"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3, E,
                       dilations=[-1, 1]), "dilations"),
        (lambda: _conv(np.ones((1, 4, 4, 2), np.float32), np.ones((1, 1, 2, 3), np.int8), S3, E,
                       activation="softmax"), "activation"),
    ],
)
def test_kernel_rejects_bad_input(call, match):
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        call()


def test_kernel_checks_also_run_with_unknown_shapes():
    # Inside a function with unknown shapes the shape function cannot judge: the kernel does.
    fn = tf.function(lambda x, q, s: _mm(x, q, s, E),
                     input_signature=[tf.TensorSpec(None, tf.float32), tf.TensorSpec(None, tf.int8),
                                      tf.TensorSpec(None, tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="K"):
        fn(np.ones((4, 5), np.float32), Q23, S3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="finite and > 0"):
        fn(np.ones((4, 2), np.float32), Q23, np.zeros(3, np.float32))


def test_reference_rejects_a_bad_scale_like_the_kernel(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    with pytest.raises(tf.errors.InvalidArgumentError, match="finite and > 0"):
        ops.int8_matmul(tf.ones([2, 2]), Q23, np.array([1, 0, 1], np.float32))


# ----------------------------------------------------------------------------
# Python argument checks (ValueError).


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.int8_matmul(tf.ones([2, 2], tf.int32), Q23, S3), "Received: x.dtype=int32"),
        (lambda: ops.int8_matmul(tf.ones([2]), Q23, S3), "Received: x.shape="),
        (lambda: ops.int8_matmul(tf.ones([2, 2]), Q23.astype(np.float32), S3), "Received: kernel.dtype=float32"),
        (lambda: ops.int8_matmul(tf.ones([2, 5]), Q23, S3), "Received: x.shape="),
        (lambda: ops.int8_matmul(tf.ones([2, 2]), Q23, S3[:2]), "Received: kernel_scale.shape="),
        (lambda: ops.int8_matmul(tf.ones([2, 2]), Q23, S3, bias=tf.ones([4])), "Received: bias.shape="),
        (lambda: ops.int8_matmul(tf.ones([2, 2]), Q23, S3, activation="swish"), "Received: activation='swish'"),
        (lambda: ops.int8_matmul(tf.ones([2, 2]), Q23, S3, activation=tf.nn.relu), "Received: activation="),
        (lambda: ops.int8_conv2d(tf.ones([1, 4, 4, 2]), np.ones((1, 1, 2, 3), np.int8), S3, padding="full"),
         "Received: padding='full'"),
        (lambda: ops.int8_conv2d(tf.ones([1, 4, 4, 2]), np.ones((1, 1, 2, 3), np.int8), S3, strides=(1, 0)),
         "Received: strides="),
        (lambda: ops.int8_conv2d(tf.ones([1, 4, 4, 2]), np.ones((1, 1, 2, 3), np.int8), S3, dilation_rate=(1, 2, 3)),
         "Received: dilation_rate="),
        (lambda: ops.int8_conv2d(tf.ones([1, 4, 4, 3]), np.ones((1, 1, 2, 3), np.int8), S3), "Received: x.shape="),
        (lambda: ops.int8_conv2d(tf.ones([4, 4, 2]), np.ones((1, 1, 2, 3), np.int8), S3), "Received: x.shape="),
    ],
)
def test_python_checks(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------
# Quantization, switches, the portable loops.


def test_quantize_int8_is_keras_abs_max():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((3, 3, 4, 6)).astype(np.float32)
    q, scale = ops.quantize_int8(w, axis=(0, 1, 2))
    assert q.dtype == tf.int8 and q.shape == w.shape
    assert scale.dtype == tf.float32 and scale.shape == (6,)
    import keras

    want_scale = 127.0 / (np.max(np.abs(w), axis=(0, 1, 2)) + keras.config.epsilon())
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-6)
    np.testing.assert_array_equal(q.numpy(), np.clip(np.round(w * want_scale.astype(np.float32)), -127, 127))
    q2, scale2 = ops.quantize_int8(w[0, 0], axis=0)
    assert q2.shape == (4, 6) and scale2.shape == (6,)


def test_avoid_fusions_and_the_reference_switch_run_the_reference(monkeypatch):
    rng = np.random.default_rng(12)
    q, scale = weights(rng, (6, 4))
    x = tf.constant(rng.standard_normal((2, 6)), tf.float32)

    def op_types():
        graph = tf.function(lambda x: ops.int8_matmul(x, q, scale, activation="relu")).get_concrete_function(x).graph
        return {o.type for o in graph.get_operations()}

    assert fusion.INT8_MATMUL_OP in op_types()
    tfmetal_ext.configure("float32", avoid_fusions=["int8_matmul"])
    try:
        assert not int8_ops.uses_kernel("matmul") and int8_ops.uses_kernel("conv2d")
        types = op_types()
        assert fusion.INT8_MATMUL_OP not in types and "MatMul" in types
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    assert not int8_ops.int8_uses_kernel("matmul") and not int8_ops.int8_uses_kernel("conv2d")
    with pytest.raises(ValueError, match="Received: op='dense'"):
        int8_ops.uses_kernel("dense")


@pytest.mark.full  # the portable loops in numpy (~6 s); the quick tier keeps the kernels against numpy
def test_portable_loops_match_numpy():
    # TFMETAL_EXT_CPU_BASELINE=1: the loops arm64 runs (here without AVX2), in a fresh process.
    script = textwrap.dedent(
        """
        import numpy as np, tensorflow as tf
        from tfmetal_ext import ops
        rng = np.random.default_rng(13)
        q = rng.integers(-127, 128, (70, 37)).astype(np.int8); s = rng.uniform(20, 80, 37).astype(np.float32)
        x = rng.standard_normal((9, 70)).astype(np.float32)
        qc = rng.integers(-127, 128, (3, 3, 4, 21)).astype(np.int8); sc = rng.uniform(20, 80, 21).astype(np.float32)
        xc = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
        np.save("OUT/mm.npy", ops.int8_matmul(x, q, s, activation="gelu").numpy())
        np.save("OUT/conv.npy", ops.int8_conv2d(xc, qc, sc, strides=2, padding="same").numpy())
        """
    )
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, TFMETAL_EXT_CPU_BASELINE="1", TFMETAL_EXT_REFERENCE_OPS="0")
        subprocess.run([sys.executable, "-c", script.replace("OUT", out)], check=True, env=env, capture_output=True)
        mm, conv = np.load(f"{out}/mm.npy"), np.load(f"{out}/conv.npy")
    rng = np.random.default_rng(13)
    q = rng.integers(-127, 128, (70, 37)).astype(np.int8)
    s = rng.uniform(20, 80, 37).astype(np.float32)
    x = rng.standard_normal((9, 70)).astype(np.float32)
    qc = rng.integers(-127, 128, (3, 3, 4, 21)).astype(np.int8)
    sc = rng.uniform(20, 80, 21).astype(np.float32)
    xc = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    w = np_dequantize(q, s)
    assert_close(mm, np_activate(x.astype(np.float64) @ w, "gelu"), np.abs(x) @ np.abs(w), 1e-5)
    wc = np_dequantize(qc, sc)
    ref = np_conv2d(xc, wc, (2, 2), "same", (1, 1))
    assert_close(conv, ref, np_conv2d(np.abs(xc), np.abs(wc), (2, 2), "same", (1, 1)), 1e-5)


@pytest.mark.parametrize("k, n", [(3, 8), (7, 13), (130, 70), (257, 200)])
def test_one_and_two_rows_stream_and_match_the_packed_rows(k, n):
    # One or two rows take the unpacked streaming loop (cpu/int8_gemm_body.h StreamRows), more
    # rows the packed panels: both sum each output over k in order with one multiply-add per k,
    # so a row comes out bitwise the same whichever path ran; and both match float64 numpy.
    assert int8_ops.uses_kernel("matmul")
    rng = np.random.default_rng(k * 1000 + n)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(10.0, 100.0, n).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    packed = ops.int8_matmul(x, q, scale).numpy()
    want = x.astype(np.float64) @ (q.astype(np.float64) / scale.astype(np.float64))
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(q / scale.astype(np.float64)))
    for m in (1, 2):
        streamed = ops.int8_matmul(x[:m], q, scale).numpy()
        np.testing.assert_array_equal(streamed, packed[:m])
        assert np.all(np.abs(streamed - want[:m]) <= bound[:m] + 1e-30)
