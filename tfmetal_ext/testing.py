"""Test helpers for layers built on tfmetal_ext (used by this package's own suite too)."""

from __future__ import annotations

import os
import tempfile

import numpy as np


def run_layer_test(
    layer_cls,
    init_kwargs,
    input_shape,
    *,
    expected_output_shape,
    expected_num_trainable_weights,
    expected_num_non_trainable_weights=0,
    seed=0,
    check_mixed_float16=True,
):
    """Keras-style checks of one layer configuration.

    Checks: `get_config`/`from_config` round trip; symbolic call output shape
    (and `compute_output_shape`); eager call output shape; weight counts; a
    `.keras` save/load of a model holding the layer gives identical outputs;
    one `model.fit` step runs and changes the trainable weights; under
    ``mixed_float16`` outputs are float16 and weights float32.

    Args:
        layer_cls: the layer class.
        init_kwargs: constructor arguments.
        input_shape: full input shape including the batch dimension.
        expected_output_shape: full output shape including the batch dimension.
        expected_num_trainable_weights: count of trainable weights.
        expected_num_non_trainable_weights: count of non-trainable weights.

    Returns:
        The built layer of the float32 run.

    Raises:
        AssertionError: on the first check that fails.
    """
    import keras

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(input_shape).astype("float32")
    expected_output_shape = tuple(expected_output_shape)

    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    clone = layer_cls.from_config(config)
    assert clone.get_config() == config, f"from_config(get_config()) differs:\n{config}\n{clone.get_config()}"

    # Symbolic call.
    sym_in = keras.Input(batch_shape=input_shape)
    sym_out = layer(sym_in)
    assert tuple(sym_out.shape) == expected_output_shape, f"symbolic shape {sym_out.shape} != {expected_output_shape}"
    assert tuple(layer.compute_output_shape(input_shape)) == expected_output_shape
    assert len(layer.trainable_weights) == expected_num_trainable_weights, (
        f"trainable weights: {len(layer.trainable_weights)} != {expected_num_trainable_weights}"
    )
    assert len(layer.non_trainable_weights) == expected_num_non_trainable_weights, (
        f"non-trainable weights: {len(layer.non_trainable_weights)} != {expected_num_non_trainable_weights}"
    )

    # Eager call.
    eager = layer_cls(**init_kwargs)
    out = eager(x)
    assert tuple(out.shape) == expected_output_shape, f"eager shape {out.shape} != {expected_output_shape}"

    # Save / load.
    model = keras.Model(sym_in, sym_out)
    ref = keras.ops.convert_to_numpy(model(x, training=False))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layer.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    got = keras.ops.convert_to_numpy(loaded(x, training=False))
    np.testing.assert_array_equal(ref, got, err_msg="outputs differ after .keras save/load")
    assert type(loaded.layers[-1]) is layer_cls

    # One training step.
    if expected_num_trainable_weights:
        before = [w.numpy().copy() for w in model.trainable_weights]
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        y = rng.standard_normal(expected_output_shape).astype("float32")
        model.fit(x, y, batch_size=input_shape[0], epochs=1, verbose=0)
        after = [w.numpy() for w in model.trainable_weights]
        assert any(not np.array_equal(a, b) for a, b in zip(before, after)), "fit did not change any weight"

    # Mixed precision.
    if check_mixed_float16:
        layer16 = layer_cls(**dict(init_kwargs, dtype="mixed_float16"))
        out16 = layer16(x)
        assert keras.backend.standardize_dtype(out16.dtype) == "float16", f"mixed_float16 output is {out16.dtype}"
        for w in layer16.weights:
            assert keras.backend.standardize_dtype(w.dtype) == "float32", f"weight {w.name} is {w.dtype}"
    return layer


def outputs_and_gradients(layer, x, training):
    """Runs `layer` on `x` inside a tf.function (so grappler rewrites it as in training).

    Returns the output and the gradients with respect to `x` and the layer's
    trainable weights of a fixed, non-uniform weighted sum of the output (so
    every output element matters), all as float32 numpy arrays.
    """
    import tensorflow as tf

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
            weights = tf.sin(tf.cast(tf.range(tf.size(y)), tf.float32) * 0.37)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.reshape(weights, tf.shape(y)))
        return y, tape.gradient(loss, [x] + layer.trainable_weights)

    y, grads = step(tf.constant(x))
    return np.asarray(tf.cast(y, tf.float32)), [np.asarray(g) for g in grads]


def check_equivalence(ours, stock, input_shape, seed=0):
    """Same weights in (stock -> ours and back), same outputs and gradients out, in train and predict."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(input_shape).astype("float32")
    stock(x)
    ours(x)
    assert [(w.name, w.shape) for w in ours.weights] == [(w.name, w.shape) for w in stock.weights]
    stock.set_weights([w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    back = type(stock).from_config(stock.get_config())
    back(x)
    back.set_weights(ours.get_weights())
    for a, b in zip(back.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    for training in (True, False):
        y, grads = outputs_and_gradients(ours, x, training)
        y_ref, grads_ref = outputs_and_gradients(stock, x, training)
        assert y.shape == y_ref.shape
        assert_close(y, y_ref, "float32")
        assert len(grads) == len(grads_ref)
        for g, g_ref in zip(grads, grads_ref):
            assert_close(g, g_ref, "float32")


def error_type(fn):
    """The type of the exception ``fn()`` raises, or None: to compare a drop-in's errors with stock's."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception types themselves are compared
        return type(e)
    return None


