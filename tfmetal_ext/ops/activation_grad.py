"""activation_grad: ``dy * act'(x)`` of a smooth activation in one op (``TfmetalExt>ActivationGrad``), and
gated_activation_grad: the backward of ``act(gate) * up`` in one op (``TfmetalExt>GatedActivationGrad``)."""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

ACTIVATION_GRAD_OP = fusion.ACTIVATION_GRAD_OP
GATED_ACTIVATION_GRAD_OP = fusion.GATED_ACTIVATION_GRAD_OP
ACTIVATIONS = fusion.ACTIVATION_GRAD_ACTIVATIONS


def activation_grad(dy, x, activation, name=None):
    """The gradient of a smooth activation: ``dy * act'(x)``, elementwise, in one op.

    What a feed-forward block's backward pass computes for its activation.
    TensorFlow's autodiff of ``tf.nn.silu`` / ``tf.nn.gelu`` builds it from
    3-5 ops, each with a temporary of the activation's size (Sigmoid, Mul,
    Sub, Pow, Tanh, ...); this is one custom op (CPU kernel; Metal kernel on
    Apple GPUs), float32 math per element rounded once to the dtype:

    - ``"silu"`` (alias ``"swish"``): ``s * (1 + x * (1 - s))``, ``s = sigmoid(x)``;
    - ``"gelu"`` (exact, erf form): ``Phi(x) + x * phi(x)``;
    - ``"gelu_approximate"`` (tanh form, ``tf.nn.gelu(approximate=True)``):
      ``0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)``,
      ``t = tanh(sqrt(2/pi) (x + 0.044715 x^3))``.

    NaN in `dy` or `x` gives NaN. ``x = +inf`` gives `dy` and ``-inf`` gives
    ``0 * dy`` (the derivative's limits; TensorFlow's autodiff gives NaN
    there); no finite `x` overflows. The op's own gradient (second order) is
    ``activation_grad(g, x)`` for `dy` and ``g * dy * act''(x)`` for `x`.

    Args:
        dy: the incoming gradient, float32, float16 or bfloat16.
        x: the activation's input, the dtype and shape of `dy`.
        activation: ``"silu"`` (or ``"swish"``), ``"gelu"`` or ``"gelu_approximate"``.
        name: optional op name.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for another activation, dtype, mismatched dtypes or
            (statically) mismatched shapes.

    >>> dx = activation_grad(tf.constant([1.0, 1.0]), tf.constant([0.0, 20.0]), "silu")
    >>> dx.numpy()
    array([0.5, 1. ], dtype=float32)
    """
    activation = _check_activation(activation)
    dy = tf.convert_to_tensor(dy)
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    _common.check_float("dy", dy)
    if dy.dtype != x.dtype:
        raise ValueError(f"`dy` and `x` must have the same dtype. Received: dy.dtype={dy.dtype.name}, "
                         f"x.dtype={x.dtype.name}")
    if not dy.shape.is_compatible_with(x.shape):
        raise ValueError(f"`dy` and `x` must have the same shape. Received: dy.shape={dy.shape}, x.shape={x.shape}")
    if uses_kernel():
        return _common.library().tfmetal_ext_activation_grad(dy, x, activation=activation, name=name)
    # The reference is differentiable TF ops: its autodiff is the op's registered gradient.
    with tf.name_scope(name or "activation_grad"):
        return _reference.activation_grad(dy, x, activation)


