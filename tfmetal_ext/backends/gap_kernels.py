"""Gap kernels: GPU kernels our op library registers for *standard* TensorFlow ops, where a Metal backend has none.

An op with no GPU kernel runs on the CPU: every use is a GPU -> CPU -> GPU
round trip with a synchronisation (REFERENCE.md sections 4 and 7). Ordinary
Keras train steps have several (`tfmetal_ext.backends.gaps.TRAIN_STEP_OPS`).
Our library carries Metal kernels for them (``custom_ops/metal/gap_*``) and
registers each one **exactly where the loaded backend's kernel table has no
kernel for that op and dtype**: TensorFlow fails an op whose node matches two
registrations, so a kernel the backend already has is never registered again.

This module is the one home of that decision:

* `GAP_KERNELS`: what our library implements, per op: the dtypes of its
  primary type attribute, the other type attributes it accepts (registered as
  the cross product), and the arguments it keeps in host memory.
* `plan(table, macos)`: one `GapRow` per implemented (op, dtype) on one
  backend table, registered or not, with the reason. The op loader
  (`tfmetal_ext.ops._loader`) hands the registered rows to the Metal host
  code as text (`plan_text`, environment variable `PLAN_ENV`) before the
  library loads; the host code registers what the text lists and nothing
  else. `placement_report(..., predict_for=...)` reads the same rows
  (`covers`), and `tfmetal_ext.ops.status()` reports them.

A backend table vouches for one release of its plugin (`TABLE_RELEASES`).
With any other release installed nothing is registered: a kernel it gained
would be a duplicate.
"""

from __future__ import annotations

import dataclasses
import os
import types

# The environment variable carrying the plan to the Metal host code
# (custom_ops/metal/gap_plan.h parses it).
PLAN_ENV = "TFMETAL_EXT_GAP_KERNELS"
# Set to 0 to register no gap kernel at all.
ENABLE_ENV = "TFMETAL_EXT_GAP_KERNELS_ENABLE"

FLOATS = ("float32", "float16", "bfloat16")
INDICES = ("int32", "int64")


@dataclasses.dataclass(frozen=True)
class GapKernel:
    """One standard op our library has a Metal kernel for.

    Attributes:
        op: the TensorFlow op name.
        dtypes: dtypes of `dtype_attr` the kernel is instantiated for.
        dtype_attr: the type attribute the plan decides on (the one the
            backend tables list dtypes of: ``T``, ``dtype``, ``Tseed``).
        other_attrs: other type attributes -> the dtypes accepted for each
            (every combination is registered).
        host_memory: argument names (as in the op's OpDef) the kernel keeps
            in host memory; TensorFlow copies them there.
        string_attrs: string attributes -> the values the kernel takes
            (Einsum's ``equation``). Registered as an allowed-values
            constraint: TensorFlow matches the kernel only to nodes with one
            of them, and places every other node on the CPU (its own kernel).
        family: the ``custom_ops/metal/<family>.metal`` / ``<family>_metal.mm``
            holding the kernel.
        note: what the kernel does differently from TensorFlow's CPU kernel,
            if anything (documented agreement).
    """

    op: str
    dtypes: tuple
    family: str
    dtype_attr: str = "T"
    other_attrs: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    host_memory: tuple = ()
    note: str = ""
    string_attrs: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        for name in ("other_attrs", "string_attrs"):
            if not isinstance(getattr(self, name), types.MappingProxyType):
                object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))

    def refusal(self, strings):
        """Why this kernel does not take a node with string attributes `strings` (``{"equation": ...}``), or None."""
        for attr, allowed in self.string_attrs.items():
            value = strings.get(attr)
            if value not in allowed:
                return f"{self.op}'s tfmetal_ext gap kernel takes only its {len(allowed)} listed {attr}s, not {value!r}"
        return None


def _k(op, dtypes, family, **kw):
    return op, GapKernel(op, tuple(dtypes), family, **kw)


