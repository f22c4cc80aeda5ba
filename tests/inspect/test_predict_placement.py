"""Predicted placement on a Metal backend, on any machine (issue 14, item 3).

Expected ops come from what the backends are documented to lack (REFERENCE.md
sections 4 and 7: the open plugin has no Einsum, no bfloat16 and no CudnnRNN
kernels; TF has no CPU kernel for CudnnRNNV3; Apple's plugin has CudnnRNNV3),
and from the traced graph itself read independently of the predictor.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels as tf_kernels

import keras

from tfmetal_ext import devices, inspect
from tfmetal_ext.inspect import capture, predict
from tfmetal_ext.inspect.report import FallbackNode, PlacementReport

PLUGIN = "tensorflow-metal-plugin"
APPLE = "tensorflow-metal"


def _cpu_kernel(op):
    return any(k.device_type == "CPU" for k in tf_kernels.get_registered_kernels_for_op(op).kernel)


@pytest.fixture
def policy():
    """Sets a global dtype policy for the test; puts the old one back."""
    old = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(old)


def _compiled(model):
    model.compile(optimizer="adam", loss="mse")
    return model


def _attention_model():
    x = keras.Input((8, 16))
    y = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(x, x)
    return _compiled(keras.Model(x, keras.layers.Dense(4, name="head")(y)))


def _lstm_model(**kw):
    return _compiled(keras.Sequential([keras.Input((6, 4)), keras.layers.LSTM(8, name="lstm", **kw),
                                       keras.layers.Dense(3, name="head")]))


def _entries(report, op):
    return [e for e in report.entries if e.op == op]


# ----------------------------------------------------------------------------
# The "Done when".


def test_plugin_flags_einsum_of_stock_multi_head_attention_with_its_layer():
    model = _attention_model()
    report = inspect.placement_report(model, mode="train", predict_for=PLUGIN, gap_kernels=False)
    einsum = _entries(report, "Einsum")
    assert einsum, str(report)
    assert all(e.layer and e.layer.split("/")[0] == "mha" for e in einsum), str(report)
    assert {e.outcome for e in einsum} == {predict.FALLBACK if _cpu_kernel("Einsum") else predict.FAILS}
    assert all(e.dtype == "float32" for e in einsum)
    assert einsum[0] in report.missing and einsum[0] in report.cpu_fallback
    assert "Einsum" in str(report) and "mha" in str(report)
    # tfmetal_ext's Einsum gap kernel takes the equations Keras' attention emits: on the GPU with it.
    ours = _entries(inspect.placement_report(model, mode="train", predict_for=PLUGIN), "Einsum")
    assert ours and {e.outcome for e in ours} == {predict.GAP}


def test_plugin_flags_the_bfloat16_ops_of_a_mixed_bfloat16_model(policy):
    policy("mixed_bfloat16")
    model = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="d1"),
                                        keras.layers.Dense(4, name="d2")]))
    report = inspect.placement_report(model, mode="train", predict_for=PLUGIN)
    # Reference: every compute node of the traced step that computes in bfloat16, read from the graph.
    with predict.tracing_as(PLUGIN):
        x = np.zeros((8, 16), "float32")
        cap = capture.trace_train(model, x, np.zeros((8, 4), "float32"))
    bf16_ops = {n.op for n in cap.nodes()
                if n.attr["T"].type == tf.bfloat16.as_datatype_enum and n.op not in predict.PLUMBING_OPS}
    assert {"MatMul", "BiasAdd", "Relu"} <= bf16_ops
    flagged = {e.op for e in report.missing if e.dtype == "bfloat16"}
    assert bf16_ops <= flagged, (bf16_ops - flagged, str(report))
    matmul = [e for e in report.missing if e.op == "MatMul" and e.dtype == "bfloat16"]
    assert {e.layer for e in matmul} >= {"d1", "d2"}
    assert all(e.outcome == predict.FALLBACK for e in matmul)  # TF has bfloat16 CPU MatMul kernels
    assert not [e for e in report.missing if e.dtype == "float32" and e.layer in ("d1", "d2")], str(report)


def test_plugin_flags_cudnn_rnn_v3_of_stock_lstm_as_a_failure():
    assert not _cpu_kernel("CudnnRNNV3")  # the reason it fails rather than falls back
    report = inspect.placement_report(_lstm_model(), mode="train", predict_for=PLUGIN)
    rnn = _entries(report, "CudnnRNNV3")
    assert len(rnn) == 1 and rnn[0].layer == "lstm" and rnn[0].outcome == predict.FAILS, str(report)
    assert rnn[0] in report.fails
    assert [e.layer for e in _entries(report, "CudnnRNNBackpropV3")] == ["lstm"]
    assert "fails" in str(report)
    with pytest.raises(AssertionError, match="would not run on the GPU"):
        inspect.assert_no_cpu_fallback(report)


def _fused_model():
    from tfmetal_ext import layers

    x = keras.Input((8, 8, 3))
    y = layers.ConvBNAct(8, 3, activation="relu", name="cba")(x)
    y = keras.layers.Reshape((8, 64))(y)
    y = layers.FusedLSTM(16, name="flstm")(y)
    y = layers.FusedDense(4, activation="relu", name="fd")(y)
    return _compiled(keras.Model(x, y))


def _fused_lstm_emits_cudnn_on_plugin():
    from tfmetal_ext import layers

    layer = layers.FusedLSTM(4)
    with predict.tracing_as(PLUGIN):
        cap = capture.trace_function(lambda s: layer(s), tf.zeros((2, 3, 4)))
    return any(n.op.startswith("CudnnRNN") for n in cap.nodes())


# Keras' own train step outside any layer: the compiled loss's and the loss tracker's DivNoNan, the
# loss gradient's BroadcastTo, LossScaleOptimizer's IsFinite / Pack(bool) and the int64 step counters.
# The plugin registers none of them, so they fall back on every Keras model; no layer choice changes it.
STEP_ROWS = ("loss", None)


@pytest.mark.parametrize("optimizer", ["adam", "fused_adam"])
def test_plugin_reports_only_host_ops_for_a_mixed_float16_fused_model(policy, request, optimizer):
    from tfmetal_ext import optimizers

    if _fused_lstm_emits_cudnn_on_plugin():
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="FusedLSTM still emits CudnnRNNV3 on the open plugin (issue 14 item 5 pending)"))
    policy("mixed_float16")
    model = _fused_model()
    model.compile(optimizer=optimizers.FusedAdam() if optimizer == "fused_adam" else "adam", loss="mse")
    # Our gap kernels of AssignVariableOp / AssignAddVariableOp / AssignSubVariableOp take every variable
    # update off the host there (and the multi-tensor op is on the GPU): no host op at all.
    covered = inspect.placement_report(model, mode="train", predict_for=PLUGIN)
    assert not covered.fails and not covered.unknown and not covered.host, str(covered)
    assert {e.op for e in covered.entries if e.outcome == predict.GAP} >= {"AssignVariableOp"}, str(covered)
    # Without them, what the plugin itself leaves on the host on TF 2.21: variable updates only.
    bare = inspect.placement_report(model, mode="train", predict_for=PLUGIN, gap_kernels=False)
    assert {e.op for e in bare.host} <= {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}, str(bare)
    assert [e for e in bare.host if e.layer == "cba" and e.op == "AssignVariableOp"], str(bare)  # moving statistics
    report = covered
    ours = {"cba", "flstm", "fd"}
    for e in report.missing:
        if e.layer in ours:
            # Only the batch norm's moving statistics: variable updates, on the host on TF 2.21.
            assert e.outcome == predict.HOST and e.op == "AssignVariableOp" and e.layer == "cba", str(report)
        elif e.outcome == predict.HOST:
            assert e.op.startswith(("ResourceApply", "Assign")), str(report)
        else:
            assert e.layer in STEP_ROWS or e.layer.startswith("optimizer "), str(report)
            assert e.op in ("DivNoNan", "BroadcastTo", "IsFinite", "Pack", "AddV2"), str(report)
    host = [e for e in bare.host if e.layer and e.layer.startswith("optimizer ")]
    assert host and all("optimizer's update op" in e.reason and "resource-variable" in e.reason for e in host)
    if optimizer == "fused_adam":
        # FusedAdam's one multi-tensor op has a Metal kernel there (variables through TF's C++ API): of its
        # update only the step counter's assignment is left.
        assert {(e.op, e.dtype) for e in host} == {("AssignVariableOp", "int64")}, str(bare)
        assert not [e for e in bare.entries if e.op == "TfmetalExt>MultiTensorAdam"], str(bare)
    assert "runs on the host" in str(bare) and "runs on the host" not in str(covered)


# ----------------------------------------------------------------------------
# Apple's plugin, arguments, tracing.


def test_apple_plugin_has_cudnn_rnn_v3_so_stock_lstm_is_not_flagged():
    report = inspect.placement_report(_lstm_model(), mode="train", predict_for=APPLE)
    assert report.predicted_for == APPLE and report.table_complete
    assert not [e for e in report.entries if e.op.startswith("CudnnRNN")], str(report)
    # ...while the same step traced for the open plugin has the op (so it was traced as on a GPU).
    assert _entries(inspect.placement_report(_lstm_model(), mode="train", predict_for=PLUGIN), "CudnnRNNV3")
    assert "complete" in str(report) and not report.unknown, str(report)


@pytest.mark.parametrize("bad", ["cuda", "metal", "", "Tensorflow-Metal", 3])
def test_bad_predict_for(bad):
    with pytest.raises(ValueError, match="Received: predict_for="):
        inspect.placement_report(lambda x: x * 2.0, tf.ones((2,)), predict_for=bad)


def test_the_step_is_traced_not_run():
    model = _lstm_model()
    model.build((None, 6, 4))
    before = [v.numpy().copy() for v in model.weights]
    inspect.placement_report(model, mode="train", predict_for=PLUGIN)
    # CudnnRNNV3 has no CPU kernel: had the step run here it would have raised.
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.weights))
    assert int(model.optimizer.iterations.numpy()) == 0


def test_keras_gpu_branches_are_restored_and_only_inside():
    import importlib

    rnn = importlib.import_module("keras.src.backend.tensorflow.rnn")
    nn = importlib.import_module("keras.src.backend.tensorflow.nn")
    originals = rnn._is_gpu_available, nn._cpu_only
    with predict.keras_gpu_branches():
        assert rnn._is_gpu_available() is True and nn._cpu_only() is False
    assert (rnn._is_gpu_available, nn._cpu_only) == originals
    # Outside, a stock LSTM on this host traces Keras' loop, not CudnnRNNV3.
    if not tf.config.list_logical_devices("GPU"):
        layer = keras.layers.LSTM(4)
        cap = capture.trace_function(lambda s: layer(s), tf.zeros((2, 3, 4)))
        assert not any(n.op.startswith("CudnnRNN") for n in cap.nodes())
    assert devices.assumed_backend() is None


def test_predicted_report_str_dict_and_function_input():
    report = inspect.placement_report(lambda a, b: tf.einsum("ij,jk->ik", a, b),
                                      (tf.ones((2, 3)), tf.ones((3, 4))), predict_for=PLUGIN)
    assert isinstance(report, inspect.PredictedPlacementReport) and isinstance(report, PlacementReport)
    assert [e.op for e in report.missing] == ["Einsum"] and report.missing[0].layer is None
    d = report.to_dict()
    assert d["predicted_for"] == PLUGIN and [m["op"] for m in d["missing"]] == ["Einsum"]
    text = str(report)
    assert text.startswith(f"Predicted placement (function) on {PLUGIN}") and "Einsum" in text


def test_an_op_of_constants_is_folded_not_a_fallback():
    # Apple's tensorflow-metal has no half MatrixDiagV3. Keras' extract_patches builds its identity kernel
    # with tf.eye from constants: grappler folds that into a constant before the step runs, so it never
    # falls back; the same op on a computed input does.
    def eye_of_constants(x):
        return tf.matmul(x, tf.eye(4, dtype=tf.float16))

    def diag_of_input(x):
        return tf.linalg.diag(x[0])

    x = tf.ones((2, 4), tf.float16)
    folded = inspect.placement_report(eye_of_constants, (x,), predict_for="tensorflow-metal")
    assert not _entries(folded, "MatrixDiagV3"), folded
    computed = inspect.placement_report(diag_of_input, (x,), predict_for="tensorflow-metal")
    assert [e.outcome for e in _entries(computed, "MatrixDiagV3")] == [predict.FALLBACK], computed
    # Grappler leaves results over 10 MiB unfolded, and so does the prediction.
    def diag_of(n):
        diagonal = np.ones(n, np.float16)
        return lambda a: a + tf.linalg.diag(tf.constant(diagonal))[0, :4]

    under = inspect.placement_report(diag_of(2200), (x,), predict_for="tensorflow-metal")  # 9.7 MB
    assert not _entries(under, "MatrixDiagV3"), under
    over = inspect.placement_report(diag_of(2400), (x,), predict_for="tensorflow-metal")  # 11.5 MB > 10 MiB
    assert [e.outcome for e in _entries(over, "MatrixDiagV3")] == [predict.FALLBACK], over


def test_a_chain_of_constants_folds_to_its_end_as_grappler_folds_it():
    # A loss's element count: Prod of constant dimensions (int32, host memory on a GPU), then its Cast to
    # the compute dtype. Grappler folds both, so no copy reaches the device op that reads the count; the
    # reference is this CPU's own run, whose optimized graph holds neither.
    def scaled(x):
        count = tf.reduce_prod(tf.constant([3, 4]), name="count")
        return x / tf.cast(count, tf.float16, name="count_cast")

    x = tf.ones((2, 4), tf.float16)
    r = inspect.placement_report(scaled, (x,), predict_for="tensorflow-metal")
    assert r.transfer_count == 0, r.transfers
    ran = capture.capture_function(scaled, x)
    names = {n.name for fg in ran.functions for n in fg.graph.node}
    assert not {"count", "count_cast"} & names, names
    traced = capture.trace_function(scaled, x)
    body = [nodes for nodes in predict._functions(traced)][0]
    assert predict._constant_folded(body) >= {"count", "count_cast"}

    # The same chain from an argument is computed in the step: nothing of it folds.
    def computed(x, n):
        return x / tf.cast(tf.reduce_prod(n, name="count"), tf.float16, name="count_cast")

    traced = capture.trace_function(computed, x, tf.constant([3, 4]))
    body = [nodes for nodes in predict._functions(traced)][0]
    assert not {"count", "count_cast"} & predict._constant_folded(body)


def test_bfloat16_contraction_chain_is_listed_float32_chain_is_fused_away():
    table = None
    with devices.assume_backend(PLUGIN):
        from tfmetal_ext import backends

        table = backends.current()
    if not table.kernels_complete:
        pytest.skip("the plugin's generated kernel table has not landed (its kernels are unknown)")

    def chain(dtype):
        def fn(x, w, b):
            return tf.nn.relu(tf.nn.bias_add(tf.matmul(tf.cast(x, dtype), tf.cast(w, dtype)), tf.cast(b, dtype)))
        return inspect.placement_report(fn, (tf.ones((2, 3)), tf.ones((3, 4)), tf.ones((4,))), predict_for=PLUGIN)

    assert {e.op for e in chain("bfloat16").missing} >= {"MatMul", "BiasAdd", "Relu"}
    assert not chain("float32").missing


# ----------------------------------------------------------------------------
# MetalCallback on a Mac: real vs predicted (the logic, fed fake reports).


def _prediction(entries):
    missing = [e for e in entries if e.outcome != predict.UNKNOWN]
    return inspect.PredictedPlacementReport(
        mode="train", gpu_present=True, ops_by_device={},
        fallbacks=[FallbackNode(e.op, e.name, e.layer, "CPU:0") for e in missing],
        predicted_for=PLUGIN, table="metal_plugin", table_complete=True, entries=entries)


def test_differences_between_real_and_predicted():
    predicted = _prediction([
        inspect.PredictedOp("Einsum", "float32", "mha/query", predict.FALLBACK, "no kernel", 1, "mha/query/Einsum"),
        inspect.PredictedOp("Erf", "float32", "gelu", predict.FALLBACK, "no kernel", 1, "gelu/Erf"),
        inspect.PredictedOp("Foo", "float32", "x", predict.UNKNOWN, "not in the table", 1, "x/Foo"),
    ])
    real = PlacementReport(mode="train", gpu_present=True, ops_by_device={"GPU:0": 10, "CPU:0": 3}, fallbacks=[
        FallbackNode("Einsum", "mha/query/Einsum", "mha/query", "CPU:0"),
        FallbackNode("RngReadAndSkip", "RngReadAndSkip", None, "CPU:0"),
        FallbackNode("Foo", "x/Foo", "x", "CPU:0"),
    ])
    notes = predict.differences(real, predicted)
    assert len(notes) == 3, notes
    assert any("Erf" in n and "ran on the GPU" in n for n in notes)
    assert any("RngReadAndSkip" in n and "had a kernel" in n for n in notes)
    assert any("Foo" in n and "did not know" in n for n in notes)
    assert not any("Einsum" in n for n in notes)  # predicted and real agree
    same = PlacementReport("train", True, {}, [FallbackNode("Einsum", "n", "mha/query", "CPU:0"),
                                               FallbackNode("Erf", "n", "gelu", "CPU:0"),
                                               FallbackNode("Foo", "n", "x", "CPU:0")])
    assert [n for n in predict.differences(same, predicted) if "Foo" not in n] == []


def test_callback_compares_only_on_a_real_mac():
    from tfmetal_ext.callbacks import _capture

    real = PlacementReport("train", True, {"GPU:0": 4}, [])
    predicted = _prediction([
        inspect.PredictedOp("Einsum", "float32", "mha", predict.FALLBACK, "no kernel", 1, "mha/Einsum")])
    calls = []

    def fake_predict(model, plugin):
        calls.append(plugin)
        return predicted

    mac = devices.capabilities().__class__(**{**devices.capabilities().to_dict(), "backend": "metal",
                                              "metal_plugin": PLUGIN, "gpus": ("/physical_device:GPU:0",)})
    got, notes = _capture.compare_with_prediction(None, real, caps=mac, predict=fake_predict)
    assert got is predicted and calls == [PLUGIN]
    assert len(notes) == 1 and "Einsum" in notes[0] and "ran on the GPU" in notes[0]
    # Not on a Mac, or only assumed to be one: no prediction.
    here = devices.capabilities()
    if here.backend != "metal":
        assert _capture.compare_with_prediction(None, real, caps=here, predict=fake_predict) == (None, [])
    with devices.assume_backend(PLUGIN):
        assert _capture.compare_with_prediction(None, real, caps=mac, predict=fake_predict) == (None, [])
    assert calls == [PLUGIN]

    def broken(model, plugin):
        raise ValueError("no input spec")

    got, notes = _capture.compare_with_prediction(None, real, caps=mac, predict=broken)
    assert got is None and "no placement prediction" in notes[0]
    # The notes reach the printed summary.
    lines, _ = _capture.summarize(None, [], None, PlacementReport("train", True, {}, [], notes=notes))
    assert any("no placement prediction" in line for line in lines)


def test_the_table_names_the_attribute_to_judge():
    # GatherV2's kernels are listed by Tparams: float32 params with int32 indices have a kernel.
    report = inspect.placement_report(lambda p, i: tf.gather(p, i), (tf.ones((4, 3)), tf.constant([0, 2])),
                                      predict_for=PLUGIN)
    assert not report.missing, str(report)
    bf16 = inspect.placement_report(lambda p, i: tf.gather(tf.cast(p, tf.bfloat16), i),
                                    (tf.ones((4, 3)), tf.constant([0, 2])), predict_for=PLUGIN)
    assert {e.op for e in bf16.missing} == {"GatherV2"} and bf16.missing[0].dtype == "bfloat16", str(bf16)


def test_real_placement_report_prints_its_notes():
    text = str(PlacementReport("train", True, {"GPU:0": 3}, [], notes=["differs from the prediction"]))
    assert "note: differs from the prediction" in text


def test_metal_callback_on_a_mac_notes_where_real_and_predicted_differ(monkeypatch):
    """The wiring, on Linux: capabilities say "a Mac with the open plugin" (not assumed), so the callback
    predicts; this host ran everything on its CPU, so every op with a plugin kernel is a difference."""
    from tfmetal_ext.callbacks import MetalCallback

    here = devices.capabilities()
    mac = here.__class__(**{**here.to_dict(), "backend": "metal", "metal_plugin": PLUGIN,
                            "gpus": ("/physical_device:GPU:0",)})
    monkeypatch.setattr(devices, "capabilities", lambda: mac)
    model = _compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc")]))
    lines = []
    cb = MetalCallback(print_fn=lines.append)
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), epochs=1, verbose=0, callbacks=[cb])
    assert isinstance(cb.predicted_placement_report, inspect.PredictedPlacementReport)
    assert cb.predicted_placement_report.predicted_for == PLUGIN
    notes = cb.placement_report.notes
    assert any(n.startswith("BiasAddGrad in fc ran on the CPU") and "had a kernel" in n for n in notes), notes
    assert len(notes) <= 11 and notes[-1].startswith("... and "), notes  # capped in the summary
    assert any("placement note: BiasAddGrad in fc ran on the CPU" in line for line in "\n".join(lines).splitlines())
