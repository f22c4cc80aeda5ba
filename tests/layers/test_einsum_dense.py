"""FusedEinsumDense: the equations as data, equivalence with keras.layers.EinsumDense, LoRA, int8, the graph."""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import FusedEinsumDense
from tfmetal_ext.layers._einsum_plan import BATCH_MATMUL, BIAS_ADD, BIAS_AFTER, MATMUL, einsum_plan
from tfmetal_ext.testing import assert_close, run_layer_test

EinsumDense = keras.layers.EinsumDense

# The EinsumDense equations Keras' MultiHeadAttention (its rank-3 build) and keras-hub 0.32's models
# build (grep "EinsumDense(" under keras_hub/src/models and keras/src/layers/attention), with an
# output_shape, bias_axes and input shape for each: (equation, output_shape, bias_axes, input_shape).
EQUATIONS = [
    ("abc,cde->abde", (None, 2, 3), "de", (2, 5, 6)),  # MHA query/key/value
    ("abcd,cde->abe", (None, 6), "e", (2, 5, 2, 3)),  # MHA output
    ("abc,cdef->abdef", (None, 2, 3, 2), "def", (2, 4, 6)),  # MHA with output_shape of rank 2
    ("btd,dnh->btnh", (None, 2, 3), "nh", (2, 5, 6)),
    ("btnh,nhd->btd", (None, 6), "d", (2, 5, 2, 3)),
    ("btd,ndh->btnh", (None, 2, 3), "nh", (2, 5, 6)),  # kernel (heads, dim, head_dim): transposed
    ("bsd,dkh->bskh", (None, 2, 3), None, (2, 5, 6)),
    ("bsd,kdh->bskh", (None, 2, 3), None, (2, 5, 6)),
    ("bsd,qdh->bsqh", (None, 2, 3), None, (2, 5, 6)),
    ("bkm,mvh->bkvh", (None, 2, 3), None, (2, 5, 6)),
    ("bqm,muh->bquh", (None, 2, 3), None, (2, 5, 6)),
    ("bquh,uhm->bqm", (None, 6), None, (2, 5, 2, 3)),
    ("bsm,mnh->bsnh", (None, 2, 3), None, (2, 5, 6)),
    ("bkm,mnh->bknh", (None, 2, 3), None, (2, 5, 6)),
    ("btm,mnh->btnh", (None, 2, 3), None, (2, 5, 6)),
    ("bqm,mnh->bqnh", (None, 2, 3), None, (2, 5, 6)),
    ("btd,df->btf", (None, 7), None, (2, 5, 6)),
    ("btf,fd->btd", (None, 6), None, (2, 5, 7)),
    ("abc,cd->abd", (None, 7), "d", (2, 5, 6)),
    ("ibnd,hnd->ibh", (None, 7), "h", (3, 2, 2, 3)),  # kernel (out, heads, head_dim): transposed
    # Keras' own forms: 2-D, ellipsis, and a contraction before a kept axis (BatchMatMulV2).
    ("ab,bc->ac", 7, "c", (4, 6)),
    ("...b,bc->...c", 7, "c", (2, 3, 6)),
    ("...c,cde->...de", (2, 3), "e", (2, 3, 6)),
    ("abc,bd->acd", (None, 7), "d", (2, 6, 3)),
]
BATCHED = {"abc,bd->acd"}

# Equations EinsumDense takes that are no reshaped matrix product: stock's einsum runs, and why.
UNFUSED = [
    ("ab,ab->a", 2, "a batched kernel"),
    ("abcde,afce->acdbf", 5, "a batched kernel"),
    ("bc...,cd->bd...", 3, "a transposed output"),
    ("abc,cd->adb", 3, "a transposed output"),
    ("i,d->id", 1, "an outer product"),
    ("abc,bd->ad", 3, "summed over one operand alone"),
    ("abc,acd->bd", 3, "not adjacent"),
]


def _case_id(case):
    return case[0]


