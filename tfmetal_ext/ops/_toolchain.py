"""The native toolchain shared by the op-library loader and the Metal emulator.

Loading native code is running it, so a cached library may only come from a
directory only this user (or root) can write, and be a regular file this user
(or root) owns: the cache directories are created private (0o700) and checked
(not a symlink, owned by this user or root, not group/other-writable), the
file is checked the same way before it is loaded, lock files are opened with
O_NOFOLLOW, and built files are installed by an atomic rename from a private
temporary name. Also here: the compiler lookup and identity, compiler flag
probing and the digests that key the caches.

Standard library only and no package imports: the emulator
(``custom_ops/emu/emu.py``) loads this file by path, without TensorFlow.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def cache_root() -> Path:
    """``$TFMETAL_EXT_CACHE`` if set, else ``~/.cache/tfmetal_ext``."""
    root = os.environ.get("TFMETAL_EXT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tfmetal_ext"


# ----------------------------------------------------------------------------
# The compiler.


def find_compiler(order: tuple | None = None) -> str | None:
    """``$CXX`` (when its program is on the PATH), else the first of ``order`` found on the PATH.

    ``order`` defaults to clang++, c++ on macOS and c++, g++, clang++ elsewhere.
    Returns None when there is none.
    """
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env.split()[0]) and env
    if order is None:
        order = ("clang++", "c++") if sys.platform == "darwin" else ("c++", "g++", "clang++")
    for name in order:
        found = shutil.which(name)
        if found:
            return found
    return None


_identities: dict = {}
_probes: dict = {}
_cache_lock = threading.Lock()


def compiler_identity(compiler: str) -> str:
    """The first line of ``compiler --version`` (``compiler`` itself when it prints nothing).

    Cached per compiler command. Raises OSError or subprocess.SubprocessError
    when the compiler cannot be run.
    """
    with _cache_lock:
        if compiler in _identities:
            return _identities[compiler]
    out = subprocess.run(shlex.split(compiler) + ["--version"], capture_output=True, text=True, timeout=60)
    identity = (out.stdout or compiler).splitlines()[0]
    with _cache_lock:
        _identities[compiler] = identity
    return identity


def supports_flags(compiler: str, flags: tuple, language: str = "c++") -> bool:
    """Whether ``compiler`` accepts ``flags`` without a warning (cached per compiler and flags)."""
    key = (compiler, tuple(flags), language)
    with _cache_lock:
        if key in _probes:
            return _probes[key]
    try:
        result = subprocess.run(shlex.split(compiler) + list(flags) + ["-Werror", "-x", language, "-fsyntax-only", "-"],
                                input="", capture_output=True, text=True, timeout=60)
        ok = result.returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    with _cache_lock:
        _probes[key] = ok
    return ok


# ----------------------------------------------------------------------------
# The trusted cache.


class UntrustedCacheError(PermissionError):
    """A cache directory or native file is not trusted: not owned by the
    current user or root, group/other-writable, or a symlink."""


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def check_trusted(path: Path, kind: str, *, what: str = "cache", error: type = UntrustedCacheError) -> None:
    """Refuses ``path`` unless it is a real (not symlinked) ``kind`` ("dir" or
    "file") owned by the current euid or root and not group/other-writable.

    Raises ``error`` ("tfmetal_ext: refusing the <what>: <path> <problem>; fix: <fix>").
    """
    st = os.lstat(path)
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem, fix = "is a symlink", f"remove it (rm {shlex.quote(str(path))}) or use a private TFMETAL_EXT_CACHE"
    elif not is_kind:
        problem, fix = f"is not a {'directory' if kind == 'dir' else 'regular file'}", "remove it"
    elif not _trusted_owner(st.st_uid):
        problem = f"is owned by uid {st.st_uid}, not the current user ({os.geteuid()}) or root"
        fix = "remove it, or use a private TFMETAL_EXT_CACHE"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        fix = f"chmod go-w {shlex.quote(str(path))}"
    if problem:
        raise error(f"tfmetal_ext: refusing the {what}: {path} {problem}; fix: {fix}")


def verify_dirs(dirs, create: bool, *, what: str = "cache", error: type = UntrustedCacheError) -> None:
    """Checks each of ``dirs`` (outermost first), creating the missing ones
    with mode 0o700 when ``create``."""
    for d in dirs:
        if create and not os.path.lexists(d):
            Path(d).mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.lexists(d):
            check_trusted(Path(d), "dir", what=what, error=error)


def verify_file(path: Path, *, what: str = "cache", error: type = UntrustedCacheError) -> None:
    """Checks a native file in the cache before it is loaded or linked (when it exists)."""
    if os.path.lexists(path):
        check_trusted(Path(path), "file", what=what, error=error)


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on ``path`` (created 0o600; a symlink there is refused by O_NOFOLLOW)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_private(directory: Path, final: Path, data: bytes) -> None:
    """Writes ``data`` to a mkstemp file in ``directory`` (mode 0o644), then renames it to ``final``."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def install(built: Path, final: Path) -> None:
    """Installs the built file ``built`` as ``final`` (mode 0o644), atomically, never following a symlink."""
    write_private(final.parent, final, Path(built).read_bytes())


# ----------------------------------------------------------------------------
# Digests.


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's contents, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(*parts, length: int = 20) -> str:
    """A cache key: the SHA-256 of ``parts`` (bytes, or anything by its str), each NUL-terminated, hex, truncated."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]
