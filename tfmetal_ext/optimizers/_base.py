"""What the fused optimizers share: one training op per variable, scalars once per step.

Keras 3 optimizers on TensorFlow call ``update_step(grad, var, lr)`` once per
variable, and each call rebuilds its own step-dependent scalars (Adam: cast,
two ``Pow``, ``Sqrt``, ``Sub``, ``RealDiv``...) before a chain of elementwise
ops and assignments: about 27 ops per variable for Adam. `FusedUpdateMixin`
replaces that per-variable body with a single TF training op
(``ResourceApplyAdam`` and friends, which have CPU, CUDA and tensorflow-metal
kernels) and computes the scalars those ops take once per step and dtype.

Everything else stays Keras': gradient clipping (``clipnorm``,
``clipvalue``, ``global_clipnorm``), learning-rate schedules, EMA, gradient
accumulation, loss scaling (`keras.optimizers.LossScaleOptimizer` wraps these
like any optimizer; where the multi-tensor op runs, it checks, unscales and
skips inside the op: `MultiTensorMixin._apply_loss_scaled`,
`tfmetal_ext.optimizers.loss_scale`), variable constraints, the iteration
counter, and the optimizer variables themselves (same names and order as the
Keras optimizer of the same name, so saved state is interchangeable).
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf
from keras.src import backend as keras_backend

from tfmetal_ext.ops._common import in_xla_context

logger = logging.getLogger("tfmetal_ext")

_merge_call = tf.__internal__.distribute.interim.maybe_merge_call


def _tf_variable(variable):
    """The `tf.Variable` (or distributed variable) behind a Keras variable."""
    if isinstance(variable, keras_backend.Variable):
        return variable.value
    return variable


def _dtype_key(variable):
    return tf.as_dtype(variable.dtype).base_dtype.name


def dense_gradient(grad, dtype):
    """`grad` as a dense tensor of `dtype`.

    `tf.IndexedSlices` (e.g. from `Embedding`) are densified: the fused ops
    are dense, and for Adam and momentum SGD Keras' own update is dense in
    effect too (every slot row decays each step). Rows given more than once
    add up first, as Keras adds them wherever its update is linear in the
    gradient; an optimizer whose Keras update squares the gradient takes
    Keras' own update for such a gradient instead (`FusedUpdateMixin.keras_sparse_reason`).
    """
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    return tf.cast(grad, dtype)


@tf.autograph.experimental.do_not_convert  # reads the backend tables (plain Python) during tracing
def composite_reason(op, dtype):
    """Why the fused optimizers emit their composite update instead of `op` on this backend, or None.

    The composite form is Keras' own update math as elementwise ops into
    ``AssignVariableOp`` / ``AssignAddVariableOp`` / ``AssignSubVariableOp``,
    with the step's scalars built once per step and dtype (about 10 ops per
    Adam variable instead of Keras' 27). It is emitted on a GPU backend whose
    table says `op` has no kernel there (`Backend.has_kernel` is False): the
    open tensorflow-metal-plugin on TF 2.21, where every ``ResourceApply*``
    is in the table's `host_ops` (see `tfmetal_ext.optimizers`), and Apple's
    tensorflow-metal for a variable that is not float32 (its ``ResourceApply*``
    kernels are float32 only). A CPU or CUDA keeps the one fused op per
    variable, and so does tensorflow-metal for float32 variables.
    """
    from tfmetal_ext import backends

    table = backends.current()
    if table.device == "cpu" or table.has_kernel(op, dtype) is not False:
        return None
    return table.host_ops.get(op) or f"{table.label} has no {op} kernel"


def check_unit_interval(name, value, *, closed_right=False):
    """Raises ValueError unless ``0 <= value < 1`` (``<= 1`` with closed_right)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Argument `{name}` must be a float. Received: {name}={value!r}") from None
    upper_ok = v <= 1.0 if closed_right else v < 1.0
    if not (v >= 0.0 and upper_ok):
        bound = "[0, 1]" if closed_right else "[0, 1)"
        raise ValueError(f"Argument `{name}` must be in {bound}. Received: {name}={value!r}")
    return v


