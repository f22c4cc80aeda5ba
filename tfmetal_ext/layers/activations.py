"""Activation layers backed by custom ops (one op forward, one backward)."""

from __future__ import annotations

import keras

from tfmetal_ext import ops as tfm_ops
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.ops import _common
from tfmetal_ext.ops.softshrink import uses_kernel as softshrink_uses_kernel


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class Softshrink(keras.layers.Layer):
    """Soft shrinkage activation as one custom op: ``TfmetalExt>Softshrink``.

    ``y = x - lambd`` for ``x > lambd``, ``x + lambd`` for ``x < -lambd``,
    else 0, elementwise, in the input's dtype (float32, float16, bfloat16).
    `keras.ops.soft_shrink` emits about 8 small ops forward and more
    backward, and on Metal some may fall back to the CPU; this layer emits
    one op each way, with a CPU kernel and, on Apple GPUs, a Metal kernel.
    NaN propagates (Keras' soft_shrink maps it to 0).

    Without a C++ compiler, or with ``TFMETAL_EXT_REFERENCE_OPS=1``, it runs
    the pure-TF reference (same values, more ops).

    Args:
        lambd: the threshold, a finite float >= 0.
        **kwargs: `keras.layers.Layer` arguments.

    Input shape:
        Any.

    Output shape:
        Same as the input.

    >>> Softshrink(0.5)(np.array([[-1.0, 0.2, 2.0]], "float32")).numpy()
    array([[-0.5,  0. ,  1.5]], dtype=float32)
    """

    def __init__(self, lambd=0.5, **kwargs):
        super().__init__(**kwargs)
        self.lambd = _common.check_nonnegative("lambd", lambd)
        self.supports_masking = True

    def call(self, inputs):
        return tfm_ops.softshrink(inputs, self.lambd)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config["lambd"] = self.lambd
        return config


def _softshrink_rule(layer, ctx):
    if not catalog.fusion_for(ctx, "custom_softshrink").fuses or not softshrink_uses_kernel():
        return catalog.Expectation(
            "custom_softshrink", None, None, None,
            reason="the pure-TF reference runs (no compiler, TFMETAL_EXT_REFERENCE_OPS=1, or no kernel for this GPU)",
        )
    return catalog.Expectation("custom_softshrink", fusion.SOFTSHRINK_OP, (), ())


catalog.register_rule(Softshrink, catalog.unless_avoided("softshrink", _softshrink_rule))
