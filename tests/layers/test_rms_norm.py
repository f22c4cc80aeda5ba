"""FusedRMSNorm: a drop-in for keras.layers.RMSNormalization (stock layer, numpy, saving, fit, graphs)."""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
import tfmetal_ext.inspect as ti
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import FusedRMSNorm
from tfmetal_ext.testing import run_layer_test

rms_layer_module = importlib.import_module("tfmetal_ext.layers.rms_norm")
RMS_NORM_OP = "TfmetalExt>RMSNorm"
RMS_NORM_GRAD_OP = "TfmetalExt>RMSNormGrad"

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "mixed_bfloat16": dict(rtol=1e-2), "mixed_float16": dict(rtol=1e-2)}


def np_rms(x, scale, axes, epsilon):
    """Written out here: float64, over `axes`."""
    x = np.asarray(x, np.float64)
    ms = np.mean(x * x, axis=tuple(axes), keepdims=True)
    return x / np.sqrt(ms + epsilon) * scale


def _close(got, want, policy, what):
    got = np.asarray(tf.cast(got, tf.float32))
    want = np.asarray(tf.cast(want, tf.float32))
    tol = dict(TOL[policy])
    if policy != "float32":  # relative to the tensor's scale, so values near 0 do not dominate
        tol["atol"] = 1e-2 * float(np.max(np.abs(want)) or 1.0)
    np.testing.assert_allclose(got, want, err_msg=what, **tol)


def _pair(kwargs, shape, policy, seed=0):
    """A stock and a fused layer with the same random scale."""
    rng = np.random.default_rng(seed)
    stock = keras.layers.RMSNormalization(dtype=policy, **kwargs)
    ours = FusedRMSNorm(dtype=policy, **kwargs)
    stock.build(shape)
    ours.build(shape)
    stock.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in stock.weights])
    ours.set_weights(stock.get_weights())
    return stock, ours


def _forward_backward(layer, x, dy):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
    return y, tape.gradient(loss, [x] + list(layer.trainable_variables))


def _ops_of(layer, x):
    """Op types of a forward+backward step of `layer` on `x`, as graph-captured."""

    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = layer(t)
        return y, tape.gradient(y, [t] + list(layer.trainable_variables))

    return ti.report_from_capture(ti.capture_function(step, tf.constant(x))).ops_by_type


# ----------------------------------------------------------------------------
# Equivalence with the stock layer and numpy.


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("shape,kwargs", [((6, 8), {}), ((2, 5, 16), dict(epsilon=1e-3)), ((2, 3, 4, 33), {}),
                                          ((3, 7), dict(axis=1))])
def test_matches_the_stock_layer(policy, shape, kwargs):
    stock, ours = _pair(kwargs, shape, policy)
    assert ours.unfused_reason is None
    rng = np.random.default_rng(1)
    x = (rng.normal(size=shape) * 2 + 0.3).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    y_ref, g_ref = _forward_backward(stock, x, dy)
    y, g = _forward_backward(ours, x, dy)
    assert y.dtype == y_ref.dtype == tf.as_dtype(keras.mixed_precision.Policy(policy).compute_dtype)
    _close(y, y_ref, policy, "output")
    assert len(g) == len(g_ref) == 2
    for i, (a, b) in enumerate(zip(g, g_ref)):
        assert a.dtype == b.dtype, i
        _close(a, b, policy, f"gradient {i}")
    if policy == "float32":
        scale = stock.get_weights()[0]
        np.testing.assert_allclose(y.numpy(), np_rms(x, scale, [-1], ours.epsilon), rtol=1e-5, atol=1e-5)


