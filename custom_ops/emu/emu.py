"""Runs Metal kernels on the CPU: compiles a ``.metal`` file as C++ against the
emulated MSL surface (``metal_emu.h``) and dispatches its kernels with Metal's
execution model (``runtime.cc``: concurrent threads per threadgroup, real
barriers, 32-wide SIMD-groups, poisoned threadgroup memory).

    lib = build("custom_ops/metal/softshrink.metal")
    lib.kernels()                       # ['softshrink_float', 'softshrink_half', ...]
    x = np.random.randn(1000).astype(np.float32); y = np.empty_like(x)
    lib.run("softshrink_float", [x, y, ("bytes", np.float32(0.5)), ("bytes", np.uint32(x.size))],
            grid=(x.size, 1, 1), threadgroup=(256, 1, 1))

Arguments bind to the kernel's parameters by position (buffers, then
constants, then threadgroup memory; the builtins come from the runner):
- a C-contiguous numpy array: a buffer (``device T*`` / ``constant T*``), written in place;
- ``("buffer", array)``: the same without the element-size check;
- ``("bytes", value)``: ``setBytes``-style data for a ``constant T&`` (numpy
  scalar or array, ``bytes``, or a ctypes structure);
- ``("threadgroup", nbytes)``: ``setThreadgroupMemoryLength`` (multiple of 16).
``grid=`` is in threads (``dispatchThreads``: edge threadgroups are smaller);
``threadgroups=`` instead gives ``dispatchThreadgroups`` semantics.

Standard library + numpy only (no TensorFlow). Libraries are cached in
``$TFMETAL_EXT_CACHE/emu`` (default ``~/.cache/tfmetal_ext/emu``) keyed by a
hash of the flattened source, the emulator sources, flags and compiler. The
cache is the op loader's kind (``tfmetal_ext/ops/_toolchain.py``): private
directories, file locks, atomic installs, and a library or object that is a
symlink, owned by another user, or in a group/other-writable directory is
refused (`EmuCacheError`), never loaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

EMU_DIR = Path(__file__).resolve().parent
CUSTOM_OPS_DIR = EMU_DIR.parent
METAL_DIR = CUSTOM_OPS_DIR / "metal"
INCLUDE_DIR = CUSTOM_OPS_DIR / "include"
ABI_VERSION = 1

_CXX_STD = "-std=c++20"
_RUNTIME_FLAGS = (_CXX_STD, "-O2", "-fPIC", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra")
# -ffp-contract=off: no fused a*b+c unless the kernel writes fma(), so results
# do not depend on the host CPU (arm64 has fma, x86-64 baseline not).
_KERNEL_FLAGS = (_CXX_STD, "-O1", "-DTFM_EMU=1", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
                 "-ffp-contract=off") + (
    ("-Wl,-undefined,error",) if sys.platform == "darwin" else ("-Wl,-Bsymbolic", "-Wl,--no-undefined"))
_DEFAULT_TIMEOUT = 120.0


def _load_by_path(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_toolchain():
    """The op loader's toolchain (compiler, trusted cache, locks), without importing the package.

    The package's own module when it is imported (tests), else its file: beside
    the package in the source tree, or in it when installed (``custom_ops`` ships
    as ``tfmetal_ext/_custom_ops``).
    """
    if "tfmetal_ext.ops._toolchain" in sys.modules:
        return sys.modules["tfmetal_ext.ops._toolchain"]
    for path in (CUSTOM_OPS_DIR.parent / "tfmetal_ext" / "ops" / "_toolchain.py",
                 CUSTOM_OPS_DIR.parent / "ops" / "_toolchain.py"):
        if path.is_file():
            return _load_by_path("tfmetal_ext_toolchain", path)
    raise ImportError(f"the op loader's toolchain module (tfmetal_ext/ops/_toolchain.py) is missing beside {CUSTOM_OPS_DIR}")


embed = _load_by_path("tfmetal_ext_metal_embed", METAL_DIR / "embed.py")
flatten = embed.flatten
FlattenError = embed.FlattenError
_toolchain = _load_toolchain()


class EmuError(RuntimeError):
    """A kernel could not be run: bad arguments, divergent barrier, timeout, ..."""


class EmuCompileError(EmuError):
    """The kernel did not compile under the emulator; the message holds the compiler output."""


class EmuCacheError(EmuError, _toolchain.UntrustedCacheError):
    """The emulator cache is not trusted: a directory, library or object file is
    a symlink, not owned by the current user or root, or group/other-writable.
    Nothing from it is loaded. Also a PermissionError."""


@dataclasses.dataclass(frozen=True)
class KernelParam:
    """One kernel parameter before the builtins."""

    index: int
    kind: str  # "pointer" (device/constant/threadgroup T*) or "reference" (constant T&)
    const: bool
    size: int  # sizeof(T)
    align: int


# ----------------------------------------------------------------------------
# Source preparation: what g++ needs beyond metal_emu.h.

_TG_ATTRIBUTE = re.compile(r"\[\[\s*threadgroup\s*\(")
# `threadgroup T name[N]...;` in a kernel body (one variable, no initializer).
_TG_VARIABLE = re.compile(
    r"\bthreadgroup\s+((?:(?:const|volatile)\s+)*[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+"
    r"([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);"
)
_TG_LEFTOVER = re.compile(r"\bthreadgroup\s+(?:(?:const|volatile)\s+)*[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?\s+[A-Za-z_]\w*\s*[\[=,;]")
_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(h|H|bf|BF)\b")
_LINE_MARKER = re.compile(r'^#line (\d+) "((?:[^"\\]|\\.)*)"\n', re.M)


def _origin(text: str, offset: int) -> str:
    """file:line of ``offset`` in flattened text, from its #line markers."""
    name, line = "<source>", 1
    base_offset = 0
    for m in _LINE_MARKER.finditer(text, 0, offset):
        name, line, base_offset = m.group(2), int(m.group(1)), m.end()
    return f"{name}:{line + text.count(chr(10), base_offset, offset)}"


