"""Weight-only int8 contractions: ``TfmetalExt>Int8MatMul`` and ``TfmetalExt>Int8Conv2D``.

Keras' convention (``layer.quantize("int8")``): a float kernel ``w`` is stored as
int8 ``q = round(w * kernel_scale)`` clipped to [-127, 127], with a float32
``kernel_scale`` per output channel, so ``w ~= q / kernel_scale``. The ops
compute

    y = activation(acc / kernel_scale + bias),  acc = sum float(x) * float(q)

in float32 for every activation dtype, the int8 weights converted inside the
kernel (never de-quantized into memory). The activations are float (no
calibration, no activation quantization).

Gradients (Keras' semantics for quantized layers): to the input and the bias,
computed with the de-quantized kernel; none to the int8 kernel or its scale
(they are not trainable).

Where the op does not run (no op library, ``TFMETAL_EXT_REFERENCE_OPS=1``,
``configure(avoid_fusions=["int8_matmul"])`` / ``["int8_conv2d"]``, or no kernel
for the visible GPU), the pure-TF reference runs: the kernel de-quantized
(Cast, RealDiv), then MatMul / Conv2D + BiasAdd + activation, in float32.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common

INT8_MATMUL_OP = fusion.INT8_MATMUL_OP
INT8_CONV2D_OP = fusion.INT8_CONV2D_OP
INT8_ACTIVATIONS = fusion.INT8_ACTIVATIONS
LEAKY_RELU_ALPHA = fusion.LEAKY_RELU_ALPHA

# Names of the generated wrappers in the loaded op module.
_MATMUL_WRAPPER = "tfmetal_ext_int8_mat_mul"
_CONV2D_WRAPPER = "tfmetal_ext_int8_conv2d"
_OPS = {"matmul": (INT8_MATMUL_OP, _MATMUL_WRAPPER), "conv2d": (INT8_CONV2D_OP, _CONV2D_WRAPPER)}


# ----------------------------------------------------------------------------
# Quantization (every quantized layer uses this one).


def quantize_int8(kernel, axis):
    """Keras' int8 quantization of a float kernel: ``(q, scale)``.

    Wraps ``keras.quantizers.abs_max_quantize(kernel, axis, to_numpy=True)``
    (``scale = 127 / (max|w| + epsilon)`` over `axis`,
    ``q = clip(round(w * scale), -127, 127)``) and squeezes `axis` out of the
    scale.

    Args:
        kernel: a float kernel (tensor, variable or numpy array).
        axis: the reduction axis or axes: every kernel axis but the output
            channel one (0 for a Dense [in, out] kernel, (0, 1, 2) for an HWIO
            Conv2D kernel).

    Returns:
        ``(q, scale)``: the int8 kernel (same shape) and the float32 scale of
        the output channels (the kernel's shape without `axis`).
    """
    from keras import quantizers

    q, scale = quantizers.abs_max_quantize(kernel, axis=axis, to_numpy=True)
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    scale = tf.squeeze(tf.cast(scale, tf.float32), axis=[a % scale.shape.rank for a in axes])
    return tf.cast(q, tf.int8), scale


# ----------------------------------------------------------------------------
# Public ops.


@tf.autograph.experimental.do_not_convert
def int8_matmul(x, kernel, kernel_scale, bias=None, activation=None, name=None):
    """``activation(x @ (kernel / kernel_scale) + bias)`` with an int8 `kernel`.

    One ``TfmetalExt>Int8MatMul``: the int8 weights are streamed once and
    converted in the kernel, the float32 accumulation divided by the
    per-column scale, the bias added and the activation applied in the same
    pass.

    Args:
        x: a float32, float16 or bfloat16 tensor of rank >= 2, ``[..., K]``
            (flattened to ``[M, K]`` around the op and reshaped back).
        kernel: an int8 ``[K, N]`` tensor.
        kernel_scale: the float32 ``[N]`` scale (``w ~= kernel / kernel_scale``).
        bias: a float ``[N]`` vector (used in `x`'s dtype), or None.
        activation: None / ``"linear"`` or a name in
            `tfmetal_ext.backends.fusion.INT8_ACTIVATIONS`.
        name: optional op name.

    Returns:
        ``[..., N]`` in `x`'s dtype.

    Raises:
        ValueError: for a non-float `x`, a non-int8 `kernel`, wrong ranks,
            mismatched sizes or an unknown activation.
    """
    x, kernel, kernel_scale, bias, act = _matmul_args(x, kernel, kernel_scale, bias, activation)
    n = kernel.shape[1]
    rank = x.shape.rank
    x2 = x if rank == 2 else tf.reshape(x, [-1, tf.shape(x)[-1]])
    if _common.portable():
        y = portable_int8_matmul(x2, kernel, kernel_scale, bias, act)
    elif uses_kernel("matmul"):
        y = _wrapper("matmul")(x2, kernel, kernel_scale, _bias_or_empty(bias, x.dtype), activation=act,
                               leaky_relu_alpha=LEAKY_RELU_ALPHA, has_bias=bias is not None, name=name)
    else:
        _check_scale_values(kernel_scale)
        y = reference_int8_matmul(x2, kernel, kernel_scale, bias, act)
    if rank != 2:
        out_shape = tf.concat([tf.shape(x)[:-1], tf.shape(kernel)[1:]], axis=0)
        y = tf.reshape(y, out_shape)
        y.set_shape(x.shape[:-1].concatenate([n]))
    return y


@tf.autograph.experimental.do_not_convert
def int8_conv2d(x, kernel, kernel_scale, bias=None, strides=(1, 1), padding="valid", dilation_rate=(1, 1),
                activation=None, name=None):
    """A 2-D convolution (NHWC, HWIO) with an int8 `kernel`, bias and activation in one op.

    One ``TfmetalExt>Int8Conv2D``: ``activation(conv(x, kernel / kernel_scale)
    + bias)``, TF's Conv2D padding rules, accumulated in float32.

    Args:
        x: a float32, float16 or bfloat16 ``[B, H, W, Cin]`` tensor.
        kernel: an int8 ``[KH, KW, Cin, Cout]`` tensor.
        kernel_scale: the float32 ``[Cout]`` scale.
        bias: a float ``[Cout]`` vector, or None.
        strides: an int or 2 positive ints (h, w).
        padding: ``"valid"`` or ``"same"`` (either case).
        dilation_rate: an int or 2 positive ints (h, w).
        activation: None / ``"linear"`` or a name in `fusion.INT8_ACTIVATIONS`.
        name: optional op name.

    Returns:
        ``[B, OH, OW, Cout]`` in `x`'s dtype.

    Raises:
        ValueError: for bad dtypes, ranks, sizes, strides, dilations, padding
            or activation.
    """
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank is not None and x.shape.rank != 4:
        raise ValueError(f"`x` must be a 4-D NHWC tensor. Received: x.shape={x.shape}")
    kernel = _int8_kernel(kernel, 4, "[KH, KW, Cin, Cout]")
    cin = x.shape[-1] if x.shape.rank is not None else None
    if cin is not None and kernel.shape[2] is not None and cin != kernel.shape[2]:
        raise ValueError(
            f"`kernel`'s input channels ({kernel.shape[2]}) must match x's last dimension ({cin}). "
            f"Received: x.shape={x.shape}, kernel.shape={kernel.shape}"
        )
    cout = kernel.shape[3]
    kernel_scale = _scale(kernel_scale, cout)
    bias = _bias(bias, cout, x.dtype)
    act = _activation(activation)
    strides = _pair("strides", strides)
    dilations = _pair("dilation_rate", dilation_rate)
    pad = _padding(padding)
    if uses_kernel("conv2d"):
        return _wrapper("conv2d")(x, kernel, kernel_scale, _bias_or_empty(bias, x.dtype), activation=act,
                                  leaky_relu_alpha=LEAKY_RELU_ALPHA, has_bias=bias is not None,
                                  strides=list(strides), dilations=list(dilations), padding=pad, name=name)
    if _common.portable():
        return portable_int8_conv2d(x, kernel, kernel_scale, bias, strides, pad, dilations, act)
    _check_scale_values(kernel_scale)
    return reference_int8_conv2d(x, kernel, kernel_scale, bias, strides, pad, dilations, act)


def int8_uses_kernel(op="matmul") -> bool:
    """`int8_matmul` (``op="matmul"``) / `int8_conv2d` (``"conv2d"``) runs the custom op here."""
    return uses_kernel(op)


def uses_kernel(op="matmul") -> bool:
    """The int8 op `op` (``"matmul"`` or ``"conv2d"``) runs as the custom op here (else its reference)."""
    if op not in _OPS:
        raise ValueError(f"Argument `op` must be 'matmul' or 'conv2d'. Received: op={op!r}")
    op_name, wrapper = _OPS[op]
    if not _common.uses_kernel(op_name):
        return False
    # A library built before the int8 ops existed has no wrapper for them.
    return hasattr(_common.library(), wrapper)


def _wrapper(op):
    return getattr(_common.library() or _loaded_library(), _OPS[op][1])


# ----------------------------------------------------------------------------
# Argument checks (ValueError, Keras style).


def _matmul_args(x, kernel, kernel_scale, bias, activation):
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank is not None and x.shape.rank < 2:
        raise ValueError(f"`x` must have rank >= 2 ([..., K]). Received: x.shape={x.shape}")
    kernel = _int8_kernel(kernel, 2, "[K, N]")
    k = x.shape[-1] if x.shape.rank is not None else None
    if k is not None and kernel.shape[0] is not None and k != kernel.shape[0]:
        raise ValueError(
            f"`kernel`'s first dimension ({kernel.shape[0]}) must match x's last dimension ({k}). "
            f"Received: x.shape={x.shape}, kernel.shape={kernel.shape}"
        )
    n = kernel.shape[1]
    return x, kernel, _scale(kernel_scale, n), _bias(bias, n, x.dtype), _activation(activation)


def _int8_kernel(kernel, rank, layout):
    kernel = tf.convert_to_tensor(kernel)
    if kernel.dtype != tf.int8:
        raise ValueError(f"`kernel` must be int8. Received: kernel.dtype={kernel.dtype.name}")
    if kernel.shape.rank != rank:
        raise ValueError(f"`kernel` must be a {rank}-D {layout} tensor. Received: kernel.shape={kernel.shape}")
    return kernel


def _scale(kernel_scale, n):
    s = tf.convert_to_tensor(kernel_scale)
    if not s.dtype.is_floating:
        raise ValueError(f"`kernel_scale` must be a float tensor. Received: kernel_scale.dtype={s.dtype.name}")
    if s.shape.rank not in (None, 1) or (s.shape.rank == 1 and None not in (n, s.shape[0]) and s.shape[0] != n):
        raise ValueError(
            f"`kernel_scale` must be a vector of the output channels ({n}). Received: kernel_scale.shape={s.shape}"
        )
    return tf.cast(s, tf.float32)


def _bias(bias, n, dtype):
    if bias is None:
        return None
    b = tf.convert_to_tensor(bias)
    if not b.dtype.is_floating:
        raise ValueError(f"`bias` must be a float tensor. Received: bias.dtype={b.dtype.name}")
    if b.shape.rank not in (None, 1) or (b.shape.rank == 1 and None not in (n, b.shape[0]) and b.shape[0] != n):
        raise ValueError(f"`bias` must be a vector of the output channels ({n}). Received: bias.shape={b.shape}")
    return tf.cast(b, dtype)


def _bias_or_empty(bias, dtype):
    return bias if bias is not None else tf.zeros([0], dtype)


def _activation(activation):
    if activation is None:
        return "linear"
    if not isinstance(activation, str) or activation not in INT8_ACTIVATIONS:
        raise ValueError(
            f"Argument `activation` must be None or one of {', '.join(map(repr, INT8_ACTIVATIONS))}. "
            f"Received: activation={activation!r}"
        )
    return activation


def _pair(name, value):
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value, value)
    try:
        pair = tuple(value)
    except TypeError:
        pair = None
    if (pair is None or len(pair) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in pair)):
        raise ValueError(f"Argument `{name}` must be a positive int or 2 positive ints. Received: {name}={value!r}")
    return tuple(int(v) for v in pair)


def _padding(padding):
    if not isinstance(padding, str) or padding.upper() not in ("SAME", "VALID"):
        raise ValueError(f"Argument `padding` must be 'valid' or 'same'. Received: padding={padding!r}")
    return padding.upper()


def _check_scale_values(kernel_scale):
    """The kernels' scale check, where the reference runs on a known scale (eager)."""
    value = tf.get_static_value(kernel_scale)
    if value is not None and not np.all(np.isfinite(value) & (value > 0)):
        raise tf.errors.InvalidArgumentError(
            None, None, f"kernel_scale must be finite and > 0 everywhere, got {np.asarray(value).tolist()[:8]}")


# ----------------------------------------------------------------------------
# Pure-TF references (also the second reference of the tests).


def dequantize(kernel, kernel_scale):
    """The float32 kernel ``kernel / kernel_scale`` (the scale broadcast over the last axis)."""
    return tf.cast(kernel, tf.float32) / tf.cast(kernel_scale, tf.float32)


def reference_int8_matmul(x, kernel, kernel_scale, bias=None, activation=None, alpha=LEAKY_RELU_ALPHA):
    """``activation(x @ (kernel / kernel_scale) + bias)`` for 2-D `x`, in float32, cast back to x's dtype."""
    xf = tf.cast(x, tf.float32)
    y = tf.linalg.matmul(xf, dequantize(kernel, kernel_scale))
    if bias is not None:
        y = tf.nn.bias_add(y, tf.cast(bias, tf.float32))
    return tf.cast(_common.reference_activate(y, activation, alpha), x.dtype)


def reference_int8_conv2d(x, kernel, kernel_scale, bias=None, strides=(1, 1), padding="VALID", dilations=(1, 1),
                          activation=None, alpha=LEAKY_RELU_ALPHA):
    """The convolution of `int8_conv2d` with the de-quantized kernel, in float32, cast back to x's dtype."""
    empty = _empty_conv_output(x, kernel, strides, padding, dilations)
    if empty is not None:  # no output position, or an empty batch (see `_empty_conv_output`)
        return tf.zeros(empty, x.dtype)
    xf = tf.cast(x, tf.float32)
    # The dilated kernel spelled out (zeros between the taps): the same convolution, and TF's CPU
    # Conv2D gradient kernels take no dilation.
    w = _dilate(dequantize(kernel, kernel_scale), dilations)
    y = tf.nn.conv2d(xf, w, strides=list(strides), padding=padding.upper())
    if bias is not None:
        y = tf.nn.bias_add(y, tf.cast(bias, tf.float32))
    return tf.cast(_common.reference_activate(y, activation, alpha), x.dtype)


# Portable forms (traced for export, `tfmetal_ext.deploy.portable_forms`): the op's own definition,
# ``activation(acc / kernel_scale + bias)`` with ``acc = x @ float(kernel)``, as stock ops (Keras'
# weight-only int8 layers compute the same). The int8 kernel stays int8 in the artifact (a Cast
# where it is read). Not `reference_int8_*` (the kernel de-quantized before the product): the TFLite
# converter (TF 2.21) turns MatMul by a computed kernel + BiasAdd + Relu into a BATCH_MATMUL and
# drops the Relu when the bias is all zeros (measured; tests/deploy/test_export.py).


def portable_int8_matmul(x, kernel, kernel_scale, bias=None, activation=None, alpha=LEAKY_RELU_ALPHA):
    """`int8_matmul`'s portable form for 2-D `x`: the accumulator de-quantized, in float32."""
    y = tf.linalg.matmul(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32)) / tf.cast(kernel_scale, tf.float32)
    if bias is not None:
        y = y + tf.cast(bias, tf.float32)
    return tf.cast(_common.reference_activate(y, activation, alpha), x.dtype)


def portable_int8_conv2d(x, kernel, kernel_scale, bias=None, strides=(1, 1), padding="VALID", dilations=(1, 1),
                         activation=None, alpha=LEAKY_RELU_ALPHA):
    """`int8_conv2d`'s portable form: the accumulator de-quantized, in float32."""
    empty = _empty_conv_output(x, kernel, strides, padding, dilations)
    if empty is not None:
        return tf.zeros(empty, x.dtype)
    y = tf.nn.conv2d(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32), strides=list(strides),
                     padding=padding.upper(), dilations=list(dilations))
    y = y / tf.cast(kernel_scale, tf.float32)
    if bias is not None:
        y = y + tf.cast(bias, tf.float32)
    return tf.cast(_common.reference_activate(y, activation, alpha), x.dtype)


