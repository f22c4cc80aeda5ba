import os
import subprocess
import sys

from tfmetal_ext import distribute


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


def test_two_workers_fit_on_loopback():
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(here, "..", "..")))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "_mwms_fit_worker.py")],
        env=env, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = [l for l in proc.stdout.splitlines() if l.startswith("WEIGHTS")]
    assert len(weights) == 2 and weights[0] == weights[1], proc.stdout
