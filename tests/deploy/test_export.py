"""`tfmetal_ext.export`: portable forms (stock TF ops only) and each format's artifact, run by its runtime.

The references here are independent of the package's checking code: each format's runtime is called
directly in the test (onnxruntime, the LiteRT interpreter, OpenVINO) and compared with numpy to the
Keras model's own outputs.
"""

import os
import platform

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import deploy, layers as fl
from tfmetal_ext.deploy import formats, runtimes
from tfmetal_ext.ops import _common

L = keras.layers


def _fused_model(seq=6, width=16):
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq, width), name="tokens")
    x = fl.FusedLayerNorm(name="ln")(inp)
    x = fl.FusedMultiHeadAttention(num_heads=2, key_dim=8, name="mha")(x, x)
    x = fl.FusedRMSNorm(name="rms")(x)
    x = fl.FusedDense(8, activation="relu", name="dense")(x)
    return keras.Model(inp, x)


def _x(seq=6, width=16, batch=3, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, seq, width)).astype("float32")


def _op_types(concrete):
    gd = concrete.graph.as_graph_def()
    return {n.op for n in gd.node} | {n.op for f in gd.library.function for n in f.node_def}


def _rel(expected, got):
    expected = np.asarray(expected, "float64")
    return float(np.max(np.abs(expected - np.asarray(got, "float64"))) / np.max(np.abs(expected)))


def _requires(fmt):
    missing = formats.missing_modules(formats.FORMATS[fmt])
    return pytest.mark.skipif(bool(missing), reason=f"{fmt} needs {missing} (pip install 'tfmetal-ext[export]')")


# ----------------------------------------------------------------------------
# Portable forms.


def test_portable_forms_trace_no_custom_op():
    model = _fused_model()
    spec = tf.TensorSpec([None, 6, 16], tf.float32)
    with deploy.portable_forms():
        inside = _op_types(tf.function(lambda x: model(x, training=False)).get_concrete_function(spec))
    outside = _op_types(tf.function(lambda x: model(x, training=False)).get_concrete_function(spec))
    assert not [o for o in inside if o.startswith("TfmetalExt>")]
    # No custom-gradient wrapper either (its IdentityN leaves dead ends OpenVINO exposes as outputs).
    assert "IdentityN" not in inside
    # The stock forms where the custom ops were: MHA's own Softmax, the norms' Rsqrt.
    assert {"Softmax", "Rsqrt", "MatMul", "Relu"} <= inside
    if _common.library() is not None:  # the same trace outside the block does hold the custom ops
        assert {"TfmetalExt>LayerNorm", "TfmetalExt>Attention", "TfmetalExt>RMSNorm"} <= outside


def test_portable_forms_is_scoped():
    from tfmetal_ext import _env

    with deploy.portable_forms():
        assert _env.current().portable and _common.library() is None
    assert not _env.current().portable


