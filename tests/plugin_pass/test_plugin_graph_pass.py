"""The open tensorflow-metal-plugin's own graph pass, run on Linux over our layers' graphs.

What runs
---------
Each graph is the real step of a small model built from our layers (``inspect.capture_step``:
the predict step, or the train step ``model.fit`` runs), taken as TensorFlow's function runtime
hands it to grappler, and rewritten the way grappler rewrites it for the open plugin's device:

1. placement: every node on ``/job:localhost/replica:0/task:0/device:GPU:0`` (the plugin names its
   device "GPU"), except a node that would not run there by the plugin's backend table
   (``TABLES["metal_plugin"]`` read by ``inspect.predict.judge``, the predicted placement's rule: no
   kernel for its dtype, or a host op such as ``ResourceApply*`` on TF 2.21), which goes to
   ``CPU:0`` as TF's soft placement puts it; ops the table does not know stay on the GPU. Nodes
   inside called functions (a train step's body) are placed too: grappler inlines them and an
   inlined node keeps a device it names. The resource arguments get the ``_handle_dtypes`` /
   ``_handle_shapes`` the runtime attaches before grappler (copied from the executed graph's
   ``_Arg`` nodes): without them grappler cannot see a filter's shape and the remapper's GPU conv
   branch never fires.
2. TF's grappler, with a virtual cluster of one device of type "GPU" (and a CPU), through
   ``tensorflow.python.grappler.tf_optimizer.OptimizeGraph``: TF's default optimizers, with the
   layout optimizer off as the plugin's optimizer config sets it (``TF_TriState_Off``). The GPU has
   no ``environment`` (no CUDA compute capability), so cuDNN runtime fusion is off, as on a Mac.
   It runs in a worker process with ``TF_ENABLE_ONEDNN_OPTS=0`` (``conftest.Grappler``): with oneDNN
   on, TF's remapper skips every float16 node, GPU-placed ones included
   (`test_onednn_makes_the_remapper_skip_half_nodes_on_any_device`), which a Mac's TF, built without
   oneDNN as far as we know, does not do.
3. the plugin's pass (``FuseGraph``, compiled from its sdist in ``conftest.py``), which runs after
   TF's optimizers ("plugin optimizers run last").

Real grappler runs its optimizer list twice (meta_optimizer_iterations) with the plugin's pass in
each round; here TF's two rounds run first and the plugin's pass once after them. The pass only
fuses a BiasAdd still fed by a Conv2D/MatMul, so the order changes nothing we assert.

Does TF's remapper take its GPU branches on a virtual GPU?  Yes.
----------------------------------------------------------------
`test_remapper_takes_its_gpu_branches_on_a_virtual_gpu` is the evidence (TF 2.21.0, this Linux
wheel, oneDNN on and off): on the GPU-placed graph the remapper alone fuses a 3x3 float32
Conv2D + BiasAdd + Relu into ``_FusedConv2D[BiasAdd, Relu]`` and leaves a 1x1 conv, a conv + Elu,
a conv with no activation and every MatMul alone (its GPU rules: cuDNN Relu only, no 1x1 filters,
MatMul only with ``TF_USE_CUBLASLT``), float16 alike (without oneDNN); it turns inference
``FusedBatchNormV3`` + Relu into ``_FusedBatchNormEx`` (float32 and float16). The same graph
placed on the CPU fuses all the contractions (the CPU branch). So remapper-then-plugin-pass runs
here as TF would run it.

What the Linux wheel and a Mac's TF could differ in: the Linux wheel is built with CUDA, the
macOS arm64 one without. The GPU gates we met read run-time facts that are off in both: cuDNN
runtime fusion (needs a compute capability >= 8 in the cluster's device environment, absent here,
and compiled out on macOS); training ``_FusedBatchNormEx`` (needs ``TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT``,
unset here, compiled out on macOS); MatMul fusion (``TF_USE_CUBLASLT``, unset). oneDNN changes only
the CPU branches and, with it on, skips half nodes on every device: hence the worker without it.
Not verified on a Mac.

What is asserted
----------------
For each of our layers (FusedDense relu/relu6/elu/tanh/sigmoid/linear, FusedConv2D, ConvBNAct in
its train form and folded inference form, FusedDepthwiseConv2D, FusedConv1D), float32 and
mixed_float16, predict and train: the fused node the catalog promises for the open plugin
(``FusionContext(backend="metal", metal_plugin="tensorflow-metal-plugin", onednn=False)``, read
from ``backends.TABLES["metal_plugin"]``) is in the rewritten graph with exactly those
``fused_ops``, on the GPU, in the layer's compute dtype; and nothing fuses that the catalog denies.
Negative cases: a bfloat16 model (no bfloat16 kernels: its contractions stay off the GPU and the
pass fuses nothing) and graphs placed nowhere or on the CPU (the pass leaves them as they are).
The output is a valid GraphDef that TF imports, with every node the pass did not fold carried
through unchanged.

Seen here (TF 2.21.0, plugin 0.4.1), all of which the plugin's table now says: in a train step
only LeakyRelu stays out (``[BiasAdd]``; its gradient reads the pre-activation), every other
activation fuses; ConvBNAct's inference form (FusedBatchNormV3 + Relu) becomes TF's
``_FusedBatchNormEx`` on the GPU, float32 and float16, its train form fuses nothing; 1x1 convs,
Conv1D and every Dense fuse in the plugin's pass; depthwise convs never fuse. The pass checks no
dtype (`test_the_pass_itself_ignores_dtype`).
"""

