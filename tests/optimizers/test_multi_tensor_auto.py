"""multi_tensor="auto" (the default of FusedAdam, FusedAdamW and FusedLion): the multi-tensor op where
its kernel runs, else per-variable updates with one INFO line; what ran is read from the executed graph.

Whether the op runs here is taken from `tfmetal_ext.ops.status()` (the loaded library and its CPU
kernel) and `tfmetal_ext.devices.capabilities()`, never assumed of this machine.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import devices, inspect, ops
from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _loader
from tfmetal_ext.optimizers import FusedAdam, FusedAdamW, FusedLion

ADAM_OP = fusion.CUSTOM_OPS["multi_tensor_adam"].name
LION_OP = fusion.CUSTOM_OPS["multi_tensor_lion"].name


def op_here(key):
    """The multi-tensor op `key` has its kernel here (a CPU backend: the library's CPU kernel)."""
    status = ops.status()
    if devices.capabilities().backend != "cpu":
        pytest.skip("these expectations are written for a CPU backend (GPU backends: tests/test_backends.py)")
    return status.loaded and not status.reference_forced and status.kernels[key]["cpu"]


def variables_and_grads(n=4, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    variables = [keras.Variable(rng.standard_normal((8, 8)).astype(dtype), name=f"w{i}") for i in range(n)]
    grads = [tf.constant(rng.standard_normal((8, 8)).astype(dtype)) for _ in range(n)]
    return variables, grads


def step_ops(opt, variables, grads):
    opt.build(variables)
    return inspect.report_from_capture(inspect.capture_function(lambda: opt.apply(grads, variables))).ops_by_type


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])


def fit(opt, steps=6, **compile_kw):
    m = model()
    m.compile(optimizer=opt, loss="mse", **compile_kw)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((steps * 4, 6)).astype("float32"), rng.standard_normal((steps * 4, 2)).astype("float32")
    m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    return m


def fallback_records(caplog, cls_name):
    """The optimizer's fallback lines (configure() also logs, naming FusedAdam(multi_tensor=True))."""
    return [r for r in caplog.records
            if r.name == "tfmetal_ext" and r.getMessage().startswith(f"tfmetal_ext: {cls_name}(multi_tensor=")]


@pytest.mark.parametrize("make", [FusedAdam, FusedAdamW, FusedLion])
def test_default_is_auto(make):
    opt = make()
    assert opt.multi_tensor == "auto"
    assert opt.get_config()["multi_tensor"] == "auto"
    assert opt.update_form is None  # nothing traced yet


def test_auto_picks_one_op_per_dtype_group_on_cpu():
    if not op_here("multi_tensor_adam"):
        pytest.skip("the op library is not loaded here: test_auto_without_the_library covers that case")
    v32, g32 = variables_and_grads(4)
    v16, g16 = variables_and_grads(3, "float16", seed=1)
    opt = FusedAdam()
    counts = step_ops(opt, v32 + v16, g32 + g16)
    assert counts.get(ADAM_OP) == 2, counts  # float32 and float16
    assert "ResourceApplyAdam" not in counts, counts
    assert opt.update_form == "multi_tensor" and opt.update_form_reason is None
    # AdamW: decay inside the op, no per-variable decay op.
    variables, grads = variables_and_grads(4)
    counts = step_ops(FusedAdamW(weight_decay=0.1), variables, grads)
    assert counts.get(ADAM_OP) == 1 and not [op for op in counts if op.startswith("ResourceApply")], counts


def test_auto_lion_picks_its_op_on_cpu():
    if not op_here("multi_tensor_lion"):
        pytest.skip("the op library (with multi_tensor_lion) is not loaded here")
    variables, grads = variables_and_grads(5)
    opt = FusedLion()
    counts = step_ops(opt, variables, grads)
    assert counts.get(LION_OP) == 1 and "Sign" not in counts, counts
    assert opt.update_form == "multi_tensor"


