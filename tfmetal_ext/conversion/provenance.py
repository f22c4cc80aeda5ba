"""What a converted layer was made from: recorded by `convert`, read by `to_stock`.

`convert()` (training form) records on each new layer that replaced stock layers a `Source`: the
class and config of every stock layer it replaced, head first (a conv, the batch norm and the
activation layer it absorbed), and the head's bias where the new layer has none (a conv bias moved
into a `ConvBNAct`'s moving mean). `to_stock` re-makes those layers under their own names and
configs. The record is a plain attribute, not tracked or saved: a model loaded from a file has none.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

ATTRIBUTE = "_tfmetal_ext_source"


@dataclasses.dataclass(frozen=True)
class Source:
    """The stock layers one converted layer replaced.

    Attributes:
        layers: ``(class, config)`` of each replaced layer (or Keras operation), head first, in
            call order (each called on the output of the one before).
        head_bias: the head's bias as it was (numpy), when the new layer holds none (its value
            moved into the moving mean); else None.
        call_kwargs: the keyword arguments each layer was called with in the stock graph (plain
            values only), or None where one was a tensor.
    """

    layers: tuple
    head_bias: np.ndarray | None = None
    call_kwargs: tuple | None = None

    @property
    def names(self):
        return tuple(config.get("name") for _, config in self.layers)


def record(new_layer, plan):
    """Records on `new_layer` the stock layers of `plan` (a ``replace`` plan) it replaced."""
    ops = [n.operation for n in plan.nodes]
    try:
        layers = tuple((type(op), op.get_config()) for op in ops)
    except Exception:  # a layer whose config cannot be read: no record, to_stock names its own layers
        return
    head = ops[0]
    bias = None
    if getattr(head, "use_bias", False) and getattr(head, "bias", None) is not None \
            and getattr(new_layer, "use_bias", None) is None:
        bias = np.array(keras.ops.convert_to_numpy(head.bias))
    kwargs = tuple(dict(getattr(getattr(n, "arguments", None), "kwargs", {}) or {}) for n in plan.nodes)
    if any(isinstance(v, keras.KerasTensor) for kw in kwargs for v in keras.tree.flatten(kw)):
        kwargs = None
    object.__setattr__(new_layer, ATTRIBUTE, Source(layers, bias, kwargs))


def of(layer):
    """The `Source` recorded on `layer`, or None."""
    return getattr(layer, ATTRIBUTE, None)
