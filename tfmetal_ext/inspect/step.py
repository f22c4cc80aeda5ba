"""The step inspect runs or traces: synthetic data, layer clones, the training clone, and the dispatch.

`fusion_report`, `placement_report` and the callback's first-step reports run
(or, for a prediction, trace) the step made here.
"""

from __future__ import annotations

import numpy as np

from tfmetal_ext import devices
from tfmetal_ext.inspect import predict
from tfmetal_ext.inspect.capture import (
    capture_function,
    capture_predict,
    capture_train,
    trace_function,
    trace_predict,
    trace_train,
)
from tfmetal_ext.inspect.catalog import FusionContext
from tfmetal_ext.inspect.report import LayerIndex, build_fusion_report, build_placement_report

MODES = ("predict", "train")


def _is_model(obj):
    import keras

    return isinstance(obj, keras.Model)


def _random_for(shape, dtype, batch_size, rng, length=None):
    shape = tuple(
        (batch_size if i == 0 else length) if d is None else int(d) for i, d in enumerate(shape)
    )
    dtype = np.dtype(dtype if dtype not in ("bfloat16",) else "float32")
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 10, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.bool_):
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(dtype)


# Lengths tried for an input's `None` sequence/spatial dimensions when the model declares none,
# smallest first (each is checked symbolically before use).
DEFAULT_LENGTHS = (32, 64, 128, 224)
# Layer attributes that declare the sequence length a model expects.
_LENGTH_ATTRIBUTES = ("sequence_length", "input_length", "maxlen", "max_length", "output_sequence_length")


def _declared_lengths(model):
    found = []
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten(include_self=True, recursive=True) if flatten else ():
        for attr in _LENGTH_ATTRIBUTES:
            value = getattr(layer, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value not in found:
                found.append(value)
    return found


def _accepts(model, inputs, batch_size, length):
    import keras

    specs = [keras.KerasTensor(tuple((batch_size if i == 0 else length) if d is None else d
                                     for i, d in enumerate(t.shape)), dtype=t.dtype) for t in inputs]
    try:
        out = model.compute_output_spec(specs[0] if len(specs) == 1 else specs)
    except Exception:  # the model refuses this length (too short for its convs, ...)
        return False
    return all(0 not in tuple(o.shape) for o in keras.tree.flatten(out) if hasattr(o, "shape"))


def synthetic_inputs(model, batch_size=8, seed=0):
    """Random inputs matching a built functional/Sequential model's input spec.

    `None` dimensions past the batch (sequence lengths, image sizes) take a
    length the model declares (a layer's ``sequence_length``, ``input_length``,
    ...) or else the first of `DEFAULT_LENGTHS` the model accepts.

    Raises:
        ValueError: for a model without an input spec, or one that accepts
            none of the lengths tried (pass ``inputs=``).
    """
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            "Cannot derive inputs for a model without a known input spec (subclassed "
            f"or unbuilt); pass inputs=. Received: model={model.name!r}"
        )
    length = None
    if any(d is None for t in inputs for d in tuple(t.shape)[1:]):
        tried = _declared_lengths(model) + [n for n in DEFAULT_LENGTHS if n not in _declared_lengths(model)]
        length = next((n for n in tried if _accepts(model, inputs, batch_size, n)), None)
        if length is None:
            shapes = [tuple(t.shape) for t in inputs]
            raise ValueError(
                f"Cannot choose a length for the None dimensions of the model's inputs: it accepts none of "
                f"{tried}. Pass inputs= (a batch the model accepts). Received: input shapes={shapes}"
            )
    rng = np.random.default_rng(seed)
    values = [_random_for(t.shape, t.dtype, batch_size, rng, length) for t in inputs]
    return values[0] if len(values) == 1 else values


def _loss_is_sparse(loss):
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or type(loss).__name__
    return "sparse" in str(name).lower()


def _loss_for(loss, index, name):
    """The loss of one output, from a single loss, a list or a dict of them."""
    if isinstance(loss, dict):
        return loss.get(name)
    if isinstance(loss, (list, tuple)):
        return loss[index] if index < len(loss) else None
    return loss


def batch_size_of(inputs):
    """The batch size of a batch of inputs (its first array's first dimension), or None."""
    import keras

    for leaf in keras.tree.flatten(inputs):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


