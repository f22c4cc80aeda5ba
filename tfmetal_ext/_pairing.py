"""The TensorFlow / Metal plugin pairing policy: verdicts, reasons and the pip commands that fix one.

Reads the rows of `tfmetal_ext.backends.pairings` and probes nothing: the
installed versions come in as arguments (`tfmetal_ext.devices.capabilities`
passes the host's). Public through `tfmetal_ext.devices` (`check_pairing`,
`pairing_verdict`, `pairing_fixes`, `check_installed`, `PairingFix`,
`PairingCheck`).
"""

from __future__ import annotations

import dataclasses

from tfmetal_ext.backends import pairings as P
from tfmetal_ext.backends.pairings import (
    APPLE,
    BOTH_INSTALLED,
    KNOWN_BROKEN,
    KNOWN_GOOD,
    METAL_PLUGINS,
    NOT_APPLICABLE,
    OPEN_PLUGIN,
    PLUGIN_LIBRARY,
    UNKNOWN,
)

_fmt = P.fmt
_APPLE_TF_RANGE = P.apple_route_range()  # ">=2.16,<2.20"
_APPLE_PIN = f"{APPLE}=={P.APPLE_SERIES}.*"
_APPLE_TF_TEXT = f"{_fmt(P.APPLE_ROUTE_TF[0])}-{_fmt(P.APPLE_ROUTE_TF[1])}"
_APPLE_PY_MAX = P.APPLE_NEWEST_PYTHON
_PLUGIN_PY = f"{_fmt(P.PLUGIN_MIN_PYTHON)}-{_fmt(P.PLUGIN_TF_MAX_PYTHON)}"
_PLUGIN_TF_MINOR = _fmt(P.version_tuple(P.PLUGIN_TF_VERSION)[:2])
_PLUGIN_MACOS = P.PLUGIN_MIN_MACOS[0]
# The first CPython no wheel of Apple's supports.
_PAST_APPLE_PY = _fmt((_APPLE_PY_MAX[0], _APPLE_PY_MAX[1] + 1))

FIX_PAIRING_COMMAND = f'pip install "tensorflow{_APPLE_TF_RANGE}" "{_APPLE_PIN}"'
UNINSTALL_APPLE = f"pip uninstall -y {APPLE}"
UNINSTALL_PLUGIN = f"pip uninstall -y {OPEN_PLUGIN}"


def _plugin_commands():
    """(install TF for the plugin, install the plugin, rebuild the plugin) commands at the pin.

    The plugin is an sdist compiled at install against the TensorFlow installed then, so it is
    always a separate pip command after TensorFlow's. ``--no-cache-dir``: pip caches the wheel it
    built from an sdist and would reinstall that build, compiled against the previous TensorFlow.
    ``--no-deps`` on a rebuild keeps pip from touching TensorFlow itself.
    """
    return (
        f'pip install "tensorflow=={P.PLUGIN_TF_VERSION}"',
        f"pip install --no-cache-dir {OPEN_PLUGIN}=={P.PLUGIN_PIN}",
        f"pip install --force-reinstall --no-deps --no-cache-dir {OPEN_PLUGIN}=={P.PLUGIN_PIN}",
    )


@dataclasses.dataclass(frozen=True)
class PairingFix:
    """One way to fix a pairing: what it does and the commands, run one after the other.

    Attributes:
        summary: one sentence: what this route leaves installed.
        commands: shell commands, in order (each its own pip run); empty when the
            route is not a command (e.g. "update macOS").
    """

    summary: str
    commands: tuple = ()

    @property
    def command(self):
        """The commands as one line (``" && "``-joined), or the summary when there are none."""
        return " && ".join(self.commands) if self.commands else self.summary

    def __str__(self):
        return f"{self.summary}: {self.command}" if self.commands else self.summary


@dataclasses.dataclass(frozen=True)
class PairingCheck:
    """The verdict on an install of TensorFlow and a Metal plugin, why, and how to fix it.

    Attributes:
        verdict: `KNOWN_GOOD`, `KNOWN_BROKEN`, `UNKNOWN`, `NOT_APPLICABLE` or `BOTH_INSTALLED`.
        reason: why, in one sentence (None when there is nothing to say).
        fixes: the `PairingFix` routes, the one that keeps the installed TensorFlow (where one
            does) first; empty unless the verdict is known-broken or both-installed.
    """

    verdict: str
    reason: str | None = None
    fixes: tuple = ()




