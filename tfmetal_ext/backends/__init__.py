"""What each backend has and fuses, as data: the one home of that knowledge.

* `fusion`: names and maps (activations, fused-op names, custom ops, the
  stock-to-fused layer map, safe forms).
* `PATTERNS`: every fusion pattern this package targets, with the op it
  becomes.
* One table per backend: `cpu` (``ONEDNN`` and ``EIGEN``, the CPU without
  oneDNN), `cuda`, `metal` (Apple's tensorflow-metal: its kernels are the
  facts known from its binary) and `metal_plugin` (the open
  tensorflow-metal-plugin: its kernels generated from its sdist by
  ``scripts/gen_metal_plugin_kernels.py``, complete, with the ops it leaves
  to the host on this TensorFlow and the stock layers that fail there).
  Each declares, per pattern, the dtypes, activations, modes and conditions
  under which it fuses (a `Fusion`), the kernels it has where known
  (`Backend.has_kernel`), and its precision choice.

Everything else reads these: `inspect`'s catalog and rules, the layers,
`convert()`, `MetalCallback`, the doctor and `configure()`. Adding a pattern
is one `PATTERNS` entry plus one `Fusion` row per backend; adding a backend is
one module with a table and a `precision(caps)` function, registered in
`TABLES` and `PRECISION` below.
"""

from __future__ import annotations

import dataclasses
import types

from tfmetal_ext.backends import cpu, cuda, fusion, metal, metal_plugin
from tfmetal_ext.backends._table import PREDICT, TRAIN, Backend, Fusion
from tfmetal_ext.backends.fusion import (
    ACTIVATION_OPS,
    CUSTOM_OPS,
    FUSED_LAYER_OPS,
    OPTIMIZER_TO_FUSED,
    SAFE_FORMS,
    STOCK_TO_FUSED,
)

__all__ = [
    "ACTIVATION_OPS",
    "CUSTOM_OPS",
    "FUSED_LAYER_OPS",
    "OPTIMIZER_TO_FUSED",
    "PATTERNS",
    "PREDICT",
    "SAFE_FORMS",
    "STOCK_TO_FUSED",
    "TABLES",
    "TRAIN",
    "current",
    "support_key",
    "Backend",
    "Fusion",
    "Pattern",
    "fusion",
    "precision",
    "table",
]

# support key (FusionContext.support_key) -> table.
TABLES = types.MappingProxyType(
    {t.key: t for t in (cpu.ONEDNN, cpu.EIGEN, cuda.CUDA, metal.METAL, metal_plugin.METAL_PLUGIN)}
)

# devices.backend() value -> precision(caps) -> (policy, reason).
PRECISION = types.MappingProxyType({"cpu": cpu.precision, "cuda": cuda.precision, "metal": metal.precision})


def table(key):
    """The `Backend` table for a support key (``"cpu_onednn"``, ``"cpu"``, ``"cuda"``, ``"metal"``, ``"metal_plugin"``).

    Raises:
        ValueError: for an unknown key.
    """
    try:
        return TABLES[key]
    except KeyError:
        raise ValueError(f"Unknown backend table; valid keys: {', '.join(TABLES)}. Received: key={key!r}") from None


def precision(caps):
    """``(policy, reason)``: the dtype policy the backend of `caps` computes fastest in."""
    return PRECISION[caps.backend](caps)


def support_key(backend, onednn, metal_plugin=None):
    """The table key for a `devices.backend()` value.

    The CPU has one table with oneDNN and one without; Metal has one per
    plugin (``"metal"``: Apple's tensorflow-metal, also when `metal_plugin`
    is unknown; ``"metal_plugin"``: the open tensorflow-metal-plugin).
    """
    if backend == "cpu":
        return "cpu_onednn" if onednn else "cpu"
    if backend == "metal" and metal_plugin == "tensorflow-metal-plugin":
        return "metal_plugin"
    return backend


