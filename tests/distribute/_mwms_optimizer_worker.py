"""One process of the optimizer-equivalence test (see test_optimizers.py).

usage: _mwms_optimizer_worker.py OUTDIR TAG   (TF_CONFIG set -> 2-worker MWMS,
unset -> one process, no strategy, on the whole global batch).
Trains the same tfmetal-ext model once per optimizer for STEPS steps and
writes OUTDIR/TAG_<optimizer>.npz with the final weights.
"""

import os
import sys

import numpy as np
import tensorflow as tf
import keras

import tfmetal_ext.layers as L
import tfmetal_ext.optimizers as O
from tfmetal_ext.distribute import fit_compat

STEPS = 20
GLOBAL_BATCH = 16
OPTIMIZERS = {
    "adam": lambda: O.FusedAdam(learning_rate=0.01, multi_tensor=False),  # the per-variable form
    "adam_mt": lambda: O.FusedAdam(learning_rate=0.01, multi_tensor=True),
    "sgd_momentum": lambda: O.FusedSGD(learning_rate=0.05, momentum=0.9),
}


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, 6, 6, 2)).astype("float32")
    y = rng.standard_normal((STEPS * GLOBAL_BATCH, 2)).astype("float32")
    return x, y


def build_model():
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        L.FusedConv2D(3, 3, activation="relu"),
        keras.layers.Flatten(),
        L.FusedDense(4, activation="tanh"),
        L.FusedDense(2),
    ])
    # Same initial weights in every process, independent of seeds/strategy.
    rng = np.random.default_rng(0)
    model.set_weights([0.3 * rng.standard_normal(w.shape).astype("float32") for w in model.get_weights()])
    return model


def worker_rows(n_workers, index, steps=STEPS):
    # Worker i takes the i-th contiguous slice of each global batch.
    per = GLOBAL_BATCH // n_workers
    idx = np.arange(steps * GLOBAL_BATCH).reshape(steps, n_workers, per)
    return idx[:, index, :].reshape(-1), per


def strategy_and_data(x, y, steps):
    """(strategy, dataset, task index): under TF_CONFIG a 2-worker MWMS where
    worker i reads its half of each global batch (no auto-sharding); else one
    process on the whole global batch."""
    if "TF_CONFIG" not in os.environ:
        return tf.distribute.get_strategy(), tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def dataset_fn(ctx):
        rows, per = worker_rows(ctx.num_input_pipelines, ctx.input_pipeline_id, steps)
        ds = tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(per)
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(opts)

    return strategy, strategy.distribute_datasets_from_function(dataset_fn), strategy.cluster_resolver.task_id


def main(outdir, tag):
    x, y = data()
    multi = "TF_CONFIG" in os.environ
    strategy, dataset, task = strategy_and_data(x, y, STEPS)

    for name, make in OPTIMIZERS.items():
        with strategy.scope():
            model = build_model()
            model.compile(make(), "mse", jit_compile=False)
        with fit_compat(strategy):
            hist = model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
        assert len(hist.history["loss"]) == 1
        np.savez(os.path.join(outdir, f"{tag}_{name}_{task}.npz"), *model.get_weights())
        print("DONE", name, task, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