# ----------------------------------------------------------------------------
# The plan (no TensorFlow: the analysis is data).


def test_every_equation_of_keras_and_keras_hub_is_a_matrix_product():
    for eq, _, bias_axes, shape in EQUATIONS:
        plan, reason = einsum_plan(eq, bias_axes, len(shape))
        assert reason is None, (eq, reason)
        assert plan.op == (BATCH_MATMUL if eq in BATCHED else MATMUL), eq
        assert plan.bias == (BIAS_ADD if bias_axes else None), eq
    # Kernel transposes: exactly where the kernel's free axes are not stored last in output order.
    assert einsum_plan("btd,ndh->btnh", "nh", 3)[0].kernel_perm == (1, 0, 2)
    assert einsum_plan("ibnd,hnd->ibh", "h", 4)[0].kernel_perm == (1, 2, 0)
    assert einsum_plan("btd,dnh->btnh", "nh", 3)[0].kernel_perm is None
    # The ellipsis takes the rank: rows = every axis before the contracted one.
    assert einsum_plan("...b,bc->...c", "c", 5)[0].rows == 4
    # A bias over input-side axes is added after the reshape.
    assert einsum_plan("abc,cd->abd", "bd", 3)[0].bias == BIAS_AFTER


@pytest.mark.parametrize("eq, rank, why", UNFUSED)
def test_other_equations_run_stock_with_the_reason(eq, rank, why):
    plan, reason = einsum_plan(eq, None, rank)
    assert plan is None and why in reason and "stock's einsum runs" in reason


def test_unparseable_and_rank_mismatch_reasons():
    assert "not one of EinsumDense's equation forms" in einsum_plan("ab,bc", None, 2)[1]
    assert "rank 3" in einsum_plan("ab,bc->ac", None, 3)[1]
    assert "fewer axes" in einsum_plan("...ab,bc->...ac", None, 1)[1]


# ----------------------------------------------------------------------------
# Equivalence with stock, within a bound derived for float32 sums taken in another order.

U32 = 2.0**-24


def _gamma(n):
    """Higham's gamma_n: |fl(sum of n products) - exact| <= gamma_n * sum |products|, any order, float32."""
    return n * U32 / (1 - n * U32)