def gated_activation_grad(dy, gate, up, activation, name=None):
    """The backward of a gated product ``y = act(gate) * up`` in one op: ``(d_gate, d_up)``.

    What a gated feed-forward's backward pass computes (Llama's ``silu(gate) * up``, Gemma's
    ``gelu(x1) * x2``): ``d_gate = dy * up * act'(gate)`` and ``d_up = dy * act(gate)``, float32 math
    per element rounded once to the dtype. TensorFlow's autodiff of the product and the activation
    keeps ``act(gate)`` for ``d_up`` and makes ``dy * up`` and the activation's temporaries; this op
    needs only `dy`, `gate` and `up`, and its CPU kernel writes its outputs into inputs nothing else
    holds any more.

    `act(gate)` is ``gate * f(gate)`` with ``f`` = sigmoid (silu), Phi (gelu) or
    ``0.5 (1 + tanh(u))`` (gelu_approximate), as TensorFlow's forward formulas compute it: ``+inf``
    gives ``+inf`` and ``-inf`` NaN (``-inf * 0``), as there. `d_gate` is `activation_grad`'s
    ``dy * up * act'(gate)``. NaN propagates.

    Args:
        dy: the gradient of ``y``, float32, float16 or bfloat16.
        gate: the activation's input, the dtype and shape of `dy`.
        up: the other factor, the dtype and shape of `dy`.
        activation: ``"silu"`` (or ``"swish"``), ``"gelu"`` or ``"gelu_approximate"``.
        name: optional op name.

    Returns:
        ``(d_gate, d_up)``, tensors of `gate`'s shape and dtype.

    Raises:
        ValueError: for another activation, dtype, mismatched dtypes or (statically) mismatched shapes.

    >>> d_gate, d_up = gated_activation_grad(tf.constant([2.0]), tf.constant([0.0]), tf.constant([3.0]), "silu")
    >>> float(d_gate[0]), float(d_up[0])
    (3.0, 0.0)
    """
    activation = _check_activation(activation)
    dy, gate, up = (tf.convert_to_tensor(t) for t in (dy, gate, up))
    for label, t in (("gate", gate), ("dy", dy), ("up", up)):
        _common.check_float(label, t)
    for label, t in (("dy", dy), ("up", up)):
        if t.dtype != gate.dtype:
            raise ValueError(f"`{label}` and `gate` must have the same dtype. Received: {label}.dtype={t.dtype.name}, "
                             f"gate.dtype={gate.dtype.name}")
        if not t.shape.is_compatible_with(gate.shape):
            raise ValueError(f"`{label}` and `gate` must have the same shape. Received: {label}.shape={t.shape}, "
                             f"gate.shape={gate.shape}")
    if uses_kernel():
        return tuple(_common.library().tfmetal_ext_gated_activation_grad(dy, gate, up, activation=activation,
                                                                         name=name))
    with tf.name_scope(name or "gated_activation_grad"):
        return _reference.gated_activation_grad(dy, gate, up, activation)


def uses_kernel() -> bool:
    """`activation_grad` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(ACTIVATION_GRAD_OP)


def _check_activation(activation):
    name = fusion.ACTIVATION_GRAD_ALIASES.get(activation, activation) if isinstance(activation, str) else activation
    if name not in ACTIVATIONS:
        raise ValueError(f"Argument `activation` must be one of {', '.join(map(repr, ACTIVATIONS))} (or an alias: "
                         f"{', '.join(map(repr, fusion.ACTIVATION_GRAD_ALIASES))}). Received: activation={activation!r}")
    return name


@tf.RegisterGradient(ACTIVATION_GRAD_OP)
def _activation_grad_grad(op, g):
    """Second order: d/d(dy) = g * act'(x) (the op again); d/dx = g * dy * act''(x), by autodiff of the reference."""
    dy, x = op.inputs
    activation = op.get_attr("activation")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    lib = _common.library() or _loaded_library()
    d_dy = lib.tfmetal_ext_activation_grad(g, x, activation=activation)
    xf = tf.cast(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(xf)
        derivative = _reference.activation_derivative(xf, activation)
    d_x = tape.gradient(derivative, xf, output_gradients=tf.cast(g, tf.float32) * tf.cast(dy, tf.float32))
    return d_dy, tf.cast(d_x, x.dtype)


def _loaded_library():
    # The op exists, so the library is loaded even if the reference switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()


@tf.RegisterGradient(GATED_ACTIVATION_GRAD_OP)
def _gated_activation_grad_grad(op, g_gate, g_up):
    """Second order, by autodiff of the reference (its float32 formula; the op's values)."""
    dy, gate, up = op.inputs
    activation = op.get_attr("activation")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    inputs = [tf.cast(t, tf.float32) for t in (dy, gate, up)]
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        d_gate, d_up = _reference.gated_activation_grad_terms(*inputs, activation)
    grads = tape.gradient([d_gate, d_up], inputs,
                          output_gradients=[tf.cast(_zeros_if_none(g_gate, gate), tf.float32),
                                            tf.cast(_zeros_if_none(g_up, gate), tf.float32)])
    return tuple(tf.cast(_zeros_if_none(d, t), t.dtype) for d, t in zip(grads, op.inputs))


def _zeros_if_none(g, like):
    return tf.zeros_like(like) if g is None else g