def current(caps=None):
    """The table of the backend this process runs on (the environment's capabilities unless given)."""
    if caps is None:
        from tfmetal_ext import _env

        caps = _env.current().capabilities
    return table(support_key(caps.backend, caps.onednn, getattr(caps, "metal_plugin", None)))


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A fusion pattern.

    Attributes:
        name: catalog key, e.g. ``"conv2d_bias_act"``.
        description: the unfused subgraph it replaces.
        fused_op: the op it becomes ("" when nothing fuses it).
        nowhere: why it fuses on no backend (then no table has a row for it).
    """

    name: str
    description: str
    fused_op: str
    nowhere: str = ""

    @property
    def support(self):
        """Per backend table key, the conditions in words."""
        if self.nowhere:
            return {key: f"not fused: {self.nowhere}" for key in TABLES}
        return {key: t.fusion(self.name).summary for key, t in TABLES.items()}


_F = fusion
PATTERNS = types.MappingProxyType(
    {
        p.name: p
        for p in [
            Pattern("conv2d_bias_act", "Conv2D + BiasAdd [+ Relu|Relu6|Elu|LeakyRelu]", _F.FUSED_CONV2D),
            Pattern("matmul_bias_act", "MatMul + BiasAdd [+ Relu|Relu6|Elu|LeakyRelu|Tanh|Sigmoid]", _F.FUSED_MATMUL),
            Pattern("matmul_bias_gelu", "MatMul + BiasAdd + GELU subgraph", _F.FUSED_MATMUL),
            Pattern("depthwise_bias_act", "DepthwiseConv2dNative + BiasAdd + act", _F.FUSED_DEPTHWISE),
            Pattern("conv2d_bias_add_relu", "Conv2D + BiasAdd + Add(residual) + Relu", _F.FUSED_CONV2D),
            Pattern("conv2d_batchnorm_act", "Conv2D + FusedBatchNormV3 [+ act], inference", _F.FUSED_CONV2D),
            Pattern("batchnorm_act", "FusedBatchNormV3 [+ Add side input] + Relu", _F.FUSED_BATCH_NORM_EX),
            Pattern("batchnorm_grad_relugrad", "FusedBatchNormGradV3 + ReluGrad", _F.FUSED_BATCH_NORM_GRAD_EX),
            Pattern("batch_norm", "Keras BatchNormalization (moments + Rsqrt/Mul/Sub/Add)", "",
                    nowhere="Keras 3 never emits FusedBatchNormV3"),
            Pattern("layer_norm", "Keras LayerNormalization (moments + Rsqrt + Mul/Add)", "",
                    nowhere="no remapper pattern on any device"),
            Pattern("custom_layer_norm", "layer norm over the last axis (FusedLayerNorm)", _F.LAYER_NORM_OP),
            Pattern("custom_rms_norm", "RMS norm over the last axis (FusedRMSNorm)", _F.RMS_NORM_OP),
            Pattern(
                "custom_int8_matmul",
                "int8-weight MatMul + scale + BiasAdd + act (quantized FusedDense, 1x1 FusedConv2D)",
                _F.INT8_MATMUL_OP,
            ),
            Pattern(
                "custom_int8_conv2d",
                "int8-weight Conv2D + scale + BiasAdd + act (quantized FusedConv2D)",
                _F.INT8_CONV2D_OP,
            ),
            Pattern(
                "custom_softshrink",
                "softshrink activation (Softshrink layer; keras.ops.soft_shrink is several elementwise ops)",
                _F.SOFTSHRINK_OP,
            ),
            Pattern(
                "custom_attention",
                "softmax attention, flash-style: no score matrix stored (FusedMultiHeadAttention)",
                _F.ATTENTION_OP,
            ),
            Pattern(
                "multi_tensor_adam",
                "Adam update of every variable of one dtype (FusedAdam(multi_tensor=True))",
                _F.MULTI_TENSOR_ADAM_OP,
            ),
            Pattern(
                "multi_tensor_lion",
                "Lion update of every variable of one dtype (FusedLion)",
                _F.MULTI_TENSOR_LION_OP,
            ),
            Pattern(
                "multi_tensor_rmsprop",
                "RMSprop update of every variable of one dtype (FusedRMSprop)",
                _F.MULTI_TENSOR_RMSPROP_OP,
            ),
            Pattern(
                "cudnn_rnn",
                "a whole LSTM/GRU recurrence (tanh/sigmoid, no recurrent dropout, GRU reset_after=True)",
                _F.CUDNN_RNN,
            ),
        ]
    }
)
