"""Running the checks of `tfmetal_ext.doctor.checks.REGISTRY`: `selftest()` and its results."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tfmetal_ext import devices
from tfmetal_ext.backends import fusion, pairings
from tfmetal_ext.doctor import checks as registry
from tfmetal_ext.doctor.report import BUILD_OPS

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# Allowed error, relative to the reference's largest magnitude (at least 1).
_RTOL = {"float32": 1e-4, "float16": 2e-2}

_INJECTED = " (fault injected by selftest(faults=...))"


@dataclasses.dataclass
class CheckResult:
    """One self-test check.

    Attributes:
        name: the check (one of `CHECKS`).
        status: ``"PASS"``, ``"FAIL"`` or ``"SKIP"``.
        max_abs_err: largest absolute difference from the reference (the
            worst dtype, relative to its tolerance), or None.
        tolerance: the allowed difference for that dtype, or None.
        fused: the fused ops that appeared in the executed graph, e.g.
            ``"_FusedMatMul[BiasAdd, Relu]"``, or None when nothing fused.
        detail: what was compared and what was found.
        fix: what to do about a FAIL or SKIP, else None.
        dtypes: the dtypes checked.
    """

    name: str
    status: str
    max_abs_err: float | None = None
    tolerance: float | None = None
    fused: str | None = None
    detail: str = ""
    fix: str | None = None
    dtypes: tuple = ()

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["dtypes"] = list(self.dtypes)
        for key in ("max_abs_err", "tolerance"):  # JSON has no inf/NaN
            if d[key] is not None and not math.isfinite(d[key]):
                d[key] = None
        return d


@dataclasses.dataclass
class SelfTestResult:
    """All checks of one `selftest()` run.

    Attributes:
        device: the device the checks ran on.
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        checks: one `CheckResult` per check.
        metal_plugin: the Metal plugin the GPU checks ran on
            (``"tensorflow-metal"``, ``"tensorflow-metal-plugin"``), or None.
        metal_plugin_version: its version, or None.
        notes: what fails or runs on the host on this backend
            (`tfmetal_ext.doctor.report.backend_notes`).
    """

    device: str
    backend: str
    checks: list
    metal_plugin: str | None = None
    metal_plugin_version: str | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def tested(self):
        """What was tested: ``"tensorflow-metal-plugin 0.4.1"``, ``"tensorflow-metal 1.2.0"``, ``"CUDA"`` or ``"CPU"``."""
        if "GPU" in self.device.upper():
            if self.backend == "metal" and self.metal_plugin:
                return f"{self.metal_plugin} {self.metal_plugin_version}"
            return "CUDA" if self.backend == "cuda" else "GPU"
        return "CPU"

    @property
    def passed(self):
        """No check failed (skipped checks do not count)."""
        return all(c.status != FAIL for c in self.checks)

    @property
    def failed_patterns(self):
        """Names of failed checks that have a safe form (``configure(avoid_fusions=...)`` takes them)."""
        return tuple(c.name for c in self.checks if c.status == FAIL and c.name in fusion.SAFE_FORMS)

    def check(self, name):
        """The `CheckResult` named `name`."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"No check {name!r} in this result; checks: {[c.name for c in self.checks]}")

    def to_dict(self):
        return {
            "device": self.device,
            "backend": self.backend,
            "tested": self.tested,
            "metal_plugin": self.metal_plugin,
            "metal_plugin_version": self.metal_plugin_version,
            "notes": list(self.notes),
            "passed": self.passed,
            "failed_patterns": list(self.failed_patterns),
            "checks": [c.to_dict() for c in self.checks],
        }

    def __str__(self):
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"Self-test on {self.device} (backend {self.backend}: tested {self.tested})"]
        for c in self.checks:
            lines.append(f"  {c.status}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status != PASS:
                lines.append(f"  {'':4}  {'':<{width}}  fix: {c.fix}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}
        lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
        if self.failed_patterns:
            lines.append(
                f"to use the safe forms: tfmetal_ext.configure(avoid_fusions={list(self.failed_patterns)!r})"
            )
        return "\n".join(lines)


def _device():
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else tf.config.list_logical_devices("CPU")[0].name


# ----------------------------------------------------------------------------
# NUMERIC checks.


def _fused_label(nodes):
    """The fused ops in executed graph nodes, e.g. ``"_FusedConv2D[BiasAdd, Relu]"``, or None."""
    labels = []
    for n in nodes:
        fused_ops = fusion.node_fused_ops(n)
        if fusion.is_fused_op(n.op) or n.op.startswith(fusion.CUSTOM_OP_PREFIX) or fused_ops:
            label = f"{n.op}[{', '.join(fused_ops)}]" if fused_ops else n.op
            if label not in labels:
                labels.append(label)
    return ", ".join(labels) or None


def _as_numpy(structure):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t, np.float64), structure)


