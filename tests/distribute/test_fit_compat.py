import os
import pytest

from tfmetal_ext import distribute

from . import _cluster


def test_install_is_idempotent_and_reversible():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    before = (tf_trainer.TensorFlowTrainer._maybe_symbolic_build, tf_trainer.reduce_per_replica)
    with distribute.fit_compat():
        with distribute.fit_compat():
            assert distribute.install() is True
            patched = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
            assert patched is not before[0]
        assert tf_trainer.TensorFlowTrainer._maybe_symbolic_build is patched
    after = (tf_trainer.TensorFlowTrainer._maybe_symbolic_build, tf_trainer.reduce_per_replica)
    assert after == before


@pytest.mark.full  # two worker processes; the quick tier keeps the patch/unpatch test above
def test_two_workers_fit_on_loopback():
    worker = os.path.join(os.path.dirname(__file__), "_mwms_fit_worker.py")
    codes, outs = _cluster.cluster(worker, []).wait(timeout=150)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    weights = [line for out in outs for line in out.splitlines() if line.startswith("WEIGHTS")]
    assert len(weights) == 2 and weights[0] == weights[1], outs


def test_keras_3_15_still_needs_both_parts():
    # The guard reads the source of the functions it replaces: on this Keras
    # both still contain the failing call, so both parts are installed.
    assert distribute.needed() == {"build": True, "reduce": True}


class _FixedTrainer:
    # Stand-in for a Keras whose build step no longer reduces the sample.
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        return None


def _fixed_reduce(values, strategy, reduction):
    return values


def test_noop_when_keras_no_longer_has_the_bug(monkeypatch):
    from keras.src.backend.tensorflow import trainer as tf_trainer

    monkeypatch.setattr(tf_trainer, "TensorFlowTrainer", _FixedTrainer)
    monkeypatch.setattr(tf_trainer, "reduce_per_replica", _fixed_reduce)
    build = _FixedTrainer._maybe_symbolic_build
    assert distribute.needed() == {"build": False, "reduce": False}
    with distribute.fit_compat():
        assert distribute.install() is False
        assert _FixedTrainer._maybe_symbolic_build is build
        assert tf_trainer.reduce_per_replica is _fixed_reduce


def test_only_the_still_buggy_part_is_installed(monkeypatch):
    from keras.src.backend.tensorflow import trainer as tf_trainer

    real_reduce = tf_trainer.reduce_per_replica
    monkeypatch.setattr(tf_trainer, "TensorFlowTrainer", _FixedTrainer)
    build = _FixedTrainer._maybe_symbolic_build
    with distribute.fit_compat():
        assert _FixedTrainer._maybe_symbolic_build is build
        assert tf_trainer.reduce_per_replica is not real_reduce
    assert tf_trainer.reduce_per_replica is real_reduce
