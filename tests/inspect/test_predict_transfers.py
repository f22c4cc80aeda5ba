"""Host memory in the predicted placement: transfers between host and device memory (issue 29, part 3).

Each expected count is derived by hand from the rules of `tfmetal_ext.inspect.transfers` (TensorFlow's
`MemoryTypesForNode`): a node on the CPU reads and writes host memory; on the device, resource tensors and
the arguments its kernel declares HostMemory are in host memory, and int32 is too where no declaration is
known; arguments, constants and calls have no memory of their own; Identity passes its input's memory on.
The graphs are written by hand (a `tf.Graph`), a nested `tf.function` where the FunctionDef form of
references matters, and one tiny Keras model.
"""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf

import keras

from tfmetal_ext import backends, devices, inspect
from tfmetal_ext.backends._table import backend
from tfmetal_ext.inspect import capture, predict, transfers
from tfmetal_ext.inspect.report import LayerIndex, PlacementReport

PLUGIN = "tensorflow-metal-plugin"
D2H, H2D = transfers.DEVICE_TO_HOST, transfers.HOST_TO_DEVICE


def _plugin():
    with devices.assume_backend(PLUGIN):
        return backends.current()


def _without(table, *ops):
    """`table` with no kernel (its own or TensorFlow's shared one) for `ops`."""
    def drop(kernels):
        return None if kernels is None else types.MappingProxyType({k: v for k, v in kernels.items() if k not in ops})
    return dataclasses.replace(table, kernels=drop(table.kernels), shared_kernels=drop(table.shared_kernels))


def _hand_graph(build):
    """A `Capture` of the graph `build()` writes into a fresh `tf.Graph` (a GraphDef: ``node:index`` refs)."""
    g = tf.Graph()
    with g.as_default():
        build()
    return capture.Capture(functions=[capture.FunctionGraph("hand", g.as_graph_def(), [])], mode="function")


def _predict(cap, table):
    return predict.build_predicted_report(cap, LayerIndex(None, cap.layer_scopes), PLUGIN, table=table)


def _rows(report):
    return {(t.producer, t.consumer, t.direction): t.count for t in report.transfers}


def _placeholder(shape, dtype=tf.float32):
    return tf.compat.v1.placeholder(dtype, shape)


# A table with only hand-written facts, host-memory arguments declared as Apple's generated table records them.
_FAKE = backend(
    "fake_metal", "metal", "Fake Metal", {},
    kernels=types.MappingProxyType({
        "Relu": ("float32",), "Cast": ("float32", "int32"), "BroadcastTo": ("float32",),
        "Split": ("float32",), "ConcatV2": ("float32",), "Unique": ("float32",), "AssignVariableOp": ("float32",),
    }),
    kernels_complete=True,
    dtype_attrs=types.MappingProxyType({"Cast": "SrcT"}),
    host_memory=types.MappingProxyType({
        "Cast": {"float32": ()},  # declares nothing: its int32 output is in device memory
        "BroadcastTo": {"float32": ("shape",)},
        "Split": {"float32": ("split_dim",)},
        "ConcatV2": {"float32": ("axis",)},
        "Unique": {"float32": ("idx",)},  # its second output
        "AssignVariableOp": {"float32": ()},  # declares nothing, yet its `resource` is on the host
    }),
)


# ----------------------------------------------------------------------------
# The cases.


def _dense_softmax_matmul():
    x, w, b, w2 = _placeholder((2, 4)), _placeholder((4, 3)), _placeholder((3,)), _placeholder((3, 2))
    s = tf.nn.softmax(tf.nn.bias_add(tf.matmul(x, w), b))
    passed = tf.raw_ops.IdentityN(input=[w2, tf.identity(s)])[1]  # identities pass the memory on
    tf.matmul(passed, w2)


def test_a_softmax_without_a_kernel_between_two_device_ops_costs_two_transfers():
    # MatMul + BiasAdd fuse into _FusedMatMul (device memory, float32) -> Softmax on the CPU: device->host (1).
    # Softmax -> (Identity, IdentityN's second output) -> MatMul on the device: host->device (2), judged
    # between Softmax and MatMul. The placeholders are arguments: not judged.
    cap = _hand_graph(_dense_softmax_matmul)
    report = _predict(cap, _without(_plugin(), "Softmax"))
    assert [e.op for e in report.cpu_fallback] == ["Softmax"], str(report)
    assert report.transfer_count == 2 and report.transfer_copies == 2, str(report)
    assert _rows(report) == {("_FusedMatMul", "Softmax", D2H): 1, ("Softmax", "MatMul", H2D): 1}
    # With its kernel, everything stays in device memory.
    full = _predict(cap, _plugin())
    assert full.transfer_count == 0 and not full.transfers, str(full)


