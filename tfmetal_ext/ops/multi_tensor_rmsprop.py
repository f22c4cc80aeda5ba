"""multi_tensor_rmsprop: RMSprop for a list of variables in one op (``TfmetalExt>MultiTensorRMSprop``)."""

from __future__ import annotations

import numbers

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference
from tfmetal_ext.ops import _multi_tensor as _mt

_OP_NAME = fusion.MULTI_TENSOR_RMSPROP_OP

# An update op (its only output, with a loss scale, is a flag), like the Adam and Lion ones.
tf.no_gradient(_OP_NAME)


# Plain Python over lists, no tensor-dependent control flow: AutoGraph has
# nothing to convert, and converting would descend into the library loader.
@tf.autograph.experimental.do_not_convert
def multi_tensor_rmsprop(variables, velocities, grads, lr, rho, momentum, epsilon, momentums=None,
                         average_gradients=None, weight_decay_rate=None, name=None, *, one_minus_rho=None,
                         scale=None):
    """RMSprop update of N variables and their slots in one op.

    Elementwise, for every variable ``i``, in the variables' dtype and in the
    operation order of ``keras.optimizers.RMSprop`` (each operation rounded
    to the dtype, so float32, float16 and bfloat16 results are bitwise those
    of Keras' update)::

        velocities[i] = rho * velocities[i] + (1 - rho) * grads[i]**2
        # with average_gradients (centered):
        average_gradients[i] = rho * average_gradients[i] + (1 - rho) * grads[i]
        denominator = velocities[i] - average_gradients[i]**2 + epsilon
        # else: denominator = velocities[i] + epsilon
        increment = lr * grads[i] / sqrt(denominator)
        # with momentums:
        momentums[i] = momentum * momentums[i] + increment; variables[i] -= momentums[i]
        # else: variables[i] -= increment

    ``1 - rho`` is formed as Keras forms it: in Python (double precision)
    from a Python `rho`, then rounded to the dtype (float32 ``1 - 0.9`` is
    ``0.1``, not ``1 - 0.9f``); pass `one_minus_rho` to give it yourself (a
    tensor `rho` gets ``1 - rho`` in float64 from its value). `momentum` is
    used only with `momentums`. With `weight_decay_rate`,
    ``variables[i] -= variables[i] * weight_decay_rate`` runs first
    (decoupled weight decay; pass ``lr * weight_decay``).

    One ``TfmetalExt>MultiTensorRMSprop`` op. Its CPU kernel reads and writes
    every element once, spread over the intra-op thread pool; its Metal
    kernel encodes one dispatch per variable in a single compute encoder and,
    like `multi_tensor_adam`'s, reaches the variables through TF's C++ kernel
    API (registered on TF 2.19 and 2.21 alike). Where the op has no kernel
    for the variables' device, without a
    compiler, with ``TFMETAL_EXT_REFERENCE_OPS=1``, or while
    ``tfmetal_ext.configure(avoid_fusions=["multi_tensor_rmsprop"])`` is in
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
        velocities: the N mean-square variables, same shapes and dtype.
        grads: the N gradients, dense tensors (`tf.IndexedSlices` are
            densified) of the variables' shapes and dtype.
        lr, rho, momentum, epsilon: scalars, converted to the variables' dtype.
        momentums: optional N momentum variables (Keras' ``momentum > 0``).
        average_gradients: optional N average-gradient variables (centered).
        weight_decay_rate: optional scalar ``lr * weight_decay``.
        name: optional op name.
        one_minus_rho: (keyword-only) optional scalar ``1 - rho``.
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

    >>> w = tf.Variable([1.0, 2.0]); v = tf.Variable([0.0, 0.0])
    >>> multi_tensor_rmsprop([w], [v], [tf.constant([0.5, -0.5])], 0.1, 0.9, 0.0, 1e-7)
    >>> w.numpy().round(4)
    array([0.6838, 2.3162], dtype=float32)
    """
    lists = {"variables": variables, "velocities": velocities}
    if momentums is not None:
        lists["momentums"] = momentums
    if average_gradients is not None:
        lists["average_gradients"] = average_gradients
    lists["grads"] = grads
    lists = _mt.check_lists(lists)
    scale = _mt.loss_scale(scale)
    if not lists["variables"]:
        return _mt.no_op(name, scale)
    call = _mt.prepare(lists)
    if one_minus_rho is None:
        # Keras' `1 - rho`: computed before the rounding to the dtype.
        if isinstance(rho, numbers.Real) and not isinstance(rho, bool):
            one_minus_rho = 1.0 - float(rho)
        else:
            one_minus_rho = 1.0 - tf.cast(rho, tf.float64)
    scalars = [call.scalar(x) for x in (lr, rho, one_minus_rho, momentum, epsilon)]
    decay = [] if weight_decay_rate is None else [call.scalar(weight_decay_rate)]
    args = [call.handle_list(key) for key in ("variables", "velocities", "momentums", "average_gradients")]
    lib = None if _common.op_avoided(_OP_NAME) else _common.library()
    if lib is None or not _mt.has_kernel(call.device, _OP_NAME):
        # Per-variable ops, all-or-nothing (`_multi_tensor.fallback_guards`).
        with tf.control_dependencies(_mt.fallback_guards(call, op="multi_tensor_rmsprop")):
            def update(grads):
                return _reference.multi_tensor_rmsprop(*args, grads, *scalars, decay[0] if decay else None,
                                                       dtype=call.dtype, name=name)

            return _mt.reference_update(call, scale, update)
    result = _raw_op(lib)(*args, call.grads, *scalars, decay, [] if scale is None else [scale], name=name)
    return _mt.finish(result, scale)


def _raw_op(lib):
    """The generated Python wrapper of the op in `lib` (TF's name for it from the op name)."""
    return lib.tfmetal_ext_multi_tensor_rm_sprop
