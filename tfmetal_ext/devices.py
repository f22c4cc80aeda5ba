"""Backend detection and host capabilities.

`backend()` answers "where will Keras run this model": ``"metal"`` (a Metal
PluggableDevice on Apple silicon: Apple's ``tensorflow-metal`` or the open
``tensorflow-metal-plugin``), ``"cuda"`` or ``"cpu"``. `capabilities()`
gathers everything else the rest of the package decides on: versions, which
Metal plugin is installed (both at once is an error), native bfloat16/float16
support of the CPU, whether oneDNN is on, and the verdict on the TensorFlow /
Metal plugin pairing with the commands that fix a broken one
(`check_pairing`, `pairing_verdict`, `pairing_fixes`, `check_installed`,
`describe_pairing`).

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

logger = logging.getLogger("tfmetal_ext")

BACKENDS = ("metal", "cuda", "cpu")

KNOWN_GOOD = "known-good"
KNOWN_BROKEN = "known-broken"
UNKNOWN = "unknown"
NOT_APPLICABLE = "not-applicable"  # no Metal plugin installed
BOTH_INSTALLED = "both-installed"  # tensorflow-metal and tensorflow-metal-plugin at once: an error

APPLE = "tensorflow-metal"
OPEN_PLUGIN = "tensorflow-metal-plugin"
# The two Metal PluggableDevice distributions (Apple's, then the open one).
METAL_PLUGINS = (APPLE, OPEN_PLUGIN)

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
# Apple's wheels (PyPI's file list, `pip index versions tensorflow-metal --platform ... --python-version ...`):
# macosx_12_0_arm64 only; 1.2.0 up to cp312, 1.1.0 up to cp311; no sdist. Version prefix -> newest CPython.
_APPLE_MAX_PYTHON = (("1.2", (3, 12)), ("1.1", (3, 11)))
APPLE_MIN_MACOS = (12, 0)

# The open plugin, keyed on its release: (plugin version, the one TF release it is built for, its
# TF_SUPPORTED_VERSION). Its load check compares major.minor and offers no GPU device on any other
# TensorFlow; tfmetal-ext's tables were generated and tested against the exact release, so another
# patch of that minor is "unknown" (it loads; nobody here tested it). It needs Python >= 3.10
# (python_requires) and macOS 15 (`backends.metal_plugin.MIN_MACOS`: dyld refuses the library on older).
def _plugin_pairings():
    from tfmetal_ext.backends import metal_plugin as open_plugin

    return ((open_plugin.PIN, open_plugin.TF_VERSION),)


PLUGIN_MIN_PYTHON = (3, 10)
# TensorFlow releases that Apple's route pins (the known-good 1.2 rows) and the newest CPython TF 2.21 has
# wheels for (cp310-cp313; PyPI, 2026-12).
_APPLE_TF_RANGE = ">=2.16,<2.20"
_TF_2_21_MAX_PYTHON = (3, 13)

FIX_PAIRING_COMMAND = f'pip install "tensorflow{_APPLE_TF_RANGE}" "tensorflow-metal==1.2.*"'
UNINSTALL_APPLE = f"pip uninstall -y {APPLE}"
UNINSTALL_PLUGIN = f"pip uninstall -y {OPEN_PLUGIN}"


def _plugin_commands():
    """(install TF for the plugin, install the plugin, rebuild the plugin) commands at the pin.

    The plugin is an sdist compiled at install against the TensorFlow installed then, so it is
    always a separate pip command after TensorFlow's. ``--no-cache-dir``: pip caches the wheel it
    built from an sdist and would reinstall that build, compiled against the previous TensorFlow.
    ``--no-deps`` on a rebuild keeps pip from touching TensorFlow itself.
    """
    from tfmetal_ext.backends import metal_plugin as open_plugin

    return (
        f'pip install "tensorflow=={open_plugin.TF_VERSION}"',
        f"pip install --no-cache-dir {OPEN_PLUGIN}=={open_plugin.PIN}",
        f"pip install --force-reinstall --no-deps --no-cache-dir {OPEN_PLUGIN}=={open_plugin.PIN}",
    )


@dataclasses.dataclass(frozen=True)
class PairingFix:
    """One way to fix a pairing: what it does and the commands, run one after the other.

    Attributes:
        summary: one sentence: what this route leaves installed.
        commands: shell commands, in order (each its own pip run); empty when the
            route is not a command (e.g. "update macOS").
    """

    summary: str
    commands: tuple = ()

    @property
    def command(self):
        """The commands as one line (``" && "``-joined), or the summary when there are none."""
        return " && ".join(self.commands) if self.commands else self.summary

    def __str__(self):
        return f"{self.summary}: {self.command}" if self.commands else self.summary


@dataclasses.dataclass(frozen=True)
class PairingCheck:
    """The verdict on an install of TensorFlow and a Metal plugin, why, and how to fix it.

    Attributes:
        verdict: `KNOWN_GOOD`, `KNOWN_BROKEN`, `UNKNOWN`, `NOT_APPLICABLE` or `BOTH_INSTALLED`.
        reason: why, in one sentence (None when there is nothing to say).
        fixes: the `PairingFix` routes, the one that keeps the installed TensorFlow (where one
            does) first; empty unless the verdict is known-broken or both-installed.
    """

    verdict: str
    reason: str | None = None
    fixes: tuple = ()


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


PLUGIN_LIBRARY = "tensorflow-plugins/libmetal_plugin.dylib"  # both distributions install this one file


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

    from tfmetal_ext.backends import metal_plugin as open_plugin

    version = open_plugin.PIN if metal_plugin == OPEN_PLUGIN else "1.2.0"
    macos = ".".join(map(str, open_plugin.MIN_MACOS))  # a Mac both plugins run on
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


def _version_tuple(argument, value, parts=3):
    """`value` (``"3.12.8"``, ``"2.21.0rc1"``, ``(3, 12)``) as a tuple of ints; `argument` names it in errors."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
        return tuple(value)[:parts]
    if isinstance(value, str):
        nums = []
        for piece in value.split("+")[0].split(".")[:parts]:
            digits = ""
            for ch in piece:
                if not ch.isdigit():
                    break
                digits += ch
            if not digits:
                break
            nums.append(int(digits))
            if len(digits) < len(piece):  # "0rc1": the rest is a pre-release tag
                break
        if nums:
            return tuple(nums)
    raise ValueError(
        f"`{argument}` must be a version string such as \"3.12.1\" or a tuple of ints. Received: {argument}={value!r}"
    )


