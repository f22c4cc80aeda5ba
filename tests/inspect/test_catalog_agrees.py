"""The catalog agrees with the graph that ran, on whatever CPU configuration this is.

The expectations come from the backend table that `devices.capabilities()` selects (oneDNN on
or off, native bf16/fp16); the fused nodes come from the executed graph. On every CPU the suite
meets, no layer may be "missed" (a fusion the table promises and the graph lacks) or
"unexpected" (a fusion the graph has and the table denies), and every fused forward node must be
credited to a layer row. CI runs this file with oneDNN on and with TF_ENABLE_ONEDNN_OPTS=0.
"""

import keras
import pytest

from tfmetal_ext import devices, inspect
from tfmetal_ext import layers as fl

L = keras.layers


def _conv_zoo():
    inp = keras.Input((12, 12, 4))
    x = fl.FusedConv2D(8, 3, padding="same", activation="relu", name="conv_relu")(inp)
    x = fl.FusedConv2D(8, 3, padding="same", activation="leaky_relu", name="conv_leaky")(x)
    x = fl.FusedConv2D(8, 1, name="conv_1x1_linear")(x)
    x = fl.FusedDepthwiseConv2D(3, padding="same", activation="relu6", name="depthwise")(x)
    x = L.Conv2D(8, 3, padding="same", activation="elu", name="stock_conv")(x)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(3, name="head")(x)
    return keras.Model(inp, out)


def _dense_zoo():
    inp = keras.Input((16,))
    x = fl.FusedDense(16, activation="relu", name="dense_relu")(inp)
    x = fl.FusedDense(16, activation="tanh", name="dense_tanh")(x)
    x = fl.FusedDense(16, activation="gelu", name="dense_gelu")(x)
    x = L.Dense(16, activation="relu6", name="stock_dense")(x)
    out = L.Dense(3, name="head")(x)
    return keras.Model(inp, out)


def _norm_zoo():
    inp = keras.Input((12, 12, 4))
    x = fl.ConvBNAct(8, 3, name="cba_relu")(inp)
    x = fl.ConvBNAct(8, 3, activation="elu", name="cba_elu")(x)
    x = fl.ConvBNAct(8, 1, name="cba_pointwise")(x)
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="conv_nobias")(x)
    x = fl.FusedBatchNorm(name="bn")(x)
    x = L.ReLU(name="bn_relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(3, name="head")(x)
    return keras.Model(inp, out)


def _residual_zoo():
    inp = keras.Input((12, 12, 8))
    x = fl.ResidualBlock(8, name="block")(inp)
    x = fl.ResidualBlock(16, strides=2, name="block_proj")(x)
    conv = L.Conv2D(16, 3, padding="same", name="stock_res_conv")(x)
    x = L.ReLU(name="stock_res_relu")(L.Add(name="stock_res_add")([conv, x]))
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(3, name="head")(x)
    return keras.Model(inp, out)


class _Block(L.Layer):
    # The usual example style: sublayers in attributes, default names, a call of its own.
    def __init__(self, activation):
        super().__init__()
        self.conv = L.Conv2D(8, 3, padding="same", activation=activation)
        self.dense = L.Dense(8, activation=activation)

    def call(self, x):
        y = self.conv(x)
        return y + self.dense(keras.ops.mean(y, axis=(1, 2)))[:, None, None, :]


def _examples_zoo():
    # How public examples write models (issue 13): default names, repeated subclassed blocks, a shared
    # layer, TF functions as activations, keras.ops between layers, a grouped conv, wrappers.
    import tensorflow as tf

    inp = keras.Input((12, 12, 4))
    x = L.Conv2D(8, 3, padding="same", activation=tf.nn.relu)(inp)
    for act in ("relu", "elu", "relu"):
        x = _Block(act)(x)
    shared = L.Conv2D(8, 3, padding="same", activation="relu6")
    x = keras.ops.relu(keras.ops.add(shared(x), shared(x * 0.5)))
    x = L.Conv2D(8, 3, groups=2, padding="same")(x)
    x = L.Reshape((12, 96))(x)
    x = L.TimeDistributed(L.Dense(8, activation="relu"))(x)
    out = L.Dense(3)(L.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out)


ZOOS = {
    "conv": _conv_zoo, "dense": _dense_zoo, "norm": _norm_zoo, "residual": _residual_zoo,
    "examples": _examples_zoo,
}


@pytest.mark.parametrize("mode", ["predict", "train"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("zoo", list(ZOOS))
def test_catalog_matches_the_executed_graph(zoo, policy, mode):
    keras.mixed_precision.set_global_policy(policy)
    model = ZOOS[zoo]()
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    caps = devices.capabilities()
    where = f"oneDNN={'on' if caps.onednn else 'off'}, cpu_bf16={caps.cpu_bf16}, cpu_fp16={caps.cpu_fp16}"
    bad = [r for r in report.layers if r.status in ("missed", "unexpected")]
    assert not bad, f"{where}\n{report}"
    credited = {f.name for r in report.layers if r.fused for f in report.fused_for(r.path)}
    stray = [f for f in report.fused if not f.backward and f.name not in credited]
    assert not stray, f"fused nodes credited to no layer ({where}): {stray}\n{report}"
    # Something fuses in float32 on every CPU (Conv2D/MatMul + BiasAdd is TF's own CPU fusion):
    # the check above is not passing on an empty report.
    if policy == "float32":
        assert any(r.status in ("fused", "partial") for r in report.layers), str(report)


@pytest.mark.parametrize("mode", ["predict", "train"])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_one_unit_heads(activation, mode):
    # keras.ops.add emits tf.nn.bias_add only for a bias that squeezes to a vector: a one-unit
    # Dense (or one-filter Conv2D) adds its bias with AddV2, which only oneDNN fuses as a BiasAdd.
    # FusedDense always emits BiasAdd.
    inp = keras.Input((6, 6, 3))
    x = L.Conv2D(1, 3, activation=activation, name="conv_one")(inp)
    x = L.Flatten()(x)
    stock = L.Dense(1, activation=activation, name="stock_head")(x)
    ours = fl.FusedDense(1, activation=activation, name="fused_head")(x)
    model = keras.Model(inp, L.Concatenate()([stock, ours]))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    bad = [r for r in report.layers if r.status in ("missed", "unexpected")]
    assert not bad, str(report)
    onednn = devices.capabilities().onednn
    for name in ("conv_one", "stock_head"):
        row = report.row(name)
        if onednn:
            assert row.fused and row.actual_fused_ops[0] == "BiasAdd", str(report)
        else:
            assert row.status == "not fused" and "AddV2" in row.reason, str(report)
    assert report.row("fused_head").fused, str(report)
