"""Predicted placement: which ops of a step would have no kernel on a Metal backend that is not here.

`tfmetal_ext.inspect.placement_report(model, predict_for="tensorflow-metal-plugin")`
traces the step (never runs it) as it would be traced on that backend, then
reads every compute op of the traced graph against the backend's kernel
table (`tfmetal_ext.backends`).

What the prediction assumes (the report's header and notes say so):

* The graph is the one TensorFlow traces, before grappler. Of grappler's
  rewrites, only the contraction fusions that matter for kernels are applied:
  a Conv2D / MatMul + BiasAdd [+ activation] chain that the backend table's
  ``conv2d_bias_act`` / ``matmul_bias_act`` row fuses for its dtype is judged
  as the fused op (``_FusedConv2D`` / ``_FusedMatMul``), and its parts are not.
  A chain the row does not fuse (bfloat16 on both Metal backends) is judged op
  by op. Layout, constant folding and other rewrites are not modelled.
* An op may run on the device through TensorFlow's own device-independent
  (``DEFAULT``) kernels: the table's `Backend.shared_kernels` where it records
  them (the open plugin's, generated for its pinned TF), else this
  TensorFlow's kernel registry. TensorFlow's ``GPU`` registrations on this
  host are CUDA kernels and do not count on a Mac.
* Where no device kernel exists: "falls back to the CPU" when this
  TensorFlow has a CPU kernel for the op's dtypes, "fails" when it has none
  either (``CudnnRNNV3``). Ops the backend's source has but does not register
  on this TensorFlow run on the host (`Backend.host_ops`, with the reason).
* int32 ops without a device kernel are listed apart (`INT32_HOST`): TensorFlow
  keeps int32 tensors in host memory on every GPU, so running them on the
  CPU costs nothing a GPU kernel would have saved.
* "unknown": the table does not know the op. Both Metal tables are complete
  (`Backend.kernels_complete`): the open plugin's is generated from its
  source, Apple's from its wheel (``scripts/gen_metal_kernels.py``), so an op
  is unknown only for a table that records facts alone.
* The user's macOS: Apple's tensorflow-metal registers ten stateless-random
  ops only on macOS 13 or later (`Backend.gate`). The prediction uses the
  `macos` it is given, else this Mac's version, else (not on a Mac) the
  assumed Mac of `tfmetal_ext.devices.assume_backend`, and says which in a note.
* Our gap kernels (`tfmetal_ext.backends.gap_kernels`): where the backend
  has no kernel for an op and dtype that our op library registers one for
  (the same plan the library follows when it loads), the op runs on the
  device ("tfmetal_ext gap kernel", `GAP`), with the host-memory arguments
  our kernel declares. ``gap_kernels=False`` predicts the backend alone (a
  process that never imported tfmetal_ext).
* Nodes that never run are not read: TensorFlow prunes a function's body
  when it instantiates it (``PruneFunctionBody`` in
  ``tensorflow/core/common_runtime/function_utils.cc``), keeping only what
  the function's results, control outputs, stateful ops and v1 control
  flow need. The gradient tape's zeros for an output nobody differentiates
  (the ``ZerosLike`` of a cuDNN LSTM's reserve space) are such nodes; so is
  every node of a library function that only pruned nodes call
  (`live_nodes`).
* Ops that compute nothing a kernel table speaks of are skipped
  (`PLUMBING_OPS`: arguments, constants, identities, variable handles and
  reads, functional control flow and its v1 loop ops, the input iterator).
* Memory and transfers (`tfmetal_ext.inspect.transfers`, which has the
  rules): an op that reads host memory on the device is not a fallback. A
  data edge between an op writing host memory and one reading device memory
  (or the reverse) is a transfer, and the report counts them per step
  (`PredictedPlacementReport.transfers`). Nodes without a device kernel run
  on the CPU (`FALLBACK`, `INT32_HOST`, and `HOST` unless TensorFlow's
  ``DEFAULT`` kernel runs it on the device), where every tensor is in host
  memory. On the device, a kernel's host-memory arguments come from the
  table's own kernel where it records them (`Backend.host_memory_args`),
  else from this TensorFlow's ``DEFAULT`` kernel. Where neither declares
  anything, int32 is taken to live on the host. Resource and string
  tensors always do. The edges of ops that fail or that the table does not
  know are not judged (a note counts them). So are edges to or from
  arguments, constants and function calls, so the input batch's copy is not
  counted. A node in a loop body counts once.

Thread safety: the trace patches Keras' GPU probes (see `keras_gpu_branches`)
and `tfmetal_ext.devices.assume_backend` changes what this package sees, both
process-wide: a prediction holds a lock, but other threads tracing at the same
time see a GPU and the assumed backend. Predict from one thread.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import re
import threading

from tfmetal_ext import backends, devices
from tfmetal_ext.backends import PREDICT, TRAIN, fusion, gap_kernels
from tfmetal_ext.inspect import transfers
from tfmetal_ext.inspect.report import EXPECTED_HOST_OPS, NON_COMPUTE_OPS, FallbackNode, PlacementReport

# What each listed op would do.
FALLBACK = "falls back to the CPU"
FAILS = "fails"
HOST = "runs on the host"
INT32_HOST = "int32 on the host"
UNKNOWN = "unknown"
GAP = "tfmetal_ext gap kernel"
OUTCOMES = (FAILS, FALLBACK, HOST, INT32_HOST, UNKNOWN, GAP)
# An int32 op the backend has no kernel for runs on the CPU, but TensorFlow computes int32 (shape
# arithmetic) on the host on every GPU: its own GPU kernels for int32 keep it in host memory. Such ops
# are listed apart (`int32_host`), not as missing kernels.
_HOST_DTYPES = ("int32",)

# Ops skipped: nothing a kernel table speaks of (graph arguments, constants, identities, variable
# handles and reads, functional control flow whose bodies are read as functions, v1 loop plumbing).
PLUMBING_OPS = NON_COMPUTE_OPS | EXPECTED_HOST_OPS | frozenset(
    {
        "Placeholder", "PlaceholderWithDefault", "IdentityN", "ReadVariableOp", "VarHandleOp",
        "VarIsInitializedOp", "DestroyResourceOp", "While", "StatelessWhile", "If", "StatelessIf", "Case",
        "StatelessCase", "PartitionedCall", "StatefulPartitionedCall", "Enter", "Exit", "Merge", "Switch",
        "NextIteration", "LoopCond", "ControlTrigger",
    }
)

# The contraction chains grappler fuses (TF's remapper; on the open plugin, its graph pass too):
# contraction op -> (backend table pattern, fused op).
_CHAINS = {
    "Conv2D": ("conv2d_bias_act", fusion.FUSED_CONV2D),
    "MatMul": ("matmul_bias_act", fusion.FUSED_MATMUL),
}

_LOCK = threading.Lock()


# ----------------------------------------------------------------------------
# Keras' own GPU-only branches.


@contextlib.contextmanager
def keras_gpu_branches():
    """Within this context, Keras' TF backend traces as if a GPU were present.

    Keras decides on a GPU in two places of its traced code (Keras 3.15,
    ``keras/src/backend/tensorflow``): ``rnn._is_gpu_available()``
    (``tf.config.list_logical_devices("GPU")``), read by ``rnn.cudnn_ok``,
    which makes `keras.layers.LSTM` / `GRU` emit ``CudnnRNNV3``; and
    ``nn._cpu_only()``, which transposes channels-first 1-D depthwise and
    separable convolutions on a CPU-only host. Exactly those two module
    functions are replaced (and put back on exit); a Keras without them is
    left alone. Process-wide: not thread-safe (see the module docstring).
    """
    patches = []
    # By module path: the package ``keras.src.backend.tensorflow`` re-exports a function named `rnn`.
    try:
        keras_rnn = importlib.import_module("keras.src.backend.tensorflow.rnn")
        keras_nn = importlib.import_module("keras.src.backend.tensorflow.nn")
    except ImportError:  # another Keras layout: its GPU branches are not known here
        keras_nn = keras_rnn = None
    for module, name, value in ((keras_rnn, "_is_gpu_available", True), (keras_nn, "_cpu_only", False)):
        if module is not None and callable(getattr(module, name, None)):
            patches.append((module, name, getattr(module, name)))
            setattr(module, name, functools.partial(lambda v: v, value))
    try:
        yield
    finally:
        for module, name, original in reversed(patches):
            setattr(module, name, original)


# ----------------------------------------------------------------------------
# The report.

# How a row without a layer, optimizer or loss scope reads: Keras' own step (loss scaling,
# metrics, the loss gradient's broadcast).
_NO_LAYER = "(step)"
# How many kinds of transfer the printed report lists.
_TOP_TRANSFERS = 8


@dataclasses.dataclass
class PredictedOp:
    """One kind of op predicted to have no kernel on the backend (identical nodes counted once).

    Attributes:
        op: the op type.
        dtype: the dtype it was judged for (None: the node has no type attribute).
        layer: the layer path it belongs to, ``"optimizer <name>"`` for the
            optimizer's update ops, or None.
        outcome: `FALLBACK`, `FAILS`, `HOST` or `UNKNOWN`.
        reason: why (the host reason, the missing kernel).
        count: how many such nodes the step has.
        name: one node's name.
    """

    op: str
    dtype: str | None
    layer: str | None
    outcome: str
    reason: str
    count: int = 1
    name: str = ""


@dataclasses.dataclass
class PredictedPlacementReport(PlacementReport):
    """Predicted placement of one step on a Metal backend (see `tfmetal_ext.inspect.predict`).

    A `PlacementReport` whose `fallbacks` are the ops that would not run on
    the GPU (falling back, failing or running on the host), so
    `assert_no_cpu_fallback` works on it.

    Attributes:
        predicted_for: the plugin distribution predicted for.
        table: the backend table's key.
        table_complete: the table lists every kernel (else "unknown" rows).
        entries: one `PredictedOp` per kind of op without a known kernel.
        transfers: one `PredictedTransfer` per kind of data edge between
            host and device memory (`tfmetal_ext.inspect.transfers`), most
            frequent first.
        transfer_count: the step's transfers: data edges whose producer
            writes one memory and whose consumer reads the other (a node in
            a loop body counted once).
        transfer_copies: the copies TensorFlow makes for them (one per tensor
            and destination, however many ops read it).
        notes (inherited): what the prediction assumed or noticed.
    """

    predicted_for: str = ""
    table: str = ""
    table_complete: bool = False
    entries: list = dataclasses.field(default_factory=list)
    transfers: list = dataclasses.field(default_factory=list)
    transfer_count: int = 0
    transfer_copies: int = 0

    def _with(self, *outcomes):
        return [e for e in self.entries if e.outcome in outcomes]

    @property
    def missing(self):
        """Ops with no kernel on the device: they fall back, fail or run on the host."""
        return self._with(FAILS, FALLBACK, HOST)

    @property
    def fails(self):
        """Ops with no kernel on the device and none on the CPU either: the step fails."""
        return self._with(FAILS)

    @property
    def cpu_fallback(self):
        """Ops that fall back to TensorFlow's CPU kernels."""
        return self._with(FALLBACK)

    @property
    def host(self):
        """Ops the backend's source has but does not register on this TensorFlow (`Backend.host_ops`)."""
        return self._with(HOST)

    @property
    def int32_host(self):
        """int32 ops without a device kernel: host arithmetic, as on every GPU (not missing kernels)."""
        return self._with(INT32_HOST)

    @property
    def gap_kernels(self):
        """Ops the backend has no kernel for that run on the device through tfmetal_ext's gap kernels."""
        return self._with(GAP)

    @property
    def unknown(self):
        """Ops the table does not know (only a table that records known facts alone has them)."""
        return self._with(UNKNOWN)

    def to_dict(self):
        out = dataclasses.asdict(self)
        out["missing"] = [dataclasses.asdict(e) for e in self.missing]
        return out

    def _transfer_lines(self, top=_TOP_TRANSFERS):
        n = self.transfer_count
        head = f"  {n} transfer{'' if n == 1 else 's'} per step between host and device memory"
        if not n:
            return [head]
        lines = [head + f" ({self.transfer_copies} tensor cop{'y' if self.transfer_copies == 1 else 'ies'}):"]
        rows = [(f"{t.producer} -> {t.consumer}", t.direction, t.layer or _NO_LAYER, f"x{t.count}")
                for t in self.transfers[:top]]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.transfers) > top:
            rest = self.transfers[top:]
            lines.append(f"    ... and {len(rest)} more kind(s), {sum(t.count for t in rest)} transfer(s)")
        return lines

    def __str__(self):
        label = backends.table(self.table).label if self.table in backends.TABLES else self.table
        head = f"Predicted placement ({self.mode}) on {self.predicted_for}, traced here, not run (kernel table "
        head += f"{label!r}: complete, generated from the backend's own registrations)" if self.table_complete else (
            f"{label!r}: known facts only, so an op it does not list is unknown, not missing)")
        lines = [head]
        if not self.missing:
            lines.append("  every op has a kernel on the device" + (
                " or is unknown (below)" if self.unknown else ""))
        rows, reasons = [("op", "dtype", "layer", "outcome", "why")], []
        for e in sorted(self.missing, key=lambda e: (OUTCOMES.index(e.outcome), e.layer or "~", e.op)):
            if e.reason not in reasons:
                reasons.append(e.reason)
            rows.append((e.op + (f" x{e.count}" if e.count > 1 else ""), e.dtype or "-", e.layer or _NO_LAYER,
                         e.outcome, f"[{reasons.index(e.reason) + 1}]"))
        if len(rows) > 1:
            widths = [max(len(r[i]) for r in rows) for i in range(5)]
            for r in rows:
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            lines += [f"  [{i}] {why}" for i, why in enumerate(reasons, 1)]
        for rows_of, what in ((self.gap_kernels, "on the GPU through tfmetal_ext gap kernels"),
                              (self.int32_host, "int32 ops on the host, as on any GPU"),
                              (self.unknown, "not in the table (unknown)")):
            if rows_of:
                counts = collections.Counter()
                for e in rows_of:
                    counts[e.op + (f"({e.dtype})" if e.dtype and e.outcome in (UNKNOWN, GAP) else "")] += e.count
                shown = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(counts.items()))
                lines.append(f"  {what}: {shown}")
        lines += self._transfer_lines()
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# Judging ops.


