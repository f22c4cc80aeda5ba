"""The parts MetalCallback is composed of, each on its own (no fit: fakes stand in for the model and clock)."""

import types
import warnings

import keras
import pytest

from tfmetal_ext import devices
from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED, STOCK_TO_FUSED
from tfmetal_ext.callbacks import _capture, _profiling, _timing
from tfmetal_ext.callbacks._findings import Findings
from tfmetal_ext.callbacks._nonfinite import NonFiniteLoss
from tfmetal_ext.callbacks._steps import StepCounter

no_keras = pytest.mark.no_keras


def _counter(first, per_call=1, epoch_base=0):
    steps = StepCounter()
    steps.epoch_base = epoch_base
    steps.batch_begin(first - epoch_base - 1, per_call)
    return steps


# ----------------------------------------------------------------------------
# Steps.


@no_keras
def test_step_numbers_run_on_across_epochs_and_stop_at_the_epochs_end():
    steps = StepCounter()
    steps.batch_begin(0, per_call=2)
    assert (steps.first, steps.last) == (1, 2)
    steps.batch_begin(2, per_call=2)  # the last call of a 3-step epoch runs one step
    assert steps.epoch_last(total=3) == 3 and steps.epoch_last() == 4
    steps.epoch_end(total=3)
    steps.batch_begin(0, per_call=2)
    assert (steps.first, steps.last, steps.in_epoch(5)) == (4, 5, 2)
    steps.batch_begin(2, per_call=2)
    steps.epoch_end(total=3)
    steps.epoch_end(total=3)  # an epoch without a call does not move the numbers
    assert steps.epoch_base == 6


# ----------------------------------------------------------------------------
# Non-finite loss.


@no_keras
def test_nonfinite_stop_names_the_call_and_acts_once():
    model, printed = types.SimpleNamespace(stop_training=False), []
    watch = NonFiniteLoss("stop", printed.append)
    watch.check(model, {"loss": 1.5}, _counter(3, per_call=2))
    assert watch.step is None and not model.stop_training
    watch.check(model, {"loss": float("nan")}, _counter(5, per_call=2))
    assert watch.step == 6 and model.stop_training
    assert printed == ["MetalCallback: non-finite loss (nan) at steps 5-6 (steps_per_execution=2: the loss is "
                       "read once per call); training stopped"]
    watch.check(model, {"loss": float("inf")}, _counter(7))
    assert watch.step == 6 and len(printed) == 1


@no_keras
def test_nonfinite_warn_and_ignore():
    model = types.SimpleNamespace(stop_training=False)
    with pytest.warns(RuntimeWarning, match=r"non-finite loss \(inf\) at step 9 \(step 4 of the epoch\)"):
        NonFiniteLoss("warn").check(model, {"loss": float("inf")}, _counter(9, epoch_base=5))
    ignore = NonFiniteLoss("ignore")
    ignore.check(model, {"loss": float("nan")}, _counter(1))
    assert ignore.step is None and not model.stop_training


# ----------------------------------------------------------------------------
# Timing.


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Count:
    def __init__(self):
        self.value = 0.0

    def numpy(self):
        return self.value


@no_keras
def test_epoch_figures_skip_the_first_step_and_divide_by_steps_per_call(monkeypatch):
    clock, count = _Clock(), _Count()
    monkeypatch.setattr(_timing.time, "perf_counter", clock)
    model = types.SimpleNamespace(_loss_tracker=types.SimpleNamespace(count=count), optimizer=None)
    timer, steps = _timing.StepTimer(), StepCounter()
    timer.epoch_begin(model)
    for batch, t in ((0, 0.0), (2, 1.0), (4, 3.0)):  # calls of 2 steps beginning at these times
        clock.now = t
        steps.batch_begin(batch, per_call=2)
        timer.call_begin(model, steps.first)
    clock.now, count.value = 4.0, 48.0
    timer.training_done()
    clock.now = 100.0  # validation time is not training time
    stats = timer.epoch_stats(model, steps)
    # Step 1's call is excluded; then 2 s and 1 s for 2 steps each.
    assert stats == {"step_time_ms": pytest.approx(750.0), "examples_per_second": pytest.approx(8 / 0.75)}


@no_keras
def test_batch_figures_every_n_steps(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_timing.time, "perf_counter", clock)
    model = types.SimpleNamespace(optimizer=None)
    timer = _timing.StepTimer(log_every_n_steps=2)
    timer.epoch_begin(model)
    seen = []
    for step in range(1, 6):
        clock.now = float(step)
        timer.call_begin(model, step)
        clock.now += 0.5
        logs = {}
        timer.call_end(model, step, step, logs)
        seen.append(logs.get("step_time_ms"))
    # Intervals begin after step 1: steps 2 (1.5 s begin to end) and 3-4 (3.0 to 4.5 s, 2 steps).
    assert seen == [None, pytest.approx(500.0), None, pytest.approx(750.0), None]


# ----------------------------------------------------------------------------
# Profiling.


class _FakeSignposts:
    def __init__(self):
        self.events = []

    def begin(self, step):
        self.events.append(("begin", step))
        return step

    def end(self, token, step):
        self.events.append(("end", step))


@no_keras
def test_profile_window_forms():
    assert _profiling.profile_window(3) == (3, 3)
    assert _profiling.profile_window([2, 5]) == (2, 5)
    assert _profiling.profile_window(None) is None
    with pytest.raises(ValueError, match="Received: profile_steps=True"):
        _profiling.profile_window(True)


