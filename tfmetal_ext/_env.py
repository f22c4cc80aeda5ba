"""The environment: the one object the layers, ops and rules decide on.

An `Environment` carries what changes what this package emits or expects,
beyond a layer's own arguments:

* `assumed_plugin`: the Metal plugin `tfmetal_ext.devices.assume_backend` is
  assuming (None: this host as it is);
* `avoided`: the fusion patterns (`tfmetal_ext.backends.fusion.SAFE_FORMS`
  names) whose safe unfused form ``configure(avoid_fusions=...)`` switched on;
* `rnn_form`: a recurrent form forced on CPU (``"fused"`` / ``"stock"``; None:
  the backend table's rule decides);
* `capabilities`: the host's `tfmetal_ext.devices.Capabilities` (or the
  assumed Mac's), probed once and cached until `invalidate_capabilities()`.

It lives in a `contextvars.ContextVar`: `current()` reads it; `configure()`
changes it with `update()`; `assume_backend()`, forced forms and tests change
it for a block with `scope()`, which restores only the fields it set (a
`configure()` inside the block stays). Nothing else in the package keeps
this state, so what a layer emits at trace time depends on the environment
and its own arguments only.
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
        pinned_capabilities: a `Capabilities` to report instead of probing
            (tests that describe another host); None: probe (cached).
    """

    assumed_plugin: str | None = None
    avoided: frozenset = frozenset()
    rnn_form: str | None = None
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


_DEFAULT = Environment()
_CURRENT = contextvars.ContextVar("tfmetal_ext_environment")


def current() -> Environment:
    """The environment in force in this context."""
    return _CURRENT.get(_DEFAULT)


def update(**changes) -> Environment:
    """Replaces fields of the environment of this context (``configure()``); returns the new one."""
    env = dataclasses.replace(current(), **changes)
    _CURRENT.set(env)
    return env


@contextlib.contextmanager
def scope(**changes):
    """Within the block, the environment has `changes`; afterwards those fields are as before.

    Only the fields named are restored, so a `configure()` inside the block
    (another field) outlives it, as it would outside.
    """
    env = current()
    before = {name: getattr(env, name) for name in changes}
    update(**changes)
    try:
        yield current()
    finally:
        update(**before)


def invalidate_capabilities():
    """Forgets the cached capabilities: the next read probes the host again.

    For whatever legitimately changes what the probes see (tests that replace
    a probe, `assume_backend`'s capabilities are cached per plugin).
    """
    current()._cache.clear()
