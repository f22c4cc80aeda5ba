"""The int8 Metal kernels (custom_ops/metal/int8.metal) on the Metal emulator.

Every instantiation -- int8_matmul_float, int8_matmul_half, int8_matmul_bfloat,
int8_conv2d_float, int8_conv2d_half, int8_conv2d_bfloat -- is dispatched the
way int8_metal.mm dispatches it (1-D dispatchThreads of at most 2^30 threads
with the first thread in the params, metal_helper's ThreadgroupSize1D; one
thread per output element of the conv, per column and block of 4 rows of the
matmul) and compared with a float64 numpy reference
written here (de-quantize q / scale, contract, add the bias, activate) and
with the CPU kernel of the op library.

The kernels accumulate in float32 in the order of k (matmul) or kh, kw, ci
(conv): float32 outputs agree with float64 to accumulation noise (bounded by
sum |x * q| / scale), half / bfloat16 outputs to their rounding on top of it.
Shapes stay small: the emulator runs each thread of a threadgroup on an OS
thread.
"""

import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.testing import compiled_ops, dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
MATMUL = {"float": "int8_matmul_float", "half": "int8_matmul_half", "bfloat": "int8_matmul_bfloat"}
CONV2D = {"float": "int8_conv2d_float", "half": "int8_conv2d_half", "bfloat": "int8_conv2d_bfloat"}
# Relative rounding of one stored output (half: 2^-11, bfloat16: 2^-8), with room for a
# float32 accumulation a rounding away from float64 landing on the other side of a tie.
OUTPUT_ROUNDING = {"float": 0.0, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}
ACTIVATIONS = ["linear", "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid"]
MATMUL_ROWS = 4  # int8.h TFM_INT8_MATMUL_ROWS: rows of x per int8_matmul thread

# tfm_int8_matmul_params / tfm_int8_conv2d_params (custom_ops/metal/int8.h)
MATMUL_PARAMS = np.dtype([("base", "<u8"), ("count", "<u4"), ("m", "<u4"), ("k", "<u4"), ("n", "<u4"),
                          ("activation", "<i4"), ("alpha", "<f4"), ("has_bias", "<u4"), ("unused", "<u4")])
CONV2D_PARAMS = np.dtype([("base", "<u8"), ("count", "<u4"), ("batch", "<u4"), ("in_h", "<u4"), ("in_w", "<u4"),
                          ("in_c", "<u4"), ("k_h", "<u4"), ("k_w", "<u4"), ("out_h", "<u4"), ("out_w", "<u4"),
                          ("out_c", "<u4"), ("stride_h", "<i4"), ("stride_w", "<i4"), ("dilation_h", "<i4"),
                          ("dilation_w", "<i4"), ("pad_top", "<i4"), ("pad_left", "<i4"), ("activation", "<i4"),
                          ("alpha", "<f4"), ("has_bias", "<u4"), ("unused", "<u4")])

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "int8.metal")


# ----------------------------------------------------------------------------
# The host side, as int8_metal.mm + metal_helper.mm do it.


