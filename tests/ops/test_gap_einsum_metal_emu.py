"""The Einsum gap kernel (custom_ops/metal/gap_einsum.metal) and its planner, on the Metal emulator.

Every instantiation -- gap_einsum_float, gap_einsum_half, gap_einsum_bfloat -- runs one equation of each
family Keras and keras-hub emit (attention scores and values and their gradients, projections, the
rotary embedding's outer product, EinsumDense, Gemma's grouped heads, rank-5 attention whose groups
split into several dimensions), dispatched with the plan and the grid the host code computes (the
planner of custom_ops/include/tfmetal/gap_einsum.h, exported by the emulated library), at sizes off the
32 x 32 x 16 tiles, and is compared with numpy's einsum in float64 and with TensorFlow's own CPU kernel.

The tolerances are derived, not tuned. The kernel sums K products in float in increasing k and rounds
once to T, so against the exact result (float64)

    |C - exact| <= u_T |exact| + (1 + u_T) gamma_K(2^-24) S + eta_T,   S = sum_k |a_k b_k|,

with gamma_K(u) = K u / (1 - K u), u_T the unit roundoff of T (float 2^-24, half 2^-11, bfloat16
2^-8) and eta_T half its smallest subnormal. TensorFlow's CPU kernel of half and bfloat16 rounds
partial sums to T (measured: more than float accumulation allows), so against it the bound adds
u_T |exact| + gamma_K(u_T) S. Empty dimensions, K = 0 (zeros), NaN and infinities, chunked batches and
threadgroup order are checked as well, and the planner's rejections with their reasons. One documented
difference: where oneDNN computes TF's bfloat16 einsum on a CPU without bfloat16 instructions
(`devices.capabilities()`: onednn_bf16 and not cpu_bf16), TF gives NaN for some outputs whose exact
value is infinite; the kernel gives the infinity (test_nan_and_inf_propagate_as_numpy).
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, testing
from tfmetal_ext.backends import gap_kernels

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
KERNELS = {d: f"gap_einsum_{d}" for d in DTYPES}
UNIT_ROUNDOFF = {"float": 2.0 ** -24, "half": 2.0 ** -11, "bfloat": 2.0 ** -8}
HALF_SUBNORMAL = {"float": 2.0 ** -150, "half": 2.0 ** -25, "bfloat": 2.0 ** -134}
THREADS = (16, 16, 1)

emu = testing.load_emu()
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "gap_einsum.metal")


@pytest.fixture(scope="module")
def planner(lib):
    return testing.EinsumPlanner(lib.path)


def metal_einsum(lib, planner, dtype, equation, a, b, chunk=None, order="linear"):
    """The kernel's result, dispatched as gap_einsum_metal.mm does: the plan, then chunks of batches."""
    code, shape, params, message = planner.plan(equation, a.shape, b.shape)
    assert code == 0, message
    out = np.full(shape, np.nan, np.float32).astype(a.dtype)
    if out.size == 0:
        return out
    placeholder = out.reshape(-1)[:1].copy()  # an empty operand (K = 0) binds some buffer; never read
    flat_a = a.reshape(-1) if a.size else placeholder
    flat_b = b.reshape(-1) if b.size else placeholder
    chunk = planner.max_batch() if chunk is None else chunk
    batch = int(params["batch"])
    for start in range(0, batch, chunk):
        p = params.copy()
        p["batch_start"] = start
        lib.run(KERNELS[dtype], [flat_a, flat_b, out.reshape(-1), ("bytes", p)],
                threadgroups=planner.grid(p, min(chunk, batch - start)), threadgroup=THREADS, order=order)
    return out


def contraction_size(planner, equation, a, b):
    return int(planner.plan(equation, a.shape, b.shape)[2]["k"])


def gamma(k, u):
    return k * u / (1 - k * u)


def bounds(planner, dtype, equation, a, b):
    """(exact, bound against exact, bound against TF's CPU kernel): see the module docstring."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = np.einsum(equation, a64, b64)
    s = np.einsum(equation, np.abs(a64), np.abs(b64))
    k, u_t = contraction_size(planner, equation, a, b), UNIT_ROUNDOFF[dtype]
    ours = u_t * np.abs(exact) + (1 + u_t) * gamma(k, 2.0 ** -24) * s + HALF_SUBNORMAL[dtype]
    theirs = u_t * np.abs(exact) + gamma(k, u_t) * s + HALF_SUBNORMAL[dtype]
    return exact, ours, ours + theirs


def tf_cpu_einsum(equation, a, b):
    with tf.device("/CPU:0"):
        return tf.raw_ops.Einsum(inputs=[tf.constant(a), tf.constant(b)], equation=equation).numpy()


def onednn_emulates_bfloat16():
    """TF's CPU kernels compute bfloat16 through oneDNN on a CPU without bfloat16 instructions."""
    caps = devices.capabilities()
    return caps.onednn_bf16 and not caps.cpu_bf16


