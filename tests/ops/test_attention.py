"""attention: CPU kernel and pure-TF reference against a numpy softmax attention; gradients; masks; errors."""

import importlib
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext.ops.attention import attention

from tests.ops._cpu_levels import run_at_level

# The module (tfmetal_ext.ops exports the function under the same name).
attention_module = importlib.import_module("tfmetal_ext.ops.attention")

# Output tolerance (relative to the largest magnitude, at least 1): the output
# dtype's rounding; the kernel accumulates in float32 for every dtype.
DTYPES = {"float32": (tf.float32, 2e-5), "float16": (tf.float16, 3e-3), "bfloat16": (tf.bfloat16, 2e-2)}


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Runs a test on the compiled kernel and on the pure-TF reference."""
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    if request.param == "kernel" and not attention_module.uses_kernel():
        pytest.skip("the attention kernel is not in the op library yet")
    assert attention_module.uses_kernel() == (request.param == "kernel")
    return request.param


# ---------------------------------------------------------------- numpy reference (float64)


def np_allowed(mask, causal, tq, tk):
    """The attend mask as a (.., tq, tk) boolean array."""
    allowed = np.ones((1, 1, tq, tk), bool) if mask is None else np.asarray(mask, bool)
    if causal:
        allowed = allowed & (np.arange(tk)[None, :] <= np.arange(tq)[:, None])
    return allowed


def np_probs(q, k, mask, causal, scale):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    tq, tk = q.shape[2], k.shape[2]
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    allowed = np.broadcast_to(np_allowed(mask, causal, tq, tk), scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    any_key = allowed.any(-1, keepdims=True)
    shift = np.where(any_key, scores.max(-1, keepdims=True, initial=-np.inf), 0.0)
    e = np.where(allowed, np.exp(scores - shift), 0.0)
    total = e.sum(-1, keepdims=True)
    p = np.where(any_key, e / np.where(any_key, total, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(any_key, shift + np.log(np.where(any_key, total, 1.0)), -np.inf)[..., 0]
    return p, lse


def np_attention(q, k, v, mask=None, causal=False, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p, lse = np_probs(q, k, mask, causal, scale)
    return np.einsum("bhqk,bhkd->bhqd", p, np.asarray(v, np.float64)), lse


def np_attention_grad(do, q, k, v, mask=None, causal=False, scale=None):
    """Softmax backward: dP = dO v^T, dS = P * (dP - rowsum(P * dP))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v, do = (np.asarray(t, np.float64) for t in (q, k, v, do))
    p, _ = np_probs(q, k, mask, causal, scale)
    dp = np.einsum("bhqd,bhkd->bhqk", do, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, k)
    dk = scale * np.einsum("bhqk,bhqd->bhkd", ds, q)
    dv = np.einsum("bhqk,bhqd->bhkd", p, do)
    return dq, dk, dv


# ---------------------------------------------------------------- helpers


def rounded(x, tf_dtype):
    """x rounded to tf_dtype, as float64: the op's actual input."""
    return tf.cast(tf.cast(x, tf_dtype), tf.float64).numpy()


def as64(t):
    return tf.cast(t, tf.float64).numpy()


def assert_close(got, want, tol, what=""):
    scale = float(np.max(np.abs(want))) if np.size(want) else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(scale, 1.0), err_msg=what)


def qkv(b, h, tq, tk, d, dv=None, seed=0):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    return (
        rng.normal(0, 1, (b, h, tq, d)).astype("float32"),
        rng.normal(0, 1, (b, h, tk, d)).astype("float32"),
        rng.normal(0, 1, (b, h, tk, dv)).astype("float32"),
    )


def padding_mask(b, tk, lengths, tq=1):
    """(b, 1, tq, tk): batch row i attends its first lengths[i] keys."""
    keep = np.arange(tk)[None, :] < np.asarray(lengths)[:, None]
    return np.broadcast_to(keep[:, None, None, :], (b, 1, tq, tk)).copy()


# (b, h, tq, tk, d, dv, mask kind, causal)
CASES = [
    (1, 2, 3, 70, 256, 256, None, False),  # the largest head dims
    (1, 1, 66, 5, 256, 1, "padding", True),
    (1, 1, 1, 1, 1, 1, None, False),
    (2, 3, 5, 7, 4, 4, None, False),
    (2, 2, 9, 9, 8, 8, None, True),
    (1, 2, 13, 6, 5, 3, None, True),  # tq > tk, causal, dv != d
    (1, 2, 6, 13, 5, 7, None, True),  # tq < tk, causal
    (2, 2, 33, 65, 16, 8, "padding", False),
    (3, 2, 17, 17, 3, 5, "full", True),
    (2, 4, 70, 130, 32, 24, "heads", False),  # several key and query tiles
    (1, 1, 129, 129, 64, 64, "padding", True),
    (2, 2, 70, 130, 16, 8, "query_rows", True),  # a mask broadcast along the keys, some rows attending none
]


def make_mask(kind, b, h, tq, tk, seed=0):
    rng = np.random.default_rng(seed + 100)
    if kind is None:
        return None
    if kind == "padding":
        return padding_mask(b, tk, rng.integers(1, tk + 1, b))
    if kind == "full":  # a random (b, h, tq, tk) mask
        return rng.random((b, h, tq, tk)) < 0.7
    if kind == "heads":  # (1, h, tq, 1)... and (b, 1, 1, tk) combined: per-head query rows
        return (rng.random((1, h, tq, 1)) < 0.8) & (rng.random((b, 1, 1, tk)) < 0.8)
    if kind == "query_rows":  # (b, 1, tq, 1): a query row attends every key it may, or none
        return rng.random((b, 1, tq, 1)) < 0.8
    raise ValueError(kind)


def case_id(case):
    b, h, tq, tk, d, dv, kind, causal = case
    return f"{b}x{h}x{tq}x{tk}x{d}x{dv}-{kind}-{'causal' if causal else 'full'}"


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_numpy(path, dtype):
    tf_dtype, tol = DTYPES[dtype]
    for case in CASES:
        b, h, tq, tk, d, dv, kind, causal = case
        q, k, v = qkv(b, h, tq, tk, d, dv)
        mask = make_mask(kind, b, h, tq, tk)
        got = attention(
            tf.constant(q, tf_dtype), tf.constant(k, tf_dtype), tf.constant(v, tf_dtype), mask=mask, causal=causal
        )
        assert got.dtype == tf_dtype and got.shape == (b, h, tq, dv), case_id(case)
        want, _ = np_attention(rounded(q, tf_dtype), rounded(k, tf_dtype), rounded(v, tf_dtype), mask, causal)
        assert_close(as64(got), want, tol, case_id(case))


def test_default_scale_is_one_over_sqrt_head_dim(path):
    q, k, v = qkv(2, 2, 5, 6, 9, 4, seed=1)
    got = attention(q, k, v).numpy()
    assert_close(got, np_attention(q, k, v, scale=1.0 / 3.0)[0], 2e-5)
    assert_close(attention(q, k, v, scale=0.7).numpy(), np_attention(q, k, v, scale=0.7)[0], 2e-5)
    # A different scale gives a different output (the scale is used).
    assert np.max(np.abs(got - np_attention(q, k, v, scale=0.7)[0])) > 1e-2


def test_large_scores_stay_finite(path):
    """Scores of several hundred: exp would overflow without the running max."""
    q, k, v = qkv(1, 2, 9, 40, 16, seed=2)
    got = attention(q * 30, k * 30, v).numpy()
    assert np.isfinite(got).all()
    assert_close(got, np_attention(q * 30, k * 30, v)[0], 1e-4)


def test_mask_of_lower_rank_broadcasts(path):
    q, k, v = qkv(2, 3, 5, 6, 4, seed=3)
    mask2 = np.random.default_rng(4).random((5, 6)) < 0.6
    mask2[:, 0] = True
    want, _ = np_attention(q, k, v, mask2[None, None])
    assert_close(attention(q, k, v, mask=mask2).numpy(), want, 2e-5)
    assert_close(attention(q, k, v, mask=mask2[None]).numpy(), want, 2e-5)


def test_fully_masked_rows_give_zero_and_no_nan(path):
    b, h, tq, tk, d = 2, 2, 6, 5, 4
    q, k, v = qkv(b, h, tq, tk, d, seed=5)
    mask = np.random.default_rng(6).random((b, h, tq, tk)) < 0.6
    mask[0, 1, 2, :] = False  # one fully masked row
    mask[1, :, :, :] = False  # a fully masked batch row
    mask[0, 0, 0, :] = True
    qt, kt, vt = (tf.constant(t) for t in (q, k, v))
    do = np.random.default_rng(7).normal(0, 1, (b, h, tq, d)).astype("float32")
    with tf.GradientTape() as tape:
        tape.watch([qt, kt, vt])
        out = attention(qt, kt, vt, mask=mask)
    grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.constant(do))
    out = out.numpy()
    assert np.isfinite(out).all() and all(np.isfinite(g.numpy()).all() for g in grads)
    assert (out[0, 1, 2] == 0).all() and (out[1] == 0).all()
    assert_close(out, np_attention(q, k, v, mask)[0], 2e-5)
    for got, want, what in zip(grads, np_attention_grad(do, q, k, v, mask), "qkv"):
        assert_close(got.numpy(), want, 2e-5, f"d{what}")
    assert (grads[0].numpy()[1] == 0).all() and (grads[1].numpy()[1] == 0).all() and (grads[2].numpy()[1] == 0).all()