@functools.lru_cache(maxsize=None)
def _registered(op, device_type):
    """This TensorFlow's kernels of `op` on `device_type`.

    A tuple of ``({type attr: allowed dtype names}, frozenset of the
    argument names the kernel keeps in host memory)``, one per kernel.
    """
    import tensorflow as tf
    from tensorflow.python.framework import kernels

    try:
        found = kernels.get_registered_kernels_for_op(op).kernel
    except Exception:  # an op this TensorFlow does not know
        return ()
    out = []
    for k in found:
        if k.device_type != device_type:
            continue
        constraints = {}
        for c in k.constraint:
            names = set()
            for t in c.allowed_values.list.type:
                try:
                    names.add(tf.dtypes.as_dtype(t).name)
                except TypeError:
                    pass
            constraints[c.name] = frozenset(names)
        out.append((constraints, frozenset(k.host_memory_arg)))
    return tuple(out)


def _type_attrs(node):
    import tensorflow as tf

    out = {}
    for key, value in node.attr.items():
        if value.WhichOneof("value") == "type":
            try:
                out[key] = tf.dtypes.as_dtype(value.type).name
            except TypeError:
                pass
    return out


def _gap_strings(node):
    """The node's string attributes that a gap kernel of its op is constrained on (``{"equation": ...}``)."""
    kernel = gap_kernels.GAP_KERNELS.get(node.op)
    if kernel is None or not kernel.string_attrs:
        return None
    return {name: node.attr[name].s.decode() for name in kernel.string_attrs if name in node.attr}


