"""Sparse gradients (`tf.IndexedSlices`, an Embedding's) with repeated rows, in every update form.

Keras' TF backend squares each slice of a sparse gradient before the slices
of a repeated row add up: Adam's and RMSprop's velocity and Adagrad's
accumulator gain the sum of the squares, where a dense op would add the
square of the sum. The fused optimizers whose Keras update squares the
gradient hand such a variable to the Keras class's own ``update_step``
(`FusedUpdateMixin.keras_sparse_reason`); everything else stays fused.

References: the Keras class in the same process (the sparse variable
bitwise, the dense ones to float rounding), and for Adam and Adagrad a
float64 numpy model of that rule written from Keras' update math, so the
rule itself is pinned, not only agreement with Keras.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.optimizers import FusedAdagrad, FusedAdam, FusedAdamW, FusedLion, FusedRMSprop, FusedSGD

PLUGIN = "tensorflow-metal-plugin"
ROWS = [1, 4, 1, 1, 0]  # row 1 three times
SHAPE = (6, 3)

KERAS = {
    FusedAdam: keras.optimizers.Adam,
    FusedAdamW: keras.optimizers.AdamW,
    FusedRMSprop: keras.optimizers.RMSprop,
    FusedAdagrad: keras.optimizers.Adagrad,
    FusedSGD: keras.optimizers.SGD,
    FusedLion: keras.optimizers.Lion,
}


def _steps(n=3):
    rng = np.random.default_rng(7)
    return [
        (rng.standard_normal((len(ROWS), SHAPE[1])).astype("float32"), rng.standard_normal(5).astype("float32"))
        for _ in range(n)
    ]


def _run(opt, steps, initial):
    """Applies `steps` (sparse table values, dense bias gradient) in one tf.function; the two variables."""
    table = keras.Variable(initial[0], name="table")
    bias = keras.Variable(initial[1], name="bias")
    opt.build([table, bias])

    @tf.function
    def step(values, dense):
        sparse = tf.IndexedSlices(values, tf.constant(ROWS), tf.constant(SHAPE))
        opt.apply([sparse, dense], [table, bias])

    for values, dense in steps:
        step(tf.constant(values), tf.constant(dense))
    return table.numpy(), bias.numpy(), step.get_concrete_function(tf.constant(steps[0][0]),
                                                                   tf.constant(steps[0][1]))


def _initial():
    rng = np.random.default_rng(3)
    return rng.standard_normal(SHAPE).astype("float32"), rng.standard_normal(5).astype("float32")


def _graph_ops(concrete):
    types = set()
    for op in concrete.graph.get_operations():
        types.add(op.type)
    for f in concrete.graph._functions.values():  # the bodies of nested functions (conds)
        for node in f.definition.node_def:
            types.add(node.op)
    return types


def _np_keras_sparse_adam(initial, steps, lr, b1=0.9, b2=0.999, eps=1e-7):
    """Keras 3's Adam on IndexedSlices, float64: m from the summed rows, v from the summed squares."""
    var = initial.astype(np.float64)
    m = np.zeros_like(var)
    v = np.zeros_like(var)
    for t, (values, _) in enumerate(steps, start=1):
        g = np.zeros_like(var)
        g2 = np.zeros_like(var)
        np.add.at(g, ROWS, values.astype(np.float64))
        np.add.at(g2, ROWS, values.astype(np.float64) ** 2)
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m += (g - m) * (1 - b1)
        v += (g2 - v) * (1 - b2)
        var -= m * alpha / (np.sqrt(v) + eps)
    return var


def _np_keras_sparse_adagrad(initial, steps, lr, acc0=0.1, eps=1e-7):
    var = initial.astype(np.float64)
    acc = np.full_like(var, acc0)
    for values, _ in steps:
        g = np.zeros_like(var)
        g2 = np.zeros_like(var)
        np.add.at(g, ROWS, values.astype(np.float64))
        np.add.at(g2, ROWS, values.astype(np.float64) ** 2)
        acc += g2
        var -= lr * g / np.sqrt(acc + eps)
    return var