def _dilate(w, dilations):
    """HWIO `w` with dilations[i] - 1 zeros between its taps along H and W (no-op for (1, 1))."""
    dh, dw = dilations
    if (dh, dw) == (1, 1):
        return w
    kh, kw, ci, co = tf.unstack(tf.shape(w))
    wide = tf.pad(w[:, None, :, None], [[0, 0], [0, dh - 1], [0, 0], [0, dw - 1], [0, 0], [0, 0]])
    wide = tf.reshape(wide, tf.stack([kh * dh, kw * dw, ci, co]))
    return wide[: (kh - 1) * dh + 1, : (kw - 1) * dw + 1]


def _empty_conv_output(x, kernel, strides, padding, dilations):
    """The static output shape when the convolution's output is statically empty, else None.

    Empty when a VALID window is larger than the input (TF's Conv2D rejects
    that; the op gives an empty output) or the batch is 0: TF's oneDNN Conv2D
    (x86-64 Linux wheels on AVX-512 CPUs, or TF_ENABLE_ONEDNN_OPTS=1) returns
    its input unchanged for an empty batch, with the input's spatial size and
    channels, so the bias that follows fails or the shape is wrong. A batch
    that is 0 only at run time (an unknown batch dimension in a graph) still
    meets that bug, as stock Keras' Conv2D does there.
    """
    if x.shape.rank != 4 or None in x.shape[1:3] or None in kernel.shape:
        return None
    if padding.upper() == "VALID":
        out = [(x.shape[1 + i] - ((kernel.shape[i] - 1) * dilations[i] + 1)) // strides[i] + 1
               if x.shape[1 + i] >= (kernel.shape[i] - 1) * dilations[i] + 1 else 0 for i in range(2)]
    else:  # SAME: ceil(in / stride)
        out = [-(-x.shape[1 + i] // strides[i]) for i in range(2)]
    if min(out) > 0 and x.shape[0] != 0:
        return None
    batch = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
    return [batch, out[0], out[1], kernel.shape[3]]


# ----------------------------------------------------------------------------
# Gradients of the ops: dx through the de-quantized kernel, dbias; none for the kernel and its scale.


def _activation_grad(op, dy, recompute):
    """dz = dy * activation'(z) in float32, z the op's pre-activation.

    Where the derivative is a function of the output (all but GELU, and
    leaky_relu with a slope <= 0), it is read from the op's output; else z is
    recomputed with the same op, activation "linear" (`recompute()`).
    """
    act = op.get_attr("activation")
    act = act.decode() if isinstance(act, bytes) else act
    alpha = op.get_attr("leaky_relu_alpha")
    dy = tf.cast(dy, tf.float32)
    if act == "linear":
        return dy
    y = tf.cast(op.outputs[0], tf.float32)
    if act == "relu":
        return tf.where(y > 0, dy, tf.zeros_like(dy))
    if act == "relu6":
        return tf.where((y > 0) & (y < 6), dy, tf.zeros_like(dy))
    if act == "elu":
        return tf.where(y > 0, dy, dy * (y + 1.0))
    if act == "tanh":
        return dy * (1.0 - y * y)
    if act == "sigmoid":
        return dy * y * (1.0 - y)
    if act == "leaky_relu" and alpha > 0:
        return tf.where(y > 0, dy, dy * alpha)
    z = tf.cast(recompute(), tf.float32)
    if act == "leaky_relu":
        return tf.where(z > 0, dy, dy * alpha)
    if act == "gelu":
        cdf = 0.5 * (1.0 + tf.math.erf(z * 0.7071067811865476))
        pdf = tf.exp(-0.5 * z * z) * 0.3989422804014327
        return dy * (cdf + z * pdf)
    if act == "gelu_approximate":
        c = 0.7978845608028654
        t = tf.math.tanh(c * (z + 0.044715 * z * z * z))
        return dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z))
    raise ValueError(f"Unknown int8 activation. Received: activation={act!r}")