def _version_tuple(argument, value, parts=3):
    """`value` (``"3.12.8"``, ``"2.21.0rc1"``, ``(3, 12)``) as a tuple of ints; `argument` names it in errors."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
        return tuple(value)[:parts]
    if isinstance(value, str):
        nums = []
        for piece in value.split("+")[0].split(".")[:parts]:
            digits = ""
            for ch in piece:
                if not ch.isdigit():
                    break
                digits += ch
            if not digits:
                break
            nums.append(int(digits))
            if len(digits) < len(piece):  # "0rc1": the rest is a pre-release tag
                break
        if nums:
            return tuple(nums)
    raise ValueError(
        f"`{argument}` must be a version string such as \"3.12.1\" or a tuple of ints. Received: {argument}={value!r}"
    )


def _matches(version, prefix):
    return version == prefix or version.startswith(prefix + ".")


def _apple_verdict(tf, metal):
    """Verdict of Apple's rows (`pairings.APPLE_PAIRINGS`) for TF version tuple `tf` and tensorflow-metal `metal`."""
    tf_minor = ".".join(map(str, tf[:2]))
    tf_patch = ".".join(map(str, tf[:3]))
    for by in (tf_patch, tf_minor):  # patch-specific rows win over minor-wide rows
        for row in P.APPLE_PAIRINGS:
            if _matches(metal, row.plugin_version) and by in row.tf_versions:
                return row.verdict
    return UNKNOWN


def _apple_route(tf, *, uninstall_plugin=False, reinstall=False):
    """Apple's route: TF 2.16-2.19 with tensorflow-metal 1.2 (Python <= 3.12)."""
    first = (UNINSTALL_PLUGIN,) if uninstall_plugin else ()
    if reinstall:  # tensorflow-metal 1.2 is installed but its dylib was deleted or overwritten
        keep_tf = P.in_apple_route(tf)
        cmds = first + (() if keep_tf else (f'pip install "tensorflow{_APPLE_TF_RANGE}"',)) + (
            f'pip install --force-reinstall --no-deps "{_APPLE_PIN}"',
        )
    else:
        cmds = first + (FIX_PAIRING_COMMAND,)
    keeps = P.in_apple_route(tf)
    return PairingFix(
        f"use Apple's {APPLE} {P.APPLE_SERIES} with TensorFlow {_APPLE_TF_TEXT} (Python <= {_fmt(_APPLE_PY_MAX)})"
        + ("" if keeps else f"; this replaces TensorFlow {_fmt(tf)}"),
        cmds,
    )


def _plugin_route(tf, *, uninstall_apple=False, rebuild=False):
    """The open plugin's route: TF at its pin, then the plugin compiled against it (Python >= 3.10, macOS 15)."""
    install_tf, install, reinstall = _plugin_commands()
    pin_tf = _version_tuple("tf_version", P.PLUGIN_TF_VERSION)
    cmds = (UNINSTALL_APPLE,) if uninstall_apple else ()
    if tf != pin_tf:
        cmds += (install_tf,)
    cmds += (reinstall if rebuild else install,)
    keeps = tf == pin_tf
    return PairingFix(
        f"use the open {OPEN_PLUGIN} {P.PLUGIN_PIN} on TensorFlow {P.PLUGIN_TF_VERSION} (macOS {_PLUGIN_MACOS}+; "
        "a separate pip command after TensorFlow's: it compiles against the TensorFlow installed)"
        + ("" if keeps else f"; this replaces TensorFlow {_fmt(tf)}"),
        cmds,
    )


