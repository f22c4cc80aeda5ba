"""Worker 1 of a 2-worker MWMS run is SIGKILLed mid-epoch; both are restarted,
training resumes from keras.callbacks.BackupAndRestore and ends where an
uninterrupted run ends (issue 15 scale-out, fault test)."""

import json
import os
import signal
import time

import numpy as np
import pytest

from . import _cluster

WORKER = os.path.join(os.path.dirname(__file__), "_mwms_fault_worker.py")
KILL_AT = 12  # steps: epoch 2 (0-based) of 4 x 5 steps, after its 2nd step


def _load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _runs(outs):
    return [json.loads(l[4:]) for o in outs for l in o.splitlines() if l.startswith("RUN ")]


@pytest.mark.slow
def test_killed_worker_resumes_from_backup(tmp_path):
    out = str(tmp_path)
    # Uninterrupted reference: one process, same global batches, same backup callback.
    ref = [_cluster.start_single(WORKER, [out, "ref"])]
    first = _cluster.cluster(WORKER, [out, "multi", str(KILL_AT)])
    try:
        deadline = time.monotonic() + 120
        marker = os.path.join(out, "marker")
        while not os.path.exists(marker):
            first.poll()  # relaunches on new ports if a worker could not bind its port
            assert all(p.poll() is None for p in first.procs), "a worker exited before the kill: " + first.output(0)[-2000:]
            assert time.monotonic() < deadline, "worker 1 never reached the kill step"
            time.sleep(0.2)
        first.procs[1].send_signal(signal.SIGKILL)
        first.procs[1].wait(timeout=30)
        assert first.procs[1].returncode == -signal.SIGKILL
    finally:
        first.stop()  # worker 0 is blocked in a collective: stop it too
    for i in range(2):  # each worker kept the backup of the last finished epoch
        with open(os.path.join(out, f"backup_multi_{i}", "training_metadata.json")) as f:
            assert json.load(f)["epoch"] == 2

    codes, outs = _cluster.cluster(WORKER, [out, "multi"]).wait(timeout=150)
    ref_codes, ref_outs = _cluster.run_all(ref, timeout=150)
    codes, outs = codes + ref_codes, outs + ref_outs
    for code, text in zip(codes, outs):
        assert code == 0, text[-3000:]
    runs = {r["task"]: r for r in _runs(outs[:2])}
    for i in range(2):  # resumed at epoch 2: ran 2 epochs of 5 steps, not 4
        assert runs[i]["epochs"] == [2, 3] and runs[i]["steps"] == 10, runs
    assert _runs(outs[2:]) == [{"task": 0, "epochs": [0, 1, 2, 3], "steps": 20}]

    want = _load(os.path.join(out, "ref_0.npz"))
    for i in range(2):
        for got, w in zip(_load(os.path.join(out, f"multi_{i}.npz")), want):
            np.testing.assert_allclose(got, w, rtol=0, atol=1e-5)
