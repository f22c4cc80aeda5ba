"""What `tfmetal_ext.ops` runs: the op library's state, per-op kernels, and building it.

`status()` describes the loaded library (`OpsStatus`); `build()` builds it, or
finds it in the cache, for this TensorFlow (``tfmetal-ext build-ops``). Both
are re-exported as ``tfmetal_ext.ops.status`` / ``tfmetal_ext.ops.build``.
"""

from __future__ import annotations

import dataclasses

from tfmetal_ext.ops import _common, _loader


@dataclasses.dataclass(frozen=True)
class OpsStatus:
    """What `tfmetal_ext.ops` runs.

    Attributes:
        loaded: the compiled op library is loaded.
        reference_forced: ``TFMETAL_EXT_REFERENCE_OPS=1`` is set.
        library: path of the loaded library, or None.
        tf_version: the TF version it was built for, or None.
        metal_kernels: the library contains Metal kernels (macOS arm64 builds).
        error: why the library is not loaded, or None.
        metal_backend: the Metal backend the GPU kernels are bound to
            (``"tensorflow-metal"``, ``"tensorflow-metal-plugin"``), or None.
        kernels: per op (``"softshrink"``, ``"layer_norm"``,
            ``"multi_tensor_adam"``, ``"multi_tensor_lion"``, ``"multi_tensor_rmsprop"``, ``"rms_norm"``,
            ``"attention"``, ``"int8_matmul"``, ``"int8_conv2d"``, ``"dropout"``, ``"rope"``, ``"batch_norm_act"``, ``"activation_grad"``,
            ``"sparse_softmax_cross_entropy"``: the keys of
            `tfmetal_ext.backends.fusion.CUSTOM_OPS`), ``{"cpu": bool, "gpu":
            bool, "gpu_reason": str | None}``: whether the op's CPU kernel and
            its GPU (Metal) kernel are registered (for the op and its gradient
            op), and why there is no GPU kernel. Where the Metal host code
            cannot bind to the backend (an unknown stream type, the open
            plugin at a release whose layout was not checked, its buffer
            registry not exported), the reason says so; TF then places the op
            on the CPU.
        gap_kernels: one dict per standard op and dtype our library has a
            gap kernel for (`tfmetal_ext.backends.gap_kernels`), ``{"op",
            "dtype", "registered": bool, "reason": str}``: registered on this
            Metal backend because it has no kernel of its own, or why not
            (the backend has one, no Metal backend here, the library not
            loaded or built without Metal, the host code's refusal).
        cpu_level: the vector code the CPU kernels run in this process:
            ``"avx512"``, ``"avx2"`` (with FMA) or ``"baseline"`` (portable
            loops, as on arm64), picked from the CPU at load and capped by
            ``TFMETAL_EXT_CPU_LEVEL`` (``TFMETAL_EXT_CPU_BASELINE=1``:
            ``"baseline"``); None when the library is not loaded.
    """

    loaded: bool
    reference_forced: bool
    library: str | None
    tf_version: str | None
    metal_kernels: bool
    error: str | None
    metal_backend: str | None = None
    kernels: dict = dataclasses.field(default_factory=dict)
    gap_kernels: tuple = ()
    cpu_level: str | None = None

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        if self.reference_forced:
            return "custom ops: pure-TF references (TFMETAL_EXT_REFERENCE_OPS=1)"
        if not self.loaded:
            return "\n".join([f"custom ops: not loaded ({self.error or 'not used yet'})"] + gap_lines(self.gap_kernels))
        metal = "with Metal kernels" if self.metal_kernels else "CPU kernels only"
        if self.cpu_level:
            metal += f", CPU kernels' vector code: {self.cpu_level}"
        if self.metal_backend:
            metal += f" for {self.metal_backend}"
        lines = [f"custom ops: {self.library} (TF {self.tf_version}, {metal})"]
        if self.metal_kernels:
            for name, k in sorted(self.kernels.items()):
                if not k.get("gpu"):
                    lines.append(f"  {name}: no GPU kernel ({k.get('gpu_reason') or 'unknown reason'})")
        lines += gap_lines(self.gap_kernels)
        return "\n".join(lines)