def tf_kernel_host_memory(op, type_attrs, device_type):
    """The host-memory arguments of this TensorFlow's `device_type` kernel of `op` for the node's type
    attributes (a frozenset of OpDef argument names), or None when it registers no such kernel."""
    for constraints, host_args in _registered(op, device_type):
        if all(name not in type_attrs or type_attrs[name] in allowed for name, allowed in constraints.items()):
            return host_args
    return None


def tf_has_kernel(op, type_attrs, device_type):
    """This TensorFlow registers a `device_type` kernel of `op` accepting the node's type attributes."""
    return tf_kernel_host_memory(op, type_attrs, device_type) is not None


def _judged_dtypes(table, op, attrs):
    """The dtypes the backend table is asked about.

    The attribute the table names for the op (`Backend.dtype_attrs`), else
    ``T`` / ``dtype``; both ends of a ``Cast``.
    """
    if op == "Cast" and ("SrcT" in attrs or "DstT" in attrs):
        return [attrs[k] for k in ("SrcT", "DstT") if k in attrs]
    for key in (table.dtype_attrs.get(op), "T", "dtype"):
        if key in attrs:
            return [attrs[key]]
    return [None]


def _custom_op_kernel(table, op, dtype):
    """Our custom ops: the backend table's row for their pattern says where their kernels run."""
    for key, custom in fusion.CUSTOM_OPS.items():
        if op in custom.op_names:
            row = table.fusions.get(f"custom_{key}") or table.fusions.get(key)
            if row is None:
                return None
            return dtype is None or dtype in row.dtypes
    return None


