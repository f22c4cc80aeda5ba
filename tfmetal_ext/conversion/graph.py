"""The walk of one functional graph: its call nodes in order, their consumers and call counts."""

from __future__ import annotations

import collections

import keras


def policy_name(op):
    """The dtype policy of a layer; None for a Keras operation (``keras.ops``), which has none."""
    policy = getattr(op, "dtype_policy", None)
    return policy.name if policy is not None else None


def trainable(op):
    """A layer's trainable flag; a Keras operation (no weights) goes with whatever it follows."""
    return getattr(op, "trainable", None)


def graph_models(model):
    """Every Functional graph reachable from `model` through the nodes of graphs (itself first).

    A Sequential counts as its ``_functional``. Only graph nodes are followed: a model held by
    a subclassed layer is converted by a `Converter` of its own and counted there.
    """
    from keras.src.models.functional import Functional

    def fn_of(m):
        if isinstance(m, keras.Sequential):
            return getattr(m, "_functional", None)
        return m if isinstance(m, Functional) else None

    found, seen, todo = [], set(), [model]
    while todo:
        fn = fn_of(todo.pop())
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        found.append(fn)
        for nodes in fn._nodes_by_depth.values():
            todo += [n.operation for n in nodes if isinstance(n.operation, keras.Model)]
    return found


def call_counts(model):
    """How many times each operation is called across all graphs of `model` (`graph_models`).

    A layer called once in a nested model and once in the model around it (a CausalLM's tied
    token embedding: the backbone's input embedding and the task's output projection) is shared:
    it becomes one new layer, so nothing may be merged into it for one call only.
    """
    counts = collections.Counter()
    for fn in graph_models(model):
        for d in fn._nodes_by_depth.values():
            counts.update(id(n.operation) for n in d if n.operation is not None and not n.is_input)
    return counts


class Graph:
    """Consumers and call counts of one functional graph.

    Args:
        fn: a Functional model (a Sequential's ``_functional``).
        keep_output_names: the graph's outputs keep their layers' names, so
            no layer whose output is a model output is absorbed into the one
            before it (true at the top level only: a nested model's output
            names are invisible to the outer graph).
        calls: call counts over the whole model being converted (`call_counts`),
            else this graph's own.
    """

    def __init__(self, fn, keep_output_names=True, calls=None):
        self.fn = fn
        self.keep_output_names = keep_output_names
        depths = sorted(fn._nodes_by_depth, reverse=True)
        self.nodes = [n for d in depths for n in fn._nodes_by_depth[d] if n.operation is not None and not n.is_input]
        self.consumers = collections.defaultdict(list)
        for n in self.nodes:
            for kt in n.input_tensors:
                self.consumers[id(kt)].append(n)
        self.outputs = {id(t) for t in fn.outputs}
        self.calls = calls if calls is not None else collections.Counter(id(n.operation) for n in self.nodes)

    def shared(self, layer):
        return self.calls[id(layer)] > 1

    def next_layer(self, node):
        """The node that alone consumes `node`'s single output, when it can be merged into `node`."""
        if len(node.outputs) != 1 or id(node.outputs[0]) in self.outputs:
            return None
        users = self.consumers[id(node.outputs[0])]
        if len(users) != 1:
            return None
        user = users[0]
        if self.keep_output_names and any(id(t) in self.outputs for t in user.outputs):
            return None  # merging it would rename a model output
        args, kwargs = user.arguments.args, user.arguments.kwargs
        if (
            self.shared(user.operation)
            or len(user.input_tensors) != 1
            or len(args) != 1
            or args[0] is not node.outputs[0]
            or {k for k, v in kwargs.items() if v is not None} - {"training"}
            or trainable(user.operation) not in (None, trainable(node.operation))
            or policy_name(user.operation) not in (None, policy_name(node.operation))
        ):
            return None
        return user