# op -> GapKernel: what custom_ops/metal/gap_*_metal.mm implement.
GAP_KERNELS = types.MappingProxyType(
    dict(
        [
            _k("DivNoNan", FLOATS, "gap_broadcast"),
            _k("BroadcastTo", FLOATS + ("bool",), "gap_broadcast", other_attrs={"Tidx": INDICES},
               host_memory=("shape",)),
            _k("Pack", FLOATS + ("bool",), "gap_stack"),
            _k("Unpack", FLOATS + ("bool",), "gap_stack"),
            _k("UnsortedSegmentSum", FLOATS, "gap_segment",
               other_attrs={"Tindices": INDICES, "Tnumsegments": INDICES},
               host_memory=("segment_ids", "num_segments"),
               note="segment_ids in host memory: checked with TF's errors and sorted on the host (an Embedding's "
                    "int32 ids are there already; custom_ops/include/tfmetal/gap_segment.h); fewer than 2^32 rows, "
                    "segments and columns"),
            *(_k(op, ("int64",), "gap_int") for op in ("AddV2", "Sub", "Mul", "Maximum", "Minimum", "Equal",
                                                        "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual")),
            _k("FloorMod", ("int64",), "gap_int", host_memory=("y",),
               note="the divisor in host memory, so a zero divisor is TF's error before the GPU runs"),
            _k("All", ("int32", "int64"), "gap_int", dtype_attr="Tidx", host_memory=("reduction_indices",)),
            _k("Any", ("int32", "int64"), "gap_int", dtype_attr="Tidx", host_memory=("reduction_indices",)),
            _k("IsFinite", FLOATS, "gap_elementwise"),
            _k("Sigmoid", FLOATS, "gap_elementwise"),
            _k("SigmoidGrad", FLOATS, "gap_elementwise"),
            _k("Elu", FLOATS, "gap_elementwise"),
            _k("EluGrad", FLOATS, "gap_elementwise"),
            _k("ZerosLike", FLOATS, "gap_elementwise"),
            _k("OnesLike", FLOATS, "gap_elementwise"),
            _k("Fill", FLOATS + ("bool",), "gap_elementwise", other_attrs={"index_type": INDICES},
               host_memory=("dims", "value")),
            _k("StatelessRandomGetKeyCounter", INDICES, "gap_random", dtype_attr="Tseed",
               host_memory=("seed", "key", "counter")),
            _k("StatelessRandomUniformV2", FLOATS, "gap_random", dtype_attr="dtype", other_attrs={"Tshape": INDICES},
               host_memory=("shape", "key", "counter", "alg"),
               note="Philox (alg 1, and auto-select 3) only, as TF's CPU kernel; a counter must have 2 words"),
        ]
    )
)


def _table_releases():
    from tfmetal_ext.backends import _metal_kernels, _metal_plugin_kernels

    return types.MappingProxyType({
        "metal": ("tensorflow-metal", _metal_kernels.PIN),
        "metal_plugin": ("tensorflow-metal-plugin", _metal_plugin_kernels.PIN),
    })


# table key -> (distribution, the release its kernel table was generated from).
TABLE_RELEASES = _table_releases()


@dataclasses.dataclass(frozen=True)
class GapRow:
    """One implemented (op, dtype) on one backend: registered or not, and why."""

    op: str
    dtype: str
    registered: bool
    reason: str

    @property
    def key(self):
        """``"DivNoNan[float16]"``: how the Metal host code records it."""
        return f"{self.op}[{self.dtype}]"


def parse_macos(macos):
    """A macOS version tuple from ``"13.4"`` / ``(13, 4)`` / None."""
    if macos is None or isinstance(macos, tuple):
        return macos
    try:
        return tuple(int(p) for p in str(macos).split(".") if p != "")
    except ValueError:
        raise ValueError(f"macos must look like '13.4'. Received: macos={macos!r}") from None


def plan(table, macos=None, installed=None, enabled=None):
    """The gap-kernel rows of backend `table` (a `Backend` or its key): one `GapRow` per `GAP_KERNELS` (op, dtype).

    Args:
        table: a Metal backend table (``"metal"`` or ``"metal_plugin"``), or
            any other table (nothing is registered there: every CPU and CUDA
            build of TensorFlow has these kernels).
        macos: the user's macOS (``"13.4"`` or a tuple; None: the table's
            gate is taken as met).
        installed: the installed version of the table's plugin; None: taken
            to be the release the table was generated from.
        enabled: False registers nothing (None: unless ``$TFMETAL_EXT_GAP_KERNELS_ENABLE`` is ``0``).
    """
    from tfmetal_ext.backends import registry

    if isinstance(table, str):
        table = registry.table(table)
    macos = parse_macos(macos)
    if enabled is None:
        enabled = os.environ.get(ENABLE_ENV, "1") != "0"
    release = TABLE_RELEASES.get(table.key)
    rows = []
    for kernel in GAP_KERNELS.values():
        for dtype in kernel.dtypes:
            rows.append(_row(table, kernel, dtype, macos, installed, release, enabled))
    return tuple(rows)