from __future__ import annotations

import dataclasses
import os

import keras
import pytest

from tfmetal_ext import _env, backends
from tfmetal_ext import inspect as tinspect
from tfmetal_ext import layers as fl
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog, predict
from tfmetal_ext.inspect.capture import Capture
from tfmetal_ext.inspect.report import LayerIndex, build_fusion_report

from .conftest import CPU, GPU, optimize_here

PLUGIN = "tensorflow-metal-plugin"
L = keras.layers


def plugin_table():
    return backends.TABLES["metal_plugin"]


# ----------------------------------------------------------------------------
# The pipeline: placement, TF's grappler on a virtual GPU, the plugin's pass.


def _dtype_of(node):
    import tensorflow as tf

    for key in ("T", "dtype"):
        if key in node.attr and node.attr[key].type:
            return tf.dtypes.as_dtype(node.attr[key].type).name
    return None


def _type_attrs(node):
    import tensorflow as tf

    return {k: tf.dtypes.as_dtype(v.type).name for k, v in node.attr.items() if v.WhichOneof("value") == "type"}


def place(graph_def, executed=None, table=None, device=GPU):
    """`graph_def` with every node on `device`; with a `table`, nodes that would not run on its
    device (`tfmetal_ext.inspect.predict.judge`: no kernel for their dtype, or a host op) on the CPU.

    `executed`: the graph TF ran, whose ``_Arg`` nodes carry the argument shapes the runtime adds
    before grappler; they are copied over by node name.
    """
    import tensorflow as tf

    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    args = {n.name: n for n in executed.node if n.op == "_Arg"} if executed is not None else {}

    def where(node):
        if table is None or device != GPU:
            return device
        verdict = predict.judge(table, node.op, _type_attrs(node))  # None: it has a kernel there
        return CPU if verdict is not None and verdict[0] != predict.UNKNOWN else GPU

    # The bodies of called functions (a train step calls one): grappler inlines them, and an inlined
    # node keeps a device it names.
    for fdef in out.library.function:
        for node in fdef.node_def:
            node.device = where(node)
    for node in out.node:
        node.device = where(node)
        if node.op == "_Arg" and node.name in args:
            for key in ("_handle_dtypes", "_handle_shapes", "_output_shapes"):
                if key in args[node.name].attr:
                    node.attr[key].CopyFrom(args[node.name].attr[key])
    return out


@dataclasses.dataclass
class PassRun:
    """One model step through the pipeline."""

    model: object  # the model that ran (a compiled clone in train mode)
    capture: Capture  # what ran on this CPU
    placed: list  # per function: the GPU-placed graph grappler starts from
    remapped: list  # per function: after TF's grappler
    fused: list  # per function: after the plugin's pass
    report: object  # FusionReport of the plugin's output against the plugin's catalog
    mode: str


