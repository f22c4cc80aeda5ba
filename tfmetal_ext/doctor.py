"""What this install runs on, and whether its fused kernels compute the right values.

`collect()` gathers versions, the TF / tensorflow-metal pairing verdict (with the
pip command that fixes a broken one), devices, oneDNN and native bf16/fp16, what
`configure()` would choose and why, the custom-op library status and the
avoided fusions. `selftest()` runs each fused pattern on the current device in a
graph-mode `tf.function` (so grappler fuses it) and compares it with an eager,
unfused reference on the same device; it catches e.g. the wrong
``_FusedMatMul[BiasAdd, Relu]`` reported on Metal. Every failure says how to fix
or avoid it, usually ``tfmetal_ext.configure(avoid_fusions=...)``:

>>> result = tfmetal_ext.doctor.selftest()
>>> print(result)
>>> tfmetal_ext.configure(avoid_fusions=result)   # the safe forms of what failed

Command line: ``tfmetal-ext doctor [--selftest] [--json]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform

import numpy as np

from tfmetal_ext import devices, precision

CHECKS = (
    "conv_bias_relu",
    "matmul_bias_relu",
    "fused_batch_norm",
    "softshrink",
    "layer_norm",
    "multi_tensor_adam",
    "cpu_fallback",
)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# Test hook: comma-separated check names whose graph-mode result is perturbed.
FAULT_ENV = "TFMETAL_EXT_SELFTEST_FAULT"

# Allowed error, relative to the reference's largest magnitude (at least 1).
_RTOL = {"float32": 1e-4, "float16": 2e-2}

_BUILD_OPS = "tfmetal-ext build-ops"
_REPORT = "and report it (attach `tfmetal-ext doctor --selftest --json`)"


# ----------------------------------------------------------------------------
# collect()


@dataclasses.dataclass
class DoctorInfo:
    """What `collect()` found.

    Attributes:
        tfmetal_ext: this package's version.
        platform: ``"<system>/<machine>"``.
        python: Python version.
        tensorflow, keras: installed versions.
        tensorflow_metal: tensorflow-metal version, or None.
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        pairing: TF / tensorflow-metal verdict (``tfmetal_ext.devices.pairing_verdict``).
        pairing_fix: the pip command that fixes a broken pairing, else None.
        physical_devices: ``{"name", "device_type"}`` of every physical device.
        onednn: oneDNN kernels and fusions are on.
        cpu_bf16, cpu_fp16: the CPU computes bfloat16 / float16 natively.
        global_policy: the Keras dtype policy in force now.
        config: what ``configure()`` would choose: ``policy``, ``jit_compile``,
            ``reasons`` (from `tfmetal_ext.precision.recommend`; nothing is changed).
        ops: custom-op library: ``built`` (a valid build for this TF is
            cached), ``loaded``, ``library``, ``tf_version`` (built for),
            ``metal_kernels``, ``reference_forced``, ``error``.
        avoided_fusions: patterns switched to their safe unfused form.
    """

    tfmetal_ext: str
    platform: str
    python: str
    tensorflow: str
    keras: str
    tensorflow_metal: str | None
    backend: str
    pairing: str
    pairing_fix: str | None
    physical_devices: list
    onednn: bool
    cpu_bf16: bool
    cpu_fp16: bool
    global_policy: str
    config: dict
    ops: dict
    avoided_fusions: list

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        pairing = self.pairing
        if self.tensorflow_metal is None:
            pairing += " (tensorflow-metal not installed)"
        devices_text = ", ".join(f"{d['name']} ({d['device_type']})" for d in self.physical_devices) or "none"
        sections = [
            ("Versions", [
                ("tfmetal-ext", self.tfmetal_ext),
                ("platform", self.platform),
                ("python", self.python),
                ("tensorflow", self.tensorflow),
                ("keras", self.keras),
                ("tensorflow-metal", self.tensorflow_metal or "not installed"),
                ("pairing", pairing),
            ] + ([("fix", self.pairing_fix)] if self.pairing_fix else [])),
            ("Devices", [
                ("backend", self.backend),
                ("physical devices", devices_text),
                ("oneDNN", "on" if self.onednn else "off"),
                ("CPU bfloat16", yes(self.cpu_bf16)),
                ("CPU float16", yes(self.cpu_fp16)),
            ]),
            ("configure() would choose", [
                ("policy", f"{self.config['policy']} (global policy now: {self.global_policy})"),
                ("jit_compile", str(self.config["jit_compile"])),
                ("reasons", list(self.config["reasons"]) or ["-"]),
                ("avoided fusions", ", ".join(self.avoided_fusions) or "none"),
            ]),
            ("Custom ops", _ops_rows(self.ops)),
        ]
        width = max(len(k) for _, rows in sections for k, _ in rows)
        lines = [f"tfmetal-ext doctor ({self.backend} on {self.platform})"]
        for title, rows in sections:
            lines.append(title)
            for key, value in rows:
                values = value if isinstance(value, list) else [value]
                for i, v in enumerate(values):
                    lines.append(f"  {(key if i == 0 else ''):<{width}}  {v}")
        return "\n".join(lines)


def _ops_rows(ops):
    if ops.get("reference_forced"):
        return [("status", "pure-TF references forced (TFMETAL_EXT_REFERENCE_OPS=1)")]
    if ops.get("loaded"):
        status = "loaded"
    elif ops.get("built"):
        status = "built, not loaded"
    else:
        status = f"not built for this TF: run `{_BUILD_OPS}` (until then the pure-TF references run)"
    rows = [("status", status)]
    if ops.get("library"):
        rows.append(("library", ops["library"]))
    if ops.get("tf_version"):
        rows.append(("built for TF", ops["tf_version"]))
    rows.append(("Metal kernels", "yes" if ops.get("metal_kernels") else "no (built on macOS arm64 only)"))
    if ops.get("error"):
        rows.append(("error", ops["error"]))
    return rows


def _ops_info():
    """The op library's status, loading it only when a valid build is already cached."""
    from tfmetal_ext import ops
    from tfmetal_ext.ops import _common, _loader

    info = {"built": False, "loaded": False, "library": None, "tf_version": None, "metal_kernels": False,
            "reference_forced": _common.use_reference(), "error": None}
    if info["reference_forced"]:
        return info
    try:
        plan = _loader.plan()
        info["built"] = _loader.entry_is_valid(plan)
    except (_loader.BuildError, FileNotFoundError, OSError) as e:
        info["error"] = str(e)
        return info
    status = ops.status(load=info["built"])  # never compiles here: that is `tfmetal-ext build-ops`
    info.update(loaded=status.loaded, error=status.error)
    if info["built"]:
        info.update(library=str(plan.library), tf_version=plan.tf_version, metal_kernels=plan.with_metal)
    return info


