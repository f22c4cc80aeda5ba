"""Copies that share no state with the stock layer: construction, state transfer, sublayer swaps.

A kept layer (and every subclassed layer or model) is copied in three steps:

1. `construct`: a new, unbuilt instance of the same class with the same
   constructor arguments: ``from_config(get_config())``, else the arguments
   Keras recorded when the layer was made (``Operation.__new__`` stores them
   as ``_auto_config`` when they are plain values), which is how a subclass
   whose ``__init__`` takes no ``**kwargs`` is copied. A layer neither can
   re-create is refused (`NotCopyable`), never shared.
2. `swap_sublayers` (subclasses only): every tracked sublayer of the copy (in
   attributes, lists and dicts) whose stock counterpart has a one-to-one
   planner (`planners.plan_sublayer`) is replaced by its fusion-first class,
   before the copy is built. The subclass keeps its own ``call``.
3. `transfer_state`, once the copy is built: the stock object tree and the
   copy's are walked in parallel the way Keras' own saving walks them
   (``saving_lib._walk_saveable``). Each object's own state goes through its
   own ``save_own_variables`` / ``load_own_variables`` and
   ``save_assets`` / ``load_assets``, exactly what a ``.keras`` save and load
   does, so adapted preprocessing state is finalized the way Keras finalizes
   it (``Normalization.finalize_state``, lookup vocabularies, TF-IDF
   weights); swapped sublayers get their planner's weight copy.
"""

from __future__ import annotations

import collections.abc
import contextlib
import shutil
import tempfile

import keras

from tfmetal_ext import _saved_names as saved_names
from tfmetal_ext.conversion import weights
from tfmetal_ext.inspect import step


class NotCopyable(ValueError):
    """A layer that cannot be re-created as an independent copy (the message says why)."""


def _is_stock(obj):
    return type(obj).__module__.startswith("keras.")


def _is_graph_model(obj):
    from keras.src.models.functional import Functional

    return isinstance(obj, (keras.Sequential, Functional))


@contextlib.contextmanager
def _global_policy(policy):
    """The global dtype policy set to `policy` while a copy's sublayers are made (they read it)."""
    saved = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(policy)
        yield
    finally:
        keras.config.set_dtype_policy(saved)


def construct(layer, label):
    """A new, unbuilt `layer` of the same class and constructor arguments (name, trainable and policy kept).

    Raises:
        NotCopyable: when neither ``from_config(get_config())`` nor the constructor
            arguments Keras recorded re-create the layer.
    """
    cls = type(layer)
    errors = []
    policy = layer.dtype_policy
    with _global_policy(policy.name if not isinstance(policy, keras.dtype_policies.DTypePolicyMap) else "float32"):
        try:
            config = layer.get_config()
        except Exception as e:  # arbitrary user code
            config = None
            errors.append(f"get_config() failed ({type(e).__name__}: {_first_line(e)})")
        if config is not None:
            fuller = with_kept_arguments(layer, config)
            for candidate in ([fuller, config] if fuller is not config else [config]):
                try:
                    return step.from_config(layer, candidate)
                except Exception as e:  # arbitrary user code
                    errors.append(f"from_config(get_config()) failed ({type(e).__name__}: {_first_line(e)})")
        auto = getattr(layer, "_auto_config", None)
        if auto is None:
            errors.append("Keras recorded no constructor arguments (some are not plain values, or *args)")
        else:
            try:
                new = cls(**auto.config)
            except Exception as e:
                errors.append(f"{cls.__name__}(**recorded constructor arguments) failed ({type(e).__name__}: "
                              f"{_first_line(e)})")
            else:
                new.name = layer.name
                new.trainable = layer.trainable
                if new.dtype_policy.name != policy.name:
                    new.dtype_policy = policy
                return new
        base = next((c for c in cls.__mro__ if _is_stock_class(c)), None)
        if base in (keras.layers.Layer, keras.Model):
            try:
                return _shell_copy(layer, base, label)
            except NotCopyable as e:
                errors.append(f"its attributes could not be copied ({e})")
    raise NotCopyable(
        f"convert() cannot make an independent copy of layer {label!r} ({cls.__module__}.{cls.__name__}): "
        + "; ".join(errors) + ". Give the class a get_config() whose output its constructor accepts, or pass "
        "convert(..., in_place=True) to swap its sublayers in the input model itself. "
        f"Received: layer={label!r}"
    )


