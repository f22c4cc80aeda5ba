"""What our layers emit on each Metal backend, checked against that backend's kernels (issue 14, item 5).

Traced here under `devices.assume_backend(...)`: the graphs are the ones the layers build on that
backend; what they run on is decided on a Mac. A kernel "exists" on the open tensorflow-metal-plugin
when its backend table says so (`backends.TABLES["metal_plugin"].has_kernel`, generated from the
plugin's source) or TensorFlow registers the op for every device (``DEVICE_DEFAULT``: shapes,
reshapes, loop control, TensorLists), read from the installed TensorFlow's kernel registry. Until the
generated table is in, the plugin's pinned sdist is the reference: the op names its kernel sources
register (dtypes then unchecked).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import backends, devices
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import FusionContext
from tfmetal_ext.layers import FusedGRU, FusedLSTM, recurrent
from tfmetal_ext.ops import _recurrence

PLUGIN = "tensorflow-metal-plugin"
APPLE = "tensorflow-metal"
FLOATS = ("float32", "float16", "bfloat16")
_DTYPE_ATTRS = ("T", "dtype", "element_dtype", "SrcT")


# ----------------------------------------------------------------------------
# Kernel references.


def _default_device_kernels():
    """{op: dtype names or {"any"}} that TensorFlow registers for DEVICE_DEFAULT (every device)."""
    from tensorflow.python.framework import kernels

    found = {}
    for k in kernels.get_all_registered_kernels().kernel:
        if k.device_type != "DEFAULT":
            continue
        typed = [c for c in k.constraint if c.name in _DTYPE_ATTRS]
        names = {tf.dtypes.as_dtype(t).name for c in typed for t in c.allowed_values.list.type}
        found.setdefault(k.op, set()).update(names or {"any"})
    return found


_DEFAULT = None


def _source_ops():
    """Op names the plugin's kernel sources register (None: no sdist reachable)."""
    from tfmetal_ext import testing

    try:
        root = testing.metal_plugin_source()
    except testing.SourceUnavailable:
        return None
    names = set()
    for path in root.rglob("kernels/*.mm"):
        names.update(re.findall(r'Register\w*\(\s*"(\w+)"', path.read_text(errors="replace")))
    return names


_SOURCE = []


