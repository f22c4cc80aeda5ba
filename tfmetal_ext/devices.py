"""Backend detection and host capabilities: the probes, and `assume_backend`.

`backend()` answers "where will Keras run this model": ``"metal"`` (a Metal
PluggableDevice on Apple silicon: Apple's ``tensorflow-metal`` or the open
``tensorflow-metal-plugin``), ``"cuda"`` or ``"cpu"``. `capabilities()`
gathers everything else the rest of the package decides on: versions, which
Metal plugin is installed (both at once is an error), native bfloat16/float16
support of the CPU, whether oneDNN is on, and the verdict on the TensorFlow /
Metal plugin pairing with the commands that fix a broken one. It is probed
once and cached in the environment (`tfmetal_ext._env`) until
`invalidate_capabilities()`.

Levels: this module probes; the pairing rows are data in
`tfmetal_ext.backends.pairings`; the policy that turns them into a verdict
and fixes is `tfmetal_ext._pairing` (`check_pairing`, `pairing_verdict`,
`pairing_fixes`, `check_installed`, re-exported here); the text for screens
is `tfmetal_ext._pairing_display` (`describe_pairing`, re-exported here).

The probes (`_platform`, `_gpu_devices`, `_metal_plugins`,
`_metal_library_owner`, `_cpu_flags`, `_onednn_enabled`, `_python_version`,
`_macos_version`) are module-level
functions so tests can replace them where the hardware is absent. The Metal
plugins are found from package metadata only: importing a second library that
registers the METAL platform would abort the process.
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

from tfmetal_ext import _env
from tfmetal_ext._pairing import (  # noqa: F401  (the pairing policy, public here)
    FIX_PAIRING_COMMAND,
    UNINSTALL_APPLE,
    UNINSTALL_PLUGIN,
    PairingCheck,
    PairingFix,
    check_installed,
    check_pairing,
    pairing_fixes,
    pairing_verdict,
)
from tfmetal_ext._pairing_display import describe_pairing  # noqa: F401
from tfmetal_ext.backends import pairings as _pairings
from tfmetal_ext.backends.pairings import (  # noqa: F401  (the pairing data, public here)
    APPLE,
    APPLE_MIN_MACOS,
    BOTH_INSTALLED,
    KNOWN_BROKEN,
    KNOWN_GOOD,
    METAL_PLUGINS,
    NOT_APPLICABLE,
    OPEN_PLUGIN,
    PLUGIN_LIBRARY,
    PLUGIN_MIN_PYTHON,
    UNKNOWN,
)

logger = logging.getLogger("tfmetal_ext")

BACKENDS = ("metal", "cuda", "cpu")


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
        pairing: ``"known-good"``, ``"known-broken"``, ``"unknown"``,
            ``"not-applicable"`` (no Metal plugin installed) or
            ``"both-installed"`` (both plugins: an error).
        pairing_fix: the commands of the first of `pairing_fixes`, joined
            with ``" && "``, else None.
        gpus: names of the physical GPU devices.
        metal_plugin: the Metal PluggableDevice distribution installed:
            ``"tensorflow-metal"`` (Apple's), ``"tensorflow-metal-plugin"``
            (the open one) or None. `metal_plugin_version` is its version.
            With both installed: the one whose library is on disk (RECORD
            hash), else the one the first fix keeps.
        metal_plugins: ``((name, version), ...)`` of every Metal plugin
            installed (from package metadata; nothing is imported).
        pairing_reason: why the verdict is what it is, or None.
        pairing_fixes: every `PairingFix` route, the first is `pairing_fix`.
        python: the Python version, e.g. ``"3.12.8"``.
        macos: the macOS version (``"15.3"``) on Darwin, else None.
        onednn_bf16: oneDNN is on and fuses bfloat16 on this CPU: TF's
            ``IsBF16SupportedByOneDNNOnThisCPU`` (AVX512F or AVX_NE_CONVERT).
            Off on an AVX2-only CPU with ``TF_ENABLE_ONEDNN_OPTS=1``: there
            the remapper leaves bfloat16 nodes unfused.
        cublaslt: ``TF_USE_CUBLASLT=1`` in the environment when probed (TF's
            remapper fuses MatMul on a GPU only through cuBLASLt).
        cpu_avx512: the CPU has AVX-512F with AVX2 and FMA: our op library's
            CPU kernels that have AVX-512 code (attention's tile products,
            the dropout kernels' Philox) run it, unless
            ``TFMETAL_EXT_CPU_LEVEL=avx2`` (or ``baseline``) caps them. With
            AVX2 and FMA alone they run their AVX2 code: the same Philox
            words and the same products' bits (attention's element-wise
            loops may differ in the last bit).
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
    metal_plugins: tuple = ()
    pairing_reason: str | None = None
    pairing_fixes: tuple = ()
    python: str = ""
    macos: str | None = None
    onednn_bf16: bool = False
    cublaslt: bool = False
    cpu_avx512: bool = False

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


def _metal_plugins():
    """``{distribution: version}`` of the Metal plugins installed (none, one, or both)."""
    found = {}
    for name in METAL_PLUGINS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _metal_library_owner():
    """Which Metal plugin's `PLUGIN_LIBRARY` is on disk now (the one TensorFlow loads), or None.

    Read from package metadata: the file's sha256 against each distribution's
    RECORD. Nothing is imported or loaded.
    """
    import base64
    import hashlib

    for name in METAL_PLUGINS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for path in dist.files or ():
            if str(path).replace("\\", "/").endswith(PLUGIN_LIBRARY) and path.hash and path.hash.mode == "sha256":
                try:
                    with open(dist.locate_file(path), "rb") as f:
                        digest = hashlib.sha256(f.read()).digest()
                except OSError:
                    break
                if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == path.hash.value:
                    return name
                break
    return None


def _python_version():
    return platform.python_version()


def _macos_version():
    """The macOS version string on Darwin (``"15.3"``), else None."""
    if platform.system() != "Darwin":
        return None
    return platform.mac_ver()[0] or None


def _metal_plugin_version():
    """The version of the Metal plugin installed (Apple's when both are), or None."""
    found = _metal_plugins()
    return next((found[n] for n in METAL_PLUGINS if n in found), None)


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
    It sets the environment's assumed plugin (`tfmetal_ext._env`) for the
    block, in this context only.

    Args:
        metal_plugin: ``"tensorflow-metal"`` or ``"tensorflow-metal-plugin"``.

    Raises:
        ValueError: for any other name.
    """
    if metal_plugin not in METAL_PLUGINS:
        raise ValueError(
            f"metal_plugin must be one of {', '.join(METAL_PLUGINS)}. Received: metal_plugin={metal_plugin!r}"
        )
    _env.current()._cache.pop(metal_plugin, None)  # described afresh on entry, as before the cache
    with _env.scope(assumed_plugin=metal_plugin):
        yield


def assumed_backend():
    """The Metal plugin `assume_backend` is assuming, or None outside it."""
    return _env.current().assumed_plugin


def _assumed_capabilities(metal_plugin):
    import keras
    import tensorflow as tf

    version = _pairings.PLUGIN_PIN if metal_plugin == OPEN_PLUGIN else _pairings.APPLE_LAST_RELEASE
    macos = _pairings.fmt(_pairings.PLUGIN_MIN_MACOS)  # a Mac both plugins run on
    python = _python_version()
    check = check_pairing(tf.__version__, version, plugin=metal_plugin, python_version=python, macos_version=macos)
    return Capabilities(
        backend="metal",
        tf_version=tf.__version__,
        keras_version=keras.__version__,
        metal_plugin_version=version,
        platform="Darwin/arm64",
        cpu_bf16=False,
        cpu_fp16=False,
        onednn=False,
        pairing=check.verdict,
        pairing_fix=check.fixes[0].command if check.fixes else None,
        gpus=("/physical_device:GPU:0",),
        metal_plugin=metal_plugin,
        metal_plugins=((metal_plugin, version),),
        pairing_reason=check.reason,
        pairing_fixes=check.fixes,
        python=python,
        macos=macos,
        cublaslt=_cublaslt(),
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


def _cublaslt():
    return os.environ.get("TF_USE_CUBLASLT", "0") == "1"


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

    Read from the environment (`capabilities()`' snapshot, probed once).

    >>> tfmetal_ext.devices.backend() in ("metal", "cuda", "cpu")
    True
    """
    return _env.current().backend


def _probe_backend():
    """`backend()`, probed now."""
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


# CPU features with which TF's oneDNN fuses bfloat16 (tensorflow/core/util/port.cc,
# IsBF16SupportedByOneDNNOnThisCPU: AVX512F or AVX_NE_CONVERT), as /proc/cpuinfo names them.
ONEDNN_BF16_FLAGS = frozenset({"avx512f", "avx_ne_convert"})


def capabilities():
    """Collects backend, versions, CPU features and the Metal plugin pairing verdict.

    Probed once and cached in the environment (`tfmetal_ext._env`) until
    `invalidate_capabilities()`; under `assume_backend`, the assumed Mac's.

    Returns:
        A `Capabilities` instance.
    """
    return _env.current().capabilities


def invalidate_capabilities():
    """Forgets the cached `capabilities()`: the next call probes the host again.

    `configure()` calls it; so do tests that replace a probe.
    """
    _env.invalidate_capabilities()


def probe_capabilities(assumed_plugin=None):
    """`capabilities()` probed now (uncached): this host, or the Mac `assume_backend(assumed_plugin)` describes."""
    if assumed_plugin is not None:
        return _assumed_capabilities(assumed_plugin)
    import keras
    import tensorflow as tf

    system, machine = _platform()
    flags = _cpu_flags()
    found = _metal_plugins()
    python, macos = _python_version(), (_macos_version() if system == "Darwin" else None)
    owner = _metal_library_owner() if len(found) > 1 else None
    plugin, check = check_installed(found, tf.__version__, python_version=python, macos_version=macos,
                                    library_owner=owner)
    return Capabilities(
        backend=_probe_backend(),
        tf_version=tf.__version__,
        keras_version=keras.__version__,
        metal_plugin_version=found.get(plugin),
        platform=f"{system}/{machine}",
        cpu_bf16=bool(flags & {"avx512_bf16", "amx_bf16", "feat_bf16"}),
        cpu_fp16=bool(flags & {"avx512_fp16", "amx_fp16", "avx_ne_convert"}),
        onednn=_onednn_enabled(),
        pairing=check.verdict,
        pairing_fix=check.fixes[0].command if check.fixes else None,
        gpus=tuple(_gpu_devices()),
        metal_plugin=plugin,
        metal_plugins=tuple((n, found[n]) for n in METAL_PLUGINS if n in found),
        pairing_reason=check.reason,
        pairing_fixes=check.fixes,
        python=python,
        macos=macos,
        onednn_bf16=_onednn_enabled() and bool(flags & ONEDNN_BF16_FLAGS),
        cublaslt=_cublaslt(),
        cpu_avx512={"avx512f", "avx2", "fma"} <= flags,
    )