_NEW_PYTHON = PairingFix(
    f"create a Python {_PLUGIN_PY} environment: TensorFlow {_PLUGIN_TF_MINOR} has wheels for "
    f"cp{''.join(map(str, P.PLUGIN_MIN_PYTHON))}-cp{''.join(map(str, P.PLUGIN_TF_MAX_PYTHON))} "
    f"(Python {_fmt(P.PLUGIN_MIN_PYTHON)}-{_fmt(_APPLE_PY_MAX)} also for Apple's {APPLE} {P.APPLE_SERIES})"
)
_MACOS_UPDATE = PairingFix(f"update macOS to {_PLUGIN_MACOS} or later, then use the open {OPEN_PLUGIN}")


def _check_args(tf_version, metal_version, plugin, python_version, macos_version):
    if plugin not in METAL_PLUGINS:
        raise ValueError(f"`plugin` must be one of {', '.join(METAL_PLUGINS)}. Received: plugin={plugin!r}")
    if metal_version is not None and not isinstance(metal_version, str):
        raise ValueError(f"`metal_version` must be a version string or None. Received: metal_version={metal_version!r}")
    tf = _version_tuple("tf_version", tf_version) if isinstance(tf_version, str) else None
    if tf is None:
        raise ValueError(f"`tf_version` must be a version string such as \"2.21.0\". Received: tf_version={tf_version!r}")
    tf = (tf + (0, 0))[:3]
    py = None if python_version is None else _version_tuple("python_version", python_version, parts=2)
    mac = None if macos_version is None else _version_tuple("macos_version", macos_version, parts=2)
    return tf, py, mac