def test_an_int32_shape_computed_on_the_host_feeds_reshape_without_a_transfer():
    # Relu (device) -> Shape: TF's DEFAULT kernel keeps only `output` (int32) in host memory, its input on
    # the device. StridedSlice and Pack on int32: no plugin kernel, so the CPU (host memory). Pack ->
    # Reshape's `shape`: HostMemory in TF's DEFAULT Reshape. Relu -> Reshape's `tensor` and Reshape ->
    # Relu: device. Every edge has one memory at both ends: 0 transfers.
    def build():
        r = tf.nn.relu(_placeholder((2, 6)))
        shape = tf.raw_ops.Shape(input=r, out_type=tf.int32)
        tf.nn.relu(tf.reshape(r, tf.stack([shape[0], -1])))

    report = _predict(_hand_graph(build), _plugin())
    assert {e.op for e in report.int32_host} == {"StridedSlice", "Pack"}, str(report)
    assert report.transfer_count == 0, str(report)
    assert "0 transfers per step" in str(report)


def test_a_resource_variable_read_and_update_move_nothing():
    # VarHandleOp -> ReadVariableOp / AssignSubVariableOp: a resource, in host memory at both ends.
    # ReadVariableOp (TF's DEFAULT kernel) writes device memory; MatMul and Mul read it there.
    # AssignSubVariableOp runs on the host for the plugin on TF 2.21 (`host_ops`) but through TF's DEFAULT
    # kernel on the device, so Mul -> its `value` is device to device: 0 transfers.
    def build():
        v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[4, 3], shared_name="v")
        read = tf.raw_ops.ReadVariableOp(resource=v, dtype=tf.float32)
        tf.matmul(_placeholder((2, 4)), read)
        tf.raw_ops.AssignSubVariableOp(resource=v, value=read * 0.5)

    graph = _hand_graph(build)
    report = predict.build_predicted_report(graph, LayerIndex(None, graph.layer_scopes), PLUGIN, table=_plugin(),
                                            gap=False)
    assert [e.op for e in report.host] == ["AssignSubVariableOp"], str(report)
    assert report.transfer_count == 0, str(report)
    # With our gap kernel (the default) it runs on the GPU: no host op, still nothing moved.
    report = _predict(graph, _plugin())
    assert not report.host and [e.op for e in report.entries if e.outcome == predict.GAP] == ["AssignSubVariableOp"]
    assert report.transfer_count == 0, str(report)


def test_an_update_op_on_the_cpu_reads_its_gradient_across():
    # ResourceApplyGradientDescent runs on the host for the plugin and TF has no DEFAULT kernel for it:
    # the CPU. Its `delta` comes from Mul on the device: device->host (1). `var` is a resource (host at
    # both ends), `alpha` a constant (not judged).
    def build():
        v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[3], shared_name="v")
        read = tf.raw_ops.ReadVariableOp(resource=v, dtype=tf.float32)
        tf.raw_ops.ResourceApplyGradientDescent(var=v, alpha=tf.constant(0.1), delta=read * 2.0)

    report = _predict(_hand_graph(build), _plugin())
    assert [e.op for e in report.host] == ["ResourceApplyGradientDescent"], str(report)
    assert _rows(report) == {("Mul", "ResourceApplyGradientDescent", D2H): 1}, str(report)


# ----------------------------------------------------------------------------
# Host-memory arguments a table declares.


def _cast_feeds_broadcast_shape():
    r = tf.nn.relu(_placeholder((2,)))
    shape = tf.cast(r, tf.int32)
    tf.nn.relu(tf.raw_ops.BroadcastTo(input=tf.nn.relu(_placeholder((1, 2))), shape=shape))


