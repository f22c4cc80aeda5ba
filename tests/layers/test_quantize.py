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
        if mode == "predict":
            assert report.ops_by_type.get(INT8_MATMUL) == 2
        else:  # the gradient of a non-linear activation recomputes its input with a linear op
            assert report.ops_by_type.get(INT8_MATMUL) >= 2
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


@pytest.mark.parametrize("mode", ["int4", "float8"])
def test_model_quantize_other_modes_report_keras_own_form_for_ours_and_stock(mode):
    # model.quantize(mode) with another mode: ours and stock Dense both run Keras' own form, and each row
    # says so; where that form de-quantizes and runs the float MatMul + BiasAdd, the fusion is expected
    # (no "unexpected" row).
    model = _mixed_model()
    model.quantize(mode)
    report = ti.fusion_report(model)
    assert INT8_MATMUL not in report.ops_by_type
    for name in ("ours_a", "ours_b", "stock"):
        row = report.row(name)
        assert row.status in ("fused", "not fused") and f"Keras' own {mode} form runs" in row.note, row
    assert "a stock Dense" in report.row("stock").note


def test_only_the_op_runs_no_dequantized_kernel():
    model = keras.Sequential([keras.Input((2, 5)), FusedDense(8, activation="relu"), FusedDense(3)])
    model.quantize("int8")
    report = ti.fusion_report(model)
    if not int8_ops.int8_uses_kernel("matmul"):
        assert INT8_MATMUL not in report.ops_by_type and report.ops_by_type.get("RealDiv") == 2
        return
    assert report.ops_by_type.get(INT8_MATMUL) == 2
    for op in ("Cast", "RealDiv", "MatMul", "BatchMatMulV3", "_FusedMatMul", "BiasAdd", "Relu"):
        assert op not in report.ops_by_type, op


# ----------------------------------------------------------------------------
# FusedDense: errors.


def test_dense_quantize_errors():
    layer = FusedDense(3)
    with pytest.raises(ValueError, match="isn't yet built"):
        layer.quantize("int8")
    layer.build((None, 4))
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        layer.quantize("int7")
    assert layer.quantization_mode is None and layer._kernel.dtype == "float32"
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


def _custom_activation_quantizer():
    return keras.quantizers.Int8QuantizationConfig(
        activation_quantizer=keras.quantizers.AbsMaxQuantizer(value_range=(-5, 5)))


def _custom_weight_quantizer():
    return keras.quantizers.Int8QuantizationConfig(
        weight_quantizer=keras.quantizers.AbsMaxQuantizer(axis=0, value_range=(-100, 100)), activation_quantizer=None)


KERAS_FORMS = [
    pytest.param("int4", None, "quantization mode 'int4'", id="int4"),
    pytest.param("float8", None, "quantization mode 'float8'", id="float8"),
    pytest.param("int8", _custom_activation_quantizer, "int8 with an activation quantizer",
                 id="int8-activation_quantizer"),
    pytest.param("int8", _custom_weight_quantizer, "weight quantizer other than Keras' default",
                 id="int8-weight_quantizer"),
]


@pytest.mark.parametrize("mode, config, reason", KERAS_FORMS)
def test_dense_modes_without_a_fused_form_run_keras_own(mode, config, reason):
    """A drop-in refuses nothing: what the fused int8 form does not run is Keras' own form, as stock Dense runs it,
    and the fusion report says which form ran and why."""
    ours, stock = _built_pair(units=6, in_dim=5, activation="relu")
    for layer in (ours, stock):
        layer.quantize(mode, config=config() if config else None)
    assert ours.quantization_mode == stock.quantization_mode
    assert [(v.path.split("/")[-1], v.dtype) for v in ours.weights] == [
        (v.path.split("/")[-1], v.dtype) for v in stock.weights]
    for a, b in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    x = np.random.default_rng(3).normal(size=(4, 5)).astype("float32")
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(stock(x)))
    model = keras.Sequential([keras.Input((5,)), ours])
    report = ti.fusion_report(model)
    row = report.row(ours.name)
    # Keras' form may de-quantize the kernel and run the float MatMul + bias + relu, which can fuse.
    assert row.status in ("fused", "not fused"), row
    assert f"Keras' own {mode} form runs" in row.note and reason in row.note
    assert INT8_MATMUL not in report.ops_by_type
    # The config and the stores round-trip as stock Dense's do.
    back = FusedDense.from_config(ours.get_config())
    assert back.quantization_mode == mode
    store = {}
    ours.save_own_variables(store)
    back.build((None, 5))
    back.load_own_variables(store)
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(stock(x)))


