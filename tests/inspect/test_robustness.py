"""fusion_report on models as public examples write them (issue 13, defects 4 and 8)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmetal_ext import devices, inspect
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog

L = keras.layers


def _no_bad_rows(report):
    bad = [r for r in report.layers if r.status in ("missed", "unexpected")]
    assert not bad, str(report)


# ----------------------------------------------------------------------------
# Activations given as any callable.


@pytest.mark.parametrize(
    "activation, want",
    [
        ("relu", "relu"),
        (tf.nn.relu, "relu"),
        (tf.nn.swish, "silu"),
        (keras.activations.gelu, "gelu"),
        (tf.math.tanh, "tanh"),
        (keras.activations.linear, "linear"),
        (None, "linear"),
    ],
)
def test_activation_name_of_known_callables(activation, want):
    assert catalog.activation_name(L.Dense(2, activation=activation)) == want


@pytest.mark.parametrize("activation", [lambda t: t * 2.0, L.ReLU(), np.tanh])
def test_unknown_callables_are_custom_and_never_raise(activation):
    layer = L.Dense(2)
    layer.activation = activation  # whatever the constructor accepts, the attribute may hold anything
    name = catalog.activation_name(layer)
    assert name.startswith("custom (")
    assert catalog.act_op(layer) not in fusion.ACTIVATION_OPS.values()


@pytest.mark.parametrize("mode", ["predict", "train"])
def test_report_with_callable_activations_and_keras_ops_between_layers(mode):
    inp = keras.Input((8,))
    a = L.Dense(8, activation=tf.nn.swish, name="swish")(inp)
    b = L.Dense(8, activation=tf.nn.relu, name="tf_relu")(inp)
    c = L.Dense(8, activation=keras.activations.gelu, name="gelu")(inp)
    d = L.Dense(8, activation=lambda t: t * 2.0, name="lam")(inp)
    x = keras.ops.relu(keras.ops.add(a, b))  # op nodes in the layer graph
    x = keras.ops.subtract(keras.ops.add(x, c), d)
    model = keras.Model(inp, L.Dense(1, name="head")(x))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode=mode)
    _no_bad_rows(report)
    # tf.nn.relu is the Relu op: it fuses like "relu" does (the table lists Relu for MatMul everywhere).
    assert report.row("tf_relu").actual_fused_ops == ["BiasAdd", "Relu"], str(report)
    assert "custom" in report.row("lam").reason, str(report)


# ----------------------------------------------------------------------------
# Synthetic inputs and targets.


def test_train_targets_take_the_batch_of_the_inputs():
    inp = keras.Input((8,))
    model = keras.Model(inp, L.Dense(3, activation="relu")(inp))
    report = inspect.fusion_report(model, inputs=np.zeros((4, 8), "float32"), mode="train")
    assert report.num_ops > 0
    assert report.row(model.layers[-1].name).fused


@pytest.mark.parametrize("structure", ["dict", "list"])
def test_multi_output_model_without_targets(structure):
    inp = keras.Input((8,))
    h = L.Dense(4, activation="relu")(inp)
    outs = [L.Dense(2, name="cls")(h), L.Dense(1, activation="sigmoid", name="score")(h)]
    outputs = {"cls": outs[0], "score": outs[1]} if structure == "dict" else outs
    model = keras.Model(inp, outputs)
    report = inspect.fusion_report(model, mode="train")
    _no_bad_rows(report)
    assert {"cls", "score"} <= {r.path for r in report.layers}


def test_none_sequence_length_into_embedding():
    inp = keras.Input((None,), dtype="int32")
    x = L.GlobalAveragePooling1D()(L.Embedding(50, 8)(inp))
    model = keras.Model(inp, L.Dense(1, activation="sigmoid")(x))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    x = inspect.synthetic_inputs(model)
    assert x.shape[0] == 8 and x.shape[1] >= 1 and x.max() < 50
    _no_bad_rows(inspect.fusion_report(model, mode="train"))


def test_none_spatial_dims_use_a_size_the_model_accepts():
    inp = keras.Input((None, None, 3))
    x = L.Conv2D(4, 3, activation="relu")(inp)
    for _ in range(4):  # needs at least 46 pixels: the smallest default lengths fail, a later one fits
        x = L.MaxPooling2D()(L.Conv2D(4, 3, activation="relu")(x))
    model = keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling2D()(x)))
    x = inspect.synthetic_inputs(model)
    assert model.predict(x, verbose=0).shape == (8, 2)
    _no_bad_rows(inspect.fusion_report(model, mode="predict"))


def test_declared_sequence_length_is_used():
    class Positions(L.Layer):
        def __init__(self, sequence_length):
            super().__init__()
            self.sequence_length = sequence_length

        def call(self, x):
            return x + keras.ops.zeros((self.sequence_length, 1))

    inp = keras.Input((None, 1))
    model = keras.Model(inp, Positions(17)(inp))
    assert inspect.synthetic_inputs(model).shape == (8, 17, 1)


def test_unacceptable_none_dims_ask_for_inputs():
    inp = keras.Input((None, 3))
    x = L.Reshape((5, 3))(inp)  # only length 5 works; nothing declares it
    model = keras.Model(inp, L.Dense(2)(x))
    with pytest.raises(ValueError, match="inputs="):
        inspect.fusion_report(model)


# ----------------------------------------------------------------------------
# A sigmoid head trained with binary crossentropy: the loss reads its logits.


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("units", [1, 4])
def test_sigmoid_head_with_crossentropy_is_never_missed(units, policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        inp = keras.Input((None,), dtype="int32")
        x = L.Bidirectional(L.LSTM(4))(L.Embedding(40, 8)(inp))
        model = keras.Model(inp, L.Dense(units, activation="sigmoid", name="head")(x))
        model.compile(optimizer="adam", loss="binary_crossentropy")
        report = inspect.fusion_report(model, mode="train")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    _no_bad_rows(report)
    row = report.row("head")
    table = catalog.table(inspect._context("train", False))
    if policy == "float32" and row.fused and "Sigmoid" in table.fusion("matmul_bias_act").acts_in("train"):
        # The table fuses Sigmoid here, but Keras' crossentropy took the Sigmoid's input.
        assert "Sigmoid" not in row.actual_fused_ops, str(report)
        assert "logits" in row.reason, str(report)


def test_sigmoid_head_with_mse_fuses_where_the_table_says():
    inp = keras.Input((8,))
    model = keras.Model(inp, L.Dense(4, activation="sigmoid", name="head")(inp))
    model.compile(optimizer="sgd", loss="mse")
    report = inspect.fusion_report(model, mode="train")
    _no_bad_rows(report)
    table = catalog.table(inspect._context("train", False))
    want_sigmoid = "Sigmoid" in table.fusion("matmul_bias_act").acts_in("train")
    assert ("Sigmoid" in (report.row("head").actual_fused_ops or [])) == want_sigmoid, str(report)
    assert devices.capabilities().onednn == want_sigmoid  # CPU: only oneDNN fuses Sigmoid


def test_activation_and_loss_tables_name_real_objects():
    for path, name in fusion.TF_ACTIVATION_FUNCTIONS.items():
        obj = tf
        for part in path.split("."):
            obj = getattr(obj, part)
        assert callable(obj), path
        keras.activations.get(name)  # a Keras activation name (raises otherwise)
    for act, losses in fusion.LOSSES_READING_LOGITS.items():
        assert act in fusion.ACTIVATION_OPS.values() or act == "Softmax", act
        for loss in losses:
            assert callable(getattr(keras.losses, loss)), loss


class SubclassedHead(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(3)

    def call(self, x):
        return {"logits": self.d(x)}


def test_synthetic_targets_of_a_subclassed_model_follow_its_output_spec():
    # A subclassed model has no symbolic outputs; given inputs, the targets follow
    # compute_output_spec (structure and shape), with the inputs' batch.
    model = SubclassedHead()
    x = np.zeros((5, 4), "float32")
    with pytest.raises(ValueError, match="pass targets="):
        inspect.synthetic_targets(model, 5)
    y = inspect.synthetic_targets(model, 5, inputs=x)
    assert set(y) == {"logits"} and y["logits"].shape == (5, 3)
    model.compile(optimizer="sgd", loss={"logits": "mse"})
    report = inspect.fusion_report(model, inputs=x, mode="train")
    assert report.num_ops > 0


def _residual_add_with_two_consumers():
    # The Xception residual (keras.io "Image classification from scratch"): the Add after a conv
    # feeds a ReLU and, directly, the next shortcut conv.
    L = keras.layers
    inp = keras.Input((16, 16, 8))
    s = L.add([L.Conv2D(8, 3, strides=2, padding="same")(inp), L.Conv2D(8, 1, strides=2, padding="same")(inp)])
    a = L.Activation("relu")(s)
    return keras.Model(inp, L.add([L.Conv2D(8, 1)(a), L.Conv2D(8, 1)(s)]))


def test_a_remapper_pass_that_fails_as_a_whole_is_said_so():
    # With oneDNN the whole remapper pass fails on this inference graph ("Mutation::Apply error"),
    # so no node fuses; the report must say so instead of blaming each layer's consumers. Which
    # configuration has the failure comes from the backend table, not from this machine.
    from tfmetal_ext.backends import current

    report = inspect.fusion_report(_residual_add_with_two_consumers(), inputs=np.zeros((2, 16, 16, 8), "float32"))
    convs = [r for r in report.layers if r.layer_class in ("Conv2D", "FusedConv2D")]
    assert len(convs) == 4
    if current().pass_failure is not None:
        assert not report.fused
        assert all(r.status == "missed" and "remapper pass failed" in r.reason for r in convs), convs
        assert any("remapper pass failed" in n and "Mutation::Apply" in n for n in report.notes), report.notes
    else:
        assert len(report.fused) >= 4
        assert not any("remapper pass failed" in n for n in report.notes)


class BNReluBlock(keras.layers.Layer):
    """A subclassed block whose own call applies the ReLU after its batch norm (keras.ops)."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)
        self.bn = keras.layers.BatchNormalization()
        self.bn_tail = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        h = keras.ops.relu(self.bn(self.conv(x), training=training))
        return self.bn_tail(h, training=training) + x


