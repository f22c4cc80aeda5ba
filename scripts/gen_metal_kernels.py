"""Generates tfmetal_ext/backends/_metal_kernels.py: Apple's tensorflow-metal kernel table, read from its wheel.

    python scripts/gen_metal_kernels.py            # rewrite the module
    python scripts/gen_metal_kernels.py --check    # exit 1 when the committed module differs
    python scripts/gen_metal_kernels.py --dump     # print every registration as JSON lines

It needs ``unicorn`` and ``lief`` (``pip install -e .[gen]``), pip and an
index to download the pinned wheel from (cached, sha256-checked, under
``~/.cache/tfmetal_ext/wheels``), and, for `TF_DEFAULT_KERNELS`, the
TensorFlow release the plugin pairs with, built without CUDA as macOS's is
(``tensorflow-cpu`` on Linux), installed (``--tf-python`` names another
interpreter that has it).

How the table is read
---------------------
Apple's ``tensorflow-plugins/libmetal_plugin.dylib`` is an arm64 Mach-O that
registers every GPU kernel from its exported ``TF_InitKernel`` through TF's
kernel C API (``TF_NewKernelBuilder``, ``TF_KernelBuilder_TypeConstraint``,
``TF_KernelBuilder_HostMemory``, ``TF_RegisterKernelBuilder``). The op names
are C++ strings built at run time inside template wrappers, so no static
reading recovers them. This script *runs* the registration instead, on an
arm64 CPU emulator (unicorn):

1. The image is mapped at `IMAGE_BASE`; its rebase table is applied and its
   bind tables (standard, lazy, weak) point every imported symbol at a
   stand-in: a ``ret`` instruction for a function, a zeroed block for data.
   A weak binding to a symbol the image defines itself binds to the image's
   own copy, as dyld does.
2. Each imported function that registration reaches has a small Python
   stand-in (`IMPORTS`): the allocator, the libc memory and string functions
   it uses, ``dispatch_once`` / ``std::call_once`` / static guards, the
   Objective-C calls, the kernel-builder calls, which record, and the
   op-definition calls of the one op the plugin defines. The op names are
   ``std::string`` objects built by inlined libc++ code, so no libc++ member
   needs a stand-in. Any other import that runs is counted and returns 0,
   and the run fails when one of them is not in `HARMLESS` (a dispatch
   queue, an exit-time destructor, a thread count).
3. The image's static initializers run, then ``TF_InitKernel``, twice: once
   with ``-[MPSGraph instancesRespondToSelector:]`` answering YES and once
   NO. Registrations that appear only in the first run are the ones gated on
   that MPSGraph API (macOS 13 and later).
4. Completeness: every ``bl`` / ``b`` in ``__text`` to the stub of a
   kernel-builder function (`BUILDER_CALLS`) is found by decoding the
   branches, and the run fails unless each of those call sites executed in
   one of the two runs (tail calls included).

Nothing of Apple's code is copied into this repository: the table records op
names, devices, kernel names, type constraints and host-memory argument
names.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import pprint
import struct
import subprocess
import sys
import tempfile
import zipfile

REPO = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = REPO / "tfmetal_ext" / "backends" / "_metal_kernels.py"

# The pinned release: a macOS arm64 wheel (any of its CPython tags carries the same plugin binary).
PIN = "1.2.0"
WHEEL = f"tensorflow_metal-{PIN}-cp311-cp311-macosx_12_0_arm64.whl"
WHEEL_SHA256 = "5fa7cee627031c14f45bd97ff0ef422cd6c3866199ff99cf29b94db6674ceb42"
PLUGIN_PATH = "tensorflow-plugins/libmetal_plugin.dylib"
ENTRY = "_TF_InitKernel"
# The TensorFlow release tensorflow-metal 1.2 pairs with last (its DEVICE_DEFAULT kernels serve the device).
TF_VERSION = "2.19.1"
# What the gated registrations need: the MPSGraph selector asked about, and what its presence means.
GATE_LABEL = "macOS 13 or later (MPSGraph's GRU API, asked with instancesRespondToSelector:)"
GATE_MIN_MACOS = (13, 0)

# TF_DataType values (tensorflow/c/tf_datatype.h) -> tf.DType names.
TF_DTYPES = {
    1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string", 8: "complex64",
    9: "int64", 10: "bool", 11: "qint8", 12: "quint8", 13: "qint32", 14: "bfloat16", 15: "qint16",
    16: "quint16", 17: "uint16", 18: "complex128", 19: "float16", 20: "resource", 21: "variant",
    22: "uint32", 23: "uint64",
}

IMAGE_BASE = 0x1_0000_0000
IMPORT_BASE = 0x2_0000_0000  # one 16-byte slot per imported function
DATA_BASE = 0x2_8000_0000  # imported data symbols, 4 KiB each
HEAP_BASE, HEAP_SIZE = 0x3_0000_0000, 256 << 20
STACK_BASE, STACK_SIZE = 0x4_0000_0000, 8 << 20
EXIT = 0x5_0000_0000  # return address of every top-level call
RET = struct.pack("<I", 0xD65F03C0)

# Imports that run during registration and do nothing it depends on (a dispatch queue for later
# work, an exit-time destructor, a thread count), matched by name prefix; they return 0. Any other
# import without a stand-in fails the run, so a new code path is looked at, not guessed.
HARMLESS = (
    "dispatch_queue_create", "dispatch_release", "__cxa_atexit", "_ZNSt3__16thread20hardware_concurrency",
    "pthread_mutex_lock", "pthread_mutex_unlock", "_ZNSt3__15mutex4lock", "_ZNSt3__15mutex6unlock",
)


# Static initializers allowed to fault, with why that does not touch registration.
EXPECTED_INIT_FAULTS = {
    "GLOBAL__sub_I_mtl_ops_common.cc": "constructs a global std::ofstream (a debug log) through libc++'s "
    "VTT, which the stand-ins leave empty; no kernel registration reads it",
}


# The kernel-builder functions of TF's C API whose every call site must execute.
BUILDER_CALLS = (
    "TF_NewKernelBuilder", "TF_KernelBuilder_TypeConstraint", "TF_KernelBuilder_HostMemory", "TF_RegisterKernelBuilder",
)


class GenerationError(RuntimeError):
    pass


# ----------------------------------------------------------------------------
# The wheel.


def wheel_cache():
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return root / "tfmetal_ext" / "wheels"


def fetch_wheel(cache=None):
    """The pinned wheel's path: from the cache when its sha256 matches, else downloaded with pip."""
    cache = pathlib.Path(cache or wheel_cache())
    path = cache / WHEEL
    if path.is_file() and _sha256(path) == WHEEL_SHA256:
        return path
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
            "macosx_12_0_arm64", "--python-version", "3.11", "--dest", tmp, f"tensorflow-metal=={PIN}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = pathlib.Path(tmp) / WHEEL
        if done.returncode != 0 or not got.is_file():
            raise GenerationError(f"could not download {WHEEL}: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        if _sha256(got) != WHEEL_SHA256:
            raise GenerationError(f"{WHEEL}: sha256 {_sha256(got)} is not the pinned {WHEEL_SHA256}")
        os.replace(got, path)
    return path


def _sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def plugin_binary(wheel):
    with zipfile.ZipFile(wheel) as z:
        return z.read(PLUGIN_PATH)


# ----------------------------------------------------------------------------
# The machine.


@dataclasses.dataclass
class Builder:
    op: str
    device: str
    constraints: list = dataclasses.field(default_factory=list)
    host_memory: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Registration:
    op: str
    device: str
    kernel: str
    constraints: tuple  # ((attr, dtype name), ...) in call order
    host_memory: tuple  # argument names, in call order


class Machine:
    """An arm64 process with the plugin image loaded and its imports stood in for."""

    def __init__(self, binary, responds_to_selector=True):
        import lief
        import unicorn
        from unicorn import arm64_const as A

        self.A, self.unicorn = A, unicorn
        self.responds = responds_to_selector
        image = lief.MachO.parse(list(binary)).at(0) if hasattr(lief, "MachO") else None
        if image is None:
            raise GenerationError("lief could not parse the plugin as a Mach-O")
        self.image = image
        self.uc = uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
        uc.ctl_set_cpu_model(A.UC_CPU_ARM64_MAX)  # ldapr (absl), ...
        self._map_image(binary)
        self._bind_imports()
        uc.mem_map(HEAP_BASE, HEAP_SIZE)
        uc.mem_map(STACK_BASE, STACK_SIZE)
        uc.mem_map(EXIT, 0x1000)
        uc.mem_write(EXIT, RET)
        self.heap = HEAP_BASE
        self.sizes = {}
        self.builders = {}
        self.registrations = []
        self.op_builders, self.op_defs = {}, {}
        self.unhandled = collections.Counter()
        uc.hook_add(unicorn.UC_HOOK_CODE, self._on_import, begin=IMPORT_BASE, end=IMPORT_BASE + 16 * len(self.slots))

    # -- loading ----------------------------------------------------------------------------------

    def _map_image(self, binary):
        uc, image = self.uc, self.image
        top = max(s.virtual_address + s.virtual_size for s in image.segments)
        uc.mem_map(IMAGE_BASE, (top + 0xFFFF) & ~0xFFFF)
        for seg in image.segments:
            if seg.file_size:
                uc.mem_write(IMAGE_BASE + seg.virtual_address, bytes(binary[seg.file_offset:seg.file_offset + seg.file_size]))
        rebased = 0
        for reloc in image.relocations:  # the rebase table, as lief reads it (pointer slots)
            addr = IMAGE_BASE + reloc.address
            value = struct.unpack("<Q", uc.mem_read(addr, 8))[0]
            uc.mem_write(addr, struct.pack("<Q", value + IMAGE_BASE))
            rebased += 1
        if not rebased:
            raise GenerationError("the image has no rebase entries: not the binary this script was written for")

    def _bind_imports(self):
        uc, image = self.uc, self.image
        exported = {s.name: s.value for s in image.exported_symbols}
        self.exported = exported
        functions = sorted({f.name for f in image.imported_functions})
        self.slots = functions
        self.slot_of = {name: i for i, name in enumerate(functions)}
        uc.mem_map(IMPORT_BASE, (16 * len(functions) + 0xFFF) & ~0xFFF)
        for i in range(len(functions)):
            uc.mem_write(IMPORT_BASE + 16 * i, RET)
        data_names = sorted({b.symbol.name for b in image.bindings if b.has_symbol} - set(functions) - set(exported))
        self.data = {name: DATA_BASE + 0x1000 * i for i, name in enumerate(data_names)}
        uc.mem_map(DATA_BASE, 0x1000 * max(1, len(data_names)))
        for b in image.bindings:
            if not b.has_symbol:
                continue
            name = b.symbol.name
            if name in exported and str(b.binding_class).endswith("WEAK"):
                target = IMAGE_BASE + exported[name]  # a weak definition of the image's own
            elif name in self.slot_of:
                target = IMPORT_BASE + 16 * self.slot_of[name]
            elif name in self.data:
                target = self.data[name]
            else:
                target = IMAGE_BASE + exported[name]
            uc.mem_write(IMAGE_BASE + b.address, struct.pack("<Q", target + b.addend))

    # -- memory helpers ---------------------------------------------------------------------------

    def reg(self, i):
        return self.uc.reg_read(self.A.UC_ARM64_REG_X0 + i)

    def set_reg(self, i, value):
        self.uc.reg_write(self.A.UC_ARM64_REG_X0 + i, value & 0xFFFFFFFFFFFFFFFF)

    def u64(self, addr):
        return struct.unpack("<Q", self.uc.mem_read(addr, 8))[0]

    def put64(self, addr, value):
        self.uc.mem_write(addr, struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF))

    def cstr(self, addr, limit=1 << 16):
        out = bytearray()
        while len(out) < limit:
            chunk = bytes(self.uc.mem_read(addr + len(out), 64))
            end = chunk.find(b"\0")
            if end >= 0:
                return bytes(out + chunk[:end]).decode("latin-1")
            out += chunk
        raise GenerationError(f"unterminated string at {addr:#x}")

    def malloc(self, size):
        size = max(16, (int(size) + 15) & ~15)
        addr = self.heap
        self.heap += size
        if self.heap > HEAP_BASE + HEAP_SIZE:
            raise GenerationError("the emulated heap is exhausted")
        self.sizes[addr] = size
        return addr

    # -- calls ------------------------------------------------------------------------------------

    def call(self, addr, *args):
        for i, a in enumerate(args):
            self.set_reg(i, a)
        self.uc.reg_write(self.A.UC_ARM64_REG_SP, STACK_BASE + STACK_SIZE - 0x100)
        self.uc.reg_write(self.A.UC_ARM64_REG_LR, EXIT)
        self.uc.emu_start(addr, EXIT)
        return self.reg(0)

    def _tail_call(self, addr, *args):
        """From an import's stand-in: jump to `addr` with `args`; it returns to the import's caller."""
        for i, a in enumerate(args):
            self.set_reg(i, a)
        self.uc.reg_write(self.A.UC_ARM64_REG_PC, addr)

    def _on_import(self, uc, address, size, _):
        name = self.slots[(address - IMPORT_BASE) // 16]
        key = name[1:] if name.startswith("_") else name
        handler = IMPORTS.get(key)
        if handler is None:
            self.unhandled[key] += 1
            self.set_reg(0, 0)
            return
        result = handler(self)
        if result is not None:
            self.set_reg(0, result)

    # -- the builder call sites ----------------------------------------------------------------------

    def builder_call_sites(self):
        """{address: kernel-builder function} of every ``bl`` / ``b`` in __text to one of `BUILDER_CALLS`' stubs.

        A stub is ``adrp x16, page; ldr x16, [x16, #off]; br x16``: the slot it
        loads is bound to the import it calls. A ``b`` is a tail call.
        """
        bound = {b.address: b.symbol.name.lstrip("_") for b in self.image.bindings if b.has_symbol}
        section = self.image.get_section("__stubs")
        code, base = bytes(section.content), section.virtual_address
        stubs = {}
        for i in range(0, len(code) - 11, 12):
            adrp, ldr = struct.unpack_from("<II", code, i)
            page = ((adrp >> 29) & 3 | ((adrp >> 5) & 0x7FFFF) << 2) << 12
            page -= (page & (1 << 32)) << 1  # sign of the 33-bit page offset
            slot = ((base + i) & ~0xFFF) + page + ((ldr >> 10) & 0xFFF) * 8
            if bound.get(slot) in BUILDER_CALLS:
                stubs[base + i] = bound[slot]
        text = self.image.get_section("__text")
        code, base = bytes(text.content), text.virtual_address
        sites = {}
        for off in range(0, len(code), 4):
            word = struct.unpack_from("<I", code, off)[0]
            if word & 0x7C000000 == 0x14000000:  # b / bl imm26
                imm = word & 0x3FFFFFF
                dest = base + off + (imm - ((imm & (1 << 25)) << 1)) * 4
                if dest in stubs:
                    sites[base + off] = stubs[dest]
        return sites

    def watch(self, sites):
        """Records in `self.reached` each of `sites` (image offsets) that executes."""
        self.reached = set()

        def hit(uc, address, size, _):
            self.reached.add(address - IMAGE_BASE)

        for site in sites:
            self.uc.hook_add(self.unicorn.UC_HOOK_CODE, hit, begin=IMAGE_BASE + site, end=IMAGE_BASE + site)

    def run_initializers(self):
        """Runs the static initializers; the names of those that faulted (see `EXPECTED_INIT_FAULTS`)."""
        section = self.image.get_section("__init_offsets")
        offsets = struct.unpack(f"<{section.size // 4}I", bytes(section.content))
        names = {s.value: s.name for s in self.image.symbols if s.value}
        faulted = []
        for off in offsets:
            try:
                self.call(IMAGE_BASE + off, 0, 0, 0, 0, 0)
            except self.unicorn.UcError as e:
                name = names.get(off, f"initializer at {off:#x}").lstrip("_")
                if name not in EXPECTED_INIT_FAULTS:
                    raise GenerationError(f"static initializer {name} faulted: {e}") from None
                faulted.append(name)
        return faulted

    def init_kernels(self):
        self.call(IMAGE_BASE + self.exported[ENTRY], self.malloc(64))


# ----------------------------------------------------------------------------
# The stand-ins, by (unmangled-underscore) symbol name.

IMPORTS = {}


def stand_in(*names):
    def register(fn):
        for n in names:
            IMPORTS[n] = fn
        return fn

    return register


@stand_in("_Znwm", "_Znam", "malloc")
def _new(m):
    return m.malloc(m.reg(0))


@stand_in("calloc")
def _calloc(m):
    return m.malloc(m.reg(0) * m.reg(1))


@stand_in("realloc")
def _realloc(m):
    old, size = m.reg(0), m.reg(1)
    new = m.malloc(size)
    if old:
        m.uc.mem_write(new, bytes(m.uc.mem_read(old, min(size, m.sizes.get(old, size)))))
    return new


@stand_in("_ZdlPv", "_ZdaPv", "free")
def _free(m):
    return None


@stand_in("memcpy", "memmove")
def _memcpy(m):
    dst, src, n = m.reg(0), m.reg(1), m.reg(2)
    if n:
        m.uc.mem_write(dst, bytes(m.uc.mem_read(src, n)))
    return dst


@stand_in("memset")
def _memset(m):
    dst, c, n = m.reg(0), m.reg(1), m.reg(2)
    if n:
        m.uc.mem_write(dst, bytes([c & 0xFF]) * n)
    return dst


@stand_in("bzero")
def _bzero(m):
    if m.reg(1):
        m.uc.mem_write(m.reg(0), b"\0" * m.reg(1))


@stand_in("strlen")
def _strlen(m):
    return len(m.cstr(m.reg(0)))


@stand_in("strcmp")
def _strcmp(m):
    a, b = m.cstr(m.reg(0)), m.cstr(m.reg(1))
    return (a > b) - (a < b)


@stand_in("__cxa_guard_acquire")
def _guard_acquire(m):
    return 0 if m.uc.mem_read(m.reg(0), 1)[0] else 1


@stand_in("__cxa_guard_release")
def _guard_release(m):
    m.uc.mem_write(m.reg(0), b"\1")


@stand_in("dispatch_once")
def _dispatch_once(m):
    predicate, block = m.reg(0), m.reg(1)
    if m.u64(predicate) == 0xFFFFFFFFFFFFFFFF:
        return None
    m.put64(predicate, 0xFFFFFFFFFFFFFFFF)
    m._tail_call(m.u64(block + 16), block)  # the block's invoke function, called with the block
    return None


@stand_in("_ZNSt3__111__call_onceERVmPvPFvS2_E")
def _call_once(m):
    flag, arg, fn = m.reg(0), m.reg(1), m.reg(2)
    if m.u64(flag) == 0xFFFFFFFFFFFFFFFF:
        return None
    m.put64(flag, 0xFFFFFFFFFFFFFFFF)
    m._tail_call(fn, arg)
    return None


# Objective-C: classes are opaque handles; the only question that matters is the gate.
@stand_in("NSClassFromString", "objc_alloc", "objc_opt_new")
def _objc_object(m):
    return m.malloc(64)


@stand_in("objc_msgSend")
def _objc_msgsend(m):
    selector = m.cstr(m.reg(1))
    if selector == "instancesRespondToSelector:":
        m.gate_asked = m.cstr(m.reg(2))
        return 1 if m.responds else 0
    m.unhandled["objc_msgSend " + selector] += 1  # not HARMLESS: fails the run, naming the selector
    return 0


# The kernel C API.
@stand_in("TF_NewStatus")
def _new_status(m):
    return m.malloc(16)


@stand_in("TF_GetCode")
def _get_code(m):
    return 0


@stand_in("TF_Message")
def _message(m):
    p = m.malloc(16)
    return p


@stand_in("TF_NewKernelBuilder")
def _new_builder(m):
    handle = m.malloc(16)
    m.builders[handle] = Builder(m.cstr(m.reg(0)), m.cstr(m.reg(1)))
    return handle


@stand_in("TF_KernelBuilder_TypeConstraint")
def _type_constraint(m):
    dtype = m.reg(2) & 0xFFFFFFFF
    if dtype not in TF_DTYPES:
        raise GenerationError(f"unknown TF_DataType {dtype} in a type constraint")
    m.builders[m.reg(0)].constraints.append((m.cstr(m.reg(1)), TF_DTYPES[dtype]))


@stand_in("TF_KernelBuilder_HostMemory")
def _host_memory(m):
    m.builders[m.reg(0)].host_memory.append(m.cstr(m.reg(1)))


@stand_in("TF_RegisterKernelBuilder")
def _register(m):
    b = m.builders.pop(m.reg(1))
    m.registrations.append(Registration(b.op, b.device, m.cstr(m.reg(0)), tuple(b.constraints), tuple(b.host_memory)))


@stand_in("TF_DeleteStatus")
def _delete_status(m):
    return None


# The ops the plugin defines itself (name -> its attr, input and output specs).
@stand_in("TF_NewOpDefinitionBuilder")
def _new_op(m):
    handle = m.malloc(16)
    m.op_builders[handle] = (m.cstr(m.reg(0)), [])
    return handle


@stand_in("TF_OpDefinitionBuilderAddAttr", "TF_OpDefinitionBuilderAddInput", "TF_OpDefinitionBuilderAddOutput")
def _op_spec(m):
    m.op_builders[m.reg(0)][1].append(m.cstr(m.reg(1)))


@stand_in("TF_RegisterOpDefinition")
def _register_op(m):
    name, specs = m.op_builders.pop(m.reg(0))
    m.op_defs[name] = tuple(specs)


# ----------------------------------------------------------------------------
# Running it.


def run(binary, responds_to_selector, sites=None):
    m = Machine(binary, responds_to_selector=responds_to_selector)
    m.gate_asked = None
    if sites is not None:
        m.watch(sites)
    faulted = m.run_initializers()
    m.init_kernels()
    if m.builders:
        raise GenerationError(f"{len(m.builders)} kernel builder(s) were made and never registered")
    bad = sorted(k for k in m.unhandled if not k.startswith(HARMLESS))
    if bad:
        raise GenerationError("imports without a stand-in ran during registration: " + ", ".join(bad))
    devices = {r.device for r in m.registrations}
    if devices != {"GPU"}:
        raise GenerationError(f"registrations for devices other than GPU: {sorted(devices)}")
    return m, faulted


def read_wheel(binary):
    """Runs the registration with and without the gate: a dict of everything the table records."""
    sites = Machine(binary).builder_call_sites()
    if not sites:
        raise GenerationError("no call site of the kernel-builder API was found: not the binary this script reads")
    on, faulted = run(binary, True, sites)
    off, _ = run(binary, False, sites)
    unreached = sorted(set(sites) - on.reached - off.reached)
    if unreached:
        raise GenerationError(f"{len(unreached)} of {len(sites)} kernel-builder call sites never ran, e.g. "
                              + ", ".join(f"{sites[a]} at {a:#x}" for a in unreached[:5]))
    if on.gate_asked is None:
        raise GenerationError("the MPSGraph selector check never ran: the gate this script models is gone")
    only_off = collections.Counter(off.registrations) - collections.Counter(on.registrations)
    if only_off:
        raise GenerationError(f"registrations made only without the gate: {sorted(only_off)[:5]}")
    gated = collections.Counter(on.registrations) - collections.Counter(off.registrations)
    rows, left = [], collections.Counter(gated)
    for r in on.registrations:  # in registration order; the gated ones marked
        needs_gate = left[r] > 0
        if needs_gate:
            left[r] -= 1
        rows.append((r.op, r.kernel, r.constraints, r.host_memory, needs_gate))
    per_call = collections.Counter(sites.values())
    return {
        "registrations": rows, "gate_selector": on.gate_asked, "call_sites": dict(sorted(per_call.items())), "op_defs": dict(sorted(on.op_defs.items())),
        "faulted": faulted, "unhandled": dict(on.unhandled),
    }


def derive(rows):
    """KERNELS, DTYPE_ATTR, GATED_KERNELS, HOST_MEMORY from the registration rows (checked for consistency)."""
    attr_of, dtypes, gated_dtypes, ungated_dtypes = {}, collections.defaultdict(set), collections.defaultdict(set), collections.defaultdict(set)
    host = collections.defaultdict(dict)
    for op, _kernel, constraints, host_memory, needs_gate in rows:
        attr, dtype = constraints[0] if constraints else (None, "")
        if attr_of.setdefault(op, attr) != attr:
            raise GenerationError(f"{op} is registered with different first type attrs: {attr_of[op]} and {attr}")
        if dtype:
            dtypes[op].add(dtype)
        else:
            dtypes[op]
        (gated_dtypes if needs_gate else ungated_dtypes)[op].add(dtype)
        seen = host[op].setdefault(dtype, tuple(host_memory))
        if set(seen) != set(host_memory):
            raise GenerationError(f"{op} ({dtype or 'no constraint'}) keeps different arguments in host memory "
                                  f"across its registrations: {seen} and {host_memory}")
    kernels = {op: tuple(sorted(d)) for op, d in sorted(dtypes.items())}
    attrs = {op: a for op, a in sorted(attr_of.items()) if a not in ("T", None)}
    gated = {}
    for op, ds in sorted(gated_dtypes.items()):
        only = tuple(sorted(d for d in ds if d not in ungated_dtypes.get(op, ())))
        if only:
            gated[op] = only
    host_memory = {op: {d: tuple(sorted(a)) for d, a in sorted(by.items()) if a}
                   for op, by in sorted(host.items()) if any(by.values())}
    return kernels, attrs, gated, host_memory


_TF_SNIPPET = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
import gen_metal_plugin_kernels as g
print(json.dumps({"cuda": tf.test.is_built_with_cuda(), "kernels": g.tf_default_kernels(sys.argv[2])}))
"""


class CudaBuild(GenerationError):
    """The TensorFlow at hand is a CUDA build, whose DEVICE_DEFAULT kernels are not macOS's."""


def tf_default_kernels(tf_python=None):
    """TensorFlow TF_VERSION's DEVICE_DEFAULT kernels, read by `tf_python` (an interpreter that has it).

    Read from a build without CUDA, as TensorFlow's macOS wheels are: a CUDA
    build registers more DEVICE_DEFAULT kernels (int32 ``ScatterNd``,
    ``Sum``, ... under its GPU build flags), which a Mac does not have. On
    Linux that is ``tensorflow-cpu``; the ``tensorflow`` wheel raises `CudaBuild`.
    """
    done = subprocess.run([tf_python or sys.executable, "-c", _TF_SNIPPET, str(REPO / "scripts"), TF_VERSION],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise GenerationError(f"TF_DEFAULT_KERNELS need TensorFlow {TF_VERSION} (--tf-python):\n"
                              + done.stderr.strip().splitlines()[-1])
    read = json.loads(done.stdout.strip().splitlines()[-1])
    if read["cuda"]:
        raise CudaBuild(f"TF_DEFAULT_KERNELS are read from a TensorFlow {TF_VERSION} built without CUDA, as macOS's "
                        f"is (pip install tensorflow-cpu=={TF_VERSION}); this one is a CUDA build")
    return {op: tuple(d) for op, d in read["kernels"].items()}


HEADER = '''"""GENERATED by scripts/gen_metal_kernels.py -- do not edit.

The kernels Apple's tensorflow-metal {pin} registers for its GPU device, read
from its wheel ({wheel}, sha256 {sha}, MIT license) by running
the plugin's own TF_InitKernel on an arm64 emulator against recording
stand-ins of TF's kernel-builder C API; see the script's docstring. Names and
dtypes only: none of the plugin's code.

Rerun when the pin moves:  python scripts/gen_metal_kernels.py
Check it is current:       python scripts/gen_metal_kernels.py --check

REGISTRATIONS: every registration, in the order TF_InitKernel makes them,
on device "GPU": (op, kernel name, ((type attr, dtype), ...), (arguments in
host memory, ...), registered only when GATE holds).
KERNELS: op -> dtypes of its first type constraint (``T`` unless DTYPE_ATTR
names another attr), with GATE met. An empty tuple: no type constraint.
GATED_KERNELS: op -> dtypes registered only when GATE holds.
HOST_MEMORY: op -> {{dtype of KERNELS: arguments the kernel keeps in host memory}}.
OP_DEFINITIONS: the ops the plugin defines itself (TF_RegisterOpDefinition).
TF_DEFAULT_KERNELS: TensorFlow {tf}'s own DEVICE_DEFAULT kernels (any device,
the plugin's included): op -> dtypes of their T/dtype constraint.
"""

'''
_DEFAULTS_MARK = "TF_DEFAULT_KERNELS = "


def render(read, defaults):
    rows = read["registrations"]
    kernels, attrs, gated, host_memory = derive(rows)
    n_gated = sum(r[4] for r in rows)
    macos12_ops = {op for op, _k, _c, _h, g in rows if not g}
    body = [
        HEADER.format(pin=PIN, wheel=WHEEL, sha=WHEEL_SHA256, tf=TF_VERSION),
        f"PIN = {PIN!r}",
        f"WHEEL = {WHEEL!r}",
        f"WHEEL_SHA256 = {WHEEL_SHA256!r}",
        f"TF_VERSION = {TF_VERSION!r}",
        "DEVICE = 'GPU'",
        f"GATE = {GATE_LABEL!r}",
        f"GATE_SELECTOR = {read['gate_selector']!r}",
        f"GATE_MIN_MACOS = {GATE_MIN_MACOS!r}",
        f"# {len(rows)} registrations of {len(kernels)} ops with GATE met; without it "
        f"{len(rows) - n_gated} of {len(macos12_ops)} ops.",
        "# Call sites of the kernel-builder API in the binary, every one of which ran: "
        + ", ".join(f"{n} {name}" for name, n in read["call_sites"].items()) + ".",
        "",
        "OP_DEFINITIONS = " + pprint.pformat(read["op_defs"], width=110),
        "",
        "REGISTRATIONS = (\n" + "".join(f"    {r!r},\n" for r in rows) + ")",
        "",
        "KERNELS = " + pprint.pformat(kernels, width=110, sort_dicts=True),
        "",
        "DTYPE_ATTR = " + pprint.pformat(attrs, width=110, sort_dicts=True),
        "",
        "GATED_KERNELS = " + pprint.pformat(gated, width=110, sort_dicts=True),
        "",
        "HOST_MEMORY = " + pprint.pformat(host_memory, width=110, sort_dicts=True),
        "",
        _DEFAULTS_MARK + pprint.pformat(defaults, width=110, sort_dicts=True),
        "",
    ]
    return "\n".join(body)


def _installed_tf():
    from importlib import metadata

    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-macos"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed module is stale")
    parser.add_argument("--dump", action="store_true", help="print every registration as JSON lines")
    parser.add_argument("--tf-python", help=f"an interpreter with TensorFlow {TF_VERSION} (TF_DEFAULT_KERNELS)")
    parser.add_argument("--module", type=pathlib.Path, default=OUTPUT, help="the module to write or check")
    args = parser.parse_args(argv)
    output = args.module
    try:
        read = read_wheel(plugin_binary(fetch_wheel()))
        if args.dump:
            for r in read["registrations"]:
                print(json.dumps(r))
            return 0
        current = output.read_text() if output.exists() else ""
        defaults, partial = None, f"TensorFlow {TF_VERSION} is not installed"
        if args.tf_python or _installed_tf() == TF_VERSION:
            try:
                defaults, partial = tf_default_kernels(args.tf_python), None
            except CudaBuild as e:
                if not args.check:
                    raise
                partial = str(e)
        if partial and not (args.check and _DEFAULTS_MARK in current):
            raise GenerationError(f"TF_DEFAULT_KERNELS need TensorFlow {TF_VERSION} without CUDA: pass --tf-python")
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = render(read, defaults or {})
    if args.check:
        ours, theirs = text, current
        if partial:  # TensorFlow TF_VERSION is not here: check everything read from the wheel
            ours, theirs = text.split(_DEFAULTS_MARK)[0], current.split(_DEFAULTS_MARK)[0]
        if ours != theirs:
            import difflib

            sys.stdout.writelines(difflib.unified_diff(theirs.splitlines(True), ours.splitlines(True),
                                                       str(output), "generated", n=1))
            print(f"{output} is out of date: rerun python scripts/gen_metal_kernels.py")
            return 1
        what = f" (TF_DEFAULT_KERNELS not checked: {partial})" if partial else ""
        print(f"{output} is current{what}")
        return 0
    output.write_text(text)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
