"""Train a tfmetal-ext model on two workers with MultiWorkerMirroredStrategy.

On one machine (two processes on 127.0.0.1, free ports picked for you):

    python examples/multi_worker.py

Each process is a worker; this launcher starts them, waits (bounded by
--timeout) and prints their output.  To run one worker yourself, give its
index and the ports of the whole cluster:

    python examples/multi_worker.py --worker 0 --ports 12345,12346
    python examples/multi_worker.py --worker 1 --ports 12345,12346

Across machines: set TF_CONFIG on every machine instead of --ports, with the
same "cluster" list everywhere and that machine's own index, e.g. on host B

    TF_CONFIG='{"cluster": {"worker": ["hostA:12345", "hostB:12345"]},
                "task": {"type": "worker", "index": 1}}' \\
        python examples/multi_worker.py --worker 1

Start every worker (training begins once all have connected); the ports must
be reachable between the hosts.  The gRPC channel is not encrypted or
authenticated: use it on a trusted network only.  Every worker runs the same
script; worker 0 is the chief.  `fit_compat()` makes `model.fit` work under
this strategy on Keras 3.15 (see tfmetal_ext/distribute.py).
"""

import argparse
import json
import os
import socket
import subprocess
import sys

GLOBAL_BATCH = 32


# What TF prints when its gRPC server cannot bind the worker's port.
BIND_FAILURE = "Could not start gRPC server"


def free_ports(n):
    """`n` ports free right now on every interface (TF's gRPC server binds 0.0.0.0:<port>)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """Worker processes on loopback ports, relaunched on new ports when one could not bind its port.

    A port found free is released before the worker binds it, seconds later
    once TensorFlow is imported, and another process can take it meanwhile.
    The worker then fails with "Could not start gRPC server" while the
    others wait for it; the cluster is stopped and started again on fresh
    ports (at most `attempts` times). Each worker's output goes to a file.

    Args:
        argv_for: ``argv_for(index, ports)`` -> the worker's command line.
        n: the number of workers.
        env_for: ``env_for(index, ports)`` -> its environment (default: this one).
        attempts: launches at most, bind failures included.
    """

    def __init__(self, argv_for, n, env_for=None, attempts=3):
        self.argv_for, self.n, self.env_for, self.attempts = argv_for, n, env_for, attempts
        self.procs, self.files, self.launches = [], [], 0

    def start(self):
        import tempfile

        self.stop()
        ports = free_ports(self.n)
        self.launches += 1
        self.files = [tempfile.TemporaryFile("w+") for _ in range(self.n)]
        self.procs = [
            subprocess.Popen(self.argv_for(i, ports), env=self.env_for(i, ports) if self.env_for else None,
                             stdout=f, stderr=subprocess.STDOUT, text=True)
            for i, f in enumerate(self.files)
        ]
        return self

    def output(self, i):
        f = self.files[i]
        f.flush()
        f.seek(0)
        return f.read()

    def bind_failed(self):
        return any(p.poll() not in (None, 0) and BIND_FAILURE in self.output(i) for i, p in enumerate(self.procs))

    def poll(self):
        """True while a worker runs; relaunches the cluster after a bind failure (RuntimeError past `attempts`)."""
        if self.bind_failed():
            if self.launches >= self.attempts:
                raise RuntimeError(f"workers could not bind their ports in {self.launches} launches:\n"
                                   + self.output(0)[-2000:])
            self.start()
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout):
        """Waits for every worker (relaunching after a bind failure); returns (returncodes, outputs)."""
        import time

        deadline = time.monotonic() + timeout
        try:
            while self.poll():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            self.stop()
        return [p.returncode for p in self.procs], [self.output(i) for i in range(len(self.procs))]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def launch(n, timeout, epochs):
    cluster = Cluster(lambda i, ports: [sys.executable, __file__, "--worker", str(i),
                                        "--ports", ",".join(map(str, ports)), "--epochs", str(epochs)], n).start()
    codes, outputs = cluster.wait(timeout)
    for i, text in enumerate(outputs):
        print(f"----- worker {i} -----\n{text}", end="" if text.endswith("\n") else "\n")
    return max(abs(c if c is not None else 1) for c in codes)


def train(index, ports, epochs):
    if ports:
        workers = [f"127.0.0.1:{p}" for p in ports.split(",")]
        os.environ["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        )
    import numpy as np
    import tensorflow as tf
    import keras

    import tfmetal_ext.layers as L
    import tfmetal_ext.optimizers as O
    from tfmetal_ext.distribute import fit_compat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("float32")

    def dataset_fn(ctx):
        # Each worker reads its own shard and batches per replica.
        per_replica = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_replica).repeat()

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            L.FusedConv2D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            L.FusedDense(1, activation="sigmoid"),
        ])
        model.compile(O.FusedAdam(1e-2, multi_tensor=True), "binary_crossentropy", metrics=["accuracy"])
    with fit_compat(strategy):
        model.fit(dataset, epochs=epochs, steps_per_epoch=len(x) // GLOBAL_BATCH,
                  shuffle=False, verbose=2 if index == 0 else 0)
    print(f"worker {index} done", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, help="run as this worker (default: launch 2 on 127.0.0.1)")
    parser.add_argument("--ports", help="comma-separated ports of all workers on 127.0.0.1")
    parser.add_argument("--workers", type=int, default=2, help="workers to launch (launcher mode)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for the workers")
    args = parser.parse_args(argv)
    if args.worker is None:
        return launch(args.workers, args.timeout, args.epochs)
    if args.ports is None and "TF_CONFIG" not in os.environ:
        parser.error("--worker needs --ports or TF_CONFIG")
    train(args.worker, args.ports, args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
