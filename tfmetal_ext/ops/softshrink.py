"""softshrink: one op forward (``TfmetalExt>Softshrink``), one op backward."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference


def softshrink(x, lambd=0.5, name=None):
    """Soft shrinkage, elementwise: ``x - lambd`` above ``lambd``, ``x + lambd``
    below ``-lambd``, 0 between.

    One custom op forward and one backward (CPU kernel; Metal kernel on
    Apple GPUs) where `keras.ops.soft_shrink` emits about 8 small ops forward.
    NaN propagates (Keras' version maps NaN to 0); infinities shrink to
    themselves. The gradient is ``dy`` where ``|x| > lambd`` and 0 elsewhere
    (0 at the kinks).

    Args:
        x: a float32, float16 or bfloat16 tensor of any shape.
        lambd: the threshold, a finite float >= 0.
        name: optional op name.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for another dtype or a negative/non-finite `lambd`.

    >>> softshrink(tf.constant([-1.0, 0.2, 2.0]), 0.5).numpy()
    array([-0.5,  0. ,  1.5], dtype=float32)
    """
    lambd = _common.check_nonnegative("lambd", lambd)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    if not uses_kernel():
        return _with_reference_gradient(x, lambd)
    return _common.library().tfmetal_ext_softshrink(x, lambd=lambd, name=name)


SOFTSHRINK_OP = fusion.SOFTSHRINK_OP


def uses_kernel() -> bool:
    """`softshrink` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(SOFTSHRINK_OP)


def _with_reference_gradient(x, lambd):
    if _common.portable():
        return _reference.softshrink(x, lambd)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            return _reference.softshrink_grad(dy, x, lambd)

        return _reference.softshrink(x, lambd), grad

    return fn(x)


@tf.RegisterGradient(SOFTSHRINK_OP)
def _softshrink_grad(op, dy):
    lib = _common.library() or _loaded_library()
    return lib.tfmetal_ext_softshrink_grad(dy, op.inputs[0], lambd=op.get_attr("lambd"))


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
