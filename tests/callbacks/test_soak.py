"""Soak: 3,000 train steps with MetalCallback; the host RSS must not keep growing."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import layers as L
from tfmetal_ext.callbacks import MetalCallback

STEPS_PER_EPOCH, EPOCHS, BATCH = 300, 10, 8
WARM_UP_EPOCHS = 2  # tracing, the first step's inspection and allocator pools settle by then
MAX_GROWTH = 0.05


def _net():
    inputs = keras.Input((8, 8, 3))
    x = L.ConvBNAct(8, 3, padding="same", name="stem")(inputs)
    x = L.ConvBNAct(8, 3, name="block")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    outputs = L.FusedDense(4, name="logits")(x)
    return keras.Model(inputs, outputs, name="soak")


@pytest.mark.slow
def test_host_rss_stays_flat_over_3000_steps(record_property):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, size=(64,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    model = _net()
    model.compile(
        optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        data, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, verbose=0, shuffle=False,
        callbacks=[MetalCallback(report=None)],
    )
    rss = history.history["memory_mb"]
    assert len(rss) == EPOCHS
    start, end = rss[WARM_UP_EPOCHS - 1], rss[-1]
    growth = (end - start) / start
    figures = (
        f"host RSS after epoch {WARM_UP_EPOCHS}: {start:.1f} MB, after epoch {EPOCHS}: {end:.1f} MB, "
        f"growth {growth * 100:.2f}% over {(EPOCHS - WARM_UP_EPOCHS) * STEPS_PER_EPOCH} steps "
        f"(all epochs: {', '.join(f'{v:.1f}' for v in rss)})"
    )
    record_property("rss_start_mb", round(start, 1))
    record_property("rss_end_mb", round(end, 1))
    record_property("rss_growth_percent", round(growth * 100, 2))
    print(figures)
    assert growth <= MAX_GROWTH, figures
