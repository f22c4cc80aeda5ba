"""Helpers for training under ``tf.distribute.MultiWorkerMirroredStrategy``.

Keras 3 (checked on 3.15 with TF 2.21) fails in ``model.fit`` with two or
more workers: ``TensorFlowTrainer._maybe_symbolic_build`` takes a sample batch
to build the model and passes the whole ``(x, y)`` structure of ``PerReplica``
values to ``strategy.reduce("MEAN", ..., axis=None)``.  In multi-worker mode
that goes through the collective cross-device ops, which accept a single
distributed value only and try to convert the tuple to a tensor
(``ValueError: Attempt to convert a value (PerReplica:{...}) ...``).  The
sample is only used for shapes, so a local replica's value is enough.
Then ``reduce_per_replica`` (same file) averages the scalar step logs with
``strategy.reduce("MEAN", v, axis=0)``, which fails on rank-0 values
("Invalid reduction dimension 0 for input with 0 dimensions"); the patch
averages rank-0 values across replicas with ``axis=None`` and leaves the
others to Keras.

``fit_compat()`` swaps in those two replacements while its block runs.  It is
idempotent and reversible.

Version guard: each replacement is installed only when the Keras function it
replaces still contains the failing call, found by reading the function's
source (``inspect.getsource``): a ``distribute_strategy.reduce(`` call in
``_maybe_symbolic_build``, and ``reduce("MEAN", v, axis=0)`` in
``reduce_per_replica``.  Once Keras rewrites either function, that part of
the patch turns itself off, and ``fit_compat()`` becomes a no-op when both are
gone (or when the Keras layout has no such method at all).  When the source
cannot be read (e.g. a build shipped without ``.py`` files) the patch is
installed, since the replacements behave the same as Keras wherever Keras
works.
"""

import contextlib
import inspect
import re

_STATE = {"build": None, "reduce": None}

# Whitespace-free fragments of the failing calls (see the module docstring).
_BUILD_BUG = "distribute_strategy.reduce("
_REDUCE_BUG = 'reduce("MEAN",v,axis=0)'


def _has_call(fn, fragment):
    """True when the source of `fn` contains `fragment` (True if unreadable)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return True
    return fragment in re.sub(r"\s+", "", source).replace("'", '"')


def _trainer_module():
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    return tf_trainer


def _trainer_class():
    module = _trainer_module()
    cls = getattr(module, "TensorFlowTrainer", None)
    if cls is None or not hasattr(cls, "_maybe_symbolic_build"):
        return None
    return cls


def needed():
    """Which parts of the patch this Keras still needs: {"build": bool, "reduce": bool}."""
    cls = _trainer_class()
    module = _trainer_module()
    build = cls is not None and _has_call(cls._maybe_symbolic_build, _BUILD_BUG)
    reduce_fn = getattr(module, "reduce_per_replica", None)
    reduce = reduce_fn is not None and _has_call(reduce_fn, _REDUCE_BUG)
    return {"build": build, "reduce": reduce}


def _local_sample_build(self, iterator=None, data_batch=None):
    import tensorflow as tf
    from keras import tree

    strategy = self._distribute_strategy
    if strategy is None or iterator is None:
        return _STATE["build"](self, iterator=iterator, data_batch=data_batch)

    def first_local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    for _, _, it in iterator:
        data_batch = tree.map_structure(first_local, next(it))
        break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _scalar_safe_reduce(values, strategy, reduction):
    # Multi-worker "mean" of step logs: a rank-0 value per replica is averaged
    # across replicas (axis=None); axis=0 fails on it.  Other ranks: Keras.
    import tensorflow as tf
    from keras import tree

    original = _STATE["reduce"]
    multi = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()
    if not (multi and reduction in ("auto", "mean")):
        return original(values, strategy, reduction)

    def one(v):
        local = strategy.experimental_local_results(v) if isinstance(v, tf.distribute.DistributedValues) else [v]
        if all(getattr(t, "shape", None) is not None and t.shape.rank == 0 for t in local):
            return strategy.reduce("MEAN", v, axis=None)
        return original(v, strategy, reduction)

    return tree.map_structure(one, values)


def install():
    """Installs the parts of the patch this Keras needs; True when any is active."""
    cls = _trainer_class()
    module = _trainer_module()
    if cls is None:
        return False
    need = needed()
    if need["build"] and _STATE["build"] is None:
        _STATE["build"] = cls._maybe_symbolic_build
        cls._maybe_symbolic_build = _local_sample_build
    if need["reduce"] and _STATE["reduce"] is None:
        _STATE["reduce"] = module.reduce_per_replica
        module.reduce_per_replica = _scalar_safe_reduce
    return _STATE["build"] is not None or _STATE["reduce"] is not None


def uninstall():
    """Restores the original Keras functions (no-op when not installed)."""
    cls = _trainer_class()
    module = _trainer_module()
    if cls is not None and _STATE["build"] is not None:
        cls._maybe_symbolic_build = _STATE["build"]
    if module is not None and _STATE["reduce"] is not None:
        module.reduce_per_replica = _STATE["reduce"]
    _STATE["build"] = None
    _STATE["reduce"] = None


@contextlib.contextmanager
def fit_compat(strategy=None):
    """Context manager: ``model.fit`` works under a multi-worker strategy.

    ``strategy`` is accepted for symmetry with ``strategy.scope()``; the patch
    applies only while the block runs and is undone on exit unless it was
    already installed before.  A no-op on a Keras without the bug (see the
    module docstring).
    """
    was_installed = _STATE["build"] is not None or _STATE["reduce"] is not None
    install()
    try:
        yield strategy
    finally:
        if not was_installed:
            uninstall()
