"""gemv (TfmetalExt>Gemv): the CPU kernel bit for bit against an exact model of its summation
order (fused multiply-adds in increasing k, computed with rationals), against float64 numpy and
TF's MatMul within a derived bound, every dtype; gradients; errors; empty and non-finite inputs;
the vector levels; the layers' use of it for a decoding step."""

import dataclasses
import fractions
import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import ops
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import FusedDense, FusedEinsumDense

from tests.ops._cpu_levels import run_at_level

gemv_module = importlib.import_module("tfmetal_ext.ops.gemv")

U32 = 2.0 ** -24  # float32 unit roundoff
DTYPES = {"float32": (tf.float32, U32), "float16": (tf.float16, 2.0 ** -11), "bfloat16": (tf.bfloat16, 2.0 ** -8)}


def lib():
    if not gemv_module.uses_kernel():
        pytest.skip("the op library is not loaded here (TFMETAL_EXT_REFERENCE_OPS or no compiler)")
    return ops._common.library()


def raw(x, kernel, bias=None):
    """The op itself, without the wrapper's checks."""
    has_bias = bias is not None
    b = bias if has_bias else tf.zeros([0], x.dtype)
    return lib().tfmetal_ext_gemv(x, kernel, b, has_bias=has_bias)


def operands(rng, m, k, n, dtype, bias=True, scale=1.0):
    x = tf.cast(tf.constant(rng.normal(size=(m, k)) * scale, tf.float32), dtype)
    w = tf.cast(tf.constant(rng.normal(size=(k, n)) * scale, tf.float32), dtype)
    b = tf.cast(tf.constant(rng.normal(size=(n,)), tf.float32), dtype) if bias else None
    return x, w, b


def f64(t):
    return tf.cast(t, tf.float64).numpy()


# ----------------------------------------------------------------------------- exact model


