"""sparse_softmax_cross_entropy: the CPU kernels and the pure-TF reference against float64 numpy
and TensorFlow's own kernel, within a derived bound; gradients (also through the statistics and of
second order); NaN and infinities; TensorFlow's errors; the lower CPU levels."""

import importlib

import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import ops
from tfmetal_ext.backends import fusion

from tests.ops._cpu_levels import run_at_level

xent_module = importlib.import_module("tfmetal_ext.ops.sparse_xent")

U32 = 2.0 ** -24  # float32 unit roundoff
DTYPES = {"float32": (tf.float32, U32), "float16": (tf.float16, 2.0 ** -11), "bfloat16": (tf.bfloat16, 2.0 ** -8)}
# Half the spacing of each output type's subnormals: the absolute part of rounding a tiny result
# (a softmax probability of 1e-9 is a float16 subnormal or 0). float32's also covers the float32 math.
TINY = {U32: 2.0 ** -150, 2.0 ** -11: 2.0 ** -25, 2.0 ** -8: 2.0 ** -134, 0.0: 2.0 ** -150}
LABELS = {"int32": tf.int32, "int64": tf.int64}
LANES = 16  # the CPU kernel's accumulators (custom_ops/cpu/sparse_xent_kernels.cc)


def lib():
    if not xent_module.uses_kernel():
        pytest.skip("the op library is not loaded here (TFMETAL_EXT_REFERENCE_OPS or no compiler)")
    return ops._common.library()


