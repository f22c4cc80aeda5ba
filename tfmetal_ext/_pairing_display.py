"""How a `tfmetal_ext.devices.Capabilities` and its pairing read on screen (``tfmetal-ext version``, the doctor)."""

from __future__ import annotations


def describe_pairing(caps):
    """Lines that describe the Metal backend of `caps` and its pairing: verdict, why, fix commands.

    For ``tfmetal-ext version`` and the doctor.
    """
    if caps.metal_plugins and len(caps.metal_plugins) > 1:
        backend_text = " and ".join(f"{n} {v}" for n, v in caps.metal_plugins) + " (both installed: an error)"
    elif caps.metal_plugin:
        backend_text = f"{caps.metal_plugin} {caps.metal_plugin_version}"
    else:
        backend_text = "none installed"
    lines = [
        f"Metal plugin: {backend_text}",
        f"backend {caps.backend} on {caps.platform}"
        + (f" (macOS {caps.macos})" if caps.macos else "") + (f", Python {caps.python}" if caps.python else ""),
        f"pairing: {caps.pairing}" + (f" ({caps.pairing_reason})" if caps.pairing_reason else ""),
    ]
    for i, fix in enumerate(caps.pairing_fixes or ()):
        lines.append(f"{'fix' if i == 0 else 'or'}: {fix.summary}")
        lines.extend(f"  {c}" for c in fix.commands)
    if caps.pairing_fix and not caps.pairing_fixes:
        lines.append(f"fix: {caps.pairing_fix}")
    return lines
