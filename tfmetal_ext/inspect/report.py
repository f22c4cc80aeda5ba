"""FusionReport and PlacementReport: what the executed graph says about fusion and placement."""

from __future__ import annotations

import collections
import dataclasses
import json
import re

from tfmetal_ext import _saved_names
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog

# Nodes that are not compute: excluded from `num_ops`.
NON_COMPUTE_OPS = frozenset({"_Arg", "_Retval", "Const", "NoOp", "Identity"})

# Ops that legitimately run on the host even when a GPU is present (input
# pipeline plumbing, cross-device transfers): no placement finding.
EXPECTED_HOST_OPS = frozenset(
    {
        "_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
        "Identity", "IteratorGetNext", "IteratorGetNextAsOptional", "OptionalFromValue",
        "OptionalHasValue", "OptionalGetValue", "OptionalNone", "MakeIterator",
        "AnonymousIteratorV3", "_DeviceArg", "_DeviceRetval",
    }
)
HOST_OPS = EXPECTED_HOST_OPS  # the name before issue 28 (public module)

_SUFFIX = re.compile(r"_\d+$")


# ----------------------------------------------------------------------------
# Node name -> Keras layer.


class LayerIndex:
    """Maps TF node names (name scopes) to Keras layer paths, nested layers included.

    A path is the chain of layer names from the top model, e.g. ``"block_1/conv2d"``,
    so equally named layers in different containers stay apart. Every layer
    Keras tracks is reached: the layers of nested models, the sublayers a
    subclassed layer or model keeps in attributes, lists and dicts, and the
    layers inside wrappers (``Bidirectional``'s forward and backward layers,
    ``TimeDistributed``'s layer).

    Args:
        model: the model (or layer) the nodes come from; None for a plain function.
        scopes: graph name scope -> layer object, as recorded while the step
            was traced (`Capture.layer_scopes`). With it, attribution follows
            the layer objects; without, it falls back to resolving Keras'
            default-name scopes by name (`observe`).
    """

    def __init__(self, model=None, scopes=None):
        self.layers = {}  # path -> layer
        self._children = {}  # container path -> {child name: child path}
        self._scopes = {}  # container path -> {scope component: child path}, set by observe()
        self._path_of = {}  # id(layer) -> its first path
        self._object_scopes = {}  # graph scope -> layer path (from `scopes`)
        self._roots = set()  # first components of the recorded scopes
        if model is not None:
            self._walk(model, "", {id(model)})
        for scope, layer in (scopes or {}).items():
            path = self._path_of.get(id(layer))
            if path is not None:
                self._object_scopes[scope] = path
                self._roots.add(scope.split("/")[0])
        self._credit_wrapped_calls()

    def _credit_wrapped_calls(self):
        """A wrapper that runs its one sublayer's ``call`` directly (``TimeDistributed``) opens no
        scope for it: the wrapper's scopes are the sublayer's."""
        owned = set(self._object_scopes.values())
        for container, children in self._children.items():
            if container and len(children) == 1:
                (child,) = children.values()
                if child not in owned and child not in self._children:
                    for scope, path in list(self._object_scopes.items()):
                        if path == container:
                            self._object_scopes[scope] = child

    def _walk(self, parent, prefix, seen):
        children = self._children.setdefault(prefix, {})
        for layer in _sublayers(parent):
            path = f"{prefix}/{layer.name}" if prefix else layer.name
            children.setdefault(layer.name, path)
            self.layers[path] = layer
            self._path_of.setdefault(id(layer), path)
            if id(layer) not in seen and _sublayers(layer):
                self._walk(layer, path, seen | {id(layer)})

    def path_of(self, layer):
        """The path of a layer object (its first, for a layer reached twice), or None."""
        return self._path_of.get(id(layer))

    def leaf_layers(self):
        """(layer, path) of every layer that is not itself a container of layers."""
        return [(layer, path) for path, layer in self.layers.items() if not _sublayers(layer)]

    def all_layers(self):
        """(layer, path) of every layer reached, containers included, each object once."""
        seen, out = set(), []
        for path, layer in self.layers.items():
            if id(layer) not in seen:
                seen.add(id(layer))
                out.append((layer, path))
        return out

    def observe(self, node_names):
        """Resolves the name scopes in `node_names` (one executed graph) to layer paths.

        Used only without recorded scopes. TensorFlow uniquifies a scope opened
        twice in one graph (``conv2d`` -> ``conv2d_1``), and Keras' default
        names have the same shape, so a scope ``conv2d_1`` may be layer
        ``conv2d``'s second scope or layer ``conv2d_1``'s first. Seeing every
        scope of the graph at once decides it: a scope that can only be one
        layer's goes to that layer, and an ambiguous one goes to the candidate
        layer that has no scope yet (the exact name when that does not decide).
        Called by the report builders before `layer_of`.
        """
        if self._object_scopes:
            return self
        parts = [n.lstrip("^").split(":")[0].split("/")[:-1] for n in node_names]
        self._scopes = {}
        pending = {"": [p for p in parts if p]}
        while pending:
            container, seqs = pending.popitem()
            children = self._children.get(container, {})
            mapping = _assign_scopes({part for seq in seqs for part in seq}, children)
            self._scopes[container] = mapping
            for seq in seqs:
                for i, part in enumerate(seq):
                    path = mapping.get(part)
                    if path is not None and path in self._children:
                        pending.setdefault(path, []).append(seq[i + 1:])
        return self

    def layer_of(self, node_name):
        """The path of the innermost layer in a node name's scopes, or None.

        With recorded scopes, the node's scope is looked up as recorded (after
        any prefix inlining added, such as ``StatefulPartitionedCall/`` or
        ``gradient_tape/``). Otherwise, after `observe`, scopes resolve as it
        decided; before, each name decides alone by the same rule (the exact
        layer name, else the one whose ``_N`` uniquified scope it is). Without
        a model, the innermost scope under the top-level model scope is used.
        """
        name = node_name.lstrip("^").split(":")[0]
        parts = name.split("/")[:-1]  # the last component is the op itself
        if self._object_scopes:
            return self._recorded_layer_of(parts)
        if not self._children:
            parts = [p for p in parts if p not in ("StatefulPartitionedCall", "gradient_tape")]
            return _SUFFIX.sub("", parts[-1]) if len(parts) > 1 else None
        container, found = "", None
        for part in parts:
            scopes = self._scopes.get(container)
            if scopes is None:  # not observed: this one name decides alone
                scopes = _assign_scopes({part}, self._children.get(container, {}))
            path = scopes.get(part)
            if path is not None:
                found = path
                if path in self._children:
                    container = path
        return found

    def _recorded_layer_of(self, parts):
        for i, part in enumerate(parts):
            if part not in self._roots:
                continue
            for j in range(len(parts), i, -1):  # the innermost recorded scope first
                path = self._object_scopes.get("/".join(parts[i:j]))
                if path is not None:
                    return path
        return None


