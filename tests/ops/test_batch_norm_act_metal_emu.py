"""The batch norm + activation Metal kernels (custom_ops/metal/batch_norm_act.metal) on the Metal emulator.

Every instantiation -- batch_norm_act_stats_float, batch_norm_act_stats_half,
batch_norm_act_stats_bfloat, batch_norm_act_float, batch_norm_act_half,
batch_norm_act_bfloat, batch_norm_act_grad_sums_float, batch_norm_act_grad_sums_half,
batch_norm_act_grad_sums_bfloat, batch_norm_act_grad_float, batch_norm_act_grad_half,
batch_norm_act_grad_bfloat, batch_norm_act_moving -- is dispatched the way
batch_norm_act_metal.mm dispatches it (the column reductions as norm_metal.h's
parameter-gradient pass, the elementwise passes one thread per element, the moving statistics
pass as one threadgroup of ThreadgroupSize1D(C) threads, at most TFM_BNA_MOVING_THREADS) and
compared with numpy float64 (tfmetal_ext.testing) and the CPU kernel, for every activation,
with and without the side input.

Tolerances, as tests/ops/test_batch_norm_act.py derives them: float32 results within
K u (1 + sqrt(M)) of the output scale (u = 2^-24, K = 16: the per-channel sums' rounding over
M rows plus a few elementwise roundings); half / bfloat16 outputs, rounded once from float32,
within that plus half a unit in the last place of T. The sums run in another order than on the
CPU (row lanes of a threadgroup vs row blocks), so results agree to rounding, not bit for bit.

The moving statistics' update (batch_norm_act_moving) is compared BIT FOR BIT with a float32
numpy reference written from the definition (moving * momentum + batch * (float32(1) - momentum),
each operation rounded to float32): the emulator compiles the kernel with -ffp-contract=off, so
the two roundings of the products and the one of the sum are exactly numpy's. (A Metal compiler
that fused `kept + added` into an fma would differ by at most one float32 ulp: the Mac test
allows that.) When any channel's update is not finite both outputs must be the moving inputs'
exact bits (NaN payloads included).
"""

import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.testing import compiled_ops, load_emu, norm_param_grad_groups, norm_param_grad_threads

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
TF_DTYPES = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}
MANTISSA = {"float": 23, "half": 10, "bfloat": 7}
MIN_EXP = {"float": -126, "half": -14, "bfloat": -126}
NAMES = ("batch_norm_act_stats", "batch_norm_act", "batch_norm_act_grad_sums", "batch_norm_act_grad")  # per dtype
MOVING_NAME = "batch_norm_act_moving"  # one instantiation: float32 whatever T
ACTIVATIONS = list(fusion.BATCH_NORM_ACT_ACTIVATIONS)
CODES = {name: i for i, name in enumerate(ACTIVATIONS)}  # the TFM_BNA_* codes
PARAMS = np.dtype([("rows", "<u4"), ("channels", "<u4"), ("activation", "<i4"), ("has_side", "<u4"),
                   ("alpha", "<f4"), ("epsilon", "<f4"), ("momentum", "<f4"),
                   ("has_moving", "<u4")])  # tfm_batch_norm_act_params
# The moving pass's threadgroup cap (the host's, and the length of the kernel's threadgroup flags).
MOVING_THREADS = int(re.search(r"#define TFM_BNA_MOVING_THREADS (\d+)",
                               (ROOT / "custom_ops" / "metal" / "batch_norm_act.h").read_text()).group(1))
EPSILON = 1e-3
MOMENTUM = 0.99
ALPHA = 0.3
U = 2.0 ** -24
K = 16.0
SWEEP_CAP = 128  # threadgroup cap of the emulated reductions (the host's is 1024)
ELEMENT_THREADS = 64

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "batch_norm_act.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


# ----------------------------------------------------------------------------
# The host side, as batch_norm_act_metal.mm does it.


def params(rows, channels, activation, has_side, alpha=ALPHA, epsilon=EPSILON, momentum=0.0, has_moving=False):
    return ("bytes", np.array((rows, channels, CODES[activation], int(has_side), alpha, epsilon, momentum,
                               int(has_moving)), PARAMS))


