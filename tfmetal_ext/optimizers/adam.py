"""FusedAdam: Keras' Adam with one ``ResourceApplyAdam`` per variable, or one
``TfmetalExt>MultiTensorAdam`` per dtype with ``multi_tensor=True``."""

from __future__ import annotations

import functools
import logging
import math

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfmetal_ext.ops._common import check_nonnegative
from tfmetal_ext.optimizers._base import (
    FusedUpdateMixin,
    composite_reason,
    _dtype_key,
    _merge_call,
    _tf_variable,
    check_unit_interval,
    dense_gradient,
)

logger = logging.getLogger("tfmetal_ext")

# Strategies whose update runs per replica on one device holding a copy of
# every variable, so one op per replica can update a group of variables.
_MULTI_TENSOR_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.OneDeviceStrategy,
)


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
    variable and step, this one 1. On a backend without those kernels (the
    open tensorflow-metal-plugin on TF 2.21) it emits Keras' update math as
    elementwise ops and variable assignments instead, with the scalars once
    per step (`tfmetal_ext.optimizers` says why).

    With ``multi_tensor=True`` the whole step is one
    ``TfmetalExt>MultiTensorAdam`` op per variable dtype (apex's FusedAdam
    pattern), with the same scalars and results bitwise identical to the
    per-variable ops (decoupled weight decay and AMSGrad included). On the
    CPU this is also faster for many small variables: TF's per-variable
    kernel shards every variable over all threads, however small. Where the
    op cannot run it falls back to the per-variable ops with one log line:
    inside an XLA-compiled step (the op has no XLA kernel), under
    `tf.distribute` strategies other than Mirrored, MultiWorkerMirrored and
    OneDevice, and (inside the op wrapper) on devices without a kernel for it
    (CUDA; Apple GPUs whose TF lacks the resource-variable C API the Metal
    kernel needs, see `tfmetal_ext.ops.multi_tensor_adam`).

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
        multi_tensor: (keyword-only) update all variables of one dtype with one
            ``TfmetalExt>MultiTensorAdam`` op instead of one op per variable.
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.

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
        multi_tensor=False,
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
        if not isinstance(multi_tensor, bool):
            raise ValueError(f"Argument `multi_tensor` must be a bool. Received: multi_tensor={multi_tensor!r}")
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
        self.multi_tensor = multi_tensor
        self._fallbacks_logged = set()

    def get_config(self):
        config = super().get_config()
        config["multi_tensor"] = self.multi_tensor
        return config

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
        if self.composite_reason(dtype.name) is not None:
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

    # -- multi_tensor=True ----------------------------------------------------

    def _multi_tensor_blocker(self):
        """Why the multi-tensor op cannot be used here, or None."""
        if not self.multi_tensor:
            return "multi_tensor=False"
        from tfmetal_ext import precision

        if "multi_tensor_adam" in precision.avoided_fusions():
            return "configure(avoid_fusions=['multi_tensor_adam']) avoids TfmetalExt>MultiTensorAdam"
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            return "the step is XLA-compiled and TfmetalExt>MultiTensorAdam has no XLA kernel"
        why = composite_reason("ResourceApplyAdam", "float32")
        if why is not None:
            # Its Metal kernel needs the same resource-variable C API; its CPU kernel would
            # update GPU-resident variables from the host: the composite form is used instead.
            return f"no device kernel for it or ResourceApplyAdam here ({why}): the composite update runs"
        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            if not isinstance(strategy, _MULTI_TENSOR_STRATEGIES):
                return f"{type(strategy).__name__} is not supported (Mirrored, MultiWorkerMirrored and OneDevice are)"
        return None

    def _log_fallback(self, reason):
        if reason not in self._fallbacks_logged:
            self._fallbacks_logged.add(reason)
            logger.warning("tfmetal_ext: %s(multi_tensor=True) uses one op per variable: %s",
                           type(self).__name__, reason)

    def _apply_weight_decay(self, variables):
        # Keras calls this right before `_backend_update_step`, in the same
        # context; the multi-tensor op applies the decay inside its update.
        if self.weight_decay is not None and self._multi_tensor_blocker() is None:
            return
        super()._apply_weight_decay(variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        reason = self._multi_tensor_blocker()
        if reason is not None:
            if self.multi_tensor:
                self._log_fallback(reason)
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        decayed = frozenset()
        if self.weight_decay is not None:
            decayed = frozenset(self._var_key(v) for v in trainable_variables if self._use_weight_decay(v))
        variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        scalars = self._scalars_by_dtype(learning_rate, variables)
        decay_rates = {}
        if decayed:
            with tf.name_scope("weight_decay"):
                decay_rates = {
                    d: tf.cast(learning_rate, d) * tf.cast(self.weight_decay, d)
                    for d in sorted({_dtype_key(v) for v in variables if self._var_key(v) in decayed})
                }
        # `decayed` travels in the closure: merge_call would turn a Python
        # object built by each replica into a per-replica value.
        update = functools.partial(self._distributed_multi_tensor_update, decayed=decayed)
        _merge_call(update, self._distribution_strategy, grads_and_vars, scalars, decay_rates)

    def _distributed_multi_tensor_update(self, distribution, grads_and_vars, scalars, decay_rates, decayed):
        # Groups of variables that one op can update: same dtype, same
        # devices (per replica), same decay. Under MirroredStrategy,
        # `extended.update` runs `fn` once per replica on that replica's
        # device; inside it, the distributed variables in `args` resolve to
        # that replica's copies and per-replica values to that replica's.
        groups = {}
        for grad, variable in grads_and_vars:
            is_decayed = self._var_key(variable) in decayed
            key = (_dtype_key(variable), _placement(variable), is_decayed)
            groups.setdefault(key, []).append((grad, variable))
        for (dtype, _, is_decayed), items in groups.items():
            grads = [g for g, _ in items]
            variables = [v for _, v in items]
            rate = decay_rates[dtype] if is_decayed else None
            distribution.extended.update(
                variables[0], self._multi_tensor_apply, args=(variables, grads, scalars[dtype], rate), group=False
            )

    def _multi_tensor_apply(self, _, variables, grads, scalars, weight_decay_rate):
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
        )


def _placement(variable):
    """The devices holding `variable`: one per replica for distributed variables."""
    components = getattr(variable, "values", None)
    if components is not None:
        return tuple(c.device for c in components)
    return (variable.device,)
