"""MetalCallback on tiny models, in the style of Keras' own callback tests.

Where hardware is absent (Metal, a GPU for fallback), `devices.capabilities` is
replaced; the real-device path runs under `pytest -m metal` on a Mac.
"""

import csv
import dataclasses
import glob
import math
import os
import time

import keras
import numpy as np
import pytest

import tfmetal_ext
from tfmetal_ext import devices, inspect
from tfmetal_ext.callbacks import MetalCallback, MetalCallbackError, PerformanceWarning
from tfmetal_ext.inspect.report import FallbackNode, PlacementReport

L = tfmetal_ext.layers


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6, 6, 3)).astype("float32")
    y = rng.integers(0, 4, size=(n,)).astype("int32")
    return x, y


def _ours(dropout=False):
    inputs = keras.Input((6, 6, 3))
    x = L.ConvBNAct(8, 3, name="stem")(inputs)
    x = keras.layers.Flatten(name="flatten")(x)
    x = L.FusedDense(16, activation="relu", name="fc")(x)
    if dropout:
        x = keras.layers.Dropout(0.3, name="drop")(x)
    outputs = L.FusedDense(4, name="logits")(x)
    return keras.Model(inputs, outputs, name="ours")


def _stock():
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(8, 3, use_bias=False, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    outputs = keras.layers.Dense(4, name="logits")(x)
    return keras.Model(inputs, outputs, name="stock")


def _compile(model, optimizer=None, **kw):
    model.compile(
        optimizer=optimizer or tfmetal_ext.optimizers.FusedAdam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kw,
    )
    return model


class Recorder(keras.callbacks.Callback):
    """Records what the callbacks after MetalCallback see."""

    def __init__(self):
        super().__init__()
        self.batch_logs = []
        self.batches_begun = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.batches_begun += 1

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs or {}))


def _fake_caps(**changes):
    return dataclasses.replace(devices.capabilities(), **changes)


def _patch_caps(monkeypatch, **changes):
    caps = _fake_caps(**changes)
    monkeypatch.setattr(devices, "capabilities", lambda: caps)


@pytest.fixture
def lines():
    return []


# ----------------------------------------------------------------------------
# Arguments.


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"report": "verbose"}, "report"),
        ({"check_fallback": "yes"}, "check_fallback"),
        ({"on_nonfinite": "raise"}, "on_nonfinite"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"log_every_n_steps": True}, "log_every_n_steps"),
        ({"profile_steps": (5, 2)}, "profile_steps"),
        ({"profile_steps": (0, 2)}, "profile_steps"),
        ({"profile_steps": "10,20"}, "profile_steps"),
        ({"profile_dir": "/tmp/x"}, "profile_dir"),
        ({"strict": 1}, "strict"),
        ({"print_fn": "stdout"}, "print_fn"),
    ],
)
def test_bad_arguments_raise_in_init(kwargs, name):
    with pytest.raises(ValueError, match=f"Received: {name}="):
        MetalCallback(**kwargs)


def test_single_profile_step_is_a_window_of_one():
    assert MetalCallback(profile_steps=3).profile_steps == (3, 3)


# ----------------------------------------------------------------------------
# Logs.


class EpochTimer(keras.callbacks.Callback):
    """An independent clock: batch-begin and epoch-end times, per epoch."""

    def __init__(self):
        super().__init__()
        self.begins, self.ends = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self.begins[-1].append(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(time.perf_counter())


def test_epoch_logs_reach_history_and_csv_logger(tmp_path, lines):
    x, y = _data()
    model = _compile(_ours())
    path = tmp_path / "log.csv"
    timer = EpochTimer()
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0,
        callbacks=[timer, MetalCallback(print_fn=lines.append), keras.callbacks.CSVLogger(str(path))],
    )
    for key in ("step_time_ms", "examples_per_second"):
        assert key in history.history and len(history.history[key]) == 2
        assert all(v > 0 and math.isfinite(v) for v in history.history[key])
    assert "loss_scale" not in history.history  # no LossScaleOptimizer
    # Epoch 2 against the independent clock: 64 examples in 8 steps of 8.
    begins, end = timer.begins[1], timer.ends[1]
    gaps = np.diff(begins + [end]) * 1e3
    assert history.history["step_time_ms"][1] == pytest.approx(float(np.median(gaps)), rel=0.1, abs=0.05)
    assert history.history["examples_per_second"][1] == pytest.approx(64 / (end - begins[0]), rel=0.1)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[1]["step_time_ms"]) > 0


