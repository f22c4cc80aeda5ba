"""README's "Which Metal backend" section agrees with the backend tables (`tfmetal_ext.backends`).

* The two kernel-gap lines are exactly `tfmetal_ext.backends.gaps.summary` of each table.
* In Apple's column, every op named in backticks is checked against its table: an op in a clause that
  begins with "no" must have no kernel there, any other op must have one.
* The figures the section gives for Apple's table (ops, registrations, the macOS 12 count, the
  bfloat16 count) are the generated table's.
"""

import pathlib
import re

import pytest

from tfmetal_ext.backends import TABLES, gaps
from tfmetal_ext.backends import _metal_kernels as generated

pytestmark = pytest.mark.no_keras

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
SECTION = README[README.index("## Which Metal backend"):]
SECTION = SECTION[: SECTION.index("\n## ", 3)]
_OP = re.compile(r"`(_?[A-Z][a-z][A-Za-z0-9]*)`")  # an op name (not `GPU`)


def _column(index):
    """Cells of one column of the section's table, by row header."""
    cells = {}
    for line in SECTION.splitlines():
        if line.startswith("| ") and not line.startswith("| |"):
            parts = [c.strip() for c in line.strip().strip("|").split(" | ")]
            cells[parts[0]] = parts[index]
    return cells


@pytest.mark.parametrize("label, key", [
    ("Apple's `tensorflow-metal` 1.2 (macOS 13 or later)", "metal"),
    ("the open `tensorflow-metal-plugin` 0.4.1", "metal_plugin"),
])
def test_gap_lines_are_the_tables(label, key):
    assert f"- {label}: {gaps.summary(TABLES[key])}.\n" in SECTION


def test_ops_named_in_apples_column_agree_with_its_table():
    apple = TABLES["metal"]
    checked = []
    for row, cell in _column(1).items():
        for clause in re.split(r"[;:]", cell):
            negated = clause.strip().startswith("no ")
            for op in _OP.findall(clause):
                has = apple.has_kernel(op)
                assert has is (not negated), f"README row {row!r}: {op} {'has' if has else 'has no'} kernel"
                checked.append(op)
    # The cells name, among others, the missing Einsum and the float32-only optimizer kernels.
    assert {"Einsum", "ResourceApplyAdam", "_FusedConv2D"} <= set(checked), checked


def test_apples_figures_are_the_generated_tables():
    kernels = _column(1)["kernels"]
    n_ops, n_regs, n_macos12 = (int(n) for n in re.findall(r"\b(\d{3})\b", kernels)[:3])
    rows = generated.REGISTRATIONS
    assert (n_ops, n_regs) == (len(generated.KERNELS), len(rows))
    assert n_macos12 == len({r[0] for r in rows if not r[4]})
    with_bf16 = int(re.search(r"(\d+) of its ops", _column(1)["does not"]).group(1))
    assert with_bf16 == sum("bfloat16" in d for d in generated.KERNELS.values())
    assert all(d == ("float32",) for op, d in generated.KERNELS.items() if op.startswith("ResourceApply"))


GAP_SECTION = README[README.index("## What runs on the CPU on your Mac, and what we do about it"):]
GAP_SECTION = GAP_SECTION[: GAP_SECTION.index("\n## ", 3)]


@pytest.mark.parametrize("label, key", [
    ("Apple's `tensorflow-metal` 1.2 (macOS 13 or later)", "metal"),
    ("the open `tensorflow-metal-plugin` 0.4.1", "metal_plugin"),
])
def test_gap_kernel_lines_are_the_plan(label, key):
    from tfmetal_ext.backends import gap_kernels

    assert f"- {label}: {gap_kernels.summary(TABLES[key])}.\n" in GAP_SECTION