def check_pairing(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """The verdict on TensorFlow `tf_version` with Metal plugin `plugin` at `metal_version`, why, and the fixes.

    Apple's ``tensorflow-metal``: `pairings.APPLE_PAIRINGS` (user reports), and no wheel
    past cp312 (1.1: cp311) or before macOS 12, so a Python >= 3.13 is
    known-broken whatever the TensorFlow. The open
    ``tensorflow-metal-plugin``: known-good only on the TensorFlow release
    its pin was built for (`tfmetal_ext.backends.pairings.PLUGIN_TF_VERSION`),
    unknown on another patch of that minor (its load check compares
    major.minor), known-broken on any other TensorFlow (it offers no GPU
    device), on Python < 3.10 or on macOS < 15; another plugin release is
    unknown (our tables describe the pin).

    The fixes name the commands for this Python and TensorFlow: on TF 2.21
    with tensorflow-metal 1.2, uninstall it and install the open plugin (a
    second pip command, since it compiles against the installed TF), or,
    on Python <= 3.12, pin TF 2.16-2.19 with tensorflow-metal 1.2.

    Args:
        tf_version: TensorFlow version, e.g. ``"2.21.0"``.
        metal_version: the plugin's version, or None (not installed).
        plugin: ``"tensorflow-metal"`` or ``"tensorflow-metal-plugin"``.
        python_version: e.g. ``"3.12.8"`` or ``(3, 12)``; None: unknown (no
            Python-based verdict, and every route is offered).
        macos_version: e.g. ``"15.3"`` or ``(15, 3)``; None: unknown.

    Returns:
        A `PairingCheck`.

    Raises:
        ValueError: an unknown `plugin` or an unreadable version.
    """
    tf, py, mac = _check_args(tf_version, metal_version, plugin, python_version, macos_version)
    if metal_version is None:
        return PairingCheck(NOT_APPLICABLE, "no Metal plugin installed")
    apple_ok_python = py is None or py <= _APPLE_PY_MAX
    plugin_ok_python = py is None or P.PLUGIN_MIN_PYTHON <= py <= P.PLUGIN_TF_MAX_PYTHON
    plugin_ok_macos = mac is None or mac >= P.PLUGIN_MIN_MACOS
    min_mac = _fmt(P.PLUGIN_MIN_MACOS)

    if plugin == APPLE:
        max_py = next((v for prefix, v in P.APPLE_MAX_PYTHON if _matches(metal_version, prefix)), None)
        to_plugin = [_plugin_route(tf, uninstall_apple=True)] if plugin_ok_python else []
        if not plugin_ok_macos:
            to_plugin = [_MACOS_UPDATE] if plugin_ok_python else []
        if py is not None and max_py is not None and py > max_py:
            fixes = list(to_plugin)
            if py <= _APPLE_PY_MAX:  # 1.1 on 3.12: 1.2 has the wheel
                fixes.append(_apple_route(tf))
            if not fixes:
                fixes.append(_NEW_PYTHON)
            return PairingCheck(
                KNOWN_BROKEN,
                f"{APPLE} {metal_version} has no wheel for Python {_fmt(py)} (newest: cp{max_py[0]}{max_py[1]}); "
                f"on Python >= {_PAST_APPLE_PY} only the open {OPEN_PLUGIN} runs TensorFlow on a Mac's GPU",
                tuple(fixes),
            )
        if mac is not None and mac < P.APPLE_MIN_MACOS:
            return PairingCheck(
                KNOWN_BROKEN, f"{APPLE} has wheels for macOS {P.APPLE_MIN_MACOS[0]} and later only (this is {_fmt(mac)})",
                (PairingFix(f"update macOS to {P.APPLE_MIN_MACOS[0]} or later ({_PLUGIN_MACOS} or later for the open "
                            "plugin)"),))
        verdict = _apple_verdict(tf, metal_version)
        if verdict == KNOWN_GOOD:
            return PairingCheck(KNOWN_GOOD, f"TensorFlow {_fmt(tf[:2])} with {APPLE} {metal_version} is a reported working pairing")
        if verdict == UNKNOWN:
            return PairingCheck(UNKNOWN, f"no report on TensorFlow {_fmt(tf)} with {APPLE} {metal_version}")
        apple = [_apple_route(tf)] if apple_ok_python else []
        plugin_first = tf[:2] >= P.APPLE_BROKEN_FROM_TF and plugin_ok_macos  # it keeps this TensorFlow
        fixes = (to_plugin + apple) if plugin_first else (apple + to_plugin)
        why = (
            f"{APPLE} {metal_version} fails to load into TensorFlow {_fmt(tf)} (missing _pywrap_tensorflow_internal.so"
            f" / AttrValue symbol); its last release, {P.APPLE_LAST_RELEASE}, loads into TF <= "
            f"{_fmt(P.APPLE_ROUTE_TF[1])}"
            if tf[:2] >= P.APPLE_BROKEN_FROM_TF else f"TensorFlow {_fmt(tf)} with {APPLE} {metal_version} was reported broken"
        )
        return PairingCheck(KNOWN_BROKEN, why, tuple(fixes))

    # The open plugin.
    apple = [_apple_route(tf, uninstall_plugin=True)] if apple_ok_python else []
    if py is not None and py < P.PLUGIN_MIN_PYTHON:
        return PairingCheck(
            KNOWN_BROKEN, f"{OPEN_PLUGIN} needs Python >= {_fmt(P.PLUGIN_MIN_PYTHON)} (this is {_fmt(py)})",
            (PairingFix(f"use a Python {_PLUGIN_PY} environment for {OPEN_PLUGIN}"),) + tuple(apple),
        )
    if not plugin_ok_macos:
        return PairingCheck(
            KNOWN_BROKEN,
            f"{OPEN_PLUGIN} needs macOS {min_mac} or later (dyld refuses to load it on {_fmt(mac)})",
            tuple(apple) + (_MACOS_UPDATE,),
        )
    pins = P.plugin_pins()
    if metal_version not in pins:
        return PairingCheck(
            UNKNOWN,
            f"tfmetal-ext knows {OPEN_PLUGIN} {', '.join(pins)} (built for TensorFlow {', '.join(pins.values())}); "
            f"{metal_version} is untested here",
        )
    pin_tf = _version_tuple("tf_version", pins[metal_version])
    if tf == pin_tf:
        return PairingCheck(KNOWN_GOOD, f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]}")
    if tf[:2] == pin_tf[:2]:
        return PairingCheck(
            UNKNOWN,
            f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]}; it loads into "
            f"{_fmt(tf)} (it checks major.minor) but that release is untested here",
        )
    reroute = [_plugin_route(tf, rebuild=True)] if plugin_ok_python else []
    fixes = (apple + reroute) if P.in_apple_route(tf) else (reroute + apple)
    return PairingCheck(
        KNOWN_BROKEN,
        f"{OPEN_PLUGIN} {metal_version} is built for TensorFlow {pins[metal_version]} only and offers no GPU device "
        f"in TensorFlow {_fmt(tf)}",
        tuple(fixes),
    )


