"""Fusion-first Keras layers.

Each layer emits exactly the op pattern grappler's remapper fuses (see
`tfmetal_ext.inspect.PATTERNS`) and registers a rule with the inspection
catalog so fusion reports know what to expect from it.
"""

from tfmetal_ext.layers.conv import FusedConv2D, FusedDepthwiseConv2D
from tfmetal_ext.layers.conv1d import FusedConv1D
from tfmetal_ext.layers.separable import FusedSeparableConv2D
from tfmetal_ext.layers.dense import FusedDense
from tfmetal_ext.layers.einsum_dense import FusedEinsumDense
from tfmetal_ext.layers.conv_bn import ConvBNAct, ConvBNAct1D
from tfmetal_ext.layers.residual import FoldedResidualBlock, ResidualBlock
from tfmetal_ext.layers.normalization import FusedBatchNorm, FusedLayerNorm
from tfmetal_ext.layers.recurrent import FusedGRU, FusedLSTM
from tfmetal_ext.layers.rms_norm import FusedRMSNorm
from tfmetal_ext.layers.activations import Softshrink
from tfmetal_ext.layers.attention import FusedMultiHeadAttention
from tfmetal_ext.layers.dropout import FusedDropout
from tfmetal_ext.layers.embedding import FusedEmbedding

__all__ = [
    "ConvBNAct",
    "ConvBNAct1D",
    "FoldedResidualBlock",
    "FusedBatchNorm",
    "FusedConv1D",
    "FusedConv2D",
    "FusedDense",
    "FusedDepthwiseConv2D",
    "FusedDropout",
    "FusedEinsumDense",
    "FusedEmbedding",
    "FusedGRU",
    "FusedLayerNorm",
    "FusedLSTM",
    "FusedRMSNorm",
    "FusedMultiHeadAttention",
    "FusedSeparableConv2D",
    "ResidualBlock",
    "Softshrink",
]
