"""Fusion and placement inspection of the graphs TensorFlow actually ran.

>>> report = tfmetal_ext.inspect.fusion_report(model, mode="train")
>>> print(report)
>>> tfmetal_ext.inspect.assert_fused(report, layer="conv1", op="_FusedConv2D",
...                                  fused_ops=["BiasAdd", "Relu"])
"""

from __future__ import annotations

import logging

import numpy as np

from tfmetal_ext import devices
from tfmetal_ext.inspect.capture import Capture, capture_call, capture_function, capture_predict, capture_train
from tfmetal_ext.inspect.catalog import PATTERNS, Expectation, FusionContext, register_rule
from tfmetal_ext.inspect.report import (
    FallbackNode,
    FusedNode,
    FusionReport,
    LayerIndex,
    LayerRow,
    PlacementReport,
    build_fusion_report,
    build_placement_report,
)

__all__ = [
    "PATTERNS",
    "Capture",
    "Expectation",
    "FallbackNode",
    "FusedNode",
    "FusionContext",
    "FusionReport",
    "LayerRow",
    "PlacementReport",
    "assert_fused",
    "assert_no_cpu_fallback",
    "capture_step",
    "fusion_report",
    "placement_report",
    "register_rule",
]

logger = logging.getLogger("tfmetal_ext")

_MODES = ("predict", "train")


def _is_model(obj):
    import keras

    return isinstance(obj, keras.Model)


def _random_for(shape, dtype, batch_size, rng):
    shape = tuple(batch_size if d is None else int(d) for d in shape)
    dtype = np.dtype(dtype if dtype not in ("bfloat16",) else "float32")
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 10, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.bool_):
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(dtype)


def synthetic_inputs(model, batch_size=8, seed=0):
    """Random inputs matching a built functional/Sequential model's input spec."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            "Cannot derive inputs for a model without a known input spec (subclassed "
            f"or unbuilt); pass inputs=. Received: model={model.name!r}"
        )
    rng = np.random.default_rng(seed)
    values = [_random_for(t.shape, t.dtype, batch_size, rng) for t in inputs]
    return values[0] if len(values) == 1 else values


def _loss_is_sparse(loss):
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or type(loss).__name__
    return "sparse" in str(name).lower()


def synthetic_targets(model, batch_size=8, loss=None, seed=1):
    """Random targets matching the model's outputs (integer labels for sparse losses)."""
    rng = np.random.default_rng(seed)
    outputs = getattr(model, "outputs", None) or []
    if not outputs:
        raise ValueError(
            f"Cannot derive targets for model {model.name!r}; pass targets=. Received: targets=None"
        )
    values = []
    for out in outputs:
        shape = tuple(batch_size if d is None else int(d) for d in out.shape)
        if _loss_is_sparse(loss):
            values.append(rng.integers(0, int(shape[-1]), size=shape[:-1]).astype("int32"))
        else:
            values.append(rng.random(shape).astype("float32"))
    return values[0] if len(values) == 1 else values


def _context(mode, xla):
    caps = devices.capabilities()
    return FusionContext(
        backend=caps.backend, onednn=caps.onednn, mode=mode, xla=xla, cpu_fp16=caps.cpu_fp16
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
    import keras

    if optimizer is None and loss is None and getattr(model, "compiled", False):
        return model
    try:
        clone = keras.models.clone_model(model)
    except Exception as e:  # clone_model raises many types for subclassed models
        raise ValueError(
            "To inspect the train step with a different optimizer/loss the model is cloned, "
            f"and cloning failed ({e}). Compile the model instead. Received: model={model.name!r}"
        ) from e
    clone.set_weights(model.get_weights())
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
        f"train step inspected on a compiled clone (optimizer={_describe(optimizer)}, "
        f"loss={_describe(loss)}); the model itself is untouched"
    )
    return clone


