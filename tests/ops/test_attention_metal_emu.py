"""The attention Metal kernels (custom_ops/metal/attention.metal) on the Metal emulator.

Every instantiation -- attention_fwd_float, attention_fwd_half,
attention_fwd_bfloat, attention_bwd_dq_float, attention_bwd_dq_half,
attention_bwd_dq_bfloat, attention_bwd_dkdv_float, attention_bwd_dkdv_half,
attention_bwd_dkdv_bfloat -- is dispatched the way attention_metal.mm
dispatches it (dispatchThreadgroups of 128 threads over a (tile, head, batch)
grid) and compared with float64 softmax attention written here in numpy,
and with the CPU kernel (custom_ops/cpu/attention_kernels.cc: the same shared
math, another summation order). This is what verifies the kernels without a
Mac: no GPU result is claimed.

Attention dropout: every instantiation again with a seed (int32 and int64),
against the same float64 attention with the mask of TensorFlow's stateless
dropout drawn by the numpy Philox of tfmetal_ext.testing (np_key_counter,
np_stateless_uniform: written from the definition, not from the kernels'
header), and against the CPU kernel's dropout.

The BSHD layout: a few representative cases (grouped-query attention,
causal, windows, dropout, half and bfloat16, D != Dv past a chunk) again with
the operands transposed to [B, T, heads, width]: the results, transposed back,
must be the BHSD run's bits.

Outputs start as NaN (an element no thread writes fails the comparison) and
sit in front of a guard region that must come back untouched (no write past
the end). Emulated threadgroups run their 128 threads as OS threads, one
threadgroup after another, so the shapes are small; the larger sweep is
marked slow.
"""

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tfmetal_ext.testing import UNIFORM_BITS, compiled_ops, load_emu, np_key_counter, np_stateless_uniform

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
FORWARD = {"float": "attention_fwd_float", "half": "attention_fwd_half", "bfloat": "attention_fwd_bfloat"}
DQ = {"float": "attention_bwd_dq_float", "half": "attention_bwd_dq_half", "bfloat": "attention_bwd_dq_bfloat"}
DKDV = {"float": "attention_bwd_dkdv_float", "half": "attention_bwd_dkdv_half",
        "bfloat": "attention_bwd_dkdv_bfloat"}
# tfm_attention_params (custom_ops/metal/attention.h)
PARAMS = np.dtype([("batch", "<u4"), ("heads", "<u4"), ("tq", "<u4"), ("tk", "<u4"), ("d", "<u4"), ("dv", "<u4"),
                   ("mask_stride_b", "<u4"), ("mask_stride_h", "<u4"), ("mask_stride_q", "<u4"),
                   ("mask_stride_k", "<u4"), ("scale", "<f4"), ("causal", "<u4"), ("dropout", "<u4"),
                   ("seed_is_int64", "<u4"), ("mantissa_bits", "<u4"), ("dropout_rate", "<f4"),
                   ("dropout_scale", "<f4"), ("kv_heads", "<u4"), ("window", "<u4"), ("layout", "<u4")])
LAYOUTS = {"BHSD": 0, "BSHD": 1}  # TFM_ATTENTION_LAYOUT_* (tfmetal/attention.h)
BITS = {"float": 23, "half": 10, "bfloat": 7}
THREADS, BLOCK_Q, BLOCK_K, CHUNK = 128, 8, 32, 64  # attention.h
GUARD = 37      # elements after each output that no kernel may write
SENTINEL = -3.5  # exact in every dtype
# Tolerance relative to the largest |reference| value (outputs are averages of
# values ~1; the sums run in float32 in every dtype, so half/bfloat16 results
# are their dtype's rounding of a float32 value computed from rounded inputs).
TOL = {"float": 1e-5, "half": 2e-3, "bfloat": 1.6e-2}

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "attention.metal")


# ----------------------------------------------------------------------------
# The host side, as attention_metal.mm does it.


class Dropout:
    """An attention dropout: the seed (as its dtype holds it), rate and scale rounded to the kernel's dtype."""

    def __init__(self, dtype, seed, seed_dtype=np.int32, rate=0.3):
        self.seed, self.seed_dtype = np.asarray(seed, seed_dtype), seed_dtype
        self.rate = float(np.asarray(np.float32(rate), DTYPES[dtype]))
        self.scale = float(np.asarray(np.float32(1 / (1 - rate)), DTYPES[dtype]))
        self.bits = BITS[dtype]

    def buffer(self):
        """The seed tensor's bytes as the kernels' `device const uint* seed` reads them."""
        return np.ascontiguousarray(self.seed).view(np.uint32).copy()

    def factors(self, shape):
        """The (b, h, tq, tk) dropout factors m: scale where TF's stateless dropout keeps, else 0 (numpy)."""
        key, counter = np_key_counter([int(s) for s in self.seed])
        u = np_stateless_uniform(int(np.prod(shape)), key, counter, self.bits).reshape(shape)
        return np.where(u >= self.rate, self.scale, 0.0)