def moving_threads(channels):
    """The moving pass's one threadgroup, as the host sizes it (ThreadgroupSize1D, capped)."""
    return testing.threadgroup_size_1d(channels, cap=MOVING_THREADS)


def metal_moving(lib, mean, var, moving_mean, moving_var, p, threads=None, order="linear", seed=7):
    """The moving statistics pass: (new_mean, new_variance), filled with a sentinel before."""
    channels = mean.shape[0]
    new_mean, new_var = np.full(channels, -9.0, np.float32), np.full(channels, -9.0, np.float32)
    if channels:  # C == 0: the host encodes nothing (every output is empty)
        lib.run(MOVING_NAME, [mean, var, moving_mean, moving_var, new_mean, new_var, p], threadgroups=1,
                threadgroup=threads or moving_threads(channels), order=order, seed=seed)
    return new_mean, new_var


def metal_forward(lib, dtype, x, gamma, beta, side, activation, threads=None, cap=SWEEP_CAP, order="linear",
                  moving=(), momentum=MOMENTUM):
    """The op's outputs: y, mean, inv_std, variance and new_moving ([] or [new_mean, new_variance])."""
    rows, channels = x.shape
    y = np.full_like(x, np.nan)
    mean, inv_std, var = (np.full(channels, -7.0, np.float32) for _ in range(3))
    p = params(rows, channels, activation, side is not None, momentum=momentum if moving else 0.0,
               has_moving=bool(moving))
    new_moving = []
    if channels:
        lib.run(f"batch_norm_act_stats_{dtype}", [x, mean, inv_std, var, p],
                threadgroups=norm_param_grad_groups(channels), threadgroup=threads or norm_param_grad_threads(rows, cap),
                order=order, seed=3)
    if moving:  # after the stats pass, before the elementwise one, also when rows == 0
        new_moving = list(metal_moving(lib, mean, var, moving[0], moving[1], p))
    if channels and rows:
        lib.run(f"batch_norm_act_{dtype}", [x, gamma, beta, x if side is None else side, mean, inv_std, y, p],
                grid=rows * channels, threadgroup=ELEMENT_THREADS, order=order, seed=4)
    return y, mean, inv_std, var, new_moving


def metal_grad(lib, dtype, dy, x, gamma, beta, side, mean, inv_std, activation, threads=None, cap=SWEEP_CAP,
               order="linear"):
    rows, channels = x.shape
    dx = np.full_like(x, np.nan)
    dside = np.full_like(x, np.nan)
    dgamma, dbeta = np.full(channels, np.nan, np.float32), np.full(channels, np.nan, np.float32)
    p = params(rows, channels, activation, side is not None)
    s = x if side is None else side
    if channels:
        lib.run(f"batch_norm_act_grad_sums_{dtype}", [dy, x, gamma, beta, s, mean, inv_std, dgamma, dbeta, p],
                threadgroups=norm_param_grad_groups(channels), threadgroup=threads or norm_param_grad_threads(rows, cap),
                order=order, seed=5)
    if channels and rows:
        lib.run(f"batch_norm_act_grad_{dtype}",
                [dy, x, gamma, beta, s, mean, inv_std, dgamma, dbeta, dx, dx if side is None else dside, p],
                grid=rows * channels, threadgroup=ELEMENT_THREADS, order=order, seed=6)
    return dx, dgamma, dbeta, (None if side is None else dside)


# ----------------------------------------------------------------------------
# Inputs, references, tolerances


def random_case(dtype, rows, channels, seed, side=True, offset=0.5):
    rng = np.random.default_rng(seed)
    cast = lambda a: a.astype(np.float32).astype(DTYPES[dtype])  # noqa: E731
    x = cast(rng.normal(offset, 2.0, (rows, channels)))
    dy = cast(rng.normal(0, 1, (rows, channels)))
    s = cast(rng.normal(0, 1, (rows, channels))) if side else None
    gamma = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    beta = rng.normal(0, 0.3, channels).astype(np.float32)
    return x, dy, s, gamma, beta


def f64(a):
    return None if a is None else np.asarray(a, np.float32).astype(np.float64)