def plugin_context(mode, model=None):
    return catalog.FusionContext(
        backend="metal", metal_plugin=PLUGIN, onednn=False, mode=mode,
        logits_read=catalog.read_as_logits(model) if mode == "train" else frozenset(),
    )


def run_pipeline(plugin_pass, grappler, model, mode):
    cap, ran, _ = tinspect.capture_step(model, mode=mode)
    assert cap.functions, "the step exported no function graph"
    table = plugin_table()
    placed = [place(fg.pre_graph, fg.graph, table) for fg in cap.functions]
    remapped = [grappler(g) for g in placed]
    fused = [plugin_pass(g) for g in remapped]
    run = PassRun(ran, cap, placed, remapped, fused, None, mode)
    run.report = stage_report(run, fused)
    return run


def fused_nodes(graphs):
    return [n for g in graphs for n in g.node if fusion.is_fused_op(n.op)]


# ----------------------------------------------------------------------------
# Our layers.

DENSE_ACTS = ["relu", "relu6", "elu", "tanh", "sigmoid", None]
CONV_ACTS = ["relu", "relu6", "elu", "leaky_relu", "tanh", "sigmoid", None]


def _name(prefix, act):
    return f"{prefix}_{act or 'linear'}"


def zoo(mode):
    """A model holding one of each of our contraction layers (names are the test ids)."""
    inp = keras.Input((8, 8, 4))
    x = inp
    for act in CONV_ACTS:
        x = fl.FusedConv2D(8, 3, padding="same", activation=act, name=_name("conv", act))(x)
    x = fl.FusedConv2D(8, 1, activation="relu", name="conv_1x1_relu")(x)
    x = fl.FusedDepthwiseConv2D(3, padding="same", activation="relu", name="depthwise_relu")(x)
    x = fl.ConvBNAct(8, 3, name="cba_relu")(x)
    if mode == "predict":
        # The folded inference form: ConvBNAct.fold() is a FusedConv2D with the batch norm folded in.
        source = fl.ConvBNAct(8, 3, name="cba_to_fold")
        source.build((None, 8, 8, 8))
        x = source.fold(name="cba_folded")(x)
    seq = L.Reshape((8, 64))(x)
    seq = fl.FusedConv1D(8, 3, padding="same", activation="relu", name="conv1d_relu")(seq)
    v = L.GlobalAveragePooling1D()(seq)
    for act in DENSE_ACTS:
        v = fl.FusedDense(8, activation=act, name=_name("dense", act))(v)
    out = fl.FusedDense(3, name="head")(v)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    return model


LAYERS = (
    [_name("conv", a) for a in CONV_ACTS] + ["conv_1x1_relu", "depthwise_relu", "cba_relu", "cba_folded",
                                             "conv1d_relu"]
    + [_name("dense", a) for a in DENSE_ACTS]
)
PREDICT_ONLY = {"cba_folded"}


POLICIES = ("float32", "mixed_float16")
MODES = ("predict", "train")


@pytest.fixture(scope="module")
def runs(plugin_pass, grappler):
    """``runs(policy, mode)``: the zoo's step through the pipeline, all four made once here.

    Built in the fixture, with its own seed, policy restore and Keras session reset, so the tests
    that read them touch no Keras state (``no_keras``: no per-test session reset, about 0.6 s each).
    """
    cache = {}
    previous = keras.mixed_precision.global_policy()
    # ConvBNAct trains with FusedBatchNormV3 + Relu here, the form whose remapper and plugin-pass
    # fusions this file checks: the grappler worker has no tfmetal_ext op library (its
    # TfmetalExt>BatchNormAct form is checked in tests/layers/test_batch_norm_act_layers.py).
    avoided = frozenset(_env.current().avoided) | {"batch_norm_act"}
    try:
        for policy in POLICIES:
            for mode in MODES:
                keras.mixed_precision.set_global_policy(policy)
                keras.utils.set_random_seed(0)
                with _env.scope(avoided=avoided):
                    cache[(policy, mode)] = run_pipeline(plugin_pass, grappler, zoo(mode), mode)
    finally:
        keras.mixed_precision.set_global_policy(previous)
        keras.backend.clear_session()
    return lambda policy, mode: cache[(policy, mode)]


