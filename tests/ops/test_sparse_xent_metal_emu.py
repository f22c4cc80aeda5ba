"""The sparse softmax cross-entropy Metal kernels (custom_ops/metal/sparse_xent.metal) on the Metal emulator.

Every instantiation -- sparse_xent_int32_float, sparse_xent_int64_float, sparse_xent_int32_half,
sparse_xent_int64_half, sparse_xent_int32_bfloat, sparse_xent_int64_bfloat,
sparse_xent_grad_int32_float, sparse_xent_grad_int64_float, sparse_xent_grad_int32_half,
sparse_xent_grad_int64_half, sparse_xent_grad_int32_bfloat, sparse_xent_grad_int64_bfloat -- is
dispatched the way sparse_xent_metal.mm dispatches it (dispatchThreadgroups, one threadgroup per row,
the threads norm_metal.h's EncodeForward picks: dispatch_geometry.h's NormRowThreads) and compared
with float64 numpy within a bound derived below, and with the CPU kernel of the same op:
- the forward within the two kernels' bounds (the sums run in another order: threads, SIMD-groups
  and their partials here, 16 lanes then pairwise there), row_max exactly (a max is exact);
- the gradient bit for bit, given the same row_max / row_sum (the same per-element float operations
  from tfmetal/sparse_xent.h, one round-to-nearest-even store).

Emulated 1024-thread threadgroups are slow (each barrier wakes 1024 OS threads): the shape sweep caps
threadgroups at 128 threads; the threadgroup-size test and the 32000-class row run the host's own
picks up to 1024.

The bound. u = 2^-24 (float32's unit roundoff). Per row, with m the max (exact: it is one of the
logits), d_j = x_j - m and t_j = exp(d_j) in exact arithmetic, s = sum_j t_j, l the label:
- term j: fl(x_j - m) is off by u |d_j|, which exp turns into a relative u |d_j|; tfm_exp_poly adds
  EXP_ULPS ulps (one ulp <= 2u relative), and below exp(-87.3) < 2^-125 it gives 0 (TINY absolute);
- the sum: positive terms added along a tree whose longest leaf-to-root path has h rounded
  additions are off by at most gamma(h) = h u / (1 - h u) of s (Higham, Accuracy and Stability of
  Numerical Algorithms, 4.2). The kernel's h: ceil(classes / threads) - 1 in each thread (its
  first addition is to 0, exact), 5 for simd_sum (the emulator adds the 32 lanes pairwise; 31 on a
  GPU, whose order Metal does not document), threads / 32 - 1 for the SIMD-group partials added in
  order. The CPU kernel's: ceil(classes / 16) - 1 in each lane, 4 pairwise levels. So
      rel_s = gamma(h) + 2 EXP_ULPS u + u sum_j t_j |d_j| / s + classes TINY / s;
- the loss log(s^) - fl(x_l - m): log moves a relative error rel_s of s to an absolute
  rel_s / (1 - rel_s), log itself adds LOG_ULPS ulps (<= 2u |log s| each: the emulator's log is the
  C library's, < 1 ulp), fl(x_l - m) adds u |x_l - m|, the subtraction u |loss|;
- the gradient (p_j - [j == l]) dloss with p_j = t_j^ fl(1 / s^): t_j^ as above, 1 / s^ off by
  rel_s / (1 - rel_s) relative plus u for the division, u for the product; the subtraction adds
  u |p_j - [j == l]|, the product with dloss u |dx_j|;
- a float32 rounding below float32's normal range is off by up to 2^-150 absolute (F32_FLOOR
  covers the few of them in a chain);
- the one rounding to T: half an ulp of T, UNIT[T] |value| (2^-11 half, 2^-8 bfloat16; 0 for
  float), or FLOOR[T] absolute below T's normal range.
The first-order sum is widened by SLACK = 1 + 2^-10 for the products of these small terms.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.testing import assert_same_bits, compiled_ops, load_emu, norm_row_threads

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
LABEL_DTYPES = {"int32": np.int32, "int64": np.int64}
FORWARD = {
    ("float", "int32"): "sparse_xent_int32_float", ("float", "int64"): "sparse_xent_int64_float",
    ("half", "int32"): "sparse_xent_int32_half", ("half", "int64"): "sparse_xent_int64_half",
    ("bfloat", "int32"): "sparse_xent_int32_bfloat", ("bfloat", "int64"): "sparse_xent_int64_bfloat",
}
GRAD = {
    ("float", "int32"): "sparse_xent_grad_int32_float", ("float", "int64"): "sparse_xent_grad_int64_float",
    ("half", "int32"): "sparse_xent_grad_int32_half", ("half", "int64"): "sparse_xent_grad_int64_half",
    ("bfloat", "int32"): "sparse_xent_grad_int32_bfloat", ("bfloat", "int64"): "sparse_xent_grad_int64_bfloat",
}
INSTANCES = list(FORWARD)  # (T, Tlabels): one parameter, so the quick tier runs every instantiation
PARAMS = np.dtype([("rows", "<u4"), ("classes", "<u4")])  # tfm_sparse_xent_params
SHAPES = [(5, 33), (1, 1), (3, 31), (2, 32), (4, 1000), (3, 2049)]
SWEEP_CAP = 128  # threadgroup cap for the shape sweep (the host's is 1024)
FILL = -777.0  # outputs start as this finite value: a NaN or a result must be written
CPU_FORWARD = "tfmetal_ext_sparse_softmax_cross_entropy"
CPU_GRAD = "tfmetal_ext_sparse_softmax_cross_entropy_grad"

# The bound's constants (module docstring).
U = 2.0 ** -24
UNIT = {"float": 0.0, "half": 2.0 ** -11, "bfloat": 2.0 ** -8}
FLOOR = {"float": 0.0, "half": 2.0 ** -25, "bfloat": 2.0 ** -134}
EXP_ULPS = 2  # tfm_exp_poly (tfmetal/portable.h: about 1 ulp on its range)
LOG_ULPS = 1  # the emulator's log (the C library's logf)
EMU_SIMD_DEPTH = 5  # the emulator's simd_sum: 32 lanes added pairwise
TINY = 2.0 ** -125  # exp below -87.3 is returned as 0
F32_FLOOR = 2.0 ** -147  # the absolute part of a few float32 roundings of subnormal results
SLACK = 1.0 + 2.0 ** -10

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


def instance_id(instance):
    return f"{instance[0]}-{instance[1]}"


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "sparse_xent.metal")


@pytest.fixture(scope="module")
def cpu():
    """The op library with the CPU kernels of both ops: a missing one fails the test, it is not skipped."""
    library = compiled_ops()
    missing = [name for name in (CPU_FORWARD, CPU_GRAD) if not hasattr(library, name)]
    assert not missing, f"the op library has no {missing}: the CPU kernels of the op are not built"
    return library


# ----------------------------------------------------------------------------
# The host side, as sparse_xent_metal.mm + norm_metal.h do it.


def row_threads(classes, cap=1024):
    # The geometry is the host's own C++ (dispatch_geometry.h, through tfmetal_ext.testing).
    return norm_row_threads(classes, cap)


def metal_forward(lib, instance, x, labels, threads=None, cap=1024, order="linear", seed=3):
    """loss, row_max, row_sum; nothing is dispatched for rows == 0 (Metal rejects empty dispatches)."""
    rows, classes = x.shape
    x = np.ascontiguousarray(x)
    labels = np.ascontiguousarray(labels, LABEL_DTYPES[instance[1]])
    loss = np.full(rows, FILL, DTYPES[instance[0]])
    row_max = np.full(rows, FILL, np.float32)
    row_sum = np.full(rows, FILL, np.float32)
    if rows:
        lib.run(FORWARD[instance], [x, labels, loss, row_max, row_sum, ("bytes", np.array((rows, classes), PARAMS))],
                threadgroups=rows, threadgroup=threads or row_threads(classes, cap), order=order, seed=seed)
    return loss, row_max, row_sum


def metal_grad(lib, instance, dloss, x, labels, row_max, row_sum, threads=None, cap=1024, order="linear", seed=5,
               out=None):
    """dlogits, written into `out` (default: a new array; the host may pass the logits' buffer)."""
    rows, classes = x.shape
    labels = np.ascontiguousarray(labels, LABEL_DTYPES[instance[1]])
    dx = np.full_like(x, FILL) if out is None else out
    if rows:
        lib.run(GRAD[instance], [dloss, x, labels, row_max, row_sum, dx, ("bytes", np.array((rows, classes), PARAMS))],
                threadgroups=rows, threadgroup=threads or row_threads(classes, cap), order=order, seed=seed)
    return dx


def cpu_forward(cpu, x, labels):
    return [t.numpy() for t in getattr(cpu, CPU_FORWARD)(tf.constant(x), tf.constant(labels))]


def cpu_grad(cpu, dloss, x, labels, row_max, row_sum):
    return getattr(cpu, CPU_GRAD)(tf.constant(dloss), tf.constant(x), tf.constant(labels), tf.constant(row_max),
                                  tf.constant(row_sum)).numpy()


# ----------------------------------------------------------------------------
# Inputs, the float64 reference and the bound


def random_case(instance, rows, classes, seed, scale=3.0, offset=0.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, scale, (rows, classes)).astype(np.float32).astype(DTYPES[instance[0]])
    labels = rng.integers(0, classes, rows).astype(LABEL_DTYPES[instance[1]])
    dloss = rng.normal(0.0, 1.0, rows).astype(np.float32).astype(DTYPES[instance[0]])
    return x, labels, dloss


class Reference:
    """The op in float64 from the (T-valued) logits: max, terms, sum, loss, softmax."""

    def __init__(self, x, labels):
        x = np.asarray(x, np.float64)
        rows = np.arange(x.shape[0])
        self.classes = x.shape[1]
        self.m = x.max(axis=1)
        self.d = x - self.m[:, None]
        self.t = np.exp(self.d)
        self.s = self.t.sum(axis=1)
        self.d_label = self.d[rows, labels]
        self.loss = np.log(self.s) - self.d_label
        self.p = self.t / self.s[:, None]
        self.q = self.p - (np.arange(self.classes)[None, :] == np.asarray(labels)[:, None])


def gamma(h):
    return h * U / (1.0 - h * U)


def metal_depth(classes, threads, simd_depth=EMU_SIMD_DEPTH):
    """Longest chain of rounded additions in the kernel's sum (module docstring)."""
    return (-(-classes // threads) - 1) + simd_depth + (threads // 32 - 1)


def cpu_depth(classes):
    """The same for the CPU kernel: 16 lanes accumulated in order, then pairwise (8, 4, 2, 1)."""
    return (-(-classes // 16) - 1) + 4


def sum_bound(ref, depth, exp_ulps=EXP_ULPS):
    """Relative error bound of a row_sum against s."""
    weighted = (ref.t * np.abs(np.where(ref.t > 0, ref.d, 0.0))).sum(axis=1) / ref.s  # -inf logits add 0
    return gamma(depth) + 2 * exp_ulps * U + U * weighted + ref.classes * TINY / ref.s


def loss_bound(ref, depth, dtype, exp_ulps=EXP_ULPS, log_ulps=LOG_ULPS):
    """Absolute error bound of the loss in T against the float64 loss."""
    rel = sum_bound(ref, depth, exp_ulps)
    e_log = rel / (1.0 - rel) + 2 * log_ulps * U * (np.abs(np.log(ref.s)) + rel)
    e1 = e_log + U * np.abs(ref.d_label)
    e32 = (e1 + U * (np.abs(ref.loss) + e1)) * SLACK + F32_FLOOR
    return e32 + UNIT[dtype] * (np.abs(ref.loss) + e32) + FLOOR[dtype]


def grad_bound(ref, dloss, rel_s, dtype, exp_ulps=EXP_ULPS):
    """Absolute error bound of dlogits in T against the float64 gradient, for a row_sum off by rel_s."""
    g = np.abs(np.asarray(dloss, np.float64))[:, None]
    rel_inv = (rel_s / (1.0 - rel_s))[:, None]
    d = np.where(ref.t > 0, np.abs(ref.d), 0.0)
    e_p = ref.p * (2 * exp_ulps * U + U * d + rel_inv + 2 * U) + TINY
    e_q = e_p + U * (np.abs(ref.q) + e_p)
    e32 = (g * e_q + U * g * (np.abs(ref.q) + e_q)) * SLACK + F32_FLOOR
    return e32 + UNIT[dtype] * (g * np.abs(ref.q) + e32) + FLOOR[dtype]


def assert_within(got, want, bound, what):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN fails too
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outside the derived bound; first at "
                           f"{np.argwhere(bad)[:3].tolist()}: got {got[bad][:3]}, want {want[bad][:3]}, "
                           f"bound {np.broadcast_to(bound, bad.shape)[bad][:3]}")


def check_forward(got, cpu_out, ref, instance, threads):
    """got / cpu_out: (loss, row_max, row_sum) of the emulated and the CPU kernel."""
    dtype, classes = instance[0], ref.classes
    loss, row_max, row_sum = got
    cpu_loss, cpu_max, cpu_sum = cpu_out
    h_metal, h_cpu = metal_depth(classes, threads), cpu_depth(classes)
    # The max is one of the logits: exact everywhere.
    np.testing.assert_array_equal(row_max, ref.m)
    np.testing.assert_array_equal(row_max, cpu_max)
    assert_within(row_sum, ref.s, sum_bound(ref, h_metal) * ref.s, "row_sum vs float64")
    # Both sum the same float32 terms (the same operations): only the order differs.
    assert_within(row_sum, cpu_sum.astype(np.float64),
                  (gamma(h_metal) + gamma(h_cpu)) * cpu_sum / (1.0 - gamma(h_cpu)) * SLACK, "row_sum vs CPU")
    assert loss.dtype == DTYPES[dtype] and loss.shape == cpu_loss.shape
    assert_within(loss, ref.loss, loss_bound(ref, h_metal, dtype), "loss vs float64")
    assert_within(loss, cpu_loss.astype(np.float64),
                  loss_bound(ref, h_metal, dtype) + loss_bound(ref, h_cpu, dtype), "loss vs CPU")


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype_and_label_type(lib):
    assert lib.kernels() == sorted(list(FORWARD.values()) + list(GRAD.values()))
    for (dtype, labels), name in FORWARD.items():
        params = lib.params(name)
        assert [p.kind for p in params] == ["pointer"] * 5 + ["reference"]
        assert [p.const for p in params] == [True, True, False, False, False, False]
        assert [p.size for p in params] == [np.dtype(DTYPES[dtype]).itemsize, np.dtype(LABEL_DTYPES[labels]).itemsize,
                                            np.dtype(DTYPES[dtype]).itemsize, 4, 4, PARAMS.itemsize]
    for (dtype, labels), name in GRAD.items():
        params = lib.params(name)
        assert [p.kind for p in params] == ["pointer"] * 6 + ["reference"]
        assert [p.const for p in params] == [True, True, True, True, True, False, False]
        item = np.dtype(DTYPES[dtype]).itemsize
        assert [p.size for p in params] == [item, item, np.dtype(LABEL_DTYPES[labels]).itemsize, 4, 4, item,
                                            PARAMS.itemsize]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_forward_matches_numpy_and_cpu_kernel(lib, cpu, instance, shape):
    # Offset logits: x - m is then mostly inexact (no Sterbenz), which the bound accounts for.
    x, labels, _ = random_case(instance, *shape, seed=shape[1] + 11 * shape[0], offset=20.0)
    threads = row_threads(shape[1], SWEEP_CAP)
    got = metal_forward(lib, instance, x, labels, threads=threads)
    check_forward(got, cpu_forward(cpu, x, labels), Reference(x, labels), instance, threads)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_grad_matches_cpu_kernel_bit_for_bit_and_numpy(lib, cpu, instance, shape):
    x, labels, dloss = random_case(instance, *shape, seed=7 * shape[0] + shape[1])
    threads = row_threads(shape[1], SWEEP_CAP)
    _, row_max, row_sum = metal_forward(lib, instance, x, labels, threads=threads)
    dx = metal_grad(lib, instance, dloss, x, labels, row_max, row_sum, threads=threads)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_same_bits(dx, cpu_grad(cpu, dloss, x, labels, row_max, row_sum))
    ref = Reference(x, labels)
    rel_s = sum_bound(ref, metal_depth(shape[1], threads))
    assert_within(dx, ref.q * np.asarray(dloss, np.float64)[:, None], grad_bound(ref, dloss, rel_s, instance[0]),
                  "dlogits vs float64")


@pytest.mark.cover_axes("threads")  # each size is another reduction geometry
@pytest.mark.parametrize("threads", [32, 64, 96, 128, 256, 512, 1024])
@pytest.mark.parametrize("instance", [("float", "int64"), ("half", "int32"), ("bfloat", "int64")], ids=instance_id)
def test_threadgroup_sizes_the_host_can_pick(lib, cpu, instance, threads):
    # The host picks a power of two from 32 to 1024 by the row length (96: any multiple of 32 works).
    assert [row_threads(c) for c in (1, 128, 129, 1000, 4096, 32000)] == [32, 32, 64, 256, 1024, 1024]
    x, labels, dloss = random_case(instance, 3, 1000, seed=threads)
    got = metal_forward(lib, instance, x, labels, threads=threads)
    check_forward(got, cpu_forward(cpu, x, labels), Reference(x, labels), instance, threads)
    dx = metal_grad(lib, instance, dloss, x, labels, got[1], got[2], threads=threads)
    assert_same_bits(dx, cpu_grad(cpu, dloss, x, labels, got[1], got[2]))


@pytest.mark.parametrize("instance", [("float", "int64"), ("bfloat", "int32")], ids=instance_id)
def test_a_32000_class_row_in_one_1024_thread_threadgroup(lib, cpu, instance):
    assert row_threads(32000) == 1024
    x, labels, dloss = random_case(instance, 2, 32000, seed=32000, scale=4.0)
    got = metal_forward(lib, instance, x, labels)
    ref = Reference(x, labels)
    check_forward(got, cpu_forward(cpu, x, labels), ref, instance, 1024)
    dx = metal_grad(lib, instance, dloss, x, labels, got[1], got[2])
    assert_same_bits(dx, cpu_grad(cpu, dloss, x, labels, got[1], got[2]))
    rel_s = sum_bound(ref, metal_depth(32000, 1024))
    assert_within(dx, ref.q * np.asarray(dloss, np.float64)[:, None], grad_bound(ref, dloss, rel_s, instance[0]),
                  "dlogits vs float64")


@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_one_class(lib, cpu, instance):
    # exp(0) = 1 and log(1) = 0 exactly: row_max = x, row_sum = 1, loss = 0, dlogits = (1 - 1) * dloss = 0.
    x, labels, dloss = random_case(instance, 4, 1, seed=1)
    loss, row_max, row_sum = metal_forward(lib, instance, x, labels)
    np.testing.assert_array_equal(row_max, x[:, 0].astype(np.float32))
    np.testing.assert_array_equal(row_sum, 1.0)
    np.testing.assert_array_equal(loss.astype(np.float32), 0.0)
    dx = metal_grad(lib, instance, dloss, x, labels, row_max, row_sum)
    np.testing.assert_array_equal(dx.astype(np.float32), 0.0)
    assert_same_bits(dx, cpu_grad(cpu, dloss, x, labels, row_max, row_sum))


@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_no_rows_dispatch_nothing(lib, cpu, instance):
    # rows == 0: the host returns before encoding (the outputs are empty); an empty dispatch is an error.
    x = np.zeros((0, 7), DTYPES[instance[0]])
    labels = np.zeros(0, LABEL_DTYPES[instance[1]])
    outputs = metal_forward(lib, instance, x, labels)
    assert [o.shape for o in outputs] == [o.shape for o in cpu_forward(cpu, x, labels)] == [(0,)] * 3
    empty = np.zeros(0, np.float32)
    assert metal_grad(lib, instance, x[:, 0], x, labels, empty, empty).shape == (0, 7)
    with pytest.raises(emu.EmuError, match="empty dispatches"):
        lib.run(FORWARD[instance], [x, labels, outputs[0], empty, empty, ("bytes", np.array((0, 7), PARAMS))],
                threadgroups=0, threadgroup=32)


@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_bad_labels_give_nan_rows_only(lib, cpu, instance):
    classes = 37
    x, labels, dloss = random_case(instance, 6, classes, seed=66)
    good = labels.copy()
    bad = labels.copy()
    bad[1], bad[3] = -1, classes
    # A label only its low 32 bits would make valid (0), or the most negative int32.
    bad[4] = 2 ** 32 if instance[1] == "int64" else np.iinfo(np.int32).min
    wrong = np.array([False, True, False, True, True, False])
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the valid range"):
        cpu_forward(cpu, x, bad)  # the CPU kernel refuses them; the GPU cannot read labels on the host
    loss, row_max, row_sum = metal_forward(lib, instance, x, bad)
    want_loss, want_max, want_sum = metal_forward(lib, instance, x, good)
    loss32 = loss.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(loss32), wrong)
    assert_same_bits(loss[~wrong], want_loss[~wrong])
    # The statistics do not depend on the label: written for every row.
    assert_same_bits(row_max, want_max)
    assert_same_bits(row_sum, want_sum)
    dx = metal_grad(lib, instance, dloss, x, bad, row_max, row_sum)
    dx32 = dx.astype(np.float32)
    assert np.isnan(dx32[wrong]).all() and not np.isnan(dx32[~wrong]).any()
    assert_same_bits(dx[~wrong], cpu_grad(cpu, dloss, x, good, row_max, row_sum)[~wrong])


@pytest.mark.cover_axes("dtype")  # NaN and inf through each dtype's conversions
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_logits_poison_only_their_row(lib, cpu, dtype):
    instance = (dtype, "int64")
    classes = 40
    x, labels, dloss = random_case(instance, 8, classes, seed=40)
    labels[:] = 3
    x[1, 5] = np.nan                  # NaN: its term is NaN -> the loss and every dx NaN
    x[2, 0] = np.inf                  # +inf: inf - inf -> NaN (row_max = inf)
    x[3, 6] = -np.inf                 # -inf off the label: a 0 term, a finite row
    x[4, 3] = -np.inf                 # -inf at the label: an infinite loss, a finite gradient
    x[5, :] = -np.inf                 # all -inf: -inf - -inf -> NaN
    x[6, 3] = np.nan                  # NaN at the label
    clean = [0, 3, 4, 7]
    loss, row_max, row_sum = metal_forward(lib, instance, x, labels)
    cpu_loss, cpu_max, cpu_sum = cpu_forward(cpu, x, labels)
    np.testing.assert_array_equal(row_max, cpu_max)
    loss32, cpu_loss32 = loss.astype(np.float32), cpu_loss.astype(np.float32)
    nan_rows = [False, True, True, False, False, True, True, False]
    np.testing.assert_array_equal(np.isnan(loss32), nan_rows)
    np.testing.assert_array_equal(np.isnan(cpu_loss32), nan_rows)
    assert loss32[4] == cpu_loss32[4] == np.inf and np.isfinite(loss32[[0, 3, 7]]).all()
    assert row_max[2] == np.inf and row_max[5] == -np.inf
    np.testing.assert_array_equal(row_max[[1, 6]], np.nanmax(x[[1, 6]].astype(np.float32), axis=1))
    np.testing.assert_array_equal(np.isnan(row_sum), nan_rows)
    np.testing.assert_array_equal(np.isnan(cpu_sum), nan_rows)
    # A row does not see the others: the finite rows as computed without the poisoned ones.
    alone = metal_forward(lib, instance, x[[0, 7]], labels[[0, 7]])
    for got, want in zip((loss, row_max, row_sum), alone):
        assert_same_bits(got[[0, 7]], want)
    ref = Reference(x[[3]], labels[[3]])  # exp(-inf) = 0 in float64 too
    assert_within(loss[[3]], ref.loss, loss_bound(ref, metal_depth(classes, row_threads(classes)), dtype),
                  "loss with a -inf logit")
    dx = metal_grad(lib, instance, dloss, x, labels, row_max, row_sum)
    assert_same_bits(dx, cpu_grad(cpu, dloss, x, labels, row_max, row_sum))
    dx32 = dx.astype(np.float32)
    assert np.isnan(dx32[[1, 2, 5, 6]]).all() and np.isfinite(dx32[clean]).all()
    assert dx32[3, 6] == 0 and dx32[4, 3] == -np.float32(dloss[4])  # p = 0: 0 * dloss and (0 - 1) * dloss


def test_grad_may_write_into_the_logits(lib):
    # The host forwards the logits' buffer to dlogits when TF allows it.
    instance = ("half", "int32")
    x, labels, dloss = random_case(instance, 5, 300, seed=9)
    _, row_max, row_sum = metal_forward(lib, instance, x, labels)
    want = metal_grad(lib, instance, dloss, x, labels, row_max, row_sum)
    inplace = x.copy()
    metal_grad(lib, instance, dloss, inplace, labels, row_max, row_sum, out=inplace)
    assert_same_bits(inplace, want)


def test_results_do_not_depend_on_threadgroup_order(lib):
    # Deterministic: no atomics, each threadgroup owns its row, the reduction tree is fixed by the shape.
    instance = ("float", "int64")
    x, labels, dloss = random_case(instance, 9, 700, seed=8)
    first = metal_forward(lib, instance, x, labels, cap=SWEEP_CAP)
    for order, seed in (("shuffle", 1), ("shuffle", 2), ("reverse", 0)):
        again = metal_forward(lib, instance, x, labels, cap=SWEEP_CAP, order=order, seed=seed)
        for a, b in zip(first, again):
            assert_same_bits(a, b)
    grad = metal_grad(lib, instance, dloss, x, labels, first[1], first[2], cap=SWEEP_CAP)
    again = metal_grad(lib, instance, dloss, x, labels, first[1], first[2], cap=SWEEP_CAP, order="shuffle", seed=4)
    assert_same_bits(grad, again)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through the Metal backend. The GPU's simd_sum order
# is not documented (depth 31, the worst) and its log is not the C library's (LOG_ULPS 4 assumed); the
# Metal compiler may contract the exp polynomial into fmas (EXP_ULPS 4), so the gradient is held to
# the bound there, not to the CPU's bits.


@pytest.mark.metal
@pytest.mark.parametrize("shape", [(5, 33), (64, 32000), (0, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("instance", INSTANCES, ids=instance_id)
def test_gpu_kernels_match_numpy_and_the_cpu_kernels(cpu, instance, shape):
    x, labels, dloss = random_case(instance, *shape, seed=31)
    with tf.device("/GPU:0"):
        loss, row_max, row_sum = getattr(cpu, CPU_FORWARD)(tf.constant(x), tf.constant(labels))
        dx = getattr(cpu, CPU_GRAD)(tf.constant(dloss), tf.constant(x), tf.constant(labels), row_max, row_sum)
    assert "GPU" in loss.device and "GPU" in dx.device
    if shape[0] == 0:
        assert loss.shape == (0,) and dx.shape == shape
        return
    ref = Reference(x, labels)
    h = metal_depth(shape[1], row_threads(shape[1]), simd_depth=31)
    np.testing.assert_array_equal(row_max.numpy(), ref.m)
    assert_within(loss.numpy(), ref.loss, loss_bound(ref, h, instance[0], exp_ulps=4, log_ulps=4), "GPU loss")
    rel_s = sum_bound(ref, h, exp_ulps=4)
    assert_within(dx.numpy(), ref.q * np.asarray(dloss, np.float64)[:, None],
                  grad_bound(ref, dloss, rel_s, instance[0], exp_ulps=4), "GPU dlogits")
