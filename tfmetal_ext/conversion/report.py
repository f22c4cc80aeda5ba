"""What `convert` did: `ConversionReport`, its `Rewrite` and `Kept` rows, and the op counts."""

from __future__ import annotations

import collections
import dataclasses

from tfmetal_ext.inspect import step

NO_COUNTERPART = "no fusion-first counterpart (kept as a copy with the same config and weights)"


@dataclasses.dataclass
class Rewrite:
    """One rewrite: stock layer(s) `source` replaced by layer `name` of class `new_class`."""

    source: tuple
    name: str
    new_class: str
    note: str = ""


@dataclasses.dataclass
class Kept:
    """A layer kept as it is, and why."""

    name: str
    class_name: str
    reason: str


@dataclasses.dataclass
class Quantized:
    """One layer of the converted model quantized by ``convert(..., quantize="int8")``.

    Attributes:
        name: the layer's path in the converted model (``block_1/conv`` inside
            a subclass or a nested model).
        class_name: its class.
        bytes_before, bytes_after: bytes of the layer's variables before and
            after (int8 kernel: 1 byte per element, plus a float32 scale per
            channel, plus the bias as it was).
        max_abs_error: largest |quantized - float| output of the layer on the
            inputs it received in the float model's verification pass; None
            when not verified.
        max_rel_error: `max_abs_error` relative to that output's max |y|.
        bound: the largest entry of the error bound the check used (half a
            quantization step per weight, see `quantize.bound_note`), None
            when there is no bound for the class or activation.
        bound_ratio: largest |error| / (bound + float slack) over the output
            entries (at most 1 when verified), None where not checked.
    """

    name: str
    class_name: str
    bytes_before: int
    bytes_after: int
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    bound: float | None = None
    bound_ratio: float | None = None
    note: str = ""


@dataclasses.dataclass
class ConversionReport:
    """What `convert` did.

    Attributes:
        model: name of the converted model.
        inference: whether the deployment (batch norm folded) form was made.
        rewrites: every `Rewrite`, nested models' ones with ``outer/inner`` names.
        kept: every layer kept as it is (`Kept`), with the reason.
        ops_before, ops_after: compute ops per step after grappler, keyed
            ``"train"`` (one `model.fit` step) and ``"predict"`` (one inference
            call), from `tfmetal_ext.inspect.fusion_report(...).num_ops`;
            empty when ops were not counted.
        verified: None when not verified, else True (a mismatch raises).
        max_output_diff: largest relative output difference found by verify.
        max_grad_diff: largest relative gradient difference (training form).
        notes: anything else worth knowing (compile config copied, ...).
        optimizer: ``(stock class, fused class)`` names when the source
            model's stock optimizer was replaced by its fused class
            (``("Adam", "FusedAdam")``; a LossScaleOptimizer keeps wrapping
            it), else None.
        quantize: the quantization mode (``"int8"``) or None.
        quantized: every layer quantized (`Quantized`), in layer order.
        quantize_skipped: layers with weights that were not quantized
            (`Kept` rows: path, class, reason).
        weight_bytes_before, weight_bytes_after: bytes of every variable of
            the whole model before and after quantization (None without
            ``quantize``); `quantized_bytes_before` / `quantized_bytes_after`
            sum the quantized layers only.
        max_quantized_output_diff: largest max |y_int8 - y_float| / max
            |y_float| over the model's outputs (the float model being the
            converted inference form before quantization).
        quantized_output_tolerance: the tolerance it was checked against
            (`quantize.output_tolerance`).
    """

    model: str
    inference: bool = False
    rewrites: list = dataclasses.field(default_factory=list)
    kept: list = dataclasses.field(default_factory=list)
    ops_before: dict = dataclasses.field(default_factory=dict)
    ops_after: dict = dataclasses.field(default_factory=dict)
    verified: bool | None = None
    max_output_diff: float | None = None
    max_grad_diff: float | None = None
    notes: list = dataclasses.field(default_factory=list)
    optimizer: tuple | None = None
    quantize: str | None = None
    quantized: list = dataclasses.field(default_factory=list)
    quantize_skipped: list = dataclasses.field(default_factory=list)
    weight_bytes_before: int | None = None
    weight_bytes_after: int | None = None
    max_quantized_output_diff: float | None = None
    quantized_output_tolerance: float | None = None

    @property
    def quantized_bytes_before(self):
        """Bytes of the quantized layers' variables before quantization."""
        return sum(q.bytes_before for q in self.quantized)

    @property
    def quantized_bytes_after(self):
        """Bytes of the quantized layers' variables after quantization."""
        return sum(q.bytes_after for q in self.quantized)

    @property
    def absorbed(self):
        """Names of the stock layers that were merged into another layer."""
        return [s for r in self.rewrites for s in r.source[1:]]

    def rewrite_for(self, name):
        """The `Rewrite` whose source includes stock layer `name` (KeyError if none)."""
        for r in self.rewrites:
            if name in r.source:
                return r
        raise KeyError(name)

    def kept_names(self):
        return [k.name for k in self.kept]

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        form = "inference form, batch norms folded" if self.inference else "training form"
        lines = [
            f"Conversion of {self.model!r} ({form}): {len(self.rewrites)} rewrites "
            f"({len(self.absorbed)} layers absorbed), {len(self.kept)} layers kept"
        ]
        for mode, label in (("train", "ops per train step"), ("predict", "ops per inference call")):
            if mode in self.ops_before and mode in self.ops_after:
                b, a = self.ops_before[mode], self.ops_after[mode]
                lines.append(f"{label}: {b} -> {a} ({a / max(b, 1):.2f}x)")
        if self.verified:
            v = f"verified: outputs max rel diff {self.max_output_diff:.2g}"
            if self.max_grad_diff is not None:
                v += f", training gradients max rel diff {self.max_grad_diff:.2g}"
            lines.append(v)
        elif self.verified is None:
            lines.append("not verified (verify=False)")
        if self.optimizer:
            lines.append(f"optimizer: {self.optimizer[0]} -> {self.optimizer[1]}")
        if self.rewrites:
            lines.append("rewrites:")
            width = max(len(" + ".join(r.source)) for r in self.rewrites)
            for r in self.rewrites:
                note = f"  ({r.note})" if r.note else ""
                lines.append(f"  {' + '.join(r.source):<{width}} -> {r.name} [{r.new_class}]{note}")
        lines += _kept_lines(self.kept)
        lines += self._quantize_lines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _quantize_lines(self):
        if not self.quantize:
            return []
        b, a = self.quantized_bytes_before, self.quantized_bytes_after
        lines = [f"quantized {self.quantize} (weight-only, float activations): {len(self.quantized)} layers, "
                 f"their weights {_bytes(b)} -> {_bytes(a)} ({a / max(b, 1):.2f}x); "
                 f"model weights {_bytes(self.weight_bytes_before)} -> {_bytes(self.weight_bytes_after)}"]
        if self.max_quantized_output_diff is not None:
            lines.append(f"  outputs vs the float inference form: max rel diff {self.max_quantized_output_diff:.2g} "
                         f"(tolerance {self.quantized_output_tolerance:.2g})")
        width = max((len(f"{q.name} [{q.class_name}]") for q in self.quantized), default=0)
        for q in self.quantized:
            label = f"{q.name} [{q.class_name}]"
            row = f"  {label:<{width}}  {_bytes(q.bytes_before)} -> {_bytes(q.bytes_after)}"
            if q.max_abs_error is not None:
                row += f"; max error {q.max_abs_error:.3g} ({q.max_rel_error:.2%} of max |y|)"
                row += f", bound {q.bound:.3g}" if q.bound is not None else ", no bound"
            if q.note:
                row += f" ({q.note})"
            lines.append(row)
        if self.quantize_skipped:
            lines.append("not quantized:")
            lines += [f"  {k.name} [{k.class_name}]: {k.reason}" for k in self.quantize_skipped]
        return lines


