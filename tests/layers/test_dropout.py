"""FusedDropout: a drop-in for keras.layers.Dropout (same numbers from the same seed), one op each way.

Keras' own Dropout test file runs with FusedDropout swapped in under tests/keras_suite (every test
Keras' own class passes, 14 of 14); the checks here cover the same behaviours in this suite's terms
(arguments and their errors, rescaling, noise_shape, config, masking) and add what a drop-in owes:
the stock layer's exact numbers, forward and backward, from the same seed state, under each policy.
"""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import inspect
from tfmetal_ext.backends import fusion, registry
from tfmetal_ext.backends._table import Fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import FusedDropout
from tfmetal_ext.testing import run_layer_test

L = keras.layers
dropout_op_module = importlib.import_module("tfmetal_ext.ops.dropout")  # `ops.dropout` is the function


@pytest.fixture(autouse=True)
def op_row(request, table_row):
    """Every table uses the op (the real tables are tested apart, `test_every_table_uses_the_op`), so the
    tests here run the op's CPU kernel against Keras' Dropout."""
    if "cpu_tables" not in request.node.name:
        table_row("custom_dropout", Fusion("test: used", dtypes=("float32", "float16", "bfloat16")))


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def pair(rate=0.3, **kwargs):
    """A stock Dropout and a FusedDropout with the same configuration and seed state."""
    stock, ours = L.Dropout(rate, seed=1337, **kwargs), FusedDropout(rate, seed=1337, **kwargs)
    return stock, ours


def outputs_and_input_grads(layer, x, dy):
    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return y, tape.gradient(y, x, output_gradients=dy)

    return step(x, dy)


# ----------------------------------------------------------------------------
# The drop-in contract: the stock layer's numbers.


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_same_outputs_and_gradients_as_stock_dropout(policy):
    keras.mixed_precision.set_global_policy(policy)
    stock, ours = pair(0.4)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 33)), stock.compute_dtype)
    dy = tf.constant(rng.standard_normal((8, 33)), stock.compute_dtype)
    for _ in range(2):  # the seed generators advance alike
        y_s, g_s = outputs_and_input_grads(stock, x, dy)
        y_o, g_o = outputs_and_input_grads(ours, x, dy)
        assert y_o.dtype == y_s.dtype == tf.as_dtype(stock.compute_dtype)
        np.testing.assert_array_equal(bits(y_o.numpy()), bits(y_s.numpy()))
        np.testing.assert_array_equal(bits(g_o.numpy()), bits(g_s.numpy()))
    np.testing.assert_array_equal(ours.seed_generator.state.numpy(), stock.seed_generator.state.numpy())
    # eager calls too
    np.testing.assert_array_equal(bits(ours(x, training=True).numpy()), bits(stock(x, training=True).numpy()))


def test_set_random_seed_reproduces_a_run():
    def run():
        keras.utils.set_random_seed(42)
        layer = FusedDropout(0.5)  # seed=None: a seed from the global generator set_random_seed seeds
        x = tf.ones([4, 64])
        return [layer(x, training=True).numpy() for _ in range(3)]

    first, second = run(), run()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], first[1])  # a new mask per call


def test_inference_and_rate_zero_are_the_identity():
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 5)), tf.float32)
    assert FusedDropout(0.5)(x, training=False) is x
    assert FusedDropout(0.5)(x) is x
    assert FusedDropout(0.0)(x, training=True) is x


def test_rate_one_gives_zeros_as_stock():
    x = tf.ones([3, 5])
    np.testing.assert_array_equal(FusedDropout(1.0)(x, training=True).numpy(), np.zeros((3, 5)))
    assert "rate=1.0" in FusedDropout(1.0).unfused_reason


def test_rescaling():
    # Keras' test_dropout_rescaling: the kept units scale by 1 / (1 - rate), the mean stays about 1.
    y = FusedDropout(0.5, seed=1337)(np.ones((20, 500), "float32"), training=True).numpy()
    np.testing.assert_allclose(y.mean(), 1.0, atol=0.02)
    assert set(np.unique(y)) == {0.0, 2.0}


# ----------------------------------------------------------------------------
# noise_shape: the op draws the noise shape's mask, broadcast over the input as Keras broadcasts it.


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("noise_shape", [(None, 1, None), (20, 1, 10), (None, 1, 1), (1, 10)], ids=str)
def test_noise_shape_fixing_a_dimension_runs_the_op_with_the_stock_numbers(noise_shape, policy):
    keras.mixed_precision.set_global_policy(policy)
    stock, ours = pair(0.5, noise_shape=noise_shape)
    assert ours.unfused_reason is None
    rng = np.random.default_rng(8)
    x = tf.constant(rng.standard_normal((20, 5, 10)), stock.compute_dtype)
    dy = tf.constant(rng.standard_normal((20, 5, 10)), stock.compute_dtype)
    for _ in range(2):  # the seed generators advance alike
        y_o, g_o = outputs_and_input_grads(ours, x, dy)
        y_s, g_s = outputs_and_input_grads(stock, x, dy)
        np.testing.assert_array_equal(bits(y_o.numpy()), bits(y_s.numpy()))
        np.testing.assert_array_equal(bits(g_o.numpy()), bits(g_s.numpy()))
    dropped = bits(ours(x, training=True).numpy()) == 0
    assert dropped.any() and not dropped.all()
    np.testing.assert_array_equal(dropped[:, 0, :], dropped[:, 1, :])  # the mask is shared along axis 1