def _linear_attrs(op, extra=()):
    attrs = {"activation": "linear", "leaky_relu_alpha": op.get_attr("leaky_relu_alpha"),
             "has_bias": op.get_attr("has_bias")}
    for key in extra:
        attrs[key] = op.get_attr(key)
    return attrs


@tf.RegisterGradient(INT8_MATMUL_OP)
def _int8_matmul_grad(op, dy):
    x, kernel, scale, bias = op.inputs
    wrapper = getattr(_common.library() or _loaded_library(), _MATMUL_WRAPPER)
    dz = _activation_grad(op, dy, lambda: wrapper(x, kernel, scale, bias, **_linear_attrs(op)))
    dx = tf.linalg.matmul(dz / scale, tf.cast(kernel, tf.float32), transpose_b=True)
    dbias = tf.cast(tf.reduce_sum(dz, axis=0), bias.dtype) if op.get_attr("has_bias") else tf.zeros_like(bias)
    return tf.cast(dx, x.dtype), None, None, dbias


@tf.RegisterGradient(INT8_CONV2D_OP)
def _int8_conv2d_grad(op, dy):
    x, kernel, scale, bias = op.inputs
    wrapper = getattr(_common.library() or _loaded_library(), _CONV2D_WRAPPER)
    extra = ("strides", "dilations", "padding")
    dz = _activation_grad(op, dy, lambda: wrapper(x, kernel, scale, bias, **_linear_attrs(op, extra)))
    sh, sw = op.get_attr("strides")
    dh, dw = op.get_attr("dilations")
    padding = op.get_attr("padding")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    dx = tf.raw_ops.Conv2DBackpropInput(
        input_sizes=tf.shape(x), filter=_dilate(dequantize(kernel, scale), (dh, dw)), out_backprop=dz,
        strides=[1, sh, sw, 1], padding=padding)
    dbias = tf.cast(tf.reduce_sum(dz, axis=[0, 1, 2]), bias.dtype) if op.get_attr("has_bias") else tf.zeros_like(bias)
    return tf.cast(dx, x.dtype), None, None, dbias


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