_PLAIN_VALUES = (bool, int, float, str, type(None))


def with_kept_arguments(layer, config):
    """`config` plus the constructor arguments its ``get_config()`` leaves out that the layer keeps under
    their own name as plain values (``self.use_sliding_window_attention = use_sliding_window_attention``),
    or `config` itself when there are none.

    Some classes' configs omit arguments (keras-hub's ``QwenTransformerDecoder`` drops its sliding window):
    a copy made from the config alone would silently compute something else. Only arguments the
    constructor names explicitly and the layer holds as a bool, number, string or None are added.
    """
    import inspect

    try:
        params = inspect.signature(type(layer).__init__).parameters
    except (TypeError, ValueError):
        return config
    missing = {}
    for name, param in params.items():
        if name == "self" or name in config or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        value = layer.__dict__.get(name, inspect.Parameter.empty)
        if isinstance(value, _PLAIN_VALUES) and not (param.default is not param.empty and value == param.default
                                              and type(value) is type(param.default)):
            missing[name] = value
    return dict(config, **missing) if missing else config


def is_ours(obj):
    """True for an instance of a tfmetal_ext class (a fused drop-in, a retype or saved-name alias)."""
    return type(obj).__module__.startswith("tfmetal_ext.")


def _is_stock_class(cls):
    return cls.__module__.startswith("keras.")


def same_class(stock, copy):
    """True when `copy` is of `stock`'s class, or of a tfmetal_ext subclass of it (a retyped copy); or,
    for a tfmetal_ext `stock` (`to_stock`'s direction), of the stock class it stands for: its
    `planners.stock_class`, or the keras-hub class a retype subclass (``fused_name``) extends."""
    if type(copy) is type(stock) or (
            type(copy).__module__.startswith("tfmetal_ext.") and isinstance(copy, type(stock))):
        return True
    if not type(stock).__module__.startswith("tfmetal_ext."):
        return False
    from tfmetal_ext.conversion import planners

    return type(copy) is planners.stock_class(type(stock)) or (
        hasattr(type(stock), "fused_name") and type(copy) is type(stock).__mro__[1])


def retype(layer, cls):
    """`layer` (a copy, built or not) made an instance of `cls`, a method-only subclass of its class.

    A ``retype`` plan's fusion-first subclasses add methods and no state, so the
    copy keeps its constructor arguments, sublayers and variables as they are.
    """
    if not (isinstance(cls, type) and isinstance(layer, cls.__mro__[1])):
        raise TypeError(f"{cls!r} is not a subclass of {type(layer).__name__}. Received: cls={cls!r}")
    object.__setattr__(layer, "__class__", cls)
    return layer


# Attributes Keras and TF set on a layer or model after its base __init__ (training, tracking, build):
# not the user's own state, never copied by `_shell_copy`.
_INTERNAL = frozenset((
    "_compile_config", "_compiled_trainable_state", "_eval_epoch_iterator", "history", "optimizer",
    "stop_training", "_build_shapes_dict", "train_function", "test_function", "predict_function",
    "make_train_function", "make_test_function", "make_predict_function",
))


