"""Hypothesis fuzzing of `tfmetal_ext.ops.multi_tensor_rmsprop` with random lists of variables.

Expected values: Keras' RMSprop in float32 numpy, operation by operation (written here),
for the four variants (momentum or not, centered or not), several steps, compared bit for
bit: float32 numpy in Keras' op order, with ``1 - rho`` formed in double as Keras forms
it, is what TF computes eagerly. One exception, with its reason: the pure-TF fallback
inside a `tf.function` is Keras' ops after grappler, which rewrites ``x / sqrt(y)`` into
``x * rsqrt(y)`` (TF's CPU Rsqrt is not correctly rounded), so there it is compared to a
relative 1e-5 -- as Keras' own RMSprop in a tf.function would be. Bad calls (a gradient of
the wrong shape seen only at run time under `tf.function`, a variable passed twice,
mismatched lists) must raise and leave every variable and slot bitwise unchanged.

No subnormal draws: TF runs its CPU ops with denormals flushed to zero, which numpy does
not; tests/ops/test_multi_tensor_rmsprop.py compares that case with Keras directly.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import multi_tensor_rmsprop

from ._tally import expect_error, expect_ok, fuzz_settings

FUZZ = fuzz_settings(10)
LR, RHO, MOMENTUM, EPS = 0.01, 0.9, 0.5, 1e-7


def numpy_rmsprop32(w, v, m, mg, g, wd):
    """One RMSprop step (after decoupled decay `wd`) in float32, Keras' op order; m / mg None when unused."""
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if wd is not None:
            w = w - w * f(wd)
        v = f(RHO) * v + f(1.0 - RHO) * (g * g)
        if mg is not None:
            mg = f(RHO) * mg + f(1.0 - RHO) * g
            denominator = (v - mg * mg) + f(EPS)
        else:
            denominator = v + f(EPS)
        increment = (f(LR) * g) / np.sqrt(denominator)
        if m is not None:
            m = f(MOMENTUM) * m + increment
            w = w - m
        else:
            w = w - increment
    return w, v, m, mg


_shapes = st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5), min_size=0, max_size=5)


@FUZZ
@given(data=st.data(), wd=st.sampled_from([None, 0.0, 1e-3]), steps=st.integers(1, 3),
       momentum=st.booleans(), centered=st.booleans())
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_multi_tensor_rmsprop_matches_float32_numpy_bitwise(impl, mode, data, wd, steps, momentum, centered):
    shapes = data.draw(_shapes, label="shapes")
    arrays = lambda label, lo, hi: [  # noqa: E731
        data.draw(hnp.arrays(np.float32, s, elements=st.floats(lo, hi, width=32, allow_subnormal=False)),
                  label=f"{label}{i}")
        for i, s in enumerate(shapes)
    ]
    w0 = arrays("w", -2, 2)
    v0 = arrays("v", 0.25, 1)  # above mg**2: centered denominators stay positive
    m0 = arrays("m", -0.125, 0.125)
    mg0 = arrays("mg", -0.25, 0.25)
    grads = [arrays(f"g{k}_", -1, 1) for k in range(steps)]
    ws, vs = [tf.Variable(a) for a in w0], [tf.Variable(a) for a in v0]
    ms = [tf.Variable(a) for a in m0] if momentum else None
    mgs = [tf.Variable(a) for a in mg0] if centered else None

    def update(gs):
        multi_tensor_rmsprop(ws, vs, gs, LR, RHO, MOMENTUM, EPS, momentums=ms, average_gradients=mgs,
                             weight_decay_rate=wd)

    fn = tf.function(update) if mode == "function" else update

    def call():
        for k in range(steps):
            fn([tf.constant(g) for g in grads[k]])

    ref = []
    for i in range(len(shapes)):
        state = (w0[i], v0[i], m0[i] if momentum else None, mg0[i] if centered else None)
        for k in range(steps):
            state = numpy_rmsprop32(*state, grads[k][i], wd)
        ref.append(state)
    bitwise = impl == "kernel" or mode == "eager"

    def verify(_):
        for i, want in enumerate(ref):
            got = (ws[i], vs[i], ms[i] if momentum else None, mgs[i] if centered else None)
            for name, var, expected in zip(("var", "velocity", "momentum", "average_gradient"), got, want):
                if var is None:
                    continue
                value = var.numpy()
                assert value.shape == expected.shape
                if bitwise:
                    assert np.array_equal(value.view(np.uint32), expected.view(np.uint32)), (
                        f"{name} {i} {shapes[i]}: {np.count_nonzero(value != expected)} elements differ "
                        f"(steps={steps}, wd={wd}, momentum={momentum}, centered={centered})")
                else:
                    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=f"{name} {i}")

    expect_ok(call, verify)