def synthetic_targets(model, batch_size=8, loss=None, seed=1, inputs=None):
    """Random targets matching the model's outputs (integer labels for sparse losses).

    The targets have the structure of the model's outputs (a dict or list
    for a multi-output functional model), which is what ``fit`` expects. A
    subclassed model has no symbolic outputs: given `inputs`, its output
    shapes come from ``model.compute_output_spec(inputs)`` (symbolic, nothing
    runs).
    """
    import keras

    rng = np.random.default_rng(seed)
    outputs = getattr(model, "outputs", None) or []
    struct = getattr(model, "_outputs_struct", None)
    if not outputs and inputs is not None:
        try:
            struct = model.compute_output_spec(inputs)
            outputs = keras.tree.flatten(struct)
        except Exception as e:  # arbitrary user code
            raise ValueError(
                f"Cannot derive targets for model {model.name!r} (its output spec for these inputs failed: "
                f"{type(e).__name__}: {e}); pass targets=. Received: targets=None"
            ) from e
    if not outputs:
        raise ValueError(
            f"Cannot derive targets for model {model.name!r}; pass targets=. Received: targets=None"
        )
    names = list(getattr(model, "output_names", None) or [])
    values = []
    for i, out in enumerate(outputs):
        shape = tuple(batch_size if d is None else int(d) for d in out.shape)
        name = names[i] if i < len(names) else None
        if _loss_is_sparse(_loss_for(loss, i, name)):
            values.append(rng.integers(0, int(shape[-1]), size=shape[:-1]).astype("int32"))
        else:
            values.append(rng.random(shape).astype("float32"))
    if struct is not None and not keras.tree.is_nested(struct):
        return values[0]
    if struct is not None:
        return keras.tree.pack_sequence_as(struct, values)
    return values[0] if len(values) == 1 else values


def _context(mode, xla, model=None):
    from tfmetal_ext.inspect import catalog

    caps = devices.capabilities()
    return FusionContext(
        backend=caps.backend, onednn=caps.onednn, mode=mode, xla=xla, cpu_fp16=caps.cpu_fp16,
        onednn_bf16=caps.onednn_bf16,
        metal_plugin=caps.metal_plugin,
        logits_read=catalog.read_as_logits(model) if mode == "train" else frozenset(),
    )


def _fresh_optimizer(optimizer):
    import keras

    if optimizer is None:
        return "adam"
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer.__class__.from_config(optimizer.get_config())
    return optimizer


def _describe(obj):
    return obj if isinstance(obj, str) else getattr(obj, "name", None) or type(obj).__name__


# Layer config entries that hold a callable which may not deserialize (a lambda, a TF function
# such as tf.nn.swish): the clone gets the very same callable instead.
_CALLABLE_CONFIG_KEYS = ("activation", "recurrent_activation")


def _clone_layer(layer):
    """A fresh layer from `layer`'s config; callables that do not round-trip are carried over as they are."""
    import warnings

    with warnings.catch_warnings():  # Keras warns about serializing a lambda; it is not saved anywhere
        warnings.simplefilter("ignore", UserWarning)
        config = layer.get_config()
    try:
        return layer.__class__.from_config(config)
    except Exception:
        keys = [k for k in _CALLABLE_CONFIG_KEYS if callable(getattr(layer, k, None)) and k in config]
        if not keys:
            raise
    config = dict(config, **{k: "linear" for k in keys})
    clone = layer.__class__.from_config(config)
    for k in keys:
        setattr(clone, k, getattr(layer, k))
    return clone


def _training_model(model, optimizer, loss, jit_compile, notes):
    """The model whose train step to capture: the user's own, or a compiled clone."""
    import keras

    if optimizer is None and loss is None and getattr(model, "compiled", False):
        return model
    how = "clone"
    try:
        clone = keras.models.clone_model(model, clone_function=_clone_layer)
        clone.set_weights(model.get_weights())
    except Exception as e:  # clone_model raises many types for subclassed layers and models
        # A layer Keras cannot re-create from its config (a subclassed block whose __init__ takes
        # no **kwargs): a Functional view over the model's own layers instead. The capture
        # snapshots every variable the step changes and restores it afterwards.
        inputs, outputs = getattr(model, "inputs", None), getattr(model, "outputs", None)
        if not inputs or not outputs:
            raise ValueError(
                "To inspect the train step with a different optimizer/loss the model is cloned, "
                f"and cloning failed ({e}). Compile the model instead. Received: model={model.name!r}"
            ) from e
        clone = keras.Model(inputs, outputs, name=model.name)
        how = f"view over the model's own layers (cloning failed: {type(e).__name__}; its weights are restored)"
    if optimizer is None and getattr(model, "compiled", False):
        optimizer = model.optimizer
    if loss is None:
        loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    if loss is None:
        loss = "mse"
    optimizer = _fresh_optimizer(optimizer)
    jit = jit_compile if jit_compile is not None else getattr(model, "jit_compile", False)
    clone.compile(optimizer=optimizer, loss=loss, jit_compile=bool(jit) and jit != "auto")
    notes.append(
        f"train step inspected on a compiled {how} (optimizer={_describe(optimizer)}, "
        f"loss={_describe(loss)}); the model itself is untouched"
    )
    return clone


