"""Make an existing model fuse with one call: keras.applications.ResNet50 -> tfmetal_ext.convert.

Converts the stock model (verified against it: same outputs, same training gradients), prints the
conversion report with ops per train step and per inference call before and after, trains the
converted model for one epoch on random data, then folds it for deployment and saves it.

    python examples/convert_resnet.py [--size 32] [--out resnet50_deploy.keras] [--seed 0]
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
    parser.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the random data")
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(args.seed)  # the same initial weights and data every run
    stock = keras.applications.ResNet50(
        weights=None, input_shape=(args.size, args.size, 3), classes=10, classifier_activation=None)
    model = tfmetal_ext.convert(stock)  # training form: Conv2D + BatchNormalization + ReLU -> ConvBNAct
    print(model.conversion_report)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, args.size, args.size, 3)).astype("float32")
    y = rng.integers(0, 10, 8)
    # Adam keeps the first steps small. After two steps the batch norms' moving statistics are still
    # near their initial values; a large SGD step would make the inference-mode outputs (which use
    # those statistics) blow up to 1e30 or NaN, in the stock model just the same.
    model.compile(optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loss = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"][0]
    print(f"trained the converted model for one epoch: loss {loss:.3f}")

    deploy = tfmetal_ext.convert(model, inference=True, count_ops=False)  # fold every batch norm
    kinds = sorted({type(layer).__name__ for layer in deploy.layers})
    print(f"deployment form: {len(deploy.conversion_report.rewrites)} folded layers; layer types: {', '.join(kinds)}")
    out = args.out or os.path.join(tempfile.mkdtemp(), "resnet50_deploy.keras")
    deploy.save(out)
    reloaded = keras.saving.load_model(out)
    same_weights = len(deploy.weights) == len(reloaded.weights) and all(
        np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
        for a, b in zip(deploy.weights, reloaded.weights))
    want = keras.ops.convert_to_numpy(deploy(x, training=False))
    got = keras.ops.convert_to_numpy(reloaded(x, training=False))
    finite = bool(np.all(np.isfinite(want)))
    rel = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if finite else float("nan")
    print(f"deployment outputs finite: {finite}; folded vs trained max rel diff "
          f"{deploy.conversion_report.max_output_diff:.1e}")
    print(f"saved {out}; reloaded weights identical: {same_weights}; outputs max rel diff {rel:.1e}")


if __name__ == "__main__":
    main()
