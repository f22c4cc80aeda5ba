"""tfmetal_ext.ops.activation_grad (TfmetalExt>ActivationGrad): the CPU kernel and the pure-TF
reference against float64 numpy, against TensorFlow's own autodiff, and its second-order gradient.

Tolerances, derived (u = 2^-24, float32's unit roundoff; numpy computes in float64 from the very
T-rounded inputs the op gets, so only the op's own arithmetic counts):

- The float32 evaluation (tfmetal/activation_grad.h; the reference is the same formula in TF ops)
  is a chain of at most ~12 float32 operations (exp/erf within an ulp or two each), every one
  rounding at a magnitude bounded by M(x), the sum of the absolute values of the formula's terms:
    silu              M = s (1 + |x|)                       (s = sigmoid(x); 1 - s rounds at the
                                                             size of s, times |x|)
    gelu              M = 1 + |x| phi(x)                    (1 + erf rounds at magnitude 1: in the
                                                             left tail Phi is only accurate to ~u)
    gelu_approximate  M = s + 2 |x| s (1 - s) c (1 + 3k x^2) (s = sigmoid(2w), w = c (x + k x^3))
  So 16 u M, times K(x) for an exp whose argument is itself rounded: exp(a (1 + d)) is off by
  |a| d relative, a = x^2 / 2 (gelu's phi) or 2|w| (the tanh form's e), d <= 3u: K = 1 + x^2 / 2
  or 1 + 2|w| (1 for silu, whose argument -x is exact).
- gelu's erf is tfm_int8_erf (erfc with fractional error < 1.2e-7, erfc <= 1 where it is used), so
  Phi = 0.5 (1 + erf) is off by at most 6e-8 more: A = 6e-8 (TF's erf in the reference is better).
- Subnormal intermediates (exp near float32's underflow) are exact to 2^-149 absolute, times the
  multipliers that follow (<= 1 + |x| + 2 |x| c (1 + 3k x^2)): a floor of 2^-120 times that.
- All of that is times |dy| (one more rounding: in the 16 u). Then one rounding to T: half an ulp,
  <= 2^-p |dx| (p = 24, 11, 8 for float32, float16, bfloat16), plus half float16's subnormal step
  (2^-25).
Against TensorFlow's autodiff (float32) the bound is ours plus the same for TF's formula, whose
tanh form rounds 1 - t^2 at magnitude 1: M_tf = 0.5 (1 + |t|) + 0.5 |x| (1 + t^2) c (1 + 3k x^2).
"""

import contextlib
import importlib
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import ops, testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _reference

activation_grad_module = importlib.import_module("tfmetal_ext.ops.activation_grad")

activation_grad = ops.activation_grad
ACTIVATIONS = list(fusion.ACTIVATION_GRAD_ACTIVATIONS)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
PRECISION = {"float32": 24, "float16": 11, "bfloat16": 8}
U = 2.0 ** -24
C, K = math.sqrt(2.0 / math.pi), 0.044715
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 5)]
HEADER = Path(__file__).resolve().parents[2] / "custom_ops" / "include" / "tfmetal" / "activation_grad.h"

pytestmark = pytest.mark.no_keras


def lib():
    return testing.compiled_ops()


# ----------------------------------------------------------------------------
# The derived tolerance (module docstring).


def _sigmoid(v):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def error_terms(x, activation, tf_formula=False):
    """(M, K, A, multipliers) of the module docstring, per element."""
    x = np.clip(np.asarray(x, np.float64), -128.0, 128.0)  # the header's saturation: exact 1 / 0 beyond
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    if activation == "silu":
        m, k, a = _sigmoid(x) * (1.0 + np.abs(x)), 1.0, 0.0
        mult = 1.0 + np.abs(x)
    elif activation == "gelu":
        m, k, a = 1.0 + np.abs(x) * phi, 1.0 + 0.5 * x * x, 6e-8
        mult = 1.0 + np.abs(x)
    else:
        w = C * (x + K * x ** 3)
        s = _sigmoid(2.0 * w)
        poly = C * (1.0 + 3.0 * K * x * x)
        if tf_formula:
            t = np.tanh(w)
            m = 0.5 * (1.0 + np.abs(t)) + 0.5 * np.abs(x) * (1.0 + t * t) * poly
        else:
            m = s + 2.0 * np.abs(x) * s * (1.0 - s) * poly
        k, a = 1.0 + 2.0 * np.abs(w), 0.0
        mult = 1.0 + 2.0 * np.abs(x) * poly
    return m, k, a, mult


