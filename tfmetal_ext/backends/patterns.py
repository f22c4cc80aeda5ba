"""`PATTERNS`: every fusion pattern this package targets, with the op it becomes."""

from __future__ import annotations

import dataclasses
import types

from tfmetal_ext.backends import fusion
from tfmetal_ext.backends.registry import TABLES


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
                "custom_batch_norm_act",
                "batch norm with batch statistics [+ residual add] + activation, training (ConvBNAct, "
                "ResidualBlock): FusedBatchNormV3, Add, act and their gradients as one op each way",
                _F.BATCH_NORM_ACT_OP,
            ),
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
                "custom_activation_grad",
                "the backward of a smooth activation, dy * act'(x) (silu, exact and tanh gelu), and of a gated "
                "product act(gate) * up (TfmetalExt>GatedActivationGrad): TF's autodiff of tf.nn.silu / tf.nn.gelu "
                "is 3-5 elementwise ops",
                _F.ACTIVATION_GRAD_OP,
            ),
            Pattern(
                "custom_sparse_softmax_cross_entropy",
                "softmax cross-entropy with integer labels (FusedSparseCategoricalCrossentropy): one op each way, "
                "two statistics per row kept, where TF keeps the [..., classes] gradient and multiplies it by a Mul",
                _F.SPARSE_XENT_OP,
            ),
            Pattern(
                _F.GEMV_PATTERN,
                "a decoding step's few rows times a weight matrix (FusedDense, FusedEinsumDense on [batch, 1, ...] "
                "inputs): each weight read once, the bias in the op, where MatMul packs the kernel first",
                _F.GEMV_OP,
            ),
            Pattern(
                "custom_dropout",
                "dropout whose counter-based mask the backward pass draws again from the seed (FusedDropout; "
                "Keras' Dropout is five ops and keeps a boolean mask)",
                _F.DROPOUT_OP,
            ),
            Pattern(
                "custom_attention",
                "softmax attention, flash-style: no score matrix stored, attention dropout inside with the mask "
                "regenerated (FusedMultiHeadAttention)",
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
