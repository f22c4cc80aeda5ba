"""Keras' int8 quantization API on FusedDense, FusedConv2D and FusedDepthwiseConv2D (issue 18).

Expected values come from numpy written here (de-quantized from the stored
int8 kernel and scale, float64 contraction) and from stock Keras' quantized
Dense (bitwise the same int8 weights and scales from the same float kernel).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext.inspect as ti
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import FusedDense
from tfmetal_ext.ops import int8 as int8_ops

INT8_MATMUL = "TfmetalExt>Int8MatMul"
INT8_CONV2D = "TfmetalExt>Int8Conv2D"
EPS = keras.backend.epsilon()


def np_quantize(w, axes):
    """Keras' abs-max int8 scheme, written out: scale over `axes`, q = clip(round(w * scale))."""
    w = np.asarray(w, np.float32)
    scale = np.float32(127.0) / (np.max(np.abs(w), axis=axes, keepdims=True) + np.float32(EPS))
    return np.clip(np.round(w * scale), -127, 127).astype(np.int8), scale.astype(np.float32)


NP_ACTS = {
    "linear": lambda z: z,
    "relu": lambda z: np.maximum(z, 0),
    "tanh": np.tanh,
    "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
}


def np_dense(x, q, scale, bias, act):
    w = q.astype(np.float64) / scale.astype(np.float64)
    z = np.asarray(x, np.float64) @ w
    if bias is not None:
        z = z + bias
    return NP_ACTS[act](z)


def _built_pair(units=6, in_dim=5, activation=None, use_bias=True, seed=0, **kwargs):
    """A FusedDense and a stock Dense with the same random float weights."""
    rng = np.random.default_rng(seed)
    ours = FusedDense(units, activation=activation, use_bias=use_bias, **kwargs)
    stock = keras.layers.Dense(units, activation=activation, use_bias=use_bias, **kwargs)
    ours.build((None, in_dim))
    stock.build((None, in_dim))
    weights = [rng.normal(size=w.shape).astype("float32") for w in stock.weights]
    ours.set_weights(weights)
    stock.set_weights(weights)
    return ours, stock


def _weight_only():
    return keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)


def _var_rows(layer):
    return [(v.name, keras.backend.standardize_dtype(v.dtype), v.trainable, tuple(v.shape)) for v in layer.weights]


# ----------------------------------------------------------------------------
# FusedDense: values.


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5)])
def test_dense_matches_numpy_and_the_int8_error_bound(activation, shape):
    ours, _ = _built_pair(activation=activation)
    x = np.random.default_rng(1).normal(size=shape).astype("float32")
    y_float = np.asarray(ours(x))
    w_float = ours._kernel.numpy()
    ours.quantize("int8")
    q, scale, bias = ours._kernel.numpy(), ours.kernel_scale.numpy(), ours.bias.numpy()
    y = np.asarray(ours(x))
    assert y.shape == shape[:-1] + (6,)
    np.testing.assert_allclose(y, np_dense(x, q, scale, bias, activation), rtol=1e-5, atol=1e-5)
    # Each weight is off by at most half a step (0.5 / scale); the activations are 1-Lipschitz.
    bound = np.abs(x.astype(np.float64)) @ np.broadcast_to(0.5 / scale.astype(np.float64), w_float.shape)
    assert np.all(np.abs(y - y_float) <= bound + 1e-5)


def test_dense_quantized_weights_are_stock_keras_bitwise():
    ours, stock = _built_pair(units=7, in_dim=9, seed=3)
    ours.quantize("int8")
    stock.quantize("int8")
    np.testing.assert_array_equal(ours._kernel.numpy(), stock._kernel.numpy())
    np.testing.assert_array_equal(ours.kernel_scale.numpy(), stock.kernel_scale.numpy())


def test_dense_matches_numpy_quantization_of_the_float_kernel():
    ours, _ = _built_pair(units=4, in_dim=8, seed=5)
    w = ours._kernel.numpy()
    ours.quantize("int8")
    q, scale = np_quantize(w, 0)
    np.testing.assert_array_equal(ours._kernel.numpy(), q)
    np.testing.assert_array_equal(ours.kernel_scale.numpy(), scale[0])


