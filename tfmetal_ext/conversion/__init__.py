"""Convert an existing Keras model into one built from tfmetal_ext's fusion-first layers, verified.

>>> model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3))
>>> fused = tfmetal_ext.convert(model)            # training form, verified
>>> print(fused.conversion_report)
>>> deploy = tfmetal_ext.convert(model, inference=True)   # batch norms folded into the convolutions
>>> int8 = tfmetal_ext.convert(model, inference=True, quantize="int8")   # ... and int8 weights

The converter walks the functional graph of a Functional or Sequential model
(nested models recursively), decides per call of each layer what replaces it,
and rebuilds the graph with the same layer names, input and output names,
trainable flags, dtype policies and weights:

| stock layers | becomes |
|---|---|
| Conv2D (+ Activation/ReLU) | `FusedConv2D` (activation folded in) |
| DepthwiseConv2D (+ Activation/ReLU) | `FusedDepthwiseConv2D` |
| Dense (+ Activation/ReLU) | `FusedDense` |
| Conv2D -> BatchNormalization (-> Activation/ReLU) | `ConvBNAct` (conv bias moved into the moving mean) |
| Conv2D/DepthwiseConv2D -> BatchNormalization (-> act), ``inference=True`` | `FusedConv2D`/`FusedDepthwiseConv2D` with the batch norm folded in |
| BatchNormalization (last axis, input rank >= 2: 3-D/5-D reshaped to NHWC around the fused op) | `FusedBatchNorm` |
| LayerNormalization (last axis) | `FusedLayerNorm` |
| LSTM / GRU (tanh/sigmoid, no recurrent dropout, no unroll, GRU reset_after) | `FusedLSTM` / `FusedGRU` |
| MultiHeadAttention (rank-3 inputs, sequence-axis attention, no returned scores; training form: no attention dropout) | `FusedMultiHeadAttention` (same weights) |
| RMSNormalization (last axis) | `FusedRMSNorm` |
| Bidirectional / TimeDistributed of one of the above | the same wrapper of the fused class |
| a sublayer of a subclassed layer or model (attribute, list, dict) | its one-to-one fused class, nothing merged |
| anything else | kept (an independent copy with the same constructor arguments and state), listed in the report with the reason |

A layer is absorbed into the one before it only when nothing else reads the
tensor between them (no other consumer, not a model output), its own output is
not an output of the top-level model (output names stay), both are called once, and they share
the dtype policy and trainable flag. A shared layer
(called more than once) is converted once and the new layer is shared the
same way; it is never merged with its neighbours.

Modules: `planners` (what replaces each layer call: the planner registry,
keyed by layer class, `register_planner`), `rebuild` (the graph walk that
makes the new model), `graph` (consumers and call counts of one graph),
`weights` (weight copies and batch-norm folding), `quantize` (the int8 form of the inference
model and its check against the float one), `copying` (independent
copies of kept and subclassed layers: construction, sublayer swaps, state
moved by Keras' own save/load methods), `verify` (outputs and gradients
against the stock model, `VerificationError`) and `report`
(`ConversionReport`).
"""

from __future__ import annotations

import logging

import keras

from tfmetal_ext.conversion import quantize  # noqa: F401  (a documented module; convert's argument shadows it below)
from tfmetal_ext.conversion.planners import register_planner
from tfmetal_ext.inspect import step
from tfmetal_ext.conversion.rebuild import Converter
from tfmetal_ext.conversion.report import NO_COUNTERPART, ConversionReport, Kept, Rewrite, count_ops as _count_ops
from tfmetal_ext.conversion.verify import (
    GRAD_RTOL,
    OPEN_DIM_LENGTHS,
    MIN_GRAD_BATCH,
    NOISE_FACTOR,
    OUTPUT_RTOL,
    VerificationError,
    make_inputs,
    verify_conversion,
)

logger = logging.getLogger("tfmetal_ext")

__all__ = [
    "GRAD_RTOL",
    "MIN_GRAD_BATCH",
    "NOISE_FACTOR",
    "NO_COUNTERPART",
    "OUTPUT_RTOL",
    "ConversionReport",
    "Kept",
    "Rewrite",
    "VerificationError",
    "convert",
    "register_planner",
]


