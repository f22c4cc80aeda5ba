"""Capture the graphs TensorFlow actually executed.

TensorFlow exports, per instantiated function, the graph after grappler and
placement ("post-optimization graph") and the per-device partition graphs,
but only for functions whose first call happens while run metadata is on.
So every capture here runs a *fresh* function: a fresh Keras train/predict
function for models, a fresh `tf.function` around a plain callable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import numpy as np

logger = logging.getLogger("tfmetal_ext")


_ARG_OPS = ("_Arg", "_Retval", "_DeviceArg", "_DeviceRetval")


@dataclasses.dataclass
class FunctionGraph:
    """One executed function: its post-optimization and partition graphs."""

    name: str
    graph: object  # tf.compat.v1.GraphDef, post-optimization
    partitions: list  # list of GraphDef, one per device partition
    pre_graph: object = None  # GraphDef before grappler
    # Traced (not run) captures: the nodes whose results or effects the function returns (its outputs'
    # producers and its control outputs). None: not known (a run's post-optimization graph, already pruned).
    roots: tuple = None


def _tf_functions(fn):
    """The tf.functions behind `fn`: itself, or those its closure holds (Keras' train wrapper)."""
    if hasattr(fn, "_list_all_concrete_functions"):
        return [fn]
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "_list_all_concrete_functions"):
            found.append(value)
    return found


def _keep_own(cap, tf_functions):
    """Drops graphs that are not from `tf_functions` (or the functions they call).

    Graphs of functions instantiated earlier in the process, and eager ops,
    can be exported into a later window; a graph is ours when its node names
    come from our functions and every function it calls is one of ours.
    """
    names, fn_names = set(), set()
    for tf_fn in tf_functions:
        for concrete in tf_fn._list_all_concrete_functions():
            fn_names.add(concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name)
            names.update(n.name for n in concrete.function_def.node_def)
            for lib_fn in concrete.graph.as_graph_def().library.function:
                fn_names.add(lib_fn.signature.name)
                names.update(n.name for n in lib_fn.node_def)
    if not names:
        return cap
    own = []
    for fg in cap.functions:
        body = [n for n in fg.pre_graph.node if n.op not in _ARG_OPS and not n.name.endswith("_RetVal")]
        calls = {n.attr["f"].func.name for n in body if "f" in n.attr and n.attr["f"].func.name}
        if {n.name for n in body} <= names and calls <= fn_names:
            own.append(fg)
    cap.functions = own
    return cap


@dataclasses.dataclass
class Capture:
    """Everything captured from one step.

    Attributes:
        functions: the executed functions' graphs.
        jit_compile: the step ran under XLA (grappler's remapper never saw it).
        mode: ``"train"``, ``"predict"`` or ``"function"``.
        layer_scopes: graph name scope (as TensorFlow uniquified it while
            tracing, e.g. ``"sequential_1/conv2d_1_2"``) -> the layer object
            that opened it; empty when the trace happened outside the capture.
    """

    functions: list
    jit_compile: bool = False
    mode: str = "function"
    layer_scopes: dict = dataclasses.field(default_factory=dict, repr=False)

    def nodes(self):
        """Yields every NodeDef of the post-optimization graphs, library included."""
        for fg in self.functions:
            yield from fg.graph.node
            for fdef in fg.graph.library.function:
                yield from fdef.node_def

    def partition_nodes(self):
        for fg in self.functions:
            for part in fg.partitions:
                yield from part.node


# ----------------------------------------------------------------------------
# Which layer object opened which graph name scope.
#
# TensorFlow uniquifies a name scope opened twice in one graph (``conv2d`` ->
# ``conv2d_1``), and Keras opens each layer's scope more than once per call, so
# scope strings and layer names disagree in ways no name rule can undo (the
# scope ``block_1_2/conv2d_1_1`` is layer ``block_1``'s ``conv2d_1``). While a
# capture traces its function, every scope a Keras layer opens is recorded
# with the layer object itself; node names are then attributed by scope.


