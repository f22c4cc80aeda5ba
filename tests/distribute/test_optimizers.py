"""2 MWMS workers on loopback train a model of our layers with our optimizers
and end where one process on the same global batch ends (issue 15 scale-out)."""

import os

import numpy as np
import pytest

from . import _cluster

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "_mwms_optimizer_worker.py")
OPTIMIZERS = ["adam", "adam_mt", "sgd_momentum"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mwms_opt"))
    single = _cluster.start_single(WORKER, [out, "single"])
    codes, outs = _cluster.cluster(WORKER, [out, "multi"]).wait(timeout=150)
    single_codes, single_outs = _cluster.run_all([single], timeout=150)
    codes, outs = codes + single_codes, outs + single_outs
    for code, text in zip(codes, outs):
        assert code == 0, text[-3000:]
    return out


def _load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


# Full tier: one cluster run of three optimizers (20 s). In the quick tier the multi-worker path is
# test_fit_compat.py's two-worker fit, and the fused optimizers across replicas are
# tests/optimizers/test_optimizers.py::test_multi_tensor_mirrored_strategy_two_cpus.
@pytest.mark.full
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_two_workers_match_one_process(runs, opt):
    single = _load(os.path.join(runs, f"single_{opt}_0.npz"))
    w0 = _load(os.path.join(runs, f"multi_{opt}_0.npz"))
    w1 = _load(os.path.join(runs, f"multi_{opt}_1.npz"))
    # Initial weights are 0.3 * N(0, 1) from default_rng(0): training moved them.
    rng = np.random.default_rng(0)
    init = [0.3 * rng.standard_normal(w.shape).astype("float32") for w in single]
    assert max(np.abs(a - b).max() for a, b in zip(single, init)) > 1e-2
    for a, b, c in zip(single, w0, w1):
        np.testing.assert_array_equal(b, c)  # mirrored variables agree exactly
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
