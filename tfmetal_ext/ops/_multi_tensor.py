"""What the multi-tensor update wrappers share (`multi_tensor_adam`, `multi_tensor_lion`,
`multi_tensor_rmsprop`): their argument checks, the variables' handles, and the guards of the
per-variable fallback.

Every check here runs before any op is built, so a bad call raises ValueError and writes nothing;
the kernels check the same again at run time (InvalidArgumentError, also before any write).
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from tfmetal_ext.ops import _common


@dataclasses.dataclass
class Prepared:
    """A checked call: its dtype, device, lists, handles (key -> [(handle, dtype, device)]) and dense grads."""

    dtype: tf.DType
    device: str
    lists: dict
    handles: dict
    grads: list

    def scalar(self, value):
        """`value` as a scalar tensor of the call's dtype."""
        return tf.cast(value, self.dtype) if tf.is_tensor(value) else tf.constant(value, self.dtype)

    def handle_list(self, key):
        """The resource handles of list `key` (empty when the call has no such list)."""
        return [h for h, _, _ in self.handles.get(key, [])]


def check_lists(lists):
    """`lists` (key -> list or tuple, "variables" and "grads" among them) as lists of one length."""
    lists = {key: as_list(value, key) for key, value in lists.items()}
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"`{'`, `'.join(lists)}` must have the same length. Received: "
            + ", ".join(f"len({k})={n}" for k, n in lengths.items())
        )
    return lists


def no_op(name, scale=None):
    """What a call with no variables returns: nothing to update, so nothing non-finite found."""
    if scale is not None:
        return tf.constant(False)
    return None if tf.executing_eagerly() else tf.no_op(name=name)


def prepare(lists):
    """Checks a call's variables, slots and gradients (`check_lists`' result, not empty).

    Raises ValueError for a non-float or mixed dtype, a variable or slot passed twice, variables on
    different devices, a gradient of another dtype, or shapes that differ statically.
    """
    keys = [k for k in lists if k != "grads"]
    var_handles = [handle(v, "variables", i) for i, v in enumerate(lists["variables"])]
    dtype = tf.as_dtype(var_handles[0][1])
    if dtype not in _common.FLOAT_DTYPES:
        raise ValueError(
            f"`variables` must be float32, float16 or bfloat16. Received: variables[0].dtype={dtype.name}"
        )
    handles = {"variables": var_handles}
    for key in keys[1:]:
        handles[key] = [handle(v, key, i) for i, v in enumerate(lists[key])]
    for key, hs in handles.items():
        for i, (_, dt, _) in enumerate(hs):
            if tf.as_dtype(dt) != dtype:
                raise ValueError(
                    f"All variables and slots of one call must share one dtype (group them by dtype). "
                    f"Received: {key}[{i}].dtype={tf.as_dtype(dt).name} (variables[0].dtype={dtype.name})"
                )
    check_distinct(lists, handles)
    devices = {device_name(d) for _, _, d in var_handles} - {""}
    if len(devices) > 1:
        raise ValueError(f"All variables must be on one device. Received: devices={sorted(devices)}")

    grads = []
    for i, g in enumerate(lists["grads"]):
        g = tf.convert_to_tensor(g)  # densifies tf.IndexedSlices
        if g.dtype != dtype:
            raise ValueError(
                f"`grads` must have the variables' dtype. Received: grads[{i}].dtype={g.dtype.name} "
                f"(variables[{i}].dtype={dtype.name})"
            )
        grads.append(g)
        for key in handles:
            shape = static_shape(lists[key][i])
            if shape is not None and not g.shape.is_compatible_with(shape):
                raise ValueError(
                    f"Each gradient must have its variable's shape. Received: grads[{i}].shape={tuple(g.shape)}, "
                    f"{key}[{i}].shape={tuple(shape)}"
                )
    return Prepared(dtype, next(iter(devices), ""), lists, handles, grads)


def fallback_guards(prepared, op):
    """Makes the per-variable fallback all-or-nothing; returns the ops it must depend on.

    Every run-time shape check runs before the first update, so a bad gradient leaves every
    variable untouched (the kernels check all their inputs before writing, too). Where a
    variable's shape is static, its gradient goes through EnsureShape (`prepared.grads` is
    updated): inside a tf.function grappler's constant folding can fold an Assert on
    ``tf.shape(grad)`` away (it takes the shape the consuming update implies), and a decay or
    another variable's update would be written before the bad update fails. `op` names the
    function in the messages.
    """
    ensured = []
    for i, g in enumerate(prepared.grads):
        shape = static_shape(prepared.lists["variables"][i])
        if shape is not None and shape.is_fully_defined() and not g.shape.is_fully_defined():
            prepared.grads[i] = g = tf.ensure_shape(g, shape, name=f"{op}_grads_{i}_takes_the_shape_of_variables_{i}")
            ensured.append(g)
    return runtime_shape_checks(prepared.lists, prepared.handles, prepared.grads, op=op) + ensured


