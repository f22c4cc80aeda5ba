"""tfmetal_ext.doctor and `tfmetal-ext doctor`: environment report, self-test, fault injection."""

import dataclasses
import functools
import json
import os
import platform
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmetal_ext
from tfmetal_ext import cli, devices, doctor, precision, testing
from tfmetal_ext.backends import fusion
from tfmetal_ext.doctor import checks
from tfmetal_ext.ops import _reference


@pytest.fixture(scope="module")
def healthy():
    """One self-test run of every check on this machine, without injected faults."""
    return doctor.selftest()


@pytest.fixture
def faulty_selftest(monkeypatch):
    """Makes `doctor.selftest` (as the CLI calls it) inject faults into the named checks."""

    def inject(*names):
        monkeypatch.setattr(doctor, "selftest", functools.partial(doctor.selftest, faults=names))

    return inject


@pytest.fixture
def clear_avoided():
    yield
    tfmetal_ext.configure("float32", avoid_fusions=())


# ----------------------------------------------------------------------------
# collect()


def test_collect_reports_this_install():
    info = doctor.collect()
    assert info.tensorflow == tf.__version__ and info.keras == keras.__version__
    assert info.python == platform.python_version()
    assert info.tfmetal_ext == tfmetal_ext.__version__
    assert info.backend in devices.BACKENDS
    types = {d["device_type"] for d in info.physical_devices}
    assert "CPU" in types
    assert ("GPU" in types) == bool(tf.config.list_physical_devices("GPU"))
    assert info.onednn == devices.capabilities().onednn
    assert info.config["policy"] == precision.recommend().policy
    assert info.config["reasons"] and all(isinstance(r, str) for r in info.config["reasons"])
    assert {"built", "loaded", "library", "tf_version", "metal_kernels", "error"} <= set(info.ops)
    if info.ops["loaded"]:
        assert info.ops["tf_version"] == tf.__version__ and os.path.isfile(info.ops["library"])
    assert info.avoided_fusions == []


def test_collect_changes_nothing():
    keras.mixed_precision.set_global_policy("float32")
    before = (precision.avoided_fusions(), precision._last_config)
    info = doctor.collect()
    assert keras.mixed_precision.global_policy().name == "float32" == info.global_policy
    assert (precision.avoided_fusions(), precision._last_config) == before


def test_collect_str_and_json_round_trip():
    info = doctor.collect()
    text = str(info)
    for section in ("Versions", "Devices", "configure() would choose", "Custom ops"):
        assert f"\n{section}\n" in text
    assert re.search(rf"^  tensorflow +{re.escape(tf.__version__)}$", text, re.M)
    assert re.search(r"^  oneDNN +(on|off)$", text, re.M)
    data = info.to_dict()
    assert json.loads(json.dumps(data)) == data


def test_collect_gives_the_pairing_fix(monkeypatch):
    caps = devices.capabilities()
    broken = devices.Capabilities(**{
        **caps.to_dict(), "metal_plugin_version": "1.2.0", "pairing": devices.KNOWN_BROKEN,
        "pairing_fix": devices.FIX_PAIRING_COMMAND,
    })
    monkeypatch.setattr(devices, "capabilities", lambda: broken)
    info = doctor.collect()
    assert info.pairing == "known-broken" and info.pairing_fix == devices.FIX_PAIRING_COMMAND
    assert devices.FIX_PAIRING_COMMAND in str(info)


def test_collect_lists_avoided_fusions(clear_avoided):
    tfmetal_ext.configure("float32", avoid_fusions=["matmul_bias_relu"])
    info = doctor.collect()
    assert info.avoided_fusions == ["matmul_bias_relu"]
    assert "matmul_bias_relu" in str(info)


# ----------------------------------------------------------------------------
# selftest() on this machine


