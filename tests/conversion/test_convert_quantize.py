"""tfmetal_ext.convert(model, inference=True, quantize="int8"): the int8 deployment form, checked.

The reference is independent of the code under test: the float inference form (convert without
quantize) with each quantized kernel replaced by its abs-max int8 round trip written here in
numpy (q = clip(round(w * 127 / (max|w| + eps)), -127, 127), w' = q / scale), and byte counts
from the layer shapes.
"""

import numpy as np
import pytest
import keras

import tfmetal_ext
from tfmetal_ext import conversion
from tfmetal_ext.conversion import quantize as Q
from tfmetal_ext import layers as fl

L = keras.layers


def _x(shape, seed=0, batch=2):
    return np.random.default_rng(seed).standard_normal((batch,) + tuple(shape)).astype("float32")


def _np(t):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")), dtype="float64")


def _randomize_bn(model, seed=1):
    """Moving statistics and affine weights that make folding matter."""
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.5, 1.5, n))
            layer.beta.assign(rng.normal(0, 0.3, n))
            layer.moving_mean.assign(rng.normal(0, 0.3, n))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n))


def _round_trip(w, axes):
    """numpy abs-max int8 round trip of `w`, one scale per entry of the axes not in `axes`."""
    w = np.asarray(w, dtype="float64")
    scale = 127.0 / (np.max(np.abs(w), axis=axes, keepdims=True) + 1e-7)
    return np.clip(np.round(w * scale), -127, 127) / scale


def _dequantized_twin(stock, axes_of, **kw):
    """The float inference form of `stock` with the kernels `axes_of(layer)` names replaced by their
    int8 round trip (`axes_of` returns (variable, axes) or None)."""
    twin = tfmetal_ext.convert(stock, inference=True, count_ops=False, **kw)
    for layer in twin._flatten_layers(include_self=False, recursive=True):
        spec = axes_of(layer)
        if spec is not None:
            var, axes = spec
            var.assign(_round_trip(_np(var), axes).astype("float32"))
    return twin


def _axes_of(layer):
    if isinstance(layer, L.Embedding):
        return layer.embeddings, (1,)
    if isinstance(layer, L.DepthwiseConv2D):
        return layer.kernel, (0, 1)
    if isinstance(layer, L.Conv2D) and layer.groups == 1:
        return layer.kernel, (0, 1, 2)
    if isinstance(layer, (L.Dense, tfmetal_ext.layers.FusedDense)):
        return layer.kernel, (0,)
    return None


def _assert_close(a, b, rtol):
    a, b = _np(a), _np(b)
    assert a.shape == b.shape
    np.testing.assert_allclose(b, a, rtol=0, atol=rtol * max(float(np.max(np.abs(a))), 1e-6))


def _conv_bn_dense():
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(6, 3, padding="same", name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(x)
    x = L.DepthwiseConv2D(3, name="dw")(x)
    x = L.BatchNormalization(name="dw_bn")(x)
    x = L.GlobalAveragePooling2D(name="pool")(x)
    out = L.Dense(4, name="head")(x)
    model = keras.Model(inp, out, name="conv_bn_dense")
    _randomize_bn(model)
    return model


def test_bad_arguments_are_refused_with_the_value():
    model = _conv_bn_dense()
    with pytest.raises(ValueError, match=r"Received: quantize='int4'"):
        tfmetal_ext.convert(model, inference=True, quantize="int4")
    with pytest.raises(ValueError, match=r"Received: quantize=True"):
        tfmetal_ext.convert(model, inference=True, quantize=True)
    with pytest.raises(ValueError, match=r"needs inference=True.*deployment form.*Received: quantize='int8', "
                                         r"inference=False"):
        tfmetal_ext.convert(model, quantize="int8")
    with pytest.raises(ValueError, match=r"in_place=True"):
        tfmetal_ext.convert(model, inference=True, quantize="int8", in_place=True)


def test_conv_bn_dense_matches_the_numpy_round_trip_of_the_folded_kernels():
    stock = _conv_bn_dense()
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    report = new.conversion_report
    quantized = {q.name: q for q in report.quantized}
    assert set(quantized) == {"conv", "dw", "head"}, report
    for name in quantized:
        assert new.get_layer(name).quantization_mode == "int8"
    # The int8 model computes the folded float model with round-tripped kernels (float activations).
    x = _x((8, 8, 3), batch=3)
    twin = _dequantized_twin(stock, _axes_of)
    _assert_close(twin(x), new(x), 1e-5)
    # ... and differs from the float one by a quantization error, not by nothing.
    float_form = tfmetal_ext.convert(stock, inference=True, count_ops=False)
    diff = float(np.max(np.abs(_np(float_form(x)) - _np(new(x)))))
    assert 0 < diff < 0.05 * float(np.max(np.abs(_np(float_form(x)))))
    # Per layer: within the half-step bound, with a non-zero error.
    for q in report.quantized:
        assert q.bound is not None and q.bound_ratio <= 1.0 and q.max_abs_error > 0, q
        assert 0 < q.max_rel_error < 0.05, q
    assert 0 < report.max_quantized_output_diff <= report.quantized_output_tolerance == Q.output_tolerance(3)


def test_weight_bytes_per_layer_and_in_total():
    stock = _conv_bn_dense()
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False, verify=False)
    report = new.conversion_report
    q = {r.name: r for r in report.quantized}
    # float32 before: kernel + bias; after: int8 kernel + float32 scale per output channel + bias.
    expect = {
        "conv": (3 * 3 * 3 * 6 * 4 + 6 * 4, 3 * 3 * 3 * 6 + 6 * 4 + 6 * 4),
        "dw": (3 * 3 * 6 * 4 + 6 * 4, 3 * 3 * 6 + 6 * 4 + 6 * 4),
        "head": (6 * 4 * 4 + 4 * 4, 6 * 4 + 4 * 4 + 4 * 4),
    }
    assert {n: (r.bytes_before, r.bytes_after) for n, r in q.items()} == expect
    assert report.quantized_bytes_before == sum(b for b, _ in expect.values())
    assert report.quantized_bytes_after == sum(a for _, a in expect.values())
    # Nothing else has weights once the batch norms are folded: the model totals are the same sums.
    assert (report.weight_bytes_before, report.weight_bytes_after) == (
        report.quantized_bytes_before, report.quantized_bytes_after)
    text = str(report)
    assert "quantized int8 (weight-only, float activations): 3 layers" in text
    assert f"{expect['conv'][0]} B -> {expect['conv'][1]} B" in text
    assert q["conv"].max_abs_error is None  # verify=False: nothing measured
    d = report.to_dict()
    assert d["quantize"] == "int8" and len(d["quantized"]) == 3


