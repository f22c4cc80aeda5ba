"""Verification: the converted model's outputs and training gradients against the stock model's."""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np

from tfmetal_ext.conversion.weights import to_numpy
from tfmetal_ext.inspect.step import OPEN_DIM_LENGTHS, make_inputs, make_targets  # noqa: F401  (documented here)

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
# A weight whose true gradient is exactly zero (a MultiHeadAttention's key bias: softmax is invariant to
# the q.b_k it adds to every score of a row) has a stock gradient of pure rounding noise (1e-11 where the
# others are 1e-1), which no relative comparison passes reliably. Its gradients count as equal when they
# differ by less than this fraction of the model's largest weight-gradient norm (a few unit roundoffs of
# the compute dtype); a wrong mapping of a weight that matters differs by far more.
ZERO_GRAD_FLOOR = {"float32": 1e-6, "float64": 1e-14, "bfloat16": 1.6e-2, "float16": 2e-3}
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


def _finite_norm(a):
    a = np.asarray(a, dtype="float64")
    return float(np.linalg.norm(np.where(np.isfinite(a), a, 0.0)))


def _abs_l2(a, b):
    """||a - b|| over the finite entries of `a` (`rel_l2` has checked the others agree)."""
    a = np.asarray(a, dtype="float64")
    b = np.asarray(b, dtype="float64")
    fin = np.isfinite(a)
    return float(np.linalg.norm(np.where(fin, a - np.where(fin, b, 0.0), 0.0)))


def as_numpy_list(y):
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
# Verification data: `make_inputs` and `make_targets` (`tfmetal_ext.inspect.step`, the one step builder).


def _batch(x):
    return int(keras.tree.flatten(x)[0].shape[0])


