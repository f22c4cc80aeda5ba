"""One process of the worker-kill resume test (see test_fault.py).

usage: _mwms_fault_worker.py OUTDIR TAG [KILL_AT_STEP]
TF_CONFIG set -> 2-worker MWMS, unset -> one process, no strategy.  Trains
EPOCHS epochs of STEPS_PER_EPOCH steps (the same batches every epoch) with
keras.callbacks.BackupAndRestore(save_freq="epoch") in OUTDIR/backup_<task>.
With KILL_AT_STEP, worker 1 writes OUTDIR/marker after that many steps of
this run and waits to be SIGKILLed by the test.
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
import keras

import tfmetal_ext.optimizers as O
from tfmetal_ext.distribute import fit_compat
from _mwms_optimizer_worker import GLOBAL_BATCH, build_model, data, strategy_and_data

EPOCHS = 4
STEPS_PER_EPOCH = 5


class Marker(keras.callbacks.Callback):
    def __init__(self, outdir, task, kill_at):
        super().__init__()
        self.outdir, self.task, self.kill_at = outdir, task, kill_at
        self.steps, self.epochs = 0, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.kill_at is not None and self.task == 1 and self.steps == self.kill_at:
            with open(os.path.join(self.outdir, "marker"), "w") as f:
                f.write(str(self.steps))
            time.sleep(300)  # the test SIGKILLs us here


def main(outdir, tag, kill_at=None):
    x, y = data()
    x, y = x[: STEPS_PER_EPOCH * GLOBAL_BATCH], y[: STEPS_PER_EPOCH * GLOBAL_BATCH]
    strategy, dataset, task = strategy_and_data(x, y, STEPS_PER_EPOCH)

    with strategy.scope():
        model = build_model()
        model.compile(O.FusedAdam(learning_rate=0.01), "mse", jit_compile=False)
        model.optimizer.build(model.trainable_variables)
    # One backup dir per worker: the mirrored weights are the same, and two
    # processes never write one file.
    backup = keras.callbacks.BackupAndRestore(os.path.join(outdir, f"backup_{tag}_{task}"), save_freq="epoch")
    marker = Marker(outdir, task, kill_at)
    with fit_compat(strategy):
        model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[backup, marker])
    print("RUN", json.dumps({"task": task, "epochs": marker.epochs, "steps": marker.steps}), flush=True)
    np.savez(os.path.join(outdir, f"{tag}_{task}.npz"), *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
