"""The environment report: `collect()` and `DoctorInfo`."""

from __future__ import annotations

import dataclasses
import platform

from tfmetal_ext import devices, precision
from tfmetal_ext.backends import pairings

BUILD_OPS = "tfmetal-ext build-ops"


@dataclasses.dataclass
class DoctorInfo:
    """What `collect()` found.

    Attributes:
        tfmetal_ext: this package's version.
        platform: ``"<system>/<machine>"``.
        python: Python version.
        tensorflow, keras: installed versions.
        tensorflow_metal: the Metal plugin's version (`metal_plugin`), or None.
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        pairing: TF / Metal plugin verdict (``tfmetal_ext.devices.check_installed``):
            ``"known-good"``, ``"known-broken"``, ``"unknown"``,
            ``"not-applicable"`` or ``"both-installed"``.
        pairing_fix: the commands of the first fix, ``" && "``-joined, else None.
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
        metal_plugin: the Metal plugin distribution (``"tensorflow-metal"``,
            ``"tensorflow-metal-plugin"``) or None; with both installed, the one
            the first fix keeps.
        metal_plugins: ``{name: version}`` of every Metal plugin installed.
        macos: the macOS version, or None off macOS.
        pairing_reason: why the verdict is what it is, or None.
        pairing_fixes: ``[{"summary", "commands"}]``: every fix route, in order.
        backend_notes: what fails or runs on the host on this Metal backend
            (its table's ``unsupported_layers`` and ``host_ops``).
        errors: what is wrong with this install (a known-broken pairing, both
            Metal plugins installed), each with its fix; empty when nothing is.
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
    metal_plugin: str | None = None
    metal_plugins: dict = dataclasses.field(default_factory=dict)
    macos: str | None = None
    pairing_reason: str | None = None
    pairing_fixes: list = dataclasses.field(default_factory=list)
    backend_notes: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        devices_text = ", ".join(f"{d['name']} ({d['device_type']})" for d in self.physical_devices) or "none"
        sections = [
            ("Versions", [
                ("tfmetal-ext", self.tfmetal_ext),
                ("platform", self.platform + (f" (macOS {self.macos})" if self.macos else "")),
                ("python", self.python),
                ("tensorflow", self.tensorflow),
                ("keras", self.keras),
            ]),
            ("Metal backend", _metal_rows(self)),
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
            ("Custom ops", _ops_rows(self.ops, self.backend)),
        ]
        if self.errors:
            sections.insert(0, ("Errors", [("error", list(self.errors))]))
        width = max(len(k) for _, rows in sections for k, _ in rows)
        lines = [f"tfmetal-ext doctor ({self.backend} on {self.platform})"]
        for title, rows in sections:
            lines.append(title)
            for key, value in rows:
                values = value if isinstance(value, list) else [value]
                for i, v in enumerate(values):
                    lines.append(f"  {(key if i == 0 else ''):<{width}}  {v}")
        return "\n".join(lines)


def _metal_rows(info):
    """Rows of the "Metal backend" section: which plugin, the verdict, why, every fix, the backend's notes."""
    plugins = info.metal_plugins or ({info.metal_plugin: info.tensorflow_metal} if info.metal_plugin else {})
    if len(plugins) > 1:
        plugin = [f"{n} {v}" for n, v in plugins.items()] + ["both installed: an error"]
    elif plugins:
        name, version = next(iter(plugins.items()))
        plugin = f"{name} {version}" + (" (Apple's)" if name == pairings.APPLE else " (the open plugin)")
    else:
        plugin = "none installed (no Metal GPU: runs on the CPU)"
    rows = [("plugin", plugin), ("pairing", info.pairing + (f": {info.pairing_reason}" if info.pairing_reason else ""))]
    fixes = info.pairing_fixes or ([{"summary": "fix", "commands": [info.pairing_fix]}] if info.pairing_fix else [])
    for i, fix in enumerate(fixes):
        rows.append(("fix" if i == 0 else "or", [fix["summary"]] + [f"  {c}" for c in fix["commands"]]))
    if info.backend_notes:
        rows.append(("notes", list(info.backend_notes)))
    return rows