@pytest.mark.parametrize("where", ["query", "key"])
def test_nan_inputs_reach_the_rows_they_feed(path, where):
    """As in a softmax: a NaN in query row i makes row i's output and lse NaN; a NaN key row every row's."""
    q, k, v = qkv(1, 1, 9, 40, 8, seed=21)
    (q if where == "query" else k)[0, 0, 2, 3] = np.nan
    out = attention(tf.constant(q), tf.constant(k), tf.constant(v)).numpy()
    rows = [2] if where == "query" else list(range(9))
    assert np.isnan(out[0, 0, rows]).all()
    others = np.delete(out[0, 0], rows, axis=0)
    assert np.isfinite(others).all()
    if others.size:
        want = np.delete(np_attention(np.nan_to_num(q), k, v)[0][0, 0], rows, axis=0)
        assert_close(others, want, 2e-5)
    if path == "kernel":
        lib = attention_module._common.library()
        _, lse = lib.tfmetal_ext_attention(q, k, v, np.ones([1, 1, 1, 1], bool), [], causal=False,
                                          scale=1.0 / math.sqrt(8))
        assert np.isnan(lse.numpy()[0, 0, rows]).all()


def test_causal_with_more_queries_than_keys_masks_nothing_extra(path):
    """Top-left aligned: query row i sees keys 0..i, so rows >= tk see every key."""
    q, k, v = qkv(1, 1, 8, 3, 4, seed=8)
    got = attention(q, k, v, causal=True).numpy()
    assert_close(got[:, :, 3:], np_attention(q[:, :, 3:], k, v)[0], 2e-5)
    assert_close(got[:, :, :1], v[:, :, :1], 2e-5)  # row 0 sees key 0 only


@pytest.mark.parametrize(
    "b, h, tq, tk, d, dv",
    [(0, 2, 3, 4, 4, 4), (2, 2, 0, 4, 4, 5), (2, 2, 3, 0, 4, 5), (2, 0, 3, 4, 4, 4)],
    ids=["batch0", "tq0", "tk0", "heads0"],
)
def test_empty_sizes(path, b, h, tq, tk, d, dv):
    q, k, v = qkv(b, h, tq, tk, d, dv, seed=9)
    qt, kt, vt = (tf.constant(t) for t in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([qt, kt, vt])
        out = attention(qt, kt, vt, causal=True)
    assert out.shape == (b, h, tq, dv)
    assert (out.numpy() == 0).all()  # tk = 0: every row attends nothing
    grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.ones_like(out))
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and (g.numpy() == 0).all()


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_match_numpy(path, dtype):
    tf_dtype, tol = DTYPES[dtype]
    for seed, case in enumerate(CASES):
        b, h, tq, tk, d, dv, kind, causal = case
        q, k, v = qkv(b, h, tq, tk, d, dv, seed=seed)
        mask = make_mask(kind, b, h, tq, tk, seed)
        do = np.random.default_rng(seed + 50).normal(0, 1, (b, h, tq, dv)).astype("float32")
        qt, kt, vt = (tf.constant(t, tf_dtype) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=causal)
        grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.constant(do, tf_dtype))
        wants = np_attention_grad(rounded(do, tf_dtype), *(rounded(t, tf_dtype) for t in (q, k, v)), mask, causal)
        for got, want, what in zip(grads, wants, "qkv"):
            assert got.dtype == tf_dtype
            # dQ/dK sum products of rounded p's and dp's: a few roundings more.
            assert_close(as64(got), want, 2 * tol, f"d{what}, {case_id(case)}")


# ---------------------------------------------------------------- grouped-query attention, sliding window


