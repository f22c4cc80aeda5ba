"""Models written the way public Keras examples write them: stock vs `tfmetal_ext.convert()` + FusedAdam.

Each model is built as its keras.io example builds it (default layer names, Sequential or Functional,
subclassed blocks, `keras.ops` between layers, activations passed as callables), scaled down so one
model measures in well under a minute on a 2-core CPU, and fed synthetic data of the example's shapes.
For each model, in one process of its own (a crash, refusal or hang is recorded, never fatal):

- ``convert_s``, ``verified``: `tfmetal_ext.convert(model)` (training form, verify=True) wall time and
  outcome; when verification fails, the model is converted again with verify=False so the rest is still
  measured (``verified`` says no, with the reason);
- ``shared_vars``: variables the converted model shares with the stock one (must be 0);
- ops per train step (post-grappler graph, `tfmetal_ext.inspect.fusion_report(...).num_ops`) of: stock
  (Keras Adam), stock + FusedAdam (the optimizer alone), converted + Keras Adam (the layers alone) and
  converted + FusedAdam (what a user gets); ``ops_ratio`` = converted+FusedAdam / stock;
- time to first step: ``model.fit`` on one batch of a freshly compiled model (trace + grappler + first
  run), stock vs the freshly converted model;
- median train-step time (``model.fit``'s own train function, paired rounds, order rotated).

Every ratio is converted / stock: below 1 is fewer ops or less time (targets: ops <= 0.7, step <= 1.0).

    .venv/bin/python benchmarks/bench_models.py [--quick] [--models mnist_convnet,vit] [--rounds N]
    .venv/bin/python benchmarks/bench_models.py --applications [--quick]   # keras.applications (bench_applications.py)
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/bench_models.py --quick   # no oneDNN (AVX2 / Mac CPU path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, _fmt, environment, paired_rounds, ratio, run_json_worker  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

import tfmetal_ext  # noqa: E402

# ----------------------------------------------------------------------------
# Models, each modeled on a keras.io example (the example's name in the docstring). Each builder returns
# a dict: model, x, y, loss, metrics. Sizes are scaled down from the examples; layer choices and the
# way the model is written are kept.


def _rng(seed=0):
    return np.random.default_rng(seed)


def mnist_convnet(batch=64):
    """keras.io "Simple MNIST convnet": Sequential, default names, one-hot targets."""
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(10, activation="softmax"),
    ])
    rng = _rng()
    x = rng.random((batch, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, batch), 10).astype("float32")
    return dict(model=model, x=x, y=y, loss="categorical_crossentropy", metrics=["accuracy"])


def xception_small(batch=8, size=64):
    """keras.io "Image classification from scratch" (make_model): a small Xception, Functional."""
    inputs = keras.Input(shape=(size, size, 3))
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(32, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for width in (64, 128, 256):
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(width, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(width, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(width, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    x = layers.SeparableConv2D(384, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1, activation=None)(x)
    model = keras.Model(inputs, outputs)
    rng = _rng()
    x = (rng.random((batch, size, size, 3)) * 255).astype("float32")
    y = rng.integers(0, 2, (batch, 1)).astype("float32")
    return dict(model=model, x=x, y=y, loss=keras.losses.BinaryCrossentropy(from_logits=True),
                metrics=[keras.metrics.BinaryAccuracy(name="acc")])


class TransformerBlock(layers.Layer):
    """Attention + feed-forward with post-norm residuals; no **kwargs, as the example writes it."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def text_transformer(batch=32, maxlen=200, vocab_size=20000):
    """keras.io "Text classification with Transformer": subclassed embedding and block."""
    embed_dim, num_heads, ff_dim = 32, 2, 32
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    rng = _rng()
    x = rng.integers(0, vocab_size, (batch, maxlen)).astype("float32")  # the example feeds padded int ids
    y = rng.integers(0, 2, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def bilstm_text(batch=16, maxlen=100, max_features=20000):
    """keras.io "Bidirectional LSTM on IMDB": variable-length int input, two Bidirectional(LSTM)."""
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(max_features, 128)(inputs)
    x = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(64))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs)
    rng = _rng()
    x = rng.integers(0, max_features, (batch, maxlen)).astype("int32")
    y = rng.integers(0, 2, (batch, 1)).astype("float32")
    return dict(model=model, x=x, y=y, loss="binary_crossentropy", metrics=["accuracy"])


