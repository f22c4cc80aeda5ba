"""Keras losses whose heavy part is one custom op each way.

`FusedSparseCategoricalCrossentropy` is a drop-in for ``keras.losses.SparseCategoricalCrossentropy``:
the same arguments, config and results. Where Keras' TensorFlow backend would run
``SparseSoftmaxCrossEntropyWithLogits`` (logits, or the logits under a softmax output with
``from_logits=False``), it runs `tfmetal_ext.ops.sparse_softmax_cross_entropy`. That op keeps two
float32 statistics per row instead of TensorFlow's ``[..., classes]`` softmax gradient, and its
backward pass is one op that writes ``(softmax - one_hot) * dloss``; TensorFlow's backward pass
multiplies its stored gradient in a further op. Elsewhere (probabilities that are not a softmax's
output, ``ignore_class``, a class axis that is not the last, float64, a function compiled with XLA,
another Keras backend, or the op avoided with ``configure(avoid_fusions=["sparse_softmax_cross_entropy"])``)
Keras' own function runs, unchanged.

``convert()`` gives a compiled model this class in place of Keras' (`fusion.LOSS_TO_FUSED`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.ops import _common
from tfmetal_ext.ops import sparse_xent as _sparse_xent

__all__ = ["FusedSparseCategoricalCrossentropy", "fused_reason", "sparse_categorical_crossentropy"]


def fused_reason(y_true, y_pred, from_logits=False, ignore_class=None, axis=-1):
    """Why `sparse_categorical_crossentropy` runs Keras' own function for these arguments, or None
    when it runs the custom op (the logits it would use are a Keras graph fact: see `_logits`)."""
    if keras.backend.backend() != "tensorflow":
        return f"the Keras backend is {keras.backend.backend()!r} (the op is a TensorFlow op)"
    if ignore_class is not None:
        return "ignore_class is set (Keras masks the labels and the losses around its op)"
    rank = getattr(getattr(y_pred, "shape", None), "rank", None)
    if rank is None or rank < 1:
        return "y_pred has no known rank >= 1"
    if axis not in (-1, rank - 1):
        return f"the class axis is {axis}, not the last one"
    if tf.as_dtype(y_pred.dtype) not in _common.FLOAT_DTYPES:
        return f"y_pred is {tf.as_dtype(y_pred.dtype).name} (the op takes float32, float16 and bfloat16)"
    if not _sparse_xent.uses_kernel():
        return "the op's kernel does not run here (reference ops, avoid_fusions, no compiler, or XLA)"
    return None


def _labels_and_logits(y_true, y_pred, from_logits):
    """``(int labels, logits)`` for the op, or None where Keras' function must run: probabilities
    that are not a softmax's output (Keras takes their clipped log), or shapes Keras refuses (its
    function raises its own error)."""
    logits = y_pred
    if not from_logits:
        logits = _logits(y_pred)
        if logits is None:
            return None
    labels = tf.convert_to_tensor(y_true)
    if labels.shape.rank is not None and labels.shape.rank == logits.shape.rank and labels.shape[-1] == 1:
        labels = tf.squeeze(labels, axis=-1)
    if labels.shape.rank is None or labels.shape.rank != logits.shape.rank - 1 or not (
            labels.shape.is_compatible_with(logits.shape[:-1])):
        return None
    if labels.dtype not in _sparse_xent.LABEL_DTYPES:
        labels = tf.cast(labels, tf.int64)  # Keras casts any target to int64 (truncating floats)
    return labels, logits


def _logits(probabilities):
    """The logits under softmax probabilities, as Keras' TensorFlow backend finds them (its
    ``_get_logits``: a tensor's ``_keras_logits``, or a Softmax op's input in a graph), else None."""
    try:
        from keras.src.backend.tensorflow.nn import _get_logits
    except ImportError:  # pragma: no cover - Keras moved it: its own function runs
        return None
    try:
        logits, found = _get_logits(probabilities, False, "Softmax", "sparse_categorical_crossentropy")
    except Exception:  # noqa: BLE001 - anything Keras' helper refuses: its own function runs
        return None
    return logits if found else None


@keras.saving.register_keras_serializable(package="tfmetal_ext")
def sparse_categorical_crossentropy(y_true, y_pred, from_logits=False, ignore_class=None, axis=-1):
    """``keras.losses.sparse_categorical_crossentropy`` through `tfmetal_ext.ops.sparse_softmax_cross_entropy`
    where Keras' TensorFlow backend would run ``SparseSoftmaxCrossEntropyWithLogits`` (see
    `fused_reason`); Keras' own function everywhere else. The same arguments and results (within
    float32 rounding, bound in the op's tests)."""
    y_pred = tf.convert_to_tensor(y_pred)
    stock = lambda: keras.losses.sparse_categorical_crossentropy(  # noqa: E731
        y_true, y_pred, from_logits=from_logits, ignore_class=ignore_class, axis=axis)
    if fused_reason(y_true, y_pred, from_logits, ignore_class, axis) is not None:
        return stock()
    pair = _labels_and_logits(y_true, y_pred, from_logits)
    if pair is None or tf.as_dtype(pair[1].dtype) not in _common.FLOAT_DTYPES:
        return stock()
    return _sparse_xent.sparse_softmax_cross_entropy(*pair)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedSparseCategoricalCrossentropy(keras.losses.SparseCategoricalCrossentropy):
    """``keras.losses.SparseCategoricalCrossentropy`` whose cross-entropy is one custom op each way.

    Takes the same arguments (`from_logits`, `ignore_class`, `reduction`, `axis`, `name`, `dtype`)
    and gives the same losses, reductions and config. It runs
    `tfmetal_ext.ops.sparse_softmax_cross_entropy` where Keras' TensorFlow backend would run
    TensorFlow's op: on logits (``from_logits=True``), and under ``from_logits=False`` on the logits
    of a softmax output, which Keras finds the same way. Elsewhere it runs Keras' function
    (`fused_reason` says why).

    >>> loss = FusedSparseCategoricalCrossentropy(from_logits=True)
    >>> round(float(loss([0], [[0.0, 0.0]])), 6)  # log(2)
    0.693147
    """

    def __init__(self, from_logits=False, ignore_class=None, reduction="sum_over_batch_size", axis=-1,
                 name="sparse_categorical_crossentropy", dtype=None):
        super().__init__(from_logits=from_logits, ignore_class=ignore_class, reduction=reduction, axis=axis,
                         name=name, dtype=dtype)
        self.fn = sparse_categorical_crossentropy