def _shell_copy(layer, base, label):
    """A copy made without the subclass's ``__init__``: the base Keras ``__init__``, then each of the
    user's attributes copied (sublayers by `construct`, variables fresh, plain values as they are).

    Keras records no constructor arguments of a subclassed `keras.Model` (``Model.__new__``
    drops them), so this is how ``class Net(keras.Model): def __init__(self, classes)`` is copied.
    The attributes are set in the order the subclass set them, so sublayers and weights keep
    their order.
    """
    cls = type(layer)
    new = cls.__new__(cls)
    base.__init__(new, name=layer.name, trainable=layer.trainable, dtype=layer.dtype_policy)
    internal = set(vars(new)) | _INTERNAL

    def special(v, where):
        if isinstance(v, keras.layers.Layer):
            return construct(v, where)
        if isinstance(v, keras.Variable):
            return keras.Variable(v.value, dtype=v.dtype, trainable=v.trainable, name=v.name)
        return _PLAIN

    clone = _attribute_cloner(special)

    for k, v in vars(layer).items():
        if k in internal or k.startswith("_self_") or k.startswith("_keras"):
            continue
        value = clone(v, f"{label}/{k}")
        if isinstance(value, keras.Variable):
            new._track_variable(value)
            object.__setattr__(new, k, value)
        else:
            setattr(new, k, value)
    return new


def functional_copy(stock, inputs, outputs, copies, label, pairs):
    """A model of `stock`'s own class (a Functional subclass) over the new graph ``inputs -> outputs``.

    The subclass's ``__init__`` is not run (it would build its graph from fresh stock layers):
    the instance is made the way Keras makes a functional model (``keras.Model.__init__`` with
    the inputs and outputs), then each attribute the subclass set is carried over, in its order:

    - a layer the conversion made a new one for (`copies`: a graph call, a nested model, a
      sublayer of a kept copy) becomes that new layer, so an attribute and the graph keep
      pointing at one object (a backbone's ``token_embedding``, a task's ``backbone``);
    - a layer outside the graph that holds no variables (a keras-hub task's preprocessor, a
      tokenizer) is the same object: nothing in it is converted or trained, and sharing it
      keeps its vocabulary and assets as they are;
    - a layer outside the graph with variables is an independent copy (`construct`, its state
      copied; its trainable variables added to `pairs`);
    - a set of ids of stock layers (keras-hub's ``_functional_layer_ids``) becomes their copies' ids
      (ids of objects with no copy, the stock graph's input layers, are dropped);
    - containers are walked; plain values are kept (immutable ones, functions) or deep-copied.

    What ``compile()`` set is left out (the pipeline compiles the copy afresh).

    Raises:
        NotCopyable: an attribute that cannot be carried over (the message says which).
    """
    from keras.src.models.functional import Functional
    from keras.src.trainers.trainer import Trainer

    cls = type(stock)
    new = cls.__new__(cls)
    try:  # what keras.Model.__init__ does for inputs and outputs (the class already has Functional in its MRO)
        Trainer.__init__(new)
        Functional.__init__(new, inputs, outputs, name=stock.name, trainable=stock.trainable)
    except Exception as e:  # a subclass whose tracking refuses the bare functional init
        raise NotCopyable(f"{cls.__name__} could not be made from the new graph ({type(e).__name__}: "
                          f"{_first_line(e)})") from e
    internal = set(vars(new)) | _INTERNAL | _COMPILE_STATE | {"compiled", "_compile_config", "_loss_tracker",
                                                            "_compile_metrics", "_compile_loss", "_tracker"}

    def layer_of(v, where):
        if id(v) in copies:
            return copies[id(v)]
        if not v.weights:
            return v
        out = construct(v, where)
        build_like(v, out)
        transfer_state(v, out, pairs, label=where, copies=copies)
        return out

    def special(v, where):
        if isinstance(v, keras.layers.Layer):
            return layer_of(v, where)
        if isinstance(v, collections.abc.Set) and v and all(isinstance(i, int) for i in v) \
                and any(i in copies for i in v):
            return {id(copies[i]) for i in v if i in copies}  # the others (input layers) are no more
        if isinstance(v, keras.Variable):
            raise NotCopyable(f"attribute {where!r} is a variable outside the graph's layers")
        return _PLAIN

    clone = _attribute_cloner(special)

    for k, v in vars(stock).items():
        if k in internal or k.startswith("_self_") or k.startswith("_keras"):
            continue
        setattr(new, k, clone(v, f"{label}/{k}"))
    if new.dtype_policy.name != stock.dtype_policy.name:
        new.dtype_policy = stock.dtype_policy
    return new


