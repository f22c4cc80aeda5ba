"""tfmetal_ext.ops.gated_activation_grad (TfmetalExt>GatedActivationGrad): the backward of
``y = act(gate) * up``, ``d_gate = dy * up * act'(gate)`` and ``d_up = dy * act(gate)``.

The CPU kernel and the pure-TF reference against float64 numpy, against TensorFlow's own autodiff of
``act(gate) * up``, its second-order gradient, and its arguments.

Tolerances, derived from test_activation_grad.py's (u = 2^-24; numpy computes in float64 from the very
T-rounded inputs the op gets):

- d_gate is ActivationGrad's ``dy' * act'(gate)`` with ``dy' = dy * up`` rounded to float32 first:
  that bound with |dy * up| for |dy|, plus u |dy * up| M (the extra rounding, at most M times).
- d_up = dy * (gate * f(gate)), f = sigmoid(gate) (silu), Phi(gate) (gelu), sigmoid(2w) (tanh gelu,
  w = c (x + k x^3)): f's chain is ~6 float32 operations (an exp within ~2 ulps, a division, the
  selects), each rounding at the size of f (or of 1 where Phi = 1 - erfc / 2 is formed), and an exp
  whose argument is rounded: K = 1 + x^2 / 2 (gelu's erfc), 1 + 2|w| (tanh gelu), 1 (silu: -|x| is
  exact). So 16 u (f K + [gelu] 1) + A (gelu's erfc: 6e-8), times |dy * gate|, plus the two products'
  roundings (in the 16 u), a 2^-120 floor for subnormal intermediates times |dy * gate|, then the
  rounding to T (2^-p of the value, and half float16's subnormal step).
"""

import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import ops, testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _reference

pytestmark = pytest.mark.no_keras

gated_module = importlib.import_module("tfmetal_ext.ops.activation_grad")
gated_activation_grad = ops.gated_activation_grad