def params(q, k, v, mask, causal, scale, dropout=None, window=0, layout="BHSD"):
    """q, k, v as [B, heads, T, width] whatever the layout."""
    b, h, tq, d = q.shape
    tk, dv = k.shape[2], v.shape[3]
    bm, hm, tqm, tkm = mask.shape
    strides = (hm * tqm * tkm if bm > 1 else 0, tqm * tkm if hm > 1 else 0, tkm if tqm > 1 else 0,
               1 if tkm > 1 else 0)
    bits = {np.dtype(t): BITS[name] for name, t in DTYPES.items()}[q.dtype]
    drop = (0, 0, bits, 0.0, 1.0) if dropout is None else (
        1, int(dropout.seed_dtype == np.int64), bits, dropout.rate, dropout.scale)
    return ("bytes", np.array((b, h, tq, tk, d, dv) + strides + (scale, int(causal)) + drop +
                              (k.shape[1], window, LAYOUTS[layout]), PARAMS))


def stored(shape, layout):
    """The shape `layout` stores a [B, heads, T, width] operand in."""
    b, h, t, w = shape
    return (b, t, h, w) if layout == "BSHD" else (b, h, t, w)


def to_layout(x, layout):
    """A [B, heads, T, width] array as `layout` stores it, contiguous (the kernel's buffer)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "BSHD" else x)


def from_layout(x, layout):
    """The [B, heads, T, width] view of an array stored in `layout`."""
    return x.transpose(0, 2, 1, 3) if layout == "BSHD" else x


def seed_buffer(dropout):
    """The seed buffer the host binds: the seed, or a placeholder without dropout (never read)."""
    return np.zeros(4, np.uint32) if dropout is None else dropout.buffer()


def guarded(shape, dtype):
    """A NaN-filled output of `shape` in front of GUARD sentinel elements: (flat buffer, view)."""
    n = int(np.prod(shape))
    flat = np.full(n + GUARD, np.nan, dtype)
    flat[n:] = SENTINEL
    return flat, flat[:n].reshape(shape)


def check_guard(flat, shape, what):
    tail = flat[int(np.prod(shape)):].astype(np.float32)
    assert (tail == SENTINEL).all(), f"{what}: the kernel wrote past the end of the output"


# The operands and results of metal_forward / metal_backward are [B, heads, T, width]
# arrays whatever the layout: the kernels get and write them as `layout` stores them.


def metal_forward(lib, dtype, q, k, v, mask, causal=False, scale=None, order="linear", dropout=None, window=0,
                  layout="BHSD"):
    b, h, tq, d = q.shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    out_shape, lse_shape = (b, h, tq, v.shape[3]), (b, h, tq)
    out_flat, out = guarded(stored(out_shape, layout), DTYPES[dtype])
    lse_flat, lse = guarded(lse_shape, np.float32)
    if out.size:  # the host returns before dispatching when B, H or Tq is 0
        lib.run(FORWARD[dtype], [to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), mask,
                                 seed_buffer(dropout), out_flat, lse_flat,
                                 params(q, k, v, mask, causal, scale, dropout, window, layout)],
                threadgroups=(-(-tq // BLOCK_Q), h, b), threadgroup=THREADS, order=order, seed=3)
    check_guard(out_flat, out_shape, "output")
    check_guard(lse_flat, lse_shape, "lse")
    return from_layout(out, layout), lse


def metal_backward(lib, dtype, do, q, k, v, mask, out, lse, causal=False, scale=None, order="linear", dropout=None,
                   window=0, layout="BHSD"):
    b, h, tq, d = q.shape
    tk, dv = k.shape[2], v.shape[3]
    scale = 1 / np.sqrt(d) if scale is None else scale
    dq_flat, dq = guarded(stored(q.shape, layout), DTYPES[dtype])
    dk_flat, dk = guarded(stored(k.shape, layout), DTYPES[dtype])
    dv_flat, dvv = guarded(stored(v.shape, layout), DTYPES[dtype])
    args = [to_layout(x, layout) for x in (do, q, k, v)]
    args += [mask, to_layout(out, layout), np.ascontiguousarray(lse), seed_buffer(dropout)]
    p = params(q, k, v, mask, causal, scale, dropout, window, layout)
    if dq.size:  # B, H, Tq > 0
        lib.run(DQ[dtype], args + [dq_flat, p], threadgroups=(-(-tq // BLOCK_Q), h, b), threadgroup=THREADS,
                order=order, seed=5)
    if dk.size:  # B, Hk, Tk > 0: one threadgroup row per key/value head
        chunks = -(-max(d, dv) // CHUNK)
        lib.run(DKDV[dtype], args + [dk_flat, dv_flat, p], threadgroups=(-(-tk // BLOCK_K) * chunks, k.shape[1], b),
                threadgroup=THREADS, order=order, seed=7)
    for flat, shape, what in ((dq_flat, q.shape, "d_query"), (dk_flat, k.shape, "d_key"),
                              (dv_flat, v.shape, "d_value")):
        check_guard(flat, shape, what)
    return tuple(from_layout(g, layout) for g in (dq, dk, dvv))


# ----------------------------------------------------------------------------
# float64 reference: softmax attention over the attended keys, written out.


def allowed(mask, causal, b, h, tq, tk, window=0):
    a = np.broadcast_to(mask, (b, h, tq, tk))
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    if causal:
        a = a & (j <= i)
    if window:
        a = a & (np.abs(i - j) < window)
    return a


def repeat_kv(x, heads):
    """Grouped-query attention: each key/value head repeated for its consecutive query heads."""
    return np.repeat(x, heads // x.shape[1], axis=1)


def sum_kv(x, kv_heads):
    """A gradient of the repeated key/value heads summed back per key/value head."""
    b, h, t, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, t, d).sum(2)


def np_forward(q, k, v, mask, causal, scale, m=1.0, window=0):
    """(output, lse, probabilities) in float64; rows attending no key: 0, -inf, 0. `m`: the dropout
    factors (scale or 0) of the probabilities in the output (the lse and probabilities are undropped)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    b, h, tq, _ = q.shape
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    drop = m
    a = allowed(mask, causal, b, h, tq, k.shape[2], window)
    s = np.where(a, scale * q @ k.transpose(0, 1, 3, 2), -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    e = np.where(a, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    l = e.sum(-1, keepdims=True)
    safe = np.where(l > 0, l, 1)
    p = np.where(l > 0, e / safe, 0.0)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(safe[..., 0]), -np.inf)
    return (p * drop) @ v, lse, p


def np_backward(do, q, k, v, mask, causal, scale, m=1.0, window=0):
    """(dQ, dK, dV) of sum(output * do) in float64, and the size of each element's terms.

    ds = p (dp - Dr) cancels where the softmax is peaked (dp ~ Dr), so a
    gradient element can be far smaller than the float32 terms it is summed
    from; its rounding error scales with |terms|: scale * (p (|dO| |V|^T +
    rowsum |dO| |O|)) |K| for dQ (likewise dK), p^T |dO| for dV.
    """
    o, _, p = np_forward(q, k, v, mask, causal, scale, m, window)
    kv_heads = k.shape[1]
    do, q, k, v = (x.astype(np.float64) for x in (do, q, k, v))
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    t = (0, 1, 3, 2)
    pm = p * m  # the dropped probabilities (p without dropout)
    dv = pm.transpose(t) @ do
    dp = m * (do @ v.transpose(t))
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    ds_terms = p * (m * (np.abs(do) @ np.abs(v).transpose(t)) + (np.abs(do) * np.abs(o)).sum(-1, keepdims=True))
    grads = (scale * ds @ k, sum_kv(scale * ds.transpose(t) @ q, kv_heads), sum_kv(dv, kv_heads))
    terms = (scale * ds_terms @ np.abs(k), sum_kv(scale * ds_terms.transpose(t) @ np.abs(q), kv_heads),
             sum_kv(pm.transpose(t) @ np.abs(do), kv_heads))
    return grads, terms


def random_case(dtype, b, h, tq, tk, d, dv, seed, kv_heads=None):
    rng = np.random.default_rng(seed)
    t = DTYPES[dtype]
    hk = h if kv_heads is None else kv_heads
    q = rng.normal(0, 1, (b, h, tq, d)).astype(np.float32).astype(t)
    k = rng.normal(0, 1, (b, hk, tk, d)).astype(np.float32).astype(t)
    v = rng.normal(0, 1, (b, hk, tk, dv)).astype(np.float32).astype(t)
    do = rng.normal(0, 1, (b, h, tq, dv)).astype(np.float32).astype(t)
    return q, k, v, do


def assert_close(got, want, dtype, what, terms=None):
    """|got - want| <= TOL * (the largest |want|), or with `terms` (the size of
    each element's summands) <= TOL * (terms + 1e-3 * max(terms))."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    if terms is None:
        scale = float(np.abs(want).max(initial=0.0)) + 1e-3
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale, err_msg=what)
        return
    bound = TOL[dtype] * (terms + 1e-3 * float(terms.max(initial=0.0)) + 1e-6)
    bad = np.abs(got - want) > bound
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; worst at "
                           f"{np.unravel_index(np.argmax(np.abs(got - want) - bound), bad.shape)}: "
                           f"got {got[bad][:4]}, want {want[bad][:4]}, bound {bound[bad][:4]}")


def assert_same_bits(got, want, what):
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=what)


def check(lib, dtype, shape, mask, causal=False, scale=None, seed=0, backward=True, inputs=None, dropout=None,
          kv_heads=None, window=0, bshd=False):
    """Runs forward (and backward) on a random case; returns (output, lse, grads). With `bshd` also
    in the BSHD layout: its results must be the BHSD ones bit for bit (so as close to the reference)."""
    b, h, tq, tk, d, dv = shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    q, k, v, do = random_case(dtype, b, h, tq, tk, d, dv, seed, kv_heads) if inputs is None else inputs
    m = 1.0 if dropout is None else dropout.factors((b, h, tq, tk))
    out, lse = metal_forward(lib, dtype, q, k, v, mask, causal, scale, dropout=dropout, window=window)
    want_o, want_lse, _ = np_forward(q, k, v, mask, causal, scale, m, window)
    assert_close(out, want_o, dtype, "output")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.isfinite(lse[finite]).all()
    # lse is float32 from the dtype-rounded inputs: float32 rounding of ~ log(Tk) + the max score.
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    if bshd:
        bshd_results = metal_forward(lib, dtype, q, k, v, mask, causal, scale, dropout=dropout, window=window,
                                     layout="BSHD")
        for name, got, want in zip(("output", "lse"), bshd_results, (out, lse)):
            assert_same_bits(got, want, name + " (BSHD)")
    if not backward:
        return out, lse, None
    grads = metal_backward(lib, dtype, do, q, k, v, mask, out, lse, causal, scale, dropout=dropout, window=window)
    # Reference: the exact gradient in float64 (of the dtype-rounded inputs).
    wants, terms = np_backward(do, q, k, v, mask, causal, scale, m, window)
    for name, got, want, term in zip(("d_query", "d_key", "d_value"), grads, wants, terms):
        assert got.shape == want.shape
        assert_close(got, want, dtype, name, term)
    if bshd:
        bshd_grads = metal_backward(lib, dtype, do, q, k, v, mask, out, lse, causal, scale, dropout=dropout,
                                    window=window, layout="BSHD")
        for name, got, want in zip(("d_query", "d_key", "d_value"), bshd_grads, grads):
            assert_same_bits(got, want, name + " (BSHD)")
    return out, lse, grads


def no_mask():
    return np.ones((1, 1, 1, 1), bool)


def shape_id(s):
    return "x".join(map(str, s))


# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    names = list(FORWARD.values()) + list(DQ.values()) + list(DKDV.values())
    assert lib.kernels() == sorted(names)
    for name in FORWARD.values():
        ps = lib.params(name)
        assert len(ps) == 8 and ps[7].kind == "reference" and ps[7].size == PARAMS.itemsize
    for name in DQ.values():
        assert len(lib.params(name)) == 10 and lib.params(name)[9].size == PARAMS.itemsize
    for name in DKDV.values():
        assert len(lib.params(name)) == 11 and lib.params(name)[10].size == PARAMS.itemsize


# (B, H, Tq, Tk, D, Dv)
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (1, 1, 3, 70, 1, 1),     # head dim 1, three key tiles
    (1, 2, 9, 33, 16, 8),    # odd, Tq != Tk, Dv != D, partial query and key tiles
    (2, 1, 8, 32, 64, 64),   # exact tile edges, head dim 64
    (1, 1, 12, 45, 40, 40),  # odd head dim 40 (a partial chunk)
    (1, 1, 17, 40, 65, 3),   # D one past a chunk, Dv < D: the second dK chunk writes no dV
    (1, 2, 9, 33, 3, 130),   # Dv > D over three chunks: chunks past D write no dK
    (2, 3, 5, 3, 8, 8),      # Tk < Tq, B and H > 1
]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_and_backward_match_numpy(lib, dtype, shape):
    check(lib, dtype, shape, no_mask(), seed=sum(shape))


@pytest.mark.parametrize("dims", [(256, 256), (256, 1), (1, 256)], ids=shape_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_head_dim_256(lib, dtype, dims):
    check(lib, dtype, (1, 1, 5, 7) + dims, no_mask(), seed=sum(dims))


@pytest.mark.parametrize("shape", [(1, 2, 9, 9, 8, 8), (1, 1, 40, 35, 8, 12), (1, 1, 5, 40, 4, 4),
                                   (1, 1, 33, 70, 16, 16)], ids=shape_id)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal(lib, dtype, shape):
    # Top-left aligned: with Tq > Tk every row attends something; with Tq < Tk
    # the key tiles past the last query row are skipped (their dK, dV are 0).
    _, _, (_, dk, dv) = check(lib, dtype, shape, no_mask(), causal=True, seed=shape[2])
    tq = shape[2]
    assert (dk[:, :, tq:].astype(np.float32) == 0).all() and (dv[:, :, tq:].astype(np.float32) == 0).all()


@pytest.mark.sample_axes("pattern")  # one broadcast pattern in the quick tier, all seven in the full tier
@pytest.mark.parametrize("pattern", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 10, 1), (1, 1, 1, 37),
                                     (1, 1, 10, 37), (2, 3, 10, 37)], ids=shape_id)
def test_mask_broadcast_patterns(lib, pattern):
    rng = np.random.default_rng(sum(pattern))
    mask = rng.random(pattern) < 0.7
    check(lib, "float", (2, 3, 10, 37, 8, 8), mask, seed=1, causal=pattern == (2, 3, 10, 37))


@pytest.mark.parametrize("dtype", ["half", "bfloat"])
def test_full_mask_in_low_precision(lib, dtype):
    rng = np.random.default_rng(11)
    check(lib, dtype, (2, 2, 10, 37, 8, 8), rng.random((2, 2, 10, 37)) < 0.5, seed=12)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fully_masked_rows_give_zero_output_and_minus_inf_lse(lib, dtype):
    mask = np.ones((1, 1, 11, 34), bool)
    rows = [0, 7, 10]  # whole rows, in two query tiles
    mask[0, 0, rows] = False
    out, lse, (dq, dk, dv) = check(lib, dtype, (1, 2, 11, 34, 8, 8), mask, seed=4)
    assert np.isneginf(lse[:, :, rows]).all() and np.isfinite(np.delete(lse, rows, axis=2)).all()
    assert (out[:, :, rows].astype(np.float32) == 0).all()
    assert (dq[:, :, rows].astype(np.float32) == 0).all()
    for g in (dq, dk, dv):
        assert np.isfinite(g.astype(np.float32)).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_causal_with_a_mask_that_empties_rows(lib, dtype):
    # Under causal row 0 attends only key 0 and row 1 keys 0 and 1: masking key 0
    # for both and key 1 (with key 3) for every row empties them; row 5 is masked
    # out entirely.
    mask = np.ones((1, 1, 9, 20), bool)
    mask[0, 0, :2, 0] = False
    mask[..., 1] = mask[..., 3] = False
    mask[0, 0, 5] = False
    out, lse, _ = check(lib, dtype, (2, 1, 9, 20, 8, 8), mask, causal=True, seed=21)
    assert np.isneginf(lse[:, :, [0, 1, 5]]).all()
    assert (out[:, :, [0, 1, 5]].astype(np.float32) == 0).all()


def test_one_attended_key_per_row_is_exact(lib):
    # A row that attends one key has p = 1 exactly: output = that value row,
    # dV of that key = the row's dO, lse = its score (float32 rounding).
    tq, tk = 10, 40
    mask = np.zeros((1, 1, tq, tk), bool)
    keys = (np.arange(tq) * 3 + 1) % tk
    mask[0, 0, np.arange(tq), keys] = True
    inputs = random_case("float", 1, 1, tq, tk, 8, 8, 30)
    q, k, v, do = inputs
    out, lse, (dq, dk, dv) = check(lib, "float", (1, 1, tq, tk, 8, 8), mask, inputs=inputs)
    np.testing.assert_array_equal(out[0, 0], v[0, 0, keys])
    np.testing.assert_array_equal(dv[0, 0, keys], do[0, 0])
    np.testing.assert_array_equal(np.delete(dv[0, 0], keys, axis=0), 0)  # keys nobody attends
    np.testing.assert_allclose(lse[0, 0], (q[0, 0] * k[0, 0, keys]).sum(-1) / np.sqrt(8), rtol=1e-6, atol=1e-6)


def test_large_scores_stay_finite(lib):
    # The online max subtraction: scores ~ 400 would overflow exp without it.
    q, k, v, do = random_case("float", 1, 1, 9, 40, 16, 16, 9)
    inputs = (q * 20, k * 20, v, do)
    _, lse, _ = check(lib, "float", (1, 1, 9, 40, 16, 16), no_mask(), scale=0.25, inputs=inputs)
    assert (lse > 100).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_zero_key_length(lib, dtype):
    # Tk == 0: every row attends no key: output 0, lse -inf, dQ 0; dK and dV are
    # empty (the host dispatches no dK/dV pass).
    q, k, v, do = random_case(dtype, 1, 2, 9, 0, 8, 4, 2)
    out, lse = metal_forward(lib, dtype, q, k, v, no_mask())
    assert (out.astype(np.float32) == 0).all() and np.isneginf(lse).all()
    dq, dk, dv = metal_backward(lib, dtype, do, q, k, v, no_mask(), out, lse)
    assert (dq.astype(np.float32) == 0).all() and dk.shape == (1, 2, 0, 8) and dv.shape == (1, 2, 0, 4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_zero_query_length_gives_zero_key_grads(lib, dtype):
    q, k, v, do = random_case(dtype, 1, 2, 0, 9, 8, 4, 2)
    out, lse = metal_forward(lib, dtype, q, k, v, no_mask())
    dq, dk, dv = metal_backward(lib, dtype, do, q, k, v, no_mask(), out, lse, causal=True)
    assert dq.shape == (1, 2, 0, 8)
    assert (dk.astype(np.float32) == 0).all() and (dv.astype(np.float32) == 0).all()


def test_results_do_not_depend_on_threadgroup_order(lib):
    q, k, v, do = random_case("half", 1, 2, 17, 40, 8, 8, 6)
    mask = no_mask()
    first = metal_forward(lib, "half", q, k, v, mask, causal=True)
    again = metal_forward(lib, "half", q, k, v, mask, causal=True, order="shuffle")
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    g1 = metal_backward(lib, "half", do, q, k, v, mask, *first, causal=True)
    g2 = metal_backward(lib, "half", do, q, k, v, mask, *first, causal=True, order="reverse")
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_larger_causal_masked_case(lib, dtype):
    # Several query and key tiles per head, D != Dv across chunk edges, a
    # [B, 1, 1, Tk] padding mask and causal together.
    rng = np.random.default_rng(40)
    mask = rng.random((2, 1, 1, 100)) < 0.8
    check(lib, dtype, (2, 2, 70, 100, 72, 40), mask, causal=True, seed=41)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_the_cpu_kernel(lib, dtype):
    # The same inputs through the CPU op; both backward passes get the CPU
    # forward's output and lse, so each kernel is compared on its own.
    import tensorflow as tf

    ops = compiled_ops()
    if not hasattr(ops, "tfmetal_ext_attention"):
        pytest.skip("the op library has no TfmetalExt>Attention CPU kernel to compare with")
    shape = (2, 2, 19, 41, 24, 16)
    rng = np.random.default_rng(50)
    mask = rng.random((2, 1, 19, 41)) < 0.75
    mask[0, :, 3] = False  # a fully masked row
    q, k, v, do = random_case(dtype, *shape, seed=51)
    scale = 0.3
    tf_dtype = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}[dtype]
    t = [tf.constant(x.astype(np.float32), tf_dtype) for x in (q, k, v, do)]
    with tf.device("/CPU:0"):
        cpu_out, cpu_lse = ops.tfmetal_ext_attention(t[0], t[1], t[2], tf.constant(mask), [], causal=True, scale=scale)
        cpu_grads = ops.tfmetal_ext_attention_grad(t[3], t[0], t[1], t[2], tf.constant(mask), cpu_out, cpu_lse, [],
                                                   causal=True, scale=scale)
    cpu_out = cpu_out.numpy().astype(DTYPES[dtype])
    cpu_lse = cpu_lse.numpy()
    out, lse = metal_forward(lib, dtype, q, k, v, mask, causal=True, scale=scale)
    assert_close(out, cpu_out.astype(np.float64), dtype, "output vs CPU")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(cpu_lse))
    finite = np.isfinite(cpu_lse)
    np.testing.assert_allclose(lse[finite], cpu_lse[finite], rtol=1e-5, atol=1e-5)
    grads = metal_backward(lib, dtype, do, q, k, v, mask, cpu_out, cpu_lse, causal=True, scale=scale)
    _, terms = np_backward(do, q, k, v, mask, True, scale)
    for name, got, want, term in zip(("d_query", "d_key", "d_value"), grads, cpu_grads, terms):
        want = want.numpy().astype(np.float64)
        assert got.shape == want.shape
        assert_close(got, want, dtype, name + " vs CPU", 2 * term)


# ----------------------------------------------------------------------------
# Grouped-query attention and the sliding window


# Quick tier: one case per dtype (three of the six); the full tier every case with every dtype.
@pytest.mark.sample_axes("case")
@pytest.mark.cover_axes("dtype")  # each dtype is its own instantiation of every kernel
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [
    # (shape, kv_heads, causal, window): groups of 2 and 4; windows inside one key tile (5), across
    # tile edges (9, 33), one key (1), wider than the keys (200); a window without causality (two-sided).
    ((2, 4, 21, 21, 8, 8), 2, True, 5),
    ((1, 4, 40, 40, 16, 24), 1, True, 9),
    ((1, 2, 70, 70, 8, 8), 2, True, 33),
    ((2, 2, 12, 12, 4, 4), 1, True, 1),
    ((1, 6, 17, 17, 8, 8), 3, True, 200),
    ((1, 2, 30, 45, 8, 8), 1, False, 9),
], ids=["g2-w5", "g4-w9", "g1-w33", "g2-w1", "g2-wide", "noncausal-w9"])
def test_grouped_query_and_sliding_window_match_numpy(lib, dtype, case):
    # The reference repeats each key/value head for its query heads, masks |i - j| >= w, and sums the
    # repeated heads' gradients back: the kernels read the unrepeated heads and skip the key (forward,
    # dQ) and query (dK/dV) tiles outside the band.
    shape, kv_heads, causal, window = case
    rng = np.random.default_rng(shape[2] + window)
    mask = rng.random((shape[0], 1, 1, shape[3])) < 0.85
    check(lib, dtype, shape, mask, causal=causal, seed=window, kv_heads=kv_heads, window=window)


def test_grouped_query_dropout_draws_per_query_head(lib):
    # Dropout with shared key/value heads: each query head draws its own (b, h, i, j) mask elements,
    # as the repeated-heads computation does.
    rng = np.random.default_rng(81)
    mask = rng.random((1, 1, 1, 37)) < 0.9
    check(lib, "float", (2, 4, 11, 37, 8, 8), mask, causal=True, seed=82, kv_heads=2, window=7,
          dropout=Dropout("float", (5, 9)))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grouped_query_and_window_match_the_cpu_kernel(lib, dtype):
    import tensorflow as tf

    ops = compiled_ops()
    if not hasattr(ops, "tfmetal_ext_attention"):
        pytest.skip("the op library has no TfmetalExt>Attention CPU kernel to compare with")
    shape, kv_heads, window, scale = (2, 4, 19, 41, 24, 16), 2, 6, 0.3
    rng = np.random.default_rng(90)
    mask = rng.random((2, 1, 19, 41)) < 0.8
    q, k, v, do = random_case(dtype, *shape, seed=91, kv_heads=kv_heads)
    tf_dtype = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}[dtype]
    t = [tf.constant(x.astype(np.float32), tf_dtype) for x in (q, k, v, do)]
    attrs = dict(causal=True, scale=scale, sliding_window=window)
    with tf.device("/CPU:0"):
        cpu_out, cpu_lse = ops.tfmetal_ext_attention(t[0], t[1], t[2], tf.constant(mask), [], **attrs)
        cpu_grads = ops.tfmetal_ext_attention_grad(t[3], t[0], t[1], t[2], tf.constant(mask), cpu_out, cpu_lse, [],
                                                   **attrs)
    cpu_out = cpu_out.numpy().astype(DTYPES[dtype])
    cpu_lse = cpu_lse.numpy()
    out, lse = metal_forward(lib, dtype, q, k, v, mask, causal=True, scale=scale, window=window)
    assert_close(out, cpu_out.astype(np.float64), dtype, "output vs CPU")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(cpu_lse))
    finite = np.isfinite(cpu_lse)
    np.testing.assert_allclose(lse[finite], cpu_lse[finite], rtol=1e-5, atol=1e-5)
    grads = metal_backward(lib, dtype, do, q, k, v, mask, cpu_out, cpu_lse, causal=True, scale=scale, window=window)
    _, terms = np_backward(do, q, k, v, mask, True, scale, window=window)
    for name, got, want, term in zip(("d_query", "d_key", "d_value"), grads, cpu_grads, terms):
        want = want.numpy().astype(np.float64)
        assert got.shape == want.shape == (k.shape if name != "d_query" else q.shape)[:2] + got.shape[2:]
        assert_close(got, want, dtype, name + " vs CPU", 2 * term)


# ----------------------------------------------------------------------------
# Attention dropout


@pytest.mark.cover_axes("dtype")  # each dtype is its own instantiation of every kernel
@pytest.mark.parametrize("seed, seed_dtype", [((7, -3), np.int32), ((2**40 + 5, -(2**35)), np.int64)],
                         ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_matches_numpy(lib, dtype, seed, seed_dtype):
    # Several key tiles (keys of one row span Philox blocks across tile edges), Tq != Tk, Dv != D
    # over two chunks, causal with a mask that empties rows.
    drop = Dropout(dtype, seed, seed_dtype)
    rng = np.random.default_rng(70)
    mask = rng.random((2, 1, 11, 37)) < 0.8
    mask[1, 0, 4] = False
    out, lse, (dq, _, _) = check(lib, dtype, (2, 2, 11, 37, 8, 70), mask, causal=True, seed=71, dropout=drop)
    assert (out[1, :, 4].astype(np.float32) == 0).all() and np.isneginf(lse[1, :, 4]).all()
    assert (dq[1, :, 4].astype(np.float32) == 0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_mask_is_the_numpy_philox_mask_exactly(lib, dtype):
    # value = identity (Dv = Tk): output row i is p_i * m_i, so its zeros are exactly the dropped keys.
    drop = Dropout(dtype, (11, 12), rate=0.45)
    b, h, tq, tk = 2, 2, 9, 40
    q, k, _, _ = random_case(dtype, b, h, tq, tk, 4, 4, 72)
    v = np.ascontiguousarray(np.broadcast_to(np.eye(tk, dtype=np.float32), (b, h, tk, tk)).astype(DTYPES[dtype]))
    out, _ = metal_forward(lib, dtype, (q.astype(np.float32) * 0.1).astype(DTYPES[dtype]), k, v, no_mask(),
                           dropout=drop)
    dropped = out.astype(np.float32) == 0
    np.testing.assert_array_equal(dropped, drop.factors((b, h, tq, tk)) == 0)
    assert dropped.any() and not dropped.all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_matches_the_cpu_kernel(lib, dtype):
    import tensorflow as tf

    ops = compiled_ops()
    shape = (1, 2, 19, 41, 24, 16)
    drop = Dropout(dtype, (3, 4), np.int64, rate=0.25)
    rng = np.random.default_rng(73)
    mask = rng.random((1, 1, 19, 41)) < 0.8
    q, k, v, do = random_case(dtype, *shape, seed=74)
    scale = 0.3
    tf_dtype = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}[dtype]
    t = [tf.constant(x.astype(np.float32), tf_dtype) for x in (q, k, v, do)]
    seeds = [tf.constant(drop.seed)]
    attrs = dict(causal=True, scale=scale, dropout_rate=drop.rate, dropout_scale=drop.scale)
    with tf.device("/CPU:0"):
        cpu_out, cpu_lse = ops.tfmetal_ext_attention(t[0], t[1], t[2], tf.constant(mask), seeds, **attrs)
        cpu_grads = ops.tfmetal_ext_attention_grad(t[3], t[0], t[1], t[2], tf.constant(mask), cpu_out, cpu_lse, seeds,
                                                   **attrs)
    cpu_out = cpu_out.numpy().astype(DTYPES[dtype])
    out, lse = metal_forward(lib, dtype, q, k, v, mask, causal=True, scale=scale, dropout=drop)
    np.testing.assert_array_equal(out.astype(np.float32) == 0, cpu_out.astype(np.float32) == 0)
    assert_close(out, cpu_out.astype(np.float64), dtype, "output vs CPU")
    np.testing.assert_allclose(lse, cpu_lse.numpy(), rtol=1e-5, atol=1e-5)
    grads = metal_backward(lib, dtype, do, q, k, v, mask, cpu_out, cpu_lse.numpy(), causal=True, scale=scale,
                           dropout=drop)
    _, terms = np_backward(do, q, k, v, mask, True, scale, drop.factors((1, 2, 19, 41)))
    for name, got, want, term in zip(("d_query", "d_key", "d_value"), grads, cpu_grads, terms):
        assert_close(got, want.numpy().astype(np.float64), dtype, name + " vs CPU", 2 * term)


# ----------------------------------------------------------------------------
# The BSHD layout


@pytest.mark.every_case
@pytest.mark.parametrize("dtype, shape, kv_heads, causal, window, dropout_seed", [
    # (B, H, Tq, Tk, D, Dv). Groups of 2 with causal, a window across key tiles and dropout; D and Dv
    # past one chunk (two each, partial) over several query and key tiles; a two-sided window with an
    # int64-seeded dropout. H, Hk > 1 and T > 1 throughout, so the layouts differ (with one key/value
    # head, BSHD's key and value are BHSD's).
    ("float", (2, 4, 11, 37, 8, 8), 2, True, 7, ((5, 9), np.int32)),
    ("half", (1, 2, 19, 40, 72, 80), 2, True, 0, None),
    ("bfloat", (2, 3, 13, 45, 16, 24), 3, False, 9, ((3, -4), np.int64)),
], ids=["float-g2-causal-w7-dropout", "half-d72-dv80-causal", "bfloat-w9-dropout"])
def test_bshd_layout_gives_the_bhsd_bits(lib, dtype, shape, kv_heads, causal, window, dropout_seed):
    # Each kernel on the BSHD transpose of the same data: the same sums in the same order, read and
    # written through other strides (the mask, lse and the dropout's (b, h, i, j) stay as they are).
    b, _, tq, tk, _, _ = shape
    rng = np.random.default_rng(tq + tk)
    mask = rng.random((b, 1, tq, tk)) < 0.85
    check(lib, dtype, shape, mask, causal=causal, seed=tk, kv_heads=kv_heads, window=window,
          dropout=None if dropout_seed is None else Dropout(dtype, *dropout_seed), bshd=True)


# Run in a child process whose allocator is AddressSanitizer's, so a read
# before or past any input buffer (the guards above only see writes) fails.
_SANITIZED = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_attention_metal_emu as t
lib = t.emu.build(t.ROOT / "custom_ops/metal/attention.metal",
                  extra_flags=["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])
rng = np.random.default_rng(0)
for dtype in t.DTYPES:
    for shape, mask, causal in [((1, 2, 9, 33, 3, 130), rng.random((1, 2, 9, 33)) < 0.6, True),
                                ((2, 1, 5, 7, 256, 1), rng.random((2, 1, 1, 7)) < 0.6, False),
                                ((1, 1, 17, 40, 65, 3), t.no_mask(), True), ((1, 1, 1, 1, 1, 1), t.no_mask(), False)]:
        t.check(lib, dtype, shape, mask, causal=causal, seed=3)
    t.check(lib, dtype, (1, 2, 9, 33, 3, 70), t.no_mask(), causal=True, seed=4,
            dropout=t.Dropout(dtype, (1, 2), np.int64))
    t.check(lib, dtype, (2, 4, 9, 33, 65, 3), t.no_mask(), causal=True, seed=5, kv_heads=2, bshd=True)
    for tq, tk in [(9, 0), (0, 9)]:
        q, k, v, do = t.random_case(dtype, 1, 2, tq, tk, 8, 4, 2)
        out, lse = t.metal_forward(lib, dtype, q, k, v, t.no_mask())
        t.metal_backward(lib, dtype, do, q, k, v, t.no_mask(), out, lse, causal=True)
print("sanitized run passed")
"""


@pytest.mark.slow
def test_no_out_of_bounds_reads_under_address_sanitizer():
    cxx = os.environ.get("CXX", "g++")
    runtimes = []
    for name in ("libasan.so", "libubsan.so"):
        found = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(found) or not os.path.exists(found):
            pytest.skip(f"{cxx} has no {name} to preload (AddressSanitizer runtime not installed)")
        runtimes.append(found)
    env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS="detect_leaks=0")
    result = subprocess.run([sys.executable, "-c", _SANITIZED, str(Path(__file__).resolve().parent)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "sanitized run passed" in result.stdout, result.stderr[-6000:]


@pytest.mark.parametrize("where", ["query", "key"])
def test_nan_inputs_propagate_to_the_rows_they_reach(lib, where):
    q, k, v, _ = random_case("float", 1, 1, 9, 40, 8, 8, 60)
    (q if where == "query" else k)[0, 0, 2, 3] = np.nan
    out, lse = metal_forward(lib, "float", q, k, v, no_mask())
    rows = [2] if where == "query" else list(range(9))  # key 2 is attended by every row
    assert np.isnan(out[0, 0, rows]).all(axis=-1).all() and np.isnan(lse[0, 0, rows]).all()
    assert np.isfinite(np.delete(out[0, 0], rows, axis=0)).all()


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through the Metal backend.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_gpu_kernels_with_dropout_match_the_cpu_kernels(dtype, layout):
    # Forward and gradient with and without dropout on /GPU:0 against the CPU kernels: the mask's
    # zeros exactly (value = identity), the values to the dtype's tolerance; in both layouts (the
    # CPU kernel's "BSHD" is its "BHSD" bit for bit, tests/ops/test_attention.py).
    import tensorflow as tf

    ops = compiled_ops()
    tf_dtype = {"float": tf.float32, "half": tf.float16, "bfloat": tf.bfloat16}[dtype]
    b, h, tq, tk = 2, 2, 19, 41
    q, k, _, _ = random_case(dtype, b, h, tq, tk, 8, 8, 80)
    eye = np.ascontiguousarray(np.broadcast_to(np.eye(tk, dtype=np.float32), (b, h, tk, tk)))
    do = np.random.default_rng(81).normal(0, 1, (b, h, tq, tk)).astype(np.float32)
    mask = tf.constant(np.random.default_rng(82).random((b, 1, 1, tk)) < 0.8)
    drop = Dropout(dtype, (9, -9), np.int64, rate=0.3)
    for seeds, attrs in (([], {}), ([tf.constant(drop.seed)], dict(dropout_rate=drop.rate,
                                                                        dropout_scale=drop.scale))):
        results = {}
        for device in ("/CPU:0", "/GPU:0"):
            with tf.device(device):
                args = [tf.constant(x.astype(np.float32), tf_dtype) for x in (q, k, eye, do)]
                if layout == "BSHD":
                    args = [tf.transpose(x, [0, 2, 1, 3]) for x in args]
                out, lse = ops.tfmetal_ext_attention(*args[:3], mask, seeds, causal=True, scale=0.4, layout=layout,
                                                     **attrs)
                grads = ops.tfmetal_ext_attention_grad(args[3], *args[:3], mask, out, lse, seeds, causal=True,
                                                       scale=0.4, layout=layout, **attrs)
            assert device[1:4] in out.device
            results[device] = [np.asarray(tf.cast(t, tf.float64)) for t in (out, *grads)]
        cpu, gpu = results["/CPU:0"], results["/GPU:0"]
        np.testing.assert_array_equal(gpu[0] == 0, cpu[0] == 0)
        for name, a, c in zip(("output", "d_query", "d_key", "d_value"), gpu, cpu):
            assert_close(a, c, dtype, f"{name} GPU vs CPU")
