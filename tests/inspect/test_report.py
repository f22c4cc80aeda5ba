"""FusionReport / PlacementReport mechanics: layer mapping, op counts, state restore, serialization."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import inspect
from tfmetal_ext.inspect import report as report_mod


def _block(name):
    inp = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv_a")(inp)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv_b")(x)
    return keras.Model(inp, x, name=name)


def _nested_model():
    inp = keras.Input((8, 8, 4), name="image")
    x = _block("block1")(inp)
    x = keras.layers.Conv2D(4, 1, activation="relu", name="mid")(x)
    x = _block("block2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(2, activation="relu", name="fc")(x)
    return keras.Model(inp, out, name="outer")


def test_fused_nodes_map_to_nested_layers():
    model = _nested_model()
    report = inspect.fusion_report(model, mode="predict")
    convs = [f for f in report.fused if f.op == "_FusedConv2D"]
    assert len(convs) == 5
    # Both blocks have conv_a and conv_b: they must be told apart by the enclosing block.
    names = sorted(f.name for f in convs)
    assert sum("block1" in n for n in names) == 2 and sum("block2" in n for n in names) == 2
    assert sorted(f.layer for f in convs) == ["conv_a", "conv_a", "conv_b", "conv_b", "mid"]
    paths = {r.path for r in report.layers}
    assert {"block1/conv_a", "block2/conv_b", "mid", "fc"} <= paths
    assert report.row("block1/conv_a").status == "fused"
    inspect.assert_fused(report, layer="mid", op="_FusedConv2D", fused_ops=["BiasAdd", "Relu"])


def test_layer_of_strips_tf_uniquifying_suffix():
    index = report_mod.LayerIndex(_nested_model())
    assert index.layer_of("StatefulPartitionedCall/outer_1/block1_1/conv_a_1/Relu") == "block1/conv_a"
    assert index.layer_of("gradient_tape/outer_1/mid_1/ReluGrad") == "mid"
    assert index.layer_of("adam/Pow") is None


def test_num_ops_excludes_non_compute_nodes():
    @tf.function
    def fn(x):
        return tf.identity(tf.nn.relu(x * 2.0))

    report = inspect.fusion_report(fn, (tf.ones([3]),))
    assert report.ops_by_type == {"Mul": 1, "Relu": 1}
    assert report.num_ops == 2
    assert report.layers == []


def test_function_with_fusable_pattern():
    w = tf.random.normal([4, 5])
    b = tf.zeros([5])

    def fn(x):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))

    report = inspect.fusion_report(fn, tf.random.normal([3, 4]))
    node = inspect.assert_fused(report, op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])
    assert node.device.startswith("CPU")
    # add (AddV2) instead of bias_add: CPU without a broadcast-bias rewrite keeps it separate or not, but
    # the Relu+BiasAdd pattern must not be claimed for a plain matmul.
    plain = inspect.fusion_report(lambda x: tf.nn.relu(tf.matmul(x, w)), tf.random.normal([3, 4]))
    with pytest.raises(AssertionError):
        inspect.assert_fused(plain, op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])


def test_train_inspection_leaves_model_untouched():
    model = _nested_model()
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", metrics=["mae"])
    x = np.random.rand(8, 8, 8, 4).astype("float32")
    y = np.random.rand(8, 2).astype("float32")
    model.fit(x, y, epochs=1, verbose=0)  # optimizer slots are non-zero now
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    train_fn = model.train_function
    report = inspect.fusion_report(model, x, mode="train", targets=y)
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert model.train_function is train_fn
    assert report.num_ops > 50 and any(f.backward is False for f in report.fused)
    # Training goes on exactly as without the inspection: compare against a twin.
    twin = keras.models.clone_model(model)
    twin.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", metrics=["mae"])
    twin.fit(x, y, epochs=1, verbose=0)
    twin.set_weights(model.get_weights())
    for t, s in zip(twin.optimizer.variables, model.optimizer.variables):
        t.assign(s)
    model.fit(x, y, epochs=1, verbose=0, shuffle=False)
    twin.fit(x, y, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_train_with_explicit_optimizer_uses_a_clone():
    model = _nested_model()  # not compiled
    report = inspect.fusion_report(model, mode="train", optimizer="sgd", loss="mse")
    assert not model.compiled
    assert any("clone" in n for n in report.notes)
    inspect.assert_fused(report, layer="fc", op="_FusedMatMul", fused_ops=["BiasAdd", "Relu"])


def test_report_serializes_and_prints():
    report = inspect.fusion_report(_nested_model(), mode="predict")
    data = json.loads(report.to_json())
    assert data["num_ops"] == report.num_ops
    assert {r["layer"] for r in data["layers"]} >= {"conv_a", "mid", "fc"}
    text = str(report)
    assert "block1/conv_a" in text and "_FusedConv2D[BiasAdd, Relu]" in text
    assert f"{report.num_ops} ops per step" in text


def test_bad_arguments():
    model = _nested_model()
    with pytest.raises(ValueError, match="Received: mode='eval'"):
        inspect.fusion_report(model, mode="eval")
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        inspect.fusion_report(model, batch_size=0)
    with pytest.raises(ValueError, match="Received: model_or_fn=3"):
        inspect.fusion_report(3)
    with pytest.raises(KeyError):
        inspect.fusion_report(model).row("nope")


def test_assert_no_cpu_fallback_on_cpu_only_host_passes():
    placement = inspect.placement_report(_nested_model(), mode="train", optimizer="sgd", loss="mse")
    assert placement.gpu_present is False
    assert placement.fallbacks == []
    inspect.assert_no_cpu_fallback(placement)
    assert sum(placement.ops_by_device.values()) > 0


def _fake_capture(nodes):
    from tensorflow.core.framework import graph_pb2

    from tfmetal_ext.inspect.capture import FunctionGraph

    part = graph_pb2.GraphDef()
    for name, op, device in nodes:
        n = part.node.add()
        n.name, n.op, n.device = name, op, device
    return inspect.Capture(functions=[FunctionGraph("f", graph_pb2.GraphDef(), [part])], mode="train")


def test_placement_flags_cpu_ops_when_gpu_present():
    gpu = "/job:localhost/replica:0/task:0/device:GPU:0"
    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    cap = _fake_capture(
        [
            ("model_1/conv_a_1/Conv2D", "Conv2D", gpu),
            ("model_1/drop_1/RngReadAndSkip", "RngReadAndSkip", cpu),
            ("IteratorGetNext", "IteratorGetNext", cpu),  # input pipeline: allowed on host
            ("Const", "Const", cpu),
        ]
    )
    index = report_mod.LayerIndex()
    placement = report_mod.build_placement_report(cap, index)
    assert placement.gpu_present
    assert [(f.op, f.layer) for f in placement.fallbacks] == [("RngReadAndSkip", "drop")]
    with pytest.raises(AssertionError, match="RngReadAndSkip"):
        inspect.assert_no_cpu_fallback(placement)
    assert placement.ops_by_device == {"GPU:0": 1, "CPU:0": 2}


def test_capture_ignores_functions_instantiated_between_windows():
    # Graphs of functions first run after an earlier capture stay queued in
    # TF's run metadata; with the same Python body their node names equal
    # ours, so only flushing the queue keeps them out of the next capture.
    v = tf.Variable(1.0)
    body = lambda: v.assign_add(tf.sin(v.read_value()))  # noqa: E731
    first = inspect.capture_function(body)
    tf.function(body)()  # same body, instantiated outside any window
    second = inspect.capture_function(body)
    for cap in (first, second):
        assert inspect.report_from_capture(cap).ops_by_type.get("Sin") == 1


# ----------------------------------------------------------------------------
# Keras' default names: TF uniquifies a reused scope the same way Keras numbers layers.


def _index_with(names):
    index = report_mod.LayerIndex()
    index._children = {"": {n: n for n in names}}
    index.layers = {n: None for n in names}
    return index


@pytest.mark.no_keras
@pytest.mark.parametrize(
    "scopes, want",
    [
        # As written: each layer's own name.
        (("conv2d", "conv2d_1"), {"conv2d": "conv2d", "conv2d_1": "conv2d_1"}),
        # Every scope uniquified once (what a Sequential's train and predict steps show).
        (("conv2d_1", "conv2d_1_2"), {"conv2d_1": "conv2d", "conv2d_1_2": "conv2d_1"}),
    ],
)
def test_default_names_resolve_by_the_whole_graph(scopes, want):
    index = _index_with(["conv2d", "conv2d_1"])
    index.observe([f"sequential_1/{s}/Relu" for s in scopes])
    assert {s: index.layer_of(f"sequential_1/{s}/Relu") for s in scopes} == want


def test_default_layer_names_credit_each_conv_to_itself():
    # keras-io's MNIST convnet, as written: default names, pooling between the convs.
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    first, second = model.layers[0].name, model.layers[2].name
    for mode in ("predict", "train"):
        report = inspect.fusion_report(model, mode=mode)
        convs = [f for f in report.fused if f.op == "_FusedConv2D" and not f.backward]
        assert sorted(f.layer for f in convs) == sorted([first, second]), (mode, convs)
        assert report.row(first).status == "fused" and report.row(second).status == "fused", str(report)