def convert(model, inference=False, verify=True, *, quantize=None, count_ops=True, batch_size=2, tolerance=None,
            seed=0, inputs=None, in_place=False):
    """Returns an equivalent model built from tfmetal_ext's fusion-first layers.

    Walks the layer graph of a Functional or Sequential model (nested models
    recursively; a subclassed model or layer is copied and its tracked
    sublayers are swapped one to one, see below) and rewrites Conv2D, DepthwiseConv2D, Dense,
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

    Args:
        model: a built `keras.Model`: functional, `keras.Sequential`, or a
            subclassed model (built, or with ``inputs=``).
        inference: also fold batch norms into the preceding convolution's
            kernel and bias (the deployment form; not for training).
        quantize: None, or ``"int8"`` (needs ``inference=True``): then every
            leaf layer of the inference form whose ``quantize("int8")`` works
            (`FusedDense`, `FusedConv2D`, `FusedDepthwiseConv2D`, and the
            stock Dense, EinsumDense and Embedding that were kept; nested and
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
    import time

    from keras.src.models.functional import Functional

    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected a Functional, Sequential or subclassed keras.Model. Received: model={model!r}")
    if isinstance(model, keras.Sequential) and getattr(model, "_functional", None) is None:
        raise ValueError(
            "Only a built Sequential model (with an Input, or called once) can be converted. "
            f"Received: model={model.name!r} (not built)"
        )
    subclassed = not isinstance(model, (keras.Sequential, Functional))
    if subclassed and not model.built and inputs is None:
        raise ValueError(
            "A subclassed model must be built (called once) or given inputs=x to be converted. "
            f"Received: model={model.name!r} ({type(model).__name__}, not built)"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if count_ops not in (True, False, "train", "predict"):
        raise ValueError(f"`count_ops` must be True, False, 'train' or 'predict'. Received: count_ops={count_ops!r}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not tolerance > 0):
        raise ValueError(f"`tolerance` must be a positive number or None. Received: tolerance={tolerance!r}")
    from tfmetal_ext.conversion import quantize as _quantize

    _quantize.check_args(quantize, inference, in_place)
    if subclassed and not model.built:
        model(inputs, training=False)
    report = ConversionReport(model=model.name, inference=bool(inference))
    conv = Converter(bool(inference), report, in_place=bool(in_place))
    reference = _reference_outputs(model, batch_size, seed, inputs) if in_place and verify else None
    t0 = time.perf_counter()
    if subclassed:
        new = _convert_subclassed(model, conv, report, batch_size, seed, inputs)
    else:
        new = conv.convert_model(model)
    logger.info("convert(%s): rebuild done in %.1f s", model.name, time.perf_counter() - t0)
    if getattr(model, "compiled", False):
        try:
            config = model.get_compile_config()
            fused_optimizer = _fused_optimizer(getattr(model, "optimizer", None), report)
            if fused_optimizer is not None:
                config = {**config, "optimizer": keras.saving.serialize_keras_object(fused_optimizer)}
            new.compile_from_config(config)
            report.notes.append("compiled with the source model's compile config (fresh optimizer state)")
        except Exception as e:  # custom losses / metrics may not deserialize
            report.optimizer = None
            report.notes.append(f"not compiled: the compile config could not be applied ({e})")
    if inference:
        report.notes.append("inference form: batch norms are folded; train the training form instead")
    if verify:
        t = time.perf_counter()
        if reference is not None:
            report.notes.append("in_place=True: outputs compared with the input model's before conversion; "
                                "gradients not compared (the models share the converted layers)")
        verify_conversion(model, new, conv, report, bool(inference), batch_size, tolerance, seed, inputs,
                          reference=reference)
        report.verified = True
        logger.info("convert(%s): verify done in %.1f s", model.name, time.perf_counter() - t)
    if quantize:
        t = time.perf_counter()
        x = make_inputs(model, batch_size, seed, inputs) if verify else None
        _quantize.quantize_model(model, new, report, x, verify=bool(verify))
        logger.info("convert(%s): int8 quantization done in %.1f s", model.name, time.perf_counter() - t)
    if count_ops:
        t = time.perf_counter()
        modes = ("train", "predict") if count_ops is True else (count_ops,)
        x = inputs
        if x is None and (subclassed or step.has_open_dims(t.shape for t in model.inputs)):
            x = make_inputs(model, batch_size, seed)
        if reference is None:  # in place, the input model is no longer the stock one
            report.ops_before = _count_ops(model, batch_size, report, "stock", x, modes)
        report.ops_after = _count_ops(new, batch_size, report, "converted", x, modes)
        logger.info("convert(%s): op counts done in %.1f s", model.name, time.perf_counter() - t)
    object.__setattr__(new, "conversion_report", report)  # plain attribute, not tracked by Keras
    logger.info("%s", report)
    return new


def _fused_optimizer(optimizer, report):
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


def _reference_outputs(model, batch_size, seed, inputs):
    from tfmetal_ext.conversion.verify import as_numpy_list

    return as_numpy_list(model(make_inputs(model, batch_size, seed, inputs), training=False))


def _convert_subclassed(model, conv, report, batch_size, seed, inputs):
    """A subclassed top-level model: copied (or in place), sublayers swapped, built, state copied."""
    import numpy as np

    new, kind, swaps = conv.copy_deep(model, model.name)
    report.kept.append(Kept(model.name, type(model).__name__,
                            f"subclassed model: its call is its own; {len(swaps)} sublayer(s) swapped for "
                            "fusion-first ones (listed as rewrites)"))
    if kind == "in_place":
        conv.pairs += [(w, w) for w in model.trainable_weights if not any(w is b for _, b in conv.pairs)]
        return new
    x = make_inputs(model, batch_size, seed, inputs)
    new(keras.tree.map_structure(lambda v: np.asarray(v)[:1], x), training=False)  # builds the copy
    from tfmetal_ext.conversion import copying

    copying.transfer_state(model, new, conv.pairs, swaps, model.name)
    return new
