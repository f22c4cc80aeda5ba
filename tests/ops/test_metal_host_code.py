"""The Objective-C++ host code of the Metal kernels (custom_ops/metal/*.mm), checked without a Mac.

- clang syntax-checks every .mm (-Wall -Werror, ARC, blocks) against the real TF
  C API headers of the installed wheel and minimal Foundation/Metal stand-ins
  (tests/ops/metal_stubs/), for an SDK with and without the macOS 15 API;
- every buffer binding's comment names a kernel parameter declared at that
  [[buffer(n)]] index, and every kernel parameter is bound somewhere;
- the macOS branch of the op loader writes the embedded kernel sources and puts
  them on the include path (its compiler command is run as a syntax check);
- against the open tensorflow-metal-plugin's real headers (its pinned sdist,
  fetched by `tfmetal_ext.testing.metal_plugin_source`; skipped with the reason
  when no index is reachable): every .mm compiles with them included, our
  declaration of its stream (custom_ops/metal/metal_plugin_stream.h) has the
  offsets, size and alignment of its SP_Stream_st (static_asserts; a swapped
  field fails them), and the symbol names we dlsym are what clang mangles for
  its declarations;
- the load-time decision (metal_binding.h: which backend, GPU kernels or not,
  and why), its status text as tfmetal_ext.ops reads it, the plugin's
  synchronous-mode rule, and the stream-sequence protocol under contention
  (Submission from many threads: commit order is number order, every buffer
  waits for its predecessor) compiled with the host C++ compiler and run.
What stays unverified here: linking against the real frameworks, the dyld
probe of the loaded images, Metal itself and running on a GPU, on either
backend (`pytest -m metal` and `tfmetal-ext doctor --selftest` on a Mac).
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

from tfmetal_ext import testing
from tfmetal_ext.backends import metal_plugin
from tfmetal_ext.ops import _loader

ROOT = Path(__file__).resolve().parents[2]
METAL_DIR = ROOT / "custom_ops" / "metal"
STUBS = Path(__file__).resolve().parent / "metal_stubs"
HOST_FILES = sorted(METAL_DIR.glob("*.mm"))
OP_HOST_FILES = [f for f in HOST_FILES if f.name != "metal_helper.mm"]
# No macOS SDK here: the Objective-C runtime must be named for -fobjc-arc.
SYNTAX_FLAGS = ["-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-fobjc-runtime=macosx-13.0", "-fobjc-arc",
                "-fblocks", "-Wall", "-Werror"] + list(_loader.metal_defines())
# The open plugin's sources are manual retain/release (no ARC), as it builds them.
PLUGIN_FLAGS = ["-x", "objective-c++", "-std=c++17", "-fobjc-runtime=macosx-13.0", "-fblocks", "-Wall", "-Werror"]
PLUGIN_METAL = "tensorflow/core/common_runtime/metal"
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


@pytest.fixture(scope="module")
def plugin_src():
    """The pinned tensorflow-metal-plugin sdist's src/ (its headers)."""
    try:
        root = testing.metal_plugin_source()
    except testing.SourceUnavailable as e:
        pytest.skip(str(e))
    assert (root / "TF_SUPPORTED_VERSION").read_text().strip() == metal_plugin.TF_VERSION
    return root / "src"


