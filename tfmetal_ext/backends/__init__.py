"""What each backend has and fuses, as data: the one home of that knowledge.

* `fusion`: names and maps (activations, fused-op names, custom ops, the
  stock-to-fused layer map, safe forms).
* `patterns`: `PATTERNS`, every fusion pattern this package targets, with
  the op it becomes.
* `registry`: `TABLES` by support key, `PRECISION`, and `table`,
  `support_key`, `current` to pick one.
* `pairings`: the TensorFlow / Metal plugin pairings and every version the
  package decides on.
* `gaps`: the ops of an ordinary train step a backend has no kernel for
  (`gaps.summary(table)`, the one line README, the doctor and ``configure()``
  print).
* One table per backend: `cpu` (``ONEDNN`` and ``EIGEN``, the CPU without
  oneDNN), `cuda`, `metal` (Apple's tensorflow-metal: its kernels generated
  from its wheel by ``scripts/gen_metal_kernels.py``, complete) and `metal_plugin` (the open
  tensorflow-metal-plugin: its kernels generated from its sdist by
  ``scripts/gen_metal_plugin_kernels.py``, complete, with the ops it leaves
  to the host on this TensorFlow and the stock layers that fail there).
  Each declares, per pattern, the dtypes, activations, modes and conditions
  under which it fuses (a `Fusion`), the kernels it has where known
  (`Backend.has_kernel`), and its precision choice.

Everything else reads these: `inspect`'s catalog and rules, the layers,
`convert()`, `MetalCallback`, the doctor and `configure()`. Adding a pattern
is one `PATTERNS` entry plus one `Fusion` row per backend; adding a backend is
one module with a table and a `precision(caps)` function, registered in
`registry.TABLES` and `registry.PRECISION`. This package face only re-exports.
"""

from __future__ import annotations

from tfmetal_ext.backends import cpu, cuda, fusion, gaps, metal, metal_plugin, pairings
from tfmetal_ext.backends._table import PREDICT, TRAIN, Backend, Fusion, RnnStock
from tfmetal_ext.backends.fusion import (
    ACTIVATION_OPS,
    CUSTOM_OPS,
    FUSED_LAYER_OPS,
    OPTIMIZER_TO_FUSED,
    SAFE_FORMS,
    STOCK_TO_FUSED,
)
from tfmetal_ext.backends.patterns import PATTERNS, Pattern
from tfmetal_ext.backends.registry import PRECISION, TABLES, current, precision, support_key, table

__all__ = [
    "ACTIVATION_OPS",
    "CUSTOM_OPS",
    "FUSED_LAYER_OPS",
    "OPTIMIZER_TO_FUSED",
    "PATTERNS",
    "PRECISION",
    "PREDICT",
    "SAFE_FORMS",
    "STOCK_TO_FUSED",
    "TABLES",
    "TRAIN",
    "current",
    "support_key",
    "Backend",
    "Fusion",
    "Pattern",
    "RnnStock",
    "fusion",
    "gaps",
    "pairings",
    "precision",
    "table",
]
