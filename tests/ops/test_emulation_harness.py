"""The Metal kernel emulator (custom_ops/emu) and the include flattener (custom_ops/metal/embed.py).

Self-test kernels live in tests/ops/emu_kernels/ and follow the conventions of
custom_ops/metal/. The last tests enforce the rule that every kernel
instantiated by a custom_ops/metal/*.metal file is run by an emulation test.
"""

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tfmetal_ext.testing import load_emu

ROOT = Path(__file__).resolve().parents[2]
KERNELS = Path(__file__).resolve().parent / "emu_kernels"


emu = load_emu()

ODD_SIZES = [1, 31, 32, 33, 1000, 100003]


# These tests never touch Keras: skip the conftest's per-test Keras session
# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


# ---------------------------------------------------------------------------
# numpy references


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept NaN (bit-level reference)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bfloat16_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def simd_reference(x: np.ndarray, n: int, tg: int, groups: int) -> np.ndarray:
    """Expected output of the simd_functions kernel (12 values per thread, NaN = inactive source lane)."""
    out = np.full((groups * tg, 12), np.nan, np.float64)
    for g in range(groups):
        size = min(tg, groups * tg - g * tg)
        for s in range(0, size, 32):
            lanes = range(min(32, size - s))
            gids = [g * tg + s + lane for lane in lanes]
            active = [gid < n for gid in gids]
            vals = {lane: float(x[gids[lane]]) for lane in lanes if active[lane]}
            if not vals:
                continue
            act = sorted(vals)
            for lane in act:
                def src(i, own=vals[lane]):
                    if i < 0 or i >= 32:
                        return own
                    return vals.get(i, np.nan)
                row = out[gids[lane]]
                row[0] = sum(vals.values())
                row[1] = max(vals.values())
                row[2] = min(vals.values())
                row[3] = sum(vals[i] for i in act if i < lane)
                row[4] = sum(vals[i] for i in act if i <= lane)
                row[5] = src(lane + 1)
                row[6] = src(lane - 2)
                row[7] = vals.get(lane ^ 1, np.nan)
                row[8] = vals.get(3, np.nan)
                row[9] = vals[act[0]]
                row[10] = float(all(v > 0 for v in vals.values()))
                row[11] = float(sum(1 << i for i in act if vals[i] > 0.5) & 0xFFFFFF)
    return out


# ---------------------------------------------------------------------------
# Libraries (compiled once per session, cached on disk across sessions).


@pytest.fixture(scope="module")
def elementwise():
    return emu.build(KERNELS / "elementwise.metal")


@pytest.fixture(scope="module")
def reduce():
    return emu.build(KERNELS / "reduce.metal")


@pytest.fixture(scope="module")
def convert():
    return emu.build(KERNELS / "convert.metal")


@pytest.fixture(scope="module")
def faults():
    return emu.build(KERNELS / "faults.metal")


def affine_params(a: float, b: float, n: int) -> np.ndarray:
    dtype = np.dtype([("a", np.float32), ("b", np.float32), ("n", np.uint32)])
    return np.array((a, b, n), dtype)


# ---------------------------------------------------------------------------
# Elementwise kernels: sizes, non-uniform threadgroups, dtypes.


def test_kernels_are_listed_with_their_parameters(elementwise):
    assert elementwise.kernels() == ["affine_bfloat", "affine_float", "affine_half", "grid2d", "mark_once"]
    params = elementwise.params("affine_half")
    assert [(p.kind, p.const, p.size) for p in params] == [
        ("pointer", True, 2), ("pointer", False, 2), ("reference", False, 12)]
    assert elementwise.max_total_threads_per_threadgroup == 1024
    assert elementwise.thread_execution_width == 32


@pytest.mark.parametrize("n", ODD_SIZES)
def test_every_thread_runs_once_and_nothing_past_the_end(elementwise, n):
    tg = 256 if n > 1000 else 32
    guard = 64
    count = np.zeros(n + guard, np.uint32)
    group = np.full(n + guard, 7777, np.uint32)
    elementwise.run("mark_once", [count, group, ("bytes", np.uint32(n))], grid=(n, 1, 1), threadgroup=(tg, 1, 1))
    assert np.all(count[:n] == 1)
    assert np.all(count[n:] == 0) and np.all(group[n:] == 7777)
    # dispatchThreads: the edge threadgroup is smaller and says so.
    expected = np.full(n, tg, np.uint32)
    if n % tg:
        expected[n - n % tg:] = n % tg
    np.testing.assert_array_equal(group[:n], expected)


@pytest.mark.parametrize("dtype", ["float", "half", "bfloat"])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_affine_matches_numpy(elementwise, dtype, n):
    rng = np.random.default_rng(n)
    x32 = (rng.standard_normal(n) * 3).astype(np.float32)
    a, b = np.float32(1.7), np.float32(-0.3)
    ref32 = a * x32 + b
    guard = 8
    if dtype == "float":
        x, ref = x32, ref32
        y = np.full(n + guard, 12345.0, np.float32)
    elif dtype == "half":
        x = x32.astype(np.float16)
        ref = (a * x.astype(np.float32) + b).astype(np.float16)
        y = np.full(n + guard, 1234.0, np.float16)
    else:
        x = bfloat16_bits(x32)
        ref = bfloat16_bits(a * bfloat16_to_float(x) + b)
        y = np.full(n + guard, 0x4B4B, np.uint16)
    sentinel = y[n:].copy()
    elementwise.run(f"affine_{dtype}", [x, y, ("bytes", affine_params(a, b, n))], grid=n, threadgroup=256 if n > 1000 else 64)
    if dtype == "bfloat":
        np.testing.assert_array_equal(y[:n], ref)
    else:
        np.testing.assert_array_equal(y[:n].view(np.uint16 if dtype == "half" else np.uint32),
                                      ref.view(np.uint16 if dtype == "half" else np.uint32))
    np.testing.assert_array_equal(y[n:], sentinel)


@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_threadgroup_order_does_not_change_results(elementwise, order):
    n = 1000
    x = np.linspace(-5, 5, n, dtype=np.float32)
    y = np.zeros(n, np.float32)
    elementwise.run("affine_float", [x, y, ("bytes", affine_params(2.0, 1.0, n))], grid=n, threadgroup=64,
                    order=order, seed=3)
    np.testing.assert_array_equal(y, np.float32(2.0) * x + np.float32(1.0))


def test_two_dimensional_grid_with_edge_threadgroups(elementwise):
    w, h = 37, 5
    out = np.zeros((h * w, 4), np.uint32)
    elementwise.run("grid2d", [out, ("bytes", np.array([w, h], np.uint32))], grid=(w, h), threadgroup=(8, 4))
    ys, xs = np.divmod(np.arange(h * w), w)
    np.testing.assert_array_equal(out[:, 0], xs)
    np.testing.assert_array_equal(out[:, 1], ys)
    np.testing.assert_array_equal(out[:, 2], np.where(xs >= 32, w % 8, 8))
    np.testing.assert_array_equal(out[:, 3], np.where(ys >= 4, h % 4, 4))


def test_dispatch_threadgroups_runs_full_threadgroups(elementwise):
    n = 100
    count = np.zeros(128, np.uint32)
    group = np.zeros(128, np.uint32)
    elementwise.run("mark_once", [count, group, ("bytes", np.uint32(n))], threadgroups=2, threadgroup=64)
    np.testing.assert_array_equal(count, (np.arange(128) < n).astype(np.uint32))
    np.testing.assert_array_equal(group[:n], 64)  # every threadgroup full; the kernel guards gid < n


# ---------------------------------------------------------------------------
# Reductions: threadgroup memory, barriers, SIMD-group functions.


@pytest.mark.parametrize("tg", [32, 64, 256, 1024])
@pytest.mark.parametrize("variant", ["tree", "simd"])
def test_row_sums_match_numpy(reduce, variant, tg):
    rng = np.random.default_rng(tg)
    for cols in ([1, 33, 1000] if tg <= 256 else [1000]):
        rows = 2 if tg == 1024 else 5
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        out = np.zeros(rows, np.float32)
        args = [x, out, ("bytes", np.uint32(cols))] + ([("threadgroup", tg * 4)] if variant == "tree" else [])
        reduce.run(f"row_sum_{variant}_float", args, threadgroups=rows, threadgroup=tg)
        np.testing.assert_allclose(out, x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["tree", "simd"])