def same_padding(size, k, stride, dilation):
    """TF's SAME rule: out = ceil(size / stride), padded before by half the total (rounded down)."""
    out = -(-size // stride)
    need = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return out, need // 2


def valid_out(size, k, stride, dilation):
    eff = (k - 1) * dilation + 1
    return 0 if size < eff else (size - eff) // stride + 1


def conv_dim(size, k, stride, dilation, padding):
    """(output size, padding before) of one spatial dimension."""
    return same_padding(size, k, stride, dilation) if padding == "SAME" else (valid_out(size, k, stride, dilation), 0)


def dispatch(lib, name, buffers, params, total, chunk=None, order="linear"):
    """The host's loop: dispatches of at most `chunk` threads, each with its first thread in base."""
    for start, count in dispatch_chunks(total, chunk):
        params["base"], params["count"] = start, count
        lib.run(name, buffers + [("bytes", params.copy())], grid=count, threadgroup=threadgroup_size_1d(count),
                order=order, seed=start + 1)


def placeholders(scale, *tensors):
    """An empty tensor is bound to the scale's buffer (never read), as the host's Or() does."""
    return [t if t.size else ("buffer", scale) for t in tensors]


def metal_matmul(lib, dtype, x, q, scale, bias=None, activation="linear", alpha=0.2, chunk=None,
                 order="linear"):
    m, k = x.shape
    n = q.shape[1]
    y = np.full((m, n), np.nan, DTYPES[dtype])
    bias_in = np.zeros(0, DTYPES[dtype]) if bias is None else bias
    params = np.zeros((), MATMUL_PARAMS)
    params["m"], params["k"], params["n"] = m, k, n
    params["activation"] = ACTIVATIONS.index(activation)
    params["alpha"], params["has_bias"] = alpha, int(bias is not None)
    if m * n:  # the host encodes nothing for an empty output
        xs, qs, bs = placeholders(scale, np.ascontiguousarray(x), np.ascontiguousarray(q), bias_in)
        threads = -(-m // MATMUL_ROWS) * n  # one per column and block of rows
        dispatch(lib, MATMUL[dtype], [xs, qs, scale, bs, y], params, threads, chunk, order)
    return y


def metal_conv2d(lib, dtype, x, q, scale, bias=None, strides=(1, 1), dilations=(1, 1), padding="VALID",
                 activation="linear", alpha=0.2, chunk=None):
    b, h, w, cin = x.shape
    kh, kw, _, cout = q.shape
    oh, pt = conv_dim(h, kh, strides[0], dilations[0], padding)
    ow, pl = conv_dim(w, kw, strides[1], dilations[1], padding)
    y = np.full((b, oh, ow, cout), np.nan, DTYPES[dtype])
    bias_in = np.zeros(0, DTYPES[dtype]) if bias is None else bias
    params = np.zeros((), CONV2D_PARAMS)
    for field, value in dict(batch=b, in_h=h, in_w=w, in_c=cin, k_h=kh, k_w=kw, out_h=oh, out_w=ow, out_c=cout,
                             stride_h=strides[0], stride_w=strides[1], dilation_h=dilations[0],
                             dilation_w=dilations[1], pad_top=pt, pad_left=pl,
                             activation=ACTIVATIONS.index(activation), alpha=alpha,
                             has_bias=int(bias is not None)).items():
        params[field] = value
    if y.size:
        xs, qs, bs = placeholders(scale, np.ascontiguousarray(x), np.ascontiguousarray(q), bias_in)
        dispatch(lib, CONV2D[dtype], [xs, qs, scale, bs, y], params, y.size, chunk)
    return y


# ----------------------------------------------------------------------------
# Inputs and the float64 reference


def quantized(rng, shape, axis_out=-1):
    """An int8 kernel and its per-output-channel scale, Keras' convention (w ~= q / scale)."""
    w = rng.normal(0, 0.3, shape)
    reduce = tuple(i for i in range(len(shape)) if i != (axis_out % len(shape)))
    amax = np.abs(w).max(axis=reduce) if reduce else np.abs(w)
    scale = (127.0 / np.maximum(amax, 1e-6)).astype(np.float32)
    q = np.clip(np.round(w * scale), -127, 127).astype(np.int8)
    return q, scale


def case(dtype, x_shape, k_shape, seed, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1.5, x_shape).astype(np.float32).astype(DTYPES[dtype])
    q, scale = quantized(rng, k_shape)
    b = rng.normal(0, 0.5, k_shape[-1]).astype(np.float32).astype(DTYPES[dtype]) if bias else None
    return x, q, scale, b


_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_activate(v, activation, alpha=0.2):
    if activation == "linear":
        return v
    if activation == "relu":
        return np.maximum(v, 0.0)
    if activation == "relu6":
        return np.clip(v, 0.0, 6.0)
    if activation == "elu":
        return np.where(v < 0, np.expm1(np.minimum(v, 0.0)), v)
    if activation == "leaky_relu":
        return np.where(v < 0, alpha * v, v)
    if activation == "gelu":
        return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))
    if activation == "gelu_approximate":
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
    if activation == "tanh":
        return np.tanh(v)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-v))
    raise AssertionError(activation)


def np_matmul(x, q, scale, bias=None, activation="linear", alpha=0.2):
    """y and the size of its float32 accumulation noise (sum |x q| / scale), both float64."""
    x64, q64, s64 = x.astype(np.float64), q.astype(np.float64), scale.astype(np.float64)
    v = (x64 @ q64) / s64
    if bias is not None:
        v = v + bias.astype(np.float64)
    return np_activate(v, activation, alpha), (np.abs(x64) @ np.abs(q64)) / s64