@pytest.mark.parametrize("mode", ["train", "predict"])
def test_batch_norm_inside_a_subclass_fuses_with_what_its_caller_applies(mode):
    # Inside a subclass's call no layer graph shows the ReLU after the batch norm (or the
    # bias-free conv before it); what the remapper fuses with them is right, never "unexpected".
    import tfmetal_ext

    inp = keras.Input((8, 8, 8))
    stock = keras.Model(inp, keras.layers.GlobalAveragePooling2D()(BNReluBlock()(inp)))
    model = tfmetal_ext.convert(stock, count_ops=False)
    block = model.layers[1]
    assert type(block.bn).__name__ == "FusedBatchNorm"
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 8)).astype("float32")
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.variables]
    # Keras cannot clone the block (its __init__ takes no **kwargs): the train step runs on a
    # view over the model's own layers, whose variables come back unchanged.
    report = inspect.fusion_report(model, inputs=x, targets=np.zeros((4, 8), "float32"), mode=mode,
                                   optimizer="sgd", loss="mse")
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), b, err_msg=v.path)
    if mode == "train":
        assert any("view over the model's own layers" in n for n in report.notes), report.notes
    rows = {r.path.split("/")[-1]: r for r in report.layers if r.layer_class == "FusedBatchNorm"}
    assert set(rows) == {block.bn.name, block.bn_tail.name}, [r.path for r in report.layers]
    for row in rows.values():
        assert row.status in ("fused", "not fused"), (row.path, row.status, row.reason)
        assert (row.status == "fused") == (row.actual_op is not None), row
