"""convert() inside a `tf.distribute` strategy's scope, as a model built for MirroredStrategy is.

A subprocess: two logical CPUs must be configured before TensorFlow starts.
"""

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras

import tfmetal_ext

keras.utils.set_random_seed(0)
strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
rng = np.random.default_rng(0)
x = rng.standard_normal((16, 6, 8)).astype("float32")
y = rng.integers(0, 4, 16)
with strategy.scope():
    inp = keras.Input((6, 8))
    g, u = keras.layers.Dense(16)(inp), keras.layers.Dense(16)(inp)
    h = keras.layers.Dense(8)(keras.activations.silu(g) * u)
    stock = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h)))
    ours = tfmetal_ext.convert(stock, inputs=x[:4])
    ours.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
report = ours.conversion_report
assert report.verified, report
assert all(strategy.extended.variable_created_in_scope(w.value) for w in ours.weights)
loss = ours.fit(x, y, batch_size=8, epochs=1, verbose=0).history["loss"][0]
assert np.isfinite(loss)
print("OK verified", report.verified)
"""


@pytest.mark.slow
def test_convert_inside_a_mirrored_strategy_scope_verifies(tmp_path):
    """Verification's gradient pass reads the converted model's distributed variables in a replica's
    context (outside one, TF refuses: "DistributedVariable.handle is not available outside the replica
    context"), and the converted model then trains under the strategy."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK verified True" in out.stdout
