"""Verification: the converted model's outputs and training gradients against the stock model's."""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np

from tfmetal_ext.conversion.weights import to_numpy

# Relative tolerances (max |stock - converted| / max |stock|) of verify, per compute dtype.
OUTPUT_RTOL = {"float32": 1e-4, "float64": 1e-6, "bfloat16": 5e-2, "float16": 2e-2}
# Gradients: ||g_stock - g_new|| / ||g_stock|| per weight must be within the larger of GRAD_RTOL and
# NOISE_FACTOR x the stock model's own rounding noise, measured as the larger relative diff between its
# gradients at (x, y) and (a) the same batch in reverse order (same math, other reduction order) and (b)
# x * (1 + 1e-6 * noise). Training-mode batch norm amplifies rounding going backwards through a deep net:
# ResNet50 and MobileNetV2 (32x32, batch 8) measured 1e-4 to 8e-2 between runs of identical code (threaded
# reduction order changes), with cosine similarities above 0.999; a wrong mapping gives O(1).
GRAD_RTOL = {"float32": 1e-1, "float64": 1e-5, "bfloat16": 3e-1, "float16": 3e-1}
NOISE_FACTOR = 4.0
# Batch norm over two values per channel (batch 2 at 1x1 spatial) has a near-zero, noise-dominated
# gradient; the gradient check uses at least this batch size.
MIN_GRAD_BATCH = 16


class VerificationError(AssertionError):
    """The converted model's outputs or gradients differ from the stock model's beyond tolerance,
    or there is nothing to compare (every output of the stock model is NaN or inf).

    Attributes:
        diffs: list of ``(what, relative_diff, tolerance)`` rows, in graph
            order (per layer output, or per weight gradient).
        report: the `ConversionReport` so far.
    """

    def __init__(self, message, diffs=(), report=None):
        super().__init__(message)
        self.diffs = list(diffs)
        self.report = report


# ----------------------------------------------------------------------------
# Diff measures.


def _agree(a, b):
    """Where two arrays hold exactly the same value, NaN with NaN and +inf with +inf included."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


def rel_diff(a, b):
    """max |a - b| / max |a| over the finite entries of `a`; NaN or inf where non-finite values differ."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    # One-sided non-finite values give NaN or inf, which fail every tolerance.
    with np.errstate(invalid="ignore"):
        err = np.where(_agree(a, b), 0.0, np.abs(a - b))
    return float(np.max(err) / max(float(np.max(np.abs(np.where(np.isfinite(a), a, 0.0)))), 1e-6))


def rel_l2(a, b):
    """||a - b|| / ||a|| over the finite entries of `a`; inf unless `b` has the same non-finite entries."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    if a.shape != b.shape:
        return float("inf")
    fin = np.isfinite(a)
    if not np.all(fin):
        if not np.all(_agree(a, b)[~fin]):
            return float("inf")
        a, b = a[fin], b[fin]
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), 1e-12))


def _as_list(y):
    """Flat list of numpy arrays (floating outputs as float32)."""
    out = []
    for t in keras.tree.flatten(y):
        if "float" in str(getattr(t, "dtype", "")):
            t = keras.ops.cast(t, "float32")
        out.append(keras.ops.convert_to_numpy(t))
    return out


def _tol(table, policy_name, tolerance):
    if tolerance is not None:
        return float(tolerance)
    compute = keras.mixed_precision.Policy(policy_name).compute_dtype
    return table.get(compute, table["float32"])


def _warn_partial(report, note, stacklevel):
    """A verification that could only compare part of the values: a report note and a RuntimeWarning."""
    report.notes.append(note)
    warnings.warn(f"convert(verify=True): {note}.", RuntimeWarning, stacklevel=stacklevel + 1)


# ----------------------------------------------------------------------------
# Outputs.


def _check_finite(ref, model, report):
    """Verification means little where the stock model's own outputs are NaN or inf: say so, or refuse."""
    bad = sum(int(np.sum(~np.isfinite(r))) for r in ref)
    total = sum(r.size for r in ref)
    if not bad:
        return
    if bad == total:
        raise VerificationError(
            f"convert(verify=True): cannot verify the conversion: every output value of {model.name!r} on "
            "the synthetic verification inputs is NaN or inf (in the stock model itself), so there is "
            "nothing to compare. Check the model's weights (e.g. moving statistics after a diverged run), "
            "or pass verify=False to convert without checking.",
            diffs=[], report=report,
        )
    # Frames up to the caller of convert(): _check_finite, _check_outputs, verify_conversion, convert.
    _warn_partial(report, f"{bad} of {total} output values of {model.name!r} on the synthetic verification "
                  "inputs are NaN or inf (in the stock model itself); there the conversion was only checked "
                  "to give the same non-finite values", stacklevel=5)


