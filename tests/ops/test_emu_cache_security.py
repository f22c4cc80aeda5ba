"""The Metal emulator's cache is the op loader's kind (issue 28 item 6).

`emu.build()` loads a native library from ``$TFMETAL_EXT_CACHE/emu``, so it
goes through the loader's toolchain (``tfmetal_ext/ops/_toolchain.py``): a
library (or the runtime object linked into every library) planted there as a
symlink, with a group/other-writable mode, owned by another user, or in a
directory others can write, is refused with `emu.EmuCacheError` and never
loaded (its constructor never runs). The file lock and the cache still build
each library once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.ops.test_loader_security import NOBODY, needs_root, planted_library, shared_dir  # noqa: F401
from tfmetal_ext.testing import load_emu

emu = load_emu()

# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras

TINY = ('#include "tfmetal/portable.h"\n'
        "[[kernel]] void tiny(device float* y [[buffer(0)]], TFM_KERNEL_BUILTINS) { y[gid.x] = 3.0f; }\n"
        "TFM_REGISTER_KERNEL(tiny)\n")

# emu.build() in a process of its own (the emulator alone, loaded by path: no TensorFlow), so this
# process has never loaded the library a test then replaces (dlopen would reuse a loaded image).
_BUILD = textwrap.dedent(
    """
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("emu_alone", sys.argv[1])
    emu = importlib.util.module_from_spec(spec)
    sys.modules["emu_alone"] = emu
    spec.loader.exec_module(emu)
    lib = emu.build(sys.argv[2])
    print(json.dumps({"path": str(lib.path), "stats": emu.stats, "tensorflow": "tensorflow" in sys.modules}))
    """
)


def _build_elsewhere(cache_root, source, processes=1):
    """Runs emu.build(source) in `processes` processes at once; their {"path", "stats", "tensorflow"}."""
    env = dict(os.environ, TFMETAL_EXT_CACHE=str(cache_root))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, emu.__file__, str(source)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(processes)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    """tiny.metal built once for the module (by another process): (cache root, source, library path).

    Each test works on a copy of this cache, so one compile serves them all.
    """
    where = tmp_path_factory.mktemp("emu-template")
    source = where / "tiny.metal"
    source.write_text(TINY)
    [built] = _build_elsewhere(where / "cache", source)
    return where / "cache", source, built["path"]


@pytest.fixture
def cache(built_once, tmp_path, monkeypatch):
    """A fresh private copy of the built cache (modes kept; a new path and inode, so never an image
    this process has loaded); its root, the source and the library in it."""
    template, source, library = built_once
    root = tmp_path / "cache"
    shutil.copytree(template, root, symlinks=True)
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(root))
    emu.clear_loaded()
    yield root, source, str(root / os.path.relpath(library, template))
    emu.clear_loaded()


@pytest.fixture
def evil(tmp_path):
    """A library whose constructor writes a marker file; (library, marker)."""
    marker = tmp_path / "constructor-ran"
    return planted_library(tmp_path, marker), marker


def _refused(source, match, marker=None):
    compiles = dict(emu.stats)
    with pytest.raises(emu.EmuCacheError, match=match) as caught:
        emu.build(source)
    assert isinstance(caught.value, emu.EmuError) and isinstance(caught.value, PermissionError)
    assert "refusing the Metal emulator cache" in str(caught.value)
    assert emu.stats == compiles  # nothing rebuilt over the planted file either
    if marker is not None:
        assert not marker.exists(), "the planted library's constructor ran: it was loaded"
    return str(caught.value)


def test_cache_is_private_and_reused(cache):
    root, source, library = cache
    for d in (root, root / "emu"):
        assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(library).st_mode & 0o777 == 0o644
    compiles = dict(emu.stats)
    lib = emu.build(source)  # this process: from the disk cache, no compiler run
    assert str(lib.path) == library and emu.stats == compiles
    y = np.zeros(4, np.float32)
    lib.run("tiny", [y], grid=4)
    np.testing.assert_array_equal(y, 3.0)


def test_symlinked_library_is_refused(cache, evil):
    _, source, library = cache
    os.unlink(library)
    os.symlink(evil[0], library)
    message = _refused(source, "is a symlink", marker=evil[1])
    assert library in message and "TFMETAL_EXT_CACHE" in message


def test_group_writable_library_is_refused(cache, evil):
    _, source, library = cache
    shutil.copyfile(evil[0], library)
    os.chmod(library, 0o664)
    _refused(source, r"is writable by group or others \(mode 664\); fix: chmod go-w", marker=evil[1])


def test_group_writable_cache_dir_is_refused(cache):
    root, source, _ = cache
    os.chmod(root / "emu", 0o775)
    _refused(source, f"{root / 'emu'} is writable by group or others")


def test_symlinked_runtime_object_is_refused(cache, tmp_path, evil):
    # The runtime object is linked into every new kernel library: a planted one is refused too.
    root, _, _ = cache
    [runtime] = (root / "emu").glob("runtime-*.o")
    os.unlink(runtime)
    os.symlink(evil[0], runtime)
    other = tmp_path / "other.metal"
    other.write_text(TINY.replace("3.0f", "4.0f"))
    _refused(other, f"{runtime} is a symlink")
    assert not list((root / "emu").glob("other-*.so"))


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file as another uid needs root")
def test_library_owned_by_another_user_is_refused(cache, evil):
    _, source, library = cache
    shutil.copyfile(evil[0], library)
    os.chown(library, 65534, 65534)
    _refused(source, "is owned by uid 65534", marker=evil[1])


@needs_root
def test_cache_planted_by_another_user_is_refused(shared_dir, built_once, evil, monkeypatch):
    """Another uid creates the emulator cache in a shared place and plants a library at the
    name this kernel builds to: the build refuses the cache and loads nothing."""
    _, source, library = built_once  # where its library goes: the name
    built = {"path": library}
    root = shared_dir / "cache"
    evil_copy = shared_dir / "evil.so"
    shutil.copyfile(evil[0], evil_copy)
    os.chmod(evil_copy, 0o755)
    plant = f"mkdir -p {root / 'emu'} && cp {evil_copy} {root / 'emu' / os.path.basename(built['path'])}"
    subprocess.run([*NOBODY, "sh", "-c", plant], check=True, timeout=60, cwd="/")
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(root))
    emu.clear_loaded()
    try:
        _refused(source, f"{root} is owned by uid 65534", marker=evil[1])
    finally:
        emu.clear_loaded()


@pytest.mark.full  # two emulator builds racing in subprocesses (~3 s); the quick tier keeps the private-cache test
def test_two_processes_build_once(tmp_path):
    """The file lock: two processes building the same new kernel at once compile it (and the
    runtime) once between them, both get the same library, neither imports TensorFlow."""
    source = tmp_path / "tiny.metal"
    source.write_text(TINY)
    results = _build_elsewhere(tmp_path / "cache", source, processes=2)
    assert results[0]["path"] == results[1]["path"]
    assert sum(r["stats"]["kernel_compiles"] for r in results) == 1
    assert sum(r["stats"]["runtime_compiles"] for r in results) == 1
    assert not any(r["tensorflow"] for r in results)
