"""The backend tables by key, and which one a host (or a `Capabilities`) reads.

`TABLES` maps a support key to its `Backend` table, `PRECISION` a
`devices.backend()` value to its ``precision(caps)`` choice; `table`,
`support_key` and `current` pick one. Data and lookups only: the host is read
from the environment (`tfmetal_ext._env`), never probed here.
"""

from __future__ import annotations

import types

from tfmetal_ext import _env
from tfmetal_ext.backends import cpu, cuda, metal, metal_plugin

# support key (FusionContext.support_key) -> table.
TABLES = types.MappingProxyType(
    {t.key: t for t in (cpu.ONEDNN, cpu.EIGEN, cuda.CUDA, metal.METAL, metal_plugin.METAL_PLUGIN)}
)

# devices.backend() value -> precision(caps) -> (policy, reason).
PRECISION = types.MappingProxyType({"cpu": cpu.precision, "cuda": cuda.precision, "metal": metal.precision})


def table(key):
    """The `Backend` table for a support key (``"cpu_onednn"``, ``"cpu"``, ``"cuda"``, ``"metal"``, ``"metal_plugin"``).

    Raises:
        ValueError: for an unknown key.
    """
    try:
        return TABLES[key]
    except KeyError:
        raise ValueError(f"Unknown backend table; valid keys: {', '.join(TABLES)}. Received: key={key!r}") from None


def precision(caps):
    """``(policy, reason)``: the dtype policy the backend of `caps` computes fastest in."""
    return PRECISION[caps.backend](caps)


def support_key(backend, onednn, metal_plugin=None):
    """The table key for a `devices.backend()` value.

    The CPU has one table with oneDNN and one without; Metal has one per
    plugin (``"metal"``: Apple's tensorflow-metal, also when `metal_plugin`
    is unknown; ``"metal_plugin"``: the open tensorflow-metal-plugin).
    """
    if backend == "cpu":
        return "cpu_onednn" if onednn else "cpu"
    if backend == "metal" and metal_plugin == "tensorflow-metal-plugin":
        return "metal_plugin"
    return backend


def current(caps=None):
    """The table of the backend this process runs on (the environment's capabilities unless given)."""
    if caps is None:
        caps = _env.current().capabilities
    return table(support_key(caps.backend, caps.onednn, getattr(caps, "metal_plugin", None)))