def _gptq_config():
    return keras.quantizers.GPTQConfig(dataset=None, tokenizer=None, weight_bits=4, group_size=4)


def _awq_config():
    return keras.quantizers.AWQConfig(dataset=None, tokenizer=None, group_size=4, num_grid_points=10)


@pytest.mark.parametrize("mode, config", [("gptq", _gptq_config), ("awq", _awq_config)], ids=["gptq", "awq"])
def test_dense_calibrated_modes_take_keras_own_form(mode, config):
    # GPTQ and AWQ: layer.quantize(mode, config) prepares Keras' own form (model.quantize then calibrates it
    # through Keras' isinstance(layer, Dense) walk, which FusedDense, a Dense subclass, takes part in):
    # the same variables, config and stores as stock Dense, and the report names the form.
    ours, stock = _built_pair(units=8, in_dim=8, activation="relu")
    for layer in (ours, stock):
        layer.quantize(mode, config=config())
    assert ours.quantization_mode == stock.quantization_mode == mode
    assert [(v.path.split("/")[-1], v.shape, v.dtype) for v in ours.weights] == [
        (v.path.split("/")[-1], v.shape, v.dtype) for v in stock.weights]
    back = FusedDense.from_config(ours.get_config())
    back.build((None, 8))
    assert back.quantization_mode == mode and isinstance(back, keras.layers.Dense)
    store_ours, store_stock = {}, {}
    ours.save_own_variables(store_ours)
    stock.save_own_variables(store_stock)
    assert sorted(store_ours) == sorted(store_stock)
    # Before calibration Keras' own form does not load its own store back (Keras 3.15: one variable short);
    # ours does what stock does.
    stock_back = keras.layers.Dense.from_config(stock.get_config())
    stock_back.build((None, 8))
    outcomes = []
    for layer, store in ((back, store_ours), (stock_back, store_stock)):
        try:
            layer.load_own_variables(store)
            outcomes.append("loaded")
        except ValueError as e:
            outcomes.append(str(e).split(" expected ", 1)[1])
    assert outcomes[0] == outcomes[1], outcomes
    report = ti.fusion_report(keras.Sequential([keras.Input((8,)), ours]))
    note = report.row(ours.name).note
    assert f"Keras' own {mode} form runs" in note and INT8_MATMUL not in report.ops_by_type


def test_dense_default_int8_runs_the_fused_form_not_keras_own():
    ours, _ = _built_pair(units=6, in_dim=5, activation="relu")
    ours.quantize("int8")
    assert ours._tfm_int8 and ours.inputs_quantizer is None
    ours, _ = _built_pair(units=6, in_dim=5, activation="relu")
    ours.quantize("int8", config=_weight_only())
    assert ours._tfm_int8
    # Built from an int8_from_* policy with a config the fused form does not run: Keras' own form.
    layer = FusedDense(4, dtype="int8_from_float32", quantization_config=_custom_activation_quantizer())
    layer.build((None, 3))
    assert not layer._tfm_int8 and layer.inputs_quantizer is not None


# ----------------------------------------------------------------------------
# FusedConv2D / FusedDepthwiseConv2D.

from tfmetal_ext.layers import FusedConv2D, FusedDepthwiseConv2D  # noqa: E402