def _assign_scopes(scopes, children):
    """Scope component -> child layer path, for the components seen under one container."""
    candidates = {}
    for scope in scopes:
        names = [n for n in children if scope == n or re.fullmatch(re.escape(n) + r"_\d+", scope)]
        if names:
            candidates[scope] = names
    assigned, taken = {}, set()
    for scope, names in candidates.items():
        if len(names) == 1:
            assigned[scope] = names[0]
            taken.add(names[0])
    ambiguous = sorted((s for s in candidates if s not in assigned), key=lambda s: (len(s), s))
    for scope in ambiguous:
        names = candidates[scope]
        free = [n for n in names if n not in taken]
        if len(free) == 1:
            pick = free[0]
        else:
            pool = free or names
            pick = scope if scope in pool else pool[0]
        assigned[scope] = pick
        taken.add(pick)
    return {scope: children[name] for scope, name in assigned.items()}


def _sublayers(layer):
    """The layers Keras tracks directly under `layer`: a model's `.layers`, else its tracked sublayers.

    Tracked sublayers are those a layer keeps in attributes, lists and dicts
    (Keras' `_flatten_layers`); a layer with an inspection rule of its own
    (e.g. ``LSTM``, whose ``LSTMCell`` is its own business) is a leaf.
    """
    import keras

    if isinstance(layer, keras.Model):
        layers = getattr(layer, "layers", None)
        if layers:
            return list(layers)
    if not hasattr(layer, "_flatten_layers"):
        return []
    if not getattr(layer, "_tfmetal_container", False) and catalog.has_rule(layer):
        return []
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _matches(path, layer):
    """A layer given by name or by path matches a layer path."""
    return path == layer or path.endswith("/" + layer)