def test_declared_host_memory_arguments_decide_where_int32_lives():
    cap = _hand_graph(_cast_feeds_broadcast_shape)
    # The fake table's own Cast declares nothing, so its int32 output is in device memory; its BroadcastTo
    # declares `shape` HostMemory: Cast -> BroadcastTo is device->host (1). Relu edges stay on the device.
    declared = _predict(cap, _FAKE)
    assert _rows(declared) == {("Cast", "BroadcastTo", D2H): 1}, str(declared)
    # A table that records no memory: int32 is taken to live on the host at both ends: 0.
    assert _predict(cap, dataclasses.replace(_FAKE, host_memory=None)).transfer_count == 0
    # BroadcastTo missing from a complete table: it falls back to the CPU (TF has a CPU kernel), so both its
    # inputs cross (Cast's int32 in device memory, Relu's float32) and its output crosses back: 3.
    missing = _predict(cap, _without(_FAKE, "BroadcastTo"))
    assert [e.op for e in missing.cpu_fallback] == ["BroadcastTo"], str(missing)
    assert _rows(missing) == {("Cast", "BroadcastTo", D2H): 1, ("Relu", "BroadcastTo", D2H): 1,
                              ("BroadcastTo", "Relu", H2D): 1}, str(missing)


def test_function_references_and_argument_lists_map_to_positions():
    # In the nested function's FunctionDef, refs read ``split:output:2`` and ``unique:idx:0``; ConcatV2's
    # `values` spans three positions (N=3) before `axis`. Cast (int32 in device memory, as declared) ->
    # `axis` (HostMemory): device->host (1). Split's third output -> Softmax (missing: the CPU):
    # device->host (2); Softmax -> Relu: host->device (3). Unique's `idx` (its second output, declared
    # HostMemory) -> Cast from int32 (declares nothing: device memory): host->device (4). Split's
    # `split_dim` is a Const and every other edge runs device to device: no more.
    @tf.function
    def inner(x, a, v):
        parts = tf.split(tf.nn.relu(x), 3, axis=1)
        axis = tf.cast(tf.nn.relu(a), tf.int32)
        c = tf.concat([parts[0], parts[1], tf.nn.relu(parts[2])], axis)
        _, idx = tf.unique(tf.nn.relu(v))
        return tf.nn.relu(tf.nn.softmax(parts[2])), c, tf.nn.relu(tf.cast(idx, tf.float32))

    cap = capture.trace_function(lambda x, a, v: inner(x, a, v), tf.ones((2, 6)), tf.ones(()), tf.ones((5,)))
    fdefs = [f for f in cap.functions[0].graph.library.function if any(n.op == "ConcatV2" for n in f.node_def)]
    assert fdefs and any(r.endswith(":idx:0") for n in fdefs[0].node_def for r in n.input)  # the FunctionDef form
    report = _predict(cap, _FAKE)
    assert _rows(report) == {("Cast", "ConcatV2", D2H): 1, ("Split", "Softmax", D2H): 1,
                             ("Softmax", "Relu", H2D): 1, ("Unique", "Cast", H2D): 1}, str(report)
    assert report.transfer_count == 4 and report.transfer_copies == 4


def test_a_resource_is_in_host_memory_whatever_a_kernel_declares():
    # VarHandleOp (TF's DEFAULT kernel) -> the fake table's own AssignVariableOp, which declares no
    # HostMemory: a resource handle lives on the host all the same, so nothing crosses. Relu -> `value`:
    # device to device. 0.
    def build():
        v = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], shared_name="v")
        tf.raw_ops.AssignVariableOp(resource=v, value=tf.nn.relu(_placeholder((2,))))

    report = _predict(_hand_graph(build), _FAKE)
    assert not report.entries, str(report)
    assert report.transfer_count == 0, str(report)


def test_ops_the_table_does_not_know_are_not_judged_and_a_note_says_so():
    # A facts-only table that knows MatMul and BiasAdd: Softmax is unknown, so its two edges are not judged.
    facts = backend("facts", "metal", "Facts", {},
                    kernels=types.MappingProxyType({"MatMul": ("float32",), "BiasAdd": ("float32",)}))
    report = _predict(_hand_graph(_dense_softmax_matmul), facts)
    assert [e.op for e in report.unknown] == ["Softmax"]
    assert report.transfer_count == 0, str(report)
    assert any(n.startswith("2 data edge(s) not judged") for n in report.notes), report.notes


# ----------------------------------------------------------------------------
# A Keras step, and the report.


