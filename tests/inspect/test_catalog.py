"""The catalog's expectations for backends absent here (Metal, CUDA, CPU without oneDNN).

Expected values come from TF's remapper conditions (remapper.cc) and tensorflow-metal's published
kernels and patterns, written out here, not from running the code.
"""

import keras
import pytest

from tfmetal_ext.inspect import PATTERNS, catalog
from tfmetal_ext.inspect.catalog import FusionContext


def _built(layer, shape):
    layer.build(shape)
    return layer


def conv(act="relu", kernel=3, dtype=None, bias=True):
    return _built(keras.layers.Conv2D(4, kernel, activation=act, use_bias=bias, dtype=dtype), (None, 8, 8, 3))


def dense(act="relu", dtype=None):
    return _built(keras.layers.Dense(4, activation=act, dtype=dtype), (None, 3))


def ctx(backend, **kw):
    kw.setdefault("onednn", backend == "cpu")
    kw.setdefault("cublaslt", False)
    return FusionContext(backend=backend, **kw)


def test_every_pattern_names_all_backends():
    for p in PATTERNS.values():
        assert set(p.support) == {"cpu_onednn", "cpu", "cuda", "metal", "metal_plugin"}, p.name


def test_metal_conv_relu_float_and_half_fuse_bf16_does_not():
    for policy in ("float32", "mixed_float16"):
        exp = catalog.expectation(conv(dtype=policy), ctx("metal"))
        assert (exp.op, exp.fused_ops) == ("_FusedConv2D", ("BiasAdd", "Relu"))
    exp = catalog.expectation(conv(dtype="mixed_bfloat16"), ctx("metal"))
    assert exp.op is None and "bfloat16 on Metal" in exp.reason


def test_metal_dense_relu_carries_miscompute_note():
    exp = catalog.expectation(dense(), ctx("metal"))
    assert (exp.op, exp.fused_ops) == ("_FusedMatMul", ("BiasAdd", "Relu"))
    assert "miscompute" in exp.note


def test_metal_tanh_only_bias_fuses():
    exp = catalog.expectation(dense("tanh"), ctx("metal"))
    assert exp.fused_ops == ("BiasAdd",) and exp.ideal_fused_ops == ("BiasAdd", "Tanh")


def test_cuda_conv_needs_relu_and_not_1x1():
    assert catalog.expectation(conv("relu"), ctx("cuda")).fused_ops == ("BiasAdd", "Relu")
    assert catalog.expectation(conv(None), ctx("cuda")).op is None
    exp = catalog.expectation(conv("relu", kernel=1), ctx("cuda"))
    assert exp.op is None and "1x1" in exp.reason


def test_cuda_matmul_only_with_cublaslt():
    assert "TF_USE_CUBLASLT" in catalog.expectation(dense(), ctx("cuda")).reason
    assert catalog.expectation(dense(), ctx("cuda", cublaslt=True)).op == "_FusedMatMul"


def test_cpu_without_onednn():
    no = ctx("cpu", onednn=False)
    assert catalog.expectation(conv(), no).fused_ops == ("BiasAdd", "Relu")
    exp = catalog.expectation(conv(dtype="mixed_bfloat16"), no)
    assert exp.op is None and "bfloat16" in exp.reason
    exp = catalog.expectation(dense("tanh"), no)
    assert exp.fused_ops == ("BiasAdd",)
    dw = _built(keras.layers.DepthwiseConv2D(3, activation="relu"), (None, 8, 8, 3))
    assert catalog.expectation(dw, no).op is None


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
def test_xla_blocks_everything(backend):
    exp = catalog.expectation(conv(), ctx(backend, xla=True))
    assert exp.op is None and exp.reason == "XLA compiled: grappler not applied"


def test_keras_norm_layers_never_fuse():
    for backend in ("cpu", "cuda", "metal"):
        bn = catalog.expectation(keras.layers.BatchNormalization(), ctx(backend))
        ln = catalog.expectation(keras.layers.LayerNormalization(), ctx(backend))
        assert bn.op is None and "BatchNormalization is not fused by Keras 3" in bn.reason
        assert ln.op is None and "LayerNormalization" in ln.reason


def test_unknown_layer_has_no_row():
    assert catalog.expectation(keras.layers.Flatten(), ctx("cpu")) is None


def test_cpu_onednn_without_avx512f_leaves_bfloat16_unfused():
    # TF's IsBF16SupportedByOneDNNOnThisCPU: oneDNN fuses bfloat16 only with AVX512F or AVX_NE_CONVERT
    # (an AVX2-only CPU with TF_ENABLE_ONEDNN_OPTS=1 has neither); float32 fuses either way.
    no_isa = ctx("cpu", onednn=True, onednn_bf16=False)
    for layer in (conv(dtype="mixed_bfloat16"), dense(dtype="mixed_bfloat16")):
        exp = catalog.expectation(layer, no_isa)
        assert exp.op is None and exp.reason == catalog.REASON_BF16_ONEDNN
    assert catalog.expectation(conv(), no_isa).fused_ops == ("BiasAdd", "Relu")
    exp = catalog.expectation(conv(dtype="mixed_bfloat16"), ctx("cpu", onednn=True, onednn_bf16=True))
    assert (exp.op, exp.fused_ops) == ("_FusedConv2D", ("BiasAdd", "Relu"))


@pytest.mark.parametrize("flags,onednn_on,want", [
    ({"avx2", "fma"}, True, False),                  # the AVX2-only CI box with TF_ENABLE_ONEDNN_OPTS=1
    ({"avx2", "avx512f", "avx512_bf16"}, True, True),
    ({"avx2", "avx_ne_convert"}, True, True),        # AVX-NE-CONVERT without AVX-512 (e.g. Sierra Forest)
    ({"avx2", "avx512f"}, False, False),             # oneDNN off: TF's own kernels never fuse bfloat16
])
def test_onednn_bf16_capability_follows_tf_rule(monkeypatch, flags, onednn_on, want):
    # TF's IsBF16SupportedByOneDNNOnThisCPU (tensorflow/core/util/port.cc): AVX512F or AVX_NE_CONVERT.
    from tfmetal_ext import devices

    monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(devices, "_onednn_enabled", lambda: onednn_on)
    devices.invalidate_capabilities()  # the probes changed
    try:
        caps = devices.capabilities()
    finally:
        devices.invalidate_capabilities()
    assert (caps.onednn, caps.onednn_bf16) == (onednn_on, want)
