"""Build-on-first-use: cache key, concurrent builds, corrupted entries, no compiler, wheel install."""

from __future__ import annotations

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


def small_sources(dest: Path, src: Path | None = None) -> Path:
    """A copy of custom_ops/ that builds one op, Softshrink, in seconds.

    The tests of the build mechanics (the cache, concurrent builds, a
    corrupted entry) build in fresh caches; the whole library takes a minute
    and more per build, and what they prove does not depend on which ops are
    in it. Every header and the Metal plumbing come along; only the other
    ops' translation units stay out.
    """
    src = src or _loader.sources_dir()
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for unit in [*dest.glob("ops/*.cc"), *dest.glob("cpu/*.cc"), *dest.glob("metal/*.mm")]:
        if not unit.name.startswith(("softshrink", "metal_helper")):
            unit.unlink()
    return dest


def with_sources(code, sources):
    """`code` run with the loader building from `sources` (the package's own otherwise)."""
    return (f"from pathlib import Path\nfrom tfmetal_ext.ops import _loader\n"
            f"_loader.sources_dir = lambda: Path({str(sources)!r})\n" + code)


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


@pytest.mark.full  # two processes each importing TF (~20 s); the quick tier keeps the lock and cache-key tests of this file
def test_two_processes_build_once_and_both_succeed(tmp_path):
    code = with_sources(_USE_OPS, small_sources(tmp_path / "src"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
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


def _stand_in_compiler(tmp_path):
    """An executable that writes b"library" to the path after its `-o` (and answers --version)."""
    script = tmp_path / "fake-cxx"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo fake-cxx 1.0; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then printf library > "$2"; fi; shift; done\n'
    )
    os.chmod(script, 0o700)
    return str(script)


def test_corrupted_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    # The cache logic with a stand-in compiler (that a real build loads and runs, in two processes at
    # once, is test_two_processes_build_once_and_both_succeed).
    src = small_sources(tmp_path / "src")
    monkeypatch.setattr(_loader, "sources_dir", lambda: src)
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path / "cache"))
    compiler = _stand_in_compiler(tmp_path)
    compiles = []
    real_compile = _loader._compile
    monkeypatch.setattr(_loader, "_compile", lambda p: (compiles.append(p.key), real_compile(p)))
    plan = _loader.build(compiler=compiler)
    assert len(compiles) == 1 and _loader.entry_is_valid(plan) and plan.library.read_bytes() == b"library"
    plan.library.write_bytes(b"lib")  # truncated, as by a crash or full disk
    assert not _loader.entry_is_valid(plan)
    _loader.build(compiler=compiler)
    assert len(compiles) == 2 and _loader.entry_is_valid(plan) and plan.library.read_bytes() == b"library"
    _loader.build(compiler=compiler)  # valid again: no rebuild
    assert len(compiles) == 2


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


@pytest.mark.full  # a TF import in a subprocess (~6 s); the quick tier keeps the no-compiler fallback test
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


@pytest.mark.full  # a real failing compile (~9 s); the quick tier keeps the no-compiler fallback test
def test_compile_error_shows_the_compiler_message(tmp_path, monkeypatch):
    copy = small_sources(tmp_path / "src")
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


def _expected_cpu_level():
    """The level cpu/cpu_common.h picks here, from the CPU's flags (devices' reading of /proc/cpuinfo)."""
    from tfmetal_ext import devices

    if devices.capabilities().cpu_avx512:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= devices._cpu_flags() else "baseline"


def test_status_names_the_cpu_kernels_vector_level():
    st = ops.status()
    assert st.cpu_level == _expected_cpu_level()
    assert f"vector code: {st.cpu_level}" in str(st)


@pytest.mark.full  # three TF imports in subprocesses
@pytest.mark.parametrize("env, cap", [({"TFMETAL_EXT_CPU_LEVEL": "avx2"}, "avx2"),
                                      ({"TFMETAL_EXT_CPU_LEVEL": "baseline"}, "baseline"),
                                      ({"TFMETAL_EXT_CPU_BASELINE": "1"}, "baseline"),
                                      ({"TFMETAL_EXT_CPU_LEVEL": "avx512"}, "avx512"),
                                      ({"TFMETAL_EXT_CPU_LEVEL": "fastest"}, "avx512")])