def _tg_variable(m: re.Match) -> str:
    type_, name, dims = m.group(1), m.group(2), re.sub(r"\s+", "", m.group(3))
    alias, tag = f"tfm_tg_type_{name}", f"tfm_tg_tag_{name}"
    code = (f"typedef {type_} {alias}{dims}; static char {tag}; {alias}& {name} = *static_cast<{alias}*>("
            f"::tfm_emu::threadgroup_variable(&{tag}, sizeof({alias}), alignof({alias})));")
    return code + "\n" * m.group(0).count("\n")  # keep line numbers


def _literal(m: re.Match) -> str:
    value = m.group(1)
    return f"(half({value}f))" if m.group(2) in ("h", "H") else f"(bfloat({value}f))"


def emulator_source(flat_source: str) -> str:
    """Rewrites the MSL constructs a C++ header cannot express.

    ``[[threadgroup(n)]]`` would lose its name to the empty ``threadgroup``
    macro; ``threadgroup T x[N];`` in a kernel body must be one shared object
    per threadgroup, not per thread; ``1.5h`` / ``1.5bf`` literal suffixes.
    """
    text = _TG_ATTRIBUTE.sub("[[tfm_threadgroup(", flat_source)
    text = _TG_VARIABLE.sub(_tg_variable, text)
    left = _TG_LEFTOVER.search(text)
    if left:
        raise EmuCompileError(
            f"{_origin(text, left.start())}: unsupported threadgroup variable declaration "
            f"'{left.group(0)}': declare one threadgroup variable per statement, without initializer"
        )
    return _LITERAL.sub(_literal, text)


# ----------------------------------------------------------------------------
# Building.


def cache_dir() -> Path:
    return _toolchain.cache_root() / "emu"


# The emulator cache's trust checks (the op loader's, raising EmuCacheError).
_CACHE = {"what": "Metal emulator cache", "error": EmuCacheError}


def _verify_cache(create: bool) -> Path:
    """The cache directory, checked with its parent (created with mode 0o700 when ``create``)."""
    directory = cache_dir()
    _toolchain.verify_dirs((_toolchain.cache_root(), directory), create, **_CACHE)
    return directory


def find_compiler() -> str:
    compiler = _toolchain.find_compiler(("g++", "c++", "clang++"))
    if not compiler:
        cxx = os.environ.get("CXX")
        raise EmuCompileError(f"C++ compiler CXX={cxx!r} not found" if cxx else
                              "no C++ compiler found (install g++ or set CXX)")
    return compiler


def _compiler_id(compiler: str) -> str:
    try:
        return _toolchain.compiler_identity(compiler)
    except (OSError, subprocess.SubprocessError) as e:
        raise EmuCompileError(f"cannot run the C++ compiler {compiler!r}: {e}") from e


_supports_flags = _toolchain.supports_flags


def _half_flags(compiler: str) -> list:
    """Make `half` arithmetic round after every operation, as the GPU's half ALU does.

    g++ does so by default; clang on targets without native fp16 arithmetic
    (x86-64) computes _Float16 expressions in float unless told not to (the
    spelling of that option depends on the clang version).
    """
    if "clang" not in _compiler_id(compiler).lower():
        return []
    for flags in (("-ffloat16-excess-precision=none",), ("-fexcess-precision=16",),
                  ("-Xclang", "-ffloat16-excess-precision=none")):
        if _supports_flags(compiler, flags):
            return list(flags)
    return []


