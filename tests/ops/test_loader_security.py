"""The op cache refuses directories and libraries it cannot trust (issue 15 items 1, 2)."""

import os

import pytest

from tfmetal_ext.ops import _loader


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


def test_temp_write_does_not_follow_planted_symlink(cache, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    os.chmod(victim, 0o600)
    for name in (f".build.json.{os.getpid()}", f".{_loader.LIBRARY_NAME}.{os.getpid()}"):
        os.symlink(victim, cache.directory / name)
    _loader._write_private(cache.directory, cache.metadata, b"{}")
    assert victim.read_bytes() == b"secret"
    assert cache.metadata.read_bytes() == b"{}"
