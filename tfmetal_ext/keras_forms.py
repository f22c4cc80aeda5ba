"""Keras ops in forms that stay on a GPU, installed at import: the same results, no int32 detour.

Keras' TensorFlow ``argmax`` and ``argmin`` (``keras/src/backend/tensorflow/numpy.py``) guard float
inputs against flush-to-zero: before the reduction they replace -0.0 by ``-tiny`` (the smallest normal
number), so that -0.0 ranks below +0.0 whatever the device does with zeros and subnormals. They find
-0.0 with ``signbit``, which bitcasts the values to int32 and tests the sign bit with int32
``BitwiseAnd`` and ``Less``. TensorFlow keeps int32 tensors in host memory on every GPU, Metal
included, so each argmax (every accuracy metric runs one per step) copies its input's bits to the host
and the mask back: two transfers per step (`tfmetal_ext.inspect.placement_report(...,
predict_for=...)` lists them).

Here the same test is made in floating point: where ``x == 0``, the sign of ``x`` is the sign of
``1 / x`` (-inf for -0.0, +inf for +0.0). Where a device flushes subnormals, a negative subnormal
compares equal to 0 and its reciprocal is -inf, as its sign bit says; elsewhere it is not 0, and
neither form replaces it. So the mask, and the indices, are Keras' for every input (NaN and
infinities included): only the ops differ (``Reciprocal`` and a float ``Less`` instead of ``Bitcast``,
``BitwiseAnd`` and an int32 ``Less``). Integer inputs and scalars run Keras' own functions.

`install()` runs when `tfmetal_ext` is imported, and replaces the two functions in Keras' TensorFlow
backend module (which ``keras.ops.argmax``, the accuracy metrics and layers call through) only when
their source is the form reproduced here (`keras_forms_match`); ``TFMETAL_EXT_KERAS_FORMS=0`` (read at
import) keeps Keras' own. `uninstall()` puts Keras' back.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os

import numpy as np

logger = logging.getLogger("tfmetal_ext")

ENV = "TFMETAL_EXT_KERAS_FORMS"
_MODULE = "keras.src.backend.tensorflow.numpy"
FUNCTIONS = ("argmax", "argmin")
# What each Keras function must contain for its float path to be the one reproduced here.
_FORM = (
    'dtype = dtypes.result_type(dtype, "float32")',
    "is_negative_zero = tf.logical_and(tf.equal(x, 0.0), signbit(x))",
    "-np.finfo(standardize_dtype(x.dtype)).tiny",
    'output_type="int32"',
    "y = _keepdims(_x, y, axis)",
)
_original = {}


def _keras_module():
    try:
        return importlib.import_module(_MODULE)
    except ImportError:
        return None


def keras_forms_match(module=None):
    """Whether Keras' ``argmax`` and ``argmin`` (of `module`, default Keras' TensorFlow backend) have the
    float path reproduced here, read from their source."""
    module = module or _keras_module()
    if module is None or not hasattr(module, "_keepdims"):
        return False
    for name in FUNCTIONS:
        fn = _original.get(name) or getattr(module, name, None)
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            return False
        if not all(fragment in source for fragment in _FORM):
            return False
    return True


def installed():
    """Whether Keras' ``argmax`` / ``argmin`` are the forms of this module."""
    return bool(_original)


def install():
    """Replaces Keras' TensorFlow ``argmax`` / ``argmin`` with the sign test in float; True when installed.

    Idempotent. Does nothing with ``TFMETAL_EXT_KERAS_FORMS=0`` or when
    Keras' functions are not the form reproduced here.
    """
    if installed():
        return True
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no"):
        return False
    module = _keras_module()
    if not keras_forms_match(module):
        logger.info("tfmetal_ext: this Keras' argmax / argmin are not the ones tfmetal_ext.keras_forms "
                    "reproduces: they stay Keras' own")
        return False
    for name in FUNCTIONS:  # Keras' names are TensorFlow's (tf.argmax, tf.argmin)
        _original[name] = getattr(module, name)
        setattr(module, name, _arg_reduce(module, _original[name], name))
    return True


def uninstall():
    """Restores Keras' own ``argmax`` / ``argmin`` (no-op when not installed)."""
    module = _keras_module()
    for name, fn in list(_original.items()):
        setattr(module, name, fn)
        del _original[name]


def original(name):
    """Keras' own function `name` (``"argmax"`` / ``"argmin"``), installed or not."""
    return _original.get(name) or getattr(_keras_module(), name)


def negative_zero(x):
    """Where `x` (float) is -0.0, as Keras' ``x == 0 and signbit(x)``, without leaving floating point."""
    import tensorflow as tf

    zero = tf.zeros([], x.dtype)
    return tf.logical_and(tf.equal(x, zero), tf.less(tf.math.reciprocal(x), zero))


def _arg_reduce(module, keras_fn, tf_reduce):
    import tensorflow as tf

    reduce_fn = getattr(tf, tf_reduce)

    def arg_reduce(x, axis=None, keepdims=False):
        x = module.convert_to_tensor(x)
        dtype = module.standardize_dtype(x.dtype)
        if "float" not in dtype or x.ndim == 0:
            return keras_fn(x, axis=axis, keepdims=keepdims)  # no sign test on this path
        x = module.cast(x, module.dtypes.result_type(dtype, "float32"))
        tiny = np.finfo(module.standardize_dtype(x.dtype)).tiny
        x = tf.where(negative_zero(x), -tiny, x)
        shaped = x
        if axis is None:
            x = tf.reshape(x, [-1])
        y = reduce_fn(x, axis=axis, output_type="int32")
        return module._keepdims(shaped, y, axis) if keepdims else y  # noqa: SLF001 - Keras' own helper

    arg_reduce.__name__ = arg_reduce.__qualname__ = keras_fn.__name__
    arg_reduce.__doc__ = (f"Keras' TensorFlow `{keras_fn.__name__}`, its -0.0 test made in float "
                          "(tfmetal_ext.keras_forms): the same indices.")
    arg_reduce.__wrapped_keras__ = keras_fn
    return arg_reduce