def test_portable_recurrent_layer_runs_keras_loop():
    keras.utils.set_random_seed(0)
    lstm = fl.FusedLSTM(4, name="lstm")
    lstm.build((None, 5, 3))
    with deploy.portable_forms():
        y = lstm(_x(5, 3))
        assert lstm.form == "stock"
    ref = L.LSTM(4)
    ref.build((None, 5, 3))
    ref.set_weights(lstm.get_weights())
    np.testing.assert_allclose(y, ref(_x(5, 3)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Arguments.


def test_bad_arguments_get_clear_errors(tmp_path):
    model = _fused_model()
    with pytest.raises(ValueError, match="format="):
        tfmetal_ext.export(model, tmp_path / "m.onnx", format="tflite")
    with pytest.raises(ValueError, match=r"\.onnx file.*Received: path="):
        tfmetal_ext.export(model, tmp_path / "m.tflite", format="onnx")
    with pytest.raises(ValueError, match="Received: model="):
        tfmetal_ext.export("model.keras", tmp_path / "m.onnx", format="onnx")
    with pytest.raises(ValueError, match="must be built"):
        tfmetal_ext.export(keras.Sequential([L.Dense(2)]), tmp_path / "m.onnx", format="onnx")
    with pytest.raises(ValueError, match="does not exist"):
        tfmetal_ext.export(model, tmp_path / "nowhere" / "m.onnx", format="onnx")


def test_missing_converter_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "missing_modules", lambda fmt: ["tf2onnx (ImportError: No module named 'tf2onnx')"])
    with pytest.raises(ImportError, match=r"tfmetal-ext\[export\]"):
        tfmetal_ext.export(_fused_model(), tmp_path / "m.onnx", format="onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_every_format_has_a_runtime_and_a_cli_choice():
    from tfmetal_ext import cli

    assert set(runtimes._RUNNERS) == set(formats.FORMATS)
    export = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["export"]._actions
                  if a.dest == "format")
    assert tuple(export.choices) == tuple(formats.FORMATS)


# ----------------------------------------------------------------------------
# The artifacts, run by their runtimes in the test.


@_requires("onnx")
def test_onnx_export_runs_in_onnxruntime_as_keras(tmp_path):
    import onnx
    import onnxruntime as ort

    model, x = _fused_model(), _x()
    path = str(tmp_path / "m.onnx")
    report = tfmetal_ext.export(model, path, format="onnx")
    assert report.max_rel_error is not None and report.max_rel_error <= formats.FLOAT32_RTOL
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert _rel(model.predict(x, verbose=0), got) <= 1e-5
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert "Softmax" in ops and not any("Tfmetal" in o for o in ops)


@_requires("litert")
def test_litert_export_runs_in_the_interpreter_as_keras(tmp_path):
    from ai_edge_litert import interpreter as litert

    model, x = _fused_model(), _x()
    path = str(tmp_path / "m.tflite")
    report = tfmetal_ext.export(model, path, format="litert")
    assert report.max_rel_error <= formats.FLOAT32_RTOL and report.size_bytes == os.path.getsize(path)
    runner = litert.Interpreter(model_path=path).get_signature_runner()
    (got,) = runner(**{next(iter(runner.get_input_details())): x}).values()
    assert _rel(model.predict(x, verbose=0), got) <= 1e-5
    # TFLite fused the Dense's BiasAdd + Relu into its FULLY_CONNECTED (the target's own fusion).
    assert "FULLY_CONNECTED" in report.ops and "RELU" not in report.ops


@pytest.mark.full  # a Python process that starts TensorFlow (about 8 s)
def test_saved_model_loads_in_a_process_without_tfmetal_ext(tmp_path):
    model = _fused_model()
    report = tfmetal_ext.export(model, tmp_path / "sm", format="tf_saved_model")
    assert "without tfmetal_ext" in report.note
    assert report.max_rel_error <= formats.FLOAT32_RTOL
    assert "Softmax" in report.ops and not any(o.startswith("TfmetalExt") for o in report.ops)


@pytest.mark.full
@pytest.mark.skipif(_common.library() is None, reason="needs the op library to write a graph with a custom op")
def test_the_isolated_process_really_lacks_tfmetal_ext(tmp_path):
    """A SavedModel holding a TfmetalExt op does not load there (so a passing load proves portability)."""
    from tfmetal_ext.ops.layer_norm import layer_norm

    module = tf.Module()
    module.serve = tf.function(lambda x: layer_norm(x, epsilon=1e-3),
                               input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "custom"))
    with pytest.raises(runtimes.RuntimeRefused, match="TfmetalExt>LayerNorm"):
        runtimes.run_without_tfmetal_ext("saved_model", str(tmp_path / "custom"),
                                         [np.ones((2, 4), "float32")], {"kind": "single", "keys": None})


@pytest.mark.full
@_requires("openvino")
def test_openvino_export_of_a_converted_gpt2_backbone(tmp_path):
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install 'tfmetal-ext[hub]')")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=16)
    converted = tfmetal_ext.convert(backbone, count_ops=False)
    x = {"token_ids": np.random.default_rng(0).integers(1, 100, (2, 8)).astype("int32"),
         "padding_mask": np.ones((2, 8), "int32")}
    report = tfmetal_ext.export(converted, tmp_path / "gpt2.xml", format="openvino", inputs=x)
    assert report.max_rel_error <= formats.FLOAT32_RTOL


@pytest.mark.full
@_requires("openvino")
def test_openvino_export_runs_as_keras(tmp_path):
    import openvino as ov

    model, x = _fused_model(), _x()
    path = str(tmp_path / "m.xml")
    report = tfmetal_ext.export(model, path, format="openvino")
    assert report.max_rel_error <= formats.FLOAT32_RTOL
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = compiled([x])[compiled.outputs[0]]
    assert _rel(model.predict(x, verbose=0), got) <= 1e-5


@pytest.mark.full
@_requires("coreml")
def test_coreml_export_reads_back_its_program(tmp_path):
    report = tfmetal_ext.export(_fused_model(), tmp_path / "m.mlpackage", format="coreml")
    assert {"softmax", "matmul", "rsqrt"} <= set(report.ops)
    if platform.system() != "Darwin":
        assert report.max_rel_error is None and "needs a Mac" in report.note
    else:
        assert report.max_rel_error <= formats.FLOAT32_RTOL