def test_dense_matches_stock_weight_only_dense():
    ours, stock = _built_pair(activation="relu", seed=7)
    ours.quantize("int8")
    stock.quantize("int8", config=_weight_only())
    x = np.random.default_rng(8).normal(size=(5, 5)).astype("float32")
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(stock(x)), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# FusedDense: variables, policies, config.


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_variables_as_stock(use_bias):
    ours, stock = _built_pair(use_bias=use_bias)
    ours.quantize("int8")
    stock.quantize("int8")
    assert _var_rows(ours) == _var_rows(stock)
    assert ours.dtype_policy.name == stock.dtype_policy.name == "int8_from_float32"
    assert ours.quantization_mode == "int8" and ours.inputs_quantizer is None
    built = FusedDense(6, use_bias=use_bias, dtype="int8_from_float32")
    built.build((None, 5))
    stock_built = keras.layers.Dense(6, use_bias=use_bias, dtype="int8_from_float32")
    stock_built.build((None, 5))
    assert _var_rows(built) == _var_rows(stock_built)
    assert [v.trainable for v in built.weights if v.name == "kernel"] == [False]


def test_dense_setting_the_dtype_policy_quantizes():
    ours, stock = _built_pair()
    ours.dtype_policy = "int8_from_float32"
    stock.dtype_policy = "int8_from_float32"
    assert len(ours.variables) == 3
    np.testing.assert_array_equal(ours._kernel.numpy(), stock._kernel.numpy())


def test_dense_mixed_bfloat16_and_float16_error():
    built = FusedDense(4, dtype="int8_from_mixed_bfloat16")
    built.build((None, 3))
    assert built.compute_dtype == "bfloat16"
    assert keras.backend.standardize_dtype(built.kernel_scale.dtype) == "float32"
    assert len(built.trainable_weights) == 1 and len(built.non_trainable_weights) == 2
    layer = FusedDense(4, dtype="mixed_bfloat16")
    layer.build((None, 3))
    layer.quantize("int8")
    assert layer.dtype_policy.name == "int8_from_mixed_bfloat16"
    x = np.random.default_rng(2).normal(size=(2, 3)).astype("float32")
    y = layer(x)
    assert y.dtype == tf.bfloat16
    xb = np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float32))
    np.testing.assert_allclose(
        np.asarray(tf.cast(y, tf.float32)),
        np_dense(xb, layer._kernel.numpy(), layer.kernel_scale.numpy(), layer.bias.numpy(), "linear"),
        rtol=2e-2, atol=2e-2,
    )
    half = FusedDense(4, dtype="mixed_float16")
    half.build((None, 3))
    with pytest.raises(ValueError, match="compute_dtype='float16'"):
        half.quantize("int8")


def test_dense_config_round_trip_keeps_the_weight_only_config():
    ours, _ = _built_pair()
    ours.quantize("int8")
    config = ours.get_config()
    assert config["quantization_config"]["config"]["activation_quantizer"] is None
    again = FusedDense.from_config(config)
    assert isinstance(again.quantization_config, keras.quantizers.Int8QuantizationConfig)
    assert again.quantization_config.activation_quantizer is None
    assert again.dtype_policy.name == "int8_from_float32"


# ----------------------------------------------------------------------------
# FusedDense: saving and weight interchange with stock Dense.


def test_dense_keras_and_weights_files_round_trip(tmp_path):
    model = keras.Sequential([keras.Input((5,)), FusedDense(6, activation="relu"), FusedDense(2)])
    model.quantize("int8")
    x = np.random.default_rng(3).normal(size=(4, 5)).astype("float32")
    path = str(tmp_path / "q.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [l.quantization_mode for l in loaded.layers] == ["int8", "int8"]
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(loaded(x)))
    wpath = str(tmp_path / "q.weights.h5")
    model.save_weights(wpath)
    fresh = keras.Sequential([keras.Input((5,)), FusedDense(6, activation="relu"), FusedDense(2)])
    fresh.quantize("int8")
    fresh.load_weights(wpath)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(fresh(x)))