def test_selftest_passes_here(healthy):
    assert [c.name for c in healthy.checks] == list(doctor.CHECKS)
    assert healthy.passed and healthy.failed_patterns == ()
    for c in healthy.checks:
        assert c.status in ("PASS", "SKIP"), c
        if c.status == "SKIP":
            assert c.detail and c.fix, c
        elif c.name not in ("cpu_fallback", "metal_pairing"):
            assert 0 <= c.max_abs_err <= c.tolerance, c
            assert "float32" in c.dtypes
    assert healthy.device == (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))[0].name


def test_selftest_reports_what_fused(healthy):
    # Conv2D + BiasAdd + Relu fuses on CPU with and without oneDNN, and on GPUs.
    assert healthy.check("conv_bias_relu").fused.startswith("_FusedConv2D[BiasAdd")
    if healthy.check("softshrink").status == "PASS":
        assert fusion.SOFTSHRINK_OP in healthy.check("softshrink").fused


def test_selftest_matmul_fuses_on_cpu(healthy):
    # MatMul + BiasAdd + Relu fuses in float32 on every CPU (TF's own kernels and oneDNN's).
    assert healthy.check("matmul_bias_relu").fused == "_FusedMatMul[BiasAdd, Relu]"


def test_selftest_cpu_fallback_without_gpu(healthy):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is present here: the check lists fallbacks instead")
    assert healthy.check("cpu_fallback").detail.startswith("no GPU present: nothing can fall back")


def test_selftest_str_and_json(healthy):
    text = str(healthy)
    for name in doctor.CHECKS:
        assert any(line.split()[1:2] == [name] for line in text.splitlines()[1:-1]), name
    assert " 0 failed, " in text.splitlines()[-1]
    data = healthy.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["passed"] is True and len(data["checks"]) == len(doctor.CHECKS)


# ----------------------------------------------------------------------------
# The check registry


def test_registry_declares_every_check_once():
    assert doctor.CHECKS == tuple(checks.REGISTRY) == (
        "metal_pairing", "conv_bias_relu", "matmul_bias_relu", "fused_batch_norm", "softshrink", "layer_norm",
        "rms_norm", "batch_norm_act", "rope", "activation_grad", "sparse_softmax_cross_entropy", "gemv", "int8_matmul", "int8_conv2d", "multi_tensor_adam", "multi_tensor_lion",
        "multi_tensor_rmsprop",
        "dropout", "attention", "cpu_fallback", "gap_kernels",
    )
    for name, check in checks.REGISTRY.items():
        assert check.name == name and check.fix and callable(check.case), check


@pytest.mark.parametrize("name", sorted(fusion.SAFE_FORMS))
def test_fixes_come_from_the_safe_forms(name):
    check = checks.REGISTRY[name]
    assert check.fix.startswith(fusion.safe_form_fix(name))
    if name in fusion.CUSTOM_OPS:  # our own op computing wrong values is our bug
        assert check.op is fusion.CUSTOM_OPS[name] and check.fix.endswith(checks.REPORT_IT)
    else:
        assert check.op is None and check.fix == fusion.safe_form_fix(name)


@pytest.mark.parametrize("op", sorted({op for form in fusion.SAFE_FORMS.values() for op in form.implies}))
def test_fallback_fix_of_each_fused_op_is_its_safe_form(op):
    assert checks.fallback_fix(op, "fc") == fusion.safe_form_fix(fusion.safe_form_for_op(op).name)


def test_fallback_fix_of_an_unknown_op_names_the_layer():
    fix = checks.fallback_fix("SomeOp", "fc")
    assert fix.startswith("SomeOp has no kernel on this GPU") and "layer fc" in fix


def test_one_registration_adds_a_check(monkeypatch):
    monkeypatch.setattr(checks, "REGISTRY", dict(checks.REGISTRY))

    @checks.register("square", fix="nothing to fix")
    def square(dtype):
        x = tf.constant([[1.0, -2.0, 3.0]], dtype)
        return (lambda x: x * x), (x,), np.array([[1.0, 4.0, 9.0]])

    result = doctor.selftest(checks=["square"], faults=["square"])
    assert result.check("square").status == "FAIL" and result.check("square").fix == "nothing to fix"
    assert result.failed_patterns == ()  # no safe form: nothing for configure()
    assert doctor.selftest(checks=["square"]).check("square").status == "PASS"


