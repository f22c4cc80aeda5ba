"""os_signpost step intervals for Instruments on macOS; a no-op everywhere else.

The C side (`custom_ops/signpost/tfm_signpost.c`) is compiled on first use into
a small dylib in the tfmetal_ext cache (no TensorFlow headers needed) and
loaded with ctypes. If it cannot be built, one warning is issued and step
signposts are skipped: training is never affected.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

logger = logging.getLogger("tfmetal_ext")

SOURCE_NAME = "tfm_signpost.c"


def source_path() -> Path:
    from tfmetal_ext.ops import _loader

    return _loader.sources_dir() / "signpost" / SOURCE_NAME


def find_c_compiler() -> str | None:
    """``$CC``, else clang / cc."""
    env = os.environ.get("CC")
    if env:
        return shutil.which(env.split()[0])
    for name in ("clang", "cc"):
        found = shutil.which(name)
        if found:
            return found
    return None


def build(source: Path, output: Path, compiler: str, extra_flags=()) -> Path:
    """Compiles `source` into the shared library `output` (atomically).

    Raises:
        RuntimeError: with the compiler's output when compilation fails.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name (mkstemp, in the caller's verified directory): a planted
    # symlink at a predictable name is never written through.
    fd, tmp_name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(source), *extra_flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building {source.name} failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
    os.replace(tmp, output)
    return output


class Signposts:
    """Begin/end an interval per training step (subsystem ``tfmetal_ext``).

    `Signposts()` is the no-op; `Signposts.for_this_host()` loads the real
    library on macOS.
    """

    def __init__(self, library: ctypes.CDLL | None = None):
        self._lib = library
        if library is not None:
            library.tfm_signpost_init.restype = ctypes.c_int
            library.tfm_signpost_init.argtypes = []
            library.tfm_signpost_step_begin.restype = ctypes.c_uint64
            library.tfm_signpost_step_begin.argtypes = [ctypes.c_uint64]
            library.tfm_signpost_step_end.restype = None
            library.tfm_signpost_step_end.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            library.tfm_signpost_init()

    @property
    def active(self) -> bool:
        """A library is loaded (signposts are emitted, whether or not Instruments records)."""
        return self._lib is not None

    @classmethod
    def from_library(cls, path) -> Signposts:
        return cls(ctypes.CDLL(str(path)))

    @classmethod
    def for_this_host(cls) -> Signposts:
        """The real signposts on macOS (building the dylib on first use), else the no-op."""
        if sys.platform != "darwin":
            return cls()
        try:
            return cls.from_library(_cached_library())
        except (OSError, RuntimeError) as e:
            warnings.warn(
                f"tfmetal_ext: os_signpost step intervals are off ({e}); profiling continues without them.",
                RuntimeWarning,
                stacklevel=2,
            )
            return cls()

    def begin(self, step: int) -> int:
        """Starts the interval of `step`; returns the token for `end`."""
        if self._lib is None:
            return 0
        return int(self._lib.tfm_signpost_step_begin(int(step)))

    def end(self, token: int, step: int) -> None:
        if self._lib is not None:
            self._lib.tfm_signpost_step_end(int(token), int(step))


def _cached_library() -> Path:
    from tfmetal_ext.ops import _loader

    source = source_path()
    if not source.exists():
        raise RuntimeError(f"the signpost source {source} is missing from this installation")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    # Loading it is running native code: only from a cache the loader trusts
    # (tfmetal_ext.ops.OpCacheError otherwise), as for the op library.
    directory = _loader.cache_root() / "signpost"
    out = directory / f"libtfm_signpost-{digest}.dylib"
    _loader.verify_dirs((_loader.cache_root(), directory), create=False)
    if out.exists():
        _loader.verify_library(out)
        return out
    _loader.verify_dirs((_loader.cache_root(), directory), create=True)
    compiler = find_c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (install the Xcode command line tools: xcode-select --install)")
    with _loader._file_lock(out.with_suffix(".lock")):
        if not out.exists():
            logger.info("building %s", out)
            build(source, out, compiler)
    _loader.verify_library(out)
    return out
