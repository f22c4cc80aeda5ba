"""FusedSGD: Keras' SGD with one training op per variable."""

from __future__ import annotations

import numbers

import keras
import tensorflow as tf

from tfmetal_ext.optimizers._base import FusedUpdateMixin, dense_gradient


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedSGD(FusedUpdateMixin, keras.optimizers.SGD):
    """Stochastic gradient descent (with momentum) in one op per variable.

    Same algorithm, arguments, defaults and optimizer variables
    (``momentum`` slots when ``momentum > 0``) as `keras.optimizers.SGD`:

    - ``momentum == 0``: ``var -= lr * grad``, one
      ``ResourceApplyGradientDescent`` (sparse gradients: a scatter
      subtract of the touched rows).
    - ``momentum > 0``: ``m = momentum * m - lr * grad; var += m`` (with
      ``nesterov``: ``var += momentum * m - lr * grad``), one
      ``ResourceApplyKerasMomentum``.

    On a backend without those kernels (the open tensorflow-metal-plugin on
    TF 2.21) the same update as elementwise ops and variable assignments
    (`tfmetal_ext.optimizers` says why).

    Args:
        learning_rate: a float, a learning-rate schedule or a callable.
        momentum: a float in [0, 1].
        nesterov: use Nesterov momentum.
        weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
            ema_momentum, ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.SGD`'s positional order
            (``name`` defaults to ``"fused_sgd"``).
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.0,
        nesterov=False,
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
        # keras.optimizers.SGD's arguments, in its positional order.
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1:
            # Keras' message, with the value. (Keras also refuses an int such
            # as momentum=0; any real number in [0, 1] is accepted here.)
            raise ValueError(f"`momentum` must be a float between [0, 1]. Received: momentum={momentum!r}")
        if not isinstance(nesterov, bool):
            raise ValueError(f"Argument `nesterov` must be a bool. Received: nesterov={nesterov!r}")
        super().__init__(
            learning_rate=learning_rate,
            momentum=float(momentum),
            nesterov=nesterov,
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

    def _step_scalars(self, learning_rate, dtype, composite=None):
        scalars = {"lr": tf.cast(learning_rate, dtype)}
        if self.momentum != 0:
            scalars["momentum"] = tf.constant(self.momentum, dtype)
        return scalars

    def _fused_op(self):
        return "ResourceApplyGradientDescent" if self.momentum == 0 else "ResourceApplyKerasMomentum"

    def _composite_apply(self, grad, variable, scalars):
        lr = scalars["lr"]
        if self.momentum == 0:
            return variable.assign_sub(grad * lr)
        m = self.momentums[self._get_variable_index(variable)].value
        m.assign(m * scalars["momentum"] - grad * lr)
        if self.nesterov:
            return variable.assign_add(m * scalars["momentum"] - grad * lr)
        return variable.assign_add(m)

    def _fused_apply(self, grad, variable, scalars):
        if self.momentum == 0:
            return tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=scalars["lr"], delta=grad)
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=self._slot_handle(self.momentums, variable),
            lr=scalars["lr"],
            grad=grad,
            momentum=scalars["momentum"],
            use_nesterov=self.nesterov,
        )

    def _fused_apply_sparse(self, grad, variable, scalars):
        if self.momentum == 0:
            # Only the touched rows change; duplicates accumulate, as with a
            # dense gradient.
            return tf.raw_ops.ResourceScatterSub(
                resource=variable.handle,
                indices=grad.indices,
                updates=tf.cast(grad.values, variable.dtype) * scalars["lr"],
            )
        # Keras decays every momentum row each step: that is a dense update.
        return self._fused_apply(dense_gradient(grad, variable.dtype), variable, scalars)