def round_to_float32(q):
    """The float32 nearest to the rational `q`, ties to even (IEEE round to nearest)."""
    guess = np.float32(float(q))  # within an ulp or two of the answer (two roundings)
    best = None
    for c in (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))):
        if not np.isfinite(c):
            continue
        d = abs(fractions.Fraction(float(c)) - q)
        even = int(c.view(np.uint32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    return best[1]


def exact_fma_model(x, w, b):
    """tfmetal/gemv.h's result from its definition: per output, +0.0 then fma(x_k, w_k, acc) for
    k in increasing order, each fma the exact x_k w_k + acc rounded once to float32; then the bias
    added with one rounding. Rationals, so nothing here rounds but the steps the header names."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    m, k = x.shape
    n = w.shape[1]
    y = np.zeros((m, n), np.float32)
    for r in range(m):
        for c in range(n):
            acc = np.float32(0.0)
            for kk in range(k):
                acc = round_to_float32(fractions.Fraction(float(x[r, kk])) * fractions.Fraction(float(w[kk, c]))
                                       + fractions.Fraction(float(acc)))
            if b is not None:
                acc = round_to_float32(fractions.Fraction(float(acc)) + fractions.Fraction(float(b[c])))
            y[r, c] = acc
    return y


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (1, 37, 19), (3, 20, 70), (2, 64, 129)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_float32_is_the_exact_fma_chain_bit_for_bit(m, k, n, bias):
    """Every output is the header's chain of fused multiply-adds: vector lanes, the tile GEMM's
    register blocks and the panels' column tails all round as the model does."""
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    x, w, b = operands(rng, m, k, n, tf.float32, bias)
    got = raw(x, w, b).numpy()
    want = exact_fma_model(x.numpy(), w.numpy(), None if b is None else b.numpy())
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def sum_bound(x, w, b, u_out):
    """|result - exact| for a float32 chain of K fused multiply-adds, the bias, the rounding to T.

    Derivation (u = 2^-24): each fma rounds once, acc_k = (acc_{k-1} + x_k w_k)(1 + d_k), so the
    sum of K steps is within gamma_K = K u / (1 - K u) of the exact sum times sum_k |x_k w_k|
    (Higham, Accuracy and Stability, 3.1); the bias addition is one more rounding: gamma_{K+1}
    times (sum |x_k w_k| + |b|). The inputs of half/bfloat16 widen to float32 exactly. The store
    rounds to T: u_out times the result's magnitude (that of the exact result plus the bound, to
    first order the exact one's; doubled for the second-order terms), plus half T's smallest
    subnormal spacing for results in T's subnormal range.
    """
    x, w = f64(x), f64(w)
    k = x.shape[1]
    mag = np.abs(x) @ np.abs(w) + (np.abs(f64(b)) if b is not None else 0.0)
    g = (k + 1) * U32 / (1 - (k + 1) * U32)
    exact = x @ w + (f64(b) if b is not None else 0.0)
    tiny = {U32: 2.0 ** -150, 2.0 ** -11: 2.0 ** -25, 2.0 ** -8: 2.0 ** -134}[u_out]
    return g * mag + 2 * u_out * (np.abs(exact) + g * mag) + tiny, exact


@pytest.mark.cover_axes("dtype_name")  # each a kernel instantiation
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("m, k, n", [(1, 256, 256), (4, 300, 1000), (8, 7, 3), (1, 1024, 64)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernels_against_float64_numpy(m, k, n, dtype_name, bias):
    dtype, u = DTYPES[dtype_name]
    x, w, b = operands(np.random.default_rng(k + n), m, k, n, dtype, bias)
    got = f64(raw(x, w, b))
    bound, exact = sum_bound(x, w, b, u)
    assert got.shape == (m, n)
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


@pytest.mark.parametrize("m, k, n", [(1, 256, 512), (5, 512, 256)])
def test_float32_against_tensorflows_matmul(m, k, n):
    """TF's MatMul + BiasAdd sums in another order: both within the bound of the exact result."""
    x, w, b = operands(np.random.default_rng(7), m, k, n, tf.float32, True)
    ours, stock = f64(raw(x, w, b)), f64(tf.nn.bias_add(tf.linalg.matmul(x, w), b))
    bound, exact = sum_bound(x, w, b, U32)
    assert np.all(np.abs(ours - exact) <= bound)
    assert np.all(np.abs(stock - exact) <= bound)
    assert np.all(np.abs(ours - stock) <= 2 * bound)


def test_wrapper_any_rank_and_unknown_shapes():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 1, 3, 16)), tf.float32)
    w = tf.constant(rng.normal(size=(16, 5)), tf.float32)
    b = tf.constant(rng.normal(size=(5,)), tf.float32)
    want = np.einsum("abcd,de->abce", x.numpy().astype(np.float64), w.numpy().astype(np.float64)) + b.numpy()
    np.testing.assert_allclose(ops.gemv(x, w, b).numpy(), want, rtol=1e-5, atol=1e-5)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 16], tf.float32), tf.TensorSpec([16, None], tf.float32)])
    def f(x, w):
        return ops.gemv(x, w)

    y = f(x[:, 0], w)
    assert y.shape == (2, 3, 5)
    np.testing.assert_allclose(y.numpy(), want[:, 0] - b.numpy(), rtol=1e-5, atol=1e-5)


def test_empty_operands():
    lib()
    for m, k, n in ((0, 4, 3), (2, 4, 0), (2, 0, 3)):
        x = tf.zeros([m, k])
        w = tf.ones([k, n])
        b = tf.fill([n], 1.5)
        y = raw(x, w, b).numpy()
        assert y.shape == (m, n)
        np.testing.assert_array_equal(y, np.full((m, n), 1.5, np.float32))  # K = 0: the bias alone
        assert np.all(raw(x, w).numpy().view(np.uint32) == 0)  # +0.0, as the header starts the sum


def test_nan_and_infinities_propagate_as_in_matmul():
    x = tf.constant([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0], [np.inf, 0.0, 1.0]])
    w = tf.constant([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]])
    got = raw(x, w).numpy()
    stock = tf.linalg.matmul(x, w).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(stock))
    np.testing.assert_array_equal(got[~np.isnan(got)], stock[~np.isnan(stock)])
    w_inf = tf.constant([[np.inf], [-np.inf], [0.0]])
    assert np.isnan(raw(tf.constant([[1.0, 1.0, 1.0]]), w_inf).numpy()[0, 0])  # inf - inf