def _run_compiler(cmd: list, what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stderr or result.stdout)[-30000:]
        raise EmuCompileError(f"{what} failed to compile under the Metal emulator:\n{output}\ncommand: "
                              + " ".join(shlex.quote(c) for c in cmd))


_digest = _toolchain.digest


# Counts actual compiler runs (tests check that the cache is used).
stats = {"kernel_compiles": 0, "runtime_compiles": 0}
_lock = threading.RLock()
_loaded: dict = {}


def _runtime_object(compiler: str, directory: Path) -> Path:
    sources = [EMU_DIR / "runtime.cc", EMU_DIR / "emu_runtime.h"]
    key = _digest(ABI_VERSION, _compiler_id(compiler), " ".join(_RUNTIME_FLAGS), *(p.read_bytes() for p in sources))
    obj = directory / f"runtime-{key}.o"
    with _toolchain.file_lock(directory / f"runtime-{key}.lock"):
        if not os.path.lexists(obj):
            with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
                out = Path(tmp) / obj.name
                _run_compiler(shlex.split(compiler) + list(_RUNTIME_FLAGS) + ["-c", str(sources[0]), "-o", str(out)],
                              "the emulator runtime")
                _toolchain.install(out, obj)
            stats["runtime_compiles"] += 1
    _toolchain.verify_file(obj, **_CACHE)  # linked into every kernel library
    return obj


def build(metal_path, *, include_dirs=None, defines=None, extra_flags=(), compiler=None) -> "EmuLibrary":
    """Compiles ``metal_path`` for the emulator (or reuses a cached build).

    Args:
        metal_path: a ``.metal`` file following custom_ops' conventions.
        include_dirs: where its includes are searched (after its own
            directory); default: its directory, then ``custom_ops/include``.
        defines: ``{"NAME": value}`` preprocessor definitions.
        extra_flags: more compiler flags (e.g. ``["-fsanitize=undefined"]``).
        compiler: default ``$CXX`` or g++.

    Returns:
        EmuLibrary.

    Raises:
        EmuCompileError: with the compiler's messages (file:line of the
            original sources) if it does not compile.
    """
    metal_path = Path(metal_path).resolve()
    compiler = compiler or find_compiler()
    try:
        flat = flatten(metal_path, include_dirs, line_markers="absolute")
    except FlattenError as e:
        raise EmuCompileError(str(e)) from e
    source = emulator_source(flat.source)
    flags = list(_KERNEL_FLAGS) + _half_flags(compiler)
    flags += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())] + list(extra_flags)
    flags += ["-I", str(EMU_DIR)]
    emu_sources = [EMU_DIR / n for n in ("metal_emu.h", "emu_runtime.h", "runtime.cc", "metal_stdlib")]
    key = _digest(ABI_VERSION, _compiler_id(compiler), " ".join(flags), source,
                  *(p.read_bytes() for p in emu_sources))
    with _lock:
        if key in _loaded:
            return _loaded[key]
        directory = _verify_cache(create=True)
        library = directory / f"{metal_path.stem}-{key}.so"
        with _toolchain.file_lock(directory / f"{metal_path.stem}-{key}.lock"):
            if not os.path.lexists(library):
                runtime = _runtime_object(compiler, directory)
                with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
                    src = Path(tmp) / f"{metal_path.stem}.emu.cc"
                    src.write_text(source, encoding="utf-8")
                    out = Path(tmp) / library.name
                    _run_compiler(shlex.split(compiler) + flags + [str(src), str(runtime), "-o", str(out)],
                                  str(metal_path))
                    _toolchain.install(out, library)
                stats["kernel_compiles"] += 1
        _toolchain.verify_file(library, **_CACHE)  # loading it runs it
        lib = EmuLibrary(library, metal_path, flat.files)
        _loaded[key] = lib
        return lib


def clear_loaded() -> None:
    """Forgets libraries loaded in this process (the next build() re-checks the disk cache)."""
    with _lock:
        _loaded.clear()


# ----------------------------------------------------------------------------
# Running.