def judge(table, op, attrs, macos=None, gap=True, strings=None):
    """``(outcome, dtype, reason)`` of one op on `table`, or None when it runs on the device.

    `macos`: the user's macOS as a version tuple, for a table whose kernels
    depend on it (`Backend.gate`); None: the gate is taken as met. `gap`:
    count our gap kernels (`GAP`: it runs on the device through ours).
    `strings`: the node's string attributes a gap kernel is constrained on
    (`_gap_strings`: Einsum's equation).
    """
    if op in table.host_ops:
        dtypes = _judged_dtypes(table, op, attrs)
        if gap and gap_kernels.covers(table, op, attrs, macos, strings=strings):
            return GAP, dtypes[0], f"{table.label} registers no kernel for it on this TensorFlow: {GAP}"
        return HOST, dtypes[0], table.host_ops[op]
    verdicts = []
    for dtype in _judged_dtypes(table, op, attrs):
        has = table.has_kernel(op, dtype, macos=macos)
        if op.startswith(fusion.CUSTOM_OP_PREFIX):
            has = _custom_op_kernel(table, op, dtype)
        verdicts.append((has, dtype))
    if all(has for has, _ in verdicts):
        return None
    if table.shared_kernels is None and tf_has_kernel(op, attrs, "DEFAULT"):
        return None  # TensorFlow's device-independent kernel runs there (a table that records them says so itself)
    missing = [(has, d) for has, d in verdicts if has is False]
    has, dtype = (missing or [v for v in verdicts if not v[0]])[0]
    if has is False and gap and gap_kernels.covers(table, op, attrs, macos, strings=strings):
        return GAP, dtype, f"no {table.label} kernel: {GAP}"
    kernel = gap_kernels.GAP_KERNELS.get(op) if gap else None
    # Our gap kernel takes the node's dtype but not its string attributes (an equation it does not take): say so.
    refusal = kernel.refusal(strings or {}) if kernel and attrs.get(kernel.dtype_attr) in kernel.dtypes else None
    if has is None:
        return UNKNOWN, dtype, "not in the backend table"
    what = f"no {table.label} kernel" + (f" for {dtype}" if dtype else "")
    if table.has_kernel(op, dtype) and not table.gate_met(macos):
        what += f" on macOS {'.'.join(map(str, macos))}: it needs {table.gate[0]}"
    if dtype in _HOST_DTYPES:
        return INT32_HOST, dtype, what + "; TensorFlow computes int32 on the host on GPUs anyway"
    if dtype is None and attrs:  # an op without T/dtype: name its type attributes (``Tseed=int64``)
        dtype = ",".join(f"{k}={v}" for k, v in sorted(attrs.items()))
    if refusal:
        what += f" ({refusal})"
    if tf_has_kernel(op, attrs, "CPU"):
        return FALLBACK, dtype, what
    return FAILS, dtype, what + " and no CPU kernel either"


# ----------------------------------------------------------------------------
# Where each node runs, for the memory of its tensors (`tfmetal_ext.inspect.transfers`).