def _tile_batch(x, n):
    """`x` repeated along the batch up to at least `n` rows (for the gradient check's batch size)."""
    b = _batch(x)
    if b >= n:
        return x
    reps = -(-n // b)
    return keras.tree.map_structure(lambda v: np.concatenate([np.asarray(v)] * reps, axis=0), x)


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
    # Frames up to the caller of convert(): _check_finite, _check_outputs, verify_conversion,
    # pipeline.check, convert.
    _warn_partial(report, f"{bad} of {total} output values of {model.name!r} on the synthetic verification "
                  "inputs are NaN or inf (in the stock model itself); there the conversion was only checked "
                  "to give the same non-finite values", stacklevel=6)


def _layer_diffs(model, stock_graph, x, tol):
    """Per-layer relative output diffs in graph order (inference mode)."""
    if stock_graph is None:
        return []
    ins, corr = stock_graph
    stock_fn = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    rows = []
    try:
        a = keras.Model(stock_fn.input, [c[2] for c in corr])(x, training=False)
        b = keras.Model(ins, [c[3] for c in corr])(x, training=False)
    except Exception as e:  # intermediate models are best effort
        return [(f"(per-layer outputs unavailable: {e})", float("nan"), tol)]
    for (label, cls, _, _), ya, yb in zip(corr, as_numpy_list(a), as_numpy_list(b)):
        name, _, rest = label.partition(" ")
        rows.append((f"{name} [{cls}]{' ' + rest if rest else ''}", rel_diff(ya, yb), tol))
    return rows


def _check_outputs(model, new, graph, report, x, tolerance, reference=None):
    tol = _tol(OUTPUT_RTOL, model.dtype_policy.name, tolerance)
    ref = reference if reference is not None else as_numpy_list(model(x, training=False))
    _check_finite(ref, model, report)
    got = as_numpy_list(new(x, training=False))
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


def _seed_states(model):
    """The state variables of every seed generator in `model` (random layers advance them)."""
    return [g.state for layer in model._flatten_layers(include_self=True, recursive=True)
            for g in getattr(layer, "_seed_generators", ()) if getattr(g, "state", None) is not None]


def _gradients(model, new, stock_vars, new_vars, x, seed):
    """One training step's gradients (MSE against random targets, dropout off, weights restored after).

    Returns the stock model's gradients, the converted model's, and ``noise()``: the stock model's
    at the inputs perturbed by 1e-6 relative noise and at the batch in reverse order (its own
    rounding noise), computed only when asked (two more passes).
    """
    import tensorflow as tf

    y = make_targets(model, x, seed + 1)
    ys = [tf.constant(t) for t in keras.tree.flatten(y)]
    variables = model.weights + new.weights + _seed_states(model) + _seed_states(new)
    seen = set()
    state = [(v, tf.identity(v.value)) for v in variables if not (id(v) in seen or seen.add(id(v)))]

    def grads(m, variables, inputs, targets):
        def step():
            with tf.GradientTape() as tape:
                out = keras.tree.flatten(m(inputs, training=True))
                loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, "float32") - t)) for o, t in zip(out, targets)])
            return tape.gradient(loss, [v.value for v in variables])

        if not (tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context()):
            return step()
        # convert() inside `strategy.scope()`: a distributed variable is read in a replica's context
        # only. Every replica computes the same batch; the first replica's gradients are the step's.
        strategy = tf.distribute.get_strategy()
        return strategy.experimental_local_results(strategy.run(step))[0]

    def restore():
        for v, value in state:
            v.assign(value)

    def noise():
        """The stock model's gradients at perturbed inputs and at the batch reversed."""
        rng = np.random.default_rng(seed + 2)
        x_pert = keras.tree.map_structure(
            lambda v: (v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(v.dtype)
            if np.issubdtype(v.dtype, np.floating) else v, x)
        x_rev = keras.tree.map_structure(lambda v: v[::-1], x)
        try:
            with _no_dropout(model, new):
                restore()
                g_pert = grads(model, stock_vars, x_pert, ys)
                restore()
                return g_pert, grads(model, stock_vars, x_rev, [t[::-1] for t in ys])
        finally:
            restore()

    try:
        with _no_dropout(model, new):
            g_ref = grads(model, stock_vars, x, ys)
            restore()  # random layers: both models start from the same seed state
            g_new = grads(new, new_vars, x, ys)
            return g_ref, g_new, noise
    finally:
        restore()


def _check_gradients(model, new, pairs, report, x, tolerance, seed):
    gtol = _tol(GRAD_RTOL, model.dtype_policy.name, None if tolerance is None else tolerance * 20)
    stock_vars = [a for a, _ in pairs]
    new_vars = [b for _, b in pairs]
    g_ref, g_new, noise = _gradients(model, new, stock_vars, new_vars, x, seed)
    g_ref = [None if g is None else to_numpy(g) for g in g_ref]
    g_new = [None if g is None else to_numpy(g) for g in g_new]
    # The stock model's own rounding noise is measured only when some gradient is off by more than
    # the plain tolerance (two more backward passes, the costliest part of verifying a big model).
    zeros = [np.zeros(a.shape) for a in stock_vars]
    diffs = [None if ga is None and gb is None else rel_l2(z if ga is None else ga, z if gb is None else gb)
             for ga, gb, z in zip(g_ref, g_new, zeros)]
    # Within the absolute floor of a true-zero gradient (ZERO_GRAD_FLOOR): equal, whatever the relative diff.
    floor = _tol(ZERO_GRAD_FLOOR, model.dtype_policy.name, None) * max(
        (_finite_norm(g) for g in g_ref if g is not None), default=0.0)
    negligible = [d is not None and np.isfinite(d) and _abs_l2(z if ga is None else ga, z if gb is None else gb) <= floor
                  for ga, gb, z, d in zip(g_ref, g_new, zeros, diffs)]
    if all(d is None or d <= gtol or small for d, small in zip(diffs, negligible)):
        g_pert = g_perm = None
    else:
        g_pert, g_perm = ([None if g is None else to_numpy(g) for g in gs] for gs in noise())
    rows, clean, nonfinite = [], [], []
    for i, (a, ga, d) in enumerate(zip(stock_vars, g_ref, diffs)):
        if d is None:
            continue
        ga = zeros[i] if ga is None else ga
        if not np.all(np.isfinite(ga)):
            nonfinite.append(a.path)
        if g_pert is None:  # every gradient within the plain tolerance: the noise does not matter
            noise_ = 0.0
        else:
            gp, gq = (zeros[i] if g[i] is None else g[i] for g in (g_pert, g_perm))
            noise_ = max(rel_l2(ga, gp), rel_l2(ga, gq))
            noise_ = noise_ if np.isfinite(noise_) else float("inf")
        tol = max(gtol, NOISE_FACTOR * noise_)
        if negligible[i] and d > tol:  # a true-zero gradient: both are rounding noise below the floor
            rows.append((a.path, d, d))
            continue
        rows.append((a.path, d, tol))
        if noise_ <= gtol:
            clean.append(d)
    # Weights whose true gradient is ~0 (e.g. a batch norm beta feeding another batch norm) are all noise.
    report.max_grad_diff = max(clean, default=0.0)
    if len(clean) < len(rows):
        report.notes.append(
            f"{len(rows) - len(clean)} of {len(rows)} weight gradients are dominated by rounding noise in the "
            "stock model itself (true gradient ~0); compared against that noise only"
        )
    if nonfinite:
        # Frames up to the caller of convert(): _check_gradients, verify_conversion, pipeline.check, convert.
        _warn_partial(report, f"{len(nonfinite)} of {len(rows)} weight gradients of the stock model itself "
                      f"have NaN or inf entries (first: {nonfinite[0]}); only their finite entries were compared",
                      stacklevel=5)
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


def verify_conversion(model, new, converter, report, inference, batch_size, tolerance, seed, inputs=None,
                      reference=None):
    """Raises `VerificationError` unless `new` (made by `converter`) computes what `model` does.

    Inference outputs are compared on `inputs` (else synthetic inputs of `model`'s input
    spec, `make_inputs`); for the training form (not `inference`) also one training step's
    gradients. `reference`: the stock outputs computed before an in-place conversion.
    Fills `report`'s diff fields.
    """
    x = make_inputs(model, batch_size, seed, inputs)
    _check_outputs(model, new, converter.graph, report, x, tolerance, reference)
    if not inference and reference is None:
        xg = make_inputs(model, max(batch_size, MIN_GRAD_BATCH), seed) if inputs is None else \
            _tile_batch(inputs, MIN_GRAD_BATCH)
        _check_gradients(model, new, converter.pairs, report, xg, tolerance, seed)