@keras.saving.register_keras_serializable(package="test_convert_quantize")
class ConvBlock(L.Layer):
    """keras.io style: Conv2D + BatchNormalization + ReLU in a block of its own."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = L.Conv2D(filters, 3, padding="same", name="conv")
        self.bn = L.BatchNormalization(name="bn")
        self.act = L.ReLU(name="act")

    def call(self, x, training=False):
        return self.act(self.bn(self.conv(x), training=training))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


@keras.saving.register_keras_serializable(package="test_convert_quantize")
class SmallNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block_1 = ConvBlock(4, name="block_1")
        self.block_2 = ConvBlock(6, name="block_2")
        self.pool = L.GlobalAveragePooling2D(name="pool")
        self.head = L.Dense(3, activation="relu", name="head")

    def call(self, x, training=False):
        return self.head(self.pool(self.block_2(self.block_1(x, training=training), training=training)))


def test_subclassed_model_quantizes_its_sublayers_and_lists_the_rest():
    stock = SmallNet(name="small_net")
    stock(_x((8, 8, 3)))
    _randomize_bn(stock)
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    report = new.conversion_report
    assert [q.name for q in report.quantized] == ["block_1/conv", "block_2/conv", "head"], report
    # Inside a subclass nothing is folded: its batch norms stay (float) and are said not to be quantized.
    skipped = {k.name: k for k in report.quantize_skipped}
    assert set(skipped) == {"block_1/bn", "block_2/bn"}
    assert all("no int8 form" in k.reason for k in skipped.values())
    assert new.block_1.conv.quantization_mode == "int8" and new.head.quantization_mode == "int8"
    assert all(q.bound_ratio <= 1.0 for q in report.quantized)
    x = _x((8, 8, 3), seed=3)
    twin = _dequantized_twin(stock, _axes_of)
    _assert_close(twin(x), new(x), 1e-5)
    assert "not quantized:" in str(report) and "block_1/bn" in str(report)


def test_embedding_model():
    inp = keras.Input((6,), dtype="int32")
    x = L.Embedding(30, 8, name="emb")(inp)
    x = L.GlobalAveragePooling1D(name="pool")(x)
    out = L.Dense(4, activation="tanh", name="head")(x)
    stock = keras.Model(inp, out)
    tokens = np.random.default_rng(0).integers(0, 30, size=(4, 6)).astype("int32")
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False, inputs=tokens)
    report = new.conversion_report
    q = {r.name: r for r in report.quantized}
    assert set(q) == {"emb", "head"}
    assert (q["emb"].bytes_before, q["emb"].bytes_after) == (30 * 8 * 4, 30 * 8 + 30 * 4)
    assert q["emb"].bound_ratio <= 1.0 and q["head"].bound_ratio <= 1.0
    twin = _dequantized_twin(stock, _axes_of, inputs=tokens)
    _assert_close(twin(tokens), new(tokens), 1e-5)


def test_an_einsum_dense_quantizes_weight_only():
    # EinsumDense becomes FusedEinsumDense, then takes Keras' int8 weights, inputs left float.
    inp = keras.Input((5, 8))
    x = L.EinsumDense("abc,cd->abd", (5, 6), bias_axes="d", name="ein")(inp)
    stock = keras.Model(inp, x)
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    layer = new.get_layer("ein")
    assert type(layer) is fl.FusedEinsumDense and layer.quantization_mode == "int8"
    assert layer.unfused_reason is None  # the weight-only int8 product, no Einsum
    assert layer.inputs_quantizer is None  # weight-only: Keras' default would quantize the inputs too
    w = _np(stock.get_layer("ein").kernel)
    x = _x((5, 8))
    ref = np.einsum("abc,cd->abd", _np(x), _round_trip(w, (0,))) + _np(stock.get_layer("ein").bias)
    _assert_close(ref, layer(x), 1e-5)
    assert new.conversion_report.quantized[0].bound_ratio <= 1.0


def test_a_stock_dense_quantizes_weight_only():
    # The converter replaces Dense, but a stock one it meets (a kept layer's sublayer) takes Keras' int8
    # without the on-the-fly input quantizer.
    layer = L.Dense(5, activation="relu")
    x = _x((7,), batch=4)
    layer(x)
    w, b = _np(layer.kernel), _np(layer.bias)
    assert Q._quantize_layer(layer) is None
    assert layer.quantization_mode == "int8" and layer.inputs_quantizer is None
    _assert_close(np.maximum(_np(x) @ _round_trip(w, (0,)) + b, 0), layer(x), 1e-6)
    assert "no int8 form" in Q._quantize_layer(L.LayerNormalization())


def test_a_wrong_scale_fails_verification_naming_the_layer(monkeypatch):
    real = Q._quantize_layer

    def wrong_scale(layer):
        why = real(layer)
        if why is None and layer.name == "head":
            layer.kernel_scale.assign(_np(layer.kernel_scale) * 1.05)  # 5 % off: beyond half a step
        return why

    monkeypatch.setattr(Q, "_quantize_layer", wrong_scale)
    with pytest.raises(conversion.VerificationError, match=r"head \[FusedDense\]: max error .* its bound") as e:
        tfmetal_ext.convert(_conv_bn_dense(), inference=True, quantize="int8", count_ops=False)
    rows = {r.name: r for r in e.value.report.quantized}
    assert rows["head"].bound_ratio > 1.0 and rows["conv"].bound_ratio <= 1.0


def test_grouped_convs_are_left_float_with_the_reason():
    inp = keras.Input((6, 6, 4))
    x = L.Conv2D(4, 3, groups=2, name="stock_grouped")(inp)  # the converter keeps it (stock Conv2D)
    x = tfmetal_ext.layers.FusedConv2D(4, 1, groups=2, name="fused_grouped")(x)  # its int8 form refuses groups
    x = L.Conv2D(3, 1, name="pointwise")(x)
    stock = keras.Model(inp, x)
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    report = new.conversion_report
    assert [q.name for q in report.quantized] == ["pointwise"]
    skipped = {k.name: k.reason for k in report.quantize_skipped}
    assert set(skipped) == {"stock_grouped", "fused_grouped"}
    assert "no int8 form (Conv2D has no quantize())" in skipped["stock_grouped"]
    assert "groups=2" in skipped["fused_grouped"]
    assert new.get_layer("fused_grouped").quantization_mode is None
    assert "fused_grouped [FusedConv2D]: quantize('int8') refused" in str(report)


def test_a_nested_model_is_quantized_through_with_paths():
    inner_in = keras.Input((6,))
    inner = keras.Model(inner_in, L.Dense(5, activation="gelu", name="fc")(inner_in), name="inner")
    inp = keras.Input((6,))
    out = L.Dense(2, name="head")(inner(inp))
    stock = keras.Model(inp, out)
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    rows = {q.name: q for q in new.conversion_report.quantized}
    assert set(rows) == {"inner/fc", "head"}
    assert new.get_layer("inner").get_layer("fc").quantization_mode == "int8"
    assert rows["inner/fc"].bound_ratio <= 1.0  # gelu: the bound times its Lipschitz constant
    x = _x((6,), batch=5)
    _assert_close(_dequantized_twin(stock, _axes_of)(x), new(x), 1e-5)


def test_mixed_bfloat16_model_passes_with_its_own_roundoff():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        stock = _conv_bn_dense()
    finally:
        keras.config.set_dtype_policy("float32")
    new = tfmetal_ext.convert(stock, inference=True, quantize="int8", count_ops=False)
    report = new.conversion_report
    assert {q.name for q in report.quantized} == {"conv", "dw", "head"}
    assert all(q.bound_ratio <= 1.0 for q in report.quantized)
    assert new.get_layer("head").compute_dtype == "bfloat16"
