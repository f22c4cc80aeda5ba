"""Fused Keras optimizers: one training op per variable and step.

`FusedAdam`, `FusedAdamW` and `FusedSGD` are drop-in replacements for
`keras.optimizers.Adam`, `AdamW` and `SGD` (same arguments, results and
optimizer variables) that update each variable with one TF training op
(``ResourceApplyAdam``, ``ResourceApplyKerasMomentum``,
``ResourceApplyGradientDescent``), which tensorflow-metal, CUDA and the CPU
implement as single kernels. Keras' own optimizers issue about 27 (Adam) or 8
(SGD with momentum) small ops per variable.
"""

from tfmetal_ext.optimizers.adam import FusedAdam
from tfmetal_ext.optimizers.adamw import FusedAdamW
from tfmetal_ext.optimizers.sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]
