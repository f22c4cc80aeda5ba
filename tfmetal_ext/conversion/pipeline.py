"""`convert()` as its list of stages, and the `ConvertOptions` its arguments become.

Stages, in order:

- `ConvertOptions.from_args`: every argument check (the ValueErrors `convert` documents).
- `prepare`: an unbuilt subclassed model built on ``inputs=``; the report, the `Converter`, and
  the reference outputs of an in-place conversion.
- `rebuild`: the new model: the graph walk (`rebuild.Converter`), or a subclassed model's copy
  with its sublayers swapped; `copy_state`: that copy's state (`copying.transfer_state`).
- `compile_like`: a compiled model's compile config on the result, a stock optimizer swapped
  for its fused class (`fused_optimizer`).
- `check` (`verify.verify_conversion`), `quantize_int8` (`quantize.quantize_model`), `count`
  (op counts of both models, `report.count_ops`), `attach_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import time

import keras
import numpy as np

from tfmetal_ext.conversion import copying, quantize
from tfmetal_ext.conversion.rebuild import Converter
from tfmetal_ext.conversion.report import ConversionReport, Kept, count_ops
from tfmetal_ext.conversion.verify import as_numpy_list, make_inputs, verify_conversion
from tfmetal_ext.inspect import step

logger = logging.getLogger("tfmetal_ext")

INFERENCE_NOTE = "inference form: batch norms are folded; train the training form instead"
IN_PLACE_NOTE = ("in_place=True: outputs compared with the input model's before conversion; "
                 "gradients not compared (the models share the converted layers)")


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertOptions:
    """`convert()`'s arguments, checked (`from_args`).

    `quantize_mode` is convert's ``quantize`` (None or ``"int8"``; the name `quantize` is the
    module). `subclassed`: the model is neither Functional nor Sequential. `inference`, `verify`
    and `in_place` are booleans; the others are kept as given.
    """

    inference: bool
    verify: bool
    quantize_mode: str | None
    count_ops: bool | str
    batch_size: int
    tolerance: float | None
    seed: int
    inputs: object
    in_place: bool
    subclassed: bool

    @classmethod
    def from_args(cls, model, inference, verify, quantize_mode, count_ops, batch_size, tolerance, seed, inputs,
                  in_place):
        """The options of ``convert(model, ...)``; raises the ValueError `convert` documents for a bad one."""
        if not isinstance(model, keras.Model):
            raise ValueError(f"Expected a Functional, Sequential or subclassed keras.Model. Received: model={model!r}")
        if isinstance(model, keras.Sequential) and getattr(model, "_functional", None) is None:
            raise ValueError(
                "Only a built Sequential model (with an Input, or called once) can be converted. "
                f"Received: model={model.name!r} (not built)"
            )
        subclassed = step.is_subclassed(model)
        if subclassed and not model.built and inputs is None:
            raise ValueError(
                "A subclassed model must be built (called once) or given inputs=x to be converted. "
                f"Received: model={model.name!r} ({type(model).__name__}, not built)"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
        if count_ops not in (True, False, "train", "predict"):
            raise ValueError(
                f"`count_ops` must be True, False, 'train' or 'predict'. Received: count_ops={count_ops!r}")
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not tolerance > 0):
            raise ValueError(f"`tolerance` must be a positive number or None. Received: tolerance={tolerance!r}")
        quantize.check_args(quantize_mode, inference, in_place)
        return cls(inference=bool(inference), verify=bool(verify), quantize_mode=quantize_mode, count_ops=count_ops,
                   batch_size=batch_size, tolerance=tolerance, seed=seed, inputs=inputs, in_place=bool(in_place),
                   subclassed=subclassed)


def convert(model, inference=False, verify=True, *, quantize=None, count_ops=True, batch_size=2, tolerance=None,
            seed=0, inputs=None, in_place=False):
    """Returns an equivalent model built from tfmetal_ext's fusion-first layers.

    Walks the layer graph of a Functional or Sequential model (nested models
    recursively; a subclassed model or layer is copied and its tracked
    sublayers are swapped one to one, see below) and rewrites Conv2D, DepthwiseConv2D, Dense, EinsumDense,
    Conv2D -> BatchNormalization (-> Activation) chains, BatchNormalization,
    LayerNormalization, RMSNormalization, MultiHeadAttention, LSTM and GRU
    into `tfmetal_ext.layers`, folding
    separate activation layers into the layer before them when nothing else
    reads the pre-activation tensor. Layer names, input/output names,
    trainable flags, dtype policies and weights are preserved (weights copied
    bitwise where the mapping is the identity). Layers that cannot be
    converted are kept (copied) and listed with the reason. A compiled model's
    compile configuration is applied to the result.

    Subclassed layers and models: the layer (or a subclassed top-level
    model) is re-created with the same constructor arguments
    (``from_config(get_config())``, else the arguments Keras recorded when it
    was made), and each tracked sublayer of the copy (in attributes, lists and
    dicts) that has a one-to-one fusion-first drop-in (Conv2D, Dense,
    BatchNormalization, LayerNormalization, MultiHeadAttention, LSTM, GRU,
    ...) is replaced
    before the copy is built; the subclass keeps its own ``call``. Nothing is
    merged inside a subclass (no folded activation, no ConvBNAct): its call
    graph is not visible. Rewrites are reported per sublayer path
    (``block_1/conv``). `Bidirectional` and `TimeDistributed` are converted
    through to their inner layers. Every kept layer is an independent copy
    whose state is copied with Keras' own ``save_own_variables`` /
    ``load_own_variables`` and ``save_assets`` / ``load_assets``, so adapted
    preprocessing layers (Normalization, StringLookup, IntegerLookup,
    TextVectorization, Discretization, ...) and random layers' seed state
    come out equal. The result never shares a variable with `model` (unless
    ``in_place=True``).

    Keras operations in the graph (``keras.ops.*`` and ``keras.activations.*``
    applied to a KerasTensor: ``Silu``, ``Add``, ``GetItem``, ...) are kept,
    re-made from their config, and listed in ``report.kept`` with the reason;
    an activation operation right after a Dense (`planners.OP_ACTIVATIONS`)
    folds into it like an activation layer. A layer reachable along two paths
    (called in a nested model and again around it, like a keras-hub CausalLM's
    tied ``token_embedding``; or held by a kept layer and called in the graph)
    stays one object in the result, with its variables. A Functional subclass
    (a keras-hub backbone or task, a ``class Net(keras.Model)`` built from
    inputs and outputs) comes back as its own class over the new graph, its
    attributes pointing at the new layers (`copying.functional_copy`); a
    weightless layer attribute outside the graph (a task's preprocessor) is
    the same object. A ``.keras`` file of such a result loads back through
    the class's ``from_config``, i.e. rebuilt with stock layers: each
    graph-level layer replaced one to one is saved under the stock class's
    name (`_saved_names`), so the file loads; where graph-level layers
    were merged, the report's notes say it will not. The same holds for the
    swapped sublayers a kept subclassed layer holds in a list or a
    Sequential (`copying.keep_saved_names`). ``save_weights`` /
    ``load_weights`` between converted models always round-trip.

    Args:
        model: a built `keras.Model`: functional, `keras.Sequential`, or a
            subclassed model (built, or with ``inputs=``).
        inference: also fold batch norms into the preceding convolution's
            kernel and bias (the deployment form; not for training).
        quantize: None, or ``"int8"`` (needs ``inference=True``): then every
            leaf layer of the inference form whose ``quantize("int8")`` works
            (`FusedDense`, `FusedEinsumDense`, `FusedConv2D`, `FusedDepthwiseConv2D`, and
            the stock Dense, EinsumDense and Embedding that were kept; nested and
            subclassed ones included) gets weight-only int8 weights (Keras'
            abs-max, a float32 scale per output channel, float activations);
            the others are listed in ``report.quantize_skipped`` with the
            reason. verify then also checks the int8 model against the float
            inference form: each quantized layer within the half-step error
            bound on the inputs it received, and the outputs within
            `quantize.output_tolerance` (see `tfmetal_ext.conversion.quantize`).
            The report gives each layer's error, bound and weight bytes before
            -> after, and the model's totals.
        verify: run both models on random inputs of the model's input spec
            (inference mode) and, for the training form, compare one training
            step's gradients (MSE against random targets, dropout off);
            raises `VerificationError` on a mismatch. Where the stock
            model's own outputs or gradients are NaN or inf, the converted
            model must give the same non-finite values and the finite ones
            are compared (with a `RuntimeWarning` and a report note); if every
            output is non-finite there is nothing to compare and it raises.
        count_ops: count compute ops per train step and per inference call
            of both models with `tfmetal_ext.inspect.fusion_report`
            (uncompiled models are counted with plain SGD and MSE,
            `report.COUNT_OPTIMIZER`). The train-step counts trace two
            train steps, most of a big model's conversion time (Xception at
            96x96: about 25 s of 40 on two shared cores); ``"predict"`` or
            ``"train"`` counts that mode only.
        batch_size: batch size of the random inputs of verify and op counts.
        tolerance: relative tolerance of verify's output comparison
            (gradients: 20x), instead of the per-dtype defaults in
            `OUTPUT_RTOL` / `GRAD_RTOL`.
        seed: seed of the random inputs.
        inputs: verification and op-count data (a batch, as `model` takes it)
            instead of random inputs. Needed for string inputs, and where
            convert() cannot tell the input shape; an input dimension left
            open (None) otherwise takes the first length of
            `OPEN_DIM_LENGTHS` the stock model accepts.
        in_place: a layer that cannot be copied (its constructor arguments
            cannot be recovered) is converted in place: its tracked
            sublayers are swapped in the input model itself, which then
            shares that layer (and its new sublayers) with the result, and
            verification compares the result to the outputs the input model
            gave before (no gradient check). Without it such a layer raises
            `ValueError`.

    Returns:
        The converted `keras.Model` (a `keras.Sequential` for a Sequential
        input); its `conversion_report` attribute holds the
        `ConversionReport`.

    Raises:
        ValueError: if `model` is not a built model (``... Received:
            model=...``), `quantize` is not None or ``"int8"``, or is
            ``"int8"`` without ``inference=True`` (or with ``in_place=True``), or a layer cannot be copied (``in_place=False``;
            the message names the layer and why), or verification data
            cannot be made (string inputs, unknown input shape: pass
            ``inputs=``).
        VerificationError: (an `AssertionError`) when verify finds outputs or
            gradients that differ beyond tolerance (the message lists the
            per-layer or per-weight differences), or when every output of
            the stock model on the verification inputs is NaN or inf.

    Example:

    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
    ...                           keras.layers.BatchNormalization(), keras.layers.ReLU(),
    ...                           keras.layers.Flatten()])
    >>> fused = tfmetal_ext.convert(model, count_ops=False)
    >>> [type(l).__name__ for l in fused.layers]
    ['ConvBNAct', 'Flatten']
    """
    opts = ConvertOptions.from_args(model, inference, verify, quantize, count_ops, batch_size, tolerance, seed,
                                    inputs, in_place)
    report, conv, reference = prepare(model, opts)
    with _phase(model, "rebuild"):
        new, swaps = rebuild(model, conv, report, opts)
        copy_state(model, new, conv, swaps)
    compile_like(model, new, report)
    if opts.inference:
        report.notes.append(INFERENCE_NOTE)
    if opts.verify:
        with _phase(model, "verify"):
            check(model, new, conv, report, opts, reference)
    if opts.quantize_mode:
        with _phase(model, "int8 quantization"):
            quantize_int8(model, new, report, opts)
    if opts.count_ops:
        with _phase(model, "op counts"):
            count(model, new, report, opts, reference)
    return attach_report(new, report)


convert.__module__ = "tfmetal_ext.conversion"  # its documented home, which re-exports it


@contextlib.contextmanager
def _phase(model, what):
    """Logs how long a stage took (when it did not raise)."""
    t = time.perf_counter()
    yield
    logger.info("convert(%s): %s done in %.1f s", model.name, what, time.perf_counter() - t)


def prepare(model, opts):
    """``(report, converter, reference)``: an unbuilt subclassed model built on ``inputs``, an empty
    `ConversionReport`, the `Converter`, and (in place, verified) the stock outputs before conversion."""
    from tfmetal_ext import integrations

    integrations.load_available()  # planners for the layers of libraries in use (keras-hub)
    if opts.subclassed and not model.built:
        model(opts.inputs, training=False)
    report = ConversionReport(model=model.name, inference=opts.inference)
    conv = Converter(opts.inference, report, in_place=opts.in_place)
    reference = None
    if opts.in_place and opts.verify:
        reference = as_numpy_list(model(make_inputs(model, opts.batch_size, opts.seed, opts.inputs), training=False))
    return report, conv, reference


def rebuild(model, conv, report, opts):
    """``(new model, swaps)``: the converted graph, or a subclassed top-level model copied (or, in
    place, itself) with its sublayers swapped and the copy built; `swaps` is None unless the copy's
    state is still to be copied (`copy_state`)."""
    if not opts.subclassed:
        return conv.convert_model(model), None
    new, kind, swaps = conv.copy_deep(model, model.name)
    report.kept.append(Kept(model.name, type(model).__name__,
                            f"subclassed model: its call is its own; {len(swaps)} sublayer(s) swapped for "
                            "fusion-first ones (listed as rewrites)"))
    if kind == "in_place":
        conv.pairs += [(w, w) for w in model.trainable_weights if not any(w is b for _, b in conv.pairs)]
        return new, None
    x = make_inputs(model, opts.batch_size, opts.seed, opts.inputs)
    new(keras.tree.map_structure(lambda v: np.asarray(v)[:1], x), training=False)  # builds the copy
    return new, swaps


def copy_state(model, new, conv, swaps):
    """A subclassed copy's state (variables, assets, seed state) from the stock model; else nothing."""
    if swaps is not None:
        copying.transfer_state(model, new, conv.pairs, swaps, model.name)


