"""Build-on-first-use of the custom-op library.

The op sources (``custom_ops/``: registrations, CPU kernels, and on macOS
arm64 the Metal kernels) ship with the package. The first time an op is used,
they are compiled into one shared library in a cache directory keyed by the
TensorFlow version, the compile and link flags, the compiler and a hash of the
sources, so a library is only ever loaded into the TensorFlow it was built for
(a library built for TF 2.19 does not load into 2.21). A file lock makes
concurrent processes build once; the build goes to a temporary name and is
renamed into place, and a checksum written beside it lets a corrupted or
truncated entry be detected and rebuilt. The compiler lookup, the cache's
trust checks, the lock and the atomic install are the toolchain's
(``_toolchain``), which the Metal emulator (``custom_ops/emu``) builds through too.

Cache root: ``$TFMETAL_EXT_CACHE`` if set, else ``~/.cache/tfmetal_ext``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from tfmetal_ext.ops import _toolchain
from tfmetal_ext.ops._toolchain import cache_root, find_compiler  # noqa: F401  (the loader's own names)

logger = logging.getLogger("tfmetal_ext")

LIBRARY_NAME = "libtfmetal_ext_ops.so"
# -fno-math-errno: sqrt in a kernel loop otherwise needs a libm call path to
# set errno, which stops GCC from vectorizing the loop (clang's default on macOS).
_BUILD_FLAGS = ("-std=c++17", "-shared", "-fPIC", "-O3", "-fno-math-errno", "-Wall", "-Wno-sign-compare",
               "-Wno-unused-function", "-Wno-deprecated-declarations")


# The Metal host code's declaration of tensorflow-metal-plugin's stream
# (custom_ops/metal/metal_plugin_stream.h) is checked against this release's
# headers (tests/ops/test_metal_host_code.py); the op library binds to that
# plugin only at this release. Passed to the compiler from the one pin.
def metal_defines() -> tuple:
    """The preprocessor definitions the Metal host code is compiled with."""
    from tfmetal_ext.backends import metal_plugin

    return (f'-DTFMETAL_EXT_OPEN_PLUGIN_VERIFIED="{metal_plugin.PIN}"',)


# The environment variable through which the Metal host code learns which
# Metal plugin distributions are installed ("name==version", comma-separated),
# set before the library loads (custom_ops/metal/metal_binding.h).
METAL_PLUGINS_ENV = "TFMETAL_EXT_METAL_PLUGINS"
# The gap-kernel plan, read by custom_ops/metal/gap_plan.h.
from tfmetal_ext.backends.gap_kernels import PLAN_ENV as GAP_PLAN_ENV  # noqa: E402


class BuildError(RuntimeError):
    """The op library failed to compile; the message holds the compiler's output."""


class OpCacheError(_toolchain.UntrustedCacheError):
    """The op cache is not trusted: a directory or the library is not owned by
    the current user or root, is group/other-writable, or is a symlink.

    A PermissionError (so an OSError): `load()` falls back to the pure-TF
    references with a warning carrying this message; `build()` raises it.
    """


# The op cache's trust checks (the toolchain's, raising OpCacheError).
_CACHE = {"what": "op cache", "error": OpCacheError}


def verify_dirs(dirs, create: bool) -> None:
    """Checks each of `dirs` (outermost first), creating the missing ones
    with mode 0o700 when ``create``."""
    _toolchain.verify_dirs(dirs, create, **_CACHE)


def verify_library(path: Path) -> None:
    """Checks a native library in the cache before it is loaded (when it exists)."""
    _toolchain.verify_file(path, **_CACHE)


def verify_cache(p: "BuildPlan", create: bool) -> None:
    """Checks the cache root, ``ops/`` and the key directory (creating them
    with mode 0o700 when ``create``), and the library when it exists."""
    verify_dirs((cache_root(), cache_root() / "ops", p.directory), create)
    verify_library(p.library)


def sources_dir() -> Path:
    """The ``custom_ops`` directory: installed package data, else the source tree."""
    spec = importlib.util.find_spec("tfmetal_ext._custom_ops")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0])
        if (path / "ops").is_dir():
            return path
    path = Path(__file__).resolve().parents[2] / "custom_ops"
    if (path / "ops").is_dir():
        return path
    raise FileNotFoundError("tfmetal_ext: the custom op sources (custom_ops/) are missing from this installation")


