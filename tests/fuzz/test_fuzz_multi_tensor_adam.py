"""Hypothesis fuzzing of `tfmetal_ext.ops.multi_tensor_adam` with random lists of variables.

Expected values: a float64 textbook Adam (AMSGrad, decoupled weight decay)
written here, several steps. Bad calls (a gradient of the wrong shape seen
only at run time under `tf.function`, a variable passed twice, mismatched
lists) must raise and leave every variable and slot bitwise unchanged.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import multi_tensor_adam

from ._tally import expect_error, expect_ok, fuzz_settings, MODES

FUZZ = fuzz_settings(10)
# Relative tolerance on the steps taken (their path length; float32 statistics of a few steps), per dtype.
# float16/bfloat16 round every intermediate (v underflows for small gradients), so a float64 Adam
# bounds them only loosely; tests/ops/test_multi_tensor_adam.py checks them bitwise.
TOLERANCE = {"float32": 1e-4}
DTYPES = {"float32": tf.float32}
LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-3


def numpy_adam64(w, m, v, vhat, g, step, amsgrad, wd):
    """One Adam step in float64 (step counts from 1)."""
    b1p, b2p = B1**step, B2**step
    alpha = LR * np.sqrt(1 - b2p) / (1 - b1p)
    if wd is not None:
        w = w - w * wd
    m = m + (g - m) * (1 - B1)
    v = v + (g * g - v) * (1 - B2)
    if amsgrad:
        vhat = np.maximum(vhat, v)
    w = w - m * alpha / (np.sqrt(vhat if amsgrad else v) + EPS)
    return w, m, v, vhat


_shapes = st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5), min_size=0, max_size=5)


@FUZZ
@given(data=st.data(), amsgrad=st.booleans(), wd=st.sampled_from([None, 0.0, 1e-3]), steps=st.integers(1, 3))
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_multi_tensor_adam_matches_float64_numpy(impl, mode, dtype, data, amsgrad, wd, steps):
    tf_dtype = DTYPES[dtype]
    np_dtype = tf_dtype.as_numpy_dtype
    shapes = data.draw(_shapes, label="shapes")
    arrays = lambda label, lo, hi: [  # noqa: E731
        data.draw(hnp.arrays(np.float32, s, elements=st.floats(lo, hi, width=32)), label=f"{label}{i}")
        for i, s in enumerate(shapes)
    ]
    w0 = [a.astype(np_dtype) for a in arrays("w", -2, 2)]
    grads = [[a.astype(np_dtype) for a in arrays(f"g{k}_", -1, 1)] for k in range(steps)]
    ws = [tf.Variable(a) for a in w0]
    ms = [tf.Variable(tf.zeros(s, tf_dtype)) for s in shapes]
    vs = [tf.Variable(tf.zeros(s, tf_dtype)) for s in shapes]
    vhats = [tf.Variable(tf.zeros(s, tf_dtype)) for s in shapes] if amsgrad else None

    def update(gs, step):
        multi_tensor_adam(
            ws, ms, vs, gs, LR, B1, B2, EPS, B1**step, B2**step, vhats=vhats, weight_decay_rate=wd
        )

    fn = tf.function(update) if mode == "function" else update

    def call():
        for k in range(steps):
            fn([tf.constant(g) for g in grads[k]], float(k + 1))

    # The float64 result, and the path length sum_k |w_k - w_(k-1)| of each element: every step carries
    # its own float32 rounding (1 - beta2**t alone is ~1e-5 relative), which does not cancel when
    # steps in opposite directions cancel, so the bound scales with the path, not the net move.
    ref, paths = [], []
    for i in range(len(shapes)):
        w, m, v = w0[i].astype(np.float64), np.zeros(shapes[i]), np.zeros(shapes[i])
        vhat = np.zeros(shapes[i])
        path = np.zeros(shapes[i])
        for k in range(steps):
            w_prev = w
            w, m, v, vhat = numpy_adam64(w, m, v, vhat, grads[k][i].astype(np.float64), k + 1, amsgrad, wd)
            path = path + np.abs(w - w_prev)
        ref.append(w)
        paths.append(path)

    def verify(_):
        for i, (var, want) in enumerate(zip(ws, ref)):
            got = var.numpy().astype(np.float64)
            assert got.shape == want.shape
            tol = TOLERANCE[dtype] * (paths[i] + LR * 0.01) + np.abs(want) * float(np.finfo(np_dtype).eps)
            err = np.abs(got - want)
            assert np.all(err <= tol), f"variable {i} {shapes[i]}: max error {err.max()} ({dtype}, steps={steps})"

    expect_ok(call, verify)


def _setup(shapes):
    ws = [tf.Variable(np.random.default_rng(i).normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)]
    ms = [tf.Variable(np.full(s, 0.1, np.float32)) for s in shapes]
    vs = [tf.Variable(np.full(s, 0.2, np.float32)) for s in shapes]
    snapshot = lambda: [x.numpy().copy() for x in ws + ms + vs]  # noqa: E731
    return ws, ms, vs, snapshot


@FUZZ
@given(
    shapes=st.lists(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4), min_size=1, max_size=4),
    bad=st.data(),
)
def test_wrong_grad_shape_at_run_time_changes_nothing(impl, shapes, bad):
    ws, ms, vs, snapshot = _setup(shapes)
    i = bad.draw(st.integers(0, len(shapes) - 1), label="bad index")
    grads = [np.ones(s, np.float32) for s in shapes]
    grads[i] = np.ones(shapes[i][:-1] + (shapes[i][-1] + 1,), np.float32)
    specs = [tf.TensorSpec([None] * len(g.shape)) for g in grads]
    def update(*gs):
        multi_tensor_adam(ws, ms, vs, list(gs), LR, B1, B2, EPS, B1, B2)

    fn = tf.function(update, input_signature=specs)
    expect_error(lambda: fn(*grads), (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("which", ["variables", "ms", "vs", "cross"])
def test_duplicate_variable_changes_nothing(impl, mode, which):
    ws, ms, vs, snapshot = _setup([(3,), (3,), (2, 2)])
    lists = {"variables": list(ws), "ms": list(ms), "vs": list(vs)}
    if which == "cross":
        lists["ms"][1] = ws[0]  # a variable as its own slot
    else:
        lists[which][1] = lists[which][0]
    grads = [tf.ones([3]), tf.ones([3]), tf.ones([2, 2])]

    def call():
        multi_tensor_adam(lists["variables"], lists["ms"], lists["vs"], grads, LR, B1, B2, EPS, B1, B2)

    fn = tf.function(call) if mode == "function" else call
    expect_error(fn, (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


def test_mismatched_lists_change_nothing(impl):
    ws, ms, vs, snapshot = _setup([(3,), (2,)])
    grads = [tf.ones([3]), tf.ones([2])]
    expect_error(lambda: multi_tensor_adam(ws, ms[:1], vs, grads, LR, B1, B2, EPS, B1, B2), ValueError, snapshot)
    expect_error(lambda: multi_tensor_adam(ws, ms, vs, grads[:1], LR, B1, B2, EPS, B1, B2), ValueError, snapshot)
    expect_error(
        lambda: multi_tensor_adam(ws, ms, vs, [tf.ones([3]), tf.ones([3])], LR, B1, B2, EPS, B1, B2), ValueError, snapshot
    )
    expect_error(
        lambda: multi_tensor_adam(ws, ms, vs, [tf.ones([3], tf.int32), tf.ones([2])], LR, B1, B2, EPS, B1, B2),
        (ValueError, TypeError),
        snapshot,
    )
