"""Backend detection and host capabilities.

`backend()` answers "where will Keras run this model": ``"metal"`` (the
tensorflow-metal PluggableDevice on Apple silicon), ``"cuda"`` or ``"cpu"``.
`capabilities()` gathers everything else the rest of the package decides on:
versions, native bfloat16/float16 support of the CPU, whether oneDNN is on, and
the verdict on the TensorFlow / tensorflow-metal pairing.

The probes (`_platform`, `_gpu_devices`, `_metal_plugin_version`, `_cpu_flags`,
`_onednn_enabled`) are module-level functions so tests can replace them where
the hardware is absent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import os
import platform
import subprocess

logger = logging.getLogger("tfmetal_ext")

BACKENDS = ("metal", "cuda", "cpu")

KNOWN_GOOD = "known-good"
KNOWN_BROKEN = "known-broken"
UNKNOWN = "unknown"
NOT_APPLICABLE = "not-applicable"  # no tensorflow-metal installed

# The one place in code for TF / tensorflow-metal pairings, from user reports (Apple Developer
# Forums' tensorflow-metal threads, tensorflow/tensorflow issues): 1.2.0 (2025-01-31) is the last
# release; with TF 2.20/2.21 it fails to load (missing _pywrap_tensorflow_internal.so / AttrValue symbol).
# Each row: (tensorflow-metal version prefix, TF "major.minor" versions, verdict).
# A TF entry may name a patch release ("2.18.0") when only that release was reported.
_PAIRINGS = (
    ("1.1", ("2.14", "2.15"), KNOWN_GOOD),
    ("1.1", ("2.18.0",), KNOWN_BROKEN),
    ("1.2", ("2.16", "2.17", "2.18", "2.19"), KNOWN_GOOD),
    ("1.2", ("2.20", "2.21"), KNOWN_BROKEN),
)
FIX_PAIRING_COMMAND = 'pip install "tensorflow>=2.16,<2.20" "tensorflow-metal==1.2.*"'


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this host and its TensorFlow install can do.

    Attributes:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        tf_version: installed TensorFlow version.
        keras_version: installed Keras version.
        metal_plugin_version: tensorflow-metal version, or None when absent.
        platform: ``"<system>/<machine>"``, e.g. ``"Darwin/arm64"``.
        cpu_bf16: the CPU computes bfloat16 natively (AVX512_BF16, AMX_BF16 or
            Arm FEAT_BF16).
        cpu_fp16: the CPU computes float16 natively (AVX512_FP16, AMX_FP16,
            AVX_NE_CONVERT); only then does TF's remapper fuse half on CPU.
        onednn: oneDNN (MKL) kernels and oneDNN-only remapper fusions are on.
        pairing: ``"known-good"``, ``"known-broken"``, ``"unknown"`` or
            ``"not-applicable"`` (no tensorflow-metal installed).
        pairing_fix: a pip command that fixes a broken pairing, else None.
        gpus: names of the physical GPU devices.
        metal_plugin: the Metal PluggableDevice distribution installed:
            ``"tensorflow-metal"`` (Apple's), ``"tensorflow-metal-plugin"``
            (the open one) or None. `metal_plugin_version` is its version.
    """

    backend: str
    tf_version: str
    keras_version: str
    metal_plugin_version: str | None
    platform: str
    cpu_bf16: bool
    cpu_fp16: bool
    onednn: bool
    pairing: str
    pairing_fix: str | None
    gpus: tuple = ()
    metal_plugin: str | None = None

    def to_dict(self):
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------
# Probes (replaced in tests).


def _platform():
    return platform.system(), platform.machine()


def _gpu_devices():
    import tensorflow as tf

    return [d.name for d in tf.config.list_physical_devices("GPU")]


def _built_with_cuda():
    import tensorflow as tf

    return bool(tf.test.is_built_with_cuda())


# The two Metal PluggableDevice distributions (Apple's, then the open one).
METAL_PLUGINS = ("tensorflow-metal", "tensorflow-metal-plugin")


def _metal_plugins():
    """``{distribution: version}`` of the Metal plugins installed (none, one, or both)."""
    found = {}
    for name in METAL_PLUGINS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _metal_plugin_version():
    """The version of the Metal plugin installed (Apple's when both are), or None."""
    found = _metal_plugins()
    return next((found[n] for n in METAL_PLUGINS if n in found), None)


# `assume_backend` stack: the Metal plugin distribution being assumed.
_ASSUMED = []


@contextlib.contextmanager
def assume_backend(metal_plugin="tensorflow-metal-plugin"):
    """Within this context, this process describes itself as a Mac with `metal_plugin`.

    `backend()` returns ``"metal"`` and `capabilities()` a Darwin/arm64 host
    with one GPU, no oneDNN, and `metal_plugin` installed at its known-good
    version for the installed TensorFlow (or its pin). Our layers and
    `configure()` then choose what they would choose on that backend. It
    changes what this package decides, not where TensorFlow runs anything:
    `tfmetal_ext.inspect.placement_report(..., predict_for=...)` traces the
    step inside it, and tests use it to reach the Metal code paths on any host.

    Args:
        metal_plugin: ``"tensorflow-metal"`` or ``"tensorflow-metal-plugin"``.

    Raises:
        ValueError: for any other name.
    """
    if metal_plugin not in METAL_PLUGINS:
        raise ValueError(
            f"metal_plugin must be one of {', '.join(METAL_PLUGINS)}. Received: metal_plugin={metal_plugin!r}"
        )
    _ASSUMED.append(metal_plugin)
    try:
        yield
    finally:
        _ASSUMED.pop()


