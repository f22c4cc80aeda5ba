"""FusedDense: equivalence with keras.layers.Dense, fusion (rank 2 and > 2), Keras checks."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import FusedDense
from tfmetal_ext.testing import assert_close, outputs_and_gradients, run_layer_test


def gelu_tanh(x):
    """The stock reference for activation="gelu_approximate"."""
    return keras.activations.gelu(x, approximate=True)


# ----------------------------------------------------------------------------
# Reference: keras.layers.Dense with the same weights, both run in a tf.function
# (grappler fuses both), outputs and gradients w.r.t. input and weights.


def check_equivalence(kwargs, input_shape, policy="float32", seed=0):
    stock_kwargs = dict(kwargs)
    if kwargs.get("activation") == "gelu_approximate":
        stock_kwargs["activation"] = gelu_tanh
    ours, stock = FusedDense(**kwargs), keras.layers.Dense(**stock_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(input_shape).astype("float32")
    stock(x)
    ours.build(input_shape)
    assert [(w.name, w.shape) for w in ours.weights] == [(w.name, w.shape) for w in stock.weights]
    stock.set_weights([w + rng.standard_normal(w.shape).astype(w.dtype) * 0.1 for w in stock.get_weights()])
    ours.set_weights(stock.get_weights())
    back = keras.layers.Dense(**stock_kwargs)  # and ours -> stock
    back.build(input_shape)
    back.set_weights(ours.get_weights())
    for a, b in zip(back.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    for w in ours.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"
    for training in (True, False):
        y, grads = outputs_and_gradients(ours, x, training)
        y_ref, grads_ref = outputs_and_gradients(stock, x, training)
        assert y.shape == y_ref.shape == tuple(input_shape[:-1]) + (kwargs["units"],)
        assert_close(y, y_ref, policy)
        assert len(grads) == len(grads_ref)
        for g, g_ref in zip(grads, grads_ref):
            assert_close(g, g_ref, policy)


ACTIVATIONS = [None, "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid", "swish"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_keras_rank2(activation):
    check_equivalence(dict(units=5, activation=activation), (4, 7))


@pytest.mark.parametrize(
    "kwargs, input_shape",
    [
        (dict(units=5, activation="relu"), (3, 4, 7)),
        (dict(units=3, activation="gelu"), (2, 5, 7)),
        (dict(units=6), (2, 3, 1, 7)),
        (dict(units=4, use_bias=False, activation="tanh"), (2, 3, 7)),
        (dict(units=1, activation="sigmoid"), (5, 1)),
    ],
)
def test_matches_keras_other_shapes(kwargs, input_shape):
    check_equivalence(kwargs, input_shape)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "kwargs, input_shape",
    [(dict(units=6, activation="relu"), (4, 9)), (dict(units=5, activation="gelu"), (2, 3, 9))],
)
def test_mixed_precision_matches_keras(policy, kwargs, input_shape):
    keras.mixed_precision.set_global_policy(policy)
    check_equivalence(kwargs, input_shape, policy=policy)
    out = FusedDense(**kwargs)(np.ones(input_shape, "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]


def test_rank3_keeps_static_and_dynamic_shapes():
    layer = FusedDense(4)
    sym = layer(keras.Input((None, 6)))
    assert tuple(sym.shape) == (None, None, 4)
    assert layer.compute_output_shape((None, None, 6)) == (None, None, 4)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 6])])
    def f(x):
        y = layer(x)
        assert y.shape.as_list() == [None, None, 4]
        return y

    assert f(tf.zeros((2, 3, 6))).shape == (2, 3, 4)


# ----------------------------------------------------------------------------
# Fusion in the graph that actually ran.

# (activation, fused_ops at inference, fused_ops in training, needs oneDNN)
DENSE_FUSIONS = [
    ("relu", ["BiasAdd", "Relu"], ["BiasAdd", "Relu"], False),
    ("relu6", ["BiasAdd", "Relu6"], ["BiasAdd", "Relu6"], False),
    ("elu", ["BiasAdd", "Elu"], ["BiasAdd", "Elu"], False),
    ("leaky_relu", ["BiasAdd", "LeakyRelu"], ["BiasAdd"], False),
    (None, ["BiasAdd"], ["BiasAdd"], False),
    ("tanh", ["BiasAdd", "Tanh"], ["BiasAdd", "Tanh"], True),
    ("sigmoid", ["BiasAdd", "Sigmoid"], ["BiasAdd", "Sigmoid"], True),
    ("gelu", ["BiasAdd", "GeluExact"], ["BiasAdd"], True),
    ("gelu_approximate", ["BiasAdd", "GeluApproximate"], ["BiasAdd"], True),
]


def _branches(make_layer, shape, fusions):
    """One model, one parallel branch per activation: one capture checks them all."""
    inp = keras.Input(shape)
    outs = [make_layer(act, f"fc_{act or 'linear'}")(inp) for act, *_ in fusions]
    model = keras.Model(inp, keras.layers.Concatenate()(outs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["predict", "train"])
@pytest.mark.parametrize("shape", [(6,), (3, 6)], ids=["rank2", "rank3"])
def test_fuses(policy, mode, shape):
    caps = devices.capabilities()
    onednn = caps.onednn
    if policy == "mixed_bfloat16" and not caps.onednn_bf16:
        pytest.skip("bfloat16 MatMul fusion needs oneDNN with bfloat16 on this CPU (AVX512F or AVX_NE_CONVERT; "
                    "x86-64 Linux wheels, TF_ENABLE_ONEDNN_OPTS unset); tests/inspect/test_fusion_stock.py "
                    "checks the report's reason where it does not fuse")
    keras.mixed_precision.set_global_policy(policy)
    fusions = [f for f in DENSE_FUSIONS if onednn or not f[3]]
    model = _branches(lambda act, name: FusedDense(4, activation=act, name=name), shape, fusions)
    report = inspect.fusion_report(model, mode=mode)
    dtype = "float32" if policy == "float32" else "bfloat16"
    for act, infer_ops, train_ops, _ in fusions:
        name, want = f"fc_{act or 'linear'}", (infer_ops if mode == "predict" else train_ops)
        node = inspect.assert_fused(report, layer=name, op="_FusedMatMul", fused_ops=want)
        assert node.dtype == dtype
        row = report.row(name)
        assert row.actual_fused_ops == want
        assert row.status == ("fused" if want == infer_ops else "partial"), row
        if row.status == "partial":
            assert "pre-activation" in row.reason


def test_rank3_fuses_unlike_keras_dense():
    inp = keras.Input((3, 6))
    ours = FusedDense(4, activation="relu", name="ours")(inp)
    stock = keras.layers.Dense(4, activation="relu", name="stock")(inp)
    model = keras.Model(inp, keras.layers.Concatenate()([ours, stock]))
    report = inspect.fusion_report(model)
    inspect.assert_fused(report, layer="ours", op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])
    assert report.row("ours").status == "fused"
    assert "input rank 3" in inspect.assert_not_fused(report, "stock")
    assert report.row("stock").status == "not fused"


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_mixed_float16_on_cpu_fuses_nothing(mode):
    if devices.capabilities().cpu_fp16:
        pytest.skip("this CPU has native float16 (AVX512_FP16/AMX_FP16/AVX_NE_CONVERT): half fuses here")
    keras.mixed_precision.set_global_policy("mixed_float16")
    fusions = [f for f in DENSE_FUSIONS if f[0] in ("relu", "gelu", None)]
    report = inspect.fusion_report(_branches(lambda a, n: FusedDense(4, activation=a, name=n), (6,), fusions), mode=mode)
    # The remapper fuses nothing in half here. A train step's GELU gradient is our one op
    # (TfmetalExt>ActivationGrad, in the backward pass) where the op library is loaded.
    import importlib

    grads = [(f.op, f.layer, f.backward) for f in report.fused]
    uses_op = mode == "train" and importlib.import_module("tfmetal_ext.ops.activation_grad").uses_kernel()
    assert grads == ([(fusion.ACTIVATION_GRAD_OP, "fc_gelu", True)] if uses_op else []), grads
    for act, *_ in fusions:
        row = report.row(f"fc_{act or 'linear'}")
        assert row.status == "not fused" and row.reason == "float16 on CPU: remapper skips half"


# ----------------------------------------------------------------------------
# Keras layer checks and argument validation.


@pytest.mark.parametrize(
    "kwargs, input_shape, output_shape, n_weights",
    [
        (dict(units=3, activation="relu"), (4, 5), (4, 3), 2),
        (dict(units=2, activation="gelu_approximate", kernel_regularizer="l2", bias_constraint="non_neg"),
         (2, 3, 5), (2, 3, 2), 2),
        (dict(units=4, use_bias=False, kernel_initializer="he_normal", activity_regularizer="l1",
              kernel_constraint="max_norm"), (2, 3, 2, 5), (2, 3, 2, 4), 1),
    ],
)
def test_keras_layer_checks(kwargs, input_shape, output_shape, n_weights):
    run_layer_test(FusedDense, kwargs, input_shape, expected_output_shape=output_shape,
                   expected_num_trainable_weights=n_weights)


def test_config_is_complete_and_matches_keras():
    kwargs = dict(units=4, activation="gelu", kernel_regularizer="l2", bias_initializer="ones")
    ours = FusedDense(**kwargs).get_config()
    stock = keras.layers.Dense(**kwargs).get_config()
    assert set(stock) - {"quantization_config", "lora_rank", "lora_alpha"} <= set(ours)
    for key in ("activation", "kernel_initializer", "kernel_regularizer", "bias_initializer", "use_bias"):
        assert ours[key] == stock[key], key
    approx = FusedDense(2, activation="gelu_approximate")
    assert approx.get_config()["activation"] == "gelu_approximate"
    x = np.linspace(-3, 3, 12, dtype="float32").reshape(6, 2)
    np.testing.assert_allclose(approx.activation(x), gelu_tanh(x), rtol=1e-6)
    assert keras.saving.get_registered_name(FusedDense) == "tfmetal_ext>FusedDense"


BAD_ARGS = [
    (dict(units=0), "units"),
    (dict(units=-3), "units"),
    (dict(units="8"), "units"),
    (dict(units=True), "units"),
    (dict(units=4, activation="no_such_activation"), "activation"),
    (dict(units=4, use_bias=1), "use_bias"),
    (dict(units=4, kernel_initializer="no_such_init"), "kernel_initializer"),
    (dict(units=4, bias_regularizer="no_such_reg"), "bias_regularizer"),
    (dict(units=4, kernel_constraint="no_such_constraint"), "kernel_constraint"),
]


def test_bad_arguments():
    # Cases looped in one test: each test's teardown (clear_session) is the slow part.
    for kwargs, name in BAD_ARGS:
        with pytest.raises(ValueError) as info:
            FusedDense(**kwargs)
        assert re.search(rf"Received: {name}=[^\n]*$", str(info.value)), (kwargs, str(info.value))


def test_rejects_rank1_input():
    with pytest.raises(ValueError):
        FusedDense(3)(np.zeros((4,), "float32"))


# ----------------------------------------------------------------------------
# The rest of the stock contract: LoRA, masks, quantization_config.


def _lora_pair(units=5, in_dim=6, rank=2, alpha=None, activation="relu"):
    rng = np.random.default_rng(11)
    stock = keras.layers.Dense(units, activation=activation, name="fc")
    ours = FusedDense(units, activation=activation, name="fc")
    for layer in (stock, ours):
        layer.build((None, in_dim))
        layer.enable_lora(rank, lora_alpha=alpha)
    values = [rng.standard_normal(w.shape).astype("float32") for w in stock.weights]
    stock.set_weights(values)
    ours.set_weights(values)
    return stock, ours


def test_enable_lora_matches_keras():
    # Before: FusedDense had no enable_lora / lora_rank.
    stock, ours = _lora_pair(alpha=3.0)
    assert [(w.name, tuple(w.shape), w.trainable) for w in ours.weights] == [
        (w.name, tuple(w.shape), w.trainable) for w in stock.weights]
    assert [w.name for w in ours.trainable_weights] == ["bias", "lora_kernel_a", "lora_kernel_b"]
    assert (ours.lora_rank, ours.lora_alpha) == (stock.lora_rank, stock.lora_alpha) == (2, 3.0)
    base = stock._kernel.numpy()
    want_kernel = base + 1.5 * stock.lora_kernel_a.numpy() @ stock.lora_kernel_b.numpy()
    np.testing.assert_allclose(np.asarray(ours.kernel), want_kernel, rtol=1e-5, atol=1e-5)
    x = np.random.default_rng(12).standard_normal((4, 6)).astype("float32")
    (y, grads), (y_ref, grads_ref) = outputs_and_gradients(ours, x, True), outputs_and_gradients(stock, x, True)
    assert_close(y, y_ref, "float32")
    assert len(grads) == len(grads_ref) == 4  # x, bias, lora_kernel_a, lora_kernel_b
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, "float32")


def test_lora_fit_trains_only_the_adapters():
    _, ours = _lora_pair()
    kernel = ours._kernel.numpy().copy()
    a = ours.lora_kernel_a.numpy().copy()
    model = keras.Sequential([keras.Input((6,)), ours])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(13)
    model.fit(rng.random((16, 6)), rng.random((16, 5)), epochs=1, verbose=0)
    np.testing.assert_array_equal(ours._kernel.numpy(), kernel)
    assert np.abs(ours.lora_kernel_a.numpy() - a).max() > 0


def test_lora_rank_argument_builds_with_lora():
    run_layer_test(FusedDense, dict(units=5, activation="sigmoid", kernel_regularizer="l2", lora_rank=2),
                   (2, 3, 4), expected_output_shape=(2, 3, 5), expected_num_trainable_weights=3,
                   expected_num_non_trainable_weights=1)
    layer = FusedDense(3, lora_rank=2, lora_alpha=4)
    layer.build((None, 4))
    assert layer.lora_enabled and (layer.lora_rank, layer.lora_alpha) == (2, 4)
    config = layer.get_config()
    assert (config["lora_rank"], config["lora_alpha"]) == (2, 4)
    assert FusedDense.from_config(config).lora_rank == 2


def test_lora_errors_as_keras():
    for cls in (keras.layers.Dense, FusedDense):
        with pytest.raises(ValueError, match="incompatible with kernel constraints"):
            cls(2, kernel_constraint="max_norm").enable_lora(rank=2)
        with pytest.raises(ValueError, match="Cannot enable lora on a layer that isn't yet built"):
            cls(2).enable_lora(rank=2)
        layer = cls(2)
        layer.build((None, 2))
        layer.enable_lora(rank=2)
        with pytest.raises(ValueError, match="lora is already enabled"):
            layer.enable_lora(rank=2)


def test_lora_save_load_and_weights_interchange_with_keras(tmp_path):
    _, ours = _lora_pair()
    model = keras.Sequential([keras.Input((6,)), ours])
    x = np.random.default_rng(14).standard_normal((8, 6)).astype("float32")
    path = str(tmp_path / "lora.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.layers[0].lora_enabled
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    # The weights file holds the merged kernel, as Keras' does: a fresh non-LoRA layer reads it.
    weights = str(tmp_path / "lora.weights.h5")
    model.save_weights(weights)
    plain = keras.Sequential([keras.Input((6,)), FusedDense(5, activation="relu", name="fc")])
    plain.load_weights(weights)
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    assert len(plain.layers[0].get_weights()) == 2
    plain.save_weights(weights)  # and a plain checkpoint into the LoRA model (adapters restart at zero)
    model.load_weights(weights)
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    assert not ours.lora_kernel_a.numpy().any() and not ours.lora_kernel_b.numpy().any()


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_lora_still_fuses(mode):
    keras.mixed_precision.set_global_policy("float32")
    inp = keras.Input((6,))
    layer = FusedDense(4, activation="relu", name="fc")
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(layer(inp)))
    layer.enable_lora(2)
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    inspect.assert_fused(report, layer="fc", op="_FusedMatMul")
    assert report.row("fc").status in ("fused", "partial")


def test_masks_pass_through_as_keras():
    # Before: FusedDense dropped the mask (supports_masking was False).
    masks = []
    for cls in (keras.layers.Dense, FusedDense):
        inp = keras.Input((5, 3))
        out = cls(4)(keras.layers.Masking()(inp))
        masks.append(out._keras_mask)
    assert masks[1] is not None and tuple(masks[1].shape) == tuple(masks[0].shape)
    x = np.ones((2, 5, 3), "float32")
    x[:, 3:] = 0.0
    layer = FusedDense(4)
    mask = tf.constant(x[..., 0] != 0)
    np.testing.assert_array_equal(np.asarray(layer.compute_mask(x, mask)), np.asarray(mask))


def test_quantization_config_that_is_not_a_config_is_refused():
    # None and a keras.quantizers.Int8QuantizationConfig are accepted (tests/layers/test_quantize.py).
    FusedDense(3, quantization_config=None)
    with pytest.raises(ValueError, match="Received: quantization_config="):
        FusedDense(3, quantization_config=object())


def test_sparse_input_as_keras():
    # Before: a tf.SparseTensor input raised in tf.reshape / tf.matmul.
    x = np.random.default_rng(15).random((10, 10)).astype("float32")
    x *= x >= 0.8
    sparse = tf.sparse.from_dense(x)
    layer = FusedDense(6, activation="relu")
    out = layer(sparse)
    want = np.maximum(x @ layer.kernel.numpy() + layer.bias.numpy(), 0)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    with tf.GradientTape() as tape:
        out = layer(sparse)
    assert isinstance(tape.gradient(out, layer.kernel), tf.IndexedSlices)


# ----------------------------------------------------------------------------
# Composite activations in training: only the input kept; the gradient is one TfmetalExt>ActivationGrad.


def _hub_gelu():
    keras_utils = pytest.importorskip("keras_hub.src.utils.keras_utils", reason="keras-hub is not installed")
    return keras_utils.gelu_approximate


@pytest.mark.parametrize("activation", ["gelu", "gelu_approximate", "hub"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_recomputed_activation_gradient(activation, dtype):
    """`_contraction.recomputed` GELU (exact, tanh, keras-hub's tanh function) in a training call: the
    forward output is the plain activation's bit for bit (the same ops), and the gradient is
    ``dy * act'(x)`` against float64 numpy of the same dtype-rounded x and dy.

    Bound: the op computes act'(x) in float32 (about ten operations, each within eps32/2 relative to
    its operands, whose magnitudes are at most 1 + |x|; the erf is a float32 approximation of the
    same order) and rounds the product once to the dtype. So
    ``|got - exact| <= eps_T / 2 * |exact| + 64 * eps32 * |dy| * (1 + |x|)``, where 64 covers the
    operation count with margin; TF's own autodiff would round every step to the dtype instead."""
    from tfmetal_ext.layers import _contraction as C
    from tfmetal_ext.testing import np_activation_grad

    fn = _hub_gelu() if activation == "hub" else activation
    name = None
    if activation != "hub":
        fn, name = C.resolve_activation(fn, allow_gelu_approximate=True)
    kind = C.recomputed_name(fn, name)
    assert kind in ("gelu", "gelu_approximate")
    x = tf.cast(np.random.default_rng(2).standard_normal((64, 33)).astype("float32") * 3, dtype)
    dy = tf.cast(np.random.default_rng(3).standard_normal((64, 33)).astype("float32"), dtype)

    def run(training):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = C.apply_activation(x, fn, name, training)
        return y, tape.gradient(y, x, output_gradients=dy)

    (y, got), (y_plain, _) = run(True), run(False)
    np.testing.assert_array_equal(np.asarray(tf.cast(y, "float32")), np.asarray(tf.cast(y_plain, "float32")))
    x64, dy64 = (np.asarray(tf.cast(t, "float64")) for t in (x, dy))
    exact = dy64 * np_activation_grad(kind, x64)
    eps = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype] * 2
    bound = eps / 2 * np.abs(exact) + 64 * 2.0 ** -24 * np.abs(dy64) * (1 + np.abs(x64))
    err = np.abs(np.asarray(tf.cast(got, "float64")) - exact)
    assert np.all(err <= bound), (err - bound).max()


