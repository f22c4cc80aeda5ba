"""FusedRMSNorm: keras.layers.RMSNormalization as one custom op forward and one backward."""

from __future__ import annotations


import keras
import numpy as np
import tensorflow as tf

from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import Expectation, register_rule
from tfmetal_ext.ops._common import FLOAT_DTYPES
from tfmetal_ext.ops.rms_norm import RMS_NORM_OP, epsilon_reason, rms_norm, uses_kernel

_STOCK = keras.layers.RMSNormalization


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedRMSNorm(_STOCK):
    """`keras.layers.RMSNormalization` over the last axis as one fused op each way.

    A drop-in subclass: the same arguments (``axis``, ``epsilon``, the base
    layer's), the same ``scale`` weight (shape, name, initializer, autocast),
    config, outputs and gradients, so ``set_weights(stock.get_weights())``
    works both ways and a ``.keras`` file round-trips. Normalizing over the
    last axis alone, the layer is one ``TfmetalExt>RMSNorm`` op forward and
    one ``TfmetalExt>RMSNormGrad`` backward (dx and dgamma together;
    `tfmetal_ext.ops.rms_norm`), where the stock computation is a Square,
    Mean, AddV2, Rsqrt and two Muls forward and their gradients backward.
    Statistics are float32 for float16/bfloat16 inputs, as in Keras.

    The exact stock computation (`keras.layers.RMSNormalization.call`)
    runs instead for: normalized axes other than the last one alone, an
    ``epsilon`` the op cannot take (None, <= 0, not finite, or 0 / inf in
    float32), and inputs that are not float32/float16/bfloat16.
    `unfused_reason` says which, or None. Without the op library (no
    compiler, ``TFMETAL_EXT_REFERENCE_OPS=1``) or with
    ``configure(avoid_fusions=["rms_norm"])`` the op runs its pure-TF
    reference: the same results.

    Args:
        axis: the normalized axis or axes (an int or a list of ints); the
            last axis alone runs fused.
        epsilon: added to the mean square.
        **kwargs: base layer arguments (``name``, ``dtype``, ...).

    Example:

    >>> norm = FusedRMSNorm()
    >>> y = norm(np.random.rand(2, 5, 8).astype("float32"))
    >>> y.shape
    TensorShape([2, 5, 8])
    """

    def build(self, input_shape):
        super().build(input_shape)
        self._input_rank = len(input_shape)

    @property
    def unfused_reason(self):
        """Why this layer runs the stock computation instead of the RMS-norm op, or None.

        Known once the layer is built (before that, only the epsilon reason).
        """
        return self._reason(getattr(self, "_input_rank", None))

    def _reason(self, rank, dtype=None):
        why = epsilon_reason(self.epsilon)
        if why is not None:
            return f"{why}; the stock computation runs"
        if rank is not None:
            axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
            if sorted(a + rank if a < 0 else a for a in axes) != [rank - 1]:
                return f"axis={self.axis}: the RMS-norm op normalizes the last axis alone; the stock computation runs"
        if dtype is not None and tf.as_dtype(dtype) not in FLOAT_DTYPES:
            return f"{tf.as_dtype(dtype).name} input: the RMS-norm op takes float32, float16 or bfloat16"
        return None

    def call(self, x):
        x = tf.convert_to_tensor(x)
        if self._reason(x.shape.rank, x.dtype) is not None:
            return _STOCK.call(self, x)
        # self.scale reads as the compute dtype under a mixed policy (autocast, as in the stock
        # call); rms_norm takes it as float32, the stock computation's dtype.
        return rms_norm(x, self.scale, epsilon=self.epsilon)


# ----------------------------------------------------------------------------
# Inspection rule.

REASON_RMS_REFERENCE = (
    "custom ops not in use here (no op library, TFMETAL_EXT_REFERENCE_OPS=1, or no kernel for this "
    "device): FusedRMSNorm runs the pure-TF reference"
)
REASON_RMS_FUSED = (
    "no remapper pattern for RMS norm on any device; FusedRMSNorm emits one TfmetalExt>RMSNorm "
    "(+ one TfmetalExt>RMSNormGrad per train step)"
)


def _fused_rms_norm_rule(layer, ctx):
    why = layer._reason(catalog.input_rank(layer))
    if why is not None:
        return Expectation("custom_rms_norm", None, None, None, reason=why)
    if not catalog.fusion_for(ctx, "custom_rms_norm").fuses or not uses_kernel():
        return Expectation("custom_rms_norm", None, None, None, reason=REASON_RMS_REFERENCE)
    if RMS_NORM_OP in catalog.FUSED_LAYER_OPS:  # the report lists the op as a whole fused layer
        return Expectation("custom_rms_norm", RMS_NORM_OP, (), ())
    return Expectation("custom_rms_norm", None, None, None, reason=REASON_RMS_FUSED)


register_rule(FusedRMSNorm, catalog.unless_avoided("rms_norm", _fused_rms_norm_rule))