_PLAIN = object()  # `_attribute_cloner`'s `special` hook: not a special value, copy it the plain way


def _attribute_cloner(special):
    """``clone(value, where)`` for a copy's attributes: `special(value, where)` first (sublayers,
    variables: the caller's rule), else containers element by element, immutable values and
    functions as they are, anything else deep-copied. Each object is cloned once (shared stays shared).
    """
    import copy as pycopy

    memo = {}

    def clone(v, where):
        if id(v) in memo:
            return memo[id(v)]
        out = special(v, where)
        if out is not _PLAIN:
            pass
        elif isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            out = [clone(x, f"{where}/{i}") for i, x in enumerate(v)]
            out = out if isinstance(v, list) else tuple(out)
        elif isinstance(v, dict):
            out = {k: clone(x, f"{where}/{k}") for k, x in v.items()}
        elif v is None or isinstance(v, (str, bytes, int, float, bool, complex, type)) or callable(v):
            out = v  # immutable, or a function / class: stateless
        else:
            try:
                out = pycopy.deepcopy(v)
            except Exception as e:
                raise NotCopyable(f"attribute {where!r} ({type(v).__name__}) cannot be copied: "
                                  f"{type(e).__name__}") from e
        memo[id(v)] = out
        return out

    return clone


def _first_line(e):
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


# ----------------------------------------------------------------------------
# The object tree.


# Attributes `keras.Model.compile()` sets (Keras' Trainer.compile): not the model's own state.
_COMPILE_STATE = frozenset(("optimizer", "loss", "_compile_loss", "_compile_metrics", "_loss_tracker"))


def children(obj):
    """``(attribute, child)`` of `obj` that hold state: Keras saveables and containers of them.

    The attributes Keras' own saving walks (``saving_lib._walk_saveable``), so a copy's
    state lands where a ``.keras`` load would put it.
    """
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.saving.saving_lib import _walk_saveable

    if _is_stock(obj) and not _is_graph_model(obj) and not getattr(obj, "_layers", None) \
            and not getattr(obj, "_seed_generators", None):
        return  # a stock leaf layer: its own variables are all its state
    graph = _is_graph_model(obj)
    for attr, child in _walk_saveable(obj):
        if attr == "layers" and not graph:
            continue  # a subclassed model's `layers` property: the same sublayers, under their own attributes
        if isinstance(child, keras.optimizers.Optimizer) or (
                isinstance(obj, keras.Model) and attr in _COMPILE_STATE):
            continue  # what compile() made (optimizer, loss, metrics): the copy is compiled afresh
        if isinstance(child, KerasSaveable) or (isinstance(child, (list, tuple, dict)) and _holds_saveable(child)):
            yield attr, child


def _holds_saveable(container, depth=0):
    from keras.src.saving.keras_saveable import KerasSaveable

    values = container.values() if isinstance(container, dict) else container
    for v in values:
        if isinstance(v, KerasSaveable):
            return True
        if isinstance(v, (list, tuple, dict)) and depth < 4 and _holds_saveable(v, depth + 1):
            return True
    return False


