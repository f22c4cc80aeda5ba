"""Mixed-precision policy and XLA choice for the current backend.

`configure()` is the one call a training script makes first: it picks the
global Keras dtype policy that the backend's fused kernels run fastest in,
decides whether XLA may be used, and says why.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings

from tfmetal_ext import devices

logger = logging.getLogger("tfmetal_ext")

_AUTO = "auto"
_VALID_POLICIES = (
    "float32",
    "float64",
    "mixed_float16",
    "mixed_bfloat16",
    "float16",
    "bfloat16",
)

# The decision of the last configure() call; compile_kwargs() reads it.
_last_config = None


@dataclasses.dataclass(frozen=True)
class Config:
    """What `configure()` decided.

    Attributes:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        policy: the global Keras dtype policy name now in force.
        jit_compile: the value to pass to ``model.compile(jit_compile=...)``.
        reasons: human-readable reasons for each decision.
    """

    backend: str
    policy: str
    jit_compile: bool
    reasons: tuple

    def compile_kwargs(self):
        """Keyword arguments for ``model.compile`` that follow this config."""
        return {"jit_compile": self.jit_compile}

    def __str__(self):
        lines = [
            f"backend={self.backend} policy={self.policy} jit_compile={self.jit_compile}"
        ]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _choose_policy(policy, caps):
    """Returns (policy name, reasons)."""
    reasons = []
    if policy != _AUTO:
        reasons.append(f"policy {policy!r} set explicitly")
        if caps.backend == "cpu" and "float16" in policy and "bfloat16" not in policy:
            if not caps.cpu_fp16:
                msg = (
                    "float16 on this CPU: the remapper skips half nodes (no "
                    "AVX512_FP16/AMX_FP16/AVX_NE_CONVERT), so nothing fuses; "
                    "mixed_bfloat16 or float32 would"
                )
                reasons.append(msg)
                warnings.warn(msg, stacklevel=3)
        if caps.backend == "metal" and "bfloat16" in policy:
            reasons.append(
                "bfloat16 on Metal: tensorflow-metal's _FusedConv2D has no bf16 "
                "kernel; mixed_float16 fuses"
            )
        return policy, reasons
    if caps.backend == "metal":
        reasons.append("Metal GPU: mixed_float16 (half kernels, fused conv/matmul in half)")
        return "mixed_float16", reasons
    if caps.backend == "cuda":
        reasons.append("CUDA GPU: mixed_float16 (tensor cores, cuDNN half kernels)")
        return "mixed_float16", reasons
    if caps.cpu_bf16:
        reasons.append(
            "CPU with native bfloat16 (AVX512_BF16/AMX/FEAT_BF16): mixed_bfloat16 "
            "(fuses like float32 under oneDNN)"
        )
        return "mixed_bfloat16", reasons
    reasons.append("CPU without native bfloat16: float32")
    return "float32", reasons


def _choose_jit(jit_compile, caps):
    """Returns (bool, reasons)."""
    if caps.backend == "metal":
        if jit_compile is True:
            warnings.warn(
                "jit_compile=True was requested, but XLA does not run on Metal "
                "(\"Could not find compiler for platform METAL\"); using "
                "jit_compile=False.",
                stacklevel=3,
            )
        return False, [
            "Metal: XLA is never used (tensorflow-metal has no XLA compiler); "
            "jit_compile=False so grappler's remapper fuses instead"
        ]
    if jit_compile is not _AUTO:
        return bool(jit_compile), [f"jit_compile={jit_compile} set explicitly"]
    if caps.backend == "cuda":
        return True, ["CUDA: XLA fuses the step itself (Keras' own 'auto' choice)"]
    return False, [
        "CPU: no XLA, so grappler's remapper (and oneDNN) fusions apply"
    ]


def _layers_built_under_other_policy(policy_name):
    """Counts built Keras layers alive in this process whose policy differs."""
    import keras

    gc.collect()  # unreachable models from earlier experiments are not "existing layers"
    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, keras.layers.Layer) and getattr(obj, "built", False):
            try:
                name = obj.dtype_policy.name
            except AttributeError:
                continue
            if name != policy_name:
                count += 1
    return count


def configure(policy="auto", jit_compile="auto"):
    """Sets the global Keras dtype policy for the current backend.

    ``"auto"`` picks ``mixed_float16`` on Metal and CUDA, ``mixed_bfloat16`` on
    CPUs with native bfloat16 and ``float32`` otherwise. Keras wraps the
    optimizer in a `keras.optimizers.LossScaleOptimizer` by itself under
    ``mixed_float16``, so loss scaling needs nothing more. On Metal, XLA is
    never used. Calling it again with the same arguments changes nothing.

    Args:
        policy: ``"auto"`` or a Keras dtype policy name (``"float32"``,
            ``"mixed_float16"``, ``"mixed_bfloat16"``, ...).
        jit_compile: ``"auto"``, True or False: the XLA decision to report in
            `Config.jit_compile` and `compile_kwargs()`.

    Returns:
        A `Config` with the backend, the policy, the jit_compile decision and
        the reasons for each.

    Raises:
        ValueError: for an unknown policy or jit_compile value.

    Example:

    >>> cfg = tfmetal_ext.configure()
    >>> model.compile(optimizer="adam", loss="mse", **cfg.compile_kwargs())
    """
    global _last_config
    import keras

    if not isinstance(policy, str) or (policy != _AUTO and policy not in _VALID_POLICIES):
        raise ValueError(
            f"`policy` must be 'auto' or one of {', '.join(_VALID_POLICIES)}. "
            f"Received: policy={policy!r}"
        )
    if jit_compile not in (_AUTO, True, False):
        raise ValueError(
            f"`jit_compile` must be 'auto', True or False. Received: jit_compile={jit_compile!r}"
        )
    caps = devices.capabilities()
    chosen, policy_reasons = _choose_policy(policy, caps)
    jit, jit_reasons = _choose_jit(jit_compile, caps)

    current = keras.mixed_precision.global_policy().name
    if current != chosen:
        stale = _layers_built_under_other_policy(chosen)
        if stale:
            warnings.warn(
                f"configure() set the global dtype policy to {chosen!r}, but "
                f"{stale} layer(s) were already built and keep their old policy. "
                "Call configure() before building the model.",
                stacklevel=2,
            )
        keras.mixed_precision.set_global_policy(chosen)
        logger.info("global dtype policy: %s -> %s", current, chosen)
    reasons = list(policy_reasons) + list(jit_reasons)
    if chosen == "mixed_float16":
        reasons.append(
            "loss scaling: Keras wraps the optimizer in LossScaleOptimizer under mixed_float16"
        )
    _last_config = Config(
        backend=caps.backend, policy=chosen, jit_compile=jit, reasons=tuple(reasons)
    )
    return _last_config


def compile_kwargs():
    """What to pass to ``model.compile`` for the current backend.

    Follows the last `configure()` call; before any, the backend's defaults.

    >>> model.compile(optimizer="adam", loss="mse", **tfmetal_ext.precision.compile_kwargs())
    """
    if _last_config is not None:
        return _last_config.compile_kwargs()
    jit, _ = _choose_jit(_AUTO, devices.capabilities())
    return {"jit_compile": jit}