def np_grouped(q, k, v, do, mask, causal, window, scale):
    """Output and gradients written out in float64 with each key/value head repeated for its query heads
    (keras-hub's repeat) and the band |i - j| < window added to the mask, the repeated heads' gradients
    summed back: an independent reference for the op's unrepeated, banded form."""
    h, hk = q.shape[1], k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    band = np.abs(np.arange(tq)[:, None] - np.arange(tk)[None, :]) < window if window else np.ones((tq, tk), bool)
    full = band[None, None] if mask is None else np.asarray(mask, bool) & band[None, None]
    kr, vr = (np.repeat(t, h // hk, axis=1) for t in (k, v))
    out, lse = np_attention(q, kr, vr, full, causal, scale)
    dq, dk, dv = np_attention_grad(do, q, kr, vr, full, causal, scale)
    b, _, _, d = dk.shape
    return out, lse, dq, dk.reshape(b, hk, h // hk, tk, d).sum(2), dv.reshape(b, hk, h // hk, tk, -1).sum(2)


# (b, h, kv_heads, tq, tk, d, dv, mask kind, causal, window): groups of 1-4; windows inside a key tile,
# across the 64-row query and 128-key tiles, of one key, wider than the keys; without causality.
GROUPED_CASES = [
    (2, 4, 2, 21, 21, 8, 8, "padding", True, 5),
    (1, 4, 1, 140, 140, 16, 8, None, True, 9),
    (1, 2, 2, 300, 300, 8, 8, "padding", True, 129),
    (2, 2, 1, 12, 12, 4, 4, None, True, 1),
    (1, 6, 3, 17, 17, 8, 8, "full", True, 200),
    (1, 2, 1, 70, 150, 8, 8, "padding", False, 40),
    (2, 6, 2, 33, 33, 8, 4, "padding", True, 0),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_grouped_query_and_sliding_window_match_numpy(path, dtype):
    tf_dtype, tol = DTYPES[dtype]
    for seed, case in enumerate(GROUPED_CASES):
        b, h, hk, tq, tk, d, dv, kind, causal, window = case
        rng = np.random.default_rng(seed + 300)
        q, k, v, do = (rng.normal(0, 1, shape).astype("float32")
                       for shape in ((b, h, tq, d), (b, hk, tk, d), (b, hk, tk, dv), (b, h, tq, dv)))
        mask = make_mask(kind, b, h, tq, tk, seed)
        qt, kt, vt = (tf.constant(t, tf_dtype) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=causal, sliding_window=window or None)
        grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.constant(do, tf_dtype))
        want = np_grouped(*(rounded(t, tf_dtype) for t in (q, k, v, do)), mask, causal, window, 1 / math.sqrt(d))
        what = f"{case}"
        assert out.shape == (b, h, tq, dv) and [g.shape for g in grads] == [qt.shape, kt.shape, vt.shape]
        assert_close(as64(out), want[0], tol, what)
        for got, w, name in zip(grads, want[2:], "qkv"):
            assert_close(as64(got), w, 2 * tol, f"d{name}, {what}")


def test_sliding_window_raw_op_lse_and_tiles_outside_the_band():
    """The raw op's lse is that of the band's keys only (float64 reference), and a window shorter than
    the keys of a long row gives that row exactly the result of attending its band alone."""
    lib = _lib()
    q, k, v = qkv(1, 2, 300, 300, 8, seed=41)
    out, lse = lib.tfmetal_ext_attention(q, k, v, np.ones((1, 1, 1, 1), bool), [], causal=True, scale=0.5,
                                         sliding_window=64)
    band = np.abs(np.arange(300)[:, None] - np.arange(300)[None, :]) < 64
    want_out, want_lse = np_attention(q, k, v, band[None, None], True, 0.5)
    assert_close(out.numpy(), want_out, 2e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)
    # Row 299 attends keys 236..299: the same as the op on those keys alone.
    alone, _ = lib.tfmetal_ext_attention(q[:, :, 299:], k[:, :, 236:], v[:, :, 236:], np.ones((1, 1, 1, 1), bool), [],
                                         scale=0.5)
    np.testing.assert_allclose(out.numpy()[:, :, 299:], alone.numpy(), rtol=0, atol=2e-6)


def test_grouped_query_equals_the_repeated_heads_bit_for_bit_forward():
    """Unrepeated key/value heads read in place give the repeated-heads forward exactly (the same
    float32 operations in the same order per query head)."""
    lib = _lib()
    q, _, _ = qkv(2, 6, 37, 50, 16, seed=42)
    _, k, v = qkv(2, 2, 37, 50, 16, seed=43)
    m = np.ones((1, 1, 1, 1), bool)
    got, got_lse = lib.tfmetal_ext_attention(q, k, v, m, [], causal=True, scale=0.25, sliding_window=11)
    kr, vr = (np.repeat(t, 3, axis=1) for t in (k, v))
    want, want_lse = lib.tfmetal_ext_attention(q, kr, vr, m, [], causal=True, scale=0.25, sliding_window=11)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(got_lse.numpy(), want_lse.numpy())


_THREADS_CASE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[2]))
    sys.path.insert(0, sys.argv[1])
    import test_attention as t
    from tfmetal_ext.ops import _common
    lib = _common.library()
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.normal(0, 1, shape).astype("float32")
                   for shape in ((1, 6, 70, 8), (1, 1, 70, 8), (1, 1, 70, 4), (1, 6, 70, 4)))
    attrs = dict(causal=True, scale=0.3, sliding_window=20)
    m = np.ones((1, 1, 1, 1), bool)
    out, lse = lib.tfmetal_ext_attention(q, k, v, m, [], **attrs)
    grads = lib.tfmetal_ext_attention_grad(do, q, k, v, m, out, lse, [], **attrs)
    want = t.np_grouped(q, k, v, do, None, True, 20, 0.3)
    for got, w in zip(grads, want[2:]):
        t.assert_close(t.as64(got), w, 4e-5)
    np.save(sys.argv[3], np.concatenate([g.numpy().ravel() for g in grads]))
    print("ok")
    """
)


@pytest.mark.slow
def test_grouped_backward_split_over_query_heads_matches_the_unsplit_one(tmp_path):
    """With fewer key/value heads (x batch) than threads, the CPU backward runs one item per query head
    into float partials summed per key/value head; with one thread, one item per key/value head. Both
    match float64 numpy, and each other within a few roundings (the sums' order differs)."""
    if not attention_module.uses_kernel():
        pytest.skip("the attention kernel is not in the op library")
    env = {k: v for k, v in os.environ.items() if k != "TFMETAL_EXT_REFERENCE_OPS"}
    results = {}
    for threads in (1, 4):
        path = str(tmp_path / f"grads{threads}.npy")
        proc = subprocess.run(
            [sys.executable, "-c", _THREADS_CASE, os.path.dirname(os.path.abspath(__file__)), str(threads), path],
            capture_output=True, text=True, timeout=600, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stderr[-3000:]
        results[threads] = np.load(path)
    np.testing.assert_allclose(results[4], results[1], rtol=0, atol=8 * 2.0**-24 * np.abs(results[1]).max() * 6)


# ---------------------------------------------------------------- rounded once: a derived bound


F32_U = 2.0**-24
HALF_U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # unit roundoff 2^-p, p significand bits (11, 8)


def _gamma(n):
    return n * F32_U / (1 - n * F32_U)


def rounded_once_bounds(q, k, v, do, mask, causal, scale, half_u):
    """Exact (float64) O, dQ, dK, dV on the op's (half) inputs, and the bound on each component of an
    algorithm that computes in float32 and rounds each output once to the half type.

    The derivation (u = 2^-24, gamma(n) = n u / (1 - n u), |.| elementwise, products of absolute values
    bounding the float32 errors; Higham, "Accuracy and Stability of Numerical Algorithms", 3.1, 3.5):
    - scores S = scale * Q K^T: |dS| <= Delta = gamma(d + 1) scale |Q||K|^T; over a row, softmax moves
      each p by a factor within e^(+-2 Delta_i), Delta_i = max_j Delta_ij;
    - the float32 exp, shift, running-max rescales (at most one per key), sum and division, and the
      backward's p = exp(s - lse): at most eps_i = (e^(2 Delta_i) - 1) + 4u (max_j |S_ij| + |lse_i|)
      + (4 tk + 16) u relative on each p (expf is within 1 ulp; 16 covers it and the divisions);
    - O = P V: |dO| <= (eps + gamma(tk)) P |V|;
    - dV = P^T dO: (eps + gamma(tq))-weighted P^T |dO|;  dP = dO V^T: gamma(dv) |dO||V|^T;
    - D = rowsum(dO * O), from the op's own output, which may already be rounded: (gamma(dv) + h) |dO||O|;
    - dS = P (dP - D): eps P |dP - D| + P (|d dP| + |d D|) + 2u P |dP - D|;
    - dQ = scale dS K, dK = scale dS^T Q: the dS error through |K|, |Q|, plus gamma(tk + 1), gamma(tq + 1);
    - the output rounded once to the half type: |fl(x^) - x| <= h (|x| + E) + E, h = 2^-p.
    An extra rounding to the half type inside (scores, probabilities, an accumulator) is a relative
    error of h >> u on an intermediate: far outside this bound.
    """
    q, k, v, do = (np.asarray(t, np.float64) for t in (q, k, v, do))
    d, tq, tk, dv = q.shape[-1], q.shape[2], k.shape[2], v.shape[-1]
    p, lse = np_probs(q, k, mask, causal, scale)
    o = np.einsum("bhqk,bhkd->bhqd", p, v)
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    live = p > 0
    delta = _gamma(d + 1) * scale * np.einsum("bhqd,bhkd->bhqk", np.abs(q), np.abs(k))
    delta_i = np.where(live, delta, 0).max(-1, keepdims=True)
    s_max = np.where(live, np.abs(scores), 0).max(-1, keepdims=True)
    lse_abs = np.where(np.isfinite(lse), np.abs(lse), 0)[..., None]
    eps = np.expm1(2 * delta_i) + 4 * F32_U * (s_max + lse_abs) + (4 * tk + 16) * F32_U
    e_o = (eps + _gamma(tk)) * np.einsum("bhqk,bhkd->bhqd", p, np.abs(v))

    dp = np.einsum("bhqd,bhkd->bhqk", do, v)
    dr = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - dr)
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, k)
    dk = scale * np.einsum("bhqk,bhqd->bhkd", ds, q)
    d_v = np.einsum("bhqk,bhqd->bhkd", p, do)
    e_dv = np.einsum("bhqk,bhqd->bhkd", (eps + _gamma(tq)) * p, np.abs(do))
    e_dp = _gamma(dv) * np.einsum("bhqd,bhkd->bhqk", np.abs(do), np.abs(v))
    e_dr = (_gamma(dv) + half_u) * (np.abs(do) * np.abs(o)).sum(-1, keepdims=True)
    e_ds = (eps + 2 * F32_U) * p * np.abs(dp - dr) + p * (e_dp + e_dr)
    e_dq = scale * (np.einsum("bhqk,bhkd->bhqd", e_ds, np.abs(k))
                    + _gamma(tk + 1) * np.einsum("bhqk,bhkd->bhqd", np.abs(ds), np.abs(k)))
    e_dk = scale * (np.einsum("bhqk,bhqd->bhkd", e_ds, np.abs(q))
                    + _gamma(tq + 1) * np.einsum("bhqk,bhqd->bhkd", np.abs(ds), np.abs(q)))
    exact = (o, dq, dk, d_v)
    errors = (e_o, e_dq, e_dk, e_dv)
    return exact, tuple(half_u * (np.abs(x) + e) + e for x, e in zip(exact, errors))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_and_bfloat16_are_float32_rounded_once(path, dtype):
    """The op's half/bfloat16 output and gradients are the float32 computation rounded once: within
    the derived bound (rounded_once_bounds) of the exact result on the same inputs, componentwise.
    This is what makes it at least as accurate as stock attention, which rounds its scores,
    probabilities and products to the half type as well."""
    tf_dtype = DTYPES[dtype][0]
    for seed, case in enumerate(CASES[:9]):
        b, h, tq, tk, d, dv, kind, causal = case
        q, k, v = qkv(b, h, tq, tk, d, dv, seed=seed)
        do = np.random.default_rng(seed + 50).normal(0, 1, (b, h, tq, dv)).astype("float32")
        mask = make_mask(kind, b, h, tq, tk, seed)
        qt, kt, vt, dot = (tf.constant(t, tf_dtype) for t in (q, k, v, do))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=causal)
        grads = tape.gradient(out, [qt, kt, vt], output_gradients=dot)
        exact, bounds = rounded_once_bounds(*(as64(t) for t in (qt, kt, vt, dot)), mask, causal,
                                            1 / math.sqrt(d), HALF_U[dtype])
        for what, got, want, bound in zip(("O", "dQ", "dK", "dV"), [out, *grads], exact, bounds):
            assert got.dtype == tf_dtype
            error = np.abs(as64(got) - want)
            worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else ()
            assert (error <= bound).all(), (what, case_id(case), worst, error[worst], bound[worst])


def test_rounded_once_bound_catches_a_second_rounding():
    # The bound is tight enough to tell: the float32 result rounded once passes it, the same computation
    # with its probabilities rounded to bfloat16 on the way does not.
    q, k, v = qkv(2, 2, 9, 9, 8, 8, seed=3)
    do = np.random.default_rng(3).normal(0, 1, (2, 2, 9, 8))
    q, k, v, do = (rounded(t, tf.bfloat16) for t in (q, k, v, do))
    (o, *_), (bound, *_) = rounded_once_bounds(q, k, v, do, None, True, 1 / math.sqrt(8), HALF_U["bfloat16"])
    p, _ = np_probs(q, k, None, True, 1 / math.sqrt(8))
    once = rounded(np.einsum("bhqk,bhkd->bhqd", p, v), tf.bfloat16)
    twice = rounded(np.einsum("bhqk,bhkd->bhqd", rounded(p, tf.bfloat16), v), tf.bfloat16)
    assert (np.abs(once - o) <= bound).all()
    assert not (np.abs(twice - o) <= bound).all()