CASES = [
    pytest.param(FusedAdam, {"learning_rate": 0.05, "multi_tensor": False}, "ResourceApplyAdam", id="adam"),
    pytest.param(FusedAdam, {"learning_rate": 0.05, "multi_tensor": True}, "TfmetalExt>MultiTensorAdam",
                 id="adam_multi_tensor"),
    pytest.param(FusedAdamW, {"learning_rate": 0.05, "weight_decay": 0.1, "multi_tensor": True},
                 "TfmetalExt>MultiTensorAdam", id="adamw_multi_tensor"),
    pytest.param(FusedAdamW, {"learning_rate": 0.05, "weight_decay": 0.1, "amsgrad": True, "multi_tensor": False},
                 "ResourceApplyAdamWithAmsgrad", id="adamw_amsgrad"),
    pytest.param(FusedRMSprop, {"learning_rate": 0.01, "multi_tensor": True}, "TfmetalExt>MultiTensorRMSprop",
                 id="rmsprop_multi_tensor"),
    pytest.param(FusedRMSprop, {"learning_rate": 0.01, "multi_tensor": False}, "ResourceApplyRMSProp",
                 id="rmsprop"),
    pytest.param(FusedRMSprop, {"learning_rate": 0.01, "momentum": 0.5, "centered": True, "multi_tensor": False},
                 "ResourceApplyCenteredRMSProp", id="rmsprop_centered_momentum"),
    pytest.param(FusedAdagrad, {"learning_rate": 0.1}, "ResourceApplyAdagradV2", id="adagrad"),
]


def _needs_op_library(fused_op):
    if fused_op.startswith("TfmetalExt>"):
        from tfmetal_ext.ops import _common

        if _common.library() is None or _common.use_reference():
            pytest.skip("the multi-tensor op needs the op library (not built here, or TFMETAL_EXT_REFERENCE_OPS=1)")


@pytest.mark.every_case  # each case is another update form
@pytest.mark.parametrize("cls, kwargs, fused_op", CASES)
def test_repeated_rows_update_as_keras_does(cls, kwargs, fused_op):
    _needs_op_library(fused_op)
    steps, initial = _steps(), _initial()
    ours = cls(**kwargs)
    table, bias, concrete = _run(ours, steps, initial)
    keras_kwargs = {k: v for k, v in kwargs.items() if k != "multi_tensor"}
    want_table, want_bias, _ = _run(KERAS[cls](**keras_kwargs), steps, initial)
    # The table took Keras' own update: the same graph, the same bits.
    np.testing.assert_array_equal(table, want_table)
    # The dense variable kept the fused form, which follows Keras to float rounding.
    np.testing.assert_allclose(bias, want_bias, rtol=2e-6, atol=1e-7)
    assert fused_op in _graph_ops(concrete)
    assert "IndexedSlices" in ours.keras_sparse_reason(tf.IndexedSlices(tf.ones((1, 3)), tf.constant([0])))
    assert np.abs(table[ROWS] - initial[0][ROWS]).min() > 1e-4  # every given row moved


def test_adam_repeated_rows_follow_the_sum_of_squares():
    # An independent model of Keras' rule (float64 numpy): v gains the sum of the squared slices.
    steps, initial = _steps(4), _initial()
    table, _, _ = _run(FusedAdam(0.05), steps, initial)
    np.testing.assert_allclose(table, _np_keras_sparse_adam(initial[0], steps, 0.05), rtol=2e-6, atol=2e-6)
    # The square of the sum (the dense rule) is measurably elsewhere on the repeated row.
    dense_rule = keras.Variable(initial[0])
    opt = keras.optimizers.Adam(0.05)
    for values, _ in steps:
        opt.apply([tf.convert_to_tensor(tf.IndexedSlices(tf.constant(values), tf.constant(ROWS),
                                                         tf.constant(SHAPE)))], [dense_rule])
    assert np.abs(dense_rule.numpy()[1] - table[1]).max() > 1e-3


def test_adagrad_repeated_rows_follow_the_sum_of_squares():
    steps, initial = _steps(4), _initial()
    table, _, _ = _run(FusedAdagrad(0.1), steps, initial)
    np.testing.assert_allclose(table, _np_keras_sparse_adagrad(initial[0], steps, 0.1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cls, kwargs", [
    pytest.param(FusedSGD, {"learning_rate": 0.1}, id="sgd"),
    pytest.param(FusedSGD, {"learning_rate": 0.1, "momentum": 0.9}, id="sgd_momentum"),
    pytest.param(FusedLion, {"learning_rate": 0.01}, id="lion"),
])
def test_linear_updates_stay_fused_on_sparse_gradients(cls, kwargs):
    # SGD and Lion are linear in the gradient (Lion before its sign): summing the rows first is Keras'
    # result, so no Keras fallback is taken.
    steps, initial = _steps(), _initial()
    ours = cls(**kwargs)
    assert ours.keras_sparse_reason(tf.IndexedSlices(tf.ones((1, 3)), tf.constant([0]))) is None
    table, _, _ = _run(ours, steps, initial)
    want, _, _ = _run(KERAS[cls](**kwargs), steps, initial)
    np.testing.assert_allclose(table, want, rtol=2e-6, atol=1e-6)