def _pairs_of(a, b, path):
    """Children of stock `a` and copy `b` matched by attribute (containers by index or key)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            raise NotCopyable(f"{path}: the copy's dict keys differ from the stock layer's")
        return [(f"{path}/{k}", a[k], b[k]) for k in a]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise NotCopyable(f"{path}: the copy holds {len(b) if isinstance(b, (list, tuple)) else b!r} "
                              f"items where the stock layer holds {len(a)}")
        return [(f"{path}/{i}", x, y) for i, (x, y) in enumerate(zip(a, b))]
    return [(f"{path}/{attr}" if path else attr, child, getattr(b, attr, None)) for attr, child in children(a)]


# ----------------------------------------------------------------------------
# Sublayer swaps (deep conversion).


def keep_saved_names(copy):
    """Swapped sublayers of kept copy `copy` that a ``.keras`` file keys by class name, named for the load.

    A kept (subclassed) layer is re-made on load from its config by its own constructor, which makes
    its sublayers again: stock ones, unless its config records them. Keras keys a sublayer held in a
    list (a Sequential's or Functional's ``layers``, a plain list attribute) by its class name, so a
    ``FusedDense`` saved as ``ffn/layers/fused_dense`` is not found where the re-made ``Dense`` looks
    (``ffn/layers/dense``). This re-makes `copy` from its config once (unbuilt: what the load makes),
    walks both trees the way Keras' saving walks them, and makes each of our layers in such a list,
    where the re-made tree has another class, a saved-name alias of that class (`_saved_names`).
    Attribute-held sublayers are keyed by attribute name and need none. A layer that cannot be re-made
    from its config is left as it is (its file could not load anyway). A Functional subclass's own
    graph layers are named by `rebuild.Converter._keep_saved_names` from the conversion's own mapping
    instead: re-making such a model from its config would build its whole graph, weights included.
    """
    from keras.src.saving.saving_lib import _walk_saveable

    try:
        rebuilt = type(copy).from_config(copy.get_config())
    except Exception:  # arbitrary constructors: nothing to compare with
        return
    seen = set()

    def children(obj):
        try:
            return list(_walk_saveable(obj))
        except Exception:
            return []

    def walk(a, b):
        if id(a) in seen:
            return
        seen.add(id(a))
        theirs = dict(children(b))
        for attr, x in children(a):
            y = theirs.get(attr)
            if isinstance(x, dict) and isinstance(y, dict):
                x, y = list(x.values()), list(y.values())
            if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
                for u, v in zip(x, y):
                    if not (isinstance(u, keras.layers.Layer) and isinstance(v, keras.layers.Layer)):
                        continue
                    if is_ours(u) and not is_ours(v):  # saved_as leaves a layer already so named
                        saved_names.saved_as(u, type(v).__name__)
                    walk(u, v)
            elif isinstance(x, keras.layers.Layer) and isinstance(y, keras.layers.Layer):
                walk(x, y)

    walk(copy, rebuilt)


def swap_sublayers(stock, copy, label, plan_fn, report):
    """Replaces the copy's sublayers that have one-to-one fusion-first drop-ins, before it is built.

    `plan_fn(stock_sublayer, path)` returns a ``replace`` `Plan` (or None to keep it).
    Returns ``{id(stock sublayer): plan}`` for `transfer_state`.
    """
    swaps = {}
    seen = set()

    def walk(a, b, path):
        if isinstance(a, keras.layers.Layer) and _made_in_build(a, b):
            before = list(getattr(b, "_layers", None) or ())
            build_like(a, b)  # sublayers its build() creates: build the copy first, then swap them
            _drop_replaced(b, before)
        for p, x, y in _pairs_of(a, b, path):
            if isinstance(x, (list, tuple, dict)):
                walk(x, y, p)
                continue
            if not isinstance(x, keras.layers.Layer) or id(x) in seen:
                continue
            seen.add(id(x))
            if y is None or not same_class(x, y):
                raise NotCopyable(f"{label}/{p}: the copy has {type(y).__name__} where the stock layer has "
                                  f"{type(x).__name__}")
            plan = plan_fn(x, f"{label}/{p}")
            if plan is not None and plan.kind == "retype":  # the copy's own sublayer, as the subclass
                retype(y, plan.make)
                report.rewrites.append(plan.rewrite)
                walk(x, y, p)
                continue
            if plan is not None:
                new = plan.make()
                plan.made = new
                _replace_everywhere(copy, y, new)
                swaps[id(x)] = plan
                if plan.rewrite is not None:  # a converted nested model reports its own rewrites
                    report.rewrites.append(plan.rewrite)
            elif not _is_stock(x) and not _is_graph_model(x):
                walk(x, y, p)

    if isinstance(stock, keras.layers.Layer) and _made_below(stock, copy):
        # A sublayer makes its own sublayers in build(), and the layer around it builds it from its
        # own build() (keras-hub's decoder blocks build their attention): building that sublayer
        # alone first would have the parent build it again, adding state to a built layer. Build
        # the whole copy first; the swapped sublayers are then built from their stock build shapes.
        before = list(getattr(copy, "_layers", None) or ())
        build_like(stock, copy)
        _drop_replaced(copy, before)
    walk(stock, copy, "")
    return swaps


def _drop_replaced(layer, before):
    """Sublayers `layer` tracked before its build() that the build replaced (a shell copy's copies of
    sublayers its build() makes again: unbuilt, no attribute holds them) are no longer tracked."""
    tracked = getattr(layer, "_layers", None)
    if not isinstance(tracked, list):
        return
    attrs = [v for k, v in vars(layer).items() if k != "_layers"]
    held = {id(v) for v in attrs}
    held |= {id(x) for v in attrs if isinstance(v, (list, tuple)) for x in v}
    held |= {id(x) for v in attrs if isinstance(v, dict) for x in v.values()}
    stale = {id(x) for x in before if not x.built and id(x) not in held}
    tracked[:] = [x for x in tracked if id(x) not in stale]


def _made_below(stock, copy, depth=0):
    """True when some sublayer (below `stock` itself) of unbuilt `copy` is `_made_in_build`."""
    if copy.built or not stock.built or depth > 8:
        return False

    def leaves(x, y):
        if isinstance(x, (list, tuple, dict)):
            for _, u, v in _pairs_of(x, y, ""):
                yield from leaves(u, v)
        else:
            yield x, y

    try:
        for _, x, y in _pairs_of(stock, copy, ""):
            for u, v in leaves(x, y):
                if isinstance(u, keras.layers.Layer) and same_class(u, v) and not _is_graph_model(u) and (
                        _made_in_build(u, v) or (not _is_stock(u) and _made_below(u, v, depth + 1))):
                    return True
    except NotCopyable:  # mismatched trees: swap_sublayers says where
        return False
    return False


def _made_in_build(stock, copy):
    """True when built `stock` holds sublayers its unbuilt `copy` does not have yet (made in ``build()``)."""
    if not stock.built or copy.built:
        return False
    for attr, child in children(stock):
        mine = getattr(copy, attr, None)
        if mine is None:
            return True
        if isinstance(child, (list, tuple, dict)) and (
                type(mine) is not type(child) or len(mine) != len(child)):
            return True
    return False


def _replace_everywhere(root, old, new):
    """Every reference to `old` inside `root`'s (unbuilt) tree, attributes and containers, now `new`."""
    done = set()

    def fix_container(c):
        if id(c) in done:
            return
        done.add(id(c))
        items = list(c.items()) if isinstance(c, dict) else list(enumerate(c)) if isinstance(c, list) else []
        for k, v in items:
            if v is old:
                (dict.__setitem__ if isinstance(c, dict) else list.__setitem__)(c, k, new)
            elif isinstance(v, (list, dict)):
                fix_container(v)

    def fix(obj):
        if id(obj) in done or not isinstance(obj, keras.layers.Layer) or _is_graph_model(obj):
            return
        done.add(id(obj))
        for attr, v in list(vars(obj).items()):
            if v is old:
                object.__setattr__(obj, attr, new)
            elif isinstance(v, (list, dict)) and attr != "_layers":
                fix_container(v)
            elif isinstance(v, tuple) and any(x is old for x in v):
                object.__setattr__(obj, attr, type(v)(new if x is old else x for x in v)
                                   if not hasattr(v, "_fields") else v._replace(
                                       **{f: new for f, x in zip(v._fields, v) if x is old}))
        tracked = getattr(obj, "_layers", None)
        if isinstance(tracked, list):
            for i, v in enumerate(tracked):
                if v is old:
                    tracked[i] = new
        for v in list(vars(obj).values()):
            if isinstance(v, keras.layers.Layer):
                fix(v)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    fix(x)
            elif isinstance(v, dict):
                for x in v.values():
                    fix(x)

    fix(root)


