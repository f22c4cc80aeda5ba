import dataclasses
import json

import pytest
import tensorflow as tf

from tfmetal_ext import devices

APPLE, PLUGIN = "tensorflow-metal", "tensorflow-metal-plugin"

# The commands, written out from the published facts (not taken from tfmetal_ext): Apple's route pins
# TF 2.16-2.19 with tensorflow-metal 1.2 (REFERENCE.md section 4); the open plugin 0.4.1 is an sdist built
# against the TF installed first, pinned to TF 2.21.0 (its README's install section, TF_SUPPORTED_VERSION).
APPLE_ROUTE = 'pip install "tensorflow>=2.16,<2.20" "tensorflow-metal==1.2.*"'
UNINSTALL_APPLE = "pip uninstall -y tensorflow-metal"
UNINSTALL_PLUGIN = "pip uninstall -y tensorflow-metal-plugin"
TF_FOR_PLUGIN = 'pip install "tensorflow==2.21.0"'
INSTALL_PLUGIN = "pip install --no-cache-dir tensorflow-metal-plugin==0.4.1"
REBUILD_PLUGIN = "pip install --force-reinstall --no-deps --no-cache-dir tensorflow-metal-plugin==0.4.1"
REINSTALL_APPLE = 'pip install --force-reinstall --no-deps "tensorflow-metal==1.2.*"'


@pytest.fixture
def fake_host(monkeypatch, request):
    """Replaces the hardware probes; returns a setter. The cached capabilities are forgotten on each change."""
    request.addfinalizer(devices.invalidate_capabilities)

    def set_host(system="Linux", machine="x86_64", gpus=(), cuda=False, metal=None, flags=(),
                 plugin=APPLE, plugins=None, python="3.11.9", macos=None, library_owner=None):
        monkeypatch.setattr(devices, "_platform", lambda: (system, machine))
        monkeypatch.setattr(devices, "_gpu_devices", lambda: list(gpus))
        monkeypatch.setattr(devices, "_built_with_cuda", lambda: cuda)
        found = plugins if plugins is not None else ({plugin: metal} if metal else {})
        monkeypatch.setattr(devices, "_metal_plugins", lambda: dict(found))
        monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(devices, "_python_version", lambda: python)
        monkeypatch.setattr(devices, "_macos_version", lambda: macos)
        monkeypatch.setattr(devices, "_metal_library_owner", lambda: library_owner)
        devices.invalidate_capabilities()

    return set_host


def test_backend_metal_is_gpu_on_darwin_arm64(fake_host):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], metal="1.2.0")
    assert devices.backend() == "metal"


def test_backend_cuda(fake_host):
    fake_host("Linux", "x86_64", gpus=["/physical_device:GPU:0"], cuda=True)
    assert devices.backend() == "cuda"


@pytest.mark.parametrize("system,machine", [("Linux", "x86_64"), ("Darwin", "arm64"), ("Darwin", "x86_64")])
def test_backend_cpu_without_gpu(fake_host, system, machine):
    fake_host(system, machine, gpus=[])
    assert devices.backend() == "cpu"


def test_backend_on_this_host_matches_tensorflow():
    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    assert (devices.backend() != "cpu") == has_gpu


# ----------------------------------------------------------------------------
# Apple's tensorflow-metal: every row of the table, as users reported them (tensorflow-metal 1.1/1.2
# threads; REFERENCE.md section 4), written out independently of `backends.pairings.APPLE_PAIRINGS`, on Python 3.11 (1.1 has
# wheels up to cp311, 1.2 up to cp312) and macOS 15.
# Each row: (TF, tensorflow-metal, verdict, the fix routes' commands in order).
APPLE_ROWS = [
    ("2.14.1", "1.1.0", "known-good", []),
    ("2.15.0", "1.1.0", "known-good", []),
    ("2.15.1", "1.1.0", "known-good", []),
    ("2.16.2", "1.2.0", "known-good", []),
    ("2.17.1", "1.2.0", "known-good", []),
    ("2.18.1", "1.2.0", "known-good", []),
    ("2.19.1", "1.2.0", "known-good", []),
    # 2.18.0 + 1.1.0: Apple's route keeps TF 2.18 (first), the plugin's replaces it.
    ("2.18.0", "1.1.0", "known-broken", [[APPLE_ROUTE], [UNINSTALL_APPLE, TF_FOR_PLUGIN, INSTALL_PLUGIN]]),
    # 2.20: neither route keeps it; the plugin's (newer TF) first.
    ("2.20.0", "1.2.0", "known-broken", [[UNINSTALL_APPLE, TF_FOR_PLUGIN, INSTALL_PLUGIN], [APPLE_ROUTE]]),
    # 2.21: the open plugin keeps TF 2.21 (two commands: it builds against the installed TF).
    ("2.21.0", "1.2.0", "known-broken", [[UNINSTALL_APPLE, INSTALL_PLUGIN], [APPLE_ROUTE]]),
    ("2.13.0", "1.2.0", "unknown", []),
    ("2.18.1", "1.1.0", "unknown", []),
    ("2.21.0", None, "not-applicable", []),
]