def conv1d_timeseries(batch=16, length=500):
    """keras.io "Timeseries classification from scratch" (FordA): Conv1D + BN + ReLU blocks."""
    input_layer = keras.layers.Input((length, 1))
    x = input_layer
    for _ in range(3):
        x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    output_layer = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.models.Model(inputs=input_layer, outputs=output_layer)
    rng = _rng()
    x = rng.standard_normal((batch, length, 1)).astype("float32")
    y = rng.integers(0, 2, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss="sparse_categorical_crossentropy",
                metrics=["sparse_categorical_accuracy"])


class Patches(layers.Layer):
    """Image -> sequence of flattened patches (keras.ops between layers)."""

    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        shape = ops.shape(images)
        batch, height, width, channels = shape[0], shape[1], shape[2], shape[3]
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        return ops.reshape(patches, (batch, (height // self.patch_size) * (width // self.patch_size),
                                     self.patch_size * self.patch_size * channels))


class PatchEncoder(layers.Layer):
    """Linear projection of the patches plus a learned position embedding."""

    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


def _mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation=keras.activations.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


def vit_small(batch=16, image_size=32, patch_size=4, num_classes=100):
    """keras.io "Image classification with Vision Transformer" (no augmentation stage)."""
    projection_dim, num_heads, transformer_layers = 32, 2, 2
    num_patches = (image_size // patch_size) ** 2
    inputs = keras.Input(shape=(image_size, image_size, 3))
    patches = Patches(patch_size)(inputs)
    encoded = PatchEncoder(num_patches, projection_dim)(patches)
    for _ in range(transformer_layers):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention_output = layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim,
                                                     dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention_output, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = _mlp(x3, hidden_units=[projection_dim * 2, projection_dim], dropout_rate=0.1)
        encoded = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded)
    representation = layers.Flatten()(representation)
    representation = layers.Dropout(0.5)(representation)
    features = _mlp(representation, hidden_units=[128, 64], dropout_rate=0.5)
    logits = layers.Dense(num_classes)(features)
    model = keras.Model(inputs=inputs, outputs=logits)
    rng = _rng()
    x = rng.random((batch, image_size, image_size, 3)).astype("float32")
    y = rng.integers(0, num_classes, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])


def _activation_block(x):
    x = layers.Activation("gelu")(x)
    return layers.BatchNormalization()(x)