def assert_close(got, want, policy):
    """Equivalence tolerance by dtype policy: float32 1e-5; half/bfloat16 1e-2 relative, in norm."""
    if policy == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6)
        assert err < 1e-2, f"relative error {err:.3g}"


def float_bits(a):
    """`a`'s IEEE-754 bits (uint32 for 4-byte floats, uint16 for float16 / bfloat16)."""
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_same_bits(got, want):
    """Bitwise equal, NaN where the other is NaN (payloads may differ): emulated Metal against CPU kernels."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    mismatch = np.flatnonzero(float_bits(got)[~nan] != float_bits(want)[~nan])
    assert mismatch.size == 0, f"{mismatch.size} elements differ, first at {mismatch[:5]}: " \
                               f"{got[~nan][mismatch[:5]]} != {want[~nan][mismatch[:5]]}"


def assert_close_scaled(actual, expected, rtol):
    """`assert_allclose` with `atol` = `rtol` times the reference's largest magnitude (at least 1)."""
    import keras

    actual = np.asarray(keras.ops.convert_to_numpy(actual), "float64")
    expected = np.asarray(keras.ops.convert_to_numpy(expected), "float64")
    scale = max(np.abs(expected).max(), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def randomize_batch_norm(layer, rng):
    """Non-trivial gamma, beta and moving statistics, so inference is not the identity."""
    c = layer.gamma.shape[0]
    layer.gamma.assign(rng.uniform(0.5, 1.5, c).astype("float32"))
    layer.beta.assign(rng.normal(0.0, 0.5, c).astype("float32"))
    layer.moving_mean.assign(rng.normal(0.0, 0.5, c).astype("float32"))
    layer.moving_variance.assign(rng.uniform(0.5, 2.0, c).astype("float32"))


# ----------------------------------------------------------------------------
# Custom ops and their Metal kernels under emulation.


def load_emu():
    """The Metal emulation harness (``custom_ops/emu/emu.py``), loaded once by path.

    It is a plain module beside the kernel sources, not part of the package's
    import tree, so tests load it from the sources directory.
    """
    import importlib.util
    import sys

    from tfmetal_ext.ops import _loader

    name = "tfmetal_ext_metal_emu"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _loader.sources_dir() / "emu" / "emu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def compiled_ops():
    """The compiled op library (its CPU kernels), whatever TFMETAL_EXT_REFERENCE_OPS says."""
    from tfmetal_ext.ops import _loader

    library = _loader.load()
    assert library is not None, _loader.state().error
    return library


# The Metal host's dispatch geometry, from the host's own C++
# (custom_ops/metal/dispatch_geometry.h, which metal_helper.mm and the <op>_metal.mm files call):
# the emulator compiles that header into a library of its own and these functions call it
# through ctypes, so an emulation test dispatches a kernel exactly as the host would.
# Defaults: the SIMD width (32) and threadgroup limit (1024) of Apple GPUs and the emulator.

_GEOMETRY_FUNCTIONS = {
    "max_elements_per_dispatch": ("i64", ()),
    "threadgroup_size_1d": ("u64", ("u64",) * 4),
    "reduction_threadgroup_size": ("u64", ("u64",) * 5),
    "chunk_elements": ("i64", ("i64",) * 3),
    "norm_row_threads": ("u64", ("u64",) * 4),
    "norm_param_grad_groups": ("u64", ("u64",) * 2),
    "norm_param_grad_threads": ("u64", ("u64",) * 5),
}
_geometry = []


def host_geometry():
    """The C functions ``tfm_geometry_<name>`` of dispatch_geometry.h, built once by the emulator (ctypes)."""
    if not _geometry:
        import ctypes

        from tfmetal_ext.ops import _loader

        built = load_emu().build(_loader.sources_dir() / "metal" / "dispatch_geometry.h")
        library = ctypes.CDLL(str(built.path))
        types = {"i64": ctypes.c_int64, "u64": ctypes.c_uint64}
        functions = {}
        for name, (restype, argtypes) in _GEOMETRY_FUNCTIONS.items():
            function = getattr(library, f"tfm_geometry_{name}")
            function.restype = types[restype]
            function.argtypes = [types[t] for t in argtypes]
            functions[name] = function
        _geometry.append(functions)
    return _geometry[0]


def max_elements_per_dispatch():
    """metal_helper's kMaxElementsPerDispatch: the most elements one 1-D dispatch covers (2^30)."""
    return host_geometry()["max_elements_per_dispatch"]()


def dispatch_chunks(n, chunk=None):
    """DispatchChunked1D's ``(start, count)`` chunks of n elements (chunks of `chunk`, default the host's)."""
    chunk = max_elements_per_dispatch() if chunk is None else chunk
    return [(start, host_geometry()["chunk_elements"](n, start, chunk)) for start in range(0, n, chunk)]


def threadgroup_size_1d(n, cap=256, width=32, max_total=1024):
    """metal_helper's ThreadgroupSize1D: whole SIMD-groups, no more than the work, at most `cap`."""
    return host_geometry()["threadgroup_size_1d"](width, max_total, n, cap)


def reduction_threadgroup_size(row_length, elements_per_thread=1, cap=1024, width=32, max_total=1024):
    """metal_helper's ReductionThreadgroupSize: a power of two from the SIMD width up to the cap.

    The smallest that covers `row_length` elements at `elements_per_thread` each, never above
    min(max_total, cap) rounded down to a power of two.
    """
    return host_geometry()["reduction_threadgroup_size"](width, max_total, row_length, elements_per_thread, cap)


def norm_row_threads(channels, cap=1024, width=32, max_total=1024):
    """Threads per row of the norm kernels' forward and dx passes (norm_metal.h), capped at `cap`."""
    return host_geometry()["norm_row_threads"](width, max_total, channels, cap)


def norm_param_grad_groups(channels, columns=32):
    """Threadgroups of a norm kernel's parameter-gradient pass: one per `columns` columns."""
    return host_geometry()["norm_param_grad_groups"](channels, columns)


def norm_param_grad_threads(rows, cap=1024, columns=32, width=32, max_total=1024):
    """Threads per threadgroup of a norm kernel's parameter-gradient pass (`columns` times the row lanes)."""
    return host_geometry()["norm_param_grad_threads"](width, max_total, rows, columns, cap)


# The Einsum gap kernel's planner (custom_ops/include/tfmetal/gap_einsum.h, the one the host code
# runs), from the emulated build of gap_einsum.metal, which exports it (ctypes).


class EinsumPlanner:
    """`GapEinsumParse` / `GapEinsumPlan` / `GapEinsumGrid` of the Einsum gap kernel's host code.

    ``reason(equation)``: None if the kernel takes `equation`, else why not.
    ``plan(equation, a_shape, b_shape)``: ``(code, out_shape, params, message)``; code 0 is OK,
    else TensorFlow's status code (3 InvalidArgument, 12 Unimplemented) with its message, or -1
    and the reason for an equation the kernel does not take. `params` is a numpy record of
    `PARAMS` (the kernel's ``tfm_gap_einsum_params``).
    ``grid(params, count)``: the threadgroups (x, y, z) of the dispatch covering `count` batches.
    """

    _GROUP = [("rank", "<u4"), ("dims", "<u4", 4), ("a", "<u4", 4), ("b", "<u4", 4), ("c", "<u4", 4)]
    PARAMS_FIELDS = [("batch", "<u4"), ("m", "<u4"), ("n", "<u4"), ("k", "<u4"), ("batch_start", "<u4"),
                     ("pad", "<u4", 3), ("g", _GROUP, 4)]

    def __init__(self, library_path):
        import ctypes

        import numpy as np

        self.PARAMS = np.dtype(self.PARAMS_FIELDS)
        lib = ctypes.CDLL(str(library_path))
        p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
        self._parse = lib.tfm_gap_einsum_parse
        self._parse.restype, self._parse.argtypes = i, [s, s, i]
        self._plan = lib.tfm_gap_einsum_plan
        self._plan.restype, self._plan.argtypes = i, [s, p, i, p, i, p, p, p, s, i]
        self._grid = lib.tfm_gap_einsum_grid
        self._grid.restype, self._grid.argtypes = None, [p, ctypes.c_uint32, p]
        self.max_batch = lib.tfm_gap_einsum_max_batch
        self.max_batch.restype, self.max_batch.argtypes = ctypes.c_uint32, []
        self._ctypes, self._np = ctypes, np

    def reason(self, equation):
        buf = self._ctypes.create_string_buffer(512)
        return None if self._parse(equation.encode(), buf, len(buf)) else buf.value.decode()

    def plan(self, equation, a_shape, b_shape):
        np, ctypes = self._np, self._ctypes
        a = np.asarray(a_shape, np.int64).reshape(-1)
        b = np.asarray(b_shape, np.int64).reshape(-1)
        out = np.zeros(64, np.int64)
        rank = ctypes.c_int(0)
        params = np.zeros((), self.PARAMS)
        buf = ctypes.create_string_buffer(512)
        code = self._plan(equation.encode(), a.ctypes.data, a.size, b.ctypes.data, b.size, out.ctypes.data,
                          ctypes.addressof(rank), params.ctypes.data, buf, len(buf))
        return code, tuple(int(d) for d in out[:rank.value]), params, buf.value.decode()

    def grid(self, params, count):
        xyz = self._np.zeros(3, self._np.uint32)
        self._grid(params.ctypes.data, count, xyz.ctypes.data)
        return tuple(int(v) for v in xyz)


_einsum_planner = []


def einsum_planner():
    """The Einsum gap kernel's planner (`EinsumPlanner`), built once by the emulator."""
    if not _einsum_planner:
        from tfmetal_ext.ops import _loader

        built = load_emu().build(_loader.sources_dir() / "metal" / "gap_einsum.metal")
        _einsum_planner.append(EinsumPlanner(built.path))
    return _einsum_planner[0]


# tfm_multi_tensor_check_params (custom_ops/metal/multi_tensor_check.h).
MULTI_TENSOR_CHECK_PARAMS = np.dtype([("n", "<u4")])


def metal_multi_tensor_check(lib, dtype, grads, chunk=None, order="linear", seed=0):
    """The finite check a loss-scaled multi-tensor op encodes first (multi_tensor_metal.h), on the emulator.

    In the host's order: multi_tensor_found_reset (one thread), multi_tensor_find_non_finite_<dtype>
    over every gradient in the host's chunks (chunks of `chunk` elements to test the offsets), then
    multi_tensor_found_write. `lib` is an emulated multi_tensor_*.metal library, `dtype` "float",
    "half" or "bfloat", `order` the threadgroup order of the checks. Returns ``(found,
    found_non_finite)``: the 4-byte temp the update kernels read (uint32[1]; it starts as garbage,
    as an uninitialized temp would) and the op's bool output (uint8[1]).
    """
    found = np.full(1, 0xDEADBEEF, np.uint32)
    out = np.full(1, 0xAB, np.uint8)
    lib.run("multi_tensor_found_reset", [found], grid=1, threadgroup=threadgroup_size_1d(1))
    for g in grads:
        flat = np.asarray(g).reshape(-1)
        for start, count in dispatch_chunks(flat.size, chunk):
            params = np.array((count,), MULTI_TENSOR_CHECK_PARAMS)
            lib.run(f"multi_tensor_find_non_finite_{dtype}", [flat[start:start + count], found, ("bytes", params)],
                    grid=count, threadgroup=threadgroup_size_1d(count), order=order, seed=seed)
    lib.run("multi_tensor_found_write", [found, out], grid=1, threadgroup=threadgroup_size_1d(1))
    return found, out


# ----------------------------------------------------------------------------
# numpy references of the custom ops, shared by the op tests, their Metal-emulation tests and
# `tfmetal_ext.doctor.selftest()`.


def np_softshrink(x, lambd):
    """Softshrink in float64; NaN propagates (the op's documented behaviour)."""
    x = x.astype(np.float64)
    y = np.where(x > lambd, x - lambd, np.where(x < -lambd, x + lambd, 0.0))
    return np.where(np.isnan(x), x, y)


def np_softshrink_grad(dy, x, lambd):
    """Softshrink's gradient in float64: `dy` where ``|x| > lambd``, else 0; NaN propagates."""
    x = x.astype(np.float64)
    g = np.where(np.abs(x) > lambd, dy.astype(np.float64), 0.0)
    return np.where(np.isnan(x), x, g)


def np_layer_norm(x, gamma, beta, epsilon):
    """Layer norm over the last axis in float64."""
    if x.shape[-1] == 0:
        return x.astype(np.float64)
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    return (x - mean) * rstd * gamma + beta


def np_layer_norm_grad(dy, x, gamma, epsilon):
    """``(dx, dgamma, dbeta)`` of `np_layer_norm` in float64."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    if x.shape[-1] == 0:  # empty rows: no gradient to sum
        return x, np.zeros(0), np.zeros(0)
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    xhat = (x - mean) * rstd
    g = dy * gamma
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(rows), dy.sum(rows)


def _np_repeat_kv(q, t):
    """Grouped-query attention: key/value heads repeated for their consecutive query heads."""
    t = np.asarray(t, np.float64)
    return np.repeat(t, q.shape[1] // t.shape[1], axis=1) if t.shape[1] and q.shape[1] != t.shape[1] else t


def _np_sum_kv_groups(g, like):
    """A repeated key/value gradient summed back over each key/value head's query heads."""
    b, h, t, d = g.shape
    kv = np.shape(like)[1]
    return g if kv == h else g.reshape(b, kv, h // kv, t, d).sum(2)


def _np_attention_probs(q, k, mask, causal, scale, window=0):
    """float64 softmax probabilities (0 in a row attending no key) and lse (-inf there)."""
    q = np.asarray(q, np.float64)
    k = _np_repeat_kv(q, k)
    tq, tk = q.shape[2], k.shape[2]
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    allowed = np.ones((1, 1, tq, tk), bool) if mask is None else np.asarray(mask, bool)
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    if causal:
        allowed = allowed & (j <= i)
    if window:
        allowed = allowed & (np.abs(i - j) < window)
    allowed = np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    any_key = allowed.any(-1, keepdims=True)
    shift = np.where(any_key, scores.max(-1, keepdims=True, initial=-np.inf), 0.0)
    e = np.where(allowed, np.exp(scores - shift), 0.0)
    total = np.where(any_key, e.sum(-1, keepdims=True), 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(any_key, shift + np.log(total), -np.inf)[..., 0]
    return np.where(any_key, e / total, 0.0), lse


def np_attention(q, k, v, mask=None, causal=False, scale=None, factors=None, window=0):
    """``(output, lse)`` of softmax attention in float64 (TfmetalExt>Attention's contract).

    Inputs (batch, heads, seq, dim), key and value with heads dividing query's (grouped-query:
    each repeated for its consecutive query heads); `mask` a boolean "attend" mask broadcastable
    to (batch, heads, q_seq, kv_seq); causal: key j attended by query i only if j <= i; window
    w > 0: only if |i - j| < w; scale None for 1/sqrt(head_dim). A row attending no key has
    output 0 and lse -inf.
    `factors`: None, or attention dropout's (batch, heads, q_seq, kv_seq) factors of the
    probabilities (`np_attention_dropout_factors`); the lse stays the undropped one.
    """
    scale = 1.0 / np.sqrt(np.shape(q)[-1]) if scale is None else scale
    p, lse = _np_attention_probs(q, k, mask, causal, scale, window)
    p = p if factors is None else p * factors
    return np.einsum("bhqk,bhkd->bhqd", p, _np_repeat_kv(np.asarray(q), v)), lse


def np_attention_grad(d_output, q, k, v, mask=None, causal=False, scale=None, factors=None, window=0):
    """``(d_query, d_key, d_value)`` of `np_attention`'s output in float64 (with its `factors`; key and
    value gradients summed over each key/value head's query heads)."""
    scale = 1.0 / np.sqrt(np.shape(q)[-1]) if scale is None else scale
    k_in, v_in = k, v
    q, do = (np.asarray(t, np.float64) for t in (q, d_output))
    k, v = _np_repeat_kv(q, k), _np_repeat_kv(q, v)
    p, _ = _np_attention_probs(q, k, mask, causal, scale, window)
    m = 1.0 if factors is None else factors
    dp = m * np.einsum("bhqd,bhkd->bhqk", do, v)  # d(output)/d(p): through the dropped p
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return (
        scale * np.einsum("bhqk,bhkd->bhqd", ds, k),
        _np_sum_kv_groups(scale * np.einsum("bhqk,bhqd->bhkd", ds, q), k_in),
        _np_sum_kv_groups(np.einsum("bhqk,bhqd->bhkd", p * m, do), v_in),
    )


def np_attention_dropout_factors(shape, seed, rate, scale, bits):
    """Attention dropout's factors of the (batch, heads, q_seq, kv_seq) probabilities: `scale` where
    TensorFlow's stateless dropout of a tensor of that shape keeps the element (its uniform number,
    from `bits` mantissa bits, >= `rate`), else 0; `rate` and `scale` as the dtype rounds them."""
    key, counter = np_key_counter(seed)
    u = np_stateless_uniform(int(np.prod(shape)), key, counter, bits).reshape(shape)
    return np.where(u >= rate, scale, 0.0)


def np_rms_norm(x, gamma, epsilon):
    """RMS norm over the last axis in float64: ``x / sqrt(mean(x^2) + epsilon) * gamma``."""
    x = x.astype(np.float64)
    if x.shape[-1] == 0:
        return x
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + epsilon) * gamma


def np_rms_norm_grad(dy, x, gamma, epsilon):
    """``(dx, dgamma)`` of `np_rms_norm` in float64."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    if x.shape[-1] == 0:  # empty rows: no gradient to sum
        return x, np.zeros(0)
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + epsilon)
    xhat = x * rstd
    g = dy * gamma
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(tuple(range(x.ndim - 1)))


def np_activation(name, v, alpha=0.2):
    """A Keras activation of TfmetalExt>BatchNormAct in float64 from its definition (gelu exact)."""
    import math

    if name == "relu":
        return np.maximum(v, 0.0)
    if name == "relu6":
        return np.minimum(np.maximum(v, 0.0), 6.0)
    if name == "elu":
        return np.where(v < 0.0, np.expm1(np.minimum(v, 0.0)), v)
    if name == "leaky_relu":
        return np.where(v > 0.0, v, alpha * v)
    if name == "silu":
        return v / (1.0 + np.exp(-v))
    if name == "gelu":
        return 0.5 * v * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(v / math.sqrt(2.0)))
    assert name == "linear", name
    return v


def np_activation_grad(name, v, alpha=0.2):
    """d act / d v in float64; at the kinks the value of TensorFlow's gradient ops (relu' (0) = 0,
    relu6' = 0 at 0 and 6, leaky_relu' (0) = alpha, elu' (0) = 1)."""
    import math

    if name == "relu":
        return (v > 0.0).astype(np.float64)
    if name == "relu6":
        return ((v > 0.0) & (v < 6.0)).astype(np.float64)
    if name == "elu":
        return np.where(v < 0.0, np.exp(np.minimum(v, 0.0)), 1.0)
    if name == "leaky_relu":
        return np.where(v > 0.0, 1.0, alpha)
    if name == "silu":
        s = 1.0 / (1.0 + np.exp(-v))
        return s + v * s * (1.0 - s)
    if name == "gelu":  # Phi as 0.5 erfc(-v / sqrt 2): 0.5 (1 + erf) cancels in the left tail, even in float64
        cdf = 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-v / math.sqrt(2.0))
        return cdf + v * np.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)
    if name == "gelu_approximate":  # tf.nn.gelu(approximate=True)
        # 0.5 (1 + t) + 0.5 v (1 - t^2) c (1 + 3k v^2), t = tanh(w), w = c (v + k v^3); with
        # e = exp(-2|w|): 0.5 (1 + t) = sigmoid(2w), 1 - t^2 = 4 e / (1 + e)^2 (no cancellation
        # in float64 as t -> +-1, which would cost ~1e-16 / (1 - |t|) relative).
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        w = c * (v + k * v ** 3)
        e = np.exp(-2.0 * np.abs(w))
        half_one_plus_t = np.where(w < 0.0, e / (1.0 + e), 1.0 / (1.0 + e))
        one_minus_t2 = 4.0 * e / (1.0 + e) ** 2
        return half_one_plus_t + 0.5 * v * one_minus_t2 * c * (1.0 + 3.0 * k * v * v)
    assert name == "linear", name
    return np.ones_like(v)


