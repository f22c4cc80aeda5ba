"""A projection's input, rebuilt in the backward pass instead of kept (`fusion.REPLAYED_OPS`).

A transformer's feed-forward ends in a projection whose input is a short elementwise chain over
tensors the backward pass keeps anyway: ``silu(gate) * up`` (Llama, Mistral, Qwen), ``gelu(x1) * x2``
(Gemma), ``gelu(pre)`` (GPT-2, BERT). TensorFlow's autodiff keeps that input for the projection's
kernel gradient, and keeps the chain's own intermediates (the activation's output, a product's
operands) for their gradients: two to three tensors of the feed-forward's width per layer that
nothing else needs.

`plan(x)` reads, in a graph, how `x` was made. When it is such a chain (ops of `fusion.REPLAYED_OPS`
holding a product of two computed tensors, `fusion.REPLAY_GAIN_OPS`) over a few *anchor* tensors,
`apply(forward, x, replay)` runs the projection `forward` on `x` with a gradient that keeps only
the anchors: the backward pass makes the same ops again from them (bit for bit the same values),
runs the projection on that, and takes TensorFlow's own gradient of both, for the anchors and for
the projection's variables (its kernel, LoRA factors, bias). The projection's forward output is
pruned from that backward graph by grappler: only its gradient ops are used.

A smooth activation inside the chain (SiLU, exact or tanh GELU, as TF, Keras, keras-hub and our
layers write them: `_forms`) is found by its ops and made again with the same ops, but
differentiated by one ``TfmetalExt>ActivationGrad`` (`_contraction.recomputed`) instead of TF's chain of
3-5 elementwise gradient ops, each a temporary of the feed-forward's width alive at the step's
memory peak. Where the activation's output is one factor of a product of two same-shape tensors (a
gated feed-forward's ``silu(gate) * up``), the product and the activation are differentiated together
by one ``TfmetalExt>GatedActivationGrad`` (`_contraction.recomputed_gated`): its backward keeps neither
the activation's output nor ``dy * up``.

Eagerly (`run_eagerly=True`, a plain GradientTape loop) there is no graph to read: the layers keep
the ordinary path.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend

from tfmetal_ext.backends import fusion
from tfmetal_ext.layers import _contraction as C

# Bounds on what is replayed: a feed-forward's chain is a handful of ops over two anchors.
MAX_OPS = 48
MAX_ANCHORS = 4


@dataclasses.dataclass(frozen=True)
class Replay:
    """How tensor `target` is made again from `anchors` (`plan`'s answer)."""

    target: tf.Tensor
    anchors: tuple
    ops: tuple  # the replayed ops (`rebuild` makes each once its inputs are made)
    # The chain's activations with a one-op gradient: (output, `fusion.ACTIVATION_GRAD_ACTIVATIONS`
    # name, the form that made it, its input), outermost first.
    activations: tuple = ()

    def rebuild(self, anchors):
        """`target` made again from `anchors` (tensors standing for `self.anchors`, in order)."""
        made = {a.ref(): b for a, b in zip(self.anchors, anchors)}
        replayed = {id(op) for op in self.ops}
        activations = {out.ref(): (kind, form, x) for out, kind, form, x in self.activations}

        def value(t):
            if t.ref() in made:
                return made[t.ref()]
            if t.ref() in activations:
                kind, form, x = activations[t.ref()]
                made[t.ref()] = C.recomputed(form, kind)(value(x))
                return made[t.ref()]
            op = t.op
            if id(op) in replayed:
                gated = _gated_operands(op, activations)
                if gated is not None:
                    k, (kind, form, x), other = gated
                    made[t.ref()] = C.recomputed_gated(form, kind, act_first=k == 0)(value(x), value(other))
                    return made[t.ref()]
                for old, new in zip(op.outputs, _clone(op, [value(i) for i in op.inputs])):
                    made[old.ref()] = new
                return made[t.ref()]
            if op.type == "IdentityN":
                return value(op.inputs[t.value_index])
            return t  # a constant or a non-float leaf: the forward pass's own tensor

        return value(self.target)


def _gated_operands(op, activations):
    """``(k, (kind, form, x), other)`` when `op` is a gated product ``act(x) * other``
    (`fusion.GATED_PRODUCT_OPS`, input `k` a chain activation with a one-op gradient), its operands
    of one dtype and one static shape (so no broadcast), else None: its backward pass is then one
    ``TfmetalExt>GatedActivationGrad`` (`_contraction.recomputed_gated`). Unknown dimensions count as
    equal when both are unknown at the same place (a feed-forward's batch and time: gate and up are
    two projections of one tensor); operands that broadcast along such a dimension at run time get
    the op's InvalidArgumentError, naming both shapes, in the backward pass."""
    if op.type not in fusion.GATED_PRODUCT_OPS or len(op.inputs) != 2:
        return None
    for k, t in enumerate(op.inputs):
        other = op.inputs[1 - k]
        if t.ref() not in activations or t.dtype != other.dtype:
            continue
        a, b = t.shape, other.shape
        if a.rank is None or a.rank != b.rank or a.as_list() != b.as_list():
            continue  # a broadcast, or shapes it cannot tell apart
        return k, activations[t.ref()], other
    return None


def _clone(op, inputs):
    """The output of a new `op.type` op on `inputs` with `op`'s attributes (those not inferred), in a list."""
    op_def = op.op_def
    inferred = set()
    for arg in op_def.input_arg:
        inferred.update(a for a in (arg.type_attr, arg.number_attr, arg.type_list_attr) if a)
    kwargs = {arg.name: v for arg, v in zip(op_def.input_arg, inputs)}
    for attr in op_def.attr:
        if attr.name not in inferred:
            kwargs[attr.name] = op.get_attr(attr.name)
    fn = getattr(tf.raw_ops, op.type, None) or _custom_op_function(op.type)
    out = fn(**kwargs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _custom_op_function(op_type):
    """The loaded op library's Python function of custom op `op_type` (``TfmetalExt>RMSNorm`` ->
    ``tfmetal_ext_rms_norm``, TF's naming of generated wrappers), or None."""
    import re

    from tfmetal_ext.ops import _common

    lib = _common.library()
    if lib is None or not op_type.startswith(fusion.CUSTOM_OP_PREFIX):
        return None
    name = op_type.replace(">", "_")
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower().replace("__", "_")
    return getattr(lib, name, None)


def _is_float(t):
    return t.dtype.is_floating


def plan(x, max_ops=MAX_OPS, max_anchors=MAX_ANCHORS):
    """The `Replay` that makes `x` again from the tensors its backward pass keeps anyway, or None.

    None when `x` is not a graph tensor, when its chain of `fusion.REPLAYED_OPS` holds no product of
    two computed tensors (nothing to gain), or when it reaches past `max_ops` ops or `max_anchors`
    float tensors it does not make.
    """
    if not tf.is_symbolic_tensor(x) or not hasattr(x, "op") or not _is_float(x):
        return None
    anchors, ops, seen = [], [], set()
    gain = False
    stops = []  # per custom gradient being walked into: (its own inputs, those of them reached)

    def visit(t):
        nonlocal gain
        if stops and t.ref() in stops[-1][0]:
            stops[-1][1].append(t)
            return True
        if t.ref() in seen:
            return True
        seen.add(t.ref())
        op = t.op
        if op.type == "Const" or not _is_float(t):
            return True  # reused as it is
        if op.type == "IdentityN" and len(op.inputs) == len(op.outputs):
            # A custom gradient's output (TF's silu, our layers' own replays): its forward is replayed
            # when it is made, by replayable ops, from the custom gradient's own inputs alone (the
            # walk then goes on from those). Otherwise the output is an anchor: stepping inside would
            # bypass its gradient (and keep what that gradient frees).
            k = t.value_index
            own = {i.ref() for j, i in enumerate(op.inputs) if j != k}
            state = (len(anchors), len(ops), set(seen), gain)
            stops.append((own, []))
            inside = visit(op.inputs[k])
            reached = stops.pop()[1]
            if inside and len(anchors) == state[0]:
                return all(visit(r) for r in reached)
            del anchors[state[0]:], ops[state[1]:]
            seen.clear()
            seen.update(state[2])
            gain = state[3]
            anchors.append(t)
            return len(anchors) <= max_anchors
        if not _replayable(op):
            anchors.append(t)
            return len(anchors) <= max_anchors
        if len(ops) >= max_ops:
            return False
        for i in op.inputs:
            if not visit(i):
                return False
        if op.type in fusion.REPLAY_GAIN_OPS and sum(_computed(i) for i in op.inputs) >= 2:
            gain = True
        ops.append(op)
        return True

    if not visit(x) or not gain:
        return None
    return Replay(x, tuple(anchors), tuple(ops), _chain_activations(x, anchors, ops))


# ----------------------------------------------------------------------------
# Activations with a one-op gradient inside a replayed chain.

def _forms():
    """(name, function) for each way the chain's smooth activations are written, as data for `plan`:
    TF's and Keras' functions (keras-hub's ``gelu_approximate`` is Keras' tanh GELU) and our
    contraction layers' training form (`_contraction.recomputed`, a custom gradient around the same
    ops). Names are `fusion.ACTIVATION_GRAD_ACTIVATIONS`."""
    import keras

    return (
        ("silu", tf.nn.silu),
        ("silu", keras.activations.silu),
        ("gelu", functools.partial(tf.nn.gelu, approximate=False)),
        ("gelu", functools.partial(keras.activations.gelu, approximate=False)),
        ("gelu_approximate", functools.partial(tf.nn.gelu, approximate=True)),
        ("gelu_approximate", functools.partial(keras.activations.gelu, approximate=True)),
        ("gelu", lambda t: C.apply_activation(t, None, "gelu", training=True)),
        ("gelu_approximate", lambda t: C.apply_activation(t, None, C.GELU_APPROXIMATE, training=True)),
    )


@functools.lru_cache(maxsize=None)
def _templates(dtype):
    """Each form of `_forms` made once in a scratch graph on a placeholder of `dtype` (a DType's
    enum): (name, function, placeholder, output). Forms whose ops coincide are kept once."""
    dtype = tf.as_dtype(dtype)
    made, signatures = [], set()
    for kind, form in _forms():
        assert kind in fusion.ACTIVATION_GRAD_ACTIVATIONS, kind
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(dtype, None)
            y = form(x)
        signature = (kind, tuple((op.type, tuple(i.op.type for i in op.inputs)) for op in graph.get_operations()))
        if signature not in signatures:
            signatures.add(signature)
            made.append((kind, form, x, y))
    return tuple(made)


def _const_value(op):
    return tf.make_ndarray(op.get_attr("value"))


def _same_attrs(a, b):
    op_def = a.op_def
    inferred = set()
    for arg in op_def.input_arg:
        inferred.update(n for n in (arg.type_attr, arg.number_attr, arg.type_list_attr) if n)
    return all(a.get_attr(attr.name) == b.get_attr(attr.name) for attr in op_def.attr if attr.name not in inferred)


def _matches(pattern, t, placeholder, bound):
    """Whether tensor `t` is made by the same ops as `pattern` (a template's tensor), with
    `placeholder` standing for one tensor throughout (appended to `bound` once found)."""
    if pattern is placeholder:
        if bound:
            return bound[0] is t
        if t.dtype != placeholder.dtype:
            return False
        bound.append(t)
        return True
    a, b = pattern.op, t.op
    if (a.type != b.type or pattern.value_index != t.value_index or pattern.dtype != t.dtype
            or len(a.inputs) != len(b.inputs) or b.control_inputs):
        return False
    if a.type == "Const":
        want, got = _const_value(a), _const_value(b)
        return want.shape == got.shape and want.dtype == got.dtype and np.array_equal(want, got)
    if a.type == "Placeholder" or not _same_attrs(a, b):
        return False
    return all(_matches(p, i, placeholder, bound) for p, i in zip(a.inputs, b.inputs))


def match_activation(t):
    """``(name, form, input)`` when tensor `t` is one of `_forms`' activations of `input`, else None."""
    if not t.dtype.is_floating:
        return None
    for kind, form, placeholder, output in _templates(t.dtype.as_datatype_enum):
        bound = []
        if _matches(output, t, placeholder, bound):
            return kind, form, bound[0]
    return None


def _chain_activations(target, anchors, ops):
    """`Replay.activations`: the chain's tensors that `match_activation` finds, from `target` down
    through the replayed ops (and custom gradients' outputs, as `plan` walks them); a match's own
    ops are not searched further."""
    inside = {id(op) for op in ops}
    stop = {a.ref() for a in anchors}
    found, seen = [], set()

    def walk(t):
        if t.ref() in seen or t.ref() in stop:
            return
        seen.add(t.ref())
        match = match_activation(t)
        if match is not None:
            kind, form, x = match
            found.append((t, kind, form, x))
            walk(x)
            return
        op = t.op
        if op.type == "IdentityN" and len(op.inputs) == len(op.outputs):
            walk(op.inputs[t.value_index])
        elif id(op) in inside:
            for i in op.inputs:
                walk(i)

    walk(target)
    return tuple(found)


def _replayable(op):
    return op.type in fusion.REPLAYED_OPS and len(op.outputs) == 1 and not op.control_inputs


def _computed(t):
    """Whether `t` is computed in the step (not a constant)."""
    while t.op.type == "IdentityN":
        t = t.op.inputs[t.value_index]
    return t.op.type != "Const"


def apply(forward, x, replay):
    """``forward(x)``, with a gradient that keeps `replay.anchors` and makes `x` again from them.

    `forward` is the projection (one tensor in, one out) and may read variables; their gradients
    are TensorFlow's own for ``forward(rebuilt x)``. Keras' autocast scope of the call is entered
    again in the backward pass, so a mixed-precision layer reads its variables in the same dtype.
    """
    scope = keras_backend.get_autocast_scope()
    dtype = scope.dtype if scope is not None else None

    @tf.custom_gradient
    def run(*anchors):
        def grad(dy, variables=None):
            again = C.waiting_for(dy, anchors)
            return _gradients(lambda *a: forward(replay.rebuild(list(a))), again, variables, dy, dtype)

        return forward(x), grad

    return run(*replay.anchors)


def _gradients(fn, inputs, variables, dy, dtype):
    """TensorFlow's gradients of ``fn(*inputs)`` (the backward pass's `dy` flowing in) for `inputs` and
    `variables`, under the forward call's autocast `dtype`: ``(input grads, variable grads)``."""
    inputs, variables = list(inputs), list(variables or ())
    with keras_backend.AutocastScope(dtype), tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(inputs)
        tape.watch(variables)
        y = fn(*inputs)
    grads = tape.gradient(y, inputs + variables, output_gradients=dy)
    return grads[: len(inputs)], grads[len(inputs):]


# Ops between a norm and its projection that the rebuild makes again as they are (a dtype cast under
# mixed precision, a reshape to the projection's rows).
_NORM_PASSTHROUGH_OPS = frozenset({"Identity", "Reshape", "Cast"})


@dataclasses.dataclass(frozen=True)
class NormRebuild:
    """`target`, a norm op's output (`fusion.REBUILT_NORM_OPS`, through `_NORM_PASSTHROUGH_OPS`),
    made again in the backward pass from the norm's inputs (`anchors`), which its own gradient keeps.
    `norm_plan`'s answer; `apply_rebuilt` gives the gradient to `target` itself."""

    target: tf.Tensor
    norm: tf.Operation
    passthrough: tuple  # the ops from the norm's output 0 to `target`, in order

    @property
    def anchors(self):
        return tuple(self.norm.inputs)

    def rebuild(self, anchors, dy):
        """`target` made again: the norm once per backward graph (shared by every projection of its
        output, after the first incoming gradient `dy`), then the passthrough ops."""
        graph = tf.compat.v1.get_default_graph()
        cache = _REBUILT.setdefault(graph, {})
        key = self.norm.name
        if key not in cache:
            again = C.waiting_for(dy, list(anchors))
            cache[key] = _clone(self.norm, again)[0]
        t = cache[key]
        for op in self.passthrough:
            t = _clone(op, [t] + list(op.inputs[1:]))[0]
        return t


# Backward graph -> norm op name -> its rebuilt output (`NormRebuild.rebuild`).
_REBUILT = weakref.WeakKeyDictionary()


def norm_plan(x):
    """The `NormRebuild` of projection input `x`, or None: when `x` is not a graph tensor made by a
    norm of `fusion.REBUILT_NORM_OPS` (output 0, through `_NORM_PASSTHROUGH_OPS` of one input that
    matters), or the op library is not loaded here."""
    if not tf.is_symbolic_tensor(x) or not hasattr(x, "op") or not _is_float(x):
        return None
    passthrough, t = [], x
    while t.op.type in _NORM_PASSTHROUGH_OPS and not t.op.control_inputs:
        passthrough.append(t.op)
        t = t.op.inputs[0]
    op = t.op
    if op.type not in fusion.REBUILT_NORM_OPS or t.value_index != 0 or op.control_inputs:
        return None
    if _custom_op_function(op.type) is None:
        return None
    return NormRebuild(x, op, tuple(reversed(passthrough)))


def apply_rebuilt(forward, x, rebuild):
    """``forward(x)`` (a projection) whose gradient does not keep `x`: it makes `x` again with
    `rebuild` (a `NormRebuild`), takes TensorFlow's gradient of ``forward`` there for `x` and the
    variables `forward` reads (its kernel, LoRA factors, bias), and hands the gradient for `x` back
    to `x`, whose own producer (the norm) differentiates the sum once. The anchors get none."""
    scope = keras_backend.get_autocast_scope()
    dtype = scope.dtype if scope is not None else None
    anchors = rebuild.anchors

    @tf.custom_gradient
    def run(x, *anchors):
        def grad(dy, variables=None):
            (dx,), dvars = _gradients(forward, [rebuild.rebuild(anchors, dy)], variables, dy, dtype)
            return (dx,) + (None,) * len(anchors), dvars

        return forward(x), grad

    return run(x, *anchors)


def apply_projection(project, x, replay, fn, name, training):
    """A projection layer's training call on `x` through `apply`.

    ``project(x, activate)`` is the layer's call, with or without its activation `fn` (`name`). An
    activation the backward pass recomputes anyway (`fusion.RECOMPUTED_ACTIVATIONS`: GELU) is applied
    after the replay's gradient, not inside it: the next projection (a feed-forward's second) then
    finds it over this one's pre-activation and replays it in turn. Other activations stay inside,
    next to the BiasAdd the remapper fuses them with.
    """
    run = apply_rebuilt if isinstance(replay, NormRebuild) else apply
    if C.recomputed_name(fn, name) is None:
        return run(lambda t: project(t, True), x, replay)
    pre = run(lambda t: project(t, False), x, replay)
    return C.apply_activation(pre, fn, name, training)