def build_like(stock, new):
    """Builds the unbuilt layers of `new` whose stock counterparts are built (same build shapes).

    Inside the name scopes `stock` was built in, so the copy's variables get the stock
    variables' paths (``block/attention/query/kernel``, not ``query/kernel``): what
    ``exclude_from_weight_decay``, checkpoints by path and users' filters match on.
    """
    if not new.built and stock.built:
        config = stock.get_build_config()
        if config:
            with contextlib.ExitStack() as scopes:
                for part in _parent_scopes(stock):
                    scopes.enter_context(keras.name_scope(part))
                new.build_from_config(config)


def _parent_scopes(layer):
    """The name scopes around `layer`'s own variables when it built them (``[]`` if it has none)."""
    for v in list(getattr(layer, "_trainable_variables", ())) + list(getattr(layer, "_non_trainable_variables", ())):
        parts = str(getattr(v, "path", "")).split("/")
        if len(parts) >= 2 and parts[-2] == layer.name:
            return parts[:-2]
    return []


# ----------------------------------------------------------------------------
# State transfer.


def transfer_state(stock, new, pairs, swaps=None, label="", copies=None):
    """Copies all of `stock`'s state into its copy `new` (built), Keras' own save/load per object.

    Appends trainable ``(stock, new)`` variable pairs to `pairs`; swapped sublayers
    (``swaps``: id -> `Plan`) get their plan's weight copy. Trainable flags (each layer's and
    each variable's: a LoRA layer's frozen kernel) end as the stock object's. `copies` (id of a
    stock layer -> its copy) gets every layer of the walk, so a later reference to one of them
    (a graph call, an attribute of a Functional subclass) finds the same copy.
    """
    swaps = swaps or {}
    visited = {}
    assets = []

    def visit(a, b, path):
        if id(a) in visited:
            if visited[id(a)] is not b:
                raise NotCopyable(f"{label}/{path}: shared in the stock layer but not in its copy")
            return
        visited[id(a)] = b
        if id(a) in swaps:
            if b is not swaps[id(a)].made:
                raise NotCopyable(f"{label}/{path}: the swapped sublayer is not where it was put")
            build_like(a, b)
            swaps[id(a)].copy(b, pairs)
            return
        if b is None or not same_class(a, b):
            raise NotCopyable(f"{label}/{path}: the copy has {type(b).__name__} where the stock layer has "
                              f"{type(a).__name__}")
        if isinstance(a, keras.layers.Layer):
            build_like(a, b)
        _own_state(a, b, pairs, assets, f"{label}/{path}" if path else label)
        for p, x, y in _pairs_of(a, b, path):
            walk_value(x, y, p)

    def walk_value(x, y, p):
        if isinstance(x, (list, tuple, dict)):
            for q, u, v in _pairs_of(x, y, p):
                walk_value(u, v, q)
        else:
            visit(x, y, p)

    try:
        visit(stock, new, "")
    finally:
        for d in assets:
            shutil.rmtree(d, ignore_errors=True)
    layers = [(a, visited[id(a)]) for a in _walked(stock, visited) if isinstance(a, keras.layers.Layer)]
    if copies is not None:
        _share_variables(layers, swaps, copies, pairs)
    for a, b in layers:  # top-down: a parent's setter sets its sublayers, which then get their own flag
        if b.trainable != a.trainable:
            b.trainable = a.trainable
    for a, b in layers:
        for va, vb in zip(_own_vars(a), _own_vars(b)):
            # A swapped sublayer's variables are matched by name (a fused class may hold others).
            if (id(a) not in swaps or va.name == vb.name) and vb.trainable != va.trainable:
                vb.trainable = va.trainable
    if copies is not None:
        for a, b in layers:
            copies.setdefault(id(a), b)