def _matches(version, prefix):
    return version == prefix or version.startswith(prefix + ".")


def _apple_verdict(tf, metal):
    """Verdict of Apple's `_PAIRINGS` for TF version tuple `tf` and tensorflow-metal `metal`."""
    tf_minor = ".".join(map(str, tf[:2]))
    tf_patch = ".".join(map(str, tf[:3]))
    for by in (tf_patch, tf_minor):  # patch-specific rows win over minor-wide rows
        for metal_prefix, tf_versions, verdict in _PAIRINGS:
            if _matches(metal, metal_prefix) and by in tf_versions:
                return verdict
    return UNKNOWN


def _fmt(version):
    return ".".join(map(str, version))


def _apple_route(tf, *, uninstall_plugin=False, reinstall=False):
    """Apple's route: TF 2.16-2.19 with tensorflow-metal 1.2 (Python <= 3.12)."""
    first = (UNINSTALL_PLUGIN,) if uninstall_plugin else ()
    if reinstall:  # tensorflow-metal 1.2 is installed but its dylib was deleted or overwritten
        keep_tf = (2, 16) <= tf[:2] <= (2, 19)
        cmds = first + (() if keep_tf else (f'pip install "tensorflow{_APPLE_TF_RANGE}"',)) + (
            f'pip install --force-reinstall --no-deps "{APPLE}==1.2.*"',
        )
    else:
        cmds = first + (FIX_PAIRING_COMMAND,)
    keeps = (2, 16) <= tf[:2] <= (2, 19)
    return PairingFix(
        f"use Apple's {APPLE} 1.2 with TensorFlow 2.16-2.19 (Python <= 3.12)"
        + ("" if keeps else f"; this replaces TensorFlow {_fmt(tf)}"),
        cmds,
    )


def _plugin_route(tf, *, uninstall_apple=False, rebuild=False):
    """The open plugin's route: TF at its pin, then the plugin compiled against it (Python >= 3.10, macOS 15)."""
    from tfmetal_ext.backends import metal_plugin as open_plugin

    install_tf, install, reinstall = _plugin_commands()
    pin_tf = _version_tuple("tf_version", open_plugin.TF_VERSION)
    cmds = (UNINSTALL_APPLE,) if uninstall_apple else ()
    if tf != pin_tf:
        cmds += (install_tf,)
    cmds += (reinstall if rebuild else install,)
    keeps = tf == pin_tf
    return PairingFix(
        f"use the open {OPEN_PLUGIN} {open_plugin.PIN} on TensorFlow {open_plugin.TF_VERSION} (macOS 15+; "
        "a separate pip command after TensorFlow's: it compiles against the TensorFlow installed)"
        + ("" if keeps else f"; this replaces TensorFlow {_fmt(tf)}"),
        cmds,
    )