class _ScopeRecorder:
    """Records ``scope -> layer`` for Keras name scopes entered in graphs while active."""

    _lock = threading.Lock()
    _active = []  # recorders, innermost last
    _patched = None  # (class, original __enter__)

    def __init__(self):
        self.scopes = {}

    @classmethod
    def _install(cls):
        try:
            from keras.src.backend.tensorflow import core as tf_core
        except ImportError:  # another Keras layout: attribution falls back to names
            return
        scope_cls = tf_core.name_scope
        original = scope_cls.__enter__

        def __enter__(self):
            result = original(self)
            if cls._active and getattr(self, "_pop_on_exit", False):
                cls._record(self.caller)
            return result

        scope_cls.__enter__ = __enter__
        cls._patched = (scope_cls, original)

    @classmethod
    def _record(cls, caller):
        import keras
        import tensorflow as tf

        if not isinstance(caller, keras.layers.Layer) or tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        if getattr(graph, "name", "").startswith("scratch_graph"):  # Keras' shape inference
            return
        scope = graph.get_name_scope()
        for recorder in cls._active:
            recorder.scopes.setdefault(scope, caller)

    def __enter__(self):
        with self._lock:
            if not self._active:
                self._install()
            self._active.append(self)
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._active.remove(self)
            if not self._active and self._patched is not None:
                scope_cls, original = self._patched
                scope_cls.__enter__ = original
                type(self)._patched = None
        return False


def record_layer_scopes():
    """Context manager: records the graph name scope of every Keras layer call traced inside.

    ``with record_layer_scopes() as rec: ...`` then ``rec.scopes`` maps each
    scope (as uniquified in its graph) to the layer object that opened it.
    Keras' name-scope class is patched only while a recorder is active.
    """
    return _ScopeRecorder()


@contextlib.contextmanager
def _run_metadata():
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    # Function graphs instantiated since an earlier window stay queued after
    # `disable_run_metadata` and would be exported into this one (with node
    # names identical to ours when the same Python body was traced before, so
    # `_keep_own` cannot tell them apart): drop them first.
    context.export_run_metadata()
    box = []
    try:
        yield box
    finally:
        box.append(context.export_run_metadata())
        context.disable_run_metadata()


def _as_tensors(structure):
    """numpy arrays -> tensors, so converting them runs before the capture window."""
    import tensorflow as tf

    return tf.nest.map_structure(
        lambda v: tf.convert_to_tensor(v) if isinstance(v, np.ndarray) else v, structure
    )


def _is_eager_op(fg):
    """Eager ops that ran inside the window (Keras' Python around the step, or
    any op whose kernel was not cached yet) are exported as one-op functions.
    A traced tf.function always has more than one node: it wraps its outputs
    in Identity. `_keep_own` filters by ownership as well; this check alone
    still holds if the Keras functions cannot be found behind a step."""
    body = [n for n in fg.pre_optimization_graph.node if n.op not in _ARG_OPS]
    return len(body) <= 1


def _to_capture(md, jit_compile, mode, layer_scopes=None):
    functions = [
        FunctionGraph(
            name=getattr(fg, "function_name", "") or "",  # absent in older protos
            graph=fg.post_optimization_graph,
            partitions=list(fg.partition_graphs),
            pre_graph=fg.pre_optimization_graph,
        )
        for fg in md.function_graphs
        if not _is_eager_op(fg)
    ]
    return Capture(functions=functions, jit_compile=jit_compile, mode=mode, layer_scopes=dict(layer_scopes or {}))


def _fresh_function(fn, jit_compile):
    """``(tf.function, jit)``: a new trace of `fn` (a tf.function or a callable), XLA as `fn` asks unless given."""
    import tensorflow as tf

    python_fn = getattr(fn, "python_function", None)
    if python_fn is not None:
        own_jit = getattr(fn, "_jit_compile", None)
        jit = bool(own_jit) if jit_compile is None else bool(jit_compile)
    elif callable(fn):
        python_fn = fn
        jit = bool(jit_compile)
    else:
        raise ValueError(f"Expected a callable or a tf.function. Received: fn={fn!r}")
    return tf.function(python_fn, jit_compile=jit), jit


def capture_function(fn, *args, jit_compile=None, **kwargs):
    """Runs ``fn(*args, **kwargs)`` once as a fresh `tf.function` and captures its graphs.

    Args:
        fn: a Python callable or a `tf.function`. A `tf.function` is re-wrapped
            around its Python function so it is traced anew; a function that
            creates variables on its first call must be called once before.
        *args, **kwargs: the arguments.
        jit_compile: overrides the function's own XLA setting.

    Returns:
        A `Capture`.
    """
    fresh, jit = _fresh_function(fn, jit_compile)
    args, kwargs = _as_tensors(args), _as_tensors(kwargs)  # no eager op inside the window
    with record_layer_scopes() as rec, _run_metadata() as box:
        fresh(*args, **kwargs)
    return _keep_own(_to_capture(box[0], jit, "function", rec.scopes), [fresh])