def np_smooth_activation_grad(dy, x, activation):
    """TfmetalExt>ActivationGrad in float64 from its definition: ``dy * act'(x)`` for ``"silu"``,
    ``"gelu"`` (erf) or ``"gelu_approximate"`` (tanh); at x = +-inf the derivative's limits 1 and 0."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.where(np.isinf(x), 0.0, x)
        derivative = np.where(np.isinf(x), (x > 0).astype(np.float64), np_activation_grad(activation, finite))
        return np.asarray(dy, np.float64) * np.where(np.isnan(x), np.nan, derivative)


def np_activation_factor(x, activation):
    """f of act(x) = x * f(x) in float64 (sigmoid, Phi, or the tanh GELU's 0.5 (1 + tanh w) =
    sigmoid(2w)); at x = +-inf its limits 1 and 0."""
    import math

    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if activation == "silu":
            return 1.0 / (1.0 + np.exp(-x))
        if activation == "gelu":
            return 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x / math.sqrt(2.0))
        w = np.clip(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3), -1e4, 1e4)
        return 1.0 / (1.0 + np.exp(-2.0 * w))


def np_gated_activation_grad(dy, gate, up, activation):
    """TfmetalExt>GatedActivationGrad in float64 from its definition: ``(dy * up * act'(gate),
    dy * act(gate))``, act(gate) = gate * f(gate) (`np_activation_factor`)."""
    dy, gate, up = (np.asarray(t, np.float64) for t in (dy, gate, up))
    with np.errstate(invalid="ignore"):
        return np_smooth_activation_grad(dy * up, gate, activation), dy * (gate * np_activation_factor(gate, activation))


def np_sparse_softmax_cross_entropy(x, labels):
    """TfmetalExt>SparseSoftmaxCrossEntropy in float64 from its definition: ``(loss, row_max,
    row_sum)`` with ``loss = log(sum exp(x - max)) - (x[label] - max)`` per row of [rows, classes]."""
    x = np.asarray(x, np.float64)
    row_max = x.max(axis=-1)
    row_sum = np.exp(x - row_max[:, None]).sum(axis=-1)
    label_logit = x[np.arange(x.shape[0]), np.asarray(labels)]
    return np.log(row_sum) - (label_logit - row_max), row_max, row_sum


def np_sparse_softmax_cross_entropy_grad(dloss, x, labels):
    """Its gradient in float64: ``(softmax(x) - one_hot(labels)) * dloss[:, None]``."""
    x = np.asarray(x, np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p[np.arange(x.shape[0]), np.asarray(labels)] -= 1.0
    return p * np.asarray(dloss, np.float64)[:, None]


def np_batch_norm_act(x, gamma, beta, side=None, activation="relu", epsilon=1e-3, alpha=0.2):
    """TfmetalExt>BatchNormAct in float64: ``(y, mean, inv_std, variance)``, statistics over every
    axis but the last (biased variance; NaN for an empty batch)."""
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - 1))
    rows = int(np.prod(x.shape[:-1]))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = x.sum(axes) / rows if rows else np.full(x.shape[-1], np.nan)
        variance = ((x - mean) ** 2).sum(axes) / rows if rows else np.full(x.shape[-1], np.nan)
        inv_std = 1.0 / np.sqrt(variance + epsilon)
        pre = (x - mean) * inv_std * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
        if side is not None:
            pre = pre + np.asarray(side, np.float64)
        return np_activation(activation, pre, alpha), mean, inv_std, variance


def np_moving_update(mean, variance, moving_mean, moving_variance, momentum):
    """Keras' moving-statistics update of a training batch, as TfmetalExt>BatchNormAct's
    ``new_moving`` defines it: ``moving * momentum + batch * (1 - momentum)`` in float32 (the
    batch's weight ``1 - momentum`` rounded in float32), for the mean and the variance; the
    moving statistics unchanged unless every updated value is finite."""
    f32 = np.float32
    m = f32(momentum)
    weight = f32(1.0) - m
    with np.errstate(invalid="ignore", over="ignore"):
        new_mean = np.asarray(moving_mean, f32) * m + np.asarray(mean, f32) * weight
        new_variance = np.asarray(moving_variance, f32) * m + np.asarray(variance, f32) * weight
    if np.isfinite(new_mean).all() and np.isfinite(new_variance).all():
        return new_mean, new_variance
    return np.asarray(moving_mean, f32).copy(), np.asarray(moving_variance, f32).copy()


def np_batch_norm_act_grad(dy, x, gamma, beta, side=None, activation="relu", epsilon=1e-3, alpha=0.2):
    """``(dx, dgamma, dbeta, dside)`` of `np_batch_norm_act`'s y in float64 (dside None without a side).

    With xhat = (x - mean) inv_std and dpre = dy act'(pre): y depends on x through xhat, whose
    Jacobian over one channel's M values is inv_std (I - 1/M - xhat xhat^T / M); so
    dx = gamma inv_std (dpre - mean(dpre) - xhat mean(dpre xhat)).
    """
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    gamma = np.asarray(gamma, np.float64)
    axes = tuple(range(x.ndim - 1))
    rows = int(np.prod(x.shape[:-1]))
    channels = x.shape[-1]
    if rows == 0 or channels == 0:
        return np.zeros_like(x), np.zeros(channels), np.zeros(channels), None if side is None else np.zeros_like(x)
    _, mean, inv_std, _ = np_batch_norm_act(x, gamma, beta, side, "linear", epsilon)
    xhat = (x - mean) * inv_std
    pre = xhat * gamma + np.asarray(beta, np.float64)
    if side is not None:
        pre = pre + np.asarray(side, np.float64)
    dpre = dy * np_activation_grad(activation, pre, alpha)
    dbeta = dpre.sum(axes)
    dgamma = (dpre * xhat).sum(axes)
    dx = gamma * inv_std * (dpre - dbeta / rows - xhat * dgamma / rows)
    return dx, dgamma, dbeta, None if side is None else dpre


def np_rope_rotate(x, cos, sin, inverse=False):
    """The rotation of TfmetalExt>Rope (tfmetal/rope.h) in numpy, in the dtype of its operands.

    x is [..., features] (halves x1 | x2); cos and sin broadcast against one
    half, or against all features (then each output uses its own position's
    value, as keras-hub's layer does with its repeated embedding). Each product
    and the sum are rounded separately (float32 operands: the kernels' exact
    sequence; float64: the exact rotation). ``inverse`` turns back (the gradient).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if half > 0 and cos.shape[-1] == 2 * half:
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    else:
        c1 = c2 = cos
        s1 = s2 = sin
    if inverse:
        return np.concatenate([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], -1)
    return np.concatenate([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], -1)


def np_rope(x, positions, inv_freq, scale=1.0, inverse=False):
    """TfmetalExt>Rope in float64 from its definition: x [batch, seq, ..., features],
    positions [seq] or [batch, seq], angle = float32(position * inv_freq) (one float32 product)."""
    positions = np.asarray(positions, np.float32).reshape(-1, x.shape[1])
    angle = (positions[:, :, None] * np.asarray(inv_freq, np.float32)).astype(np.float64)
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[2:])
    return np_rope_rotate(x.astype(np.float64), scale * np.cos(angle), scale * np.sin(angle), inverse)


# ----------------------------------------------------------------------------
# Philox-4x32-10 and TensorFlow's stateless random numbers, in numpy uint64
# arithmetic (Salmon et al. 2011; TensorFlow's constants), written from the
# definition, independently of custom_ops/include/tfmetal/philox.h.

_W32 = np.uint64(0xFFFFFFFF)
_M64 = (1 << 64) - 1


def np_philox(words, key):
    """Philox-4x32-10 of counters `words` (4 arrays of 32-bit words, low first) under `key` (2 words)."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) for w in words)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # 32 x 32 bits: exact in 64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _W32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _W32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _W32, (k1 + np.uint64(0xBB67AE85)) & _W32
    return c0, c1, c2, c3


def np_philox_counters(counter, g):
    """The 128-bit counter (two uint64, low first) plus each of `g`, as 4 arrays of 32-bit words."""
    g = np.asarray(g, np.uint64)
    with np.errstate(over="ignore"):
        lo = np.uint64(counter[0]) + g  # wraps modulo 2^64
        hi = np.uint64(counter[1]) + (lo < g).astype(np.uint64)
    return lo & _W32, lo >> np.uint64(32), hi & _W32, hi >> np.uint64(32)


def np_key_counter(seed):
    """StatelessRandomGetKeyCounter: ``(key, [counter_lo, counter_hi])`` of a seed of two ints."""
    s0, s1 = (int(s) & _M64 for s in seed)
    mix = [int(w) for w in np_philox(np_philox_counters([s0, s1], 0), (0x3EC8F720, 0x02461E29))]
    return mix[0] | (mix[1] << 32), [0, mix[2] | (mix[3] << 32)]


# Random mantissa bits of a uniform number per dtype name (TensorFlow's UniformDistribution).
UNIFORM_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}


def np_stateless_uniform(n, key, counter, bits):
    """StatelessRandomUniformV2 (Philox) as float64: element i from word i % 4 of block counter + i // 4."""
    blocks = np_philox(np_philox_counters(counter, np.arange(-(-n // 4))), (key & 0xFFFFFFFF, key >> 32))
    words = np.stack(blocks, axis=1).ravel()[:n]
    return (words & np.uint64((1 << bits) - 1)).astype(np.float64) / float(1 << bits)  # exact


def np_dropout(x, seed, rate, scale, bits):
    """Dropout with TensorFlow's stateless mask: ``x * scale`` where the seed's uniform number >= rate, else +0.

    `x` is a numpy array of the result's dtype; `rate` and `scale` are the
    values rounded to it; the product is rounded once to that dtype.
    """
    x = np.asarray(x)
    key, counter = np_key_counter(seed)
    keep = np_stateless_uniform(x.size, key, counter, bits).reshape(x.shape) >= rate
    kept = (x.astype(np.float32) * np.float32(scale)).astype(x.dtype)  # float32 product, one rounding
    return np.where(keep, kept, np.zeros((), x.dtype)), keep


def np_adam_step(state, g, scalars, np_dtype, amsgrad=False, decay_rate=None):
    """One ResourceApplyAdam(WithAmsgrad) step, operation by operation, each result rounded to `np_dtype`.

    Args:
        state: ``(var, m, v, vhat)`` arrays.
        g: the gradient.
        scalars: ``(lr, beta_1, beta_2, epsilon, beta_1_power, beta_2_power)``.
        np_dtype: the numpy type values are rounded to (through float32, like Eigen).
        amsgrad: use and update `vhat`.
        decay_rate: decoupled weight decay applied first (``var -= var * decay_rate``), or None.

    Returns:
        The new ``(var, m, v, vhat)`` as float64 arrays.
    """

    def r(x):
        return np.asarray(x, np.float64).astype(np.float32).astype(np_dtype).astype(np.float64)

    var, m, v, vhat, g = (np.asarray(a).astype(np.float64) for a in (*state, g))
    lr, b1, b2, eps, b1p, b2p = (float(r(s)) for s in scalars)
    alpha = r(r(lr * r(np.sqrt(r(1.0 - b2p)))) / r(1.0 - b1p))
    if decay_rate is not None:
        var = r(var - r(var * float(r(decay_rate))))
    m = r(m + r(r(g - m) * r(1.0 - b1)))
    v = r(v + r(r(r(g * g) - v) * r(1.0 - b2)))
    base = v
    if amsgrad:
        vhat = np.where(vhat < v, v, vhat)
        base = vhat
    var = r(var - r(r(m * alpha) / r(r(np.sqrt(base)) + eps)))
    return var, m, v, vhat


def np_lion_step(state, g, scalars, np_dtype, decay_rate=None):
    """One keras.optimizers.Lion update_step, operation by operation, each result rounded to `np_dtype`.

    ``sign`` is tf.sign's: 1, -1, +0 for either zero, NaN for NaN.

    Args:
        state: ``(var, m)`` arrays.
        g: the gradient.
        scalars: ``(lr, beta_1, beta_2)``.
        np_dtype: the numpy type values are rounded to (through float32, like Eigen).
        decay_rate: decoupled weight decay applied first (``var -= var * decay_rate``), or None.

    Returns:
        The new ``(var, m)`` as float64 arrays (values of `np_dtype`).
    """

    def r(x):
        return np.asarray(x, np.float64).astype(np.float32).astype(np_dtype).astype(np.float64)

    var, m, g = (r(np.asarray(a).astype(np.float64)) for a in (*state, g))
    lr, b1, b2 = (float(r(s)) for s in scalars)
    with np.errstate(invalid="ignore", over="ignore"):
        if decay_rate is not None:
            var = r(var - r(var * float(r(decay_rate))))
        blend = r(r(m * b1) + r(g * r(1.0 - b1)))
        sign = np.where(blend > 0, 1.0, np.where(blend < 0, -1.0, np.where(blend == 0, 0.0, blend)))
        var = r(var - r(lr * sign))
        m = r(r(m * b2) + r(g * r(1.0 - b2)))
    return var, m


def np_rmsprop_step(state, g, scalars, np_dtype, decay_rate=None):
    """One keras.optimizers.RMSprop update_step, operation by operation, each result rounded to `np_dtype`.

    Args:
        state: ``(var, velocity, momentum, average_gradient)`` arrays; ``momentum`` and
            ``average_gradient`` are None without momentum / centering (and stay None).
        g: the gradient.
        scalars: ``(lr, rho, momentum, epsilon)``; ``1 - rho`` is formed in double before
            the rounding, as Keras' ``1 - self.rho``.
        np_dtype: the numpy type values are rounded to (through float32, like Eigen).
        decay_rate: decoupled weight decay applied first (``var -= var * decay_rate``), or None.

    Returns:
        The new state as float64 arrays (values of `np_dtype`; None where `state` has None).
    """

    def r(x):
        return np.asarray(x, np.float64).astype(np.float32).astype(np_dtype).astype(np.float64)

    var, v, m, mg = state
    var, v, g = (r(np.asarray(a).astype(np.float64)) for a in (var, v, g))
    lr, rho, momentum, epsilon = (float(r(s)) for s in scalars)
    one_minus_rho = float(r(1.0 - scalars[1]))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if decay_rate is not None:
            var = r(var - r(var * float(r(decay_rate))))
        v = r(r(rho * v) + r(one_minus_rho * r(g * g)))
        if mg is not None:
            mg = r(r(rho * r(mg)) + r(one_minus_rho * g))
            denominator = r(r(v - r(mg * mg)) + epsilon)
        else:
            denominator = r(v + epsilon)
        increment = r(r(lr * g) / r(np.sqrt(denominator)))
        if m is not None:
            m = r(r(momentum * r(m)) + increment)
            var = r(var - m)
        else:
            var = r(var - increment)
    return var, v, m, mg


class SourceUnavailable(RuntimeError):
    """The tensorflow-metal-plugin sdist could not be fetched (no package index, or a bad download)."""


def metal_plugin_source(version=None, cache_dir=None):
    """The extracted source tree of the pinned tensorflow-metal-plugin sdist, fetched with pip once.

    tfmetal-ext contains none of the plugin's code: its tests and scripts
    that read or compile the plugin's source (the kernel-table generator,
    the graph-pass tests, the host-code syntax check) fetch the sdist like
    any other dependency, with ``pip download --no-deps``, check its sha256
    when it is the pinned release, and extract it (tar "data" filter: no
    links out of the tree, no device files) into a cache directory.

    Args:
        version: the release; defaults to `tfmetal_ext.backends.metal_plugin.PIN`.
        cache_dir: where to keep it; defaults to ``$TFMETAL_EXT_SDIST_CACHE``,
            else ``$XDG_CACHE_HOME/tfmetal-ext/sdist`` (``~/.cache/...``).

    Returns:
        A `pathlib.Path` to the source root (the directory holding
        ``TF_SUPPORTED_VERSION`` and ``src/``).

    Raises:
        SourceUnavailable: pip could not fetch it (no index reachable), or
            the download does not match the recorded sha256. Tests skip on
            it with its message as the reason.
    """
    import hashlib
    import pathlib
    import shutil
    import subprocess
    import sys
    import tarfile

    from tfmetal_ext.backends import metal_plugin

    version = version or metal_plugin.PIN
    if cache_dir is None:
        cache_dir = os.environ.get("TFMETAL_EXT_SDIST_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tfmetal-ext", "sdist"
        )
    cache = pathlib.Path(cache_dir)
    root = cache / f"tensorflow_metal_plugin-{version}"
    if (root / "TF_SUPPORTED_VERSION").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"tensorflow-metal-plugin=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise SourceUnavailable(f"could not run pip download for tensorflow-metal-plugin=={version}: {e}") from e
        archives = sorted(pathlib.Path(tmp).glob("tensorflow_metal_plugin-*.tar.gz"))
        if done.returncode != 0 or not archives:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SourceUnavailable(
                f"pip download tensorflow-metal-plugin=={version} failed (no package index reachable?): {tail[0]}"
            )
        archive = archives[0]
        if version == metal_plugin.PIN:
            digest = hashlib.sha256(archive.read_bytes()).hexdigest()
            if digest != metal_plugin.SDIST_SHA256:
                raise SourceUnavailable(
                    f"{archive.name} has sha256 {digest}, expected {metal_plugin.SDIST_SHA256} "
                    "(tfmetal_ext.backends.metal_plugin.SDIST_SHA256)"
                )
        out = pathlib.Path(tmp) / "x"
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")
        found = [p.parent for p in out.glob("*/TF_SUPPORTED_VERSION")]
        if len(found) != 1:
            raise SourceUnavailable(f"{archive.name} does not hold one source tree with TF_SUPPORTED_VERSION")
        try:
            found[0].rename(root)
        except OSError:
            if not (root / "TF_SUPPORTED_VERSION").is_file():  # another process won the race: use theirs
                raise
        shutil.rmtree(out, ignore_errors=True)
    return root
