"""The loopback launcher the multi-worker tests and examples/multi_worker.py share: a port taken between
finding it free and the worker binding it relaunches the cluster on new ports instead of failing the run."""

import socket
import sys

import pytest

from . import _cluster

pytestmark = pytest.mark.no_keras

# A stand-in worker: binds its port as TF's gRPC server does, and fails with TF's message when it cannot.
_WORKER = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "try:\n"
    "    s.bind(('0.0.0.0', int(sys.argv[1])))\n"
    "except OSError:\n"
    "    print('E grpc_server_lib.cc] UNKNOWN: Could not start gRPC server', flush=True)\n"
    "    sys.exit(1)\n"
    "print('bound', sys.argv[1])\n"
)


def _argv(i, ports):
    return [sys.executable, "-c", _WORKER, str(ports[i])]


def test_a_worker_that_cannot_bind_its_port_is_relaunched_on_new_ports(monkeypatch):
    example = _cluster._EXAMPLE
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))  # another process holds this port when the worker starts
    taken.listen()
    real_free_ports = example.free_ports
    handed_out = []

    def free_ports(n):
        ports = real_free_ports(n)
        if not handed_out:
            ports[0] = taken.getsockname()[1]
        handed_out.append(ports)
        return ports

    monkeypatch.setattr(example, "free_ports", free_ports)
    try:
        cluster = example.Cluster(_argv, 2).start()
        codes, outs = cluster.wait(timeout=60)
    finally:
        taken.close()
    assert codes == [0, 0], outs
    assert cluster.launches == 2 and len(handed_out) == 2
    assert all(f"bound {p}" in out for p, out in zip(handed_out[1], outs))


def test_a_port_that_stays_taken_ends_with_the_reason(monkeypatch):
    example = _cluster._EXAMPLE
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    monkeypatch.setattr(example, "free_ports", lambda n: [taken.getsockname()[1]] * n)
    try:
        with pytest.raises(RuntimeError, match="could not bind their ports in 3 launches"):
            example.Cluster(_argv, 2).start().wait(timeout=60)
    finally:
        taken.close()