def test_row_sums_half_input(reduce, variant):
    x = np.random.default_rng(0).standard_normal((3, 31)).astype(np.float16)
    out = np.zeros(3, np.float32)
    args = [x, out, ("bytes", np.uint32(31))] + ([("threadgroup", 64 * 4)] if variant == "tree" else [])
    reduce.run(f"row_sum_{variant}_half", args, threadgroups=3, threadgroup=64)
    np.testing.assert_allclose(out, x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


def test_simd_sum_with_a_partial_simdgroup(reduce):
    # 48 threads: SIMD-group 1 has 16 lanes.
    x = np.random.default_rng(1).standard_normal((4, 1000)).astype(np.float32)
    out = np.zeros(4, np.float32)
    reduce.run("row_sum_simd_float", [x, out, ("bytes", np.uint32(1000))], threadgroups=4, threadgroup=48)
    np.testing.assert_allclose(out, x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["linear", "reverse"])
@pytest.mark.parametrize("tg", [32, 100, 1024])
def test_barrier_orders_writes_before_reads(reduce, tg, order):
    # Thread i reads the slot thread i+1 wrote before the barrier: run one
    # after another, thread 0 would read poison (NaN) instead.
    n = 2 * tg + 7
    out = np.zeros(n, np.float32)
    reduce.run("neighbour_exchange", [out, ("threadgroup", (tg * 4 + 15) // 16 * 16)], grid=n, threadgroup=tg,
               order=order)
    gid = np.arange(n)
    start = gid - gid % tg
    size = np.minimum(tg, n - start)
    np.testing.assert_array_equal(out, (start + (gid - start + 1) % size) * 2.0 + 1.0)


@pytest.mark.parametrize("grid,tg,threadgroups", [(100, 48, None), (None, 64, 2), (33, 32, None)])
def test_simd_functions_match_reference(reduce, grid, tg, threadgroups):
    n = 40 if threadgroups else grid  # with full threadgroups, threads >= n return early (inactive lanes)
    groups = threadgroups or -(-grid // tg)
    total = groups * tg if threadgroups else grid
    x = np.random.default_rng(tg).uniform(0.01, 1.0, total).astype(np.float32)
    x[5] = -0.5  # simd_all false in the first SIMD-group
    out = np.full((total, 12), -999.0, np.float32)
    kwargs = {"threadgroups": threadgroups} if threadgroups else {"grid": grid}
    reduce.run("simd_functions", [x, out, ("bytes", np.uint32(n))], threadgroup=tg, **kwargs)
    ref = simd_reference(x, n, tg, groups)[:total]
    ran = np.arange(total) < n
    np.testing.assert_allclose(out[ran], ref[ran], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert np.all(out[~ran] == -999.0)


# ---------------------------------------------------------------------------
# half and bfloat.


def _special_floats() -> np.ndarray:
    specials = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan,
                1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 2.0**-24, 65504.0, 65519.0, 65520.0, 1e9,
                1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.4028235e38, -3.4028235e38, 1.17549435e-38, 1e-45, 0.1, 1 / 3]
    rng = np.random.default_rng(7)
    random = rng.standard_normal(2000) * np.exp(rng.uniform(-30, 30, 2000))
    return np.concatenate([np.array(specials), random]).astype(np.float32)


def test_half_conversions_round_to_nearest_even(convert):
    x = _special_floats()
    n = x.size
    h = np.zeros(n, np.float16)
    convert.run("float_to_half", [x, h, ("bytes", np.uint32(n))], grid=n, threadgroup=64)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    assert np.all(np.isnan(h[nan]))
    back = np.zeros(n, np.float32)
    convert.run("half_to_float", [h, back, ("bytes", np.uint32(n))], grid=n, threadgroup=64)
    np.testing.assert_array_equal(back[~nan], h.astype(np.float32)[~nan])
    assert np.all(np.isnan(back[nan]))


def test_bfloat_conversions_round_to_nearest_even(convert):
    x = _special_floats()
    n = x.size
    b = np.zeros(n, np.uint16)
    convert.run("float_to_bfloat", [x, b, ("bytes", np.uint32(n))], grid=n, threadgroup=64)
    nan = np.isnan(x)
    np.testing.assert_array_equal(b[~nan], bfloat16_bits(x)[~nan])
    assert np.all(np.isnan(bfloat16_to_float(b[nan])))
    np.testing.assert_array_equal(np.signbit(bfloat16_to_float(b[nan])), np.signbit(x[nan]))
    assert b[list(x).index(np.float32(1 + 2.0**-8))] == 0x3F80  # tie -> even (1.0)
    assert b[list(x).index(np.float32(3.4028235e38))] == 0x7F80  # FLT_MAX rounds to inf
    back = np.zeros(n, np.float32)
    convert.run("bfloat_to_float", [b, back, ("bytes", np.uint32(n))], grid=n, threadgroup=64)
    np.testing.assert_array_equal(back.view(np.uint32), b.astype(np.uint32) << 16)


def test_bfloat_matches_ml_dtypes(convert):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (installed with TensorFlow) is the bfloat16 reference")
    x = _special_floats()
    n = x.size
    b = np.zeros(n, np.uint16)
    convert.run("float_to_bfloat", [x, b, ("bytes", np.uint32(n))], grid=n, threadgroup=64)
    ref = x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(b[~nan], ref.view(np.uint16)[~nan])
    assert np.all(np.isnan(ref[nan].astype(np.float32)))


def test_half_and_bfloat_arithmetic_round_each_operation(convert):
    rng = np.random.default_rng(3)
    n = 1000
    a32 = rng.standard_normal(n).astype(np.float32) * 10
    b32 = rng.standard_normal(n).astype(np.float32)
    a, b = a32.astype(np.float16), b32.astype(np.float16)
    y = np.zeros(n, np.float16)
    convert.run("mul_add_half", [a, b, y, ("bytes", np.uint32(n))], grid=n, threadgroup=32)
    np.testing.assert_array_equal(y.view(np.uint16), (a * b + a).view(np.uint16))
    ab, bb = bfloat16_bits(a32), bfloat16_bits(b32)
    yb = np.zeros(n, np.uint16)
    convert.run("mul_add_bfloat", [ab, bb, yb, ("bytes", np.uint32(n))], grid=n, threadgroup=32)
    af, bf = bfloat16_to_float(ab), bfloat16_to_float(bb)
    np.testing.assert_array_equal(yb, bfloat16_bits(bfloat16_to_float(bfloat16_bits(af * bf)) + af))


# ---------------------------------------------------------------------------
# Faults: poison, divergence, limits, timeouts.


def test_uninitialized_threadgroup_memory_reads_nan(faults):
    out = np.zeros(128, np.float32)
    out_half = np.zeros(128, np.float16)
    faults.run("read_uninitialized", [out, out_half, ("threadgroup", 256)], grid=128, threadgroup=64)
    # Threadgroup 0 wrote its memory; threadgroup 1 starts from fresh (poisoned) memory.
    np.testing.assert_array_equal(out[:64], 1.0)
    np.testing.assert_array_equal(out_half[:64], 2.0)
    assert np.all(np.isnan(out[64:])) and np.all(np.isnan(out_half[64:]))


@pytest.mark.parametrize("kernel,args,match", [
    ("divergent_barrier", [], "must reach each threadgroup_barrier"),
    ("return_before_barrier", [("bytes", np.uint32(40))], "returned"),  # either order of events
    ("different_barriers", [], "different barriers"),
    ("divergent_simd", [], "different SIMD-group functions"),
    ("too_much_threadgroup_memory", [], "exceeds 32768 bytes"),
])
def test_divergence_and_limits_are_errors(faults, kernel, args, match):
    out = np.zeros(64, np.float32)
    with pytest.raises(emu.EmuError, match=match) as info:
        faults.run(kernel, [out] + args, threadgroups=1, threadgroup=64)
    assert "faults.metal:" in str(info.value) or "exceeds" in str(info.value)
    # The library stays usable after a failed dispatch.
    faults.run("simd_after_return", [out, ("bytes", np.uint32(40))], threadgroups=1, threadgroup=64)
    np.testing.assert_array_equal(out[:40], [32.0] * 32 + [8.0] * 8)


def test_timeout_is_an_error_not_a_hang(faults):
    counter = np.zeros(1, np.uint32)
    test_timeout_is_an_error_not_a_hang.keep = counter  # a late thread may still write it
    with pytest.raises(emu.EmuError, match="timed out"):
        faults.run("slow_thread", [counter, ("bytes", np.uint32(150_000_000))], grid=64, threadgroup=64, timeout=0.2)
    out = np.zeros(64, np.float32)
    faults.run("simd_after_return", [out, ("bytes", np.uint32(64))], grid=64, threadgroup=64)
    np.testing.assert_array_equal(out, 32.0)


def test_bad_arguments_are_errors(elementwise, reduce):
    x = np.zeros(64, np.float32)
    y = np.zeros(64, np.float32)
    p = ("bytes", affine_params(1.0, 0.0, 64))
    cases = [
        (dict(args=[x, y]), "takes 3 argument"),
        (dict(args=[x, y[::2], p]), "C-contiguous"),
        (dict(args=[x, np.zeros(64, np.float64), p]), "8-byte elements"),
        (dict(args=[x, y, ("bytes", np.zeros(2, np.float32))]), "bytes bound to a constant"),
        (dict(args=[x, y, ("bytes", np.zeros(2000, np.float32))]), "setBytes"),
        (dict(args=[x, y, ("bytes", 1.0)]), "no fixed type"),
        (dict(args=[x, y, p], threadgroup=2048), "maxTotalThreadsPerThreadgroup"),
        (dict(args=[x, y, p], grid=0), "must be >= 1"),
    ]
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    cases.append((dict(args=[x, readonly, p]), "read-only"))
    for kwargs, match in cases:
        kwargs = {"grid": 64, "threadgroup": 32, **kwargs}
        with pytest.raises(emu.EmuError, match=match):
            elementwise.run("affine_float", **kwargs)
    with pytest.raises(emu.EmuError, match="multiple of 16"):
        reduce.run("neighbour_exchange", [x, ("threadgroup", 100)], grid=25, threadgroup=25)
    with pytest.raises(emu.EmuError, match="no kernel 'nope'"):
        elementwise.run("nope", [], grid=1)


# ---------------------------------------------------------------------------
# Build: cache, compile errors, signature checks.


def test_build_cache_is_reused(tmp_path, convert):
    assert emu.build(KERNELS / "convert.metal") is convert
    compiles = emu.stats["kernel_compiles"]
    emu.clear_loaded()
    again = emu.build(KERNELS / "convert.metal")  # from the disk cache
    assert again.path == convert.path and emu.stats["kernel_compiles"] == compiles
    src = tmp_path / "tiny.metal"
    body = ('#include "tfmetal/portable.h"\n[[kernel]] void tiny(device float* y [[buffer(0)]], TFM_KERNEL_BUILTINS)'
            ' {{ y[gid.x] = {}; }}\nTFM_REGISTER_KERNEL(tiny)\n')
    src.write_text(body.format("1.0f"))
    first = emu.build(src)
    src.write_text(body.format("2.0f"))
    second = emu.build(src)
    assert emu.stats["kernel_compiles"] == compiles + 2 and first.path != second.path
    y = np.zeros(3, np.float32)
    second.run("tiny", [y], grid=3)
    np.testing.assert_array_equal(y, 2.0)


def test_compile_error_carries_the_compiler_message(tmp_path):
    bad = tmp_path / "bad_kernel.metal"
    bad.write_text('#include "tfmetal/portable.h"\n'
                   "[[kernel]] void broken(device float* x [[buffer(0)]], TFM_KERNEL_BUILTINS) { x[gid.x] = nope; }\n"
                   "TFM_REGISTER_KERNEL(broken)\n")
    with pytest.raises(emu.EmuCompileError, match=r"bad_kernel\.metal:2:.*nope"):
        emu.build(bad)


def test_kernel_without_builtins_is_rejected_at_compile_time(tmp_path):
    bad = tmp_path / "no_builtins.metal"
    bad.write_text('#include "tfmetal/portable.h"\n'
                   "[[kernel]] void k(device float* x [[buffer(0)]], uint3 gid [[thread_position_in_grid]]) {}\n"
                   "TFM_REGISTER_KERNEL(k)\n")
    with pytest.raises(emu.EmuCompileError, match="TFM_KERNEL_BUILTINS"):
        emu.build(bad)


def test_duplicate_host_names_are_rejected(tmp_path):
    bad = tmp_path / "dup.metal"
    bad.write_text('#include "tfmetal/portable.h"\n'
                   "template <typename T> [[kernel]] void k(device T* x [[buffer(0)]], TFM_KERNEL_BUILTINS) {}\n"
                   "TFM_INSTANTIATE_KERNEL(k_float, k<float>)\n"
                   "namespace other { TFM_INSTANTIATE_KERNEL(k_float, k<half>) }\n")
    with pytest.raises(emu.EmuCompileError, match="instantiated twice"):
        emu.build(bad)


def test_unsupported_threadgroup_declaration_is_rejected(tmp_path):
    bad = tmp_path / "tg_decl.metal"
    bad.write_text('#include "tfmetal/portable.h"\n'
                   "[[kernel]] void k(device float* x [[buffer(0)]], TFM_KERNEL_BUILTINS) {\n"
                   "  threadgroup float a[4], b[4];\n}\nTFM_REGISTER_KERNEL(k)\n")
    with pytest.raises(emu.EmuCompileError, match=r"tg_decl\.metal:3: unsupported threadgroup"):
        emu.build(bad)


# ---------------------------------------------------------------------------
# Include flattening and embedding (what the macOS build hands to Metal).


def test_flattener_inlines_each_include_once(tmp_path):
    metal = KERNELS / "elementwise.metal"
    flat = emu.flatten(metal)
    assert [p.name for p in flat.files] == ["elementwise.metal", "elementwise.h", "affine.h", "portable.h"]
    assert not re.search(r'^\s*#\s*include\s*"', flat.source, re.M)
    assert flat.source.count("#define TFMETAL_PORTABLE_H_") == 1
    assert '#line 1 "include/tfmetal/portable.h"' in flat.source  # relative: no build paths embedded
    assert "#include <metal_stdlib>" in flat.source  # Metal's own headers stay
    # The flattened text alone builds under the emulator and computes the same.
    copy = tmp_path / "flat_elementwise.metal"
    copy.write_text(flat.source)
    lib = emu.build(copy, include_dirs=[])
    x = np.arange(33, dtype=np.float32)
    y = np.zeros(33, np.float32)
    lib.run("affine_float", [x, y, ("bytes", affine_params(3.0, -1.0, 33))], grid=33, threadgroup=32)
    np.testing.assert_array_equal(y, np.float32(3.0) * x - np.float32(1.0))


def test_flattener_reports_missing_includes(tmp_path):
    bad = tmp_path / "missing.metal"
    bad.write_text('#include "tfmetal/portable.h"\n#include "no_such_header.h"\n')
    with pytest.raises(emu.FlattenError, match=r'missing\.metal:2: cannot find include "no_such_header\.h"'):
        emu.flatten(bad)
    with pytest.raises(emu.EmuCompileError, match="no_such_header.h"):
        emu.build(bad)


def test_embedded_header_holds_the_flattened_source(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to compile the generated header")
    metal = KERNELS / "reduce.metal"
    [header] = emu.embed.write_embedded_sources(tmp_path, [metal])
    assert header.name == "reduce_metal_source.h"
    main = tmp_path / "main.cc"
    main.write_text('#include <cstdio>\n#include "reduce_metal_source.h"\n'
                    "int main() { std::fputs(tfm_reduce_metal_source, stdout); "
                    "std::fputs(tfm_reduce_metal_source_name, stderr); }\n")
    exe = tmp_path / "main"
    subprocess.run(["g++", "-std=c++17", "-I", str(tmp_path), str(main), "-o", str(exe)], check=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    assert result.stdout == emu.flatten(metal, line_markers="relative").source
    assert result.stderr == "reduce"


# ---------------------------------------------------------------------------
# Every Metal kernel has an emulation test.


def test_every_metal_kernel_has_an_emulation_test():
    problems = emu.coverage_problems()
    assert not problems, "\n".join(problems)


def test_coverage_check_finds_untested_kernels(tmp_path):
    metal_dir, tests_dir = tmp_path / "metal", tmp_path / "tests"
    metal_dir.mkdir()
    tests_dir.mkdir()
    shutil.copy(KERNELS / "convert.metal", metal_dir / "convert.metal")
    [problem] = emu.coverage_problems(metal_dir, tests_dir)
    assert "no emulation test" in problem and "test_convert_metal_emu.py" in problem
    test = tests_dir / "test_convert_metal_emu.py"
    test.write_text('KERNELS = ["float_to_half", "half_to_float", "float_to_bfloat", "bfloat_to_float", "mul_add_half"]\n')
    [problem] = emu.coverage_problems(metal_dir, tests_dir)
    assert "mul_add_bfloat" in problem and "float_to_half" not in problem
    test.write_text(test.read_text() + 'KERNELS.append("mul_add_bfloat")\n')
    assert emu.coverage_problems(metal_dir, tests_dir) == []
