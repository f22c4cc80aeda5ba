"""The activation-gradient Metal kernels (custom_ops/metal/activation_grad.metal) on the Metal emulator.

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
ACTIVATIONS = list(fusion.ACTIVATION_GRAD_ACTIVATIONS)  # index = the TFM_ACTGRAD_* code
SIZES = [1, 33, 1000]
PARAMS = np.dtype([("n", "<u4"), ("activation", "<i4")])  # tfm_activation_grad_params

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


def _load_op_tests():
    # The derived tolerance lives once, in the CPU test file (loaded by path: tests/ is no package).
    spec = importlib.util.spec_from_file_location("activation_grad_op_tests", Path(__file__).with_name(
        "test_activation_grad.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


op_tests = _load_op_tests()


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
    assert lib.kernels() == sorted(KERNELS.values())
    for name in KERNELS.values():
        assert [p.kind for p in lib.params(name)] == ["pointer", "pointer", "pointer", "reference"]
        assert [p.const for p in lib.params(name)] == [True, True, False, False]
        assert lib.params(name)[3].size == PARAMS.itemsize


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