def compile_like(model, new, report):
    """A compiled `model`'s compile config applied to `new` (a stock optimizer swapped for the fused
    class made from its config, `fused_optimizer`); a config that cannot be applied is a note."""
    if not getattr(model, "compiled", False):
        return
    try:
        config = model.get_compile_config()
        fused = fused_optimizer(getattr(model, "optimizer", None), report)
        if fused is not None:
            config = {**config, "optimizer": keras.saving.serialize_keras_object(fused)}
        if config.get("loss") is not None:
            config = {**config, "loss": mapped_losses(config["loss"], True, report.notes)}
        _compile_from_config(new, config)
        report.notes.append("compiled with the source model's compile config (fresh optimizer state)")
    except Exception as e:  # custom losses / metrics may not deserialize
        report.optimizer = None
        report.notes.append(f"not compiled: the compile config could not be applied ({e})")


def _compile_from_config(new, config):
    """``new.compile_from_config(config)``, also for a class whose ``compile()`` is its own (a
    keras-hub task), which Keras' method skips with a warning: then its ``compile`` is called with
    the deserialized config, and what that ``compile`` sets besides Keras' own compile state (a
    CausalLM's sampler) keeps the value carried over from the stock model."""
    from keras.src.saving import serialization_lib

    if getattr(type(new), "compile", None) is keras.Model.compile:
        new.compile_from_config(config)
        return
    before = dict(vars(new))
    new.compile(**serialization_lib.deserialize_keras_object(config))
    for k, v in before.items():
        if k not in _keras_compile_state() and vars(new).get(k) is not v:
            object.__setattr__(new, k, v) if k.startswith("_") else setattr(new, k, v)


