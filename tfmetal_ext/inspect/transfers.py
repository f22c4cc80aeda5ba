"""Host and device memory in a predicted step, and the copies TensorFlow makes between them.

`tfmetal_ext.inspect.predict` decides where each node of a traced step runs:
on the Metal device, or on the CPU (an op without a device kernel). This
module decides which memory each input and output of a node lives in, and
finds the data edges whose two ends disagree. Such an edge is a **transfer**:
TensorFlow inserts a copy there (a send/receive pair). An op that reads host
memory on the device, such as a ``Reshape``'s int32 ``shape``, is not a
transfer when a host-memory op feeds it.

Memory of a node's arguments (`memory_types`, the one home of these rules;
TensorFlow's ``MemoryTypesForNode`` in
``tensorflow/core/framework/memory_types.cc``, for a device other than the
CPU):

* A node on the CPU reads and writes host memory only.
* On the device, resource and string tensors live in host memory
  (TensorFlow's ``DataTypeAlwaysOnHost``). Variant tensors are not on that
  list: a TensorList lives on the device.
* The arguments the kernel declares ``HostMemory`` live in host memory. The
  caller names the kernel (`Placement.host_args`): the backend table's own
  kernel where the table records its memory, else TensorFlow's
  ``DEVICE_DEFAULT`` kernel for the node.
* int32: where the kernel's declarations are known, int32 arguments follow
  them. TensorFlow puts int32 in device memory whenever it finds a kernel, so
  its own GPU and ``DEFAULT`` kernels declare their int32 arguments
  ``HostMemory``. Where no declaration is known (a table that does not record
  memory, a custom op), int32 is taken to live on the host. TensorFlow does
  the same for a node without a kernel, and its GPU kernels do it by
  convention.
* The positions named by the node's ``_input_hostmem`` / ``_output_hostmem``
  attributes are in host memory.

Plumbing (`_NO_FIXED_MEMORY`, `_PASS_THROUGH`):

* No fixed memory: function arguments and return values, ``Const`` (TensorFlow
  places a constant where it is consumed), function calls and functional
  control flow (their bodies are read as functions of their own), TF1
  control flow, send/receive. An edge from or to such a node is never a
  transfer. So the copy of the input batch into the step's function, and
  copies across a function call, are not counted.
* ``Identity`` / ``IdentityN``: each output lives where its input does. An
  edge through identities is judged between the ops at its two ends.
* Other plumbing (``ReadVariableOp``, ``VarHandleOp``, the input pipeline's
  ops on the host) follows the rules above, on the side `predict` gives it.

Counting: one transfer per data edge (a control edge carries no tensor). A
node inside a loop body or a function counts once, whatever the trip count,
as the report's fallbacks do. TensorFlow copies a tensor only once per
destination, however many ops read it: ``EnsureMemoryTypes``
(``tensorflow/core/common_runtime/memory_types.cc``) and the graph
partitioner reuse one receive. `PredictedTransfer.copies` counts those
copies. An edge with an end that runs nowhere known (the table does not know
the op, the op has no kernel anywhere, or TensorFlow has no OpDef for it) is
not judged: `find` counts such edges apart.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

HOST = "host"
DEVICE = "device"
DEVICE_TO_HOST = "device→host"
HOST_TO_DEVICE = "host→device"

# TensorFlow's DataTypeAlwaysOnHost (tensorflow/core/framework/types.cc), as dtype names.
_ALWAYS_ON_HOST = frozenset({"resource", "string"})
# Kept in host memory by a device kernel that declares nothing about them (see the module docstring).
_HOST_WITHOUT_DECLARATIONS = frozenset({"int32"})

# Nodes whose tensors have no memory of their own: edges from or to them are not judged.
_NO_FIXED_MEMORY = frozenset(
    {
        "_Arg", "_Retval", "_DeviceArg", "_DeviceRetval", "Placeholder", "PlaceholderWithDefault", "Const",
        "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
        "StatefulPartitionedCall", "SymbolicGradient", "Enter", "Exit", "Merge", "Switch", "NextIteration",
        "LoopCond", "_Send", "_Recv", "_HostSend", "_HostRecv",
    }
)
# Nodes whose output i lives where their data input i does.
_PASS_THROUGH = frozenset({"Identity", "IdentityN"})


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one node runs, as `tfmetal_ext.inspect.predict` decided.

    Attributes:
        op: the op as judged (a contraction chain's fused op for its nodes),
            which names it in `PredictedTransfer` rows.
        device: True on the Metal device, False on the CPU.
        host_args: the OpDef argument names its device kernel keeps in host
            memory; None when no declaration is known (see the module
            docstring's int32 rule). Ignored on the CPU.
    """

    op: str
    device: bool
    host_args: frozenset | None = None