def test_register_rejects_duplicates_and_checks_without_fix(monkeypatch):
    monkeypatch.setattr(checks, "REGISTRY", dict(checks.REGISTRY))
    with pytest.raises(ValueError, match=r"registered already.*Received: name='softshrink'"):
        checks.register("softshrink")(lambda dtype: None)
    with pytest.raises(ValueError, match=r"no safe form.*Received: fix=None"):
        checks.register("new_pattern")
    with pytest.raises(ValueError, match=r"Received: kind='graph'"):
        checks.register("new_pattern", kind="graph", fix="-")
    assert "new_pattern" not in checks.REGISTRY


class _WrongSoftshrinkLibrary:
    """An op library whose softshrink kernels shrink by 0.6 whatever `lambd` they are given."""

    @staticmethod
    def tfmetal_ext_softshrink(x, lambd):
        return _reference.softshrink(x, 0.6)

    @staticmethod
    def tfmetal_ext_softshrink_grad(dy, x, lambd):
        return _reference.softshrink_grad(dy, x, 0.6)


def test_miscomputing_custom_op_fails_by_its_error(monkeypatch):
    from tfmetal_ext.ops import _common, _loader

    monkeypatch.delenv("TFMETAL_EXT_REFERENCE_OPS", raising=False)
    monkeypatch.setattr(_loader, "load", lambda: _WrongSoftshrinkLibrary)
    monkeypatch.setattr(_common, "kernel_for_visible_devices", lambda op_name, device_type="GPU": True)
    _, (x, dy), _ = checks.REGISTRY["softshrink"].case("float32")
    x, dy, lambd = np.asarray(x, np.float64), np.asarray(dy, np.float64), checks.SOFTSHRINK_LAMBDA
    want = max(
        np.abs(testing.np_softshrink(x, 0.6) - testing.np_softshrink(x, lambd)).max(),
        np.abs(testing.np_softshrink_grad(dy, x, 0.6) - testing.np_softshrink_grad(dy, x, lambd)).max(),
    )
    check = doctor.selftest(checks=["softshrink"]).check("softshrink")
    assert check.status == "FAIL" and check.fused is None, check
    assert check.fix.startswith(fusion.safe_form_fix("softshrink"))
    if check.dtypes == ("float32",):  # on Metal and CUDA the float16 run may be the worst
        assert check.max_abs_err == pytest.approx(want, rel=1e-5)
    else:
        assert check.max_abs_err > check.tolerance


# ----------------------------------------------------------------------------
# Fault injection (the test hook) and failures


@pytest.mark.parametrize("name", doctor.CHECKS)
def test_injected_fault_fails_exactly_that_check(monkeypatch, name):
    other = "matmul_bias_relu" if name == "conv_bias_relu" else "conv_bias_relu"
    result = doctor.selftest(checks=[name, other], faults=[name])
    failed = result.check(name)
    if failed.status == "SKIP":  # a custom op without the library: nothing but the reference to check
        pytest.skip(f"{name} skipped here: {failed.detail}")
    assert failed.status == "FAIL" and failed.fix, failed
    assert result.check(other).status == "PASS"
    assert not result.passed
    assert "fault injected by selftest(faults=...)" in failed.detail
    if name in fusion.SAFE_FORMS:
        assert failed.max_abs_err > failed.tolerance
        assert f"avoid_fusions=[{name!r}]" in failed.fix
        assert result.failed_patterns == (name,)
    else:
        assert result.failed_patterns == ()
    text = str(result)
    assert f"FAIL  {name}" in text and f"fix: {failed.fix}" in text


