"""Custom TF ops with CPU and Metal kernels, where no fused kernel exists.

- `softshrink(x, lambd=0.5)`: ``TfmetalExt>Softshrink`` (+ gradient op).
- `layer_norm(x, gamma=None, beta=None, epsilon=1e-3)`: ``TfmetalExt>LayerNorm``
  (+ ``TfmetalExt>LayerNormGrad``: dx, dgamma, dbeta in one op).
- `rms_norm(x, gamma=None, epsilon=1e-6)`: ``TfmetalExt>RMSNorm``
  (+ ``TfmetalExt>RMSNormGrad``: dx and dgamma in one op).
- `multi_tensor_adam(variables, ms, vs, grads, ...)`: ``TfmetalExt>MultiTensorAdam``,
  Adam (AMSGrad, decoupled decay) for N variables of one dtype in one op.
- `multi_tensor_lion(variables, ms, grads, lr, beta_1, beta_2, ...)`:
  ``TfmetalExt>MultiTensorLion``, Keras' Lion (optional decoupled decay) for N
  variables of one dtype in one op.
- `multi_tensor_rmsprop(variables, velocities, grads, lr, rho, momentum, epsilon, ...)`:
  ``TfmetalExt>MultiTensorRMSprop``, Keras' RMSprop (momentum, centered,
  decoupled decay) for N variables of one dtype in one op.
- `attention(query, key, value, *, mask=None, causal=False, scale=None)`:
  ``TfmetalExt>Attention`` (+ ``TfmetalExt>AttentionGrad``), softmax attention
  flash-style: the score matrix is never stored, forward or backward.
- `int8_matmul(x, kernel, kernel_scale, bias=None, activation=None)` and
  `int8_conv2d(x, kernel, kernel_scale, bias=None, strides, padding, dilation_rate, activation)`:
  ``TfmetalExt>Int8MatMul`` / ``TfmetalExt>Int8Conv2D``, weight-only int8 contractions (float
  activations, an int8 kernel with Keras' per-output-channel scale, bias and activation in the same
  op); `quantize_int8(kernel, axis)` quantizes a float kernel the way Keras does.

The op library is compiled on first use into a cache keyed by the TF version,
compiler flags and sources (see `status()`, ``tfmetal-ext build-ops``).
Without a compiler, or with ``TFMETAL_EXT_REFERENCE_OPS=1``, every op runs
its pure-TF reference instead (same results, more ops); so does each op that
``tfmetal_ext.configure(avoid_fusions=[...])`` names (``"softshrink"``,
``"layer_norm"``, ``"rms_norm"``, ``"multi_tensor_adam"``, ``"multi_tensor_lion"``,
``"multi_tensor_rmsprop"``, ``"attention"``, ``"int8_matmul"``, ``"int8_conv2d"``).
"""

from __future__ import annotations

import dataclasses

from tfmetal_ext.ops import _common, _loader
from tfmetal_ext.ops._loader import BuildError, OpCacheError
from tfmetal_ext.ops.attention import attention
from tfmetal_ext.ops.int8 import int8_conv2d, int8_matmul, quantize_int8
from tfmetal_ext.ops.layer_norm import layer_norm
from tfmetal_ext.ops.multi_tensor_adam import multi_tensor_adam
from tfmetal_ext.ops.multi_tensor_lion import multi_tensor_lion
from tfmetal_ext.ops.multi_tensor_rmsprop import multi_tensor_rmsprop
from tfmetal_ext.ops.rms_norm import rms_norm
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
        metal_backend: the Metal backend the GPU kernels are bound to
            (``"tensorflow-metal"``, ``"tensorflow-metal-plugin"``), or None.
        kernels: per op (``"softshrink"``, ``"layer_norm"``,
            ``"multi_tensor_adam"``, ``"multi_tensor_lion"``, ``"multi_tensor_rmsprop"``, ``"rms_norm"``,
            ``"attention"``: the keys of
            `tfmetal_ext.backends.fusion.CUSTOM_OPS`), ``{"cpu": bool, "gpu":
            bool, "gpu_reason": str | None}``: whether the op's CPU kernel and
            its GPU (Metal) kernel are registered (for the op and its gradient
            op), and why there is no GPU kernel. Where the Metal host code
            cannot bind to the backend (an unknown stream type, the open
            plugin at a release whose layout was not checked, its buffer
            registry not exported), the reason says so; TF then places the op
            on the CPU.
    """

    loaded: bool
    reference_forced: bool
    library: str | None
    tf_version: str | None
    metal_kernels: bool
    error: str | None
    metal_backend: str | None = None
    kernels: dict = dataclasses.field(default_factory=dict)

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        if self.reference_forced:
            return "custom ops: pure-TF references (TFMETAL_EXT_REFERENCE_OPS=1)"
        if not self.loaded:
            return f"custom ops: not loaded ({self.error or 'not used yet'})"
        metal = "with Metal kernels" if self.metal_kernels else "CPU kernels only"
        if self.metal_backend:
            metal += f" for {self.metal_backend}"
        lines = [f"custom ops: {self.library} (TF {self.tf_version}, {metal})"]
        if self.metal_kernels:
            for name, k in sorted(self.kernels.items()):
                if not k.get("gpu"):
                    lines.append(f"  {name}: no GPU kernel ({k.get('gpu_reason') or 'unknown reason'})")
        return "\n".join(lines)


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
    )


def build(force: bool = False):
    """Builds (or finds in the cache) the op library for this TF; returns its path."""
    return _loader.build(force=force).library


__all__ = ["BuildError", "OpCacheError", "OpsStatus", "attention", "build", "int8_conv2d", "int8_matmul",
           "layer_norm", "multi_tensor_adam", "quantize_int8",
           "multi_tensor_lion", "multi_tensor_rmsprop", "rms_norm", "softshrink", "status"]