class EmuLibrary:
    """A compiled ``.metal`` file: its kernels, runnable on numpy arrays."""

    def __init__(self, path: Path, source: Path, files=()):
        self.path = Path(path)
        self.source = Path(source)
        self.files = tuple(files)
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.tfm_emu_abi_version.restype = ctypes.c_int
        abi = self._lib.tfm_emu_abi_version()
        if abi != ABI_VERSION:
            raise EmuError(f"{self.path}: emulator ABI {abi}, expected {ABI_VERSION}")
        self._lib.tfm_emu_describe.restype = ctypes.c_char_p
        info = json.loads(self._lib.tfm_emu_describe().decode())
        if info["errors"]:
            raise EmuCompileError(f"{source}: {info['errors'].strip()}")
        self.limits = info["limits"]
        self._kernels = {
            k["name"]: [KernelParam(i, p["kind"], p["const"], p["size"], p["align"]) for i, p in enumerate(k["params"])]
            for k in info["kernels"]
        }
        run = self._lib.tfm_emu_run
        run.restype = ctypes.c_int
        run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
                        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                        ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                        ctypes.c_double, ctypes.c_char_p, ctypes.c_int]
        self._run = run

    def __repr__(self) -> str:
        return f"EmuLibrary({self.source.name}: {', '.join(self.kernels())})"

    @property
    def max_total_threads_per_threadgroup(self) -> int:
        return self.limits["max_total_threads_per_threadgroup"]

    @property
    def thread_execution_width(self) -> int:
        return self.limits["thread_execution_width"]

    def kernels(self) -> list:
        """Host names of the instantiated kernels, sorted."""
        return sorted(self._kernels)

    def params(self, name: str) -> list:
        """The kernel's parameters before the builtins (KernelParam)."""
        return list(self._kernel(name))

    def _kernel(self, name: str):
        try:
            return self._kernels[name]
        except KeyError:
            raise EmuError(f"no kernel {name!r} in {self.source.name}; it has: {', '.join(self.kernels())}") from None

    def run(self, name: str, args, grid=None, threadgroup=(1, 1, 1), *, threadgroups=None, order: str = "linear",
            seed: int = 0, timeout: float | None = None) -> None:
        """Dispatches kernel ``name`` and waits for it; output arrays are written in place.

        Args:
            name: host name.
            args: one per parameter before the builtins (see the module docstring).
            grid: threads per dimension (``dispatchThreads``), int or up to 3 ints.
            threadgroup: threads per threadgroup, at most 1024 in total.
            threadgroups: instead of ``grid``: threadgroups per dimension
                (``dispatchThreadgroups``; every threadgroup is full).
            order: threadgroup execution order, "linear", "reverse" or
                "shuffle" (with ``seed``): a kernel must not depend on it.
            timeout: seconds before the dispatch is abandoned (default
                ``$TFM_EMU_TIMEOUT`` or 120).

        Raises:
            EmuError: bad arguments, divergent barriers, timeouts, ... (the
                message says which thread, threadgroup and call site).
        """
        params = self._kernel(name)
        if (grid is None) == (threadgroups is None):
            raise EmuError("pass exactly one of grid= (threads) and threadgroups=")
        mode = 0 if threadgroups is None else 1
        grid3 = _size3(grid if threadgroups is None else threadgroups, "grid" if mode == 0 else "threadgroups")
        tg3 = _size3(threadgroup, "threadgroup")
        orders = {"linear": 0, "reverse": 1, "shuffle": 2}
        if order not in orders:
            raise EmuError(f"order must be one of {sorted(orders)}. Received: order={order!r}")
        args = list(args)
        if len(args) != len(params):
            raise EmuError(f"kernel {name!r} takes {len(params)} argument(s) before the builtins, got {len(args)}")
        n = len(args)
        kinds = (ctypes.c_int * max(n, 1))()
        ptrs = (ctypes.c_void_p * max(n, 1))()
        sizes = (ctypes.c_uint64 * max(n, 1))()
        keep = []  # temporaries that must outlive the call
        for i, (arg, param) in enumerate(zip(args, params)):
            kinds[i], ptrs[i], sizes[i] = _bind(i, arg, param, keep)
        err = ctypes.create_string_buffer(8192)
        if timeout is None:
            timeout = float(os.environ.get("TFM_EMU_TIMEOUT", _DEFAULT_TIMEOUT))
        rc = self._run(name.encode(), n, kinds, ptrs, sizes, (ctypes.c_uint32 * 3)(*grid3),
                       (ctypes.c_uint32 * 3)(*tg3), mode, orders[order], seed, float(timeout), err, len(err))
        del keep
        if rc != 0:
            raise EmuError(err.value.decode(errors="replace"))


def _size3(value, what: str) -> tuple:
    if isinstance(value, (int, np.integer)):
        value = (int(value),)
    value = tuple(int(v) for v in value)
    if not 1 <= len(value) <= 3 or any(v < 0 or v > 0xFFFFFFFF for v in value):
        raise EmuError(f"{what} must be 1 to 3 sizes. Received: {what}={value!r}")
    return value + (1,) * (3 - len(value))