class FusedUpdateMixin:
    """Mixin for a Keras optimizer (TF backend): fused per-variable updates.

    Subclasses implement:

    - ``_step_scalars(learning_rate, dtype, composite=None) -> dict[str, tf.Tensor]``:
      the step-dependent scalars of one dtype, built once per step, for the
      composite form when `composite` is True (None: when `composite_reason`
      gives one for `dtype`). Only tensors (they travel through
      `tf.distribute` merge calls).
    - ``_fused_apply(grad, variable, scalars)``: emit the one training op
      updating `variable` (a `tf.Variable`, or the local component of a
      distributed one) from the dense `grad` of the variable's dtype.
    - optionally ``_fused_apply_sparse(grad, variable, scalars)`` for
      `tf.IndexedSlices`; the default densifies.
    - ``_fused_op() -> str``: the training op `_fused_apply` emits, and
      ``_composite_apply(grad, variable, scalars)``: the same update as
      elementwise ops and variable assignments, emitted instead where the
      backend has no kernel for that op (`composite_reason`).

    A subclass whose Keras update squares the gradient sets
    `_keras_squares_slices`: its `tf.IndexedSlices` gradients then take the
    Keras class's own ``update_step`` (`keras_sparse_reason`).
    """

    # Whether the Keras class's update squares the gradient (Adam's and RMSprop's velocity, Adagrad's
    # accumulator). On a `tf.IndexedSlices` gradient Keras' TF backend squares each slice, and only then
    # do the slices of a row given more than once add up (`ops.square` keeps the slices; adding them to
    # the dense slot sums them): the velocity gets the sum of the squares. The dense ops here square
    # the summed gradient. Both are the same when no row repeats, which a batch of token ids rarely
    # guarantees; so such a gradient takes Keras' own update and the results stay Keras'.
    _keras_squares_slices = False

    def keras_sparse_reason(self, grad):
        """Why `grad` takes the Keras class's own ``update_step`` instead of a fused form, or None."""
        if self._keras_squares_slices and isinstance(grad, tf.IndexedSlices):
            return (f"{type(self).__name__}: a tf.IndexedSlices gradient (an Embedding's) takes "
                    f"keras.optimizers.{self._keras_class_name()}'s own update, which squares each slice "
                    "before a repeated row's slices add up")
        return None

    def _keras_class_name(self):
        keras_class = next(c for c in type(self).__mro__ if c.__module__.startswith("keras."))
        return keras_class.__name__

    def _keras_update(self, variable, grad, learning_rate):
        """The Keras class's own per-variable update (the class after this mixin in the MRO); `variable`
        first, as `distribute.extended.update` calls it."""
        return super(FusedUpdateMixin, self).update_step(grad, variable, learning_rate)

    def _fused_op(self):
        raise NotImplementedError

    def _composite_apply(self, grad, variable, scalars):
        raise NotImplementedError

    def composite_reason(self, dtype="float32"):
        """Why this optimizer emits its composite update here (variables of `dtype`), or None (the fused op)."""
        return composite_reason(self._fused_op(), dtype)

    def _step_scalars(self, learning_rate, dtype, composite=None):
        raise NotImplementedError

    def _fused_apply(self, grad, variable, scalars):
        raise NotImplementedError

    def _fused_apply_sparse(self, grad, variable, scalars):
        return self._fused_apply(dense_gradient(grad, variable.dtype), variable, scalars)

    def _slot_handle(self, slots, variable):
        """Resource handle of `variable`'s slot in the list `slots`."""
        return _tf_variable(slots[self._get_variable_index(variable)]).handle

    def _scalars_by_dtype(self, learning_rate, variables, composite=None):
        """{dtype: `_step_scalars`}; `composite` False: the fused or multi-tensor op's scalars whatever
        `composite_reason` says for the dtype (None: as it says)."""
        dtypes = sorted({_dtype_key(v) for v in variables})
        with tf.name_scope("step_scalars"):
            return {d: self._step_scalars(learning_rate, tf.as_dtype(d), composite) for d in dtypes}

    def _log_keras_sparse(self, grad):
        if not getattr(self, "_keras_sparse_logged", False):
            self._keras_sparse_logged = True
            logger.info("tfmetal_ext: %s", self.keras_sparse_reason(grad))

    def _apply_one(self, variable, grad, scalars_by_dtype, learning_rate):
        if self.keras_sparse_reason(grad) is not None:
            self._log_keras_sparse(grad)
            return self._keras_update(variable, grad, learning_rate)
        scalars = scalars_by_dtype[_dtype_key(variable)]
        if self.composite_reason(_dtype_key(variable)) is not None:
            return self._composite_apply(dense_gradient(grad, variable.dtype), variable, scalars)
        if isinstance(grad, tf.IndexedSlices):
            return self._fused_apply_sparse(grad, variable, scalars)
        return self._fused_apply(dense_gradient(grad, variable.dtype), variable, scalars)

    # -- Keras hooks --------------------------------------------------------

    def update_step(self, gradient, variable, learning_rate):
        """Updates one variable (Keras' per-variable entry point)."""
        variable = _tf_variable(variable)
        scalars = self._scalars_by_dtype(learning_rate, [variable])
        return self._apply_one(variable, gradient, scalars, learning_rate)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        # Built in the replica context like Keras' learning rate, so under
        # tf.distribute each replica's update reads its own copy.
        scalars = self._scalars_by_dtype(learning_rate, variables)
        _merge_call(self._distributed_fused_update, self._distribution_strategy, grads_and_vars, scalars,
                    learning_rate)

    def _distributed_fused_update(self, distribution, grads_and_vars, scalars, learning_rate):
        for grad, variable in grads_and_vars:
            distribution.extended.update(variable, self._apply_one, args=(grad, scalars, learning_rate),
                                         group=False)

    def _apply_weight_decay(self, variables):
        """Decoupled weight decay ``var -= lr * wd * var``, one op per variable.

        ``ResourceApplyGradientDescent(var, alpha=lr * wd, delta=var)``, with
        ``lr * wd`` built once per step and dtype (Keras rebuilds the learning
        rate, two casts and two multiplies for every variable).
        """
        if self.weight_decay is None:
            return
        decayed = [_tf_variable(v) for v in variables if self._use_weight_decay(v)]
        if not decayed:
            return
        learning_rate = self.learning_rate
        with tf.name_scope("weight_decay"):
            rates = {
                d: tf.cast(learning_rate, d) * tf.cast(self.weight_decay, d)
                for d in sorted({_dtype_key(v) for v in decayed})
            }

        def decay(variable, rates):
            if composite_reason("ResourceApplyGradientDescent", _dtype_key(variable)) is not None:
                return variable.assign_sub(variable * rates[_dtype_key(variable)])
            return tf.raw_ops.ResourceApplyGradientDescent(
                var=variable.handle,
                alpha=rates[_dtype_key(variable)],
                delta=variable.read_value(),
            )

        def distributed_decay(distribution, variables, rates):
            for variable in variables:
                distribution.extended.update(variable, decay, args=(rates,), group=False)

        _merge_call(distributed_decay, self._distribution_strategy, decayed, rates)


