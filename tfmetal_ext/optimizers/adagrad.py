"""FusedAdagrad: Keras' Adagrad, one ``ResourceApplyAdagradV2`` per variable where that op computes its update."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmetal_ext.ops._common import check_nonnegative
from tfmetal_ext.optimizers._base import FusedUpdateMixin, _tf_variable


def epsilon_placement_error(initial_accumulator_value, epsilon):
    """Largest relative difference between ``1 / (sqrt(a) + epsilon)`` and ``1 / sqrt(a + epsilon)`` over ``a >= a0``.

    What separates ``ResourceApplyAdagradV2`` (epsilon outside the square
    root) from Keras' Adagrad (inside) on one step, given that the
    accumulator never falls below its initial value ``a0``. Evaluated in
    float64 on ``s = sqrt(a)`` from ``sqrt(a0)`` up: the difference
    ``sqrt(s**2 + eps) - s - eps`` changes sign once (at ``s ~ 1/2``) and
    vanishes relative to ``s`` as ``s`` grows, so a log grid from
    ``sqrt(a0)`` to ``1e4`` plus the end point holds the maximum to a few
    percent, which is all the threshold needs.
    """
    eps = float(epsilon)
    s0 = float(np.sqrt(initial_accumulator_value))
    grid = np.geomspace(max(s0, 1e-30), max(s0, 1.0) * 1e4, 2000)
    s = np.concatenate([[s0], grid, [0.5 * (1.0 - eps)] if 0.5 * (1.0 - eps) > s0 else []])
    ratio = np.sqrt(s * s + eps) / (s + eps) - 1.0 if eps > 0 else np.zeros_like(s)
    if s0 == 0.0 and eps > 0:
        ratio[0] = np.inf  # 1/sqrt(eps) against 1/eps
    return float(np.max(np.abs(ratio)))


# Machine epsilon of each float dtype.
_MACHINE_EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def _placement_tolerance(dtype):
    # Two units of rounding of the dtype: Keras' own update rounds four times
    # (multiply, add, square root, divide), so a smaller deviation is below
    # what separates Keras from exact arithmetic.
    return 2.0 * _MACHINE_EPSILON.get(tf.as_dtype(dtype).name, 2.0**-23)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedAdagrad(FusedUpdateMixin, keras.optimizers.Adagrad):
    """Adagrad that updates each variable with one fused training op where that op computes Keras' update.

    Same algorithm, arguments, defaults and optimizer variables
    (``accumulator``, starting at ``initial_accumulator_value``) as
    `keras.optimizers.Adagrad`: ``accumulator += grad**2;
    var -= lr * grad / sqrt(accumulator + epsilon)``.

    TF's one-op Adagrad, ``ResourceApplyAdagradV2``, puts epsilon outside
    the square root (``lr * grad / (sqrt(accumulator) + epsilon)``), and no
    TF training op accumulates ``grad**2`` with epsilon inside (the RMSProp
    and Adadelta ops decay their mean square by ``rho``; the Adagrad,
    proximal and FTRL ops take no epsilon inside). The two forms agree when
    the accumulator is large against epsilon and part when it is small: with
    ``initial_accumulator_value=0`` and gradients of 1e-6 the first step is
    about 300x larger with epsilon outside. Keeping the saved accumulator
    Keras' (not ``accumulator + epsilon``), this class therefore emits:

    - one ``ResourceApplyAdagradV2`` per variable when, for every
      accumulator value the run can reach (``>= initial_accumulator_value``),
      the two forms' step sizes differ by at most two units of rounding of
      the variable's dtype (`epsilon_placement_error`): the defaults
      (0.1, 1e-7) differ by at most 1.9e-7 in float32;
    - otherwise (``initial_accumulator_value=0``, or tiny ones) Keras'
      update as elementwise ops and assignments, ``Square``, ``AssignAdd``,
      ``AddV2``, ``Sqrt``, ``Mul``, ``RealDiv``, ``AssignSub``: 8 ops per
      variable (Keras' Adagrad: 9), with the scalars once per step.
      `composite_reason` says which applies.

    On a backend without that kernel (the open tensorflow-metal-plugin on
    TF 2.21) the elementwise form runs too (`tfmetal_ext.optimizers` says
    why). Sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`) take
    Keras' own update for that variable: Keras adds each slice's square to
    the accumulator, so a row given twice gains the sum of the squares, not
    the square of the sum a dense op would add (`keras_sparse_reason`).

    Args:
        learning_rate: a float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable taking no arguments.
        initial_accumulator_value: the accumulators' starting value, a float >= 0.
        epsilon: added to the accumulator inside the square root, a float >= 0.
        weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
            ema_momentum, ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.Adagrad`'s positional order
            (``name`` defaults to ``"fused_adagrad"``).
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.
    """

    _keras_squares_slices = True  # sparse gradients take Keras' own update (FusedUpdateMixin)

    def __init__(
        self,
        learning_rate=0.001,
        initial_accumulator_value=0.1,
        epsilon=1e-7,
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
        **kwargs,
    ):
        # keras.optimizers.Adagrad's arguments, in its positional order.
        initial_accumulator_value = check_nonnegative("initial_accumulator_value", initial_accumulator_value)
        epsilon = check_nonnegative("epsilon", epsilon)
        super().__init__(
            learning_rate=learning_rate,
            initial_accumulator_value=initial_accumulator_value,
            epsilon=epsilon,
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
        self._placement_error = epsilon_placement_error(initial_accumulator_value, epsilon)

    def composite_reason(self, dtype="float32"):
        """Why this optimizer emits its elementwise update here (variables of `dtype`), or None (the fused op)."""
        why = super().composite_reason(dtype)
        if why is not None:
            return why
        if self._placement_error > _placement_tolerance(dtype):
            return (
                f"ResourceApplyAdagradV2 adds epsilon outside the square root: with "
                f"initial_accumulator_value={self.initial_accumulator_value} and epsilon={self.epsilon} its "
                f"step differs from Keras' by up to {self._placement_error:.3g} (relative), more than the "
                f"{dtype} rounding of {_placement_tolerance(dtype):.3g}"
            )
        return None

    def _step_scalars(self, learning_rate, dtype, composite=None):
        return {"lr": tf.cast(learning_rate, dtype), "epsilon": tf.constant(self.epsilon, dtype)}

    def _fused_op(self):
        return "ResourceApplyAdagradV2"

    def _fused_apply(self, grad, variable, scalars):
        return tf.raw_ops.ResourceApplyAdagradV2(
            var=variable.handle,
            accum=self._slot_handle(self._accumulators, variable),
            lr=scalars["lr"],
            epsilon=scalars["epsilon"],
            grad=grad,
            update_slots=True,
        )

    def _composite_apply(self, grad, variable, scalars):
        """Keras' Adagrad update as elementwise ops and assignments (`composite_reason` says where)."""
        accumulator = _tf_variable(self._accumulators[self._get_variable_index(variable)])
        accumulator.assign_add(tf.square(grad))
        return variable.assign_sub(scalars["lr"] * grad / tf.sqrt(accumulator + scalars["epsilon"]))