@dataclasses.dataclass
class PredictedTransfer:
    """One kind of copy between host and device memory in a predicted step.

    Attributes:
        producer: the op whose output is copied (as judged: ``_FusedMatMul``
            for the nodes of a fused chain).
        consumer: the op that reads it.
        direction: `DEVICE_TO_HOST` or `HOST_TO_DEVICE`.
        layer: the consumer's layer path, ``"optimizer <name>"``, ``"loss"``
            or None (as `PredictedOp.layer`).
        count: how many such data edges the step has.
        copies: how many copies TensorFlow makes for them: one per tensor and
            destination, however many ops read it (a tensor that ops of two
            rows read counts in both rows).
        name: one such edge, ``"producer node -> consumer node"``.
    """

    producer: str
    consumer: str
    direction: str
    layer: str | None
    count: int = 1
    copies: int = 1
    name: str = ""


# ----------------------------------------------------------------------------
# The arguments of a node, by position.


@dataclasses.dataclass(frozen=True)
class _Layout:
    inputs: tuple  # (arg name, dtype name or None) per input position
    outputs: tuple  # the same per output position
    output_start: dict  # output arg name -> its first position


@functools.lru_cache(maxsize=None)
def _dtype_name(enum):
    import tensorflow as tf

    try:
        return tf.dtypes.as_dtype(enum).base_dtype.name
    except TypeError:
        return None


@functools.lru_cache(maxsize=None)
def _op_def(op):
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op)


def _attr(node, op_def, name):
    """The node's attribute `name`, else the OpDef's default for it; None when neither has one."""
    if name in node.attr:
        return node.attr[name]
    for a in op_def.attr:
        if a.name == name and a.HasField("default_value"):
            return a.default_value
    return None


def _arg_dtypes(node, op_def, arg):
    """The dtype names of the positions one OpDef argument spans in `node`, or None when unresolvable."""
    if arg.type_list_attr:
        value = _attr(node, op_def, arg.type_list_attr)
        return None if value is None else [_dtype_name(t) for t in value.list.type]
    if arg.type:
        dtype = _dtype_name(arg.type)
    else:
        value = _attr(node, op_def, arg.type_attr)
        if value is None:
            return None
        dtype = _dtype_name(value.type)
    if not arg.number_attr:
        return [dtype]
    count = _attr(node, op_def, arg.number_attr)
    return None if count is None else [dtype] * count.i


def _layout(node):
    """The node's input and output positions with their OpDef argument names and dtypes; None if unknown."""
    op_def = _op_def(node.op)
    if op_def is None:
        return None
    sides = []
    start = {}
    for args, record in ((op_def.input_arg, None), (op_def.output_arg, start)):
        positions = []
        for arg in args:
            dtypes = _arg_dtypes(node, op_def, arg)
            if dtypes is None:
                return None
            if record is not None:
                record[arg.name] = len(positions)
            positions += [(arg.name, d) for d in dtypes]
        sides.append(tuple(positions))
    return _Layout(sides[0], sides[1], start)


# ----------------------------------------------------------------------------
# TensorFlow's memory rules.


def _listed_positions(node, attr):
    return set(node.attr[attr].list.i) if attr in node.attr else set()


def memory_types(node, placement, layout=None):
    """``(input memories, output memories)`` of `node` by position (`HOST` / `DEVICE`); None without an OpDef.

    `placement`: the node's `Placement`. The rules are the module
    docstring's, after TensorFlow's ``MemoryTypesForNode``.
    """
    layout = layout or _layout(node)
    if layout is None:
        return None

    def memory(name, dtype):
        if not placement.device or dtype in _ALWAYS_ON_HOST:
            return HOST
        if placement.host_args is None:
            return HOST if dtype in _HOST_WITHOUT_DECLARATIONS else DEVICE
        return HOST if name in placement.host_args else DEVICE

    out = []
    for positions, attr in ((layout.inputs, "_input_hostmem"), (layout.outputs, "_output_hostmem")):
        forced = _listed_positions(node, attr) if placement.device else set()
        out.append([HOST if i in forced else memory(name, dtype) for i, (name, dtype) in enumerate(positions)])
    return tuple(out)


