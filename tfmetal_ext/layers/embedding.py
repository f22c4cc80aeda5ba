"""FusedEmbedding: keras.layers.Embedding whose index arithmetic stays on the GPU."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext import _saved_names

_STOCK = keras.layers.Embedding


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedEmbedding(_STOCK):
    """`keras.layers.Embedding` with its lookup's index arithmetic in int64, which a GPU keeps in device memory.

    A drop-in subclass: the same arguments (``input_dim``, ``output_dim``,
    initializer, regularizer, constraint, ``mask_zero``, ``weights``, LoRA,
    quantization), weights, config, mask and numbers. What differs is the
    graph of a dense lookup. Keras' Embedding (``ops.take`` on TensorFlow)
    wraps negative indices with int32 ops (``Less``, ``AddV2``, ``SelectV2``
    on the indices) before its ``GatherV2``. TensorFlow keeps int32 tensors in
    host memory on every GPU, Metal included, so each lookup copies the
    indices to the host and back in every step. Here the indices are cast to
    int64 first (non-integer inputs are cast to int32 before that, as stock
    casts them) and wrapped as ``i + input_dim * (i < 0)`` (``Less``,
    ``Cast``, ``Mul``, ``AddV2``, all int64), which gives stock's index for
    every value, out-of-range ones included. Then ``GatherV2`` with int64
    indices gathers the same rows. Both Metal backends run these int64 ops on
    the device: natively, or through tfmetal_ext's gap kernels (see
    `tfmetal_ext.backends.gap_kernels`). The gradient is the same
    ``IndexedSlices``, with int64 indices.

    Sparse and ragged inputs and the quantized modes (``quantize("int8")``
    as stock) run Keras' own code.

    Args:
        Those of `keras.layers.Embedding`.

    Example:

    >>> layer = FusedEmbedding(10, 3)
    >>> layer(np.array([[1, -1]])).shape  # -1 is row 9, as stock
    TensorShape([1, 2, 3])
    """

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras' `Embedding.quantize` (``"int8"``, ``"int4"``): Keras refuses it to subclasses; this class's
        own instances take it, and its subclasses are refused as Keras refuses Embedding's."""
        # An alias (a converted layer saved under the stock name, `tfmetal_ext._saved_names`) is this class.
        if type_check and _saved_names.unaliased(type(self)) is not FusedEmbedding:
            raise self._not_implemented_error(self.quantize)
        return super().quantize(mode, type_check=False, config=config)

    def call(self, inputs):
        if isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)):
            return super().call(inputs)
        indices = tf.convert_to_tensor(inputs)
        if indices.dtype not in (tf.int32, tf.int64):
            indices = tf.cast(indices, tf.int32)  # stock's cast (its truncation), before ours
        outputs = tf.gather(self.embeddings, wrapped_indices(indices, self.input_dim), axis=0)
        return keras.ops.cast(outputs, dtype=self.compute_dtype)


def wrapped_indices(indices, rows):
    """`indices` as int64 with Keras' negative-index wrap (``take``'s "fill" mode): ``i + rows`` where ``i < 0``.

    Computed as ``i + rows * (i < 0)``, all in int64, with no select (the
    open plugin and Apple's backend have no int64 ``SelectV2`` kernel).
    `rows`: the gathered axis' length, a Python int.
    """
    i = tf.cast(indices, tf.int64)
    return i + tf.cast(tf.less(i, tf.constant(0, tf.int64)), tf.int64) * tf.constant(rows, tf.int64)