def _setup(shapes):
    ws = [tf.Variable(np.random.default_rng(i).normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)]
    vs = [tf.Variable(np.full(s, 0.5, np.float32)) for s in shapes]
    ms = [tf.Variable(np.full(s, 0.1, np.float32)) for s in shapes]
    mgs = [tf.Variable(np.full(s, 0.2, np.float32)) for s in shapes]
    snapshot = lambda: [x.numpy().copy() for x in ws + vs + ms + mgs]  # noqa: E731
    return ws, vs, ms, mgs, snapshot


@FUZZ
@given(
    shapes=st.lists(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4), min_size=1, max_size=4),
    bad=st.data(),
)
def test_wrong_grad_shape_at_run_time_changes_nothing(impl, shapes, bad):
    ws, vs, ms, mgs, snapshot = _setup(shapes)
    i = bad.draw(st.integers(0, len(shapes) - 1), label="bad index")
    grads = [np.ones(s, np.float32) for s in shapes]
    grads[i] = np.ones(shapes[i][:-1] + (shapes[i][-1] + 1,), np.float32)
    specs = [tf.TensorSpec([None] * len(g.shape)) for g in grads]

    def update(*gs):
        multi_tensor_rmsprop(ws, vs, list(gs), LR, RHO, MOMENTUM, EPS, momentums=ms, average_gradients=mgs,
                             weight_decay_rate=1e-3)

    fn = tf.function(update, input_signature=specs)
    expect_error(lambda: fn(*grads), (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("which", ["variables", "velocities", "momentums", "cross"])
def test_duplicate_variable_changes_nothing(impl, mode, which):
    ws, vs, ms, mgs, snapshot = _setup([(3,), (3,), (2, 2)])
    lists = {"variables": list(ws), "velocities": list(vs), "momentums": list(ms), "average_gradients": list(mgs)}
    if which == "cross":
        lists["average_gradients"][1] = vs[1]  # a velocity as an average gradient
    else:
        lists[which][1] = lists[which][0]
    grads = [tf.ones([3]), tf.ones([3]), tf.ones([2, 2])]

    def call():
        multi_tensor_rmsprop(lists["variables"], lists["velocities"], grads, LR, RHO, MOMENTUM, EPS,
                             momentums=lists["momentums"], average_gradients=lists["average_gradients"])

    fn = tf.function(call) if mode == "function" else call
    expect_error(fn, (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


def test_mismatched_lists_change_nothing(impl):
    ws, vs, ms, mgs, snapshot = _setup([(3,), (2,)])
    grads = [tf.ones([3]), tf.ones([2])]
    call = lambda **kw: multi_tensor_rmsprop(**{  # noqa: E731
        "variables": ws, "velocities": vs, "grads": grads, "lr": LR, "rho": RHO, "momentum": MOMENTUM,
        "epsilon": EPS, **kw})
    expect_error(lambda: call(velocities=vs[:1]), ValueError, snapshot)
    expect_error(lambda: call(momentums=ms[:1]), ValueError, snapshot)
    expect_error(lambda: call(average_gradients=mgs[:1], momentums=ms), ValueError, snapshot)
    expect_error(lambda: call(grads=grads[:1]), ValueError, snapshot)
    expect_error(lambda: call(grads=[tf.ones([3]), tf.ones([3])]), ValueError, snapshot)
    expect_error(lambda: call(grads=[tf.ones([3], tf.int32), tf.ones([2])]), (ValueError, TypeError), snapshot)