def loss_scale(scale):
    """`scale` (a Python number, tensor or variable) as a float32 scalar tensor; None for None.

    Raises ValueError for a bool, a non-numeric dtype or a shape that is not a scalar.
    """
    if scale is None:
        return None
    if isinstance(scale, bool):
        raise ValueError(f"`scale` must be a float32 scalar. Received: scale={scale!r}")
    value = tf.convert_to_tensor(scale)  # reads a variable
    if value.dtype != tf.float32:
        if not (value.dtype.is_floating or value.dtype.is_integer):
            raise ValueError(f"`scale` must be a float32 scalar. Received: scale.dtype={value.dtype.name}")
        value = tf.cast(value, tf.float32)
    if value.shape.rank is not None and value.shape.rank != 0:
        raise ValueError(f"`scale` must be a float32 scalar. Received: scale.shape={tuple(value.shape)}")
    return value


def reference_update(call, scale, update):
    """The per-variable fallback `update(grads)`, inside the loss scaling when there is a `scale`."""
    if scale is None:
        return update(call.grads)
    from tfmetal_ext.ops import _reference

    return _reference.loss_scaled_update(call.grads, scale, call.dtype, update)


def finish(result, scale):
    """What a wrapper returns from the raw op's `result`: the flag with a scale, else the op (None eagerly)."""
    if scale is not None:
        return result[0]
    return None if tf.executing_eagerly() else result


def check_distinct(lists, handles):
    """Each variable and slot at most once in a call, as the kernels require
    (one update of a variable would read another's half-written values)."""
    seen = {}
    for key in handles:
        for i, variable in enumerate(lists[key]):
            var = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)
            ident = id(var)
            if ident in seen:
                raise ValueError(
                    f"A variable may appear only once among `variables` and their slots. "
                    f"Received: {key}[{i}] is also {seen[ident]} ({getattr(var, 'name', var)!s})"
                )
            seen[ident] = f"{key}[{i}]"


def runtime_shape_checks(lists, handles, grads, op):
    """Assert ops for the shapes static shapes leave open, empty when all are known
    (`op` names the function in their messages)."""
    checks = []
    for i, g in enumerate(grads):
        want = static_shape(lists["variables"][i])
        if want is not None and want.is_fully_defined() and g.shape.is_fully_defined() and all(
            (static_shape(lists[key][i]) or tf.TensorShape(None)).is_fully_defined() for key in handles
        ):
            continue  # every shape known, and compatible (checked by `prepare`): equal
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


def as_list(value, name):
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"`{name}` must be a list or tuple. Received: {name}={value!r}")


def handle(variable, key, index):
    """(resource handle, dtype, device) of a tf.Variable or Keras variable."""
    var = getattr(variable, "value", None) if not isinstance(variable, tf.Variable) else variable
    if var is None or not hasattr(var, "handle"):
        raise ValueError(
            f"`{key}` must hold tf.Variables or Keras variables. Received: {key}[{index}]={variable!r}"
        )
    h = var.handle
    # The variable's own device: inside a tf.function the captured handle
    # may not carry one.
    return h, var.dtype, getattr(var, "device", "") or getattr(h, "device", "") or ""


def static_shape(variable):
    var = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)
    shape = getattr(var, "shape", None)
    return tf.TensorShape(shape) if shape is not None else None


def device_name(device):
    if not device:
        return ""
    return tf.DeviceSpec.from_string(device).to_string()


def has_kernel(device, op_name):
    """A kernel of `op_name` is registered for `device`'s type (no device: assume CPU)."""
    device_type = tf.DeviceSpec.from_string(device).device_type if device else "CPU"
    return device_type in kernel_device_types(op_name)


@functools.lru_cache(maxsize=None)
def kernel_device_types(op_name):
    """The device types with a registered kernel of `op_name` (once the op library is loaded)."""
    from tensorflow.python.framework import kernels

    return frozenset(k.device_type for k in kernels.get_registered_kernels_for_op(op_name).kernel)