@pytest.mark.parametrize("x_shape, w_shape, b_shape, has_bias, match", [
    ((2, 3, 1), (3, 4), (0,), False, "x must be a matrix"),
    ((2, 3), (3,), (0,), False, "kernel must be a matrix"),
    ((2, 3), (4, 5), (0,), False, "must match kernel's first dimension"),
    ((2, 3), (3, 5), (4,), True, "bias must be a vector"),
    ((2, 3), (3, 5), (5,), False, "bias must have shape \\[0\\]"),
])
def test_kernel_errors_are_invalid_argument(x_shape, w_shape, b_shape, has_bias, match):
    lib()

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)] * 3)
    def f(x, w, b):  # unknown ranks: the shape function passes, the kernel checks
        return lib().tfmetal_ext_gemv(x, w, b, has_bias=has_bias)

    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        f(tf.zeros(x_shape), tf.zeros(w_shape), tf.zeros(b_shape))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
        lib().tfmetal_ext_gemv(tf.zeros(x_shape), tf.zeros(w_shape), tf.zeros(b_shape), has_bias=has_bias)


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=tf.zeros([2, 3], tf.int32), kernel=tf.zeros([3, 4], tf.int32)), "x.dtype=int32"),
    (dict(x=tf.zeros([3]), kernel=tf.zeros([3, 4])), "x.shape=\\(3,\\)"),
    (dict(x=tf.zeros([2, 3]), kernel=tf.zeros([3, 4], tf.float16)), "kernel.dtype=float16"),
    (dict(x=tf.zeros([2, 3]), kernel=tf.zeros([3, 4, 1])), "kernel.shape=\\(3, 4, 1\\)"),
    (dict(x=tf.zeros([2, 3]), kernel=tf.zeros([5, 4])), "Received: x.shape=\\(2, 3\\), kernel.shape"),
    (dict(x=tf.zeros([2, 3]), kernel=tf.zeros([3, 4]), bias=tf.zeros([3])), "bias.shape=\\(3,\\)"),
    (dict(x=tf.zeros([2, 3]), kernel=tf.zeros([3, 4]), bias=tf.zeros([4], tf.float16)), "bias.dtype=float16"),
])
def test_wrapper_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.gemv(**kwargs)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gradients_are_matmuls(dtype_name):
    dtype, u = DTYPES[dtype_name]
    x, w, b = operands(np.random.default_rng(5), 3, 40, 24, dtype, True)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, w, b])
        ours = tf.reduce_sum(tf.cast(ops.gemv(x, w, b), tf.float32) ** 2)
        stock = tf.reduce_sum(tf.cast(tf.nn.bias_add(tf.linalg.matmul(x, w), b), tf.float32) ** 2)
    for a, c in zip(tape.gradient(ours, [x, w, b]), tape.gradient(stock, [x, w, b])):
        # The upstream 2y differs by the forward results' difference (within sum_bound); the
        # gradient products then sum it in T: a relative tolerance of a few of T's roundoffs.
        np.testing.assert_allclose(f64(a), f64(c), rtol=64 * u, atol=64 * u * np.max(np.abs(f64(c))))
    if dtype == tf.float32:
        theoretical, numerical = tf.test.compute_gradient(lambda x, w, b: ops.gemv(x, w, b),
                                                          [x[:, :6] * 0.1, w[:6, :5], b[:5]], delta=1e-3)
        for t, n in zip(theoretical, numerical):
            np.testing.assert_allclose(t, n, atol=2e-3)


def test_one_op_forward_and_two_matmuls_backward():
    lib()
    x, w, b = operands(np.random.default_rng(2), 1, 16, 8, tf.float32, True)

    @tf.function
    def step(x, w, b):
        with tf.GradientTape() as tape:
            tape.watch([w, b])
            y = ops.gemv(x, w, b)
        return tape.gradient(y, [w, b])

    graph = step.get_concrete_function(x, w, b).graph
    types = [op.type for op in graph.get_operations()]
    assert types.count(fusion.GEMV_OP) == 1
    assert "BiasAdd" not in types


def test_avoided_runs_matmul_and_bias_add():
    lib()
    x, w, b = operands(np.random.default_rng(3), 2, 16, 8, tf.float32, True)
    kernel_result = raw(x, w, b).numpy()
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["gemv"])
        assert not gemv_module.uses_kernel()
        graph = tf.function(ops.gemv).get_concrete_function(x, w, b).graph
        types = {op.type for op in graph.get_operations()}
        assert fusion.GEMV_OP not in types and {"MatMul", "BiasAdd"} <= types
        np.testing.assert_allclose(ops.gemv(x, w, b).numpy(), kernel_result, rtol=1e-5, atol=1e-6)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=[])