def _run_graph(fn, *args):
    """Runs `fn` once as a fresh graph-mode tf.function (grappler on); returns (outputs, fused label)."""
    import tensorflow as tf

    from tfmetal_ext.inspect.capture import capture_call

    outputs, cap = capture_call(tf.function(fn), *args)
    return _as_numpy(outputs), _fused_label(cap.nodes())


def _perturb(outputs):
    """What an injected fault does to a graph-mode result: off by at least 1 everywhere."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: a + 1.0 + np.abs(a), outputs)


def _error(got, want, dtype):
    """(max abs error, tolerance) over matching structures."""
    import tensorflow as tf

    got, want = tf.nest.flatten(got), tf.nest.flatten(want)
    scale = max([1.0] + [float(np.max(np.abs(w))) for w in want if w.size])
    err = 0.0
    for g, w in zip(got, want):
        if g.size:
            diff = np.abs(g - w)
            err = max(err, math.inf if not np.all(np.isfinite(diff)) else float(np.max(diff)))
    return err, _RTOL[dtype] * scale


def _custom_op_skip(check, dtypes, device):
    """The SKIP result of a custom-op check that cannot run its op here, else None."""
    from tfmetal_ext.ops import _common, _loader

    def skip(detail, fix):
        return CheckResult(check.name, SKIP, detail=detail, fix=fix, dtypes=tuple(dtypes))

    if _common.use_reference():
        return skip("TFMETAL_EXT_REFERENCE_OPS=1: only the pure-TF reference runs, nothing else to check",
                    "unset TFMETAL_EXT_REFERENCE_OPS to check the custom op")
    if _loader.load() is None:
        why = _loader.state().error or "not loaded"
        return skip(f"custom-op library not loaded ({why}): only the pure-TF reference runs", BUILD_OPS)
    if "GPU" in device and not _common.kernel_for_visible_devices(check.op.name):
        return skip(f"{check.op.name} has no GPU kernel in this build: the pure-TF reference runs on the GPU",
                    f"{BUILD_OPS} on macOS arm64 builds the Metal kernels")
    return None


def _run_numeric(check, dtypes, device, faulty):
    """Runs ``check.case(dtype) -> (graph fn, args, reference)`` per dtype and compares."""
    import tensorflow as tf

    if check.op is not None:
        skipped = _custom_op_skip(check, dtypes, device)
        if skipped is not None:
            return skipped
    worst, fused, parts = None, [], []
    for dtype in dtypes:
        with tf.device(device):
            fn, args, reference = check.case(dtype)
            got, label = _run_graph(fn, *args)
        if faulty:
            got = _perturb(got)
        err, tol = _error(got, _as_numpy(reference), dtype)
        if label and label not in fused:
            fused.append(label)
        parts.append(f"{dtype} max err {err:.2g} (tol {tol:.2g})")
        if worst is None or err / tol > worst[0] / worst[1]:
            worst = (err, tol)
    fused_text = ", ".join(fused) or None
    ok = worst[0] <= worst[1]
    detail = f"{fused_text or 'not fused here'}: " + "; ".join(parts)
    if faulty:
        detail += _INJECTED
    if not ok:
        detail += " -- the graph-mode (fused) result differs from the eager unfused reference"
    return CheckResult(
        check.name, PASS if ok else FAIL, worst[0], worst[1], fused_text, detail,
        None if ok else check.fix, tuple(dtypes),
    )


# ----------------------------------------------------------------------------
# PLACEMENT checks.


def _run_placement(check, dtypes, device, faulty):
    """Places one train step of ``check.case()``; FAIL on each op that ran on the CPU beside a GPU."""
    from tfmetal_ext import inspect
    from tfmetal_ext.inspect.report import FallbackNode

    report = inspect.placement_report(check.case(), mode="train", batch_size=4)
    fallbacks = list(report.fallbacks)
    if faulty:
        fallbacks.append(FallbackNode(op="InjectedFault", name="injected/InjectedFault", layer="fc", device="CPU:0"))
    ops = ", ".join(f"{d}: {n}" for d, n in sorted(report.ops_by_device.items()))
    tail = _INJECTED if faulty else ""
    if fallbacks:
        listed = ", ".join(f"{f.op} ({f.layer or '-'})" for f in fallbacks)
        fixes = list(dict.fromkeys(registry.fallback_fix(f.op, f.layer) for f in fallbacks))
        return CheckResult(
            check.name, FAIL,
            detail=f"{len(fallbacks)} op(s) of a train step of our layers ran on the CPU: {listed}{tail}",
            fix="; ".join(fixes),
        )
    if not report.gpu_present:
        detail = f"no GPU present: nothing can fall back (train step of our layers ran: {ops})"
    else:
        detail = f"train step of our layers: no CPU fallback ({ops})"
    return CheckResult(check.name, PASS, detail=detail + tail)


# ----------------------------------------------------------------------------
# ENVIRONMENT checks.


def _run_environment(check, dtypes, device, faulty):
    """FAIL on a known-broken Metal pairing or both Metal plugins installed, with the pairing's fix."""
    caps = check.case()
    tail = _INJECTED if faulty else ""
    plugins = ", ".join(f"{n} {v}" for n, v in caps.metal_plugins) or "no Metal plugin"
    detail = f"{plugins} with TensorFlow {caps.tf_version}, Python {caps.python or '?'}: {caps.pairing}"
    if caps.pairing_reason and caps.pairing != pairings.NOT_APPLICABLE:
        detail += f" ({caps.pairing_reason})"
    broken = caps.pairing in (pairings.KNOWN_BROKEN, pairings.BOTH_INSTALLED)
    if broken or faulty:
        fixes = [f.command for f in caps.pairing_fixes]
        fix = " ; or: ".join(fixes) if fixes else check.fix
        return CheckResult(check.name, FAIL, detail=detail + tail, fix=fix)
    return CheckResult(check.name, PASS, detail=detail)