@functools.lru_cache(maxsize=None)
def _keras_compile_state():
    """The attributes Keras' own ``Model.compile`` sets (found once, on a one-layer model)."""
    i = keras.Input((1,))
    probe = keras.Model(i, keras.layers.Dense(1)(i))
    before = dict(vars(probe))
    probe.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return frozenset(k for k, v in vars(probe).items() if before.get(k, None) is not v)


def mapped_losses(loss, to_fused, notes):
    """A compile config's serialized `loss` (one loss, or a list or dict of them per output) with each
    loss of a `LOSS_TO_FUSED` row as the other class of its row, made from the same config: the
    stock Keras class (or its string name, `LOSS_NAMES`) as the fused one (`to_fused`), or the fused
    class back as the stock one (`to_stock`). Each swap is noted."""
    from keras.src.saving import serialization_lib

    from tfmetal_ext.backends.fusion import LOSS_NAMES, LOSS_TO_FUSED

    if isinstance(loss, (list, tuple)):
        return type(loss)(mapped_losses(v, to_fused, notes) for v in loss)
    if isinstance(loss, str) and to_fused and loss in LOSS_NAMES:
        row = LOSS_TO_FUSED[LOSS_NAMES[loss]]
        target = getattr(importlib.import_module(row.module), row.fused)
        notes.append(f"loss: {loss!r} replaced by {target.__module__}.{target.__name__}() (Keras' defaults)")
        return keras.saving.serialize_keras_object(target())
    if not isinstance(loss, dict):
        return loss
    if "class_name" not in loss or "config" not in loss:
        return {k: mapped_losses(v, to_fused, notes) for k, v in loss.items()}
    name = loss["class_name"]
    row = next((r for r in LOSS_TO_FUSED.values() if name == (r.stock if to_fused else r.fused)), None)
    module = str(loss.get("module") or "")
    if row is None or not module.startswith("keras." if to_fused else row.module):
        return loss
    source = serialization_lib.deserialize_keras_object(loss)
    target = (getattr(importlib.import_module(row.module), row.fused) if to_fused else getattr(keras.losses, row.stock))
    notes.append(f"loss: {name} replaced by {target.__module__}.{target.__name__} from the same config")
    return keras.saving.serialize_keras_object(target.from_config(source.get_config()))