def _row(table, kernel, dtype, macos, installed, release, enabled):
    op = kernel.op
    if release is None:
        return GapRow(op, dtype, False, f"{table.label} is not a Metal backend: TensorFlow has its own kernel")
    if not enabled:
        return GapRow(op, dtype, False, f"gap kernels are turned off ({ENABLE_ENV}=0)")
    dist, pin = release
    if installed is not None and installed != pin:
        return GapRow(op, dtype, False, f"{dist} {installed} is installed; its kernel table was read from {pin}, "
                                        "so a kernel it gained could be registered twice (TensorFlow then fails "
                                        "the op)")
    has = table.has_kernel(op, dtype, macos=macos)
    if has is True:
        return GapRow(op, dtype, False, f"{table.label} has its own kernel")
    if has is None:
        return GapRow(op, dtype, False, f"{table.label}'s table does not say whether it has a kernel")
    return GapRow(op, dtype, True, f"{table.label} has no kernel: tfmetal_ext gap kernel")


def registered(rows):
    """``{op: dtypes}`` of the registered rows."""
    out = {}
    for r in rows:
        if r.registered:
            out.setdefault(r.op, []).append(r.dtype)
    return {op: tuple(d) for op, d in out.items()}


def plan_text(backend, rows):
    """The text the Metal host code reads (custom_ops/metal/gap_plan.h).

    Line 1 is the backend's distribution name; then one line per op with
    registered rows: ``<op>|<dtype_attr>=<d>,<d>|<attr>=<d>,<d>|string:<attr>=<v>,<v>|host=<arg>,<arg>``
    (dtype names as Python spells them: ``float32``, ``float16``,
    ``bfloat16``, ``bool``, ``int32``, ``int64``; string values escaped by
    `escape`).
    """
    lines = [backend]
    for op, dtypes in registered(rows).items():
        kernel = GAP_KERNELS[op]
        fields = [op, f"{kernel.dtype_attr}={','.join(dtypes)}"]
        fields += [f"{attr}={','.join(ds)}" for attr, ds in kernel.other_attrs.items()]
        fields += [f"string:{attr}={','.join(escape(v) for v in vs)}" for attr, vs in kernel.string_attrs.items()]
        if kernel.host_memory:
            fields.append("host=" + ",".join(kernel.host_memory))
        lines.append("|".join(fields))
    return "\n".join(lines) + "\n"


def escape(value):
    """`value` as the plan text carries a string: every byte outside ``[A-Za-z0-9_]`` as ``%XX``."""
    return "".join(chr(b) if chr(b).isascii() and (chr(b).isalnum() or b == 0x5F) else f"%{b:02X}"
                   for b in value.encode())


def covers(table, op, attrs, macos=None, enabled=None, strings=None):
    """Whether our gap kernel runs a node of `op` with type attributes `attrs` (``{"T": "float16", ...}``) on `table`.

    The plan's row for the node's `GapKernel.dtype_attr` dtype must be
    registered, each of its other type attributes within the kernel's, and
    each of its string attributes (`strings`, ``{"equation": "ab,bc->ac"}``)
    one the kernel takes (`GapKernel.string_attrs`).
    """
    kernel = GAP_KERNELS.get(op)
    if kernel is None or kernel.dtype_attr not in attrs:
        return False
    if kernel.refusal(strings or {}) is not None:
        return False
    if any(attrs.get(attr) not in dtypes for attr, dtypes in kernel.other_attrs.items() if attr in attrs):
        return False
    dtype = attrs[kernel.dtype_attr]
    if dtype not in kernel.dtypes:
        return False
    if enabled is None:
        enabled = os.environ.get(ENABLE_ENV, "1") != "0"
    return _row(table, kernel, dtype, parse_macos(macos), None, TABLE_RELEASES.get(table.key), enabled).registered


def for_this_process():
    """``(table key, distribution, rows)`` for the Metal backend installed here, or None without exactly one.

    Reads package metadata and the macOS version only (nothing is imported
    or loaded): the plan the op loader hands to the Metal host code.
    """
    from tfmetal_ext import devices

    installed = devices._metal_plugins()
    if len(installed) != 1:
        return None
    (dist, version), = installed.items()
    key = next((k for k, (d, _) in TABLE_RELEASES.items() if d == dist), None)
    if key is None:
        return None
    rows = plan(key, macos=devices._macos_version(), installed=version)
    return key, dist, rows


def summary(table, macos=None):
    """One line: the ops our gap kernels give a GPU kernel on `table`, grouped by the dtypes registered.

    README's "What runs on the CPU on your Mac" section prints this line per
    Metal backend (tests/test_readme_backends.py keeps it equal).
    """
    if isinstance(table, str):
        from tfmetal_ext.backends import registry

        table = registry.table(table)
    groups = {}
    for op, dtypes in registered(plan(table, macos=macos, enabled=True)).items():
        groups.setdefault(dtypes, []).append(op)
    parts = [f"{', '.join(f'`{op}`' for op in sorted(ops))} {'/'.join(dtypes)}"
             for dtypes, ops in sorted(groups.items(), key=lambda kv: (-len(kv[0]), kv[0]))]
    return "; ".join(parts) if parts else "none: it has a kernel for each of them"