def test_custom_op_failure_fix_says_report_it():
    check = doctor.selftest(checks=["layer_norm"], faults=["layer_norm"]).check("layer_norm")
    if check.status == "SKIP":
        pytest.skip(check.detail)
    assert "avoid_fusions=['layer_norm']" in check.fix and "report it" in check.fix


def test_attention_check_passes_and_catches_a_fault():
    check = doctor.selftest(checks=["attention"]).check("attention")
    assert check.status == "PASS", check
    assert fusion.ATTENTION_OP in check.fused
    faulty = doctor.selftest(checks=["attention"], faults=["attention"]).check("attention")
    assert faulty.status == "FAIL" and "avoid_fusions=['attention']" in faulty.fix and "report it" in faulty.fix


def test_rms_norm_check_passes_and_catches_a_fault():
    check = doctor.selftest(checks=["rms_norm"]).check("rms_norm")
    assert check.status == "PASS", check
    assert fusion.RMS_NORM_OP in check.fused
    faulty = doctor.selftest(checks=["rms_norm"], faults=["rms_norm"]).check("rms_norm")
    assert faulty.status == "FAIL" and "avoid_fusions=['rms_norm']" in faulty.fix


def test_batch_norm_act_check_passes_and_catches_a_fault():
    check = doctor.selftest(checks=["batch_norm_act"]).check("batch_norm_act")
    assert check.status == "PASS", check
    assert fusion.BATCH_NORM_ACT_OP in check.fused and fusion.BATCH_NORM_ACT_GRAD_OP in check.fused
    faulty = doctor.selftest(checks=["batch_norm_act"], faults=["batch_norm_act"]).check("batch_norm_act")
    assert faulty.status == "FAIL" and "avoid_fusions=['batch_norm_act']" in faulty.fix and "report it" in faulty.fix


def test_activation_grad_check_passes_and_catches_a_fault():
    check = doctor.selftest(checks=["activation_grad"]).check("activation_grad")
    assert check.status == "PASS", check
    assert fusion.ACTIVATION_GRAD_OP in check.fused
    faulty = doctor.selftest(checks=["activation_grad"], faults=["activation_grad"]).check("activation_grad")
    assert faulty.status == "FAIL" and "avoid_fusions=['activation_grad']" in faulty.fix and "report it" in faulty.fix


def test_dropout_check_passes_and_catches_a_fault():
    check = doctor.selftest(checks=["dropout"]).check("dropout")
    assert check.status == "PASS", check
    assert fusion.DROPOUT_OP in check.fused and fusion.DROPOUT_GRAD_OP in check.fused
    faulty = doctor.selftest(checks=["dropout"], faults=["dropout"]).check("dropout")
    assert faulty.status == "FAIL" and "avoid_fusions=['dropout']" in faulty.fix and "report it" in faulty.fix


@pytest.mark.parametrize("bad", [["matmul_bias_relu", "nope"], "matmul_bias_relu"])
def test_bad_faults_argument(bad):
    with pytest.raises(ValueError, match=r"`faults`.*metal_pairing.*conv_bias_relu.*cpu_fallback.*Received: faults="):
        doctor.selftest(checks=["conv_bias_relu"], faults=bad)


