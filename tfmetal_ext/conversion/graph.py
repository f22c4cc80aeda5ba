"""The walk of one functional graph: its call nodes in order, their consumers and call counts."""

from __future__ import annotations

import collections


def policy_name(layer):
    return layer.dtype_policy.name


class Graph:
    """Consumers and call counts of one functional graph.

    Args:
        fn: a Functional model (a Sequential's ``_functional``).
        keep_output_names: the graph's outputs keep their layers' names, so
            no layer whose output is a model output is absorbed into the one
            before it (true at the top level only: a nested model's output
            names are invisible to the outer graph).
    """

    def __init__(self, fn, keep_output_names=True):
        self.fn = fn
        self.keep_output_names = keep_output_names
        depths = sorted(fn._nodes_by_depth, reverse=True)
        self.nodes = [n for d in depths for n in fn._nodes_by_depth[d] if n.operation is not None and not n.is_input]
        self.consumers = collections.defaultdict(list)
        for n in self.nodes:
            for kt in n.input_tensors:
                self.consumers[id(kt)].append(n)
        self.outputs = {id(t) for t in fn.outputs}
        self.calls = collections.Counter(id(n.operation) for n in self.nodes)

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
            or user.operation.trainable != node.operation.trainable
            or policy_name(user.operation) != policy_name(node.operation)
        ):
            return None
        return user
