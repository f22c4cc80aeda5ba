"""FusedAdam: Keras' Adam with one ``ResourceApplyAdam`` per variable."""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfmetal_ext.optimizers._base import FusedUpdateMixin, check_unit_interval


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedAdam(FusedUpdateMixin, keras.optimizers.Adam):
    """Adam that updates each variable with one fused training op.

    Same algorithm, arguments, defaults and optimizer variables
    (``momentum``, ``velocity``, and ``velocity_hat`` with ``amsgrad``) as
    `keras.optimizers.Adam`, so results match it to float rounding and saved
    optimizer state loads into either. Each variable is updated by one
    ``ResourceApplyAdam`` (``ResourceApplyAdamWithAmsgrad`` with ``amsgrad``),
    ops with CPU, CUDA and tensorflow-metal kernels; the bias-correction
    powers ``beta_1**t`` and ``beta_2**t`` are computed once per step (Keras
    recomputes them for every variable). Keras' Adam costs about 27 ops per
    variable and step, this one 1.

    Args:
        learning_rate: a float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable taking no arguments.
        beta_1: decay of the first-moment estimate, a float in [0, 1).
        beta_2: decay of the second-moment estimate, a float in [0, 1).
        epsilon: the "epsilon hat" of Kingma & Ba (added to ``sqrt(v)``
            after bias correction of the step size), a float >= 0.
        amsgrad: use the AMSGrad variant (the maximum of past velocities).
        **kwargs: `keras.optimizers.Optimizer` arguments: ``weight_decay``,
            ``clipnorm``, ``clipvalue``, ``global_clipnorm``, ``use_ema``,
            ``ema_momentum``, ``ema_overwrite_frequency``,
            ``loss_scale_factor``, ``gradient_accumulation_steps``, ``name``.
            A ``weight_decay`` is applied decoupled, as Keras does, with one
            more op per variable.

    Example:

    ```python
    model.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3), loss="mse")
    ```
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
        name="fused_adam",
        **kwargs,
    ):
        beta_1 = check_unit_interval("beta_1", beta_1)
        beta_2 = check_unit_interval("beta_2", beta_2)
        if not isinstance(epsilon, (int, float)) or epsilon < 0:
            raise ValueError(f"Argument `epsilon` must be a float >= 0. Received: epsilon={epsilon!r}")
        if not isinstance(amsgrad, bool):
            raise ValueError(f"Argument `amsgrad` must be a bool. Received: amsgrad={amsgrad!r}")
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=float(epsilon),
            amsgrad=amsgrad,
            name=name,
            **kwargs,
        )

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
        if dtype == tf.bfloat16:
            as_dtype = lambda x: float(tf.constant(x, tf.bfloat16).numpy())  # noqa: E731
            sub = lambda b: float(tf.constant(1.0, tf.bfloat16) - tf.constant(b, tf.bfloat16))  # noqa: E731
        else:
            np_dtype = np.dtype(dtype.as_numpy_dtype)
            as_dtype = lambda x: float(np_dtype.type(x))  # noqa: E731
            sub = lambda b: float(np_dtype.type(1.0) - np_dtype.type(b))  # noqa: E731
        keras_1 = as_dtype(1.0 - self.beta_1)
        keras_2 = as_dtype(1.0 - self.beta_2)
        kernel_1, kernel_2 = sub(self.beta_1), sub(self.beta_2)
        if min(keras_1, keras_2, kernel_1, kernel_2) <= 0.0:
            return 1.0
        return keras_1 / kernel_1 * math.sqrt(kernel_2 / keras_2)

    def _step_scalars(self, learning_rate, dtype):
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.constant(self.beta_1, dtype)
        beta_2 = tf.constant(self.beta_2, dtype)
        lr = tf.cast(learning_rate, dtype)
        return {
            "lr": lr * tf.constant(self._keras_rounding(dtype), dtype),
            "keras_lr": lr,
            "beta_1": beta_1,
            "beta_2": beta_2,
            "beta_1_power": tf.pow(beta_1, step),
            "beta_2_power": tf.pow(beta_2, step),
            "epsilon": tf.constant(self.epsilon, dtype),
        }

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
            if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
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