def _vm_rss_mb():
    """Current RSS from /proc/self/status (VmRSS, in kB): a source apart from the callback's statm read."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return None


class _RssAtEpochEnd(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rss = []

    def on_epoch_end(self, epoch, logs=None):
        self.rss.append(_vm_rss_mb())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_memory_mb_is_the_host_rss_in_the_epoch_logs():
    x, y = _data()
    model = _compile(_ours())
    probe = _RssAtEpochEnd()  # runs right after MetalCallback's epoch end
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[MetalCallback(report=None), probe])
    values = history.history["memory_mb"]
    assert len(values) == 2 and all(type(v) is float and v > 0 for v in values)
    for ours, theirs in zip(values, probe.rss):
        assert ours == pytest.approx(theirs, rel=0.02, abs=2.0)


def test_loss_scale_is_logged_under_mixed_float16(lines):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(32)
    model = _compile(_ours(), optimizer="adam")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(
        x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(report=None, check_fallback=False)]
    )
    assert history.history["loss_scale"] == [float(model.optimizer.dynamic_scale.numpy())]


def test_log_every_n_steps_adds_batch_logs_every_n_steps():
    x, y = _data(48)
    model = _compile(_ours())
    recorder = Recorder()
    model.fit(
        x, y, batch_size=4, epochs=1, verbose=0,
        callbacks=[MetalCallback(report=None, log_every_n_steps=4), recorder],
    )
    have = [i + 1 for i, logs in enumerate(recorder.batch_logs) if "step_time_ms" in logs]
    assert have == [4, 8, 12]
    for i in have:
        logs = recorder.batch_logs[i - 1]
        assert logs["step_time_ms"] > 0 and logs["examples_per_second"] > 0
        # Both figures come from one interval of 4 steps of 4 examples.
        assert logs["examples_per_second"] * logs["step_time_ms"] / 1e3 == pytest.approx(4.0, rel=1e-6)


# ----------------------------------------------------------------------------
# The train-step inspection.


def test_summary_reports_the_real_train_step(lines):
    x, y = _data()
    model = _compile(_ours())
    cb = MetalCallback(print_fn=lines.append)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    text = "\n".join(lines)
    assert text == cb.summary
    assert "ops per step" in text and "backend cpu" in text
    assert "_FusedMatMul[BiasAdd, Relu]" in text  # FusedDense(relu) fuses on CPU
    assert "CPU fallback: none possible (no GPU present)" in text
    # The same step inspected independently, on a compiled clone, has the same ops.
    independent = inspect.fusion_report(model, mode="train", inputs=x[:8], targets=y[:8],
                                        optimizer=tfmetal_ext.optimizers.FusedAdam(1e-3),
                                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert cb.fusion_report.num_ops == independent.num_ops
    assert cb.fusion_report.ops_by_type == independent.ops_by_type
    assert cb.placement_report is not None and not cb.placement_report.fallbacks


def test_full_report_prints_both_reports(lines):
    x, y = _data(16)
    model = _compile(_ours())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(report="full", print_fn=lines.append)])
    text = "\n".join(lines)
    assert "Fusion report (train" in text and "Placement report (train" in text


def test_report_none_prints_nothing_and_skips_inspection(lines):
    x, y = _data(16)
    model = _compile(_ours())
    cb = MetalCallback(report=None, check_fallback=False, print_fn=lines.append)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert lines == [] and cb.fusion_report is None and cb.placement_report is None


def test_stock_model_gets_replacement_advice(lines):
    x, y = _data(16)
    model = _compile(_stock(), optimizer="adam")
    cb = MetalCallback(print_fn=lines.append)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    text = cb.summary
    assert "bn (BatchNormalization" in text and "tfmetal_ext.layers.FusedBatchNorm" in text
    assert "tfmetal_ext.optimizers.FusedAdam" in text  # stock Adam


def test_one_instance_serves_several_fits(lines):
    x, y = _data(16)
    model = _compile(_ours())
    cb = MetalCallback(print_fn=lines.append)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    first = cb.fusion_report.num_ops
    lines.clear()
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert cb.fusion_report is not None and cb.fusion_report.num_ops == first
    assert "ops per step" in "\n".join(lines)
    assert "step_time_ms" in history.history


def test_inspection_does_not_change_training():
    x, y = _data()

    def run(callbacks):
        keras.utils.set_random_seed(7)
        model = _compile(_ours(dropout=True))
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=True, callbacks=callbacks)
        return model.get_weights(), [v.numpy() for v in model.optimizer.variables]

    plain = run([])
    watched = run([MetalCallback(print_fn=lambda *_: None, log_every_n_steps=3)])
    for a, b in zip(plain[0] + plain[1], watched[0] + watched[1]):
        np.testing.assert_array_equal(a, b)


def test_strict_raises_on_a_known_unfused_pattern():
    x, y = _data(16)
    model = _compile(_stock())
    with pytest.raises(MetalCallbackError, match="bn.*FusedBatchNorm"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(strict=True, report=None)])


def test_strict_error_leaves_the_model_usable():
    x, y = _data(16)
    model = _compile(_stock())
    with pytest.raises(MetalCallbackError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(strict=True, report=None)])
    assert not hasattr(model.train_function, "_tfmetal_ext_inner")  # unwrapped
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(report=None)])
    assert "step_time_ms" in history.history


def test_keras_keeps_dispatching_batch_end_hooks_asynchronously():
    # No batch-end hook: Keras need not convert every step's logs on the main thread.
    from keras.src.utils.python_utils import is_default

    assert is_default(MetalCallback().on_train_batch_end)


def test_strict_passes_a_model_that_fuses(lines):
    x, y = _data(16)
    model = _compile(_ours())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(strict=True, print_fn=lines.append)])
    assert "ops per step" in "\n".join(lines)


def test_cpu_fallback_is_listed_with_its_layer_and_replacement(lines):
    model = _compile(_stock())
    model.build((None, 6, 6, 3))
    cb = MetalCallback(strict=True, print_fn=lines.append)
    cb.set_model(model)
    cb._reset()
    cb.placement_report = PlacementReport(
        mode="train", gpu_present=True, ops_by_device={"GPU:0": 10, "CPU:0": 1},
        fallbacks=[FallbackNode(op="SomeCpuOnlyOp", name="bn/x", layer="bn", device="CPU:0")],
    )
    problems = cb._report_first_step()
    assert "CPU fallback: 1 op(s)" in cb.summary
    assert "1 CPU round trip per step: SomeCpuOnlyOp in bn" in cb.summary
    assert "SomeCpuOnlyOp in bn -> use tfmetal_ext.layers.FusedBatchNorm" in cb.summary
    assert problems == ["SomeCpuOnlyOp in bn fell back to the CPU"]


# ----------------------------------------------------------------------------
# Train-begin warnings, with the backend replaced where the hardware is absent.


def test_metal_float32_layers_and_broken_pairing_warn(monkeypatch):
    caps = _fake_caps(backend="metal", metal_plugin_version="1.2.0", tf_version="2.21.0",
                      pairing=devices.KNOWN_BROKEN, pairing_fix=devices.FIX_PAIRING_COMMAND, gpus=("gpu:0",))
    monkeypatch.setattr(devices, "capabilities", lambda: caps)
    x, y = _data(16)
    model = _compile(_ours())
    cb = MetalCallback(report=None, check_fallback=False)
    with pytest.warns(PerformanceWarning) as record:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    messages = [str(w.message) for w in record]
    assert any("compute in float32 on Metal" in m and "stem" in m for m in messages)
    assert any("known-broken" in m and devices.FIX_PAIRING_COMMAND in m for m in messages)
    assert any("configure() would choose mixed_float16" in f for f in cb.findings)


def test_mixed_float16_on_a_cpu_without_fp16_warns(monkeypatch):
    _patch_caps(monkeypatch, backend="cpu", cpu_fp16=False, gpus=())
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(16)
    model = _compile(_ours())
    with pytest.warns(PerformanceWarning, match="nothing fuses"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[MetalCallback(report=None, check_fallback=False)])


def test_no_warning_for_a_float32_cpu_model(monkeypatch, recwarn):
    _patch_caps(monkeypatch, backend="cpu", cpu_bf16=False, gpus=())
    x, y = _data(16)
    model = _compile(_ours())
    cb = MetalCallback(report=None, check_fallback=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert not [w for w in recwarn if issubclass(w.category, PerformanceWarning)]
    assert any("dtype policy: float32 (what configure() chooses here)" in f for f in cb.findings)


def test_xla_on_metal_warns_or_raises_when_strict(monkeypatch):
    _patch_caps(monkeypatch, backend="metal", gpus=("gpu:0",))
    x, y = _data(16)
    model = _compile(_ours(), jit_compile=True)
    assert model.jit_compile is True
    with pytest.raises(MetalCallbackError, match="XLA"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[MetalCallback(report=None, check_fallback=False, strict=True)])
    with pytest.warns(PerformanceWarning, match="jit_compile=True on Metal"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[MetalCallback(report=None, check_fallback=False)])


def test_avoided_fusions_are_reported():
    tfmetal_ext.configure(policy="float32", avoid_fusions=["matmul_bias_relu"])
    try:
        x, y = _data(16)
        model = _compile(_ours())
        cb = MetalCallback(report=None, check_fallback=False)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    finally:
        tfmetal_ext.configure(policy="float32", avoid_fusions=())
    assert any("avoided fusions" in f and "matmul_bias_relu" in f for f in cb.findings)


def test_fused_optimizer_gets_no_advice():
    x, y = _data(16)
    model = _compile(_ours())
    cb = MetalCallback(report=None, check_fallback=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert not any(f.startswith("optimizer:") for f in cb.findings)


# ----------------------------------------------------------------------------
# Non-finite loss.


def _nan_at(index, n=12):
    x, y = _data(n)
    x[index] = np.nan
    return x, y


def _linear():
    # No Relu on the way: oneDNN's Relu maps NaN to 0, which would hide the bad sample.
    inputs = keras.Input((6, 6, 3))
    outputs = L.FusedDense(4, name="logits")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, outputs)


def test_nonfinite_loss_stops_at_the_step():
    x, y = _nan_at(5)
    model = _compile(_linear())
    recorder = Recorder()
    cb = MetalCallback(report=None, print_fn=lambda *_: None)
    history = model.fit(x, y, batch_size=1, epochs=3, verbose=0, shuffle=False, callbacks=[cb, recorder])
    assert cb.nonfinite_step == 6  # the sixth sample, batch size 1
    assert recorder.batches_begun == 6
    assert len(history.history["loss"]) == 1  # stopped within the first epoch


def test_steps_per_execution_and_validation():
    x, y = _nan_at(4, n=16)
    model = _compile(_linear(), steps_per_execution=2)
    lines = []
    cb = MetalCallback(print_fn=lines.append, log_every_n_steps=4)
    clean_x, clean_y = _data(16)
    history = model.fit(clean_x, clean_y, batch_size=1, epochs=2, verbose=0, shuffle=False,
                        validation_data=(clean_x[:4], clean_y[:4]), callbacks=[cb])
    assert "ops per step" in cb.summary
    assert len(history.history["step_time_ms"]) == 2 and "val_loss" in history.history
    recorder = Recorder()
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False, callbacks=[cb, recorder])
    # Sample 4 is step 5, run in the call covering steps 5-6.
    assert cb.nonfinite_step == 6
    assert any("steps 5-6" in line for line in lines)
    assert recorder.batches_begun == 3


def _keras_call_ranges(steps_per_epoch, per_call, epochs):
    """Global 1-based (first, last) steps of each train-function call on endless data.

    Keras starts a call at every `per_call`-th batch of the epoch, and a call
    runs `per_call` steps while the data lasts, even past `steps_per_epoch`.
    """
    ranges, done = [], 0
    for _ in range(epochs):
        for _begin in range(0, steps_per_epoch, per_call):
            ranges.append((done + 1, done + per_call))
            done += per_call
    return ranges


@pytest.mark.parametrize("nan_step", [8, 12])
def test_steps_are_numbered_when_steps_per_execution_does_not_divide_the_epoch(nan_step):
    import tensorflow as tf

    x, y = _nan_at(nan_step - 1, n=16)  # batch size 1: sample i is step i + 1
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(1).repeat()
    model = _compile(_linear(), steps_per_execution=3)
    lines = []
    cb = MetalCallback(report=None, print_fn=lines.append)
    model.fit(data, steps_per_epoch=5, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    first, last = next(r for r in _keras_call_ranges(5, 3, 2) if r[0] <= nan_step <= r[1])
    assert first > 6  # a call of the second epoch
    assert cb.nonfinite_step == last
    text = "\n".join(str(line) for line in lines)
    assert f"steps {first}-{last}" in text, text


def test_a_call_cut_short_by_the_end_of_the_data_is_numbered_to_its_last_step():
    # 7 samples, batch size 1, 3 steps per call: the epoch's calls run steps 1-3, 4-6
    # and then only step 7, where the data ends. The NaN is in sample 7.
    x, y = _nan_at(6, n=7)
    model = _compile(_linear(), steps_per_execution=3)
    lines = []
    cb = MetalCallback(report=None, print_fn=lines.append)
    history = model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    assert int(model.optimizer.iterations.numpy()) == 7
    assert cb.nonfinite_step == 7
    text = "\n".join(str(line) for line in lines)
    assert "at step 7 (step 7 of the epoch)" in text, text
    assert "7-9" not in text, text
    assert len(history.history["loss"]) == 1


class OwnOptimizerModel(keras.Model):
    """A keras.io-style custom train step (as in a GAN) that never applies `model.optimizer`."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.own_optimizer = keras.optimizers.SGD(0.01)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.own_optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_steps_follow_on_when_the_train_step_never_applies_model_optimizer(tmp_path):
    # model.optimizer.iterations stays 0 here: it must not restart epoch 2 at step 1.
    model = OwnOptimizerModel()
    model.compile(optimizer="sgd")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    cb = MetalCallback(report=None, profile_steps=(6, 7), profile_dir=str(tmp_path))
    model.fit(x, y, batch_size=1, epochs=2, verbose=0, callbacks=[cb])
    assert int(model.optimizer.iterations.numpy()) == 0
    assert cb.profiled_steps == [6, 7]


def test_nonfinite_loss_warns_and_keeps_training():
    x, y = _nan_at(2)
    model = _compile(_linear())
    recorder = Recorder()
    cb = MetalCallback(report=None, on_nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="non-finite loss .* at step 3"):
        model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False, callbacks=[cb, recorder])
    assert recorder.batches_begun == 12 and cb.nonfinite_step == 3


def test_nonfinite_ignore_trains_on():
    x, y = _nan_at(2)
    model = _compile(_linear())
    cb = MetalCallback(report=None, on_nonfinite="ignore")
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    assert cb.nonfinite_step is None


# ----------------------------------------------------------------------------
# Profiling.


def test_profile_window_writes_a_trace(tmp_path):
    x, y = _data(32)
    model = _compile(_ours())
    cb = MetalCallback(report=None, profile_steps=(2, 3), profile_dir=str(tmp_path))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    assert cb.profiled_steps == [2, 3]
    traces = glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))
    assert traces and os.path.getsize(traces[0]) > 0


def test_profile_window_past_the_end_is_closed_at_train_end(tmp_path):
    x, y = _data(8)
    model = _compile(_ours())
    cb = MetalCallback(report=None, profile_steps=(2, 50), profile_dir=str(tmp_path))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    assert cb.profiled_steps == [2]
    assert glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))
    # The profiler is stopped: a new session can start.
    import tensorflow as tf

    tf.profiler.experimental.start(str(tmp_path / "again"))
    tf.profiler.experimental.stop()


def test_signposts_bracket_each_profiled_step(monkeypatch, tmp_path):
    events = []

    class FakeSignposts:
        active = True

        def begin(self, step):
            events.append(("begin", step))
            return 1000 + step

        def end(self, token, step):
            events.append(("end", step, token))

    from tfmetal_ext.callbacks import _signpost

    monkeypatch.setattr(_signpost.Signposts, "for_this_host", classmethod(lambda cls: FakeSignposts()))
    x, y = _data(24)
    model = _compile(_ours())
    cb = MetalCallback(report=None, profile_steps=(2, 4), profile_dir=str(tmp_path))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cb])
    assert events == [("begin", 2), ("end", 2, 1002), ("begin", 3), ("end", 3, 1003), ("begin", 4), ("end", 4, 1004)]


# ----------------------------------------------------------------------------
# On the real device (`pytest -m metal` on a Mac).


@pytest.mark.metal
def test_on_metal_our_layers_fuse_and_stay_on_the_gpu(lines):
    tfmetal_ext.configure()  # mixed_float16 on Metal
    x, y = _data(32)
    model = _compile(_ours())
    cb = MetalCallback(strict=True, print_fn=lines.append)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert cb.placement_report.gpu_present and not cb.placement_report.fallbacks
    assert "backend metal" in cb.summary and "CPU fallback: none" in cb.summary


