"""One worker of the minimal repro: stock `Sequential([Dense(3)])` with "adam"
under a 2-worker MultiWorkerMirroredStrategy (TF_CONFIG from the test). Stock
Keras 3.15 fails in `fit` here; under `fit_compat` it trains. Prints the
final weights for the test to compare across workers."""

import keras
import numpy as np
import tensorflow as tf

from tfmetal_ext.distribute import fit_compat

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile("adam", "mse")
x, y = np.ones((16, 4), "float32"), np.ones((16, 3), "float32")
with fit_compat(strategy):
    model.fit(x, y, batch_size=8, epochs=1, verbose=2)
print("WEIGHTS", np.concatenate([w.ravel() for w in model.get_weights()]).round(6).tolist())
