"""cuDNN's canonical weight layout: Keras LSTM / GRU weights packed into `CudnnRNNV3`'s flat params.

Read by the recurrence engine's ``"cudnn"`` form (`tfmetal_ext.ops._recurrence`).
"""

from __future__ import annotations

import tensorflow as tf


def _gate_blocks_transposed(w, gates, order):
    """(in, gates*H) Keras kernel -> flat concatenation of the per-gate (H, in) blocks in `order`."""
    rows = tf.shape(w)[0]
    blocks = tf.reshape(w, tf.stack([rows, gates, -1]))  # (in, gate, H)
    if order is not None:
        blocks = tf.gather(blocks, order, axis=1)
    return tf.reshape(tf.transpose(blocks, [1, 2, 0]), [-1])  # (gate, H, in) row-major


def lstm_cudnn_params(kernel, recurrent_kernel, bias, units):
    """The flat `CudnnRNNV3` params of an LSTM with Keras weights.

    cuDNN's canonical layout: the 4 input-weight matrices, then the 4 recurrent
    ones, each ``(units, in)`` row-major (a Keras kernel block transposed), then
    the 4 input biases and the 4 recurrent biases. Gate order i, f, c, o is the
    same in Keras and cuDNN. Keras has one bias, so the input biases are zero.
    """
    dtype = kernel.dtype
    if bias is None:
        bias = tf.zeros([4 * units], dtype)
    return tf.concat(
        [
            _gate_blocks_transposed(kernel, 4, None),
            _gate_blocks_transposed(recurrent_kernel, 4, None),
            tf.zeros([4 * units], dtype),
            tf.reshape(bias, [-1]),
        ],
        axis=0,
    )


def gru_cudnn_params(kernel, recurrent_kernel, bias, units, swap_gates):
    """The flat `CudnnRNNV3` params of a ``reset_after=True`` GRU with Keras weights.

    Keras orders the gates z (update), r (reset), h; cuDNN r, z, h. With
    `swap_gates` the blocks are reordered for cuDNN (CUDA). Without it they stay
    in Keras order, which is what Keras itself sends to `CudnnRNNV3` on a
    non-CUDA build of TensorFlow such as the macOS one tensorflow-metal runs
    under. Bias row 0 (input) then row 1 (recurrent).
    """
    order = [1, 0, 2] if swap_gates else None
    dtype = kernel.dtype
    if bias is None:
        bias = tf.zeros([2, 3 * units], dtype)
    biases = tf.reshape(bias, [2, 3, units])
    if order is not None:
        biases = tf.gather(biases, order, axis=1)
    return tf.concat(
        [
            _gate_blocks_transposed(kernel, 3, order),
            _gate_blocks_transposed(recurrent_kernel, 3, order),
            tf.reshape(biases, [-1]),
        ],
        axis=0,
    )
