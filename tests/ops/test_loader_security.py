"""The op cache refuses directories and libraries it cannot trust (issue 15 items 1, 2)."""

import dataclasses
import os
from pathlib import Path

import pytest

from tfmetal_ext.ops import _loader
from tests.ops.test_loader import _stand_in_compiler


def _plan(root):
    d = root / "ops" / "tfX-key"
    return _loader.BuildPlan("c++", "X", (), (), (), (), "key", d)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(root))
    p = _plan(root)
    _loader.verify_cache(p, create=True)
    return p


def test_new_cache_dirs_are_private(cache):
    for d in (cache.directory, cache.directory.parent, cache.directory.parent.parent):
        assert os.stat(d).st_mode & 0o777 == 0o700


def test_group_writable_dir_refused(cache):
    os.chmod(cache.directory.parent, 0o775)
    with pytest.raises(_loader.OpCacheError, match="chmod go-w"):
        _loader.verify_cache(cache, create=False)


def test_symlinked_library_refused(cache, tmp_path):
    target = tmp_path / "evil.so"
    target.write_bytes(b"x")
    os.symlink(target, cache.library)
    with pytest.raises(_loader.OpCacheError, match="symlink"):
        _loader.verify_cache(cache, create=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file as another uid needs root")
def test_library_owned_by_other_uid_refused(cache):
    cache.library.write_bytes(b"x")
    os.chown(cache.library, 65534, 65534)
    with pytest.raises(_loader.OpCacheError, match="uid 65534"):
        _loader.verify_cache(cache, create=False)


def test_build_does_not_follow_symlinks_planted_at_its_temp_names(cache, tmp_path):
    # The attack of item 2, through the real build: symlinks at the temp names the old
    # build wrote (`.build.json.<pid>`, `.<library>.<pid>`) point at a 0600 victim; the
    # old build's plain open() followed them and overwrote it.
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    os.chmod(victim, 0o600)
    for name in (f".build.json.{os.getpid()}", f".{_loader.LIBRARY_NAME}.{os.getpid()}"):
        os.symlink(victim, cache.directory / name)
    p = dataclasses.replace(cache, compiler=_stand_in_compiler(tmp_path))
    _loader._compile(p)
    assert victim.read_bytes() == b"secret"
    assert p.library.read_bytes() == b"library"
    assert json.loads(p.metadata.read_text())["compiler"] == "fake-cxx 1.0"


# ----------------------------------------------------------------------------
# End to end, as the attacks were run: another uid plants, root loads. These
# need root (to act as uid 65534 and to drop root's permission override).

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as another uid (setpriv --reuid=65534) and dropping CAP_DAC_OVERRIDE need root and util-linux setpriv",
)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# Root without the capabilities that bypass file modes: a read-only directory is read-only to it.
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]

STATUS = (
    "import json, warnings\n"
    "warnings.simplefilter('ignore')\n"
    "from tfmetal_ext import ops\n"
    "from tfmetal_ext.ops import _loader\n"
    "s = ops.status()\n"
    "print(json.dumps({'loaded': bool(s.loaded), 'error': _loader.state().error, "
    "'kernel': ops.softshrink.__module__ and __import__('tfmetal_ext.ops.softshrink', fromlist=['x']).uses_kernel()}))\n"
)


def _run(argv, cache_root, **kw):
    env = dict(os.environ, TFMETAL_EXT_CACHE=str(cache_root), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TFMETAL_EXT_REFERENCE_OPS", None)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, **kw)


def _status(cache_root, prefix=()):
    r = _run([*prefix, sys.executable, "-c", STATUS], cache_root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _plan_paths(cache_root, monkeypatch):
    """Where the loader of a process with TFMETAL_EXT_CACHE=`cache_root` puts the library (planned here: the
    plan depends only on the cache root, this TF, the compiler and the sources)."""
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(cache_root))
    p = _loader.plan()
    return p.directory, p.library, p.metadata


@pytest.fixture
def shared_dir():
    """A sticky world-writable directory, like /tmp: where a shared cache gets planted."""
    d = Path(tempfile.mkdtemp(prefix="tfmetal-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def planted_library(directory: Path, marker: Path) -> Path:
    """``directory/evil.so`` (mode 0o755), whose constructor writes "ran" to `marker` when it is loaded.

    Built with gcc (the test skips without it). Planted in a cache, it shows whether the cache loads it.
    """
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the planted library")
    src = directory / "evil.c"
    src.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen("{marker}", "w"); '
        'if (f) { fputs("ran", f); fclose(f); } }\n'
    )
    evil = directory / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(evil), str(src)], check=True, timeout=60)
    os.chmod(evil, 0o755)
    return evil