@pytest.mark.parametrize("tf_version,metal,verdict,routes", APPLE_ROWS)
def test_apple_pairing_verdict_and_fixes(tf_version, metal, verdict, routes):
    check = devices.check_pairing(tf_version, metal, plugin=APPLE, python_version="3.11.9", macos_version="15.3")
    assert check.verdict == verdict
    assert devices.pairing_verdict(tf_version, metal, APPLE, "3.11.9", macos_version="15.3") == verdict
    assert [list(f.commands) for f in check.fixes] == routes
    assert [list(f.commands) for f in devices.pairing_fixes(tf_version, metal, APPLE, "3.11.9", "15.3")] == routes
    for fix in check.fixes:
        assert fix.summary and str(fix).startswith(fix.summary)
    if verdict != "not-applicable":
        assert check.reason


@pytest.mark.parametrize("tf_version,metal,verdict", [(r[0], r[1], r[2]) for r in APPLE_ROWS])
def test_apple_verdict_without_python_or_macos_is_the_table(tf_version, metal, verdict):
    assert devices.pairing_verdict(tf_version, metal) == verdict


# The open plugin 0.4.1 (TF_SUPPORTED_VERSION 2.21.0; its load check compares major.minor), Python 3.12, macOS 15.
PLUGIN_ROWS = [
    ("2.21.0", "0.4.1", "known-good", []),
    ("2.21.0rc1", "0.4.1", "known-good", []),  # a 2.21.0 pre-release is the 2.21.0 headers
    ("2.21.1", "0.4.1", "unknown", []),  # loads (same minor), untested
    # TF 2.20: back to the pin, then rebuild the plugin against it (compiled at install).
    ("2.20.0", "0.4.1", "known-broken", [[TF_FOR_PLUGIN, REBUILD_PLUGIN], [UNINSTALL_PLUGIN, APPLE_ROUTE]]),
    ("2.22.0", "0.4.1", "known-broken", [[TF_FOR_PLUGIN, REBUILD_PLUGIN], [UNINSTALL_PLUGIN, APPLE_ROUTE]]),
    # TF 2.16-2.19: Apple's plugin keeps that TF, so it is first.
    ("2.19.1", "0.4.1", "known-broken", [[UNINSTALL_PLUGIN, APPLE_ROUTE], [TF_FOR_PLUGIN, REBUILD_PLUGIN]]),
    ("2.16.2", "0.4.1", "known-broken", [[UNINSTALL_PLUGIN, APPLE_ROUTE], [TF_FOR_PLUGIN, REBUILD_PLUGIN]]),
    ("2.21.0", "0.3.0", "unknown", []),  # another release: our tables describe 0.4.1
    ("2.21.0", None, "not-applicable", []),
]


@pytest.mark.parametrize("tf_version,metal,verdict,routes", PLUGIN_ROWS)
def test_plugin_pairing_verdict_and_fixes(tf_version, metal, verdict, routes):
    check = devices.check_pairing(tf_version, metal, plugin=PLUGIN, python_version="3.12.8", macos_version="15.3")
    assert check.verdict == verdict
    assert [list(f.commands) for f in check.fixes] == routes
    assert devices.pairing_verdict(tf_version, metal, plugin=PLUGIN) == verdict


def test_plugin_pin_is_the_table_key():
    from tfmetal_ext.backends import metal_plugin

    assert devices.pairing_verdict(metal_plugin.TF_VERSION, metal_plugin.PIN, plugin=PLUGIN) == "known-good"