def test_noise_shape_step_draws_no_stock_random_ops():
    """EfficientNet's drop-connect: the op on the (batch, 1, 1, 1) noise shape, no stock random ops."""
    layer = FusedDropout(0.2, noise_shape=(None, 1, 1, 1), seed=3)
    x = tf.constant(np.random.default_rng(9).standard_normal((4, 6, 6, 8)), tf.float32)

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = layer(t, training=True)
        return y, tape.gradient(y, t)

    counts = inspect.report_from_capture(inspect.capture_function(step, x)).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1, counts
    assert not {"StatelessRandomGetKeyCounter", "StatelessRandomUniformV2"} & set(counts), counts


def test_noise_shape_of_nones_runs_the_op():
    stock, ours = pair(0.5, noise_shape=(None, None))
    assert ours.unfused_reason is None
    x = tf.constant(np.random.default_rng(2).standard_normal((6, 7)), tf.float32)
    fn = tf.function(lambda t: ours(t, training=True))
    counts = inspect.report_from_capture(inspect.capture_function(fn, x)).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1
    stock(x, training=True)  # the capture ran one step of `ours`
    np.testing.assert_array_equal(ours(x, training=True).numpy(), stock(x, training=True).numpy())


def test_float64_runs_the_stock_call():
    stock, ours = pair(0.5, dtype="float64")
    x = tf.constant(np.random.default_rng(3).standard_normal((4, 9)), tf.float64)
    np.testing.assert_array_equal(ours(x, training=True).numpy(), stock(x, training=True).numpy())
    assert "float64 input" in ours._reason(tf.float64)


# ----------------------------------------------------------------------------
# Arguments, config, serialization: Keras' checks.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rate": -0.5}, "Expected a float value between 0 and 1"),
        ({"rate": 1.5}, "Expected a float value between 0 and 1"),
        ({"rate": 0.5, "noise_shape": "bad"}, "Expected a tuple or list of integers"),
        ({"rate": 0.5, "noise_shape": (20, 1.5, 10)}, "Expected all elements to be integers or None"),
        ({"rate": 0.5, "noise_shape": (20, 0, 10)}, "Expected all dimensions to be positive integers or None"),
        ({"rate": 0.5, "noise_shape": (20, -1, 10)}, "Expected all dimensions to be positive integers or None"),
    ],
)
def test_bad_arguments_raise_as_stock(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedDropout(**kwargs)
    with pytest.raises(ValueError, match=message):
        L.Dropout(**kwargs)


def test_noise_shape_normalized_as_stock():
    assert FusedDropout(0.5, noise_shape=[20, 1, 10]).noise_shape == (20, 1, 10)
    assert FusedDropout(0.5).noise_shape is None


def test_config_is_stocks():
    stock, ours = pair(0.25, noise_shape=(None, 4), name="drop")
    assert ours.get_config() == stock.get_config()
    assert FusedDropout.from_config(stock.get_config()).get_config() == stock.get_config()


def test_keras_layer_checks():
    layer = run_layer_test(FusedDropout, {"rate": 0.2}, input_shape=(2, 3), expected_output_shape=(2, 3),
                           expected_num_trainable_weights=0)
    assert len(layer._seed_generators) == 1 and layer.supports_masking


def test_keras_save_load_keeps_the_class(tmp_path):
    inp = keras.Input((6,))
    model = keras.Model(inp, L.Dense(2)(FusedDropout(0.3, seed=5, name="drop")(inp)))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.get_layer("drop")) is FusedDropout and loaded.get_layer("drop").rate == 0.3


def test_masking_passes_through():
    inp = keras.Input((4, 3))
    masked = L.Masking(0.0)(inp)
    out = FusedDropout(0.5)(masked)
    assert out._keras_mask is not None


# ----------------------------------------------------------------------------
# The graph: one op each way in a real train step; the catalog knows it.


def test_train_step_is_one_op_each_way():
    model = keras.Sequential([keras.Input((16,)), L.Dense(16, name="d"), FusedDropout(0.5, name="drop"), L.Dense(1)])
    report = inspect.fusion_report(model, mode="train", optimizer="sgd", loss="mse")
    assert report.ops_by_type.get(fusion.DROPOUT_OP) == 1
    assert report.ops_by_type.get(fusion.DROPOUT_GRAD_OP) == 1
    assert "StatelessRandomUniformV2" not in report.ops_by_type and "SelectV2" not in report.ops_by_type
    stock = keras.Sequential([keras.Input((16,)), L.Dense(16), L.Dropout(0.5), L.Dense(1)])
    stock_report = inspect.fusion_report(stock, mode="train", optimizer="sgd", loss="mse")
    assert stock_report.ops_by_type.get("StatelessRandomUniformV2") == 1
    assert report.num_ops < stock_report.num_ops