def _pair(eq, output_shape, bias_axes, shape, seed=0, **kwargs):
    """A built stock EinsumDense and a FusedEinsumDense with the same (non-trivial) weights."""
    rng = np.random.default_rng(seed)
    stock = EinsumDense(eq, output_shape, bias_axes=bias_axes, **kwargs)
    ours = FusedEinsumDense(eq, output_shape, bias_axes=bias_axes, **kwargs)
    stock.build(shape)
    ours.build(shape)
    assert [(w.path.split("/")[-1], w.shape) for w in ours.weights] == [
        (w.path.split("/")[-1], w.shape) for w in stock.weights]
    stock.set_weights([rng.standard_normal(w.shape).astype("float32") for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    return stock, ours, rng.standard_normal(shape).astype("float32")


def _outputs_and_grads(layer, x, graph=True):
    """Output and gradients (input, trainable weights) of ``sum(y * w)`` for a fixed non-uniform w."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            w = tf.reshape(tf.sin(tf.cast(tf.range(tf.size(y)), tf.float32) * 0.37), tf.shape(y))
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * w)
        return y, w, tape.gradient(loss, [x] + layer.trainable_weights)

    fn = tf.function(step) if graph else step
    y, w, grads = fn(tf.constant(x))
    return np.asarray(tf.cast(y, tf.float32)), np.asarray(w), [np.asarray(g) for g in grads]


def _expanded(eq, rank):
    """The equation with its ellipsis spelled out in letters (for numpy's abs-value reference sums)."""
    if "..." not in eq:
        return eq
    letters = [c for c in "zyxwvutsrq" if c not in eq]
    inp = eq.split(",")[0].replace("...", "")
    extra = "".join(letters[: rank - len(inp)])
    return eq.replace("...", extra)


def _check_matches_stock(stock, ours, x, graph=True):
    """Outputs and gradients of `ours` equal stock's to within the float32 reordering bound.

    Each entry of the output and of every gradient is a float32 sum of `n` products (n: the
    contracted length, the free length, or the rows summed over); two summation orders differ by at
    most ``2 gamma_n sum|products|`` (the sum of absolute products computed with numpy from the
    definition), plus one rounding of the bias add each (``2u |y|``). Linear activation: no more.
    """
    eq = _expanded(stock.equation, x.ndim)
    y_ref, w, grads_ref = _outputs_and_grads(stock, x, graph)
    y, _, grads = _outputs_and_grads(ours, x, graph)
    ins, out = eq.split("->")
    inp, ker = ins.split(",")
    kernel = np.asarray(stock.kernel)
    n = max(x.size, kernel.size, y.size)  # at least the number of terms of any of the sums below
    abs_y = np.einsum(eq, np.abs(x), np.abs(kernel))
    if stock.bias is not None:
        abs_y = abs_y + np.abs(np.asarray(stock.bias))
    np.testing.assert_array_less(np.abs(y - y_ref), 2 * _gamma(n) * abs_y + 2 * U32 * np.abs(y_ref) + 1e-30)
    # d/dx = einsum(out,ker->inp) of the output weights w; d/dkernel = einsum(inp,out->ker) of x and w.
    bounds = [np.einsum(f"{out},{ker}->{inp}", np.abs(w), np.abs(kernel)),
              np.einsum(f"{inp},{out}->{ker}", np.abs(x), np.abs(w))]
    if stock.bias is not None:
        bounds.append(np.full(np.shape(grads_ref[2]), np.abs(w).sum()))
    assert len(grads) == len(grads_ref) == len(bounds)
    for g, g_ref, b in zip(grads, grads_ref, bounds):
        assert g.shape == g_ref.shape
        np.testing.assert_array_less(np.abs(g - g_ref), 2 * _gamma(n) * b + 1e-30)


@pytest.mark.sample_axes("case")
@pytest.mark.parametrize("case", EQUATIONS, ids=_case_id)
def test_matches_stock(case):
    stock, ours, x = _pair(*case)
    assert ours.unfused_reason is None
    _check_matches_stock(stock, ours, x)


def test_every_equation_matches_stock_eagerly():
    # The quick tier's check of the whole list (test_matches_stock runs each in a tf.function).
    for i, case in enumerate(EQUATIONS):
        stock, ours, x = _pair(*case, seed=i)
        y_ref, y = stock(x), ours(x)
        assert tuple(y.shape) == tuple(y_ref.shape), case[0]
        scale = np.einsum(_expanded(case[0], x.ndim), np.abs(x), np.abs(np.asarray(stock.kernel)))
        if stock.bias is not None:
            scale = scale + np.abs(np.asarray(stock.bias))
        n = max(x.size, math.prod(stock.kernel.shape))  # at least the terms of one sum
        np.testing.assert_array_less(np.abs(np.asarray(y) - np.asarray(y_ref)),
                                     2 * _gamma(n) * scale + 1e-30, err_msg=case[0])


def test_unknown_dimensions_when_traced():
    # Batch and sequence unknown at trace time (keras-hub's generate, a retrace): the same outputs,
    # and the symbolic shapes keep what is known.
    for i in (3, 4, 19, len(EQUATIONS) - 1):
        eq, output_shape, bias_axes, shape = EQUATIONS[i]
        stock, ours, x = _pair(eq, output_shape, bias_axes, shape, seed=i)
        spec = tf.TensorSpec([None] * (len(shape) - 1) + [shape[-1]] if eq != "abc,bd->acd" else [None, 6, None])
        fn = tf.function(lambda t: ours(t), input_signature=[spec])
        out = fn.get_concrete_function().outputs[0]
        assert out.shape.rank == len(stock(x).shape)
        assert out.shape[-1] == stock(x).shape[-1], eq
        np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(stock(x)), rtol=1e-5, atol=1e-5, err_msg=eq)


@pytest.mark.parametrize(
    "eq, output_shape, bias_axes, shape",
    [
        ("btd,dnh->btnh", (None, 2, 3), "h", (2, 5, 6)),  # the bias tiled over the heads
        ("btd,dnh->btnh", (None, 2, 3), "n", (2, 5, 6)),  # (n, 1): tiled over the head dim
        ("btd,dnh->btnh", (5, 2, 3), "tnh", (2, 5, 6)),  # over the sequence too: added after the reshape
        ("abc,cd->abd", (5, 7), "b", (2, 5, 6)),  # over an input axis only
        ("abc,bd->acd", (None, 7), "d", (2, 6, 3)),  # BiasAdd on the BatchMatMulV2
        ("btd,ndh->btnh", (None, 2, 3), None, (2, 5, 6)),
    ],
)
def test_bias_axes_variants_match_stock(eq, output_shape, bias_axes, shape):
    stock, ours, x = _pair(eq, output_shape, bias_axes, shape, seed=3)
    _check_matches_stock(stock, ours, x, graph=False)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "swish"])