def fused_optimizer(optimizer, report):
    """`optimizer` (a stock Keras one with an `OPTIMIZER_TO_FUSED` row, also inside a
    `keras.optimizers.LossScaleOptimizer`) as the fused class made from its config, fresh state; else None.

    Sets ``report.optimizer`` to ``(stock, fused)`` class names and notes it, or notes why the
    stock optimizer is kept (its config does not load into the fused class).
    """
    import importlib

    from tfmetal_ext.backends.fusion import OPTIMIZER_TO_FUSED

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    wrapper = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    inner = wrapper.inner_optimizer if wrapper is not None else optimizer
    row = OPTIMIZER_TO_FUSED.get(type(inner).__name__)
    if row is None or not type(inner).__module__.startswith("keras.") or not type(inner).__name__ == row.stock:
        return None
    where = " inside its LossScaleOptimizer" if wrapper is not None else ""
    try:
        cls = getattr(importlib.import_module(row.module), row.fused)
        fused = cls.from_config(inner.get_config())
        if wrapper is not None:
            outer = wrapper.get_config()
            outer.pop("inner_optimizer", None)
            fused = type(wrapper).from_config({**outer, "inner_optimizer": keras.saving.serialize_keras_object(fused)})
    except Exception as e:  # a config only the stock class accepts (e.g. a custom schedule): keep it
        report.notes.append(f"optimizer: kept the stock {row.stock}{where}: its config does not load into "
                            f"{row.qualified} ({type(e).__name__}: {e})")
        return None
    report.optimizer = (row.stock, row.fused)
    report.notes.append(f"optimizer: stock {row.stock}{where} replaced by {row.qualified} from the same config "
                        "(fresh optimizer state)")
    return fused