@pytest.mark.parametrize("predict_for", ["tensorflow-metal-plugin", "tensorflow-metal"])
def test_predicted_on_metal_without_the_stock_seeds_round_trip(predict_for):
    # Stock Dropout on Metal: StatelessRandomGetKeyCounter keeps the seed in host memory (the backend's kernel
    # or ours), so the seed is copied to the host every step. FusedDropout's kernel reads it on the device.
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(6)
    x, y = rng.random((4, 8), dtype=np.float32), np.zeros((4, 3), np.float32)
    reports = {}
    for cls in (L.Dropout, FusedDropout):
        model = keras.Sequential([keras.Input((8,)), L.Dense(16), cls(0.2, name="drop"), L.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        reports[cls] = inspect.placement_report(model, x, targets=y, mode="train", predict_for=predict_for)
    stock, ours = reports[L.Dropout], reports[FusedDropout]
    assert [t.consumer for t in stock.transfers if t.layer == "drop"] == ["StatelessRandomGetKeyCounter"]
    assert not [t for t in ours.transfers if t.layer == "drop"]
    assert not [e for e in ours.missing if e.layer == "drop" and e.op.startswith(fusion.CUSTOM_OP_PREFIX)]
    assert ours.transfer_count == stock.transfer_count - 1


def test_catalog_rule():
    ctx = catalog.FusionContext()
    layer = FusedDropout(0.5)
    assert catalog.expectation(layer, ctx) is None  # predict mode: the identity
    train = catalog.FusionContext(mode="train")
    assert catalog.expectation(layer, train).op == fusion.DROPOUT_OP
    assert catalog.expectation(FusedDropout(0.5, noise_shape=(None, 1)), train).op == fusion.DROPOUT_OP
    all_dropped = catalog.expectation(FusedDropout(1.0), train)
    assert all_dropped.op is None and "rate=1.0" in all_dropped.reason
    assert catalog.expectation(FusedDropout(0.0), train) is None


def test_avoid_fusions_runs_the_reference_with_the_same_numbers():
    stock, ours = pair(0.5)
    x = tf.constant(np.random.default_rng(4).standard_normal((5, 11)), tf.float32)
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["dropout"])
        fn = tf.function(lambda t: ours(t, training=True))
        counts = inspect.report_from_capture(inspect.capture_function(fn, x)).ops_by_type
        assert fusion.DROPOUT_OP not in counts and counts.get("StatelessRandomUniformV2") == 1
        exp = catalog.expectation(ours, catalog.FusionContext(mode="train"))
        assert exp.op is None and "avoid_fusions=['dropout']" in exp.reason
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    # the capture drew one seed from `ours`: draw one from `stock` too, then compare
    stock(x, training=True)
    np.testing.assert_array_equal(ours(x, training=True).numpy(), stock(x, training=True).numpy())


def test_fit_matches_stock():
    def model(dropout):
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((8,)), L.Dense(16, activation="relu"), dropout(0.3, seed=9),
                                 L.Dense(1)])

    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((32, 8)).astype("float32"), rng.standard_normal((32, 1)).astype("float32")
    histories = []
    for cls in (L.Dropout, FusedDropout):
        m = model(cls)
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        histories.append((m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"],
                          [w.numpy() for w in m.weights]))
    assert histories[0][0] == histories[1][0]
    for a, b in zip(histories[0][1], histories[1][1]):
        np.testing.assert_array_equal(a, b)


def test_cpu_tables_use_the_op():
    """Every real table uses the op: both Metal tables (the stock random ops have no kernel there) and
    both CPU tables (the op's CPU kernel measured faster than Keras' dropout, bench_ops' dropout
    section). On a CPU the layer's graph is the op each way, with Keras' Dropout's numbers bit for bit."""
    from tfmetal_ext import backends
    from tfmetal_ext.layers.dropout import table_reason

    for key in ("cpu_onednn", "cpu", "metal", "metal_plugin"):
        assert registry.TABLES[key].fusion("custom_dropout").fuses, key
        assert table_reason("float32", registry.TABLES[key]) is None, key
    if backends.current().key not in ("cpu_onednn", "cpu"):
        pytest.skip(f"this process's backend is {backends.current().key}, not a CPU table")
    if not dropout_op_module.uses_kernel():
        pytest.skip("the op library is not in use here: the layer runs the pure-TF reference")
    stock, ours = pair(0.5)
    assert ours.unfused_reason is None
    x = tf.constant(np.random.default_rng(3).normal(size=(4, 32)), tf.float32)
    dy = tf.constant(np.random.default_rng(4).normal(size=(4, 32)), tf.float32)
    y_ref, dx_ref = outputs_and_input_grads(stock, x, dy)
    y, dx = outputs_and_input_grads(ours, x, dy)
    np.testing.assert_array_equal(bits(y), bits(y_ref))
    np.testing.assert_array_equal(bits(dx), bits(dx_ref))
    counts = inspect.report_from_capture(
        inspect.capture_function(lambda t: ours(t, training=True), x)).ops_by_type
    assert counts.get(fusion.DROPOUT_OP) == 1 and "StatelessRandomUniformV2" not in counts
