"""tfmetal_ext.keras_forms: Keras' argmax / argmin with the -0.0 test in float, the same indices as Keras'.

The reference is Keras' own function (kept by the module) on inputs built to hit every case of its
flush-to-zero guard, and numpy where the expected index follows from the guard's rule by hand.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import inspect, keras_forms

knp = keras.src.backend.tensorflow.numpy
DTYPES = ["float32", "float16", "bfloat16", "float64"]
TINY32 = np.finfo(np.float32).tiny


def _cases(dtype):
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, TINY32 / 4, -TINY32 / 4, np.inf, -np.inf, np.nan, 1.0, -1.0], np.float32)
    rows = [
        [-0.0, 0.0],  # +0 wins argmax, -0 wins argmin (Keras' rule)
        [0.0, -0.0],
        [-0.0, -0.0, -1.0],
        [-TINY32 / 4, 0.0, -0.0],  # a negative subnormal (kept as itself on a CPU)
        [np.nan, 1.0, -0.0],
        [-np.inf, -0.0, -np.inf],
    ]
    width = max(map(len, rows))
    ragged = np.full((len(rows), width), -np.inf, np.float32)
    for i, r in enumerate(rows):
        ragged[i, :len(r)] = r
    mixed = rng.choice(special, size=(7, 11)).astype(np.float32)
    return [tf.cast(tf.constant(a), dtype) for a in (ragged, mixed, rng.standard_normal((3, 4, 5)).astype("float32"))]


@pytest.mark.parametrize("name", keras_forms.FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_same_indices_as_keras(name, dtype, traced):
    assert keras_forms.installed()
    ours, theirs = getattr(knp, name), keras_forms.original(name)
    assert ours is not theirs
    for x in _cases(dtype):
        for axis in (None, 0, -1):
            for keepdims in (False, True):
                call = lambda fn, t: fn(t, axis=axis, keepdims=keepdims)  # noqa: E731
                if traced:
                    got = tf.function(lambda t: call(ours, t))(x)
                    want = tf.function(lambda t: call(theirs, t))(x)
                else:
                    got, want = call(ours, x), call(theirs, x)
                assert got.dtype == want.dtype == tf.int32
                np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"{x} axis={axis}")


def test_negative_zero_ranks_below_positive_zero_by_hand():
    x = tf.constant([[-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0]])
    np.testing.assert_array_equal(keras.ops.argmax(x, axis=-1).numpy(), [1, 0, 0])
    np.testing.assert_array_equal(keras.ops.argmin(x, axis=-1).numpy(), [0, 1, 0])


def test_integer_and_scalar_inputs_run_keras_own_path():
    x = tf.constant([[3, -1, 7], [0, 0, -5]])
    np.testing.assert_array_equal(keras.ops.argmax(x, axis=1).numpy(), [2, 0])
    assert int(keras.ops.argmax(tf.constant(-0.0))) == 0


def _ops(fn, x):
    graph = tf.function(fn).get_concrete_function(x).graph
    return {op.type for op in graph.get_operations()}


def test_the_graph_has_no_int32_sign_test():
    x = tf.ones([4, 10])
    ours = _ops(lambda t: knp.argmax(t, axis=-1), x)
    theirs = _ops(lambda t: keras_forms.original("argmax")(t, axis=-1), x)
    assert {"Bitcast", "BitwiseAnd"} <= theirs
    assert not {"Bitcast", "BitwiseAnd"} & ours and "Reciprocal" in ours
    metric = keras.metrics.SparseCategoricalAccuracy()
    assert not {"Bitcast", "BitwiseAnd"} & _ops(lambda t: metric.update_state(tf.zeros([4]), t), x)


def test_predicted_accuracy_step_on_apple_has_no_sign_test_transfers():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = np.ones((4, 8), "float32"), np.zeros((4,), "int32")
    r = inspect.placement_report(model, x, targets=y, mode="train", predict_for="tensorflow-metal")
    assert not [t for t in r.transfers if {t.producer, t.consumer} & {"Bitcast", "BitwiseAnd", "LogicalAnd"}], \
        r.transfers
    keras_forms.uninstall()
    try:
        stock = inspect.placement_report(model, x, targets=y, mode="train", predict_for="tensorflow-metal")
        assert [t for t in stock.transfers if t.producer == "Bitcast"], stock.transfers
    finally:
        keras_forms.install()
    assert keras_forms.installed()


def test_uninstall_restores_keras_and_install_is_idempotent():
    keras_forms.uninstall()
    try:
        assert not keras_forms.installed()
        assert knp.argmax is keras_forms.original("argmax")
    finally:
        assert keras_forms.install() and keras_forms.install()
    assert knp.argmax is not keras_forms.original("argmax")


def test_a_keras_whose_argmax_differs_is_left_alone():
    class Other:
        _keepdims = staticmethod(lambda *a: None)

        @staticmethod
        def argmax(x, axis=None, keepdims=False):
            return x

        argmin = argmax

    saved = dict(keras_forms._original)
    keras_forms._original.clear()
    try:
        assert not keras_forms.keras_forms_match(Other)
    finally:
        keras_forms._original.update(saved)


@pytest.mark.parametrize("value", ["0", "false", "no"])
def test_environment_switch_keeps_keras_own(monkeypatch, value):
    # The import calls install(), which reads the variable: with it off, install() leaves Keras' functions.
    keras_forms.uninstall()
    try:
        monkeypatch.setenv("TFMETAL_EXT_KERAS_FORMS", value)
        assert keras_forms.install() is False
        assert not keras_forms.installed() and knp.argmax is keras_forms.original("argmax")
        monkeypatch.setenv("TFMETAL_EXT_KERAS_FORMS", "1")
    finally:
        keras_forms.install()
    assert keras_forms.installed()


def test_accuracy_metric_and_fit_are_unchanged():
    # The metric's value from the installed form equals Keras' own, on logits with signed-zero ties.
    y_pred = tf.constant([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0], [0.5, 2.0, 2.0]])
    y_true = tf.constant([1, 0, 1])
    got = keras.metrics.sparse_categorical_accuracy(y_true, y_pred).numpy()
    keras_forms.uninstall()
    try:
        want = keras.metrics.sparse_categorical_accuracy(y_true, y_pred).numpy()
    finally:
        keras_forms.install()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [1.0, 1.0, 1.0])
    assert tfmetal_ext.keras_forms is keras_forms