_LEVEL_SCRIPT = """
import sys
import numpy as np, tensorflow as tf
from tfmetal_ext.ops import _common
lib = _common.library()
rng = np.random.default_rng(11)
out = []
for dtype in (tf.float32, tf.float16, tf.bfloat16):
    for m, k, n in ((1, 256, 1000), (3, 77, 65), (8, 512, 300)):
        x = tf.cast(tf.constant(rng.normal(size=(m, k)), tf.float32), dtype)
        w = tf.cast(tf.constant(rng.normal(size=(k, n)), tf.float32), dtype)
        b = tf.cast(tf.constant(rng.normal(size=(n,)), tf.float32), dtype)
        for has_bias in (False, True):
            y = lib.tfmetal_ext_gemv(x, w, b if has_bias else tf.zeros([0], dtype), has_bias=has_bias)
            out.append(tf.cast(y, tf.float32).numpy())
np.savez(sys.argv[1], *out)
"""


@pytest.mark.slow
def test_cpu_levels_give_the_same_bits(tmp_path):
    """The baseline loop (arm64's), AVX2 and AVX-512 all make the header's fma chain: the same bits,
    in fresh processes at each level this machine has (a level above it runs the highest it has)."""
    lib()
    results = {}
    for level in ("baseline", "avx2", "avx512"):
        path = tmp_path / f"{level}.npz"
        run_at_level(_LEVEL_SCRIPT, level, path)
        results[level] = np.load(path)
    base = results["baseline"]
    assert len(base.files) == 18
    for level in ("avx2", "avx512"):
        for key in base.files:
            np.testing.assert_array_equal(base[key].view(np.uint32), results[level][key].view(np.uint32),
                                          err_msg=f"{level} {key}")


# ----------------------------------------------------------------------------- the layers


def _op_types(fn, *args):
    return [op.type for op in tf.function(fn).get_concrete_function(*args).graph.get_operations()]


@pytest.mark.parametrize("shape, routed", [
    ((1, 1, 32), True), ((fusion.GEMV_MAX_ROWS, 1, 32), True), ((fusion.GEMV_MAX_ROWS + 1, 1, 32), False),
    ((2, 3, 32), False), ((4, 32), False),
    ((2, 1, 1, 32), True),
])
def test_fused_dense_runs_gemv_for_a_decoding_steps_rows(shape, routed):
    lib()
    keras.utils.set_random_seed(0)
    layer = FusedDense(24, activation="relu")
    stock = keras.layers.Dense(24, activation="relu")
    x = tf.constant(np.random.default_rng(0).normal(size=shape), tf.float32)
    layer.build(x.shape)
    stock.build(x.shape)
    stock.set_weights([layer.kernel.numpy(), np.random.default_rng(1).normal(size=24).astype("float32")])
    layer.set_weights(stock.get_weights())
    types = _op_types(lambda x: layer(x), x)
    assert (fusion.GEMV_OP in types) == routed
    assert ("MatMul" in types) == (not routed)
    np.testing.assert_allclose(layer(x).numpy(), stock(x).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, out_shape, bias_axes, x_shape", [
    ("btd,dnh->btnh", (None, 4, 8), "nh", (2, 1, 16)),     # a query projection
    ("btnh,nhd->btd", (None, 16), "d", (3, 1, 4, 8)),      # an attention output projection
    ("btd,df->btf", (None, 24), None, (1, 1, 16)),          # a feed-forward, no bias
    ("abc,cd->abd", (1, 24), "bd", (2, 1, 16)),             # a bias over an input-side axis: no gemv
])
def test_fused_einsum_dense_runs_gemv_for_a_decoding_steps_rows(equation, out_shape, bias_axes, x_shape):
    lib()
    keras.utils.set_random_seed(0)
    stock = keras.layers.EinsumDense(equation, output_shape=out_shape, bias_axes=bias_axes,
                                     bias_initializer="random_normal")
    layer = FusedEinsumDense(equation, output_shape=out_shape, bias_axes=bias_axes)
    x = tf.constant(np.random.default_rng(0).normal(size=x_shape), tf.float32)
    stock.build(x.shape)
    layer.build(x.shape)
    layer.set_weights(stock.get_weights())
    types = _op_types(lambda x: layer(x), x)
    routed = bias_axes != "bd"
    assert (fusion.GEMV_OP in types) == routed
    assert "Einsum" not in types
    np.testing.assert_allclose(layer(x).numpy(), stock(x).numpy(), rtol=1e-5, atol=1e-5)
    # A longer sequence keeps the MatMul (and its remapper pattern).
    longer = tf.concat([x, x], axis=1)
    assert fusion.GEMV_OP not in _op_types(lambda x: layer(x), longer)