def np_xent(x, labels):
    """Loss, softmax and the float64 pieces of the error bound, from the definition."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    t = np.exp(z)
    s = t.sum(axis=-1)
    rows = np.arange(x.shape[0])
    d = x[rows, labels] - m[:, 0]
    loss = np.log(s) - d
    p = t / s[:, None]
    return loss, p, dict(z=z, t=t, s=s, d=d)


def loss_bound(x, labels, u_out, tree_terms):
    """|kernel loss - exact| for float32 math over a summation tree of `tree_terms` sequential
    additions per accumulator, rounded once to a type of unit roundoff `u_out`.

    Derivation (u = float32 unit roundoff, first order, then doubled for the second-order terms):
    - term t_j = exp_poly(x_j - m): the subtraction rounds by u |z_j| (z_j = x_j - m), which the exp
      turns into a relative error u |z_j|; the polynomial is within about 1 ulp, taken as 2u.
    - the sum s of C terms in [0, 1], each lane adding `tree_terms` terms in sequence then a pairwise
      tree of log2(16) = 4 levels: relative error <= (tree_terms + 4) u (Higham's gamma bound).
    - log(s): absolute error e_s (the relative error of s) plus u |log s| for logf's rounding.
    - d = x_label - m rounds by u |d|; loss = log(s) - d rounds by u |loss|; the cast by u_out |loss|.
    """
    _, _, k = np_xent(x, labels)
    e_terms = (np.sum((2 * U32 + U32 * np.abs(k["z"])) * k["t"], axis=-1)) / k["s"]
    e_s = e_terms + (tree_terms + 4) * U32
    loss = np.log(k["s"]) - k["d"]
    bound = e_s + U32 * (np.abs(np.log(k["s"])) + np.abs(k["d"]) + np.abs(loss))
    return 2 * bound + u_out * np.abs(loss) + TINY[u_out] + TINY[0.0]


def grad_bound(x, labels, dloss, u_out, tree_terms):
    """|kernel dlogits - exact| elementwise: p = t * (1 / s) carries the term's error (2u + u|z|),
    the sum's relative error, and two roundings (the reciprocal, the product); p - one_hot rounds by
    u |p - one_hot|, the product with dloss by u |result|, the cast by u_out |result|; doubled. Each
    rounding also has an absolute part below the smallest normal (`TINY`)."""
    _, p, k = np_xent(x, labels)
    e_s = (np.sum((2 * U32 + U32 * np.abs(k["z"])) * k["t"], axis=-1)) / k["s"] + (tree_terms + 4) * U32
    one_hot = np.zeros_like(p)
    one_hot[np.arange(x.shape[0]), labels] = 1.0
    exact = (p - one_hot) * dloss[:, None]
    e_p = p * (2 * U32 + U32 * np.abs(k["z"]) + e_s[:, None] + 2 * U32)
    bound = np.abs(dloss)[:, None] * (e_p + U32 * np.abs(p - one_hot)) + U32 * np.abs(exact)
    return exact, 2 * bound + u_out * np.abs(exact) + TINY[u_out] + TINY[0.0]


def case(rows, classes, dtype, label_dtype, seed=0, scale=3.0):
    rng = np.random.default_rng(seed + 7 * rows + classes)
    x = tf.cast(tf.constant(rng.normal(size=(rows, classes)) * scale, tf.float32), dtype)
    labels = tf.constant(rng.integers(0, classes, rows), label_dtype)
    dloss = tf.cast(tf.constant(rng.normal(size=rows), tf.float32), dtype)
    return x, labels, dloss


def f64(t):
    return tf.cast(t, tf.float64).numpy()


SHAPES = [(1, 1), (3, 5), (7, 17), (5, 16), (9, 33), (33, 1000)]


@pytest.mark.cover_axes("dtype_name", "label_name")  # each a kernel instantiation
@pytest.mark.parametrize("label_name", sorted(LABELS))
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernels_against_float64_numpy(shape, dtype_name, label_name):
    dtype, u_out = DTYPES[dtype_name]
    x, labels, dloss = case(*shape, dtype, LABELS[label_name])
    loss, row_max, row_sum = lib().tfmetal_ext_sparse_softmax_cross_entropy(x, labels)
    assert loss.dtype == dtype and row_max.dtype == tf.float32 and row_sum.dtype == tf.float32
    xs, ls = f64(x), labels.numpy()
    tree = -(-shape[1] // LANES)
    want, _, k = np_xent(xs, ls)
    np.testing.assert_array_less(np.abs(f64(loss) - want), loss_bound(xs, ls, u_out, tree))
    np.testing.assert_array_equal(row_max.numpy(), xs.max(axis=-1))  # the max is exact
    np.testing.assert_allclose(row_sum.numpy(), k["s"], rtol=(tree + 8) * U32 * 2 + 1e-6)
    dx = lib().tfmetal_ext_sparse_softmax_cross_entropy_grad(dloss, x, labels, row_max, row_sum)
    assert dx.dtype == dtype and dx.shape == x.shape
    exact, bound = grad_bound(xs, ls, f64(dloss), u_out, tree)
    np.testing.assert_array_less(np.abs(f64(dx) - exact), bound)


@pytest.mark.parametrize("shape", [(64, 1000), (8, 32000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_against_tensorflows_kernel(shape):
    """TensorFlow's kernel (Eigen's exp, its own summation tree) has an error of the same form:
    the two agree within the sum of the bounds, with TF's summation taken as sequential (C terms)."""
    x, labels, _ = case(*shape, tf.float32, tf.int64, scale=4.0)
    ours = ops.sparse_softmax_cross_entropy(labels, x)
    theirs = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x)
    xs, ls = f64(x), labels.numpy()
    bound = loss_bound(xs, ls, 0.0, -(-shape[1] // LANES)) + loss_bound(xs, ls, 0.0, shape[1])
    np.testing.assert_array_less(np.abs(ours.numpy().astype(np.float64) - theirs.numpy()), bound)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        a = tf.reduce_sum(ops.sparse_softmax_cross_entropy(labels, x) * tf.range(shape[0], dtype=tf.float32))
        b = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x) *
                          tf.range(shape[0], dtype=tf.float32))
    ga, gb = tape.gradient(a, x).numpy(), tape.gradient(b, x).numpy()
    dl = np.arange(shape[0], dtype=np.float64)
    _, bound_ours = grad_bound(xs, ls, dl, 0.0, -(-shape[1] // LANES))
    _, bound_tf = grad_bound(xs, ls, dl, 0.0, shape[1])
    np.testing.assert_array_less(np.abs(ga.astype(np.float64) - gb), bound_ours + bound_tf)


def test_wrapper_any_rank_and_labels_shape():
    """[..., classes] logits and labels of the leading shape, as tf.nn's function takes them."""
    x, labels, _ = case(12, 7, tf.float32, tf.int32)
    x3, l3 = tf.reshape(x, [3, 4, 7]), tf.reshape(labels, [3, 4])
    out = ops.sparse_softmax_cross_entropy(l3, x3)
    assert out.shape == (3, 4)
    np.testing.assert_array_equal(tf.reshape(out, [-1]).numpy(), ops.sparse_softmax_cross_entropy(labels, x).numpy())
    one = ops.sparse_softmax_cross_entropy(tf.constant(2), tf.constant([0.0, 1.0, 2.0]))
    assert one.shape == ()
    np.testing.assert_allclose(one.numpy(), np.log(np.exp([0.0, 1.0, 2.0]).sum()) - 2.0, rtol=1e-6)


def test_unknown_shapes_in_a_function():
    fn = tf.function(ops.sparse_softmax_cross_entropy,
                     input_signature=[tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None, None, None])])
    x, labels, _ = case(6, 9, tf.float32, tf.int64)
    got = fn(tf.reshape(labels, [2, 3]), tf.reshape(x, [2, 3, 9]))
    np.testing.assert_array_equal(tf.reshape(got, [-1]).numpy(), ops.sparse_softmax_cross_entropy(labels, x).numpy())