# ----------------------------------------------------------------------------
# GAP checks.

# Relative tolerance (of max(1, |value|)) of a gap kernel against TensorFlow's CPU kernel. The kernels
# compute in float and round once; TF's CPU kernels use Eigen's own exp and sigmoid and, for half and
# bfloat16, round after every operation: up to 8 float32 ulps and 3 ulps of half / bfloat16 (derived in
# custom_ops/include/tfmetal/gap_elementwise.h; tests/ops/test_gap_elementwise_metal_emu.py), with margin.
_GAP_RTOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _gap_compare(got, want, dtype):
    """None when `got` (GPU) agrees with `want` (CPU), else what differs."""
    import tensorflow as tf

    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return f"shape {g.shape} != {w.shape}"
        if g.dtype.kind in "biu" or dtype not in _GAP_RTOL:
            if not np.array_equal(g, w):
                return "values differ"
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        if not np.array_equal(np.isnan(g64), np.isnan(w64)):
            return "NaN positions differ"
        ok = np.isnan(w64) | (g64 == w64) | (np.abs(g64 - w64) <= _GAP_RTOL[dtype] * np.maximum(1.0, np.abs(w64)))
        if not ok.all():
            return f"max abs error {float(np.nanmax(np.abs(g64 - w64))):.3g}"
    return None


def _run_gap(check, dtypes, device, faulty):
    """Runs each registered gap kernel on the GPU against TensorFlow's own CPU kernel of the op."""
    import tensorflow as tf

    from tfmetal_ext import ops

    if "GPU" not in device:
        return CheckResult(check.name, SKIP, detail="no GPU here: TensorFlow's own kernels run these ops",
                           fix="run `tfmetal-ext doctor --selftest` on a Mac with a Metal plugin to check them")
    rows = [r for r in ops.status().gap_kernels if r["registered"]]
    if not rows:
        return CheckResult(check.name, SKIP, detail="no gap kernel is registered on this backend",
                           fix="`python -c 'import tfmetal_ext; print(tfmetal_ext.ops.status())'` says why")
    cases = check.case()
    failed, passed = [], []
    for r in rows:
        op, dtype = r["op"], r["dtype"]
        fn, kwargs = cases[op](dtype)
        with tf.device(device):
            got = fn(**kwargs)
        with tf.device("/CPU:0"):
            want = fn(**kwargs)
        if faulty:
            got = tf.nest.map_structure(lambda a: np.asarray(a).astype(np.float64) + 1.0, got)
        why = _gap_compare(got, want, dtype)
        (failed if why else passed).append(f"{op}[{dtype}]" + (f": {why}" if why else ""))
    tail = _INJECTED if faulty else ""
    if failed:
        return CheckResult(check.name, FAIL, detail=f"{len(failed)} of {len(rows)} gap kernels differ from "
                           f"TensorFlow's CPU kernel: {'; '.join(failed)}{tail}", fix=check.fix)
    return CheckResult(check.name, PASS, detail=f"{len(passed)} gap kernels agree with TensorFlow's CPU kernels: "
                       f"{', '.join(passed)}{tail}")


_RUNNERS = {registry.NUMERIC: _run_numeric, registry.PLACEMENT: _run_placement,
            registry.ENVIRONMENT: _run_environment, registry.GAP: _run_gap}


