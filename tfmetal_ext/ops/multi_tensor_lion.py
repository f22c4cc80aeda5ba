"""multi_tensor_lion: Lion for a list of variables in one op (``TfmetalExt>MultiTensorLion``)."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference
from tfmetal_ext.ops import _multi_tensor as _mt

_OP_NAME = fusion.MULTI_TENSOR_LION_OP

# An update op (its only output, with a loss scale, is a flag), like the Adam one.
tf.no_gradient(_OP_NAME)


# Plain Python over lists, no tensor-dependent control flow: AutoGraph has
# nothing to convert, and converting would descend into the library loader.
@tf.autograph.experimental.do_not_convert
def multi_tensor_lion(variables, ms, grads, lr, beta_1, beta_2, weight_decay_rate=None, name=None, *, scale=None):
    """Lion update of N variables and their momentums in one op.

    Elementwise, for every variable ``i``, in the variables' dtype and in the
    operation order of ``keras.optimizers.Lion`` (each operation rounded to
    the dtype, so float32, float16 and bfloat16 results are bitwise those of
    Keras' update)::

        c = ms[i] * beta_1 + grads[i] * (1 - beta_1)
        variables[i] -= lr * sign(c)
        ms[i] = ms[i] * beta_2 + grads[i] * (1 - beta_2)

    ``sign`` is ``tf.sign`` (0 for a zero of either sign, NaN for NaN). With
    `weight_decay_rate`, ``variables[i] -= variables[i] * weight_decay_rate``
    runs first (decoupled weight decay; pass ``lr * weight_decay``).

    One ``TfmetalExt>MultiTensorLion`` op. Its CPU kernel spreads the elements
    of all variables over the intra-op thread pool; its Metal kernel encodes
    one dispatch per variable in a single compute encoder and, like
    `multi_tensor_adam`'s, reaches the variables through TF's C++ kernel API
    (registered on TF 2.19 and 2.21 alike). Where the
    op has no kernel for the variables' device, without a compiler, with
    ``TFMETAL_EXT_REFERENCE_OPS=1``, or while
    ``tfmetal_ext.configure(avoid_fusions=["multi_tensor_lion"])`` is in
    force, the same update runs as Keras' own ops, per variable.

    With `scale` (loss scaling), `grads` are the loss-scaled gradients: if an
    element of one is NaN or infinite nothing is written and the result is
    True, else the update runs with ``grads[i] / scale`` (float32 division,
    rounded to the dtype) and the result is False, as for
    `multi_tensor_adam`.

    This is an update, not a differentiable function: it has no gradient.

    Args:
        variables: the N variables to update (`tf.Variable`s or Keras
            variables), all of one float dtype (float32, float16 or bfloat16)
            and on one device; group them by dtype first.
        ms: the N momentum variables, same shapes and dtype.
        grads: the N gradients, dense tensors (`tf.IndexedSlices` are
            densified) of the variables' shapes and dtype.
        lr, beta_1, beta_2: scalars, converted to the variables' dtype.
        weight_decay_rate: optional scalar ``lr * weight_decay``.
        name: optional op name.
        scale: (keyword-only) optional loss scale, a float32 scalar.

    Returns:
        Without `scale`: the update op in graph mode; None when executing
        eagerly. With `scale`: ``found_non_finite``, a bool scalar tensor
        (True: nothing was updated). An empty list of variables is a no-op.

    Raises:
        ValueError: lists of different lengths, mixed or non-float dtypes,
            variables on different devices, a variable passed twice,
            shapes that differ statically, or a `scale` that is not a real
            scalar.
        tf.errors.InvalidArgumentError: shapes that differ at run time, or a
            variable passed twice to the raw op.

    >>> w = tf.Variable([1.0, 2.0]); m = tf.Variable([0.0, 0.0])
    >>> multi_tensor_lion([w], [m], [tf.constant([0.5, -0.5])], 0.1, 0.9, 0.99)
    >>> w.numpy().round(4)
    array([0.9, 2.1], dtype=float32)
    """
    lists = {"variables": variables, "ms": ms, "grads": grads}
    lists = _mt.check_lists(lists)
    scale = _mt.loss_scale(scale)
    if not lists["variables"]:
        return _mt.no_op(name, scale)
    call = _mt.prepare(lists)
    scalars = [call.scalar(x) for x in (lr, beta_1, beta_2)]
    decay = [] if weight_decay_rate is None else [call.scalar(weight_decay_rate)]
    handles = (call.handle_list("variables"), call.handle_list("ms"))
    lib = None if _common.op_avoided(_OP_NAME) else _common.library()
    if lib is None or not _mt.has_kernel(call.device, _OP_NAME):
        # Per-variable ops, all-or-nothing (`_multi_tensor.fallback_guards`).
        with tf.control_dependencies(_mt.fallback_guards(call, op="multi_tensor_lion")):
            def update(grads):
                return _reference.multi_tensor_lion(*handles, grads, *scalars, decay[0] if decay else None,
                                                    dtype=call.dtype, name=name)

            return _mt.reference_update(call, scale, update)
    result = lib.tfmetal_ext_multi_tensor_lion(*handles, call.grads, *scalars, decay,
                                               [] if scale is None else [scale], name=name)
    return _mt.finish(result, scale)
