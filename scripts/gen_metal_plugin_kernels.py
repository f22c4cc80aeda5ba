"""Generates tfmetal_ext/backends/_metal_plugin_kernels.py: the open tensorflow-metal-plugin's kernel table.

    python scripts/gen_metal_plugin_kernels.py            # rewrite the module
    python scripts/gen_metal_plugin_kernels.py --check    # exit 1 when the committed module differs

Rerun it when `tfmetal_ext.backends.metal_plugin.PIN` moves. It needs a C++
compiler (``$CXX``, else g++ or clang++), the pinned sdist (fetched and
sha256-checked by `tfmetal_ext.testing.metal_plugin_source`) and, for the
TensorFlow half of the table, the plugin's TensorFlow release installed.

How the table is read, rather than typed
----------------------------------------
The plugin registers its kernels at load time through TF's C kernel API: its
``TF_InitKernel`` (``src/plugin_init.cc``) calls ``RegisterAllMetalKernels``
(``kernels/metal_kernels.mm``), which calls one ``RegisterMetal*Kernels``
function per file, which call per-file helpers that loop over dtype arrays
and ``{op, compute}`` tables and end in ``TF_NewKernelBuilder`` /
``TF_KernelBuilder_TypeConstraint`` / ``TF_RegisterKernelBuilder``. Those
loops are ordinary C++ (nested loops over part of an array, optional second
constraints, ops with no type constraint at all), so instead of matching them
with patterns this script *runs* them:

1. It cuts out of the sdist the functions reachable from
   ``RegisterAllMetalKernels`` (the registration call graph, per file), and
   replaces every reference to a kernel's create/compute/delete function
   with ``nullptr`` (only the function pointer's type is needed).
2. It compiles them, in a temporary directory, against a small recording
   stand-in of the kernel-builder C API written here, and runs the result
   twice: once with the plugin's ``ResourceVariableApiAvailable()`` false (what
   TF 2.20/2.21 give it: no binary exports those symbols) and once true.
3. Every ``TF_RegisterKernelBuilder`` call prints its op, device, type
   constraints and the arguments its builder passed to
   ``TF_KernelBuilder_HostMemory``; the run without the C API gives `KERNELS`
   and `HOST_MEMORY`, and the other run's extra kernels give
   `NEEDS_RESOURCE_VARIABLE_API`. Their host-memory arguments (the ``var`` /
   ``resource`` handles) are checked like the rest but not recorded: those
   kernels do not exist on the TensorFlow the plugin pins.

Nothing of the plugin is copied into this repository: the cut-out source
lives only in the temporary build directory. The script fails loudly (exit
status 1, with the file and line) when a ``TF_NewKernelBuilder`` call lies
outside the functions it compiled, when the cut-out code does not compile
(an unknown helper, a file-scope table, Objective-C in a registration path),
when a registration logs an error, targets another device, or constrains an
attr twice, when two kernels of one op and dtype keep different arguments in
host memory, when a host-memory argument is not an input or output of the
op's OpDef in the pinned TensorFlow (which rejects such a kernel when it is
placed), or when the required-symbol list of
``ResourceVariableApiAvailable`` cannot be read.

TF's own kernels for any device
-------------------------------
A pluggable device also gets TensorFlow's ``DEVICE_DEFAULT`` registrations
(device-agnostic kernels: control flow, ``Const``, ``Identity``, ``Shape``,
``ReadVariableOp``, int32 host-memory arithmetic, ...). They are read from the
installed TensorFlow's kernel registry, which must be the plugin's pinned
release, into `TF_DEFAULT_KERNELS`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import pprint
import re
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = REPO / "tfmetal_ext" / "backends" / "_metal_plugin_kernels.py"
KERNEL_DIR = pathlib.Path("src/tensorflow/core/common_runtime/metal/kernels")
ROOT_FUNCTION = "RegisterAllMetalKernels"
GATE_FUNCTION = "ResourceVariableApiAvailable"

# TF_DataType enumerators (tensorflow/c/tf_datatype.h) -> tf.DType names.
DTYPES = {
    "TF_FLOAT": "float32", "TF_DOUBLE": "float64", "TF_INT32": "int32", "TF_UINT8": "uint8",
    "TF_INT16": "int16", "TF_INT8": "int8", "TF_STRING": "string", "TF_COMPLEX64": "complex64",
    "TF_INT64": "int64", "TF_BOOL": "bool", "TF_QINT8": "qint8", "TF_QUINT8": "quint8",
    "TF_QINT32": "qint32", "TF_BFLOAT16": "bfloat16", "TF_QINT16": "qint16", "TF_QUINT16": "quint16",
    "TF_UINT16": "uint16", "TF_COMPLEX128": "complex128", "TF_HALF": "float16", "TF_RESOURCE": "resource",
    "TF_VARIANT": "variant", "TF_UINT32": "uint32", "TF_UINT64": "uint64",
}


class ParseError(SystemExit):
    """A registration this script cannot read: it stops, it never drops one."""

    def __init__(self, message):
        super().__init__(f"gen_metal_plugin_kernels: {message}")


# ---------------------------------------------------------------------------------------------
# Reading C++ structure: comments and literals blanked, braces matched.


def blank_comments_and_literals(text):
    """`text` with comments and the insides of string/char literals replaced by spaces (same offsets)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ParseError("unterminated /* comment")
            j += 2
            out[i:j] = [ch if ch == "\n" else " " for ch in text[i:j]]
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise ParseError("unterminated literal")
            out[i + 1:j] = " " * (j - i - 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


Function = collections.namedtuple("Function", "name start body_start end header")


def top_level_functions(text, masked):
    """The function definitions at namespace scope of one source file.

    Returns `Function` tuples whose offsets index `text`; `start` is where
    the definition (with any ``template <...>``) begins.
    """
    functions = []
    stack = []  # True for a namespace / extern "C" brace
    last_boundary = 0
    i = 0
    while i < len(masked):
        c = masked[i]
        if c == "#" and (i == 0 or masked[i - 1] == "\n"):
            # A preprocessor line (with continuations) is not part of any header.
            j = i
            while True:
                j = masked.find("\n", j)
                if j < 0:
                    j = len(masked)
                    break
                if masked[j - 1] != "\\":
                    break
                j += 1
            if all(stack):
                last_boundary = j
            i = j
            continue
        if c == "{":
            header = masked[last_boundary:i]
            at_namespace_scope = all(stack)
            if at_namespace_scope and header.count("(") > header.count(")"):
                # A braced initializer inside a parameter list (a default argument): part of the header.
                depth, j = 0, i
                while True:
                    depth += {"{": 1, "}": -1}.get(masked[j], 0)
                    if depth == 0:
                        break
                    j += 1
                i = j + 1
                continue
            is_namespace = bool(re.search(r'(\bnamespace(\s+\w+)?|\bextern\s+"\s*")\s*$', header))
            if at_namespace_scope and not is_namespace and "(" in header and "=" not in header.split("(")[0]:
                # The parameter list is the header's last top-level parenthesis group; anything before an
                # earlier group's close (a macro invocation with no semicolon) is not part of the definition.
                groups, depth, open_at = [], 0, None
                for k, ch in enumerate(header):
                    if ch == "(":
                        if depth == 0:
                            open_at = k
                        depth += 1
                    elif ch == ")":
                        depth -= 1
                        if depth == 0:
                            groups.append((open_at, k))
                m = re.search(r"(~?\w+)\s*(<[^<>]*>)?\s*$", header[:groups[-1][0]]) if groups else None
                if m is None:
                    raise ParseError(f"cannot name the function defined at offset {i}: {header.strip()!r}")
                if len(groups) > 1:
                    header = header[groups[-2][1] + 1:]
                    last_boundary = i - len(header)
                depth, j = 0, i
                while True:
                    if masked[j] == "{":
                        depth += 1
                    elif masked[j] == "}":
                        depth -= 1
                        if depth == 0:
                            break
                    j += 1
                    if j >= len(masked):
                        raise ParseError(f"unbalanced braces in function {m.group(1)}")
                start = last_boundary + (len(header) - len(header.lstrip()))
                functions.append(Function(m.group(1), start, i, j + 1, header.strip()))
                i = j + 1
                last_boundary = i
                continue
            stack.append(is_namespace)
            if is_namespace:
                last_boundary = i + 1
        elif c == "}":
            if not stack:
                raise ParseError("unbalanced closing brace")
            stack.pop()
            if all(stack):
                last_boundary = i + 1
        elif c == ";" and all(stack):
            last_boundary = i + 1
        i += 1
    return functions


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


# ---------------------------------------------------------------------------------------------
# Cutting out the registration call graph.


def registration_sources(root):
    """file -> (text, masked, functions) for every C/C++/Objective-C++ source of the plugin."""
    sources = {}
    for path in sorted((root / "src").rglob("*")):
        if path.suffix in (".mm", ".cc", ".cpp", ".h") and path.is_file():
            text = path.read_text(encoding="utf-8")
            masked = blank_comments_and_literals(text)
            sources[path.relative_to(root)] = (text, masked, top_level_functions(text, masked))
    return sources


def call_graph_from_root(sources):
    """The functions reachable from RegisterAllMetalKernels: [(file, Function)], in file order."""
    by_name = collections.defaultdict(list)
    for file, (_, _, functions) in sources.items():
        for fn in functions:
            by_name[fn.name].append((file, fn))
    roots = by_name.get(ROOT_FUNCTION, [])
    if len(roots) != 1:
        raise ParseError(f"expected one definition of {ROOT_FUNCTION}, found {len(roots)}")
    init = [fn for file, fn in by_name.get("TF_InitKernel", [])]
    if len(init) != 1:
        raise ParseError("expected one TF_InitKernel")
    init_file = next(file for file, fn in by_name["TF_InitKernel"])
    init_body = sources[init_file][1][init[0].body_start:init[0].end]
    if not re.search(rf"\b{ROOT_FUNCTION}\s*\(", init_body):
        raise ParseError(f"TF_InitKernel does not call {ROOT_FUNCTION}; the registration entry point moved")

    selected = {}
    todo = [roots[0]]
    while todo:
        file, fn = todo.pop()
        key = (file, fn.start)
        if key in selected:
            continue
        selected[key] = (file, fn)
        body = sources[file][1][fn.body_start:fn.end]
        for called in set(re.findall(r"\b(\w+)\s*(?:<[^<>;]*>)?\s*\(", body)):
            if called == GATE_FUNCTION:
                continue  # stubbed: the two runs set it
            same_file = [(f, g) for f, g in by_name.get(called, []) if f == file]
            cross = [(f, g) for f, g in by_name.get(called, []) if called.startswith("RegisterMetal")]
            todo.extend(same_file or cross)
    return sorted(selected.values(), key=lambda item: (str(item[0]), item[1].start))


# Other ways a plugin could register a kernel; this script reads none of them.
_OTHER_REGISTRATIONS = re.compile(r"\b(REGISTER_KERNEL_BUILDER|TF_RegisterKernelBuilderWithKernelDef)\b")


def check_every_builder_is_reached(sources, graph):
    reached = collections.defaultdict(list)
    for file, fn in graph:
        reached[file].append((fn.start, fn.end))
    for file, (text, masked, _) in sources.items():
        other = _OTHER_REGISTRATIONS.search(masked)
        if other:
            raise ParseError(
                f"{file}:{line_of(text, other.start())}: {other.group(1)} registers kernels in a way this script "
                "does not read"
            )
        for m in re.finditer(r"\bTF_NewKernelBuilder\s*\(", masked):
            if not any(a <= m.start() < b for a, b in reached.get(file, ())):
                raise ParseError(
                    f"{file}:{line_of(text, m.start())}: a TF_NewKernelBuilder call outside the functions "
                    f"reachable from {ROOT_FUNCTION}; this script does not know whether it registers"
                )


def resource_api_symbols(sources):
    """The symbols ResourceVariableApiAvailable() dlsym()s (its kRequired list)."""
    for file, (text, masked, functions) in sources.items():
        for fn in functions:
            if fn.name == GATE_FUNCTION:
                body = text[fn.body_start:fn.end]
                if "dlsym" not in body:
                    raise ParseError(f"{file}: {GATE_FUNCTION} no longer uses dlsym; read it again")
                symbols = tuple(re.findall(r'"(TF_\w+)"', body))
                if not symbols:
                    raise ParseError(f"{file}: cannot read the symbols {GATE_FUNCTION} looks up")
                return str(file), symbols
    raise ParseError(f"no definition of {GATE_FUNCTION}")


# Create/compute/delete function references: only their type matters to a registration.
_KERNEL_FN = re.compile(r"&?\s*\b([A-Za-z]\w*_(?:Compute|Create|Delete))\b(\s*<[^<>;()]*>)?")


PRELUDE = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

typedef enum TF_DataType {
%(enum)s
} TF_DataType;
typedef enum TF_Code { TF_OK = 0, TF_INVALID_ARGUMENT = 3, TF_INTERNAL = 13 } TF_Code;
struct TF_Status { TF_Code code = TF_OK; std::string message; };
struct TF_OpKernelConstruction;
struct TF_OpKernelContext;
struct TF_KernelBuilder {
  std::string op, device;
  std::vector<std::pair<std::string, int>> types;
  std::vector<std::string> host;
};
static const char* kDTypeNames[] = {%(names)s};
static int g_errors = 0;
static bool g_resource_api = false;

inline TF_Status* TF_NewStatus() { return new TF_Status(); }
inline void TF_DeleteStatus(TF_Status* s) { delete s; }
inline TF_Code TF_GetCode(const TF_Status* s) { return s->code; }
inline const char* TF_Message(const TF_Status* s) { return s->message.c_str(); }
inline void TF_SetStatus(TF_Status* s, TF_Code code, const char* msg) { s->code = code; s->message = msg; }
inline TF_KernelBuilder* TF_NewKernelBuilder(const char* op, const char* device,
    void* (*)(TF_OpKernelConstruction*), void (*)(void*, TF_OpKernelContext*), void (*)(void*)) {
  auto* b = new TF_KernelBuilder();
  b->op = op; b->device = device;
  return b;
}
inline void TF_KernelBuilder_TypeConstraint(TF_KernelBuilder* b, const char* attr, const TF_DataType t, TF_Status*) {
  b->types.emplace_back(attr, static_cast<int>(t));
}
inline void TF_KernelBuilder_HostMemory(TF_KernelBuilder* b, const char* arg) { b->host.emplace_back(arg); }
inline void TF_DeleteKernelBuilder(TF_KernelBuilder* b) {
  std::fprintf(stderr, "ERROR: builder for %%s deleted without registering\n", b->op.c_str());
  ++g_errors;
  delete b;
}
inline void TF_RegisterKernelBuilder(const char* name, TF_KernelBuilder* b, TF_Status*) {
  std::printf("{\"name\": \"%%s\", \"op\": \"%%s\", \"device\": \"%%s\", \"types\": [", name, b->op.c_str(),
              b->device.c_str());
  for (size_t i = 0; i < b->types.size(); ++i)
    std::printf("%%s[\"%%s\", \"%%s\"]", i ? ", " : "", b->types[i].first.c_str(), kDTypeNames[b->types[i].second]);
  std::printf("], \"host\": [");
  for (size_t i = 0; i < b->host.size(); ++i) std::printf("%%s\"%%s\"", i ? ", " : "", b->host[i].c_str());
  std::printf("]}\n");
  delete b;
}

struct TfmLog {
  bool error;
  std::ostringstream s;
  explicit TfmLog(bool e) : error(e) {}
  template <typename T> TfmLog& operator<<(const T& v) { s << v; return *this; }
  ~TfmLog() { std::fprintf(stderr, "%%s: %%s\n", error ? "ERROR" : "LOG", s.str().c_str()); if (error) ++g_errors; }
};
#define LOG(severity) TfmLog(std::string(#severity) != "INFO")

namespace tensorflow {
namespace metal {
inline constexpr char kMetalDeviceType[] = "GPU";
bool %(gate)s() { return g_resource_api; }
%(decls)s
}  // namespace metal
}  // namespace tensorflow
"""

MAIN = r"""
int main(int argc, char** argv) {
  g_resource_api = argc > 1 && std::strcmp(argv[1], "1") == 0;
  tensorflow::metal::%(root)s();
  return g_errors ? 2 : 0;
}
"""


def build_program(sources, graph):
    enum_names = list(DTYPES)
    enum = ",\n".join(f"  {name} = {i}" for i, name in enumerate(enum_names))
    names = ", ".join(f'"{DTYPES[name]}"' for name in enum_names)
    globals_ = sorted({fn.name for _, fn in graph if fn.name.startswith("RegisterMetal") or fn.name == ROOT_FUNCTION})
    decls = "\n".join(f"void {name}();" for name in globals_)
    parts = [PRELUDE % {"enum": enum, "names": names, "gate": GATE_FUNCTION, "decls": decls}]
    by_file = collections.defaultdict(list)
    for file, fn in graph:
        by_file[file].append(fn)
    forwarders = []
    for index, (file, functions) in enumerate(sorted(by_file.items(), key=lambda kv: str(kv[0]))):
        text = sources[file][0]
        defined = {fn.name for fn in functions}
        ns = f"tfm_{index}"
        parts.append(f"// ---- {file}\nnamespace tensorflow {{\nnamespace metal {{\nnamespace {ns} {{")
        for fn in functions:
            code = text[fn.start:fn.end]

            def keep_or_null(m, defined=defined):
                return m.group(0) if m.group(1) in defined else "nullptr"

            parts.append(f"#line {line_of(text, fn.start)} \"{file}\"\n" + _KERNEL_FN.sub(keep_or_null, code))
            if fn.name in globals_:
                forwarders.append(f"void {fn.name}() {{ {ns}::{fn.name}(); }}")
        parts.append(f"}}  // namespace {ns}\n}}  // namespace metal\n}}  // namespace tensorflow")
    parts.append("namespace tensorflow {\nnamespace metal {\n" + "\n".join(forwarders) + "\n}\n}")
    parts.append(MAIN % {"root": ROOT_FUNCTION})
    return "\n".join(parts)


def compiler():
    for candidate in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise ParseError("no C++ compiler found (set CXX)")


def run_registrations(program):
    """{False: [...], True: [...]}: the registrations without and with the resource-variable C API."""
    with tempfile.TemporaryDirectory(prefix="tfmetal-plugin-kernels-") as tmp:
        src = pathlib.Path(tmp) / "registrations.cc"
        exe = pathlib.Path(tmp) / "registrations"
        src.write_text(program)
        proc = subprocess.run(
            [compiler(), "-std=c++17", "-O0", "-w", "-fno-exceptions", str(src), "-o", str(exe)],
            capture_output=True, text=True,
        )
        if proc.returncode:
            raise ParseError(
                "the plugin's registration code did not compile against the recording stub; a registration "
                "path uses something this script does not model:\n" + proc.stderr[-6000:]
            )
        runs = {}
        for api in (False, True):
            proc = subprocess.run([str(exe), "1" if api else "0"], capture_output=True, text=True)
            if proc.returncode:
                raise ParseError(f"registration run (resource API {api}) failed:\n{proc.stderr[-4000:]}")
            runs[api] = [json.loads(line) for line in proc.stdout.splitlines()]
    return runs


def table(registrations):
    """op -> (dtypes of its first type constraint), op -> that attr's name when it is not T, the number of
    kernels, and op -> {that dtype ("" without a constraint): the arguments its kernel keeps in host memory}."""
    dtypes = collections.defaultdict(set)
    attrs = {}
    names = set()
    host = collections.defaultdict(dict)
    for reg in registrations:
        if reg["device"] != "GPU":
            raise ParseError(f"kernel {reg['name']} registers for device {reg['device']!r}, not GPU")
        if reg["name"] in names:
            raise ParseError(f"kernel name {reg['name']} registered twice")
        names.add(reg["name"])
        seen = [attr for attr, _ in reg["types"]]
        if len(seen) != len(set(seen)):
            raise ParseError(f"kernel {reg['name']} constrains an attr twice: {reg['types']}")
        op = reg["op"]
        dtypes[op]  # an op registered with no type constraint keeps an empty tuple
        if reg["types"]:
            attr, dtype = reg["types"][0]
            if attrs.setdefault(op, attr) != attr:
                raise ParseError(f"op {op} is registered with different first type attrs: {attrs[op]} and {attr}")
            dtypes[op].add(dtype)
        key = reg["types"][0][1] if reg["types"] else ""
        kept = tuple(sorted(set(reg["host"])))
        if host[op].setdefault(key, kept) != kept:
            raise ParseError(f"op {op} ({key or 'no constraint'}) keeps different arguments in host memory across "
                             f"its kernels: {host[op][key]} and {kept}")
    kernels = {op: tuple(sorted(d)) for op, d in sorted(dtypes.items())}
    host_memory = {op: {d: a for d, a in sorted(by.items()) if a} for op, by in sorted(host.items()) if any(by.values())}
    return kernels, {op: a for op, a in sorted(attrs.items()) if a != "T"}, len(names), host_memory


def tf_default_kernels(tf_version):
    """TF's DEVICE_DEFAULT registrations (they serve a pluggable device too): op -> dtypes of T/dtype."""
    import tensorflow as tf
    from tensorflow.python.framework import kernels as tf_kernels

    if tf.__version__ != tf_version:
        raise ParseError(
            f"TF_DEFAULT_KERNELS are read from the installed TensorFlow, which must be the plugin's "
            f"TF_SUPPORTED_VERSION {tf_version}. Received: tensorflow {tf.__version__}"
        )
    found = collections.defaultdict(set)
    for kernel in tf_kernels.get_all_registered_kernels().kernel:
        if kernel.device_type != "DEFAULT":
            continue
        found[kernel.op]
        for constraint in kernel.constraint:
            if constraint.name in ("T", "dtype"):
                found[kernel.op].update(tf.DType(v).name for v in constraint.allowed_values.list.type)
                break
    return {op: tuple(sorted(d)) for op, d in sorted(found.items())}


def check_host_memory_names(registrations, tf_version):
    """Fails on a HostMemory argument that the op's OpDef in the installed TensorFlow does not have.

    TensorFlow refuses such a kernel when it places a node on it ("HostMemory
    args '...' not found in OpDef"), so the table would list a kernel that
    cannot run.
    """
    from tensorflow.python.framework import op_def_registry

    for reg in registrations:
        if not reg["host"]:
            continue
        op_def = op_def_registry.get(reg["op"])
        if op_def is None:
            raise ParseError(f"kernel {reg['name']} keeps arguments in host memory for {reg['op']}, an op "
                             f"TensorFlow {tf_version} does not define")
        names = {arg.name for arg in (*op_def.input_arg, *op_def.output_arg)}
        unknown = sorted(set(reg["host"]) - names)
        if unknown:
            raise ParseError(f"kernel {reg['name']} keeps {unknown} in host memory, but {reg['op']} has no such "
                             f"argument in TensorFlow {tf_version} (it has {sorted(names)}); TensorFlow rejects "
                             "the kernel when it places a node on it")


HEADER = '''"""GENERATED by scripts/gen_metal_plugin_kernels.py -- do not edit.

The kernels tensorflow-metal-plugin {pin} registers for its GPU device, read
by compiling and running the registration functions of its sdist
(tensorflow_metal_plugin-{pin}.tar.gz, sha256 {sha}) against a recording
stand-in of TF's kernel-builder C API; see the script's docstring.

Rerun when the pin moves:  python scripts/gen_metal_plugin_kernels.py
Check it is current:       python scripts/gen_metal_plugin_kernels.py --check

KERNELS: op -> dtypes of the op's first type constraint (``T`` unless
DTYPE_ATTR names another attr), as registered on TF {tf} (no binary of which
exports the resource-variable kernel C API). An empty tuple: registered with
no type constraint (e.g. the bool-only LogicalAnd).
NEEDS_RESOURCE_VARIABLE_API: op -> dtypes the plugin registers only when
``{gate}()`` ({gate_file}) finds every symbol of
RESOURCE_VARIABLE_API_SYMBOLS with dlsym; on TF {tf} it finds none.
HOST_MEMORY: op -> {{dtype of KERNELS ("" without a type constraint): the
arguments (OpDef input/output names) its kernel keeps in host memory, as its
TF_KernelBuilder_HostMemory calls declare}}, for the kernels registered on
TF {tf}. An op of KERNELS that is not here declares none. The
NEEDS_RESOURCE_VARIABLE_API kernels' host memory is not recorded.
TF_DEFAULT_KERNELS: TensorFlow {tf}'s own DEVICE_DEFAULT kernels (any device,
the plugin's included): op -> dtypes of their T/dtype constraint.
"""

'''


def render(pin, sha, tf_version, gate_file, symbols, kernels, attrs, gated, defaults, counts, host_memory):
    body = [
        HEADER.format(pin=pin, sha=sha, tf=tf_version, gate=GATE_FUNCTION, gate_file=gate_file),
        f"PIN = {pin!r}",
        f"SDIST_SHA256 = {sha!r}",
        f"TF_VERSION = {tf_version!r}",
        f"# {counts[0]} registrations of {len(kernels)} ops; with the resource-variable C API, "
        f"{counts[1]} registrations, {len(gated)} more ops.",
        f"RESOURCE_VARIABLE_API_SYMBOLS = {pprint.pformat(symbols, width=100)}",
        f"RESOURCE_VARIABLE_API_GATE = {f'{GATE_FUNCTION}() in {gate_file}: dlsym() of every symbol above'!r}",
        "",
        "KERNELS = " + pprint.pformat(kernels, width=110, sort_dicts=True),
        "",
        "DTYPE_ATTR = " + pprint.pformat(attrs, width=110, sort_dicts=True),
        "",
        "NEEDS_RESOURCE_VARIABLE_API = " + pprint.pformat(gated, width=110, sort_dicts=True),
        "",
        "HOST_MEMORY = " + pprint.pformat(host_memory, width=110, sort_dicts=True),
        "",
        "TF_DEFAULT_KERNELS = " + pprint.pformat(defaults, width=110, sort_dicts=True),
        "",
    ]
    return "\n".join(body)


def generate(root=None):
    sys.path.insert(0, str(REPO))
    from tfmetal_ext import testing
    from tfmetal_ext.backends import metal_plugin

    root = pathlib.Path(root) if root else testing.metal_plugin_source()
    tf_version = (root / "TF_SUPPORTED_VERSION").read_text().strip()
    if tf_version != metal_plugin.TF_VERSION:
        raise ParseError(
            f"the sdist supports TF {tf_version}, metal_plugin.TF_VERSION says {metal_plugin.TF_VERSION}; "
            "update the pin first"
        )
    sources = registration_sources(root)
    graph = call_graph_from_root(sources)
    check_every_builder_is_reached(sources, graph)
    for file, (text, masked, functions) in sources.items():
        for fn in functions:
            if fn.name.startswith("RegisterMetal") and fn.name.endswith("Kernels") and \
                    not any(g is fn for _, g in graph):
                raise ParseError(f"{file}: {fn.name} is defined but not reached from {ROOT_FUNCTION}")
    gate_file, symbols = resource_api_symbols(sources)
    runs = run_registrations(build_program(sources, graph))
    kernels, attrs, n_without, host_memory = table(runs[False])
    with_api, attrs_api, n_with, _ = table(runs[True])
    gated = {}
    for op, dtypes in with_api.items():
        extra = tuple(d for d in dtypes if d not in kernels.get(op, ()))
        if op not in kernels or extra:
            gated[op] = dtypes if op not in kernels else extra
    attrs = {**{op: a for op, a in attrs_api.items() if op in gated}, **attrs}
    defaults = tf_default_kernels(tf_version)
    check_host_memory_names(runs[False] + runs[True], tf_version)
    return render(
        metal_plugin.PIN, metal_plugin.SDIST_SHA256, tf_version, gate_file, symbols, kernels,
        dict(sorted(attrs.items())), gated, defaults, (n_without, n_with), host_memory,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed module differs")
    parser.add_argument("--source", help="an extracted sdist (default: fetch the pinned one)")
    args = parser.parse_args(argv)
    text = generate(args.source)
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            import difflib

            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(True), text.splitlines(True), str(OUTPUT), "generated"))
            print(f"{OUTPUT.relative_to(REPO)} is out of date: rerun python scripts/gen_metal_plugin_kernels.py")
            return 1
        print(f"{OUTPUT.relative_to(REPO)} is current")
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