def plugin_has_kernel(op, dtype):
    """The plugin's device has a kernel for `op` in `dtype` (see the module docstring)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = _default_device_kernels()
    table = backends.TABLES["metal_plugin"]
    known = table.has_kernel(op, dtype)
    if known:
        return True
    default = _DEFAULT.get(op, set())
    if "any" in default or dtype in default:
        return True
    if known is False or table.kernels is not None:
        return False
    if not _SOURCE:
        _SOURCE.append(_source_ops())
    if _SOURCE[0] is None:
        pytest.skip("no kernel table for the open plugin yet and its sdist is unreachable")
    return op in _SOURCE[0] and op not in table.host_ops


def _node_dtype(node):
    for a in _DTYPE_ATTRS:
        if a in node.attr and node.attr[a].type:
            return tf.dtypes.as_dtype(node.attr[a].type).name
    return None


def graph_nodes(concrete):
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node)
    for fn in graph.library.function:
        nodes += list(fn.node_def)
    return nodes


def missing_on_plugin(nodes):
    """``(op, dtype)`` of the compute nodes (float-typed, or untyped) with no kernel on the plugin.

    Integer and bool nodes are shape and index math, which TF keeps in host memory on any GPU.
    """
    missing = set()
    for n in nodes:
        dtype = _node_dtype(n)
        if n.op in ("Placeholder", "_Arg", "_Retval") or (dtype is not None and dtype not in FLOATS):
            continue
        if not plugin_has_kernel(n.op, dtype):
            missing.add((n.op, dtype))
    return missing


def _graphs(graph, seen=None):
    """`graph` and every function graph it calls (loop bodies, cond branches), once each."""
    seen = set() if seen is None else seen
    if id(graph) in seen:
        return []
    seen.add(id(graph))
    out = [graph]
    for fn in getattr(graph, "_functions", {}).values():
        if getattr(fn, "graph", None) is not None:
            out += _graphs(fn.graph, seen)
    return out


def partial_strided_slices(concrete):
    """Float StridedSlice ops the plugin's kernel refuses at run time.

    Its kernel takes only a begin/end/strides spec as long as the input's rank (a shorter
    one, ``x[t]`` on a 3-D tensor, implies an ellipsis) and no ellipsis or new-axis mask.
    """
    bad = []
    for g in _graphs(concrete.graph):
        for op in g.get_operations():
            if op.type != "StridedSlice" or op.inputs[0].dtype.name not in FLOATS:
                continue
            rank, spec = op.inputs[0].shape.rank, op.inputs[1].shape.num_elements()
            if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask") or rank is None or spec != rank:
                bad.append(op.name)
    return bad


def traced(layer, x, mode, mask=None):
    """The concrete function of a predict or a train (forward + backward) step."""
    if mode == "predict":
        return tf.function(lambda x: layer(x, mask=mask)).get_concrete_function(x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(layer(x, mask=mask, training=True), tf.float32))
        return tape.gradient(loss, [x] + layer.trainable_weights)

    return step.get_concrete_function(x)


@pytest.fixture
def policy():
    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------------------------
# FusedLSTM / FusedGRU.


def test_open_plugin_recurrences_emit_no_cudnn_and_only_ops_with_kernels(policy, monkeypatch):
    """Before: CudnnRNNV3 on any Metal backend (no kernel on the plugin, none on the CPU)."""
    monkeypatch.setattr(_recurrence, "MAX_UNROLL", 100)  # the while-loop case at 130 steps, not 286
    with devices.assume_backend(PLUGIN):
        for name in ("float32", "mixed_float16"):
            policy(name)
            for cls in (FusedLSTM, FusedGRU):
                # 6 steps: the unrolled form; 130 (> MAX_UNROLL): the while loop; masks too.
                for steps, masked in ((6, False), (6, True), (_recurrence.MAX_UNROLL + 30, True)):
                    layer = cls(8, return_sequences=True, go_backwards=masked)
                    x = tf.zeros((3, steps, 5))
                    mask = tf.constant(np.arange(steps)[None] < np.array([[steps], [2], [1]])) if masked else None
                    layer(x)
                    assert layer.form == "fused"
                    for mode in ("predict", "train"):
                        concrete = traced(layer, x, mode, mask)
                        nodes = graph_nodes(concrete)
                        ops = {n.op for n in nodes}
                        where = (name, cls.__name__, steps, masked, mode)
                        assert not {op for op in ops if op.startswith("CudnnRNN")}, where
                        assert not {op for op in ops if "LSTMBlock" in op}, where
                        assert ("StatelessWhile" in ops or "While" in ops) == (steps > _recurrence.MAX_UNROLL), where
                        assert not missing_on_plugin(nodes), (where, missing_on_plugin(nodes))
                        assert not partial_strided_slices(concrete), where


def test_apple_metal_keeps_cudnn():
    with devices.assume_backend(APPLE):
        for cls in (FusedLSTM, FusedGRU):
            layer = cls(8, return_sequences=True)
            x = tf.zeros((3, 6, 5))
            layer.build(x.shape)  # traced only: CudnnRNNV3 has no kernel on this host
            ops = [n.op for n in graph_nodes(traced(layer, x, "train"))]
            assert ops.count("CudnnRNNV3") == 1 and ops.count("CudnnRNNBackpropV3") == 1
            assert layer.supports_jit is False


def test_the_choice_is_the_table_data():
    """`rnn_implementation` reads the cudnn_rnn row and `has_kernel`, not a plugin name."""
    apple, plugin = backends.TABLES["metal"], backends.TABLES["metal_plugin"]
    assert apple.rnn_implementation("float32") == "cudnn"
    assert plugin.rnn_implementation("float32") == "loop"
    assert plugin.cudnn_rnn_kernels("float16") is False
    # A table like Apple's whose kernels say CudnnRNNV3 is missing: the loop.
    import dataclasses

    without = dataclasses.replace(apple, missing_kernels=frozenset({"CudnnRNNV3"}))
    assert without.rnn_implementation("float32") == "loop"
    with devices.assume_backend(PLUGIN):
        assert recurrent._implementation("metal", "float32") == "loop"
        assert recurrent._rnn_table("metal").rnn_list_form("float32") == "split"
    with devices.assume_backend(APPLE):
        assert recurrent._implementation("metal", "float32") == "cudnn"
    for key in ("cpu", "cpu_onednn"):
        assert backends.TABLES[key].rnn_list_form("float32") == "pack"


def test_use_cudnn_true_on_the_open_plugin_is_a_clear_error():
    with devices.assume_backend(PLUGIN):
        layer = FusedLSTM(4, use_cudnn=True)
        with pytest.raises(ValueError, match=r"CudnnRNNV3 kernel.*tensorflow-metal-plugin.*Received: use_cudnn=True"):
            layer(tf.zeros((2, 3, 5)))


def _ctx(plugin, mode="predict"):
    return FusionContext(backend="metal", onednn=False, mode=mode, metal_plugin=plugin)


def test_report_rows_say_what_runs_on_each_metal_backend():
    lstm = FusedLSTM(4)
    lstm.build((2, 7, 3))
    for mode in ("predict", "train"):
        exp = catalog.expectation(lstm, _ctx(PLUGIN, mode))
        assert exp.op is None and exp.ideal_op == "CudnnRNNV3"
        assert "tensorflow-metal-plugin has no CudnnRNNV3 kernel" in exp.reason
        assert "unrolled over its 7 steps" in exp.reason
        assert exp.may_fuse == (("_FusedMatMul", ("BiasAdd",)),)
        assert catalog.expectation(lstm, _ctx(APPLE, mode)).op == "CudnnRNNV3"
        assert catalog.expectation(lstm, _ctx(None, mode)).op == "CudnnRNNV3"  # unknown plugin: Apple's
    gru = FusedGRU(4, use_bias=False)
    gru.build((2, None, 3))
    exp = catalog.expectation(gru, _ctx(PLUGIN))
    assert "tf.while_loop" in exp.reason and exp.may_fuse == ()


def test_stock_lstm_and_gru_rows_say_they_fail_on_the_open_plugin():
    for cls, fused in ((keras.layers.LSTM, "FusedLSTM"), (keras.layers.GRU, "FusedGRU")):
        layer = cls(4)
        exp = catalog.expectation(layer, _ctx(PLUGIN))
        assert exp.op is None and exp.ideal_op == "CudnnRNNV3"
        table_reason = backends.TABLES["metal_plugin"].unsupported_layers.get(cls.__name__)
        if table_reason:
            assert exp.reason == table_reason
        else:
            assert "fails" in exp.reason and fused in exp.reason
        assert catalog.expectation(layer, _ctx(APPLE)).op == "CudnnRNNV3"
        # Keras' own loop (use_cudnn=False) runs anywhere.
        assert "CudnnRNNV3" not in (catalog.expectation(cls(4, use_cudnn=False), _ctx(PLUGIN)).op or "")


# ----------------------------------------------------------------------------
# Optimizers: on TF 2.21 the open plugin registers no ResourceApply* (table host_ops).

from tfmetal_ext.optimizers import FusedAdagrad, FusedAdam, FusedAdamW, FusedRMSprop, FusedSGD  # noqa: E402

OPTIMIZERS = [
    # (ours, the stock Keras optimizer it must match, the op the fused form emits)
    (lambda: FusedAdam(0.01), lambda: keras.optimizers.Adam(0.01), "ResourceApplyAdam"),
    (lambda: FusedAdam(0.01, amsgrad=True), lambda: keras.optimizers.Adam(0.01, amsgrad=True),
     "ResourceApplyAdamWithAmsgrad"),
    (lambda: FusedAdam(0.01, multi_tensor=True), lambda: keras.optimizers.Adam(0.01), "ResourceApplyAdam"),
    (lambda: FusedAdamW(0.01, weight_decay=0.1), lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
     "ResourceApplyAdam"),
    (lambda: FusedSGD(0.05), lambda: keras.optimizers.SGD(0.05), "ResourceApplyGradientDescent"),
    (lambda: FusedSGD(0.05, momentum=0.9, nesterov=True),
     lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), "ResourceApplyKerasMomentum"),
    (lambda: FusedRMSprop(0.01), lambda: keras.optimizers.RMSprop(0.01), "ResourceApplyRMSProp"),
    (lambda: FusedRMSprop(0.01, momentum=0.5, centered=True),
     lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True), "ResourceApplyCenteredRMSProp"),
    (lambda: FusedAdagrad(0.05), lambda: keras.optimizers.Adagrad(0.05), "ResourceApplyAdagradV2"),
]


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def _train_step(model, opt):
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _step_nodes(opt):
    step = _train_step(_model(), opt)
    return graph_nodes(step.get_concrete_function(tf.zeros((2, 4)), tf.zeros((2, 1))))


def _per_variable(opt):
    """`opt` with its per-variable form (the subject here): "auto" and True take the multi-tensor op."""
    if getattr(opt, "multi_tensor", None) in ("auto", True):
        return type(opt).from_config({**opt.get_config(), "multi_tensor": False})
    return opt


def test_open_plugin_optimizers_emit_the_composite_form_with_kernels_there():
    """Before: one ResourceApplyAdam/KerasMomentum/GradientDescent per variable, none with a kernel there."""
    table = backends.TABLES["metal_plugin"]
    with devices.assume_backend(PLUGIN):
        for make, make_stock, fused_op in OPTIMIZERS:
            assert table.has_kernel(fused_op, "float32") is False  # on TF 2.21: in host_ops, or never registered
            opt = _per_variable(make())
            assert fused_op in opt.composite_reason("float32") or "resource-variable" in opt.composite_reason()
            nodes = _step_nodes(opt)
            ops = [n.op for n in nodes]
            assert not [op for op in ops if op.startswith("ResourceApply") or "MultiTensorAdam" in op], ops
            assert not missing_on_plugin(nodes), (type(opt).__name__, missing_on_plugin(nodes))
            assert any(op in ("AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp") for op in ops)
            stock_ops = [n.op for n in _step_nodes(make_stock())]
            assert len(ops) <= len(stock_ops), (type(opt).__name__, len(ops), len(stock_ops))


def test_open_plugin_multi_tensor_auto_takes_the_one_op_that_runs_on_the_gpu_there():
    # Its Metal kernel reaches the variables through TF's C++ kernel API, which TF 2.21 exports: one op for
    # every variable, predicted on the GPU with no host op (the composite form's Assign* each run on the host
    # unless our gap kernels take them).
    from tfmetal_ext import inspect as tinspect

    with devices.assume_backend(PLUGIN):
        opt = FusedAdam(0.01)
        model = _model()
        step = _train_step(model, opt)
        ops = [n.op for n in graph_nodes(step.get_concrete_function(tf.zeros((2, 4)), tf.zeros((2, 1))))]
    assert ops.count("TfmetalExt>MultiTensorAdam") == 1, ops
    # The iteration counter's AssignVariableOp (int64) is all that is left of the per-variable updates.
    assert not [op for op in ops if op.startswith(("AssignAdd", "AssignSub", "ResourceApply"))], ops
    report = tinspect.placement_report(step, (tf.zeros((2, 4)), tf.zeros((2, 1))), predict_for=PLUGIN)
    assert not report.cpu_fallback and not report.host and not report.fails, str(report)


@pytest.mark.parametrize("plugin", [APPLE, None])
def test_elsewhere_the_fused_op_stays(plugin):
    # Apple's tensorflow-metal has the ResourceApply* kernels; a CPU (plugin None: this host) has them too.
    import contextlib

    with devices.assume_backend(plugin) if plugin else contextlib.nullcontext():
        for make, _, fused_op in OPTIMIZERS[:2] + OPTIMIZERS[4:]:
            opt = make()
            if getattr(opt, "multi_tensor", None) == "auto":
                # The per-variable form is the subject here; "auto" may take the multi-tensor op
                # (tests/optimizers/test_multi_tensor_auto.py).
                opt = type(opt).from_config({**opt.get_config(), "multi_tensor": False})
            assert opt.composite_reason("float32") is None
            assert fused_op in [n.op for n in _step_nodes(opt)]


def test_open_plugin_composite_updates_match_keras():
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 4)).astype("float32"), rng.standard_normal((8, 1)).astype("float32"))
               for _ in range(4)]
    for make, make_stock, _ in OPTIMIZERS:
        results = []
        for factory, assumed in ((make, PLUGIN), (make_stock, None)):
            model = _model(seed=1)
            opt = _per_variable(factory())
            if assumed:
                with devices.assume_backend(assumed):
                    step = _train_step(model, opt)
                    for x, y in batches:
                        step(x, y)
            else:
                step = _train_step(model, opt)
                for x, y in batches:
                    step(x, y)
            results.append([v.numpy() for v in model.trainable_variables + list(opt.variables)])
        ours, stock = results
        assert len(ours) == len(stock)
        for a, b in zip(ours, stock):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
