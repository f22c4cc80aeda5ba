"""The environment: the one object the layers, ops and rules decide on.

An `Environment` carries what changes what this package emits or expects,
beyond a layer's own arguments:

* `assumed_plugin`: the Metal plugin `tfmetal_ext.devices.assume_backend` is
  assuming (None: this host as it is);
* `avoided`: the fusion patterns (`tfmetal_ext.backends.fusion.SAFE_FORMS`
  names) whose safe unfused form ``configure(avoid_fusions=...)`` switched on;
* `rnn_form`: a recurrent form forced on CPU (``"fused"`` / ``"stock"``; None:
  the backend table's rule decides);
* `portable`: emit stock TensorFlow ops only (every custom op's pure-TF
  reference), for a graph that leaves this package (`tfmetal_ext.export`,
  `tfmetal_ext.deploy.portable_forms`);
* `capabilities`: the host's `tfmetal_ext.devices.Capabilities` (or the
  assumed Mac's), probed once and cached until `invalidate_capabilities()`.

Two layers make up the one in force (`current()`):

* the process-wide environment, which `configure()` changes with
  `update()`: its avoided fusions apply to every thread, as its dtype policy
  does (TensorFlow traces a `tf.distribute` replica function in a thread of
  its own, which starts with an empty `contextvars` context);
* overrides held in a `contextvars.ContextVar`, set for a block with
  `scope()` by `assume_backend()`, a forced RNN form and tests: they apply to
  this context only (two threads may assume different backends) and are
  undone at the block's end; a `configure()` inside the block outlives it.

Nothing else in the package keeps this state, so what a layer emits at trace
time depends on the environment and its own arguments only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the layers, ops and rules read: see the module docstring.

    Attributes:
        assumed_plugin: the Metal plugin being assumed, or None.
        avoided: frozenset of avoided fusion pattern names.
        rnn_form: ``"fused"`` or ``"stock"`` to force a CPU recurrent form, or None.
        portable: True while tracing a graph for export: no custom op is emitted.
        pinned_capabilities: a `Capabilities` to report instead of probing
            (tests that describe another host); None: probe (cached).
    """

    assumed_plugin: str | None = None
    avoided: frozenset = frozenset()
    rnn_form: str | None = None
    portable: bool = False
    pinned_capabilities: object = None
    # assumed plugin (None: this host) -> Capabilities; shared by every environment derived from this one.
    _cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def capabilities(self):
        """The `tfmetal_ext.devices.Capabilities` this environment describes (probed once, then cached)."""
        if self.pinned_capabilities is not None:
            return self.pinned_capabilities
        caps = self._cache.get(self.assumed_plugin)
        if caps is None:
            from tfmetal_ext import devices  # the probes (devices imports this module at the top)

            caps = self._cache[self.assumed_plugin] = devices.probe_capabilities(self.assumed_plugin)
        return caps

    @property
    def backend(self):
        """``"metal"``, ``"cuda"`` or ``"cpu"``: `capabilities`' backend."""
        if self.assumed_plugin is not None and self.pinned_capabilities is None:
            return "metal"
        return self.capabilities.backend


class _Process:
    """The process-wide environment (what `configure()` sets); read only through `current()`."""

    __slots__ = ("env",)

    def __init__(self):
        self.env = Environment()


_PROCESS = _Process()
# This context's overrides: ((field, value), ...), set by `scope()`.
_OVERRIDES = contextvars.ContextVar("tfmetal_ext_environment_overrides", default=())


def current() -> Environment:
    """The environment in force in this context: the process-wide one with this context's overrides."""
    overrides = _OVERRIDES.get()
    env = _PROCESS.env
    return dataclasses.replace(env, **dict(overrides)) if overrides else env


def update(**changes) -> Environment:
    """Changes fields of the process-wide environment (``configure()``); returns the one now in force here."""
    _PROCESS.env = dataclasses.replace(_PROCESS.env, **changes)
    return current()


@contextlib.contextmanager
def scope(**changes):
    """Within the block, in this context only, the environment has `changes`; then they are undone.

    Only the fields named are overridden, so a `configure()` inside the
    block (the process-wide avoided set) outlives it.
    """
    token = _OVERRIDES.set(tuple({**dict(_OVERRIDES.get()), **changes}.items()))
    try:
        yield current()
    finally:
        _OVERRIDES.reset(token)


def invalidate_capabilities():
    """Forgets the cached capabilities: the next read probes the host again.

    For whatever legitimately changes what the probes see: `configure()`
    (a script's first call decides on the host as it is then), tests that
    replace a probe. `assume_backend` re-describes its Mac on entry.
    """
    current()._cache.clear()