def syntax_check(clang, sources, include_dirs, extra=()):
    # TensorFlow's headers as system headers: their own warnings (deprecated integer aliases in its C++
    # headers, which the kernels reaching variables include) are not our code's; ours stay -Wall -Werror.
    cmd = [clang] + SYNTAX_FLAGS + list(extra) + ["-I", str(STUBS), "-isystem", tf.sysconfig.get_include()]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    result = _RUN(cmd + [str(s) for s in sources], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, "clang rejected the host code:\n" + result.stderr[-20000:] + "\n" + " ".join(
        shlex.quote(c) for c in cmd)


# ----------------------------------------------------------------------------


def test_every_op_has_host_code():
    ops = sorted(p.stem for p in METAL_DIR.glob("*.metal"))
    assert [f.stem for f in OP_HOST_FILES] == [f"{op}_metal" for op in ops]


# The quick tier compiles every host file against the macOS 14 stubs (and, below, the open plugin's
# headers); the full tier also against the macOS 15 ones (a define more: a second compile of each file).
# Files that include TF's C++ headers (through variables_metal.h) take ~5 s each to parse here. The quick
# tier compiles one multi-tensor runner row (multi_tensor_adam_metal.mm) and gap_variable_metal.mm; the
# other two rows (the same runner with another Spec) and the two headers on their own (compiled in quick
# through those .mm files) run in the full tier.
_TF_CXX_FULL_TIER = {"multi_tensor_lion_metal.mm", "multi_tensor_rmsprop_metal.mm", "multi_tensor_metal.h",
                     "variables_metal.h"}


def _tiered(paths):
    return [pytest.param(p, marks=pytest.mark.full, id=p.name) if p.name in _TF_CXX_FULL_TIER
            else pytest.param(p, id=p.name) for p in paths]


@pytest.mark.parametrize("sdk", [pytest.param(s, marks=pytest.mark.full) if i else s for i, s in enumerate(SDKS)])
@pytest.mark.parametrize("source", _tiered(HOST_FILES))
def test_metal_host_code_compiles_against_stubs(clang, embedded, source, sdk):
    syntax_check(clang, [source], [ROOT / "custom_ops" / "include", ROOT / "custom_ops", embedded], SDKS[sdk])


# The shared host headers, each compiled on its own (not only through the .mm
# files that include them): the Objective-C++ ones with the .mm flags, the
# plain C++ ones (no Objective-C, no TF: the emulator compiles
# dispatch_geometry.h, the CPU kernels include host_checks.h) as C++ too.
OBJC_HOST_HEADERS = [METAL_DIR / n for n in (
    "metal_helper.h", "multi_tensor_metal.h", "norm_metal.h", "gap_host.h", "variables_metal.h")]
CXX_HOST_HEADERS = [METAL_DIR / "dispatch_geometry.h", METAL_DIR / "gap_plan.h", ROOT / "custom_ops" / "include" / "tfmetal" / "host_checks.h",
                    ROOT / "custom_ops" / "include" / "tfmetal" / "gap_broadcast_checks.h"]


@pytest.mark.parametrize("header", _tiered(OBJC_HOST_HEADERS + CXX_HOST_HEADERS))
def test_shared_host_headers_compile_on_their_own(clang, header):
    syntax_check(clang, [header], [ROOT / "custom_ops" / "include", ROOT / "custom_ops"])
    if header in CXX_HOST_HEADERS:
        cmd = [clang, "-fsyntax-only", "-x", "c++", "-std=c++17", "-Wall", "-Wextra", "-Werror",
               "-I", str(ROOT / "custom_ops" / "include"), str(header)]
        result = _RUN(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-20000:]


def test_every_shared_host_header_is_used():
    # Each shared header is included by a host file, so the checks above cover
    # it in use too; and every header a .mm includes from metal/ is one of them
    # or a kernel header (<op>.h, reduction.h, multi_tensor_check.h).
    included = set()
    for f in HOST_FILES + OBJC_HOST_HEADERS:
        included |= set(re.findall(r'#include "(?:metal|tfmetal)/([\w.]+)"', f.read_text()))
    for header in OBJC_HOST_HEADERS + CXX_HOST_HEADERS:
        assert header.name in included, f"{header.name} is included by no host file"
    kernel_headers = {p.stem + ".h" for p in METAL_DIR.glob("*.metal")} | {"reduction.h", "metal_binding.h",
                                                                           "metal_plugin_stream.h",
                                                                           "multi_tensor_check.h"}
    for name in included:
        if (METAL_DIR / name).is_file():
            assert METAL_DIR / name in OBJC_HOST_HEADERS + CXX_HOST_HEADERS or name in kernel_headers, name


# `[encoder setBuffer:... atIndex:3];  // device T* y [[buffer(3)]]`,
# `SetBytes(encoder, params, 6);  // constant P& p [[buffer(6)]]` or a row of a
# multi-tensor Spec (multi_tensor_metal.h binds it) `{"lr", 5},  // device const T* lr [[buffer(5)]]`,
# the comment on the binding's line or on the line(s) just above it.
_COMMENT = re.compile(r"//.*?\b(\w+)\s*\[\[buffer\((\d+)\)\]\]")
_BINDING = re.compile(r"atIndex:\s*(\d+)\s*\]|SetBytes\(\s*encoder\s*,\s*[^,]+,\s*(\d+)\s*\)"
                      r"|^\s*\{\s*\"(\w+)\"\s*,\s*(\d+)\s*[,}]")
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
        if binding.group(3):  # a Spec row: its input name is the kernel parameter's
            assert binding.group(3) == comment.group(1), f"line {i + 1}: {line.strip()}"
        found.append((comment.group(1), int(comment.group(2)),
                      int(binding.group(1) or binding.group(2) or binding.group(4))))
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


def test_the_multi_tensor_runners_check_bindings_match_its_kernels():
    # multi_tensor_metal.h (the runner of every multi-tensor op) binds the finite
    # check of a loss-scaled step itself: its kernels are multi_tensor_check.h's.
    declared = {(m.group(1), int(m.group(2)))
                for m in _KERNEL_PARAM.finditer((METAL_DIR / "multi_tensor_check.h").read_text())}
    bindings = _bindings((METAL_DIR / "multi_tensor_metal.h").read_text())
    assert bindings
    for name, commented, bound in bindings:
        assert commented == bound, f"{name}: comment says [[buffer({commented})]], bound at index {bound}"
        assert (name, bound) in declared, f"multi_tensor_metal.h binds {name} at {bound}; declared: {sorted(declared)}"
    assert declared <= {(name, index) for name, _, index in bindings}, "check kernel parameters never bound"


def test_macos_build_embeds_the_kernel_sources(clang, tmp_path, monkeypatch):
    # The loader's macOS arm64 branch, run here with its compiler command
    # replaced by a check of its include paths: every generated header a .mm
    # includes is found on them, and clang accepts one .mm with exactly those
    # paths. (Each .mm is syntax-checked on its own, with the generated headers,
    # by test_metal_host_code_compiles_against_stubs, every file in both tiers:
    # clang over all of them again here cost ~40 s of the quick tier.)
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
        assert set(_loader.metal_defines()) <= set(cmd)  # the open plugin's verified release, from the pin
        for source in mm:
            for generated in re.findall(r'#include "(\w+_metal_source\.h)"', Path(source).read_text()):
                assert any((Path(d) / generated).is_file() for d in includes), f"{source}: {generated} not found"
        assert sum(bool(re.search(r'#include "\w+_metal_source\.h"', Path(s).read_text())) for s in mm) == len(
            list(METAL_DIR.glob("*.metal")))  # each op's .mm includes its generated header
        syntax_check(clang, [next(s for s in mm if s.endswith("attention_metal.mm"))], includes)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"not a library")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(_loader.subprocess, "run", fake_run)
    _loader._compile(plan)
    assert "cmd" in seen and plan.library.read_bytes() == b"not a library"