def _layer_diffs(model, stock_graph, x, tol):
    """Per-layer relative output diffs in graph order (inference mode)."""
    ins, corr = stock_graph
    stock_fn = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    rows = []
    try:
        a = keras.Model(stock_fn.input, [c[2] for c in corr])(x, training=False)
        b = keras.Model(ins, [c[3] for c in corr])(x, training=False)
    except Exception as e:  # intermediate models are best effort
        return [(f"(per-layer outputs unavailable: {e})", float("nan"), tol)]
    for (label, cls, _, _), ya, yb in zip(corr, _as_list(a), _as_list(b)):
        name, _, rest = label.partition(" ")
        rows.append((f"{name} [{cls}]{' ' + rest if rest else ''}", rel_diff(ya, yb), tol))
    return rows


def _check_outputs(model, new, graph, report, batch_size, tolerance, seed):
    from tfmetal_ext.inspect import synthetic_inputs

    x = synthetic_inputs(model, batch_size=batch_size, seed=seed)
    tol = _tol(OUTPUT_RTOL, model.dtype_policy.name, tolerance)
    ref = _as_list(model(x, training=False))
    _check_finite(ref, model, report)
    got = _as_list(new(x, training=False))
    worst = max(rel_diff(a, b) for a, b in zip(ref, got))
    report.max_output_diff = worst
    if worst <= tol:
        return
    rows = _layer_diffs(model, graph, x, tol)
    bad = [r for r in rows if not r[1] <= r[2]]
    lines = [f"  {w:<48} rel diff {d:.3g}" for w, d, _ in rows if not d <= tol][:25]
    first = bad[0][0] if bad else "(no single layer output differs; see the model outputs)"
    raise VerificationError(
        f"convert(verify=True): outputs of {model.name!r} and its conversion differ by {worst:.3g} "
        f"(relative to the largest output; tolerance {tol:g}). First layer that differs: {first}.\n"
        "Per-layer output diffs above tolerance (inference mode):\n" + "\n".join(lines),
        diffs=rows, report=report,
    )


# ----------------------------------------------------------------------------
# Training gradients.


@contextlib.contextmanager
def _no_dropout(*models):
    """Sets every dropout rate in `models` to 0 for the duration (both sides must be deterministic)."""
    saved = []
    for m in models:
        for layer in m._flatten_layers(include_self=True, recursive=True):
            for attr in ("rate", "dropout", "recurrent_dropout"):
                value = getattr(type(layer), attr, None)
                if isinstance(value, property):
                    continue
                v = layer.__dict__.get(attr)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                    saved.append((layer, attr, v))
                    object.__setattr__(layer, attr, 0.0)
    try:
        yield
    finally:
        for layer, attr, v in saved:
            object.__setattr__(layer, attr, v)