def test_dense_weights_interchange_with_stock_quantized_dense():
    # Same store layout (kernel, bias, kernel_scale) as stock Dense: each loads the other's.
    # (A .weights.h5 file keys layers by class name, so the store is what two classes can share.)
    x = np.random.default_rng(4).normal(size=(3, 5)).astype("float32")
    ours, stock = _built_pair(activation="relu", seed=21)
    stock.quantize("int8", config=_weight_only())
    ours.quantize("int8")
    ours._kernel.assign(np.zeros(ours._kernel.shape, "int8"))
    store = {}
    stock.save_own_variables(store)
    ours.load_own_variables(store)
    np.testing.assert_array_equal(ours._kernel.numpy(), stock._kernel.numpy())
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(stock(x)), rtol=1e-5, atol=1e-5)
    ours.bias.assign(np.arange(6, dtype="float32"))
    store = {}
    ours.save_own_variables(store)
    stock.load_own_variables(store)
    np.testing.assert_array_equal(stock.bias.numpy(), np.arange(6, dtype="float32"))
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(stock(x)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected 3 variables"):
        ours.load_own_variables({"0": store["0"], "1": store["1"]})


# ----------------------------------------------------------------------------
# FusedDense: LoRA on the quantized layer, gradients, fit.


def test_dense_lora_on_quantized_layer_as_stock(tmp_path):
    ours, stock = _built_pair(activation="relu", seed=11)
    for layer in (ours, stock):
        layer.enable_lora(2)
        layer.quantize("int8")
    assert _var_rows(ours) == _var_rows(stock)
    assert {v.name for v in ours.trainable_weights} == {"bias", "lora_kernel_a", "lora_kernel_b"}
    rng = np.random.default_rng(12)
    a = rng.normal(size=ours.lora_kernel_a.shape).astype("float32")
    b = rng.normal(size=ours.lora_kernel_b.shape).astype("float32")
    for layer in (ours, stock):
        layer.lora_kernel_a.assign(a)
        layer.lora_kernel_b.assign(b)
    x = rng.normal(size=(4, 5)).astype("float32")
    # Stock int8 Dense quantizes its inputs too: compare with numpy (the de-quantized kernel + adapters).
    w = ours._kernel.numpy().astype(np.float64) / ours.kernel_scale.numpy() + a.astype(np.float64) @ b
    want = np.maximum(x.astype(np.float64) @ w + ours.bias.numpy(), 0)
    np.testing.assert_allclose(np.asarray(ours(x)), want, rtol=1e-4, atol=1e-4)
    # Saving merges the adapters and re-quantizes, as Keras does: the stores agree.
    ours_store, stock_store = {}, {}
    ours.save_own_variables(ours_store)
    stock.save_own_variables(stock_store)
    assert sorted(ours_store) == sorted(stock_store) == ["0", "1", "2"]
    assert np.max(np.abs(ours_store["0"].astype(int) - np.asarray(stock_store["0"]).astype(int))) <= 1
    np.testing.assert_allclose(ours_store["2"], np.asarray(stock_store["2"]), rtol=1e-6)
    w_merged = ours_store["0"].astype(np.float64) / ours_store["2"]
    want = ours._kernel.numpy() / ours.kernel_scale.numpy()[None, :] + a @ b
    np.testing.assert_allclose(w_merged, want, atol=np.max(0.5 / ours_store["2"]) + 1e-6)


def test_dense_gradients_reach_inputs_bias_and_lora():
    ours, _ = _built_pair(activation="tanh", seed=13)
    ours.quantize("int8")
    x = tf.constant(np.random.default_rng(14).normal(size=(3, 5)).astype("float32"))
    dy = np.random.default_rng(15).normal(size=(3, 6)).astype("float32")
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = ours(x, training=True)
        loss = tf.reduce_sum(y * dy)
    dx, dbias = tape.gradient(loss, [x, ours.bias])
    assert [v.name for v in ours.trainable_weights] == ["bias"]
    w = ours._kernel.numpy().astype(np.float64) / ours.kernel_scale.numpy()
    z = x.numpy().astype(np.float64) @ w + ours.bias.numpy()
    dz = dy * (1 - np.tanh(z) ** 2)
    np.testing.assert_allclose(dx.numpy(), dz @ w.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbias.numpy(), dz.sum(0), rtol=1e-4, atol=1e-4)


def test_dense_fit_trains_bias_and_lora_not_the_int8_kernel():
    model = keras.Sequential([keras.Input((5,)), FusedDense(8, activation="relu", lora_rank=2), FusedDense(1)])
    model.quantize("int8")
    kernels = [l._kernel.numpy().copy() for l in model.layers]
    lora_a = model.layers[0].lora_kernel_a.numpy().copy()
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(16)
    history = model.fit(rng.normal(size=(32, 5)), rng.normal(size=(32, 1)), epochs=2, batch_size=16, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    for layer, k in zip(model.layers, kernels):
        np.testing.assert_array_equal(layer._kernel.numpy(), k)
    assert np.max(np.abs(model.layers[0].lora_kernel_a.numpy() - lora_a)) > 0


# ----------------------------------------------------------------------------
# FusedDense: model.quantize with stock layers, the executed graph.


def _mixed_model():
    inputs = keras.Input((5,))
    h = FusedDense(8, activation="relu", name="ours_a")(inputs)
    h = keras.layers.Dense(4, name="stock")(h)
    outputs = FusedDense(3, activation="gelu", name="ours_b")(h)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_model_quantize_and_the_executed_graph(mode):
    model = _mixed_model()
    model.quantize("int8")
    assert [l.quantization_mode for l in model.layers[1:]] == ["int8"] * 3
    kwargs = dict(optimizer="sgd", loss="mse") if mode == "train" else {}
    report = ti.fusion_report(model, mode=mode, **kwargs)
    if int8_ops.int8_uses_kernel("matmul"):
        assert report.ops_by_type.get(INT8_MATMUL) == 2
        if mode == "predict":
            # The stock layer de-quantizes its output (Cast, RealDiv); ours de-quantize nothing.
            assert report.ops_by_type.get("RealDiv", 0) == 1
        for name in ("ours_a", "ours_b"):
            row = report.row(name)
            if INT8_MATMUL in catalog.FUSED_LAYER_OPS:
                assert (row.status, row.actual_op) == ("fused", INT8_MATMUL)
    else:
        assert INT8_MATMUL not in report.ops_by_type
        assert report.row("ours_a").status in ("partial", "not fused")
        assert "reference" in report.row("ours_a").reason
    assert report.row("stock").status == "not fused"
    assert report.row("stock").reason == catalog.REASON_STOCK_INT8


# ----------------------------------------------------------------------------
# FusedDense: errors.


def test_dense_quantize_errors():
    layer = FusedDense(3)
    with pytest.raises(ValueError, match="isn't yet built"):
        layer.quantize("int8")
    layer.build((None, 4))
    for mode in ("int4", "float8"):
        with pytest.raises(NotImplementedError, match="'int8'"):
            layer.quantize(mode)
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        layer.quantize("int7")
    custom = keras.quantizers.Int8QuantizationConfig(
        activation_quantizer=keras.quantizers.AbsMaxQuantizer(value_range=(-5, 5))
    )
    with pytest.raises(ValueError, match="activations stay float"):
        layer.quantize("int8", config=custom)
    bad_weights = keras.quantizers.Int8QuantizationConfig(
        weight_quantizer=keras.quantizers.AbsMaxQuantizer(axis=0, value_range=(-100, 100)),
        activation_quantizer=None,
    )
    with pytest.raises(ValueError, match="Received: weight_quantizer="):
        layer.quantize("int8", config=bad_weights)
    assert layer.quantization_mode is None and layer._kernel.dtype == "float32"
    with pytest.raises(ValueError, match="activations stay float"):
        FusedDense(3, quantization_config=custom)
    layer.quantize("int8")
    with pytest.raises(ValueError, match="is already quantized"):
        layer.quantize("int8")

    class Sub(FusedDense):
        pass

    sub = Sub(3)
    sub.build((None, 4))
    with pytest.raises(NotImplementedError):
        sub.quantize("int8")
    sub.quantize("int8", type_check=False)
    assert sub.quantization_mode == "int8"