@pytest.mark.parametrize("python", ["3.13.1", (3, 13), "3.14.0"])
@pytest.mark.parametrize("tf_version", ["2.16.2", "2.19.1", "2.21.0"])
def test_apple_plugin_has_no_wheel_past_cp312(python, tf_version):
    check = devices.check_pairing(tf_version, "1.2.0", plugin=APPLE, python_version=python, macos_version="15.1")
    assert check.verdict == "known-broken" and "cp312" in check.reason
    routes = [list(f.commands) for f in check.fixes]
    if str(python).startswith(("3.13", "(3, 13")):  # only the plugin route: Apple's has no wheel here
        want = [UNINSTALL_APPLE] + ([] if tf_version == "2.21.0" else [TF_FOR_PLUGIN]) + [INSTALL_PLUGIN]
        assert routes == [want]
    else:  # Python 3.14: TF 2.21 has no wheel either (cp310-cp313): a new environment, no command
        assert routes == [[]] and "3.10-3.13" in check.fixes[0].summary


def test_apple_plugin_on_python_3_12_is_the_table():
    assert devices.pairing_verdict("2.19.1", "1.2.0", python_version="3.12.0") == "known-good"
    # 1.1.0 has no cp312 wheel: 1.2 does.
    check = devices.check_pairing("2.15.0", "1.1.0", python_version="3.12.0", macos_version="15.0")
    assert check.verdict == "known-broken"
    assert [list(f.commands) for f in check.fixes][-1] == [APPLE_ROUTE]


def test_plugin_needs_macos_15():
    check = devices.check_pairing("2.21.0", "0.4.1", plugin=PLUGIN, python_version="3.12.1", macos_version="14.6")
    assert check.verdict == "known-broken" and "macOS 15" in check.reason
    # Apple's route (macOS 12+) first; updating macOS is the other route, not a command.
    assert [list(f.commands) for f in check.fixes] == [[UNINSTALL_PLUGIN, APPLE_ROUTE], []]
    assert "macOS to 15" in check.fixes[1].summary
    assert devices.pairing_verdict("2.21.0", "0.4.1", plugin=PLUGIN, macos_version=(15, 0)) == "known-good"
    assert devices.pairing_verdict("2.21.0", "0.4.1", plugin=PLUGIN, macos_version="26.1") == "known-good"


def test_plugin_on_macos_14_and_python_3_13_has_no_metal_route():
    check = devices.check_pairing("2.21.0", "0.4.1", plugin=PLUGIN, python_version="3.13.0", macos_version="14.2")
    assert check.verdict == "known-broken"
    assert [list(f.commands) for f in check.fixes] == [[]] and "macOS" in check.fixes[0].summary


def test_apple_on_macos_14_with_tf_2_21_puts_its_own_route_first():
    check = devices.check_pairing("2.21.0", "1.2.0", python_version="3.12.1", macos_version="14.6")
    assert check.verdict == "known-broken"
    assert [list(f.commands) for f in check.fixes] == [[APPLE_ROUTE], []]


def test_plugin_needs_python_3_10():
    check = devices.check_pairing("2.21.0", "0.4.1", plugin=PLUGIN, python_version="3.9.18")
    assert check.verdict == "known-broken" and "3.10" in check.reason


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"plugin": "tensorflow-metal-nightly"}, r"Received: plugin='tensorflow-metal-nightly'"),
        ({"plugin": None}, r"Received: plugin=None"),
        ({"python_version": "three"}, r"Received: python_version='three'"),
        ({"macos_version": 15.3}, r"Received: macos_version=15.3"),
        ({"tf_version": 2.21}, r"Received: tf_version=2.21"),
        ({"tf_version": "nightly"}, r"Received: tf_version='nightly'"),
        ({"metal_version": 1.2}, r"Received: metal_version=1.2"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"tf_version": "2.21.0", "metal_version": "1.2.0", **kwargs}
    with pytest.raises(ValueError, match=match):
        devices.pairing_verdict(**args)


# ----------------------------------------------------------------------------
# Both plugins installed