def backend_notes(caps=None):
    """What fails, or runs on the host, on the Metal backend of `caps` (`devices.capabilities()` unless given).

    Read from the backend table: its ``unsupported_layers`` (stock Keras
    layers that fail there, with the fix), ``host_ops`` (ops its source
    has but does not register on this TensorFlow), grouped by reason, and the
    ops of an ordinary train step it has no kernel for
    (`tfmetal_ext.backends.gaps.summary`, on this Mac's macOS), with the
    ones tfmetal_ext's gap kernels cover (`tfmetal_ext.backends.gap_kernels.summary`).
    Empty off Metal.
    """
    from tfmetal_ext import backends

    caps = caps if caps is not None else devices.capabilities()
    if caps.backend != "metal" and not caps.metal_plugin:
        return []
    table = backends.table(backends.support_key("metal", False, caps.metal_plugin))
    notes = [f"{layer}: {why}" for layer, why in table.unsupported_layers.items()]
    from tfmetal_ext.backends import gap_kernels

    macos = tuple(int(p) for p in caps.macos.split(".")) if getattr(caps, "macos", None) else None
    covered = gap_kernels.registered(gap_kernels.plan(table, macos=macos))
    by_reason = {}
    for op, why in table.host_ops.items():
        by_reason.setdefault(why, []).append(op)
    for why, ops in by_reason.items():
        ours = [op for op in ops if op in covered]
        left = [op for op in ops if op not in covered]
        if left:
            notes.append(f"on the host, not the GPU (TensorFlow {caps.tf_version}): {', '.join(left)}: {why}")
        if ours:
            notes.append(f"on the host with {table.label} alone (TensorFlow {caps.tf_version}), on the GPU through "
                         f"tfmetal_ext's gap kernels: {', '.join(ours)}")
    if table.kernels_complete:
        notes.append(f"CPU fallbacks in an ordinary train step ({table.label}): "
                     + backends.gaps.summary(table, macos=macos).replace("`", ""))
        notes.append("tfmetal_ext's gap kernels (registered at import) keep these on the GPU: "
                     + gap_kernels.summary(table, macos=macos).replace("`", ""))
    return notes


def _ops_rows(ops, backend="cpu"):
    if ops.get("reference_forced"):
        return [("status", "pure-TF references forced (TFMETAL_EXT_REFERENCE_OPS=1)")]
    if ops.get("loaded"):
        status = "loaded"
    elif ops.get("built"):
        status = "built, not loaded"
    else:
        status = f"not built for this TF: run `{BUILD_OPS}` (until then the pure-TF references run)"
    rows = [("status", status)]
    if ops.get("library"):
        rows.append(("library", ops["library"]))
    if ops.get("tf_version"):
        rows.append(("built for TF", ops["tf_version"]))
    metal = "yes" if ops.get("metal_kernels") else "no (built on macOS arm64 only)"
    if ops.get("metal_kernels") and ops.get("metal_backend"):
        metal += f", bound to {ops['metal_backend']}"
    rows.append(("Metal kernels", metal))
    if backend == "metal" or ops.get("metal_kernels"):
        no_gpu = [f"{name}: {k['gpu_reason']}" for name, k in sorted((ops.get("kernels") or {}).items())
                  if not k.get("gpu") and k.get("gpu_reason")]
        if no_gpu:
            rows.append(("no GPU kernel", no_gpu))
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
    # Per-op GPU kernel state and the Metal backend the kernels bind to (newer OpsStatus fields).
    info.update(metal_backend=getattr(status, "metal_backend", None), kernels=dict(getattr(status, "kernels", {}) or {}))
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
    errors = []
    if caps.pairing in (pairings.KNOWN_BROKEN, pairings.BOTH_INSTALLED):
        errors.append(f"{caps.pairing}: {caps.pairing_reason}" + (f"; fix: {caps.pairing_fix}" if caps.pairing_fix else ""))
    return DoctorInfo(
        tfmetal_ext=__version__,
        platform=caps.platform,
        python=caps.python or platform.python_version(),
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
        metal_plugin=caps.metal_plugin,
        metal_plugins=dict(caps.metal_plugins),
        macos=caps.macos,
        pairing_reason=caps.pairing_reason,
        pairing_fixes=[{"summary": f.summary, "commands": list(f.commands)} for f in caps.pairing_fixes],
        backend_notes=backend_notes(caps),
        errors=errors,
    )


__all__ = ["BUILD_OPS", "DoctorInfo", "backend_notes", "collect"]
