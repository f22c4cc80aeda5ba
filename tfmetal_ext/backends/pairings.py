"""TensorFlow / Metal plugin pairings, as data: the one home of the versions the package decides on.

Every TensorFlow, Metal plugin, CPython and macOS version that a verdict, a
fix command or an assumed host depends on is a row or a constant here;
`tfmetal_ext.devices` (its pairing policy, `tfmetal_ext._pairing`),
`tfmetal_ext.backends.metal_plugin` and the doctor read them.
``tests/test_version_literals.py`` fails on a version literal typed
anywhere else in the package.

Sources: Apple's tensorflow-metal rows are user reports (Apple Developer
Forums' tensorflow-metal threads, tensorflow/tensorflow issues): 1.2.0
(2025-01-31) is its last release; with TF 2.20/2.21 it fails to load (missing
``_pywrap_tensorflow_internal.so`` / AttrValue symbol). Its wheels (PyPI's
file list): macosx_12_0_arm64 only; 1.2.0 up to cp312, 1.1.0 up to cp311; no
sdist. The open tensorflow-metal-plugin's row is its pin: the release this
package's tables were generated from and tested against, and the one
TensorFlow release it is built for (its ``TF_SUPPORTED_VERSION``; its load
check compares major.minor). It needs Python >= 3.10 (``python_requires``)
and macOS 15 (dyld refuses the library on older).
"""

from __future__ import annotations

import dataclasses

KNOWN_GOOD = "known-good"
KNOWN_BROKEN = "known-broken"
UNKNOWN = "unknown"
NOT_APPLICABLE = "not-applicable"  # no Metal plugin installed
BOTH_INSTALLED = "both-installed"  # tensorflow-metal and tensorflow-metal-plugin at once: an error

APPLE = "tensorflow-metal"
OPEN_PLUGIN = "tensorflow-metal-plugin"
# The two Metal PluggableDevice distributions (Apple's, then the open one).
METAL_PLUGINS = (APPLE, OPEN_PLUGIN)


@dataclasses.dataclass(frozen=True)
class Pairing:
    """One reported pairing.

    Attributes:
        plugin: the Metal plugin distribution.
        plugin_version: its release, or a prefix (``"1.2"``: every 1.2.x).
        tf_versions: TensorFlow ``"major.minor"`` versions, or a patch
            release (``"2.18.0"``) when only that release was reported.
        verdict: `KNOWN_GOOD` or `KNOWN_BROKEN`.
    """

    plugin: str
    plugin_version: str
    tf_versions: tuple
    verdict: str


APPLE_PAIRINGS = (
    Pairing(APPLE, "1.1", ("2.14", "2.15"), KNOWN_GOOD),
    Pairing(APPLE, "1.1", ("2.18.0",), KNOWN_BROKEN),
    Pairing(APPLE, "1.2", ("2.16", "2.17", "2.18", "2.19"), KNOWN_GOOD),
    Pairing(APPLE, "1.2", ("2.20", "2.21"), KNOWN_BROKEN),
)
# Apple's last release, and the series its route installs.
APPLE_LAST_RELEASE = "1.2.0"
APPLE_SERIES = "1.2"
# Apple's wheels: version prefix -> the newest CPython it has a wheel for.
APPLE_MAX_PYTHON = (("1.2", (3, 12)), ("1.1", (3, 11)))
APPLE_MIN_MACOS = (12, 0)

# The open plugin's pin (see the module docstring). When it moves, rerun
# `python scripts/gen_metal_plugin_kernels.py` and update metal_plugin.SDIST_SHA256.
PLUGIN_PIN = "0.4.1"
PLUGIN_TF_VERSION = "2.21.0"
PLUGIN_PAIRINGS = (Pairing(OPEN_PLUGIN, PLUGIN_PIN, (PLUGIN_TF_VERSION,), KNOWN_GOOD),)
PLUGIN_MIN_MACOS = (15, 0)
PLUGIN_MIN_PYTHON = (3, 10)
# The newest CPython the plugin's TensorFlow has wheels for (TF 2.21: cp310-cp313; PyPI, 2026-12).
PLUGIN_TF_MAX_PYTHON = (3, 13)


def version_tuple(version):
    """``"2.19"`` -> ``(2, 19)`` (the numeric parts of a version written in this module)."""
    return tuple(int(p) for p in version.split("."))


def fmt(version):
    """``(2, 19)`` -> ``"2.19"``."""
    return ".".join(map(str, version))


def _minors(plugin_version, verdict):
    return sorted(
        version_tuple(v)[:2] for row in APPLE_PAIRINGS
        if row.plugin_version == plugin_version and row.verdict == verdict for v in row.tf_versions
    )


# Derived: the TensorFlow minors Apple's route pins (its series' known-good rows), the first minor
# its series fails to load into, and the newest CPython any of Apple's wheels supports.
APPLE_ROUTE_TF = (_minors(APPLE_SERIES, KNOWN_GOOD)[0], _minors(APPLE_SERIES, KNOWN_GOOD)[-1])
APPLE_BROKEN_FROM_TF = _minors(APPLE_SERIES, KNOWN_BROKEN)[0]
APPLE_NEWEST_PYTHON = max(py for _, py in APPLE_MAX_PYTHON)


def apple_route_range():
    """Apple's route as a pip specifier: ``">=2.16,<2.20"``."""
    low, high = APPLE_ROUTE_TF
    return f">={fmt(low)},<{fmt((high[0], high[1] + 1))}"


def in_apple_route(tf):
    """TensorFlow version tuple `tf` is one Apple's route pins (its major.minor)."""
    return APPLE_ROUTE_TF[0] <= tuple(tf[:2]) <= APPLE_ROUTE_TF[1]


def plugin_pins():
    """``{plugin release: the TensorFlow release it is built for}`` of the open plugin."""
    return {row.plugin_version: row.tf_versions[0] for row in PLUGIN_PAIRINGS}


# Both distributions install this one file (so two installed overwrite each other).
PLUGIN_LIBRARY = "tensorflow-plugins/libmetal_plugin.dylib"