def test_activation_matches_stock(activation):
    stock, ours, x = _pair("btd,dnh->btnh", (None, 2, 3), "nh", (2, 5, 6), activation=activation)
    y_ref, _, grads_ref = _outputs_and_grads(stock, x)
    y, _, grads = _outputs_and_grads(ours, x)
    assert_close(y, y_ref, "float32")
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref, "float32")


@pytest.mark.sample_axes("case")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("case", [EQUATIONS[3], EQUATIONS[4], EQUATIONS[-1]], ids=_case_id)
def test_mixed_precision_matches_stock(policy, case):
    keras.mixed_precision.set_global_policy(policy)
    stock, ours, x = _pair(*case)
    y_ref, _, grads_ref = _outputs_and_grads(stock, x)
    y, _, grads = _outputs_and_grads(ours, x)
    assert keras.backend.standardize_dtype(ours(x).dtype) == policy.split("_")[1]
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in ours.weights)
    assert_close(y, y_ref, policy)
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref, policy)


def test_unsupported_equation_runs_stock_and_says_why():
    stock, ours, x = _pair("bc...,cd->bd...", (6,), "d", (2, 3, 4))
    assert "a transposed output" in ours.unfused_reason and ours.plan is None
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(stock(x)))  # stock's call itself


# ----------------------------------------------------------------------------
# LoRA.

LORA_CASE = ("btd,dnh->btnh", (None, 2, 3), "nh", (2, 5, 6))


@pytest.mark.parametrize("when", ["argument", "enable_lora"])
def test_lora_matches_stock_and_trains_only_the_adapters(when):
    if when == "argument":
        stock, ours, x = _pair(*LORA_CASE, lora_rank=2, lora_alpha=3)
    else:
        stock, ours, x = _pair(*LORA_CASE)
        stock.enable_lora(2, lora_alpha=3)
        ours.enable_lora(2, lora_alpha=3)
    a = np.random.default_rng(5).standard_normal(stock.lora_kernel_a.shape).astype("float32")
    for layer in (stock, ours):  # b starts at zero (a gets no gradient then): give both adapters values
        layer.lora_kernel_a.assign(a)
        layer.lora_kernel_b.assign(np.linspace(-1, 1, math.prod(layer.lora_kernel_b.shape), dtype="float32")
                                   .reshape(layer.lora_kernel_b.shape))
    names = [w.path.split("/")[-1] for w in ours.trainable_weights]
    assert names == [w.path.split("/")[-1] for w in stock.trainable_weights] == ["bias", "lora_kernel_a",
                                                                                 "lora_kernel_b"]
    assert not ours._kernel.trainable
    y_ref, _, grads_ref = _outputs_and_grads(stock, x)
    y, _, grads = _outputs_and_grads(ours, x)
    assert_close(y, y_ref, "float32")
    for g, g_ref in zip(grads, grads_ref):
        assert np.abs(g).max() > 0  # every trainable weight (adapters included) gets a gradient
        assert_close(g, g_ref, "float32")
    # model.fit moves the adapters and the bias, never the frozen kernel (not a trainable weight).
    model = keras.Sequential([keras.Input(x.shape[1:]), ours])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [np.asarray(v).copy() for v in (ours._kernel, ours.lora_kernel_a, ours.lora_kernel_b)]
    model.fit(x, np.zeros_like(y), epochs=1, verbose=0)
    after = [np.asarray(v) for v in (ours._kernel, ours.lora_kernel_a, ours.lora_kernel_b)]
    np.testing.assert_array_equal(before[0], after[0])
    assert not np.array_equal(before[1], after[1]) and not np.array_equal(before[2], after[2])