@pytest.mark.parametrize("backend, plugin", [("metal", None), ("metal", "tensorflow-metal-plugin")])
def test_the_layers_follow_the_backend_table(backend, plugin):
    """The choice is the table's row fusion.GEMV_PATTERN: both Metal backends' rows keep MatMul (the
    kernel's speed there is unmeasured), with the reason; the CPU tables take the op."""
    lib()
    from tfmetal_ext import _env, backends, devices

    layer = FusedDense(8)
    x = tf.constant(np.random.default_rng(8).normal(size=(2, 1, 16)), tf.float32)
    layer.build(x.shape)
    caps = dataclasses.replace(devices.capabilities(), backend=backend, metal_plugin=plugin)
    with _env.scope(pinned_capabilities=caps):
        row = backends.current().fusion(fusion.GEMV_PATTERN)
        assert not row.dtypes and row.why_not == fusion.GEMV_METAL_UNMEASURED
        types = _op_types(lambda x: layer(x), x)
        assert fusion.GEMV_OP not in types and "MatMul" in types
    for key in ("cpu", "cpu_onednn"):
        assert "float32" in backends.table(key).fusion(fusion.GEMV_PATTERN).dtypes


def test_xla_keeps_matmul():
    """The op has no XLA kernel: under jit_compile the wrapper and the layers emit MatMul (+ BiasAdd)."""
    layer = FusedDense(8)
    x = tf.constant(np.random.default_rng(6).normal(size=(2, 1, 16)), tf.float32)
    layer.build(x.shape)
    w = tf.constant(np.random.default_rng(7).normal(size=(16, 8)), tf.float32)
    f = tf.function(lambda x: (layer(x), ops.gemv(x, w)), jit_compile=True)
    got_layer, got_op = f(x)
    np.testing.assert_allclose(got_layer.numpy(), layer(x).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_op.numpy(), np.einsum("btd,dn->btn", x.numpy(), w.numpy()), rtol=1e-5, atol=1e-5)


def test_layers_under_mixed_precision_and_lora_gradients():
    """Under mixed_float16 the kernel is cast to float16 as stock casts it; LoRA's adapters get the
    gradients through the op, and a frozen kernel none."""
    lib()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = FusedEinsumDense("btd,dnh->btnh", output_shape=(None, 2, 8), bias_axes="nh")
        stock = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 2, 8), bias_axes="nh")
        x = tf.constant(np.random.default_rng(4).normal(size=(2, 1, 16)), tf.float16)
        layer.build(x.shape)
        stock.build(x.shape)
        stock.set_weights(layer.get_weights())
        y = layer(x)
        assert y.dtype == tf.float16
        assert fusion.GEMV_OP in _op_types(lambda x: layer(x), x)
        # float16 results: the two sums round to half within a few half roundoffs of the magnitude.
        np.testing.assert_allclose(f64(y), f64(stock(x)), rtol=4 * 2.0 ** -11, atol=4 * 2.0 ** -11 * 8)
        layer.enable_lora(2)
        layer.lora_kernel_b.assign(tf.random.normal(layer.lora_kernel_b.shape))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        grads = tape.gradient(loss, layer.trainable_variables)
        names = [v.path.split("/")[-1] for v in layer.trainable_variables]
        assert "kernel" not in names and {"lora_kernel_a", "lora_kernel_b"} <= set(names)
        assert all(g is not None and np.any(g.numpy() != 0) for g in grads)
    finally:
        keras.mixed_precision.set_global_policy("float32")
