"""Launch a loopback MultiWorkerMirroredStrategy cluster of subprocesses."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _example():
    """examples/multi_worker.py, whose loopback launcher these tests share."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tfmetal_ext_example_multi_worker",
                                                  os.path.join(ROOT, "examples", "multi_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _example()
free_ports = _EXAMPLE.free_ports


def worker_env(ports, index, **extra):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = dict(
        os.environ,
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def cluster(script, args, n=2, **extra):
    """`n` MWMS workers running `script args` on loopback ports, started; relaunched on new ports when one
    could not bind its port (examples/multi_worker.py's `Cluster`)."""
    return _EXAMPLE.Cluster(lambda i, ports: [sys.executable, script, *args], n,
                            env_for=lambda i, ports: worker_env(ports, i, **extra)).start()


def start_single(script, args, **extra):
    """One process of `script args` with no cluster (no TF_CONFIG)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("TF_CONFIG", None)
    return subprocess.Popen([sys.executable, script, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_all(procs, timeout):
    """Waits for every process; kills stragglers; returns (returncodes, outputs)."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs
