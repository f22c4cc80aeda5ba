"""The gap-kernel plan (tfmetal_ext.backends.gap_kernels): which standard ops our library registers GPU kernels for.

The one rule that matters: never a kernel the backend already has (TensorFlow fails an op whose node
matches two registrations). It is checked here against the backends' raw registration records (Apple's
`REGISTRATIONS`, with every type constraint, and the open plugin's `KERNELS` / `TF_DEFAULT_KERNELS`), not
against `Backend.has_kernel`, which the plan itself uses.
"""

import importlib
import itertools

import keras
import numpy as np
import pytest

from tfmetal_ext import inspect
from tfmetal_ext.backends import _metal_kernels as apple
from tfmetal_ext.backends import _metal_plugin_kernels as open_plugin
from tfmetal_ext.backends import gap_kernels, metal_plugin, registry
from tfmetal_ext.inspect import predict
from tfmetal_ext.ops import _loader

status_mod = importlib.import_module("tfmetal_ext.ops.status")  # the module (ops.status is its function)


def test_every_gap_kernel_is_registered_by_its_family_and_nothing_else():
    import pathlib
    import re

    metal = pathlib.Path(__file__).resolve().parents[1] / "custom_ops" / "metal"
    calls = {}
    for mm in metal.glob("*_metal.mm"):
        for op in re.findall(r'RegisterGapKernels<[^>]*>\("(\w+)"', mm.read_text()):
            calls[op] = mm.name
    assert calls == {op: f"{k.family}_metal.mm" for op, k in gap_kernels.GAP_KERNELS.items()}


def _combinations(kernel, dtypes):
    attrs = [(kernel.dtype_attr, dtypes)] + list(kernel.other_attrs.items())
    for values in itertools.product(*(ds for _, ds in attrs)):
        yield dict(zip((a for a, _ in attrs), values))


def _apple_registration_matches(op, combo, macos):
    for reg_op, _, constraints, _, gated in apple.REGISTRATIONS:
        if reg_op != op or (gated and macos < apple.GATE_MIN_MACOS):
            continue
        if all(combo.get(attr, value) == value for attr, value in constraints):
            return True
    return any(op == o and (not ds or combo.get(apple.DTYPE_ATTR.get(op, "T")) in ds)
               for o, ds in apple.TF_DEFAULT_KERNELS.items())


@pytest.mark.parametrize("macos", [(12, 7), (15, 0)])
def test_apple_plan_never_duplicates_a_registration(macos):
    rows = gap_kernels.plan("metal", macos=macos, enabled=True)
    planned = gap_kernels.registered(rows)
    assert planned, "Apple's tensorflow-metal lacks IsFinite, Einsum, ...: something must be planned"
    for op, dtypes in planned.items():
        for combo in _combinations(gap_kernels.GAP_KERNELS[op], dtypes):
            assert not _apple_registration_matches(op, combo, macos), (op, combo)
    # REFERENCE.md section 10: no IsFinite or Elu at all; Sigmoid, Fill, ZerosLike, OnesLike float only
    # (so ZerosLike's int8 is planned too).
    assert set(planned["IsFinite"]) == set(planned["Elu"]) == {"float32", "float16", "bfloat16"}
    for op in ("Sigmoid", "OnesLike"):
        assert set(planned[op]) == {"float16", "bfloat16"}, op
    assert set(planned["ZerosLike"]) == {"float16", "bfloat16", "int8"}
    assert set(planned["Fill"]) == {"float16", "bfloat16", "bool"}
    if "DivNoNan" in gap_kernels.GAP_KERNELS:
        assert "DivNoNan" not in planned  # registered for float/half/bfloat16 there


@pytest.mark.skipif("StatelessRandomUniformV2" not in gap_kernels.GAP_KERNELS,
                    reason="no StatelessRandomUniformV2 gap kernel in this build of the table")
def test_apple_gate_decides_the_random_kernels():
    old = gap_kernels.registered(gap_kernels.plan("metal", macos="12.7", enabled=True))
    new = gap_kernels.registered(gap_kernels.plan("metal", macos="13.0", enabled=True))
    # Before macOS 13 Apple registers no StatelessRandomUniformV2 at all; from 13 on, float and half.
    assert set(old["StatelessRandomUniformV2"]) == {"float32", "float16", "bfloat16"}
    assert set(new["StatelessRandomUniformV2"]) == {"bfloat16"}


def test_open_plugin_plan_never_duplicates_a_registration():
    rows = gap_kernels.plan("metal_plugin", enabled=True)
    planned = gap_kernels.registered(rows)
    for op, dtypes in planned.items():
        dtype_attr = open_plugin.DTYPE_ATTR.get(op, "T")
        assert dtype_attr == gap_kernels.GAP_KERNELS[op].dtype_attr or op not in open_plugin.KERNELS
        for d in dtypes:
            assert d not in open_plugin.KERNELS.get(op, ()), (op, d)
            if op in metal_plugin.METAL_PLUGIN.host_ops:
                # Ours replaces TensorFlow's device-default kernel, which updates the variable from the host: a
                # kernel registered for the device is chosen before a DEVICE_DEFAULT one (FindKernelRegistration
                # in TF's op_kernel.cc; TF's CUDA build registers both for AssignVariableOp), so no duplicate.
                continue
            assert d not in open_plugin.TF_DEFAULT_KERNELS.get(op, ()), (op, d)
    # REFERENCE.md section 7 / the issue: none of these has a kernel in the open plugin.
    for op in ("DivNoNan", "BroadcastTo", "IsFinite", "Pack", "UnsortedSegmentSum", "StatelessRandomGetKeyCounter",
               "StatelessRandomUniformV2"):
        if op in gap_kernels.GAP_KERNELS:
            assert "float32" in planned.get(op, ()) or "int64" in planned.get(op, ()), op
    # It registers float and half Sigmoid / Elu / Fill (no bfloat16 at all).
    assert planned["Sigmoid"] == ("bfloat16",) and planned["Elu"] == ("bfloat16",)


def test_every_row_has_a_reason_and_the_plan_covers_every_implemented_dtype():
    for key in ("metal", "metal_plugin"):
        rows = gap_kernels.plan(key, enabled=True)
        assert {(r.op, r.dtype) for r in rows} == {
            (op, d) for op, k in gap_kernels.GAP_KERNELS.items() for d in k.dtypes}
        for r in rows:
            assert r.reason
            assert ("has its own kernel" in r.reason) == (not r.registered)


@pytest.mark.parametrize("key", ["cpu", "cpu_onednn", "cuda"])
def test_nothing_is_planned_off_metal(key):
    assert not gap_kernels.registered(gap_kernels.plan(key, enabled=True))


def test_another_release_or_turned_off_registers_nothing(monkeypatch):
    rows = gap_kernels.plan("metal_plugin", installed="0.5.0", enabled=True)
    assert not gap_kernels.registered(rows)
    assert "0.5.0 is installed" in rows[0].reason and "registered twice" in rows[0].reason
    assert not gap_kernels.registered(gap_kernels.plan("metal_plugin", enabled=False))
    monkeypatch.setenv(gap_kernels.ENABLE_ENV, "0")
    assert not gap_kernels.registered(gap_kernels.plan("metal_plugin"))


def test_bad_macos():
    with pytest.raises(ValueError, match="Received: macos='thirteen'"):
        gap_kernels.plan("metal", macos="thirteen")


def test_covers_checks_every_type_attribute():
    table = registry.table("metal_plugin")
    assert gap_kernels.covers(table, "Fill", {"T": "bfloat16", "index_type": "int64"})
    assert not gap_kernels.covers(table, "Fill", {"T": "bfloat16", "index_type": "int16"})
    assert not gap_kernels.covers(table, "Fill", {"T": "float64", "index_type": "int32"})
    assert gap_kernels.covers(table, "IsFinite", {"T": "float16"})
    assert not gap_kernels.covers(table, "Sigmoid", {"T": "float16"})  # the plugin has its own
    assert not gap_kernels.covers(table, "MatMul", {"T": "float32"})  # not ours


# ----------------------------------------------------------------------------
# The loader hands the plan over; status() reports it.


def _as_mac(monkeypatch, dist, version, macos="15.1"):
    from tfmetal_ext import devices

    monkeypatch.setattr(devices, "_metal_plugins", lambda: {dist: version})
    monkeypatch.setattr(devices, "_macos_version", lambda: macos)