def np_conv2d(x, q, scale, bias=None, strides=(1, 1), dilations=(1, 1), padding="VALID", activation="linear",
              alpha=0.2):
    """NHWC x, HWIO q: zero padding per TF's rules, one tap (kh, kw) at a time."""
    b, h, w, _ = x.shape
    kh, kw, _, cout = q.shape
    oh, pt = conv_dim(h, kh, strides[0], dilations[0], padding)
    ow, pl = conv_dim(w, kw, strides[1], dilations[1], padding)
    rows = max((oh - 1) * strides[0] + (kh - 1) * dilations[0] + 1, h + pt)
    cols = max((ow - 1) * strides[1] + (kw - 1) * dilations[1] + 1, w + pl)
    xp = np.zeros((b, rows, cols, x.shape[3]))
    xp[:, pt:pt + h, pl:pl + w] = x.astype(np.float64)
    acc = np.zeros((b, oh, ow, cout))
    mag = np.zeros((b, oh, ow, cout))
    q64 = q.astype(np.float64)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilations[0], j * dilations[1]
            patch = xp[:, r0:r0 + (oh - 1) * strides[0] + 1:strides[0], c0:c0 + (ow - 1) * strides[1] + 1:strides[1]]
            acc += patch @ q64[i, j]
            mag += np.abs(patch) @ np.abs(q64[i, j])
    s64 = scale.astype(np.float64)
    v = acc / s64
    if bias is not None:
        v = v + bias.astype(np.float64)
    return np_activate(v, activation, alpha), mag / s64


def assert_matches_reference(got, want, noise, dtype, q):
    """Within float32 accumulation noise of the float64 reference, plus the rounding of the stored output.

    A float32 sum of `depth` products is within about depth * 2^-24 * sum |x q| of the exact sum
    (`noise` = sum |x q| / scale; depth from the kernel `q`); dividing, adding the bias and activating
    (at most 1.13-Lipschitz, erf within 1.2e-7) add a few float32 roundings of |v| + 1; a 16-bit store
    rounds by half a unit of the result (the bound allows a whole one: a float32 value next to a tie may
    round either way).
    """
    assert got.dtype == DTYPES[dtype] and got.shape == want.shape
    depth = q.size // q.shape[-1]  # K, or KH * KW * Cin
    g = got.astype(np.float64)
    accumulation = 1.2 * (depth + 4) * 2.0 ** -24 * (noise + np.abs(want) + 1.0)
    bound = accumulation + OUTPUT_ROUNDING[dtype] * np.abs(want) + (2.0 ** -24 if dtype == "half" else 0.0)
    err = np.abs(g - want)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} outputs off: got {g[bad][:5]}, want {want[bad][:5]}, "
                           f"bound {bound[bad][:5]}")


# ----------------------------------------------------------------------------
# The library


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(list(MATMUL.values()) + list(CONV2D.values()))
    for names, params in ((MATMUL, MATMUL_PARAMS), (CONV2D, CONV2D_PARAMS)):
        for dtype, name in names.items():
            kinds = lib.params(name)
            assert len(kinds) == 6, name
            element = np.dtype(DTYPES[dtype]).itemsize
            assert [p.size for p in kinds[:5]] == [element, 1, 4, element, element], name
            assert [p.const for p in kinds[:5]] == [True, True, True, True, False], name
            assert kinds[5].kind == "reference" and kinds[5].size == params.itemsize, name


def test_matmul_rows_per_thread_is_the_headers():
    header = (ROOT / "custom_ops" / "metal" / "int8.h").read_text()
    assert re.search(r"#define TFM_INT8_MATMUL_ROWS (\d+)", header).group(1) == str(MATMUL_ROWS)


def test_host_activation_names_are_the_registrys():
    # int8_metal.mm maps the `activation` attr to the TFM_INT8_* codes with cpu/int8_attrs.h (index = code).
    assert '#include "cpu/int8_attrs.h"' in (ROOT / "custom_ops" / "metal" / "int8_metal.mm").read_text()
    text = (ROOT / "custom_ops" / "cpu" / "int8_attrs.h").read_text()
    names = re.findall(r'"(\w+)"', re.search(r"kActivationNames\[[^]]*\] = \{(.*?)\};", text, re.S).group(1))
    assert names == list(fusion.INT8_ACTIVATIONS) == ACTIVATIONS
    header = (ROOT / "custom_ops" / "include" / "tfmetal" / "int8.h").read_text()
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define TFM_INT8_(\w+) (\d+)", header)}
    assert [codes[name.upper()] for name in names] == list(range(len(names)))