def convmixer(batch=16, image_size=32, filters=64, depth=4, kernel_size=5, patch_size=2, num_classes=10):
    """keras.io "Image classification with ConvMixer": depthwise + pointwise, GELU then BN."""
    inputs = keras.Input((image_size, image_size, 3))
    x = layers.Rescaling(scale=1.0 / 255)(inputs)
    x = layers.Conv2D(filters, kernel_size=patch_size, strides=patch_size)(x)
    x = _activation_block(x)
    for _ in range(depth):
        x0 = x
        x = layers.DepthwiseConv2D(kernel_size=kernel_size, padding="same")(x)
        x = layers.Add()([_activation_block(x), x0])
        x = layers.Conv2D(filters, kernel_size=1)(x)
        x = _activation_block(x)
    x = layers.GlobalAvgPool2D()(x)
    outputs = layers.Dense(num_classes, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    rng = _rng()
    x = (rng.random((batch, image_size, image_size, 3)) * 255).astype("float32")
    y = rng.integers(0, num_classes, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def normalized_convnet(batch=32, image_size=32):
    """A convnet on raw 0-255 pixels behind a `Normalization` layer adapted on the data
    (keras.io preprocessing-layers guide: adapt, then use it as the model's first layer)."""
    rng = _rng()
    x = (rng.random((batch, image_size, image_size, 3)) * 255).astype("float32")
    norm = layers.Normalization()
    norm.adapt(x)
    inputs = keras.Input((image_size, image_size, 3))
    h = norm(inputs)
    h = layers.Conv2D(32, 3, activation="relu")(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(64, 3, activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    outputs = layers.Dense(10)(h)
    model = keras.Model(inputs, outputs)
    y = rng.integers(0, 10, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])


class ResBlock(layers.Layer):
    """A ResNet basic block as a subclassed layer: conv-BN-relu, conv-BN, a projection shortcut when it
    strides, `keras.ops.relu` on the sum (no activation layers)."""

    def __init__(self, filters, strides=1):
        super().__init__()
        self.conv1 = layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)
        self.bn1 = layers.BatchNormalization()
        self.conv2 = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.bn2 = layers.BatchNormalization()
        self.proj = None
        if strides != 1:
            self.proj = keras.Sequential([
                layers.Conv2D(filters, 1, strides=strides, use_bias=False),
                layers.BatchNormalization(),
            ])

    def call(self, x, training=None):
        h = ops.relu(self.bn1(self.conv1(x), training=training))
        h = self.bn2(self.conv2(h), training=training)
        shortcut = self.proj(x, training=training) if self.proj is not None else x
        return ops.relu(h + shortcut)


def subclassed_resnet(batch=16, image_size=32):
    """A CIFAR-sized ResNet whose blocks are a subclassed layer (default names)."""
    inputs = keras.Input((image_size, image_size, 3))
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    for filters, strides in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
        x = ResBlock(filters, strides)(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    rng = _rng()
    x = rng.standard_normal((batch, image_size, image_size, 3)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    return dict(model=model, x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])


MODELS = {
    "mnist_convnet": mnist_convnet,
    "xception_small": xception_small,
    "text_transformer": text_transformer,
    "bilstm_text": bilstm_text,
    "conv1d_timeseries": conv1d_timeseries,
    "vit_small": vit_small,
    "convmixer": convmixer,
    "normalized_convnet": normalized_convnet,
    "subclassed_resnet": subclassed_resnet,
}


def _application(name, size=96, batch=4):
    def build():
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None)
        rng = _rng()
        x = (rng.random((batch, size, size, 3)) * 255).astype("float32")
        y = rng.integers(0, 10, batch).astype("int32")
        return dict(model=model, x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[])
    build.__doc__ = f"keras.applications.{name}(weights=None, input_shape=({size}, {size}, 3), classes=10)"
    return build


APPLICATIONS = {name: _application(name) for name in (
    "ResNet50V2", "MobileNetV3Small", "EfficientNetB0", "Xception", "ConvNeXtTiny", "DenseNet121")}


# ----------------------------------------------------------------------------
# Measurement of one model.


def fused_optimizer(multi_tensor=None):
    """The fused counterpart of Keras' Adam, with FusedAdam's own defaults unless `multi_tensor` is set."""
    kw = {} if multi_tensor is None else {"multi_tensor": multi_tensor}
    return tfmetal_ext.optimizers.FusedAdam(**kw)


def _compile(model, spec, optimizer):
    model.compile(optimizer=optimizer, loss=spec["loss"], metrics=list(spec["metrics"]))


def _first_step_s(model, spec, optimizer):
    """Compile, then one `fit` on one batch of a model that never ran a train step: trace + grappler + run."""
    _compile(model, spec, optimizer)
    start = time.perf_counter()
    model.fit(spec["x"], spec["y"], batch_size=len(spec["x"]), epochs=1, verbose=0)
    return time.perf_counter() - start


def _train_fn(model, spec):
    """The train function `fit` traced, fed the same batch forever."""
    it = iter(tf.data.Dataset.from_tensors((spec["x"], spec["y"])).repeat())
    fn = model.train_function
    return lambda: fn(it)


def train_ops(model, spec, optimizer=None, errors=None):
    """Compute ops per train step of `model` (recompiled with `optimizer` when given) and its report.

    The count is `fusion_report(...).num_ops`. Should building the report fail (the layer attribution is
    the fragile part), the nodes of the same captured step are counted directly by the report's own rule
    (`NON_COMPUTE_OPS`), the report is None, and the failure goes to `errors`.
    """
    if optimizer is not None:
        _compile(model, spec, optimizer)
    try:
        report = tfmetal_ext.inspect.fusion_report(model, inputs=spec["x"], targets=spec["y"], mode="train")
        return report.num_ops, report
    except Exception as e:
        if errors is None:
            raise
        errors["fusion_report"] = _tail(e)
    from tfmetal_ext.inspect.report import NON_COMPUTE_OPS

    cap, _, _ = tfmetal_ext.inspect.capture_step(model, spec["x"], "train", targets=spec["y"])
    return sum(n.op not in NON_COMPUTE_OPS for n in cap.nodes()), None


def _loops(report):
    """While loops in the step (grappler lowers each to one LoopCond): their bodies count once in
    `num_ops`, however many iterations run."""
    return sum(n for op, n in report.ops_by_type.items() if op in ("LoopCond", "While", "StatelessWhile"))


def _tail(exc, lines=4):
    """The last lines of an exception's traceback, for the results file."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:])


def shared_variables(a, b):
    """Number of variables model `b` holds that are the very objects model `a` holds."""
    ids = {id(v) for v in a.weights}
    return sum(id(v) in ids for v in b.weights)


def _warm_up():
    """Pays the process's one-time costs (kernel registration, the custom-op library) before timing."""
    model = keras.Sequential([keras.Input((4,)), layers.Dense(3)])
    spec = dict(x=np.zeros((2, 4), "float32"), y=np.zeros((2, 3), "float32"), loss="mse", metrics=[])
    for opt in (keras.optimizers.Adam(), fused_optimizer()):
        _compile(model, spec, opt)
        model.fit(spec["x"], spec["y"], verbose=0)


def _convert(stock, row):
    """convert() with verify; on a verification failure, again without, so the model is still measured."""
    try:
        ours = tfmetal_ext.convert(stock, count_ops=False)
        row["verified"] = "yes"
        return ours
    except Exception as e:
        row["errors"]["convert"] = _tail(e)
        if not isinstance(e, AssertionError):  # refused (or crashed): nothing to measure
            row["verified"] = f"refused ({type(e).__name__})"
            return None
        row["verified"] = f"no ({type(e).__name__})"
    try:  # VerificationError (an AssertionError): measure the unverified model all the same
        return tfmetal_ext.convert(stock, count_ops=False, verify=False)
    except Exception as e:
        row["errors"]["convert_unverified"] = _tail(e)
        return None


def _fresh_pair(builder, row, multi_tensor):
    """A fresh stock model (seeded) and its fresh conversion, each after its first `fit` step (timed)."""
    keras.utils.set_random_seed(0)
    spec = builder()
    stock = spec["model"]
    stock_s = _first_step_s(stock, spec, keras.optimizers.Adam())
    start = time.perf_counter()
    ours = _convert(stock, row)
    convert_s = time.perf_counter() - start
    ours_s = None
    if ours is not None:
        opt = fused_optimizer(multi_tensor)
        row["fused_optimizer"] = f"FusedAdam(multi_tensor={opt.multi_tensor})"
        try:
            ours_s = _first_step_s(ours, spec, opt)
        except Exception as e:
            row["errors"]["converted_fit"] = _tail(e)
            ours = None
    return spec, stock, ours, stock_s, convert_s, ours_s


def measure(name, builder, *, rounds=5, repeats=3, multi_tensor=None, split=True, time_steps=True,
            first_step_rounds=1):
    """Every figure of one model; failures of a phase go to ``row["errors"]`` and the rest goes on.

    Time to first step and convert() time are the minimum over `first_step_rounds` fresh pairs of
    models (the first pair of a process also pays one-time costs the second does not); the last
    pair is the one measured further.
    """
    row = dict(model=name, errors={}, load_before=round(os.getloadavg()[0], 2))
    firsts = {"stock_first_step_s": [], "convert_s": [], "ours_first_step_s": []}
    ours = None
    for _ in range(max(1, first_step_rounds)):
        try:
            spec, stock, ours, *secs = _fresh_pair(builder, row, multi_tensor)
        except Exception as e:
            row["errors"]["build_or_stock_fit"] = _tail(e)
            return row
        for key, sec in zip(firsts, secs):
            if sec is not None:
                firsts[key].append(sec)
    row.update({k: min(v) for k, v in firsts.items() if v})
    row.update(batch=len(spec["x"]), input="x".join(str(d) for d in np.shape(spec["x"])[1:]),
               params=int(stock.count_params()), stock_layers=len(stock.layers))
    if "ours_first_step_s" in row:
        row["first_step_ratio"] = row["ours_first_step_s"] / row["stock_first_step_s"]
    if ours is not None:
        rep = ours.conversion_report
        row.update(rewrites=len(rep.rewrites), absorbed=len(rep.absorbed), kept=len(rep.kept),
                   kept_classes=sorted({k.class_name for k in rep.kept}),
                   rewritten_to=sorted({r.new_class for r in rep.rewrites}),
                   shared_vars=shared_variables(stock, ours))

    if time_steps:
        fns = {"stock": _train_fn(stock, spec)}
        if ours is not None:
            fns["ours"] = _train_fn(ours, spec)
        try:
            times = paired_rounds(fns, rounds=rounds, repeats=repeats)
            row["stock_step_ms"] = statistics.median(times["stock"])
            if "ours" in times:
                row["ours_step_ms"] = statistics.median(times["ours"])
                row["step_ratio"] = ratio(times, "ours", "stock")
        except Exception as e:
            row["errors"]["step_time"] = _tail(e)

    try:
        row["stock_ops"], report = train_ops(stock, spec, errors=row["errors"])
        if report is not None:
            row["stock_loops"] = _loops(report)
    except Exception as e:
        row["errors"]["stock_ops"] = _tail(e)
    if ours is not None:
        try:
            row["ours_ops"], report = train_ops(ours, spec, errors=row["errors"])
            if report is not None:
                row["missed"] = sorted(r.path for r in report.layers if r.status == "missed")
                row["ours_loops"] = _loops(report)
        except Exception as e:
            row["errors"]["ours_ops"] = _tail(e)
    if split:  # what the optimizer alone and the layers alone give
        try:
            row["stock_fused_opt_ops"], _ = train_ops(stock, spec, fused_optimizer(multi_tensor), row["errors"])
        except Exception as e:
            row["errors"]["stock_fused_opt_ops"] = _tail(e)
        if ours is not None:
            try:
                row["ours_keras_adam_ops"], _ = train_ops(ours, spec, keras.optimizers.Adam(), row["errors"])
            except Exception as e:
                row["errors"]["ours_keras_adam_ops"] = _tail(e)
    for key, ops_key in (("ops_ratio", "ours_ops"), ("opt_only_ops_ratio", "stock_fused_opt_ops"),
                         ("layers_only_ops_ratio", "ours_keras_adam_ops")):
        if row.get("stock_ops") and row.get(ops_key):
            row[key] = row[ops_key] / row["stock_ops"]
    row["load_after"] = round(os.getloadavg()[0], 2)
    return row


# ----------------------------------------------------------------------------
# Driver: one subprocess per model, results written after each.


def _environment():
    return environment()


COLUMNS = ["model", "input", "batch", "params", "verified", "convert_s", "shared_vars",
           "rewrites", "kept", "stock_ops", "stock_fused_opt_ops", "ours_keras_adam_ops", "ours_ops",
           "opt_only_ops_ratio", "layers_only_ops_ratio", "ops_ratio",
           "stock_first_step_s", "ours_first_step_s", "first_step_ratio",
           "stock_step_ms", "ours_step_ms", "step_ratio"]


def _notes(args, rows):
    notes = [
        "ops = compute nodes per train step of the post-grappler graph (tfmetal_ext.inspect FusionReport.num_ops: "
        "no _Arg/_Retval/Const/NoOp/Identity); stock = Keras Adam; stock_fused_opt = stock layers + FusedAdam; "
        "ours_keras_adam = convert() + Keras Adam; ours = convert() + FusedAdam (the figure that counts)",
        "a while loop's body counts once however many iterations run (stock LSTM/GRU: the time loop), so a "
        "stock model with loops (stock_loops / ours_loops in the JSON) has more ops per step executed than counted",
        "every ratio is converted / stock: < 1 is fewer ops or less time. Targets (issue 13): ops_ratio <= 0.7, "
        "step_ratio <= 1.0 (no model slower per step)",
        "first_step = wall time of model.fit on one batch of a freshly compiled model that never ran a train step "
        "(trace + grappler + first run), the minimum over "
        f"{args.first_step_rounds} fresh stock/converted pair(s); convert_s = convert(model) with verify=True "
        "(count_ops=False), the same minimum",
        f"step = median ms of model.fit's own train function, {args.rounds} paired rounds x {args.repeats} steps, "
        "order rotated; step_ratio = median over rounds of ours / stock within the round",
        "the machine is a shared 2-core VM with other jobs running: times (step, first step, convert) are noisy, "
        "load_before/load_after in the JSON give the 1-minute load average around each model; op counts are "
        "exact and do not depend on the load",
        "verified: yes = convert(model) (verify=True) passed; no (VerificationError) = verification failed, and "
        "the model was converted again with verify=False to measure it; refused (...) = convert() raised "
        "anything else (no converted figures); errors hold the last traceback lines of any failed phase",
        "each model runs in its own process (a crash or hang is recorded and the run goes on)",
    ]
    if args.quick:
        notes.append("--quick: fewer rounds and steps; times are rough")
    failed = [r["model"] for r in rows if r.get("errors")]
    if failed:
        notes.append("phases that failed (see errors in the JSON): " + "; ".join(
            f"{r['model']}: {', '.join(r['errors'])}" for r in rows if r.get("errors")))
    notes.append("command: " + " ".join(["python", "benchmarks/" + args.script] + args.argv))
    return notes


def write(name, rows, args):
    os.makedirs(RESULTS_DIR, exist_ok=True)
    env = _environment()
    notes = _notes(args, rows)
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "rows": rows, "notes": notes}, f, indent=2, default=str)
    lines = [f"# {name}", "", "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |")
    lines += [""] + [f"- {n}" for n in notes]
    errors = [(r["model"], phase, msg) for r in rows for phase, msg in r.get("errors", {}).items()]
    if errors:
        lines += ["", "## Failures (last traceback lines)", ""]
        lines += [f"- {m} / {phase}: `{msg}`" for m, phase, msg in errors]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(text)
    chart(rows, os.path.join(RESULTS_DIR, f"{name}.png"), title=f"{name}: converted / stock "
          f"(oneDNN {'on' if env['onednn'] else 'off'}, {env['cpu']}, {env['cpu_count']} cores)")
    return text


