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
averages them across replicas with ``axis=None``.

``fit_compat()`` swaps in a build step that uses the first local replica's
value instead.  It is idempotent, reversible and a no-op on Keras versions
without the affected method.
"""

import contextlib

_STATE = {"original": None, "reduce": None}


def _trainer_class():
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    if not hasattr(TensorFlowTrainer, "_maybe_symbolic_build"):
        return None
    return TensorFlowTrainer


def _local_sample_build(self, iterator=None, data_batch=None):
    import tensorflow as tf
    from keras import tree

    strategy = self._distribute_strategy
    if strategy is None or iterator is None:
        return _STATE["original"](self, iterator=iterator, data_batch=data_batch)

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
    # Multi-worker "mean" of step logs: the logs are scalars per replica, so
    # average across replicas (axis=None); axis=0 fails on rank-0 values.
    import tensorflow as tf
    from keras import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    multi = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()
    if multi and reduction in ("auto", "mean"):
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values
        )
    return _STATE["reduce"](values, strategy, reduction)


def install():
    """Patches Keras' TF trainer; returns True when a patch is active."""
    cls = _trainer_class()
    if cls is None:
        return False
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if _STATE["original"] is None:
        _STATE["original"] = cls._maybe_symbolic_build
        cls._maybe_symbolic_build = _local_sample_build
        _STATE["reduce"] = tf_trainer.reduce_per_replica
        tf_trainer.reduce_per_replica = _scalar_safe_reduce
    return True


def uninstall():
    """Restores the original Keras method (no-op when not installed)."""
    cls = _trainer_class()
    if cls is not None and _STATE["original"] is not None:
        from keras.src.backend.tensorflow import trainer as tf_trainer

        cls._maybe_symbolic_build = _STATE["original"]
        tf_trainer.reduce_per_replica = _STATE["reduce"]
        _STATE["original"] = None
        _STATE["reduce"] = None


@contextlib.contextmanager
def fit_compat(strategy=None):
    """Context manager: ``model.fit`` works under a multi-worker strategy.

    ``strategy`` is accepted for symmetry with ``strategy.scope()``; the patch
    applies only while the block runs and is undone on exit unless it was
    already installed before.
    """
    was_installed = _STATE["original"] is not None
    install()
    try:
        yield strategy
    finally:
        if not was_installed:
            uninstall()
