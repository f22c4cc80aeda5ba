"""tfmetal_ext.losses.FusedSparseCategoricalCrossentropy: Keras' SparseCategoricalCrossentropy's
results through the custom op where Keras' backend runs TensorFlow's op, Keras' own function
elsewhere; config, saving, convert() and to_stock()."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfmetal_ext
from tfmetal_ext import losses
from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import sparse_xent

Fused = losses.FusedSparseCategoricalCrossentropy


@pytest.fixture(autouse=True)
def _kernel():
    if not sparse_xent.uses_kernel():
        pytest.skip("the op library is not loaded here (TFMETAL_EXT_REFERENCE_OPS or no compiler)")


def data(batch=6, seq=None, classes=11, seed=0):
    rng = np.random.default_rng(seed)
    shape = (batch,) if seq is None else (batch, seq)
    logits = (rng.normal(size=shape + (classes,)) * 3).astype("float32")
    labels = rng.integers(0, classes, shape).astype("int32")
    weights = rng.uniform(0.0, 1.0, shape).astype("float32")
    return labels, logits, weights


def op_types(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph.as_graph_def()
    return [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]


# float32 losses of order 1-10 over at most 11 classes: the op's bound (tests/ops/test_sparse_xent.py)
# is a few float32 roundoffs of the loss; 1e-6 relative with 1e-6 absolute covers it with room.
RTOL = ATOL = 1e-6


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", None, "mean", "mean_with_sample_weight"])
@pytest.mark.parametrize("seq", [None, 5])
def test_from_logits_matches_keras(reduction, seq):
    labels, logits, weights = data(seq=seq)
    ours, stock = Fused(from_logits=True, reduction=reduction), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction)
    np.testing.assert_allclose(ours(labels, logits, sample_weight=weights), stock(labels, logits, sample_weight=weights),
                               rtol=RTOL, atol=ATOL)
    types = op_types(lambda y, p: ours(y, p), tf.constant(labels), tf.constant(logits))
    assert fusion.SPARSE_XENT_OP in types and "SparseSoftmaxCrossEntropyWithLogits" not in types


def test_labels_with_a_trailing_one_and_float_labels():
    labels, logits, _ = data()
    want = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    ours = Fused(from_logits=True)
    np.testing.assert_allclose(ours(labels[:, None], logits), want, rtol=RTOL)
    np.testing.assert_allclose(ours(labels.astype("float32"), logits), want, rtol=RTOL)


def test_softmax_output_runs_the_op_on_its_logits():
    """from_logits=False on a softmax output: Keras' backend finds the logits under the Softmax op and
    runs TensorFlow's op on them; ours finds them the same way and runs the custom op."""
    labels, logits, _ = data()
    ours, stock = Fused(), keras.losses.SparseCategoricalCrossentropy()

    def through_softmax(loss):
        return lambda y, p: loss(y, tf.nn.softmax(p))

    types = op_types(through_softmax(ours), tf.constant(labels), tf.constant(logits))
    assert fusion.SPARSE_XENT_OP in types and "SparseSoftmaxCrossEntropyWithLogits" not in types
    assert "SparseSoftmaxCrossEntropyWithLogits" in op_types(through_softmax(stock), tf.constant(labels),
                                                            tf.constant(logits))
    a = tf.function(through_softmax(ours))(labels, logits)
    b = tf.function(through_softmax(stock))(labels, logits)
    np.testing.assert_allclose(a, b, rtol=RTOL)


@pytest.mark.parametrize("kwargs, args", [
    (dict(), "probabilities"),                     # not a softmax's output: Keras' clipped log
    (dict(from_logits=True, ignore_class=3), "logits"),
])
def test_elsewhere_keras_own_function_runs(kwargs, args):
    labels, logits, _ = data()
    probs = tf.nn.softmax(logits).numpy()
    x = {"probabilities": probs, "logits": logits}[args]
    if args == "logits" and "ignore_class" in kwargs:
        labels = labels.copy()
        labels[:2] = 3
    ours, stock = Fused(**kwargs), keras.losses.SparseCategoricalCrossentropy(**kwargs)
    np.testing.assert_array_equal(ours(labels, x), stock(labels, x))  # the same ops: the same bits
    types = op_types(lambda y, p: ours(y, p), tf.constant(labels), tf.constant(x))
    assert fusion.SPARSE_XENT_OP not in types