@pytest.mark.parametrize("activation", ["gelu", "gelu_approximate", "hub"])
def test_composite_activation_recomputed_in_training(activation):
    """In a training call FusedDense applies GELU through `recomputed`: the train step's backward pass
    reads none of the forward GELU's inner tensors (its Tanh / Erf output feeds the forward chain only,
    where TF's own gradient reads it: TanhGrad), so only the pre-activation is kept for it. Outside
    training the activation is the plain one (the single-op form the remapper fuses)."""
    act = _hub_gelu() if activation == "hub" else activation
    layer = FusedDense(16, activation=act)
    x = tf.constant(np.random.default_rng(1).standard_normal((2, 5, 8)).astype("float32"))
    layer.build(x.shape)

    def graph(training):
        def run():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x, training=training) ** 2)
            return tape.gradient(loss, [x] + layer.trainable_variables)

        return tf.function(run).get_concrete_function().graph

    trained = graph(True)
    inner_types = ("Tanh", "Erf", "Erfc")
    scope = next(op.name for op in trained.get_operations() if op.type == "MatMul").split("/")[0]
    forward = [op for op in trained.get_operations() if op.type in inner_types and op.name.startswith(f"{scope}/")]
    assert forward, [op.name for op in trained.get_operations()]
    readers = {op.name: [(c.type, c.name) for c in op.outputs[0].consumers()] for op in forward}
    assert all(c_name.startswith(f"{scope}/") and "Grad" not in c_type
               for r in readers.values() for c_type, c_name in r), readers
    assert any(op.type == "IdentityN" for op in trained.get_operations())  # the custom gradient
    plain = graph(False)
    assert not any(op.type == "IdentityN" for op in plain.get_operations())
    # TF's own gradient reads the forward inner tensor (TanhGrad of the Tanh; the exact form's
    # derivative reads the Erf(c) output's input chain): what the recomputation avoids.
    plain_forward = [op for op in plain.get_operations() if op.type in inner_types and op.name.startswith(f"{scope}/")]
    assert any(not c.name.startswith(f"{scope}/") or "Grad" in c.type
               for op in plain_forward for c in op.outputs[0].consumers()) or activation == "gelu"
