"""Mixed-precision policy, XLA choice and safe unfused forms for the current backend.

`configure()` is the one call a training script makes first: it picks the
global Keras dtype policy that the backend's fused kernels run fastest in,
decides whether XLA may be used, and says why. `recommend()` makes the same
decision without applying it. ``configure(avoid_fusions=[...])`` switches the
layers and ops named in `SAFE_FORMS` to an unfused form, for a device whose
fused kernel computes wrong values (``tfmetal-ext doctor --selftest`` finds
those).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import types
import warnings

from tfmetal_ext import _env, backends, devices
from tfmetal_ext.backends import fusion as _fusion

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

# Fusion patterns -> what our layers and ops emit instead while the pattern is
# avoided (a read-only view of tfmetal_ext.backends.fusion.SAFE_FORMS).
SAFE_FORMS = types.MappingProxyType({name: form.description for name, form in _fusion.SAFE_FORMS.items()})


@dataclasses.dataclass(frozen=True)
class Config:
    """What `configure()` decided.

    Attributes:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        policy: the global Keras dtype policy name now in force.
        jit_compile: the value to pass to ``model.compile(jit_compile=...)``.
        reasons: human-readable reasons for each decision, one per avoided
            fusion included.
        avoided_fusions: sorted names from `SAFE_FORMS` whose safe unfused
            form the layers emit.
    """

    backend: str
    policy: str
    jit_compile: bool
    reasons: tuple
    avoided_fusions: tuple = ()

    def compile_kwargs(self, **compile_kwargs):
        """Keyword arguments for ``model.compile`` that follow this config.

        Pass your own ``compile`` arguments through it rather than beside it, so
        an explicit ``jit_compile`` of yours is merged instead of given twice
        (``model.compile(jit_compile=True, **cfg.compile_kwargs())`` is a
        ``TypeError`` in Python itself: "got multiple values for keyword
        argument"):

        >>> model.compile(**cfg.compile_kwargs(optimizer="adam", loss="mse", jit_compile=True))

        Your ``jit_compile`` wins, except ``True`` on Metal, where XLA cannot
        run ("Could not find compiler for platform METAL"): that becomes
        ``False`` with a warning, as in `configure()`.

        Returns:
            A new dict: `compile_kwargs` with ``jit_compile`` set.
        """
        merged = dict(compile_kwargs)
        given = merged.get("jit_compile", _AUTO)
        if isinstance(given, str) and given == _AUTO:
            merged["jit_compile"] = self.jit_compile
        elif self.backend == "metal" and given:
            warnings.warn(
                f"compile_kwargs(jit_compile={given!r}): XLA does not run on Metal (\"Could not find "
                "compiler for platform METAL\"); using jit_compile=False.",
                stacklevel=2,
            )
            merged["jit_compile"] = False
        return merged

    def __str__(self):
        head = f"backend={self.backend} policy={self.policy} jit_compile={self.jit_compile}"
        if self.avoided_fusions:
            head += f" avoided_fusions={list(self.avoided_fusions)}"
        lines = [head]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _metal_plugin_name(caps):
    """The Metal plugin distribution `caps` describes (Apple's when unknown)."""
    return getattr(caps, "metal_plugin", None) or "tensorflow-metal"


def metal_bfloat16_gap(caps):
    """Why bfloat16 is the wrong policy on the Metal backend of `caps`, from its backend table.

    The open tensorflow-metal-plugin registers no bfloat16 compute kernel at
    all (its table is complete; only `Cast` takes bfloat16), so every
    bfloat16 op runs on the CPU; Apple's tensorflow-metal has no bfloat16
    `_FusedConv2D` / `_FusedMatMul`, so bfloat16 convs and matmuls do not fuse.
    """
    table = backends.current(caps)
    name = _metal_plugin_name(caps)
    if table.kernels_complete and table.kernels:
        with_bf16 = sorted(op for op, dtypes in table.kernels.items() if "bfloat16" in dtypes)
        if not [op for op in with_bf16 if op != "Cast"]:
            only = f" (only {', '.join(with_bf16)})" if with_bf16 else ""
            return f"{name} has no bfloat16 compute kernels{only}: bfloat16 ops run on the CPU"
    lacking = [op for op in (_fusion.FUSED_CONV2D, _fusion.FUSED_MATMUL) if table.has_kernel(op, "bfloat16") is False]
    if lacking:
        return f"{name} has no bfloat16 {' / '.join(lacking)} kernel: bfloat16 convs and matmuls do not fuse"
    row = table.fusion("conv2d_bias_act")
    if row.fuses and "bfloat16" not in row.dtypes:
        return f"{name} fuses conv + bias + activation in float32/half only"
    return None


def _choose_policy(policy, caps, warn=True):
    """Returns (policy name, reasons); `warn` also issues the warnings."""
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
                if warn:
                    warnings.warn(msg, stacklevel=4)
        if caps.backend == "metal" and "bfloat16" in policy:
            gap = metal_bfloat16_gap(caps) or f"{_metal_plugin_name(caps)} is not known to run bfloat16 fast"
            msg = f"bfloat16 on Metal: {gap}; mixed_float16 fuses"
            reasons.append(msg)
            if warn:
                warnings.warn(msg, stacklevel=4)
        return policy, reasons
    chosen, why = backends.precision(caps)
    if caps.backend == "metal":
        gap = metal_bfloat16_gap(caps)
        why = f"{_metal_plugin_name(caps)}: {why}" + (f"; not bfloat16: {gap}" if gap else "")
    reasons.append(why)
    return chosen, reasons


def _choose_jit(jit_compile, caps, warn=True):
    """Returns (bool, reasons); `warn` also issues the warnings."""
    if caps.backend == "metal":
        if jit_compile is True and warn:
            warnings.warn(
                "jit_compile=True was requested, but XLA does not run on Metal "
                "(\"Could not find compiler for platform METAL\"); using "
                "jit_compile=False.",
                stacklevel=4,
            )
        return False, [
            f"Metal: XLA is never used ({_metal_plugin_name(caps)} has no XLA compiler); "
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


def avoided_fusions():
    """The fusion patterns whose safe unfused form is in use (names from `SAFE_FORMS`).

    The environment's set (`tfmetal_ext._env`), which layers and op wrappers
    read when traced.

    >>> tfmetal_ext.precision.avoided_fusions()
    frozenset()
    """
    return _env.current().avoided


def _resolve_avoid(avoid_fusions):
    """`avoid_fusions` as a frozenset of `SAFE_FORMS` names (None: the current set)."""
    if avoid_fusions is None:
        return _env.current().avoided
    failed = getattr(avoid_fusions, "failed_patterns", None)
    if failed is not None and hasattr(avoid_fusions, "checks"):  # a doctor.SelfTestResult
        names = tuple(failed)
    elif isinstance(avoid_fusions, (str, bytes)) or not hasattr(avoid_fusions, "__iter__"):
        raise ValueError(
            "`avoid_fusions` must be None, a list of names from tfmetal_ext.precision.SAFE_FORMS "
            f"({', '.join(SAFE_FORMS)}), or a doctor.SelfTestResult. Received: avoid_fusions={avoid_fusions!r}"
        )
    else:
        names = tuple(avoid_fusions)
    unknown = [n for n in names if not isinstance(n, str) or n not in SAFE_FORMS]
    if unknown:
        raise ValueError(
            f"Unknown fusion name(s) {unknown!r} in `avoid_fusions`; valid names: {', '.join(SAFE_FORMS)}. "
            f"Received: avoid_fusions={avoid_fusions!r}"
        )
    return frozenset(names)


def _check_arguments(policy, jit_compile):
    if not isinstance(policy, str) or (policy != _AUTO and policy not in _VALID_POLICIES):
        raise ValueError(
            f"`policy` must be 'auto' or one of {', '.join(_VALID_POLICIES)}. "
            f"Received: policy={policy!r}"
        )
    if jit_compile not in (_AUTO, True, False):
        raise ValueError(
            f"`jit_compile` must be 'auto', True or False. Received: jit_compile={jit_compile!r}"
        )


def _decide(policy, jit_compile, avoid_fusions, warn):
    _check_arguments(policy, jit_compile)
    avoided = _resolve_avoid(avoid_fusions)
    caps = devices.capabilities()
    chosen, policy_reasons = _choose_policy(policy, caps, warn=warn)
    jit, jit_reasons = _choose_jit(jit_compile, caps, warn=warn)
    reasons = list(policy_reasons) + list(jit_reasons)
    if chosen == "mixed_float16":
        reasons.append(
            "loss scaling: Keras wraps the optimizer in LossScaleOptimizer under mixed_float16"
        )
    for name in sorted(avoided):
        reasons.append(f"avoid_fusions: {name} -> {SAFE_FORMS[name]}")
    return Config(
        backend=caps.backend, policy=chosen, jit_compile=jit, reasons=tuple(reasons),
        avoided_fusions=tuple(sorted(avoided)),
    )


def recommend(policy="auto", jit_compile="auto", avoid_fusions=None):
    """What `configure()` would decide, without changing anything.

    Same arguments, validation and result as `configure()`, but the global
    Keras policy, the avoided fusions and the last configuration stay as they
    are, and no warning is issued (the reasons say it all).

    Returns:
        A `Config`.

    Raises:
        ValueError: as `configure()`.

    >>> tfmetal_ext.precision.recommend().policy in ("float32", "mixed_bfloat16", "mixed_float16")
    True
    """
    return _decide(policy, jit_compile, avoid_fusions, warn=False)


def configure(policy="auto", jit_compile="auto", avoid_fusions=None):
    """Sets the global Keras dtype policy for the current backend.

    ``"auto"`` picks ``mixed_float16`` on Metal (Apple's tensorflow-metal and the
    open tensorflow-metal-plugin alike: neither runs bfloat16 well, see
    `metal_bfloat16_gap`; the reason names the plugin) and CUDA, ``mixed_bfloat16`` on
    CPUs with native bfloat16 and ``float32`` otherwise. Keras wraps the
    optimizer in a `keras.optimizers.LossScaleOptimizer` by itself under
    ``mixed_float16``, so loss scaling needs nothing more. On Metal, XLA is
    never used. Calling it again with the same arguments changes nothing.

    `avoid_fusions` is the explicit switch for a device whose fused kernel
    computes wrong values (``tfmetal-ext doctor --selftest`` checks each
    pattern): for every named pattern the layers and ops emit the safe
    unfused form described in `SAFE_FORMS` (e.g. ``matmul + b`` instead of
    ``bias_add`` for ``"matmul_bias_relu"``), the returned `Config` lists it
    in `avoided_fusions` and in its reasons, the fusion reports say
    "avoided by configure(avoid_fusions=[...])", and a warning is logged
    whenever the set changes. Layers read the set when they are traced, so
    call `configure()` before building and compiling the model (a model
    traced earlier keeps the graph it has until it is traced again).
    Outputs are the same either way, within float rounding.

    Args:
        policy: ``"auto"`` or a Keras dtype policy name (``"float32"``,
            ``"mixed_float16"``, ``"mixed_bfloat16"``, ...).
        jit_compile: ``"auto"``, True or False: the XLA decision to report in
            `Config.jit_compile` and `compile_kwargs()`.
        avoid_fusions: None keeps the current set (empty at start); a list
            of names from `SAFE_FORMS` (``"conv_bias_relu"``,
            ``"matmul_bias_relu"``, ``"fused_batch_norm"``,
            ``"softshrink"``, ``"layer_norm"``, ``"multi_tensor_adam"``)
            replaces it, ``()`` clears it; a `tfmetal_ext.doctor.SelfTestResult`
            sets it to the patterns that failed.

    Returns:
        A `Config` with the backend, the policy, the jit_compile decision,
        the avoided fusions and the reasons for each.

    Raises:
        ValueError: for an unknown policy, jit_compile value or fusion name.

    Example:

    >>> cfg = tfmetal_ext.configure()
    >>> model.compile(**cfg.compile_kwargs(optimizer="adam", loss="mse"))
    >>> result = tfmetal_ext.doctor.selftest()
    >>> tfmetal_ext.configure(avoid_fusions=result)  # the failed patterns, if any
    """
    global _last_config
    import keras

    devices.invalidate_capabilities()  # the one call a script makes first: decide on the host as it is now
    config = _decide(policy, jit_compile, avoid_fusions, warn=True)
    chosen = config.policy
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
    avoided, before = frozenset(config.avoided_fusions), _env.current().avoided
    if avoided != before:
        logger.warning(
            "tfmetal_ext: avoided fusions %s -> %s (for layers and ops traced from now on)%s",
            sorted(before), sorted(avoided),
            "".join(f"\n  {n}: {SAFE_FORMS[n]}" for n in sorted(avoided)),
        )
        _env.update(avoided=avoided)
    _last_config = config
    return _last_config


def compile_kwargs(**compile_kwargs):
    """What to pass to ``model.compile`` for the current backend, merged with yours.

    Follows the last `configure()` call; before any, `recommend()` (the
    backend's defaults). See `Config.compile_kwargs` for the merge.

    >>> model.compile(**tfmetal_ext.precision.compile_kwargs(optimizer="adam", loss="mse"))
    """
    config = _last_config if _last_config is not None else recommend()
    return config.compile_kwargs(**compile_kwargs)
