"""The activation-gradient Metal kernels (custom_ops/metal/activation_grad.metal) on the Metal emulator.

The gated kernels (gated_activation_grad_<dtype>, TfmetalExt>GatedActivationGrad) are checked the
same way, against the CPU kernel bit for bit and float64 numpy within the bounds derived in
tests/ops/test_gated_activation_grad.py.

Every instantiation -- activation_grad_float, activation_grad_half, activation_grad_bfloat -- is
dispatched the way activation_grad_metal.mm dispatches it (dispatchThreads, the helper's
threadgroup size, chunks bound at buffer offsets), for every activation code, and compared with
the CPU kernel bit for bit (same float math from tfmetal/activation_grad.h; the emulator's exp is
the C library's, as the CPU kernel's is; one round-to-nearest-even store per element) and with
float64 numpy within the bound derived in tests/ops/test_activation_grad.py.
"""

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.testing import assert_same_bits, compiled_ops, dispatch_chunks, load_emu, threadgroup_size_1d

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float": np.float32, "half": np.float16, "bfloat": ml_dtypes.bfloat16}
TF_DTYPE_NAME = {"float": "float32", "half": "float16", "bfloat": "bfloat16"}
KERNELS = {"float": "activation_grad_float", "half": "activation_grad_half", "bfloat": "activation_grad_bfloat"}
GATED_KERNELS = {"float": "gated_activation_grad_float", "half": "gated_activation_grad_half",
                 "bfloat": "gated_activation_grad_bfloat"}
ACTIVATIONS = list(fusion.ACTIVATION_GRAD_ACTIVATIONS)  # index = the TFM_ACTGRAD_* code
SIZES = [1, 33, 1000]
PARAMS = np.dtype([("n", "<u4"), ("activation", "<i4")])  # tfm_activation_grad_params

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