def check(model, new, conv, report, opts, reference):
    """Verification (`verify.verify_conversion`); sets ``report.verified``."""
    if reference is not None:
        report.notes.append(IN_PLACE_NOTE)
    verify_conversion(model, new, conv, report, opts.inference, opts.batch_size, opts.tolerance, opts.seed,
                      opts.inputs, reference=reference)
    report.verified = True


def quantize_int8(model, new, report, opts):
    """`new`'s int8 form in place (`quantize.quantize_model`), checked on verification inputs when verifying."""
    x = make_inputs(model, opts.batch_size, opts.seed, opts.inputs) if opts.verify else None
    quantize.quantize_model(model, new, report, x, verify=opts.verify)


def count(model, new, report, opts, reference):
    """Op counts of the stock model (unless converted in place) and of `new`, into the report."""
    modes = ("train", "predict") if opts.count_ops is True else (opts.count_ops,)
    x = opts.inputs
    if x is None and (opts.subclassed or step.has_open_dims(t.shape for t in model.inputs)):
        x = make_inputs(model, opts.batch_size, opts.seed)
    if reference is None:  # in place, the input model is no longer the stock one
        report.ops_before = count_ops(model, opts.batch_size, report, "stock", x, modes)
    report.ops_after = count_ops(new, opts.batch_size, report, "converted", x, modes)


def attach_report(new, report):
    """`new` with its `conversion_report` (a plain attribute, not tracked by Keras), the report logged."""
    object.__setattr__(new, "conversion_report", report)
    logger.info("%s", report)
    return new
