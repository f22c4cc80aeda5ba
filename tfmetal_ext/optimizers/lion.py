"""FusedLion: Keras' Lion with one ``TfmetalExt>MultiTensorLion`` per dtype group where that
op runs (``multi_tensor="auto"``), else Keras' update math with the scalars built once per step."""

from __future__ import annotations

import math
import numbers

import keras
import tensorflow as tf

from tfmetal_ext.optimizers._base import (
    FusedUpdateMixin,
    MultiTensorMixin,
    check_multi_tensor,
    dense_gradient,
)


def _check_real(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"Argument `{name}` must be a finite float. Received: {name}={value!r}")
    return float(value)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedLion(MultiTensorMixin, FusedUpdateMixin, keras.optimizers.Lion):
    """Lion (Chen et al., 2023) with all variables of a dtype updated by one op.

    Same algorithm, arguments, defaults and optimizer variables (one
    ``momentum`` per variable) as `keras.optimizers.Lion`, so saved state
    loads into either. Per variable and step, in the variable's dtype::

        c = m * beta_1 + grad * (1 - beta_1)
        var -= lr * sign(c)
        m = m * beta_2 + grad * (1 - beta_2)

    By default (``multi_tensor="auto"``), where the package's op library is
    loaded and has the op's kernel for the variables' device, each step is
    one ``TfmetalExt>MultiTensorLion`` op per (dtype, device, decayed or not)
    group, with decoupled weight decay (``var -= var * lr * weight_decay``,
    before the update, as Keras applies it) inside the same op. Elsewhere
    (``multi_tensor=False``, an XLA-compiled step, a `tf.distribute`
    strategy other than Mirrored, MultiWorkerMirrored and OneDevice, no op
    library, a device without the kernel, or
    ``configure(avoid_fusions=["multi_tensor_lion"])``) TF has no Lion
    training op to fall back to: the update is Keras' math as elementwise
    ops, with ``lr``, ``beta_1``, ``beta_2`` and ``1 - beta`` built once per
    step and dtype instead of once per variable; the decay is one
    ``ResourceApplyGradientDescent`` per decayed variable. `update_form`
    says which form the last traced step used.

    Under a `keras.optimizers.LossScaleOptimizer` (``mixed_float16``), where
    the multi-tensor op runs, it also takes the loss scale: one op checks,
    unscales and skips a non-finite step, with no per-gradient ``IsFinite``
    or ``cond`` (`tfmetal_ext.optimizers.loss_scale`; `loss_scale_form`
    says whether the last traced step did).

    Args:
        learning_rate: a float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable taking no arguments.
        beta_1: the rate mixing the gradient into the update direction, a
            float in (0, 1] (0 would make it SignSGD, which Keras refuses).
        beta_2: decay of the momentum, a float.
        weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
            ema_momentum, ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.Lion`'s positional order
            (``name`` defaults to ``"fused_lion"``).
        multi_tensor: (keyword-only) ``"auto"`` (default), True or False, as
            for `FusedAdam`.
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.
    """

    _multi_tensor_key = "multi_tensor_lion"
    _per_variable_form = "Keras' elementwise update per variable"

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.99,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        multi_tensor="auto",
        **kwargs,
    ):
        beta_1 = _check_real("beta_1", beta_1)
        beta_2 = _check_real("beta_2", beta_2)
        multi_tensor = check_multi_tensor(multi_tensor)
        # keras.optimizers.Lion checks beta_1 in (0, 1] with this message.
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        self._init_multi_tensor(multi_tensor)

    # -- per-variable form (FusedUpdateMixin) -----------------------------------

    def composite_reason(self, dtype="float32"):
        """None: TF has no Lion training op, so the per-variable form is always Keras' math as
        elementwise ops, which every backend runs."""
        return None

    def _fused_op(self):
        return None

    def _step_scalars(self, learning_rate, dtype, composite=None):
        beta_1 = tf.constant(self.beta_1, dtype)
        beta_2 = tf.constant(self.beta_2, dtype)
        one = tf.constant(1.0, dtype)
        # Keras forms `1 - beta` in the variable's dtype from the rounded beta; so does this.
        return {
            "lr": tf.cast(learning_rate, dtype),
            "beta_1": beta_1,
            "beta_2": beta_2,
            "one_minus_beta_1": one - beta_1,
            "one_minus_beta_2": one - beta_2,
        }

    def _fused_apply(self, grad, variable, scalars):
        m = self._momentums[self._get_variable_index(variable)].value
        direction = tf.sign(m * scalars["beta_1"] + grad * scalars["one_minus_beta_1"])
        update = variable.assign_sub(scalars["lr"] * direction)
        with tf.control_dependencies([update]):
            return m.assign(m * scalars["beta_2"] + grad * scalars["one_minus_beta_2"])

    _composite_apply = _fused_apply

    # -- multi-tensor form (MultiTensorMixin) -----------------------------------

    def _multi_tensor_apply(self, variables, grads, scalars, weight_decay_rate, scale=None):
        from tfmetal_ext.ops import multi_tensor_lion

        dtype = variables[0].dtype
        indices = [self._get_variable_index(v) for v in variables]
        return multi_tensor_lion(
            variables,
            [self._momentums[i] for i in indices],
            [dense_gradient(g, dtype) for g in grads],
            lr=scalars["lr"],
            beta_1=scalars["beta_1"],
            beta_2=scalars["beta_2"],
            weight_decay_rate=weight_decay_rate,
            scale=scale,
        )