def ulp(v, dtype):
    v = np.abs(np.asarray(v, np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return np.exp2(np.maximum(e, MIN_EXP[dtype]) - MANTISSA[dtype])


def assert_output(got, want, dtype, rows, what=""):
    got, want = f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    bound = K * U * (1.0 + math.sqrt(rows)) * scale
    if dtype != "float":
        bound = bound + 0.5 * ulp(np.maximum(np.abs(got), np.abs(want)), dtype)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def assert_sums(got, want, abs_sum, rows, what=""):
    bound = K * U * (1.0 + math.sqrt(rows)) * np.maximum(abs_sum, 1e-30)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"{what}: max error {err.max()}"


def check_case(lib, dtype, activation, x, dy, side, gamma, beta, threads=None, cap=SWEEP_CAP):
    rows = x.shape[0]
    y, mean, inv_std, var, _ = metal_forward(lib, dtype, x, gamma, beta, side, activation, threads, cap)
    wy, wmean, winv, wvar = testing.np_batch_norm_act(f64(x), gamma, beta, f64(side), activation, EPSILON, ALPHA)
    assert_output(y, wy, dtype, rows, "y")
    scale = max(1.0, float(np.abs(f64(x)).max()))
    np.testing.assert_allclose(mean, wmean, rtol=0, atol=K * U * (1 + math.sqrt(rows)) * scale)
    np.testing.assert_allclose(var, wvar, rtol=K * U * (1 + math.sqrt(rows)), atol=1e-7)
    np.testing.assert_allclose(inv_std, winv, rtol=K * U * (1 + math.sqrt(rows)))
    dx, dgamma, dbeta, dside = metal_grad(lib, dtype, dy, x, gamma, beta, side, mean, inv_std, activation, threads,
                                          cap)
    wdx, wdg, wdb, wds = testing.np_batch_norm_act_grad(f64(dy), f64(x), gamma, beta, f64(side), activation, EPSILON,
                                                        ALPHA)
    xhat = (f64(x) - wmean) * winv
    pre = xhat * gamma + beta + (0.0 if side is None else f64(side))
    dpre = f64(dy) * testing.np_activation_grad(activation, pre, ALPHA)
    assert_sums(dbeta, wdb, np.abs(dpre).sum(0), rows, "dbeta")
    assert_sums(dgamma, wdg, np.abs(dpre * xhat).sum(0), rows, "dgamma")
    assert_output(dx, wdx, dtype, rows, "dx")
    if side is not None:
        assert_output(dside, wds, dtype, rows, "dside")
    return (y, mean, inv_std, var), (dx, dgamma, dbeta, dside)


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    names = [f"{n}_{d}" for n in NAMES for d in DTYPES] + [MOVING_NAME]
    assert lib.kernels() == sorted(names)
    counts = {"batch_norm_act_stats": 5, "batch_norm_act": 8, "batch_norm_act_grad_sums": 10, "batch_norm_act_grad": 12,
              MOVING_NAME: 7}
    for name in names:
        params_ = lib.params(name)
        assert len(params_) == counts[name if name == MOVING_NAME else name.rsplit("_", 1)[0]], name
        assert params_[-1].kind == "reference" and params_[-1].size == PARAMS.itemsize


@pytest.mark.cover_axes("dtype", "activation")  # each dtype is its own instantiation; each activation its own code
@pytest.mark.parametrize("side", [False, True], ids=["noside", "side"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_instantiation_matches_numpy_and_the_cpu_kernel(lib, cpu, dtype, activation, side):
    x, dy, s, gamma, beta = random_case(dtype, 37, 40, seed=CODES[activation] * 2 + side, side=side)
    (y, mean, inv_std, var), (dx, dgamma, dbeta, dside) = check_case(lib, dtype, activation, x, dy, s, gamma, beta)
    # The CPU kernel from the same inputs: the same values to rounding.
    tx, tdy = tf.constant(x), tf.constant(dy)
    sides = [] if s is None else [tf.constant(s)]
    cy, cmean, cinv, cvar, _ = cpu.tfmetal_ext_batch_norm_act(tx, gamma, beta, sides, [], activation=activation,
                                                              alpha=ALPHA, epsilon=EPSILON)
    np.testing.assert_allclose(mean, cmean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, cvar.numpy(), rtol=1e-5)
    cgrads = cpu.tfmetal_ext_batch_norm_act_grad(tdy, tx, cy, gamma, beta, sides, mean, inv_std, activation=activation,
                                                 alpha=ALPHA, epsilon=EPSILON)
    np.testing.assert_allclose(dbeta, cgrads[2].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgamma, cgrads[1].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,threads", [("float", 32), ("float", 256), ("half", 64), ("bfloat", 128)])
def test_threadgroup_sizes_the_host_can_pick(lib, dtype, threads):
    """More row lanes than rows, and fewer: the lanes' moments merge in order."""
    x, dy, s, gamma, beta = random_case(dtype, 9, 70, seed=threads)
    check_case(lib, dtype, "relu", x, dy, s, gamma, beta, threads=threads)


@pytest.mark.full  # 1024-thread emulated threadgroups are slow; the quick tier keeps the threadgroup-size test
def test_host_sized_reduction_over_many_rows(lib):
    assert norm_param_grad_threads(3000, 1024) == 1024  # what the host picks: 32 row lanes
    x, dy, s, gamma, beta = random_case("float", 3000, 33, seed=11)
    check_case(lib, "float", "gelu", x, dy, s, gamma, beta, cap=1024)


def test_variance_of_a_large_offset_channel(lib):
    """1e4 + N(0, 1): the variance to float32 accuracy (shifted sums, Chan's merge of the lanes)."""
    rng = np.random.default_rng(12)
    x = (1e4 + rng.normal(0, 1, (2000, 4))).astype(np.float32)
    _, mean, _, var, _ = metal_forward(lib, "float", x, np.ones(4, np.float32), np.zeros(4, np.float32), None,
                                       "linear")
    want = x.astype(np.float64).var(0)
    np.testing.assert_allclose(var, want, rtol=K * U * (1 + math.sqrt(2000)))
    naive = (x * x).mean(0, dtype=np.float32) - x.mean(0, dtype=np.float32) ** 2
    assert np.max(np.abs(naive / want - 1)) > 100 * K * U * (1 + math.sqrt(2000))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_empty_batch(lib, dtype):
    # rows == 0: only the reductions run: NaN statistics forward, zero dgamma / dbeta backward.
    x = np.zeros((0, 33), DTYPES[dtype])
    gamma, beta = np.ones(33, np.float32), np.zeros(33, np.float32)
    _, mean, inv_std, var, _ = metal_forward(lib, dtype, x, gamma, beta, None, "relu")
    assert np.isnan(mean).all() and np.isnan(var).all() and np.isnan(inv_std).all()
    _, dgamma, dbeta, _ = metal_grad(lib, dtype, x.copy(), x, gamma, beta, None, mean, inv_std, "relu")
    np.testing.assert_array_equal(dgamma, 0.0)
    np.testing.assert_array_equal(dbeta, 0.0)


def test_nan_stays_in_its_channel(lib):
    x, dy, s, gamma, beta = random_case("half", 12, 40, seed=13)
    x[3, 5] = np.nan
    x[7, 33] = np.inf
    y, mean, inv_std, var, _ = metal_forward(lib, "half", x, gamma, beta, s, "silu")
    bad = [5, 33]
    good = [c for c in range(40) if c not in bad]
    assert np.isnan(var[bad]).all() and np.isfinite(var[good]).all()
    assert np.isfinite(y[:, good].astype(np.float32)).all()
    dx, dgamma, dbeta, dside = metal_grad(lib, "half", dy, x, gamma, beta, s, mean, inv_std, "silu")
    assert np.isfinite(dx[:, good].astype(np.float32)).all() and np.isfinite(dgamma[good]).all()
    assert np.isnan(dgamma[bad]).all()


def test_results_do_not_depend_on_threadgroup_order(lib):
    x, dy, s, gamma, beta = random_case("bfloat", 20, 70, seed=14)
    first = metal_forward(lib, "bfloat", x, gamma, beta, s, "leaky_relu")[:4]
    again = metal_forward(lib, "bfloat", x, gamma, beta, s, "leaky_relu", order="shuffle")[:4]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    grads = metal_grad(lib, "bfloat", dy, x, gamma, beta, s, first[1], first[2], "leaky_relu")
    grads_again = metal_grad(lib, "bfloat", dy, x, gamma, beta, s, first[1], first[2], "leaky_relu", order="reverse")
    for a, b in zip(grads, grads_again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ----------------------------------------------------------------------------
# The moving statistics pass (batch_norm_act_moving)


def np_blend(moving, batch, momentum):
    """The update from its definition, every operation rounded to float32."""
    m = np.float32(momentum)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(moving, np.float32) * m + np.asarray(batch, np.float32) * (np.float32(1) - m)


def np_moving_update(mean, var, moving_mean, moving_var, momentum):
    """(new_mean, new_variance): the blends if every one is finite, else the moving statistics."""
    new_mean, new_var = np_blend(moving_mean, mean, momentum), np_blend(moving_var, var, momentum)
    if np.isfinite(new_mean).all() and np.isfinite(new_var).all():
        return new_mean, new_var
    return np.asarray(moving_mean, np.float32).copy(), np.asarray(moving_var, np.float32).copy()


def moving_case(channels, seed):
    rng = np.random.default_rng(seed)
    mean = rng.normal(0.5, 2.0, channels).astype(np.float32)
    var = rng.uniform(0.0, 4.0, channels).astype(np.float32)
    moving_mean = rng.normal(0.0, 1.0, channels).astype(np.float32)
    moving_var = rng.uniform(0.5, 2.0, channels).astype(np.float32)
    return mean, var, moving_mean, moving_var


def moving_params(channels, momentum):
    return params(5, channels, "relu", False, momentum=momentum, has_moving=True)


def assert_bits(got, want, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{what}: channels {diff[:8]} differ: {got[diff[:8]]} vs {want[diff[:8]]}"


def check_moving(lib, channels, momentum, threads=None, order="linear", seed=0, case=None):
    mean, var, moving_mean, moving_var = case if case is not None else moving_case(channels, seed)
    inputs = [a.copy() for a in (mean, var, moving_mean, moving_var)]
    got = metal_moving(lib, mean, var, moving_mean, moving_var, moving_params(channels, momentum), threads, order,
                       seed)
    want = np_moving_update(mean, var, moving_mean, moving_var, momentum)
    assert_bits(got[0], want[0], "new_mean")
    assert_bits(got[1], want[1], "new_variance")
    for before, after in zip(inputs, (mean, var, moving_mean, moving_var)):
        assert_bits(after, before, "an input")  # read only
    return got


# (C, threads): one channel; a partial SIMD-group; more channels than threads (each thread
# loops); a threadgroup that is not a power of two; the host's size for C > 1024 (1024
# threads, some looping twice) is in the full tier.
@pytest.mark.every_case  # each pair is its own loop / reduction shape
@pytest.mark.parametrize("channels,threads", [(1, None), (31, 96), (33, 32), (1500, 64)], ids=str)
def test_moving_update_matches_the_definition(lib, channels, threads):
    got = check_moving(lib, channels, MOMENTUM, threads, seed=channels)
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()  # the update was taken
    assert not np.array_equal(got[0], moving_case(channels, channels)[2])


def test_moving_update_with_no_channels_writes_nothing(lib):
    # C == 0: the host encodes no pass (the outputs are empty); dispatched anyway, the kernel
    # reads and writes nothing (a one-element sentinel stays as it was).
    one = [np.full(1, v, np.float32) for v in (np.nan, np.nan, 1.0, 2.0)]
    new_mean, new_var = np.full(1, -9.0, np.float32), np.full(1, -9.0, np.float32)
    lib.run(MOVING_NAME, [*one, new_mean, new_var, moving_params(0, MOMENTUM)], threadgroups=1, threadgroup=32)
    assert new_mean[0] == -9.0 and new_var[0] == -9.0


@pytest.mark.full  # the threadgroup sizes and orders the quick tier does not take
@pytest.mark.parametrize("order", ["linear", "reverse", "shuffle"])
@pytest.mark.parametrize("threads", [32, 64, 96, 256, 1024, None])
@pytest.mark.parametrize("channels", [1, 31, 32, 33, 1000, 1025, 4099])
def test_moving_update_sweep(lib, channels, threads, order):
    check_moving(lib, channels, 0.9, threads, order, seed=channels + (threads or 0))


# One channel's update is not finite: both outputs are the moving inputs' exact bits: NaN
# payloads, a signaling NaN and a -0.0 (in another channel) survive (no arithmetic on the old values).
NAN_PAYLOAD = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
SIGNALING_NAN = np.array([0x7F800001], np.uint32).view(np.float32)[0]
BAD_STATISTICS = {
    "mean_nan": ("mean", np.nan),
    "mean_minus_inf": ("mean", -np.inf),
    "variance_inf": ("var", np.inf),
    "moving_mean_inf": ("moving_mean", np.inf),
    "moving_variance_nan_payload": ("moving_var", NAN_PAYLOAD),
    "moving_mean_signaling_nan": ("moving_mean", SIGNALING_NAN),
}


@pytest.mark.every_case  # the first channel is thread 0's, the last one the last thread's (second loop step)
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", list(BAD_STATISTICS))
def test_a_non_finite_channel_keeps_the_moving_statistics(lib, bad, where):
    channels, threads = 200, 64  # threads loop over the channels; the last channel is the last thread's
    case = dict(zip(("mean", "var", "moving_mean", "moving_var"), moving_case(channels, seed=21)))
    name, value = BAD_STATISTICS[bad]
    c = 0 if where == "first" else channels - 1
    case[name][c] = value
    case["moving_mean"][100] = -0.0
    moving = (case["moving_mean"].copy(), case["moving_var"].copy())
    new_mean, new_var = check_moving(lib, channels, MOMENTUM, threads, case=tuple(case.values()))
    assert_bits(new_mean, moving[0], "new_mean")  # the reference agrees: check_moving compared it
    assert_bits(new_var, moving[1], "new_variance")


@pytest.mark.parametrize("order", ["linear", pytest.param("reverse", marks=pytest.mark.full),
                                   pytest.param("shuffle", marks=pytest.mark.full)])
@pytest.mark.parametrize("threads", [96, pytest.param(160, marks=pytest.mark.full),
                                     pytest.param(1024, marks=pytest.mark.full)])
def test_every_thread_can_veto_the_update(lib, threads, order):
    """A non-finite variance in each thread's channel in turn (every slot of the reduction:
    96 and 160 threads fold through odd counts, 3 and 5; 1024 by a sample), and in a channel of
    a second loop step: the update is never taken."""
    channels = threads + 7  # threads 0..6 take a second channel
    rng = np.random.default_rng(threads)
    cs = range(channels) if threads < 1024 else sorted({0, 1, 511, 512, 1023, *rng.integers(0, channels, 6).tolist()})
    base = moving_case(channels, seed=threads)
    for c in cs:
        mean, var, moving_mean, moving_var = (a.copy() for a in base)
        var[c] = np.inf
        new_mean, new_var = check_moving(lib, channels, MOMENTUM, threads, order, seed=c,
                                         case=(mean, var, moving_mean, moving_var))
        assert_bits(new_mean, moving_mean, f"channel {c}")
        assert_bits(new_var, moving_var, f"channel {c}")


# Finite statistics whose update overflows float32 (momentum outside [0, 1]: the op only asks
# for a finite momentum; inside it a convex blend of finite values stays finite).
OVERFLOWS = {
    # kept = 3e38 and added = (1 - 2) * -1.5e38 = 1.5e38 are finite; their sum is not.
    "sum": ("mean", 1.5e38, -1.5e38, 2.0),
    # added = 3e38 * (1 - -1) overflows.
    "product": ("var", 1.0, 3e38, -1.0),
}


@pytest.mark.parametrize("kind", list(OVERFLOWS))
def test_an_overflowing_update_keeps_the_moving_statistics(lib, kind):
    name, moving_value, batch_value, momentum = OVERFLOWS[kind]
    channels = 40
    mean, var, moving_mean, moving_var = moving_case(channels, seed=22)
    batch, moving = (mean, moving_mean) if name == "mean" else (var, moving_var)
    moving[17], batch[17] = moving_value, batch_value
    m = np.float32(momentum)
    with np.errstate(over="ignore"):
        kept, added = np.float32(moving_value) * m, np.float32(batch_value) * (np.float32(1) - m)
        assert not np.isfinite(kept + added)  # it really overflows in float32
    if kind == "sum":
        assert np.isfinite(kept) and np.isfinite(added)
    # The other channels' updates are finite with this momentum too: the one overflow decides.
    others = np.arange(channels) != 17
    assert np.isfinite(np_blend(moving_mean, mean, momentum)[others]).all()
    assert np.isfinite(np_blend(moving_var, var, momentum)[others]).all()
    new_mean, new_var = check_moving(lib, channels, momentum, 32, case=(mean, var, moving_mean, moving_var))
    assert_bits(new_mean, moving_mean, "new_mean")
    assert_bits(new_var, moving_var, "new_variance")


@pytest.mark.parametrize("rows", [0, 6])
def test_forward_with_moving_statistics(lib, rows):
    """The op's passes in the host's order: the moving pass blends the stats pass's mean and
    variance; an empty batch (NaN statistics) and a batch with a NaN give the moving statistics back."""
    channels = 36
    x, _, _, gamma, beta = random_case("half", rows, channels, seed=23, side=False)
    _, _, moving_mean, moving_var = moving_case(channels, seed=24)
    y, mean, _, var, (new_mean, new_var) = metal_forward(lib, "half", x, gamma, beta, None, "relu",
                                                         moving=(moving_mean, moving_var), momentum=0.9)
    want = np_moving_update(mean, var, moving_mean, moving_var, 0.9)
    assert_bits(new_mean, want[0], "new_mean")
    assert_bits(new_var, want[1], "new_variance")
    if rows == 0:
        assert_bits(new_mean, moving_mean, "new_mean")
        assert_bits(new_var, moving_var, "new_variance")
        return
    assert np.isfinite(new_mean).all() and not np.array_equal(new_mean, moving_mean)
    x[2, 30] = np.nan
    *_, (new_mean, new_var) = metal_forward(lib, "half", x, gamma, beta, None, "relu",
                                            moving=(moving_mean, moving_var), momentum=0.9)
    assert_bits(new_mean, moving_mean, "new_mean")
    assert_bits(new_var, moving_var, "new_variance")


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("shape", [(64, 8, 8, 32), (5, 33), (0, 8), (3, 0)], ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels(cpu, dtype, activation, shape):
    rng = np.random.default_rng(31)
    cast = lambda a: tf.constant(a.astype(np.float32), TF_DTYPES[dtype])  # noqa: E731
    x, dy, s = (cast(rng.normal(0.5, 2.0, shape)) for _ in range(3))
    c = shape[-1]
    gamma, beta = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.normal(0, 0.3, c).astype(np.float32)
    results = {}
    moving = [rng.normal(0, 1, c).astype(np.float32), rng.uniform(0.5, 2.0, c).astype(np.float32)]
    for device in ("/GPU:0", "/CPU:0"):
        with tf.device(device):
            y, mean, inv_std, var, new_moving = cpu.tfmetal_ext_batch_norm_act(x, gamma, beta, [s], moving,
                                                                               activation=activation, momentum=0.9)
            grads = cpu.tfmetal_ext_batch_norm_act_grad(dy, x, y, gamma, beta, [s], mean, inv_std,
                                                        activation=activation)
        if device == "/GPU:0":
            assert "GPU" in y.device and "GPU" in grads[0].device
        results[device] = [t.numpy().astype(np.float64) for t in (y, mean, var, grads[0], grads[1], grads[2],
                                                                   grads[3][0])]
        # The moving statistics from this device's mean / variance: the numpy definition to one
        # float32 ulp (a Metal compiler may fuse the blend's sum into an fma), or unchanged
        # where the batch is empty.
        want = np_moving_update(mean.numpy(), var.numpy(), moving[0], moving[1], 0.9)
        for got, w in zip(new_moving, want):
            np.testing.assert_array_max_ulp(got.numpy(), w, maxulp=1)
    rows = int(np.prod(shape[:-1]))
    tol = K * U * (1 + math.sqrt(rows)) + {"float": 0.0, "half": 2.0 ** -10, "bfloat": 2.0 ** -7}[dtype]
    for a, b in zip(results["/GPU:0"], results["/CPU:0"]):
        scale = max(1.0, float(np.nanmax(np.abs(b), initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)
