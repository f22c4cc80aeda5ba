"""``convert(model, inference=True, quantize="int8")``: the inference form with int8 weights, verified.

After the batch norms are folded, every leaf layer of the converted model (nested models and
the sublayers of subclassed layers included) whose ``quantize("int8")`` works is quantized in
place: `FusedDense`, `FusedEinsumDense`, `FusedConv2D`, `FusedDepthwiseConv2D`, `FusedEmbedding` and the
stock `Dense`, `EinsumDense` and `Embedding` the converter kept (a Keras subclass of it, say). The scheme is weight-only (Keras' abs-max
int8 weights, one float32 scale per output channel, float activations): the stock Dense and
EinsumDense and FusedEinsumDense are given ``Int8QuantizationConfig(activation_quantizer=None)``, as Keras' default
int8 config would also quantize their inputs on the fly. A layer with weights whose quantize
raises (no int8 form, or a form it does not take, e.g. a grouped convolution) is left in float
and listed with the reason.

Verification is against the float model (the converted inference form just before
quantization), in two parts:

- Per layer, on the inputs it received in one float forward pass (captured by wrapping the
  layer instances' ``call``, which works for functional and subclassed models alike): abs-max
  int8 rounds each weight to within half a step, ``|w - q / s| <= (max|w_channel| + eps) / 254``
  (``s = 127 / (max|w_channel| + eps)``, Keras' epsilon), so each output of the linear part
  moves by at most ``bound = sum_k |x_k| * halfstep_kn`` (the layer's own contraction applied
  to ``|x|`` and the half-step array). After a Lipschitz-``L`` activation the output moves by
  at most ``L * bound`` (`ACTIVATION_LIPSCHITZ`). The check is
  ``|y_int8 - y_float| <= L * bound + slack`` per entry, where
  ``slack = max(FLOAT_SLACK, FLOAT_SLACK_PER_ROOT_K sqrt(K)) * (|x| (*) |w|) + OUTPUT_SLACK * max|y|``
  (K terms per output) covers the two float32 accumulations' rounding (a bfloat16 / float16
  layer: plus a few of its roundoffs of |y|). A layer class or activation without a bound here
  is checked end to end only (the report says so).
- End to end: ``max |y_int8 - y_float| / max |y_float| <= output_tolerance(n)`` for each output,
  `n` the number of quantized layers. The per-layer bound is a worst case (every weight error
  at half a step, all of one sign against x); the weight errors are in fact independent and
  spread over the step, so a layer's output error has a standard deviation of about
  ``||x|| * halfstep / sqrt(3)`` against ``|y| ~ ||x|| * rms(w)``: relative to the output, about
  ``(max|w| / rms w) / (254 sqrt 3)``, 0.8 % for Gaussian-like weights (max/rms ~ 3.5) whatever
  K, and some 3 % at the extreme of a batch of outputs. `PER_LAYER_RTOL` (5 %) allows that with
  room for heavier-tailed trained weights. Independent errors of `n` layers add like a random
  walk, hence ``PER_LAYER_RTOL * sqrt(n)``, capped at `MAX_OUTPUT_RTOL`: still far below the
  O(1) difference of a layer that computes the wrong thing (a wrong scale, axis or kernel),
  which the per-layer check also catches where the bound exists.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np

from tfmetal_ext.conversion.report import Kept, Quantized
from tfmetal_ext.conversion.verify import VerificationError, _agree, as_numpy_list, rel_diff
from tfmetal_ext.inspect.step import is_subclassed

QUANTIZE_MODES = ("int8",)

# Float rounding allowance of the per-layer check: the float and the int8 layers accumulate
# in float32 in different orders (and the int8 kernel de-scales after the sum). Of |x| (*) |w|
# (the same contraction on absolute values), the larger of FLOAT_SLACK and
# FLOAT_SLACK_PER_ROOT_K * sqrt(K) for a contraction over K terms (float32's unit roundoff is
# 6e-8; rounding errors of a K-term sum grow like sqrt(K) units in practice).
FLOAT_SLACK = 1e-5
FLOAT_SLACK_PER_ROOT_K = 8 * 2.0 ** -24
OUTPUT_SLACK = 1e-6  # of the layer output's max |y|
# A layer computing in a 16-bit float rounds its output (and the bias add) in that type: each entry
# gets LOW_PRECISION_ULPS unit roundoffs of its own |y| more (float32 accumulation is assumed).
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
LOW_PRECISION_ULPS = 3.0

# End-to-end tolerance: PER_LAYER_RTOL * sqrt(number of quantized layers), at most MAX_OUTPUT_RTOL.
PER_LAYER_RTOL = 0.05
MAX_OUTPUT_RTOL = 0.5

# Lipschitz constants of activations (|f(a) - f(b)| <= L |a - b|), by Keras name. Exact GELU's
# derivative peaks at 1.1289 (x ~ 0.75), the tanh form's about the same; SiLU's at 1.0998.
ACTIVATION_LIPSCHITZ = {
    "linear": 1.0, "relu": 1.0, "relu6": 1.0, "elu": 1.0, "leaky_relu": 1.0, "tanh": 1.0,
    "sigmoid": 0.25, "gelu": 1.13, "gelu_approximate": 1.13, "silu": 1.1, "swish": 1.1,
    "softplus": 1.0, "hard_sigmoid": 1.0 / 6.0, "hard_silu": 1.0, "hard_swish": 1.0,
}

_HALF_STEP = 254.0  # 2 * 127: half of one step of the [-127, 127] grid


def output_tolerance(n_quantized):
    """The end-to-end relative tolerance for a model with `n_quantized` int8 layers."""
    return min(MAX_OUTPUT_RTOL, PER_LAYER_RTOL * max(1, n_quantized) ** 0.5)


def check_args(quantize, inference, in_place=False):
    """Raises ValueError unless `quantize` is None or ``"int8"`` with ``inference=True``."""
    if quantize is None:
        return
    if not isinstance(quantize, str) or quantize not in QUANTIZE_MODES:
        raise ValueError(f"`quantize` must be None or 'int8' (weight-only int8). Received: quantize={quantize!r}")
    if not inference:
        raise ValueError(
            "quantize='int8' needs inference=True: the quantized model is the deployment form (batch norms "
            "folded, int8 kernels frozen); convert with inference=True, and train the float training form. "
            f"Received: quantize={quantize!r}, inference={inference!r}"
        )
    if in_place:
        raise ValueError(
            "quantize='int8' cannot be combined with in_place=True: the converted model shares layers with "
            f"the input model, whose weights would be quantized too. Received: quantize={quantize!r}, "
            f"in_place={in_place!r}"
        )


# ----------------------------------------------------------------------------
# Which layers, and what each one's linear part is.


def _leaves(model):
    """``[(path, layer, in_subclass)]`` of every leaf layer (no sublayers) under `model`, each layer once;
    `in_subclass`: some enclosing layer (or `model`) is a subclass with a ``call`` of its own."""
    out, seen = [], set()

    def walk(layer, prefix, in_subclass):
        # Keras' own containers (Bidirectional, TimeDistributed, ...) serialize their inner layers'
        # configs, dtype policy included; a user's subclass (or one of ours) makes them in its constructor.
        in_subclass = in_subclass or (is_subclassed(layer) and not type(layer).__module__.startswith("keras."))
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            path = f"{prefix}{sub.name}"
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            if any(True for _ in sub._flatten_layers(include_self=False, recursive=False)):
                walk(sub, f"{path}/", in_subclass)
            else:
                out.append((path, sub, in_subclass))

    walk(model, "", False)
    return out


def _kind(layer):
    """The contraction a layer's kernel goes through, for the error bound; None when unknown."""
    L = keras.layers
    if isinstance(layer, L.Embedding):
        return "embedding"
    if isinstance(layer, L.EinsumDense):
        return "einsum"
    if isinstance(layer, L.DepthwiseConv2D):
        return "depthwise"
    if isinstance(layer, L.Conv2D):
        return "conv"
    from tfmetal_ext.layers import FusedDense

    if isinstance(layer, (L.Dense, FusedDense)):
        return "dense"
    return None