def capture_step(model_or_fn, inputs=None, mode="predict", *, targets=None, sample_weight=None,
            optimizer=None, loss=None, batch_size=8, jit_compile=None):
    """Runs one step and returns the `Capture` plus the model actually run (or None) and notes."""
    notes = []
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}. Received: mode={mode!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if _is_model(model_or_fn):
        model = model_or_fn
        if mode == "train":
            model = _training_model(model, optimizer, loss, jit_compile, notes)
        x = inputs if inputs is not None else synthetic_inputs(model, batch_size)
        if mode == "predict":
            cap = capture_predict(model, x)
        else:
            y = targets if targets is not None else synthetic_targets(model, batch_size, getattr(model, "loss", None))
            cap = capture_train(model, x, y, sample_weight)
        return cap, model, notes
    if not callable(model_or_fn):
        raise ValueError(
            f"Expected a keras.Model or a callable. Received: model_or_fn={model_or_fn!r}"
        )
    if mode != "predict":
        notes.append("mode applies to Keras models only; the function was run as given")
    args = inputs if isinstance(inputs, (tuple, list)) else ((inputs,) if inputs is not None else ())
    return capture_function(model_or_fn, *args, jit_compile=jit_compile), None, notes


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
    ctx = _context(cap.mode if cap.mode in _MODES else "predict", cap.jit_compile)
    policy = model.dtype_policy.name if model is not None else None
    index = LayerIndex(model, cap.layer_scopes)
    return build_fusion_report(cap, index, ctx, policy=policy, notes=notes)


def placement_report(model_or_fn, inputs=None, mode="predict", **kw):
    """Runs one step and reports ops that ran on CPU while a GPU was present.

    Arguments as for `fusion_report`. Returns a `PlacementReport`.
    """
    cap, model, _ = capture_step(model_or_fn, inputs, mode, **kw)
    return placement_from_capture(cap, model)


def placement_from_capture(cap, model=None):
    gpu = bool(devices.capabilities().gpus) or None
    return build_placement_report(cap, LayerIndex(model, cap.layer_scopes), gpu_present=gpu)


# ----------------------------------------------------------------------------
# Assertions for users' test suites.


def assert_fused(report, layer=None, op=None, fused_ops=None):
    """Asserts that a fused node with `op` and exactly `fused_ops` exists (for `layer`).

    Args:
        report: a `FusionReport`.
        layer: a layer name or nested path; None means anywhere in the graph.
        op: the fused op, e.g. ``"_FusedConv2D"``; None accepts any.
        fused_ops: the exact ``fused_ops`` list; None accepts any.

    Raises:
        AssertionError: with the report table, when no such node exists.
    """
    nodes = report.fused_for(layer) if layer else report.fused
    nodes = [n for n in nodes if not n.backward] or nodes
    for n in nodes:
        if (op is None or n.op == op) and (fused_ops is None or list(n.fused_ops) == list(fused_ops)):
            return n
    want = f"{op or 'any fused op'}[{', '.join(fused_ops)}]" if fused_ops is not None else (op or "any fused op")
    have = ", ".join(n.label() for n in nodes) or "no fused node"
    raise AssertionError(
        f"Expected {want} for layer {layer or '(any)'}; found {have}.\n{report}"
    )


def assert_not_fused(report, layer):
    """Asserts that no forward fused node belongs to `layer`; returns its row's reason."""
    nodes = [n for n in report.fused_for(layer) if not n.backward]
    if nodes:
        raise AssertionError(
            f"Expected layer {layer} not to be fused; found {', '.join(n.label() for n in nodes)}.\n{report}"
        )
    try:
        return report.row(layer).reason
    except KeyError:
        return None


def assert_no_cpu_fallback(report):
    """Asserts a `PlacementReport` lists no op that fell back to CPU.

    Raises:
        AssertionError: listing the ops and their layers.
    """
    if not isinstance(report, PlacementReport):
        raise TypeError(f"Expected a PlacementReport. Received: report={type(report).__name__}")
    if report.fallbacks:
        raise AssertionError(f"{len(report.fallbacks)} op(s) fell back to CPU.\n{report}")
