"""Make an existing model fuse with one call: keras.applications.ResNet50 -> tfmetal_ext.convert.

Converts the stock model (verified against it: same outputs, same training gradients), prints the
conversion report with ops per train step and per inference call before and after, trains the
converted model for one epoch on random data, then folds it for deployment and saves it.

    python examples/convert_resnet.py [--size 32] [--out resnet50_deploy.keras]
"""

import argparse
import os
import tempfile

import keras
import numpy as np

import tfmetal_ext


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--out", default=None, help="where to save the deployment model (default: a temp dir)")
    args = parser.parse_args(argv)

    stock = keras.applications.ResNet50(
        weights=None, input_shape=(args.size, args.size, 3), classes=10, classifier_activation=None)
    model = tfmetal_ext.convert(stock)  # training form: Conv2D + BatchNormalization + ReLU -> ConvBNAct
    print(model.conversion_report)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, args.size, args.size, 3)).astype("float32")
    y = rng.integers(0, 10, 8)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loss = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"][0]
    print(f"trained the converted model for one epoch: loss {loss:.3f}")

    deploy = tfmetal_ext.convert(model, inference=True, count_ops=False)  # fold every batch norm
    kinds = sorted({type(layer).__name__ for layer in deploy.layers})
    print(f"deployment form: {len(deploy.conversion_report.rewrites)} folded layers; layer types: {', '.join(kinds)}")
    out = args.out or os.path.join(tempfile.mkdtemp(), "resnet50_deploy.keras")
    deploy.save(out)
    reloaded = keras.saving.load_model(out)
    same = np.array_equal(keras.ops.convert_to_numpy(deploy(x, training=False)),
                          keras.ops.convert_to_numpy(reloaded(x, training=False)))
    print(f"saved {out}; reloaded outputs identical: {same}")


if __name__ == "__main__":
    main()