def capture_call(fn, *args, mode="function", jit_compile=False):
    """Calls an existing function once under the capture window; returns ``(result, Capture)``.

    Unlike `capture_function`, `fn` is called as it is (not re-traced), so
    this captures the real call: e.g. the first step of a ``model.fit`` run,
    with nothing extra computed. The function's graphs are exported only
    when this call instantiates them (its first call), so call it on a fresh
    function. An empty `Capture` (no functions) means nothing was instantiated.

    Args:
        fn: a `tf.function`, or a Python function wrapping them (Keras'
            ``train_function``); the graphs kept are those of the
            `tf.function`s found behind it.
        *args: the arguments.
        mode: recorded in the `Capture` (``"train"``, ``"predict"``, ...).
        jit_compile: recorded in the `Capture`: whether the step is XLA compiled.
    """
    with record_layer_scopes() as rec, _run_metadata() as box:
        result = fn(*args)
    return result, _keep_own(_to_capture(box[0], bool(jit_compile), mode, rec.scopes), _tf_functions(fn))


# ----------------------------------------------------------------------------
# Keras models.


def _model_state(model):
    """Every variable a Keras step can write: weights, optimizer, metrics, seeds."""
    seen = set()
    variables = []
    groups = [model.variables]
    if getattr(model, "optimizer", None) is not None:
        groups.append(model.optimizer.variables)
    groups.append(getattr(model, "metrics_variables", []))
    for group in groups:
        for v in group:
            key = id(v)
            if key not in seen:
                seen.add(key)
                variables.append(v)
    return variables