@pytest.mark.metal
@_requires("coreml")
def test_coreml_export_predicts_as_keras_on_a_mac(tmp_path):
    if platform.system() != "Darwin":
        pytest.skip("Core ML predicts on macOS only")
    report = tfmetal_ext.export(_fused_model(), tmp_path / "m.mlpackage", format="coreml")
    assert report.max_rel_error is not None and report.max_rel_error <= formats.FLOAT32_RTOL


# ----------------------------------------------------------------------------
# The check itself.


@_requires("onnx")
def test_an_artifact_that_differs_is_refused_and_removed(tmp_path, monkeypatch):
    real = runtimes.run

    def off_by_a_little(*a, **k):
        outs, ops, note = real(*a, **k)
        return [o * 1.001 for o in outs], ops, note

    monkeypatch.setattr(runtimes, "run", off_by_a_little)
    path = tmp_path / "m.onnx"
    with pytest.raises(deploy.ExportError, match="differs from the Keras model") as info:
        tfmetal_ext.export(_fused_model(), path, format="onnx")
    assert not path.exists() and info.value.report.max_rel_error > formats.FLOAT32_RTOL


@_requires("onnx")
def test_int8_export_is_dequantize_and_matmul(tmp_path):
    import onnxruntime as ort

    keras.utils.set_random_seed(0)
    inp = keras.Input((12,))
    model = keras.Model(inp, L.Dense(5, name="out")(L.Dense(16, activation="relu", name="hidden")(inp)))
    x = np.random.default_rng(2).standard_normal((4, 12)).astype("float32")
    path = str(tmp_path / "m.onnx")
    report = tfmetal_ext.export(model, path, format="onnx", int8=True, inputs=x)
    assert report.int8 and report.max_rel_error <= formats.FLOAT32_RTOL
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x})
    # Independent reference: Keras' own weight-only int8 quantization of the stock model (its
    # default would also quantize the activations; ours are float).
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    ref.quantize("int8", config=keras.quantizers.Int8QuantizationConfig(activation_quantizer=None))
    np.testing.assert_allclose(got, ref.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, model.predict(x, verbose=0), rtol=1e-6, atol=0)  # it is the int8 model


@pytest.mark.full
@_requires("onnx")
def test_mixed_precision_model_is_held_to_its_compute_dtype_bound(tmp_path):
    from tfmetal_ext.conversion.verify import OUTPUT_RTOL

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _fused_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    report = tfmetal_ext.export(model, tmp_path / "m.onnx", format="onnx")
    assert report.tolerance == OUTPUT_RTOL["float16"] and report.max_rel_error <= report.tolerance


