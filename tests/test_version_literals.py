"""TensorFlow, Metal plugin, CPython and macOS versions live in one place: `tfmetal_ext.backends.pairings`.

The pairing verdicts, fix commands and the assumed Mac all follow those rows; a version typed again
elsewhere in the package drifts from them the first time a pin moves. This test reads every module of
`tfmetal_ext` with `ast` and fails on a version literal outside the pairing data:

* a string that is a version (``"2.19"``, ``"1.2.0"``, ``"1.2.*"``), or that carries a pip requirement
  on tensorflow / tensorflow-metal / tensorflow-metal-plugin with a version (``"tensorflow==2.21.0"``);
* a tuple of 2 or 3 ints that reads as a version: TensorFlow ``(2, 10..)``, CPython ``(3, 8..)``,
  macOS ``(11..30, 0)``.

Docstrings are documentation and are not read. Exempt, each for its reason (`EXEMPT`): the pairing
data module itself, the generated plugin kernel table, and the package's own version.
"""

import ast
import pathlib
import re

import pytest

import tfmetal_ext
from tests._source_scan import docstring_ids

PACKAGE = pathlib.Path(tfmetal_ext.__file__).parent

EXEMPT = {
    # The one home of the versions.
    "backends/pairings.py": "the pairing data",
    # Written by scripts/gen_metal_plugin_kernels.py from the sdist (it records which release and TF it read).
    "backends/_metal_plugin_kernels.py": "generated",
    # Written by scripts/gen_metal_kernels.py from Apple's wheel (the release, its TF and the macOS gate it read).
    "backends/_metal_kernels.py": "generated",
    # tfmetal-ext's own version (pyproject reads it), not a TensorFlow or plugin version.
    "_version.py": "the package's own version",
}

_VERSION = re.compile(r"^[0-3]\.\d+(?:\.\d+)?(?:\.\*)?(?:rc\d+)?$")
_REQUIREMENT = re.compile(r"tensorflow(?:-metal(?:-plugin)?)?\s*(?:==|>=|<=|~=|!=|<|>)\s*\d")


def _version_tuple(node):
    if not isinstance(node, ast.Tuple) or not 2 <= len(node.elts) <= 3:
        return None
    if not all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        return None
    v = tuple(e.value for e in node.elts)
    if (v[0] == 2 and v[1] >= 10) or (v[0] == 3 and v[1] >= 8) or (11 <= v[0] <= 30 and v[1] == 0 and len(v) == 2):
        return v
    return None


def version_literals(source):
    """``(line, literal)`` of every version literal in `source` (docstrings skipped)."""
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _VERSION.match(node.value) or _REQUIREMENT.search(node.value):
                hits.append((node.lineno, node.value))
        elif _version_tuple(node) is not None:
            hits.append((node.lineno, _version_tuple(node)))
    return sorted(hits, key=lambda h: (h[0], str(h[1])))


@pytest.mark.parametrize("snippet", [
    'x = "2.19"',
    'VERSION = "1.2.0"',
    'cmd = f\'pip install "tensorflow>=2.16,<2.20" "tensorflow-metal==1.2.*"\'',
    "ok = tf[:2] >= (2, 20)",
    "py_ok = py <= (3, 12)",
    "MIN = (15, 0)",
    'pin = "tensorflow-metal-plugin==0.4.1"',
])
def test_the_check_finds_a_version(snippet):
    assert version_literals(snippet), snippet


@pytest.mark.parametrize("snippet", [
    '"""Docs may name TF 2.19 and "1.2.0"."""',
    "strides = (1, 1)",
    "kernel = (3, 3)",
    "shape = (2, 4, 8)",
    'msg = "TensorFlow 2.21 has wheels"',
    'eps = "1e-5"',
])
def test_the_check_passes_what_is_not_a_version(snippet):
    assert not version_literals(snippet), snippet


def test_no_version_literal_outside_the_pairing_data():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in EXEMPT:
            continue
        found += [f"tfmetal_ext/{rel}:{line}: {lit!r}" for line, lit in version_literals(path.read_text())]
    assert not found, (
        "TF / plugin / Python / macOS version literals outside tfmetal_ext/backends/pairings.py "
        "(read them from there):\n" + "\n".join(found)
    )


def test_exemptions_exist():
    for rel in EXEMPT:
        assert (PACKAGE / rel).is_file(), rel