@no_keras
def test_a_profiler_that_cannot_start_warns_once_and_profiles_nothing(monkeypatch):
    import tensorflow as tf

    starts = []

    def start(log_dir):
        starts.append(log_dir)
        raise RuntimeError("another session")

    monkeypatch.setattr(tf.profiler.experimental, "start", start)
    posts = _FakeSignposts()
    monkeypatch.setattr(_profiling.Signposts, "for_this_host", classmethod(lambda cls: posts))
    profiler = _profiling.StepProfiler((1, 3), "unused")
    profiler.train_begin()
    with pytest.warns(RuntimeWarning, match="could not start the TF profiler: another session"):
        profiler.call_begin(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (1, 2, 3):
            profiler.call_begin(step)
            profiler.call_end(step, step)
        profiler.stop()
    assert starts == ["unused"] and profiler.steps == [] and posts.events == []


# ----------------------------------------------------------------------------
# Advice and the summary.


@no_keras
def test_layer_advice_is_the_fusion_tables_suggestion():
    assert {stock: _capture.layer_advice(stock) for stock in STOCK_TO_FUSED} == {
        stock: row.suggestion for stock, row in STOCK_TO_FUSED.items()
    }
    assert _capture.layer_advice("BatchNormalization").startswith("tfmetal_ext.layers.FusedBatchNorm (or ConvBNAct")
    assert _capture.layer_advice("ReLU") is None


def _stock_dense_model():
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="mid")(inputs)))


def test_summary_advises_stock_layers_but_not_partial_rows():
    def row(path, status, reason):
        return types.SimpleNamespace(path=path, status=status, layer_class="Dense", pattern="matmul_bias_act",
                                     reason=reason)

    fused = types.SimpleNamespace(backward=False, label=lambda: "_FusedMatMul[BiasAdd]")
    fr = types.SimpleNamespace(num_ops=42, fused=[fused, fused], notes=["a note"],
                               layers=[row("mid", "missed", "no BiasAdd"), row("head", "partial", "half"),
                                       row("head", "fused", None)])
    lines, problems = _capture.summarize(_stock_dense_model(), ["a finding"], fr, None)
    advice = STOCK_TO_FUSED["Dense"].suggestion
    assert lines == [
        "MetalCallback:",
        "  a finding",
        "  train step: 42 ops per step; fused (forward): _FusedMatMul[BiasAdd] x2",
        f"  missed: mid (Dense, matmul_bias_act): no BiasAdd -> use {advice}",
        "  partial: head (Dense, matmul_bias_act): half",
        "  note: a note",
    ]
    assert problems == [f"mid (Dense) is not fused -> use {advice}", "mid: expected fusion missing (no BiasAdd)"]


@pytest.mark.parametrize(
    "make, stock",
    [
        (lambda: keras.optimizers.SGD(1e-3), "SGD"),
        (lambda: keras.optimizers.SGD(1e-3, momentum=0.9, nesterov=True), "SGD"),
        (lambda: keras.optimizers.AdamW(1e-3), "AdamW"),
        (lambda: keras.optimizers.RMSprop(1e-3), "RMSprop"),
        (lambda: keras.optimizers.Adagrad(1e-3), "Adagrad"),
        (lambda: keras.optimizers.Lion(1e-3), "Lion"),
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Lion(1e-3)), "Lion"),
    ],
    ids=["sgd", "sgd_nesterov", "adamw", "rmsprop", "adagrad", "lion", "lion_loss_scaled"],
)
def test_stock_optimizer_advice_is_the_fusion_tables_class(make, stock):
    model = _stock_dense_model()
    model.compile(optimizer=make(), loss="mse")
    findings = Findings()
    findings.check(model, devices.capabilities())
    advice = [line for line in findings.lines if line.startswith("optimizer:")]
    row = OPTIMIZER_TO_FUSED[stock]
    assert advice == [
        f"optimizer: stock keras {stock} issues many small ops per variable per step; {row.suggestion}"
    ]
    assert f"tfmetal_ext.optimizers.Fused{stock} takes the same arguments" in advice[0]


def test_stock_loss_advice_is_the_fusion_tables_class():
    from tfmetal_ext.backends.fusion import LOSS_TO_FUSED
    from tfmetal_ext.losses import FusedSparseCategoricalCrossentropy

    row = LOSS_TO_FUSED["SparseCategoricalCrossentropy"]
    for loss, advised in ((keras.losses.SparseCategoricalCrossentropy(from_logits=True), True),
                          ("sparse_categorical_crossentropy", True),
                          ({"out": "sparse_categorical_crossentropy"}, True),
                          (FusedSparseCategoricalCrossentropy(from_logits=True), False), ("mse", False)):
        model = _stock_dense_model()
        model.compile(optimizer="sgd", loss=loss)
        findings = Findings()
        findings.check(model, devices.capabilities())
        advice = [line for line in findings.lines if line.startswith("loss:")]
        assert advice == ([f"loss: stock keras SparseCategoricalCrossentropy runs TensorFlow's op and a Mul over the "
                           f"logits; {row.suggestion}"] if advised else []), loss


def test_fused_optimizer_gets_no_advice():
    model = _stock_dense_model()
    from tfmetal_ext.optimizers import FusedLion

    model.compile(optimizer=FusedLion(1e-3), loss="mse")
    findings = Findings()
    findings.check(model, devices.capabilities())
    assert not [line for line in findings.lines if line.startswith("optimizer:")]


def test_loss_scale_optimizer_is_advised_by_its_inner_optimizer():
    model = _stock_dense_model()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    findings = Findings()
    findings.check(model, devices.capabilities())
    assert any(OPTIMIZER_TO_FUSED["Adam"].qualified in line for line in findings.lines)