def _names(argument, value, allowed):
    """`value` as a list of check names, validated; `argument` names it in errors."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ValueError(
            f"`{argument}` must be a list of names from {allowed}. Received: {argument}={value!r}"
        )
    names = list(value)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(
            f"Unknown check(s) {unknown} in `{argument}`; valid names: {', '.join(allowed)}. "
            f"Received: {argument}={value!r}"
        )
    return names


def selftest(checks=None, *, faults=()):
    """Checks each fused pattern on the current device against an unfused reference.

    Runs on the first GPU when one is present, else on the CPU, on
    fixed-seed random data, in float32 (and float16 on Metal and CUDA). Each
    numeric check runs the pattern as a graph-mode `tf.function` (grappler
    fuses it; the fused op found in the executed graph is reported) and
    compares it with eager primitive ops on the same device, or with the
    numpy references of `tfmetal_ext.testing`, with a tolerance of 1e-4
    (float32) or 2e-2 (float16) times the reference's largest magnitude (at
    least 1):

    - ``conv_bias_relu``: Conv2D + BiasAdd + Relu.
    - ``matmul_bias_relu``: MatMul + BiasAdd + Relu (reported wrong on Metal
      in graph mode).
    - ``fused_batch_norm``: FusedBatchNormV3 in training (output and moving
      statistics) and inference, + Relu, as our layers emit it, against
      moments-based math.
    - ``softshrink``, ``layer_norm``, ``multi_tensor_adam``: our custom ops
      (forward and gradient ops) against numpy; SKIP when the op library is
      not loaded (fix: ``tfmetal-ext build-ops``).
    - ``metal_pairing``: the Metal plugin installed fits this TensorFlow and
      Python (FAIL on a known-broken pairing or both plugins installed, with
      the commands that fix it).
    - ``gap_kernels``: each GPU kernel tfmetal_ext registered for a standard
      op this Metal backend lacks (`tfmetal_ext.backends.gap_kernels`), run
      on the GPU against TensorFlow's own CPU kernel of the op; SKIP where
      none is registered.
    - ``cpu_fallback``: one train step of a small model of our layers
      (FusedConv2D, ConvBNAct, FusedBatchNorm, FusedDense, FusedLayerNorm,
      FusedAdam); FAIL listing each op that ran on the CPU while a GPU is
      present.

    Every FAIL carries a fix, for the patterns
    ``tfmetal_ext.configure(avoid_fusions=[...])``; `SelfTestResult` can be
    passed to it as is. The checks run the raw patterns, so an avoided
    pattern is still checked. The checks are declared in
    `tfmetal_ext.doctor.checks.REGISTRY`.

    Args:
        checks: names from `CHECKS` to run, or None for all.
        faults: test hook: names from `CHECKS` whose graph-mode result is
            perturbed before the comparison (for ``cpu_fallback``: a fake
            fallback is added), so the failure path can be tested on a
            healthy machine.

    The result names what it tested (`SelfTestResult.tested`: the Metal
    plugin and its version, ``"CUDA"`` or ``"CPU"``) and, on Metal, notes
    what fails or runs on the host there (on the open plugin: stock
    LSTM/GRU, the ``ResourceApply*`` ops on TF 2.21).

    Returns:
        A `SelfTestResult`.

    Raises:
        ValueError: an unknown name in `checks` or in `faults`.
    """
    allowed = tuple(registry.REGISTRY)
    names = list(allowed) if checks is None else _names("checks", checks, allowed)
    faults = frozenset(_names("faults", faults, allowed))
    backend = devices.backend()
    device = _device()
    dtypes = ("float32", "float16") if backend in ("metal", "cuda") else ("float32",)
    results = []
    for name in names:
        check = registry.REGISTRY[name]
        try:
            results.append(_RUNNERS[check.kind](check, dtypes, device, name in faults))
        except Exception as e:  # a check that crashes has failed; the others still run
            results.append(CheckResult(
                name, FAIL, detail=f"raised {type(e).__name__}: {e}".splitlines()[0][:300],
                fix=check.fix, dtypes=tuple(dtypes),
            ))
    from tfmetal_ext.doctor.report import backend_notes

    caps = devices.capabilities()
    return SelfTestResult(
        device=device, backend=backend, checks=results,
        metal_plugin=caps.metal_plugin if backend == "metal" else None,
        metal_plugin_version=caps.metal_plugin_version if backend == "metal" else None,
        notes=backend_notes(caps) if backend == "metal" else [],
    )


__all__ = ["FAIL", "PASS", "SKIP", "CheckResult", "SelfTestResult", "selftest"]