def float32_error_bound(x, activation, tf_formula=False):
    """Per element, the bound on |float32 act'(x) - act'(x)| (before the |dy| factor)."""
    m, k, a, mult = error_terms(x, activation, tf_formula)
    return 16 * U * m * k + a + 2.0 ** -120 * mult


def tolerance(dy, x, want, activation, dtype):
    """|dy| times the float32 bound, plus the final rounding to `dtype`."""
    err32 = np.abs(np.asarray(dy, np.float64)) * float32_error_bound(x, activation)
    rounding = 2.0 ** -PRECISION[dtype] * (np.abs(want) + err32)
    return err32 + rounding + (2.0 ** -25 if dtype == "float16" else 0.0)


def assert_close(got, want, tol):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = np.isnan(want) | (got == want) | (np.abs(got - want) <= tol)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (f"{bad.size} of {ok.size} outside the derived bound, e.g. got {got.ravel()[bad[:4]]} "
                           f"want {want.ravel()[bad[:4]]} tol {np.broadcast_to(tol, want.shape).ravel()[bad[:4]]}")


def inputs(shape, dtype, seed, scale=3.0):
    """x: normal * scale (both tails, the derivatives' roots near -2.4 and -0.75), plus -0.0 and the roots."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, scale, shape).astype(np.float32)
    special = np.array([-0.0, 0.0, -2.3994, -0.7518, -0.7564, 5.0, -5.0, 12.0, -12.0], np.float32)
    flat = x.reshape(-1)
    flat[: min(flat.size, special.size)] = special[: flat.size]
    dy = rng.normal(0.0, 1.0, shape).astype(np.float32)
    return dy.astype(DTYPES[dtype]), x.astype(DTYPES[dtype])


def run(impl, dy, x, activation):
    """The raw CPU kernel ('kernel') or the pure-TF reference ('reference')."""
    if impl == "kernel":
        return lib().tfmetal_ext_activation_grad(tf.constant(dy), tf.constant(x), activation=activation).numpy()
    return _reference.activation_grad(tf.constant(dy), tf.constant(x), activation).numpy()


# ----------------------------------------------------------------------------
# Values against float64 numpy.


def test_the_ops_attribute_lists_the_python_tuple():
    """fusion.ACTIVATION_GRAD_ACTIVATIONS (the one Python list) is the op's attribute's list, in the codes' order."""
    from tensorflow.python.framework import op_def_registry

    lib()
    attr = next(a for a in op_def_registry.get(fusion.ACTIVATION_GRAD_OP).attr if a.name == "activation")
    assert tuple(v.decode() for v in attr.allowed_values.list.s) == fusion.ACTIVATION_GRAD_ACTIVATIONS
    header = HEADER.read_text()
    for code, name in enumerate(fusion.ACTIVATION_GRAD_ACTIVATIONS):
        assert f"#define TFM_ACTGRAD_{name.upper()} {code}" in header