# -- multi-tensor updates ------------------------------------------------------

# Strategies whose update runs per replica on one device holding a copy of
# every variable, so one op per replica can update a group of variables.
_MULTI_TENSOR_STRATEGIES = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.OneDeviceStrategy,
)

MULTI_TENSOR_CHOICES = (True, False, "auto")

# `MultiTensorMixin.update_form` values.
MULTI_TENSOR, PER_VARIABLE, COMPOSITE = "multi_tensor", "per_variable", "composite"


def check_multi_tensor(value):
    """`value` if it is True, False or ``"auto"``; else ValueError."""
    if not any(value is c or (isinstance(value, str) and value == c) for c in MULTI_TENSOR_CHOICES):
        raise ValueError(
            f"Argument `multi_tensor` must be True, False or 'auto'. Received: multi_tensor={value!r}"
        )
    return value


def _placement(variable):
    """The devices holding `variable`: one per replica for distributed variables."""
    components = getattr(variable, "values", None)
    if components is not None:
        return tuple(c.device for c in components)
    return (variable.device,)


@tf.autograph.experimental.do_not_convert  # loads the op library: not for AutoGraph to descend into
def multi_tensor_kernel_reason(key, variables=()):
    """Why the custom op `key` (a `fusion.CUSTOM_OPS` key) has no kernel for these variables here, or None.

    Asked by ``multi_tensor="auto"``: the op library must be loaded (not
    ``TFMETAL_EXT_REFERENCE_OPS=1``, not a failed build), contain the op,
    have its kernel registered for the variables' device type, and the
    current backend's table row for the op (when it has one) must say it
    runs there.
    """
    from tfmetal_ext import backends
    from tfmetal_ext.backends import fusion
    from tfmetal_ext.ops import _common, _loader

    op = fusion.CUSTOM_OPS.get(key)
    if op is None:
        return f"this tfmetal_ext has no {key} op"
    if _common.use_reference():
        return "TFMETAL_EXT_REFERENCE_OPS=1: the op library is not used"
    if _common.library() is None:
        return f"the op library is not loaded ({_loader.state().error or 'unavailable'})"
    row = backends.current().fusions.get(key)
    if row is not None and not row.fuses:
        return f"{backends.current().label}: {row.why_not or row.summary}"
    from tfmetal_ext.ops import _multi_tensor

    registered = _multi_tensor.kernel_device_types(op.name)  # the library is loaded (above)
    wanted = set()
    for variable in variables:
        for device in _placement(_tf_variable(variable)):
            wanted.add(tf.DeviceSpec.from_string(device).device_type if device else None)
    if None in wanted or not wanted:
        wanted.discard(None)
        wanted.add("GPU" if tf.config.list_logical_devices("GPU") else "CPU")
    missing = sorted(d for d in wanted if d not in registered)
    if missing:
        return f"{op.name} has no {'/'.join(missing)} kernel in this build"
    return None


