"""FusedRMSprop: Keras' RMSprop with one ``TfmetalExt>MultiTensorRMSprop`` per dtype group where that op
runs (``multi_tensor="auto"``), else one ``ResourceApply(Centered)RMSProp`` per variable."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.ops._common import check_nonnegative
from tfmetal_ext.optimizers._base import (
    FusedUpdateMixin,
    MultiTensorMixin,
    _dtype_key,
    _merge_call,
    _tf_variable,
    check_multi_tensor,
    check_unit_interval,
    dense_gradient,
)


class _Untracked:
    """Holds the hidden momentum buffers out of reach of tracking.

    Not a `Trackable` and not a list or dict, so neither Keras' attribute
    tracker nor `tf.train.Checkpoint` (which walks an optimizer's trackable
    attributes) sees the buffers: they are not optimizer variables, not in
    ``optimizer.variables``, not saved.
    """

    __slots__ = ("buffers",)

    def __init__(self):
        self.buffers = []


def _check_momentum(value):
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"Argument `momentum` must be a float in [0, 1]. Received: momentum={value!r}")
    return check_unit_interval("momentum", value, closed_right=True)


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedRMSprop(MultiTensorMixin, FusedUpdateMixin, keras.optimizers.RMSprop):
    """RMSprop with all variables of a dtype updated by one op, or one fused training op per variable.

    Same algorithm, arguments, defaults and optimizer variables as
    `keras.optimizers.RMSprop` (``velocity``; ``momentum`` when
    ``momentum > 0``; ``average_gradient`` when ``centered``), so saved
    optimizer state loads into either class. Per variable and step:

    - ``velocity = rho * velocity + (1 - rho) * grad**2`` (centered also
      ``average_gradient = rho * average_gradient + (1 - rho) * grad``);
    - ``increment = lr * grad / sqrt(velocity + epsilon)`` (centered:
      ``sqrt(velocity - average_gradient**2 + epsilon)``);
    - ``momentum > 0``: ``m = momentum * m + increment; var -= m``, else
      ``var -= increment``.

    By default (``multi_tensor="auto"``), where the package's op library is
    loaded and has the op's kernel for the variables' device, each step is
    one ``TfmetalExt>MultiTensorRMSprop`` op per (dtype, device, decayed or
    not) group: Keras' update in Keras' operation order (float32 results
    bitwise those of Keras' RMSprop run eagerly; inside a `tf.function`
    grappler turns Keras' ``x / sqrt(y)`` into ``x * rsqrt(y)``, whose CPU
    kernel is not correctly rounded, so there Keras itself differs by an ulp
    here and there), one pass over memory, no hidden buffer, with decoupled
    weight decay (``var -= var * lr * weight_decay``, before the update)
    inside the same op. Elsewhere (``multi_tensor=False``, an XLA-compiled
    step, a `tf.distribute` strategy other than Mirrored,
    MultiWorkerMirrored and OneDevice, no op library, a device without the
    kernel, ``configure(avoid_fusions=["multi_tensor_rmsprop"])``) the
    per-variable form below runs, with the reason logged once at INFO
    (WARNING for an explicit ``multi_tensor=True``); `update_form` says
    which form the last traced step used.

    Under a `keras.optimizers.LossScaleOptimizer` (``mixed_float16``), where
    the multi-tensor op runs, it also takes the loss scale: one op checks,
    unscales and skips a non-finite step, with no per-gradient ``IsFinite``
    or ``cond`` (`tfmetal_ext.optimizers.loss_scale`; `loss_scale_form`
    says whether the last traced step did).

    The per-variable form: one ``ResourceApplyRMSProp``
    (``ResourceApplyCenteredRMSProp`` when ``centered``) per variable, which
    computes the same (epsilon inside the
    square root, as Keras has it); Keras' RMSprop runs 13 ops per variable
    (26 centered with momentum). The scalars (``lr``, ``rho``, ``momentum``,
    ``epsilon``) are built once per step and dtype. ``ResourceApplyRMSProp``
    has CPU, CUDA and tensorflow-metal kernels; the centered op has CPU and
    CUDA kernels, and `tfmetal_ext.backends.metal` does not know whether
    tensorflow-metal has one. The kernel forms ``1 - rho`` in the variable's
    dtype (float32 ``1 - 0.9f = 0.10000002``, Keras ``0.1f``), so the velocity
    differs from Keras' by about 2e-7 (relative) and 100-step trajectories by
    a few parts in 1e6 of the distance moved (more where steps are
    sign-like, e.g. with a small
    ``clipvalue``: there Keras itself moves as far when ``rho`` changes by
    one ulp).

    Memory: the TF ops always update a momentum buffer. With ``momentum == 0``
    (the default) Keras has no momentum slot, so when a per-variable step is
    traced each variable gets a hidden zero-initialised buffer of its own
    size and dtype (one extra copy of the model's trainable weights), created
    beside the variable (per replica under `tf.distribute`); the
    multi-tensor op needs none, and none is created while only it runs. It is scratch, not state: it is not an optimizer
    variable, not in ``optimizer.variables`` and not saved (``.keras`` files
    and `tf.train.Checkpoint` hold exactly Keras' state). With momentum 0
    the op sets it to the step's increment; a non-finite increment (a NaN
    gradient) stays in that variable's buffer, as it stays in the variable
    itself and its velocity with Keras; `load_own_variables` (what loading
    weights or a ``.keras`` file calls) clears the buffers, so restored state
    resumes as Keras' does. (Restoring through `tf.train.Checkpoint` does not
    reach them: call `reset_scratch()` after such a restore.)

    On a backend without those kernels (the open tensorflow-metal-plugin on
    TF 2.21) it emits Keras' update math as elementwise ops and variable
    assignments instead (`tfmetal_ext.optimizers` says why); that form needs
    no hidden buffer and none is created for it.

    Sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`) take
    Keras' own update for that variable: Keras squares each slice before the
    slices of a repeated row add up, which a dense op cannot reproduce
    (`keras_sparse_reason`), so results stay Keras'.

    Args:
        learning_rate: a float, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable taking no arguments.
        rho: decay of the moving averages, a float in [0, 1].
        momentum: a float in [0, 1]; 0 (no momentum slot) by default.
        epsilon: added to the mean square inside the square root, a float >= 0.
        centered: normalise by the estimated variance of the gradient.
        weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
            ema_momentum, ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.RMSprop`'s positional order
            (``name`` defaults to ``"fused_rm_sprop"``: Keras names an
            unnamed optimizer after its class, ``"rm_sprop"`` for RMSprop).
        multi_tensor: (keyword-only) ``"auto"`` (default), True or False, as
            for `FusedAdam`.
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.
    """

    _keras_squares_slices = True  # sparse gradients take Keras' own update (FusedUpdateMixin)

    _multi_tensor_key = "multi_tensor_rmsprop"
    _per_variable_form = "one ResourceApply(Centered)RMSProp per variable"

    def __init__(
        self,
        learning_rate=0.001,
        rho=0.9,
        momentum=0.0,
        epsilon=1e-7,
        centered=False,
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
        # keras.optimizers.RMSprop's arguments, in its positional order.
        rho = check_unit_interval("rho", rho, closed_right=True)
        momentum = _check_momentum(momentum)
        epsilon = check_nonnegative("epsilon", epsilon)
        if not isinstance(centered, bool):
            raise ValueError(f"Argument `centered` must be a bool. Received: centered={centered!r}")
        multi_tensor = check_multi_tensor(multi_tensor)
        super().__init__(
            learning_rate=learning_rate,
            rho=rho,
            momentum=momentum,
            epsilon=epsilon,
            centered=centered,
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
        self._scratch = _Untracked()
        self._init_multi_tensor(multi_tensor)

    # -- the hidden momentum buffers (momentum == 0) ----------------------------

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # Created when a per-variable step is traced (`_ensure_scratch`): the
        # multi-tensor op needs none.
        self._scratch.buffers = [None] * len(var_list) if self.momentum == 0 else []

    def _ensure_scratch(self, variables):
        """Creates the missing hidden buffers of `variables` (momentum == 0; not for the composite form)."""
        if self.momentum > 0:
            return
        for variable in variables:
            index = self._get_variable_index(variable)
            if index < len(self._scratch.buffers) and self._scratch.buffers[index] is None:
                self._scratch.buffers[index] = self._make_scratch(variable)

    def _make_scratch(self, variable):
        """A zero buffer like `variable` beside it (per replica), or None where the composite form runs."""
        if self.composite_reason(_dtype_key(variable)) is not None:
            return None
        reference = _tf_variable(variable)
        strategy = self._distribution_strategy
        with tf.init_scope(), strategy.scope(), strategy.extended.colocate_vars_with(reference):
            return tf.Variable(
                tf.zeros(reference.shape, reference.dtype),
                trainable=False,
                name="rmsprop_scratch_momentum",
                aggregation=tf.VariableAggregation.NONE,
            )

    def reset_scratch(self):
        """Zeroes the hidden momentum buffers (``momentum == 0``); they hold no state worth keeping."""
        for buffer in self._scratch.buffers:
            if buffer is not None:
                buffer.assign(tf.zeros_like(buffer))

    def load_own_variables(self, store):
        super().load_own_variables(store)
        self.reset_scratch()

    # -- the update --------------------------------------------------------------

    def _step_scalars(self, learning_rate, dtype, composite=None):
        return {
            "lr": tf.cast(learning_rate, dtype),
            "rho": tf.constant(self.rho, dtype),
            "one_minus_rho": tf.constant(1.0 - self.rho, dtype),
            "momentum": tf.constant(self.momentum, dtype),
            "epsilon": tf.constant(self.epsilon, dtype),
        }

    def _fused_op(self):
        return "ResourceApplyCenteredRMSProp" if self.centered else "ResourceApplyRMSProp"

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if self.momentum == 0 and self._multi_tensor_blocker(trainable_variables) is not None:
            # A per-variable step: its hidden buffers, created once, in the cross-replica
            # context (one per replica under tf.distribute) before the update runs.
            # (None for a variable whose sparse gradient takes Keras' own update: it needs none.)
            fused = [v for g, v in zip(grads, trainable_variables) if self.keras_sparse_reason(g) is None]
            _merge_call(lambda _: self._ensure_scratch(fused), self._distribution_strategy)
        return super()._backend_update_step(grads, trainable_variables, learning_rate)

    def _mom_handle(self, variable):
        index = self._get_variable_index(variable)
        if self.momentum > 0:
            return _tf_variable(self._momentums[index]).handle
        buffer = self._scratch.buffers[index] if index < len(self._scratch.buffers) else None
        return None if buffer is None else buffer.handle

    def _fused_apply(self, grad, variable, scalars):
        mom = self._mom_handle(variable)
        if mom is None and not tf.distribute.has_strategy():
            # Keras' per-variable `update_step` called directly: create the buffer now.
            self._ensure_scratch([variable])
            mom = self._mom_handle(variable)
        if mom is None:
            # No buffer (the composite form's backend, or none made for this step): Keras' math.
            return self._composite_apply(grad, variable, scalars)
        args = dict(
            var=variable.handle,
            ms=self._slot_handle(self._velocities, variable),
            mom=mom,
            lr=scalars["lr"],
            rho=scalars["rho"],
            momentum=scalars["momentum"],
            epsilon=scalars["epsilon"],
            grad=grad,
        )
        if self.centered:
            return tf.raw_ops.ResourceApplyCenteredRMSProp(
                mg=self._slot_handle(self._average_gradients, variable), **args
            )
        return tf.raw_ops.ResourceApplyRMSProp(**args)

    def _composite_apply(self, grad, variable, scalars):
        """Keras' RMSprop update as elementwise ops and assignments (`composite_reason` says where)."""
        index = self._get_variable_index(variable)
        velocity = _tf_variable(self._velocities[index])
        velocity.assign(scalars["rho"] * velocity + scalars["one_minus_rho"] * tf.square(grad))
        if self.centered:
            average = _tf_variable(self._average_gradients[index])
            average.assign(scalars["rho"] * average + scalars["one_minus_rho"] * grad)
            denominator = velocity - tf.square(average) + scalars["epsilon"]
        else:
            denominator = velocity + scalars["epsilon"]
        increment = scalars["lr"] * grad / tf.sqrt(denominator)
        if self.momentum > 0:
            momentum = _tf_variable(self._momentums[index])
            momentum.assign(scalars["momentum"] * momentum + increment)
            return variable.assign_sub(momentum)
        return variable.assign_sub(increment)

    # -- multi-tensor form (MultiTensorMixin) -----------------------------------

    def _multi_tensor_apply(self, variables, grads, scalars, weight_decay_rate, scale=None):
        from tfmetal_ext.ops import multi_tensor_rmsprop

        dtype = variables[0].dtype
        indices = [self._get_variable_index(v) for v in variables]
        return multi_tensor_rmsprop(
            variables,
            [self._velocities[i] for i in indices],
            [dense_gradient(g, dtype) for g in grads],
            lr=scalars["lr"],
            rho=scalars["rho"],
            momentum=scalars["momentum"],
            epsilon=scalars["epsilon"],
            momentums=[self._momentums[i] for i in indices] if self.momentum > 0 else None,
            average_gradients=[self._average_gradients[i] for i in indices] if self.centered else None,
            weight_decay_rate=weight_decay_rate,
            one_minus_rho=scalars["one_minus_rho"],
            scale=scale,
        )