# ----------------------------------------------------------------------------
# The tests.


@pytest.mark.no_keras
def test_the_pass_builds_and_refuses_garbage(plugin_pass):
    assert plugin_pass.binary.is_file()
    assert plugin_pass.build_seconds < 120, f"building the pass took {plugin_pass.build_seconds:.1f} s"
    # Field 1 as a length-delimited node longer than the input: FuseGraph cannot read it.
    done = plugin_pass.run_bytes(b"\x0a\xff\x01abc")
    assert done.returncode == 2, done.stderr
    empty = plugin_pass.run_bytes(b"")
    assert empty.returncode == 0 and empty.stdout == b""


CASES = [
    (layer, policy, mode)
    for mode in MODES for policy in POLICIES for layer in LAYERS
    if not (mode == "train" and layer in PREDICT_ONLY)  # the folded form is inference-only
]


@pytest.mark.no_keras
@pytest.mark.parametrize("layer,policy,mode", CASES)
def test_plugin_pass_gives_what_the_catalog_promises(runs, layer, policy, mode):
    run = runs(policy, mode)
    row = run.report.row(layer)
    assert row.status not in ("missed", "unexpected"), f"{row.layer}: {row.status}: {row.reason}\n{run.report}"
    nodes = [n for n in run.report.fused_for(row.path) if not n.backward]
    if row.expected_op is None:
        assert not nodes, f"{layer}: the catalog expects no fusion ({row.reason}); graph has {nodes}"
        return
    assert row.actual_op == row.expected_op, str(run.report)
    assert (row.actual_fused_ops or []) == (row.expected_fused_ops or []), (
        f"{layer}: fused_ops {row.actual_fused_ops}, the catalog promises exactly {row.expected_fused_ops}"
    )
    node = next(n for n in nodes if n.op == row.expected_op and n.fused_ops == (row.expected_fused_ops or []))
    assert node.device == "GPU:0", node
    want_dtype = keras.layers.Layer(dtype=policy).compute_dtype
    assert node.dtype == want_dtype, f"{layer}: fused node in {node.dtype}, the layer computes in {want_dtype}"


@pytest.mark.no_keras
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_no_stray_fusion(runs, policy, mode):
    """Every forward fused node in the plugin's output belongs to a layer row that expects it."""
    run = runs(policy, mode)
    bad = [r for r in run.report.layers if r.status in ("missed", "unexpected")]
    assert not bad, str(run.report)
    credited = {f.name for r in run.report.layers if r.fused for f in run.report.fused_for(r.path)}
    stray = [f for f in run.report.fused if not f.backward and f.name not in credited]
    assert not stray, f"fused nodes credited to no layer: {stray}\n{run.report}"


def stage_report(run, graphs):
    """A FusionReport of `graphs` (one per function of `run`) against the plugin's catalog.

    The report reads copies: reading ``node.attr["fused_ops"]`` of a protobuf map inserts the key.
    """
    import tensorflow as tf

    copies = []
    for g in graphs:
        copies.append(tf.compat.v1.GraphDef())
        copies[-1].CopyFrom(g)
    out = Capture(
        functions=[dataclasses.replace(fg, graph=g, partitions=[]) for fg, g in zip(run.capture.functions, copies)],
        jit_compile=False, mode=run.capture.mode, layer_scopes=run.capture.layer_scopes,
    )
    index = LayerIndex(run.model, run.capture.layer_scopes)
    return build_fusion_report(out, index, plugin_context(run.mode, run.model), policy=run.model.dtype_policy.name)


def forward_fused(report, layer):
    return [(n.op, list(n.fused_ops), n.device) for n in report.fused_for(layer) if not n.backward]


