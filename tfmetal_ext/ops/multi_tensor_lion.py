"""multi_tensor_lion: Lion for a list of variables in one op (``TfmetalExt>MultiTensorLion``)."""

from __future__ import annotations

import importlib

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

# The list, handle and shape helpers shared with multi_tensor_adam (the module:
# the package attribute of that name is the function).
_mta = importlib.import_module("tfmetal_ext.ops.multi_tensor_adam")

_OP_NAME = fusion.MULTI_TENSOR_LION_OP

# An update op (no outputs), like the Adam one.
tf.no_gradient(_OP_NAME)


# Plain Python over lists, no tensor-dependent control flow: AutoGraph has
# nothing to convert, and converting would descend into the library loader.
@tf.autograph.experimental.do_not_convert
def multi_tensor_lion(variables, ms, grads, lr, beta_1, beta_2, weight_decay_rate=None, name=None):
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
    `multi_tensor_adam`'s, registers only where TF exports its experimental
    resource-variable C API (TF 2.19 yes, the 2.21 Linux wheel no). Where the
    op has no kernel for the variables' device, without a compiler, with
    ``TFMETAL_EXT_REFERENCE_OPS=1``, or while
    ``tfmetal_ext.configure(avoid_fusions=["multi_tensor_lion"])`` is in
    force, the same update runs as Keras' own ops, per variable.

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

    Returns:
        The update op in graph mode; None when executing eagerly. An empty
        list of variables is a no-op.

    Raises:
        ValueError: lists of different lengths, mixed or non-float dtypes,
            variables on different devices, a variable passed twice, or
            shapes that differ statically.
        tf.errors.InvalidArgumentError: shapes that differ at run time, or a
            variable passed twice to the raw op.

    >>> w = tf.Variable([1.0, 2.0]); m = tf.Variable([0.0, 0.0])
    >>> multi_tensor_lion([w], [m], [tf.constant([0.5, -0.5])], 0.1, 0.9, 0.99)
    >>> w.numpy().round(4)
    array([0.9, 2.1], dtype=float32)
    """
    lists = {"variables": variables, "ms": ms, "grads": grads}
    lists = {key: _mta._as_list(value, key) for key, value in lists.items()}
    variables, grads = lists["variables"], lists["grads"]
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"`{'`, `'.join(lists)}` must have the same length. Received: "
            + ", ".join(f"len({k})={n}" for k, n in lengths.items())
        )
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op(name=name)

    var_handles = [_mta._handle(v, "variables", i) for i, v in enumerate(variables)]
    dtype = tf.as_dtype(var_handles[0][1])
    if dtype not in _common.FLOAT_DTYPES:
        raise ValueError(
            f"`variables` must be float32, float16 or bfloat16. Received: variables[0].dtype={dtype.name}"
        )
    handles = {"variables": var_handles, "ms": [_mta._handle(v, "ms", i) for i, v in enumerate(lists["ms"])]}
    for key, hs in handles.items():
        for i, (_, dt, _) in enumerate(hs):
            if tf.as_dtype(dt) != dtype:
                raise ValueError(
                    f"All variables and slots of one call must share one dtype (group them by dtype). "
                    f"Received: {key}[{i}].dtype={tf.as_dtype(dt).name} (variables[0].dtype={dtype.name})"
                )
    _mta._check_distinct({k: lists[k] for k in handles}, handles)
    devices = {_mta._device_name(d) for _, _, d in var_handles} - {""}
    if len(devices) > 1:
        raise ValueError(f"All variables must be on one device. Received: devices={sorted(devices)}")

    grad_tensors = []
    for i, g in enumerate(grads):
        g = tf.convert_to_tensor(g)  # densifies tf.IndexedSlices
        if g.dtype != dtype:
            raise ValueError(
                f"`grads` must have the variables' dtype. Received: grads[{i}].dtype={g.dtype.name} "
                f"(variables[{i}].dtype={dtype.name})"
            )
        grad_tensors.append(g)
        for key in handles:
            shape = _mta._static_shape(lists[key][i])
            if shape is not None and not g.shape.is_compatible_with(shape):
                raise ValueError(
                    f"Each gradient must have its variable's shape. Received: grads[{i}].shape={tuple(g.shape)}, "
                    f"{key}[{i}].shape={tuple(shape)}"
                )

    def scalar(value):
        return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)

    scalars = [scalar(x) for x in (lr, beta_1, beta_2)]
    decay = [] if weight_decay_rate is None else [scalar(weight_decay_rate)]
    var_list = [h for h, _, _ in handles["variables"]]
    m_list = [h for h, _, _ in handles["ms"]]
    lib = None if _common.avoided(_OP_NAME) else _common.library()
    if lib is None or not _mta._has_kernel(next(iter(devices), ""), _OP_NAME):
        # Per-variable ops: every run-time shape check runs before the first
        # update, so a bad gradient leaves every variable untouched (the
        # kernel checks all its inputs before writing, too). Where the
        # variable's shape is static, the gradient goes through EnsureShape:
        # inside a tf.function grappler's constant folding can fold an Assert
        # on tf.shape(grad) away (it then takes the shape the consuming update
        # implies), and a decay or another variable's update would be written
        # before the bad update fails; an EnsureShape output it cannot skip.
        ensured = []
        for i, g in enumerate(grad_tensors):
            shape = _mta._static_shape(lists["variables"][i])
            if shape is not None and shape.is_fully_defined() and not g.shape.is_fully_defined():
                grad_tensors[i] = g = tf.ensure_shape(g, shape)
                ensured.append(g)
        checks = _mta._runtime_shape_checks(lists, handles, grad_tensors, op="multi_tensor_lion")
        with tf.control_dependencies(checks + ensured):
            return _reference.multi_tensor_lion(var_list, m_list, grad_tensors, *scalars,
                                                decay[0] if decay else None, dtype=dtype, name=name)
    return lib.tfmetal_ext_multi_tensor_lion(var_list, m_list, grad_tensors, *scalars, decay, name=name)