def _float_kernel(layer, kind):
    """The float kernel about to be quantized (before `quantize`), float64 numpy; None if unknown."""
    if kind is None:
        return None
    attr = "_embeddings" if kind == "embedding" else "_kernel"
    v = getattr(layer, attr, None)
    if v is None:
        v = getattr(layer, "embeddings" if kind == "embedding" else "kernel", None)
    return None if v is None else np.asarray(keras.ops.convert_to_numpy(v), dtype="float64")


def _reduced_axes(layer, kind, rank):
    """The kernel axes one scale spans (abs-max over them): all but the output channel's."""
    if kind == "embedding":
        return (1,)  # one scale per row (token)
    if kind == "einsum":
        axes = getattr(layer, "_kernel_reduced_axes", None)  # Keras sets it when quantizing
        return tuple(axes) if axes is not None else None
    if kind == "depthwise":
        return (0, 1)  # one scale per (input channel, multiplier) = per output channel
    return tuple(range(rank - 1))  # dense (K, N), conv HWIO


def _half_steps(kernel, axes):
    """Per-weight bound on |w - de-quantized w|: (max |w| over the scale's axes + Keras' epsilon) / 254."""
    amax = np.max(np.abs(kernel), axis=axes, keepdims=True) + keras.backend.epsilon()
    return np.broadcast_to(amax / _HALF_STEP, kernel.shape)