def _np_pad(x, k, s, d, padding):
    """NHWC input padded by TF's rules; returns (padded, out_h, out_w)."""
    h, w = x.shape[1:3]
    outs, pads = [], []
    for size, kk, ss, dd in ((h, k[0], s[0], d[0]), (w, k[1], s[1], d[1])):
        ek = (kk - 1) * dd + 1
        if padding == "valid":
            out = (size - ek) // ss + 1
            pads.append((0, 0))
        else:
            out = -(-size // ss)
            total = max((out - 1) * ss + ek - size, 0)
            pads.append((total // 2, total - total // 2))
        outs.append(out)
    return np.pad(x, ((0, 0), pads[0], pads[1], (0, 0))), outs[0], outs[1]


def np_conv2d(x, w, bias, strides, padding, dilation, act):
    x = np.asarray(x, np.float64)
    kh, kw = w.shape[:2]
    xp, oh, ow = _np_pad(x, (kh, kw), strides, dilation, padding)
    y = np.zeros((x.shape[0], oh, ow, w.shape[-1]))
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilation[0], j * dilation[1]
            patch = xp[:, r0:r0 + (oh - 1) * strides[0] + 1:strides[0], c0:c0 + (ow - 1) * strides[1] + 1:strides[1], :]
            y += patch @ w[i, j]
    if bias is not None:
        y = y + bias
    return NP_ACTS[act](y)


def np_depthwise(x, w, bias, strides, padding, act):
    kh, kw, cin, dm = w.shape
    full = np.zeros((kh, kw, cin, cin * dm))
    for c in range(cin):
        full[:, :, c, c * dm:(c + 1) * dm] = w[:, :, c, :]
    return np_conv2d(x, full, bias, strides, padding, (1, 1), act)


CONV_CASES = [
    dict(filters=4, kernel_size=3, padding="same", activation="relu"),
    dict(filters=5, kernel_size=3, strides=2, padding="valid"),
    dict(filters=3, kernel_size=(2, 3), dilation_rate=2, padding="same", activation="tanh"),
    dict(filters=6, kernel_size=1, activation="relu"),  # 1x1 stride 1: an Int8MatMul
    dict(filters=2, kernel_size=3, activation="sigmoid", use_bias=False),
]


def _random_conv(cls, kwargs, shape, seed):
    layer = cls(**kwargs)
    layer.build(shape)
    rng = np.random.default_rng(seed)
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.weights])
    return layer


@pytest.mark.parametrize("kwargs", CONV_CASES)
def test_conv2d_matches_numpy_and_the_float_layer(kwargs):
    x = np.random.default_rng(30).normal(size=(2, 7, 6, 3)).astype("float32")
    layer = _random_conv(FusedConv2D, kwargs, x.shape, 31)
    y_float = np.asarray(layer(x))
    w = layer._kernel.numpy()
    layer.quantize("int8")
    q, scale = np_quantize(w, (0, 1, 2))
    np.testing.assert_array_equal(layer._kernel.numpy(), q)
    np.testing.assert_array_equal(layer.kernel_scale.numpy(), scale.reshape(-1))
    strides = layer.strides
    want = np_conv2d(
        x, q.astype(np.float64) / scale.astype(np.float64), layer.bias.numpy() if layer.use_bias else None,
        strides, layer.padding, layer.dilation_rate, kwargs.get("activation") or "linear",
    )
    y = np.asarray(layer(x))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # Half a step per weight: |dy| <= sum |x| * 0.5 / scale over each window (bounded by all of x).
    assert np.max(np.abs(y - y_float)) <= np.sum(np.abs(x[0])) * np.max(0.5 / scale) + 1e-5


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, depth_multiplier=2, padding="same", activation="relu"),
                                    dict(kernel_size=2, strides=2, activation="linear")])