def chart(rows, path, title=""):
    """Grouped bars per model: ops, opt-only ops, step time and first-step ratios, with the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("opt_only_ops_ratio", "ops, FusedAdam only"), ("ops_ratio", "ops, convert() + FusedAdam"),
              ("step_ratio", "step time"), ("first_step_ratio", "time to first step")]
    names = [r["model"] for r in rows]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows) + 2), 4.6))
    for i, (key, label) in enumerate(series):
        vals = [r.get(key) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, vals, width, label=label)
    for j, r in enumerate(rows):
        if not isinstance(r.get("ops_ratio"), (int, float)):
            ax.text(j, 1.0, "no conversion" if r.get("stock_ops") else "failed", ha="center", va="bottom",
                    fontsize=7, rotation=90)
    ax.set_yscale("log")
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.7, color="grey", linestyle="--", linewidth=0.8, label="ops target 0.7")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("converted / stock (log scale, lower is better)")
    ax.set_title(title, fontsize=9)
    finite = [v for key, _ in series for r in rows for v in [r.get(key)] if isinstance(v, (int, float)) and v > 0]
    ax.set_ylim(min([0.1] + [0.8 * v for v in finite]), max([10.0] + [1.25 * v for v in finite]))
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.24))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_worker(name, args, timeout):
    """Measures one model in a subprocess; a failure or timeout becomes a row with the error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name,
           "--rounds", str(args.rounds), "--repeats", str(args.repeats),
           "--first-step-rounds", str(args.first_step_rounds)]
    if args.applications:
        cmd.append("--applications")
    if args.multi_tensor != "default":
        cmd += ["--multi-tensor", args.multi_tensor]
    if args.no_split:
        cmd.append("--no-split")
    start = time.perf_counter()
    result, error = run_json_worker(cmd, timeout)
    print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    return result if error is None else dict(model=name, errors={"process": error})


