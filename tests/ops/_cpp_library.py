"""Builds a small test-only C++ op library against the installed TensorFlow (tests that need a kernel of their own)."""

import shlex
import subprocess

import pytest
import tensorflow as tf

from tfmetal_ext.ops import _loader


def build(out_dir, name, source, include_dirs=()):
    """Compiles `source` into ``out_dir/lib<name>.so``; returns its path. Skips the test without a compiler."""
    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the test library cannot be built here")
    (out_dir / f"{name}.cc").write_text(source)
    path = out_dir / f"lib{name}.so"
    cmd = shlex.split(compiler) + ["-std=c++17", "-shared", "-fPIC", "-O1", "-w"]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    cmd += list(tf.sysconfig.get_compile_flags())
    cmd += [str(out_dir / f"{name}.cc"), "-o", str(path)] + list(tf.sysconfig.get_link_flags())
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-10000:]
    return path
