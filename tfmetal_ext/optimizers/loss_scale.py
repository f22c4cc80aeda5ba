"""Loss scaling inside the fused optimizers' multi-tensor op.

Under ``mixed_float16`` (what `tfmetal_ext.configure()` picks on Metal) Keras
wraps the optimizer in a `keras.optimizers.LossScaleOptimizer`, whose step on
TensorFlow (Keras 3.15, ``loss_scale_optimizer.py``) is: ``IsFinite`` and
``All`` per gradient, a ``Pack`` of the flags and one more ``All``, then a
``cond`` whose true branch divides every gradient by the scale and calls the
inner optimizer's ``apply``, and a second ``cond`` (or the false branch) for
the scale and its counter. On Metal, ``IsFinite`` (both backends) and
``Pack`` (the open plugin) have no GPU kernel of the backend's own, and the
``cond`` predicate goes to the host: the step leaves the GPU.

When the inner optimizer is a `FusedAdam`, `FusedAdamW`, `FusedLion` or
`FusedRMSprop` whose multi-tensor op runs for this step, the wrapper's step
is instead: the op with ``scale=dynamic_scale`` (it checks every gradient
element before any write, writes nothing if one is NaN or infinite, else
updates with ``grads / scale``; `tfmetal_ext.ops.multi_tensor_adam`), the
inner ``iterations`` advanced only when the op applied the step, and Keras'
dynamic-scale rule driven by the op's flag with selects instead of a
``cond``:

- a non-finite gradient: ``scale *= 0.5``, ``step_counter = 0``;
- else, after ``dynamic_growth_steps`` finite steps in a row
  (``step_counter == dynamic_growth_steps - 1``): ``scale *= 2``,
  ``step_counter = 0``;
- else ``step_counter += 1``.

That is `LossScaleOptimizer`'s rule step for step (same growth interval,
factors and counter), and the op unscales with Keras' own float32 division,
so results equal stock ``LossScaleOptimizer(FusedAdam(...))`` bit for bit.
Everything the inner ``apply`` does besides the update must be absent for
the op to take its place (no gradient clipping, EMA, accumulation,
constraints, one multi-tensor group, no `tf.distribute` strategy, the op's
kernel here): otherwise Keras' own loss scaling runs, with the reason logged
once at INFO and in the inner optimizer's `loss_scale_form_reason`.

How it is wired: Keras gives the inner optimizer no hook into the wrapper's
step, and ``model.compile`` creates the wrapper itself. So `install()`
(run when `tfmetal_ext.optimizers` is imported) replaces one method of the
Keras class, ``LossScaleOptimizer._tf_apply``, with `_tf_apply` below, which
asks the inner optimizer first (``_apply_loss_scaled``: only our fused
optimizers have it) and otherwise calls Keras' own method unchanged. Every
other optimizer, and every step the op cannot take, runs exactly as before.

The finite check of Keras' own step (where the op cannot take it, and
around every other optimizer) is replaced too, by `check_finite` below: the
same flag, but a sparse gradient (the ``tf.IndexedSlices`` of an
``Embedding``) is checked on its values. Keras' ``isfinite`` densifies it
first: a ``Fill`` of True the shape of the whole table and a
``TensorScatterUpdate`` of the values' flags into it, every step. Neither
Metal backend has a bool ``TensorScatterUpdate`` kernel, so that check went
to the CPU; rows without an update are True, so ``all`` of the dense mask is
``all(isfinite(values))`` exactly.

Version guard: installed only when the source of Keras'
`LossScaleOptimizer` still contains the rule reproduced here (its unscale,
growth test, factors and counter updates, and ``_tf_apply`` itself);
anything else, or an unreadable source, leaves Keras untouched.
``TFMETAL_EXT_FUSED_LOSS_SCALE=0`` (read at import) turns it off, and
`uninstall()` restores Keras' method.
"""

from __future__ import annotations

import inspect
import logging
import os
import re

import keras
import tensorflow as tf

logger = logging.getLogger("tfmetal_ext")

ENV = "TFMETAL_EXT_FUSED_LOSS_SCALE"

# Whitespace-free fragments of the Keras source this module reproduces (see the docstring).
_RULE = (
    "ops.divide(g,scale)",
    "ops.equal(self.step_counter,self.dynamic_growth_steps-1)",
    "self.dynamic_scale.assign(ops.multiply(self.dynamic_scale,2.0))",
    "self.dynamic_scale.assign(ops.multiply(self.dynamic_scale,0.5))",
    "self.step_counter.assign(0)",
    "self.step_counter.assign_add(1)",
    "def_tf_apply(self,grads,trainable_variables=None)",
    "self._tf_apply(grads,trainable_variables)",
)

