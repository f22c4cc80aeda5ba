"""FusedEmbedding: a drop-in for keras.layers.Embedding whose index arithmetic stays in device memory.

Keras' own Embedding test file runs with FusedEmbedding swapped in under tests/keras_suite. The checks
here hold the stock layer's numbers as the reference (outputs, gradients, errors, masks, LoRA, quantized
and ragged paths, training), and check the graph: the indices are wrapped in int64, so a Metal GPU
keeps them in device memory (TensorFlow keeps int32 in host memory on a GPU).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext.layers import FusedEmbedding
from tfmetal_ext.testing import run_layer_test

L = keras.layers
IDS = np.array([[0, 1, 19, -1, -20, 7], [3, 3, -3, 18, 0, -19]])


def pair(input_dim=20, output_dim=6, **kwargs):
    """A stock Embedding and a FusedEmbedding with the same configuration and weights."""
    stock, ours = L.Embedding(input_dim, output_dim, **kwargs), FusedEmbedding(input_dim, output_dim, **kwargs)
    stock.build()
    ours.build()
    ours.set_weights(stock.get_weights())
    return stock, ours


def output_and_grad(layer, ids, dy):
    @tf.function
    def step(ids, dy):
        with tf.GradientTape() as tape:
            y = layer(ids)
        grads = tape.gradient(y, layer.trainable_variables, output_gradients=dy)
        return y, [tf.convert_to_tensor(g) for g in grads]

    return step(ids, dy)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64", "float32"])
def test_same_outputs_and_gradients_as_stock(policy, ids_dtype):
    keras.mixed_precision.set_global_policy(policy)
    stock, ours = pair()
    ids = tf.constant(IDS.astype(ids_dtype))
    dy = tf.constant(np.random.default_rng(0).standard_normal(IDS.shape + (6,)), stock.compute_dtype)
    y_s, g_s = output_and_grad(stock, ids, dy)
    y_o, g_o = output_and_grad(ours, ids, dy)
    assert y_o.dtype == y_s.dtype == tf.as_dtype(stock.compute_dtype)
    np.testing.assert_array_equal(y_o.numpy(), y_s.numpy())
    assert len(g_o) == len(g_s) == 1
    np.testing.assert_array_equal(g_o[0].numpy(), g_s[0].numpy())
    # An independent reference: numpy's take with Keras' wrap of negative indices.
    table = np.asarray(ours.embeddings)
    np.testing.assert_array_equal(y_o.numpy(), table[np.where(IDS < 0, IDS + 20, IDS)].astype(y_o.dtype.as_numpy_dtype))


def test_fractional_float_ids_truncate_as_stock():
    stock, ours = pair()
    ids = np.array([[1.9, -0.5, -1.5, 18.99]], "float32")
    np.testing.assert_array_equal(np.asarray(ours(ids)), np.asarray(stock(ids)))


@pytest.mark.parametrize("bad", [20, -21, 2 ** 40])
def test_out_of_range_index_is_tensorflows_error_as_stock(bad):
    stock, ours = pair()
    ids = np.array([[1, bad]], "int64")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is not in \[0, 20\)"):
        stock(ids)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is not in \[0, 20\)"):
        ours(ids)


def test_mask_zero_as_stock():
    stock, ours = pair(mask_zero=True)
    ids = np.array([[0, 4, 0, 2]])
    np.testing.assert_array_equal(np.asarray(ours.compute_mask(ids)), np.asarray(stock.compute_mask(ids)))
    assert ours.supports_masking
    inp = keras.Input((4,), dtype="int32")
    model = keras.Model(inp, L.LSTM(3)(FusedEmbedding(20, 6, mask_zero=True)(inp)))
    assert model(ids).shape == (1, 3)


def test_lora_as_stock():
    stock, ours = pair()
    for layer in (stock, ours):
        layer.enable_lora(2)
    ours.set_weights(stock.get_weights())
    stock.lora_embeddings_b.assign(np.random.default_rng(1).standard_normal((2, 6)).astype("float32"))
    ours.lora_embeddings_b.assign(stock.lora_embeddings_b.value)
    dy = tf.ones(IDS.shape + (6,))
    (y_s, g_s), (y_o, g_o) = output_and_grad(stock, tf.constant(IDS), dy), output_and_grad(ours, tf.constant(IDS), dy)
    np.testing.assert_array_equal(y_o.numpy(), y_s.numpy())
    assert len(g_o) == len(g_s) == 2
    for a, b in zip(g_o, g_s):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_runs_stocks_call(mode):
    stock, ours = pair()
    stock.quantize(mode)
    ours.quantize(mode)
    assert ours.quantization_mode == mode
    np.testing.assert_array_equal(np.asarray(ours(IDS)), np.asarray(stock(IDS)))


def test_model_quantize_takes_it_and_refuses_a_subclass_as_keras_does():
    inp = keras.Input((6,), dtype="int32")
    model = keras.Model(inp, FusedEmbedding(20, 4, name="emb")(inp))
    model.quantize("int8")
    assert model.get_layer("emb").quantization_mode == "int8"

    class Mine(FusedEmbedding):
        pass

    mine = Mine(20, 4)
    mine.build()
    with pytest.raises(NotImplementedError):
        mine.quantize("int8")
    # convert() gives a subclassed model's sublayer the stock class name (an alias of this class): it takes it.
    from tfmetal_ext import _saved_names

    aliased = _saved_names.saved_as(FusedEmbedding(20, 4), "Embedding")
    aliased.build()
    aliased.quantize("int8")
    assert type(aliased).__name__ == "Embedding" and aliased.quantization_mode == "int8"


def test_ragged_ids_run_stocks_call():
    stock, ours = pair()
    ids = tf.ragged.constant([[1, -1], [4, 5, 6]])
    np.testing.assert_array_equal(ours(ids).flat_values.numpy(), stock(ids).flat_values.numpy())


def test_bad_arguments_raise_as_stock():
    for kwargs, message in (({"input_dim": 0, "output_dim": 3}, "input_dim"),
                            ({"input_dim": 3, "output_dim": -1}, "output_dim")):
        with pytest.raises(ValueError, match=message):
            FusedEmbedding(**kwargs)
        with pytest.raises(ValueError, match=message):
            L.Embedding(**kwargs)


def test_config_is_stocks():
    stock, ours = pair(mask_zero=True, name="emb")
    assert ours.get_config() == stock.get_config()
    assert FusedEmbedding.from_config(stock.get_config()).get_config() == stock.get_config()


def test_keras_layer_checks():
    run_layer_test(FusedEmbedding, {"input_dim": 10, "output_dim": 4}, input_shape=(2, 3),
                   expected_output_shape=(2, 3, 4), expected_num_trainable_weights=1)


def test_keras_save_load_keeps_the_class(tmp_path):
    inp = keras.Input((6,), dtype="int32")
    model = keras.Model(inp, L.Dense(2)(FusedEmbedding(20, 4, name="emb")(inp)))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.get_layer("emb")) is FusedEmbedding
    np.testing.assert_array_equal(np.asarray(loaded(IDS)), np.asarray(model(IDS)))


def _ops(layer, ids):
    """(op, index dtype) of the traced lookup's nodes."""
    graph = tf.function(layer).get_concrete_function(tf.TensorSpec(ids.shape, ids.dtype)).graph
    return [(op.type, op.outputs[0].dtype.name if op.outputs else None) for op in graph.get_operations()]


