"""Build-on-first-use: cache key, concurrent builds, corrupted entries, no compiler, wheel install."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tfmetal_ext import ops
from tfmetal_ext.ops import _loader

REPO = Path(__file__).resolve().parents[2]

_USE_OPS = textwrap.dedent(
    """
    import warnings
    import numpy as np, tensorflow as tf
    from tfmetal_ext import ops
    y = ops.softshrink(tf.constant([-2.0, 0.1, 3.0]), 0.5).numpy()
    assert np.allclose(y, [-1.5, 0.0, 2.5]), y
    st = ops.status()
    print("STATUS", st.loaded, st.library, st.error is None)
    """
)


def run_python(code, cache, env=None, cwd=None, check=True):
    full_env = {k: v for k, v in os.environ.items() if k != "TFMETAL_EXT_REFERENCE_OPS"}
    full_env.update({"TFMETAL_EXT_CACHE": str(cache), "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-5000:]
    return result


def test_cache_key_depends_on_sources_and_tf(tmp_path, monkeypatch):
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path))
    base = _loader.plan()
    assert base.directory.parent == tmp_path / "ops"
    assert base.directory.name.startswith(f"tf{base.tf_version}-")
    copy = tmp_path / "src"
    shutil.copytree(_loader.sources_dir(), copy)
    monkeypatch.setattr(_loader, "sources_dir", lambda: copy)
    assert _loader.plan().key == base.key  # same sources, same key
    (copy / "include" / "tfmetal" / "softshrink.h").write_text(
        (copy / "include" / "tfmetal" / "softshrink.h").read_text() + "\n// changed\n"
    )
    assert _loader.plan().key != base.key


def test_two_processes_build_once_and_both_succeed(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _USE_OPS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TFMETAL_EXT_CACHE": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-5000:]
        assert "STATUS True" in out
    builds = sum(err.count("building the custom-op library") for _, err in outputs)
    assert builds == 1, [err[-2000:] for _, err in outputs]
    assert len(list((tmp_path / "ops").glob("tf*/" + _loader.LIBRARY_NAME))) == 1


def test_corrupted_cache_entry_is_rebuilt(tmp_path):
    first = run_python(_USE_OPS, tmp_path)
    assert "building the custom-op library" in first.stderr
    (library,) = (tmp_path / "ops").glob("tf*/" + _loader.LIBRARY_NAME)
    library.write_bytes(library.read_bytes()[:4096])  # truncated, as by a crash or full disk
    second = run_python(_USE_OPS, tmp_path)
    assert "building the custom-op library" in second.stderr
    assert "STATUS True" in second.stdout
    third = run_python(_USE_OPS, tmp_path)  # valid again: no rebuild
    assert "building the custom-op library" not in third.stderr


def test_no_compiler_falls_back_to_references_with_one_warning(tmp_path):
    code = _USE_OPS + textwrap.dedent(
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ops.softshrink(tf.constant([1.0]))
            ops.softshrink(tf.constant([2.0]))
        assert not caught, [str(w.message) for w in caught]  # warned once, at first use
        print("ERROR", st.error)
        """
    )
    result = run_python(code, tmp_path, env={"CXX": str(tmp_path / "no-such-compiler")})
    assert "STATUS False None False" in result.stdout
    assert "custom ops unavailable" in result.stderr
    assert result.stderr.count("custom ops unavailable") == 1


def test_reference_switch_never_loads_the_library(tmp_path):
    code = textwrap.dedent(
        """
        import tensorflow as tf
        from tfmetal_ext import ops
        ops.softshrink(tf.constant([1.0]))
        st = ops.status()
        print("FORCED", st.reference_forced, st.loaded)
        """
    )
    result = run_python(code, tmp_path, env={"TFMETAL_EXT_REFERENCE_OPS": "1"})
    assert "FORCED True False" in result.stdout
    assert not (tmp_path / "ops").exists()


def test_compile_error_shows_the_compiler_message(tmp_path, monkeypatch):
    copy = tmp_path / "src"
    shutil.copytree(_loader.sources_dir(), copy)
    (copy / "cpu" / "broken_kernels.cc").write_text("this is not C++;\n")
    monkeypatch.setattr(_loader, "sources_dir", lambda: copy)
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(_loader.BuildError, match=r"(?s)broken_kernels\.cc.*error"):
        _loader.build()


def test_status_describes_the_loaded_library():
    st = ops.status()
    assert st.loaded and not st.reference_forced
    assert Path(st.library).is_file()
    import tensorflow as tf

    assert st.tf_version == tf.__version__
    assert st.metal_kernels == _loader.is_macos_arm()
    assert "TF " + tf.__version__ in str(st)
    assert set(st.to_dict()) >= {"loaded", "library", "tf_version", "metal_kernels"}


def test_build_ops_cli(capsys):
    from tfmetal_ext import cli

    assert cli.main(["build-ops"]) == 0
    out = capsys.readouterr().out
    assert _loader.LIBRARY_NAME in out and "built for TensorFlow" in out


@pytest.mark.slow
def test_non_editable_install_builds_from_shipped_sources(tmp_path):
    # A wheel-style install outside the source tree: the sources must ship
    # in the package for the build to work.
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert (target / "tfmetal_ext" / "_custom_ops" / "ops" / "softshrink_op.cc").is_file()
    code = "import tfmetal_ext, sys; assert tfmetal_ext.__file__.startswith(sys.argv[1] if len(sys.argv) > 1 else '')\n" + _USE_OPS
    result = run_python(code, tmp_path / "cache", env={"PYTHONPATH": str(target)}, cwd=tmp_path)
    assert "STATUS True" in result.stdout
    assert str(tmp_path / "cache") in result.stdout
