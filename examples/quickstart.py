"""Quickstart: configure precision, train a small conv net built from tfmetal_ext layers on
scikit-learn's digits with the MetalCallback (which inspects the real train step and prints what
fused, what fell back to the CPU and the step time), and compare ops per step with the same net in
stock Keras.

Run with `make demo` (or `python examples/quickstart.py` inside the venv).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfmetal_ext  # noqa: E402


def load_data():
    digits = load_digits()  # 1797 8x8 grey images shipped with scikit-learn: no download
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model(stock=False):
    """The demo net from tfmetal_ext's fusion-first layers (or, with stock=True, from stock Keras layers)."""
    L = tfmetal_ext.layers
    inputs = keras.Input((8, 8, 1), name="digits")
    if stock:
        x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
        x = keras.layers.BatchNormalization(momentum=0.9, name="stem_bn")(x)
        x = keras.layers.ReLU(name="stem_relu")(x)
        y = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="conv1")(x)
        y = keras.layers.BatchNormalization(momentum=0.9, name="bn1")(y)
        y = keras.layers.ReLU(name="relu1")(y)
        y = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="conv2")(y)
        y = keras.layers.BatchNormalization(momentum=0.9, name="bn2")(y)
        x = keras.layers.ReLU(name="res_relu")(keras.layers.Add(name="res_add")([y, x]))
    else:
        # Short training: momentum 0.9 lets the moving statistics settle within two epochs.
        x = L.ConvBNAct(32, 3, momentum=0.9, name="stem")(inputs)  # conv -> FusedBatchNormV3 -> relu
        x = L.ResidualBlock(32, momentum=0.9, name="block")(x)  # ResNet basic block, add + relu at the tail
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = (keras.layers.Dense if stock else L.FusedDense)(64, activation="relu", name="fc")(x)
    outputs = (keras.layers.Dense if stock else L.FusedDense)(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_stock" if stock else "digits_fused")


def train(model, config, data):
    """Trains with the MetalCallback; returns (test accuracy, the callback, the History)."""
    (x_train, y_train), (x_test, y_test) = data
    model.compile(
        optimizer=tfmetal_ext.optimizers.FusedAdam(),  # one fused update op per variable
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **config.compile_kwargs(),
    )
    # Prints its summary after the first step: checks, ops per step, fused/unfused layers, CPU fallback.
    callback = tfmetal_ext.callbacks.MetalCallback()
    history = model.fit(x_train, y_train, batch_size=64, epochs=2, verbose=2, callbacks=[callback])
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    return acc, callback, history


def main():
    config = tfmetal_ext.configure()
    print(config)
    data = load_data()
    model = build_model()
    acc, callback, history = train(model, config, data)
    print(f"test accuracy after 2 epochs: {acc:.3f}")
    print(
        f"median step time {history.history['step_time_ms'][-1]:.2f} ms, "
        f"{history.history['examples_per_second'][-1]:.0f} examples/s (last epoch, from the callback's logs)"
    )

    # The callback's full reports of the step fit ran.
    report = callback.fusion_report
    print(report)
    print(callback.placement_report)

    (x_train, y_train), _ = data
    batch = dict(inputs=x_train[:64], mode="train", targets=y_train[:64])

    # The same network from stock Keras layers, for comparison (not trained).
    stock = build_model(stock=True)
    stock.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stock_report = tfmetal_ext.inspect.fusion_report(stock, **batch)
    print(
        f"ops per train step: stock Keras {stock_report.num_ops}, tfmetal_ext {report.num_ops} "
        f"({report.num_ops / stock_report.num_ops:.0%}); fused nodes: stock {len(stock_report.fused)}, "
        f"tfmetal_ext {len(report.fused)}"
    )


if __name__ == "__main__":
    main()