def _contract(layer, kind, x, kernel):
    """The layer's linear part (no bias, no activation) applied to `x` with `kernel` (float64 numpy)."""
    ops = keras.ops
    if kind == "embedding":
        return kernel[np.asarray(x).astype("int64")]
    x = np.asarray(x, dtype="float64")
    if kind == "dense":
        return np.tensordot(x, kernel, axes=[[-1], [0]])
    if kind == "einsum":
        return np.einsum(layer.equation, x, kernel)
    k = kernel.astype("float32")
    x = x.astype("float32")
    if kind == "conv":
        y = ops.conv(x, k, strides=layer.strides, padding=layer.padding, data_format=layer.data_format,
                     dilation_rate=layer.dilation_rate)
    else:
        y = ops.depthwise_conv(x, k, strides=layer.strides, padding=layer.padding,
                               data_format=layer.data_format, dilation_rate=layer.dilation_rate)
    return np.asarray(ops.convert_to_numpy(y), dtype="float64")


def _activation_name(layer):
    if hasattr(layer, "_activation_name"):  # tfmetal_ext's layers resolve it at construction
        return layer._activation_name
    fn = getattr(layer, "activation", None)
    if fn is None:
        return "linear"
    name = getattr(fn, "__name__", None)
    try:
        return name if name is not None and keras.activations.get(name) is fn else None
    except ValueError:
        return None


def _nbytes(variables):
    import tensorflow as tf

    seen, total = set(), 0
    for v in variables:
        if id(v) in seen:
            continue
        seen.add(id(v))
        total += int(np.prod(v.shape, dtype="int64")) * tf.as_dtype(v.dtype).size
    return total


# ----------------------------------------------------------------------------
# Capturing each layer's inputs in one float pass.


@contextlib.contextmanager
def _capturing(layers):
    """While active, every call of one of `layers` appends ``(args, kwargs, output)`` to its record."""
    records = {id(layer): [] for layer in layers}
    for layer in layers:
        def wrapper(*args, _orig=layer.call, _rec=records[id(layer)], **kwargs):
            out = _orig(*args, **kwargs)
            _rec.append((args, kwargs, out))
            return out

        object.__setattr__(layer, "call", wrapper)  # the instance's call shadows the class's
    try:
        yield records
    finally:
        for layer in layers:
            layer.__dict__.pop("call", None)


def _first_float(out):
    return np.asarray(as_numpy_list(out)[0], dtype="float64")


# ----------------------------------------------------------------------------
# The quantization.


@dataclasses.dataclass
class _Candidate:
    path: str
    layer: object
    kind: str | None
    kernel: np.ndarray | None
    bytes_before: int


def _quantize_layer(layer):
    """Quantizes `layer` to int8 (weight-only); returns None, or why it could not be."""
    if type(layer).quantize is keras.layers.Layer.quantize:
        return f"no int8 form ({type(layer).__name__} has no quantize())"
    config = None
    from tfmetal_ext.layers import FusedEinsumDense

    if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense, FusedEinsumDense):
        # Keras' default int8 config also quantizes the inputs per call; the scheme is weight-only.
        config = keras.quantizers.Int8QuantizationConfig(weight_quantizer=None, activation_quantizer=None)
    try:
        layer.quantize("int8", config=config)
    except (NotImplementedError, ValueError, TypeError) as e:
        return f"quantize('int8') refused: {' '.join(str(e).split())}"
    return None