def _remapper_probe():
    inp = keras.Input((8, 8, 4))
    x = fl.FusedConv2D(8, 3, padding="same", activation="relu", name="conv3x3_relu")(inp)
    x = fl.FusedConv2D(8, 1, activation="relu", name="conv1x1_relu")(x)
    x = fl.FusedConv2D(8, 3, padding="same", activation="elu", name="conv3x3_elu")(x)
    x = fl.FusedConv2D(8, 3, padding="same", name="conv3x3_linear")(x)
    x = fl.ConvBNAct(8, 3, name="cba_relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    out = fl.FusedDense(4, activation="relu", name="dense_relu")(x)
    return keras.Model(inp, out)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_remapper_takes_its_gpu_branches_on_a_virtual_gpu(plugin_pass, grappler, policy):
    """The evidence for the module docstring: the device decides which remapper branch runs.

    Expected values: TF's remapper rules as REFERENCE.md section 1 lists them (GPU: Conv2D + BiasAdd +
    Relu only, float32/half, not 1x1; MatMul only with TF_USE_CUBLASLT; FusedBatchNorm + Relu in
    inference; CPU without oneDNN: Conv2D/MatMul + BiasAdd + Relu/Elu/..., float32).
    """
    if os.environ.get("TF_USE_CUBLASLT", "0") == "1":
        pytest.skip("TF_USE_CUBLASLT=1 turns on the remapper's GPU MatMul fusion; this checks the default")
    keras.mixed_precision.set_global_policy(policy)
    half = policy == "mixed_float16"
    run = run_pipeline(plugin_pass, grappler, _remapper_probe(), "predict")
    tf_only = stage_report(run, run.remapped)
    assert forward_fused(tf_only, "conv3x3_relu") == [("_FusedConv2D", ["BiasAdd", "Relu"], "GPU:0")], str(tf_only)
    for layer in ("conv1x1_relu", "conv3x3_elu", "conv3x3_linear", "dense_relu"):
        assert forward_fused(tf_only, layer) == [], f"{layer}\n{tf_only}"
    assert forward_fused(tf_only, "cba_relu") == [("_FusedBatchNormEx", [], "GPU:0")], str(tf_only)
    # The plugin's pass then takes what TF's GPU branch left.
    assert forward_fused(run.report, "conv1x1_relu") == [("_FusedConv2D", ["BiasAdd", "Relu"], "GPU:0")]
    assert forward_fused(run.report, "conv3x3_elu") == [("_FusedConv2D", ["BiasAdd", "Elu"], "GPU:0")]
    assert forward_fused(run.report, "dense_relu") == [("_FusedMatMul", ["BiasAdd", "Relu"], "GPU:0")]
    if half:
        return  # the CPU branch fuses no half node on a CPU without native fp16
    # The same graph placed on the CPU takes the CPU branch: every contraction fuses with its activation.
    on_cpu = stage_report(run, [grappler(place(fg.pre_graph, fg.graph, device=CPU)) for fg in run.capture.functions])
    assert forward_fused(on_cpu, "conv1x1_relu") == [("_FusedConv2D", ["BiasAdd", "Relu"], "CPU:0")], str(on_cpu)
    assert forward_fused(on_cpu, "conv3x3_elu") == [("_FusedConv2D", ["BiasAdd", "Elu"], "CPU:0")], str(on_cpu)
    assert forward_fused(on_cpu, "dense_relu") == [("_FusedMatMul", ["BiasAdd", "Relu"], "CPU:0")], str(on_cpu)


def test_onednn_makes_the_remapper_skip_half_nodes_on_any_device(plugin_pass, grappler):
    """Why grappler runs in a worker without oneDNN: in-process, oneDNN changes the GPU branch for half."""
    from tfmetal_ext import devices

    keras.mixed_precision.set_global_policy("mixed_float16")
    run = run_pipeline(plugin_pass, grappler, _remapper_probe(), "predict")
    here = stage_report(run, [optimize_here(g) for g in run.placed])
    worker = stage_report(run, run.remapped)
    assert forward_fused(worker, "conv3x3_relu"), str(worker)
    if devices.capabilities().onednn:
        assert not [n for n in here.fused if not n.backward], f"oneDNN on: half nodes fused\n{here}"
    else:
        assert sorted(map(str, here.fused)) == sorted(map(str, worker.fused))


@pytest.mark.no_keras
def test_graphs_not_on_a_gpu_come_back_unchanged(runs, plugin_pass):
    run = runs("float32", "predict")
    for device in ("", CPU):
        for graph in run.remapped:
            moved = place(graph, device=device) if device else _without_devices(graph)
            out = plugin_pass(moved)
            assert list(out.node) == list(moved.node), f"device {device!r}: the pass changed nodes not on a GPU"
            assert out.library == moved.library and out.versions == moved.versions


def _without_devices(graph):
    import tensorflow as tf

    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph)
    for node in out.node:
        node.device = ""
    return out