@pytest.mark.parametrize(
    "case", [(1, 2, 3, 4, 3, 2, "padding", False), (2, 1, 4, 4, 2, 3, None, True), (1, 1, 5, 3, 4, 4, "full", True)]
)
def test_compute_gradient(path, case):
    """Theoretical against numerical Jacobians (tf.test.compute_gradient), float32, small shapes."""
    b, h, tq, tk, d, dv, kind, causal = case
    q, k, v = qkv(b, h, tq, tk, d, dv, seed=11)
    mask = make_mask(kind, b, h, tq, tk, 11)
    if mask is not None:
        mask[..., 0] = True  # no empty row: the numerical Jacobian there is 0 too, but keep it simple

    def f(q, k, v):
        return attention(q, k, v, mask=mask, causal=causal, scale=0.8)

    theoretical, numerical = tf.test.compute_gradient(f, [tf.constant(q), tf.constant(k), tf.constant(v)], delta=1e-2)
    for t, n in zip(theoretical, numerical):
        assert np.abs(t).max() > 1e-3  # something flows
        np.testing.assert_allclose(t, n, atol=3e-3, rtol=3e-3)


def test_tf_function_matches_eager(path):
    b, h, tq, tk, d, dv = 2, 2, 7, 11, 8, 5
    q, k, v = qkv(b, h, tq, tk, d, dv, seed=12)
    mask = padding_mask(b, tk, [11, 4])
    do = np.random.default_rng(13).normal(0, 1, (b, h, tq, dv)).astype("float32")

    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, mask=mask, causal=True)
        return (out,) + tuple(tape.gradient(out, [q, k, v], output_gradients=tf.constant(do)))

    args = [tf.constant(t) for t in (q, k, v)]
    eager = step(*args)
    graph = tf.function(step)(*args)
    dynamic = tf.function(step, input_signature=[tf.TensorSpec([None, None, None, t.shape[-1]]) for t in (q, k, v)])(
        *args
    )
    want = (np_attention(q, k, v, mask, True)[0],) + np_attention_grad(do, q, k, v, mask, True)
    for e, g, dyn, w in zip(eager, graph, dynamic, want):
        assert_close(e.numpy(), w, 2e-5)
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dyn.numpy(), e.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_heads_last_is_the_transposed_output_and_gradient(path, dropout):
    """``heads_last=True``: the (batch, q, heads, dim) output is the op's output transposed, bit for bit,
    and so are the gradients (the same gradient op on the same tensors), with and without dropout;
    with the kernel, the backward pass does not read the op's own-layout output (its only consumer is
    the transpose), which is what keeps one copy of the output alive instead of two."""
    b, h, tq, tk, d = 2, 3, 9, 11, 8
    q, k, v = (tf.constant(t) for t in qkv(b, h, tq, tk, d, seed=3))
    mask = tf.constant(padding_mask(b, tk, [11, 6], tq=tq))
    dy = tf.constant(np.random.default_rng(4).normal(0, 1, (b, tq, h, d)).astype("float32"))
    kwargs = dict(mask=mask, causal=True, dropout_rate=dropout, seed=[7, 8] if dropout else None)

    def run(heads_last):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, heads_last=heads_last, **kwargs)
            y = out if heads_last else tf.transpose(out, [0, 2, 1, 3])
        return [y] + tape.gradient(y, [q, k, v], output_gradients=dy)

    for fn in (run, tf.function(run)):
        for got, want in zip(fn(True), fn(False)):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    if path == "kernel":
        graph = tf.function(lambda: run(True)).get_concrete_function().graph
        fwd = [op for op in graph.get_operations() if op.type == "TfmetalExt>Attention"]
        assert len(fwd) == 1 and [c.type for c in fwd[0].outputs[0].consumers()] == ["Transpose"]
        assert any(op.type == "TfmetalExt>AttentionGrad" for op in graph.get_operations())


# (b, h, kv_heads, tq, tk, d, dv, mask kind, causal, window, dropout rate): grouped heads (one key/value
# head for a batch of one: the backward's split over query heads where there are 2+ threads), windows,
# dropout with tk % 4 == 0 (rows drawn as Philox lanes) and not, value dims other than the head dim,
# half/bfloat16 tiles widened from strided rows.
LAYOUT_CASES = [
    (2, 4, 2, 70, 150, 32, 48, "padding", True, 0, 0.0),
    (1, 4, 1, 130, 130, 16, 8, None, True, 33, 0.0),
    (1, 3, 3, 66, 128, 8, 8, "full", False, 0, 0.2),
    (2, 2, 1, 9, 13, 8, 4, "padding", False, 5, 0.3),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bshd_layout_is_the_bhsd_result_in_place(path, dtype):
    """``layout="BSHD"`` reads (batch, seq, heads, dim) in place and gives the ``"BHSD"`` output and
    gradients transposed, bit for bit (the kernels run the same operations in the same order on the
    same values, only the addresses differ; the dropout mask is of the logical (b, h, i, j)). The first
    case is also held to float64 numpy directly. With the kernel, no Transpose is in the graph."""
    tf_dtype, tol = DTYPES[dtype]

    def run(q, k, v, dy, layout, **kwargs):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, layout=layout, **kwargs)
        return [out] + tape.gradient(out, [q, k, v], output_gradients=dy)

    swap = lambda t: tf.transpose(t, [0, 2, 1, 3])  # noqa: E731
    for seed, case in enumerate(LAYOUT_CASES):
        b, h, hk, tq, tk, d, dv, kind, causal, window, rate = case
        rng = np.random.default_rng(seed + 500)
        q, k, v, do = (tf.constant(rng.normal(0, 1, shape).astype("float32"), tf_dtype)
                       for shape in ((b, h, tq, d), (b, hk, tk, d), (b, hk, tk, dv), (b, h, tq, dv)))
        kwargs = dict(mask=make_mask(kind, b, h, tq, tk, seed), causal=causal, sliding_window=window or None,
                      dropout_rate=rate, seed=[seed, 9] if rate else None)
        want = run(q, k, v, do, "BHSD", **kwargs)
        got = run(swap(q), swap(k), swap(v), swap(do), "BSHD", **kwargs)
        assert [t.shape for t in got] == [swap(t).shape for t in want], case
        for g, w, name in zip(got, want, ["output", "dq", "dk", "dv"]):
            np.testing.assert_array_equal(swap(g).numpy(), w.numpy(), err_msg=f"{name}, {case}")
        if seed == 0:
            ref = np_grouped(*(rounded(t.numpy(), tf_dtype) for t in (q, k, v, do)), kwargs["mask"], causal, window,
                             1 / math.sqrt(d))
            assert_close(as64(swap(got[0])), ref[0], tol, "output")
            for g, r, name in zip(got[1:], ref[2:], "qkv"):
                assert_close(as64(swap(g)), r, 2 * tol, f"d{name}")
    if path == "kernel":
        q, k, v, do = (swap(t) for t in (q, k, v, do))
        graph = tf.function(lambda: run(q, k, v, do, "BSHD", **kwargs)).get_concrete_function().graph
        types = [op.type for op in graph.get_operations()]
        assert "TfmetalExt>Attention" in types and "TfmetalExt>AttentionGrad" in types
        assert "Transpose" not in types


def test_bshd_raw_op_shapes():
    """The shape functions give the layout's shapes: output (batch, q_seq, heads, value_dim), lse
    (batch, heads, q_seq), the gradients those of query, key and value."""
    lib = _lib()
    q, k, v = (tf.constant(t) for t in _bshd(*qkv(2, 4, 5, 7, 8, 6, seed=44)))
    k, v = k[:, :, :2], v[:, :, :2]
    m = np.ones((1, 1, 1, 1), bool)

    @tf.function(input_signature=[tf.TensorSpec([2, None, 4, 8]), tf.TensorSpec([2, None, 2, 8]),
                                  tf.TensorSpec([2, None, 2, 6])])
    def shapes(q, k, v):
        out, lse = lib.tfmetal_ext_attention(q, k, v, m, [], scale=0.5, layout="BSHD")
        assert out.shape.as_list() == [2, None, 4, 6] and lse.shape.as_list() == [2, 4, None]
        grads = lib.tfmetal_ext_attention_grad(out, q, k, v, m, out, lse, [], scale=0.5, layout="BSHD")
        assert [g.shape.as_list() for g in grads] == [[2, None, 4, 8], [2, None, 2, 8], [2, None, 2, 6]]
        return out, lse

    out, lse = shapes(q, k, v)
    assert out.shape == (2, 5, 4, 6) and lse.shape == (2, 4, 5)


def test_reference_lse_matches_numpy():
    q, k, v = qkv(2, 2, 6, 5, 4, seed=14)
    mask = padding_mask(2, 5, [5, 2], tq=6)
    mask[0, 0, 3] = False
    out, lse = attention_module._reference_attention(q, k, v, tf.constant(mask), True, 0.5)
    want_out, want_lse = np_attention(q, k, v, mask, True, 0.5)
    assert_close(out.numpy(), want_out, 2e-5)
    assert lse.dtype == tf.float32 and lse.shape == (2, 2, 6)
    assert np.isneginf(lse.numpy()[0, :, 3]).all()
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- errors