def quantize_model(model, new, report, x=None, verify=True):
    """Quantizes `new` (the converted inference form of `model`) in place; verifies it against its float self.

    `x`: the verification batch (as `model` takes it). Fills `report`'s quantization fields and
    raises `VerificationError` when a layer's error exceeds its bound or an output differs from
    the float model's beyond `output_tolerance`.
    """
    report.quantize = "int8"
    report.weight_bytes_before = _nbytes(new.weights)
    leaves = [(p, layer, sub) for p, layer, sub in _leaves(new) if layer.weights]
    inside = {id(layer) for _, layer, sub in leaves if sub}
    candidates = []
    for path, layer, _ in leaves:
        kind = _kind(layer)
        candidates.append(_Candidate(path, layer, kind, _float_kernel(layer, kind), _nbytes(layer.weights)))
    records, y_float = {}, None
    if verify:
        with _capturing([c.layer for c in candidates]) as records:
            y_float = as_numpy_list(new(x, training=False))
    done = []
    for c in candidates:
        why = _quantize_layer(c.layer)
        if why:
            report.quantize_skipped.append(Kept(c.path, type(c.layer).__name__, why))
            continue
        row = Quantized(c.path, type(c.layer).__name__, c.bytes_before, _nbytes(c.layer.weights))
        report.quantized.append(row)
        done.append((c, row))
    # Keras' model.quantize resets these too: a traced step would still hold the float kernels.
    new.train_function = new.test_function = new.predict_function = None
    if not done:
        report.notes.append("quantize='int8': no layer of the converted model has an int8 form; nothing quantized")
    report.weight_bytes_after = _nbytes(new.weights)
    held = [r.name for c, r in done if id(c.layer) in inside]
    if held:
        report.notes.append(
            f"{len(held)} quantized layer(s) sit inside a subclassed layer or model ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}): a subclass makes its sublayers in float when Keras loads it "
            "from a .keras file, so the int8 model saved from here does not load back (the same holds for "
            "Keras' own model.quantize, e.g. of a MultiHeadAttention); save the float inference form "
            "instead and quantize after loading"
        )
    if not verify:
        return
    bad = []
    for c, row in done:
        bad += _check_layer(c, row, records[id(c.layer)])
    y_q = as_numpy_list(new(x, training=False))
    tol = output_tolerance(len(done))
    worst = max((rel_diff(a, b) for a, b in zip(y_float, y_q)), default=0.0)
    report.max_quantized_output_diff = worst
    report.quantized_output_tolerance = tol
    if bad or not worst <= tol:
        lines = [f"  {r.name} [{r.class_name}]: max error {r.max_abs_error:.3g} is {r.bound_ratio:.3g}x its bound "
                 f"{r.bound:.3g}" for r in bad][:25]
        raise VerificationError(
            f"convert(quantize='int8'): the int8 model {model.name!r} differs from its float inference form: "
            f"outputs max rel diff {worst:.3g} (tolerance {tol:.3g}); {len(bad)} layer(s) beyond the half-step "
            "error bound on their own inputs" + (":\n" + "\n".join(lines) if lines else ""),
            diffs=[(r.name, r.bound_ratio, 1.0) for _, r in done if r.bound_ratio is not None],
            report=report,
        )


def _check_layer(c, row, calls):
    """Fills `row`'s error fields from `calls` (captured float calls); returns ``[row]`` if beyond the bound."""
    layer = c.layer
    errs, peaks, ratios, bounds = [], [], [], []
    lip = ACTIVATION_LIPSCHITZ.get(_activation_name(layer)) if c.kind else None
    axes = _reduced_axes(layer, c.kind, c.kernel.ndim) if c.kernel is not None else None
    if axes is not None:
        terms = int(np.prod([c.kernel.shape[a] for a in axes])) if c.kind != "embedding" else 1
        rel_slack = max(FLOAT_SLACK, FLOAT_SLACK_PER_ROOT_K * terms ** 0.5)
    for args, kwargs, out in calls:
        y_f = _first_float(out)
        y_q = _first_float(layer(*args, **kwargs))
        with np.errstate(invalid="ignore"):  # the same NaN / inf on both sides is no error
            err = np.where(_agree(y_q, y_f), 0.0, np.abs(y_q - y_f))
        errs.append(float(np.max(err, initial=0.0)))
        peaks.append(float(np.max(np.abs(np.where(np.isfinite(y_f), y_f, 0.0)), initial=0.0)))
        if lip is None or axes is None:
            continue
        x = keras.ops.convert_to_numpy(args[0])
        if c.kind == "embedding":
            x_abs = x
        else:
            x_abs = np.abs(np.asarray(x, dtype="float64"))
        bound = lip * _contract(layer, c.kind, x_abs, _half_steps(c.kernel, axes))
        slack = rel_slack * _contract(layer, c.kind, x_abs, np.abs(c.kernel)) + OUTPUT_SLACK * peaks[-1]
        slack = slack + LOW_PRECISION_ULPS * UNIT_ROUNDOFF.get(layer.compute_dtype, 0.0) * np.abs(y_f)
        if bound.shape != err.shape:
            row.note = f"bound not checked: its shape {bound.shape} is not the output's {err.shape}"
            lip = None
            continue
        bounds.append(float(np.max(bound, initial=0.0)))
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(err == 0, 0.0, err / (bound + slack + 1e-30))
        ratios.append(float(np.max(ratio, initial=0.0)))
    if not calls:
        row.note = "not called on the verification inputs; checked by nothing"
        return []
    row.max_abs_error = max(errs)
    row.max_rel_error = row.max_abs_error / max(max(peaks), 1e-12)
    if ratios and lip is not None:
        row.bound = max(bounds)
        row.bound_ratio = max(ratios)
    elif not row.note:
        what = f"activation {_activation_name(layer) or getattr(layer, 'activation', None)!r}" if c.kind else \
            f"class {type(layer).__name__}"
        row.note = f"no error bound for its {what}: checked end to end only"
    return [row] if row.bound_ratio is not None and not row.bound_ratio <= 1.0 else []