def _is_backward(node):
    """A backward-pass node: by its name scope, or by its op (`fusion.BACKWARD_OPS`: a custom
    gradient's ops are named outside the tape's scope)."""
    return "gradient_tape/" in node.name or "/gradients/" in node.name or node.op in fusion.BACKWARD_OPS


def _dtype_name(node):
    import tensorflow as tf

    for key in ("T", "dtype"):
        if key in node.attr and node.attr[key].type:
            try:
                return tf.dtypes.as_dtype(node.attr[key].type).name
            except TypeError:
                return str(node.attr[key].type)
    return None


# ----------------------------------------------------------------------------
# Report dataclasses.


@dataclasses.dataclass
class FusedNode:
    """One fused node of the executed graph."""

    op: str
    fused_ops: list
    layer: str | None  # innermost layer name
    layers: list  # layer paths the node reads weights from or is named after
    device: str
    name: str
    dtype: str | None
    backward: bool

    def label(self):
        return f"{self.op}[{', '.join(self.fused_ops)}]" if self.fused_ops else self.op


@dataclasses.dataclass
class LayerRow:
    """The fusion verdict for one layer.

    `status` is ``"fused"`` (the full pattern), ``"partial"`` (what this
    backend/dtype/mode allows, short of the full pattern; see `reason`),
    ``"not fused"`` (nothing can fuse here; see `reason`), ``"missed"`` (a
    fusion was expected and is not in the graph) or ``"unexpected"`` (the
    catalog expected none, yet the graph has one).
    """

    layer: str
    path: str
    layer_class: str
    pattern: str
    expected_op: str | None
    expected_fused_ops: list | None
    ideal_fused_ops: list | None
    actual_op: str | None
    actual_fused_ops: list | None
    fused: bool
    status: str
    reason: str | None
    note: str | None = None
    ran: dict | None = None  # forward compute op -> count, in this layer's scope (XLA calls named)


def _fmt_ran(ran, limit=5):
    """The ops a layer ran (most frequent first; XLA calls always shown), for a row with no fused node."""
    if not ran:
        return "-"
    items = sorted(ran.items(), key=lambda kv: (not kv[0].startswith("XLA"), -kv[1], kv[0]))
    shown = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in items[:limit])
    return shown + (f", ... ({sum(ran.values())} ops)" if len(items) > limit else "")


def _fmt_ops(op, fused_ops):
    if not op:
        return "-"
    return f"{op}[{', '.join(fused_ops)}]" if fused_ops else op


@dataclasses.dataclass
class OptimizerUpdate:
    """Which optimizer update a train step ran, read from its executed graph's ops.

    Attributes:
        form: ``"multi_tensor"`` (``TfmetalExt>MultiTensor*`` ops update
            groups of variables), ``"per_variable"`` (``ResourceApply*`` /
            ``ResourceScatter*`` training ops, one or more per variable),
            ``"elementwise"`` (no training op: the update is elementwise ops
            and variable assignments, as Keras' own optimizers and the fused
            ones' composite form emit), or ``"unknown"`` (an XLA-compiled step
            whose ops are inside the XLA cluster).
        multi_tensor_ops: ``TfmetalExt>MultiTensor*`` op type -> count.
        training_ops: ``ResourceApply*`` / ``ResourceScatter*`` op type -> count
            (a multi-tensor step may still hold per-variable ones, e.g. the
            decay of a group the op does not cover).
    """

    form: str
    multi_tensor_ops: dict
    training_ops: dict

    @classmethod
    def from_counts(cls, counts, xla=False):
        prefix = fusion.CUSTOM_OP_PREFIX + "MultiTensor"
        multi = {op: n for op, n in sorted(counts.items()) if op.startswith(prefix)}
        training = {op: n for op, n in sorted(counts.items()) if op.startswith(("ResourceApply", "ResourceScatter"))}
        if multi:
            form = "multi_tensor"
        elif training:
            form = "per_variable"
        else:
            form = "unknown" if xla else "elementwise"
        return cls(form, multi, training)

    def __str__(self):
        ops = ", ".join(f"{op} x{n}" for op, n in {**self.multi_tensor_ops, **self.training_ops}.items())
        text = {
            "multi_tensor": "multi-tensor",
            "per_variable": "one training op per variable",
            "elementwise": "elementwise ops and assignments (no training op)",
            "unknown": "inside the XLA cluster (not visible)",
        }[self.form]
        return f"{text}" + (f": {ops}" if ops else "")