def test_the_loader_writes_the_plan_for_the_installed_backend(monkeypatch):
    _as_mac(monkeypatch, "tensorflow-metal-plugin", open_plugin.PIN)
    lines = _loader.gap_plan_text().splitlines()
    assert lines[0] == "tensorflow-metal-plugin"
    assert "IsFinite|T=float32,float16,bfloat16" in lines
    assert "Fill|T=bfloat16,bool|index_type=int32,int64|host=dims,value" in lines
    _as_mac(monkeypatch, "tensorflow-metal-plugin", "0.9.0")
    assert _loader.gap_plan_text() == "tensorflow-metal-plugin\n"  # another release: nothing
    from tfmetal_ext import devices

    monkeypatch.setattr(devices, "_metal_plugins", lambda: {})
    assert _loader.gap_plan_text() == ""


def test_import_loads_the_library_only_on_a_mac_with_a_plan(monkeypatch):
    calls = []
    monkeypatch.setattr(_loader, "load", lambda: calls.append(1))
    monkeypatch.setattr(_loader, "is_macos_arm", lambda: False)
    _as_mac(monkeypatch, "tensorflow-metal", apple.PIN)
    assert not _loader.load_for_gap_kernels() and not calls
    monkeypatch.setattr(_loader, "is_macos_arm", lambda: True)
    assert _loader.load_for_gap_kernels() and calls == [1]
    monkeypatch.setenv(gap_kernels.ENABLE_ENV, "0")
    assert not _loader.load_for_gap_kernels() and calls == [1]


def test_status_merges_the_plan_with_what_the_host_code_recorded(monkeypatch):
    _as_mac(monkeypatch, "tensorflow-metal-plugin", open_plugin.PIN)
    records = {
        "IsFinite[float32]": _loader.GpuRegistration("IsFinite[float32]", True, "tensorflow-metal-plugin", None),
        "IsFinite[float16]": _loader.GpuRegistration("IsFinite[float16]", False, "tensorflow-metal-plugin",
                                                     "GPU kernel registration failed: boom"),
    }
    rows = {(r["op"], r["dtype"]): r for r in status_mod._gap_rows(True, False, None, True, records)}
    assert rows[("IsFinite", "float32")]["registered"]
    assert rows[("IsFinite", "float16")]["reason"] == "GPU kernel registration failed: boom"
    assert "recorded no registration" in rows[("IsFinite", "bfloat16")]["reason"]
    assert rows[("Sigmoid", "float32")]["reason"].endswith("has its own kernel")
    not_loaded = status_mod._gap_rows(False, False, "no compiler", False, None)
    assert all(not r["registered"] for r in not_loaded)
    text = "\n".join(status_mod.gap_lines(tuple(rows.values())))
    assert "gap kernels registered (1): IsFinite[float32]" in text and "boom" in text


def test_status_off_a_mac_says_why_none_is_registered():
    st = status_mod.status(load=False)
    assert st.gap_kernels and not any(r["registered"] for r in st.gap_kernels)
    assert "gap kernels: none registered" in str(st)


# ----------------------------------------------------------------------------
# Prediction counts an op our gap kernel covers as on the device.


@pytest.fixture
def dropout_model():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="sigmoid"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((4, 8), dtype=np.float32)
    y = np.array([0, 1, 2, 0])
    return model, x, y


@pytest.mark.parametrize("predict_for", ["tensorflow-metal-plugin", "tensorflow-metal"])
def test_prediction_counts_gap_kernels_on_the_device(dropout_model, predict_for):
    model, x, y = dropout_model
    alone = inspect.placement_report(model, x, targets=y, mode="train", predict_for=predict_for, gap_kernels=False)
    ours = inspect.placement_report(model, x, targets=y, mode="train", predict_for=predict_for)
    missing_alone = {e.op for e in alone.missing}
    # Both backends lack IsFinite (loss scaling under mixed_float16) and StatelessRandomGetKeyCounter (Dropout).
    assert {"IsFinite", "StatelessRandomGetKeyCounter"} <= missing_alone
    covered = {e.op for e in ours.gap_kernels}
    assert "IsFinite" in covered
    assert ("StatelessRandomGetKeyCounter" in covered) == ("StatelessRandomGetKeyCounter" in gap_kernels.GAP_KERNELS)
    if predict_for == "tensorflow-metal":  # float32-only Sigmoid there: the half sigmoid and its gradient are ours
        assert {"Sigmoid", "SigmoidGrad"} <= covered and {"Sigmoid", "SigmoidGrad"} <= missing_alone
    assert not covered & {e.op for e in ours.missing}
    assert all(e.outcome == predict.GAP and "tfmetal_ext gap kernel" in e.reason for e in ours.gap_kernels)
    assert len(ours.missing) < len(alone.missing)
    assert ours.transfer_count <= alone.transfer_count
    assert "on the GPU through tfmetal_ext gap kernels" in str(ours)


