import warnings

import keras
import pytest

import tfmetal_ext
from tfmetal_ext import devices, precision


def _caps(backend, bf16=False, fp16=False, onednn=None):
    return devices.Capabilities(
        backend=backend, tf_version="2.21.0", keras_version=keras.__version__,
        metal_plugin_version="1.2.0" if backend == "metal" else None,
        platform="Darwin/arm64" if backend == "metal" else "Linux/x86_64",
        cpu_bf16=bf16, cpu_fp16=fp16, onednn=(backend == "cpu") if onednn is None else onednn,
        pairing="not-applicable",
        pairing_fix=None,
    )


@pytest.fixture
def host(monkeypatch):
    def set_host(backend, **kw):
        monkeypatch.setattr(devices, "capabilities", lambda: _caps(backend, **kw))

    return set_host


@pytest.mark.parametrize(
    "backend,bf16,policy,jit",
    [
        ("metal", False, "mixed_float16", False),
        ("cuda", False, "mixed_float16", True),
        ("cpu", True, "mixed_bfloat16", False),
        ("cpu", False, "float32", False),
    ],
)
def test_auto_policy_per_backend(host, backend, bf16, policy, jit):
    host(backend, bf16=bf16)
    cfg = tfmetal_ext.configure()
    assert cfg.backend == backend
    assert cfg.policy == policy
    assert keras.mixed_precision.global_policy().name == policy
    assert cfg.jit_compile is jit
    assert cfg.compile_kwargs() == {"jit_compile": jit}
    assert precision.compile_kwargs() == {"jit_compile": jit}
    assert cfg.reasons and all(isinstance(r, str) for r in cfg.reasons)


def test_native_bf16_without_onednn_stays_float32(host):
    # TF's own CPU kernels (TF_ENABLE_ONEDNN_OPTS=0, or a wheel without oneDNN) fuse float32 only:
    # bfloat16 would fuse nothing there, native bf16 support or not.
    host("cpu", bf16=True, onednn=False)
    cfg = tfmetal_ext.configure()
    assert cfg.policy == "float32"
    assert any("oneDNN off" in r for r in cfg.reasons), cfg.reasons


def test_metal_never_uses_xla(host):
    host("metal")
    with pytest.warns(UserWarning, match="XLA does not run on Metal"):
        cfg = tfmetal_ext.configure(jit_compile=True)
    assert cfg.jit_compile is False
    assert any("XLA is never used" in r for r in cfg.reasons)


def test_mixed_float16_loss_scaling_reason(host):
    host("metal")
    cfg = tfmetal_ext.configure()
    assert any("LossScaleOptimizer" in r for r in cfg.reasons)


def test_explicit_policy_is_honoured(host):
    host("cpu", bf16=True)
    cfg = tfmetal_ext.configure("float32", jit_compile=False)
    assert cfg.policy == "float32" and cfg.jit_compile is False
    assert keras.mixed_precision.global_policy().name == "float32"


def test_explicit_mixed_float16_on_cpu_warns_and_says_why(host):
    host("cpu")
    with pytest.warns(UserWarning, match="remapper skips half"):
        cfg = tfmetal_ext.configure("mixed_float16")
    assert cfg.policy == "mixed_float16"


@pytest.mark.parametrize("bad", ["fp16", "", None, 3])
def test_bad_policy(host, bad):
    host("cpu")
    with pytest.raises(ValueError, match=r"Received: policy="):
        tfmetal_ext.configure(bad)


def test_bad_jit_compile(host):
    host("cpu")
    with pytest.raises(ValueError, match=r"Received: jit_compile='yes'"):
        tfmetal_ext.configure(jit_compile="yes")


def test_warns_when_layers_were_built_before(host):
    host("cpu", bf16=True)
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    with pytest.warns(UserWarning, match="already built and keep their old policy"):
        tfmetal_ext.configure()
    assert layer.dtype_policy.name == "float32"
    del layer