_ARG_BUFFER, _ARG_BYTES, _ARG_THREADGROUP = 0, 1, 2


def _array_arg(i: int, arr: np.ndarray, param: KernelParam, check_itemsize: bool):
    if not isinstance(arr, np.ndarray):
        raise EmuError(f"argument {i}: expected a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise EmuError(f"argument {i}: the array must be C-contiguous (np.ascontiguousarray)")
    if param.kind == "pointer" and not param.const and not arr.flags.writeable:
        raise EmuError(f"argument {i}: the kernel writes this buffer but the array is read-only")
    if (check_itemsize and param.kind == "pointer" and param.size in (1, 2, 4, 8)
            and arr.dtype.itemsize in (1, 2, 4, 8) and arr.dtype.itemsize != param.size):
        raise EmuError(f"argument {i}: array of {arr.dtype} ({arr.dtype.itemsize}-byte elements) for a parameter "
                       f"of {param.size}-byte elements (pass ('buffer', array) to bind it anyway)")
    return _ARG_BUFFER, arr.ctypes.data, arr.nbytes


def _bind(i: int, arg, param: KernelParam, keep: list):
    if isinstance(arg, np.ndarray):
        return _array_arg(i, arg, param, True)
    if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], str):
        kind, value = arg
        if kind == "buffer":
            return _array_arg(i, value, param, False)
        if kind == "threadgroup":
            return _ARG_THREADGROUP, None, int(value)
        if kind == "bytes":
            if isinstance(value, (bytes, bytearray)):
                data = bytes(value)
            elif isinstance(value, (np.ndarray, np.generic)):
                data = np.ascontiguousarray(value).tobytes()
            elif isinstance(value, (ctypes.Structure, ctypes.Array, ctypes._SimpleCData)):
                data = bytes(value)
            else:
                raise EmuError(f"argument {i}: bytes must be a numpy scalar/array, bytes or a ctypes object "
                               f"(a Python {type(value).__name__} has no fixed type)")
            buf = ctypes.create_string_buffer(data, max(len(data), 1))
            keep.append(buf)
            return _ARG_BYTES, ctypes.addressof(buf), len(data)
        raise EmuError(f"argument {i}: unknown kind {kind!r} (use 'bytes', 'threadgroup' or 'buffer')")
    raise EmuError(f"argument {i}: expected a numpy array, ('bytes', value), ('threadgroup', nbytes) or "
                   f"('buffer', array), got {type(arg).__name__}")


# ----------------------------------------------------------------------------
# Coverage: every Metal kernel must be exercised by an emulation test.


def all_metal_sources(metal_dir=None) -> list:
    """custom_ops/metal/*.metal, sorted."""
    return sorted(Path(metal_dir or METAL_DIR).glob("*.metal"))


def instantiated_kernels(metal_path) -> list:
    """The host names a .metal file instantiates (compiles it under the emulator)."""
    return build(metal_path).kernels()


def emulation_test_for(metal_path, tests_dir) -> Path:
    """Where the emulation test of ``<op>.metal`` lives: ``tests_dir/test_<op>_metal_emu.py``."""
    return Path(tests_dir) / f"test_{Path(metal_path).stem}_metal_emu.py"


def coverage_problems(metal_dir=None, tests_dir=None) -> list:
    """What is missing for every kernel of every .metal file to be emulation-tested.

    Each ``<op>.metal`` needs ``tests/ops/test_<op>_metal_emu.py`` naming every
    host name it instantiates (as a whole word: write the names out, e.g. in a
    parametrize list, so this check can see them).
    """
    tests_dir = Path(tests_dir) if tests_dir is not None else CUSTOM_OPS_DIR.parent / "tests" / "ops"
    problems = []
    for metal in all_metal_sources(metal_dir):
        test = emulation_test_for(metal, tests_dir)
        try:
            names = instantiated_kernels(metal)
        except EmuError as e:
            problems.append(f"{metal.name}: does not build under the emulator: {str(e)[:2000]}")
            continue
        if not names:
            problems.append(f"{metal.name}: instantiates no kernel (TFM_INSTANTIATE_KERNEL)")
        if not test.is_file():
            problems.append(f"{metal.name}: no emulation test {test} (must run each of: {', '.join(names)})")
            continue
        text = test.read_text(encoding="utf-8")
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text)]
        if missing:
            problems.append(f"{metal.name}: {test.name} does not run kernel(s) {', '.join(missing)}")
    return problems