# ----------------------------------------------------------------------------
# The open tensorflow-metal-plugin: its real headers.


# Quick tier: one file (the mechanism: the plugin's headers in front of ours); every file against the
# stubs above, and every file against these headers in the full tier (CI).
@pytest.mark.sample_axes("source")
@pytest.mark.parametrize("source", HOST_FILES, ids=lambda p: p.name)
def test_metal_host_code_compiles_with_the_plugins_headers(clang, embedded, plugin_src, source):
    # The plugin's stream, registry and kernel-util declarations included in
    # front of our host code: no clash with our own declaration of its stream.
    pre = [f"{PLUGIN_METAL}/metal_stream.h", f"{PLUGIN_METAL}/metal_buffer_registry.h",
           f"{PLUGIN_METAL}/kernels/metal_kernel_util.h"]
    for header in pre:
        assert (plugin_src / header).is_file(), header
    extra = [arg for h in pre for arg in ("-include", h)]
    syntax_check(clang, [source], [plugin_src, ROOT / "custom_ops" / "include", ROOT / "custom_ops", embedded], extra)


LAYOUT_TU = """
#include <cstddef>
#include <string>
#include <type_traits>

#include "{plugin}/metal_stream.h"
#include "{plugin}/metal_buffer_registry.h"
#include "{ours}"

using Ours = tfmetal_ext::open_plugin::StreamLayout;
using Theirs = SP_Stream_st;
#pragma clang diagnostic ignored "-Winvalid-offsetof"  // neither is standard-layout; offsetof works in clang

#define SAME_FIELD(f, type)                                                              \\
  static_assert(offsetof(Theirs, f) == offsetof(Ours, f), "offset of " #f);              \\
  static_assert(sizeof(Theirs::f) == sizeof(Ours::f), "size of " #f);                    \\
  static_assert(std::is_same<decltype(Ours::f), type>::value, "our type of " #f)

SAME_FIELD(queue, void*);
SAME_FIELD(order_event, void*);
SAME_FIELD(submit, absl::Mutex);
SAME_FIELD(mu, absl::Mutex);
SAME_FIELD(last_enqueued, uint64_t);
SAME_FIELD(failed, bool);
SAME_FIELD(failure_message, std::string);
static_assert(std::is_same<decltype(Theirs::submit), absl::Mutex>::value, "their submit");
static_assert(std::is_same<decltype(Theirs::mu), absl::Mutex>::value, "their mu");
static_assert(std::is_same<decltype(Theirs::last_enqueued), uint64_t>::value, "their last_enqueued");
static_assert(std::is_same<decltype(Theirs::failed), bool>::value, "their failed");
static_assert(std::is_same<decltype(Theirs::failure_message), std::string>::value, "their failure_message");
static_assert(sizeof(Theirs::queue) == sizeof(void*) && sizeof(Theirs::order_event) == sizeof(void*), "object pointers");
static_assert(sizeof(Theirs) == sizeof(Ours), "size of the stream");
static_assert(alignof(Theirs) == alignof(Ours), "alignment of the stream");

// The registry functions we call through C-level pointers: their declared signatures.
namespace plugin = tensorflow::metal;
static_assert(std::is_same<decltype(&plugin::MetalBufferRegistry::Global), plugin::MetalBufferRegistry& (*)()>::value,
              "MetalBufferRegistry::Global");
static_assert(std::is_same<decltype(&plugin::MetalBufferRegistry::Lookup),
                           bool (plugin::MetalBufferRegistry::*)(const void*, id<MTLBuffer>*, size_t*) const>::value,
              "MetalBufferRegistry::Lookup");
static_assert(std::is_same<decltype(&plugin::NoteCommandBufferCompletion), void (*)(SP_Stream, id<MTLCommandBuffer>)>::value,
              "NoteCommandBufferCompletion");
"""