def test_the_cpu_level_is_capped_by_the_environment(env, cap):
    """The cap lowers the level, never raises it above the CPU's; an unknown value caps nothing, with a warning."""
    order = ["baseline", "avx2", "avx512"]
    want = order[min(order.index(cap), order.index(_expected_cpu_level()))]
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("TFMETAL_EXT_REFERENCE_OPS", "TFMETAL_EXT_CPU_LEVEL", "TFMETAL_EXT_CPU_BASELINE")}
    result = subprocess.run([sys.executable, "-c", "from tfmetal_ext import ops; print(ops.status().cpu_level)"],
                            capture_output=True, text=True, timeout=600,
                            env={**full_env, "TF_CPP_MIN_LOG_LEVEL": "2", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == want
    unknown = env.get("TFMETAL_EXT_CPU_LEVEL") == "fastest"
    assert ("TFMETAL_EXT_CPU_LEVEL must be one of baseline, avx2, avx512" in result.stderr) == unknown


def test_build_ops_cli(capsys):
    from tfmetal_ext import cli

    assert cli.main(["build-ops"]) == 0
    out = capsys.readouterr().out
    assert _loader.LIBRARY_NAME in out and "built for TensorFlow" in out


@pytest.mark.slow
def test_non_editable_install_builds_from_shipped_sources(tmp_path):
    # A wheel-style install outside the source tree: the sources must ship in the package, and the
    # installed package's loader must find them there and build from them.
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    shipped = target / "tfmetal_ext" / "_custom_ops"
    # Every file the build reads ships: the installed package builds what the source tree builds.
    repo = _loader.sources_dir()
    assert ([str(p.relative_to(shipped)) for p in _loader._source_files(shipped)]
            == [str(p.relative_to(repo)) for p in _loader._source_files(repo)])
    # The installed package finds its own sources, and a build from them (one op's units, as the other
    # build tests do) loads and runs there.
    code = (
        "import tfmetal_ext\nfrom tfmetal_ext.ops import _loader\n"
        "print('PACKAGE', tfmetal_ext.__file__)\nprint('SOURCES', _loader.sources_dir())\n"
    ) + with_sources(_USE_OPS, small_sources(tmp_path / "small", src=shipped))
    result = run_python(code, tmp_path / "cache", env={"PYTHONPATH": str(target)}, cwd=tmp_path)
    assert f"PACKAGE {target / 'tfmetal_ext' / '__init__.py'}" in result.stdout
    assert f"SOURCES {shipped}" in result.stdout
    assert "STATUS True" in result.stdout
    assert str(tmp_path / "cache") in result.stdout


# ----------------------------------------------------------------------------
# status(): which kernels each op has, and why no GPU kernel (the Metal host
# code's records are faked here: no Metal build runs on Linux).


def _fake_metal_library(monkeypatch, text):
    """The loader's state as after loading a Metal build whose host code recorded `text`."""
    import dataclasses as dc

    plan = dc.replace(_loader.plan(), units=(Path("metal/softshrink_metal.mm"),))
    assert plan.with_metal
    monkeypatch.setattr(_loader, "_state", _loader._State(module=object(), plan=plan, attempted=True))
    monkeypatch.setattr(_loader, "_read_gpu_status_text", lambda library: text)
    monkeypatch.delenv("TFMETAL_EXT_REFERENCE_OPS", raising=False)


def test_status_reports_gpu_kernels_per_op(monkeypatch):
    from tfmetal_ext.backends import fusion

    records = "".join(f"{n}\t1\ttensorflow-metal-plugin\t\n" for op in fusion.CUSTOM_OPS.values() for n in op.op_names)
    _fake_metal_library(monkeypatch, records)
    st = ops.status(load=False)
    assert st.metal_kernels and st.metal_backend == "tensorflow-metal-plugin"
    assert set(st.kernels) == set(fusion.CUSTOM_OPS)
    assert all(k == {"cpu": True, "gpu": True, "gpu_reason": None} for k in st.kernels.values())
    assert "for tensorflow-metal-plugin" in str(st) and "no GPU kernel" not in str(st)


def test_status_says_why_an_op_has_no_gpu_kernel(monkeypatch):
    unbound = "tensorflow-metal-plugin 0.5.0 is installed; verified against 0.4.1 only"
    no_api = "internal error: the host's params do not match the kernel's struct"  # multi_tensor_metal.h's one
    text = (f"TfmetalExt>Softshrink\t0\ttensorflow-metal-plugin\t{unbound}\n"
            f"TfmetalExt>SoftshrinkGrad\t0\ttensorflow-metal-plugin\t{unbound}\n"
            "TfmetalExt>LayerNorm\t1\ttensorflow-metal-plugin\t\n"  # its gradient op recorded nothing
            f"TfmetalExt>MultiTensorAdam\t0\ttensorflow-metal-plugin\t{no_api}\n")
    _fake_metal_library(monkeypatch, text)
    st = ops.status(load=False)
    assert st.kernels["softshrink"] == {"cpu": True, "gpu": False, "gpu_reason": unbound}
    assert st.kernels["multi_tensor_adam"] == {"cpu": True, "gpu": False, "gpu_reason": no_api}
    assert not st.kernels["layer_norm"]["gpu"]
    assert "TfmetalExt>LayerNormGrad" in st.kernels["layer_norm"]["gpu_reason"]
    assert st.to_dict()["kernels"]["softshrink"]["gpu_reason"] == unbound
    text_form = str(st)
    assert f"softshrink: no GPU kernel ({unbound})" in text_form
    assert f"multi_tensor_adam: no GPU kernel ({no_api})" in text_form


def test_one_log_line_names_the_ops_without_gpu_kernels(monkeypatch, caplog):
    reason = "no Metal PluggableDevice (libmetal_plugin.dylib) is loaded in this process"
    _fake_metal_library(monkeypatch, f"TfmetalExt>Softshrink\t0\t\t{reason}\nTfmetalExt>LayerNorm\t0\t\t{reason}\n"
                                     "TfmetalExt>MultiTensorAdam\t1\ttensorflow-metal\t\n")
    with caplog.at_level("WARNING", logger="tfmetal_ext"):
        _loader._log_gpu_fallback()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "TfmetalExt>LayerNorm, TfmetalExt>Softshrink: " + reason in lines[0]
    assert "MultiTensorAdam" not in lines[0]
    caplog.clear()
    _fake_metal_library(monkeypatch, "TfmetalExt>Softshrink\t1\ttensorflow-metal\t\n")
    with caplog.at_level("WARNING", logger="tfmetal_ext"):
        _loader._log_gpu_fallback()
    assert not caplog.records  # every op bound: nothing to say


def test_status_without_metal_kernels_says_so():
    st = ops.status()
    if _loader.is_macos_arm():
        pytest.skip("a macOS arm64 build has Metal kernels")
    assert st.metal_backend is None
    assert all(k["cpu"] and not k["gpu"] and "no Metal kernels" in k["gpu_reason"] for k in st.kernels.values())


def test_malformed_gpu_records_are_an_error():
    with pytest.raises(ValueError, match="Received: line="):
        _loader.parse_gpu_registrations("TfmetalExt>Softshrink\tyes\n")


def test_the_loader_tells_the_host_code_which_metal_plugins_are_installed(monkeypatch):
    from tfmetal_ext import devices

    monkeypatch.setattr(devices, "_metal_plugins", lambda: {"tensorflow-metal-plugin": "0.4.1"})
    assert _loader.installed_metal_plugins() == "tensorflow-metal-plugin==0.4.1"
    monkeypatch.setattr(devices, "_metal_plugins", lambda: {})
    assert _loader.installed_metal_plugins() == ""
    from tfmetal_ext.backends import metal_plugin

    assert _loader.metal_defines() == (f'-DTFMETAL_EXT_OPEN_PLUGIN_VERIFIED="{metal_plugin.PIN}"',)