def assumed_backend():
    """The Metal plugin `assume_backend` is assuming, or None outside it."""
    return _ASSUMED[-1] if _ASSUMED else None


def _assumed_capabilities(metal_plugin):
    import keras
    import tensorflow as tf

    from tfmetal_ext.backends import metal_plugin as open_plugin

    version = open_plugin.PIN if metal_plugin == "tensorflow-metal-plugin" else "1.2.0"
    verdict = pairing_verdict(tf.__version__, version, plugin=metal_plugin)
    return Capabilities(
        backend="metal",
        tf_version=tf.__version__,
        keras_version=keras.__version__,
        metal_plugin_version=version,
        platform="Darwin/arm64",
        cpu_bf16=False,
        cpu_fp16=False,
        onednn=False,
        pairing=verdict,
        pairing_fix=None,
        gpus=("/physical_device:GPU:0",),
        metal_plugin=metal_plugin,
    )


@functools.lru_cache(maxsize=None)
def _cpu_flags():
    """Lower-case CPU feature names of this host (Linux cpuinfo or macOS sysctl)."""
    system, _ = _platform()
    flags = set()
    if system == "Linux":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith(("flags", "Features")):
                        flags.update(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
    elif system == "Darwin":
        for name in ("FEAT_BF16", "FEAT_FP16"):
            try:
                out = subprocess.run(
                    ["sysctl", "-n", f"hw.optional.arm.{name}"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    check=False,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                out = ""
            if out == "1":
                flags.add(name.lower())
    return frozenset(flags)


def _onednn_enabled():
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):  # pragma: no cover - very old TF
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "0") == "1"


# ----------------------------------------------------------------------------
# Public API.


def backend():
    """Returns the compute backend Keras will use: ``"metal"``, ``"cuda"`` or ``"cpu"``.

    Metal means a GPU on Darwin/arm64 with the tensorflow-metal plugin; CUDA a
    GPU in a CUDA build of TensorFlow; anything else is CPU.

    >>> tfmetal_ext.devices.backend() in ("metal", "cuda", "cpu")
    True
    """
    if _ASSUMED:
        return "metal"
    gpus = _gpu_devices()
    if not gpus:
        return "cpu"
    system, machine = _platform()
    if system == "Darwin" and machine == "arm64":
        return "metal"
    if _built_with_cuda():
        return "cuda"
    # A GPU from some other PluggableDevice: treat it like CUDA for policy
    # purposes (half precision), but say so in the log.
    logger.info("GPU devices %s are neither Metal nor CUDA; treating as cuda", gpus)
    return "cuda"


def pairing_verdict(tf_version, metal_version, plugin="tensorflow-metal", python_version=None):
    """Verdict on a TensorFlow / tensorflow-metal pairing.

    Args:
        tf_version: TensorFlow version string, e.g. ``"2.19.1"``.
        metal_version: tensorflow-metal version string, or None.

    Returns:
        ``"known-good"``, ``"known-broken"``, ``"unknown"`` or
        ``"not-applicable"`` when `metal_version` is None.
    """
    if metal_version is None:
        return NOT_APPLICABLE
    if plugin == "tensorflow-metal-plugin":
        from tfmetal_ext.backends import metal_plugin as open_plugin

        return KNOWN_GOOD if tf_version.split("+")[0] == open_plugin.TF_VERSION else KNOWN_BROKEN
    tf_parts = tf_version.split("+")[0].split(".")
    tf_minor = ".".join(tf_parts[:2])
    tf_patch = ".".join(tf_parts[:3])
    for metal_prefix, tf_versions, verdict in _PAIRINGS:
        if metal_version == metal_prefix or metal_version.startswith(metal_prefix + "."):
            # Patch-specific rows win over minor-wide rows.
            if tf_patch in tf_versions:
                return verdict
    for metal_prefix, tf_versions, verdict in _PAIRINGS:
        if metal_version == metal_prefix or metal_version.startswith(metal_prefix + "."):
            if tf_minor in tf_versions:
                return verdict
    return UNKNOWN


def capabilities():
    """Collects backend, versions, CPU features and pairing verdict.

    Returns:
        A `Capabilities` instance.
    """
    if _ASSUMED:
        return _assumed_capabilities(_ASSUMED[-1])
    import keras
    import tensorflow as tf

    system, machine = _platform()
    flags = _cpu_flags()
    found = _metal_plugins()
    plugin = next((n for n in METAL_PLUGINS if n in found), None)
    metal = found.get(plugin)
    verdict = pairing_verdict(tf.__version__, metal, plugin=plugin or "tensorflow-metal")
    return Capabilities(
        backend=backend(),
        tf_version=tf.__version__,
        keras_version=keras.__version__,
        metal_plugin_version=metal,
        platform=f"{system}/{machine}",
        cpu_bf16=bool(flags & {"avx512_bf16", "amx_bf16", "feat_bf16"}),
        cpu_fp16=bool(flags & {"avx512_fp16", "amx_fp16", "avx_ne_convert"}),
        onednn=_onednn_enabled(),
        pairing=verdict,
        pairing_fix=FIX_PAIRING_COMMAND if verdict == KNOWN_BROKEN else None,
        gpus=tuple(_gpu_devices()),
        metal_plugin=plugin,
    )