def _layout_check(clang, plugin_src, ours):
    tu = ours.parent / "layout_check.mm"
    tu.write_text(LAYOUT_TU.replace("{plugin}", PLUGIN_METAL).replace("{ours}", str(ours)))
    cmd = [clang, "-fsyntax-only"] + PLUGIN_FLAGS + ["-I", str(STUBS), "-I", tf.sysconfig.get_include(),
                                                     "-I", str(plugin_src), str(tu)]
    return _RUN(cmd, capture_output=True, text=True, timeout=600)


def test_our_stream_layout_is_the_plugins(clang, plugin_src, tmp_path):
    ours = tmp_path / "metal_plugin_stream.h"
    ours.write_text((METAL_DIR / "metal_plugin_stream.h").read_text())
    result = _layout_check(clang, plugin_src, ours)
    assert result.returncode == 0, "our SP_Stream_st layout differs from the plugin's:\n" + result.stderr[-10000:]


def test_a_wrong_stream_layout_fails_the_layout_check(clang, plugin_src, tmp_path):
    # The check can fail: the same header with two fields swapped.
    text = (METAL_DIR / "metal_plugin_stream.h").read_text()
    a, b = "  absl::Mutex submit;", "  absl::Mutex mu;"
    assert a in text and b in text
    ours = tmp_path / "metal_plugin_stream.h"
    ours.write_text(text.replace(a, "@@A@@").replace(b, a).replace("@@A@@", b)
                    .replace("  uint64_t last_enqueued;\n  bool failed;", "  bool failed;\n  uint64_t last_enqueued;"))
    result = _layout_check(clang, plugin_src, ours)
    assert result.returncode != 0
    assert "offset of last_enqueued" in result.stderr


_SYMBOL = re.compile(r'constexpr char (k\w+Symbol)\[\]\s*=\s*"([^"]+)"')

SYMBOLS_TU = """
#include "{plugin}/metal_stream.h"
#include "{plugin}/metal_buffer_registry.h"
#include "{plugin}/kernels/metal_kernel_util.h"
namespace plugin = tensorflow::metal;
// Addresses of the plugin's declared functions: the object file names each as
// an undefined symbol, spelled as the linker (and dlsym) sees it.
bool (plugin::MetalBufferRegistry::*lookup)(const void*, id<MTLBuffer>*, size_t*) const = &plugin::MetalBufferRegistry::Lookup;
plugin::MetalBufferRegistry& (*global)() = &plugin::MetalBufferRegistry::Global;
bool (*synchronous_mode)() = &plugin::SynchronousMode;
void (*note_completion)(SP_Stream, id<MTLCommandBuffer>) = &plugin::NoteCommandBufferCompletion;
"""