def test_idempotent(host):
    host("cpu", bf16=True)
    first = tfmetal_ext.configure()
    layer = keras.layers.Dense(2)
    layer.build((None, 3))  # built under the new policy: no warning on the second call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tfmetal_ext.configure()
    assert first == second
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"


def test_compile_kwargs_merge_an_explicit_jit_compile(host):
    # Issue 13: `model.compile(..., jit_compile=True, **cfg.compile_kwargs())` is Python's
    # "multiple values for keyword argument"; passing the arguments through merges them.
    host("cpu", bf16=False)
    cfg = tfmetal_ext.configure()
    assert cfg.jit_compile is False
    merged = cfg.compile_kwargs(optimizer="sgd", loss="mse", jit_compile=True)
    assert merged == {"optimizer": "sgd", "loss": "mse", "jit_compile": True}
    assert cfg.compile_kwargs(loss="mse", jit_compile="auto") == {"loss": "mse", "jit_compile": False}
    assert precision.compile_kwargs(loss="mse") == {"loss": "mse", "jit_compile": False}
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(**cfg.compile_kwargs(optimizer="sgd", loss="mse", jit_compile=True))
    assert model.jit_compile is True


def test_compile_kwargs_never_turn_xla_on_for_metal(host):
    host("metal")
    cfg = tfmetal_ext.configure()
    with pytest.warns(UserWarning, match="XLA does not run on Metal"):
        merged = cfg.compile_kwargs(loss="mse", jit_compile=True)
    assert merged == {"loss": "mse", "jit_compile": False}
    assert cfg.compile_kwargs(jit_compile=False) == {"jit_compile": False}


# ----------------------------------------------------------------------------
# Issue 14: both Metal backends.

PLUGINS = ("tensorflow-metal", "tensorflow-metal-plugin")


@pytest.mark.parametrize("plugin", PLUGINS)
def test_auto_picks_mixed_float16_on_both_metal_backends_naming_the_backend(plugin):
    with devices.assume_backend(plugin):
        cfg = precision.recommend()
    assert cfg.backend == "metal" and cfg.policy == "mixed_float16" and cfg.jit_compile is False
    assert cfg.reasons[0].startswith(f"{plugin}:"), cfg.reasons
    assert any(f"{plugin} has no XLA compiler" in r for r in cfg.reasons), cfg.reasons
    other = next(p for p in PLUGINS if p != plugin)
    assert not any(r.startswith(f"{other}:") or f"{other} has" in r for r in cfg.reasons), cfg.reasons


def test_the_bfloat16_reason_follows_each_backend_table():
    from tfmetal_ext import backends

    with devices.assume_backend("tensorflow-metal-plugin"):
        gap = precision.metal_bfloat16_gap(devices.capabilities())
    # The open plugin's table is complete: no compute kernel takes bfloat16 (independent check of the data).
    plugin = backends.TABLES["metal_plugin"]
    assert plugin.kernels_complete and plugin.has_kernel("MatMul", "bfloat16") is False
    assert plugin.has_kernel("Conv2D", "bfloat16") is False and plugin.has_kernel("MatMul", "float16") is True
    assert "no bfloat16 compute kernels" in gap and "run on the CPU" in gap
    with devices.assume_backend("tensorflow-metal"):
        gap = precision.metal_bfloat16_gap(devices.capabilities())
    assert gap.startswith("tensorflow-metal has no bfloat16 _FusedConv2D"), gap


@pytest.mark.parametrize("plugin", PLUGINS)
def test_explicit_mixed_bfloat16_on_metal_warns_naming_the_backend(plugin):
    with devices.assume_backend(plugin):
        with pytest.warns(UserWarning, match=rf"bfloat16 on Metal: {plugin} has no bfloat16"):
            cfg = tfmetal_ext.configure("mixed_bfloat16")
        assert cfg.policy == "mixed_bfloat16"  # honoured, as an explicit policy is everywhere
        assert any(r.startswith(f"bfloat16 on Metal: {plugin} has") for r in cfg.reasons)
        assert precision.recommend("mixed_bfloat16").reasons == cfg.reasons  # recommend() says it, no warning
    keras.mixed_precision.set_global_policy("float32")
