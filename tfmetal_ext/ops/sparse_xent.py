"""sparse_softmax_cross_entropy: softmax cross-entropy with integer labels, one op each way
(``TfmetalExt>SparseSoftmaxCrossEntropy`` and ``TfmetalExt>SparseSoftmaxCrossEntropyGrad``)."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

SPARSE_XENT_OP = fusion.SPARSE_XENT_OP
LABEL_DTYPES = (tf.int32, tf.int64)


def sparse_softmax_cross_entropy(labels, logits, name=None):
    """Softmax cross-entropy of `logits` against integer class `labels`, as
    ``tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)`` computes it.

    ``loss = logsumexp(logits) - logits[label]`` over the last axis, in float32
    and rounded once to the logits' dtype. One custom op forward and one
    backward (CPU kernel; Metal kernel on Apple GPUs). TensorFlow's op writes
    the softmax gradient (``[..., classes]``) in the forward pass and the
    backward pass multiplies it by the incoming gradient; here the forward op
    keeps two float32 statistics per row, and the backward op makes
    ``(softmax - one_hot) * dloss`` from them and the logits in one pass (into
    the logits' buffer when nothing else reads them).

    Compared with TensorFlow's kernel: float32 within a few float32 roundoffs
    (an exp polynomial and a fixed summation order; the bound is derived in
    the tests); float16 the same, as TensorFlow computes float16 in float32;
    bfloat16 more accurate (TensorFlow computes it in bfloat16). NaN and
    infinite logits give TensorFlow's results (a NaN row, or an infinite loss
    for a ``-inf`` label logit). A label outside ``[0, classes)`` is refused
    by the CPU kernel with TensorFlow's error; on a Metal GPU its row is NaN,
    as TensorFlow's GPU kernel gives.

    Args:
        labels: int32 or int64, shape ``logits.shape[:-1]``.
        logits: float32, float16 or bfloat16, ``[..., classes]`` with
            ``classes >= 1``.
        name: optional op name.

    Returns:
        The per-example loss, shape ``labels.shape``, in the logits' dtype.

    Raises:
        ValueError: for another dtype or mismatched ranks or shapes.

    >>> loss = sparse_softmax_cross_entropy(tf.constant([0]), tf.constant([[0.0, 0.0]]))
    >>> round(float(loss[0]), 6)  # log(2)
    0.693147
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _common.check_float("logits", logits)
    if labels.dtype not in LABEL_DTYPES:
        raise ValueError(f"`labels` must be int32 or int64. Received: labels.dtype={labels.dtype.name}")
    rank = logits.shape.rank
    if rank is not None and rank < 1:
        raise ValueError(f"`logits` must have rank >= 1 ([..., classes]). Received: logits.shape={logits.shape}")
    if rank is not None and labels.shape.rank is not None:
        if labels.shape.rank != rank - 1 or not labels.shape.is_compatible_with(logits.shape[:-1]):
            raise ValueError("`labels` must have the shape of `logits` without its last axis. "
                             f"Received: labels.shape={labels.shape}, logits.shape={logits.shape}")
    classes = logits.shape[-1] if rank is not None else None
    if classes == 0:
        raise ValueError(f"`logits` must have at least one class (a last axis of size >= 1). "
                         f"Received: logits.shape={logits.shape}")
    flat_logits = tf.reshape(logits, [-1, classes if classes is not None else tf.shape(logits)[-1]])
    flat_labels = tf.reshape(labels, [-1])
    if uses_kernel():
        loss = _common.library().tfmetal_ext_sparse_softmax_cross_entropy(flat_logits, flat_labels, name=name)[0]
    else:
        loss = _with_reference_gradient(flat_logits, flat_labels)
    return tf.reshape(loss, tf.shape(labels))


def uses_kernel() -> bool:
    """`sparse_softmax_cross_entropy` runs the custom op here (else its pure-TF reference)."""
    return not _common.in_xla_context() and _common.uses_kernel(SPARSE_XENT_OP)


def _with_reference_gradient(logits, labels):
    if _common.portable():
        return _reference.sparse_softmax_cross_entropy(logits, labels)[0]

    @tf.custom_gradient
    def fn(logits):
        loss, row_max, row_sum = _reference.sparse_softmax_cross_entropy(logits, labels)

        def grad(dloss):
            return _reference.sparse_softmax_cross_entropy_grad(dloss, logits, labels, row_max, row_sum)

        return loss, grad

    return fn(logits)


def _is_zero(g):
    """Whether gradient `g` is known to be zero (None, a zeros op or a zero constant)."""
    if g is None:
        return True
    if not tf.executing_eagerly() and g.op.type in ("ZerosLike", "Zeros"):
        return True
    value = tf.get_static_value(g)
    return value is not None and not value.any()


def _statistics_gradient(logits, d_row_max, d_row_sum):
    """The logits' gradient through the two statistics outputs (differentiated like any output, by
    TF's autodiff of their float32 definition), or None when none flows in."""
    if _is_zero(d_row_max) and _is_zero(d_row_sum):
        return None
    with tf.GradientTape() as tape:
        tape.watch(logits)
        _, row_max, row_sum = _reference.sparse_softmax_cross_entropy_stats(logits)
    grads = [g if g is not None else tf.zeros_like(row_max) for g in (d_row_max, d_row_sum)]
    return tape.gradient([row_max, row_sum], logits, output_gradients=grads)


@tf.RegisterGradient(SPARSE_XENT_OP)
def _sparse_xent_grad(op, dloss, d_row_max, d_row_sum):
    """dlogits = (softmax - one_hot) * dloss from the op's statistics; the labels get none."""
    lib = _common.library() or _loaded_library()
    logits, labels = op.inputs
    dlogits = lib.tfmetal_ext_sparse_softmax_cross_entropy_grad(dloss, logits, labels, op.outputs[1], op.outputs[2])
    extra = _statistics_gradient(logits, d_row_max, d_row_sum)
    return (dlogits if extra is None else dlogits + tf.cast(extra, dlogits.dtype)), None


@tf.RegisterGradient(fusion.SPARSE_XENT_GRAD_OP)
def _sparse_xent_grad_grad(op, g):
    """Second order: TF's autodiff of the gradient's float32 formula (the reference), with respect to
    dloss, the logits and the two statistics (whose own gradients reach the forward op's outputs)."""
    dloss, logits, labels, row_max, row_sum = op.inputs
    with tf.GradientTape() as tape:
        tape.watch([dloss, logits, row_max, row_sum])
        y = _reference.sparse_softmax_cross_entropy_grad(dloss, logits, labels, row_max, row_sum)
    d_dloss, d_logits, d_max, d_sum = tape.gradient(y, [dloss, logits, row_max, row_sum], output_gradients=g)
    return d_dloss, d_logits, None, d_max, d_sum


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