_NEW_PYTHON = PairingFix(
    "create a Python 3.10-3.13 environment: TensorFlow 2.21 has wheels for cp310-cp313 "
    f"(Python 3.10-3.12 also for Apple's {APPLE} 1.2)"
)
_MACOS_UPDATE = PairingFix(f"update macOS to 15 or later, then use the open {OPEN_PLUGIN}")


def _check_args(tf_version, metal_version, plugin, python_version, macos_version):
    if plugin not in METAL_PLUGINS:
        raise ValueError(f"`plugin` must be one of {', '.join(METAL_PLUGINS)}. Received: plugin={plugin!r}")
    if metal_version is not None and not isinstance(metal_version, str):
        raise ValueError(f"`metal_version` must be a version string or None. Received: metal_version={metal_version!r}")
    tf = _version_tuple("tf_version", tf_version) if isinstance(tf_version, str) else None
    if tf is None:
        raise ValueError(f"`tf_version` must be a version string such as \"2.21.0\". Received: tf_version={tf_version!r}")
    tf = (tf + (0, 0))[:3]
    py = None if python_version is None else _version_tuple("python_version", python_version, parts=2)
    mac = None if macos_version is None else _version_tuple("macos_version", macos_version, parts=2)
    return tf, py, mac


def check_pairing(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """The verdict on TensorFlow `tf_version` with Metal plugin `plugin` at `metal_version`, why, and the fixes.

    Apple's ``tensorflow-metal``: `_PAIRINGS` (user reports), and no wheel
    past cp312 (1.1: cp311) or before macOS 12, so a Python >= 3.13 is
    known-broken whatever the TensorFlow. The open
    ``tensorflow-metal-plugin``: known-good only on the TensorFlow release
    its pin was built for (`tfmetal_ext.backends.metal_plugin.TF_VERSION`),
    unknown on another patch of that minor (its load check compares
    major.minor), known-broken on any other TensorFlow (it offers no GPU
    device), on Python < 3.10 or on macOS < 15; another plugin release is
    unknown (our tables describe the pin).

    The fixes name the commands for this Python and TensorFlow: on TF 2.21
    with tensorflow-metal 1.2, uninstall it and install the open plugin (a
    second pip command, since it compiles against the installed TF), or,
    on Python <= 3.12, pin TF 2.16-2.19 with tensorflow-metal 1.2.

    Args:
        tf_version: TensorFlow version, e.g. ``"2.21.0"``.
        metal_version: the plugin's version, or None (not installed).
        plugin: ``"tensorflow-metal"`` or ``"tensorflow-metal-plugin"``.
        python_version: e.g. ``"3.12.8"`` or ``(3, 12)``; None: unknown (no
            Python-based verdict, and every route is offered).
        macos_version: e.g. ``"15.3"`` or ``(15, 3)``; None: unknown.

    Returns:
        A `PairingCheck`.

    Raises:
        ValueError: an unknown `plugin` or an unreadable version.
    """
    from tfmetal_ext.backends import metal_plugin as open_plugin

    tf, py, mac = _check_args(tf_version, metal_version, plugin, python_version, macos_version)
    if metal_version is None:
        return PairingCheck(NOT_APPLICABLE, "no Metal plugin installed")
    apple_ok_python = py is None or py <= (3, 12)
    plugin_ok_python = py is None or PLUGIN_MIN_PYTHON <= py <= _TF_2_21_MAX_PYTHON
    plugin_ok_macos = mac is None or mac >= open_plugin.MIN_MACOS
    min_mac = _fmt(open_plugin.MIN_MACOS)

    if plugin == APPLE:
        max_py = next((v for prefix, v in _APPLE_MAX_PYTHON if _matches(metal_version, prefix)), None)
        to_plugin = [_plugin_route(tf, uninstall_apple=True)] if plugin_ok_python else []
        if not plugin_ok_macos:
            to_plugin = [_MACOS_UPDATE] if plugin_ok_python else []
        if py is not None and max_py is not None and py > max_py:
            fixes = list(to_plugin)
            if py <= (3, 12):  # 1.1 on 3.12: 1.2 has the wheel
                fixes.append(_apple_route(tf))
            if not fixes:
                fixes.append(_NEW_PYTHON)
            return PairingCheck(
                KNOWN_BROKEN,
                f"{APPLE} {metal_version} has no wheel for Python {_fmt(py)} (newest: cp{max_py[0]}{max_py[1]}); "
                f"on Python >= 3.13 only the open {OPEN_PLUGIN} runs TensorFlow on a Mac's GPU",
                tuple(fixes),
            )
        if mac is not None and mac < APPLE_MIN_MACOS:
            return PairingCheck(KNOWN_BROKEN, f"{APPLE} has wheels for macOS 12 and later only (this is {_fmt(mac)})",
                                (PairingFix("update macOS to 12 or later (15 or later for the open plugin)"),))
        verdict = _apple_verdict(tf, metal_version)
        if verdict == KNOWN_GOOD:
            return PairingCheck(KNOWN_GOOD, f"TensorFlow {_fmt(tf[:2])} with {APPLE} {metal_version} is a reported working pairing")
        if verdict == UNKNOWN:
            return PairingCheck(UNKNOWN, f"no report on TensorFlow {_fmt(tf)} with {APPLE} {metal_version}")
        apple = [_apple_route(tf)] if apple_ok_python else []
        plugin_first = tf[:2] >= (2, 20) and plugin_ok_macos  # it keeps this TensorFlow
        fixes = (to_plugin + apple) if plugin_first else (apple + to_plugin)
        why = (
            f"{APPLE} {metal_version} fails to load into TensorFlow {_fmt(tf)} (missing _pywrap_tensorflow_internal.so"
            " / AttrValue symbol); its last release, 1.2.0, loads into TF <= 2.19"
            if tf[:2] >= (2, 20) else f"TensorFlow {_fmt(tf)} with {APPLE} {metal_version} was reported broken"
        )
        return PairingCheck(KNOWN_BROKEN, why, tuple(fixes))

    # The open plugin.
    apple = [_apple_route(tf, uninstall_plugin=True)] if apple_ok_python else []
    if py is not None and py < PLUGIN_MIN_PYTHON:
        return PairingCheck(
            KNOWN_BROKEN, f"{OPEN_PLUGIN} needs Python >= {_fmt(PLUGIN_MIN_PYTHON)} (this is {_fmt(py)})",
            (PairingFix(f"use a Python 3.10-3.13 environment for {OPEN_PLUGIN}"),) + tuple(apple),
        )
    if not plugin_ok_macos:
        return PairingCheck(
            KNOWN_BROKEN,
            f"{OPEN_PLUGIN} needs macOS {min_mac} or later (dyld refuses to load it on {_fmt(mac)})",
            tuple(apple) + (_MACOS_UPDATE,),
        )
    pins = dict(_plugin_pairings())
    if metal_version not in pins:
        return PairingCheck(
            UNKNOWN,
            f"tfmetal-ext knows {OPEN_PLUGIN} {', '.join(pins)} (built for TensorFlow {', '.join(pins.values())}); "
            f"{metal_version} is untested here",
        )
    pin_tf = _version_tuple("tf_version", pins[metal_version])
    if tf == pin_tf:
        return PairingCheck(KNOWN_GOOD, f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]}")
    if tf[:2] == pin_tf[:2]:
        return PairingCheck(
            UNKNOWN,
            f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]}; it loads into "
            f"{_fmt(tf)} (it checks major.minor) but that release is untested here",
        )
    reroute = [_plugin_route(tf, rebuild=True)] if plugin_ok_python else []
    fixes = (apple + reroute) if (2, 16) <= tf[:2] <= (2, 19) else (reroute + apple)
    return PairingCheck(
        KNOWN_BROKEN,
        f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]} only and offers no GPU device "
        f"in TensorFlow {_fmt(tf)}",
        tuple(fixes),
    )


