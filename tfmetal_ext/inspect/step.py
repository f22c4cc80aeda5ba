"""The step inspect runs or traces: synthetic data, layer clones, the training clone, and the dispatch.

`fusion_report`, `placement_report` and the callback's first-step reports run
(or, for a prediction, trace) the step made here. It is also where synthetic
data and clones are built for the other callers of a model's step (see the
sections below).
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


def is_subclassed(model):
    """`model` is neither a Functional nor a Sequential model: it has no symbolic inputs of its own."""
    import keras
    from keras.src.models.functional import Functional

    return not isinstance(model, (keras.Sequential, Functional))


# ----------------------------------------------------------------------------
# Inputs: lengths for open dimensions, dtypes, random values.
#
# Two callers fill a model's input spec with random values, with their own policies (kept as
# they were when the two copies became one):
# - `synthetic_inputs` (inspect): Functional and Sequential models; an open dimension takes a
#   length a layer declares, else the first of `DEFAULT_LENGTHS` the model accepts symbolically
#   (`accepts_symbolically`: an output spec with no zero-size dimension); float16 inputs stay
#   float16; a fixed batch dimension is kept.
# - `make_inputs` (convert's verification and op counts): also subclassed models (the shapes they
#   were built with, `input_specs`); an open dimension takes the first of `OPEN_DIM_LENGTHS` the
#   model runs with on one row (`runs_on_one_row`); float16 inputs are made float32; the batch
#   dimension is always `batch_size`; a string input is a ValueError asking for ``inputs=``.
# Both make bfloat16 inputs float32.

# Lengths tried for an input's `None` sequence/spatial dimensions when the model declares none,
# smallest first (each is checked symbolically before use).
DEFAULT_LENGTHS = (32, 64, 128, 224)
# Lengths convert() tries, in order, for an input dimension the model leaves open (None sequence or
# spatial dims); each is checked by running the model on one row.
OPEN_DIM_LENGTHS = (32, 64, 128, 224, 16, 8)
# Integer inputs of convert()'s verification data are drawn from [0, high) with the first of these the
# model runs with: token ids and masks take [0, 10); an index input with fewer rows (BERT's two
# segment ids) takes [0, 2).
INT_INPUT_HIGHS = (10, 2)
# Layer attributes that declare the sequence length a model expects.
_LENGTH_ATTRIBUTES = ("sequence_length", "input_length", "maxlen", "max_length", "output_sequence_length")


def has_open_dims(shapes):
    """Some shape in `shapes` has a None dimension past the batch."""
    return any(d is None for shape in shapes for d in tuple(shape)[1:])


def declared_lengths(model):
    """Sequence lengths `model`'s layers declare (``sequence_length``, ``input_length``, ...), in order."""
    found = []
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten(include_self=True, recursive=True) if flatten else ():
        for attr in _LENGTH_ATTRIBUTES:
            value = getattr(layer, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value not in found:
                found.append(value)
    return found


def fill_shape(shape, batch_size, length, keep_batch=True):
    """`shape` with its None dims filled: the batch with `batch_size` (also a fixed one unless
    `keep_batch`), the others with `length`."""
    shape = tuple(shape)
    if not keep_batch:
        return (batch_size,) + tuple(length if d is None else int(d) for d in shape[1:])
    return tuple((batch_size if i == 0 else length) if d is None else int(d) for i, d in enumerate(shape))


def random_array(shape, dtype, rng, widen_float16=False, int_high=10):
    """Random values of `dtype`: integers in [0, `int_high`), booleans, else standard normal floats
    (bfloat16, and float16 when `widen_float16`, made float32)."""
    wide = ("bfloat16", "float16") if widen_float16 else ("bfloat16",)
    dtype = np.dtype("float32" if dtype in wide else dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, int_high, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.bool_):
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(dtype)


def random_batch(specs, batch_size, length, seed, keep_batch=True, widen_float16=False, int_high=10):
    """One batch for ``[(shape, dtype)]`` `specs`: an array, or a list of them for several inputs."""
    rng = np.random.default_rng(seed)
    values = [random_array(fill_shape(shape, batch_size, length, keep_batch), dtype, rng, widen_float16, int_high)
              for shape, dtype in specs]
    return values[0] if len(values) == 1 else values


def accepts_symbolically(model, specs, batch_size, length):
    """`model`'s output spec for inputs of `specs` with open dims of `length` exists and is not empty."""
    import keras

    tensors = [keras.KerasTensor(fill_shape(shape, batch_size, length), dtype=dtype) for shape, dtype in specs]
    try:
        out = model.compute_output_spec(tensors[0] if len(tensors) == 1 else tensors)
    except Exception:  # the model refuses this length (too short for its convs, ...)
        return False
    return all(0 not in tuple(o.shape) for o in keras.tree.flatten(out) if hasattr(o, "shape"))


def runs_on_one_row(model, x):
    """`model` runs (inference mode) on the first row of batch `x`."""
    import keras

    try:
        model(keras.tree.map_structure(lambda v: v[:1], x), training=False)
        return True
    except Exception:  # arbitrary user code: this batch's shapes are refused
        return False


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
    specs = [(tuple(t.shape), t.dtype) for t in inputs]
    length = None
    if has_open_dims(shape for shape, _ in specs):
        declared = declared_lengths(model)
        tried = declared + [n for n in DEFAULT_LENGTHS if n not in declared]
        length = next((n for n in tried if accepts_symbolically(model, specs, batch_size, n)), None)
        if length is None:
            shapes = [shape for shape, _ in specs]
            raise ValueError(
                f"Cannot choose a length for the None dimensions of the model's inputs: it accepts none of "
                f"{tried}. Pass inputs= (a batch the model accepts). Received: input shapes={shapes}"
            )
    return in_input_structure(model, random_batch(specs, batch_size, length, seed))


def in_input_structure(model, values):
    """A batch from `random_batch` (one array, or a list in input order) in the structure `model`'s
    functional inputs were given in (a dict for ``{"token_ids": ..., "padding_mask": ...}``)."""
    import keras

    struct = getattr(model, "_inputs_struct", None) if not is_subclassed(model) else None
    if struct is None or not isinstance(struct, dict):
        return values
    return keras.tree.pack_sequence_as(struct, values if isinstance(values, list) else [values])


def input_specs(model):
    """``[(shape, dtype)]`` of `model`'s inputs: its functional inputs, else the shapes it was built with.

    Raises:
        ValueError: a subclassed model whose build shapes are not one plain shape.
    """
    inputs = getattr(model, "inputs", None) if not is_subclassed(model) else None
    if inputs:
        return [(tuple(t.shape), str(t.dtype)) for t in inputs]
    config = model.get_build_config() if model.built else None
    shapes = []
    if config and "input_shape" in config:
        shapes = [config["input_shape"]]
    elif config and "shapes_dict" in config:
        shapes = list(config["shapes_dict"].values())
    if len(shapes) != 1 or not isinstance(shapes[0], (list, tuple)) or \
            any(isinstance(d, (list, tuple, dict)) for d in shapes[0]):
        raise ValueError(
            f"convert() cannot tell the input shape of model {model.name!r} ({type(model).__name__}); pass "
            f"verification data with convert(..., inputs=x). Received: inputs=None"
        )
    return [(tuple(shapes[0]), model.compute_dtype if model.compute_dtype != "bfloat16" else "float32")]


def make_inputs(model, batch_size, seed, inputs=None):
    """Verification inputs of convert(): `inputs` when given, else random ones of `model`'s input spec.

    An input dimension the model leaves open (None, besides the batch) takes the first
    length of `OPEN_DIM_LENGTHS` the stock model runs with.

    Raises:
        ValueError: string inputs, an input shape convert() cannot tell, or no length
            the model accepts (each asks for ``inputs=``).
    """
    if inputs is not None:
        return inputs
    specs = input_specs(model)
    if any("string" in dtype for _, dtype in specs):
        raise ValueError(
            f"convert() cannot make random verification data for the string input of {model.name!r}; "
            "pass representative data with convert(..., inputs=x). Received: inputs=None"
        )
    if not has_open_dims(shape for shape, _ in specs):
        return in_input_structure(model, random_batch(specs, batch_size, None, seed, keep_batch=False,
                                                      widen_float16=True))
    ints = any(np.issubdtype(np.dtype(d), np.integer) for _, d in specs if d not in ("bfloat16",))
    for int_high in INT_INPUT_HIGHS if ints else INT_INPUT_HIGHS[:1]:
        for length in OPEN_DIM_LENGTHS:
            x = in_input_structure(model, random_batch(specs, batch_size, length, seed, keep_batch=False,
                                                       widen_float16=True, int_high=int_high))
            if runs_on_one_row(model, x):
                return x
    raise ValueError(
        f"convert() found no length for the open (None) input dimensions of {model.name!r} that the model "
        f"accepts (tried {', '.join(map(str, OPEN_DIM_LENGTHS))}); pass verification data with "
        "convert(..., inputs=x). Received: inputs=None"
    )


def batch_size_of(inputs):
    """The batch size of a batch of inputs (its first array's first dimension), or None."""
    import keras

    for leaf in keras.tree.flatten(inputs):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


# ----------------------------------------------------------------------------
# Targets.
#
# Two callers make random targets for a model's outputs, with their own policies:
# - `synthetic_targets` (inspect's train step): shapes from the symbolic outputs (a subclassed
#   model's from ``compute_output_spec(inputs)``), every None dimension taking `batch_size`;
#   integer labels for a sparse loss, else uniform float32; in the model's output structure.
# - `make_targets` (convert's gradient check and op counts): shapes from the symbolic outputs when
#   only the batch is open, else from a run on one row, the batch that of the inputs; uniform
#   float32 (the check's loss is MSE); one array or a flat list.


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


def random_targets(shapes, seed, sparse=()):
    """One array per shape: uniform float32, or where `sparse[i]` integer labels in [0, shape[-1])."""
    rng = np.random.default_rng(seed)
    values = []
    for i, shape in enumerate(shapes):
        if i < len(sparse) and sparse[i]:
            values.append(rng.integers(0, int(shape[-1]), size=shape[:-1]).astype("int32"))
        else:
            values.append(rng.random(shape).astype("float32"))
    return values


def synthetic_targets(model, batch_size=8, loss=None, seed=1, inputs=None):
    """Random targets matching the model's outputs (integer labels for sparse losses).

    The targets have the structure of the model's outputs (a dict or list
    for a multi-output functional model), which is what ``fit`` expects. A
    subclassed model has no symbolic outputs: given `inputs`, its output
    shapes come from ``model.compute_output_spec(inputs)`` (symbolic, nothing
    runs).
    """
    import keras

    outputs = getattr(model, "outputs", None) or []
    struct = getattr(model, "_outputs_struct", None)
    if inputs is not None and (not outputs or has_open_dims(o.shape for o in outputs)):
        # No symbolic outputs, or outputs with open dims besides the batch (a sequence model's
        # [B, T, V] logits): their shapes for these inputs.
        try:
            struct = model.compute_output_spec(keras.tree.map_structure(
                lambda v: keras.KerasTensor(tuple(v.shape), dtype=keras.backend.standardize_dtype(v.dtype)), inputs))
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
    shapes = [tuple(batch_size if d is None else int(d) for d in out.shape) for out in outputs]
    sparse = [_loss_is_sparse(_loss_for(loss, i, names[i] if i < len(names) else None)) for i in range(len(shapes))]
    values = random_targets(shapes, seed, sparse)
    if struct is not None and not keras.tree.is_nested(struct):
        return values[0]
    if struct is not None:
        return keras.tree.pack_sequence_as(struct, values)
    return values[0] if len(values) == 1 else values


def make_targets(model, x, seed):
    """Random float targets shaped like `model`'s outputs on `x` (convert's gradient check and op counts)."""
    import keras

    b = int(keras.tree.flatten(x)[0].shape[0])
    outs = getattr(model, "outputs", None) if not is_subclassed(model) else None
    if outs and not has_open_dims(o.shape for o in outs):
        shapes = [(b,) + tuple(o.shape)[1:] for o in outs]
    else:  # run it on one row for the output shapes
        one = keras.tree.map_structure(lambda v: np.asarray(v)[:1], x)
        shapes = [(b,) + tuple(o.shape)[1:] for o in keras.tree.flatten(model(one, training=False))]
    values = random_targets(shapes, seed)
    return values[0] if len(values) == 1 else values


# ----------------------------------------------------------------------------
# Clones.
#
# A layer's config may hold a plain function Keras cannot deserialize (a lambda, ``tf.nn.swish``).
# The two ways of carrying it over differ, and each caller keeps its own:
# - `callable_safe_clone` (inspect's training clone): the config as it is first; where that fails,
#   `activation` / `recurrent_activation` made "linear" and the layer's own callables set on the
#   clone afterwards (this also covers a lambda, which ``get_config`` writes without a class name).
# - `from_config` (convert's copies): every serialized plain function replaced by the layer's own
#   attribute before ``from_config``, never set afterwards (a constructor that wraps its callable
#   gets the right one); what this cannot re-create, convert copies another way.

# Layer config entries that hold a callable which may not deserialize (a lambda, a TF function
# such as tf.nn.swish): the clone gets the very same callable instead.
_CALLABLE_CONFIG_KEYS = ("activation", "recurrent_activation")


def live_callables(layer, config):
    """`config` with each serialized plain function (an activation given as ``tf.nn.swish`` or a
    lambda, which Keras cannot deserialize) replaced by the layer's own attribute of that name."""
    out = dict(config)
    for k, v in config.items():
        if isinstance(v, dict) and v.get("class_name") in ("function", "__lambda__") and callable(getattr(layer, k, None)):
            out[k] = getattr(layer, k)
    return out


def from_config(layer, config):
    """A new `layer` of the same class from `config`, its plain functions carried over (`live_callables`)."""
    return type(layer).from_config(live_callables(layer, config))


def callable_safe_clone(layer):
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


def functional_view(model):
    """A Functional model over `model`'s own layers (no copy: the same variables), or None without
    symbolic inputs and outputs (a subclassed model)."""
    import keras

    inputs, outputs = getattr(model, "inputs", None), getattr(model, "outputs", None)
    if not inputs or not outputs:
        return None
    return keras.Model(inputs, outputs, name=model.name)


def compiled_clone(model, optimizer, loss, jit_compile="auto", copy=True):
    """``(clone, how)``: `model` to run a train step of its own on, compiled with `optimizer` and `loss`.

    With `copy`, a copy (``keras.models.clone_model`` with `callable_safe_clone`, the weights set);
    where Keras cannot re-create a layer from its config (a subclassed block whose ``__init__``
    takes no ``**kwargs``), and without `copy`, a `functional_view` over the model's own layers:
    the caller restores the variables its step changes. `how` says which, for a note.

    Raises:
        ValueError: when neither can be made (a subclassed model that cannot be cloned).
    """
    import keras

    how = "clone"
    error = None
    if copy:
        try:
            clone = keras.models.clone_model(model, clone_function=callable_safe_clone)
            clone.set_weights(model.get_weights())
        except Exception as e:  # clone_model raises many types for subclassed layers and models
            error = e
    if not copy or error is not None:
        clone = functional_view(model)
        if clone is None:
            raise ValueError(
                "To inspect the train step with a different optimizer/loss the model is cloned, "
                f"and cloning failed ({error}). Compile the model instead. Received: model={model.name!r}"
            ) from error
        how = "view over the model's own layers" + (
            f" (cloning failed: {type(error).__name__}; its weights are restored)" if error is not None else "")
    clone.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    return clone, how


# ----------------------------------------------------------------------------
# The step.


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


def _training_model(model, optimizer, loss, jit_compile, notes):
    """The model whose train step to capture: the user's own, or a compiled clone."""
    if optimizer is None and loss is None and getattr(model, "compiled", False):
        return model
    if optimizer is None and getattr(model, "compiled", False):
        optimizer = model.optimizer
    if loss is None:
        loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    if loss is None:
        loss = "mse"
    optimizer = _fresh_optimizer(optimizer)
    jit = jit_compile if jit_compile is not None else getattr(model, "jit_compile", False)
    clone, how = compiled_clone(model, optimizer, loss, jit_compile=bool(jit) and jit != "auto")
    notes.append(
        f"train step inspected on a compiled {how} (optimizer={_describe(optimizer)}, "
        f"loss={_describe(loss)}); the model itself is untouched"
    )
    return clone


def capture_step(model_or_fn, inputs=None, mode="predict", *, targets=None, sample_weight=None,
            optimizer=None, loss=None, batch_size=8, jit_compile=None, dynamic_batch=False):
    """Runs one step and returns the `Capture` plus the model actually run (or None) and notes."""
    return _step(model_or_fn, inputs, mode, False, targets=targets, sample_weight=sample_weight,
                 optimizer=optimizer, loss=loss, batch_size=batch_size, jit_compile=jit_compile,
                 dynamic_batch=dynamic_batch)


def _step(model_or_fn, inputs, mode, trace, *, targets=None, sample_weight=None, optimizer=None, loss=None,
          batch_size=8, jit_compile=None, dynamic_batch=False):
    """`capture_step`, or with `trace` the same step traced and not run (`capture.trace_train`, ...)."""
    notes = []
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if not isinstance(dynamic_batch, bool) or (dynamic_batch and not (mode == "train" and _is_model(model_or_fn))):
        raise ValueError("`dynamic_batch` is a bool, and True applies to a Keras model's train step only "
                         f"(mode='train'). Received: dynamic_batch={dynamic_batch!r}, mode={mode!r}")
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
            cap = (trace_train if trace else capture_train)(model, x, y, sample_weight, dynamic_batch)
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
            compiled), ``batch_size`` (default 8), ``jit_compile``,
            ``dynamic_batch`` (train mode: the step sees an unknown batch
            dimension, as ``fit`` gives it when the batch size does not divide
            the data, so shape arithmetic on the batch size runs in the step;
            default False: the batch's static shape, as when it divides).

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


def placement_report(model_or_fn, inputs=None, mode="predict", predict_for=None, macos=None, gap_kernels=True,
                     **kw):
    """Runs one step and reports ops that ran on CPU while a GPU was present; or predicts them for a Metal backend.

    Arguments as for `fusion_report`. With `predict_for`
    (``"tensorflow-metal-plugin"`` or ``"tensorflow-metal"``) nothing runs:
    the step is traced as it would be on that backend (inside
    `tfmetal_ext.devices.assume_backend`, with Keras' GPU-only branches such
    as its cuDNN LSTM taken; see `tfmetal_ext.inspect.predict`), and every
    compute op with no kernel there for its dtype is listed with its layer
    and whether it would fall back to the CPU, fail (no CPU kernel either),
    or run on the host. Works on any machine. `macos` (``"12.7"``): the
    macOS to predict for where the backend's kernels depend on it (Apple's
    tensorflow-metal registers its stateless-random kernels from macOS 13);
    None: this Mac's, or off a Mac an assumed one, named in the report's notes.
    `gap_kernels`: count the GPU kernels tfmetal_ext's op library registers
    for standard ops the backend lacks (`tfmetal_ext.backends.gap_kernels`;
    they are registered when tfmetal_ext is imported on a Mac): such ops are
    reported as on the device, "tfmetal_ext gap kernel". False predicts the
    backend alone, as for a process that never imports tfmetal_ext.

    Returns:
        A `PlacementReport`; with `predict_for`, a `PredictedPlacementReport`:
        its `entries` are the ops without a device kernel there, its
        `transfers` / `transfer_count` the data edges per step between host
        and device memory, each a copy TensorFlow makes (see
        `tfmetal_ext.inspect.transfers`).

    Raises:
        ValueError: on a bad `predict_for` (or mode, batch size, ...).
    """
    if predict_for is None:
        if macos is not None:
            raise ValueError(f"`macos` applies to a prediction only: pass predict_for=... too. Received: macos={macos!r}")
        if gap_kernels is not True:
            raise ValueError("`gap_kernels` applies to a prediction only: a real report shows what ran. "
                             f"Received: gap_kernels={gap_kernels!r}")
        cap, model, _ = capture_step(model_or_fn, inputs, mode, **kw)
        return placement_from_capture(cap, model)
    predict.validate_predict_for(predict_for)
    predict.macos_version(macos)  # a bad `macos` fails before the trace
    with predict.tracing_as(predict_for):
        cap, model, notes = _step(model_or_fn, inputs, mode, True, **kw)
        index = LayerIndex(model, cap.layer_scopes)
    return predict.build_predicted_report(cap, index, predict_for, model=model, notes=notes, macos=macos,
                                          gap=gap_kernels)


def placement_from_capture(cap, model=None):
    gpu = bool(devices.capabilities().gpus) or None
    return build_placement_report(cap, LayerIndex(model, cap.layer_scopes), gpu_present=gpu)
