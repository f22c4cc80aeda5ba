"""multi_tensor_adam: Adam for a list of variables in one op (``TfmetalExt>MultiTensorAdam``)."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference
from tfmetal_ext.ops import _multi_tensor as _mt

_OP_NAME = fusion.MULTI_TENSOR_ADAM_OP

# An update op (its only output, with a loss scale, is a flag), like ResourceApplyAdam.
tf.no_gradient(_OP_NAME)


# Plain Python over lists, no tensor-dependent control flow: AutoGraph has
# nothing to convert, and converting would descend into the library loader.
@tf.autograph.experimental.do_not_convert
def multi_tensor_adam(
    variables,
    ms,
    vs,
    grads,
    lr,
    beta_1,
    beta_2,
    epsilon,
    beta_1_power,
    beta_2_power,
    vhats=None,
    weight_decay_rate=None,
    name=None,
    *,
    scale=None,
):
    """Adam update of N variables and their slots in one op, apex-style.

    Elementwise, for every variable ``i``, in the variables' dtype and in the
    operation order of ``tf.raw_ops.ResourceApplyAdam`` (so results are
    bitwise identical to one ``ResourceApplyAdam`` per variable, for
    float32, float16 and bfloat16)::

        alpha = lr * sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m[i] += (grads[i] - m[i]) * (1 - beta_1)
        v[i] += (grads[i] * grads[i] - v[i]) * (1 - beta_2)
        variables[i] -= m[i] * alpha / (sqrt(v[i]) + epsilon)

    With `vhats` (AMSGrad, as ``ResourceApplyAdamWithAmsgrad``),
    ``vhats[i] = max(vhats[i], v[i])`` replaces ``v[i]`` in the last line.
    With `weight_decay_rate`, ``variables[i] -= variables[i] * weight_decay_rate``
    runs first (decoupled weight decay, as ``ResourceApplyGradientDescent``
    with ``delta = variables[i]``).

    One ``TfmetalExt>MultiTensorAdam`` op. Its CPU kernel spreads the
    elements of all variables over the intra-op thread pool (TF's per-variable
    CPU kernel shards even tiny variables across all threads); its Metal
    kernel encodes one dispatch per variable in a single compute encoder. The
    Metal kernel reaches the variables through TF's C++ kernel API
    (``custom_ops/include/tfmetal/resource_variables.h``, shared with the CPU
    kernel), which TF 2.19 and 2.21 both export, so it registers on both
    Metal backends (not the experimental C API, which TF 2.20/2.21 lack).
    Where the op has no kernel for the variables' device (CUDA),
    without a compiler, with ``TFMETAL_EXT_REFERENCE_OPS=1``, or while
    ``tfmetal_ext.configure(avoid_fusions=["multi_tensor_adam"])`` is in
    force, the same update runs as one ``ResourceApplyAdam`` per variable.

    With `scale` (loss scaling, as under `keras.optimizers.LossScaleOptimizer`),
    `grads` are the loss-scaled gradients. The op first checks every element
    of every gradient; if one is NaN or infinite it writes nothing at all (no
    variable, slot or decay) and returns True; else it runs the update above
    with ``grads[i] / scale`` (divided in float32 and rounded to the dtype,
    the operation Keras' LossScaleOptimizer unscales with) and returns False.
    PyTorch's fused Adam takes the same pair (``grad_scale`` / ``found_inf``).

    This is an update, not a differentiable function: it has no gradient.

    Args:
        variables: the N variables to update (`tf.Variable`s or Keras
            variables), all of one float dtype (float32, float16 or bfloat16)
            and on one device; group them by dtype first.
        ms: the N first-moment variables, same shapes and dtype.
        vs: the N second-moment variables, same shapes and dtype.
        grads: the N gradients, dense tensors (`tf.IndexedSlices` are
            densified) of the variables' shapes and dtype.
        lr, beta_1, beta_2, epsilon, beta_1_power, beta_2_power: scalars,
            converted to the variables' dtype.
        vhats: optional N maximum-velocity variables (AMSGrad).
        weight_decay_rate: optional scalar ``lr * weight_decay``.
        name: optional op name.
        scale: (keyword-only) optional loss scale, a float32 scalar (a
            number, tensor or variable) the gradients were multiplied by.

    Returns:
        Without `scale`: the update op in graph mode; None when executing
        eagerly. With `scale`: ``found_non_finite``, a bool scalar tensor
        (True: nothing was updated). An empty list of variables is a no-op
        (and, with `scale`, returns False).

    Raises:
        ValueError: lists of different lengths, mixed or non-float dtypes,
            variables on different devices, shapes that differ statically,
            or a `scale` that is not a real scalar.
        tf.errors.InvalidArgumentError: shapes that differ at run time, or a
            variable passed twice.

    >>> w = tf.Variable([1.0, 2.0]); m = tf.Variable([0.0, 0.0]); v = tf.Variable([0.0, 0.0])
    >>> multi_tensor_adam([w], [m], [v], [tf.constant([0.5, -0.5])], 0.1, 0.9, 0.999, 1e-7, 0.9, 0.999)
    >>> w.numpy().round(4)
    array([0.9, 2.1], dtype=float32)
    """
    lists = {"variables": variables, "ms": ms, "vs": vs, "grads": grads}
    if vhats is not None:
        lists["vhats"] = vhats
    lists = _mt.check_lists(lists)
    scale = _mt.loss_scale(scale)
    if not lists["variables"]:
        return _mt.no_op(name, scale)
    call = _mt.prepare(lists)
    scalars = [call.scalar(x) for x in (lr, beta_1, beta_2, epsilon, beta_1_power, beta_2_power)]
    decay = [] if weight_decay_rate is None else [call.scalar(weight_decay_rate)]
    lib = None if _common.op_avoided(_OP_NAME) else _common.library()
    if lib is None or not _mt.has_kernel(call.device, _OP_NAME):
        # Per-variable ops, all-or-nothing (`_multi_tensor.fallback_guards`).
        with tf.control_dependencies(_mt.fallback_guards(call, op="multi_tensor_adam")):
            def update(grads):
                return _reference.multi_tensor_adam(*_args(call, grads), *scalars, decay[0] if decay else None,
                                                    dtype=call.dtype, name=name)

            return _mt.reference_update(call, scale, update)
    result = lib.tfmetal_ext_multi_tensor_adam(*_args(call, call.grads), *scalars, decay,
                                               [] if scale is None else [scale], name=name)
    return _mt.finish(result, scale)


def _args(call, grads):
    return [call.handle_list(k) for k in ("variables", "ms", "vs", "vhats")] + [grads]