def pairing_verdict(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """Verdict on a TensorFlow / Metal plugin pairing (`check_pairing(...).verdict`).

    Args:
        tf_version: TensorFlow version string, e.g. ``"2.19.1"``.
        metal_version: the plugin's version string, or None.
        plugin: ``"tensorflow-metal"`` (Apple's) or ``"tensorflow-metal-plugin"``.
        python_version: the Python version (``"3.13.1"``), or None: unknown.
        macos_version: the macOS version (``"14.6"``), or None: unknown.

    Returns:
        ``"known-good"``, ``"known-broken"``, ``"unknown"`` or
        ``"not-applicable"`` when `metal_version` is None.

    Raises:
        ValueError: an unknown `plugin` or an unreadable version.
    """
    return check_pairing(tf_version, metal_version, plugin, python_version, macos_version).verdict


def pairing_fixes(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """The `PairingFix` routes for this pairing (`check_pairing(...).fixes`); empty when nothing is broken."""
    return check_pairing(tf_version, metal_version, plugin, python_version, macos_version).fixes


def check_installed(plugins, tf_version, python_version=None, macos_version=None, library_owner=None):
    """`check_pairing` for the Metal plugins found installed (`{name: version}`, none, one or both).

    Both at once is `BOTH_INSTALLED`: both distributions install
    ``tensorflow-plugins/libmetal_plugin.dylib`` (the one installed last
    overwrote the other's, and uninstalling either deletes that file), and
    loading two libraries that register the METAL platform aborts the
    process. The fix uninstalls the one that cannot run this TensorFlow and
    Python (TF >= 2.20 or Python >= 3.13: Apple's; TF <= 2.19: the open
    plugin) and reinstalls the other.

    Args:
        plugins: ``{distribution: version}`` of the Metal plugins installed.
        tf_version, python_version, macos_version: as for `check_pairing`.
        library_owner: with both installed, whose ``libmetal_plugin.dylib``
            is on disk (the one TensorFlow loads), if known; it is named in
            the reason and returned as the plugin.

    Returns:
        ``(plugin, PairingCheck)``: the plugin installed, or with both, the
        one whose library is on disk when known, else the one the first fix
        keeps (None when none is installed).
    """
    plugins = {n: plugins[n] for n in METAL_PLUGINS if n in plugins}
    if len(plugins) < 2:
        name = next(iter(plugins), None)
        return name, check_pairing(tf_version, plugins.get(name), name or APPLE, python_version, macos_version)
    tf, py, mac = _check_args(tf_version, None, APPLE, python_version, macos_version)
    from tfmetal_ext.backends import metal_plugin as open_plugin

    plugin_ok = (py is None or PLUGIN_MIN_PYTHON <= py <= _TF_2_21_MAX_PYTHON) and (
        mac is None or mac >= open_plugin.MIN_MACOS)
    apple_ok = py is None or py <= (3, 12)
    keep_apple = apple_ok and (tf[:2] <= (2, 19) or not plugin_ok)
    fixes = []
    if plugin_ok:
        fixes.append(_plugin_route(tf, uninstall_apple=True, rebuild=True))
    if apple_ok:
        fixes.insert(0 if keep_apple else len(fixes), _apple_route(tf, uninstall_plugin=True, reinstall=True))
    both = ", ".join(f"{n} {v}" for n, v in plugins.items())
    on_disk = f" (the file on disk is {library_owner}'s)" if library_owner in plugins else ""
    return (library_owner if library_owner in plugins else (APPLE if keep_apple else OPEN_PLUGIN)), PairingCheck(
        BOTH_INSTALLED,
        f"both Metal plugins are installed ({both}): both install {PLUGIN_LIBRARY}, so one overwrote the "
        f"other{on_disk}, uninstalling either deletes it, and loading both aborts the process; keep one",
        tuple(fixes),
    )


def describe_pairing(caps):
    """Lines that describe the Metal backend of `caps` and its pairing: verdict, why, fix commands.

    For ``tfmetal-ext version`` and the doctor.
    """
    if caps.metal_plugins and len(caps.metal_plugins) > 1:
        backend_text = " and ".join(f"{n} {v}" for n, v in caps.metal_plugins) + " (both installed: an error)"
    elif caps.metal_plugin:
        backend_text = f"{caps.metal_plugin} {caps.metal_plugin_version}"
    else:
        backend_text = "none installed"
    lines = [
        f"Metal plugin: {backend_text}",
        f"backend {caps.backend} on {caps.platform}"
        + (f" (macOS {caps.macos})" if caps.macos else "") + (f", Python {caps.python}" if caps.python else ""),
        f"pairing: {caps.pairing}" + (f" ({caps.pairing_reason})" if caps.pairing_reason else ""),
    ]
    for i, fix in enumerate(caps.pairing_fixes or ()):
        lines.append(f"{'fix' if i == 0 else 'or'}: {fix.summary}")
        lines.extend(f"  {c}" for c in fix.commands)
    if caps.pairing_fix and not caps.pairing_fixes:
        lines.append(f"fix: {caps.pairing_fix}")
    return lines


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
    )
