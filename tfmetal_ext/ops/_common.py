"""Shared by the op wrappers: the reference switch, dtype and argument checks."""

from __future__ import annotations

import functools
import math
import os
import types

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _loader

FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def use_reference() -> bool:
    """``TFMETAL_EXT_REFERENCE_OPS=1`` forces the pure-TF references everywhere."""
    return os.environ.get("TFMETAL_EXT_REFERENCE_OPS", "0").strip().lower() in ("1", "true", "yes")


@tf.autograph.experimental.do_not_convert  # first use may be inside a tf.function
def library():
    """The loaded op module, or None when the references must be used.

    None also while a graph is traced for export (`tfmetal_ext.deploy.portable_forms`): the
    references are stock TensorFlow ops, which every runtime and converter knows.
    """
    if use_reference() or portable():
        return None
    return _loader.load()


def check_float(name, tensor):
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"`{name}` must be float32, float16 or bfloat16. Received: {name}.dtype={tensor.dtype.name}"
        )


def check_nonnegative(name, value):
    """`value` as a float: finite, >= 0 and representable in float32 (kernels take float32 attrs).

    The one check of the package's non-negative float arguments (softshrink's
    `lambd`, the optimizers' `epsilon` and `weight_decay`); a bool or a string
    is not a number here.
    """
    v = _as_float(name, value, "a float >= 0")
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"Argument `{name}` must be a finite float >= 0. Received: {name}={value!r}")
    return check_float32_representable(name, v)


def check_finite(name, value):
    """`value` as a float: finite and, unless 0, representable in float32 (kernels take float32 attrs).

    The check of the package's signed float arguments (batch_norm_act's
    `alpha` and `momentum`); a bool or a string is not a number here.
    """
    v = _as_float(name, value, "a finite float")
    if not math.isfinite(v):
        raise ValueError(f"Argument `{name}` must be a finite float. Received: {name}={value!r}")
    return check_float32_representable(name, v) if v != 0.0 else 0.0


def _as_float(name, value, what):
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"Argument `{name}` must be {what}. Received: {name}={value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Argument `{name}` must be {what}. Received: {name}={value!r}") from None


def check_float32_representable(name, value):
    """`value` (a finite float) unless float32 rounds it to 0 or to inf.

    Kernels take their float arguments as float32 attrs: 1e-50 would become
    0 and 1e39 inf there, silently another computation.
    """
    v = float(value)
    with np.errstate(over="ignore", under="ignore"):
        rounded = float(np.float32(v))
    if math.isinf(rounded) or (rounded == 0.0 and v != 0.0):
        raise ValueError(
            f"Argument `{name}` is passed to the kernel as float32, where it rounds to {rounded} "
            f"(float32 holds magnitudes from about 1.4e-45 to 3.4e38). Received: {name}={value!r}"
        )
    return v


@functools.lru_cache(maxsize=None)
def kernel_for_visible_devices(op_name, device_type="GPU"):
    """The op has a kernel for the device type ops land on by default.

    Where a GPU is visible but the library has no GPU kernel for the op (a
    CUDA machine, or a Mac build without Metal kernels), the op would run on
    the CPU with a copy each way; the pure-TF reference stays on the GPU.
    """
    if not tf.config.list_logical_devices(device_type):
        return True
    from tensorflow.python.framework import kernels

    registered = kernels.get_registered_kernels_for_op(op_name)
    return any(k.device_type == device_type for k in registered.kernel)


# Custom op -> its safe-form name (tfmetal_ext.backends.fusion.SAFE_FORMS).
SAFE_FORM_OF_OP = types.MappingProxyType({op.name: op.safe_form for op in fusion.CUSTOM_OPS.values()})


def op_avoided(op_name) -> bool:
    """Custom op `op_name` is avoided: ``configure(avoid_fusions=[...])`` names its safe form.

    Its pure-TF reference runs instead. Reads the environment's avoided set
    (`tfmetal_ext._env`) when the op is traced. For a pattern name see
    `tfmetal_ext.layers._ops.pattern_avoided`.
    """
    from tfmetal_ext import _env

    return SAFE_FORM_OF_OP.get(op_name) in _env.current().avoided