@pytest.mark.parametrize(
    "tf_version,python,routes",
    [
        # TF 2.21: keep the open plugin; its dylib (the same file as Apple's) is rebuilt after the uninstall.
        ("2.21.0", "3.12.4", [[UNINSTALL_APPLE, REBUILD_PLUGIN],
                              [UNINSTALL_PLUGIN, 'pip install "tensorflow>=2.16,<2.20"', REINSTALL_APPLE]]),
        # Python 3.13: Apple's has no wheel, only the plugin.
        ("2.21.0", "3.13.0", [[UNINSTALL_APPLE, REBUILD_PLUGIN]]),
        # TF 2.19: keep Apple's.
        ("2.19.1", "3.12.4", [[UNINSTALL_PLUGIN, REINSTALL_APPLE],
                              [UNINSTALL_APPLE, TF_FOR_PLUGIN, REBUILD_PLUGIN]]),
    ],
)
def test_both_installed_is_an_error_with_the_fix(fake_host, monkeypatch, tf_version, python, routes):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], plugins={APPLE: "1.2.0", PLUGIN: "0.4.1"},
              python=python, macos="15.2")
    monkeypatch.setattr(tf, "__version__", tf_version)
    caps = devices.capabilities()
    assert caps.pairing == devices.BOTH_INSTALLED == "both-installed"
    assert caps.metal_plugins == ((APPLE, "1.2.0"), (PLUGIN, "0.4.1"))
    assert [list(f.commands) for f in caps.pairing_fixes] == routes
    assert caps.pairing_fix == " && ".join(routes[0])
    assert caps.metal_plugin == (APPLE if routes[0][0] == UNINSTALL_PLUGIN else PLUGIN)
    assert "libmetal_plugin.dylib" in caps.pairing_reason
    lines = devices.describe_pairing(caps)
    assert any("both installed" in line for line in lines)
    assert f"  {routes[0][0]}" in lines


def _fake_dist(site, dist_name, version, library_bytes, write_library):
    """A dist-info for `dist_name` whose RECORD lists tensorflow-plugins/libmetal_plugin.dylib with these bytes."""
    import base64
    import hashlib

    info = site / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(library_bytes).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(
        f"tensorflow-plugins/libmetal_plugin.dylib,sha256={digest},{len(library_bytes)}\n{info.name}/RECORD,,\n"
    )
    if write_library:
        (site / "tensorflow-plugins").mkdir(exist_ok=True)
        (site / "tensorflow-plugins" / "libmetal_plugin.dylib").write_bytes(library_bytes)


@pytest.mark.parametrize("installed_last", [APPLE, PLUGIN])
def test_both_installed_names_whose_library_is_on_disk(tmp_path, monkeypatch, installed_last):
    import sys

    apple_bytes, plugin_bytes = b"apple's metal plugin", b"the open metal plugin"
    _fake_dist(tmp_path, APPLE, "1.2.0", apple_bytes, installed_last == APPLE)
    _fake_dist(tmp_path, PLUGIN, "0.4.1", plugin_bytes, installed_last == PLUGIN)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    modules = set(sys.modules)
    assert devices._metal_plugins() == {APPLE: "1.2.0", PLUGIN: "0.4.1"}
    assert devices._metal_library_owner() == installed_last
    assert set(sys.modules) == modules  # nothing imported or loaded
    plugin, check = devices.check_installed(devices._metal_plugins(), "2.19.1", "3.12.0",
                                            library_owner=installed_last)
    assert plugin == installed_last and check.verdict == "both-installed"
    assert f"the file on disk is {installed_last}'s" in check.reason
    # The fix still keeps the plugin that fits TF 2.19 (Apple's), whichever file is there now.
    assert check.fixes[0].commands == (UNINSTALL_PLUGIN, REINSTALL_APPLE)


def test_both_installed_is_read_from_metadata_only(monkeypatch):
    import importlib.metadata
    import sys

    seen = []
    versions = {APPLE: "1.2.0", PLUGIN: "0.4.1"}

    def fake_version(name):
        seen.append(name)
        if name in versions:
            return versions[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    modules = set(sys.modules)
    assert devices._metal_plugins() == versions
    assert set(seen) == {APPLE, PLUGIN}
    assert set(sys.modules) == modules  # nothing imported


# ----------------------------------------------------------------------------
# capabilities()


def test_capabilities_metal_host_reports_broken_pairing_with_fix(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], metal="1.2.0", flags={"feat_bf16"},
              python="3.12.8", macos="15.4")
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    assert caps.backend == "metal" and caps.metal_plugin == APPLE
    assert caps.pairing == "known-broken"
    assert caps.pairing_fix == f"{UNINSTALL_APPLE} && {INSTALL_PLUGIN}"
    assert [list(f.commands) for f in caps.pairing_fixes] == [[UNINSTALL_APPLE, INSTALL_PLUGIN], [APPLE_ROUTE]]
    assert (caps.python, caps.macos) == ("3.12.8", "15.4")
    assert caps.cpu_bf16 is True and caps.cpu_fp16 is False


def test_capabilities_python_3_13_with_apple_plugin(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=[], metal="1.2.0", python="3.13.1", macos="15.4")
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    assert caps.pairing == "known-broken"
    assert [list(f.commands) for f in caps.pairing_fixes] == [[UNINSTALL_APPLE, INSTALL_PLUGIN]]