def assert_within(got, want, bound):
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got64), np.isnan(want64)), "NaN positions differ"
    finite = np.isfinite(want64)
    assert np.array_equal(got64[~finite & ~np.isnan(want64)], want64[~finite & ~np.isnan(want64)]), "infinities differ"
    err = np.abs(got64[finite] - want64[finite])
    assert np.all(err <= bound[finite]), f"max error {err.max():.3g} over a bound of {bound[finite][err.argmax()]:.3g}"


def operands(equation, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    ins = equation.split("->")[0].split(",")
    return [np.asarray(rng.standard_normal([sizes[c] for c in s]), np.float32).astype(DTYPES[dtype]) for s in ins]


# One equation per family (all in EINSUM_EQUATIONS), with sizes off the tiles; each label's size.
FAMILIES = {
    "mha_scores": ("BTNH,BSNH->BNTS", dict(B=2, T=33, S=31, N=3, H=17)),
    "mha_values": ("BNTS,BSNH->BTNH", dict(B=2, T=33, S=31, N=3, H=17)),
    "mha_scores_grad": ("BNTS,BTNH->BSNH", dict(B=1, T=19, S=35, N=2, H=9)),
    "projection": ("abc,cde->abde", dict(a=2, b=37, c=24, d=3, e=5)),
    "projection_out": ("abcd,cde->abe", dict(a=2, b=29, c=3, d=5, e=33)),
    "projection_kernel_grad": ("abde,abc->cde", dict(a=3, b=7, c=20, d=2, e=6)),
    "rotary": ("ab,c->abc", dict(a=3, b=41, c=35)),
    "einsum_dense": ("abcd,def->abcef", dict(a=2, b=3, c=9, d=18, e=4, f=5)),
    "gemma_grouped": ("abcde,aebf->adbcf", dict(a=2, b=2, c=2, d=13, e=17, f=4)),
    "mha_rank5": ("abcdefgh,afghbi->acdebi", dict(a=1, b=2, c=2, d=3, e=3, f=2, g=3, h=5, i=4)),
}


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(KERNELS.values())


def test_every_family_is_in_the_allowlist():
    assert {eq for eq, _ in FAMILIES.values()} <= set(gap_kernels.EINSUM_EQUATIONS)


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_agrees_with_numpy_and_tf_within_the_bound(lib, planner, dtype, family):
    equation, sizes = FAMILIES[family]
    a, b = operands(equation, sizes, dtype, seed=len(family))
    got = metal_einsum(lib, planner, dtype, equation, a, b)
    exact, against_exact, against_tf = bounds(planner, dtype, equation, a, b)
    assert_within(got, exact, against_exact)
    assert_within(got, tf_cpu_einsum(equation, a, b), against_tf)


def test_the_plan_reads_operands_through_strides_without_transposes(planner):
    # MHA scores: batch (B, N) is two dimensions in each tensor (they are not neighbours); M = T, N = S, K = H.
    code, shape, p, _ = planner.plan("BTNH,BSNH->BNTS", (2, 5, 3, 7), (2, 6, 3, 7))
    assert code == 0 and shape == (2, 3, 5, 6)
    assert (int(p["batch"]), int(p["m"]), int(p["n"]), int(p["k"])) == (6, 5, 6, 7)
    batch = p["g"][0]
    assert int(batch["rank"]) == 2 and list(batch["dims"][:2]) == [2, 3]
    assert list(batch["a"][:2]) == [5 * 3 * 7, 7] and list(batch["b"][:2]) == [6 * 3 * 7, 7]
    assert list(batch["c"][:2]) == [3 * 5 * 6, 5 * 6]
    m, n, k = p["g"][1], p["g"][2], p["g"][3]
    assert (int(m["a"][0]), int(m["b"][0]), int(m["c"][0])) == (3 * 7, 0, 6)
    assert (int(n["a"][0]), int(n["b"][0]), int(n["c"][0])) == (0, 3 * 7, 1)
    assert (int(k["a"][0]), int(k["b"][0]), int(k["c"][0])) == (1, 1, 0)
    # Labels that stay neighbours in every tensor merge into one dimension: "abc,cde->abde" is a plain matmul.
    code, _, p, _ = planner.plan("abc,cde->abde", (2, 3, 4), (4, 5, 6))
    assert [int(g["rank"]) for g in p["g"]] == [1, 1, 1, 1]
    assert (int(p["batch"]), int(p["m"]), int(p["n"]), int(p["k"])) == (1, 6, 30, 4)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("equation, a_shape, b_shape", [
    ("abc,cde->abde", (0, 5, 4), (4, 3, 2)),    # batch-like leading axis 0: an empty output
    ("ab,c->abc", (3, 0), (4,)),                # M = 0
    ("BTNH,BSNH->BNTS", (2, 3, 2, 4), (2, 0, 2, 4)),  # N = 0
], ids=["leading_0", "m_0", "n_0"])
def test_empty_outputs_dispatch_nothing(lib, planner, dtype, equation, a_shape, b_shape):
    a = np.zeros(a_shape, DTYPES[dtype])
    b = np.zeros(b_shape, DTYPES[dtype])
    got = metal_einsum(lib, planner, dtype, equation, a, b)
    assert got.shape == tf_cpu_einsum(equation, a, b).shape and got.size == 0


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_k_zero_writes_zeros(lib, planner, dtype):
    equation = "abcd,cde->abe"
    a = np.zeros((2, 3, 0, 4), DTYPES[dtype])
    b = np.zeros((0, 4, 5), DTYPES[dtype])
    got = metal_einsum(lib, planner, dtype, equation, a, b)
    want = tf_cpu_einsum(equation, a, b)
    assert got.shape == want.shape == (2, 3, 5)
    assert np.array_equal(got.astype(np.float32), np.zeros((2, 3, 5), np.float32))


@pytest.mark.cover_axes("dtype")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_propagate_as_numpy(lib, planner, dtype):
    equation = "abc,cde->abde"
    a, b = operands(equation, dict(a=2, b=35, c=19, d=2, e=17), dtype, seed=3)
    a[0, 3, 5] = np.nan
    a[1, 34, 18] = np.inf
    b[7, 1, 16] = -np.inf
    b[0, 0, 0] = 0.0
    a[1, 0, 0] = np.inf  # inf * 0 = NaN in one output
    got = metal_einsum(lib, planner, dtype, equation, a, b)
    with np.errstate(invalid="ignore", over="ignore"):
        exact, against_exact, _ = bounds(planner, dtype, equation, a, b)
    assert np.isnan(got[0, 3]).all() and np.isnan(got[1, 0, 0, 0])
    assert_within(got, exact, np.nan_to_num(against_exact, posinf=np.inf))
    tf_cpu = tf_cpu_einsum(equation, a, b)
    if dtype == "bfloat" and onednn_emulates_bfloat16():
        # TF's oneDNN kernel without the CPU's bfloat16 instructions gives NaN for some infinite
        # results (measured: the 34 outputs of the row holding a[1, 34, 18] = inf, on an AVX-512 Xeon
        # without AVX512_BF16; a 1 x 8 row gives inf). Only there, and only where the exact result is
        # infinite, does the kernel (checked against the exact result above) not match TF's.
        extra = np.isnan(tf_cpu.astype(np.float64)) & ~np.isnan(exact)
        assert np.isinf(exact[extra]).all(), "TF's kernel has NaN where the exact result is finite"
        tf_cpu = np.where(extra, got, tf_cpu)
    assert_within(got, tf_cpu, np.full(got.shape, np.inf))  # NaN and inf positions


@pytest.mark.parametrize("equation, a_shape, b_shape", [
    ("a,a->", (37,), (37,)),            # a dot product: M = N = 1, a scalar output
    ("ab,ab->", (5, 7), (5, 7)),        # K of two labels that merge
    (",ab->ab", (), (3, 33)),           # a scalar operand: K = 1
    ("ab,cb->ca", (3, 0), (2, 0)),      # K = 0 with a transposed output
])
def test_scalars_and_degenerate_groups(lib, planner, equation, a_shape, b_shape):
    rng = np.random.default_rng(11)
    a = np.asarray(rng.standard_normal(a_shape), np.float32)
    b = np.asarray(rng.standard_normal(b_shape), np.float32)
    got = metal_einsum(lib, planner, "float", equation, a, b)
    exact, against_exact, against_tf = bounds(planner, "float", equation, a, b)
    assert_within(got, exact, np.asarray(against_exact))
    assert_within(got, tf_cpu_einsum(equation, a, b), np.asarray(against_tf))


def test_batches_in_chunks_continue_the_batch_index(lib, planner):
    # The host dispatches at most TFM_GAP_EINSUM_MAX_BATCH batch indices at a time.
    assert planner.max_batch() == 65535
    equation, sizes = FAMILIES["mha_scores"]
    a, b = operands(equation, dict(sizes, B=3, N=3), "half", seed=5)
    whole = metal_einsum(lib, planner, "half", equation, a, b)
    chunked = metal_einsum(lib, planner, "half", equation, a, b, chunk=4)
    assert np.array_equal(whole.view(np.uint16), chunked.view(np.uint16))


def test_results_do_not_depend_on_threadgroup_order(lib, planner):
    equation, sizes = FAMILIES["projection"]
    a, b = operands(equation, sizes, "float", seed=9)
    first = metal_einsum(lib, planner, "float", equation, a, b)
    assert np.array_equal(first, metal_einsum(lib, planner, "float", equation, a, b, order="shuffle"))


def test_grid_covers_each_tile_once(planner):
    _, _, p, _ = planner.plan("ab,bc->ac", (65, 7), (7, 33))
    assert planner.grid(p, 1) == (2, 3, 1)
    _, _, p, _ = planner.plan("ab,bc->ac", (64, 7), (7, 32))
    assert planner.grid(p, 5) == (1, 2, 5)


# ---------------------------------------------------------------------------
# The planner: what it rejects, and TensorFlow's shape errors.


@pytest.mark.parametrize("equation, reason", [
    ("ab,bc", "no '->'"),
    ("ab->ba", "1 operand(s): only two-operand contractions"),
    ("ab,bc,cd->ad", "more than two operands"),
    ("...a,ab->...b", "an ellipsis"),
    ("aa,ab->b", "label 'a' appears twice in operand 0 (a diagonal)"),
    ("ab,bb->a", "label 'b' appears twice in operand 1 (a diagonal)"),
    ("ab,bc->aac", "label 'a' appears twice in the output"),
    ("ab,ab->abd", "output label 'd' is in neither operand"),
    ("ab,b->", "label 'a' of operand 0 is summed without being contracted"),
    ("ab,bc->a", "label 'c' of operand 1 is summed without being contracted"),
    ("a1,1b->ab", "'1' is not a label"),
    ("ab,bc->a-c", "'-' is not a label"),
    ("ab,bc->ac->a", "more than one '->'"),
    ("abcdefghij,jk->acegibdfhk", "the M labels form more than 4 separate dimensions"),
])
def test_the_planner_rejects_with_a_reason(planner, equation, reason):
    got = planner.reason(equation)
    assert got is not None and reason in got, got
    code, _, _, message = planner.plan(equation, (1,), (1,))
    assert code == -1 and message == got


@pytest.mark.parametrize("equation", ["ab,bc->ac", "a,a->", ",ab->ab", "ab,ab->", "abc,cde->abde", "Ab,bC->AC"])
def test_the_planner_accepts_contractions(planner, equation):
    assert planner.reason(equation) is None


def test_the_allowlist_is_sorted_unique_and_every_equation_is_accepted(planner):
    eqs = gap_kernels.EINSUM_EQUATIONS
    assert list(eqs) == sorted(set(eqs)) and len(eqs) > 50
    rejected = {eq: planner.reason(eq) for eq in eqs if planner.reason(eq) is not None}
    assert not rejected


def tf_error(equation, a_shape, b_shape):
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        tf_cpu_einsum(equation, np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32))
    return info.value.message


@pytest.mark.parametrize("equation, a_shape, b_shape", [
    ("ab,bc->ac", (2, 3), (4, 5)),
    ("abc,cd->abd", (2, 3), (3, 5)),
    ("ab,bc->ac", (2, 3), (3,)),
    ("BTNH,BSNH->BNTS", (2, 3, 4, 5), (2, 3, 4, 6)),
])
def test_shape_errors_are_tfs(planner, equation, a_shape, b_shape):
    code, _, _, message = planner.plan(equation, a_shape, b_shape)
    assert code == 3  # InvalidArgument
    assert message in tf_error(equation, a_shape, b_shape)


def test_tensors_of_2_to_the_32_elements_are_refused(planner):
    code, _, _, message = planner.plan("ab,bc->ac", (1 << 16, 1 << 16), (1 << 16, 1))
    assert code == 12 and "fewer than 2^32 elements" in message and "input 0" in message
    # Empty tensors are not refused, however long a dimension (nothing is dispatched for them).
    assert planner.plan("ab,bc->ac", (0, 1 << 40), (1 << 40, 0))[:2] == (0, (0, 0))