@pytest.mark.every_case
@pytest.mark.parametrize("cls", [FusedAdam, FusedRMSprop, FusedAdagrad], ids=["adam", "rmsprop", "adagrad"])
def test_composite_form_takes_keras_update_for_sparse_gradients(cls):
    # On a backend without ResourceApply* kernels the dense variables take the composite form; the
    # sparse one still takes Keras' update.
    steps, initial = _steps(), _initial()
    with devices.assume_backend(PLUGIN):
        ours = cls(0.05)
        assert ours.composite_reason("float32") is not None
        table, bias, concrete = _run(ours, steps, initial)
    want_table, want_bias, _ = _run(KERAS[cls](0.05), steps, initial)
    np.testing.assert_array_equal(table, want_table)
    np.testing.assert_allclose(bias, want_bias, rtol=1e-6, atol=1e-7)
    assert not [t for t in _graph_ops(concrete) if t.startswith("ResourceApply")]


def test_rmsprop_makes_no_hidden_buffer_for_a_sparse_variable():
    ours = FusedRMSprop(0.01, multi_tensor=False)
    _run(ours, _steps(1), _initial())
    buffers = ours._scratch.buffers
    assert buffers[0] is None and buffers[1] is not None  # the table takes Keras' update, the bias the op


def test_loss_scaled_step_with_a_sparse_gradient_uses_keras_scaling():
    _needs_op_library("TfmetalExt>")
    steps, initial = _steps(), _initial()
    scaled = [(v * 1024.0, d * 1024.0) for v, d in steps]
    inner = FusedAdam(0.05, multi_tensor=True)
    table, bias, _ = _run(keras.optimizers.LossScaleOptimizer(inner, initial_scale=1024.0, dynamic_growth_steps=2),
                          scaled, initial)
    assert inner.loss_scale_form == "keras"
    assert "IndexedSlices" in inner.loss_scale_form_reason
    want_table, want_bias, _ = _run(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=1024.0,
                                            dynamic_growth_steps=2), scaled, initial)
    np.testing.assert_array_equal(table, want_table)
    np.testing.assert_allclose(bias, want_bias, rtol=2e-6, atol=1e-7)
    assert int(inner.iterations.numpy()) == 3


def test_per_variable_entry_point_takes_keras_update():
    # Keras' own per-variable hook (`update_step`), as a custom training loop may call it.
    steps, initial = _steps(1), _initial()
    results = []
    for opt in (FusedAdam(0.05), keras.optimizers.Adam(0.05)):
        table = keras.Variable(initial[0])
        opt.build([table])
        sparse = tf.IndexedSlices(tf.constant(steps[0][0]), tf.constant(ROWS), tf.constant(SHAPE))
        opt.update_step(sparse, table, tf.constant(0.05))
        results.append(table.numpy())
    np.testing.assert_array_equal(results[0], results[1])


_MIRRORED = textwrap.dedent(
    """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tfmetal_ext.optimizers import FusedAdam, FusedAdamW, FusedRMSprop

    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, (64, 6)).astype("int32")  # repeated ids in every batch
    y = rng.standard_normal((64, 2)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def run(make_opt):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(12, 4),
                                      keras.layers.Flatten(), keras.layers.Dense(2)])
            model.compile(optimizer=make_opt(), loss="mse")
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        return model

    for stock, ours in [
        (lambda: keras.optimizers.Adam(0.05), lambda: FusedAdam(0.05)),
        (lambda: keras.optimizers.Adam(0.05), lambda: FusedAdam(0.05, multi_tensor=False)),
        (lambda: keras.optimizers.AdamW(0.05), lambda: FusedAdamW(0.05)),
        (lambda: keras.optimizers.RMSprop(0.01), lambda: FusedRMSprop(0.01)),
    ]:
        want, got = run(stock), run(ours)
        w_got, w_want = got.get_weights(), want.get_weights()
        # The embedding takes Keras' own update; the Dense kernel it feeds differs by rounding, so the
        # embedding's later gradients do too (the square of the summed rows would be ~1e-2 away).
        assert np.abs(w_got[0] - w_want[0]).max() <= 1e-6, np.abs(w_got[0] - w_want[0]).max()
        for a, b in zip(w_got[1:], w_want[1:]):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-5
        parts = [t.numpy() for t in got.layers[0].embeddings.value.values]
        np.testing.assert_array_equal(parts[0], parts[1])
    print("MIRRORED SPARSE OK")
    """
)


@pytest.mark.full  # a two-replica subprocess (~15 s); the quick tier keeps every single-replica form above
def test_mirrored_strategy_sparse_gradients_match_keras():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True, env=env, timeout=600)
    assert "MIRRORED SPARSE OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_keras_sparse_reason_is_logged_once(caplog):
    steps, initial = _steps(2), _initial()
    with caplog.at_level("INFO", logger="tfmetal_ext"):
        _run(FusedAdam(0.05, multi_tensor=False), steps, initial)
    assert caplog.text.count("takes keras.optimizers.Adam's own update") == 1, caplog.text