@pytest.mark.full  # plants a library as another user (root, a subprocess per case); the quick tier keeps the permission checks
@needs_root
def test_library_planted_by_another_user_never_runs(shared_dir, monkeypatch):
    """A `.so` with a constructor, planted with a matching build.json by uid
    65534 in a shared TFMETAL_EXT_CACHE: root's loader refuses it, naming the
    path and the fix, and the constructor never runs (the reference ops run)."""
    marker = shared_dir / "constructor-ran"
    evil = planted_library(shared_dir, marker)
    cache_root = shared_dir / "cache"
    directory, library, metadata = _plan_paths(cache_root, monkeypatch)
    plant = (
        "import hashlib, json, os, shutil, sys\n"
        "d, lib, meta, evil = sys.argv[1:5]\n"
        "os.makedirs(d, mode=0o755, exist_ok=True)\n"
        "shutil.copyfile(evil, lib)\n"
        "sha = hashlib.sha256(open(lib, 'rb').read()).hexdigest()\n"
        "open(meta, 'w').write(json.dumps({'sha256': sha}))\n"
    )
    r = subprocess.run([*NOBODY, sys.executable, "-I", "-c", plant, str(directory), str(library), str(metadata),
                        str(evil)], capture_output=True, text=True, timeout=60, cwd="/")
    if r.returncode != 0 and "failed to execute" in r.stderr:
        pytest.skip(f"uid 65534 cannot run this Python ({sys.executable}): {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    assert os.stat(library).st_uid == 65534

    got = _status(cache_root)
    assert not marker.exists(), "the planted library's constructor ran in the root process"
    assert not got["loaded"] and not got["kernel"]
    assert "refusing the op cache" in got["error"] and str(cache_root) in got["error"]
    assert "uid 65534" in got["error"] and "TFMETAL_EXT_CACHE" in got["error"]
    # `tfmetal-ext build-ops` says the same and exits 2 (a usage error), no traceback.
    r = _run([sys.executable, "-m", "tfmetal_ext.cli", "build-ops"], cache_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "uid 65534" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


@needs_root
def test_group_writable_shared_cache_is_refused(tmp_path):
    cache_root = tmp_path / "cache"
    cache_root.mkdir()
    os.chmod(cache_root, 0o777)
    got = _status(cache_root)
    assert not got["loaded"]
    assert f"{cache_root} is writable by group or others" in got["error"] and "chmod go-w" in got["error"]


@pytest.fixture(scope="module")
def built_library():
    from tfmetal_ext import ops

    assert ops.status().loaded, ops.status()
    return _loader.plan()


@pytest.mark.full  # a prebuilt cache loaded by another process (~8 s); the quick tier keeps the refusal checks
@needs_root
def test_read_only_prebuilt_cache_loads(built_library, tmp_path):
    """A site-wide prebuilt cache: root-owned, not writable by the loading
    process. It loads (no lock needed) and the kernels run, not the references."""
    cache_root = tmp_path / "site-cache"
    key_dir = cache_root / "ops" / built_library.directory.name
    key_dir.mkdir(parents=True)
    for f in (built_library.library, built_library.metadata):
        shutil.copy2(f, key_dir / f.name)
        os.chmod(key_dir / f.name, 0o444)
    for d in (key_dir, key_dir.parent, cache_root):
        os.chmod(d, 0o555)
    try:
        # Not writable even by root once CAP_DAC_OVERRIDE is gone.
        probe = _run([*NO_OVERRIDE, "touch", str(key_dir.parent / "probe")], cache_root)
        assert probe.returncode != 0, "the cache is writable: the test would not test a read-only cache"
        got = _status(cache_root, prefix=NO_OVERRIDE)
        assert got["loaded"] and got["kernel"], got
        assert sorted(p.name for p in key_dir.parent.iterdir()) == [key_dir.name]  # nothing written
    finally:
        for d in (cache_root, key_dir.parent, key_dir):
            os.chmod(d, 0o755)