def test_matches_numpy_gradients():
    """The layer's dx / dscale against a numpy finite-difference-free derivation (float64)."""
    shape, eps = (4, 10), 1e-6
    _, ours = _pair({}, shape, "float32", seed=3)
    rng = np.random.default_rng(4)
    x = rng.normal(size=shape).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    _, (dx, dscale) = _forward_backward(ours, x, dy)
    s = ours.get_weights()[0].astype(np.float64)
    xd, dyd = x.astype(np.float64), dy.astype(np.float64)
    r = 1 / np.sqrt((xd * xd).mean(-1, keepdims=True) + eps)
    g = dyd * s
    want_dx = r * g - xd * r**3 * (g * xd).mean(-1, keepdims=True)
    np.testing.assert_allclose(dx.numpy(), want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dscale.numpy(), (dyd * xd * r).sum(0), rtol=1e-4, atol=1e-5)


def test_same_weights_names_and_config_as_stock():
    stock, ours = _pair(dict(epsilon=1e-4), (2, 3, 8), "float32")
    assert [(w.name, w.shape, w.trainable) for w in ours.weights] == [
        (w.name, w.shape, w.trainable) for w in stock.weights
    ]
    assert ours.scale.path.endswith("/scale") and ours.scale.dtype == "float32"
    cfg, stock_cfg = ours.get_config(), stock.get_config()
    for d in (cfg, stock_cfg):
        d.pop("name")
    assert cfg == stock_cfg
    assert isinstance(ours, keras.layers.RMSNormalization)
    # set_weights both ways.
    w = [np.linspace(0.5, 1.5, 8).astype("float32")]
    ours.set_weights(w)
    stock.set_weights(ours.get_weights())
    np.testing.assert_array_equal(stock.get_weights()[0], w[0])
    x = np.random.default_rng(5).normal(size=(2, 3, 8)).astype("float32")
    np.testing.assert_allclose(ours(x).numpy(), stock(x).numpy(), rtol=1e-5, atol=1e-6)


def test_other_axes_take_the_exact_stock_path():
    shape = (2, 3, 8)
    rng = np.random.default_rng(6)
    x = rng.normal(size=shape).astype("float32")
    dy = rng.normal(size=shape).astype("float32")
    for kwargs in (dict(axis=[1, 2]), dict(axis=[-2, -1]), dict(axis=[0, 1, 2])):
        stock, ours = _pair(kwargs, shape, "float32")
        assert "the last axis alone" in ours.unfused_reason
        y_ref, g_ref = _forward_backward(stock, x, dy)
        y, g = _forward_backward(ours, x, dy)
        np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
        for a, b in zip(g, g_ref):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert RMS_NORM_OP not in _ops_of(ours, x)
        axes = kwargs["axis"] if isinstance(kwargs["axis"], list) else [kwargs["axis"]]
        np.testing.assert_allclose(y.numpy(), np_rms(x, stock.get_weights()[0], axes, 1e-6), rtol=1e-5, atol=1e-6)
    # A middle axis alone: the stock scale (3,) does not broadcast against (2, 3, 8), so Keras
    # raises; the drop-in raises the same.
    for cls in (keras.layers.RMSNormalization, FusedRMSNorm):
        with pytest.raises(tf.errors.InvalidArgumentError, match="Incompatible shapes"):
            cls(axis=1)(x)
    # [-1] and [2] on a rank-3 input are the last axis alone: fused.
    for axis in ([-1], [2], 2):
        _, ours = _pair(dict(axis=axis), shape, "float32")
        assert ours.unfused_reason is None
        assert _ops_of(ours, x).get(RMS_NORM_OP) == 1


@pytest.mark.parametrize("epsilon", [0.0, -1.0, None, 1e-50])
def test_epsilons_the_op_cannot_take_run_the_stock_path(epsilon):
    stock, ours = _pair(dict(epsilon=epsilon), (3, 6), "float32")
    assert "epsilon=" in ours.unfused_reason
    x = np.random.default_rng(7).normal(size=(3, 6)).astype("float32")
    np.testing.assert_array_equal(ours(x).numpy(), stock(x).numpy())
    assert RMS_NORM_OP not in _ops_of(ours, x)


