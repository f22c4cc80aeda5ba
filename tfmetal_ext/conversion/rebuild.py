"""The rebuild: a model's graph walked call by call, each call planned (`planners`) and re-made."""

from __future__ import annotations

import inspect

import keras

from tfmetal_ext import _saved_names as saved_names
from tfmetal_ext.conversion import copying, planners, provenance, weights
from tfmetal_ext.conversion.graph import Graph, call_counts
from tfmetal_ext.conversion.report import Kept


def _call_kwargs_reason(node, cls):
    """Why a call of `node` cannot be passed to `cls` (a non-None argument its call does not take)."""
    accepted = inspect.signature(cls.call).parameters
    # `training` only matters to layers that take it; the others behave the same either way.
    extra = [k for k, v in node.arguments.kwargs.items()
             if v is not None and k not in accepted and k != "training"]
    if extra:
        return f"called with {', '.join(extra)}, which {cls.__name__} does not take"
    return None


def _not_walkable(model):
    return ValueError(
        "convert() walks the layer graph of a Functional or Sequential model; a subclassed "
        f"model has no graph to walk. Received: model={getattr(model, 'name', model)!r} ({type(model).__name__})"
    )


class Converter:
    """Rebuilds one Functional or Sequential model (nested ones by a `Converter` of their own).

    Args:
        inference: make the inference form (batch norms folded).
        report: the `ConversionReport` every rewrite, kept layer and note goes to.
        prefix: the ``outer/`` prefix of a nested model's layer labels.
        new_layers: the map a nested model's `Converter` shares with the one around it.
        calls: the call counts of the whole model (`graph.call_counts`) a nested `Converter` shares.
        planning: what plans each call and each sublayer: an object with ``plan(ctx, node)`` and
            ``plan_sublayer(layer, path, inference, calls)`` (default: the `planners` module, the
            stock -> fused direction; `to_stock` passes the reverse one). A plan of kind
            ``"expand"`` makes a callable `Expansion`-like object (``name``, ``layers``, ``chain``)
            that calls several new layers on the node's inputs.

    Attributes:
        pairs: ``(stock variable, new variable)`` pairs whose gradients must match.
        new_layers: id of a stock layer (or variable) -> its new one, over the whole conversion
            (nested models, the sublayers and variables of kept copies included): a layer
            reachable along two paths (called in a backbone and again in the task around it, or
            held by a kept layer and called in the graph) is made once, and a variable two layers
            hold is copied once, so the copy keeps the stock model's identities.
        graph: after `convert_model`, ``(new inputs, correspondences)``: per new layer call,
            ``(label, class name, stock output tensor, new output tensor)``, for verification.
    """

    def __init__(self, inference, report, prefix="", in_place=False, new_layers=None, calls=None, planning=None):
        self.inference = inference
        self.planning = planning if planning is not None else planners
        self.report = report
        self.prefix = prefix
        self.in_place = in_place
        self.pairs = []
        self.new_layers = new_layers if new_layers is not None else {}
        self.calls = calls
        self.swaps = {}  # id of a stock layer -> the sublayer swaps of its copy
        self.graph = None
        self.made = []  # the new layer (or expansion) of each call of the last graph walked, in order

    def _label(self, name):
        return f"{self.prefix}{name}"

    def convert_model(self, model):
        """A converted copy of a Functional or Sequential model (same name)."""
        from keras.src.models.functional import Functional

        if isinstance(model, keras.Sequential):
            fn = getattr(model, "_functional", None)
            if fn is None:
                raise ValueError(
                    "Only a built Sequential model (with an Input or called once) can be converted. "
                    f"Received: model={model.name!r} (not built)"
                )
        elif isinstance(model, Functional):
            fn = model
        else:
            raise _not_walkable(model)
        if self.calls is None:
            self.calls = call_counts(model)
        ins, outs, corr = self.convert_functional(fn)
        self.graph = (ins, corr)
        if fn is model:
            return self._functional_like(model, ins, outs)
        inp = fn.inputs[0]._keras_history.operation
        layers = [type(inp).from_config(inp.get_config())]
        seen = set()
        for made in self.made:
            for new_layer in getattr(made, "layers", None) or [made]:
                if id(new_layer) not in seen:
                    seen.add(id(new_layer))
                    layers.append(new_layer)
        if not all(getattr(m, "chain", True) for m in self.made):
            # An expansion that is no chain of layers (a residual block's add): a Sequential cannot hold it.
            self.report.notes.append(f"{self._label(model.name)}: returned as a Functional model, not a "
                                     "Sequential (an expanded layer is no chain of layers)")
            return keras.Model(ins, outs, name=model.name, trainable=model.trainable)
        return keras.Sequential(layers, name=model.name, trainable=model.trainable)

    def _functional_like(self, model, ins, outs):
        """The new graph as a model of `model`'s own class when that is a Functional subclass (a
        keras-hub backbone or task, a user's ``class Net(keras.Model)`` built from inputs and
        outputs), with its attributes carried over (`copying.functional_copy`); else a plain
        Functional model."""
        from keras.src.models.functional import Functional

        if type(model) in (Functional, keras.Model) or copying._is_stock(model):
            return keras.Model(ins, outs, name=model.name, trainable=model.trainable)
        label = self.prefix.rstrip("/") or model.name
        try:
            new = copying.functional_copy(model, ins, outs, self.new_layers, label, self.pairs)
        except copying.NotCopyable as e:
            self.report.notes.append(f"{label}: returned as a plain Functional model, not "
                                     f"{type(model).__name__}: {e}")
            return keras.Model(ins, outs, name=model.name, trainable=model.trainable)
        self._keep_saved_names(model, new, label)
        return new

    def _keep_saved_names(self, stock, new, label):
        """`new`'s graph-level replacements saved under their stock classes' names (`saved_names`).

        `stock`'s class rebuilds stock layers when a ``.keras`` file of `new` is loaded, and Keras
        finds a graph-level layer's weights by its class name. Each one-to-one replacement is made an
        alias named as the layer it replaced, so the file loads into the stock class. Where the
        graph's layers no longer match one to one (a merge: Conv2D + BatchNormalization +
        Activation -> ConvBNAct), the file cannot load into the stock class, and a note says so.
        (Sublayers of kept layers: `copying.keep_saved_names`, which re-makes the layer to compare; here
        the conversion's own stock -> new mapping says the same without building a second graph.)"""
        stock_names = [type(x).__name__ for x in stock.layers]
        in_graph = {id(x) for x in new.layers}
        for s in stock.layers:
            n = self.new_layers.get(id(s))
            if n is not None and id(n) in in_graph and copying.is_ours(n):
                saved_names.saved_as(n, type(s).__name__)
        new_names = [type(x).__name__ for x in new.layers]
        if new_names != stock_names:
            gone = sorted(set(stock_names) - set(new_names)) or sorted(set(new_names) - set(stock_names))
            self.report.notes.append(
                f"{label}: a .keras file of the result does not load into {type(stock).__name__}, which "
                f"rebuilds its stock layers on load: its graph-level layers were merged ({', '.join(gone)}); "
                "save_weights() / load_weights() between converted models round-trip")

    def convert_functional(self, fn):
        """Rebuilds functional graph `fn`; returns (new inputs struct, new outputs struct, correspondences)."""
        # A nested model's output names are invisible to the outer graph: only the top level keeps them.
        ctx = planners.PlanContext(Graph(fn, keep_output_names=not self.prefix, calls=self.calls), self.inference,
                                   self.prefix)
        tensors = {}
        new_inputs = []
        for kt in fn.inputs:
            inp_layer = kt._keras_history.operation
            clone = type(inp_layer).from_config(inp_layer.get_config())
            tensors[id(kt)] = clone.output
            new_inputs.append(clone.output)
        absorbed = set()
        corr = []
        self.made = []
        for node in ctx.graph.nodes:
            if id(node) in absorbed:
                continue
            plan, reason = self.planning.plan(ctx, node)
            if plan.kind == "replace":
                why = _call_kwargs_reason(node, type(plan.make()))
                if why:
                    plan, reason = planners.keep(node, why)
            absorbed.update(id(n) for n in plan.nodes[1:])
            out, new_layer = self._call(plan, reason, node, tensors)
            self.made.append(new_layer)
            last = plan.nodes[-1]
            for old, new in zip(last.outputs, keras.tree.flatten(out)):
                tensors[id(old)] = new
            label = self._label(new_layer.name)
            if last.operation.name != new_layer.name:
                label += f" (stock: {last.operation.name} output)"
            corr.append((label, type(new_layer).__name__, last.outputs[0], keras.tree.flatten(out)[0]))
        in_struct = keras.tree.pack_sequence_as(fn._inputs_struct, new_inputs)
        out_struct = keras.tree.map_structure(lambda t: tensors[id(t)], fn._outputs_struct)
        return in_struct, out_struct, corr

    def _call(self, plan, reason, node, tensors):
        """Calls the new layer of `plan` (made on its first call) on the new tensors of `node`'s inputs."""
        new_layer = self.new_layers.get(plan.layer_key)
        first = new_layer is None
        if first:
            new_layer, kind = self._instantiate(plan, reason)
            if kind == "replace" and self.planning is planners and not self.inference:
                provenance.record(new_layer, plan)
            self.new_layers[plan.layer_key] = new_layer
        args, kwargs = node.arguments.fill_in(tensors)
        if plan.kind == "replace":
            accepted = inspect.signature(new_layer.call).parameters
            kwargs = {k: v for k, v in kwargs.items() if k in accepted or (v is not None and k != "training")}
        for n in plan.nodes[1:]:
            if "training" in n.arguments.kwargs:
                kwargs["training"] = n.arguments.kwargs["training"]
        out = new_layer(*args, **kwargs)
        if first:
            self._after_build(plan, kind, new_layer)
        return out, new_layer

    def _instantiate(self, plan, reason):
        """The new layer of `plan` and how its weights are set: the plan's kind, or ``"reuse"``."""
        layer = plan.nodes[0].operation
        if plan.kind in ("replace", "expand"):
            self.report.rewrites.append(plan.rewrite)
            return plan.make(), plan.kind
        if plan.kind == "model":
            sub = Converter(self.inference, self.report, prefix=f"{self.prefix}{layer.name}/",
                            in_place=self.in_place, new_layers=self.new_layers, calls=self.calls,
                            planning=self.planning)
            new = sub.convert_model(layer)
            self.pairs += sub.pairs
            return new, plan.kind
        if plan.kind == "op":
            self.report.kept.append(Kept(self._label(layer.name), type(layer).__name__, reason))
            return _copy_operation(layer), plan.kind
        # keep: an independent copy (same constructor arguments; state copied once built), whose
        # sublayers with fusion-first drop-ins are swapped when it is a subclass; retype: the same
        # copy, made an instance of the plan's method-only subclass.
        label = self._label(layer.name)
        new, kind, swaps = self.copy_deep(layer, label)
        if plan.kind == "retype":
            copying.retype(new, plan.make)
            self.swaps[id(layer)] = swaps
            self.report.rewrites.append(plan.rewrite)
            return new, kind
        self.swaps[id(layer)] = swaps
        if swaps:
            reason += f"; copied with {len(swaps)} sublayer(s) swapped for fusion-first ones (listed as rewrites)"
        self.report.kept.append(Kept(label, type(layer).__name__, reason))
        return new, kind

    def copy_deep(self, layer, label):
        """``(copy, kind, swaps)`` of a kept layer: an unbuilt copy with its subclass sublayers swapped.

        With ``in_place``, a layer that cannot be copied has its sublayers swapped in the input
        model itself (kind ``"in_place"``); otherwise `copying.NotCopyable` is raised.
        """
        try:
            new = copying.construct(layer, label)
        except copying.NotCopyable:
            if not self.in_place:
                raise
            swaps = self._swap(layer, layer, label)
            self.report.notes.append(
                f"{label}: could not be copied; converted in place (in_place=True): the input model's own "
                f"{type(layer).__name__} now holds the swapped sublayers and is shared with the result"
            )
            for plan in (p for p in swaps.values() if p.nodes):
                copying.build_like(plan.nodes[0].operation, plan.made)
                plan.copy(plan.made, self.pairs)
            return layer, "in_place", swaps
        swaps = self._swap(layer, new, label) if not copying._is_stock(layer) else {}
        if swaps:
            copying.keep_saved_names(new)
        return new, "keep", swaps

    def _swap(self, stock, copy, label):
        calls = _sublayer_calls(stock)

        def plan_fn(sub, path):
            made = self.new_layers.get(id(sub))
            if made is not None:  # already made for another path to it: the copy holds that one too
                return planners.Plan("replace", [], make=lambda: made, copy=lambda new_, pairs: None,
                                     rewrite=None, layer_key=id(sub))
            if copying._is_graph_model(sub):
                return self._graph_swap(sub, path)
            plan_, reason = self.planning.plan_sublayer(sub, path, self.inference, calls)
            if plan_ is None and reason:
                self.report.kept.append(Kept(path, type(sub).__name__, reason))
            if plan_ is not None and plan_.kind == "replace" and plan_.nodes and self.planning is planners \
                    and not self.inference:
                plan_.make = _recording(plan_)
            return plan_

        return copying.swap_sublayers(stock, copy, label, plan_fn, self.report)

    def _graph_swap(self, sub, path):
        """A Functional / Sequential model held by a subclass: converted by a `Converter` of its own
        (its graph is visible, so merges apply inside it); a plan whose weight copy is already done."""
        if not sub.built or (isinstance(sub, keras.Sequential) and getattr(sub, "_functional", None) is None):
            return None
        inner = Converter(self.inference, self.report, prefix=f"{path}/", in_place=self.in_place,
                          new_layers=self.new_layers, planning=self.planning)
        new = inner.convert_model(sub)
        self.pairs += inner.pairs
        return planners.Plan("replace", [], make=lambda: new, copy=lambda new_, pairs: None,
                             rewrite=None, layer_key=id(sub))

    def _after_build(self, plan, kind, new_layer):
        layer = plan.nodes[0].operation
        if kind in ("replace", "expand"):
            start = len(self.pairs)
            plan.copy(new_layer, self.pairs)
            for a, b in self.pairs[start:]:  # a kept layer holding one of these variables shares the copy
                self.new_layers.setdefault(id(a), b)
        elif kind == "keep":
            copying.transfer_state(layer, new_layer, self.pairs, self.swaps.get(id(layer)), self._label(layer.name),
                                   copies=self.new_layers)
        elif kind in ("reuse", "in_place"):
            self.pairs += [(w, w) for w in layer.trainable_weights if not any(w is b for _, b in self.pairs)]


def _recording(plan):
    """`plan`'s make, the new layer recording the stock layer it replaced (`provenance`)."""
    make = plan.make

    def make_and_record():
        new = make()
        provenance.record(new, plan)
        return new

    return make_and_record


def _copy_operation(op):
    """A Keras operation of the graph (stateless: no weights, no seed) re-made from its config, so the
    result shares no object with the stock model; the operation itself where its config does not
    re-make it (constructor arguments Keras could not record)."""
    try:
        new = type(op).from_config(op.get_config())
    except Exception:  # arbitrary constructor: the stateless operation itself computes the same
        return op
    return new if type(new) is type(op) else op


def _sublayer_calls(layer):
    """How many times each sublayer object is reachable in `layer`'s tree (a shared sublayer, > 1)."""
    import collections

    counts = collections.Counter()
    for sub in layer._flatten_layers(include_self=False, recursive=True):
        counts[id(sub)] += 1
    return counts
