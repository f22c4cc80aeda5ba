"""gemv: a few rows times a weight matrix, every weight read once (``TfmetalExt>Gemv``)."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common

GEMV_OP = fusion.GEMV_OP
MAX_ROWS = fusion.GEMV_MAX_ROWS


def gemv(x, kernel, bias=None, name=None):
    """``x @ kernel + bias`` for an `x` of few rows: a decoding step's projections.

    One ``TfmetalExt>Gemv``: the kernel's panels of columns are spread over
    the threads (on Apple GPUs, one thread per output), each weight read once
    and used for every row, and the bias added before the one rounding to
    `x`'s dtype. TF's ``MatMul`` on the CPU packs the whole kernel before a
    one-row product, which costs more than the product itself at a decoding
    step's sizes. Each output is one float32 sum over k in increasing order,
    one fused multiply-add per step (``tfmetal/gemv.h``): the CPU kernels of
    every vector level and the Metal kernel give the same bits; against
    ``MatMul`` + ``BiasAdd`` (another summation order) the results agree
    within the rounding of a float32 sum of K products. The work is
    ``rows x K x N`` multiply-adds with no blocking over rows, so the layers
    use it up to `MAX_ROWS` rows (``fusion.GEMV_MAX_ROWS``) and ``MatMul``
    above; and only where the backend table's ``fusion.GEMV_PATTERN`` row
    takes it: on the CPU, not yet on Metal, where the kernel's bits are
    checked (emulator, ``doctor --selftest``) but its speed against the
    backend's MatMul is unmeasured.

    The gradient is two ``MatMul``s (and a sum for the bias); the op has no
    gradient op of its own. In a function XLA compiles, and while
    ``configure(avoid_fusions=["gemv"])`` is in force, ``MatMul`` (+
    ``BiasAdd``) runs instead.

    Args:
        x: float32, float16 or bfloat16, rank >= 2, ``[..., K]`` (flattened
            to ``[M, K]`` around the op and reshaped back).
        kernel: ``[K, N]`` of `x`'s dtype (a Keras Dense kernel's layout).
        bias: ``[N]`` of `x`'s dtype, or None.
        name: optional op name.

    Returns:
        ``[..., N]`` in `x`'s dtype.

    Raises:
        ValueError: for a non-float `x`, another dtype for `kernel` or `bias`,
            wrong ranks or mismatched sizes.

    >>> y = gemv(tf.constant([[1.0, 2.0]]), tf.constant([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]), tf.constant([0.5, 0.5, 0.5]))
    >>> y.numpy()
    array([[1.5, 2.5, 3.5]], dtype=float32)
    """
    x, kernel, bias = _args(x, kernel, bias)
    lead = x.shape[:-1]
    flat = x if x.shape.rank == 2 else tf.reshape(x, [-1, x.shape[-1] if x.shape[-1] is not None else tf.shape(x)[-1]])
    if uses_kernel() and not _common.in_xla_context():  # no XLA kernel: XLA compiles the MatMul
        has_bias = bias is not None
        b = bias if has_bias else tf.zeros([0], x.dtype)
        y = _common.library().tfmetal_ext_gemv(flat, kernel, b, has_bias=has_bias, name=name)
    else:
        y = reference_gemv(flat, kernel, bias)
    if x.shape.rank == 2:
        return y
    n = kernel.shape[1] if kernel.shape[1] is not None else tf.shape(kernel)[1]
    if lead.is_fully_defined() and isinstance(n, int):
        return tf.reshape(y, lead.concatenate([n]))
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], tf.reshape(tf.shape(kernel)[1], [1])], axis=0))


def reference_gemv(x, kernel, bias=None):
    """The stock ops `gemv` replaces: ``MatMul`` (+ ``BiasAdd``), in `x`'s dtype (its safe form)."""
    y = tf.linalg.matmul(x, kernel)
    return y if bias is None else tf.nn.bias_add(y, bias)


def uses_kernel() -> bool:
    """`gemv` runs the custom op here (else MatMul + BiasAdd)."""
    return _common.uses_kernel(GEMV_OP)


def _args(x, kernel, bias):
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if x.shape.rank is not None and x.shape.rank < 2:
        raise ValueError(f"`x` must have rank >= 2 ([..., K]). Received: x.shape={x.shape}")
    kernel = tf.convert_to_tensor(kernel)
    if kernel.dtype != x.dtype:
        raise ValueError(f"`kernel` must have x's dtype ({x.dtype.name}). Received: kernel.dtype={kernel.dtype.name}")
    if kernel.shape.rank is not None and kernel.shape.rank != 2:
        raise ValueError(f"`kernel` must be a matrix [K, N]. Received: kernel.shape={kernel.shape}")
    k = x.shape[-1] if x.shape.rank is not None else None
    if k is not None and kernel.shape.rank == 2 and kernel.shape[0] is not None and k != kernel.shape[0]:
        raise ValueError(f"`kernel`'s first dimension ({kernel.shape[0]}) must match x's last dimension ({k}). "
                         f"Received: x.shape={x.shape}, kernel.shape={kernel.shape}")
    if bias is not None:
        bias = tf.convert_to_tensor(bias)
        if bias.dtype != x.dtype:
            raise ValueError(f"`bias` must have x's dtype ({x.dtype.name}). Received: bias.dtype={bias.dtype.name}")
        n = kernel.shape[1] if kernel.shape.rank == 2 else None
        if bias.shape.rank is not None and (bias.shape.rank != 1 or (
                n is not None and bias.shape[0] is not None and bias.shape[0] != n)):
            raise ValueError(f"`bias` must be a vector of the kernel's N ({n}) values. "
                             f"Received: bias.shape={bias.shape}, kernel.shape={kernel.shape}")
    return x, kernel, bias


@tf.RegisterGradient(GEMV_OP)
def _gemv_grad(op, dy):
    x, kernel, bias = op.inputs
    dx = tf.linalg.matmul(dy, kernel, transpose_b=True)
    dkernel = tf.linalg.matmul(x, dy, transpose_a=True)
    dbias = tf.reduce_sum(dy, axis=0) if op.get_attr("has_bias") else tf.zeros_like(bias)
    return dx, dkernel, dbias