def _snapshot(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def _restore(variables, values):
    for v, value in zip(variables, values):
        v.assign(value)


def _first_batch_dataset(model, x, y=None, sample_weight=None, dynamic_batch=False):
    """The one batch as a dataset; with `dynamic_batch` its batch dimension is unknown (None) to the step,
    as in a `fit` whose batch size does not divide the data (Keras' adapters then batch without
    ``drop_remainder``): shape arithmetic on the batch size runs in the step instead of folding."""
    import keras
    import tensorflow as tf

    # tf.data reads a list as one tensor; Keras' own adapters treat it as a structure (a tuple).
    x, y, sample_weight = keras.tree.lists_to_tuples((x, y, sample_weight))
    data = (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    if dynamic_batch:
        rows = int(np.shape(keras.tree.flatten(data)[0])[0])
        ds = tf.data.Dataset.from_tensor_slices(data).batch(rows)
    else:
        ds = tf.data.Dataset.from_tensors(data)
    strategy = model.distribute_strategy
    if strategy is not None and strategy.num_replicas_in_sync > 1:
        return strategy.experimental_distribute_dataset(ds)
    return ds


def _resolve_jit(model):
    jit = getattr(model, "jit_compile", False)
    return bool(jit) and jit != "auto"


def capture_predict(model, x):
    """Captures the model's real predict step (``model.predict``'s function) on `x`.

    The function is called the way ``model.predict_on_batch`` calls it; the
    model's cached ``predict_function`` is put back afterwards.
    """
    saved = model.predict_function
    x = _as_tensors(x)
    try:
        model.make_predict_function(force=True)
        fn = model.predict_function
        with record_layer_scopes() as rec, _run_metadata() as box:
            fn([(x,)])
    finally:
        model.predict_function = saved
    return _keep_own(_to_capture(box[0], _resolve_jit(model), "predict", rec.scopes), _tf_functions(fn))


def _build_for_training(model, x, y, sample_weight):
    """Creates every variable the train step needs, before the snapshot is taken."""
    import keras

    batch = (x, y) if sample_weight is None else (x, y, sample_weight)
    with model.distribute_strategy.scope():
        symbolic_build = getattr(model, "_symbolic_build", None)
        if symbolic_build is not None:  # Keras 3: builds model, metrics, loss and optimizer
            symbolic_build(data_batch=keras.tree.map_structure(_as_tensor, batch))
            return
        if not model.built:
            model(x)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def _as_tensor(value):
    import tensorflow as tf

    return tf.convert_to_tensor(value)


def _prepared_train_batch(model, x, y, sample_weight, caller, dynamic_batch=False):
    """The one-batch dataset of a training capture or trace, the model and optimizer built for it.

    Raises:
        ValueError: when the model is not compiled (`caller` names the function).
    """
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            f"{caller} needs a compiled model; pass optimizer= and loss= to the report or compile the "
            f"model first. Received: model={model.name!r}"
        )
    ds = _first_batch_dataset(model, x, y, sample_weight, dynamic_batch)
    _build_for_training(model, x, y, sample_weight)
    return ds


def capture_train(model, x, y, sample_weight=None, dynamic_batch=False):
    """Captures the real training step of a *compiled* model: the function ``model.fit`` runs.

    Every variable the step writes (weights, optimizer slots and iterations,
    loss-scale state, metric accumulators, seed-generator states) is
    snapshotted first and restored afterwards, and the model's cached
    ``train_function`` is put back, so the model is left exactly as it was.
    `dynamic_batch`: the step sees the batch dimension as unknown (see
    `_first_batch_dataset`).
    """
    ds = _prepared_train_batch(model, x, y, sample_weight, "capture_train", dynamic_batch)
    state = _model_state(model)
    values = _snapshot(state)
    saved_fn = model.train_function
    saved_stop = getattr(model, "stop_training", False)
    try:
        model.make_train_function(force=True)
        fn = model.train_function
        iterator = iter(ds)
        with record_layer_scopes() as rec, _run_metadata() as box:
            fn(iterator)
    finally:
        model.train_function = saved_fn
        model.stop_training = saved_stop
        _restore(state, values)
    return _keep_own(_to_capture(box[0], _resolve_jit(model), "train", rec.scopes), _tf_functions(fn))


# ----------------------------------------------------------------------------
# Traced, not run: the graph a step would be, for backends that are not here.
#
# A predicted placement (`tfmetal_ext.inspect.placement_report(..., predict_for=...)`)
# traces the step as another backend would, and such a graph may hold ops with
# no kernel on this host (CudnnRNNV3 has no CPU kernel): it must never run. The
# graphs are the traced function's GraphDef with its whole function library
# (the inner step function, while-loop bodies, gradient functions): before
# grappler, and without placement.


def _traced_capture(concrete, mode, jit_compile, layer_scopes):
    graph_def = concrete.graph.as_graph_def()
    name = concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name
    roots = tuple(sorted({t.op.name for t in concrete.graph.outputs}
                         | {op.name for op in getattr(concrete.graph, "control_outputs", ())}))
    fg = FunctionGraph(name=name, graph=graph_def, partitions=[], pre_graph=graph_def, roots=roots)
    return Capture(functions=[fg], jit_compile=jit_compile, mode=mode, layer_scopes=dict(layer_scopes))


def _outer_function(fn):
    found = _tf_functions(fn)
    if not found:
        raise ValueError(f"Found no tf.function behind the step function. Received: fn={fn!r}")
    return found[0]


def trace_function(fn, *args, jit_compile=None, **kwargs):
    """Traces ``fn(*args, **kwargs)`` as a fresh `tf.function` without running it; returns a `Capture`.

    The `Capture`'s graphs are the traced GraphDef (before grappler, no
    partitions); its `layer_scopes` are recorded as in `capture_function`.
    """
    fresh, jit = _fresh_function(fn, jit_compile)
    args, kwargs = _as_tensors(args), _as_tensors(kwargs)
    with record_layer_scopes() as rec:
        concrete = fresh.get_concrete_function(*args, **kwargs)
    return _traced_capture(concrete, "function", jit, rec.scopes)


def trace_predict(model, x):
    """Traces the model's predict step on `x` without running it (see `trace_function`).

    The model's cached ``predict_function`` is put back afterwards.
    """
    saved = model.predict_function
    x = _as_tensors(x)
    try:
        model.make_predict_function(force=True)
        fn = _outer_function(model.predict_function)
        with record_layer_scopes() as rec:
            concrete = fn.get_concrete_function([(x,)])
    finally:
        model.predict_function = saved
    return _traced_capture(concrete, "predict", _resolve_jit(model), rec.scopes)


def trace_train(model, x, y, sample_weight=None, dynamic_batch=False):
    """Traces the real training step of a *compiled* model (``model.fit``'s function) without running it.

    The model and optimizer are built first (as `capture_train` does);
    nothing is computed, so no variable changes. The model's cached
    ``train_function`` is put back afterwards. `dynamic_batch`: as for
    `capture_train`.
    """
    ds = _prepared_train_batch(model, x, y, sample_weight, "trace_train", dynamic_batch)
    saved_fn = model.train_function
    try:
        model.make_train_function(force=True)
        fn = _outer_function(model.train_function)
        iterator = iter(ds)
        with record_layer_scopes() as rec:
            concrete = fn.get_concrete_function(iterator)
    finally:
        model.train_function = saved_fn
    return _traced_capture(concrete, "train", _resolve_jit(model), rec.scopes)
