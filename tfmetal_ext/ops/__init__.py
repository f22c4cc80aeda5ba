"""Custom TF ops with CPU and Metal kernels, where no fused kernel exists.

- `softshrink(x, lambd=0.5)`: ``TfmetalExt>Softshrink`` (+ gradient op).
- `layer_norm(x, gamma=None, beta=None, epsilon=1e-3)`: ``TfmetalExt>LayerNorm``
  (+ ``TfmetalExt>LayerNormGrad``: dx, dgamma, dbeta in one op).
- `multi_tensor_adam(variables, ms, vs, grads, ...)`: ``TfmetalExt>MultiTensorAdam``,
  Adam (AMSGrad, decoupled decay) for N variables of one dtype in one op.

The op library is compiled on first use into a cache keyed by the TF version,
compiler flags and sources (see `status()`, ``tfmetal-ext build-ops``).
Without a compiler, or with ``TFMETAL_EXT_REFERENCE_OPS=1``, every op runs
its pure-TF reference instead (same results, more ops); so does each op that
``tfmetal_ext.configure(avoid_fusions=[...])`` names (``"softshrink"``,
``"layer_norm"``, ``"multi_tensor_adam"``).
"""

from __future__ import annotations

import dataclasses

from tfmetal_ext.ops import _common, _loader
from tfmetal_ext.ops._loader import BuildError
from tfmetal_ext.ops.layer_norm import layer_norm
from tfmetal_ext.ops.multi_tensor_adam import multi_tensor_adam
from tfmetal_ext.ops.softshrink import softshrink


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
    """

    loaded: bool
    reference_forced: bool
    library: str | None
    tf_version: str | None
    metal_kernels: bool
    error: str | None

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        if self.reference_forced:
            return "custom ops: pure-TF references (TFMETAL_EXT_REFERENCE_OPS=1)"
        if not self.loaded:
            return f"custom ops: not loaded ({self.error or 'not used yet'})"
        metal = "with Metal kernels" if self.metal_kernels else "CPU kernels only"
        return f"custom ops: {self.library} (TF {self.tf_version}, {metal})"


def status(load: bool = True) -> OpsStatus:
    """Loads the op library (building it if needed, unless ``load=False``) and describes it."""
    forced = _common.use_reference()
    if load and not forced:
        _loader.load()
    st = _loader.state()
    p = st.plan
    return OpsStatus(
        loaded=st.module is not None,
        reference_forced=forced,
        library=str(p.library) if (p and st.module is not None) else None,
        tf_version=p.tf_version if p else None,
        metal_kernels=bool(p and p.with_metal and st.module is not None),
        error=st.error,
    )


def build(force: bool = False):
    """Builds (or finds in the cache) the op library for this TF; returns its path."""
    return _loader.build(force=force).library


__all__ = ["BuildError", "OpsStatus", "build", "layer_norm", "multi_tensor_adam", "softshrink", "status"]