@dataclasses.dataclass
class FusionReport:
    """What fused in one executed step.

    Attributes:
        mode: ``"train"``, ``"predict"`` or ``"function"``.
        backend: backend the context was evaluated for.
        onednn: oneDNN was on.
        xla: the step was XLA compiled.
        policy: the model's dtype policy name (or None for a function).
        num_ops: compute ops per step: nodes excluding _Arg, _Retval, Const, NoOp, Identity.
        ops_by_type: compute op type -> count.
        fused: one `FusedNode` per fused node (forward and backward).
        layers: one `LayerRow` per layer the catalog has a pattern for.
        notes: remarks on how the report was made.
        optimizer_update: for a train step, the optimizer update the
            executed graph holds (`OptimizerUpdate`), else None.
    """

    mode: str
    backend: str
    onednn: bool
    xla: bool
    policy: str | None
    num_ops: int
    ops_by_type: dict
    fused: list
    layers: list
    notes: list = dataclasses.field(default_factory=list)
    optimizer_update: OptimizerUpdate | None = None

    def row(self, layer):
        """The `LayerRow` of a layer, by name or nested path."""
        rows = [r for r in self.layers if r.path == layer] or [r for r in self.layers if _matches(r.path, layer)]
        if len(rows) > 1:
            raise KeyError(f"Layer name {layer!r} is ambiguous; use a path: {[r.path for r in rows]}")
        for r in rows:
            return r
        raise KeyError(f"No fusion row for layer {layer!r}; rows: {[r.layer for r in self.layers]}")

    def fused_for(self, layer):
        """Fused nodes that belong to `layer` (by name or path)."""
        return [f for f in self.fused if any(_matches(p, layer) for p in f.layers)]

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self, **kwargs):
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self):
        head = (
            f"Fusion report ({self.mode}; backend={self.backend}, oneDNN={'on' if self.onednn else 'off'}, "
            f"policy={self.policy}, xla={self.xla}): {self.num_ops} ops per step, "
            f"{len(self.fused)} fused nodes"
        )
        lines = [head]
        if self.layers:
            rows = [("layer", "pattern", "status", "graph has", "reason")]
            for r in self.layers:
                rows.append(
                    (
                        r.path,
                        r.pattern,
                        r.status,
                        _fmt_ops(r.actual_op, r.actual_fused_ops) if r.actual_op else _fmt_ran(r.ran),
                        (r.reason or "") + (f" [note: {r.note}]" if r.note else ""),
                    )
                )
            widths = [max(len(row[i]) for row in rows) for i in range(4)]
            for row in rows:
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
        elif self.fused:
            for f in self.fused:
                lines.append(f"  {f.label():40s} {f.layer or '-'}{' (backward)' if f.backward else ''}")
        top = sorted(self.ops_by_type.items(), key=lambda kv: (-kv[1], kv[0]))[:8]
        lines.append("  most frequent ops: " + ", ".join(f"{k} x{v}" for k, v in top))
        if self.optimizer_update is not None:
            lines.append(f"  optimizer update: {self.optimizer_update}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


@dataclasses.dataclass
class FallbackNode:
    op: str
    name: str
    layer: str | None
    device: str


@dataclasses.dataclass
class PlacementReport:
    """Where the ops of one executed step ran.

    Attributes:
        gpu_present: a GPU device took part in the step (or was available).
        ops_by_device: device -> compute op count.
        fallbacks: compute ops that ran on CPU while a GPU was present.
        notes: remarks (e.g. where a Mac's real placement differs from the
            predicted one, added by `MetalCallback`).
    """

    mode: str
    gpu_present: bool
    ops_by_device: dict
    fallbacks: list
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self, **kwargs):
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self):
        lines = [
            f"Placement report ({self.mode}): "
            + ", ".join(f"{d}: {n} ops" for d, n in sorted(self.ops_by_device.items()))
        ]
        if not self.gpu_present:
            lines.append("  no GPU present: nothing can fall back")
        elif not self.fallbacks:
            lines.append("  no CPU fallback")
        else:
            lines.append(f"  {len(self.fallbacks)} op(s) fell back to CPU:")
            for f in self.fallbacks:
                lines.append(f"    {f.op:28s} {f.layer or '-':20s} {f.name}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# Building reports from a capture.


def _short_device(device):
    m = re.search(r"device:([A-Za-z_]+):(\d+)", device or "")
    return f"{m.group(1)}:{m.group(2)}" if m else (device or "?")


def build_fusion_report(capture, index, ctx, policy=None, notes=()):
    index.observe(n.name for n in capture.nodes())
    counts = collections.Counter()
    fused = []
    ran = collections.defaultdict(collections.Counter)  # layer path -> forward op label -> count
    for node in capture.nodes():
        if node.op in NON_COMPUTE_OPS:
            continue
        counts[node.op] += 1
        if node.op not in _PLUMBING_OPS and not _is_backward(node):
            path = index.layer_of(node.name)
            if path is not None:
                ran[path][_ran_label(node)] += 1
        if fusion.is_fused_op(node.op) or "fused_ops" in node.attr and node.attr["fused_ops"].list.s:
            weight_layers = [index.layer_of(i) for i in list(node.input)[1:3] if not i.startswith("^")]
            own = index.layer_of(node.name)
            layers = []  # layer paths, the weights' layer first
            for path in weight_layers + [own]:
                if path and path not in layers:
                    layers.append(path)
            fused.append(
                FusedNode(
                    op=node.op,
                    fused_ops=fusion.node_fused_ops(node),
                    layer=layers[0].split("/")[-1] if layers else None,
                    layers=layers,
                    device=_short_device(node.device),
                    name=node.name,
                    dtype=_dtype_name(node),
                    backward=_is_backward(node),
                )
            )
    verdicts = []
    for layer, path in index.all_layers():
        exp = catalog.expectation(layer, ctx)
        if exp is None:
            continue
        row, node, exp = _layer_row(layer, path, exp, fused)
        row.ran = dict(ran.get(path, {})) or None
        verdicts.append((row, node, exp))
    rows = _credit_shared_nodes(verdicts)
    notes = list(notes)
    missed = [r for r in rows if r.status == "missed"]
    if missed and not fused and not capture.jit_compile:
        # Not one fused node although rows expect some: the remapper pass itself failed on this
        # graph (it then rolls back every fusion), not each layer on its own.
        known = catalog.table(ctx).pass_failure
        why = "grappler's remapper pass failed on this graph as a whole (no node in it fused)"
        if known:
            why += f"; known here: {known}"
        notes.append(why)
        for r in missed:
            r.reason = (f"{r.reason.split(' (is the pre-activation')[0]}: the remapper pass failed on this "
                        "whole graph (see the note)")
    return FusionReport(
        mode=capture.mode,
        backend=ctx.backend,
        onednn=ctx.onednn,
        xla=capture.jit_compile,
        policy=policy,
        num_ops=sum(counts.values()),
        ops_by_type=dict(counts),
        fused=fused,
        layers=rows,
        notes=notes,
        optimizer_update=OptimizerUpdate.from_counts(counts, capture.jit_compile) if capture.mode == "train" else None,
    )


# Forward ops that say nothing about what a layer computed (weight reads, shape and loop plumbing).
_PLUMBING_OPS = frozenset(
    {
        "ReadVariableOp", "Reshape", "Squeeze", "Shape", "ExpandDims", "Cast", "StridedSlice",
        "Enter", "Exit", "Merge", "NextIteration", "Switch", "LoopCond",
    }
)
_CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")


def _ran_label(node):
    """The op type, or ``"XLA call <function>"`` for a call of an XLA-compiled function."""
    if node.op in _CALL_OPS and "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b:
        fn = re.sub(r"^__(inference|forward|backward)_|_\d+$", "", node.attr["f"].func.name)
        return f"XLA call {fn}"
    if node.op in ("_XlaCompile", "_XlaRun", "XlaLaunch"):
        return f"XLA {node.op}"
    return node.op


def _credit_shared_nodes(verdicts):
    """Rows, with a fused node that reads two layers' weights credited to the one that expected it.

    Conv2D + FusedBatchNorm fuse into one ``_FusedConv2D`` that reads the conv's
    kernel and the batch norm's statistics: the batch norm's row expects it,
    and the bias-free conv's row, which expects nothing, is "not fused" with a
    note instead of "unexpected".
    """
    claimed = {
        node.name: row for row, node, _ in verdicts if node is not None and row.status in ("fused", "partial")
    }
    rows = []
    for row, node, exp in verdicts:
        owner = claimed.get(node.name) if node is not None and row.status == "unexpected" else None
        if owner is not None and owner is not row:
            note = f"its output fuses into {owner.path}'s {node.label()}"
            row = dataclasses.replace(
                row, status="not fused", reason=exp.reason,
                note="; ".join(n for n in (row.note, note) if n),
            )
        rows.append(row)
    return rows


def _has_prefix(fused_ops, prefix):
    prefix = tuple(prefix or ())
    return tuple(fused_ops[: len(prefix)]) == prefix


def _layer_row(layer, path, exp, fused):
    target = path
    if exp.match_layer is not None:  # a sibling layer in the same container
        parent = path.rpartition("/")[0]
        target = f"{parent}/{exp.match_layer}" if parent else exp.match_layer
    candidates = [f for f in fused if not f.backward and target in f.layers]
    actual = None
    if exp.op:
        for f in candidates:
            if f.op == exp.op and _has_prefix(f.fused_ops, exp.fused_ops):
                actual = f
                break
    if actual is None and candidates:
        actual = candidates[0]
    reason = exp.reason
    if exp.op is None and actual is not None and any(
            actual.op == op and _has_prefix(actual.fused_ops, ops) for op, ops in exp.may_fuse):
        status, reason = "fused", None  # a fusion with code the rule could not see (see Expectation)
    elif exp.op is None:
        status = "unexpected" if actual else "not fused"
        if actual:
            reason = f"catalog expected no fusion ({exp.reason}), graph has {actual.label()}"
    elif actual is not None and actual.op == exp.op and _has_prefix(actual.fused_ops, exp.fused_ops):
        if (
            exp.ideal_fused_ops is not None
            and _has_prefix(actual.fused_ops, exp.ideal_fused_ops)
            and exp.ideal_op in (None, actual.op)
        ):
            status, reason = "fused", None
        else:
            status = "partial"
    else:
        status = "missed"
        have = actual.label() if actual else "no fused node"
        reason = (
            f"expected {_fmt_ops(exp.op, exp.fused_ops)}, graph has {have}"
            " (is the pre-activation consumed elsewhere?)"
        )
    row = LayerRow(
        layer=layer.name,
        path=path,
        layer_class=_saved_names.unaliased(type(layer)).__name__,  # an alias shows its fused class
        pattern=exp.pattern,
        expected_op=exp.op,
        expected_fused_ops=list(exp.fused_ops) if exp.fused_ops else None,
        ideal_fused_ops=list(exp.ideal_fused_ops) if exp.ideal_fused_ops else None,
        actual_op=actual.op if actual else None,
        actual_fused_ops=list(actual.fused_ops) if actual else None,
        fused=actual is not None,
        status=status,
        reason=reason,
        note=exp.note,
    )
    return row, actual, exp


def build_placement_report(capture, index, gpu_present=None):
    by_device = collections.Counter()
    fallbacks = []
    nodes = list(capture.partition_nodes())
    index.observe(n.name for n in nodes)
    devices_seen = {_short_device(n.device) for n in nodes}
    if gpu_present is None:
        gpu_present = any(d.startswith("GPU") for d in devices_seen)
    for node in nodes:
        if node.op in NON_COMPUTE_OPS:
            continue
        dev = _short_device(node.device)
        by_device[dev] += 1
        if gpu_present and dev.startswith("CPU") and node.op not in EXPECTED_HOST_OPS:
            fallbacks.append(
                FallbackNode(op=node.op, name=node.name, layer=index.layer_of(node.name), device=dev)
            )
    return PlacementReport(
        mode=capture.mode, gpu_present=gpu_present, ops_by_device=dict(by_device), fallbacks=fallbacks
    )
