"""The self-test checks: one registry, one `@register` per check.

A check is a `Check`: its name, the case that builds it and, where it is
not the safe form's, its fix. Adding a check is one decorated case function
here; `selftest()` runs what `REGISTRY` holds, in order.

Three kinds:

* `NUMERIC`: ``case(dtype) -> (fn, args, reference)``. `selftest()` runs
  ``fn(*args)`` as a fresh graph-mode `tf.function` (grappler fuses it) and
  compares its outputs with `reference` (eager unfused ops on the same device,
  or the numpy references of `tfmetal_ext.testing`). With ``op`` set (a
  `tfmetal_ext.backends.fusion.CUSTOM_OPS` entry) the case runs our custom
  op through the loaded library (`custom_op_library()`), and the check skips
  where that library or the op's GPU kernel is missing.
* `PLACEMENT`: ``case() -> compiled keras.Model``; `selftest()` places one
  train step of it and fails on each op that falls back to the CPU while a GPU
  is present (the fix comes from the safe form that avoids that op).
* `ENVIRONMENT`: ``case() -> devices.Capabilities``; fails on a Metal plugin
  install that cannot work: a known-broken pairing, or both plugins
  installed (the fix: the pairing's commands).
* `GAP`: ``case() -> {op: builder}``, ``builder(dtype) -> (raw op, kwargs)``;
  `selftest()` runs each gap kernel this process registered (`ops.status()`)
  on the GPU and TensorFlow's own kernel of the same op on the CPU, and fails
  on any that differ.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tfmetal_ext import testing
from tfmetal_ext.backends import fusion

NUMERIC, PLACEMENT, ENVIRONMENT, GAP = "numeric", "placement", "environment", "gap"

REPORT_IT = "and report it (attach `tfmetal-ext doctor --selftest --json`)"


@dataclasses.dataclass(frozen=True)
class Check:
    """One self-test check.

    Attributes:
        name: the check's name; for a fused pattern, its
            ``configure(avoid_fusions=...)`` name (a `SAFE_FORMS` key).
        case: builds what is checked (see the module docstring for `kind`).
        kind: `NUMERIC`, `PLACEMENT` or `ENVIRONMENT`.
        op: the `CustomOp` the case runs, or None.
        fix: what to do when the check fails (or crashes).
    """

    name: str
    case: Callable
    kind: str = NUMERIC
    op: fusion.CustomOp | None = None
    fix: str | None = None


# name -> Check, in the order `selftest()` runs and reports them.
REGISTRY: dict[str, Check] = {}


def register(name, *, kind=NUMERIC, op=None, fix=None):
    """Declares `name`'s check; decorates its case.

    Args:
        name: the check's name.
        kind: `NUMERIC`, `PLACEMENT` or `ENVIRONMENT`.
        op: the `tfmetal_ext.backends.fusion.CUSTOM_OPS` entry the case runs, or None.
        fix: the fix of a failure; None derives it from the safe form of `op`
            (else of `name`): ``fusion.safe_form_fix``, plus "report it" for
            our own ops.

    Raises:
        ValueError: `name` is registered already, has neither a fix nor a safe
            form, or `kind` is unknown.
    """
    if name in REGISTRY:
        raise ValueError(f"A check named {name!r} is registered already. Received: name={name!r}")
    if kind not in (NUMERIC, PLACEMENT, ENVIRONMENT, GAP):
        raise ValueError(
            f"`kind` must be {NUMERIC!r}, {PLACEMENT!r}, {ENVIRONMENT!r} or {GAP!r}. Received: kind={kind!r}"
        )
    if fix is None:
        form = op.safe_form if op is not None else name
        if form not in fusion.SAFE_FORMS:
            raise ValueError(f"Check {name!r} has no safe form: give it a fix. Received: fix=None")
        fix = fusion.safe_form_fix(form) + (f"; {REPORT_IT}" if op is not None else "")

    def decorate(case):
        REGISTRY[name] = Check(name=name, case=case, kind=kind, op=op, fix=fix)
        return case

    return decorate


def custom_op_library():
    """The loaded custom-op library, for the cases of checks with an ``op``.

    `selftest()` skips such a check before calling its case when the library
    is not loaded, so here it is.
    """
    from tfmetal_ext.ops import _loader

    return _loader.load()


def _rng(seed):
    return np.random.default_rng(seed)


def _f64(t):
    return np.asarray(t, np.float64)


# ----------------------------------------------------------------------------
# The Metal plugin install: its pairing with this TensorFlow and Python, and both plugins at once.


@register(
    "metal_pairing", kind=ENVIRONMENT,
    fix="install one Metal plugin that fits this TensorFlow and Python (`tfmetal-ext version` names the commands)",
)
def metal_pairing():
    from tfmetal_ext import devices

    return devices.capabilities()


# ----------------------------------------------------------------------------
# Fused patterns of the remapper and the Metal plugins: eager references.


@register("conv_bias_relu")
def conv_bias_relu(dtype):
    import tensorflow as tf

    rng = _rng(1)
    x = tf.constant(rng.standard_normal((2, 9, 9, 8)), dtype)
    w = tf.constant(rng.standard_normal((3, 3, 8, 16)) * 0.2, dtype)
    b = tf.constant(rng.standard_normal(16) * 0.5, dtype)

    def fused(x, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))

    reference = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + b)  # eager: one kernel per op
    return fused, (x, w, b), reference


@register("matmul_bias_relu")
def matmul_bias_relu(dtype):
    import tensorflow as tf

    rng = _rng(2)
    x = tf.constant(rng.standard_normal((16, 32)), dtype)
    w = tf.constant(rng.standard_normal((32, 24)) * 0.2, dtype)
    b = tf.constant(rng.standard_normal(24) * 0.5, dtype)

    def fused(x, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))

    reference = tf.nn.relu(tf.matmul(x, w) + b)
    return fused, (x, w, b), reference


@register("fused_batch_norm")
def fused_batch_norm(dtype):
    import tensorflow as tf

    from tfmetal_ext.layers import _ops

    rng = _rng(3)
    c, eps, momentum = 8, 1e-3, 0.9
    x = tf.constant(rng.standard_normal((4, 6, 6, c)) * 2.0 + 0.5, dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, c), tf.float32)
    beta = tf.constant(rng.standard_normal(c) * 0.3, tf.float32)
    mean = tf.constant(rng.standard_normal(c) * 0.3, tf.float32)
    var = tf.constant(rng.uniform(0.5, 2.0, c), tf.float32)

    def fused(x, gamma, beta, mean, var):
        # As FusedBatchNorm / ConvBNAct emit it: FusedBatchNormV3 (+ Relu), training and inference.
        y, (new_mean, new_var) = _ops.fused_batch_norm(
            x, gamma, beta, mean, var, epsilon=eps, momentum=momentum, training=True
        )
        y_inf, _ = _ops.fused_batch_norm(x, gamma, beta, mean, var, epsilon=eps, momentum=momentum, training=False)
        return tf.nn.relu(y), new_mean, new_var, tf.nn.relu(y_inf)

    # Eager reference from primitive ops, statistics in float32.
    xf = tf.cast(x, tf.float32)
    batch_mean = tf.reduce_mean(xf, axis=[0, 1, 2])
    batch_var = tf.reduce_mean(tf.square(xf - batch_mean), axis=[0, 1, 2])
    y = tf.nn.relu((xf - batch_mean) * tf.math.rsqrt(batch_var + eps) * gamma + beta)
    y_inf = tf.nn.relu((xf - mean) * tf.math.rsqrt(var + eps) * gamma + beta)
    reference = (
        tf.cast(y, dtype), mean * momentum + batch_mean * (1 - momentum),
        var * momentum + batch_var * (1 - momentum), tf.cast(y_inf, dtype),
    )
    return fused, (x, gamma, beta, mean, var), reference


# ----------------------------------------------------------------------------
# Our custom ops (forward and gradient ops): the numpy references of tfmetal_ext.testing.

SOFTSHRINK_LAMBDA = 0.5
LAYER_NORM_EPSILON = 1e-3
RMS_NORM_EPSILON = 1e-6


@register("softshrink", op=fusion.CUSTOM_OPS["softshrink"])
def softshrink(dtype):
    import tensorflow as tf

    lib, lambd = custom_op_library(), SOFTSHRINK_LAMBDA
    rng = _rng(4)
    xn = rng.standard_normal((7, 33)) * 2.0
    xn[np.abs(np.abs(xn) - lambd) < 1e-2] = 1.0  # away from the kinks
    x = tf.constant(xn, dtype)
    dy = tf.constant(rng.standard_normal((7, 33)), dtype)

    def fused(x, dy):
        return lib.tfmetal_ext_softshrink(x, lambd=lambd), lib.tfmetal_ext_softshrink_grad(dy, x, lambd=lambd)

    reference = testing.np_softshrink(_f64(x), lambd), testing.np_softshrink_grad(_f64(dy), _f64(x), lambd)
    return fused, (x, dy), reference


@register("layer_norm", op=fusion.CUSTOM_OPS["layer_norm"])
def layer_norm(dtype):
    import tensorflow as tf

    lib, eps = custom_op_library(), LAYER_NORM_EPSILON
    rng = _rng(5)
    x = tf.constant(rng.standard_normal((6, 40)) * 1.5 + 0.3, dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, 40), tf.float32)
    beta = tf.constant(rng.standard_normal(40) * 0.2, tf.float32)
    dy = tf.constant(rng.standard_normal((6, 40)), dtype)

    def fused(x, gamma, beta, dy):
        y, mean, rstd = lib.tfmetal_ext_layer_norm(x, gamma, beta, epsilon=eps)
        return (y,) + tuple(lib.tfmetal_ext_layer_norm_grad(dy, x, gamma, mean, rstd))

    y = testing.np_layer_norm(_f64(x), _f64(gamma), _f64(beta), eps)
    grads = testing.np_layer_norm_grad(_f64(dy), _f64(x), _f64(gamma), eps)
    return fused, (x, gamma, beta, dy), (y,) + tuple(grads)


@register("rms_norm", op=fusion.CUSTOM_OPS["rms_norm"])
def rms_norm(dtype):
    import tensorflow as tf

    lib, eps = custom_op_library(), RMS_NORM_EPSILON
    rng = _rng(7)
    x = tf.constant(rng.standard_normal((6, 40)) * 1.5 + 0.3, dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, 40), tf.float32)
    dy = tf.constant(rng.standard_normal((6, 40)), dtype)

    def fused(x, gamma, dy):
        y, rstd = lib.tfmetal_ext_rms_norm(x, gamma, epsilon=eps)
        return (y,) + tuple(lib.tfmetal_ext_rms_norm_grad(dy, x, gamma, rstd))

    y = testing.np_rms_norm(_f64(x), _f64(gamma), eps)
    grads = testing.np_rms_norm_grad(_f64(dy), _f64(x), _f64(gamma), eps)
    return fused, (x, gamma, dy), (y,) + tuple(grads)


BATCH_NORM_ACT_EPSILON = 1e-3
BATCH_NORM_ACT_MOMENTUM = 0.9


@register("batch_norm_act", op=fusion.CUSTOM_OPS["batch_norm_act"])
def batch_norm_act(dtype):
    import tensorflow as tf

    lib, eps = custom_op_library(), BATCH_NORM_ACT_EPSILON
    rng = _rng(9)
    shape = (4, 5, 3, 24)
    x = tf.constant(rng.standard_normal(shape) * 1.5 + 0.3, dtype)
    side = tf.constant(rng.standard_normal(shape), dtype)
    dy = tf.constant(rng.standard_normal(shape), dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, 24), tf.float32)
    beta = tf.constant(rng.standard_normal(24) * 0.2, tf.float32)
    moving = [tf.constant(rng.standard_normal(24) * 0.1, tf.float32), tf.constant(rng.uniform(0.5, 2.0, 24), tf.float32)]

    def fused(x, side, gamma, beta, dy):
        # A residual block's second batch norm in a training step: relu after the residual add, the
        # moving statistics' update, forward and gradient.
        y, mean, inv_std, variance, new_moving = lib.tfmetal_ext_batch_norm_act(
            x, gamma, beta, [side], moving, activation="relu", epsilon=eps, momentum=BATCH_NORM_ACT_MOMENTUM
        )
        dx, dgamma, dbeta, dside = lib.tfmetal_ext_batch_norm_act_grad(dy, x, y, gamma, beta, [side], mean, inv_std,
                                                                       activation="relu", epsilon=eps)
        return (y, mean, variance) + tuple(new_moving) + (dx, dgamma, dbeta, dside[0])

    y, mean, _, variance = testing.np_batch_norm_act(_f64(x), _f64(gamma), _f64(beta), _f64(side), "relu", eps)
    new_moving = testing.np_moving_update(mean, variance, *(m.numpy() for m in moving), BATCH_NORM_ACT_MOMENTUM)
    grads = testing.np_batch_norm_act_grad(_f64(dy), _f64(x), _f64(gamma), _f64(beta), _f64(side), "relu", eps)
    return fused, (x, side, gamma, beta, dy), (y, mean, variance) + tuple(new_moving) + tuple(grads)


ROPE_POSITIONS_START = 3.0


@register("rope", op=fusion.CUSTOM_OPS["rope"])
def rope(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(8)
    x = tf.constant(rng.standard_normal((2, 9, 3, 16)) * 1.5, dtype)
    dy = tf.constant(rng.standard_normal((2, 9, 3, 16)), dtype)
    positions = tf.constant(np.arange(9, dtype=np.float32) + ROPE_POSITIONS_START)
    inv_freq = tf.constant((10000.0 ** -(np.arange(0, 16, 2) / 16.0)).astype(np.float32))

    def fused(x, dy):
        return lib.tfmetal_ext_rope(x, positions, inv_freq), lib.tfmetal_ext_rope_grad(dy, positions, inv_freq)

    reference = (testing.np_rope(_f64(x), positions.numpy(), inv_freq.numpy()),
                 testing.np_rope(_f64(dy), positions.numpy(), inv_freq.numpy(), inverse=True))
    return fused, (x, dy), reference


@register("activation_grad", op=fusion.CUSTOM_OPS["activation_grad"])
def activation_grad(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(10)
    x = tf.constant(rng.standard_normal((5, 37)) * 3.0, dtype)  # both tails and the roots of silu', gelu'
    dy = tf.constant(rng.standard_normal((5, 37)), dtype)
    up = tf.constant(rng.standard_normal((5, 37)) * 2.0, dtype)
    names = fusion.ACTIVATION_GRAD_ACTIVATIONS

    def fused(x, dy, up):
        plain = tuple(lib.tfmetal_ext_activation_grad(dy, x, activation=name) for name in names)
        gated = tuple(t for name in names for t in lib.tfmetal_ext_gated_activation_grad(dy, x, up, activation=name))
        return plain + gated

    reference = tuple(testing.np_smooth_activation_grad(_f64(dy), _f64(x), name) for name in names)
    gated = tuple(t for name in names for t in testing.np_gated_activation_grad(_f64(dy), _f64(x), _f64(up), name))
    return fused, (x, dy, up), reference + gated


@register("sparse_softmax_cross_entropy", op=fusion.CUSTOM_OPS["sparse_softmax_cross_entropy"])
def sparse_softmax_cross_entropy(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(12)
    # 37 classes: a row is not a whole number of SIMD groups or CPU lanes.
    x = tf.constant(rng.standard_normal((6, 37)) * 4.0, dtype)
    dloss = tf.constant(rng.standard_normal(6), dtype)
    labels = tf.constant(rng.integers(0, 37, 6), tf.int64)

    def fused(x, dloss):
        loss, row_max, row_sum = lib.tfmetal_ext_sparse_softmax_cross_entropy(x, labels)
        dx = lib.tfmetal_ext_sparse_softmax_cross_entropy_grad(dloss, x, labels, row_max, row_sum)
        return loss, row_max, row_sum, dx

    reference = testing.np_sparse_softmax_cross_entropy(_f64(x), labels.numpy()) + (
        testing.np_sparse_softmax_cross_entropy_grad(_f64(dloss), _f64(x), labels.numpy()),)
    return fused, (x, dloss), reference


@register("gemv", op=fusion.CUSTOM_OPS["gemv"])
def gemv(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(13)
    # 3 rows, 37 inputs, 70 outputs: not whole vectors, SIMD groups or threadgroups.
    rows = 3
    depth = 37
    width = 70
    x = tf.constant(rng.standard_normal([rows, depth]), dtype)
    w = tf.constant(rng.standard_normal([depth, width]) * 0.3, dtype)
    bias = tf.constant(rng.standard_normal(width) * 0.3, dtype)

    def fused(x, w, bias):
        return (lib.tfmetal_ext_gemv(x, w, bias, has_bias=True),
                lib.tfmetal_ext_gemv(x, w, tf.zeros([0], x.dtype), has_bias=False))

    z = _f64(x) @ _f64(w)
    return fused, (x, w, bias), (z + _f64(bias), z)


# The int8 contractions: numpy float64 of Keras' convention (w = q / scale), the TF conv padding rules.

def _np_int8_activate(z, activation, alpha=fusion.LEAKY_RELU_ALPHA):
    import math

    if activation == "relu":
        return np.maximum(z, 0.0)
    if activation == "gelu":
        return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    if activation == "leaky_relu":
        return np.where(z < 0, z * alpha, z)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    return z


def _np_int8_conv2d(x, w, strides, same, dilations):
    """NHWC x HWIO in float64 with TF's VALID / SAME output sizes and padding."""
    (b, h, wd, _), (kh, kw, _, co) = x.shape, w.shape
    out, pads = [], []
    for size, k, s, d in ((h, kh, strides[0], dilations[0]), (wd, kw, strides[1], dilations[1])):
        eff = (k - 1) * d + 1
        o = -(-size // s) if same else max(0, (size - eff) // s + 1)
        need = max((o - 1) * s + eff - size, 0) if same else 0
        out.append(o)
        pads.append((need // 2, need - need // 2 + s))
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    y = np.zeros((b, out[0], out[1], co))
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilations[0], j * dilations[1]
            patch = xp[:, r0:r0 + (out[0] - 1) * strides[0] + 1:strides[0],
                       c0:c0 + (out[1] - 1) * strides[1] + 1:strides[1], :]
            y += patch @ w[i, j]
    return y


def _int8_weights(rng, shape):
    """An int8 kernel of `shape` and a float32 per-output-channel scale, as Keras quantizes."""
    q = rng.integers(-127, 128, size=shape).astype(np.int8)
    scale = rng.uniform(20.0, 80.0, shape[-1]).astype(np.float32)
    return q, scale


@register("int8_matmul", op=fusion.CUSTOM_OPS["int8_matmul"])
def int8_matmul(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(11)
    q, scale = _int8_weights(rng, (37, 21))
    x = tf.constant(rng.standard_normal((5, 37)), dtype)
    bias = tf.constant(rng.standard_normal(21) * 0.3, dtype)
    acts = ("relu", "gelu", "linear")

    def fused(x, q, scale, bias):
        return tuple(lib.tfmetal_ext_int8_mat_mul(x, q, scale, bias, activation=a, has_bias=True) for a in acts)

    z = _f64(x) @ (_f64(q) / _f64(scale)) + _f64(bias)
    reference = tuple(_np_int8_activate(z, a) for a in acts)
    return fused, (x, tf.constant(q), tf.constant(scale), bias), reference


@register("int8_conv2d", op=fusion.CUSTOM_OPS["int8_conv2d"])
def int8_conv2d(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(12)
    q, scale = _int8_weights(rng, (3, 3, 5, 6))
    x = tf.constant(rng.standard_normal((2, 9, 8, 5)), dtype)
    bias = tf.constant(rng.standard_normal(6) * 0.3, dtype)
    cases = (("SAME", (2, 1), (1, 1), "relu"), ("VALID", (1, 1), (2, 1), "leaky_relu"))

    def fused(x, q, scale, bias):
        return tuple(
            lib.tfmetal_ext_int8_conv2d(x, q, scale, bias, activation=a, has_bias=True, strides=list(s),
                                        dilations=list(d), padding=p)
            for p, s, d, a in cases
        )

    w = _f64(q) / _f64(scale)
    reference = tuple(
        _np_int8_activate(_np_int8_conv2d(_f64(x), w, s, p == "SAME", d) + _f64(bias), a) for p, s, d, a in cases
    )
    return fused, (x, tf.constant(q), tf.constant(scale), bias), reference


@register("multi_tensor_adam", op=fusion.CUSTOM_OPS["multi_tensor_adam"])
def multi_tensor_adam(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(6)
    shapes = [(5, 7), (11,)]
    scalars = (0.01, 0.9, 0.999, 1e-7, 0.9**3, 0.999**3)  # lr, beta_1, beta_2, epsilon and the powers
    init = [[rng.standard_normal(s) * k for s in shapes] for k in (1.0, 0.1, 0.01)]
    init[2] = [np.abs(v) for v in init[2]]  # second moments are >= 0
    var, m, v = ([tf.Variable(a, dtype=dtype) for a in group] for group in init)
    grads = tuple(tf.constant(rng.standard_normal(s), dtype) for s in shapes)

    def fused(*grads):
        lib.tfmetal_ext_multi_tensor_adam(
            [x.handle for x in var], [x.handle for x in m], [x.handle for x in v], [], list(grads),
            *(tf.constant(s, dtype) for s in scalars), [], [],  # no decay, no loss scale
        )
        return [x.read_value() for x in var + m + v]

    # From the values as stored in `dtype`, each step rounded to it as ResourceApplyAdam does.
    steps = [
        testing.np_adam_step((_f64(p), _f64(m0), _f64(v0), _f64(v0)), _f64(g), scalars, np.dtype(dtype).type)
        for p, m0, v0, g in zip(var, m, v, grads)
    ]
    reference = [s[k] for k in range(3) for s in steps]  # vars, then m, then v
    return fused, grads, reference


@register("multi_tensor_lion", op=fusion.CUSTOM_OPS["multi_tensor_lion"])
def multi_tensor_lion(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(8)
    shapes = [(5, 7), (11,)]
    scalars = (0.01, 0.9, 0.99)  # lr, beta_1, beta_2
    init = [[rng.standard_normal(s) * k for s in shapes] for k in (1.0, 0.1)]
    var, m = ([tf.Variable(a, dtype=dtype) for a in group] for group in init)
    grads = tuple(tf.constant(rng.standard_normal(s), dtype) for s in shapes)

    def fused(*grads):
        lib.tfmetal_ext_multi_tensor_lion(
            [x.handle for x in var], [x.handle for x in m], list(grads), *(tf.constant(s, dtype) for s in scalars), [],
            [],  # no loss scale
        )
        return [x.read_value() for x in var + m]

    # From the values as stored in `dtype`, each operation rounded to it as Keras' Lion does.
    steps = [
        testing.np_lion_step((_f64(p), _f64(m0)), _f64(g), scalars, np.dtype(dtype).type)
        for p, m0, g in zip(var, m, grads)
    ]
    reference = [s[k] for k in range(2) for s in steps]  # vars, then m
    return fused, grads, reference


@register("multi_tensor_rmsprop", op=fusion.CUSTOM_OPS["multi_tensor_rmsprop"])
def multi_tensor_rmsprop(dtype):
    import tensorflow as tf

    lib = custom_op_library()
    rng = _rng(9)
    shapes = [(5, 7), (11,)]
    scalars = (0.01, 0.9, 0.5, 1e-7)  # lr, rho, momentum, epsilon
    # var, velocity (>= 0 and above average_gradient**2), momentum, average_gradient: centered with momentum.
    init = [[rng.standard_normal(s) * k for s in shapes] for k in (1.0, 1.0, 0.01, 0.1)]
    init[1] = [np.abs(v) + 0.1 for v in init[1]]
    var, v, m, mg = ([tf.Variable(a, dtype=dtype) for a in group] for group in init)
    grads = tuple(tf.constant(rng.standard_normal(s), dtype) for s in shapes)
    lr, rho, momentum, epsilon = scalars

    def fused(*grads):
        lib.tfmetal_ext_multi_tensor_rm_sprop(
            [x.handle for x in var], [x.handle for x in v], [x.handle for x in m], [x.handle for x in mg], list(grads),
            *(tf.constant(s, dtype) for s in (lr, rho, 1.0 - rho, momentum, epsilon)), [], [],  # no decay, no loss scale
        )
        return [x.read_value() for x in var + v + m + mg]

    # From the values as stored in `dtype`, each operation rounded to it as Keras' RMSprop does.
    steps = [
        testing.np_rmsprop_step((_f64(p), _f64(v0), _f64(m0), _f64(mg0)), _f64(g), scalars, np.dtype(dtype).type)
        for p, v0, m0, mg0, g in zip(var, v, m, mg, grads)
    ]
    reference = [s[k] for k in range(4) for s in steps]  # vars, then velocities, momentums, average gradients
    return fused, grads, reference


DROPOUT_RATE = 0.3


@register("dropout", op=fusion.CUSTOM_OPS["dropout"])
def dropout(dtype):
    import tensorflow as tf

    from tfmetal_ext.ops.dropout import dtype_constants

    lib = custom_op_library()
    rng = _rng(9)
    x = tf.constant(rng.standard_normal((7, 37)) * 2.0, dtype)  # 259 elements: a partial Philox block
    dy = tf.constant(rng.standard_normal((7, 37)), dtype)
    seed = tf.constant([1234, -5678], tf.int64)
    with tf.Graph().as_default():  # the constants as a traced step rounds them
        rate, scale = dtype_constants(DROPOUT_RATE, tf.as_dtype(dtype))

    def fused(x, dy, seed):
        return (lib.tfmetal_ext_dropout(x, seed, rate=rate, scale=scale),
                lib.tfmetal_ext_dropout_grad(dy, seed, rate=rate, scale=scale))

    bits = testing.UNIFORM_BITS[tf.as_dtype(dtype).name]
    y, _ = testing.np_dropout(x.numpy(), seed.numpy(), rate, scale, bits)
    dx, _ = testing.np_dropout(dy.numpy(), seed.numpy(), rate, scale, bits)
    return fused, (x, dy, seed), (_f64(y), _f64(dx))


ATTENTION_SCALE = 0.35
ATTENTION_DROPOUT_RATE = 0.2
ATTENTION_WINDOW = 9  # keys per query row in the sliding-window case (a fraction of the 45)


@register("attention", op=fusion.CUSTOM_OPS["attention"])
def attention(dtype):
    import tensorflow as tf

    from tfmetal_ext.ops.dropout import dtype_constants

    lib, scale = custom_op_library(), ATTENTION_SCALE
    rng = _rng(8)
    b, h, tq, tk, d, dv = 2, 2, 37, 45, 16, 8  # several key tiles on the GPU, odd sizes
    q, k = (tf.constant(rng.standard_normal((b, h, t, d)), dtype) for t in (tq, tk))
    v = tf.constant(rng.standard_normal((b, h, tk, dv)), dtype)
    keep = rng.random((b, 1, tq, tk)) < 0.8
    keep[1, 0, 4, :] = False  # a row attending no key: output 0, no NaN
    mask = tf.constant(keep)
    dy = tf.constant(rng.standard_normal((b, h, tq, dv)), dtype)

    # And with attention dropout: the mask drawn from the seed on the device, again in the gradient.
    seed = tf.constant([4321, -8765], tf.int64)
    with tf.Graph().as_default():  # the constants as a traced step rounds them
        rate, drop_scale = dtype_constants(ATTENTION_DROPOUT_RATE, tf.as_dtype(dtype))
    drop = dict(dropout_rate=rate, dropout_scale=drop_scale)

    def fused(q, k, v, mask, dy, seed):
        results = []
        for seeds, attrs in (([], {}), ([seed], drop)):
            out, lse = lib.tfmetal_ext_attention(q, k, v, mask, seeds, causal=True, scale=scale, **attrs)
            grads = lib.tfmetal_ext_attention_grad(dy, q, k, v, mask, out, lse, seeds, causal=True, scale=scale,
                                                   **attrs)
            results += [out, *grads]
        # Grouped-query (one key/value head for both query heads) with a sliding window of 9 keys, in
        # both layouts: "BSHD" reads the (batch, seq, heads, dim) transposes in place and must give the
        # same results transposed.
        k1, v1 = k[:, :1], v[:, :1]
        swap = lambda t: tf.transpose(t, [0, 2, 1, 3])  # noqa: E731
        for layout, inputs in (("BHSD", (dy, q, k1, v1)), ("BSHD", tuple(swap(t) for t in (dy, q, k1, v1)))):
            attrs = dict(causal=True, scale=scale, sliding_window=ATTENTION_WINDOW, layout=layout)
            out, lse = lib.tfmetal_ext_attention(*inputs[1:], mask, [], **attrs)
            grads = lib.tfmetal_ext_attention_grad(inputs[0], *inputs[1:], mask, out, lse, [], **attrs)
            back = (lambda t: t) if layout == "BHSD" else swap
            results += [back(out), *(back(g) for g in grads)]
        return tuple(results)

    factors = testing.np_attention_dropout_factors((b, h, tq, tk), seed.numpy(), rate, drop_scale,
                                                   testing.UNIFORM_BITS[tf.as_dtype(dtype).name])
    references = []
    for m in (None, factors):
        out, _ = testing.np_attention(_f64(q), _f64(k), _f64(v), keep, True, scale, factors=m)
        grads = testing.np_attention_grad(_f64(dy), _f64(q), _f64(k), _f64(v), keep, True, scale, factors=m)
        references += [out, *grads]
    k1, v1 = _f64(k)[:, :1], _f64(v)[:, :1]
    out, _ = testing.np_attention(_f64(q), k1, v1, keep, True, scale, window=ATTENTION_WINDOW)
    grouped = [out, *testing.np_attention_grad(_f64(dy), _f64(q), k1, v1, keep, True, scale, window=ATTENTION_WINDOW)]
    references += grouped + grouped  # the "BHSD" and "BSHD" runs
    return fused, (q, k, v, mask, dy, seed), tuple(references)


# ----------------------------------------------------------------------------
# CPU fallback of a train step of our layers.


@register("cpu_fallback", kind=PLACEMENT, fix=f"our layers cannot run a train step here; {REPORT_IT}")
def cpu_fallback():
    import keras

    from tfmetal_ext.layers import ConvBNAct, FusedBatchNorm, FusedConv2D, FusedDense, FusedLayerNorm
    from tfmetal_ext.optimizers import FusedAdam

    inp = keras.Input((8, 8, 3))
    x = FusedConv2D(8, 3, padding="same", activation="relu", name="conv")(inp)
    x = ConvBNAct(8, 3, name="conv_bn")(x)
    x = FusedBatchNorm(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = FusedDense(16, activation="relu", name="fc")(x)
    x = FusedLayerNorm(name="ln")(x)
    out = FusedDense(4, name="head")(x)
    model = keras.Model(inp, out, name="tfmetal_ext_selftest")
    model.compile(optimizer=FusedAdam(1e-3), loss="mse")
    return model


@register("gap_kernels", kind=GAP,
          fix="turn the gap kernels off (TFMETAL_EXT_GAP_KERNELS_ENABLE=0: those ops then run on the CPU) "
              f"{REPORT_IT}")
def gap_kernels():
    """Inputs for every standard op tfmetal_ext has a gap kernel for: op -> builder(dtype) -> (raw op, kwargs).

    Each case covers the op's awkward corners where a kernel can go wrong:
    broadcasting, zeros, NaN and infinities, sizes off any tile.
    """
    import tensorflow as tf

    raw = tf.raw_ops
    rng = _rng(11)

    def t(values, dtype):
        return tf.constant(np.asarray(values), dtype)

    def special(n, dtype):
        v = rng.standard_normal(n) * 3.0
        v[:4] = [0.0, np.nan, np.inf, -np.inf]
        return t(v, dtype)

    seed = tf.constant([7, 12], tf.int64)

    def variable_case(op):
        # A variable created on the device under test, read (the read holds its buffer, so the update must
        # copy on write), then assigned or updated: the value after, and the read, which must not change.
        def run(init, value):
            var = tf.Variable(init)
            held = var.read_value()
            getattr(raw, op)(resource=var.handle, value=value)
            return var.read_value(), held

        def build(d):
            if d == "int64":
                edge = [2 ** 63 - 1, -(2 ** 63), -1, 0, 7]
                init = tf.constant(edge + list(rng.integers(-2 ** 40, 2 ** 40, 62)), tf.int64)
                value = tf.constant([1, -1, -(2 ** 63), 0, -9] + list(rng.integers(-2 ** 40, 2 ** 40, 62)), tf.int64)
            else:
                init, value = special(67, d), special(67, d)
            return run, dict(init=init, value=value)
        return build

    def small_ints(shape, dtype, special_at):
        # Small integers: every partial sum is exact in half and bfloat16, so GPU and CPU agree bit for bit
        # whatever order each sums in; one NaN / infinity to propagate.
        v = rng.integers(-2, 3, shape).astype(np.float64)
        v[special_at[0]] = np.nan
        v[special_at[1]] = np.inf
        return t(v, dtype)

    return {
        # Keras' attention scores (in the gap kernel's equation allowlist), sizes off its 32 x 32 x 16 tiles.
        "Einsum": lambda d: (raw.Einsum, dict(
            inputs=[small_ints((2, 33, 3, 17), d, ((0, 4, 1, 2), (1, 30, 2, 0))),
                    small_ints((2, 31, 3, 17), d, ((1, 7, 0, 16), (0, 0, 2, 5)))],
            equation="BTNH,BSNH->BNTS")),
        "DivNoNan": lambda d: (raw.DivNoNan, dict(x=t(rng.standard_normal((5, 37)), d),
                                                  y=t(np.where(rng.random(37) < 0.2, 0.0, rng.standard_normal(37)), d))),
        "BroadcastTo": lambda d: (raw.BroadcastTo, dict(input=t(rng.standard_normal((3, 1, 5)) > 0, d)
                                                        if d == "bool" else t(rng.standard_normal((3, 1, 5)), d),
                                                        shape=tf.constant([2, 3, 4, 5]))),
        "IsFinite": lambda d: (raw.IsFinite, dict(x=special(67, d))),
        "Sigmoid": lambda d: (raw.Sigmoid, dict(x=special(67, d))),
        "SigmoidGrad": lambda d: (raw.SigmoidGrad, dict(y=t(rng.random(67), d), dy=special(67, d))),
        "Elu": lambda d: (raw.Elu, dict(features=special(67, d))),
        "EluGrad": lambda d: (raw.EluGrad, dict(gradients=t(rng.standard_normal(67), d),
                                                outputs=t(rng.standard_normal(67), d))),
        "Erfc": lambda d: (raw.Erfc, dict(x=special(67, d))),
        # A view (float32 -> int32 is Keras' argmax); int64 -> int32 adds a dimension of 2. Non-negative
        # integers, so int32 -> float32 gives no NaN bit patterns (subnormals, compared exactly).
        "Bitcast": lambda d: (raw.Bitcast, dict(
            input=t(rng.integers(0, 9, (3, 5)), d) if d in ("int32", "int64") else special(67, d),
            type={"float32": tf.int32, "float16": tf.bfloat16, "bfloat16": tf.float16, "int32": tf.float32,
                  "int64": tf.int32}[d])),
        "ZerosLike": lambda d: (raw.ZerosLike, dict(x=t(rng.integers(-9, 9, 67), d) if d == "int8"
                                                   else special(67, d))),
        "OnesLike": lambda d: (raw.OnesLike, dict(x=special(67, d))),
        "Fill": lambda d: (raw.Fill, dict(dims=tf.constant([3, 41]), value=t(True if d == "bool" else -2.5, d))),
        "Pack": lambda d: (raw.Pack, dict(values=[t(rng.standard_normal((4, 9)) > 0, d) if d == "bool"
                                                  else t(rng.standard_normal((4, 9)), d) for _ in range(3)], axis=1)),
        "Unpack": lambda d: (raw.Unpack, dict(value=t(rng.standard_normal((4, 3, 9)) > 0, d) if d == "bool"
                                              else t(rng.standard_normal((4, 3, 9)), d), num=3, axis=1)),
        "ReverseV2": lambda d: (raw.ReverseV2, dict(tensor=special(67, d)[None, :] + t(np.zeros((3, 1)), d),
                                                    axis=tf.constant([0, -1]))),
        "ReverseSequence": lambda d: (raw.ReverseSequence, dict(
            input=t(rng.standard_normal((4, 33, 3)), d), seq_lengths=tf.constant([33, 0, 17, 1], tf.int64),
            seq_dim=1, batch_dim=0)),
        "UnsortedSegmentSum": lambda d: (raw.UnsortedSegmentSum, dict(
            data=t(rng.standard_normal((50, 17)), d), segment_ids=tf.constant(rng.integers(0, 9, 50), tf.int64),
            num_segments=tf.constant(11))),
        **{op: (lambda op: lambda d: (getattr(raw, op), dict(
            x=tf.constant([[0, 1, -1, 7, -7, 2 ** 62, -(2 ** 63)]] * 2, tf.int64),
            y=tf.constant([[3], [-5]], tf.int64))))(op)
           for op in ("AddV2", "Sub", "Mul", "FloorMod", "Maximum", "Minimum", "Equal", "NotEqual", "Less",
                      "LessEqual", "Greater", "GreaterEqual")},
        "All": lambda d: (raw.All, dict(input=tf.constant(rng.random((4, 5, 6)) < 0.97),
                                        axis=tf.constant([0, 2], d), keep_dims=False)),
        "Any": lambda d: (raw.Any, dict(input=tf.constant(rng.random((4, 5, 6)) < 0.03),
                                        axis=tf.constant([1], d), keep_dims=True)),
        **{op: variable_case(op) for op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")},
        "StatelessRandomGetKeyCounter": lambda d: (raw.StatelessRandomGetKeyCounter,
                                                   dict(seed=tf.cast(seed, d))),
        "StatelessRandomUniformV2": lambda d: (raw.StatelessRandomUniformV2, dict(
            shape=tf.constant([7, 19]), key=tf.constant([0x1234], tf.uint64),
            counter=tf.constant([5, 0], tf.uint64), alg=tf.constant(1), dtype=d)),
    }


def fallback_fix(op, layer):
    """The fix for op `op` (in layer `layer`) falling back to the CPU."""
    form = fusion.safe_form_for_op(op)
    if form is not None:
        return fusion.safe_form_fix(form.name)
    return (
        f"{op} has no kernel on this GPU: replace what emits it in layer {layer or '?'} "
        "(tf.config.set_soft_device_placement(False) makes it an error that names the op)"
    )


CHECKS = tuple(REGISTRY)

__all__ = ["CHECKS", "ENVIRONMENT", "GAP", "NUMERIC", "PLACEMENT", "REGISTRY", "Check", "custom_op_library", "fallback_fix", "register"]