def _bad_calls():
    q = np.zeros((2, 3, 4, 8), "float32")
    k = np.zeros((2, 3, 5, 8), "float32")
    v = np.zeros((2, 3, 5, 6), "float32")
    m = np.ones((2, 1, 1, 5), bool)
    return [
        ("query.dtype=int32", lambda: attention(q.astype("int32"), k, v)),
        ("query.dtype=float64", lambda: attention(q.astype("float64"), k, v)),
        ("key.dtype=float16", lambda: attention(q, k.astype("float16"), v)),
        ("value.dtype=bfloat16", lambda: attention(q, k, tf.constant(v, tf.bfloat16))),
        ("query.shape=(3, 4, 8)", lambda: attention(q[0], k, v)),
        ("key.shape=(2, 3, 5, 8, 1)", lambda: attention(q, k[..., None], v)),
        ("value.shape=(2, 3, 5)", lambda: attention(q, k, v[..., 0])),
        ("key.shape=(1, 3, 5, 8)", lambda: attention(q, k[:1], v)),
        ("value.shape=(2, 1, 5, 6)", lambda: attention(q, k, v[:, :1])),
        ("value.shape=(2, 3, 4, 6)", lambda: attention(q, k, v[:, :, :4])),
        ("key.shape=(2, 3, 5, 7)", lambda: attention(q, k[..., :7], v)),
        ("query.shape=(2, 3, 4, 0)", lambda: attention(q[..., :0], k[..., :0], v, scale=1.0)),
        ("query.shape=(1, 1, 1, 257)", lambda: attention(*(np.zeros((1, 1, 1, 257), "float32"),) * 3)),
        ("value.shape=(2, 3, 5, 300)", lambda: attention(q, k, np.zeros((2, 3, 5, 300), "float32"))),
        ("mask.dtype=float32", lambda: attention(q, k, v, mask=m.astype("float32"))),
        ("mask.shape=(1, 2, 1, 1, 5)", lambda: attention(q, k, v, mask=m[None])),
        ("mask.shape=(2, 1, 1, 4)", lambda: attention(q, k, v, mask=m[..., :4])),
        ("mask.shape=(2, 2, 1, 5)", lambda: attention(q, k, v, mask=np.ones((2, 2, 1, 5), bool))),
        ("mask.shape=(3, 1, 1, 5)", lambda: attention(q, k, v, mask=np.ones((3, 1, 1, 5), bool))),
        ("mask.shape=(2, 1, 3, 5)", lambda: attention(q, k, v, mask=np.ones((2, 1, 3, 5), bool))),
        ("scale=0.0", lambda: attention(q, k, v, scale=0.0)),
        ("scale=-1.0", lambda: attention(q, k, v, scale=-1.0)),
        ("scale=nan", lambda: attention(q, k, v, scale=float("nan"))),
        ("scale=inf", lambda: attention(q, k, v, scale=float("inf"))),
        ("scale=1e-50", lambda: attention(q, k, v, scale=1e-50)),
        ("scale='x'", lambda: attention(q, k, v, scale="x")),
        ("scale=True", lambda: attention(q, k, v, scale=True)),
        ("causal=1", lambda: attention(q, k, v, causal=1)),
        ("key.shape=(2, 2, 5, 8)", lambda: attention(q, k[:, :2], v[:, :2])),  # 2 key heads for 3 query heads
        ("sliding_window=0", lambda: attention(q, k, v, sliding_window=0)),
        ("sliding_window=-3", lambda: attention(q, k, v, sliding_window=-3)),
        ("sliding_window=2.0", lambda: attention(q, k, v, sliding_window=2.0)),
        ("sliding_window=True", lambda: attention(q, k, v, sliding_window=True)),
        ("sliding_window=2147483648", lambda: attention(q, k, v, sliding_window=2**31)),
        ("layout='BHDS'", lambda: attention(q, k, v, layout="BHDS")),
        ("layout=None", lambda: attention(q, k, v, layout=None)),
        # layout="BSHD": the heads on axis 2, the sequence on axis 1
        ("key.shape=(2, 5, 2, 8)", lambda: attention(*_bshd(q, k[:, :2], v[:, :2]), layout="BSHD")),
        ("value.shape=(2, 4, 3, 6)", lambda: attention(*_bshd(q, k, v[:, :, :4]), layout="BSHD")),
        ("value.shape=(2, 5, 1, 6)", lambda: attention(*_bshd(q, k, v[:, :1]), layout="BSHD")),
        ("mask.shape=(2, 1, 3, 5)", lambda: attention(*_bshd(q, k, v), mask=np.ones((2, 1, 3, 5), bool),
                                                      layout="BSHD")),
    ]


def _bshd(*tensors):
    """(batch, heads, seq, dim) arrays as (batch, seq, heads, dim)."""
    return [np.ascontiguousarray(np.swapaxes(t, 1, 2)) for t in tensors]


@pytest.mark.parametrize("received, call", _bad_calls(), ids=[r for r, _ in _bad_calls()])
def test_bad_arguments_raise_value_error(received, call):
    with pytest.raises(ValueError, match=r"Received: .*" + __import__("re").escape(received)):
        call()


def test_scale_required_when_head_dim_unknown():
    @tf.function(input_signature=[tf.TensorSpec([None, None, None, None])] * 3)
    def f(q, k, v):
        return attention(q, k, v)

    with pytest.raises(ValueError, match="Received: scale=None"):
        f.get_concrete_function()


# ---------------------------------------------------------------- the raw ops (kernel only)


def _lib():
    if not attention_module.uses_kernel():
        pytest.skip("the attention kernel is not in the op library")
    from tfmetal_ext.ops import _common

    return _common.library()


def test_raw_op_lse_and_output():
    lib = _lib()
    q, k, v = qkv(2, 3, 70, 67, 16, 8, seed=20)
    mask = make_mask("full", 2, 3, 70, 67, seed=20)
    mask[1, 2, 5, :] = False  # a fully masked row: output 0, lse -inf
    out, lse = lib.tfmetal_ext_attention(q, k, v, mask, [], causal=True, scale=0.3)
    want_out, want_lse = np_attention(q, k, v, mask, True, 0.3)
    assert lse.dtype == tf.float32 and lse.shape == (2, 3, 70)
    assert_close(out.numpy(), want_out, 2e-5)
    assert np.isneginf(lse.numpy()[1, 2, 5]) and (out.numpy()[1, 2, 5] == 0).all()
    assert np.isneginf(lse.numpy()[np.isneginf(want_lse)]).all()
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


def test_raw_op_mask_broadcast_dims():
    """Every combination of broadcast (size-1) and full mask dimensions, against numpy's broadcasting."""
    lib = _lib()
    b, h, tq, tk = 2, 3, 9, 11
    q, k, v = qkv(b, h, tq, tk, 4, 5, seed=21)
    rng = np.random.default_rng(22)
    for bits in range(16):
        shape = tuple(full if bits >> axis & 1 else 1 for axis, full in enumerate((b, h, tq, tk)))
        mask = rng.random(shape) < 0.7
        out, _ = lib.tfmetal_ext_attention(q, k, v, mask, [], causal=False, scale=0.5)
        assert_close(out.numpy(), np_attention(q, k, v, mask, False, 0.5)[0], 2e-5, str(shape))


def test_gradient_is_deterministic():
    lib = _lib()
    q, k, v = qkv(2, 2, 150, 130, 32, 16, seed=23)
    do = np.random.default_rng(24).normal(0, 1, (2, 2, 150, 16)).astype("float32")
    m = tf.ones([1, 1, 1, 1], tf.bool)
    out, lse = lib.tfmetal_ext_attention(q, k, v, m, [], causal=True, scale=0.2)
    first = [t.numpy() for t in lib.tfmetal_ext_attention_grad(do, q, k, v, m, out, lse, [], causal=True, scale=0.2)]
    for _ in range(3):
        again = lib.tfmetal_ext_attention_grad(do, q, k, v, m, out, lse, [], causal=True, scale=0.2)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b.numpy())