@pytest.mark.cover_axes("dtype", "activation")  # each dtype's rounding and each activation's formula
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_matches_float64_numpy(impl, activation, dtype, shape):
    dy, x = inputs(shape, dtype, seed=len(shape) + 10 * ACTIVATIONS.index(activation))
    got = run(impl, dy, x, activation)
    assert got.dtype == DTYPES[dtype] and got.shape == x.shape
    want = testing.np_smooth_activation_grad(dy.astype(np.float64), x.astype(np.float64), activation)
    assert_close(got, want, tolerance(dy, x, want, activation, dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_wide_range_float32(activation):
    # Every binade that matters, both signs: the tails where exp underflows, saturation, subnormal results.
    mags = np.geomspace(1e-3, 200.0, 4001)
    x = np.concatenate([mags, -mags]).astype(np.float32)
    dy = np.ones_like(x)
    got = run("kernel", dy, x, activation)
    want = testing.np_smooth_activation_grad(dy, x.astype(np.float64), activation)
    assert_close(got, want, tolerance(dy, x, want, activation, "float32"))


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 4)])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_empty(impl, shape):
    for activation in ACTIVATIONS:
        got = run(impl, np.zeros(shape, np.float32), np.zeros(shape, np.float32), activation)
        assert got.shape == shape and got.dtype == np.float32


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_nan_and_infinities(impl, dtype):
    np_dtype = DTYPES[dtype]
    x = np.array([np.nan, 1.0, np.inf, -np.inf, np.inf, -np.inf, 0.5], np.float32).astype(np_dtype)
    dy = np.array([1.0, np.nan, 3.0, 3.0, np.inf, np.inf, np.inf], np.float32).astype(np_dtype)
    for activation in ACTIVATIONS:
        got = run(impl, dy, x, activation).astype(np.float32)
        assert np.isnan(got[0]) and np.isnan(got[1]), activation  # NaN in x or dy
        assert got[2] == 3.0 and got[3] == 0.0, activation  # the derivative's limits 1 and 0
        assert got[4] == np.inf and np.isnan(got[5]), activation  # inf * 1, inf * 0
        assert got[6] == np.inf, activation  # act'(0.5) > 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_large_finite_x_saturates_without_nan(impl, dtype):
    big = float(np.finfo(DTYPES[dtype]).max) if dtype != "bfloat16" else 3.0e38
    x = np.array([-100.0, 100.0, -50.0, 50.0, -128.5, 1e4, -1e4, big, -big], np.float32).astype(DTYPES[dtype])
    dy = np.ones_like(x)
    for activation in ACTIVATIONS:
        got = run(impl, dy, x, activation).astype(np.float64)
        assert np.isfinite(got).all(), (activation, got)
        np.testing.assert_array_equal(got[[1, 3, 5, 7]], 1.0)  # x = 100, 50, 1e4, max: exactly 1
        # x = -100, -128.5, -1e4, -max: 0 (silu's -3.7e-42 at -100 is a float32 subnormal, within 2^-120).
        assert np.all(np.abs(got[[0, 4, 6, 8]]) < 2.0 ** -120), (activation, got)
        want = testing.np_smooth_activation_grad(dy, x.astype(np.float64), activation)
        assert_close(got, want, tolerance(dy, x, want, activation, dtype))  # x = -50: silu's -9.45e-21


# ----------------------------------------------------------------------------
# Shapes and arguments.


def test_raw_op_rejects_mismatched_shapes():
    op = lib().tfmetal_ext_activation_grad
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dy and x must have the same shape, got \[2,3\] and \[3,2\]"):
        op(tf.zeros([2, 3]), tf.zeros([3, 2]), activation="silu")
    with pytest.raises(tf.errors.InvalidArgumentError, match="same shape"):
        op(tf.zeros([6]), tf.zeros([2, 3]), activation="gelu")

    @tf.function(input_signature=[tf.TensorSpec([None, None]), tf.TensorSpec([None, None])])
    def unknown(dy, x):
        return op(dy, x, activation="gelu_approximate")

    assert unknown.get_concrete_function().structured_outputs.shape.as_list() == [None, None]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got \[2,3\] and \[2,4\]"):
        unknown(tf.zeros([2, 3]), tf.zeros([2, 4]))

    @tf.function(input_signature=[tf.TensorSpec(None), tf.TensorSpec(None)])
    def unknown_rank(dy, x):
        return op(dy, x, activation="silu")

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got \[4\] and \[\]"):
        unknown_rank(tf.zeros([4]), tf.zeros([]))


