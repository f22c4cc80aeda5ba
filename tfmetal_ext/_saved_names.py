"""A fusion-first layer that a ``.keras`` file records under the stock class's name.

Keras addresses the layers of a Functional model's ``layers`` list in a saved file by their class
name (``saving_lib._save_container_state``: ``layers/layer_normalization``, ``layers/dropout_1``,
...), not by their attribute or layer name. A Functional *subclass* (a keras-hub backbone or task,
a ``class Net(keras.Model)`` built from inputs and outputs) is loaded through its own
``from_config``, which builds its graph from stock layers again. So where `convert()` put
``FusedLayerNorm`` in place of a graph-level ``LayerNormalization`` of such a model, the file keys
its weights ``layers/fused_layer_norm`` and the rebuilt stock model looks for
``layers/layer_normalization``: Keras refuses the load.

`saved_as` makes such a layer an instance of an *alias*: a subclass of its own class that adds
nothing but the stock class's ``__name__``. Its weights are then saved where the stock model
looks for them, so the file loads into the stock class (the stock layers) anywhere, and
``load_weights`` works between the converted model and a stock one in both directions. The alias
keeps its fused class's module, serializes under the fused class's registered name (so a config
holding it directly deserializes to the fused class), and `unaliased` gives the fused class back
wherever this package looks a class up.
"""

from __future__ import annotations

_ALIASES = {}  # (fused class, stock name) -> alias class


def saved_as(layer, stock_name):
    """`layer`, made an instance of the alias of its class named `stock_name`; the layer itself."""
    cls = unaliased(type(layer))
    if cls.__name__ == stock_name:
        return layer
    alias = _ALIASES.get((cls, stock_name))
    if alias is None:
        alias = type(stock_name, (cls,), {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__}, saved under the stock class name {stock_name!r} (see "
                       f"tfmetal_ext._saved_names).",
            "_tfmetal_alias_of": cls,
        })
        _register_name(alias, cls)
        _ALIASES[(cls, stock_name)] = alias
    object.__setattr__(layer, "__class__", alias)
    return layer


def unaliased(cls):
    """The fused class `cls` is an alias of (`saved_as`), else `cls`."""
    return cls.__dict__.get("_tfmetal_alias_of", cls)


def _register_name(alias, cls):
    """Serialize `alias` under `cls`'s registered name (``tfmetal_ext>FusedLayerNorm``), so that a
    config holding an aliased layer deserializes to `cls`. Keras keeps the class -> name map in
    ``object_registration.GLOBAL_CUSTOM_NAMES``; without it (another Keras) the alias serializes by
    its own name, which only a config that holds the layer directly would meet."""
    try:
        from keras.src.saving import object_registration
    except ImportError:  # pragma: no cover - another Keras layout
        return
    names = getattr(object_registration, "GLOBAL_CUSTOM_NAMES", None)
    if isinstance(names, dict) and cls in names:
        names[alias] = names[cls]