def pairing_verdict(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """Verdict on a TensorFlow / Metal plugin pairing (`check_pairing(...).verdict`).

    Args:
        tf_version: TensorFlow version string, e.g. ``"2.19.1"``.
        metal_version: the plugin's version string, or None.
        plugin: ``"tensorflow-metal"`` (Apple's) or ``"tensorflow-metal-plugin"``.
        python_version: the Python version (``"3.13.1"``), or None: unknown.
        macos_version: the macOS version (``"14.6"``), or None: unknown.

    Returns:
        ``"known-good"``, ``"known-broken"``, ``"unknown"`` or
        ``"not-applicable"`` when `metal_version` is None.

    Raises:
        ValueError: an unknown `plugin` or an unreadable version.
    """
    return check_pairing(tf_version, metal_version, plugin, python_version, macos_version).verdict


def pairing_fixes(tf_version, metal_version, plugin=APPLE, python_version=None, macos_version=None):
    """The `PairingFix` routes for this pairing (`check_pairing(...).fixes`); empty when nothing is broken."""
    return check_pairing(tf_version, metal_version, plugin, python_version, macos_version).fixes


def check_installed(plugins, tf_version, python_version=None, macos_version=None, library_owner=None):
    """`check_pairing` for the Metal plugins found installed (`{name: version}`, none, one or both).

    Both at once is `BOTH_INSTALLED`: both distributions install
    ``tensorflow-plugins/libmetal_plugin.dylib`` (the one installed last
    overwrote the other's, and uninstalling either deletes that file), and
    loading two libraries that register the METAL platform aborts the
    process. The fix uninstalls the one that cannot run this TensorFlow and
    Python (TF >= 2.20 or Python >= 3.13: Apple's; TF <= 2.19: the open
    plugin) and reinstalls the other.

    Args:
        plugins: ``{distribution: version}`` of the Metal plugins installed.
        tf_version, python_version, macos_version: as for `check_pairing`.
        library_owner: with both installed, whose ``libmetal_plugin.dylib``
            is on disk (the one TensorFlow loads), if known; it is named in
            the reason and returned as the plugin.

    Returns:
        ``(plugin, PairingCheck)``: the plugin installed, or with both, the
        one whose library is on disk when known, else the one the first fix
        keeps (None when none is installed).
    """
    plugins = {n: plugins[n] for n in METAL_PLUGINS if n in plugins}
    if len(plugins) < 2:
        name = next(iter(plugins), None)
        return name, check_pairing(tf_version, plugins.get(name), name or APPLE, python_version, macos_version)
    tf, py, mac = _check_args(tf_version, None, APPLE, python_version, macos_version)
    plugin_ok = (py is None or P.PLUGIN_MIN_PYTHON <= py <= P.PLUGIN_TF_MAX_PYTHON) and (
        mac is None or mac >= P.PLUGIN_MIN_MACOS)
    apple_ok = py is None or py <= _APPLE_PY_MAX
    keep_apple = apple_ok and (tf[:2] <= P.APPLE_ROUTE_TF[1] or not plugin_ok)
    fixes = []
    if plugin_ok:
        fixes.append(_plugin_route(tf, uninstall_apple=True, rebuild=True))
    if apple_ok:
        fixes.insert(0 if keep_apple else len(fixes), _apple_route(tf, uninstall_plugin=True, reinstall=True))
    both = ", ".join(f"{n} {v}" for n, v in plugins.items())
    on_disk = f" (the file on disk is {library_owner}'s)" if library_owner in plugins else ""
    return (library_owner if library_owner in plugins else (APPLE if keep_apple else OPEN_PLUGIN)), PairingCheck(
        BOTH_INSTALLED,
        f"both Metal plugins are installed ({both}): both install {PLUGIN_LIBRARY}, so one overwrote the "
        f"other{on_disk}, uninstalling either deletes it, and loading both aborts the process; keep one",
        tuple(fixes),
    )