def test_train_step_report_states_the_update_that_ran():
    expected = "multi_tensor" if op_here("multi_tensor_adam") else "per_variable"
    report = inspect.fusion_report(model(), mode="train", optimizer=FusedAdam(), loss="mse")
    assert report.optimizer_update.form == expected
    if expected == "multi_tensor":
        assert report.optimizer_update.multi_tensor_ops == {ADAM_OP: 1}
        assert report.optimizer_update.training_ops == {}
    assert "optimizer update: " in str(report)

    report = inspect.fusion_report(model(), mode="train", optimizer=FusedAdam(multi_tensor=False), loss="mse")
    assert report.optimizer_update.form == "per_variable"
    assert report.optimizer_update.training_ops == {"ResourceApplyAdam": 4}  # 2 kernels, 2 biases
    assert report.optimizer_update.multi_tensor_ops == {}

    report = inspect.fusion_report(model(), mode="train", optimizer=keras.optimizers.Adam(), loss="mse")
    assert report.optimizer_update.form == "elementwise"
    assert inspect.fusion_report(model(), mode="predict").optimizer_update is None


def test_metal_callback_summary_states_the_update_that_ran():
    lines = []
    expected = "multi-tensor" if op_here("multi_tensor_adam") else "one training op per variable"
    m = model()
    m.compile(optimizer=FusedAdam(), loss="mse")
    x, y = np.zeros((8, 6), "float32"), np.zeros((8, 2), "float32")
    m.fit(x, y, batch_size=4, verbose=0, callbacks=[tfmetal_ext.callbacks.MetalCallback(print_fn=lines.append)])
    text = "\n".join(str(line) for line in lines)
    assert f"optimizer update: {expected}" in text, text


def test_auto_falls_back_under_xla_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
        got = fit(FusedAdam(0.01), jit_compile=True)
    records = fallback_records(caplog, "FusedAdam")
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.INFO and "XLA" in records[0].getMessage()
    assert got.optimizer.update_form == "per_variable" and "XLA" in got.optimizer.update_form_reason
    want = fit(FusedAdam(0.01, multi_tensor=False), jit_compile=True)
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_explicit_true_falls_back_with_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
        fit(FusedAdam(0.01, multi_tensor=True), jit_compile=True)
    records = fallback_records(caplog, "FusedAdam")
    assert len(records) == 1 and records[0].levelno == logging.WARNING


def test_auto_respects_avoid_fusions(caplog):
    variables, grads = variables_and_grads(3)
    tfmetal_ext.configure("float32", avoid_fusions=["multi_tensor_adam"])
    try:
        opt = FusedAdam()
        with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
            counts = step_ops(opt, variables, grads)
            opt.apply(grads, variables)
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
    assert counts.get("ResourceApplyAdam") == 3 and ADAM_OP not in counts, counts
    records = fallback_records(caplog, "FusedAdam")
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "avoid_fusions" in records[0].getMessage() and "avoid_fusions" in opt.update_form_reason


def test_auto_with_reference_ops_forced(monkeypatch, caplog):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    variables, grads = variables_and_grads(3)
    opt = FusedLion()
    with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
        counts = step_ops(opt, variables, grads)
    assert LION_OP not in counts and counts.get("Sign") == 3, counts
    assert opt.update_form == "per_variable" and "TFMETAL_EXT_REFERENCE_OPS" in opt.update_form_reason
    records = fallback_records(caplog, "FusedLion")
    assert len(records) == 1 and records[0].levelno == logging.INFO


def test_auto_without_the_library(monkeypatch, caplog):
    # What a machine without a compiler sees: the loader tried and has no module.
    monkeypatch.delenv("TFMETAL_EXT_REFERENCE_OPS", raising=False)
    state = _loader._State(module=None, attempted=True, error="no C++ compiler (simulated)")
    monkeypatch.setattr(_loader, "_state", state)
    variables, grads = variables_and_grads(3)
    opt = FusedAdam()
    with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
        counts = step_ops(opt, variables, grads)
    assert counts.get("ResourceApplyAdam") == 3 and ADAM_OP not in counts, counts
    assert opt.update_form == "per_variable" and "no C++ compiler (simulated)" in opt.update_form_reason
    records = fallback_records(caplog, "FusedAdam")
    assert len(records) == 1 and records[0].levelno == logging.INFO


