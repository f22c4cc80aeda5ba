"""The prediction reads only the nodes TensorFlow runs (issue 30: counts per step).

A traced function holds nodes that never run: the gradient tape's zeros for an
output nobody differentiates, or a result the Python code dropped. TensorFlow
prunes them when it instantiates the function. The reference here is
TensorFlow itself: the same function run once on this CPU, whose
post-optimization and partition graphs (what ran) hold none of the nodes the
prediction drops.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras

from tfmetal_ext import inspect
from tfmetal_ext.inspect import capture, predict

APPLE = "tensorflow-metal"


def _ran(cap):
    """Node names of the graphs TensorFlow ran: post-optimization graphs, their library, partitions."""
    names = set()
    for fg in cap.functions:
        names.update(n.name for n in fg.graph.node)
        for fdef in fg.graph.library.function:
            names.update(n.name for n in fdef.node_def)
        for part in fg.partitions:
            names.update(n.name for n in part.node)
    return names


def _traced_names(cap):
    names = {n.name for n in cap.functions[0].graph.node}
    for fdef in cap.functions[0].graph.library.function:
        names.update(n.name for n in fdef.node_def)
    return names


def _live_names(cap):
    return {n.name for nodes in predict._functions(cap) for n in nodes}


def _function_with_dead_nodes():
    v = tf.Variable(tf.ones([3]), name="acc")

    @tf.function
    def inner(x):
        return tf.math.erfc(x) * 2.0

    @tf.function
    def f(x):
        unused = tf.zeros_like(x) * 3.0  # noqa: F841 - stateless, nobody reads it
        inner(x)  # a call whose result nobody reads: the call and its body never run
        y = tf.sin(x) + 1.0
        v.assign_add(tf.exp(x))  # stateful: runs with what it reads
        return y

    return f


def test_pruned_nodes_are_the_dead_ones_and_tensorflow_never_runs_them():
    f = _function_with_dead_nodes()
    x = tf.constant([1.0, 2.0, 3.0])
    traced = capture.trace_function(f, x)
    live = _live_names(traced)
    dropped = _traced_names(traced) - live
    ops = {n.name: n.op for n in traced.functions[0].graph.node}
    assert {"zeros_like", "mul"} <= dropped, dropped
    assert "PartitionedCall" in {ops.get(name) for name in dropped}, dropped  # the unread call of `inner`
    assert not any(n.op == "Erfc" for nodes in predict._functions(traced) for n in nodes)  # inner's body
    assert {"Sin", "AddV2", "Exp", "AssignAddVariableOp"} <= {ops.get(name) for name in live}
    ran = _ran(capture.capture_function(f, x))
    assert "zeros_like" in _traced_names(traced) and "zeros_like" not in ran
    assert not (dropped & ran), dropped & ran


def test_roots_unknown_keeps_the_whole_graph():
    f = _function_with_dead_nodes()
    traced = capture.trace_function(f, tf.constant([1.0, 2.0, 3.0]))
    graph = traced.functions[0].graph
    whole = list(predict.live_nodes(graph, roots=None))
    assert {n.name for n in whole[0]} == {n.name for n in graph.node}


def test_a_library_function_named_by_no_node_is_kept():
    g = tf.compat.v1.GraphDef()
    fdef = g.library.function.add()
    fdef.signature.name = "orphan"
    node = fdef.node_def.add()
    node.name, node.op = "c", "Const"
    fdef.ret["out"] = "c:output:0"
    kept = list(predict.live_nodes(g, roots=()))
    assert [[n.name for n in nodes] for nodes in kept] == [[], ["c"]]


def test_cudnn_lstm_step_predicts_no_zeros_for_its_reserve_space():
    """Apple's backend runs Keras' cuDNN LSTM: the tape zeroes its reserve outputs, which nobody reads."""
    model = keras.Sequential([keras.Input((6, 4)), keras.layers.LSTM(8, name="lstm"), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    r = inspect.placement_report(model, mode="train", predict_for=APPLE, gap_kernels=False, batch_size=4)
    ops = {e.op for e in r.entries}
    assert "CudnnRNNV3" not in ops  # Apple's backend has the kernel: the cuDNN path was traced
    assert "ZerosLike" not in ops, [e for e in r.entries if e.op == "ZerosLike"]
    assert not [t for t in r.transfers if t.consumer == "ZerosLike"], r.transfers


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


# ----------------------------------------------------------------------------
# dynamic_batch: the step as fit traces it when the batch size does not divide the data.


def _classifier():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="head")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, np.ones((4, 8), "float32"), np.zeros((4,), "int32")


def _loss_prods(cap):
    """Prod nodes of the loss (its element count) in the graphs TensorFlow ran."""
    names = set()
    for fg in cap.functions:
        names.update(n.name for n in fg.graph.node if n.op == "Prod" and "compile_loss" in n.name)
        for fdef in fg.graph.library.function:
            names.update(n.name for n in fdef.node_def if n.op == "Prod" and "compile_loss" in n.name)
    return names


def test_dynamic_batch_leaves_the_batch_size_arithmetic_in_the_step():
    model, x, y = _classifier()
    static = inspect.placement_report(model, x, targets=y, mode="train", predict_for=APPLE)
    dynamic = inspect.placement_report(model, x, targets=y, mode="train", predict_for=APPLE, dynamic_batch=True)
    assert static.transfer_count == 0, static.transfers
    # The loss' element count (int32 Prod of the batch shape, host memory) reaches the device in each step.
    assert ("Pack", "Prod") in {(t.producer, t.consumer) for t in dynamic.transfers}, dynamic.transfers
    # The reference: this CPU's own runs. With the batch size known grappler folds the count away; with it
    # unknown, a Prod runs in the step.
    assert not _loss_prods(capture.capture_train(model, x, y))
    assert _loss_prods(capture.capture_train(model, x, y, dynamic_batch=True))


@pytest.mark.parametrize("kw", [{"mode": "predict", "dynamic_batch": True}, {"mode": "train", "dynamic_batch": 1}])
def test_dynamic_batch_bad_use(kw):
    model, x, y = _classifier()
    with pytest.raises(ValueError, match="Received: dynamic_batch="):
        inspect.placement_report(model, x, targets=y, predict_for=APPLE, **kw)