class MultiTensorMixin:
    """One custom op per group of variables instead of one update per variable.

    For a `FusedUpdateMixin` optimizer whose whole step can also run as one
    ``TfmetalExt>MultiTensor*`` op per (dtype, placement, decayed or not)
    group, with decoupled weight decay folded into that op. Subclasses set
    `_multi_tensor_key` (the `fusion.CUSTOM_OPS` key) and implement
    ``_multi_tensor_apply(variables, grads, scalars, weight_decay_rate)``
    (inside one replica's update: `variables` are that replica's copies).

    ``multi_tensor``: True (the op, falling back with a WARNING where it
    cannot run), False (per-variable updates) or ``"auto"`` (the op where its
    kernel runs here, else per-variable updates with one INFO line).
    """

    _multi_tensor_key = None
    _per_variable_form = "one op per variable"  # what runs instead, for the fallback's log line

    def _init_multi_tensor(self, multi_tensor):
        self.multi_tensor = multi_tensor
        self._fallbacks_logged = set()
        self._update_form = None
        self._update_form_reason = None
        self._loss_scale_form = None
        self._loss_scale_form_reason = None

    @property
    def update_form(self):
        """How the last traced step updated: ``"multi_tensor"``, ``"per_variable"``, ``"composite"``
        (Keras' math as elementwise ops where the backend lacks the fused op's kernel), or None before
        the first step."""
        return self._update_form

    @property
    def update_form_reason(self):
        """Why the last traced step did not use the multi-tensor op (None when it did, or before the first)."""
        return self._update_form_reason

    @property
    def loss_scale_form(self):
        """How the last traced step under a `keras.optimizers.LossScaleOptimizer` scaled: ``"in_op"`` (the
        multi-tensor op checked, unscaled and skipped: `tfmetal_ext.optimizers.loss_scale`), ``"keras"``
        (Keras' own finite check and cond around the update), or None (no such step traced yet)."""
        return self._loss_scale_form

    @property
    def loss_scale_form_reason(self):
        """Why the last loss-scaled step did not scale inside the op (None when it did, or before the first)."""
        return self._loss_scale_form_reason

    def _multi_tensor_op_name(self):
        from tfmetal_ext.backends import fusion

        op = fusion.CUSTOM_OPS.get(self._multi_tensor_key)
        return op.name if op is not None else self._multi_tensor_key

    # Plain Python reading the backend tables and the op library: nothing for AutoGraph to convert.
    @tf.autograph.experimental.do_not_convert
    def _multi_tensor_blocker(self, variables=()):
        """Why the multi-tensor op is not used for this step, or None."""
        if self.multi_tensor is False:
            return "multi_tensor=False"
        from tfmetal_ext import precision
        from tfmetal_ext.backends import fusion

        op_name = self._multi_tensor_op_name()
        safe_form = getattr(fusion.CUSTOM_OPS.get(self._multi_tensor_key), "safe_form", self._multi_tensor_key)
        if safe_form in precision.avoided_fusions():
            return f"configure(avoid_fusions=[{safe_form!r}]) avoids {op_name}"
        if in_xla_context():
            return f"the step is XLA-compiled and {op_name} has no XLA kernel"
        # The custom op's Metal kernel reaches variables through TF's C++ kernel API, so it is registered
        # where TF lacks the resource-variable C API too (the open plugin on TF 2.21, which has no
        # ResourceApply* kernel): "auto" checks below (multi_tensor_kernel_reason) the backend table's row
        # and that this process registered it for the variables' device.
        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            if not isinstance(strategy, _MULTI_TENSOR_STRATEGIES):
                return f"{type(strategy).__name__} is not supported (Mirrored, MultiWorkerMirrored and OneDevice are)"
        from tfmetal_ext.ops._common import FLOAT_DTYPES

        others = sorted({_dtype_key(_tf_variable(v)) for v in variables} - {d.name for d in FLOAT_DTYPES})
        if others:
            return (f"{op_name} takes {', '.join(d.name for d in FLOAT_DTYPES)} variables; "
                    f"this step has {', '.join(others)} ones")
        if self.multi_tensor == "auto":
            return multi_tensor_kernel_reason(self._multi_tensor_key, variables)
        return None

    def _log_fallback(self, reason):
        if self.multi_tensor is False or reason in self._fallbacks_logged:
            return
        self._fallbacks_logged.add(reason)
        level = logging.INFO if self.multi_tensor == "auto" else logging.WARNING
        logger.log(level, "tfmetal_ext: %s(multi_tensor=%r) uses %s: %s",
                   type(self).__name__, self.multi_tensor, self._per_variable_form, reason)

    def _record_form(self, variables, reason):
        if reason is None:
            self._update_form, self._update_form_reason = MULTI_TENSOR, None
            return
        dtypes = {_dtype_key(_tf_variable(v)) for v in variables} or {"float32"}
        composite = any(self.composite_reason(d) is not None for d in dtypes)
        self._update_form = COMPOSITE if composite else PER_VARIABLE
        self._update_form_reason = reason

    def get_config(self):
        config = super().get_config()
        config["multi_tensor"] = self.multi_tensor
        return config

    def _apply_weight_decay(self, variables):
        # Keras calls this right before `_backend_update_step`, in the same
        # context; the multi-tensor op applies the decay inside its update.
        if self.weight_decay is not None and self._multi_tensor_blocker(variables) is None:
            return
        super()._apply_weight_decay(variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        reason = self._multi_tensor_blocker(trainable_variables)
        self._record_form(trainable_variables, reason)
        if reason is not None:
            self._log_fallback(reason)
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        # Decided here, in the replica context: inside the merge call a gradient is a per-replica value.
        sparse = [(g, v) for g, v in grads_and_vars if self.keras_sparse_reason(g) is not None]
        keras_taken = frozenset(self._var_key(v) for _, v in sparse)
        if sparse:
            self._log_keras_sparse(sparse[0][0])
            # Keras' order for those: the decay, then Keras' update (the op folds the decay into the others').
            FusedUpdateMixin._apply_weight_decay(
                self, [v for v in trainable_variables if self._var_key(v) in keras_taken])
        decayed = frozenset()
        if self.weight_decay is not None:
            decayed = frozenset(self._var_key(v) for v in trainable_variables
                                if self._use_weight_decay(v) and self._var_key(v) not in keras_taken)
        # The multi-tensor op's scalars, also for a dtype whose per-variable op has no kernel here (Apple's
        # tensorflow-metal registers ResourceApplyAdam for float32 only; the multi-tensor op takes half too).
        scalars = self._scalars_by_dtype(learning_rate, variables, composite=False)
        decay_rates = {}
        if decayed:
            with tf.name_scope("weight_decay"):
                decay_rates = {
                    d: tf.cast(learning_rate, d) * tf.cast(self.weight_decay, d)
                    for d in sorted({_dtype_key(v) for v in variables if self._var_key(v) in decayed})
                }
        # `decayed` travels in the closure: merge_call would turn a Python
        # object built by each replica into a per-replica value.
        update = functools.partial(self._distributed_multi_tensor_update, decayed=decayed, keras_taken=keras_taken)
        _merge_call(update, self._distribution_strategy, grads_and_vars, scalars, decay_rates, learning_rate)

    def _distributed_multi_tensor_update(self, distribution, grads_and_vars, scalars, decay_rates, learning_rate,
                                         decayed, keras_taken):
        # Groups of variables that one op can update: same dtype, same
        # devices (per replica), same decay. Under MirroredStrategy,
        # `extended.update` runs `fn` once per replica on that replica's
        # device; inside it, the distributed variables in `args` resolve to
        # that replica's copies and per-replica values to that replica's.
        groups = {}
        for grad, variable in grads_and_vars:
            if self._var_key(variable) in keras_taken:
                distribution.extended.update(variable, self._keras_update, args=(grad, learning_rate), group=False)
                continue
            is_decayed = self._var_key(variable) in decayed
            key = (_dtype_key(variable), _placement(variable), is_decayed)
            groups.setdefault(key, []).append((grad, variable))
        for (dtype, _, is_decayed), items in groups.items():
            grads = [g for g, _ in items]
            variables = [v for _, v in items]
            rate = decay_rates[dtype] if is_decayed else None
            distribution.extended.update(
                variables[0], self._multi_tensor_group, args=(variables, grads, scalars[dtype], rate), group=False
            )

    def _multi_tensor_group(self, _, variables, grads, scalars, weight_decay_rate):
        return self._multi_tensor_apply(variables, grads, scalars, weight_decay_rate)

    def _multi_tensor_apply(self, variables, grads, scalars, weight_decay_rate, scale=None):
        """One multi-tensor op over `variables`; with `scale`, the loss-scaled op, returning its flag."""
        raise NotImplementedError

    # -- loss scaling inside the op (tfmetal_ext.optimizers.loss_scale) -----------

    # Plain Python over the step's structure and the backend tables: nothing for AutoGraph.
    @tf.autograph.experimental.do_not_convert
    def _loss_scaled_blocker(self, grads, trainable_variables):
        """Why a `LossScaleOptimizer` step around this optimizer cannot be one loss-scaled op, or None.

        The op replaces Keras' finite check, cond and unscale, and ``apply``'s
        own work in the finite branch, so everything ``apply`` would do besides
        the update must be absent: the op checks every gradient before its
        first write, so all of them must go to one op (one group).
        """
        reason = self._multi_tensor_blocker(trainable_variables)
        if reason is not None:
            return reason
        if tf.distribute.has_strategy():
            return ("under a tf.distribute strategy (Keras' LossScaleOptimizer takes the finite check "
                    "across replicas)")
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            return "no gradients"
        why = []
        if self.loss_scale_factor is not None:
            why.append(f"loss_scale_factor={self.loss_scale_factor!r}")
        if self.gradient_accumulation_steps:
            why.append(f"gradient_accumulation_steps={self.gradient_accumulation_steps}")
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            if getattr(self, name, None):
                why.append(f"{name}={getattr(self, name)!r} (Keras clips the unscaled gradients)")
        if self.use_ema:
            why.append("use_ema=True")
        if any(getattr(v, "constraint", None) is not None for _, v in pairs):
            why.append("a variable has a constraint")
        if any(self._overwrite_variable_with_gradient(v) for _, v in pairs):
            why.append("a variable is overwritten with its gradient")
        if why:
            return "; ".join(why)
        for g, _ in pairs:
            reason = self.keras_sparse_reason(g)
            if reason is not None:
                return reason
        for g, v in pairs:
            if tf.as_dtype(g.dtype).base_dtype != tf.as_dtype(_tf_variable(v).dtype).base_dtype:
                return (f"a gradient's dtype ({tf.as_dtype(g.dtype).name}) is not its variable's "
                        f"({_dtype_key(_tf_variable(v))}): Keras checks the gradient as given")
        groups = {(_dtype_key(_tf_variable(v)), _placement(_tf_variable(v)),
                   self.weight_decay is not None and self._use_weight_decay(v)) for _, v in pairs}
        if len(groups) > 1:
            return (f"the variables form {len(groups)} groups (dtype, device, decayed or not): every gradient "
                    "must be checked before any group is updated, so one op must take them all")
        return None

    def _log_loss_scale_fallback(self, reason):
        key = ("loss_scale", reason)
        if self.multi_tensor is False or key in self._fallbacks_logged:
            return
        self._fallbacks_logged.add(key)
        logger.info("tfmetal_ext: %s under LossScaleOptimizer uses Keras' loss scaling (a finite check and a "
                    "cond around the update) instead of %s's: %s", type(self).__name__,
                    self._multi_tensor_op_name(), reason)

    @tf.autograph.experimental.do_not_convert
    def _apply_loss_scaled(self, scale, grads, trainable_variables=None):
        """The whole inner step of a `LossScaleOptimizer` as one loss-scaled multi-tensor op.

        Called by `tfmetal_ext.optimizers.loss_scale` in place of Keras' finite
        check, cond, unscale and ``apply``: `grads` are the loss-scaled ones and
        `scale` the wrapper's ``dynamic_scale``. Does what ``apply`` does in the
        finite branch (variables checked, empty gradients dropped with Keras'
        warning, learning rate from the schedule, decoupled weight decay, the
        update, the iteration counter) with the op's check deciding: when a
        gradient has a NaN or an infinity nothing is written and `iterations`
        stays, as Keras skips the step. Returns the op's ``found_non_finite``
        (a bool scalar tensor), or None when this step cannot run so
        (`_loss_scaled_blocker`, the reason logged once at INFO): the caller
        then runs Keras' own loss scaling.
        """
        grads = list(grads)
        tvs = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        reason = self._loss_scaled_blocker(grads, tvs)
        self._loss_scale_form = "keras" if reason is not None else "in_op"
        self._loss_scale_form_reason = reason
        if reason is not None:
            self._log_loss_scale_fallback(reason)
            return None
        if trainable_variables is not None:
            self._check_variables_are_known(tvs)
        with keras_backend.name_scope(self.name, caller=self):
            grads, tvs = self._filter_empty_gradients(grads, tvs)
            variables = [_tf_variable(v) for v in tvs]
            self._record_form(variables, None)
            learning_rate = self.learning_rate
            scalars = self._scalars_by_dtype(learning_rate, variables, composite=False)
            dtype = _dtype_key(variables[0])
            rate = None
            if self.weight_decay is not None and self._use_weight_decay(tvs[0]):
                with tf.name_scope("weight_decay"):
                    rate = tf.cast(learning_rate, dtype) * tf.cast(self.weight_decay, dtype)
            found = self._multi_tensor_apply(variables, grads, scalars[dtype], rate, scale=scale)
            # Keras counts only the steps it applies (a bool cast, not int64 arithmetic: Metal
            # backends lack int64 kernels of their own).
            self._iterations.assign_add(tf.cast(tf.logical_not(found), self._iterations.dtype))
        return found