def is_macos_arm() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def _source_files(src: Path) -> list[Path]:
    files = sorted(src.glob("include/**/*.h")) + sorted(src.glob("ops/*.cc")) + sorted(src.glob("cpu/*.cc"))
    files += sorted(src.glob("ops/*.h")) + sorted(src.glob("cpu/*.h"))
    if is_macos_arm():
        files += sorted(src.glob("metal/*.h")) + sorted(src.glob("metal/*.metal")) + sorted(src.glob("metal/*.mm"))
        files += sorted(src.glob("metal/*.py"))  # embed.py shapes the embedded kernel sources
    return files


def _translation_units(src: Path) -> list[Path]:
    units = sorted(src.glob("ops/*.cc")) + sorted(src.glob("cpu/*.cc"))
    if is_macos_arm():
        units += sorted(src.glob("metal/*.mm"))
    return units


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """What would be built, and where."""

    compiler: str
    tf_version: str
    compile_flags: tuple
    link_flags: tuple
    sources: tuple
    units: tuple
    key: str
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / LIBRARY_NAME

    @property
    def metadata(self) -> Path:
        return self.directory / "build.json"

    @property
    def with_metal(self) -> bool:
        return any(str(u).endswith(".mm") for u in self.units)


def _compiler_identity(compiler: str) -> str:
    try:
        return _toolchain.compiler_identity(compiler)
    except (OSError, subprocess.SubprocessError):
        return compiler


def plan(compiler: str | None = None) -> BuildPlan:
    import tensorflow as tf

    compiler = compiler or find_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++ / clang++)")
    src = sources_dir()
    compile_flags = tuple(tf.sysconfig.get_compile_flags())
    link_flags = tuple(tf.sysconfig.get_link_flags())
    files = _source_files(src)
    parts = [tf.__version__, _compiler_identity(compiler), platform.machine(), sys.platform,
             " ".join(compile_flags), " ".join(link_flags), " ".join(_BUILD_FLAGS)]
    if is_macos_arm():
        parts.append(" ".join(metal_defines()))
    for f in files:
        parts += [str(f.relative_to(src)), f.read_bytes()]
    key = _toolchain.digest(*parts)
    directory = cache_root() / "ops" / f"tf{tf.__version__}-{key}"
    return BuildPlan(compiler, tf.__version__, compile_flags, link_flags, tuple(files),
                     tuple(_translation_units(src)), key, directory)


def entry_is_valid(p: BuildPlan) -> bool:
    """The cached library exists and matches the checksum recorded when it was built."""
    try:
        meta = json.loads(p.metadata.read_text())
        return p.library.is_file() and meta.get("sha256") == _toolchain.sha256_file(p.library)
    except (OSError, ValueError):
        return False


_file_lock = _toolchain.file_lock  # also the signpost library's lock (callbacks/_signpost.py)


def _compile(p: BuildPlan) -> None:
    src = sources_dir()
    verify_cache(p, create=True)
    with tempfile.TemporaryDirectory(dir=p.directory) as tmp:
        unity = Path(tmp) / "unity.cc"
        # One translation unit: TF's headers dominate compile time, so
        # compiling them once makes the build several times faster.
        unity.write_text("".join(f'#include "{u}"\n' for u in p.units if u.suffix == ".cc"))
        out = Path(tmp) / LIBRARY_NAME
        cmd = shlex.split(p.compiler) + list(_BUILD_FLAGS) + list(p.compile_flags)
        cmd += ["-I", str(src / "include"), "-I", str(src), str(unity)]
        if p.with_metal:
            # Each <op>_metal.mm includes <op>_metal_source.h: its .metal file
            # with the includes inlined, as a string (Metal compiles kernels at
            # run time from one source string).
            embedded = Path(tmp) / "metal_sources"
            embed = _embed_module(src)
            try:
                embed.write_embedded_sources(embedded, sorted(src.glob("metal/*.metal")))
            except embed.FlattenError as e:
                raise BuildError(f"embedding the Metal kernel sources failed: {e}") from e
            cmd += ["-I", str(embedded)] + list(metal_defines())
            cmd += ["-x", "objective-c++", "-fobjc-arc"] + [str(u) for u in p.units if u.suffix == ".mm"]
            cmd += ["-framework", "Foundation", "-framework", "Metal", "-undefined", "dynamic_lookup"]
        cmd += ["-o", str(out)] + list(p.link_flags)
        logger.warning("tfmetal_ext: building the custom-op library for TensorFlow %s (once; cached in %s)",
                       p.tf_version, p.directory)
        start = time.monotonic()
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(
                "building the tfmetal_ext custom-op library failed.\ncommand: "
                + " ".join(shlex.quote(c) for c in cmd) + "\n" + (result.stderr or result.stdout)[-20000:]
            )
        _toolchain.install(out, p.library)
    meta = {
        "tf_version": p.tf_version,
        "compiler": _compiler_identity(p.compiler),
        "key": p.key,
        "metal_kernels": p.with_metal,
        "sources": [str(s.relative_to(src)) for s in p.sources],
        "seconds": round(time.monotonic() - start, 1),
        "sha256": _toolchain.sha256_file(p.library),
    }
    _toolchain.write_private(p.directory, p.metadata, json.dumps(meta, indent=2).encode())
    logger.warning("tfmetal_ext: built %s in %.1f s", p.library, meta["seconds"])


