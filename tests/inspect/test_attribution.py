"""Fused nodes are credited to the layer object that made them (issue 13, defects 2 and 6).

Keras' default names collide with TensorFlow's uniquified scopes (``conv2d`` is opened as
``conv2d_1``; a repeated block ``block_1`` as ``block_1_2``), so attribution must follow the layer
objects. The independent reference here is each layer's own activation: layers are given distinct
activations that fuse on every CPU configuration (Relu, Relu6, Elu; the backend tables list them
for Conv2D and MatMul with and without oneDNN), so a fused node credited to the wrong layer
carries the wrong activation, and each layer's node count is known from how often it is called.
"""

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import report as report_mod

L = keras.layers
MODES = ["predict", "train"]


def _forward(report):
    return [f for f in report.fused if not f.backward]


def _act_op(layer):
    return fusion.ACTIVATION_OPS.get(layer.activation.__name__)


def _assert_credited(report, model, calls):
    """Every fused forward node belongs to a layer in `calls` (layer object -> times called),
    carries that layer's activation when it has one, and each layer has one node per call."""
    index = inspect.LayerIndex(model)
    path_of = {id(layer): index.path_of(layer) for layer in calls}
    assert None not in path_of.values(), path_of
    by_path = {}
    for node in _forward(report):
        if node.op not in ("_FusedConv2D", "_FusedMatMul"):
            continue
        assert node.layers, f"uncredited fused node {node.name}\n{report}"
        by_path.setdefault(node.layers[0], []).append(node)
    for layer, count in calls.items():
        path = path_of[id(layer)]
        nodes = by_path.get(path, [])
        assert len(nodes) == count, f"{path}: {[n.label() for n in nodes]}\n{report}"
        act = _act_op(layer)
        for node in nodes:
            acts = [op for op in node.fused_ops if op != "BiasAdd"]
            assert acts in ([], [act]), f"{path} got {node.label()} (its activation is {act})\n{report}"
        row = report.row(path)
        assert row.status != "missed", str(report)
    bad = [r for r in report.layers if r.status in ("missed", "unexpected")]
    assert not bad, str(report)


def _mnist_layers():
    # keras-io's MNIST convnet as written (default names), on a smaller image.
    return [
        L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(), L.Conv2D(64, 3, activation="relu"),
        L.MaxPooling2D(), L.Flatten(), L.Dropout(0.5), L.Dense(10, activation="softmax"),
    ]


def _mnist(kind):
    layers = _mnist_layers()
    if kind == "sequential":
        return keras.Sequential([keras.Input((16, 16, 1))] + layers)
    inp = keras.Input((16, 16, 1))
    x = inp
    for layer in layers:
        x = layer(x)
    return keras.Model(inp, x)


def _mnist_calls(model):
    return {l: 1 for l in model.layers if isinstance(l, (L.Conv2D, L.Dense)) or "Fused" in type(l).__name__
            and hasattr(l, "kernel")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_mnist_convnet_default_names(kind, mode):
    model = _mnist(kind)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    report = inspect.fusion_report(model, mode=mode)
    convs = [l for l in model.layers if isinstance(l, L.Conv2D)]
    _assert_credited(report, model, {c: 1 for c in convs})
    for conv in convs:
        assert report.row(conv.name).status == "fused", str(report)


@pytest.mark.parametrize("mode", MODES)
def test_mnist_convnet_converted(mode):
    model = tfmetal_ext.convert(_mnist("sequential"))
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    report = inspect.fusion_report(model, mode=mode)
    convs = [l for l in model.layers if "Conv" in type(l).__name__]
    assert len(convs) == 2 and all(type(c).__module__.startswith("tfmetal_ext") for c in convs)
    _assert_credited(report, model, {c: 1 for c in convs})
    for conv in convs:
        assert report.row(conv.name).status == "fused", str(report)


def test_metal_callback_strict_passes_the_converted_convnet():
    model = tfmetal_ext.convert(_mnist("functional"))
    model.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(), loss="categorical_crossentropy")
    x = np.random.default_rng(0).random((16, 16, 16, 1)).astype("float32")
    y = keras.utils.to_categorical(np.arange(16) % 10, 10)
    cb = tfmetal_ext.callbacks.MetalCallback(strict=True, print_fn=lambda s: None)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])  # must not raise
    assert "missed" not in cb.summary and "-> use" not in cb.summary, cb.summary
    for conv in [l for l in model.layers if "Conv" in type(l).__name__]:
        assert cb.fusion_report.row(conv.name).status == "fused", cb.summary