def test_the_symbols_we_look_up_are_the_plugins(clang, plugin_src, tmp_path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: the mangled names cannot be listed")
    ours = dict(_SYMBOL.findall((METAL_DIR / "metal_plugin_stream.h").read_text()))
    assert set(ours) == {"kRegistryGlobalSymbol", "kRegistryLookupSymbol", "kSynchronousModeSymbol",
                         "kNoteCompletionSymbol"}
    tu = tmp_path / "symbols.mm"
    tu.write_text(SYMBOLS_TU.replace("{plugin}", PLUGIN_METAL))
    obj = tmp_path / "symbols.o"
    cmd = [clang, "-c"] + PLUGIN_FLAGS + ["-I", str(STUBS), "-I", tf.sysconfig.get_include(), "-I", str(plugin_src),
                                          str(tu), "-o", str(obj)]
    result = _RUN(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-10000:]
    undefined = set(_RUN([nm, "-u", str(obj)], capture_output=True, text=True).stdout.split()) - {"U"}
    # Itanium mangling is the same on Linux and macOS (which only adds a leading
    # underscore in the Mach-O symbol table; dlsym takes the name without it).
    for name, symbol in ours.items():
        assert symbol in undefined, f"{name} = {symbol} is not what the plugin declares; it declares {sorted(undefined)}"


# ----------------------------------------------------------------------------
# The load-time decision, the status text and the stream sequence, run here.

DRIVER_CC = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "metal/gap_plan.h"
#include "metal/metal_binding.h"
#include "metal/metal_plugin_stream.h"

using namespace tfmetal_ext;

// Parses the plan text in argv[2] and prints what registration would do:
// "backend <name>" / "error <text>", then per op its host-memory arguments
// and one line per combination of type constraints.
int PlanCommand(char** argv) {
  const gap::Plan plan = gap::ParsePlan(std::strcmp(argv[2], "-") == 0 ? nullptr : argv[2]);
  std::printf("present %d\n", plan.present ? 1 : 0);
  if (!plan.error.empty()) {
    std::printf("error %s\n", plan.error.c_str());
    return 0;
  }
  std::printf("backend %s\n", plan.backend.c_str());
  for (const gap::KernelDef& def : plan.kernels) {
    std::string host;
    for (const std::string& h : def.host_memory) host += h + ",";
    std::printf("op %s host=%s\n", def.op.c_str(), host.c_str());
    for (const gap::StringConstraint& sc : def.strings) {
      for (const std::string& v : sc.values) std::printf("string %s %s\n", sc.attr.c_str(), v.c_str());
    }
    for (const auto& combo : gap::Combinations(def)) {
      std::string line = gap::RecordName(def.op, combo.front().second);
      for (const auto& [attr, dtype] : combo) line += " " + attr + "=" + dtype + ":" + std::to_string(gap::DtypeValue(dtype));
      std::printf("combo %s\n", line.c_str());
      // The KernelDef registration hands TensorFlow for this combination, in hex.
      std::string hex;
      for (unsigned char c : gap::SerializeKernelDef(def, "GPU", combo)) {
        char byte[3];
        std::snprintf(byte, sizeof(byte), "%02x", c);
        hex += byte;
      }
      std::printf("kerneldef %s\n", hex.c_str());
    }
  }
  return 0;
}

// A stream laid out as the plugin's (the layout test checks ours is its).
struct FakeStream {
  void* queue = nullptr;
  void* order_event = nullptr;
  absl::Mutex submit;
  absl::Mutex mu;
  uint64_t last_enqueued = 0;
  bool failed = false;
  std::string failure_message;
};
static_assert(sizeof(FakeStream) == sizeof(open_plugin::StreamLayout), "fake stream layout");

int Decide(int argc, char** argv) {
  binding::Probe probe;
  probe.plugin_images = std::atoi(argv[2]);
  probe.open_plugin_images = std::atoi(argv[3]);
  probe.registry_lookup = std::strcmp(argv[4], "1") == 0;
  probe.installed = std::strcmp(argv[5], "-") == 0 ? nullptr : argv[5];
  const binding::Decision d = binding::Decide(probe, argv[6]);
  std::printf("%s\t%d\t%s\n", d.backend, d.gpu ? 1 : 0, d.reason.c_str());
  return 0;
}

int Format() {
  std::vector<binding::OpRecord> records(3);
  records[0].op = "TfmetalExt>LayerNorm"; records[0].gpu = true; records[0].backend = binding::kOpenPlugin;
  records[1].op = "TfmetalExt>Softshrink"; records[1].backend = binding::kOpenPlugin;
  records[1].reason = "a reason\twith a tab\nand a newline";
  records[2].op = "TfmetalExt>MultiTensorAdam"; records[2].reason = "no backend";
  std::fputs(binding::FormatRecords(records).c_str(), stdout);
  return 0;
}

int Sync(char** argv) {
  const char* env = std::strcmp(argv[2], "-") == 0 ? nullptr : argv[2];
  std::printf("%d\n", open_plugin::SynchronousModeRule(env, std::strcmp(argv[3], "1") == 0) ? 1 : 0);
  return 0;
}

// Many threads submit to one stream as the host code does: take a number,
// (sometimes fail to get a command buffer and give it back), "commit". The
// commit log must hold every committed number once, in order, each waiting
// for the one committed before it.
int Sequence(char** argv) {
  const int threads = std::atoi(argv[2]), per_thread = std::atoi(argv[3]);
  FakeStream fake;
  auto* stream = reinterpret_cast<open_plugin::StreamLayout*>(&fake);
  std::vector<std::pair<uint64_t, uint64_t>> commits;  // (wait, signal) in commit order
  std::mutex log_mutex;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        open_plugin::Submission s(stream);
        if ((i + t) % 7 == 3) {  // no command buffer
          s.Cancel();
          continue;
        }
        for (int y = 0; y < 4; ++y) std::this_thread::yield();  // encoding: let other threads in
        {
          std::lock_guard<std::mutex> lock(log_mutex);  // the queue's commit
          commits.emplace_back(s.wait_value(), s.signal_value());
        }
        s.Release();
      }
    });
  }
  for (auto& th : pool) th.join();
  uint64_t expected_wait = 0;
  for (const auto& c : commits) {
    if (c.first != expected_wait || c.second != c.first + 1) {
      std::printf("out of order: waits for %llu, signals %llu, after %llu\n", (unsigned long long)c.first,
                  (unsigned long long)c.second, (unsigned long long)expected_wait);
      return 1;
    }
    expected_wait = c.second;
  }
  absl::MutexLock lock(&fake.mu);
  std::printf("%zu %llu\n", commits.size(), (unsigned long long)fake.last_enqueued);
  return fake.last_enqueued == commits.size() ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc >= 7 && std::strcmp(argv[1], "decide") == 0) return Decide(argc, argv);
  if (argc >= 2 && std::strcmp(argv[1], "format") == 0) return Format();
  if (argc >= 3 && std::strcmp(argv[1], "plan") == 0) return PlanCommand(argv);
  if (argc >= 4 && std::strcmp(argv[1], "sync") == 0) return Sync(argv);
  if (argc >= 4 && std::strcmp(argv[1], "sequence") == 0) return Sequence(argv);
  return 2;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """metal_binding.h and metal_plugin_stream.h in a small program, built with TF's flags (absl from TF)."""
    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the binding logic cannot be built here")
    out = tmp_path_factory.mktemp("binding")
    src = out / "driver.cc"
    src.write_text(DRIVER_CC)
    exe = out / "driver"
    cmd = shlex.split(compiler) + ["-std=c++17", "-O1", "-pthread"] + list(tf.sysconfig.get_compile_flags())
    cmd += ["-I", str(ROOT / "custom_ops"), str(src), "-o", str(exe)] + list(tf.sysconfig.get_link_flags())
    cmd += [f"-Wl,-rpath,{tf.sysconfig.get_lib()}"]
    result = _RUN(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-10000:]
    return exe