# ----------------------------------------------------------------------------
# int8.


def test_int8_default_config_is_stock_int8_exactly():
    # Keras' default int8 config quantizes the inputs too: stock's own int8 call runs (Einsum).
    stock, ours, x = _pair(*EQUATIONS[3])
    stock.quantize("int8")
    ours.quantize("int8")
    assert ours.quantization_mode == "int8" and "activation quantizer" in ours.unfused_reason
    for a, b in zip(stock.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(stock(x)))


def _weight_only():
    return keras.quantizers.Int8QuantizationConfig(weight_quantizer=None, activation_quantizer=None)


@pytest.mark.sample_axes("case")
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("case", [EQUATIONS[3], EQUATIONS[5], EQUATIONS[-1]], ids=_case_id)
def test_int8_weight_only_matches_stock_without_einsum(case, lora):
    stock, ours, x = _pair(*case)
    if lora:
        for layer in (stock, ours):
            layer.enable_lora(2)
            layer.lora_kernel_b.assign(np.full(layer.lora_kernel_b.shape, 0.25, "float32"))
        ours.lora_kernel_a.assign(stock.lora_kernel_a)
    stock.quantize("int8", config=_weight_only())
    ours.quantize("int8", config=_weight_only())
    assert ours.unfused_reason is None
    for a, b in zip(stock.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    y_ref, _, grads_ref = _outputs_and_grads(stock, x)
    y, _, grads = _outputs_and_grads(ours, x)
    assert_close(y, y_ref, "float32")
    assert len(grads) == len(grads_ref) == 1 + (3 if lora else 1)
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref, "float32")
    graph = tf.function(lambda t: ours(t)).get_concrete_function(tf.TensorSpec(x.shape)).graph
    ops = {op.type for op in graph.get_operations()}
    assert "Einsum" not in ops and ({"MatMul", "BatchMatMulV2"} & ops), sorted(ops)


def test_quantize_refuses_subclasses_as_stock_does():
    class Mine(FusedEinsumDense):
        pass

    layer = Mine("ab,bc->ac", 4, bias_axes="c")
    layer.build((2, 3))
    with pytest.raises(NotImplementedError):
        layer.quantize("int8")
    layer.quantize("int8", type_check=False)
    assert layer.quantization_mode == "int8"


# ----------------------------------------------------------------------------
# Config, saving, Keras checks.


def test_config_is_stocks_and_round_trips():
    kwargs = dict(equation="btd,dnh->btnh", output_shape=(None, 2, 3), bias_axes="nh", activation="gelu",
                  kernel_regularizer="l2", bias_initializer="ones", lora_rank=2, name="p")
    ours, stock = FusedEinsumDense(**kwargs), EinsumDense(**kwargs)
    assert ours.get_config() == stock.get_config()
    assert FusedEinsumDense.from_config(ours.get_config()).get_config() == ours.get_config()


def test_keras_layer_checks():
    run_layer_test(FusedEinsumDense, dict(equation="abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de",
                                          activation="relu"), (2, 5, 6), expected_output_shape=(2, 5, 2, 3),
                   expected_num_trainable_weights=2)


