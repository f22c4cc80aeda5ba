"""FusedAdam: Keras' Adam with one ``TfmetalExt>MultiTensorAdam`` per dtype where
that op runs (``multi_tensor="auto"``), else one ``ResourceApplyAdam`` per variable."""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from tfmetal_ext.ops._common import check_nonnegative, in_xla_context
from tfmetal_ext.optimizers._base import (
    FusedUpdateMixin,
    MultiTensorMixin,
    check_multi_tensor,
    check_unit_interval,
    dense_gradient,
)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedAdam(MultiTensorMixin, FusedUpdateMixin, keras.optimizers.Adam):
    """Adam that updates each variable with one fused training op.

    Same algorithm, arguments, defaults and optimizer variables
    (``momentum``, ``velocity``, and ``velocity_hat`` with ``amsgrad``) as
    `keras.optimizers.Adam`, so results match it to float rounding and saved
    optimizer state loads into either. Each variable is updated by one
    ``ResourceApplyAdam`` (``ResourceApplyAdamWithAmsgrad`` with ``amsgrad``),
    ops with CPU, CUDA and tensorflow-metal (float32) kernels; the bias-correction
    powers ``beta_1**t`` and ``beta_2**t`` are computed once per step (Keras
    recomputes them for every variable). Keras' Adam costs about 27 ops per
    variable and step, this one 1. On a backend without those kernels (the
    open tensorflow-metal-plugin on TF 2.21) it emits Keras' update math as
    elementwise ops and variable assignments instead, with the scalars once
    per step (`tfmetal_ext.optimizers` says why).

    By default (``multi_tensor="auto"``), where the package's op library is
    loaded and has the op's kernel for the variables' device, the whole step
    is one ``TfmetalExt>MultiTensorAdam`` op per variable dtype (apex's
    FusedAdam pattern), with the same scalars and results bitwise identical to the
    per-variable ops (decoupled weight decay and AMSGrad included). On the
    CPU this is also faster for many small variables: TF's per-variable
    kernel shards every variable over all threads, however small. Where the
    op cannot run it uses the per-variable ops, with one log line (INFO for
    ``"auto"``, WARNING for an explicit ``multi_tensor=True``):
    inside an XLA-compiled step (the op has no XLA kernel), under
    `tf.distribute` strategies other than Mirrored, MultiWorkerMirrored and
    OneDevice, without the op library (no compiler,
    ``TFMETAL_EXT_REFERENCE_OPS=1``), and on devices without a kernel for it
    (CUDA; with ``multi_tensor=True`` the op wrapper itself falls back
    there). Its Metal kernel reaches the variables through TF's C++ kernel
    API, so it runs on both Metal backends, the open plugin on TF 2.21
    included (see `tfmetal_ext.ops.multi_tensor_adam`).

    Under a `keras.optimizers.LossScaleOptimizer` (``mixed_float16``), where
    the multi-tensor op runs, it also takes the loss scale: one op checks,
    unscales and skips a non-finite step, with no per-gradient ``IsFinite``
    or ``cond`` (`tfmetal_ext.optimizers.loss_scale`; `loss_scale_form`
    says whether the last traced step did).

    A sparse gradient (`tf.IndexedSlices`, an ``Embedding``'s) takes Keras'
    own update for its variable: Keras squares each slice into ``v`` before
    the slices of a repeated row add up, which no dense op reproduces
    (`keras_sparse_reason`). Under a `LossScaleOptimizer` such a step uses
    Keras' loss scaling.

    Args:
        learning_rate: a float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable taking no arguments.
        beta_1: decay of the first-moment estimate, a float in [0, 1).
        beta_2: decay of the second-moment estimate, a float in [0, 1).
        epsilon: the "epsilon hat" of Kingma & Ba (added to ``sqrt(v)``
            after bias correction of the step size), a float >= 0.
        amsgrad: use the AMSGrad variant (the maximum of past velocities).
        weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
            ema_momentum, ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.Adam`'s positional order. A
            ``weight_decay`` is applied decoupled, as Keras does, with one
            more op per variable. ``name`` defaults to ``"fused_adam"``.
        multi_tensor: (keyword-only) ``"auto"`` (the default): update all
            variables of one dtype with one ``TfmetalExt>MultiTensorAdam`` op
            where that op's kernel runs here (op library loaded, a kernel for
            the variables' device, not XLA, a supported strategy, not avoided
            by ``configure(avoid_fusions=["multi_tensor_adam"])``), else one op
            per variable (the reason logged once at INFO); True: the
            multi-tensor op, with a WARNING where it falls back; False: one op
            per variable. `update_form` tells what the last traced step used.
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.

    Example:

    ```python
    model.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3), loss="mse")
    ```
    """

    _keras_squares_slices = True  # sparse gradients take Keras' own update (FusedUpdateMixin)

    _multi_tensor_key = "multi_tensor_adam"

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
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
        # The positional order is keras.optimizers.Adam's; `multi_tensor`
        # (ours) is keyword-only, so `FusedAdam(lr, b1, b2, eps, ams, wd)`
        # means what it means for Adam.
        beta_1 = check_unit_interval("beta_1", beta_1)
        beta_2 = check_unit_interval("beta_2", beta_2)
        epsilon = check_nonnegative("epsilon", epsilon)
        if not isinstance(amsgrad, bool):
            raise ValueError(f"Argument `amsgrad` must be a bool. Received: amsgrad={amsgrad!r}")
        multi_tensor = check_multi_tensor(multi_tensor)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
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

    def _keras_rounding(self, dtype):
        """Step-size factor that reproduces Keras' rounding of ``1 - beta``.

        The kernel forms ``1 - beta`` in the variable's dtype from the rounded
        ``beta`` (float32: ``1 - 0.999f`` is ``0.001 * (1 - 1.3e-5)``), while
        Keras multiplies by ``1 - beta`` rounded once from double. That scales
        ``m`` and ``v`` by constant factors, which move every step by a
        constant relative amount (about 6e-6 for beta_2=0.999) and let the two
        trajectories drift apart by ~1e-5 over a hundred steps. Scaling the
        learning rate by the inverse factor (``m / sqrt(v)`` is linear in
        both) makes the fused update follow Keras'.
        """
        # numpy (ml_dtypes for bfloat16) rounds as TF does, and runs inside a tf.function too.
        np_dtype = np.dtype(dtype.as_numpy_dtype)
        as_dtype = lambda x: float(np_dtype.type(x))  # noqa: E731
        sub = lambda b: float(np_dtype.type(1.0) - np_dtype.type(b))  # noqa: E731
        keras_1 = as_dtype(1.0 - self.beta_1)
        keras_2 = as_dtype(1.0 - self.beta_2)
        kernel_1, kernel_2 = sub(self.beta_1), sub(self.beta_2)
        if min(keras_1, keras_2, kernel_1, kernel_2) <= 0.0:
            return 1.0
        return keras_1 / kernel_1 * math.sqrt(kernel_2 / keras_2)

    def _step_scalars(self, learning_rate, dtype, composite=None):
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.constant(self.beta_1, dtype)
        beta_2 = tf.constant(self.beta_2, dtype)
        lr = tf.cast(learning_rate, dtype)
        if composite is None:
            composite = self.composite_reason(dtype.name) is not None
        if composite:
            # Keras' update math, its scalars once per step: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t).
            one = tf.constant(1.0, dtype)
            return {
                "alpha": lr * tf.sqrt(one - tf.pow(beta_2, step)) / (one - tf.pow(beta_1, step)),
                "one_minus_beta_1": tf.constant(1.0 - self.beta_1, dtype),
                "one_minus_beta_2": tf.constant(1.0 - self.beta_2, dtype),
                "epsilon": tf.constant(self.epsilon, dtype),
            }
        return {
            "lr": lr * tf.constant(self._keras_rounding(dtype), dtype),
            "keras_lr": lr,
            "beta_1": beta_1,
            "beta_2": beta_2,
            "beta_1_power": tf.pow(beta_1, step),
            "beta_2_power": tf.pow(beta_2, step),
            "epsilon": tf.constant(self.epsilon, dtype),
        }

    def _fused_op(self):
        return "ResourceApplyAdamWithAmsgrad" if self.amsgrad else "ResourceApplyAdam"

    def _composite_apply(self, grad, variable, scalars):
        """Keras' Adam update as elementwise ops and assignments (`composite_reason` says where)."""
        index = self._get_variable_index(variable)
        m = self._momentums[index].value
        v = self._velocities[index].value
        m.assign_add((grad - m) * scalars["one_minus_beta_1"])
        v.assign_add((tf.square(grad) - v) * scalars["one_minus_beta_2"])
        if self.amsgrad:
            v_hat = self._velocity_hats[index].value
            v_hat.assign(tf.maximum(v_hat, v))
            v = v_hat
        return variable.assign_sub(m * scalars["alpha"] / (tf.sqrt(v) + scalars["epsilon"]))

    def _fused_apply(self, grad, variable, scalars):
        args = dict(
            var=variable.handle,
            m=self._slot_handle(self._momentums, variable),
            v=self._slot_handle(self._velocities, variable),
            beta1_power=scalars["beta_1_power"],
            beta2_power=scalars["beta_2_power"],
            lr=scalars["lr"],
            beta1=scalars["beta_1"],
            beta2=scalars["beta_2"],
            epsilon=scalars["epsilon"],
            grad=grad,
        )
        if self.amsgrad:
            if in_xla_context():
                return self._amsgrad_for_xla(grad, variable, scalars)
            return tf.raw_ops.ResourceApplyAdamWithAmsgrad(
                vhat=self._slot_handle(self._velocity_hats, variable), **args
            )
        return tf.raw_ops.ResourceApplyAdam(**args)

    def _amsgrad_for_xla(self, grad, variable, scalars):
        """AMSGrad as elementwise ops, for XLA (which has no AdamWithAmsgrad kernel
        and fuses these into one kernel itself)."""
        index = self._get_variable_index(variable)
        m = self._momentums[index].value
        v = self._velocities[index].value
        v_hat = self._velocity_hats[index].value
        one = tf.constant(1.0, variable.dtype)
        m.assign_add((grad - m) * tf.constant(1.0 - self.beta_1, variable.dtype))
        v.assign_add((tf.square(grad) - v) * tf.constant(1.0 - self.beta_2, variable.dtype))
        v_hat.assign(tf.maximum(v_hat, v))
        alpha = scalars["keras_lr"] * tf.sqrt(one - scalars["beta_2_power"]) / (one - scalars["beta_1_power"])
        return variable.assign_sub(m * alpha / (tf.sqrt(v_hat) + scalars["epsilon"]))

    # -- multi-tensor form (MultiTensorMixin) -------------------------------

    def _multi_tensor_apply(self, variables, grads, scalars, weight_decay_rate, scale=None):
        from tfmetal_ext.ops import multi_tensor_adam

        dtype = variables[0].dtype
        indices = [self._get_variable_index(v) for v in variables]
        return multi_tensor_adam(
            variables,
            [self._momentums[i] for i in indices],
            [self._velocities[i] for i in indices],
            [dense_gradient(g, dtype) for g in grads],
            lr=scalars["lr"],
            beta_1=scalars["beta_1"],
            beta_2=scalars["beta_2"],
            epsilon=scalars["epsilon"],
            beta_1_power=scalars["beta_1_power"],
            beta_2_power=scalars["beta_2_power"],
            vhats=[self._velocity_hats[i] for i in indices] if self.amsgrad else None,
            weight_decay_rate=weight_decay_rate,
            scale=scale,
        )