def _raw_bad_calls():
    """(what, op, inputs, seeds, attrs): calls of the raw ops with shapes or attrs they must reject."""
    q = np.zeros((2, 3, 4, 8), "float32")
    k = np.zeros((2, 3, 5, 8), "float32")
    v = np.zeros((2, 3, 5, 6), "float32")
    m = np.ones((1, 1, 1, 1), bool)
    out = np.zeros((2, 3, 4, 6), "float32")
    lse = np.zeros((2, 3, 4), "float32")

    seed = np.array([1, 2], "int64")

    def fwd(q=q, k=k, v=v, m=m, scale=1.0, seeds=(), **dropout):
        return "tfmetal_ext_attention", [q, k, v, m], list(seeds), {"scale": scale, **dropout}

    def grad(do=out, o=out, lse=lse, m=m, seeds=(), **dropout):
        return "tfmetal_ext_attention_grad", [do, q, k, v, m, o, lse], list(seeds), {"scale": 1.0, **dropout}

    return [
        ("query rank 3", *fwd(q=q[0])),
        ("key rank 5", *fwd(k=k[..., None])),
        ("mask rank 3", *fwd(m=m[0])),
        ("key batch", *fwd(k=k[:1])),
        ("value heads", *fwd(v=v[:, :1])),
        ("key heads 2 of 3", *fwd(k=k[:, :2], v=v[:, :2])),
        ("grad key heads 2 of 3", "tfmetal_ext_attention_grad", [out, q, k[:, :2], v[:, :2], m, out, lse], [],
         {"scale": 1.0}),
        ("sliding_window -1", *fwd(sliding_window=-1)),
        ("sliding_window 2^31", *fwd(sliding_window=2**31)),
        ("value length", *fwd(v=v[:, :, :4])),
        ("key head dim", *fwd(k=k[..., :7])),
        ("head dim 0", *fwd(q=q[..., :0], k=k[..., :0])),
        ("head dim 257", *fwd(q=np.zeros((2, 3, 4, 257), "float32"), k=np.zeros((2, 3, 5, 257), "float32"))),
        ("value dim 300", *fwd(v=np.zeros((2, 3, 5, 300), "float32"))),
        ("mask batch 3", *fwd(m=np.ones((3, 1, 1, 5), bool))),
        ("mask keys 4", *fwd(m=np.ones((1, 1, 1, 4), bool))),
        ("mask queries 5", *fwd(m=np.ones((1, 1, 5, 5), bool))),
        ("scale 0", *fwd(scale=0.0)),
        ("scale -1", *fwd(scale=-1.0)),
        ("scale nan", *fwd(scale=float("nan"))),
        ("scale inf", *fwd(scale=float("inf"))),
        ("grad d_output shape", *grad(do=out[:, :, :3])),
        ("grad output shape", *grad(o=out[..., :5])),
        ("grad lse shape", *grad(lse=lse[:, :, :3])),
        ("grad lse rank", *grad(lse=lse[..., None])),
        ("grad mask", *grad(m=np.ones((2, 2, 1, 1), bool))),
        # dropout: the seed list and attrs
        ("dropout without seed", *fwd(dropout_rate=0.5, dropout_scale=2.0)),
        ("grad dropout without seed", *grad(dropout_rate=0.5, dropout_scale=2.0)),
        ("seed of 3", *fwd(seeds=[np.array([1, 2, 3], "int32")], dropout_rate=0.5, dropout_scale=2.0)),
        ("seed rank 0", *fwd(seeds=[np.array(1, "int64")], dropout_rate=0.5, dropout_scale=2.0)),
        ("seed of 3, rate 0", *fwd(seeds=[np.array([1, 2, 3], "int64")])),
        ("grad seed of 1", *grad(seeds=[np.array([1], "int32")], dropout_rate=0.5, dropout_scale=2.0)),
        ("two seeds", *fwd(seeds=[seed, seed], dropout_rate=0.5, dropout_scale=2.0)),
        ("dropout_rate 1.5", *fwd(seeds=[seed], dropout_rate=1.5, dropout_scale=2.0)),
        ("dropout_rate -0.1", *fwd(seeds=[seed], dropout_rate=-0.1, dropout_scale=2.0)),
        ("dropout_scale 0", *grad(seeds=[seed], dropout_rate=0.5, dropout_scale=0.0)),
        # layout "BSHD": shapes read with the heads on axis 2; d_output and output in that layout
        ("BSHD value length", "tfmetal_ext_attention", [*_bshd(q, k), _bshd(v)[0][:, :4], m], [],
         {"scale": 1.0, "layout": "BSHD"}),
        ("BSHD key heads 2 of 3", "tfmetal_ext_attention", [*_bshd(q, k[:, :2], v[:, :2]), m], [],
         {"scale": 1.0, "layout": "BSHD"}),
        ("BSHD grad d_output in BHSD", "tfmetal_ext_attention_grad", [out, *_bshd(q, k, v), m, *_bshd(out), lse],
         [], {"scale": 1.0, "layout": "BSHD"}),
        ("BSHD grad output in BHSD", "tfmetal_ext_attention_grad", [*_bshd(out, q, k, v), m, out, lse],
         [], {"scale": 1.0, "layout": "BSHD"}),
    ]


@pytest.mark.parametrize("shapes", ["static", "unknown"])
def test_raw_ops_bad_shapes_raise_invalid_argument(shapes):
    """Bad shapes and attrs give InvalidArgumentError, never a crash: from the shape functions (static
    shapes), from the kernels' own checks when the shapes are unknown at graph-building time."""
    lib = _lib()
    for what, op, inputs, seeds, attrs in _raw_bad_calls():
        fn = getattr(lib, op)
        if shapes == "static":
            with pytest.raises(tf.errors.InvalidArgumentError):
                fn(*inputs, seeds, **attrs)
            continue
        n = len(inputs)
        signature = [tf.TensorSpec(None, tf.as_dtype(x.dtype)) for x in inputs + seeds]
        graph_fn = tf.function(lambda *xs: fn(*xs[:n], list(xs[n:]), **attrs), input_signature=signature)
        # The number of seeds is known when the graph is built: the shape function refuses two then.
        error = ValueError if what == "two seeds" else tf.errors.InvalidArgumentError
        with pytest.raises(error, match="seed must be a list of at most one tensor" if what == "two seeds" else None):
            graph_fn(*inputs, *seeds)
        # The kernel checks ran (the shape function saw unknown shapes), and the op still works after.
    q, k, v = qkv(1, 1, 2, 3, 4, seed=25)
    assert np.isfinite(lib.tfmetal_ext_attention(q, k, v, np.ones((1, 1, 1, 1), bool), [], scale=1.0)[0].numpy()).all()


_BASELINE_CASES = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf
    sys.path.insert(0, sys.argv[1])
    import test_attention as t
    from tfmetal_ext.ops import _common
    lib = _common.library()
    for seed, case in enumerate(t.CASES):
        b, h, tq, tk, d, dv, kind, causal = case
        q, k, v = t.qkv(b, h, tq, tk, d, dv, seed=seed)
        mask = t.make_mask(kind, b, h, tq, tk, seed)
        m = np.ones((1, 1, 1, 1), bool) if mask is None else mask
        do = np.random.default_rng(seed).normal(0, 1, (b, h, tq, dv)).astype("float32")
        for dtype, (tf_dtype, tol) in t.DTYPES.items():
            args = [tf.constant(x, tf_dtype) for x in (q, k, v)]
            out, lse = lib.tfmetal_ext_attention(*args, m, [], causal=causal, scale=0.25)
            grads = lib.tfmetal_ext_attention_grad(tf.constant(do, tf_dtype), *args, m, out, lse, [], causal=causal,
                                                   scale=0.25)
            r = [t.rounded(x, tf_dtype) for x in (q, k, v)]
            t.assert_close(t.as64(out), t.np_attention(*r, mask, causal, 0.25)[0], tol, t.case_id(case))
            wants = t.np_attention_grad(t.rounded(do, tf_dtype), *r, mask, causal, 0.25)
            for got, want in zip(grads, wants):
                t.assert_close(t.as64(got), want, 2 * tol, t.case_id(case))
    for seed, case in enumerate(t.GROUPED_CASES):
        b, h, hk, tq, tk, d, dv, kind, causal, window = case
        rng = np.random.default_rng(seed)
        q, k, v, do = (rng.normal(0, 1, shape).astype("float32")
                       for shape in ((b, h, tq, d), (b, hk, tk, d), (b, hk, tk, dv), (b, h, tq, dv)))
        mask = t.make_mask(kind, b, h, tq, tk, seed)
        m = np.ones((1, 1, 1, 1), bool) if mask is None else mask
        attrs = dict(causal=causal, scale=0.25, sliding_window=window)
        out, lse = lib.tfmetal_ext_attention(q, k, v, m, [], **attrs)
        grads = lib.tfmetal_ext_attention_grad(do, q, k, v, m, out, lse, [], **attrs)
        want = t.np_grouped(q, k, v, do, mask, causal, window, 0.25)
        t.assert_close(t.as64(out), want[0], 2e-5, str(case))
        for got, w in zip(grads, want[2:]):
            t.assert_close(t.as64(got), w, 4e-5, str(case))
        # layout "BSHD" at this level: the same bits, transposed
        qs, ks, vs, dos = t._bshd(q, k, v, do)
        out_s, lse_s = lib.tfmetal_ext_attention(qs, ks, vs, m, [], layout="BSHD", **attrs)
        grads_s = lib.tfmetal_ext_attention_grad(dos, qs, ks, vs, m, out_s, lse_s, [], layout="BSHD", **attrs)
        for a, b in zip([out, *grads], [out_s, *grads_s]):
            np.testing.assert_array_equal(np.swapaxes(b.numpy(), 1, 2), a.numpy(), err_msg=str(case))
    print("ok", len(t.CASES) + len(t.GROUPED_CASES))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["baseline", "avx2"])
def test_lower_cpu_levels_match_numpy(level):
    """The code a CPU below this one's level runs, in a fresh process, against numpy.

    ``baseline`` (TFMETAL_EXT_CPU_BASELINE=1): the Eigen GEMMs and portable loops, what arm64 runs.
    ``avx2`` (TFMETAL_EXT_CPU_LEVEL=avx2): the AVX2 micro-kernels, what an AVX2-only CPU runs, on a
    CPU with AVX-512 (elsewhere it is the code every other test here runs). The GEMMs of the two
    x86 levels give the same bits; the element-wise loops may differ in the last bit, as the compiler
    fuses a multiply and an add in one and not the other. At each level, layout "BSHD" gives the
    grouped cases' "BHSD" bits (the strided tile loads of that level's GEMMs).
    """
    from tfmetal_ext import devices

    if not attention_module.uses_kernel():
        pytest.skip("the attention kernel is not in the op library")
    if level == "avx2" and not devices.capabilities().cpu_avx512:
        pytest.skip("no AVX-512 on this CPU: its AVX2 code is what the rest of this file runs")
    proc = run_at_level(_BASELINE_CASES, level, os.path.dirname(os.path.abspath(__file__)))
    assert proc.stdout.split()[-2:] == ["ok", str(len(CASES) + len(GROUPED_CASES))]


