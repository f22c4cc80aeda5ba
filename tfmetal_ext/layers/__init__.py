"""Fusion-first Keras layers.

Each layer emits exactly the op pattern grappler's remapper fuses (see
`tfmetal_ext.inspect.PATTERNS`) and registers a rule with the inspection
catalog so fusion reports know what to expect from it.
"""

from tfmetal_ext.layers.conv import FusedConv2D, FusedDepthwiseConv2D  # noqa: E402,F401
from tfmetal_ext.layers.dense import FusedDense  # noqa: E402,F401
from tfmetal_ext.layers.conv_bn import ConvBNAct  # noqa: E402,F401
from tfmetal_ext.layers.residual import FoldedResidualBlock, ResidualBlock  # noqa: E402,F401
from tfmetal_ext.layers.normalization import FusedBatchNorm, FusedLayerNorm  # noqa: E402,F401