def test_empty_rows():
    loss = ops.sparse_softmax_cross_entropy(tf.zeros([0], tf.int32), tf.zeros([0, 4]))
    assert loss.shape == (0,)
    x = tf.zeros([0, 4])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(ops.sparse_softmax_cross_entropy(tf.zeros([0], tf.int32), x))
    assert tape.gradient(y, x).shape == (0, 4)


def test_nan_and_infinities_give_tensorflows_results():
    """A NaN or +inf logit makes its row NaN; a -inf label logit an infinite loss; a row of -inf NaN;
    other rows are unaffected. TensorFlow's kernel gives the same pattern."""
    inf, nan = np.inf, np.nan
    x = tf.constant([[nan, 0.0, 1.0], [inf, 0.0, 0.0], [-inf, 0.0, 0.0], [-inf, -inf, -inf], [1e4, 0.0, -1e4],
                     [0.5, 0.25, 0.0]])
    labels = tf.constant([1, 1, 0, 1, 1, 2])
    ours = ops.sparse_softmax_cross_entropy(labels, x).numpy()
    theirs = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x).numpy()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    np.testing.assert_array_equal(np.isnan(ours), [True, True, False, True, False, False])
    assert ours[2] == np.inf == theirs[2]
    np.testing.assert_allclose(ours[4:], theirs[4:], rtol=1e-6)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(ops.sparse_softmax_cross_entropy(labels, x))
    g = tape.gradient(y, x).numpy()
    assert np.isnan(g[[0, 1, 3]]).all() and np.isfinite(g[[2, 4, 5]]).all()
    np.testing.assert_array_equal(g[2], [-1.0, 0.5, 0.5])  # exp(-inf) = 0, the other two share the mass


@pytest.mark.parametrize("label_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("bad", [-1, 3, 2 ** 31 - 1])
def test_out_of_range_label_is_tensorflows_error(bad, label_dtype):
    x = tf.zeros([2, 3])
    labels = tf.constant([0, bad], label_dtype)
    with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
        tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)
    for call in (lambda: lib().tfmetal_ext_sparse_softmax_cross_entropy(x, labels),
                 lambda: lib().tfmetal_ext_sparse_softmax_cross_entropy_grad(tf.ones([2]), x, labels, tf.zeros([2]),
                                                                             tf.ones([2]))):
        with pytest.raises(tf.errors.InvalidArgumentError) as ours:
            call()
        text = theirs.value.message[theirs.value.message.index("Received a label"):].split(" [Op")[0]
        assert text in ours.value.message