def _gradients(model, new, stock_vars, new_vars, batch_size, seed):
    """One training step's gradients (MSE against random targets, dropout off, weights restored after).

    Returns the stock model's gradients, the converted model's, and the stock model's at the inputs
    perturbed by 1e-6 relative noise and at the batch in reverse order (its own rounding noise).
    """
    import tensorflow as tf

    from tfmetal_ext.inspect import synthetic_inputs, synthetic_targets

    x = synthetic_inputs(model, batch_size=batch_size, seed=seed)
    y = synthetic_targets(model, batch_size=batch_size, seed=seed + 1)
    ys = [tf.constant(t) for t in keras.tree.flatten(y)]
    state = [(v, tf.identity(v.value)) for v in model.weights + new.weights]

    def grads(m, variables, inputs, targets):
        with tf.GradientTape() as tape:
            out = keras.tree.flatten(m(inputs, training=True))
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, "float32") - t)) for o, t in zip(out, targets)])
        return tape.gradient(loss, [v.value for v in variables])

    rng = np.random.default_rng(seed + 2)
    x_pert = keras.tree.map_structure(
        lambda v: (v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(v.dtype)
        if np.issubdtype(v.dtype, np.floating) else v, x)
    x_rev = keras.tree.map_structure(lambda v: v[::-1], x)
    try:
        with _no_dropout(model, new):
            return (grads(model, stock_vars, x, ys), grads(new, new_vars, x, ys),
                    grads(model, stock_vars, x_pert, ys), grads(model, stock_vars, x_rev, [t[::-1] for t in ys]))
    finally:
        for v, value in state:
            v.assign(value)


def _check_gradients(model, new, pairs, report, batch_size, tolerance, seed):
    gtol = _tol(GRAD_RTOL, model.dtype_policy.name, None if tolerance is None else tolerance * 20)
    stock_vars = [a for a, _ in pairs]
    new_vars = [b for _, b in pairs]
    g_ref, g_new, g_pert, g_perm = _gradients(
        model, new, stock_vars, new_vars, max(batch_size, MIN_GRAD_BATCH), seed)
    rows, clean, nonfinite = [], [], []
    for a, ga, gb, gp, gq in zip(stock_vars, g_ref, g_new, g_pert, g_perm):
        if ga is None and gb is None:
            continue
        ga, gb, gp, gq = (np.zeros(a.shape) if g is None else to_numpy(g) for g in (ga, gb, gp, gq))
        if not np.all(np.isfinite(ga)):
            nonfinite.append(a.path)
        noise = max(rel_l2(ga, gp), rel_l2(ga, gq))
        noise = noise if np.isfinite(noise) else float("inf")
        rows.append((a.path, rel_l2(ga, gb), max(gtol, NOISE_FACTOR * noise)))
        if noise <= gtol:
            clean.append(rows[-1][1])
    # Weights whose true gradient is ~0 (e.g. a batch norm beta feeding another batch norm) are all noise.
    report.max_grad_diff = max(clean, default=0.0)
    if len(clean) < len(rows):
        report.notes.append(
            f"{len(rows) - len(clean)} of {len(rows)} weight gradients are dominated by rounding noise in the "
            "stock model itself (true gradient ~0); compared against that noise only"
        )
    if nonfinite:
        # Frames up to the caller of convert(): _check_gradients, verify_conversion, convert.
        _warn_partial(report, f"{len(nonfinite)} of {len(rows)} weight gradients of the stock model itself "
                      f"have NaN or inf entries (first: {nonfinite[0]}); only their finite entries were compared",
                      stacklevel=4)
    bad = [r for r in rows if not r[1] <= r[2]]
    if bad:
        lines = [f"  {w:<48} rel diff {d:.3g} (tolerance {t:.3g})" for w, d, t in bad][:25]
        raise VerificationError(
            f"convert(verify=True): training gradients of {model.name!r} and its conversion differ "
            f"(||g_stock - g_converted|| / ||g_stock|| above max({gtol:g}, {NOISE_FACTOR:g} x the stock "
            "gradients' own rounding noise)). First weight that differs: "
            f"{bad[0][0]}.\nPer-weight gradient diffs above tolerance:\n" + "\n".join(lines),
            diffs=rows, report=report,
        )


def verify_conversion(model, new, converter, report, inference, batch_size, tolerance, seed):
    """Raises `VerificationError` unless `new` (made by `converter`) computes what `model` does.

    Inference outputs are compared on synthetic inputs of `model`'s input spec; for the training
    form (not `inference`) also one training step's gradients. Fills `report`'s diff fields.
    """
    _check_outputs(model, new, converter.graph, report, batch_size, tolerance, seed)
    if not inference:
        _check_gradients(model, new, converter.pairs, report, batch_size, tolerance, seed)
