"""The Objective-C++ host code of the Metal kernels (custom_ops/metal/*.mm), checked without a Mac.

- clang syntax-checks every .mm (-Wall -Werror, ARC, blocks) against the real TF
  C API headers of the installed wheel and minimal Foundation/Metal stand-ins
  (tests/ops/metal_stubs/), for an SDK with and without the macOS 15 API;
- every buffer binding's comment names a kernel parameter declared at that
  [[buffer(n)]] index, and every kernel parameter is bound somewhere;
- the macOS branch of the op loader writes the embedded kernel sources and puts
  them on the include path (its compiler command is run as a syntax check).
What stays unverified here: linking against the real frameworks and running on a GPU
(`pytest -m metal` on a Mac).
"""

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tfmetal_ext.ops import _loader

ROOT = Path(__file__).resolve().parents[2]
METAL_DIR = ROOT / "custom_ops" / "metal"
STUBS = Path(__file__).resolve().parent / "metal_stubs"
HOST_FILES = sorted(METAL_DIR.glob("*.mm"))
OP_HOST_FILES = [f for f in HOST_FILES if f.name != "metal_helper.mm"]
# No macOS SDK here: the Objective-C runtime must be named for -fobjc-arc.
SYNTAX_FLAGS = ["-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-fobjc-runtime=macosx-13.0", "-fobjc-arc",
                "-fblocks", "-Wall", "-Werror"]
SDKS = {"sdk-macos14": [], "sdk-macos15": ["-D__MAC_15_0=150000"]}
_RUN = subprocess.run  # test_macos_build_embeds_the_kernel_sources replaces subprocess.run


# No Keras here: skip the conftest's per-test Keras session reset and policy restore.
pytestmark = pytest.mark.no_keras


def _clang():
    for name in ("clang++", "clang++-18", "clang++-17", "clang++-16", "clang++-15"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def clang():
    path = _clang()
    if path is None:
        pytest.skip("clang++ is not installed: the Objective-C++ syntax check needs clang (g++ has no ARC)")
    return path


def _load_embed():
    name = "tfmetal_ext_metal_embed"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, METAL_DIR / "embed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The generated <op>_metal_source.h headers, as the loader writes them."""
    out = tmp_path_factory.mktemp("metal_sources")
    _load_embed().write_embedded_sources(out)
    return out


def syntax_check(clang, sources, include_dirs, extra=()):
    cmd = [clang] + SYNTAX_FLAGS + list(extra) + ["-I", str(STUBS), "-I", tf.sysconfig.get_include()]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    result = _RUN(cmd + [str(s) for s in sources], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, "clang rejected the host code:\n" + result.stderr[-20000:] + "\n" + " ".join(
        shlex.quote(c) for c in cmd)


# ----------------------------------------------------------------------------


def test_every_op_has_host_code():
    ops = sorted(p.stem for p in METAL_DIR.glob("*.metal"))
    assert [f.stem for f in OP_HOST_FILES] == [f"{op}_metal" for op in ops]


@pytest.mark.parametrize("sdk", list(SDKS))
@pytest.mark.parametrize("source", HOST_FILES, ids=lambda p: p.name)
def test_metal_host_code_compiles_against_stubs(clang, embedded, source, sdk):
    syntax_check(clang, [source], [ROOT / "custom_ops" / "include", ROOT / "custom_ops", embedded], SDKS[sdk])


# `[encoder setBuffer:... atIndex:3];  // device T* y [[buffer(3)]]` or
# `SetBytes(encoder, params, 6);  // constant P& p [[buffer(6)]]`, the comment on
# the binding's line or on the line(s) just above it.
_COMMENT = re.compile(r"//.*?\b(\w+)\s*\[\[buffer\((\d+)\)\]\]")
_BINDING = re.compile(r"atIndex:\s*(\d+)\s*\]|SetBytes\(\s*encoder\s*,\s*[^,]+,\s*(\d+)\s*\)")
_KERNEL_PARAM = re.compile(r"\b(\w+)\s*\[\[buffer\((\d+)\)\]\]")


def _bindings(mm_text):
    """(parameter name, comment index, bound index) for every commented binding."""
    found = []
    lines = mm_text.splitlines()
    for i, line in enumerate(lines):
        comment = _COMMENT.search(line)
        if not comment:
            continue
        code = line[:line.index("//")]
        j = i
        while not _BINDING.search(code) and j + 1 < len(lines) and j < i + 3:  # comment above the call
            j += 1
            code = lines[j].split("//")[0]
        binding = _BINDING.search(code)
        assert binding, f"line {i + 1}: a [[buffer(n)]] comment without a binding below it: {line.strip()}"
        found.append((comment.group(1), int(comment.group(2)), int(binding.group(1) or binding.group(2))))
    return found


@pytest.mark.parametrize("source", OP_HOST_FILES, ids=lambda p: p.name)
def test_every_binding_matches_a_kernel_parameter(source):
    kernels_h = (METAL_DIR / source.name.replace("_metal.mm", ".h")).read_text()
    declared = {(m.group(1), int(m.group(2))) for m in _KERNEL_PARAM.finditer(kernels_h)}
    bindings = _bindings(source.read_text())
    assert bindings
    for name, commented, bound in bindings:
        assert commented == bound, f"{name}: comment says [[buffer({commented})]], bound at index {bound}"
        assert (name, bound) in declared, f"{source.name} binds {name} at {bound}; the kernels declare {sorted(declared)}"
    assert declared <= {(name, index) for name, _, index in bindings}, "kernel parameters never bound"


def test_macos_build_embeds_the_kernel_sources(clang, tmp_path, monkeypatch):
    # The loader's macOS arm64 branch, run here with its compiler command
    # replaced by a syntax check of the .mm files with that command's include
    # paths: the embedded <op>_metal_source.h headers must be found.
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_loader, "is_macos_arm", lambda: True)
    plan = _loader.plan(compiler=clang)
    assert plan.with_metal and sorted(Path(u).name for u in plan.units if str(u).endswith(".mm")) == [
        f.name for f in HOST_FILES]
    assert any(Path(f).name == "embed.py" for f in plan.sources)  # the cache key covers the embedding
    seen = {}

    def fake_run(cmd, *args, **kwargs):
        if "--version" in cmd:
            return _RUN(cmd, *args, **kwargs)
        seen["cmd"] = cmd
        includes = [cmd[i + 1] for i, c in enumerate(cmd) if c == "-I"]
        headers = sorted(p.name for d in includes for p in Path(d).glob("*_metal_source.h"))
        assert headers == sorted(f"{p.stem}_metal_source.h" for p in METAL_DIR.glob("*.metal"))
        mm = [c for c in cmd if c.endswith(".mm")]
        assert cmd.index("objective-c++") < cmd.index(mm[0]) and "-fobjc-arc" in cmd
        syntax_check(clang, mm, includes)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"not a library")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(_loader.subprocess, "run", fake_run)
    _loader._compile(plan)
    assert "cmd" in seen and plan.library.read_bytes() == b"not a library"