def _dense_softmax_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc"), keras.layers.Softmax(name="sm")])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_keras_softmax_without_a_kernel_adds_four_transfers_in_two_copies():
    # Removing Softmax's kernel changes only its own edges: _FusedMatMul -> Softmax (device->host, 1 copy),
    # and its output, read by the loss's Sub and by the softmax gradient's two Muls (host->device, 3
    # edges, 1 copy: TF copies a tensor once per destination).
    model = _dense_softmax_model()
    with predict.tracing_as(PLUGIN):
        cap = capture.trace_train(model, np.zeros((8, 4), "float32"), np.zeros((8, 3), "float32"))
        index = LayerIndex(model, cap.layer_scopes)
    full = predict.build_predicted_report(cap, index, PLUGIN, model=model, table=_plugin())
    report = predict.build_predicted_report(cap, index, PLUGIN, model=model, table=_without(_plugin(), "Softmax"))
    assert report.transfer_count - full.transfer_count == 4, (str(full), str(report))
    assert report.transfer_copies - full.transfer_copies == 2
    softmax = {(t.producer, t.consumer, t.direction, t.layer): t.count
               for t in report.transfers if "Softmax" in (t.producer, t.consumer)}
    assert softmax == {("_FusedMatMul", "Softmax", D2H, "sm"): 1, ("Softmax", "Sub", H2D, "loss"): 1,
                       ("Softmax", "Mul", H2D, "sm"): 2}, str(report)


def test_the_report_prints_and_serializes_its_transfers():
    report = _predict(_hand_graph(_dense_softmax_matmul), _without(_plugin(), "Softmax"))
    text = str(report)
    assert "2 transfers per step between host and device memory (2 tensor copies)" in text, text
    assert "_FusedMatMul -> Softmax" in text and D2H in text and "Softmax -> MatMul" in text
    d = report.to_dict()
    assert d["transfer_count"] == 2 and {t["direction"] for t in d["transfers"]} == {D2H, H2D}
    assert isinstance(report.transfers[0], inspect.PredictedTransfer)
    # Real vs predicted compares ops only: the transfers change nothing there.
    real = PlacementReport("function", True, {"GPU:0": 3}, [])
    assert predict.differences(real, report) == predict.differences(
        real, dataclasses.replace(report, transfers=[], transfer_count=0, transfer_copies=0))
    assert predict.differences(real, report)  # Softmax was predicted to fall back, but ran on the GPU


def test_the_printed_report_lists_the_most_frequent_kinds_first_and_counts_the_rest():
    rows = [transfers.PredictedTransfer(f"Op{i}", "Softmax", D2H, None, 10 - i, 1, "a -> b") for i in range(10)]
    report = inspect.PredictedPlacementReport(
        mode="train", gpu_present=True, ops_by_device={}, fallbacks=[], predicted_for=PLUGIN,
        table="metal_plugin", table_complete=True, transfers=rows, transfer_count=55, transfer_copies=10)
    lines = str(report).splitlines()
    start = next(i for i, line in enumerate(lines) if "55 transfers per step" in line)
    assert "Op0 -> Softmax" in lines[start + 1] and "x10" in lines[start + 1]
    assert lines[start + 9].strip() == "... and 2 more kind(s), 3 transfer(s)", lines


@pytest.mark.parametrize("op, attrs, expected", [
    # ConcatV2: `values` is N=3 positions, then `axis`.
    ("ConcatV2", {"N": 3, "T": tf.float32, "Tidx": tf.int32},
     ([("values", "float32")] * 3 + [("axis", "int32")], [("output", "float32")])),
    # IdentityN: a type list.
    ("IdentityN", {"T": [tf.float32, tf.int32]},
     ([("input", "float32"), ("input", "int32")], [("output", "float32"), ("output", "int32")])),
])
def test_layout_spans_number_and_type_list_attributes(op, attrs, expected):
    node = tf.compat.v1.NodeDef(name="n", op=op)
    for key, value in attrs.items():
        if isinstance(value, list):
            node.attr[key].list.type.extend([t.as_datatype_enum for t in value])
        elif isinstance(value, int):
            node.attr[key].i = value
        else:
            node.attr[key].type = value.as_datatype_enum
    layout = transfers._layout(node)
    assert (list(layout.inputs), list(layout.outputs)) == expected
    # On the device with nothing declared, the int32 positions are the host ones; on the CPU, all are.
    ins, _ = transfers.memory_types(node, transfers.Placement(op, True))
    assert ins == [transfers.HOST if d == "int32" else transfers.DEVICE for _, d in expected[0]]
    assert set(transfers.memory_types(node, transfers.Placement(op, False))[0]) == {transfers.HOST}
