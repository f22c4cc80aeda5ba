"""FusedDropout: keras.layers.Dropout as one custom op forward and one backward, the mask never stored."""

from __future__ import annotations

import importlib

import keras
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.backends._table import TRAIN
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import Expectation, register_rule
from tfmetal_ext.ops._common import FLOAT_DTYPES

_STOCK = keras.layers.Dropout
_ops = importlib.import_module("tfmetal_ext.ops.dropout")  # `tfmetal_ext.ops.dropout` is the function


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedDropout(_STOCK):
    """`keras.layers.Dropout` as one counter-based op each way.

    A drop-in subclass: the same arguments (``rate``, ``noise_shape``,
    ``seed``, the base layer's), the same ``call(inputs, training=...)``,
    config and seed generator, and the same numbers: in training the layer
    draws its seed from its `keras.random.SeedGenerator` exactly as Keras'
    Dropout does, and `tfmetal_ext.ops.dropout` draws TensorFlow's stateless
    dropout mask from it bit for bit, so a model gives the same outputs and
    gradients with either layer, and ``keras.utils.set_random_seed``
    reproduces a run. What differs is the graph: one ``TfmetalExt>Dropout``
    forward and one ``TfmetalExt>DropoutGrad`` backward, which draws the mask
    again from the seed (Philox, counter-based) instead of storing it, where
    Keras' Dropout emits StatelessRandomGetKeyCounter, StatelessRandomUniformV2,
    GreaterEqual, Mul and SelectV2 and keeps a boolean mask per element for
    the backward pass. On Metal the op has a GPU kernel (the stock random ops
    have none on Apple's tensorflow-metal and the open plugin, so each stock
    Dropout is a round trip to the CPU); on the CPU it is the CPU kernel; on
    CUDA, which has no kernel of ours, the pure-TF reference runs (the stock
    ops). Outside training (and at ``rate=0``) the layer returns its input.

    A ``noise_shape`` that fixes a dimension (the usual ``1`` that shares the
    mask along an axis: EfficientNet's drop-connect) runs
    the op on the noise shape and broadcasts its mask over the input with
    TensorFlow's select, as Keras' does: the same numbers, and the mask of the
    noise shape (small) is what the backward pass keeps.

    Keras' own call runs instead (the exact stock computation; `unfused_reason`
    says which) for ``rate=1`` (every element dropped: zeros) and inputs that
    are not float32, float16 or bfloat16. Without the op
    library (no compiler, ``TFMETAL_EXT_REFERENCE_OPS=1``) or with
    ``configure(avoid_fusions=["dropout"])`` the op runs its pure-TF reference:
    the same numbers.

    Args:
        rate: float in [0, 1], the fraction of the input units to drop.
        noise_shape: the shape of the mask, broadcast over the input (None
            entries take the input's dimension at that position); see above.
        seed: a Python integer, the seed of the layer's seed generator.
        **kwargs: base layer arguments (``name``, ``dtype``, ...).

    Input shape:
        Any. Output shape: the input's.

    Example:

    >>> layer = FusedDropout(0.5, seed=1)
    >>> y = layer(np.ones((2, 4), "float32"), training=True)
    >>> sorted(set(np.asarray(y).ravel().tolist())) in ([0.0, 2.0], [0.0], [2.0])
    True
    """

    @property
    def unfused_reason(self):
        """Why a training call runs Keras' own Dropout computation instead of the op, or None.

        From the configuration (`config_reason`), then this backend's table
        (`table_reason`: CPUs keep Keras' call); a call with a non-float input
        runs it too.
        """
        return self.config_reason or table_reason(self.compute_dtype)

    @property
    def config_reason(self):
        """Why Keras' call runs on every backend, from the configuration alone, or None.

        `convert()` keeps a Dropout for such a reason only: the backend a
        converted model runs on chooses the rest (a model converted on a CPU
        uses the op on a Mac).
        """
        return self._reason(None)

    def _reason(self, dtype):
        if self.rate >= 1:
            return f"rate={self.rate}: every element is dropped (zeros); the stock call runs"
        if dtype is not None and tf.as_dtype(dtype) not in FLOAT_DTYPES:
            return f"{tf.as_dtype(dtype).name} input: the dropout op takes float32, float16 or bfloat16"
        return None

    def call(self, inputs, training=False):
        if not (training and self.rate > 0):
            return inputs
        x = tf.convert_to_tensor(inputs)
        if self._reason(x.dtype) is not None or table_reason(x.dtype.name) is not None:
            return _STOCK.call(self, inputs, training=training)
        return _ops.dropout(x, self.rate, seed=self.seed_generator, noise_shape=self.noise_shape)


def table_reason(dtype, table=None):
    """Why this backend's table keeps Keras' dropout for a `dtype` training call, or None.

    The ``custom_dropout`` row of the backend table (`tfmetal_ext.backends`)
    says where the op was measured worth it: on both Metal backends (the
    stock random ops have no kernel there) and on CPUs (its CPU kernel
    measured faster than Keras' stateless dropout). Where a row leaves a
    dtype out, the layer runs Keras' call, the same numbers.
    """
    from tfmetal_ext import backends

    table = backends.current() if table is None else table
    row = table.fusion("custom_dropout")
    if dtype in row.dtypes_in(TRAIN):
        return None
    return f"{table.label}: {row.why_not or row.summary}"


# ----------------------------------------------------------------------------
# Inspection rule.

REASON_DROPOUT_REFERENCE = (
    "custom ops not in use here (no op library, TFMETAL_EXT_REFERENCE_OPS=1, or no kernel for this "
    "device): FusedDropout runs the pure-TF reference (Keras' stateless dropout ops)"
)


def _fused_dropout_rule(layer, ctx):
    if ctx.mode != "train" or layer.rate == 0:
        return None  # outside training (or at rate 0) the layer is the identity: nothing to expect
    why = layer._reason(layer.compute_dtype)  # the table's reason: below, for the backend of ctx
    if why is not None:
        return Expectation("custom_dropout", None, None, None, reason=why)
    f = catalog.fusion_for(ctx, "custom_dropout")
    if not f.fuses:
        return Expectation("custom_dropout", None, None, None, reason=f"{catalog.where(ctx)}: {f.why_not or f.summary}")
    if ctx.xla or not _ops.uses_kernel():
        return Expectation("custom_dropout", None, None, None, reason=REASON_DROPOUT_REFERENCE)
    if layer.compute_dtype not in f.dtypes_in(ctx.mode):
        return Expectation("custom_dropout", None, None, None,
                           reason=f"{layer.compute_dtype} on {catalog.where(ctx)}: no {fusion.DROPOUT_OP} kernel")
    return Expectation("custom_dropout", fusion.DROPOUT_OP, (), ())


register_rule(FusedDropout, catalog.unless_avoided("dropout", _fused_dropout_rule))