def test_gap_kernels_flag_is_for_predictions_only(dropout_model):
    model, x, y = dropout_model
    with pytest.raises(ValueError, match="Received: gap_kernels=False"):
        inspect.placement_report(model, x, targets=y, mode="train", gap_kernels=False)


# ----------------------------------------------------------------------------
# The doctor's self-test of the registered gap kernels (GPU against TF's CPU kernel).


def _gap_check():
    from tfmetal_ext.doctor import checks

    return checks.REGISTRY["gap_kernels"]


def test_selftest_has_a_case_for_every_gap_kernel_and_each_runs_on_the_cpu():
    import tensorflow as tf

    cases = _gap_check().case()
    assert set(cases) >= set(gap_kernels.GAP_KERNELS)
    for op, kernel in gap_kernels.GAP_KERNELS.items():
        for dtype in kernel.dtypes:
            fn, kwargs = cases[op](dtype)
            out = fn(**kwargs)  # TF's own CPU kernel accepts the case
            first = tf.nest.flatten(out)[0]
            assert first.dtype != tf.resource, op


def _all_registered(monkeypatch):
    from tfmetal_ext import ops

    rows = tuple({"op": op, "dtype": d, "registered": True, "reason": ""}
                 for op, k in gap_kernels.GAP_KERNELS.items() for d in k.dtypes)
    real = ops.status

    def fake(load=True):
        import dataclasses

        return dataclasses.replace(real(load=False), gap_kernels=rows)

    monkeypatch.setattr(ops, "status", fake)
    return rows


def test_selftest_passes_when_the_device_agrees_and_fails_when_it_does_not(monkeypatch):
    from tfmetal_ext.doctor import runner

    rows = _all_registered(monkeypatch)
    # A "GPU" device string: off a Mac TensorFlow places it on the CPU (soft placement), so GPU == CPU here.
    ok = runner._run_gap(_gap_check(), ("float32",), "/GPU:0", faulty=False)
    assert ok.status == runner.PASS and f"{len(rows)} gap kernels agree" in ok.detail
    bad = runner._run_gap(_gap_check(), ("float32",), "/GPU:0", faulty=True)
    assert bad.status == runner.FAIL and "TFMETAL_EXT_GAP_KERNELS_ENABLE=0" in bad.fix


def test_selftest_skips_without_a_gpu():
    from tfmetal_ext.doctor import runner

    result = runner._run_gap(_gap_check(), ("float32",), "/device:CPU:0", faulty=False)
    assert result.status == runner.SKIP


def test_gap_compare_tolerates_only_rounding():
    from tfmetal_ext.doctor import runner

    want = np.array([1.0, np.nan, np.inf, -2.0], np.float32)
    assert runner._gap_compare(want.copy(), want, "float32") is None
    assert runner._gap_compare(want * (1 + 2e-6), want, "float32") is None  # a few ulps
    assert runner._gap_compare(want * 1.01, want, "float32")
    assert "NaN" in runner._gap_compare(np.array([1.0, 0.0, np.inf, -2.0], np.float32), want, "float32")
    assert runner._gap_compare(np.array([True, False]), np.array([True, True]), "bool") == "values differ"


def test_variable_gap_kernels_stay_unregistered_where_tensorflow_exports_the_c_api():
    import tensorflow as tf

    # TF 2.19 exports the resource-variable kernel C API, TF 2.20 and 2.21 do not (tensorflow/tensorflow#126374).
    exported = gap_kernels.variable_api_exported()
    assert exported == (tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 20))
    host_ops = metal_plugin.METAL_PLUGIN.host_ops
    without = gap_kernels.plan("metal_plugin", enabled=True)
    with_api = gap_kernels.plan("metal_plugin", enabled=True, variable_api=True)
    ours = [r for r in without if r.op in host_ops]
    assert {r.op for r in ours} == {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}
    assert all(r.registered for r in ours)  # the table's TF (2.21): ours run them
    for a, b in zip(without, with_api):
        if a.op in host_ops:  # the plugin registers its own there: two matching kernels fail the op
            assert not b.registered and "exports the resource-variable kernel C API" in b.reason
        else:
            assert b == a
    # Apple's table has its own variable kernels, with or without the C API.
    assert not [r for r in gap_kernels.plan("metal", enabled=True) if r.op in host_ops and r.registered]