def test_explicit_false_is_one_resource_apply_adam_per_variable(caplog):
    variables, grads = variables_and_grads(5)
    opt = FusedAdam(multi_tensor=False)
    with caplog.at_level(logging.INFO, logger="tfmetal_ext"):
        counts = step_ops(opt, variables, grads)
    assert counts.get("ResourceApplyAdam") == 5 and ADAM_OP not in counts, counts
    assert opt.update_form == "per_variable" and opt.update_form_reason == "multi_tensor=False"
    assert not fallback_records(caplog, "FusedAdam")  # nothing to explain


def test_auto_matches_per_variable_bitwise():
    want = fit(FusedAdamW(0.01, multi_tensor=False))
    got = fit(FusedAdamW(0.01))
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdamW, FusedLion])
@pytest.mark.parametrize("value", [True, False, "auto"])
def test_config_round_trip(cls, value):
    opt = cls(multi_tensor=value)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(clone) is cls and clone.multi_tensor == value and type(clone.multi_tensor) is type(value)
    assert clone.get_config() == opt.get_config()


def test_old_configs_load():
    # Configs saved before "auto" existed hold a bool; configs of the stock class hold none.
    config = FusedAdam().get_config()
    for old in (True, False):
        assert FusedAdam.from_config({**config, "multi_tensor": old}).multi_tensor is old
    stock = keras.optimizers.Adam(0.01).get_config()
    assert FusedAdam.from_config(stock).multi_tensor == "auto"


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdamW, FusedLion])
@pytest.mark.parametrize("value", ["yes", 1, 0, None, "AUTO"])
def test_bad_multi_tensor(cls, value):
    with pytest.raises(ValueError, match=f"Received: multi_tensor={value!r}"):
        cls(multi_tensor=value)


def test_update_form_is_read_only():
    opt = FusedAdam()
    with pytest.raises(AttributeError):
        opt.update_form = "multi_tensor"


@pytest.mark.parametrize("make, stock", [(lambda mt: FusedAdam(0.01, multi_tensor=mt), keras.optimizers.Adam),
                                         (lambda mt: FusedLion(0.01, multi_tensor=mt), keras.optimizers.Lion)])
@pytest.mark.parametrize("mt", ["auto", True])
def test_float64_variables_take_the_per_variable_form(make, stock, mt):
    # The multi-tensor ops take float32, float16 and bfloat16; Keras' own tests use float64 variables.
    w0 = np.linspace(-1.0, 1.0, 10)
    grads = [np.full(10, 0.01), np.arange(0.1, 1.1, 0.1)]
    results = []
    for opt in (stock(0.01), make(mt)):
        var = keras.Variable(w0, dtype="float64")
        for g in grads:
            opt.apply([tf.constant(g)], [var])
        results.append(var.numpy())
    # ResourceApplyAdam and Keras' Adam round differently (test_optimizers.py compares at 1e-5); Lion is exact.
    np.testing.assert_allclose(results[1], results[0], rtol=0, atol=1e-6 if stock is keras.optimizers.Adam else 0)
    assert opt.update_form == "per_variable" and "float64" in opt.update_form_reason


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_half_variables_on_apples_table_take_the_composite_or_multi_tensor_form(multi_tensor):
    # Apple's tensorflow-metal registers ResourceApplyAdam for float32 only (REFERENCE.md 10): a float16
    # variable's per-variable update is the composite form; the multi-tensor op, which takes half, gets
    # its own scalars (the composite scalars have no "lr": this step used to fail with KeyError there).
    import keras
    import numpy as np

    from tfmetal_ext import inspect
    from tfmetal_ext.optimizers import FusedAdam

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="float16")])
    model.compile(FusedAdam(1e-3, multi_tensor=multi_tensor), "mse")
    report = inspect.placement_report(model, np.ones((2, 4), "float16"), targets=np.ones((2, 3), "float16"),
                                      mode="train", predict_for="tensorflow-metal")
    assert model.optimizer.update_form == ("multi_tensor" if multi_tensor else "composite"), model.optimizer.update_form
    assert not [e for e in report.missing if e.op.startswith("ResourceApply")], str(report)