def _share_variables(layers, swaps, copies, pairs):
    """A stock variable held by two layers (a tied projection holding an embedding's table) is one
    variable in the copies too: the first copy made of it (`copies`, id of a stock variable -> its
    copy) replaces the others, in their layers and in `pairs`."""
    for a, b in layers:
        if id(a) in swaps:
            continue
        for va, vb in zip(_own_vars(a), _own_vars(b)):
            first = copies.setdefault(id(va), vb)
            if first is not vb:
                _use_variable(b, vb, first)
                pairs[:] = [(x, first if y is vb else y) for x, y in pairs]
    seen = set()
    pairs[:] = [(x, y) for x, y in pairs if not (id(y) in seen or seen.add(id(y)))]


def _use_variable(layer, old, new):
    """`layer` holds `new` wherever it held `old` (its variable lists and attributes)."""
    for name in ("_trainable_variables", "_non_trainable_variables"):
        held = getattr(layer, name, None)
        if isinstance(held, list):
            for i, v in enumerate(held):
                if v is old:
                    held[i] = new
    for k, v in list(vars(layer).items()):
        if v is old:
            object.__setattr__(layer, k, new)


def _walked(stock, visited):
    """The stock objects of `visited` (id -> copy), in walk order (parents before their sublayers)."""
    by_id = {id(stock): stock}
    for layer in stock._flatten_layers(include_self=False, recursive=True) if isinstance(
            stock, keras.layers.Layer) else ():
        by_id.setdefault(id(layer), layer)
    return [by_id[i] for i in visited if i in by_id]