def _load_op_tests():
    # The ActivationGrad bounds live once, in its test file (loaded by path: tests/ is no package).
    spec = importlib.util.spec_from_file_location("activation_grad_op_tests",
                                                  Path(__file__).with_name("test_activation_grad.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


A = _load_op_tests()
ACTIVATIONS, DTYPES, PRECISION, U = A.ACTIVATIONS, A.DTYPES, A.PRECISION, A.U
C, K = A.C, A.K


def lib():
    return testing.compiled_ops()


np_factor = testing.np_activation_factor
np_gated = testing.np_gated_activation_grad


def tolerances(dy, gate, up, want, activation, dtype):
    dy, gate, up = (np.asarray(t, np.float64) for t in (dy, gate, up))
    dyu = np.abs(dy * up)
    m, k, _, _ = A.error_terms(gate, activation)
    err_gate = dyu * (A.float32_error_bound(gate, activation) + U * m * k)
    x = np.clip(gate, -128.0, 128.0)
    f = np_factor(x, activation)
    if activation == "silu":
        kk, extra = 1.0, 0.0
    elif activation == "gelu":
        kk, extra = 1.0 + 0.5 * x * x, 1.0 + 6e-8 / (16 * U)
    else:
        kk, extra = 1.0 + 2.0 * np.abs(C * (x + K * x ** 3)), 0.0
    with np.errstate(invalid="ignore"):
        err_up = np.abs(dy * gate) * (16 * U * (f * kk + extra) + 2.0 ** -120)
    out = []
    for err, w in zip((err_gate, err_up), want):
        rounding = 2.0 ** -PRECISION[dtype] * (np.abs(w) + err)
        out.append(err + rounding + (2.0 ** -25 if dtype == "float16" else 0.0))
    return out


def gated_inputs(shape, dtype, seed):
    dy, gate = A.inputs(shape, dtype, seed)
    up = np.random.default_rng(seed + 1).normal(0.0, 2.0, shape).astype(np.float32).astype(DTYPES[dtype])
    return dy, gate, up


def run(impl, dy, gate, up, activation):
    """The raw CPU kernel ('kernel') or the pure-TF reference ('reference')."""
    args = [tf.constant(t) for t in (dy, gate, up)]
    if impl == "kernel":
        out = lib().tfmetal_ext_gated_activation_grad(*args, activation=activation)
    else:
        out = _reference.gated_activation_grad(*args, activation)
    return tuple(t.numpy() for t in out)


def check(got, dy, gate, up, activation, dtype):
    want = np_gated(dy, gate, up, activation)
    for g, w, tol, what in zip(got, want, tolerances(dy, gate, up, want, activation, dtype), ("d_gate", "d_up")):
        assert g.dtype == np.dtype(DTYPES[dtype]) and g.shape == np.shape(gate), what
        A.assert_close(g, w, tol)


# ----------------------------------------------------------------------------
# Values against float64 numpy.


def test_op_lists_the_activation_grad_activations():
    from tensorflow.python.framework import op_def_registry

    lib()
    assert fusion.GATED_ACTIVATION_GRAD_OP in fusion.CUSTOM_OPS["activation_grad"].op_names
    attr = next(a for a in op_def_registry.get(fusion.GATED_ACTIVATION_GRAD_OP).attr if a.name == "activation")
    assert tuple(v.decode() for v in attr.allowed_values.list.s) == fusion.ACTIVATION_GRAD_ACTIVATIONS


@pytest.mark.cover_axes("dtype", "activation")
@pytest.mark.parametrize("shape", A.SHAPES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_matches_float64_numpy(impl, activation, dtype, shape):
    dy, gate, up = gated_inputs(shape, dtype, seed=len(shape) + 10 * ACTIVATIONS.index(activation))
    check(run(impl, dy, gate, up, activation), dy, gate, up, activation, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_wide_range_float32(activation):
    mags = np.geomspace(1e-3, 200.0, 2001)
    gate = np.concatenate([mags, -mags]).astype(np.float32)
    dy = np.ones_like(gate)
    up = np.full_like(gate, -1.5)
    check(run("kernel", dy, gate, up, activation), dy, gate, up, activation, "float32")


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_empty(impl):
    for shape in [(0,), (3, 0, 2)]:
        z = np.zeros(shape, np.float32)
        for activation in ACTIVATIONS:
            d_gate, d_up = run(impl, z, z, z, activation)
            assert d_gate.shape == shape and d_up.shape == shape


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_nan_and_infinities(impl, dtype):
    np_dtype = DTYPES[dtype]
    gate = np.array([np.nan, 1.0, 1.0, np.inf, -np.inf, 0.5], np.float32).astype(np_dtype)
    dy = np.array([1.0, np.nan, 1.0, 2.0, 2.0, 1.0], np.float32).astype(np_dtype)
    up = np.array([1.0, 1.0, np.nan, 3.0, 3.0, np.inf], np.float32).astype(np_dtype)
    for activation in ACTIVATIONS:
        d_gate, d_up = (t.astype(np.float32) for t in run(impl, dy, gate, up, activation))
        assert np.isnan(d_gate[:3]).all() and np.isnan(d_up[:2]).all(), activation  # NaN anywhere
        assert d_gate[3] == 6.0 and d_gate[4] == 0.0, activation  # act' at +-inf: its limits 1 and 0
        # act(+inf) = inf; act(-inf) = -inf * 0, NaN, as TensorFlow's forward formulas give.
        assert d_up[3] == np.inf and np.isnan(d_up[4]), activation
        assert d_gate[5] == np.inf and np.isfinite(d_up[5]), activation  # up = inf reaches d_gate only


# ----------------------------------------------------------------------------
# Against TensorFlow's autodiff of act(gate) * up.


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_agrees_with_tensorflows_autodiff(activation):
    fns = {"silu": tf.nn.silu, "gelu": lambda v: tf.nn.gelu(v, approximate=False),
           "gelu_approximate": lambda v: tf.nn.gelu(v, approximate=True)}
    rng = np.random.default_rng(11)
    gate = np.concatenate([rng.normal(0.0, 3.0, 1500), np.linspace(-20, 20, 401)]).astype(np.float32)
    up = rng.normal(0.0, 2.0, gate.shape).astype(np.float32)
    dy = rng.normal(0.0, 1.0, gate.shape).astype(np.float32)
    g, u = tf.constant(gate), tf.constant(up)
    with tf.GradientTape() as tape:
        tape.watch([g, u])
        y = fns[activation](g) * u
    theirs = [t.numpy().astype(np.float64) for t in tape.gradient(y, [g, u], output_gradients=tf.constant(dy))]
    ours = run("kernel", dy, gate, up, activation)
    want = np_gated(dy, gate, up, activation)
    tols = tolerances(dy, gate, up, want, activation, "float32")
    # TF's float32 evaluation is within the same kind of bound of the exact values (ActivationGrad's
    # tf_formula bound for d_gate; for d_up its own act(x), a handful of roundings at act's size).
    tf_gate = np.abs(dy * up) * A.float32_error_bound(gate, activation, tf_formula=True) + 4 * U * np.abs(theirs[0])
    tf_up = 16 * U * np.abs(dy * gate) * (1.0 + np.abs(gate)) + 4 * U * np.abs(theirs[1])
    A.assert_close(ours[0], theirs[0], tols[0] + tf_gate + 2 * U * np.abs(theirs[0]))
    A.assert_close(ours[1], theirs[1], tols[1] + tf_up)


# ----------------------------------------------------------------------------
# The op's gradient (second order).


def _reference_grads_float64(gg, gu, dy, gate, up, activation):
    ins = [tf.constant(t, tf.float64) for t in (dy, gate, up)]
    with tf.GradientTape() as tape:
        tape.watch(ins)
        d_gate, d_up = _reference.gated_activation_grad_terms(*ins, activation)
    out = tape.gradient([d_gate, d_up], ins, output_gradients=[tf.constant(gg, tf.float64), tf.constant(gu, tf.float64)])
    return [t.numpy() for t in out]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_second_order_gradient(activation, mode):
    rng = np.random.default_rng(9)
    shape = (4, 11)
    gate = rng.normal(0.0, 2.0, shape).astype(np.float32)
    gate[0, :3] = [0.0, -0.0, 7.5]
    dy, up, gg, gu = (rng.normal(0.0, 1.0, shape).astype(np.float32) for _ in range(4))

    def grads(dy, gate, up, gg, gu):
        with tf.GradientTape() as tape:
            tape.watch([dy, gate, up])
            d_gate, d_up = lib().tfmetal_ext_gated_activation_grad(dy, gate, up, activation=activation)
        return tape.gradient([d_gate, d_up], [dy, gate, up], output_gradients=[gg, gu])

    fn = tf.function(grads) if mode == "function" else grads
    got = [t.numpy().astype(np.float64) for t in fn(*(tf.constant(t) for t in (dy, gate, up, gg, gu)))]
    want = _reference_grads_float64(gg, gu, dy, gate, up, activation)
    # float32 autodiff of the same formula: terms of act' and act'' (ActivationGrad's second-order
    # bound, 48 u M K (1 + |x|)^2) times the other factors' magnitudes.
    m, k, _, _ = A.error_terms(gate, activation)
    scale = (np.abs(gg) * (np.abs(dy) + np.abs(up) + np.abs(dy * up)) + np.abs(gu) * (np.abs(dy) + 1.0))
    bound = scale * 48 * U * m * k * (1.0 + np.abs(gate)) ** 2
    for g, w in zip(got, want):
        A.assert_close(g, w, bound + 4 * U * np.abs(w))


# ----------------------------------------------------------------------------
# Shapes and arguments.


def test_raw_op_rejects_mismatched_shapes():
    op = lib().tfmetal_ext_gated_activation_grad
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dy and gate must have the same shape, got \[2,3\] and \[3,2\]"):
        op(tf.zeros([2, 3]), tf.zeros([3, 2]), tf.zeros([3, 2]), activation="silu")

    @tf.function(input_signature=[tf.TensorSpec([None, None])] * 3)
    def unknown(dy, gate, up):
        return op(dy, gate, up, activation="gelu")

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"up and gate must have the same shape, got \[2,4\] and \[2,3\]"):
        unknown(tf.zeros([2, 3]), tf.zeros([2, 3]), tf.zeros([2, 4]))

    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([3, None]), tf.TensorSpec(None)])
    def merged(dy, gate, up):
        return op(dy, gate, up, activation="silu")

    assert [t.shape.as_list() for t in merged.get_concrete_function().structured_outputs] == [[3, 5], [3, 5]]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_python_wrapper_eager_and_function(impl, monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if impl == "reference" else "0")
    assert gated_module.uses_kernel() is (impl == "kernel")
    dy, gate, up = gated_inputs((4, 9), "float32", seed=3)
    want = np_gated(dy, gate, up, "silu")
    tols = tolerances(dy, gate, up, want, "silu", "float32")
    for got in (gated_activation_grad(dy, gate, up, "swish"),
                tf.function(lambda *a: gated_activation_grad(*a, "silu"))(*(tf.constant(t) for t in (dy, gate, up)))):
        for g, w, tol in zip(got, want, tols):
            A.assert_close(g.numpy(), w, tol)
    fn = tf.function(lambda *a: gated_activation_grad(*a, "silu"))
    graph = fn.get_concrete_function(*(tf.constant(t) for t in (dy, gate, up))).graph
    assert (fusion.GATED_ACTIVATION_GRAD_OP in {n.type for n in graph.get_operations()}) is (impl == "kernel")


def test_bad_arguments_are_value_errors():
    one = tf.ones([2])
    with pytest.raises(ValueError, match=r"Argument `activation` must be one of .*Received: activation='relu'"):
        gated_activation_grad(one, one, one, "relu")
    with pytest.raises(ValueError, match=r"`gate` must be float32, float16 or bfloat16. Received: gate.dtype=float64"):
        gated_activation_grad(one, tf.ones([2], tf.float64), one, "silu")
    with pytest.raises(ValueError, match=r"same dtype. Received: up.dtype=float16, gate.dtype=float32"):
        gated_activation_grad(one, one, tf.ones([2], tf.float16), "gelu")
    with pytest.raises(ValueError, match=r"same shape. Received: dy.shape=\(3,\), gate.shape=\(2,\)"):
        gated_activation_grad(tf.ones([3]), one, one, "gelu")


def test_placement_prediction_reads_the_custom_activation_grad_rows():
    from tfmetal_ext.backends import registry
    from tfmetal_ext.inspect import predict

    lib()
    for dtype in ("float32", "float16", "bfloat16"):
        assert predict.judge(registry.TABLES["metal"], fusion.GATED_ACTIVATION_GRAD_OP, {"T": dtype}) is None
    for dtype in ("float32", "float16"):
        assert predict.judge(registry.TABLES["metal_plugin"], fusion.GATED_ACTIVATION_GRAD_OP, {"T": dtype}) is None
