"""multi_tensor_adam: Adam for a list of variables in one op (``TfmetalExt>MultiTensorAdam``)."""

from __future__ import annotations

import functools

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

_OP_NAME = fusion.MULTI_TENSOR_ADAM_OP

# An update op (no outputs), like ResourceApplyAdam.
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
    Metal kernel needs TF's experimental resource-variable C API, which the
    TF 2.19 framework library exports and the 2.21 Linux wheel does not; it
    registers only where those symbols resolve at load time. Where the op has
    no kernel for the variables' device (CUDA, or Metal without that API),
    without a compiler, with ``TFMETAL_EXT_REFERENCE_OPS=1``, or while
    ``tfmetal_ext.configure(avoid_fusions=["multi_tensor_adam"])`` is in
    force, the same update runs as one ``ResourceApplyAdam`` per variable.

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

    Returns:
        The update op in graph mode; None when executing eagerly. An empty
        list of variables is a no-op.

    Raises:
        ValueError: lists of different lengths, mixed or non-float dtypes,
            variables on different devices, or shapes that differ statically.
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
    lists = {key: _as_list(value, key) for key, value in lists.items()}
    variables, grads = lists["variables"], lists["grads"]
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"`{'`, `'.join(lists)}` must have the same length. Received: "
            + ", ".join(f"len({k})={n}" for k, n in lengths.items())
        )
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op(name=name)

    var_handles = [_handle(v, "variables", i) for i, v in enumerate(variables)]
    dtype = tf.as_dtype(var_handles[0][1])
    if dtype not in _common.FLOAT_DTYPES:
        raise ValueError(
            f"`variables` must be float32, float16 or bfloat16. Received: variables[0].dtype={dtype.name}"
        )
    handles = {"variables": var_handles}
    for key in ("ms", "vs", "vhats"):
        if key in lists:
            handles[key] = [_handle(v, key, i) for i, v in enumerate(lists[key])]
    for key, hs in handles.items():
        for i, (_, dt, _) in enumerate(hs):
            if tf.as_dtype(dt) != dtype:
                raise ValueError(
                    f"All variables and slots of one call must share one dtype (group them by dtype). "
                    f"Received: {key}[{i}].dtype={tf.as_dtype(dt).name} (variables[0].dtype={dtype.name})"
                )
    _check_distinct(lists, handles)
    devices = {_device_name(d) for _, _, d in var_handles} - {""}
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
            shape = _static_shape(lists[key][i])
            if shape is not None and not g.shape.is_compatible_with(shape):
                raise ValueError(
                    f"Each gradient must have its variable's shape. Received: grads[{i}].shape={tuple(g.shape)}, "
                    f"{key}[{i}].shape={tuple(shape)}"
                )

    def scalar(value):
        return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)

    scalars = [scalar(x) for x in (lr, beta_1, beta_2, epsilon, beta_1_power, beta_2_power)]
    decay = [] if weight_decay_rate is None else [scalar(weight_decay_rate)]
    args = (
        [h for h, _, _ in handles["variables"]],
        [h for h, _, _ in handles["ms"]],
        [h for h, _, _ in handles["vs"]],
        [h for h, _, _ in handles.get("vhats", [])],
        grad_tensors,
    )
    lib = None if _common.avoided(_OP_NAME) else _common.library()
    if lib is None or not _has_kernel(next(iter(devices), "")):
        # Per-variable ops: every run-time shape check runs before the first
        # update, so a bad gradient leaves every variable untouched (the
        # kernel checks all its inputs before writing, too).
        with tf.control_dependencies(_runtime_shape_checks(lists, handles, grad_tensors)):
            return _reference.multi_tensor_adam(*args, *scalars, decay[0] if decay else None, dtype=dtype, name=name)
    return lib.tfmetal_ext_multi_tensor_adam(*args, *scalars, decay, name=name)


def _check_distinct(lists, handles):
    """Each variable and slot at most once in a call, as the kernel requires
    (one update of a variable would read another's half-written values)."""
    seen = {}
    for key, hs in handles.items():
        for i, variable in enumerate(lists[key]):
            var = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)
            ident = id(var)
            if ident in seen:
                raise ValueError(
                    f"A variable may appear only once among `variables` and their slots. "
                    f"Received: {key}[{i}] is also {seen[ident]} ({getattr(var, 'name', var)!s})"
                )
            seen[ident] = f"{key}[{i}]"


def _runtime_shape_checks(lists, handles, grads, op="multi_tensor_adam"):
    """Assert ops for the shapes static shapes leave open, empty when all are known
    (`op` names the function in their messages)."""
    checks = []
    for i, g in enumerate(grads):
        want = _static_shape(lists["variables"][i])
        if want is not None and want.is_fully_defined() and g.shape.is_fully_defined() and all(
            (_static_shape(lists[key][i]) or tf.TensorShape(None)).is_fully_defined() for key in handles
        ):
            continue  # every shape known, and compatible (checked above): equal
        var_shape = tf.raw_ops.VariableShape(input=handles["variables"][i][0], out_type=tf.int64)
        checks.append(tf.debugging.assert_equal(
            tf.shape(g, out_type=tf.int64), var_shape,
            message=f"{op}: grads[{i}] must have the shape of variables[{i}]"))
        for key in handles:
            if key != "variables":
                checks.append(tf.debugging.assert_equal(
                    tf.raw_ops.VariableShape(input=handles[key][i][0], out_type=tf.int64), var_shape,
                    message=f"{op}: {key}[{i}] must have the shape of variables[{i}]"))
    return [c for c in checks if c is not None]


def _as_list(value, name):
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"`{name}` must be a list or tuple. Received: {name}={value!r}")


def _handle(variable, key, index):
    """(resource handle, dtype, device) of a tf.Variable or Keras variable."""
    var = getattr(variable, "value", None) if not isinstance(variable, tf.Variable) else variable
    if var is None or not hasattr(var, "handle"):
        raise ValueError(
            f"`{key}` must hold tf.Variables or Keras variables. Received: {key}[{index}]={variable!r}"
        )
    handle = var.handle
    # The variable's own device: inside a tf.function the captured handle
    # may not carry one.
    return handle, var.dtype, getattr(var, "device", "") or getattr(handle, "device", "") or ""


def _static_shape(variable):
    var = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)
    shape = getattr(var, "shape", None)
    return tf.TensorShape(shape) if shape is not None else None


def _device_name(device):
    if not device:
        return ""
    spec = tf.DeviceSpec.from_string(device)
    return spec.to_string()


def _has_kernel(device, op_name=_OP_NAME):
    """A kernel of `op_name` is registered for `device`'s type (no device: assume CPU)."""
    device_type = tf.DeviceSpec.from_string(device).device_type if device else "CPU"
    return device_type in _kernel_device_types(op_name)


@functools.lru_cache(maxsize=None)
def _kernel_device_types(op_name=_OP_NAME):
    from tensorflow.python.framework import kernels

    return frozenset(k.device_type for k in kernels.get_registered_kernels_for_op(op_name).kernel)