def main(argv=None, script="bench_models.py"):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds x 2 steps (development)")
    parser.add_argument("--models", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--applications", action="store_true", help="keras.applications models instead")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds (default 7, quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per round (default 5, quick 2)")
    parser.add_argument("--multi-tensor", choices=("default", "on", "off"), default="default",
                        help="FusedAdam multi_tensor (default: FusedAdam's own default)")
    parser.add_argument("--first-step-rounds", type=int, default=None,
                        help="fresh model pairs for time to first step, the minimum kept (default 2; quick, apps 1)")
    parser.add_argument("--no-split", action="store_true", help="skip the optimizer-only / layers-only op counts")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per model (default 600, apps 1200)")
    parser.add_argument("--in-process", action="store_true", help="measure in this process (no subprocesses)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv, args.script = argv, script
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    table = APPLICATIONS if args.applications else MODELS
    names = args.models.split(",") if args.models else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"Unknown model(s) {unknown}; choose from {list(table)}")
    multi_tensor = {"default": None, "on": True, "off": False}[args.multi_tensor]
    if args.first_step_rounds is None:
        args.first_step_rounds = 1 if (args.quick or args.applications) else 2
    kw = dict(rounds=args.rounds, repeats=args.repeats, multi_tensor=multi_tensor, split=not args.no_split,
              first_step_rounds=args.first_step_rounds)

    if args.worker:
        _warm_up()
        row = measure(args.worker, table[args.worker], **kw)
        with open(args.out, "w") as f:
            json.dump(row, f, default=str)
        return row

    onednn = tfmetal_ext.devices.capabilities().onednn
    base = "bench_applications" if args.applications else "bench_models"
    name = base if onednn else f"{base}_no_onednn"
    if args.quick:
        name += "_quick"
    timeout = args.timeout or (1200 if args.applications else 600)
    if args.in_process:
        _warm_up()
    rows = []
    for n in names:
        rows.append(measure(n, table[n], **kw) if args.in_process else _run_worker(n, args, timeout))
        write(name, rows, args)
    print(write(name, rows, args))
    return rows


if __name__ == "__main__":
    main()