# ----------------------------------------------------------------------------
# Int8MatMul

MATMUL_SHAPES = [(1, 1, 1), (3, 5, 7), (4, 33, 31), (2, 64, 65), (7, 3, 40), (1, 300, 3), (8, 17, 9), (9, 6, 33)]


@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matmul_matches_numpy(lib, dtype, shape):
    m, k, n = shape
    x, q, scale, bias = case(dtype, (m, k), (k, n), seed=m * 100 + k + n)
    y = metal_matmul(lib, dtype, x, q, scale, bias)
    want, noise = np_matmul(x, q, scale, bias)
    assert_matches_reference(y, want, noise, dtype, q)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_matmul_every_activation(lib, activation, with_bias):
    x, q, scale, bias = case("float", (5, 19), (19, 12), seed=ACTIVATIONS.index(activation), bias=with_bias)
    x[0, :] *= 8.0  # a row into relu6's and the saturating activations' upper range
    y = metal_matmul(lib, "float", x, q, scale, bias, activation=activation, alpha=0.3)
    want, noise = np_matmul(x, q, scale, bias, activation, alpha=0.3)
    assert_matches_reference(y, want, noise, "float", q)
    assert (want < 0).any() or activation in ("relu", "relu6", "sigmoid")  # the negative branch is exercised


@pytest.mark.parametrize("activation", ["relu6", "gelu", "leaky_relu", "sigmoid"])
@pytest.mark.parametrize("dtype", ["half", "bfloat"])
def test_matmul_activations_in_16_bits(lib, dtype, activation):
    x, q, scale, bias = case(dtype, (3, 24), (24, 10), seed=7)
    y = metal_matmul(lib, dtype, x, q, scale, bias, activation=activation, alpha=0.1)
    want, noise = np_matmul(x, q, scale, bias, activation, alpha=0.1)
    assert_matches_reference(y, want, noise, dtype, q)


def test_matmul_chunks_start_where_the_last_ended(lib):
    # The host's dispatch loop with a 7-thread chunk instead of 2^30: row blocks straddle chunks.
    x, q, scale, bias = case("float", (10, 9), (9, 11), seed=3)
    whole = metal_matmul(lib, "float", x, q, scale, bias, activation="gelu")
    chunked = metal_matmul(lib, "float", x, q, scale, bias, activation="gelu", chunk=7)
    np.testing.assert_array_equal(chunked, whole)
    shuffled = metal_matmul(lib, "float", x, q, scale, bias, activation="gelu", order="shuffle")
    np.testing.assert_array_equal(shuffled, whole)


def test_matmul_with_no_depth_is_the_activated_bias(lib):
    # K == 0: x and the kernel are empty (bound to the scale's buffer); y = act(bias).
    x = np.zeros((3, 0), np.float32)
    q = np.zeros((0, 4), np.int8)
    scale = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    bias = np.array([-1.0, 0.5, 7.0, -0.25], np.float32)
    y = metal_matmul(lib, "float", x, q, scale, bias, activation="relu6")
    np.testing.assert_array_equal(y, np.broadcast_to(np.clip(bias, 0, 6), (3, 4)))
    assert (metal_matmul(lib, "float", x, q, scale) == 0).all()


def test_matmul_bad_scales_give_nan_channels(lib):
    # The host cannot read kernel_scale (device memory): the kernel flags bad channels with NaN.
    x, q, scale, bias = case("half", (4, 6), (6, 6), seed=11)
    scale[1], scale[2], scale[3], scale[4] = 0.0, -2.0, np.inf, np.nan
    y = metal_matmul(lib, "half", x, q, scale, bias, activation="relu").astype(np.float32)
    assert np.isnan(y[:, 1:5]).all()
    good = [0, 5]
    want, noise = np_matmul(x, q[:, good], scale[good], bias[good], "relu")
    assert_matches_reference(y[:, good].astype(np.float16), want, noise, "half", q[:, good])


