"""The conversion package's parts: the planner registry, the knowledge it reads from
`tfmetal_ext.backends.fusion`, batch-norm folding, and the converter's state."""

import warnings

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import layers as fl
from tfmetal_ext.backends import fusion
from tfmetal_ext.conversion import planners
from tfmetal_ext.conversion.rebuild import Converter
from tfmetal_ext.conversion.report import ConversionReport
from tfmetal_ext.layers.conv_bn import fold_batch_norm

L = keras.layers


def _fold_reference(kernel, bias, gamma, beta, mean, var, eps, depthwise=False):
    """Batch norm after a conv, folded, written out per output channel (float64)."""
    scale = gamma / np.sqrt(var + eps)
    if depthwise:  # (kh, kw, in, multiplier): output channel c * multiplier + m
        scale_k = scale.reshape(kernel.shape[2], kernel.shape[3])
    else:
        scale_k = scale
    return kernel * scale_k, (bias - mean) * scale + beta


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the planner registry: registrations in a test do not outlive it."""
    monkeypatch.setattr(planners, "PLANNERS", dict(planners.PLANNERS))
    return planners.PLANNERS


class _Twin(L.Layer):
    """Computes what keras.layers.Identity computes: the stand-in fused class of a new mapping."""

    def call(self, x):
        return x


def _identity_model():
    inp = keras.Input((6,), name="x")
    h = L.Dense(4, name="fc")(inp)
    h = L.Identity(name="same")(h)
    return keras.Model(inp, L.Dense(2, name="head")(h))


def test_registering_a_planner_makes_convert_use_it(registry):
    stock = _identity_model()
    before = tfmetal_ext.convert(stock, verify=False, count_ops=False)
    assert "same" in before.conversion_report.kept_names()

    @tfmetal_ext.conversion.register_planner(L.Identity)
    def _identity(ctx, node):
        layer = node.operation
        return ctx.replace([node], "_Twin", lambda: _Twin(name=layer.name), lambda new, pairs: None, "test mapping")

    new = tfmetal_ext.convert(stock, count_ops=False)
    report = new.conversion_report
    assert type(new.get_layer("same")) is _Twin
    assert report.rewrite_for("same").new_class == "_Twin" and report.rewrite_for("same").note == "test mapping"
    assert "same" not in report.kept_names() and report.verified
    # A planner that declines (None) leaves the layer to the default classification.
    registry[L.Identity] = lambda ctx, node: None
    again = tfmetal_ext.convert(stock, verify=False, count_ops=False)
    kept = {k.name: k.reason for k in again.conversion_report.kept}
    assert kept["same"] == tfmetal_ext.conversion.NO_COUNTERPART


def test_a_class_takes_one_planner(registry):
    with pytest.raises(ValueError, match="Dense already has a planner.*Received: classes="):
        planners.register_planner(L.Dense)(lambda ctx, node: None)
    assert registry[L.Dense].__name__ == "_dense"


def test_lookup_walks_the_mro_of_stock_classes_only(registry):
    class UserDense(L.Dense):
        pass

    # A user's subclass of a stock layer is not planned as its base: its call is its own.
    assert planners.planner_for(UserDense) is None
    assert planners.planner_for(L.Dense) is registry[L.Dense]
    # A stock class (defined in keras.*) finds the planner of its nearest registered base.
    StockDense = type("StockDense", (L.Dense,), {"__module__": "keras.src.layers.fake"})
    assert planners.planner_for(StockDense) is registry[L.Dense]
    # A user's class can opt in with a registration of its own.
    planners.register_planner(UserDense)(registry[L.Dense])
    assert planners.planner_for(UserDense) is registry[L.Dense]


def test_every_stock_to_fused_row_has_a_planner_and_names_the_class_it_makes():
    for stock_name, row in fusion.STOCK_TO_FUSED.items():
        stock = getattr(L, stock_name)
        assert planners.planner_for(stock) is not None, stock_name
        assert planners.fused_class(stock) is getattr(fl, row.fused)


def test_activation_sets_come_from_the_fusion_table():
    assert planners.CONV_ACTIVATIONS == fusion.CONTRACTION_ACTIVATIONS
    assert set(planners.DENSE_ACTIVATIONS) <= set(fusion.ACTIVATION_OPS)
    assert set(fusion.CONTRACTION_ACTIVATIONS) < set(planners.DENSE_ACTIVATIONS)
    for act in planners.DENSE_ACTIVATIONS:
        keras.activations.get(act)  # a stock Keras activation a stock Activation layer can carry
        assert fl.FusedDense(2, activation=act)._activation_name == act


@pytest.mark.parametrize("act", ["tanh", "sigmoid", "gelu"])
def test_dense_absorbs_the_table_activations_convs_do_not(act):
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(4, 3, name="conv")(inp)
    x = L.Activation(act, name="conv_act")(x)
    x = L.Flatten(name="flat")(x)
    x = L.Dense(4, name="fc")(x)
    out = L.Activation(act, name="fc_act")(x)
    out = L.Dense(2, name="head")(out)
    new = tfmetal_ext.convert(keras.Model(inp, out), count_ops=False)
    report = new.conversion_report
    assert report.rewrite_for("fc_act").source == ("fc", "fc_act")
    assert new.get_layer("fc")._activation_name == act
    assert "conv_act" in report.kept_names() and new.get_layer("conv")._activation_name == "linear"


@pytest.mark.parametrize("depthwise", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fold_batch_norm_matches_the_per_channel_formula(depthwise, with_bias):
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((3, 3, 4, 2) if depthwise else (3, 3, 4, 5))
    n = 8 if depthwise else 5
    bias = rng.standard_normal(n) if with_bias else np.zeros(n)
    gamma, beta, mean = rng.uniform(0.5, 1.5, n), rng.standard_normal(n), rng.standard_normal(n)
    var = rng.uniform(0.5, 1.5, n)
    k, b = fold_batch_norm(kernel, bias if with_bias else None, gamma, beta, mean, var, 1e-3)
    k_ref, b_ref = _fold_reference(kernel, bias, gamma, beta, mean, var, 1e-3, depthwise)
    assert k.dtype == b.dtype == np.float32 and k.shape == kernel.shape
    np.testing.assert_allclose(k, k_ref, rtol=1e-6)
    np.testing.assert_allclose(b, b_ref, rtol=1e-6, atol=1e-6)


def test_fold_batch_norm_without_scale_or_center():
    kernel = np.arange(6.0).reshape(1, 1, 2, 3)
    mean, var = np.array([1.0, 2.0, 3.0]), np.array([3.0, 0.0, 8.0])
    k, b = fold_batch_norm(kernel, None, None, None, mean, var, 1.0)
    np.testing.assert_allclose(k, kernel * np.array([0.5, 1.0, 1 / 3]), rtol=1e-6)
    np.testing.assert_allclose(b, [-0.5, -2.0, -1.0], rtol=1e-6)


def test_conv_bn_act_folded_weights_use_the_shared_fold():
    layer = fl.ConvBNAct(4, 3, name="cba")
    layer(np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype("float32"), training=True)
    k, b = layer.folded_weights()
    parts = [keras.ops.convert_to_numpy(w) for w in (layer.gamma, layer.beta, layer.moving_mean,
                                                      layer.moving_variance)]
    k_ref, b_ref = _fold_reference(keras.ops.convert_to_numpy(layer.kernel).astype("float64"), 0.0,
                                   *(p.astype("float64") for p in parts), layer.epsilon)
    np.testing.assert_allclose(k, k_ref, rtol=1e-6)
    np.testing.assert_allclose(b, b_ref, rtol=1e-6, atol=1e-7)


def test_converter_creates_no_attribute_outside_init():
    block = keras.Sequential([keras.Input((8, 8, 4)), L.Conv2D(8, 3, padding="same", name="c"),
                              L.BatchNormalization(name="bn"), L.ReLU(name="r")], name="block")
    inp = keras.Input((8, 8, 3))
    out = L.GlobalAveragePooling2D(name="gap")(block(L.Conv2D(4, 1, name="stem")(inp)))
    stock = keras.Model(inp, out)
    conv = Converter(False, ConversionReport(model=stock.name))
    after_init = set(vars(conv))
    conv.convert_model(stock)
    assert set(vars(conv)) == after_init
    assert conv.graph is not None and conv.pairs and conv.new_layers


def test_partial_verification_warnings_point_at_the_caller_of_convert():
    inp = keras.Input((4,))
    stock = keras.Model(inp, L.Dense(3, name="fc")(L.Dense(4, name="hidden")(inp)))
    k = keras.ops.convert_to_numpy(stock.get_layer("fc").kernel)
    k[:, 0] = np.nan
    stock.get_layer("fc").kernel.assign(k)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tfmetal_ext.convert(stock, count_ops=False)
    ours = [w for w in record if issubclass(w.category, RuntimeWarning) and "convert(verify=True)" in str(w.message)]
    assert len(ours) == 2  # NaN outputs, NaN gradients
    assert {w.filename for w in ours} == {__file__}