def _load_gated_tests():
    # The derived tolerances live once, in the CPU test files (loaded by path: tests/ is no package);
    # the gated op's file loads the plain op's as its `A`.
    spec = importlib.util.spec_from_file_location("gated_activation_grad_op_tests", Path(__file__).with_name(
        "test_gated_activation_grad.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gated_tests = _load_gated_tests()
op_tests = gated_tests.A


@pytest.fixture(scope="module")
def lib():
    return emu.build(ROOT / "custom_ops" / "metal" / "activation_grad.metal")


@pytest.fixture(scope="module")
def cpu():
    return compiled_ops()


def metal_grad(lib, dtype, dy, x, activation, chunk=None):
    """activation_grad_metal.mm's dispatch over the flat buffers."""
    dy, x = np.ascontiguousarray(dy).ravel(), np.ascontiguousarray(x).ravel()
    dx = np.full_like(x, np.nan)
    code = ACTIVATIONS.index(activation)
    for start, count in dispatch_chunks(x.size, chunk):
        params = np.array((count, code), PARAMS)
        lib.run(KERNELS[dtype], [dy[start:start + count], x[start:start + count], dx[start:start + count],
                                 ("bytes", params)], grid=count, threadgroup=threadgroup_size_1d(count))
    return dx


def cpu_grad(cpu, dy, x, activation):
    return cpu.tfmetal_ext_activation_grad(tf.constant(dy), tf.constant(x), activation=activation).numpy()


def random_input(dtype, n, seed):
    """x: normal * 3 plus the special values (+-0, the derivatives' roots, tails, saturation, NaN, +-inf)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 3.0, n).astype(np.float32)
    special = np.array([0.0, -0.0, -2.3994, -0.7518, -100.0, 50.0, -50.0, 200.0, np.nan, np.inf, -np.inf],
                       np.float32)
    k = min(n, special.size)
    x[rng.choice(n, k, replace=False)] = special[:k]
    dy = rng.normal(0.0, 1.0, n).astype(np.float32)
    return dy.astype(DTYPES[dtype]), x.astype(DTYPES[dtype])




# ----------------------------------------------------------------------------
# Tests


def test_library_instantiates_every_dtype(lib):
    assert lib.kernels() == sorted(list(KERNELS.values()) + list(GATED_KERNELS.values()))
    for name in KERNELS.values():
        assert [p.kind for p in lib.params(name)] == ["pointer", "pointer", "pointer", "reference"]
        assert [p.const for p in lib.params(name)] == [True, True, False, False]
        assert lib.params(name)[3].size == PARAMS.itemsize
    for name in GATED_KERNELS.values():
        assert [p.kind for p in lib.params(name)] == ["pointer"] * 5 + ["reference"]
        assert [p.const for p in lib.params(name)] == [True, True, True, False, False, False]
        assert lib.params(name)[5].size == PARAMS.itemsize


def metal_gated(lib, dtype, dy, gate, up, activation, chunk=None):
    """activation_grad_metal.mm's dispatch of the gated kernel over the flat buffers."""
    dy, gate, up = (np.ascontiguousarray(t).ravel() for t in (dy, gate, up))
    d_gate, d_up = np.full_like(gate, np.nan), np.full_like(gate, np.nan)
    code = ACTIVATIONS.index(activation)
    for start, count in dispatch_chunks(gate.size, chunk):
        part = slice(start, start + count)
        lib.run(GATED_KERNELS[dtype], [dy[part], gate[part], up[part], d_gate[part], d_up[part],
                                       ("bytes", np.array((count, code), PARAMS))],
                grid=count, threadgroup=threadgroup_size_1d(count))
    return d_gate, d_up


def gated_input(dtype, n, seed):
    dy, gate = random_input(dtype, n, seed)
    up = np.random.default_rng(seed + 1).normal(0.0, 2.0, n).astype(np.float32).astype(DTYPES[dtype])
    up[: min(n, 2)] = [np.inf, -0.0][: min(n, 2)]
    return dy, gate, up


@pytest.mark.cover_axes("dtype", "activation")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gated_matches_cpu_kernel_bit_for_bit_and_numpy(lib, cpu, dtype, activation, n):
    dy, gate, up = gated_input(dtype, n, seed=n + 5 * ACTIVATIONS.index(activation))
    got = metal_gated(lib, dtype, dy, gate, up, activation)
    want_cpu = cpu.tfmetal_ext_gated_activation_grad(*(tf.constant(t) for t in (dy, gate, up)), activation=activation)
    for g, c in zip(got, want_cpu):
        assert_same_bits(g, c.numpy())
    want = gated_tests.np_gated(dy, gate, up, activation)
    for g, w, tol in zip(got, want, gated_tests.tolerances(dy, gate, up, want, activation, TF_DTYPE_NAME[dtype])):
        op_tests.assert_close(g, w, tol)


def test_gated_outputs_may_alias_dy_and_up(lib):
    # The host forwards dy's buffer to d_gate and up's to d_up when TF allows it.
    dy, gate, up = gated_input("float", 1000, seed=4)
    want = metal_gated(lib, "float", dy, gate, up, "silu")
    a, b = dy.copy(), up.copy()
    lib.run(GATED_KERNELS["float"], [a, gate, b, a, b, ("bytes", np.array((gate.size, 0), PARAMS))], grid=gate.size,
            threadgroup=threadgroup_size_1d(gate.size))
    assert_same_bits(a, want[0])
    assert_same_bits(b, want[1])


def test_gated_chunks_and_threads_past_the_end(lib):
    dy, gate, up = gated_input("bfloat", 5003, seed=12)
    for g, w in zip(metal_gated(lib, "bfloat", dy, gate, up, "gelu", chunk=1000),
                    metal_gated(lib, "bfloat", dy, gate, up, "gelu")):
        assert_same_bits(g, w)
    n, extra = 33, 31
    dy, gate, up = gated_input("float", n + extra, seed=6)
    outs = [np.full(n + extra, 9, np.float32) for _ in range(2)]
    lib.run(GATED_KERNELS["float"], [dy, gate, up, *outs, ("bytes", np.array((n, 2), PARAMS))], threadgroups=2,
            threadgroup=32)
    for out in outs:
        np.testing.assert_array_equal(out[n:], 9.0)


@pytest.mark.cover_axes("dtype", "activation")  # each instantiation and each activation code: different code paths
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_cpu_kernel_bit_for_bit_and_numpy(lib, cpu, dtype, activation, n):
    dy, x = random_input(dtype, n, seed=n + 7 * ACTIVATIONS.index(activation))
    got = metal_grad(lib, dtype, dy, x, activation)
    assert_same_bits(got, cpu_grad(cpu, dy, x, activation))
    want = testing.np_smooth_activation_grad(dy.astype(np.float64), x.astype(np.float64), activation)
    op_tests.assert_close(got, want, op_tests.tolerance(dy, x, want, activation, TF_DTYPE_NAME[dtype]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_infinities(lib, dtype):
    np_dtype = DTYPES[dtype]
    x = np.array([np.nan, 1.0, np.inf, -np.inf, np.inf, -np.inf], np.float32).astype(np_dtype)
    dy = np.array([1.0, np.nan, 3.0, 3.0, np.inf, np.inf], np.float32).astype(np_dtype)
    for activation in ACTIVATIONS:
        got = metal_grad(lib, dtype, dy, x, activation).astype(np.float32)
        assert np.isnan(got[:2]).all() and got[2] == 3.0 and got[3] == 0.0, (activation, got)
        assert got[4] == np.inf and np.isnan(got[5]), (activation, got)


def test_output_may_alias_dy(lib):
    # The host forwards dy's buffer to dx when TF allows it.
    dy, x = random_input("half", 1000, seed=3)
    want = metal_grad(lib, "half", dy, x, "gelu_approximate")
    inplace = dy.copy()
    lib.run(KERNELS["half"], [inplace, x, inplace, ("bytes", np.array((x.size, 2), PARAMS))], grid=x.size,
            threadgroup=threadgroup_size_1d(x.size))
    assert_same_bits(inplace, want)


def test_chunks_at_buffer_offsets_cover_every_element_once(lib):
    dy, x = random_input("bfloat", 5003, seed=11)
    assert_same_bits(metal_grad(lib, "bfloat", dy, x, "silu", chunk=1000), metal_grad(lib, "bfloat", dy, x, "silu"))


def test_threads_past_the_end_write_nothing(lib):
    # With dispatchThreadgroups every threadgroup is full: the 31 threads past n = 33 must not
    # touch the sentinel elements after the tensor's end.
    n, extra = 33, 31
    dy, x = random_input("float", n + extra, seed=5)
    out = np.full(n + extra, 9, np.float32)
    lib.run(KERNELS["float"], [dy, x, out, ("bytes", np.array((n, 1), PARAMS))], threadgroups=2, threadgroup=32)
    np.testing.assert_array_equal(out[n:], 9.0)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`): the real kernels through tensorflow-metal.


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_kernels_match_the_cpu_kernels_bit_for_bit(cpu, dtype):
    dy, x = random_input(dtype, 100003, seed=17)
    for activation in ACTIVATIONS:
        with tf.device("/GPU:0"):
            dx = cpu.tfmetal_ext_activation_grad(tf.constant(dy), tf.constant(x), activation=activation)
        assert "GPU" in dx.device
        assert_same_bits(dx.numpy(), cpu_grad(cpu, dy, x, activation))


@pytest.mark.metal
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_gated_kernels_match_the_cpu_kernels_bit_for_bit(cpu, dtype):
    dy, gate, up = gated_input(dtype, 100003, seed=19)
    args = [tf.constant(t) for t in (dy, gate, up)]
    for activation in ACTIVATIONS:
        with tf.device("/GPU:0"):
            got = cpu.tfmetal_ext_gated_activation_grad(*args, activation=activation)
        assert all("GPU" in t.device for t in got)
        want = cpu.tfmetal_ext_gated_activation_grad(*args, activation=activation)
        for g, w in zip(got, want):
            assert_same_bits(g.numpy(), w.numpy())