def test_depthwise_matches_numpy(kwargs):
    x = np.random.default_rng(32).normal(size=(2, 6, 6, 3)).astype("float32")
    layer = _random_conv(FusedDepthwiseConv2D, kwargs, x.shape, 33)
    w = layer.kernel.numpy()
    layer.quantize("int8")
    q, scale = np_quantize(w, (0, 1))
    np.testing.assert_array_equal(layer.kernel.numpy(), q)
    np.testing.assert_array_equal(layer._kernel.numpy(), q)
    dm = layer.depth_multiplier
    assert layer.kernel_scale.shape == (3 * dm,)
    np.testing.assert_array_equal(layer.kernel_scale.numpy(), scale.reshape(-1))
    want = np_depthwise(x, q.astype(np.float64) / scale.astype(np.float64), layer.bias.numpy(), layer.strides,
                        layer.padding, kwargs["activation"])
    np.testing.assert_allclose(np.asarray(layer(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls,kwargs", [(FusedConv2D, dict(filters=4, kernel_size=3)),
                                        (FusedDepthwiseConv2D, dict(kernel_size=3, depth_multiplier=2))])
def test_conv_variables_policy_and_store_order(cls, kwargs):
    layer = _random_conv(cls, kwargs, (1, 5, 5, 3), 34)
    layer.quantize("int8")
    rows = _var_rows(layer)
    channels = kwargs.get("filters", 3 * kwargs.get("depth_multiplier", 1))
    assert sorted(rows) == sorted([("bias", "float32", True, (channels,)),
                                   ("kernel", "int8", False, tuple(layer._kernel.shape)),
                                   ("kernel_scale", "float32", False, (channels,))])
    assert layer.dtype_policy.name == "int8_from_float32"
    store = {}
    layer.save_own_variables(store)
    assert [np.asarray(store[k]).dtype for k in ("0", "1", "2")] == [np.int8, np.float32, np.float32]
    assert np.asarray(store["1"]).shape == (channels,)  # kernel, bias, kernel_scale
    built = cls(dtype="int8_from_float32", **kwargs)
    built.build((1, 5, 5, 3))
    assert sorted(_var_rows(built)) == sorted(rows)
    built.load_own_variables(store)
    x = np.random.default_rng(35).normal(size=(1, 5, 5, 3)).astype("float32")
    np.testing.assert_array_equal(np.asarray(built(x)), np.asarray(layer(x)))


def _conv_model():
    inputs = keras.Input((8, 8, 3))
    h = FusedConv2D(4, 3, padding="same", activation="relu", name="conv3")(inputs)
    h = FusedDepthwiseConv2D(3, padding="same", activation="relu", name="dw")(h)
    h = FusedConv2D(6, 1, activation="relu", name="conv1")(h)
    h = keras.layers.Conv2D(4, 3, name="stock_conv")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = FusedDense(2, name="fc")(h)
    return keras.Model(inputs, outputs)


def test_model_quantize_mixes_convs_and_stock_layers(tmp_path):
    model = _conv_model()
    x = np.random.default_rng(36).normal(size=(2, 8, 8, 3)).astype("float32")
    y_float = np.asarray(model(x))
    with pytest.warns(UserWarning, match="Layer Conv2D does not have a `quantize`"):
        model.quantize("int8")  # stock Conv2D has no quantize in Keras 3.15: skipped with Keras' warning
    modes = {l.name: l.quantization_mode for l in model.layers}
    assert modes["stock_conv"] is None
    assert all(modes[n] == "int8" for n in ("conv3", "dw", "conv1", "fc"))
    y = np.asarray(model(x))
    assert np.max(np.abs(y - y_float)) < 0.05 * (np.max(np.abs(y_float)) + 1)
    path = str(tmp_path / "convs.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(x)), y)
    report = ti.fusion_report(model)
    if int8_ops.int8_uses_kernel("conv2d"):
        assert report.ops_by_type.get(INT8_CONV2D) == 1
    if int8_ops.int8_uses_kernel("matmul"):
        assert report.ops_by_type.get(INT8_MATMUL) == 2  # the 1x1 conv and the dense
    for name, op, kind in (("conv3", INT8_CONV2D, "conv2d"), ("conv1", INT8_MATMUL, "matmul"),
                           ("fc", INT8_MATMUL, "matmul")):
        row = report.row(name)
        if int8_ops.int8_uses_kernel(kind) and op in catalog.FUSED_LAYER_OPS:
            assert (row.status, row.actual_op) == ("fused", op), name
        else:
            assert row.status != "missed" and "reference" in row.reason, name
    assert report.row("dw").status != "missed"


def test_conv_gradients_and_fit():
    model = keras.Sequential([keras.Input((6, 6, 2)), FusedConv2D(3, 3, activation="tanh", name="c"),
                              FusedDepthwiseConv2D(2, name="d"), keras.layers.Flatten(), FusedDense(1)])
    model.quantize("int8")
    conv = model.get_layer("c")
    x = tf.constant(np.random.default_rng(37).normal(size=(2, 6, 6, 2)).astype("float32"))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = conv(x, training=True)
        loss = tf.reduce_sum(y)
    dx, dbias = tape.gradient(loss, [x, conv.bias])
    w = tf.constant((conv._kernel.numpy() / conv.kernel_scale.numpy()).astype("float32"))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss_ref = tf.reduce_sum(tf.tanh(tf.nn.conv2d(x, w, 1, "VALID") + conv.bias))
    dx_ref, dbias_ref = tape.gradient(loss_ref, [x, conv.bias])
    np.testing.assert_allclose(dx.numpy(), dx_ref.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbias.numpy(), dbias_ref.numpy(), rtol=1e-4, atol=1e-4)
    assert sorted(v.name for v in model.trainable_weights) == ["bias", "bias", "bias"]
    kernels = [v.numpy().copy() for v in model.non_trainable_weights]
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(38)
    history = model.fit(rng.normal(size=(8, 6, 6, 2)), rng.normal(size=(8, 1)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    for v, k in zip(model.non_trainable_weights, kernels):
        np.testing.assert_array_equal(v.numpy(), k)


def test_conv_quantize_errors():
    grouped = FusedConv2D(4, 3, groups=2)
    grouped.build((1, 6, 6, 4))
    with pytest.raises(NotImplementedError, match="groups=2"):
        grouped.quantize("int8")
    first = FusedConv2D(4, 3, data_format="channels_first")
    first.build((1, 3, 6, 6))
    with pytest.raises(NotImplementedError, match="channels_first"):
        first.quantize("int8")
    lora = FusedConv2D(4, 3, lora_rank=2)
    lora.build((1, 6, 6, 3))
    with pytest.raises(NotImplementedError, match="LoRA"):
        lora.quantize("int8")
    conv = FusedConv2D(4, 3)
    with pytest.raises(ValueError, match="isn't yet built"):
        conv.quantize("int8")
    conv.build((1, 6, 6, 3))
    # Stock Keras convs have no quantization: what the weight-only form does not run is refused as a stock
    # conv refuses it (NotImplementedError; model.quantize skips the layer with Keras' warning).
    with pytest.raises(NotImplementedError, match="'int8'"):
        conv.quantize("int4")
    with pytest.raises(NotImplementedError, match="no int8 form of this layer to fall back to"):
        conv.quantize("int8", config=keras.quantizers.Int8QuantizationConfig(
            activation_quantizer=keras.quantizers.AbsMaxQuantizer(value_range=(-3, 3))))
    assert conv.quantization_mode is None
    conv.quantize("int8")
    with pytest.raises(ValueError, match="is already quantized"):
        conv.quantize("int8")
    with pytest.raises(NotImplementedError, match="groups=2"):
        FusedConv2D(4, 3, groups=2, dtype="int8_from_float32").build((1, 6, 6, 4))
    model = keras.Sequential([keras.Input((6, 6, 4)), FusedConv2D(4, 3, groups=2), keras.layers.Flatten(),
                              FusedDense(2)])
    with pytest.warns(UserWarning, match="groups=2"):
        model.quantize("int8")  # Keras skips the layer whose quantize raises NotImplementedError
    assert [l.quantization_mode for l in model.layers] == [None, None, "int8"]

    class Sub(FusedDepthwiseConv2D):
        pass

    sub = Sub(3)
    sub.build((1, 6, 6, 2))
    with pytest.raises(NotImplementedError):
        sub.quantize("int8")
    sub.quantize("int8", type_check=False)
    assert sub.quantization_mode == "int8"


def test_avoid_fusions_runs_the_reference_with_the_reason():
    import tfmetal_ext

    model = _conv_model()
    model.quantize("int8")
    x = np.random.default_rng(40).normal(size=(2, 8, 8, 3)).astype("float32")
    y_op = np.asarray(model(x))
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["int8_matmul", "int8_conv2d"])
        report = ti.fusion_report(model)
        assert INT8_MATMUL not in report.ops_by_type and INT8_CONV2D not in report.ops_by_type
        for name in ("conv3", "conv1", "fc"):
            assert "avoid_fusions" in report.row(name).reason, name
        traced = tf.function(model)  # traced while avoided: the reference form
        np.testing.assert_allclose(np.asarray(traced(x)), y_op, rtol=1e-5, atol=1e-5)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())


@pytest.mark.parametrize("cls,kwargs", [(FusedConv2D, dict(filters=4, kernel_size=3, padding="same")),
                                        (FusedConv2D, dict(filters=4, kernel_size=1)),
                                        (FusedDepthwiseConv2D, dict(kernel_size=3))])
def test_conv_mixed_bfloat16(cls, kwargs):
    layer = cls(dtype="mixed_bfloat16", **kwargs)
    layer.build((2, 6, 6, 3))
    layer.quantize("int8")
    assert layer.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert keras.backend.standardize_dtype(layer.kernel_scale.dtype) == "float32"
    x = np.random.default_rng(41).normal(size=(2, 6, 6, 3)).astype("float32")
    y = layer(x)
    assert y.dtype == tf.bfloat16
    float_layer = cls(**kwargs)
    float_layer.build((2, 6, 6, 3))
    q = layer._kernel.numpy().astype(np.float32)
    scale = layer.kernel_scale.numpy().reshape(q.shape[-2:] if cls is FusedDepthwiseConv2D else q.shape[-1:])
    float_layer.set_weights([q / scale, layer.bias.numpy()])
    xb = np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float32))
    want = np.asarray(float_layer(xb))
    np.testing.assert_allclose(np.asarray(tf.cast(y, tf.float32)), want, rtol=3e-2, atol=3e-2 * np.max(np.abs(want)))


def test_dense_other_activation_rank3_lora_and_sparse_inputs():
    ours, _ = _built_pair(activation="silu", seed=50)
    ours.enable_lora(2)
    ours.quantize("int8")
    rng = np.random.default_rng(51)
    ours.lora_kernel_b.assign(rng.normal(size=ours.lora_kernel_b.shape).astype("float32"))
    a, b = ours.lora_kernel_a.numpy().astype(np.float64), ours.lora_kernel_b.numpy().astype(np.float64)
    w = ours._kernel.numpy().astype(np.float64) / ours.kernel_scale.numpy() + a @ b
    x = rng.normal(size=(2, 3, 5)).astype("float32")
    z = x.astype(np.float64) @ w + ours.bias.numpy()
    np.testing.assert_allclose(np.asarray(ours(x)), z / (1 + np.exp(-z)), rtol=1e-4, atol=1e-4)
    dense_x = np.where(rng.random((4, 5)) < 0.5, 0, rng.normal(size=(4, 5))).astype("float32")
    sparse = tf.sparse.from_dense(dense_x)
    np.testing.assert_allclose(np.asarray(ours(sparse)), np.asarray(ours(dense_x)), rtol=1e-5, atol=1e-5)