def test_shape_function_merges_dy_and_x():
    op = lib().tfmetal_ext_activation_grad

    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([3, None])])
    def merged(dy, x):
        return op(dy, x, activation="silu")

    assert merged.get_concrete_function().structured_outputs.shape.as_list() == [3, 5]

    @tf.function
    def static_mismatch():
        return op(tf.zeros([2, 3]), tf.zeros([3, 2]), activation="silu")

    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="must be equal|incompatible"):
        static_mismatch.get_concrete_function()


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_python_wrapper_eager_and_function(impl, monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if impl == "reference" else "0")
    assert activation_grad_module.uses_kernel() is (impl == "kernel")
    dy, x = inputs((4, 9), "float32", seed=3)
    want = testing.np_smooth_activation_grad(dy, x.astype(np.float64), "silu")
    tol = tolerance(dy, x, want, "silu", "float32")
    assert_close(activation_grad(dy, x, "swish").numpy(), want, tol)  # the alias
    fn = tf.function(lambda dy, x: activation_grad(dy, x, "silu"))
    assert_close(fn(tf.constant(dy), tf.constant(x)).numpy(), want, tol)
    ops_in_graph = {n.type for n in fn.get_concrete_function(tf.constant(dy), tf.constant(x)).graph.get_operations()}
    assert (fusion.ACTIVATION_GRAD_OP in ops_in_graph) is (impl == "kernel")


@pytest.mark.parametrize("bad", ["relu", "gelu_tanh", None, 3, "SILU"])
def test_unknown_activation_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"Argument `activation` must be one of .*Received: activation="):
        activation_grad(tf.ones([2]), tf.ones([2]), bad)


def test_bad_dtypes_and_shapes_are_value_errors():
    with pytest.raises(ValueError, match=r"`x` must be float32, float16 or bfloat16. Received: x.dtype=float64"):
        activation_grad(tf.ones([2], tf.float64), tf.ones([2], tf.float64), "silu")
    with pytest.raises(ValueError, match=r"Received: dy.dtype=int32"):
        activation_grad(tf.ones([2], tf.int32), tf.ones([2]), "silu")
    with pytest.raises(ValueError, match=r"same dtype. Received: dy.dtype=float16, x.dtype=float32"):
        activation_grad(tf.ones([2], tf.float16), tf.ones([2]), "gelu")
    with pytest.raises(ValueError, match=r"same shape. Received: dy.shape=\(2, 3\), x.shape=\(3, 2\)"):
        activation_grad(tf.ones([2, 3]), tf.ones([3, 2]), "gelu")


@contextlib.contextmanager
def _avoided(name):
    import tfmetal_ext

    tfmetal_ext.configure("float32", avoid_fusions=[name])
    try:
        yield
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=[])


def test_avoided_runs_the_reference():
    with _avoided("activation_grad"):
        assert not activation_grad_module.uses_kernel()
        fn = tf.function(lambda dy, x: activation_grad(dy, x, "gelu"))
        graph_ops = {n.type for n in fn.get_concrete_function(tf.ones([3]), tf.ones([3])).graph.get_operations()}
        assert fusion.ACTIVATION_GRAD_OP not in graph_ops and "Erf" in graph_ops
    assert activation_grad_module.uses_kernel()


# ----------------------------------------------------------------------------
# TensorFlow's own autodiff.


def _tf_autodiff(x, activation):
    fns = {"silu": tf.nn.silu, "gelu": lambda v: tf.nn.gelu(v, approximate=False),
           "gelu_approximate": lambda v: tf.nn.gelu(v, approximate=True)}
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fns[activation](x)
    return tape.gradient(y, x).numpy()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_agrees_with_tensorflows_autodiff(activation):
    # Within both float32 bounds: ours and TF's formula's (module docstring). Finite x only: at
    # +-inf (and |x| > ~7e12 for the tanh form) TF's autodiff gives NaN, we the limits.
    x = np.concatenate([np.random.default_rng(5).normal(0.0, 3.0, 2000), np.linspace(-20, 20, 401)]).astype(np.float32)
    ones = np.ones_like(x)
    got = run("kernel", ones, x, activation).astype(np.float64)
    theirs = _tf_autodiff(x, activation).astype(np.float64)
    tol = 2.0 * float32_error_bound(x, activation) + float32_error_bound(x, activation, tf_formula=True) + \
        2.0 ** -24 * np.abs(theirs)
    assert_close(got, theirs, tol)
    with np.errstate(invalid="ignore"):
        edge = np.array([np.inf, -np.inf], np.float32)
        assert np.isnan(_tf_autodiff(edge, activation)).all()  # TF: inf * 0 (the documented difference)
    np.testing.assert_array_equal(run("kernel", np.ones(2, np.float32), edge, activation), [1.0, 0.0])


