"""Convert an existing Keras model into one built from tfmetal_ext's fusion-first layers, verified.

>>> model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3))
>>> fused = tfmetal_ext.convert(model)            # training form, verified
>>> print(fused.conversion_report)
>>> deploy = tfmetal_ext.convert(model, inference=True)   # batch norms folded into the convolutions
>>> int8 = tfmetal_ext.convert(model, inference=True, quantize="int8")   # ... and int8 weights

The converter walks the functional graph of a Functional or Sequential model
(nested models recursively), decides per call of each layer what replaces it,
and rebuilds the graph with the same layer names, input and output names,
trainable flags, dtype policies and weights:

| stock layers | becomes |
|---|---|
| Conv2D (+ Activation/ReLU) | `FusedConv2D` (activation folded in) |
| DepthwiseConv2D (+ Activation/ReLU) | `FusedDepthwiseConv2D` |
| Dense (+ Activation/ReLU) | `FusedDense` |
| EinsumDense (an equation that is a reshaped matrix product: every one Keras' MultiHeadAttention and keras-hub build) | `FusedEinsumDense` (same weights, LoRA carried over) |
| Conv2D -> BatchNormalization (-> Activation/ReLU) | `ConvBNAct` (conv bias moved into the moving mean) |
| Conv2D/DepthwiseConv2D -> BatchNormalization (-> act), ``inference=True`` | `FusedConv2D`/`FusedDepthwiseConv2D` with the batch norm folded in |
| BatchNormalization (last axis, input rank >= 2: 3-D/5-D reshaped to NHWC around the fused op) | `FusedBatchNorm` |
| LayerNormalization (last axis) | `FusedLayerNorm` |
| LSTM / GRU (tanh/sigmoid, no recurrent dropout, no unroll, GRU reset_after) | `FusedLSTM` / `FusedGRU` |
| MultiHeadAttention (rank-3 inputs, sequence-axis attention, no returned scores; training form: attention dropout below 1) | `FusedMultiHeadAttention` (same weights; attention dropout inside the op, stock's mask) |
| RMSNormalization (last axis) | `FusedRMSNorm` |
| Dropout (no noise_shape fixing a dimension, rate < 1) | `FusedDropout` (the seed generator's state carried over) |
| Bidirectional / TimeDistributed of one of the above | the same wrapper of the fused class |
| a sublayer of a subclassed layer or model (attribute, list, dict) | its one-to-one fused class, nothing merged |
| anything else | kept (an independent copy with the same constructor arguments and state), listed in the report with the reason |

A layer is absorbed into the one before it only when nothing else reads the
tensor between them (no other consumer, not a model output), its own output is
not an output of the top-level model (output names stay), both are called once, and they share
the dtype policy and trainable flag. A shared layer
(called more than once) is converted once and the new layer is shared the
same way; it is never merged with its neighbours.

Modules: `planners` (what replaces each layer call: the planner registry,
keyed by layer class, `register_planner`), `rebuild` (the graph walk that
makes the new model), `graph` (consumers and call counts of one graph),
`weights` (weight copies and batch-norm folding), `quantize` (the int8 form of the inference
model and its check against the float one), `copying` (independent
copies of kept and subclassed layers: construction, sublayer swaps, state
moved by Keras' own save/load methods), `verify` (outputs and gradients
against the stock model, `VerificationError`), `report`
(`ConversionReport`), `pipeline` (`convert` as its list of stages, `ConvertOptions`),
`provenance` (the stock layers a converted layer replaced, recorded for `to_stock`) and
`to_stock` (the inverse of `convert`: tfmetal_ext layers as stock Keras layers, `register_expander`).
"""

from __future__ import annotations

from tfmetal_ext.conversion import quantize  # noqa: F401  (a documented module)
from tfmetal_ext.conversion.pipeline import ConvertOptions, convert, logger  # noqa: F401
from tfmetal_ext.conversion.planners import register_planner
from tfmetal_ext.conversion.rebuild import Converter  # noqa: F401
from tfmetal_ext.conversion.to_stock import register_expander, to_stock
from tfmetal_ext.conversion.report import NO_COUNTERPART, ConversionReport, Kept, Rewrite
from tfmetal_ext.conversion.verify import (  # noqa: F401  (importable here as before)
    GRAD_RTOL,
    MIN_GRAD_BATCH,
    NOISE_FACTOR,
    OPEN_DIM_LENGTHS,
    OUTPUT_RTOL,
    VerificationError,
    make_inputs,
    verify_conversion,
)

__all__ = [
    "GRAD_RTOL",
    "MIN_GRAD_BATCH",
    "NOISE_FACTOR",
    "NO_COUNTERPART",
    "OUTPUT_RTOL",
    "ConversionReport",
    "Kept",
    "Rewrite",
    "VerificationError",
    "convert",
    "register_expander",
    "register_planner",
    "to_stock",
]