def _embed_module(src: Path):
    """custom_ops/metal/embed.py of the sources being built (standard library only)."""
    name = "tfmetal_ext_ops_embed"
    path = src / "metal" / "embed.py"
    module = sys.modules.get(name)
    if module is None or Path(module.__file__) != path:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def build(force: bool = False, compiler: str | None = None) -> BuildPlan:
    """Builds the library unless a valid cached build exists; returns the plan."""
    p = plan(compiler)
    verify_cache(p, create=False)
    if not force and entry_is_valid(p):
        return p  # a valid (possibly read-only) cache needs no lock
    verify_cache(p, create=True)
    with _file_lock(p.directory.with_suffix(".lock")):
        if force or not entry_is_valid(p):
            if p.directory.exists():
                for stale in (p.library, p.metadata):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
            _compile(p)
    return p


# ----------------------------------------------------------------------------
# Loading, once per process.


@dataclasses.dataclass
class _State:
    module: object = None
    plan: BuildPlan | None = None
    error: str | None = None
    attempted: bool = False


_state = _State()
_lock = threading.Lock()


def load():
    """The loaded op module, building it first if needed; None if unavailable.

    Unavailable (no compiler, or the build failed) means the pure-TF
    references are used, with one warning saying why.
    """
    if _state.attempted:
        return _state.module
    with _lock:
        if _state.attempted:
            return _state.module
        try:
            _state.module, _state.plan = _load_or_rebuild()
            _log_gpu_fallback()
            _warn_unknown_cpu_level()
        except (BuildError, FileNotFoundError, OSError) as e:
            _state.error = str(e)
            warnings.warn(
                "tfmetal_ext: custom ops unavailable, using the pure-TF reference implementations "
                f"(correct, slower). Reason: {e}",
                RuntimeWarning,
                stacklevel=3,
            )
        _state.attempted = True
    return _state.module


def load_for_gap_kernels() -> bool:
    """Loads the op library at ``import tfmetal_ext`` where that registers gap kernels; True if it did.

    Only on macOS arm64 with exactly one Metal plugin installed whose table
    plans at least one gap kernel (`tfmetal_ext.backends.gap_kernels`), so a
    stock Keras model gets them with nothing but the import. The first import
    builds the library (once per TensorFlow version; cached). Nothing happens
    elsewhere, with ``TFMETAL_EXT_GAP_KERNELS_ENABLE=0``, or with
    ``TFMETAL_EXT_REFERENCE_OPS=1``.
    """
    from tfmetal_ext.backends import gap_kernels
    from tfmetal_ext.ops import _common

    if not is_macos_arm() or _common.use_reference():
        return False
    found = gap_kernels.for_this_process()
    if found is None or not gap_kernels.registered(found[2]):
        return False
    load()
    return True


def gap_plan_text() -> str:
    """The gap-kernel plan for this process's Metal backend (`tfmetal_ext.backends.gap_kernels`), as text.

    Empty (nothing registered) without exactly one installed Metal plugin.
    """
    from tfmetal_ext.backends import gap_kernels

    found = gap_kernels.for_this_process()
    if found is None:
        return ""
    _, dist, rows = found
    return gap_kernels.plan_text(dist, rows)


def installed_metal_plugins() -> str:
    """``"name==version"`` of each installed Metal plugin distribution, comma-separated."""
    from tfmetal_ext import devices

    return ",".join(f"{name}=={version}" for name, version in sorted(devices._metal_plugins().items()))


def _load_or_rebuild():
    import tensorflow as tf

    p = build()
    if p.with_metal:
        # Read by the Metal host code's static initializers while the library
        # loads: which backend's stream it may bind to (metal_binding.h), and
        # which gap kernels to register (gap_plan.h).
        os.environ[METAL_PLUGINS_ENV] = installed_metal_plugins()
        os.environ[GAP_PLAN_ENV] = gap_plan_text()
    verify_cache(p, create=False)
    try:
        return tf.load_op_library(str(p.library)), p
    except (tf.errors.NotFoundError, OSError) as e:
        # A library that passed the checksum but does not load (e.g. a
        # different TF with the same version string): rebuild once.
        logger.warning("tfmetal_ext: cached op library did not load (%s); rebuilding", e)
        p = build(force=True)
        verify_cache(p, create=False)
        return tf.load_op_library(str(p.library)), p