def _bytes(n):
    if n is None:
        return "?"
    if n < 10 * 1024:
        return f"{n} B"
    if n < 10 * 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _kept_lines(kept):
    """The report's ``kept:`` section: one row per reason, plain copies counted per class."""
    by_reason = collections.defaultdict(list)
    for k in kept:
        by_reason[k.reason].append(k)
    lines = ["kept:"] if kept else []
    for reason, rows in by_reason.items():
        if reason == NO_COUNTERPART:
            plain = collections.Counter(k.class_name for k in rows)
            classes = ", ".join(f"{n} x{c}" for n, c in sorted(plain.items()))
            lines.append(f"  {len(rows)} layers with {NO_COUNTERPART}: {classes}")
        elif len(rows) <= 3:
            lines += [f"  {k.name} [{k.class_name}]: {reason}" for k in rows]
        else:
            names = ", ".join(k.name for k in rows[:3])
            lines.append(f"  {len(rows)} layers ({names}, ...) [{rows[0].class_name}]: {reason}")
    return lines


# The optimizer an uncompiled model's train step is counted with: plain SGD, whose one update op per
# variable keeps the trace short (Adam's ~10 per variable made counting ResNet50 / Xception take minutes)
# and the same on both sides, so the count measures the layers.
COUNT_OPTIMIZER = "sgd"


def count_ops(model, batch_size, report, key, inputs=None, modes=("train", "predict")):
    """Compute ops per train step and per inference call of `model` (notes in `report` where not counted).

    `inputs`: the batch to count on (else `fusion_report`'s random inputs of `batch_size`).
    """
    from tfmetal_ext import inspect

    counts = {}
    for mode in modes:
        kw = {"batch_size": batch_size}
        target = model
        if inputs is not None:
            kw["inputs"] = inputs
            if mode == "train" and not getattr(model, "compiled", False):
                kw["targets"] = step.make_targets(model, inputs, 1)
        if mode == "train" and not getattr(model, "compiled", False):
            target = _compiled_view(model)
            if target is None:
                target = model
                kw.update(optimizer=COUNT_OPTIMIZER, loss="mse")
        try:
            counts[mode] = inspect.fusion_report(target, mode=mode, **kw).num_ops
        except Exception as e:  # counting is informative only
            report.notes.append(f"{key} ops per {mode} step not counted: {type(e).__name__}: {e}")
    return counts


def _compiled_view(model):
    """A Functional model over `model`'s own layers (no copy), compiled with `COUNT_OPTIMIZER` and MSE.

    Counting an uncompiled model's train step otherwise clones it first (seconds for a big
    model); `fusion_report` restores the weights the train step changes. None for a subclassed model.
    """
    try:
        view, _ = step.compiled_clone(model, COUNT_OPTIMIZER, "mse", copy=False)
        return view
    except Exception:
        return None
