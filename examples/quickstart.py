"""Quickstart: configure precision, train a small conv net on scikit-learn's digits, print what fused.

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


def build_model():
    inputs = keras.Input((8, 8, 1), name="digits")
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(64, activation="relu", name="fc")(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


def main():
    config = tfmetal_ext.configure()
    print(config)
    (x_train, y_train), (x_test, y_test) = load_data()
    model = build_model()
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **config.compile_kwargs(),
    )
    model.fit(x_train, y_train, batch_size=64, epochs=2, verbose=2)
    loss, acc = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy after 2 epochs: {acc:.3f}")

    report = tfmetal_ext.inspect.fusion_report(model, x_train[:64], mode="train", targets=y_train[:64])
    print(report)
    print(tfmetal_ext.inspect.placement_report(model, x_train[:64], mode="train", targets=y_train[:64]))


if __name__ == "__main__":
    main()