def test_index_arithmetic_is_int64():
    stock, ours = pair()
    ids = tf.constant(IDS, tf.int32)
    stock_ops, our_ops = _ops(stock, ids), _ops(ours, ids)
    assert ("SelectV2", "int32") in stock_ops  # Keras' wrap, on int32
    int_ops = {(op, dtype) for op, dtype in our_ops if op in ("Less", "AddV2", "Mul", "SelectV2", "Cast")}
    assert not [t for t in int_ops if t[1] == "int32"], our_ops
    assert ("AddV2", "int64") in int_ops and ("SelectV2", "int64") not in int_ops
    graph = tf.function(ours).get_concrete_function(tf.TensorSpec(ids.shape, ids.dtype)).graph
    gathers = [op for op in graph.get_operations() if op.type == "GatherV2"]
    assert [g.get_attr("Tindices") for g in gathers] == [tf.int64]


def _text_model(embedding_cls):
    ids = keras.Input((6,), dtype="int32")
    x = embedding_cls(20, 8, name="emb")(ids)
    model = keras.Model(ids, L.Dense(3, name="head")(L.GlobalAveragePooling1D()(x)))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("predict_for", ["tensorflow-metal", "tensorflow-metal-plugin"])
def test_predicted_on_metal_the_indices_stay_on_the_device(predict_for):
    keras.mixed_precision.set_global_policy("mixed_float16")  # what configure() picks on Metal
    x, y = IDS.astype("int32"), np.zeros((2, 3), "float32")
    reports = {cls: inspect.placement_report(_text_model(cls), x, targets=y, mode="train", predict_for=predict_for)
               for cls in (L.Embedding, FusedEmbedding)}
    stock, ours = reports[L.Embedding], reports[FusedEmbedding]
    assert [t for t in stock.transfers if t.layer == "emb"], stock.transfers  # the int32 wrap crosses
    assert not [t for t in ours.transfers if t.layer == "emb"], ours.transfers
    # What int32 is left in the layer is shape arithmetic (the gradient's dense shape), host to host.
    assert {e.op for e in ours.int32_host if e.layer == "emb"} <= {"StridedSlice", "Shape", "Pack"}, ours.int32_host
    assert not [e for e in ours.missing if e.layer == "emb"], ours.missing


# Keras' Adam on the int64 IndexedSlices: full tier; the quick tier trains the same gradient with FusedAdam.
@pytest.mark.parametrize("optimizer", [pytest.param("adam", marks=pytest.mark.full), "fused_adam"])
def test_fit_matches_stock(optimizer):
    make = {"adam": lambda: keras.optimizers.Adam(0.01),
            "fused_adam": lambda: tfmetal_ext.optimizers.FusedAdam(0.01)}[optimizer]
    models = []
    for cls in (L.Embedding, FusedEmbedding):
        keras.utils.set_random_seed(3)
        ids = keras.Input((6,), dtype="int32")
        model = keras.Model(ids, L.Dense(3)(L.GlobalAveragePooling1D()(cls(20, 8)(ids))))
        model.compile(optimizer=make(), loss="mse")
        models.append(model)
    models[1].set_weights(models[0].get_weights())
    rng = np.random.default_rng(4)
    x, y = rng.integers(-20, 20, (16, 6)), rng.standard_normal((16, 3)).astype("float32")
    for model in models:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_array_equal(a, b)