# ---------------------------------------------------------------- attention dropout
#
# The mask is TensorFlow's stateless dropout mask of a (b, h, tq, tk) tensor of the input dtype:
# here from the numpy Philox of tfmetal_ext.testing (written from the definition), independently
# of the kernels' header and of the pure-TF reference's StatelessRandomUniformV2.

from tfmetal_ext.testing import UNIFORM_BITS, np_key_counter, np_stateless_uniform  # noqa: E402

SEED = np.array([7, -3], "int32")


def np_rounded(value, dtype):
    """A Python float as `dtype` rounds it eagerly (through float32), as a float."""
    np_dtype = tf.as_dtype(DTYPES[dtype][0]).as_numpy_dtype
    return float(np.asarray(np.float32(value), np_dtype))


def np_keep(seed, shape, dtype, rate):
    """The (b, h, tq, tk) keep mask: uniform(flat index) >= rate, in `dtype`'s bits and rounding."""
    key, counter = np_key_counter([int(s) for s in seed])
    u = np_stateless_uniform(int(np.prod(shape)), key, counter, UNIFORM_BITS[dtype]).reshape(shape)
    return u >= np_rounded(rate, dtype)


def np_dropout_attention(q, k, v, mask, causal, scale, keep, drop_scale):
    """(output, dQ, dK, dV as a function of dO) with probabilities p * keep * drop_scale, float64."""
    p, _ = np_probs(q, k, mask, causal, scale)
    m = np.where(keep, drop_scale, 0.0)
    v64 = np.asarray(v, np.float64)
    out = np.einsum("bhqk,bhkd->bhqd", p * m, v64)

    def grads(do):
        do = np.asarray(do, np.float64)
        dp = m * np.einsum("bhqd,bhkd->bhqk", do, v64)
        ds = p * (dp - (do * out).sum(-1, keepdims=True))
        return (scale * np.einsum("bhqk,bhkd->bhqd", ds, np.asarray(k, np.float64)),
                scale * np.einsum("bhqk,bhqd->bhkd", ds, np.asarray(q, np.float64)),
                np.einsum("bhqk,bhqd->bhkd", p * m, do))

    return out, grads


# (b, h, tq, tk, d, dv, mask kind, causal): Tq != Tk, Dv != D, several key tiles, masks, causal
DROPOUT_CASES = [
    (2, 2, 5, 7, 4, 3, None, False),
    (1, 2, 9, 6, 5, 7, "full", True),
    (2, 1, 70, 131, 8, 8, "padding", True),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_matches_numpy(path, dtype):
    """Output and gradients against float64 attention with the numpy Philox mask, every dtype."""
    tf_dtype, tol = DTYPES[dtype]
    rate = 0.3
    for seed, case in enumerate(DROPOUT_CASES):
        b, h, tq, tk, d, dv, kind, causal = case
        q, k, v = qkv(b, h, tq, tk, d, dv, seed=seed)
        mask = make_mask(kind, b, h, tq, tk, seed)
        do = np.random.default_rng(seed + 70).normal(0, 1, (b, h, tq, dv)).astype("float32")
        qt, kt, vt = (tf.constant(t, tf_dtype) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=causal, dropout_rate=rate, seed=SEED)
        grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.constant(do, tf_dtype))
        keep = np_keep(SEED, (b, h, tq, tk), dtype, rate)
        assert 0.55 < keep.mean() < 0.85
        want, want_grads = np_dropout_attention(*(rounded(t, tf_dtype) for t in (q, k, v)), mask, causal,
                                                1 / math.sqrt(d), keep, np_rounded(1 / (1 - rate), dtype))
        assert out.dtype == tf_dtype and out.shape == (b, h, tq, dv)
        assert_close(as64(out), want, 2 * tol, case_id(case))
        for got, w, what in zip(grads, want_grads(rounded(do, tf_dtype)), "qkv"):
            assert got.dtype == tf_dtype
            assert_close(as64(got), w, 3 * tol, f"d{what}, {case_id(case)}")


