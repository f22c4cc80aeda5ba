"""The environment report: `collect()` and `DoctorInfo`."""

from __future__ import annotations

import dataclasses
import platform

from tfmetal_ext import devices, precision

BUILD_OPS = "tfmetal-ext build-ops"


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
        status = f"not built for this TF: run `{BUILD_OPS}` (until then the pure-TF references run)"
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


__all__ = ["BUILD_OPS", "DoctorInfo", "collect"]