def state() -> _State:
    return _state


# ----------------------------------------------------------------------------
# Which GPU kernels the Metal host code registered, and why not.


@dataclasses.dataclass(frozen=True)
class GpuRegistration:
    """One op's GPU kernel registration, as the Metal host code recorded it."""

    op: str  # "TfmetalExt>LayerNorm"
    gpu: bool
    backend: str | None  # "tensorflow-metal", "tensorflow-metal-plugin", or None
    reason: str | None  # why no GPU kernel, when not gpu


def parse_gpu_registrations(text: str) -> dict:
    """``{op: GpuRegistration}`` from ``TfmetalExt_MetalKernelStatus()``'s text.

    One line per op, ``<op>\t<1|0>\t<backend>\t<reason>`` (``binding::FormatRecords``
    in custom_ops/metal/metal_binding.h). Raises ValueError on a malformed line.
    """
    found = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 4 or parts[1] not in ("0", "1"):
            raise ValueError(f"malformed GPU registration record. Received: line={line!r}")
        op, gpu, backend, reason = parts
        found[op] = GpuRegistration(op, gpu == "1", backend or None, reason or None)
    return found


def _library_text(library: Path, symbol: str) -> str | None:
    """The string the loaded library's ``const char* symbol()`` returns, or None without it."""
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(str(library)), symbol)  # already loaded: the same image
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    raw = fn()
    return raw.decode("utf-8", "replace") if raw is not None else None


def _read_gpu_status_text(library: Path) -> str | None:
    """The loaded library's ``TfmetalExt_MetalKernelStatus()``, or None without it."""
    return _library_text(library, "TfmetalExt_MetalKernelStatus")


CPU_LEVELS = ("baseline", "avx2", "avx512")


def _warn_unknown_cpu_level() -> None:
    cap = os.environ.get("TFMETAL_EXT_CPU_LEVEL")
    if cap is not None and cap not in CPU_LEVELS:
        warnings.warn(f"tfmetal_ext: TFMETAL_EXT_CPU_LEVEL must be one of {', '.join(CPU_LEVELS)}; it caps "
                      f"nothing. Received: TFMETAL_EXT_CPU_LEVEL={cap!r}", RuntimeWarning, stacklevel=4)


def cpu_vector_level() -> str | None:
    """The loaded library's CPU kernel level, ``"avx512"``, ``"avx2"`` or ``"baseline"``; None unloaded.

    Picked once per process from the CPU (cpu/cpu_common.h), at most ``TFMETAL_EXT_CPU_LEVEL``.
    """
    if _state.module is None or _state.plan is None:
        return None
    return _library_text(_state.plan.library, "TfmetalExt_CpuVectorLevel")


def gpu_registrations() -> dict | None:
    """``{op: GpuRegistration}`` of the loaded library; None when it has no Metal kernels."""
    if _state.module is None or _state.plan is None or not _state.plan.with_metal:
        return None
    text = _read_gpu_status_text(_state.plan.library)
    if text is None:
        return None
    return parse_gpu_registrations(text)


def gpu_fallback_message(registrations: dict) -> str | None:
    """The one log line for ops without a GPU kernel on this Metal backend, or None."""
    by_reason = {}
    for r in registrations.values():
        if not r.gpu:
            by_reason.setdefault(r.reason or "no reason recorded", []).append(r.op)
    if not by_reason:
        return None
    parts = "; ".join(f"{', '.join(sorted(ops))}: {reason}" for reason, ops in by_reason.items())
    return (f"tfmetal_ext: custom ops with no Metal GPU kernel registered ({parts}); each runs its CPU kernel "
            "where TF places it on the CPU, and its pure-TF reference where it would run on the GPU")


def _log_gpu_fallback() -> None:
    try:
        registrations = gpu_registrations()
    except ValueError as e:
        logger.warning("tfmetal_ext: could not read the Metal kernels' registration status: %s", e)
        return
    message = gpu_fallback_message(registrations or {})
    if message:
        logger.warning("%s", message)


def reset_for_tests() -> None:
    """Forgets the loaded module (a loaded library stays mapped in the process)."""
    with _lock:
        _state.module, _state.plan, _state.error, _state.attempted = None, None, None, False