def capture_step(model_or_fn, inputs=None, mode="predict", *, targets=None, sample_weight=None,
            optimizer=None, loss=None, batch_size=8, jit_compile=None):
    """Runs one step and returns the `Capture` plus the model actually run (or None) and notes."""
    return _step(model_or_fn, inputs, mode, False, targets=targets, sample_weight=sample_weight,
                 optimizer=optimizer, loss=loss, batch_size=batch_size, jit_compile=jit_compile)


def _step(model_or_fn, inputs, mode, trace, *, targets=None, sample_weight=None, optimizer=None, loss=None,
          batch_size=8, jit_compile=None):
    """`capture_step`, or with `trace` the same step traced and not run (`capture.trace_train`, ...)."""
    notes = []
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if _is_model(model_or_fn):
        model = model_or_fn
        if mode == "train":
            model = _training_model(model, optimizer, loss, jit_compile, notes)
        x = inputs if inputs is not None else synthetic_inputs(model, batch_size)
        if mode == "predict":
            cap = (trace_predict if trace else capture_predict)(model, x)
        else:
            batch = batch_size_of(x) or batch_size  # targets follow the inputs' batch
            y = targets if targets is not None else synthetic_targets(model, batch, getattr(model, "loss", None),
                                                                      inputs=x)
            cap = (trace_train if trace else capture_train)(model, x, y, sample_weight)
        return cap, model, notes
    if not callable(model_or_fn):
        raise ValueError(
            f"Expected a keras.Model or a callable. Received: model_or_fn={model_or_fn!r}"
        )
    if mode != "predict":
        notes.append("mode applies to Keras models only; the function was run as given")
    args = inputs if isinstance(inputs, (tuple, list)) else ((inputs,) if inputs is not None else ())
    return (trace_function if trace else capture_function)(model_or_fn, *args, jit_compile=jit_compile), None, notes

def fusion_report(model_or_fn, inputs=None, mode="predict", **kw):
    """Runs one step and reports what the remapper fused.

    Args:
        model_or_fn: a `keras.Model`, or any callable / `tf.function`.
        inputs: model inputs (a batch), or the positional arguments of the
            function (a tuple, or a single tensor). For a model with a known
            input spec, random inputs of `batch_size` are made when None.
        mode: ``"predict"`` (the model's inference step) or ``"train"`` (the
            real train step ``model.fit`` runs, weights and optimizer state
            restored afterwards).
        **kw: ``targets``, ``sample_weight``, ``optimizer``, ``loss`` (a
            compiled clone is used when given or when the model is not
            compiled), ``batch_size`` (default 8), ``jit_compile``.

    Returns:
        A `FusionReport`.

    Raises:
        ValueError: on a bad mode, batch size or model without input spec.
    """
    cap, model, notes = capture_step(model_or_fn, inputs, mode, **kw)
    return report_from_capture(cap, model, notes)


def report_from_capture(cap, model=None, notes=()):
    """Builds a `FusionReport` from an existing `Capture`."""
    ctx = _context(cap.mode if cap.mode in MODES else "predict", cap.jit_compile, model)
    policy = model.dtype_policy.name if model is not None else None
    index = LayerIndex(model, cap.layer_scopes)
    return build_fusion_report(cap, index, ctx, policy=policy, notes=notes)


def placement_report(model_or_fn, inputs=None, mode="predict", predict_for=None, **kw):
    """Runs one step and reports ops that ran on CPU while a GPU was present; or predicts them for a Metal backend.

    Arguments as for `fusion_report`. With `predict_for`
    (``"tensorflow-metal-plugin"`` or ``"tensorflow-metal"``) nothing runs:
    the step is traced as it would be on that backend (inside
    `tfmetal_ext.devices.assume_backend`, with Keras' GPU-only branches such
    as its cuDNN LSTM taken; see `tfmetal_ext.inspect.predict`), and every
    compute op with no kernel there for its dtype is listed with its layer
    and whether it would fall back to the CPU, fail (no CPU kernel either),
    or run on the host. Works on any machine.

    Returns:
        A `PlacementReport`; with `predict_for`, a `PredictedPlacementReport`.

    Raises:
        ValueError: on a bad `predict_for` (or mode, batch size, ...).
    """
    if predict_for is None:
        cap, model, _ = capture_step(model_or_fn, inputs, mode, **kw)
        return placement_from_capture(cap, model)
    predict.validate_predict_for(predict_for)
    with predict.tracing_as(predict_for):
        cap, model, notes = _step(model_or_fn, inputs, mode, True, **kw)
        index = LayerIndex(model, cap.layer_scopes)
    return predict.build_predicted_report(cap, index, predict_for, model=model, notes=notes)


def placement_from_capture(cap, model=None):
    gpu = bool(devices.capabilities().gpus) or None
    return build_placement_report(cap, LayerIndex(model, cap.layer_scopes), gpu_present=gpu)
