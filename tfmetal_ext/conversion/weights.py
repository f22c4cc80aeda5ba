"""Weight mapping: stock weights copied (bitwise where the mapping is the identity) or folded."""

from __future__ import annotations

import keras
import numpy as np

from tfmetal_ext.layers.conv_bn import fold_batch_norm


def to_numpy(v):
    return keras.ops.convert_to_numpy(v)


def same_bits(a, b):
    """Bitwise equality of two variables' values (NaN payloads included, so NaN weights copy too)."""
    a, b = np.asarray(to_numpy(a)), np.asarray(to_numpy(b))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _check_copied(a, b):
    if not same_bits(a, b):
        raise RuntimeError(f"weight {a.path} did not copy exactly into {b.path}")


def copy_identical(src, dst, pairs):
    """Copies `src`'s weights into `dst` one by one (same count, names, shapes); asserts bitwise equality.

    Each variable's own ``trainable`` flag is copied too. Appends the trainable ``(stock, new)``
    variable pairs to `pairs` (their gradients must match).
    """
    sw, dw = src.weights, dst.weights
    if len(sw) != len(dw):
        raise RuntimeError(
            f"weight layouts differ: {src.name} has {[w.name for w in sw]}, {dst.name} has {[w.name for w in dw]}"
        )
    for a, b in zip(sw, dw):
        if tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"weight {a.path} {tuple(a.shape)} != {b.path} {tuple(b.shape)}")
        b.assign(a.value if hasattr(a, "value") else a)
        _check_copied(a, b)
        if b.trainable != a.trainable:  # a variable frozen on its own (LoRA's kernel) stays frozen
            b.trainable = a.trainable
        if a.trainable and b.trainable:
            pairs.append((a, b))


def copy_conv_bn(conv, bn, new, pairs):
    """Weights of a stock Conv2D -> BatchNormalization pair into a `ConvBNAct` (exact, in training too)."""
    new.kernel.assign(conv.kernel.value)
    for mine, theirs in ((new.gamma, bn.gamma), (new.beta, bn.beta), (new.moving_variance, bn.moving_variance)):
        mine.assign(theirs.value)
    mean = to_numpy(bn.moving_mean)
    if conv.use_bias:
        # Batch norm subtracts the batch mean in training, so the conv bias only shifts the
        # moving mean; keeping the moving mean minus the bias is exact, in training too.
        mean = (mean.astype("float64") - to_numpy(conv.bias).astype("float64")).astype("float32")
    new.moving_mean.assign(mean)
    for a, b in ((conv.kernel, new.kernel), (bn.gamma, new.gamma), (bn.beta, new.beta)):
        _check_copied(a, b)
        pairs.append((a, b))


def copy_folded(conv, bn, new):
    """`conv`'s kernel and bias with inference-mode `bn` folded in, into `new` (a conv with a bias)."""
    kernel, bias = fold_batch_norm(
        conv.kernel, conv.bias if conv.use_bias else None, bn.gamma if bn.scale else None,
        bn.beta if bn.center else None, bn.moving_mean, bn.moving_variance, bn.epsilon,
    )
    new.kernel.assign(kernel)
    new.bias.assign(bias)