# Outcomes whose nodes run on the CPU (HOST: unless TensorFlow's DEFAULT kernel runs it, see `placement`).
# FAILS runs nowhere; UNKNOWN is not guessed: the edges of both are left unjudged (and counted in a note).
_ON_CPU = (FALLBACK, HOST, INT32_HOST)


def device_host_memory(table, op, attrs):
    """The arguments of `op` that the device kernel running it keeps in host memory; None when not known.

    The backend table's own kernel for the judged dtype where the table
    records memory (`Backend.host_memory_args`), else TensorFlow's
    ``DEFAULT`` kernel for the node's type attributes (it serves the Metal
    device too), else None: nothing is declared, and the int32 rule of
    `tfmetal_ext.inspect.transfers` applies. Our custom ops' Metal kernels
    (``RegisterFloatKernels`` in custom_ops/metal/metal_helper.mm) declare no
    host memory: every argument, int32 included (the dropout ops' seed), is in
    device memory, as TensorFlow keeps it for a kernel that declares nothing.
    """
    if op.startswith(fusion.CUSTOM_OP_PREFIX):
        return frozenset()
    found = table.host_memory_args(op, _judged_dtypes(table, op, attrs)[0])
    return found if found is not None else tf_kernel_host_memory(op, attrs, "DEFAULT")


def placement(table, op, attrs, verdict):
    """The `transfers.Placement` of a node judged as `op` (`judge`'s `verdict`), or None: nowhere known.

    An op the backend leaves to the host (`HOST`) that TensorFlow's
    ``DEFAULT`` kernels cover is placed on the device through that kernel,
    which works on the tensors where they are: the open plugin's variable
    assignments on TF 2.21 (`Backend.host_ops`). The rest of `HOST`, with
    `FALLBACK` and `INT32_HOST`, runs on the CPU.
    """
    if verdict is None:
        return transfers.Placement(op, True, device_host_memory(table, op, attrs))
    if verdict[0] == GAP:
        return transfers.Placement(op, True, frozenset(gap_kernels.GAP_KERNELS[op].host_memory))
    shared = tf_kernel_host_memory(op, attrs, "DEFAULT") if verdict[0] == HOST else None
    if shared is not None:
        return transfers.Placement(op, True, shared)
    if verdict[0] in _ON_CPU:
        return transfers.Placement(op, False)
    return None


def _plumbing_placement(node):
    # Not judged (`PLUMBING_OPS`): the input pipeline's ops run on the host, the rest on the device through
    # TensorFlow's DEFAULT kernels (a variable read keeps its resource on the host). Arguments, constants,
    # identities and calls have no memory of their own in `transfers`, whatever this says.
    if node.op in EXPECTED_HOST_OPS:
        return transfers.Placement(node.op, False)
    return transfers.Placement(node.op, True, tf_kernel_host_memory(node.op, _type_attrs(node), "DEFAULT"))


# Grappler's constant folding leaves a result larger than this as it was (its default
# max_constant_size_in_bytes, 10 MiB).
FOLD_MAX_BYTES = 10 * 1024 * 1024


def _source_name(ref):
    """The producing node of a data input, in GraphDef ("n", "n:1") or FunctionDef ("n:output:0") form."""
    return ref.split(":")[0]


def _constant_folded(nodes):
    """Names of the nodes TensorFlow's graph optimizer folds into constants before the step runs.

    A node whose every input is a ``Const`` or a folded node (no control
    inputs), whose op is not stateful, and whose result, computed here on the
    CPU exactly as grappler's constant folding computes it, is at most
    `FOLD_MAX_BYTES` (say the identity matrix Keras' ``extract_patches``
    builds with ``MatrixDiagV3`` from constants, or a loss's element count:
    ``Prod`` of constant dimensions, then its ``Cast``). Folded level by
    level until nothing more folds, as grappler's pass folds a chain. A node
    fed through any output of a multi-output op other than its first output
    argument is judged as it stands.
    """
    consts = {n.name: n for n in nodes if n.op == "Const"}
    op_of = {n.name: n.op for n in nodes}
    folded = {}  # name -> node, in folding order
    judged = set()  # candidates already tried: a node that did not fold is not tried again
    while True:
        sources = consts.keys() | folded.keys()
        candidates = []
        for n in nodes:
            if n.op in PLUMBING_OPS or n.op == "Const" or n.name in judged or not n.input:
                continue
            if any(ref.startswith("^") for ref in n.input) or not all(_source_name(r) in sources for r in n.input):
                continue
            if not all(_graph_ref(r, op_of) is not None for r in n.input):
                continue
            op_def = transfers._op_def(n.op)  # noqa: SLF001 - the one cached OpDef lookup
            if op_def is None or op_def.is_stateful:
                continue
            candidates.append(n)
        if not candidates:
            break
        judged.update(n.name for n in candidates)
        done = _fold(candidates, consts, folded, op_of)
        if done is None:  # one candidate does not import or run alone: each on its own
            done = set()
            for n in candidates:
                done |= _fold([n], consts, folded, op_of) or set()
        if not done:
            break
        folded.update((n.name, n) for n in candidates if n.name in done)
    return set(folded)


