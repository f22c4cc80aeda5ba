import dataclasses

import pytest
import tensorflow as tf

from tfmetal_ext import devices


@pytest.fixture
def fake_host(monkeypatch):
    """Replaces the hardware probes; returns a setter."""

    def set_host(system="Linux", machine="x86_64", gpus=(), cuda=False, metal=None, flags=(),
                 plugin="tensorflow-metal"):
        monkeypatch.setattr(devices, "_platform", lambda: (system, machine))
        monkeypatch.setattr(devices, "_gpu_devices", lambda: list(gpus))
        monkeypatch.setattr(devices, "_built_with_cuda", lambda: cuda)
        monkeypatch.setattr(devices, "_metal_plugins", lambda: {plugin: metal} if metal else {})
        monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset(flags))

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


# Pairings as users reported them (tensorflow-metal 1.1/1.2 threads), written out independently of the table.
@pytest.mark.parametrize(
    "tf_version,metal,verdict",
    [
        ("2.14.1", "1.1.0", "known-good"),
        ("2.15.0", "1.1.0", "known-good"),
        ("2.16.2", "1.2.0", "known-good"),
        ("2.19.1", "1.2.0", "known-good"),
        ("2.18.0", "1.1.0", "known-broken"),
        ("2.20.0", "1.2.0", "known-broken"),
        ("2.21.0", "1.2.0", "known-broken"),
        ("2.13.0", "1.2.0", "unknown"),
        ("2.18.1", "1.1.0", "unknown"),
        ("2.21.0", None, "not-applicable"),
    ],
)
def test_pairing_verdict(tf_version, metal, verdict):
    assert devices.pairing_verdict(tf_version, metal) == verdict


def test_capabilities_metal_host_reports_broken_pairing_with_fix(fake_host, monkeypatch):
    fake_host("Darwin", "arm64", gpus=["/physical_device:GPU:0"], metal="1.2.0", flags={"feat_bf16"})
    monkeypatch.setattr(tf, "__version__", "2.21.0")
    caps = devices.capabilities()
    assert caps.backend == "metal"
    assert caps.pairing == "known-broken"
    assert "tensorflow-metal==1.2" in caps.pairing_fix and "<2.20" in caps.pairing_fix
    assert caps.cpu_bf16 is True and caps.cpu_fp16 is False


def test_capabilities_cpu_flags(fake_host):
    fake_host(flags={"avx512_bf16", "avx2"})
    caps = devices.capabilities()
    assert (caps.cpu_bf16, caps.cpu_fp16) == (True, False)
    fake_host(flags={"avx2", "avx_ne_convert"})
    caps = devices.capabilities()
    assert (caps.cpu_bf16, caps.cpu_fp16) == (False, True)
    assert caps.pairing == "not-applicable" and caps.pairing_fix is None


def test_capabilities_of_this_host_are_consistent():
    caps = devices.capabilities()
    assert caps.tf_version == tf.__version__
    assert set(dataclasses.asdict(caps)) >= {"backend", "onednn", "pairing", "cpu_bf16"}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo on this host")
    assert caps.cpu_bf16 == ("avx512_bf16" in text or "amx_bf16" in text)