# ----------------------------------------------------------------------------
# The op's gradient (second order).


def _reference_grads_float64(g, dy, x, activation):
    """(d/d dy, d/dx) of sum(g * dy * act'(x)) by autodiff of the reference formula in float64."""
    dy64, x64 = tf.constant(dy, tf.float64), tf.constant(x, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([dy64, x64])
        out = dy64 * _reference.activation_derivative(x64, activation)
    return [t.numpy() for t in tape.gradient(out, [dy64, x64], output_gradients=tf.constant(g, tf.float64))]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_second_derivative_matches_finite_differences(activation):
    # The float64 reference's autodiff (what the op's gradient tapes, in float32) is act'':
    # central differences of numpy's act' (h = 1e-5: truncation ~h^2 |act''''| < 1e-9, roundoff ~1e-11).
    x = np.linspace(-6.0, 6.0, 241)
    _, d_x = _reference_grads_float64(np.ones_like(x), np.ones_like(x), x, activation)
    h = 1e-5
    fd = (testing.np_activation_grad(activation, x + h) - testing.np_activation_grad(activation, x - h)) / (2 * h)
    np.testing.assert_allclose(d_x, fd, rtol=0, atol=1e-8)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_second_order_gradient(activation, mode):
    rng = np.random.default_rng(7)
    x = rng.normal(0.0, 2.0, (5, 13)).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 7.5]  # the tanh form's select on u < 0 (autodiff at 0), a tail
    dy = rng.normal(0.0, 1.0, x.shape).astype(np.float32)
    g = rng.normal(0.0, 1.0, x.shape).astype(np.float32)

    def grads(dy, x, g):
        with tf.GradientTape() as tape:
            tape.watch([dy, x])
            out = lib().tfmetal_ext_activation_grad(dy, x, activation=activation)
        return tape.gradient(out, [dy, x], output_gradients=g)

    fn = tf.function(grads) if mode == "function" else grads
    d_dy, d_x = (t.numpy().astype(np.float64) for t in fn(tf.constant(dy), tf.constant(x), tf.constant(g)))
    want_dy, want_x = _reference_grads_float64(g, dy, x, activation)
    # d/d dy is the op itself on (g, x): its bound. d/dx is float32 autodiff of the same formula:
    # act'' has the terms of act' times at most (1 + |x|)^2 more (the tanh form's x^2 factor and its
    # derivative), evaluated with ~3x the operations: 48 u M K (1 + |x|)^2 |g dy|.
    assert_close(d_dy, want_dy, tolerance(g, x, want_dy, activation, "float32"))
    m, k, _, _ = error_terms(x, activation)
    assert_close(d_x, want_x, np.abs(g * dy) * 48 * U * m * k * (1.0 + np.abs(x)) ** 2 + U * np.abs(want_x))


# ----------------------------------------------------------------------------
# Where its kernels run, as placement prediction reads the backend tables.


def test_placement_prediction_reads_the_custom_activation_grad_rows():
    from tfmetal_ext.backends import registry
    from tfmetal_ext.inspect import predict

    lib()  # its CPU kernel registered: a dtype without a GPU kernel falls back, it does not fail
    for dtype in ("float32", "float16", "bfloat16"):
        assert predict.judge(registry.TABLES["metal"], fusion.ACTIVATION_GRAD_OP, {"T": dtype}) is None
    for dtype in ("float32", "float16"):
        assert predict.judge(registry.TABLES["metal_plugin"], fusion.ACTIVATION_GRAD_OP, {"T": dtype}) is None
    outcome, dtype, _ = predict.judge(registry.TABLES["metal_plugin"], fusion.ACTIVATION_GRAD_OP, {"T": "bfloat16"})
    assert (outcome, dtype) == (predict.FALLBACK, "bfloat16")  # the open plugin has no bfloat16 at all
