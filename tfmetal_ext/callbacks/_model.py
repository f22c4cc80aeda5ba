"""What the callback's parts read off a Keras model: stock classes, leaf layers, layers by path."""

from __future__ import annotations


def is_stock(obj):
    """`obj` is an instance of a stock Keras class (module ``keras.*``), not a subclass defined elsewhere."""
    return type(obj).__module__.startswith("keras.")


def leaf_layers(model):
    """The layers that hold no sublayers, nested models and containers flattened."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return list(model.layers)
    return [l for l in flatten(include_self=False, recursive=True) if not getattr(l, "_layers", None)]


def find_layer(model, path):
    """The layer a report row's path (``"block_1/conv2d"`` or ``"conv2d"``) names, or None.

    Paths are the reports' own (`tfmetal_ext.inspect.LayerIndex`): sublayers of
    subclassed layers and wrapped layers included.
    """
    if path is None:
        return None
    from tfmetal_ext.inspect import LayerIndex

    layer = LayerIndex(model).layers.get(path)
    if layer is not None:
        return layer
    for l in leaf_layers(model):
        if l.name == path or path.endswith("/" + l.name):
            return l
    return None


def steps_per_call(model):
    """Train steps one call of ``model.train_function`` runs (``steps_per_execution``)."""
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))