def test_capabilities_open_plugin_on_macos_14(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=[], metal="0.4.1", plugin=PLUGIN, python="3.12.2", macos="14.7")
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    assert caps.metal_plugin == PLUGIN and caps.metal_plugin_version == "0.4.1"
    assert caps.pairing == "known-broken" and "macOS 15" in caps.pairing_reason
    assert caps.pairing_fix == f"{UNINSTALL_PLUGIN} && {APPLE_ROUTE}"


def test_capabilities_open_plugin_known_good(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], metal="0.4.1", plugin=PLUGIN, python="3.13.1",
              macos="15.4")
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    assert caps.pairing == "known-good" and caps.pairing_fix is None and caps.pairing_fixes == ()
    lines = devices.describe_pairing(caps)
    assert lines[0] == "Metal plugin: tensorflow-metal-plugin 0.4.1"
    assert any(line.startswith("pairing: known-good") for line in lines)
    assert not any(line.startswith("fix:") for line in lines)


def test_capabilities_cpu_flags(fake_host):
    fake_host(flags={"avx512_bf16", "avx2"})
    caps = devices.capabilities()
    assert (caps.cpu_bf16, caps.cpu_fp16) == (True, False)
    fake_host(flags={"avx2", "avx_ne_convert"})
    caps = devices.capabilities()
    assert (caps.cpu_bf16, caps.cpu_fp16) == (False, True)
    assert caps.pairing == "not-applicable" and caps.pairing_fix is None
    assert caps.macos is None and caps.metal_plugins == ()


def test_capabilities_of_this_host_are_consistent():
    import platform

    caps = devices.capabilities()
    assert caps.tf_version == tf.__version__
    assert caps.python == platform.python_version()
    assert set(dataclasses.asdict(caps)) >= {"backend", "onednn", "pairing", "cpu_bf16"}
    assert json.loads(json.dumps(caps.to_dict()))["tf_version"] == tf.__version__
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this host")
    assert caps.cpu_bf16 == ("avx512_bf16" in text or "amx_bf16" in text)


@pytest.mark.parametrize("plugin", [APPLE, PLUGIN])
def test_assume_backend_uses_the_pairing_table(plugin):
    with devices.assume_backend(plugin):
        caps = devices.capabilities()
    assert caps.metal_plugin == plugin and caps.backend == "metal"
    assert caps.macos is not None and tuple(int(p) for p in caps.macos.split(".")) >= (15, 0)
    want = devices.pairing_verdict(tf.__version__, caps.metal_plugin_version, plugin, caps.python, caps.macos)
    assert caps.pairing == want
    # TF 2.21 here: the open plugin is at home, Apple's 1.2 does not load.
    if tf.__version__ == "2.21.0":
        assert caps.pairing == ("known-good" if plugin == PLUGIN else "known-broken")
        assert (caps.pairing_fix is None) == (plugin == PLUGIN)
    if tf.__version__.startswith("2.19."):
        assert caps.pairing == ("known-broken" if plugin == PLUGIN else "known-good")


# ----------------------------------------------------------------------------
# setup.py's extras install only known-good pairings


@pytest.fixture
def extras(monkeypatch):
    import os
    import runpy

    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    runpy.run_path(os.path.join(root, "setup.py"))
    from packaging.requirements import Requirement

    return {name: {Requirement(r).name: Requirement(r) for r in reqs} for name, reqs in captured["extras_require"].items()}


TF_RELEASES = ["2.15.1", "2.16.2", "2.17.1", "2.18.1", "2.19.1", "2.20.0", "2.21.0", "2.22.0"]


@pytest.mark.parametrize("extra,plugin,version", [("metal", APPLE, "1.2.0"), ("metal-plugin", PLUGIN, "0.4.1")])
def test_metal_extras_pin_known_good_pairings(extras, extra, plugin, version):
    reqs = extras[extra]
    assert set(reqs) == {"tensorflow", plugin}
    mac = {"sys_platform": "darwin", "platform_machine": "arm64"}
    assert all(r.marker.evaluate(mac) and not r.marker.evaluate({"sys_platform": "linux"}) for r in reqs.values())
    assert reqs[plugin].specifier.contains(version)
    allowed = [v for v in TF_RELEASES if reqs["tensorflow"].specifier.contains(v)]
    assert allowed, reqs["tensorflow"]
    # Every TF the extra admits is a known-good pairing for its plugin on Python 3.12 / macOS 15 ...
    for tf_version in allowed:
        assert devices.pairing_verdict(tf_version, version, plugin, "3.12.1", "15.1") == "known-good", tf_version
    # ... and the published facts: Apple's 1.2 on TF 2.16-2.19, the open plugin on TF 2.21.
    assert allowed == (["2.16.2", "2.17.1", "2.18.1", "2.19.1"] if extra == "metal" else ["2.21.0"])