def _graph_ref(ref, op_of):
    """A data input as a GraphDef input: ``"n"`` / ``"n:1"`` as they are; FunctionDef's ``"n:arg:i"`` as
    ``"n:i"`` where ``arg`` is the producer's first output argument (so ``i`` is the flat index); None
    otherwise. `op_of`: node name -> op."""
    parts = ref.split(":")
    if len(parts) <= 2:
        return ref
    op_def = transfers._op_def(op_of.get(parts[0], ""))  # noqa: SLF001 - the one cached OpDef lookup
    if op_def is None or not op_def.output_arg or op_def.output_arg[0].name != parts[1] or not parts[2].isdigit():
        return None
    return f"{parts[0]}:{parts[2]}"


def _fold(candidates, consts, folded, op_of):
    """Of `candidates` (fed by `consts` and the already `folded` nodes only), those whose results have
    static shapes within `FOLD_MAX_BYTES` and compute on the CPU, in one graph; None when the graph does
    not import or a candidate does not run."""
    import tensorflow as tf

    graph_def = tf.compat.v1.GraphDef()
    needed = set()
    stack = [_source_name(r) for n in candidates for r in n.input]
    while stack:  # the constants and folded nodes the candidates read, directly or through folded nodes
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        if name in folded:
            stack.extend(_source_name(r) for r in folded[name].input)
    for name in sorted(needed & consts.keys()):
        c = graph_def.node.add()
        c.CopyFrom(consts[name])
        c.device = ""
    for n in [folded[name] for name in folded if name in needed] + list(candidates):
        c = graph_def.node.add()
        c.CopyFrom(n)
        c.device = ""
        del c.input[:]
        c.input.extend(_graph_ref(r, op_of) for r in n.input)
    try:
        with tf.Graph().as_default() as graph:
            tf.graph_util.import_graph_def(graph_def, name="")
            fetches = {}
            for n in candidates:
                outputs = graph.get_operation_by_name(n.name).outputs
                # Sized before anything runs: shape inference sees the constants, so an unknown or larger
                # result (which grappler leaves unfolded) is never computed here.
                if all(t.shape.is_fully_defined() and t.dtype.is_numpy_compatible and t.dtype != tf.string
                       for t in outputs) and \
                        sum(t.shape.num_elements() * t.dtype.size for t in outputs) <= FOLD_MAX_BYTES:
                    fetches[n.name] = outputs
            if not fetches:
                return set()
            with tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(device_count={"GPU": 0})) as sess:
                sess.run(fetches)  # each folds only if TensorFlow can compute it
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
        return None
    return set(fetches)


def _functions(capture):
    """The node list of each graph and library function of the capture, nodes that never run left out
    (`live_nodes`)."""
    for fg in capture.functions:
        yield from live_nodes(fg.graph, getattr(fg, "roots", None))


# TensorFlow's v1 control-flow ops (Node::IsControlFlow): kept by the pruning whatever reads them.
_V1_CONTROL_FLOW = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
                              "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger"})
_ARG_OPS = frozenset({"_Arg", "Placeholder"})


def _node_of(ref):
    """The node name of an input reference or a FunctionDef return value (``"^n"``, ``"n:1"``, ``"n:out:0"``)."""
    return ref.lstrip("^").split(":")[0]


def _called_functions(node):
    """Names of the functions a node's attributes name (``f``, ``body``, ``then_branch``, ``branches``, ...)."""
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        elif value.HasField("list"):
            names.extend(f.name for f in value.list.func)
    return names


def _live(nodes, roots):
    """Names of `nodes` that run: reverse reachability (data and control inputs) from `roots`, every
    stateful op but the arguments, and v1 control flow, as ``PruneFunctionBody`` seeds it. A node whose
    op has no OpDef here is kept."""
    by_name = {n.name: n for n in nodes}
    seeds = [r for r in roots if r in by_name]
    for n in nodes:
        if n.op in _V1_CONTROL_FLOW:
            seeds.append(n.name)
        elif n.op not in _ARG_OPS:
            op_def = transfers._op_def(n.op)  # noqa: SLF001 - the one cached OpDef lookup
            if op_def is None or op_def.is_stateful:
                seeds.append(n.name)
    live, stack = set(), seeds
    while stack:
        name = stack.pop()
        if name in live or name not in by_name:
            continue
        live.add(name)
        stack.extend(_node_of(ref) for ref in by_name[name].input)
    return live


def live_nodes(graph_def, roots=None):
    """Yields, for the graph and then each library function that runs, the list of its nodes that run.

    `roots`: the names of the nodes whose results or effects the graph
    returns (`capture.FunctionGraph.roots`). None: unknown, and the graph is
    taken whole (a run's post-optimization graph, which grappler has already
    pruned, or a hand-built one). A library function's roots are its return
    values and control returns. A function runs when a node that runs calls
    it, directly or through another function that runs; a function no node
    of the capture names at all is kept, as nothing shows it cannot run.
    """
    top = list(graph_def.node)
    library = {f.signature.name: f for f in graph_def.library.function}
    named_anywhere = {name for n in top for name in _called_functions(n)}
    for fdef in library.values():
        named_anywhere.update(name for n in fdef.node_def for name in _called_functions(n))
    live_top = top if roots is None else [n for n in top if n.name in _live(top, roots)]
    yield live_top
    queue = [name for n in live_top for name in _called_functions(n)]
    queue += [name for name in library if name not in named_anywhere]
    seen = set()
    while queue:
        name = queue.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        fdef = library[name]
        fnodes = list(fdef.node_def)
        froots = {_node_of(v) for v in fdef.ret.values()} | {_node_of(v) for v in fdef.control_ret.values()}
        live = _live(fnodes, froots)
        kept = [n for n in fnodes if n.name in live]
        yield kept
        queue.extend(name for n in kept for name in _called_functions(n))