def test_matmul_nan_and_inf_inputs_poison_only_their_row(lib):
    x, q, scale, bias = case("float", (4, 8), (8, 5), seed=13)
    x[1, 3] = np.nan
    x[2, 0] = np.inf
    y = metal_matmul(lib, "float", x, q, scale, bias)
    assert np.isnan(y[1]).all()
    assert not np.isfinite(y[2]).any()  # +-inf, or NaN where a zero weight met the inf
    clean = [0, 3]
    want, noise = np_matmul(x[clean], q, scale, bias)
    assert_matches_reference(y[clean], want, noise, "float", q)


# ----------------------------------------------------------------------------
# Int8Conv2D

# (x NHWC, kernel (KH, KW, Cout), strides, dilations)
CONV_CASES = [
    ((1, 5, 5, 3), (3, 3, 4), (1, 1), (1, 1)),
    ((2, 7, 6, 2), (3, 2, 5), (2, 1), (1, 2)),
    ((1, 8, 9, 3), (2, 3, 3), (3, 2), (2, 1)),
    ((2, 6, 5, 4), (1, 1, 6), (2, 2), (1, 1)),
    ((1, 4, 4, 2), (2, 2, 3), (1, 1), (1, 1)),  # even kernel: SAME pads 0 before, 1 after
    ((1, 3, 3, 2), (4, 4, 2), (1, 1), (1, 1)),  # kernel larger than the input (VALID: empty)
    ((1, 9, 4, 1), (3, 1, 33), (1, 3), (3, 1)),
]


def conv_id(c):
    x, k, s, d = c
    return f"x{'x'.join(map(str, x))}-k{'x'.join(map(str, k))}-s{s[0]}{s[1]}-d{d[0]}{d[1]}"


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("conv", CONV_CASES, ids=conv_id)
def test_conv2d_matches_numpy_float(lib, conv, padding):
    x_shape, (kh, kw, cout), strides, dilations = conv
    x, q, scale, bias = case("float", x_shape, (kh, kw, x_shape[3], cout), seed=sum(x_shape) + kh * kw)
    y = metal_conv2d(lib, "float", x, q, scale, bias, strides, dilations, padding)
    want, noise = np_conv2d(x, q, scale, bias, strides, dilations, padding)
    # The reference's padding rules against TF's own conv (float64, de-quantized kernel).
    tf_y = tf.nn.conv2d(x.astype(np.float64), q.astype(np.float64) / scale.astype(np.float64), (1,) + strides + (1,),
                        padding, dilations=(1,) + dilations + (1,)).numpy() + bias.astype(np.float64)
    assert tf_y.shape == want.shape
    np.testing.assert_allclose(want, tf_y, rtol=1e-12, atol=1e-12)
    assert_matches_reference(y, want, noise, "float", q)


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("conv", CONV_CASES[:3], ids=conv_id)
@pytest.mark.parametrize("dtype", ["half", "bfloat"])
def test_conv2d_matches_numpy_16_bits(lib, dtype, conv, padding):
    x_shape, (kh, kw, cout), strides, dilations = conv
    x, q, scale, bias = case(dtype, x_shape, (kh, kw, x_shape[3], cout), seed=5)
    y = metal_conv2d(lib, dtype, x, q, scale, bias, strides, dilations, padding, activation="elu")
    want, noise = np_conv2d(x, q, scale, bias, strides, dilations, padding, activation="elu")
    assert_matches_reference(y, want, noise, dtype, q)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_conv2d_every_activation_without_bias(lib, activation):
    x, q, scale, _ = case("float", (1, 6, 5, 3), (3, 3, 3, 4), seed=17, bias=False)
    y = metal_conv2d(lib, "float", x, q, scale, None, (1, 2), (1, 1), "SAME", activation=activation, alpha=0.05)
    want, noise = np_conv2d(x, q, scale, None, (1, 2), (1, 1), "SAME", activation=activation, alpha=0.05)
    assert_matches_reference(y, want, noise, "float", q)


def test_conv2d_chunks_start_where_the_last_ended(lib):
    x, q, scale, bias = case("half", (2, 5, 4, 3), (3, 3, 3, 5), seed=19)
    whole = metal_conv2d(lib, "half", x, q, scale, bias, (1, 1), (1, 1), "SAME", activation="tanh")
    chunked = metal_conv2d(lib, "half", x, q, scale, bias, (1, 1), (1, 1), "SAME", activation="tanh", chunk=13)
    np.testing.assert_array_equal(chunked.view(np.uint16), whole.view(np.uint16))