# ----------------------------------------------------------------------------
# Walking a graph's data edges.


@dataclasses.dataclass(frozen=True)
class Edge:
    """One data edge whose two ends are in different memory."""

    producer: str  # the producer's op, as judged
    consumer: str  # the consumer's op, as judged
    direction: str
    layer: str | None
    tensor: tuple  # (producer node, output position, consumer on the device): one copy per distinct value
    name: str


def _data_inputs(node):
    return [ref for ref in node.input if not ref.startswith("^")]


def find(nodes, placed, layer_of):
    """``(edges, unjudged)``: the transfers among one graph's or function's `nodes`.

    Args:
        nodes: the NodeDefs of one GraphDef or FunctionDef. References read
            ``node:out_arg:index`` in a FunctionDef (a bare name there is a
            function argument) and ``node:index`` or ``node`` in a GraphDef.
        placed: node name -> its `Placement`, or None where it runs nowhere
            known (the table does not know the op, or it has no kernel at all).
        layer_of: node name -> its layer path, or None.

    Returns:
        The `Edge` list, and how many data edges were not judged because an
        end runs nowhere known or has no OpDef.
    """
    by_name = {n.name: n for n in nodes}
    layouts = {}

    def layout(node):
        if node.name not in layouts:
            layouts[node.name] = _layout(node)
        return layouts[node.name]

    def endpoint(ref, seen=()):
        """The (node, output position) a reference reads, through identities; None: no fixed memory."""
        parts = ref.split(":")
        node = by_name.get(parts[0])
        if node is None or node.op in _NO_FIXED_MEMORY or node.name in seen:
            return None  # a function argument, or plumbing without memory of its own
        if len(parts) == 3:
            found = layout(node)
            if found is None or parts[1] not in found.output_start:
                return node, None
            index = found.output_start[parts[1]] + int(parts[2])
        else:
            index = int(parts[1]) if len(parts) == 2 else 0
        if node.op in _PASS_THROUGH:
            inputs = _data_inputs(node)
            return endpoint(inputs[index], seen + (node.name,)) if index < len(inputs) else None
        return node, index

    memories = {}

    def memory(node):
        if node.name not in memories:
            place = placed.get(node.name)
            found = layout(node)
            memories[node.name] = None if place is None or found is None else memory_types(node, place, found)
        return memories[node.name]

    edges, unjudged = [], 0
    for consumer in nodes:
        if consumer.op in _NO_FIXED_MEMORY or consumer.op in _PASS_THROUGH:
            continue
        for position, ref in enumerate(_data_inputs(consumer)):
            source = endpoint(ref)
            if source is None:
                continue
            producer, index = source
            produced, consumed = memory(producer), memory(consumer)
            if produced is None or consumed is None or index is None:
                unjudged += 1
                continue
            if index >= len(produced[1]) or position >= len(consumed[0]):
                unjudged += 1  # the node does not match its OpDef (a malformed graph): leave it alone
                continue
            src, dst = produced[1][index], consumed[0][position]
            if src == dst:
                continue
            on_device = placed[consumer.name].device
            edges.append(Edge(
                producer=placed[producer.name].op, consumer=placed[consumer.name].op,
                direction=DEVICE_TO_HOST if src == DEVICE else HOST_TO_DEVICE, layer=layer_of(consumer.name),
                tensor=(producer.name, index, on_device), name=f"{producer.name} -> {consumer.name}",
            ))
    return edges, unjudged


def group(edges_by_graph):
    """`PredictedTransfer` rows from `find`'s edges, one list per graph: identical (producer, consumer,
    direction, layer) counted together, most frequent first."""
    rows, tensors = {}, collections.defaultdict(set)
    for graph, edges in enumerate(edges_by_graph):
        for e in edges:
            key = (e.producer, e.consumer, e.direction, e.layer)
            if key in rows:
                rows[key].count += 1
            else:
                rows[key] = PredictedTransfer(e.producer, e.consumer, e.direction, e.layer, 1, 0, e.name)
            tensors[key].add((graph,) + e.tensor)
    for key, row in rows.items():
        row.copies = len(tensors[key])
    return sorted(rows.values(), key=lambda r: (-r.count, r.direction, r.producer, r.consumer, r.layer or ""))


def copies(edges_by_graph):
    """How many copies TensorFlow makes for `find`'s edges: one per tensor and destination."""
    return len({(graph,) + e.tensor for graph, edges in enumerate(edges_by_graph) for e in edges})