def gap_lines(rows):
    """The status lines of the gap-kernel rows: what is registered, then what is not, grouped by reason."""
    if not rows:
        return []
    registered = [f"{r['op']}[{r['dtype']}]" for r in rows if r["registered"]]
    reasons = {r["reason"] for r in rows}
    if not registered and len(reasons) == 1:
        return [f"  gap kernels: none registered ({reasons.pop()})"]
    lines = [f"  gap kernels registered ({len(registered)}): {', '.join(registered) if registered else 'none'}"]
    by_reason = {}
    for r in rows:
        if not r["registered"]:
            by_reason.setdefault(r["reason"], []).append(f"{r['op']}[{r['dtype']}]")
    for reason, keys in by_reason.items():
        lines.append(f"  not registered ({len(keys)}): {reason}: {', '.join(keys)}")
    return lines


def _kernels(loaded, forced, error, with_metal, registrations):
    """`OpsStatus.kernels` from the loader's state and the Metal host code's records."""
    from tfmetal_ext.backends import fusion

    out = {}
    for name, op in fusion.CUSTOM_OPS.items():
        if forced:
            out[name] = {"cpu": False, "gpu": False, "gpu_reason": "TFMETAL_EXT_REFERENCE_OPS=1: the pure-TF reference runs"}
            continue
        if not loaded:
            out[name] = {"cpu": False, "gpu": False,
                         "gpu_reason": f"the op library is not loaded ({error or 'not used yet'})"}
            continue
        if not with_metal:
            out[name] = {"cpu": True, "gpu": False,
                         "gpu_reason": "this build has no Metal kernels (they are built on macOS arm64 only)"}
            continue
        gpu, reasons = True, []
        for tf_op in op.op_names:
            r = (registrations or {}).get(tf_op)
            if r is None:
                gpu = False
                reasons.append(f"{tf_op}: no GPU registration recorded")
            elif not r.gpu:
                gpu = False
                if r.reason and r.reason not in reasons:
                    reasons.append(r.reason)
        out[name] = {"cpu": True, "gpu": gpu, "gpu_reason": "; ".join(reasons) if not gpu else None}
    return out


def _gap_rows(loaded, forced, error, with_metal, registrations):
    """`OpsStatus.gap_kernels`: the plan for this process's Metal backend, checked against what the host code recorded."""
    from tfmetal_ext.backends import gap_kernels

    found = gap_kernels.for_this_process()
    if found is None:
        reason = "no single Metal backend is installed here: TensorFlow's own kernels serve these ops"
        return tuple({"op": op, "dtype": d, "registered": False, "reason": reason}
                     for op, k in gap_kernels.GAP_KERNELS.items() for d in k.dtypes)
    out = []
    for row in found[2]:
        registered, reason = row.registered, row.reason
        if registered:
            record = (registrations or {}).get(row.key)
            if forced:
                registered, reason = False, "TFMETAL_EXT_REFERENCE_OPS=1: the op library is not loaded"
            elif not loaded:
                registered, reason = False, f"the op library is not loaded ({error or 'not used yet'})"
            elif not with_metal:
                registered, reason = False, "this build of the op library has no Metal kernels"
            elif record is None:
                registered, reason = False, "planned, but the loaded library recorded no registration for it"
            elif not record.gpu:
                registered, reason = False, record.reason or "the host code did not register it"
        out.append({"op": row.op, "dtype": row.dtype, "registered": registered, "reason": reason})
    return tuple(out)


def status(load: bool = True) -> OpsStatus:
    """Loads the op library (building it if needed, unless ``load=False``) and describes it."""
    forced = _common.use_reference()
    if load and not forced:
        _loader.load()
    st = _loader.state()
    p = st.plan
    loaded = st.module is not None
    with_metal = bool(p and p.with_metal and loaded)
    registrations = _loader.gpu_registrations() if with_metal else None
    backends = {r.backend for r in (registrations or {}).values() if r.gpu and r.backend}
    return OpsStatus(
        loaded=loaded,
        reference_forced=forced,
        library=str(p.library) if (p and loaded) else None,
        tf_version=p.tf_version if p else None,
        metal_kernels=with_metal,
        error=st.error,
        metal_backend=next(iter(backends)) if len(backends) == 1 else None,
        kernels=_kernels(loaded, forced, st.error, with_metal, registrations),
        gap_kernels=_gap_rows(loaded, forced, st.error, with_metal, registrations),
        cpu_level=_loader.cpu_vector_level() if loaded else None,
    )


def build(force: bool = False):
    """Builds (or finds in the cache) the op library for this TF; returns its path."""
    return _loader.build(force=force).library