def all_finite(values):
    """A scalar bool tensor: every element of every float tensor in `values` is finite.

    ``0 * v`` is 0 for a finite v and NaN for inf or NaN, so the sum of those
    terms is 0 exactly when every value is finite. Mul, Sum, AddV2 and Equal
    have float kernels on both Metal backends; IsFinite, All and Pack do not
    on the open tensorflow-metal-plugin, so the obvious form would put the
    check on the CPU. The one home of that form: the moving-statistics guards
    (`tfmetal_ext.layers.normalization.assign_finite_moving_statistics`, the
    reference of `batch_norm_act`'s moving update) use it.
    """
    probe = None
    for v in values:
        v = tf.convert_to_tensor(v)
        term = tf.reduce_sum(v * tf.constant(0, v.dtype))
        probe = term if probe is None else probe + tf.cast(term, probe.dtype)
    if probe is None:
        return tf.constant(True)
    return tf.equal(probe, tf.constant(0, probe.dtype))


def in_xla_context() -> bool:
    """True while tracing a function XLA compiles (``jit_compile=True``): the custom ops have no XLA kernels."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF moved it
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def portable() -> bool:
    """True while a graph is traced for export (`tfmetal_ext.deploy.portable_forms`).

    The references then run without their `tf.custom_gradient` wrapper: an exported graph is for
    inference, and the wrapper's ``IdentityN`` leaves dead-end tensors some converters (OpenVINO)
    expose as extra outputs.
    """
    from tfmetal_ext import _env

    return _env.current().portable


def stock_code_reason():
    """Why a layer that can run its stock parent's code must run it now, or None.

    While a graph is traced for export (`tfmetal_ext.deploy.portable_forms`): the stock layer's
    own graph is what converters and runtimes know best. In a function XLA compiles: the custom
    ops have no XLA kernels.
    """
    if portable():
        return "traced for export: the stock layer's code (portable forms)"
    if in_xla_context():
        return "a function compiled with XLA (the op has no XLA kernel)"
    return None


def gelu_exact(x):
    """Exact GELU: TF's ``Gelu`` (its GeluExact pattern), or ``0.5 x (1 + erf(x / sqrt(2)))`` while
    traced for export (`tfmetal_ext.deploy.portable_forms`).

    TF's exact GELU is built on ``Erfc``, an op ONNX has no counterpart for (onnxruntime refuses the
    file) and coremltools does not convert; ``Erf`` both have. The two forms differ by float rounding
    (the erf form loses relative precision where GELU is tiny, far in the negative tail).
    """
    if portable():
        return 0.5 * x * (1.0 + tf.math.erf(x * 0.7071067811865476))
    return tf.nn.gelu(x, approximate=False)


def reference_activate(z, activation, alpha=fusion.LEAKY_RELU_ALPHA):
    """``activation(z)`` in stock TF ops: the custom ops' references (int8 ops, batch_norm_act).

    Keras activation names (None or ``"linear"``: none; ``"leaky_relu"`` with slope `alpha`;
    ``"gelu"`` exact, ``"gelu_approximate"`` tanh form; ``"silu"`` ``z * sigmoid(z)``).

    Raises:
        ValueError: for any other name.
    """
    if activation in (None, "linear"):
        return z
    if activation == "relu":
        return tf.nn.relu(z)
    if activation == "relu6":
        return tf.nn.relu6(z)
    if activation == "elu":
        return tf.nn.elu(z)
    if activation == "leaky_relu":
        return tf.nn.leaky_relu(z, alpha=alpha)
    if activation == "silu":
        return z * tf.sigmoid(z)
    if activation == "gelu":
        return gelu_exact(z)
    if activation == "gelu_approximate":
        return tf.nn.gelu(z, approximate=True)
    if activation == "tanh":
        return tf.math.tanh(z)
    if activation == "sigmoid":
        return tf.math.sigmoid(z)
    raise ValueError(f"Unknown activation for a custom op's reference. Received: activation={activation!r}")


def uses_kernel(op_name) -> bool:
    """`op_name` runs as the custom op here (else its pure-TF reference)."""
    return not op_avoided(op_name) and library() is not None and kernel_for_visible_devices(op_name)