def test_conv2d_with_no_input_channels_is_the_activated_bias(lib):
    x = np.zeros((1, 3, 3, 0), np.float32)
    q = np.zeros((2, 2, 0, 3), np.int8)
    scale = np.ones(3, np.float32)
    bias = np.array([-0.5, 0.25, 3.0], np.float32)
    y = metal_conv2d(lib, "float", x, q, scale, bias, padding="SAME", activation="leaky_relu", alpha=0.5)
    np.testing.assert_array_equal(y, np.broadcast_to(np.where(bias < 0, 0.5 * bias, bias), (1, 3, 3, 3)))


def test_conv2d_bad_scale_gives_a_nan_channel(lib):
    x, q, scale, bias = case("float", (1, 4, 4, 2), (3, 3, 2, 3), seed=23)
    scale[1] = 0.0
    y = metal_conv2d(lib, "float", x, q, scale, bias, padding="SAME")
    assert np.isnan(y[..., 1]).all() and np.isfinite(y[..., [0, 2]]).all()


# ----------------------------------------------------------------------------
# Against the CPU kernels of the op library (helper A1's TfmetalExt>Int8MatMul / Int8Conv2D)


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


def cpu_close(got, want, dtype, scale):
    g, w = got.astype(np.float64), want.astype(np.float64)
    tol = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}[dtype]
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype,activation,with_bias", [("float", "gelu", True), ("float", "linear", False),
                                                        ("half", "relu6", True), ("bfloat", "sigmoid", True),
                                                        ("float", "leaky_relu", True)])
def test_matmul_matches_the_cpu_kernel(lib, cpu, dtype, activation, with_bias):
    x, q, scale, bias = case(dtype, (4, 37), (37, 9), seed=29, bias=with_bias)
    y = metal_matmul(lib, dtype, x, q, scale, bias, activation=activation, alpha=0.25)
    b = bias if with_bias else np.zeros(0, DTYPES[dtype])
    want = cpu.tfmetal_ext_int8_mat_mul(tf.constant(x), q, scale, tf.constant(b), activation=activation,
                                        leaky_relu_alpha=0.25, has_bias=with_bias).numpy()
    cpu_close(y, want, dtype, float(np.abs(want.astype(np.float64)).max()))


@pytest.mark.parametrize("dtype,padding,strides,dilations,activation",
                         [("float", "SAME", (1, 1), (1, 1), "relu"), ("float", "VALID", (2, 1), (1, 2), "linear"),
                          ("half", "SAME", (2, 2), (1, 1), "gelu_approximate"),
                          ("bfloat", "VALID", (1, 1), (2, 2), "tanh")])
def test_conv2d_matches_the_cpu_kernel(lib, cpu, dtype, padding, strides, dilations, activation):
    x, q, scale, bias = case(dtype, (2, 7, 6, 3), (3, 3, 3, 4), seed=31)
    y = metal_conv2d(lib, dtype, x, q, scale, bias, strides, dilations, padding, activation=activation)
    want = cpu.tfmetal_ext_int8_conv2d(tf.constant(x), q, scale, tf.constant(bias), activation=activation,
                                       has_bias=True, strides=list(strides), dilations=list(dilations),
                                       padding=padding).numpy()
    assert y.shape == want.shape
    cpu_close(y, want, dtype, float(np.abs(want.astype(np.float64)).max()))


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through a Metal backend.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels(cpu, dtype):
    x, q, scale, bias = case(dtype, (5, 40), (40, 33), seed=37)
    xc, qc, sc, bc = case(dtype, (2, 9, 8, 3), (3, 3, 3, 6), seed=41)
    results = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            mm = cpu.tfmetal_ext_int8_mat_mul(tf.constant(x), q, scale, tf.constant(bias), activation="gelu",
                                              has_bias=True)
            cv = cpu.tfmetal_ext_int8_conv2d(tf.constant(xc), qc, sc, tf.constant(bc), activation="relu",
                                             has_bias=True, strides=[2, 1], dilations=[1, 1], padding="SAME")
        results[device] = (mm.numpy(), cv.numpy())
        if device == "/GPU:0":
            assert "GPU" in mm.device and "GPU" in cv.device
    for got, want in zip(results["/GPU:0"], results["/CPU:0"]):
        cpu_close(got, want, dtype, float(np.abs(want.astype(np.float64)).max()))
