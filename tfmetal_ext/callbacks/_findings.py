"""Train-begin findings: backend and pairing, dtype policy, XLA on Metal, stock layers the backend
cannot run, the optimizer."""

from __future__ import annotations

import warnings

from tfmetal_ext import backends, devices, precision
from tfmetal_ext.backends.fusion import LOSS_NAMES, LOSS_TO_FUSED, OPTIMIZER_TO_FUSED
from tfmetal_ext.callbacks._errors import MetalCallbackError, PerformanceWarning
from tfmetal_ext.callbacks._model import is_stock, leaf_layers


class Findings:
    """The train-begin checks of one run, one line each.

    Args:
        strict: raise `MetalCallbackError` where a check would otherwise warn
            about ``jit_compile=True`` on Metal.

    Attributes:
        lines: the findings in order; `add` appends (later parts add theirs).
    """

    def __init__(self, strict=False):
        self.strict = strict
        self.lines = []

    def add(self, text, warn=False):
        """Records `text`; with `warn`, also issues it as a `PerformanceWarning`."""
        self.lines.append(text)
        if warn:
            warnings.warn(f"MetalCallback: {text}", PerformanceWarning, stacklevel=4)  # at the caller of check()

    def check(self, model, caps):
        """Runs every train-begin check of `model` against the capabilities `caps`."""
        self._environment(caps)
        self._policy(model, caps)
        self._xla(model, caps)
        self._unsupported_layers(model, caps)
        self._optimizer(model)
        self._loss(model)

    def _environment(self, caps):
        metal = caps.metal_plugin_version or "not installed"
        plugin = getattr(caps, "metal_plugin", None) or "tensorflow-metal"
        self.add(
            f"backend {caps.backend}; TensorFlow {caps.tf_version}, Keras {caps.keras_version}, "
            f"{plugin} {metal} (pairing: {caps.pairing})"
        )
        if caps.pairing == devices.KNOWN_BROKEN:
            self.add(
                f"TensorFlow {caps.tf_version} with {plugin} {metal} is a known-broken pairing; "
                f"fix: {caps.pairing_fix}",
                warn=True,
            )

    def _policy(self, model, caps):
        model_policy = model.dtype_policy.name
        recommended = precision.recommend()
        if model_policy != recommended.policy:
            why = "; ".join(r for r in recommended.reasons if "jit" not in r.lower() and "XLA" not in r)
            self.add(f"dtype policy: model {model_policy}, configure() would choose {recommended.policy} ({why})")
        else:
            self.add(f"dtype policy: {model_policy} (what configure() chooses here)")
        avoided = sorted(precision.avoided_fusions())
        if avoided:
            self.add(
                f"avoided fusions (configure(avoid_fusions=...)): {', '.join(avoided)}: "
                "those layers emit their safe unfused form"
            )
        if caps.backend == "metal":
            f32 = [
                l.name
                for l in leaf_layers(model)
                if l.weights and getattr(l.dtype_policy, "compute_dtype", None) == "float32"
            ]
            if f32:
                shown = ", ".join(f32[:5]) + (f", ... ({len(f32)} in all)" if len(f32) > 5 else "")
                self.add(
                    f"{len(f32)} layer(s) compute in float32 on Metal ({shown}): half kernels are faster; "
                    "call tfmetal_ext.configure() (mixed_float16) before building the model",
                    warn=True,
                )
        elif caps.backend == "cpu" and not caps.cpu_fp16:
            if any(getattr(l.dtype_policy, "compute_dtype", None) == "float16" for l in leaf_layers(model)):
                self.add(
                    "float16 compute on a CPU without native float16: the remapper skips half nodes, so "
                    "nothing fuses; use mixed_bfloat16 or float32 (tfmetal_ext.configure() picks)",
                    warn=True,
                )

    def _xla(self, model, caps):
        if caps.backend == "metal" and getattr(model, "jit_compile", False) is True:
            plugin = getattr(caps, "metal_plugin", None) or "tensorflow-metal"
            text = (
                f"jit_compile=True on Metal: {plugin} has no XLA compiler (\"Could not find compiler "
                "for platform METAL\"); compile with jit_compile=False so the remapper fuses"
            )
            if self.strict:
                raise MetalCallbackError(text)
            self.add(text, warn=True)

    def _unsupported_layers(self, model, caps):
        """Stock layers this backend cannot run (its table's `unsupported_layers`), each with the fix.

        A layer counts when its inspection rule comes to that table reason
        here (stock LSTM/GRU on the open tensorflow-metal-plugin: only when
        Keras would take its cuDNN path, i.e. the arguments allow it), so
        ``use_cudnn=False`` or a non-cuDNN argument is not reported. Warns;
        with `strict`, raises `MetalCallbackError`.
        """
        from tfmetal_ext.inspect import catalog

        table = backends.current(caps)
        if not table.unsupported_layers:
            return
        ctx = catalog.FusionContext(
            backend=caps.backend, onednn=caps.onednn, mode="train", metal_plugin=getattr(caps, "metal_plugin", None)
        )
        flatten = getattr(model, "_flatten_layers", None)
        layers = list(flatten(include_self=False, recursive=True)) if flatten else list(model.layers)
        failing = {}
        for layer in layers:
            name = type(layer).__name__
            reason = table.unsupported_layers.get(name)
            if reason is None or not is_stock(layer):
                continue
            expected = catalog.expectation(layer, ctx) if catalog.has_rule(layer) else None
            if expected is None or expected.reason == reason:
                failing.setdefault(name, []).append(layer.name)
        texts = []
        for name, names in sorted(failing.items()):
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            texts.append(
                f"{len(names)} stock keras.layers.{name} layer(s) ({shown}) fail on {table.label}: "
                + table.unsupported_layers[name]
            )
        if texts and self.strict:
            raise MetalCallbackError("\n".join(texts))
        for text in texts:
            self.add(text, warn=True)

    def _loss(self, model):
        """Advice for each compiled loss of a stock Keras class with a `LOSS_TO_FUSED` row, or its string
        name (`LOSS_NAMES`), per output too."""
        loss = getattr(model, "loss", None)
        items = list(loss.values()) if isinstance(loss, dict) else list(loss) if isinstance(loss, (list, tuple)) else [loss]
        seen = set()
        for item in items:
            if isinstance(item, str):  # compile(loss="sparse_categorical_crossentropy"): Keras' class
                row = LOSS_TO_FUSED.get(LOSS_NAMES.get(item))
            else:
                row = LOSS_TO_FUSED.get(type(item).__name__) if item is not None and is_stock(item) else None
            if row is not None and row.stock not in seen:
                seen.add(row.stock)
                self.add(f"loss: stock keras {row.stock} runs TensorFlow's op and a Mul over the logits; {row.suggestion}")

    def _optimizer(self, model):
        opt = getattr(model, "optimizer", None)
        inner = getattr(opt, "inner_optimizer", opt)  # LossScaleOptimizer wraps the real one
        row = OPTIMIZER_TO_FUSED.get(type(inner).__name__) if inner is not None else None
        if row is not None and is_stock(inner):
            self.add(f"optimizer: stock keras {row.stock} issues many small ops per variable per step; {row.suggestion}")