# (b, h, tq, tk, d, mask kind, causal, window). tk % 4 == 0: every query row starts at the same word of a
# Philox block, so the CPU kernel's forward draws a tile's mask 16 query rows at a time. tq = 70 leaves a
# query tile of 6 rows (a part of the 16); window 38 starts the tiles of queries 64.. and 128.. at keys 27
# and 91, inside a block.
DROPOUT_LANE_CASES = [
    (1, 2, 70, 132, 8, "padding", False, None),
    (2, 1, 132, 132, 4, None, True, 38),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_rows_in_whole_blocks_and_windows_match_numpy(path, dtype):
    """Output and gradients against float64 attention with the numpy Philox mask where tk % 4 == 0 (the
    kernel's forward draws the mask across query rows), with and without a sliding window."""
    tf_dtype, tol = DTYPES[dtype]
    rate = 0.3
    for seed, (b, h, tq, tk, d, kind, causal, window) in enumerate(DROPOUT_LANE_CASES):
        q, k, v = qkv(b, h, tq, tk, d, seed=seed + 40)
        mask = make_mask(kind, b, h, tq, tk, seed)
        allowed = None if mask is None else np.asarray(mask, bool)
        if window:
            band = np.abs(np.arange(tq)[:, None] - np.arange(tk)[None, :]) < window
            allowed = band[None, None] if allowed is None else allowed & band
        do = np.random.default_rng(seed + 90).normal(0, 1, (b, h, tq, d)).astype("float32")
        qt, kt, vt = (tf.constant(t, tf_dtype) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=causal, sliding_window=window, dropout_rate=rate,
                            seed=SEED)
        grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.constant(do, tf_dtype))
        keep = np_keep(SEED, (b, h, tq, tk), dtype, rate)
        want, want_grads = np_dropout_attention(*(rounded(t, tf_dtype) for t in (q, k, v)), allowed, causal,
                                                1 / math.sqrt(d), keep, np_rounded(1 / (1 - rate), dtype))
        what = f"{b}x{h}x{tq}x{tk}-{kind}-causal={causal}-window={window}"
        assert_close(as64(out), want, 2 * tol, what)
        for got, w, name in zip(grads, want_grads(rounded(do, tf_dtype)), "qkv"):
            assert_close(as64(got), w, 3 * tol, f"d{name}, {what}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_mask_is_tensorflows_stateless_dropout_mask(path, dtype):
    """Bit for bit: with value = identity (dv = tk), output row i is p_i * m_i, zero exactly where
    tf.nn.experimental.stateless_dropout of a (b, h, tq, tk) tensor of the dtype drops, and where the
    numpy Philox drops."""
    tf_dtype, _ = DTYPES[dtype]
    b, h, tq, tk = 2, 3, 5, 9
    q, k, _ = qkv(b, h, tq, tk, 4, seed=31)
    v = np.broadcast_to(np.eye(tk, dtype="float32"), (b, h, tk, tk))
    rate = 0.4
    for seed in (SEED, np.array([2**40 + 5, -(2**35)], "int64")):
        out = attention(*(tf.constant(t, tf_dtype) for t in (q * 0.1, k * 0.1, v)), dropout_rate=rate, seed=seed)
        dropped = as64(out) == 0.0
        stock = tf.nn.experimental.stateless_dropout(tf.ones([b, h, tq, tk], tf_dtype), rate=rate, seed=seed)
        np.testing.assert_array_equal(dropped, stock.numpy() == 0)
        np.testing.assert_array_equal(dropped, ~np_keep(seed, (b, h, tq, tk), dtype, rate))
        assert dropped.any() and not dropped.all()


def test_dropout_seeds(path):
    """A seed draws one mask: the same seed the same result (eager and tf.function), another seed
    another; int32 and int64 seeds of equal values the same; a SeedGenerator is drawn once per call
    as keras.random.dropout draws it (so set_random_seed reproduces a run); rate 0 draws nothing."""
    import keras

    q, k, v = qkv(1, 2, 6, 8, 4, seed=33)
    first = attention(q, k, v, dropout_rate=0.5, seed=[1, 2]).numpy()
    np.testing.assert_array_equal(first, attention(q, k, v, dropout_rate=0.5, seed=[1, 2]).numpy())
    np.testing.assert_array_equal(first, attention(q, k, v, dropout_rate=0.5, seed=np.array([1, 2], "int64")).numpy())
    traced = tf.function(lambda s: attention(q, k, v, dropout_rate=0.5, seed=s))
    # The same mask traced (a graph may round the reference's MatMuls differently: oneDNN).
    assert_close(traced(tf.constant([1, 2])).numpy(), first, 1e-6)
    assert not np.array_equal(first, attention(q, k, v, dropout_rate=0.5, seed=[1, 3]).numpy())

    generator = keras.random.SeedGenerator(5)
    state = generator.state.numpy().copy()
    ours = attention(q, k, v, dropout_rate=0.5, seed=generator).numpy()
    drawn = generator.state.numpy().copy()
    assert not np.array_equal(state, drawn)
    generator.state.assign(state)
    scores = tf.constant(np_probs(q, k, None, False, 0.5)[0], tf.float32)
    stock_p = keras.random.dropout(scores, 0.5, seed=generator)
    np.testing.assert_array_equal(generator.state.numpy(), drawn)  # one draw each
    assert_close(ours, np.einsum("bhqk,bhkd->bhqd", stock_p.numpy(), v), 2e-5)
    attention(q, k, v, dropout_rate=0.0, seed=generator)
    np.testing.assert_array_equal(generator.state.numpy(), drawn)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_rate_rounding_to_one_drops_everything(path, dtype):
    """A rate that the dtype rounds to 1 keeps nothing (the float16 scale is inf then): zeros, no NaN."""
    tf_dtype, _ = DTYPES[dtype]
    q, k, v = (tf.constant(t, tf_dtype) for t in qkv(1, 1, 3, 5, 4, seed=34))
    with tf.GradientTape() as tape:
        tape.watch(v)
        out = attention(q, k, v, dropout_rate=0.99999, seed=SEED)
    assert (as64(out) == 0).all()
    assert (as64(tape.gradient(out, v)) == 0).all()


def test_dropout_rows_attending_no_key_and_empty_sizes(path):
    b, h, tq, tk, d = 2, 2, 6, 5, 4
    q, k, v = qkv(b, h, tq, tk, d, seed=35)
    mask = np.ones((b, 1, tq, tk), bool)
    mask[0, 0, 2] = False
    qt, kt, vt = (tf.constant(t) for t in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([qt, kt, vt])
        out = attention(qt, kt, vt, mask=mask, dropout_rate=0.5, seed=SEED)
    grads = tape.gradient(out, [qt, kt, vt], output_gradients=tf.ones_like(out))
    assert (out.numpy()[0, :, 2] == 0).all() and np.isfinite(out.numpy()).all()
    assert (grads[0].numpy()[0, :, 2] == 0).all() and all(np.isfinite(g.numpy()).all() for g in grads)
    for shape in [(0, 2, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)]:
        bb, hh, qq, kk = shape
        q, k, v = qkv(bb, hh, qq, kk, 4, 5, seed=36)
        qt, kt, vt = (tf.constant(t) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, causal=True, dropout_rate=0.5, seed=SEED)
        assert out.shape == (bb, hh, qq, 5) and (out.numpy() == 0).all()
        for g, t in zip(tape.gradient(out, [qt, kt, vt], output_gradients=tf.ones_like(out)), (q, k, v)):
            assert g.shape == t.shape and (g.numpy() == 0).all()


def test_dropout_compute_gradient(path):
    """Theoretical against numerical Jacobians with the mask fixed by the seed (float32)."""
    q, k, v = qkv(1, 2, 4, 5, 3, 2, seed=37)
    mask = make_mask("full", 1, 2, 4, 5, 37)
    mask[..., 0] = True

    def f(q, k, v):
        return attention(q, k, v, mask=mask, causal=True, scale=0.8, dropout_rate=0.3, seed=SEED)

    theoretical, numerical = tf.test.compute_gradient(f, [tf.constant(q), tf.constant(k), tf.constant(v)], delta=1e-2)
    for t, n in zip(theoretical, numerical):
        assert np.abs(t).max() > 1e-3
        np.testing.assert_allclose(t, n, atol=3e-3, rtol=3e-3)


def test_kernel_and_reference_dropout_agree(monkeypatch):
    """The kernel's mask is the pure-TF reference's (the reference's StatelessRandomUniformV2 on the
    (b, h, tq, tk) shape): the zeros of the dropped output match exactly, the values to rounding."""
    if not attention_module.uses_kernel():
        pytest.skip("the attention kernel is not in the op library")
    q, k, v = qkv(2, 2, 7, 33, 8, 6, seed=38)
    mask = padding_mask(2, 33, [33, 20])
    results = []
    for reference in ("0", "1"):
        monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", reference)
        qt, kt, vt = (tf.constant(t, tf.float16) for t in (q, k, v))
        with tf.GradientTape() as tape:
            tape.watch([qt, kt, vt])
            out = attention(qt, kt, vt, mask=mask, causal=True, dropout_rate=0.25, seed=SEED)
        results.append([as64(out)] + [as64(g) for g in tape.gradient(out, [qt, kt, vt])])
    kernel, reference = results
    np.testing.assert_array_equal(kernel[0] == 0, reference[0] == 0)
    for a, b in zip(kernel, reference):
        assert_close(a, b, 6e-3)


def test_dropout_bad_arguments():
    q = np.zeros((1, 1, 2, 4), "float32")
    cases = [
        (dict(dropout_rate=1.0, seed=[1, 2]), "Received: dropout_rate=1.0"),
        (dict(dropout_rate=-0.1, seed=[1, 2]), "Received: dropout_rate=-0.1"),
        (dict(dropout_rate="0.1", seed=[1, 2]), "Received: dropout_rate='0.1'"),
        (dict(dropout_rate=True, seed=[1, 2]), "Received: dropout_rate=True"),
        (dict(dropout_rate=float("nan"), seed=[1, 2]), "Received: dropout_rate=nan"),
        (dict(dropout_rate=0.5), r"Received: dropout_rate=0.5, seed=None"),
        (dict(dropout_rate=0.5, seed=3), "Received: seed=3"),
        (dict(dropout_rate=0.5, seed=[1, 2, 3]), r"Received: seed.shape=\(3,\)"),
        (dict(dropout_rate=0.5, seed=[1.0, 2.0]), "Received: seed.dtype=float32"),
        (dict(dropout_rate=0.0, seed=[1, 2, 3]), r"Received: seed.shape=\(3,\)"),  # checked even unused
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attention(q, q, q, **kwargs)


def test_graphs_without_the_seed_input_still_load_and_run():
    """A TfmetalExt>Attention node written before the seed input and the dropout and layout attrs
    existed (4 inputs, no Tseed/dropout_rate/dropout_scale/layout) loads with the defaults (no seed,
    rate 0, "BHSD"): the same output and gradients as today's op."""
    lib = _lib()
    q, k, v = qkv(1, 2, 5, 6, 4, 3, seed=39)
    want = lib.tfmetal_ext_attention(q, k, v, np.ones((1, 1, 1, 1), bool), [], causal=True, scale=0.5)[0].numpy()
    graph = tf.Graph()
    with graph.as_default():
        for name, x in (("q", q), ("k", k), ("v", v), ("m", np.ones((1, 1, 1, 1), bool))):
            tf.constant(x, name=name)
    graph_def = graph.as_graph_def()
    node = graph_def.node.add()
    node.name, node.op = "old_attention", attention_module.ATTENTION_OP
    node.input.extend(["q", "k", "v", "m"])
    node.attr["T"].type = tf.float32.as_datatype_enum
    node.attr["causal"].b = True
    node.attr["scale"].f = 0.5
    assert "Tseed" not in node.attr and "dropout_rate" not in node.attr and "layout" not in node.attr
    with tf.Graph().as_default() as g:
        (out,) = tf.graph_util.import_graph_def(graph_def, return_elements=["old_attention:0"])
        grads = tf.gradients(out, [g.get_tensor_by_name(f"import/{n}:0") for n in "qkv"])
        with tf.compat.v1.Session(graph=g) as sess:
            got, got_grads = sess.run([out, grads])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    wants = np_attention_grad(np.ones_like(want), q, k, v, None, True, 0.5)
    for a, b in zip(got_grads, wants):
        assert_close(a, b, 2e-5)


def test_kernel_seed_errors_read_like_tensorflows():
    """A malformed seed tensor (shape unknown when the graph is built, so the kernels check it) gives
    InvalidArgumentError with TensorFlow's own text for stateless seeds; a missing one names the input."""
    lib = _lib()
    q = np.zeros((1, 1, 2, 4), "float32")
    m = np.ones((1, 1, 1, 1), bool)
    fn = tf.function(lambda s: lib.tfmetal_ext_attention(q, q, q, m, [s], dropout_rate=0.5, dropout_scale=2.0)[0],
                     input_signature=[tf.TensorSpec(None, tf.int64)])
    with pytest.raises(tf.errors.InvalidArgumentError) as ours:
        fn(tf.constant([1, 2, 3], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
        tf.function(lambda s: tf.raw_ops.StatelessRandomGetKeyCounter(seed=s),
                    input_signature=[tf.TensorSpec(None, tf.int64)])(tf.constant([1, 2, 3], tf.int64))
    assert "seed must have shape [2], not [3]" in ours.value.message
    assert "seed must have shape [2], not [3]" in theirs.value.message
    with pytest.raises(tf.errors.InvalidArgumentError, match="dropout_rate = 0.5.* needs the seed input"):
        lib.tfmetal_ext_attention(q, q, q, m, [], dropout_rate=0.5, dropout_scale=2.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dropout_rate must be in \[0, 1\]"):
        lib.tfmetal_ext_attention(q, q, q, m, [np.array([1, 2])], dropout_rate=1.5, dropout_scale=2.0)
