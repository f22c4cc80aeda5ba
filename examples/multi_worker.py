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


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(n, timeout, epochs):
    ports = ",".join(str(p) for p in free_ports(n))
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--ports", ports,
                          "--epochs", str(epochs)])
        for i in range(n)
    ]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(abs(p.returncode or 0) for p in procs)


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