@pytest.mark.parametrize("logits_shape, labels_shape", [((2, 3, 1), (2,)), ((2, 3), (1, 2)), ((2, 3), (3,)),
                                                        ((2, 0), (2,)), ((0, 0), (0,))])
def test_shape_errors_are_tensorflows(logits_shape, labels_shape):
    x, labels = tf.zeros(logits_shape), tf.zeros(labels_shape, tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
        tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as ours:
        lib().tfmetal_ext_sparse_softmax_cross_entropy(x, labels)
    want = theirs.value.message.split("} ", 1)[-1].split(" [Op")[0]
    assert want in str(ours.value)


def test_grad_op_checks_its_row_vectors():
    x, labels = tf.zeros([2, 3]), tf.constant([0, 1])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="dloss"):
        lib().tfmetal_ext_sparse_softmax_cross_entropy_grad(tf.ones([3]), x, labels, tf.zeros([2]), tf.ones([2]))
    fn = tf.function(lambda s: lib().tfmetal_ext_sparse_softmax_cross_entropy_grad(tf.ones([2]), x, labels,
                                                                                 tf.zeros([2]), s),
                     input_signature=[tf.TensorSpec([None])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_sum must be a vector of the number of rows"):
        fn(tf.ones([5]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(labels=tf.constant([0.0]), logits=tf.zeros([1, 2])), "labels.dtype=float32"),
    (dict(labels=tf.constant([0]), logits=tf.zeros([1, 2], tf.float64)), "logits.dtype=float64"),
    (dict(labels=tf.constant([0, 1]), logits=tf.zeros([2, 3, 4])), "labels.shape=\\(2,\\)"),
    (dict(labels=tf.constant([0, 1, 2]), logits=tf.zeros([2, 4])), "Received: labels.shape"),
    (dict(labels=tf.constant(0), logits=tf.constant(0.0)), "rank >= 1"),
    (dict(labels=tf.zeros([2], tf.int32), logits=tf.zeros([2, 0])), "at least one class"),
])
def test_wrapper_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.sparse_softmax_cross_entropy(**kwargs)


def test_statistics_outputs_are_differentiable():
    """Gradients reaching row_max and row_sum (a raw-op user differentiating them) are TF's autodiff
    of their definition, added to the loss's."""
    x, labels, _ = case(4, 6, tf.float32, tf.int32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        loss, m, s = lib().tfmetal_ext_sparse_softmax_cross_entropy(x, labels)
        y = tf.reduce_sum(loss) + 2.0 * tf.reduce_sum(m) + 3.0 * tf.reduce_sum(s)
        xm = tf.reduce_max(x, axis=-1)
        ref = (tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x)) + 2.0 * tf.reduce_sum(xm)
               + 3.0 * tf.reduce_sum(tf.reduce_sum(tf.exp(x - xm[:, None]), axis=-1)))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), tape.gradient(ref, x).numpy(), rtol=1e-5, atol=1e-6)


def test_second_order_matches_tensorflows():
    """The Hessian-vector product through our gradient op against TF's own op (which has one)."""
    x, labels, _ = case(5, 7, tf.float32, tf.int64)
    v = tf.constant(np.random.default_rng(1).normal(size=(5, 7)), tf.float32)

    def hvp(fn):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(fn(labels, x) * tf.range(1.0, 6.0))
            g = inner.gradient(y, x)
            gv = tf.reduce_sum(g * v)
        return outer.gradient(gv, x).numpy()

    np.testing.assert_allclose(hvp(ops.sparse_softmax_cross_entropy),
                               hvp(tf.nn.sparse_softmax_cross_entropy_with_logits), rtol=1e-4, atol=1e-6)


