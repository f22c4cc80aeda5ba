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
like any optimizer), variable constraints, the iteration counter, and the
optimizer variables themselves (same names and order as the Keras optimizer
of the same name, so saved state is interchangeable).
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import backend as keras_backend

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
    effect too (every slot row decays each step).
    """
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    return tf.cast(grad, dtype)


def composite_reason(op, dtype):
    """Why the fused optimizers emit their composite update instead of `op` on this backend, or None.

    The composite form is Keras' own update math as elementwise ops into
    ``AssignVariableOp`` / ``AssignAddVariableOp`` / ``AssignSubVariableOp``,
    with the step's scalars built once per step and dtype (about 10 ops per
    Adam variable instead of Keras' 27). It is emitted on a GPU backend whose
    table says `op` has no kernel there (`Backend.has_kernel` is False): the
    open tensorflow-metal-plugin on TF 2.21, where every ``ResourceApply*``
    is in the table's `host_ops` (see `tfmetal_ext.optimizers`). A CPU, CUDA
    or Apple's tensorflow-metal keeps the one fused op per variable.
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

    - ``_step_scalars(learning_rate, dtype) -> dict[str, tf.Tensor]``: the
      step-dependent scalars of one dtype, built once per step. Only tensors
      (they travel through `tf.distribute` merge calls).
    - ``_fused_apply(grad, variable, scalars)``: emit the one training op
      updating `variable` (a `tf.Variable`, or the local component of a
      distributed one) from the dense `grad` of the variable's dtype.
    - optionally ``_fused_apply_sparse(grad, variable, scalars)`` for
      `tf.IndexedSlices`; the default densifies.
    - ``_fused_op() -> str``: the training op `_fused_apply` emits, and
      ``_composite_apply(grad, variable, scalars)``: the same update as
      elementwise ops and variable assignments, emitted instead where the
      backend has no kernel for that op (`composite_reason`).
    """

    def _fused_op(self):
        raise NotImplementedError

    def _composite_apply(self, grad, variable, scalars):
        raise NotImplementedError

    def composite_reason(self, dtype="float32"):
        """Why this optimizer emits its composite update here (variables of `dtype`), or None (the fused op)."""
        return composite_reason(self._fused_op(), dtype)

    def _step_scalars(self, learning_rate, dtype):
        raise NotImplementedError

    def _fused_apply(self, grad, variable, scalars):
        raise NotImplementedError

    def _fused_apply_sparse(self, grad, variable, scalars):
        return self._fused_apply(dense_gradient(grad, variable.dtype), variable, scalars)

    def _slot_handle(self, slots, variable):
        """Resource handle of `variable`'s slot in the list `slots`."""
        return _tf_variable(slots[self._get_variable_index(variable)]).handle

    def _scalars_by_dtype(self, learning_rate, variables):
        dtypes = sorted({_dtype_key(v) for v in variables})
        with tf.name_scope("step_scalars"):
            return {d: self._step_scalars(learning_rate, tf.as_dtype(d)) for d in dtypes}

    def _apply_one(self, variable, grad, scalars_by_dtype):
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
        return self._apply_one(variable, gradient, scalars)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = [_tf_variable(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        # Built in the replica context like Keras' learning rate, so under
        # tf.distribute each replica's update reads its own copy.
        scalars = self._scalars_by_dtype(learning_rate, variables)
        _merge_call(self._distributed_fused_update, self._distribution_strategy, grads_and_vars, scalars)

    def _distributed_fused_update(self, distribution, grads_and_vars, scalars):
        for grad, variable in grads_and_vars:
            distribution.extended.update(variable, self._apply_one, args=(grad, scalars), group=False)

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