@pytest.mark.metal
def test_on_metal_signposts_are_built_and_active():
    from tfmetal_ext.callbacks import _signpost

    posts = _signpost.Signposts.for_this_host()
    assert posts.active
    posts.end(posts.begin(1), 1)


def test_steps_are_numbered_under_loss_scaling_with_skipped_steps():
    # mixed_float16: the LossScaleOptimizer skips the first steps (the scaled
    # gradients overflow float16 while the loss stays finite), and a skipped
    # step does not count in `iterations`; the numbering must not depend on it.
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    nan_step = 8
    x, y = _nan_at(nan_step - 1, n=16)
    x = x * 100.0
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(1).repeat()
    model = _compile(_linear(), steps_per_execution=3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    lines = []
    cb = MetalCallback(report=None, print_fn=lines.append)
    model.fit(data, steps_per_epoch=5, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    assert int(model.optimizer.iterations.numpy()) < nan_step - 1  # steps were skipped
    first, last = next(r for r in _keras_call_ranges(5, 3, 2) if r[0] <= nan_step <= r[1])
    assert cb.nonfinite_step == last
    text = "\n".join(str(line) for line in lines)
    assert f"steps {first}-{last}" in text, text


def test_round_trips_are_counted_and_named_most_frequent_first():
    from tfmetal_ext.callbacks._capture import round_trip_line

    fallbacks = [FallbackNode(op="IsFinite", name=f"s/f{i}", layer=None, device="CPU:0") for i in range(3)]
    fallbacks.append(FallbackNode(op="DivNoNan", name="loss/d", layer="loss", device="CPU:0"))
    pr = PlacementReport(mode="train", gpu_present=True, ops_by_device={}, fallbacks=fallbacks)
    assert round_trip_line(pr) == "  4 CPU round trips per step: IsFinite in (step) x3, DivNoNan in loss"
    many = [FallbackNode(op=f"Op{i}", name=f"n{i}", layer="l", device="CPU:0") for i in range(8)]
    line = round_trip_line(PlacementReport(mode="train", gpu_present=True, ops_by_device={}, fallbacks=many))
    assert line.startswith("  8 CPU round trips per step: Op0 in l, ") and line.endswith(", and 2 more")
