import os
import subprocess
import sys

import pytest

from . import _cluster

EXAMPLE = os.path.join(_cluster.ROOT, "examples", "multi_worker.py")


@pytest.mark.slow
def test_example_launches_two_workers_that_train():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=_cluster.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, EXAMPLE, "--epochs", "1", "--timeout", "120"],
                          env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "worker 0 done" in out and "worker 1 done" in out, out[-3000:]
    assert "Epoch 2/" not in out and "16/16" in out, out[-3000:]


def test_worker_mode_needs_ports_or_tf_config():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, EXAMPLE, "--worker", "0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--ports or TF_CONFIG" in proc.stderr