def _bf16_model():
    inp = keras.Input((8, 8, 4))
    x = fl.FusedConv2D(8, 3, padding="same", activation="relu", name="conv_relu")(inp)
    x = L.GlobalAveragePooling2D()(x)
    out = fl.FusedDense(4, activation="relu", name="dense_relu")(x)
    return keras.Model(inp, out)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_contractions_stay_off_the_gpu_and_unfused(plugin_pass, grappler, mode):
    """No bfloat16 kernels on the plugin: placement keeps those nodes off the GPU, so its pass fuses none."""
    table = plugin_table()
    for op in ("Conv2D", "MatMul", "BiasAdd", "Relu"):
        assert table.has_kernel(op, "bfloat16") is False, (
            f"the plugin's table should say {op} has no bfloat16 kernel; has_kernel gives "
            f"{table.has_kernel(op, 'bfloat16')!r}"
        )
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    run = run_pipeline(plugin_pass, grappler, _bf16_model(), mode)
    contractions = [
        n for g in run.placed for n in list(g.node) + [m for f in g.library.function for m in f.node_def]
        if n.op in ("Conv2D", "MatMul") and _dtype_of(n) == "bfloat16"
    ]
    assert contractions and all(n.device == CPU for n in contractions), contractions
    added = {n.name for n in fused_nodes(run.fused)} - {n.name for n in fused_nodes(run.remapped)}
    assert not added, f"the plugin's pass fused nodes that are not on its GPU: {added}"
    assert not [n for n in fused_nodes(run.fused) if "GPU" in n.device]
    for layer in ("conv_relu", "dense_relu"):
        row = run.report.row(layer)
        assert row.expected_op is None and "bfloat16" in (row.reason or ""), f"{layer}: {row}"


def test_the_pass_itself_ignores_dtype(plugin_pass, grappler):
    """bfloat16 nodes forced onto the GPU are fused all the same: the pass checks the device, not the
    dtype, so the plugin's no-bfloat16 guarantee rests on placement (the test above)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    run = run_pipeline(plugin_pass, grappler, _bf16_model(), "predict")
    forced = [plugin_pass(place(g)) for g in run.remapped]  # every node on the GPU, no table
    got = {(n.op, tuple(n.attr["fused_ops"].list.s), _dtype_of(n)) for n in fused_nodes(forced)}
    assert ("_FusedConv2D", (b"BiasAdd", b"Relu"), "bfloat16") in got, got
    assert ("_FusedMatMul", (b"BiasAdd", b"Relu"), "bfloat16") in got, got


@pytest.mark.no_keras
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_output_is_a_valid_graph_with_unfolded_nodes_unchanged(runs, policy, mode):
    import tensorflow as tf

    run = runs(policy, mode)
    folds = 0
    for before, after in zip(run.remapped, run.fused):
        again = tf.compat.v1.GraphDef()
        again.ParseFromString(after.SerializeToString())
        assert again == after
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(after, name="")  # checks every node against its OpDef
        old = {n.name: n for n in before.node}
        new = {n.name: n for n in after.node}
        added = {n.name for n in fused_nodes([after])} - {n.name for n in fused_nodes([before])}
        for name, node in new.items():
            if name in added:
                folds += 1
                assert old[name].op in ("BiasAdd",) + tuple(fusion.ACTIVATION_OPS.values()), old[name]
                continue
            assert node == old[name], f"{name} changed although the pass did not fold it"
        gone = set(old) - set(new)
        assert all(old[g].op in ("Conv2D", "MatMul", "BiasAdd") for g in gone), sorted(
            (g, old[g].op) for g in gone if old[g].op not in ("Conv2D", "MatMul", "BiasAdd")
        )
        assert after.library == before.library
    assert folds, "the pass folded nothing: this check ran on an empty rewrite"