def test_library_reads_no_fault_env(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_SELFTEST_FAULT", "conv_bias_relu")
    assert doctor.selftest(checks=["conv_bias_relu"]).check("conv_bias_relu").status == "PASS"


@pytest.mark.parametrize("bad", [["nope"], "conv_bias_relu", 3])
def test_bad_checks_argument(bad):
    with pytest.raises(ValueError, match=r"Received: checks="):
        doctor.selftest(checks=bad)


def test_crashing_check_fails_with_fix(monkeypatch):
    def broken(dtype):
        raise RuntimeError("no kernel")

    monkeypatch.setitem(
        checks.REGISTRY, "matmul_bias_relu", dataclasses.replace(checks.REGISTRY["matmul_bias_relu"], case=broken)
    )
    check = doctor.selftest(checks=["matmul_bias_relu"]).check("matmul_bias_relu")
    assert check.status == "FAIL" and "RuntimeError: no kernel" in check.detail
    assert "avoid_fusions=['matmul_bias_relu']" in check.fix


def test_custom_op_checks_skip_without_library(monkeypatch):
    from tfmetal_ext.ops import _loader

    monkeypatch.setattr(_loader, "load", lambda: None)
    result = doctor.selftest(checks=["softshrink", "layer_norm", "rms_norm", "multi_tensor_adam", "multi_tensor_lion",
                                     "multi_tensor_rmsprop", "attention", "dropout", "batch_norm_act",
                                     "activation_grad"])
    for c in result.checks:
        assert c.status == "SKIP" and c.fix == "tfmetal-ext build-ops" and "not loaded" in c.detail
    assert result.passed


def test_custom_op_checks_skip_with_forced_reference(monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_REFERENCE_OPS", "1")
    check = doctor.selftest(checks=["softshrink"]).check("softshrink")
    assert check.status == "SKIP" and "TFMETAL_EXT_REFERENCE_OPS" in check.detail


def test_failed_result_feeds_configure(clear_avoided):
    result = doctor.selftest(checks=["matmul_bias_relu", "cpu_fallback"], faults=["matmul_bias_relu", "cpu_fallback"])
    cfg = tfmetal_ext.configure("float32", avoid_fusions=result)
    assert cfg.avoided_fusions == ("matmul_bias_relu",)
    assert precision.avoided_fusions() == {"matmul_bias_relu"}


@pytest.mark.metal
def test_selftest_on_metal_runs_float16_and_checks_matmul(healthy):
    assert healthy.device.endswith("GPU:0")
    for name in ("conv_bias_relu", "matmul_bias_relu", "fused_batch_norm"):
        assert healthy.check(name).dtypes == ("float32", "float16")
    # The known Metal miscompute: if it is there, the fix must be the safe form.
    check = healthy.check("matmul_bias_relu")
    assert check.status == "PASS" or "avoid_fusions=['matmul_bias_relu']" in check.fix


# ----------------------------------------------------------------------------
# The Metal backend: which plugin, its pairing and fixes, both installed, the self-test naming it

APPLE, PLUGIN = "tensorflow-metal", "tensorflow-metal-plugin"
# The published commands (REFERENCE.md sections 4 and 7; the plugin's README install section).
UNINSTALL_APPLE = "pip uninstall -y tensorflow-metal"
UNINSTALL_PLUGIN = "pip uninstall -y tensorflow-metal-plugin"
INSTALL_PLUGIN = "pip install --no-cache-dir tensorflow-metal-plugin==0.4.1"
APPLE_ROUTE = 'pip install "tensorflow>=2.16,<2.20" "tensorflow-metal==1.2.*"'

# What another part of the package fills in the open plugin's table: fixed stand-ins here, so the test
# checks that the doctor prints the table's entries, whatever they are.
_LAYERS = {"LSTM": "emits CudnnRNNV3: no kernel on the plugin and none on the CPU; use FusedLSTM"}
_HOST_OPS = {"ResourceApplyAdam": "not registered on TF 2.21 (kernel C API missing)",
             "ResourceApplyKerasMomentum": "not registered on TF 2.21 (kernel C API missing)"}


@pytest.fixture
def mac(monkeypatch, request):
    """A Mac with the given Metal plugins installed: probes replaced, op library state fixed."""
    from tfmetal_ext import backends
    from tfmetal_ext.doctor import report

    real_table = backends.table

    def table(key):
        t = real_table(key)
        if key == "metal_plugin":
            return dataclasses.replace(t, unsupported_layers=_LAYERS, host_ops=_HOST_OPS)
        return t

    monkeypatch.setattr(backends, "table", table)
    monkeypatch.setattr(report, "_ops_info", lambda: {
        "built": True, "loaded": True, "library": "/x/lib.so", "tf_version": tf.__version__, "metal_kernels": True,
        "reference_forced": False, "error": None, "metal_backend": PLUGIN,
        "kernels": {"softshrink": {"cpu": True, "gpu": False, "gpu_reason": "stream type not recognised"},
                    "layer_norm": {"cpu": True, "gpu": True, "gpu_reason": None}},
    })

    def set_mac(plugins, tf_version="2.21.0", python="3.12.8", macos="15.3"):
        monkeypatch.setattr(devices, "_platform", lambda: ("Darwin", "arm64"))
        monkeypatch.setattr(devices, "_gpu_devices", lambda: ["/physical_device:GPU:0"])
        monkeypatch.setattr(devices, "_metal_plugins", lambda: dict(plugins))
        monkeypatch.setattr(devices, "_python_version", lambda: python)
        monkeypatch.setattr(devices, "_macos_version", lambda: macos)
        monkeypatch.setattr(devices, "_metal_library_owner", lambda: None)
        monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset())
        monkeypatch.setattr(tf, "__version__", tf_version)
        devices.invalidate_capabilities()
        request.addfinalizer(devices.invalidate_capabilities)

    return set_mac


def _section(text, title):
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


def test_doctor_on_the_open_plugin(mac):
    mac({PLUGIN: "0.4.1"})
    info = doctor.collect()
    assert (info.metal_plugin, info.tensorflow_metal, info.pairing) == (PLUGIN, "0.4.1", "known-good")
    assert info.errors == [] and info.pairing_fixes == []
    text = str(info)
    metal = _section(text, "Metal backend")
    assert "tensorflow-metal-plugin 0.4.1 (the open plugin)" in metal and "known-good" in metal
    # The table's notes, printed as they are: stock LSTM fails there, ResourceApply* on the host.
    assert "LSTM: emits CudnnRNNV3" in metal
    assert re.search(r"on the host.*ResourceApplyAdam, ResourceApplyKerasMomentum: not registered on TF 2.21", metal)
    assert "\nErrors\n" not in text
    # The op library's per-op GPU reason.
    ops = _section(text, "Custom ops")
    assert "softshrink: stream type not recognised" in ops and "layer_norm:" not in ops
    assert "bound to tensorflow-metal-plugin" in ops


def test_doctor_says_which_host_ops_our_gap_kernels_take_to_the_gpu(mac, monkeypatch):
    from tfmetal_ext import backends

    mac({PLUGIN: "0.4.1"})
    real_table = backends.table
    host = {**_HOST_OPS, "AssignAddVariableOp": _HOST_OPS["ResourceApplyAdam"]}
    monkeypatch.setattr(backends, "table", lambda key: dataclasses.replace(real_table(key), host_ops=host)
                        if key == "metal_plugin" else real_table(key))
    metal = _section(str(doctor.collect()), "Metal backend")
    # ResourceApply* stay on the host; AssignAddVariableOp has our gap kernel (tfmetal_ext.backends.gap_kernels).
    assert re.search(r"on the host, not the GPU.*: ResourceApplyAdam, ResourceApplyKerasMomentum: not registered",
                     metal), metal
    assert re.search(r"on the host with tensorflow-metal-plugin alone .* on the GPU through tfmetal_ext's gap "
                     r"kernels: AssignAddVariableOp", metal), metal
    monkeypatch.setenv("TFMETAL_EXT_GAP_KERNELS_ENABLE", "0")  # turned off: all of them on the host again
    metal = _section(str(doctor.collect()), "Metal backend")
    assert "ResourceApplyKerasMomentum, AssignAddVariableOp: not registered" in metal, metal


def test_doctor_on_apple_plugin_known_good(mac):
    mac({APPLE: "1.2.0"}, tf_version="2.19.1", python="3.12.8")
    info = doctor.collect()
    assert (info.metal_plugin, info.pairing, info.errors) == (APPLE, "known-good", [])
    metal = _section(str(info), "Metal backend")
    assert "tensorflow-metal 1.2.0 (Apple's)" in metal
    # Apple's table records no unsupported layers or host ops; the one note is its train-step kernel gaps
    # (REFERENCE.md 10: no Einsum or IsFinite kernel; Sigmoid float32 only).
    notes = [line for line in metal.splitlines() if "CPU fallbacks in an ordinary train step" in line]
    assert len(notes) == 1 and "no kernel for Einsum" in notes[0] and "IsFinite" in notes[0], metal
    assert "Sigmoid" in notes[0] and "LSTM" not in metal and "on the host" not in metal


def test_doctor_on_apple_plugin_with_tf_2_21_gives_both_routes(mac):
    mac({APPLE: "1.2.0"}, tf_version="2.21.0", python="3.12.8")
    info = doctor.collect()
    assert info.pairing == "known-broken" and len(info.errors) == 1
    assert [f["commands"] for f in info.pairing_fixes] == [[UNINSTALL_APPLE, INSTALL_PLUGIN], [APPLE_ROUTE]]
    text = str(info)
    assert "\nErrors\n" in text
    metal = _section(text, "Metal backend")
    lines = [line.strip() for line in metal.splitlines()]
    # Each command on its own line, in order, the plugin route first.
    assert lines.index(UNINSTALL_APPLE) < lines.index(INSTALL_PLUGIN) < lines.index(APPLE_ROUTE)
    assert json.loads(json.dumps(info.to_dict()))["pairing_fixes"][0]["commands"][1] == INSTALL_PLUGIN


def test_doctor_on_python_3_13_with_apple_plugin_offers_only_the_open_plugin(mac):
    mac({APPLE: "1.2.0"}, tf_version="2.21.0", python="3.13.1")
    info = doctor.collect()
    assert info.pairing == "known-broken"
    assert [f["commands"] for f in info.pairing_fixes] == [[UNINSTALL_APPLE, INSTALL_PLUGIN]]


def test_doctor_on_macos_14_with_the_open_plugin(mac):
    mac({PLUGIN: "0.4.1"}, macos="14.6")
    info = doctor.collect()
    assert info.pairing == "known-broken" and "macOS 15" in info.pairing_reason
    assert info.pairing_fixes[0]["commands"] == [UNINSTALL_PLUGIN, APPLE_ROUTE]


def test_doctor_both_installed_is_an_error_with_the_fix(mac):
    mac({APPLE: "1.2.0", PLUGIN: "0.4.1"})
    info = doctor.collect()
    assert info.pairing == "both-installed" and info.metal_plugins == {APPLE: "1.2.0", PLUGIN: "0.4.1"}
    assert info.errors and "both-installed" in info.errors[0] and UNINSTALL_APPLE in info.errors[0]
    text = str(info)
    assert "\nErrors\n" in text and "both installed: an error" in _section(text, "Metal backend")
    # TF 2.21: keep the plugin (uninstall Apple's, rebuild the plugin: both own the same dylib).
    assert info.pairing_fixes[0]["commands"][0] == UNINSTALL_APPLE
    result = doctor.selftest(checks=["metal_pairing"])
    check = result.check("metal_pairing")
    assert check.status == "FAIL" and not result.passed
    assert check.fix.startswith(UNINSTALL_APPLE) and "both-installed" in check.detail


def test_selftest_metal_pairing_fails_on_a_broken_pairing(mac):
    mac({PLUGIN: "0.4.1"}, tf_version="2.20.0")
    check = doctor.selftest(checks=["metal_pairing"]).check("metal_pairing")
    assert check.status == "FAIL" and 'pip install "tensorflow==2.21.0"' in check.fix
    mac({PLUGIN: "0.4.1"}, tf_version="2.21.0")
    assert doctor.selftest(checks=["metal_pairing"]).check("metal_pairing").status == "PASS"


def test_selftest_names_the_open_plugin_and_notes_what_fails_there(mac, monkeypatch):
    from tfmetal_ext.doctor import runner

    mac({PLUGIN: "0.4.1"})
    monkeypatch.setattr(runner, "_device", lambda: "/job:localhost/replica:0/task:0/device:GPU:0")
    result = doctor.selftest(checks=["metal_pairing"])
    assert (result.backend, result.tested) == ("metal", "tensorflow-metal-plugin 0.4.1")
    text = str(result)
    assert text.splitlines()[0].endswith("(backend metal: tested tensorflow-metal-plugin 0.4.1)")
    assert any(line.startswith("  note: LSTM: emits CudnnRNNV3") for line in text.splitlines())
    assert any("note: on the host" in line and "ResourceApplyAdam" in line for line in text.splitlines())
    data = result.to_dict()
    assert data["tested"] == "tensorflow-metal-plugin 0.4.1" and data["metal_plugin_version"] == "0.4.1"


def test_selftest_names_apple_plugin(mac, monkeypatch):
    from tfmetal_ext.doctor import runner

    mac({APPLE: "1.2.0"}, tf_version="2.19.1")
    monkeypatch.setattr(runner, "_device", lambda: "/job:localhost/replica:0/task:0/device:GPU:0")
    result = doctor.selftest(checks=["metal_pairing"])
    assert result.tested == "tensorflow-metal 1.2.0"
    assert len(result.notes) == 2 and result.notes[0].startswith("CPU fallbacks in an ordinary train step"), result.notes
    assert result.notes[1].startswith("tfmetal_ext's gap kernels (registered at import) keep these on the GPU: ")
    # Apple's table has no IsFinite at all (the note groups ops of the same dtypes: "IsFinite, ReverseV2 float32/...")
    assert re.search(r"\bIsFinite(, \w+)* float32/float16/bfloat16[;.]", result.notes[1]), result.notes[1]
    assert result.check("metal_pairing").status == "PASS"


def test_selftest_names_the_cpu_here(healthy):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is present here")
    assert healthy.tested == "CPU" and healthy.notes == []
    assert str(healthy).splitlines()[0].endswith(f"(backend {healthy.backend}: tested CPU)")
    assert healthy.check("metal_pairing").status == "PASS"


# ----------------------------------------------------------------------------
# Command line


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tfmetal_ext.cli", "doctor", *args],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600,
    )