def _input_name(ref):
    return ref.lstrip("^").split(":")[0]


def _fused_chains(nodes, table, mode):
    """Nodes absorbed by a contraction fusion the table makes for their dtype: {name: head node}.

    A chain is Conv2D / MatMul -> BiasAdd [-> activation the row absorbs],
    each link the only consumer of the one before (grappler's condition).
    """
    consumers = collections.defaultdict(list)
    for n in nodes:
        for ref in n.input:
            if not ref.startswith("^"):
                consumers[_input_name(ref)].append(n)
    absorbed = {}
    for n in nodes:
        if n.op not in _CHAINS:
            continue
        pattern, _ = _CHAINS[n.op]
        row = table.fusion(pattern)
        dtype = _type_attrs(n).get("T")
        if not row.fuses or dtype not in row.dtypes:
            continue
        nxt = consumers.get(n.name, [])
        if len(nxt) != 1 or nxt[0].op != "BiasAdd":
            continue
        bias = nxt[0]
        absorbed[bias.name] = n
        after = consumers.get(bias.name, [])
        if len(after) == 1 and after[0].op in row.acts_in(_table_mode(mode)):  # fused_ops names are the activations' op types
            absorbed[after[0].name] = n
    return absorbed


def _table_mode(mode):
    return TRAIN if mode == TRAIN else PREDICT


def _optimizer_scope(model):
    opt = getattr(model, "optimizer", None) if model is not None else None
    inner = getattr(opt, "inner_optimizer", None)  # a LossScaleOptimizer's update ops are its inner one's
    names = {getattr(o, "name", None) for o in (opt, inner) if o is not None} - {None}
    return names


# Keras' name scope of the compiled loss (keras/src/trainers/compile_utils.py: CompileLoss).
_LOSS_SCOPE = "compile_loss"


def _layer_of(index, node_name, optimizer_names):
    """The node's layer path; else ``"optimizer <name>"`` or ``"loss"`` by its scopes; else None."""
    path = index.layer_of(node_name)
    if path is not None:
        return path
    parts = node_name.split("/")[:-1]
    for name in optimizer_names:  # its scope, or that scope uniquified (``adam_1``)
        if any(re.fullmatch(re.escape(name) + r"(_\d+)?", p) for p in parts):
            return f"optimizer {name}"
    if any(re.fullmatch(_LOSS_SCOPE + r"(_\d+)?", p) for p in parts):
        return "loss"
    return None


def macos_version(macos, table=None):
    """``(version tuple, note)``: the macOS a prediction is made for, and a note naming where it came from.

    `macos`: ``"12.7"``, ``(13, 0)`` or None (this Mac's version; off a Mac,
    the assumed Mac of `tfmetal_ext.devices.assume_backend`). The note is
    None when `table` has no kernels that depend on the macOS.
    """
    from tfmetal_ext.backends import pairings

    if macos is not None:
        text = ".".join(map(str, macos)) if isinstance(macos, (tuple, list)) else macos
        if not isinstance(text, str) or not re.fullmatch(r"\d{1,2}(\.\d+){0,2}", text):
            raise ValueError(f"`macos` must be a macOS version such as '13.6' or (13, 6). Received: macos={macos!r}")
        version, source = tuple(int(p) for p in text.split(".")), "as asked"
    elif devices._macos_version():
        version, source = tuple(int(p) for p in devices._macos_version().split(".")), "this Mac's"
    else:
        version = pairings.PLUGIN_MIN_MACOS
        source = "assumed: this is not a Mac; pass macos=... to predict for another"
    if table is None or table.gate is None:
        return version, None
    label, minimum = table.gate
    shown = ".".join(map(str, version))
    gated = sorted(table.gated_kernels)
    named = ", ".join(gated[:3]) + (f" and {len(gated) - 3} more" if len(gated) > 3 else "")
    if table.gate_met(version):
        return version, (f"predicted for macOS {shown} ({source}): {label} holds, so the kernels of {named} count "
                         f"as present; before macOS {'.'.join(map(str, minimum))} they are not registered")
    return version, f"predicted for macOS {shown} ({source}): {label} does not hold, so its gated kernels are missing"