def collect():
    """Gathers what the doctor reports. Changes nothing (the op library is
    loaded if a build for this TF is cached, never compiled).

    Returns:
        A `DoctorInfo`.
    """
    import keras
    import tensorflow as tf

    from tfmetal_ext import __version__

    caps = devices.capabilities()
    cfg = precision.recommend()
    physical = [{"name": d.name, "device_type": d.device_type} for d in tf.config.list_physical_devices()]
    return DoctorInfo(
        tfmetal_ext=__version__,
        platform=caps.platform,
        python=platform.python_version(),
        tensorflow=caps.tf_version,
        keras=caps.keras_version,
        tensorflow_metal=caps.metal_plugin_version,
        backend=caps.backend,
        pairing=caps.pairing,
        pairing_fix=caps.pairing_fix,
        physical_devices=physical,
        onednn=caps.onednn,
        cpu_bf16=caps.cpu_bf16,
        cpu_fp16=caps.cpu_fp16,
        global_policy=keras.mixed_precision.global_policy().name,
        config={"policy": cfg.policy, "jit_compile": cfg.jit_compile, "reasons": list(cfg.reasons)},
        ops=_ops_info(),
        avoided_fusions=sorted(precision.avoided_fusions()),
    )


# ----------------------------------------------------------------------------
# selftest()


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
    """

    device: str
    backend: str
    checks: list

    @property
    def passed(self):
        """No check failed (skipped checks do not count)."""
        return all(c.status != FAIL for c in self.checks)

    @property
    def failed_patterns(self):
        """Names of failed checks that have a safe form (``configure(avoid_fusions=...)`` takes them)."""
        return tuple(c.name for c in self.checks if c.status == FAIL and c.name in precision.SAFE_FORMS)

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
            "passed": self.passed,
            "failed_patterns": list(self.failed_patterns),
            "checks": [c.to_dict() for c in self.checks],
        }

    def __str__(self):
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"Self-test on {self.device} (backend {self.backend})"]
        for c in self.checks:
            lines.append(f"  {c.status}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status != PASS:
                lines.append(f"  {'':4}  {'':<{width}}  fix: {c.fix}")
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}
        lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
        if self.failed_patterns:
            lines.append(
                f"to use the safe forms: tfmetal_ext.configure(avoid_fusions={list(self.failed_patterns)!r})"
            )
        return "\n".join(lines)


def _faults():
    """Check names listed in ``TFMETAL_EXT_SELFTEST_FAULT`` (the test hook)."""
    raw = os.environ.get(FAULT_ENV, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(
            f"Unknown check name(s) {unknown} in ${FAULT_ENV}; valid names: {', '.join(CHECKS)}. "
            f"Received: {FAULT_ENV}={raw!r}"
        )
    return frozenset(names)


def _device():
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else tf.config.list_logical_devices("CPU")[0].name


def _safe_fix(name):
    return (
        f"tfmetal_ext.configure(avoid_fusions=[{name!r}]) before building the model: "
        f"{precision.SAFE_FORMS[name]}"
    )


_FIXES = {
    "conv_bias_relu": _safe_fix("conv_bias_relu"),
    "matmul_bias_relu": _safe_fix("matmul_bias_relu"),
    "fused_batch_norm": _safe_fix("fused_batch_norm"),
    "softshrink": f"{_safe_fix('softshrink')}; {_REPORT}",
    "layer_norm": f"{_safe_fix('layer_norm')}; {_REPORT}",
    "multi_tensor_adam": f"{_safe_fix('multi_tensor_adam')}; {_REPORT}",
}


def _fused_label(nodes):
    """The fused ops in executed graph nodes, e.g. ``"_FusedConv2D[BiasAdd, Relu]"``, or None."""
    labels = []
    for n in nodes:
        fused_ops = [s.decode() for s in n.attr["fused_ops"].list.s] if "fused_ops" in n.attr else []
        if n.op.startswith(("_Fused", "TfmetalExt>")) or fused_ops:
            label = f"{n.op}[{', '.join(fused_ops)}]" if fused_ops else n.op
            if label not in labels:
                labels.append(label)
    return ", ".join(labels) or None


def _run_graph(fn, *args):
    """Runs `fn` once as a fresh graph-mode tf.function (grappler on); returns (outputs, fused label)."""
    import tensorflow as tf

    from tfmetal_ext.inspect.capture import capture_call

    outputs, cap = capture_call(tf.function(fn), *args)
    return _as_numpy(outputs), _fused_label(cap.nodes())


def _as_numpy(structure):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t, np.float64), structure)


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


def _numeric_check(name, case, dtypes, device, faults):
    """Runs ``case(dtype) -> (graph fn, args, reference)`` per dtype and compares."""
    import tensorflow as tf

    worst, fused, parts = None, [], []
    for dtype in dtypes:
        with tf.device(device):
            fn, args, reference = case(dtype)
            got, label = _run_graph(fn, *args)
        if name in faults:
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
    if name in faults:
        detail += f" (fault injected by ${FAULT_ENV})"
    if not ok:
        detail += " -- the graph-mode (fused) result differs from the eager unfused reference"
    return CheckResult(
        name, PASS if ok else FAIL, worst[0], worst[1], fused_text, detail,
        None if ok else _FIXES[name], tuple(dtypes),
    )


def _rng(seed):
    return np.random.default_rng(seed)


def _conv_case(dtype):
    import tensorflow as tf

    rng = _rng(1)
    x = tf.constant(rng.standard_normal((2, 9, 9, 8)), dtype)
    w = tf.constant(rng.standard_normal((3, 3, 8, 16)) * 0.2, dtype)
    b = tf.constant(rng.standard_normal(16) * 0.5, dtype)

    def fused(x, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), b))

    reference = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + b)  # eager: one kernel per op
    return fused, (x, w, b), reference


def _matmul_case(dtype):
    import tensorflow as tf

    rng = _rng(2)
    x = tf.constant(rng.standard_normal((16, 32)), dtype)
    w = tf.constant(rng.standard_normal((32, 24)) * 0.2, dtype)
    b = tf.constant(rng.standard_normal(24) * 0.5, dtype)

    def fused(x, w, b):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))

    reference = tf.nn.relu(tf.matmul(x, w) + b)
    return fused, (x, w, b), reference


def _batch_norm_case(dtype):
    import tensorflow as tf

    from tfmetal_ext.layers import _ops

    rng = _rng(3)
    c, eps, momentum = 8, 1e-3, 0.9
    x = tf.constant(rng.standard_normal((4, 6, 6, c)) * 2.0 + 0.5, dtype)
    gamma = tf.constant(rng.uniform(0.5, 1.5, c), tf.float32)
    beta = tf.constant(rng.standard_normal(c) * 0.3, tf.float32)
    mean = tf.constant(rng.standard_normal(c) * 0.3, tf.float32)
    var = tf.constant(rng.uniform(0.5, 2.0, c), tf.float32)

    def fused(x, gamma, beta, mean, var):
        # As FusedBatchNorm / ConvBNAct emit it: FusedBatchNormV3 (+ Relu), training and inference.
        y, (new_mean, new_var) = _ops.fused_batch_norm(
            x, gamma, beta, mean, var, epsilon=eps, momentum=momentum, training=True
        )
        y_inf, _ = _ops.fused_batch_norm(x, gamma, beta, mean, var, epsilon=eps, momentum=momentum, training=False)
        return tf.nn.relu(y), new_mean, new_var, tf.nn.relu(y_inf)

    # Eager reference from primitive ops, statistics in float32.
    xf = tf.cast(x, tf.float32)
    batch_mean = tf.reduce_mean(xf, axis=[0, 1, 2])
    batch_var = tf.reduce_mean(tf.square(xf - batch_mean), axis=[0, 1, 2])
    y = tf.nn.relu((xf - batch_mean) * tf.math.rsqrt(batch_var + eps) * gamma + beta)
    y_inf = tf.nn.relu((xf - mean) * tf.math.rsqrt(var + eps) * gamma + beta)
    reference = (
        tf.cast(y, dtype), mean * momentum + batch_mean * (1 - momentum),
        var * momentum + batch_var * (1 - momentum), tf.cast(y_inf, dtype),
    )
    return fused, (x, gamma, beta, mean, var), reference


def _softshrink_case(lib):
    def case(dtype):
        import tensorflow as tf

        rng = _rng(4)
        xn = rng.standard_normal((7, 33)) * 2.0
        xn[np.abs(np.abs(xn) - 0.5) < 1e-2] = 1.0  # away from the kinks
        x = tf.constant(xn, dtype)
        dy = tf.constant(rng.standard_normal((7, 33)), dtype)

        def fused(x, dy):
            return lib.tfmetal_ext_softshrink(x, lambd=0.5), lib.tfmetal_ext_softshrink_grad(dy, x, lambd=0.5)

        xr = np.asarray(x, np.float64)
        y = np.where(xr > 0.5, xr - 0.5, np.where(xr < -0.5, xr + 0.5, 0.0))
        dx = np.where(np.abs(xr) > 0.5, np.asarray(dy, np.float64), 0.0)
        return fused, (x, dy), (y, dx)

    return case


def _layer_norm_case(lib):
    def case(dtype):
        import tensorflow as tf

        from tfmetal_ext.ops import _reference

        rng = _rng(5)
        eps = 1e-3
        x = tf.constant(rng.standard_normal((6, 40)) * 1.5 + 0.3, dtype)
        gamma = tf.constant(rng.uniform(0.5, 1.5, 40), tf.float32)
        beta = tf.constant(rng.standard_normal(40) * 0.2, tf.float32)
        dy = tf.constant(rng.standard_normal((6, 40)), dtype)

        def fused(x, gamma, beta, dy):
            y, mean, rstd = lib.tfmetal_ext_layer_norm(x, gamma, beta, epsilon=eps)
            return (y,) + tuple(lib.tfmetal_ext_layer_norm_grad(dy, x, gamma, mean, rstd))

        xr = np.asarray(x, np.float64)
        centered = xr - xr.mean(-1, keepdims=True)
        y = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + eps) * np.asarray(gamma) + np.asarray(beta)
        grads = _reference.layer_norm_grad(dy, x, gamma, eps)  # eager, pure TF
        return fused, (x, gamma, beta, dy), (y,) + tuple(grads)

    return case


def _adam_case(lib):
    def case(dtype):
        import tensorflow as tf

        rng = _rng(6)
        shapes = [(5, 7), (11,)]
        lr, b1, b2, eps, b1p, b2p = 0.01, 0.9, 0.999, 1e-7, 0.9**3, 0.999**3
        init = [[rng.standard_normal(s) * k for s in shapes] for k in (1.0, 0.1, 0.01)]
        init[2] = [np.abs(v) for v in init[2]]  # second moments are >= 0
        grads = [rng.standard_normal(s) for s in shapes]
        var, m, v = ([tf.Variable(a, dtype=dtype) for a in group] for group in init)
        grad_tensors = [tf.constant(g, dtype) for g in grads]

        def fused(*grads):
            scalars = [tf.constant(s, dtype) for s in (lr, b1, b2, eps, b1p, b2p)]
            lib.tfmetal_ext_multi_tensor_adam(
                [x.handle for x in var], [x.handle for x in m], [x.handle for x in v], [], list(grads),
                *scalars, [],
            )
            return [x.read_value() for x in var + m + v]

        # numpy Adam in the order of ResourceApplyAdam, from the values as stored in `dtype`.
        alpha = lr * math.sqrt(1 - b2p) / (1 - b1p)
        new_vars, new_m, new_v = [], [], []
        for p0, m0, v0, g in zip(*([np.asarray(x, np.float64) for x in group] for group in (var, m, v)),
                                 [np.asarray(g, np.float64) for g in grad_tensors]):
            m1 = m0 + (g - m0) * (1 - b1)
            v1 = v0 + (g * g - v0) * (1 - b2)
            new_m.append(m1)
            new_v.append(v1)
            new_vars.append(p0 - m1 * alpha / (np.sqrt(v1) + eps))
        ref = new_vars + new_m + new_v
        return fused, tuple(grad_tensors), ref

    return case


def _custom_op_check(name, op_name, make_case, dtypes, device, faults):
    from tfmetal_ext.ops import _common, _loader

    if _common.use_reference():
        return CheckResult(
            name, SKIP, detail="TFMETAL_EXT_REFERENCE_OPS=1: only the pure-TF reference runs, nothing else to check",
            fix="unset TFMETAL_EXT_REFERENCE_OPS to check the custom op", dtypes=tuple(dtypes),
        )
    lib = _loader.load()
    if lib is None:
        why = _loader.state().error or "not loaded"
        return CheckResult(
            name, SKIP, detail=f"custom-op library not loaded ({why}): only the pure-TF reference runs",
            fix=_BUILD_OPS, dtypes=tuple(dtypes),
        )
    if "GPU" in device and not _common.kernel_for_visible_devices(op_name):
        return CheckResult(
            name, SKIP, detail=f"{op_name} has no GPU kernel in this build: the pure-TF reference runs on the GPU",
            fix=f"{_BUILD_OPS} on macOS arm64 builds the Metal kernels", dtypes=tuple(dtypes),
        )
    return _numeric_check(name, make_case(lib), dtypes, device, faults)


# Ops that fall back to the CPU -> the replacement to use.
_FALLBACK_FIXES = {
    "TfmetalExt>Softshrink": _safe_fix("softshrink"),
    "TfmetalExt>SoftshrinkGrad": _safe_fix("softshrink"),
    "TfmetalExt>LayerNorm": _safe_fix("layer_norm"),
    "TfmetalExt>LayerNormGrad": _safe_fix("layer_norm"),
    "TfmetalExt>MultiTensorAdam": _safe_fix("multi_tensor_adam"),
    "_FusedConv2D": _safe_fix("conv_bias_relu"),
    "_FusedMatMul": _safe_fix("matmul_bias_relu"),
    "FusedBatchNormV3": _safe_fix("fused_batch_norm"),
    "FusedBatchNormGradV3": _safe_fix("fused_batch_norm"),
    "_FusedBatchNormEx": _safe_fix("fused_batch_norm"),
}


def _fallback_fix(fallbacks):
    fixes = []
    for f in fallbacks:
        fix = _FALLBACK_FIXES.get(f.op) or (
            f"{f.op} has no kernel on this GPU: replace what emits it in layer {f.layer or '?'} "
            "(tf.config.set_soft_device_placement(False) makes it an error that names the op)"
        )
        if fix not in fixes:
            fixes.append(fix)
    return "; ".join(fixes)


def _cpu_fallback_check(device, faults):
    import keras

    from tfmetal_ext import inspect
    from tfmetal_ext.inspect.report import FallbackNode
    from tfmetal_ext.layers import ConvBNAct, FusedBatchNorm, FusedConv2D, FusedDense, FusedLayerNorm
    from tfmetal_ext.optimizers import FusedAdam

    inp = keras.Input((8, 8, 3))
    x = FusedConv2D(8, 3, padding="same", activation="relu", name="conv")(inp)
    x = ConvBNAct(8, 3, name="conv_bn")(x)
    x = FusedBatchNorm(name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = FusedDense(16, activation="relu", name="fc")(x)
    x = FusedLayerNorm(name="ln")(x)
    out = FusedDense(4, name="head")(x)
    model = keras.Model(inp, out, name="tfmetal_ext_selftest")
    model.compile(optimizer=FusedAdam(1e-3), loss="mse")
    report = inspect.placement_report(model, mode="train", batch_size=4)
    fallbacks = list(report.fallbacks)
    if "cpu_fallback" in faults:
        fallbacks.append(FallbackNode(op="InjectedFault", name="injected/InjectedFault", layer="fc", device="CPU:0"))
    ops = ", ".join(f"{d}: {n}" for d, n in sorted(report.ops_by_device.items()))
    detail_tail = f" (fault injected by ${FAULT_ENV})" if "cpu_fallback" in faults else ""
    if fallbacks:
        listed = ", ".join(f"{f.op} ({f.layer or '-'})" for f in fallbacks)
        return CheckResult(
            "cpu_fallback", FAIL,
            detail=f"{len(fallbacks)} op(s) of a train step of our layers ran on the CPU: {listed}{detail_tail}",
            fix=_fallback_fix(fallbacks),
        )
    if not report.gpu_present:
        detail = f"no GPU present: nothing can fall back (train step of our layers ran: {ops})"
    else:
        detail = f"train step of our layers: no CPU fallback ({ops})"
    return CheckResult("cpu_fallback", PASS, detail=detail + detail_tail)


def selftest(checks=None):
    """Checks each fused pattern on the current device against an unfused reference.

    Runs on the first GPU when one is present, else on the CPU, on
    fixed-seed random data, in float32 (and float16 on Metal and CUDA). Each
    numeric check runs the pattern as a graph-mode `tf.function` (grappler
    fuses it; the fused op found in the executed graph is reported) and
    compares it with eager primitive ops on the same device, with a tolerance
    of 1e-4 (float32) or 2e-2 (float16) times the reference's largest
    magnitude (at least 1):

    - ``conv_bias_relu``: Conv2D + BiasAdd + Relu.
    - ``matmul_bias_relu``: MatMul + BiasAdd + Relu (reported wrong on Metal
      in graph mode).
    - ``fused_batch_norm``: FusedBatchNormV3 in training (output and moving
      statistics) and inference, + Relu, as our layers emit it, against
      moments-based math.
    - ``softshrink``, ``layer_norm``, ``multi_tensor_adam``: our custom ops
      (forward and gradient ops) against numpy and the pure-TF references;
      SKIP when the op library is not loaded (fix: ``tfmetal-ext build-ops``).
    - ``cpu_fallback``: one train step of a small model of our layers
      (FusedConv2D, ConvBNAct, FusedBatchNorm, FusedDense, FusedLayerNorm,
      FusedAdam); FAIL listing each op that ran on the CPU while a GPU is
      present.

    Every FAIL carries a fix, for the patterns
    ``tfmetal_ext.configure(avoid_fusions=[...])``; `SelfTestResult` can be
    passed to it as is. The checks run the raw patterns, so an avoided
    pattern is still checked.

    Test hook: the environment variable ``TFMETAL_EXT_SELFTEST_FAULT`` (check
    names, comma-separated) perturbs the graph-mode result of those checks
    before the comparison (for ``cpu_fallback``: adds a fake fallback), so
    the failure path can be tested on a healthy machine.

    Args:
        checks: names from `CHECKS` to run, or None for all.

    Returns:
        A `SelfTestResult`.

    Raises:
        ValueError: an unknown name in `checks` or in ``TFMETAL_EXT_SELFTEST_FAULT``.
    """
    if checks is None:
        names = list(CHECKS)
    else:
        if isinstance(checks, str) or not hasattr(checks, "__iter__"):
            raise ValueError(f"`checks` must be None or a list of names from {CHECKS}. Received: checks={checks!r}")
        names = list(checks)
        unknown = [n for n in names if n not in CHECKS]
        if unknown:
            raise ValueError(f"Unknown check(s) {unknown}; valid: {', '.join(CHECKS)}. Received: checks={checks!r}")
    faults = _faults()
    backend = devices.backend()
    device = _device()
    dtypes = ("float32", "float16") if backend in ("metal", "cuda") else ("float32",)
    runners = {
        "conv_bias_relu": lambda: _numeric_check("conv_bias_relu", _conv_case, dtypes, device, faults),
        "matmul_bias_relu": lambda: _numeric_check("matmul_bias_relu", _matmul_case, dtypes, device, faults),
        "fused_batch_norm": lambda: _numeric_check("fused_batch_norm", _batch_norm_case, dtypes, device, faults),
        "softshrink": lambda: _custom_op_check(
            "softshrink", "TfmetalExt>Softshrink", _softshrink_case, dtypes, device, faults),
        "layer_norm": lambda: _custom_op_check(
            "layer_norm", "TfmetalExt>LayerNorm", _layer_norm_case, dtypes, device, faults),
        "multi_tensor_adam": lambda: _custom_op_check(
            "multi_tensor_adam", "TfmetalExt>MultiTensorAdam", _adam_case, dtypes, device, faults),
        "cpu_fallback": lambda: _cpu_fallback_check(device, faults),
    }
    results = []
    for name in names:
        try:
            results.append(runners[name]())
        except Exception as e:  # a check that crashes has failed; the others still run
            fix = _FIXES.get(name) or f"our layers cannot run a train step here; {_REPORT}"
            results.append(CheckResult(
                name, FAIL, detail=f"raised {type(e).__name__}: {e}".splitlines()[0][:300],
                fix=fix, dtypes=tuple(dtypes),
            ))
    return SelfTestResult(device=device, backend=backend, checks=results)


__all__ = ["CHECKS", "CheckResult", "DoctorInfo", "FAULT_ENV", "SelfTestResult", "collect", "selftest"]
