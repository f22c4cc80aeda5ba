"""Hypothesis fuzzing of `tfmetal_ext.ops.multi_tensor_lion` with random lists of variables.

Expected values: Keras' Lion in float32 numpy, operation by operation (written here),
several steps, compared bit for bit: Lion's step is lr * sign(...), so a float64
reference would disagree wherever a tiny blend's sign flips, while float32 numpy in
Keras' op order is exactly what TF computes. Bad calls (a gradient of the wrong shape
seen only at run time under `tf.function`, a variable passed twice, mismatched lists)
must raise and leave every variable and momentum bitwise unchanged.

No subnormal draws: TF runs its CPU ops with denormals flushed to zero (so a
subnormal momentum's sign is 0, in Keras as in the kernel), which numpy does not;
tests/ops/test_multi_tensor_lion.py compares that case with Keras directly.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tfmetal_ext.ops import multi_tensor_lion

from ._tally import expect_error, expect_ok, fuzz_settings

FUZZ = fuzz_settings(10)
LR, B1, B2 = 0.01, 0.9, 0.99


def numpy_lion32(w, m, g, wd):
    """One Lion step (after decoupled decay `wd`) in float32, Keras' op order."""
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        if wd is not None:
            w = w - w * f(wd)
        blend = m * f(B1) + g * (f(1) - f(B1))
        sign = np.where(blend > 0, f(1), np.where(blend < 0, f(-1), np.where(blend == 0, f(0), blend)))
        w = w - f(LR) * sign
        m = m * f(B2) + g * (f(1) - f(B2))
    return w.astype(np.float32), m.astype(np.float32)


_shapes = st.lists(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5), min_size=0, max_size=5)


@FUZZ
@given(data=st.data(), wd=st.sampled_from([None, 0.0, 1e-3]), steps=st.integers(1, 3))
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_multi_tensor_lion_matches_float32_numpy_bitwise(impl, mode, data, wd, steps):
    shapes = data.draw(_shapes, label="shapes")
    arrays = lambda label, lo, hi: [  # noqa: E731
        data.draw(hnp.arrays(np.float32, s, elements=st.floats(lo, hi, width=32, allow_subnormal=False)),
                  label=f"{label}{i}")
        for i, s in enumerate(shapes)
    ]
    w0 = arrays("w", -2, 2)
    m0 = arrays("m", -0.125, 0.125)
    grads = [arrays(f"g{k}_", -1, 1) for k in range(steps)]
    ws = [tf.Variable(a) for a in w0]
    ms = [tf.Variable(a) for a in m0]

    def update(gs):
        multi_tensor_lion(ws, ms, gs, LR, B1, B2, weight_decay_rate=wd)

    fn = tf.function(update) if mode == "function" else update

    def call():
        for k in range(steps):
            fn([tf.constant(g) for g in grads[k]])

    ref = []
    for i in range(len(shapes)):
        w, m = w0[i], m0[i]
        for k in range(steps):
            w, m = numpy_lion32(w, m, grads[k][i], wd)
        ref.append((w, m))

    def verify(_):
        for i, ((w, m), var, mom) in enumerate(zip(ref, ws, ms)):
            for name, got, want in (("var", var.numpy(), w), ("m", mom.numpy(), m)):
                assert got.shape == want.shape
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
                    f"{name} {i} {shapes[i]}: {np.count_nonzero(got != want)} elements differ (steps={steps}, wd={wd})")

    expect_ok(call, verify)


def _setup(shapes):
    ws = [tf.Variable(np.random.default_rng(i).normal(size=s).astype(np.float32)) for i, s in enumerate(shapes)]
    ms = [tf.Variable(np.full(s, 0.1, np.float32)) for s in shapes]
    snapshot = lambda: [x.numpy().copy() for x in ws + ms]  # noqa: E731
    return ws, ms, snapshot


@FUZZ
@given(
    shapes=st.lists(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4), min_size=1, max_size=4),
    bad=st.data(),
)
def test_wrong_grad_shape_at_run_time_changes_nothing(impl, shapes, bad):
    ws, ms, snapshot = _setup(shapes)
    i = bad.draw(st.integers(0, len(shapes) - 1), label="bad index")
    grads = [np.ones(s, np.float32) for s in shapes]
    grads[i] = np.ones(shapes[i][:-1] + (shapes[i][-1] + 1,), np.float32)
    specs = [tf.TensorSpec([None] * len(g.shape)) for g in grads]

    def update(*gs):
        multi_tensor_lion(ws, ms, list(gs), LR, B1, B2, weight_decay_rate=1e-3)

    fn = tf.function(update, input_signature=specs)
    expect_error(lambda: fn(*grads), (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("which", ["variables", "ms", "cross"])
def test_duplicate_variable_changes_nothing(impl, mode, which):
    ws, ms, snapshot = _setup([(3,), (3,), (2, 2)])
    lists = {"variables": list(ws), "ms": list(ms)}
    if which == "cross":
        lists["ms"][1] = ws[0]  # a variable as its own momentum
    else:
        lists[which][1] = lists[which][0]
    grads = [tf.ones([3]), tf.ones([3]), tf.ones([2, 2])]

    def call():
        multi_tensor_lion(lists["variables"], lists["ms"], grads, LR, B1, B2)

    fn = tf.function(call) if mode == "function" else call
    expect_error(fn, (ValueError, tf.errors.InvalidArgumentError), snapshot=snapshot)


def test_mismatched_lists_change_nothing(impl):
    ws, ms, snapshot = _setup([(3,), (2,)])
    grads = [tf.ones([3]), tf.ones([2])]
    expect_error(lambda: multi_tensor_lion(ws, ms[:1], grads, LR, B1, B2), ValueError, snapshot)
    expect_error(lambda: multi_tensor_lion(ws, ms, grads[:1], LR, B1, B2), ValueError, snapshot)
    expect_error(lambda: multi_tensor_lion(ws, ms, [tf.ones([3]), tf.ones([3])], LR, B1, B2), ValueError, snapshot)
    expect_error(
        lambda: multi_tensor_lion(ws, ms, [tf.ones([3], tf.int32), tf.ones([2])], LR, B1, B2),
        (ValueError, TypeError),
        snapshot,
    )