# ... and of its finite check, which `check_finite` reproduces.
_CHECK_RULE = (
    "defcheck_finite(self,grads):",
    "tensor_grads=[gforgingradsifgisnotNone]",
    "finite_grads=[ops.all(ops.isfinite(g))forgintensor_grads]",
    "returnops.all(ops.convert_to_tensor(finite_grads))",
)

_original = {"_tf_apply": None, "check_finite": None}


def _source(cls):
    try:
        return re.sub(r"\s+", "", inspect.getsource(cls))
    except (OSError, TypeError):
        return ""


def keras_rule_matches(cls=None):
    """Whether Keras' `LossScaleOptimizer` (or `cls`) has the rule this module reproduces, from its source."""
    source = _source(cls or keras.optimizers.LossScaleOptimizer)
    return bool(source) and all(fragment in source for fragment in _RULE)


def keras_check_matches(cls=None):
    """Whether Keras' `LossScaleOptimizer` (or `cls`) has the finite check `check_finite` reproduces."""
    source = _source(cls or keras.optimizers.LossScaleOptimizer)
    return bool(source) and all(fragment in source for fragment in _CHECK_RULE)


def installed():
    """Whether `LossScaleOptimizer._tf_apply` is ours."""
    return _original["_tf_apply"] is not None


def install():
    """Routes `LossScaleOptimizer` steps around our fused optimizers into their op; True when installed.

    Idempotent. Does nothing with ``TFMETAL_EXT_FUSED_LOSS_SCALE=0`` or when
    Keras' rule differs from the one reproduced here (`keras_rule_matches`).
    """
    if installed():
        return True
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no"):
        return False
    cls = keras.optimizers.LossScaleOptimizer
    if not keras_rule_matches(cls) or not hasattr(cls, "_tf_apply"):
        logger.info("tfmetal_ext: this Keras' LossScaleOptimizer is not the one tfmetal_ext.optimizers.loss_scale "
                    "reproduces: loss scaling stays Keras' own")
        return False
    _original["_tf_apply"] = cls.__dict__["_tf_apply"]
    cls._tf_apply = _tf_apply
    if keras_check_matches(cls) and "check_finite" in cls.__dict__:
        _original["check_finite"] = cls.__dict__["check_finite"]
        cls.check_finite = check_finite
    return True


def uninstall():
    """Restores Keras' own `LossScaleOptimizer._tf_apply` (no-op when not installed)."""
    if installed():
        keras.optimizers.LossScaleOptimizer._tf_apply = _original["_tf_apply"]
        _original["_tf_apply"] = None
    if _original["check_finite"] is not None:
        keras.optimizers.LossScaleOptimizer.check_finite = _original["check_finite"]
        _original["check_finite"] = None


def _tf_apply(self, grads, trainable_variables=None):
    """`LossScaleOptimizer._tf_apply`, with the step inside the inner optimizer's op where it can run."""
    apply_loss_scaled = getattr(self.inner_optimizer, "_apply_loss_scaled", None)
    if apply_loss_scaled is not None and not tf.distribute.in_cross_replica_context():
        found = apply_loss_scaled(self.dynamic_scale.value, grads, trainable_variables)
        if found is not None:
            update_dynamic_scale(self, found)
            return
    return _original["_tf_apply"](self, grads, trainable_variables)


def update_dynamic_scale(optimizer, found):
    """Keras' dynamic-scale rule for one step of `optimizer` (a `LossScaleOptimizer`), without a cond.

    `found` is the step's ``found_non_finite`` (a bool scalar tensor). Writes
    ``step_counter`` and ``dynamic_scale`` once each, as the rule in the
    module docstring says; the factors are exact (powers of two), so the
    scale equals Keras' bit for bit.
    """
    counter, scale = optimizer.step_counter, optimizer.dynamic_scale
    with tf.name_scope("dynamic_loss_scale"):
        count = tf.convert_to_tensor(counter.value)
        grow = tf.equal(count, tf.constant(optimizer.dynamic_growth_steps - 1, count.dtype))
        keep_counting = tf.logical_not(tf.logical_or(found, grow))
        counter.assign((count + tf.constant(1, count.dtype)) * tf.cast(keep_counting, count.dtype))
        one, two, half = (tf.constant(x, tf.float32) for x in (1.0, 2.0, 0.5))
        factor = tf.where(found, half, tf.where(grow, two, one))
        scale.assign(tf.convert_to_tensor(scale.value) * factor)


def check_finite(self, grads):
    """`LossScaleOptimizer.check_finite`: True when every gradient is finite; a sparse one is checked on its values.

    Keras' flag exactly (see the module docstring), without densifying a
    ``tf.IndexedSlices`` gradient into a bool tensor of its variable's shape.
    """
    flags = []
    for g in grads:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        flags.append(keras.ops.all(keras.ops.isfinite(g)))
    return keras.ops.all(keras.ops.convert_to_tensor(flags))