def build_predicted_report(capture, index, predict_for, model=None, notes=(), macos=None, table=None, gap=True):
    """The `PredictedPlacementReport` of a traced `capture` for `predict_for` (a plugin distribution).

    `macos`: see `macos_version`. `table`: the `Backend` to judge against;
    None: `predict_for`'s. `gap`: count our gap kernels (see `judge`).
    """
    if table is None:
        with devices.assume_backend(predict_for):
            table = backends.current()
    macos, macos_note = macos_version(macos, table)
    optimizer_names = _optimizer_scope(model)
    grouped = {}
    edges_by_graph, unjudged = [], 0
    for nodes in _functions(capture):
        absorbed = _fused_chains(nodes, table, capture.mode)
        heads = {head.name for head in absorbed.values()}
        placed = {}  # node name -> transfers.Placement, or None where it runs nowhere known
        folded = _constant_folded(nodes)
        for node in nodes:
            if node.op in PLUMBING_OPS:
                placed[node.name] = _plumbing_placement(node)
                continue
            if node.name in folded:  # a constant by the time the step runs (grappler's constant folding)
                placed[node.name] = transfers.Placement("Const", True)
                continue
            if node.name in absorbed:
                continue  # placed with its head, below
            op, attrs = node.op, _type_attrs(node)
            if node.name in heads:
                op = _CHAINS[op][1]  # judged as the fused op it becomes
            verdict = judge(table, op, attrs, macos, gap, _gap_strings(node))
            placed[node.name] = placement(table, op, attrs, verdict)
            if verdict is None:
                continue
            outcome, dtype, reason = verdict
            layer = _layer_of(index, node.name, optimizer_names)
            if outcome == HOST and layer and layer.startswith("optimizer "):
                reason = f"the optimizer's update op: {reason}"
            key = (op, dtype, layer, outcome)
            if key in grouped:
                grouped[key].count += 1
            else:
                grouped[key] = PredictedOp(op, dtype, layer, outcome, reason, 1, node.name)
        for name, head in absorbed.items():
            placed[name] = placed[head.name]  # the fused kernel computes it
        found, skipped = transfers.find(nodes, placed, lambda name: _layer_of(index, name, optimizer_names))
        edges_by_graph.append(found)
        unjudged += skipped
    entries = list(grouped.values())
    notes = list(notes) + ([macos_note] if macos_note else [])
    if capture.jit_compile:
        notes.append("the step is XLA compiled: neither Metal backend has XLA, so jit_compile=True fails there")
    if unjudged:
        notes.append(f"{unjudged} data edge(s) not judged for transfers: an end is an op the table does not know, "
                     "one with no kernel anywhere, or one without an OpDef")
    missing = [e for e in entries if e.outcome in (FAILS, FALLBACK, HOST)]
    fallbacks = [FallbackNode(op=e.op, name=e.name, layer=e.layer, device="CPU:0") for e in missing]
    return PredictedPlacementReport(
        mode=capture.mode, gpu_present=True, ops_by_device={}, fallbacks=fallbacks,
        predicted_for=predict_for, table=table.key, table_complete=bool(table.kernels_complete),
        entries=entries, notes=notes, transfers=transfers.group(edges_by_graph),
        transfer_count=sum(map(len, edges_by_graph)), transfer_copies=transfers.copies(edges_by_graph),
    )


def validate_predict_for(predict_for):
    if predict_for not in devices.METAL_PLUGINS:
        raise ValueError(
            f"`predict_for` must be one of {', '.join(repr(p) for p in devices.METAL_PLUGINS)}. "
            f"Received: predict_for={predict_for!r}"
        )
    return predict_for


@contextlib.contextmanager
def tracing_as(predict_for):
    """Traces inside are made as on `predict_for`: our layers' choices and Keras' GPU branches."""
    validate_predict_for(predict_for)
    with _LOCK, devices.assume_backend(predict_for), keras_gpu_branches():
        yield


# ----------------------------------------------------------------------------
# Real vs predicted (MetalCallback on a Mac).


def differences(real, predicted, limit=None):
    """Notes where a real `PlacementReport` differs from a `PredictedPlacementReport` of the same step.

    Ops are compared by (op, layer): ops predicted without a device kernel
    that ran on the GPU, and ops that ran on the CPU that the prediction gave
    a device kernel (or did not know). Nodes grappler made (a fused op
    absent from the traced graph) compare by their own op type. With
    `limit`, the notes past it are counted in one last note.
    """
    if real is None or predicted is None or not real.gpu_present:
        return []

    def key(op, layer):  # the real report names layers only: the optimizer's and the loss's ops have none
        return op, (None if layer == "loss" or (layer or "").startswith("optimizer ") else layer)

    ran_cpu = {key(f.op, f.layer) for f in real.fallbacks}
    predicted_missing = {key(e.op, e.layer): e for e in predicted.missing}
    on_host = {key(e.op, e.layer) for e in predicted.int32_host}
    unknown = {key(e.op, e.layer) for e in predicted.unknown}
    notes = []
    for key, e in sorted(predicted_missing.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if key not in ran_cpu and e.outcome != FAILS:
            notes.append(f"predicted {e.op} ({e.dtype or '-'}) in {e.layer or '(no layer)'} {e.outcome} on "
                         f"{predicted.predicted_for}, but it ran on the GPU")
    for op, layer in sorted(ran_cpu - set(predicted_missing) - on_host, key=lambda k: (k[0], k[1] or "")):
        known = "did not know it" if (op, layer) in unknown else "had a kernel for it"
        notes.append(f"{op} in {layer or '(no layer)'} ran on the CPU; the {predicted.predicted_for} "
                     f"prediction {known}")
    if limit is not None and len(notes) > limit:
        notes = notes[:limit] + [f"... and {len(notes) - limit} more difference(s) from the prediction"]
    return notes