@pytest.mark.full  # the CLI in a subprocess (~6 s); the quick tier keeps the in-process CLI tests below
def test_cli_doctor_text_exits_0():
    proc = _run_cli()
    assert proc.returncode == 0, proc.stderr
    assert "Custom ops" in proc.stdout and tf.__version__ in proc.stdout


def test_cli_doctor_json_parses(capsys):
    # In this process (the entry point in a subprocess of its own is test_cli_doctor_text_exits_0).
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selftest"] is None
    assert data["doctor"]["tensorflow"] == tf.__version__


def test_cli_selftest_with_fault_exits_1(faulty_selftest, capsys):
    faulty_selftest("matmul_bias_relu")
    assert cli.main(["doctor", "--selftest", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["selftest"]["passed"] is False
    assert data["selftest"]["failed_patterns"] == ["matmul_bias_relu"]


def test_cli_selftest_with_fault_prints_fail_and_fix(faulty_selftest, capsys):
    faulty_selftest("cpu_fallback")
    assert cli.main(["doctor", "--selftest"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^  FAIL  cpu_fallback +1 op\(s\) .*InjectedFault \(fc\)", out, re.M)
    assert "fix: InjectedFault has no kernel on this GPU" in out and "1 failed" in out


def test_cli_selftest_in_process_exits_0(capsys):
    assert cli.main(["doctor", "--selftest"]) == 0
    out = capsys.readouterr().out
    assert "Self-test on" in out and "0 failed" in out