def test_keras_file_round_trip_lora_and_int8():
    inp = keras.Input((5, 6))
    a = FusedEinsumDense("btd,dnh->btnh", (None, 2, 3), bias_axes="nh", name="a")
    b = FusedEinsumDense("btnh,nhd->btd", (None, 6), bias_axes="d", name="b")
    model = keras.Model(inp, b(a(inp)))
    a.enable_lora(2)
    a.lora_kernel_b.assign(np.full(a.lora_kernel_b.shape, 0.5, "float32"))
    b.quantize("int8", config=_weight_only())
    x = np.random.default_rng(1).standard_normal((2, 5, 6)).astype("float32")
    ref = np.asarray(model(x))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers[1:]] == [FusedEinsumDense, FusedEinsumDense]
    assert loaded.get_layer("b").quantization_mode == "int8"
    # The LoRA update is merged into the saved kernel (as stock saves it).
    np.testing.assert_allclose(np.asarray(loaded(x)), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# The graph: no Einsum in a model.fit train step; _FusedMatMul where the fusion catalog expects it.


def _model(policy="float32"):
    keras.mixed_precision.set_global_policy(policy)
    inp = keras.Input((5, 6))
    h = FusedEinsumDense("btd,dnh->btnh", (None, 2, 3), bias_axes="nh", activation="relu", name="proj_in")(inp)
    out = FusedEinsumDense("btnh,nhd->btd", (None, 4), bias_axes="d", name="proj_out")(h)
    bmm = FusedEinsumDense("abc,bd->acd", (None, 4), bias_axes="d", name="bmm")(inp)
    model = keras.Model(inp, keras.layers.Concatenate(axis=1)([out, bmm]))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _op_types(cap):
    ops = set()
    for fg in cap.functions:
        for graph in (fg.graph, fg.pre_graph):
            ops.update(n.op for n in graph.node)
            for fdef in graph.library.function:
                ops.update(n.op for n in fdef.node_def)
    return ops


def test_train_step_has_no_einsum_and_fuses_where_the_catalog_says():
    model = _model()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5, 6)).astype("float32"), rng.standard_normal((4, 11, 4)).astype("float32")
    cap = inspect.capture_train(model, x, y)
    ops = _op_types(cap)
    assert "Einsum" not in ops and "BatchMatMulV2" in ops
    report = inspect.fusion_report(model, x, mode="train", targets=y)
    caps = devices.capabilities()
    for name in ("proj_in", "proj_out"):
        row = report.row(name)  # the catalog's expectation for this machine's capabilities, and what ran
        assert row.pattern == "matmul_bias_act" and row.status in ("fused", "partial", "not fused"), row
        if caps.backend == "cpu":  # every CPU table fuses float32 MatMul + BiasAdd (oneDNN or not)
            assert row.expected_op == fusion.FUSED_MATMUL, row
        if row.expected_op is not None:
            inspect.assert_fused(report, layer=name, op=row.expected_op, fused_ops=row.expected_fused_ops)
    assert report.row("bmm").status == "not fused" and "BatchMatMulV2" in report.row("bmm").reason


@pytest.mark.full
@pytest.mark.parametrize("policy", ["mixed_bfloat16"])
def test_train_step_bfloat16_follows_the_catalog(policy):
    caps = devices.capabilities()
    model = _model(policy)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5, 6)).astype("float32"), rng.standard_normal((4, 11, 4)).astype("float32")
    report = inspect.fusion_report(model, x, mode="train", targets=y)
    row = report.row("proj_out")
    assert row.status in ("fused", "not fused"), row
    if caps.onednn and caps.onednn_bf16:
        assert row.expected_op == fusion.FUSED_MATMUL
        inspect.assert_fused(report, layer="proj_out", op=fusion.FUSED_MATMUL, fused_ops=["BiasAdd"])
    else:
        assert row.expected_op is None and row.status == "not fused"