def test_reasons_name_what_keeps_keras_function():
    y, p = tf.constant([0]), tf.constant([[0.0, 1.0]])
    assert losses.fused_reason(y, p, from_logits=True) is None
    assert "ignore_class" in losses.fused_reason(y, p, from_logits=True, ignore_class=0)
    assert "float64" in losses.fused_reason(y, tf.cast(p, tf.float64), from_logits=True)
    assert "class axis is 0" in losses.fused_reason(y, p, from_logits=True, axis=0)


@pytest.mark.parametrize("kwargs, labels_shape, match", [
    (dict(from_logits=True), (3, 2), "must have rank"),
    (dict(from_logits=True, axis=0), (6,), "Only axis=-1 is currently supported"),
])
def test_argument_errors_are_keras(kwargs, labels_shape, match):
    labels, logits, _ = data()
    for loss in (Fused(**kwargs), keras.losses.SparseCategoricalCrossentropy(**kwargs)):
        with pytest.raises(ValueError, match=match):
            loss(labels.reshape(labels_shape), logits)


def test_config_and_saving(tmp_path):
    loss = Fused(from_logits=True, ignore_class=-1, reduction="sum", name="xent")
    config = loss.get_config()
    assert config == keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1, reduction="sum",
                                                                name="xent").get_config()
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert type(again) is Fused and again.get_config() == config
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=Fused(from_logits=True))
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.loss) is Fused and loaded.loss.from_logits


def test_fit_matches_stock_and_runs_one_op_each_way():
    labels, logits, _ = data(batch=32, classes=7)
    x = np.random.default_rng(1).normal(size=(32, 5)).astype("float32")
    histories = {}
    for name, loss in (("stock", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
                       ("ours", Fused(from_logits=True))):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        model = keras.Model(inputs, keras.layers.Dense(7)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        histories[name] = model.fit(x, labels, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
        if name == "ours":
            from tfmetal_ext.inspect import capture

            types = [n.op for n in capture.trace_train(model, x[:8], labels[:8]).nodes()]
            assert types.count(fusion.SPARSE_XENT_OP) == 1 and types.count(fusion.SPARSE_XENT_GRAD_OP) == 1
            assert "SparseSoftmaxCrossEntropyWithLogits" not in types
    np.testing.assert_allclose(histories["ours"], histories["stock"], rtol=1e-5)


def test_convert_compiles_with_the_fused_loss_and_to_stock_maps_it_back():
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    assert type(new.loss) is Fused and new.loss.reduction == "sum" and new.loss.from_logits
    assert any("FusedSparseCategoricalCrossentropy" in n for n in new.conversion_report.notes)
    back = tfmetal_ext.to_stock(new)
    assert type(back.loss) is keras.losses.SparseCategoricalCrossentropy and back.loss.reduction == "sum"


def test_convert_maps_losses_per_output():
    inputs = keras.Input((6,))
    a, b = keras.layers.Dense(4, name="a")(inputs), keras.layers.Dense(2, name="b")(inputs)
    model = keras.Model(inputs, {"a": a, "b": b})
    model.compile(optimizer="sgd", loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                         "b": keras.losses.MeanSquaredError()})
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    assert type(new.loss["a"]) is Fused and type(new.loss["b"]) is keras.losses.MeanSquaredError


def test_mixed_precision_logits():
    """Under mixed_float16 a Dense head's float16 logits are what Keras hands the loss (cast to the
    loss's float32 dtype): both classes give the same loss."""
    labels, logits, _ = data()
    half = tf.cast(logits, tf.float16)
    ours, stock = Fused(from_logits=True), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    np.testing.assert_allclose(ours(labels, half), stock(labels, half), rtol=RTOL)


def test_convert_maps_the_string_name_with_keras_defaults():
    """``loss="sparse_categorical_crossentropy"`` (keras.io's classifiers, a softmax output): Keras'
    defaults (from_logits=False); the fused class runs its op on the softmax's logits, and fit gives
    the stock model's losses."""
    x = np.random.default_rng(2).normal(size=(32, 6)).astype("float32")
    y = np.random.default_rng(3).integers(0, 4, 32)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(keras.layers.Dense(8)(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    new = tfmetal_ext.convert(model, verify=False, count_ops=False)
    assert type(new.loss) is Fused and not new.loss.from_logits
    from tfmetal_ext.inspect import capture

    types = [n.op for n in capture.trace_train(new, x[:8], y[:8]).nodes()]
    assert fusion.SPARSE_XENT_OP in types and "SparseSoftmaxCrossEntropyWithLogits" not in types
    a = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
    b = new.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