def test_readme_names_the_commands_the_fixes_give():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Which Metal backend"):]
    section = section[:section.index("\n## ", 3)]
    install = text[text.index("## Install"):text.index("## Which Metal backend")]
    assert REBUILD_PLUGIN.replace("pip install ", "") in install
    for command in (UNINSTALL_APPLE, UNINSTALL_PLUGIN, REINSTALL_APPLE):
        assert f"`{command}`" in section, command
    for word in ("tfmetal-ext version", "tfmetal-ext doctor", "doctor --selftest", "pytest -m metal",
                 "--predict-for tensorflow-metal-plugin", "bfloat16", "CudnnRNN", "Einsum", "ResourceApply"):
        assert word in section, word
    # The commands in the README are the ones the both-installed fixes give.
    _, on_2_21 = devices.check_installed({APPLE: "1.2.0", PLUGIN: "0.4.1"}, "2.21.0", "3.12.1", "15.1")
    _, on_2_19 = devices.check_installed({APPLE: "1.2.0", PLUGIN: "0.4.1"}, "2.19.1", "3.12.1", "15.1")
    assert list(on_2_21.fixes[0].commands) == [UNINSTALL_APPLE, REBUILD_PLUGIN]
    assert list(on_2_19.fixes[0].commands) == [UNINSTALL_PLUGIN, REINSTALL_APPLE]


def test_both_installed_capabilities_describe_the_library_on_disk(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], plugins={APPLE: "1.2.0", PLUGIN: "0.4.1"},
              python="3.12.4", macos="15.2", library_owner=APPLE)
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    # Apple's file is the one TF loads (and it fails on 2.21); the fix keeps the open plugin.
    assert (caps.metal_plugin, caps.metal_plugin_version) == (APPLE, "1.2.0")
    assert caps.pairing == "both-installed" and caps.pairing_fixes[0].commands == (UNINSTALL_APPLE, REBUILD_PLUGIN)


# ----------------------------------------------------------------------------
# The environment: capabilities cached until invalidated; scopes restore only their own fields.


def test_capabilities_are_cached_until_invalidated(fake_host, monkeypatch):
    fake_host(python="3.11.9")
    first = devices.capabilities()
    assert devices.capabilities() is first and devices.backend() == first.backend == "cpu"
    monkeypatch.setattr(devices, "_python_version", lambda: "3.12.1")
    assert devices.capabilities() is first  # no re-probe at each call site
    devices.invalidate_capabilities()
    assert devices.capabilities().python == "3.12.1"


def test_assume_backend_is_environment_scoped_and_keeps_configure_inside():
    import tfmetal_ext
    from tfmetal_ext import _env, precision

    try:
        with devices.assume_backend(PLUGIN):
            assert _env.current().assumed_plugin == devices.assumed_backend() == PLUGIN
            assert devices.capabilities().metal_plugin == PLUGIN and devices.backend() == "metal"
            tfmetal_ext.configure("float32", avoid_fusions=["softshrink"])
        assert devices.assumed_backend() is None and devices.capabilities().metal_plugin != PLUGIN
        assert precision.avoided_fusions() == _env.current().avoided == {"softshrink"}
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())


def test_configure_is_process_wide_and_scopes_are_context_local():
    # TensorFlow runs a tf.distribute replica function in a thread of its own: configure()'s avoided
    # fusions must reach it; assume_backend (a scope) belongs to the context that entered it.
    import threading

    import tfmetal_ext
    from tfmetal_ext import _env

    seen = {}

    def look():
        seen["avoided"], seen["assumed"] = _env.current().avoided, devices.assumed_backend()

    try:
        tfmetal_ext.configure("float32", avoid_fusions=["softshrink"])
        with devices.assume_backend(PLUGIN):
            t = threading.Thread(target=look)
            t.start()
            t.join()
            assert devices.assumed_backend() == PLUGIN
        assert seen == {"avoided": {"softshrink"}, "assumed": None}
    finally:
        tfmetal_ext.configure("float32", avoid_fusions=())