def _drive(driver, *args):
    result = _RUN([str(driver)] + [str(a) for a in args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


PIN = metal_plugin.PIN
OPEN = f"tensorflow-metal-plugin=={PIN}"
APPLE = "tensorflow-metal==1.2.0"


@pytest.mark.parametrize(
    "probe, backend, gpu, reason",
    [
        # (plugin images, open-plugin images, Lookup exported, installed), expected.
        ((1, 1, 1, OPEN), "tensorflow-metal-plugin", True, ""),
        ((1, 0, 0, APPLE), "tensorflow-metal", True, ""),
        ((1, 0, 0, "-"), "tensorflow-metal", True, ""),  # loaded by hand: Apple's image has no registry
        ((1, 1, 1, "tensorflow-metal-plugin==0.5.0"), "tensorflow-metal-plugin", False, f"verified against {PIN} only"),
        ((1, 1, 0, OPEN), "tensorflow-metal-plugin", False, "does not export MetalBufferRegistry::Lookup"),
        ((1, 1, 1, "-"), "tensorflow-metal-plugin", False, "version is unknown"),
        ((1, 1, 1, APPLE), "tensorflow-metal-plugin", False, "distribution is not installed"),
        ((1, 0, 0, OPEN), "tensorflow-metal-plugin", False, "exports none of the symbols"),
        ((1, 1, 1, f"{APPLE},{OPEN}"), "", False, "both tensorflow-metal and tensorflow-metal-plugin"),
        ((0, 0, 0, OPEN), "", False, "no Metal PluggableDevice"),
        ((0, 0, 0, ""), "", False, "no Metal PluggableDevice"),
        ((2, 1, 1, OPEN), "", False, "ambiguous"),
        ((1, 0, 0, ""), "", False, "no Metal plugin distribution is installed"),
    ],
)
def test_which_backend_gets_gpu_kernels(driver, probe, backend, gpu, reason):
    out = _drive(driver, "decide", *probe, PIN).rstrip("\n").split("\t")
    assert out[0] == backend and out[1] == ("1" if gpu else "0")
    assert (reason in out[2]) if reason else out[2] == ""


def test_status_text_round_trips_to_python(driver):
    records = _loader.parse_gpu_registrations(_drive(driver, "format"))
    assert records["TfmetalExt>LayerNorm"] == _loader.GpuRegistration(
        "TfmetalExt>LayerNorm", True, "tensorflow-metal-plugin", None)
    assert records["TfmetalExt>Softshrink"].reason == "a reason with a tab and a newline"
    assert not records["TfmetalExt>Softshrink"].gpu
    assert records["TfmetalExt>MultiTensorAdam"].backend is None


@pytest.mark.parametrize("env, variable_api, synchronous", [
    ("-", "0", 1),  # TF 2.20/2.21: no resource-variable C API, every kernel waits
    ("-", "1", 0),
    ("0", "0", 0),
    ("1", "1", 1),
    ("yes", "1", 1),
    ("", "1", 0),  # empty: as if unset
])
def test_synchronous_mode_follows_the_plugins_rule(driver, env, variable_api, synchronous):
    assert _drive(driver, "sync", env, variable_api).strip() == str(synchronous)


def test_stream_sequence_under_contention(driver):
    # A Submission without the submit lock fails this in about half the rounds on 2 cores.
    threads, per_thread = 8, 1000
    cancelled = sum(1 for t in range(threads) for i in range(per_thread) if (i + t) % 7 == 3)
    for _ in range(5):
        count, last = _drive(driver, "sequence", threads, per_thread).split()
        assert int(count) == threads * per_thread - cancelled == int(last)


# ----------------------------------------------------------------------------
# On a Mac (`pytest -m metal`), on whichever Metal backend is installed.


@pytest.mark.metal
def test_custom_ops_bind_to_this_macs_metal_backend():
    from tfmetal_ext import devices, ops

    st = ops.status()
    assert st.metal_kernels and st.metal_backend == devices.capabilities().metal_plugin, str(st)
    for name, k in st.kernels.items():
        if name == "multi_tensor_adam" and "resource-variable kernel C API" in (k["gpu_reason"] or ""):
            continue  # TF 2.20/2.21 export no variable API: its CPU kernel, by design
        assert k["gpu"], (name, k)


@pytest.mark.metal
def test_custom_ops_keep_stream_order_with_the_backends_own_kernels():
    # Our op between two of the backend's kernels, over many small tensors
    # (the open plugin's allocator hands them out at offsets inside shared
    # buffers), with nothing synchronizing in between: a wrong offset or a
    # missing wait on the stream's sequence gives wrong sums.
    import numpy as np

    from tfmetal_ext import ops
    from tfmetal_ext.testing import np_softshrink

    rng = np.random.default_rng(5)
    xs = [rng.normal(0, 2, size=n).astype(np.float32) for n in (1, 7, 64, 1000, 4099, 65537)] * 4

    @tf.function
    def step(tensors):
        return [tf.reduce_sum(ops.softshrink(t * 2.0 + 1.0, 0.5) * 3.0) for t in tensors]

    with tf.device("/GPU:0"):
        got = [v.numpy() for v in step([tf.constant(x) for x in xs])]
    want = [np.sum(np_softshrink(x * 2.0 + 1.0, 0.5) * 3.0) for x in xs]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------
# The gap-kernel plan: Python writes it (tfmetal_ext.backends.gap_kernels),
# gap_plan.h parses it, and registration follows the parse.


def _plan_lines(driver, text):
    return _drive(driver, "plan", text).splitlines()


@pytest.mark.parametrize("key", ["metal", "metal_plugin"])
def test_the_host_code_registers_exactly_the_planned_rows(driver, key):
    from tfmetal_ext.backends import gap_kernels, registry

    table = registry.table(key)
    rows = gap_kernels.plan(table, macos="12.7", enabled=True)
    dist = gap_kernels.TABLE_RELEASES[key][0]
    lines = _plan_lines(driver, gap_kernels.plan_text(dist, rows))
    assert lines[:2] == ["present 1", f"backend {dist}"]
    planned = {line.split()[1] for line in lines if line.startswith("combo ")}
    assert planned == {r.key for r in rows if r.registered}
    # TF_DataType numbers of the dtypes: TensorFlow's DataType enum.
    for line in lines:
        if line.startswith("combo "):
            for field in line.split()[2:]:
                name, value = field.split("=")[1].split(":")
                assert int(value) == tf.as_dtype(name).as_datatype_enum, (name, value)
    # Each op's combinations are the cross product of its attrs' dtypes.
    for op, dtypes in gap_kernels.registered(rows).items():
        kernel = gap_kernels.GAP_KERNELS[op]
        n = len(dtypes)
        for ds in kernel.other_attrs.values():
            n *= len(ds)
        assert sum(1 for line in lines if line.startswith(f"combo {op}[")) == n
        assert f"op {op} host={''.join(h + ',' for h in kernel.host_memory)}" in lines


def _kernel_defs(lines):
    """The KernelDef protos the driver serialized, in combination order."""
    from tensorflow.core.framework import kernel_def_pb2

    defs = []
    for line in lines:
        if line.startswith("kerneldef "):
            proto = kernel_def_pb2.KernelDef()
            proto.ParseFromString(bytes.fromhex(line.split(" ", 1)[1]))
            defs.append(proto)
    return defs


@pytest.mark.parametrize("key", ["metal", "metal_plugin"])
def test_string_constraints_reach_tensorflow_as_allowed_values(driver, key):
    # Einsum's equations: escaped in the plan text, unescaped by the parser, and serialized into the KernelDef
    # that RegisterGapKernels hands TF_RegisterKernelBuilderWithKernelDef (parsed back here by TF's proto).
    from tfmetal_ext.backends import gap_kernels

    rows = gap_kernels.plan(key, macos="15.0", enabled=True)
    text = gap_kernels.plan_text(gap_kernels.TABLE_RELEASES[key][0], rows)
    einsum = next(line for line in text.splitlines() if line.startswith("Einsum|"))
    escaped = einsum.split("string:equation=")[1].split("|")[0].split(",")
    assert len(escaped) == len(gap_kernels.EINSUM_EQUATIONS) and not any(set(v) & set("->.") for v in escaped)
    lines = _plan_lines(driver, "tensorflow-metal\n" + einsum + "\n")
    assert [line.split(" ", 2)[2] for line in lines if line.startswith("string equation ")] == list(
        gap_kernels.EINSUM_EQUATIONS)
    defs = _kernel_defs(lines)
    dtypes = gap_kernels.registered(rows)["Einsum"]
    assert len(defs) == len(dtypes)
    for proto, dtype in zip(defs, dtypes):
        assert proto.op == "Einsum" and proto.device_type == "GPU" and not proto.host_memory_arg
        constraints = {c.name: c.allowed_values.list for c in proto.constraint}
        assert list(constraints["T"].type) == [tf.as_dtype(dtype).as_datatype_enum]
        assert [v.decode() for v in constraints["equation"].s] == list(gap_kernels.EINSUM_EQUATIONS)
        assert proto.priority == 0


def test_kernel_defs_carry_type_constraints_and_host_memory(driver):
    text = "tensorflow-metal\nFill|T=float16,bfloat16|index_type=int32|string:mode=a%2Cb,c%3Ed|host=dims,value\n"
    lines = _plan_lines(driver, text)
    assert [line for line in lines if line.startswith("string ")] == ["string mode a,b", "string mode c>d"]
    first, second = _kernel_defs(lines)
    assert [(c.name, list(c.allowed_values.list.type)) for c in first.constraint[:2]] == [
        ("T", [tf.float16.as_datatype_enum]), ("index_type", [tf.int32.as_datatype_enum])]
    assert [v.decode() for v in first.constraint[2].allowed_values.list.s] == ["a,b", "c>d"]
    assert list(first.host_memory_arg) == ["dims", "value"] == list(second.host_memory_arg)
    assert list(second.constraint[0].allowed_values.list.type) == [tf.bfloat16.as_datatype_enum]


def test_escape_round_trips_through_the_parser(driver):
    from tfmetal_ext.backends import gap_kernels

    values = ["ab,bc->ac", "x|y=z", "a b", "Tab\tnew\nline", "%41", "é"]
    escaped = ",".join(gap_kernels.escape(v) for v in values)
    assert all(c.isalnum() or c in "_%," for c in escaped)
    lines = _plan_lines(driver, f"tensorflow-metal\nEinsum|T=float32|string:equation={escaped}\n")
    assert "error" not in lines[1]
    # The driver prints each value after "string equation "; a newline inside one continues on the next line.
    printed = "\n".join(lines).split("string equation ")[1:]
    assert [p.split("\ncombo ")[0].rstrip("\n") for p in printed] == values


@pytest.mark.parametrize("text, error", [
    ("", "names no backend"),
    ("tensorflow-metal\nEinsum|T=float32|string:equation=ab,c%2\n", "bad escaped value 'c%2'"),
    ("tensorflow-metal\nEinsum|T=float32|string:equation=a%00b\n", "bad escaped value"),
    ("tensorflow-metal\nEinsum|T=float32|string:equation=a-b\n", "bad escaped value 'a-b'"),
    ("tensorflow-metal\nEinsum|T=float32|string:equation=ab,\n", "bad escaped value ''"),
    ("tensorflow-metal\nEinsum|T=float32|string:eq uation=ab\n", "bad attr"),
    ("tensorflow-metal\nDiv NoNan|T=float32\n", "bad op name"),
    ("tensorflow-metal\nDivNoNan|T=float64\n", "unknown dtype 'float64'"),
    ("tensorflow-metal\nDivNoNan\n", "has no type constraint"),
    ("tensorflow-metal\nDivNoNan|T\n", "has no '='"),
    ("tensorflow-metal\nDivNoNan|T=float32\nDivNoNan|T=float16\n", "DivNoNan twice"),
    ("tensorflow-metal\nFill|T=float32|host=di;ms\n", "bad value"),
])
def test_a_malformed_plan_registers_nothing(driver, text, error):
    lines = _plan_lines(driver, text)
    assert lines[0] == "present 1" and lines[1].startswith("error ") and error in lines[1]
    assert len(lines) == 2


def test_the_plan_variable_is_the_one_python_sets():
    from tfmetal_ext.backends import gap_kernels

    text = (METAL_DIR / "gap_plan.h").read_text()
    assert f'kPlanEnv[] = "{gap_kernels.PLAN_ENV}"' in text


def test_an_unset_plan_registers_nothing(driver):
    assert _plan_lines(driver, "-") == ["present 0", "backend "]