def _own_state(a, b, pairs, assets, where):
    """`a`'s own variables and assets into `b` through Keras' save/load methods."""
    if getattr(a, "lora_enabled", False):
        # Keras saves a LoRA layer's kernel merged with its adapters and loads it with the
        # adapters zeroed (the inference form): copy the variables themselves instead.
        if not getattr(b, "lora_enabled", True) and hasattr(b, "enable_lora"):
            # LoRA enabled after construction on a sublayer its parent makes in build() (the
            # projections of a MultiHeadAttention): no config carries it, so enable it here.
            b.enable_lora(a.lora_rank, lora_alpha=getattr(a, "lora_alpha", None))
        if len(_own_vars(a)) != len(_own_vars(b)):
            raise NotCopyable(f"{where}: the copy has {len(_own_vars(b))} variables, the stock layer "
                              f"{len(_own_vars(a))}")
        for va, vb in zip(_own_vars(a), _own_vars(b)):
            vb.assign(va.value)
    elif hasattr(a, "save_own_variables"):
        store = {}
        a.save_own_variables(store)
        if store or hasattr(b, "load_own_variables"):
            try:
                b.load_own_variables(store)
            except Exception as e:
                raise NotCopyable(f"{where}: its state did not load into the copy ({type(e).__name__}: "
                                  f"{_first_line(e)})") from e
    if hasattr(a, "save_own_variables"):
        for va, vb in zip(getattr(a, "_trainable_variables", ()), getattr(b, "_trainable_variables", ())):
            if va.trainable and not any(vb is y for _, y in pairs):  # flags: set after the walk
                pairs.append((va, vb))
        for va, vb in zip(_own_vars(a), _own_vars(b)):
            if not weights.same_bits(va, vb):
                raise NotCopyable(f"{where}: variable {va.path} did not copy exactly")
    # Seed generators (random layers): Keras does not save their state; the copy continues the same
    # random sequence from the state the stock layer has reached.
    for ga, gb in zip(getattr(a, "_seed_generators", ()), getattr(b, "_seed_generators", ())):
        if getattr(ga, "state", None) is not None and getattr(gb, "state", None) is not None:
            gb.state.assign(ga.state.value)
    if getattr(type(a), "save_assets", None) not in (None, getattr(keras.layers.Layer, "save_assets", None)):
        d = tempfile.mkdtemp(prefix="tfmetal_ext_assets_")
        assets.append(d)
        a.save_assets(d)
        b.load_assets(d)


def _own_vars(layer):
    return list(getattr(layer, "_trainable_variables", ())) + list(getattr(layer, "_non_trainable_variables", ()))