def test_unfused_reason_before_build_and_non_float_inputs():
    assert FusedRMSNorm().unfused_reason is None
    layer = FusedRMSNorm(dtype="float64")
    x = np.random.default_rng(8).normal(size=(2, 4))
    stock = keras.layers.RMSNormalization(dtype="float64")
    np.testing.assert_allclose(layer(x).numpy(), stock(x).numpy(), rtol=1e-12)
    assert layer(x).dtype == tf.float64


# ----------------------------------------------------------------------------
# Graphs: one op each way in a real train step.


def _model(norm=FusedRMSNorm, **kwargs):
    return keras.Sequential([keras.Input((5, 8)), keras.layers.Dense(8), norm(name="rms", **kwargs),
                             keras.layers.Dense(1)])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_train_step_is_one_op_each_way(policy):
    keras.mixed_precision.set_global_policy(policy)
    report = ti.fusion_report(_model(), mode="train", optimizer="sgd", loss="mse")
    assert report.ops_by_type.get(RMS_NORM_OP) == 1
    assert report.ops_by_type.get(RMS_NORM_GRAD_OP) == 1
    assert "Rsqrt" not in report.ops_by_type and "RsqrtGrad" not in report.ops_by_type
    stock = ti.fusion_report(_model(keras.layers.RMSNormalization), mode="train", optimizer="sgd", loss="mse")
    assert stock.num_ops > report.num_ops
    assert "Rsqrt" in stock.ops_by_type and RMS_NORM_OP not in stock.ops_by_type
    row = report.row("rms")
    if RMS_NORM_OP in catalog.FUSED_LAYER_OPS:
        assert (row.status, row.actual_op) == ("fused", RMS_NORM_OP)


def test_avoid_fusions_and_reference_switch_run_the_reference(monkeypatch):
    try:
        tfmetal_ext.configure("float32", avoid_fusions=["rms_norm"])
        report = ti.fusion_report(_model(), mode="train", optimizer="sgd", loss="mse")
        assert RMS_NORM_OP not in report.ops_by_type and "Rsqrt" in report.ops_by_type
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    stock, ours = _pair({}, (6, 8), "float32")
    x = np.random.default_rng(9).normal(size=(6, 8)).astype("float32")
    dy = np.random.default_rng(10).normal(size=(6, 8)).astype("float32")
    y_ref, g_ref = _forward_backward(stock, x, dy)
    y, g = _forward_backward(ours, x, dy)
    _close(y, y_ref, "float32", "output")
    for a, b in zip(g, g_ref):
        _close(a, b, "float32", "gradient")
    report = ti.fusion_report(_model(), mode="train", optimizer="sgd", loss="mse")
    assert not any(op.startswith("TfmetalExt>") for op in report.ops_by_type)
    assert report.row("rms").reason == rms_layer_module.REASON_RMS_REFERENCE


# ----------------------------------------------------------------------------
# Keras-style: config round trip, .keras save/load, fit, mixed_float16.


@pytest.mark.parametrize("kwargs,shape", [({}, (4, 6)), (dict(epsilon=1e-4), (2, 3, 5)), (dict(axis=[1, 2]), (2, 3, 4))])
def test_layer(kwargs, shape):
    run_layer_test(FusedRMSNorm, kwargs, shape, expected_output_shape=shape, expected_num_trainable_weights=1)


def test_keras_file_round_trip_and_fit_match_stock(tmp_path):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(32, 5, 8)).astype("float32")
    t = rng.normal(size=(32, 5, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    ours = _model()
    keras.utils.set_random_seed(0)
    stock = _model(keras.layers.RMSNormalization)
    stock.set_weights(ours.get_weights())
    for m in (ours, stock):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    h_ours = ours.fit(x, t, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    h_stock = stock.fit(x, t, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(h_ours, h_stock, rtol=1e-4)
    for a, b in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    path = tmp_path / "rms.keras"
    ours.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.get_layer("rms")) is FusedRMSNorm
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), ours.predict(x, verbose=0))
