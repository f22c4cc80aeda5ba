"""dropout: one op forward (``TfmetalExt>Dropout``), one op backward that regenerates the mask."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common

DROPOUT_OP = fusion.DROPOUT_OP
DROPOUT_GRAD_OP = fusion.DROPOUT_GRAD_OP

# StatelessRandomUniformV2's algorithm id for Philox (the counter-based generator the kernels implement).
PHILOX = 1


@tf.autograph.experimental.do_not_convert  # plain graph building; also keeps autograph out of the loader
def dropout(x, rate, seed, name=None, noise_shape=None):
    """Dropout with a counter-based mask: ``x / (1 - rate)`` where kept, 0 where dropped.

    Each element is dropped with probability `rate`, by a mask drawn from
    Philox-4x32-10 keyed by `seed`: the mask of
    ``tf.nn.experimental.stateless_dropout(x, rate, seed)`` (what
    `keras.layers.Dropout` runs on TensorFlow), bit for bit, so a model gives
    the same numbers with either. One custom op forward
    (``TfmetalExt>Dropout``) and one backward (``TfmetalExt>DropoutGrad``),
    which draws the mask again from the seed instead of storing it; where
    stock dropout runs five ops and keeps a boolean mask per element for the
    backward pass. CPU kernel here; a Metal kernel on Apple GPUs.

    A dropped element is +0 whatever its value (NaN and infinities
    included); a kept one is ``x * scale`` rounded once to `x`'s dtype, with
    `rate` and ``scale = 1 / (1 - rate)`` rounded to that dtype as TensorFlow
    rounds them (so float16 and bfloat16 masks use 10 and 7 random bits, as
    TensorFlow's do). The gradient is ``dy * scale`` where kept, 0 elsewhere.
    ``rate=0`` returns `x` itself, as TensorFlow does.

    With a `noise_shape` the mask has that shape and broadcasts over `x`, as
    ``stateless_dropout(x, rate, seed, noise_shape)`` and Keras' Dropout
    (whose ``noise_shape`` this is: None entries take `x`'s dimension at that
    position) broadcast theirs: an EfficientNet block's drop-connect
    ``(None, 1, 1, 1)``, a spatial dropout's ``(batch, 1, 1, channels)``. The
    op then draws one mask element per noise element (the kept ones are the
    scale, the dropped ones +0), and ``x * mask`` is selected where kept:
    the stock numbers again, forward and backward, with the mask of the
    noise shape (one element per sample, say) kept for the backward pass.

    Args:
        x: a float32, float16 or bfloat16 tensor of any shape.
        rate: the probability of dropping an element, a Python float in
            [0, 1).
        seed: the stateless seed: a tensor (or list) of 2 int32 or int64
            values, as ``tf.random.stateless_*`` take; or a
            `keras.random.SeedGenerator`, drawn and reduced to int32 as
            `keras.random.dropout` does on TensorFlow (so
            `keras.utils.set_random_seed` reproduces a run).
        name: optional op name.
        noise_shape: None (a mask element per element of `x`), or a list or
            tuple of positive ints and None, no longer than `x`'s rank, that
            broadcasts against `x`'s shape as Keras broadcasts it.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for another dtype of `x`, a `rate` outside [0, 1), a
            seed that is not 2 int32/int64 values, or a `noise_shape` that is
            not one (a known dimension that neither is 1 nor matches `x`'s).

    >>> y = dropout(tf.ones([2, 4]), 0.5, seed=[1, 2])
    >>> sorted(set(y.numpy().ravel().tolist())) in ([0.0, 2.0], [0.0], [2.0])
    True
    """
    import keras

    rate = check_rate(rate)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    shape = concrete_noise_shape(x, noise_shape)
    if rate == 0.0:  # a SeedGenerator is not drawn, as keras.random.dropout does not draw it
        if not isinstance(seed, keras.random.SeedGenerator):
            seed_tensor(seed)  # checked all the same
        return x
    seed = seed_tensor(seed)
    threshold, scale = dtype_constants(rate, x.dtype)
    if not uses_kernel():
        return reference_dropout(x, seed, threshold, scale, shape)
    lib = _common.library()
    if shape is None:
        return lib.tfmetal_ext_dropout(x, seed, rate=threshold, scale=scale, name=name)
    # The op on ones of the noise shape: `scale` (exact: 1 * scale) where kept, +0 where dropped. Nothing
    # differentiates through it (its input is a constant). Then TensorFlow's broadcast select.
    mask = lib.tfmetal_ext_dropout(tf.ones(shape, x.dtype), seed, rate=threshold, scale=scale)
    return tf.where(tf.not_equal(mask, tf.zeros([], x.dtype)), x * mask, tf.zeros([], x.dtype), name=name)


def concrete_noise_shape(x, noise_shape):
    """The mask's shape for `x`: None for a mask element per element of `x` (`noise_shape` None or all
    None), else a list of ints and scalar int32 tensors (`x`'s dimension where `noise_shape` says None),
    as Keras' TensorFlow backend builds it. Checked against `x`'s static shape."""
    if noise_shape is None:
        return None
    if isinstance(noise_shape, (str, bytes)) or not isinstance(noise_shape, (list, tuple)) or any(
            d is not None and (isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1)
            for d in noise_shape):
        raise ValueError(f"Argument `noise_shape` must be a list or tuple of positive ints and None. "
                         f"Received: noise_shape={noise_shape!r}")
    dims = list(noise_shape)
    rank = x.shape.rank
    if rank is not None:
        if len(dims) > rank:
            raise ValueError(f"Argument `noise_shape` must have at most the rank of `x` ({rank}) entries. "
                             f"Received: noise_shape={noise_shape!r}")
        # Keras fills None from x's dimension at the same position, then TensorFlow broadcasts from the right.
        filled = [x.shape[i] if d is None else int(d) for i, d in enumerate(dims)]
        try:
            tf.broadcast_static_shape(tf.TensorShape(filled), x.shape)
        except ValueError:
            raise ValueError(f"Argument `noise_shape` must broadcast against the shape of `x` {x.shape}. "
                             f"Received: noise_shape={noise_shape!r}") from None
        if len(dims) == rank and all(d is None for d in dims):
            return None
    if not dims:
        return []
    shape = tf.shape(x)
    return [shape[i] if d is None else int(d) for i, d in enumerate(dims)]


def uses_kernel() -> bool:
    """`dropout` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(DROPOUT_OP)


def check_rate(rate):
    """`rate` as a float in [0, 1) (a bool, a string or a tensor is not one)."""
    if isinstance(rate, (bool, str, bytes)) or not isinstance(rate, (int, float, np.floating, np.integer)):
        raise ValueError(f"Argument `rate` must be a float in [0, 1). Received: rate={rate!r}")
    value = float(rate)
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise ValueError(f"Argument `rate` must be a float in [0, 1). Received: rate={rate!r}")
    return value


def seed_tensor(seed):
    """The seed as the op takes it: 2 int32/int64 values (a SeedGenerator drawn as Keras draws it)."""
    import keras

    if isinstance(seed, keras.random.SeedGenerator):
        return keras_seed(seed)
    if seed is None or isinstance(seed, (bool, int, float, str)):
        raise ValueError(
            "Argument `seed` must be 2 int32 or int64 values (a tensor or a list) or a "
            f"keras.random.SeedGenerator. Received: seed={seed!r}"
        )
    seed = tf.convert_to_tensor(seed)
    if seed.dtype not in (tf.int32, tf.int64):
        raise ValueError(f"Argument `seed` must hold int32 or int64 values. Received: seed.dtype={seed.dtype.name}")
    if seed.shape.rank is not None and seed.shape.as_list() not in ([2], [None]):
        raise ValueError(f"Argument `seed` must have shape [2]. Received: seed.shape={seed.shape}")
    return seed


def keras_seed(seed_generator):
    """The next seed of `seed_generator`, as `keras.random.dropout` takes it on TensorFlow.

    Keras draws the generator's int64 state and reduces it to int32 for the
    stateless ops (``keras/src/backend/tensorflow/random.py``): the same ops
    here, so the same numbers, and ``keras.utils.set_random_seed`` reproduces
    a run.
    """
    seed = tf.convert_to_tensor(seed_generator.next())  # keras.src.random.seed_generator.draw_seed
    if seed.dtype != tf.int32:
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return seed


def dtype_constants(rate, dtype):
    """``(rate, 1 / (1 - rate))`` rounded to `dtype` exactly as TensorFlow's dropout rounds them.

    TensorFlow converts a Python float to a tensor by numpy in a graph (one
    rounding) but through float32 when executing eagerly (two); the kernels
    take both values as float32 attributes, exact for every dtype.
    """
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype

    def rounded(value):  # float16 overflows 1 / (1 - rate) to inf only where the rate rounds to 1
        with np.errstate(over="ignore"):
            source = np.float32(value) if tf.executing_eagerly() else value
            return float(np.asarray(source, np_dtype))

    return rounded(rate), rounded(1.0 / (1.0 - rate))


# ----------------------------------------------------------------------------
# The pure-TF reference (TFMETAL_EXT_REFERENCE_OPS=1, configure(avoid_fusions=["dropout"]),
# no op library, or no kernel for the visible GPU): TensorFlow's own stateless dropout,
# spelled out with the key and counter of the seed, so its mask is the kernels' bit for bit.


def reference_uniform(shape, seed, dtype):
    """The uniform numbers the kernels draw: StatelessRandomUniformV2 (Philox) of the seed's key and counter."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return tf.raw_ops.StatelessRandomUniformV2(shape=shape, key=key, counter=counter, alg=PHILOX, dtype=dtype)


def reference_dropout(x, seed, threshold, scale, noise_shape=None):
    """``where(u >= rate, x * scale, 0)`` in `x`'s dtype; `threshold` and `scale` already rounded to it.
    `noise_shape`: the shape of `u` (`concrete_noise_shape`), broadcast over `x`; None: `x`'s."""
    shape = tf.shape(x) if noise_shape is None else tf.convert_to_tensor(noise_shape, tf.int32)
    keep = reference_uniform(shape, seed, x.dtype) >= tf.constant(threshold, x.dtype)
    return tf.where(keep, x * tf.constant(scale, x.dtype), tf.zeros([], x.dtype))


@tf.RegisterGradient(DROPOUT_OP)
def _dropout_grad(op, dy):
    lib = _common.library() or _loaded_library()
    dx = lib.tfmetal_ext_dropout_grad(dy, op.inputs[1], rate=op.get_attr("rate"), scale=op.get_attr("scale"))
    return dx, None


@tf.RegisterGradient(DROPOUT_GRAD_OP)
def _dropout_grad_grad(op, ddx):
    # DropoutGrad is linear in dy, with the same mask and scale.
    return _dropout_grad(op, ddx)


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
