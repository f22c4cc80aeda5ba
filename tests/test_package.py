"""The package face: every `tfmetal_ext.<name>` README documents is reachable after `import tfmetal_ext`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _documented_paths():
    text = (REPO / "README.md").read_text()
    return sorted(set(re.findall(r"\btfmetal_ext(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text)))


@pytest.mark.no_keras
def test_readme_names_are_attributes_of_a_fresh_import():
    paths = _documented_paths()
    assert "tfmetal_ext.distribute.fit_compat" in paths  # the one a new user found missing
    # A fresh interpreter: in this one other tests have imported the submodules already.
    code = (
        "import sys, tfmetal_ext\n"
        "missing = []\n"
        "for path in sys.argv[1:]:\n"
        "    obj = tfmetal_ext\n"
        "    for part in path.split('.')[1:]:\n"
        "        if not hasattr(obj, part):\n"
        "            missing.append(path)\n"
        "            break\n"
        "        obj = getattr(obj, part)\n"
        "print('MISSING', missing)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MISSING []" in result.stdout, result.stdout