def test_one_op_each_way_in_a_train_step():
    """The loss is one op forward and one backward: no Exp, Softmax, Mul over the logits or TF's op."""
    x, labels, _ = case(8, 50, tf.float32, tf.int32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_mean(ops.sparse_softmax_cross_entropy(labels, x))
        return tape.gradient(y, x)

    lib()
    graph = step.get_concrete_function(x).graph.as_graph_def()
    types = [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
    assert types.count(fusion.SPARSE_XENT_OP) == 1 and types.count(fusion.SPARSE_XENT_GRAD_OP) == 1
    assert "SparseSoftmaxCrossEntropyWithLogits" not in types and "Exp" not in types


def test_reference_matches_the_kernels_within_the_bound():
    """The pure-TF reference (configure(avoid_fusions=["sparse_softmax_cross_entropy"]), no compiler)
    computes the same float32 formula: both within the derived bound of float64 numpy, and the same
    statistics."""
    from tfmetal_ext.ops import _reference

    x, labels, dloss = case(9, 40, tf.float32, tf.int32)
    loss, m, s = _reference.sparse_softmax_cross_entropy(x, labels)
    xs, ls = f64(x), labels.numpy()
    want, _, k = np_xent(xs, ls)
    np.testing.assert_array_less(np.abs(f64(loss) - want), loss_bound(xs, ls, 0.0, 40))
    np.testing.assert_array_equal(m.numpy(), xs.max(axis=-1))
    dx = _reference.sparse_softmax_cross_entropy_grad(dloss, x, labels, m, s)
    exact, bound = grad_bound(xs, ls, f64(dloss), 0.0, 40)
    np.testing.assert_array_less(np.abs(f64(dx) - exact), bound)


def test_avoided_runs_the_reference():
    x, labels, _ = case(3, 5, tf.float32, tf.int32)
    tfmetal_ext.configure("float32", avoid_fusions=["sparse_softmax_cross_entropy"])
    try:
        assert not xent_module.uses_kernel()

        @tf.function
        def f(x):
            return ops.sparse_softmax_cross_entropy(labels, x)

        graph = f.get_concrete_function(x).graph.as_graph_def()
        assert fusion.SPARSE_XENT_OP not in [n.op for n in graph.node]
        want, _, _ = np_xent(f64(x), labels.numpy())
        np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-6)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=[])


_LEVEL_SCRIPT = """
import sys
import numpy as np, tensorflow as tf
from tfmetal_ext.ops import _common
lib = _common.library()
rng = np.random.default_rng(3)
out = []
for dtype in (tf.float32, tf.float16, tf.bfloat16):
    for rows, classes in ((5, 7), (6, 100), (3, 1029)):
        x = tf.cast(tf.constant(rng.normal(size=(rows, classes)) * 5, tf.float32), dtype)
        labels = tf.constant(rng.integers(0, classes, rows))
        loss, m, s = lib.tfmetal_ext_sparse_softmax_cross_entropy(x, labels)
        dx = lib.tfmetal_ext_sparse_softmax_cross_entropy_grad(tf.ones([rows], dtype), x, labels, m, s)
        out += [tf.cast(t, tf.float32).numpy() for t in (loss, m, s, dx)]
np.savez(sys.argv[1], *out)
"""


@pytest.mark.slow
def test_lower_cpu_levels_give_the_same_bits(tmp_path):
    """The baseline loops (what arm64 runs) and the AVX2 ones make the same operations in the same
    lane order without FMA: the same bits, checked in fresh processes at each level."""
    lib()
    results = {}
    for level in ("baseline", "avx2"):
        path = tmp_path / f"{level}.npz"
        run_at_level(_LEVEL_SCRIPT, level, path)
        results[level] = np.load(path)
    a, b = results["baseline"], results["avx2"]
    assert len(a.files) == len(b.files) == 36
    for key in a.files:
        np.testing.assert_array_equal(a[key].view(np.uint32), b[key].view(np.uint32), err_msg=key)