@pytest.mark.full
@_requires("onnx")
def test_converted_keras_hub_model_exports_its_stock_code(tmp_path):
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install 'tfmetal-ext[hub]')")
    import onnxruntime as ort

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=100, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
    converted = tfmetal_ext.convert(backbone, count_ops=False)
    ids = np.random.default_rng(0).integers(1, 100, (2, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones((2, 8), "int32")}
    path = str(tmp_path / "llama.onnx")
    report = tfmetal_ext.export(converted, path, format="onnx", inputs=x)
    assert report.max_rel_error <= formats.FLOAT32_RTOL
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {i.name: x["token_ids" if "token" in i.name else "padding_mask"] for i in sess.get_inputs()}
    (got,) = sess.run(None, feed)
    assert _rel(backbone.predict(x, verbose=0), got) <= 1e-4  # against the stock backbone itself


def _zero_bias_mlp():
    """Dense -> relu with the bias all zeros (a fresh model): the case the TFLite converter mishandles
    for a kernel computed in the graph (see `tfmetal_ext.ops.int8.portable_int8_matmul`). The hidden
    kernel is big enough that the converter keeps it int8 rather than folding it to float32."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((256,))
    return keras.Model(inp, L.Dense(4, name="out")(L.Dense(512, activation="relu", name="hidden")(inp)))


@_requires("litert")
def test_litert_int8_keeps_int8_weights_and_the_activation(tmp_path):
    from ai_edge_litert import interpreter as litert

    model = _zero_bias_mlp()
    x = np.random.default_rng(3).standard_normal((5, 256)).astype("float32")
    path = str(tmp_path / "m.tflite")
    report = tfmetal_ext.export(model, path, format="litert", int8=True, inputs=x)
    # The kernels stay int8 (a CAST where they are read): about a quarter of the float32 file's weights.
    float_report = tfmetal_ext.export(model, str(tmp_path / "f.tflite"), format="litert", inputs=x)
    assert "CAST" in report.ops and report.size_bytes < 0.5 * float_report.size_bytes
    runner = litert.Interpreter(model_path=path).get_signature_runner()
    (got,) = runner(**{next(iter(runner.get_input_details())): x}).values()
    # Independent reference in numpy, from the definition: Keras' abs-max int8 per output column.
    h = x
    for layer in (model.get_layer("hidden"), model.get_layer("out")):
        w, b = layer.get_weights()
        scale = 127.0 / (np.max(np.abs(w), axis=0) + keras.backend.epsilon())
        q = np.clip(np.round(w * scale), -127, 127)
        h = (h.astype("float64") @ q) / scale + b
        if layer.name == "hidden":
            h = np.maximum(h, 0.0)
    assert _rel(h, got) <= 1e-5 and report.max_rel_error <= formats.FLOAT32_RTOL


@_requires("litert")
def test_litert_float16_weights_within_the_float16_bound(tmp_path):
    from tfmetal_ext.conversion.verify import OUTPUT_RTOL

    model = _zero_bias_mlp()
    report = tfmetal_ext.export(model, tmp_path / "m.tflite", format="litert", float16=True)
    assert report.float16 and report.tolerance == OUTPUT_RTOL["float16"]
    assert "DEQUANTIZE" in report.ops and 0 < report.max_rel_error <= report.tolerance
    with pytest.raises(ValueError, match="float16"):
        tfmetal_ext.export(model, tmp_path / "m.onnx", format="onnx", float16=True)


def test_readme_deploying_names_every_format():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    section = readme.split("### Deploying", 1)[1].split("\n### ", 1)[0]
    for name, fmt in formats.FORMATS.items():
        assert f"`{name}`" in section, name
        for pip_name in fmt.pip:
            assert pip_name in section, pip_name


def test_a_model_without_synthetic_inputs_asks_for_inputs(tmp_path):
    inp = keras.Input((), dtype="string")
    model = keras.Model(inp, L.StringLookup(vocabulary=["a", "b"])(inp))
    with pytest.raises(ValueError, match=r"export\(\.\.\., inputs=x\).*Received: inputs=None"):
        tfmetal_ext.export(model, tmp_path / "m.onnx", format="onnx")


@_requires("onnx")
def test_exact_gelu_of_our_layers_exports_to_onnx_where_keras_gelu_does_not(tmp_path):
    """Keras' exact GELU traces to Erfc, which onnxruntime refuses; our layers' portable GELU is erf-based."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    ours = keras.Model(inp, fl.FusedDense(4, activation="gelu")(inp))
    x = np.random.default_rng(4).standard_normal((6, 8)).astype("float32") * 3
    report = tfmetal_ext.export(ours, tmp_path / "ours.onnx", format="onnx", inputs=x)
    assert "Erf" in report.ops and "Erfc" not in report.ops and report.max_rel_error <= formats.FLOAT32_RTOL
    w, b = ours.get_weights()
    z = x.astype("float64") @ w + b
    from math import erf

    ref = 0.5 * z * (1 + np.vectorize(erf)(z / np.sqrt(2)))  # the definition, in float64
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "ours.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert _rel(ref, got) <= 1e-5
    stock = keras.Model(inp, L.Dense(4, activation="gelu")(inp))
    with pytest.raises(deploy.ExportError, match="Erfc"):  # the peer's own result, for comparison
        tfmetal_ext.export(stock, tmp_path / "stock.onnx", format="onnx", inputs=x)


@pytest.mark.full
@_requires("coreml")
def test_coreml_int8_embedding_names_the_working_route(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,), dtype="int32")
    model = keras.Model(inp, L.Dense(3)(L.Flatten()(L.Embedding(50, 8)(inp))))
    x = np.random.default_rng(0).integers(0, 50, (2, 5)).astype("int32")
    with pytest.raises(deploy.ExportError, match="int8 table.*float16=True"):
        tfmetal_ext.export(model, tmp_path / "m.mlpackage", format="coreml", int8=True, inputs=x)
    assert not (tmp_path / "m.mlpackage").exists()
    report = tfmetal_ext.export(model, tmp_path / "f.mlpackage", format="coreml", float16=True, inputs=x)
    assert "gather" in report.ops


@_requires("onnx")
def test_int8_exact_gelu_exports_to_onnx(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    model = keras.Model(inp, L.Dense(4, activation="gelu")(inp))
    report = tfmetal_ext.export(model, tmp_path / "m.onnx", format="onnx", int8=True)
    assert "Erf" in report.ops and "Erfc" not in report.ops and report.max_rel_error <= formats.FLOAT32_RTOL


@_requires("onnx")
def test_verify_false_only_writes(tmp_path):
    report = tfmetal_ext.export(_fused_model(), tmp_path / "m.onnx", format="onnx", verify=False)
    assert (tmp_path / "m.onnx").exists() and report.max_rel_error is None and report.ops == []
    assert "not checked" in str(report) and report.size_bytes == os.path.getsize(tmp_path / "m.onnx")