def test_distinct_activations_pin_each_node_to_its_layer():
    # Default names, pooling between the convs, each conv with its own activation.
    model = keras.Sequential(
        [
            keras.Input((12, 12, 3)), L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D(),
            L.Conv2D(4, 3, activation="elu"), L.Conv2D(4, 1, padding="same", activation="relu6"),
            L.GlobalAveragePooling2D(), L.Dense(3, activation="elu"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    for mode in MODES:
        report = inspect.fusion_report(model, mode=mode)
        _assert_credited(report, model, {l: 1 for l in model.layers if isinstance(l, (L.Conv2D, L.Dense))})


class Block(L.Layer):
    """The usual example style: sublayers in attributes, no **kwargs, a call of its own."""

    def __init__(self, activation):
        super().__init__()
        self.conv = L.Conv2D(4, 3, padding="same", activation=activation)
        self.dense = L.Dense(4, activation=activation)

    def call(self, x):
        y = self.conv(x)
        z = self.dense(keras.ops.mean(y, axis=(1, 2)))
        return y + z[:, None, None, :]


def _blocks_model():
    inp = keras.Input((8, 8, 4))
    x = inp
    blocks = [Block(act) for act in ("relu", "elu", "relu6")]
    for block in blocks:
        x = block(x)
    out = L.Dense(2)(L.GlobalAveragePooling2D()(x))
    return keras.Model(inp, out), blocks


@pytest.mark.parametrize("mode", MODES)
def test_repeated_subclassed_blocks(mode):
    model, blocks = _blocks_model()
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    calls = {sub: 1 for b in blocks for sub in (b.conv, b.dense)}
    _assert_credited(report, model, calls)
    # Rows for the sublayers, with their paths (defect 6).
    index = inspect.LayerIndex(model)
    for block in blocks:
        for sub in (block.conv, block.dense):
            path = index.path_of(sub)
            assert path == f"{block.name}/{sub.name}"
            assert report.row(path).status in ("fused", "partial"), str(report)


@pytest.mark.parametrize("mode", MODES)
def test_shared_layer_called_twice(mode):
    shared = L.Conv2D(4, 3, padding="same", activation="elu")
    other = L.Conv2D(4, 3, padding="same", activation="relu")
    inp = keras.Input((8, 8, 4))
    x = shared(other(shared(inp)))
    model = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling2D()(x)))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    _assert_credited(report, model, {shared: 2, other: 1})


@pytest.mark.parametrize("mode", MODES)
def test_nested_models_with_default_names(mode):
    inner_in = keras.Input((8, 8, 4))
    inner_conv = L.Conv2D(4, 3, padding="same", activation="relu6")
    inner = keras.Model(inner_in, inner_conv(inner_in))
    outer_conv = L.Conv2D(4, 3, padding="same", activation="elu")
    model = keras.Sequential([keras.Input((8, 8, 4)), outer_conv, inner, L.GlobalAveragePooling2D(), L.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    _assert_credited(report, model, {inner_conv: 1, outer_conv: 1})
    assert inspect.LayerIndex(model).path_of(inner_conv) == f"{inner.name}/{inner_conv.name}"


def test_placement_report_credits_the_same_layers():
    model = _mnist("sequential")
    cap, run, _ = inspect.capture_step(model, mode="predict")
    index = inspect.LayerIndex(run, cap.layer_scopes)
    placement = report_mod.build_placement_report(cap, index, gpu_present=True)  # every CPU op "falls back"
    convs = [l for l in model.layers if isinstance(l, L.Conv2D)]
    # Partition graphs show the kernels that ran (oneDNN's _MklNativeFusedConv2D, or _FusedConv2D).
    credited = sorted(f.layer for f in placement.fallbacks if "FusedConv2D" in f.op)
    assert credited == sorted(index.path_of(c) for c in convs), placement


def test_inspection_leaves_keras_name_scopes_as_they_were():
    from keras.src.backend.tensorflow import core as tf_core

    before = tf_core.name_scope.__enter__
    inspect.fusion_report(_mnist("sequential"), mode="predict")
    assert tf_core.name_scope.__enter__ is before


# ----------------------------------------------------------------------------
# Wrappers and layers Keras runs differently (defect 6).


def test_bidirectional_and_time_distributed_inner_layers_have_rows():
    inp = keras.Input((6, 5))
    bi = L.Bidirectional(L.LSTM(4, return_sequences=True))
    td = L.TimeDistributed(L.Dense(3, activation="relu"))
    x = td(bi(inp))
    model = keras.Model(inp, L.Dense(1)(L.Flatten()(x)))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode="train")
    paths = {r.path for r in report.layers}
    want = {f"{bi.name}/{bi.forward_layer.name}", f"{bi.name}/{bi.backward_layer.name}", f"{td.name}/{td.layer.name}"}
    assert want <= paths, str(report)
    for path in want:
        assert report.row(path).ran, f"{path}: no ops found in its scope\n{report}"


def test_grouped_conv_row_shows_the_xla_call():
    inp = keras.Input((8, 8, 4))
    grouped = L.Conv2D(8, 3, groups=2, activation="relu")
    model = keras.Model(inp, L.Dense(1)(L.GlobalAveragePooling2D()(grouped(inp))))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode="train")
    row = report.row(grouped.name)
    assert row.status == "not fused" and "groups=2" in row.reason and "XLA" in row.reason, str(report)
    assert any(op.startswith("XLA") for op in row.ran), row.ran
    assert "XLA call" in str(report)


class Net(keras.Model):
    """A subclassed model with sublayers in a list and a dict."""

    def __init__(self):
        super().__init__()
        self.stages = [L.Conv2D(4, 3, padding="same", activation="relu"), L.Conv2D(4, 3, padding="same", activation="elu")]
        self.heads = {"a": L.Dense(3, activation="relu6"), "b": L.Dense(2, activation="relu")}
        self.pool = L.GlobalAveragePooling2D()

    def call(self, x):
        for stage in self.stages:
            x = stage(x)
        x = self.pool(x)
        return self.heads["a"](x) + keras.ops.sum(self.heads["b"](x), axis=-1, keepdims=True)


@pytest.mark.parametrize("mode", MODES)
def test_subclassed_model_with_sublayers_in_lists_and_dicts(mode):
    model = Net()
    x = np.zeros((4, 8, 8, 4), "float32")
    model(x)
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, inputs=x, mode=mode, targets=np.zeros((4, 3), "float32"))
    _assert_credited(report, model, {l: 1 for l in model.stages + list(model.heads.values())})


def test_converted_repeated_blocks_pass_a_strict_callback():
    model, _ = _blocks_model()
    converted = tfmetal_ext.convert(model)
    blocks = [l for l in converted.layers if isinstance(l, Block)]
    subs = [s for b in blocks for s in (b.conv, b.dense)]
    assert len(subs) == 6 and all(type(s).__module__.startswith("tfmetal_ext") for s in subs)
    converted.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(), loss="mse")
    cb = tfmetal_ext.callbacks.MetalCallback(strict=True, print_fn=lambda s: None)
    x = np.random.default_rng(0).random((8, 8, 8, 4)).astype("float32")
    converted.fit(x, np.zeros((8, 2), "float32"), batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    _assert_credited(cb.fusion_report, converted, {s: 1 for s in subs})
