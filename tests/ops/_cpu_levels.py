"""Running a script in a fresh process at a given CPU vector level (custom_ops/cpu/cpu_common.h).

The level is decided once per process from TFMETAL_EXT_CPU_BASELINE / TFMETAL_EXT_CPU_LEVEL, so the
tests that compare the levels' results run each one in its own interpreter.
"""

import os
import subprocess
import sys

LEVEL_VARIABLES = ("TFMETAL_EXT_REFERENCE_OPS", "TFMETAL_EXT_CPU_BASELINE", "TFMETAL_EXT_CPU_LEVEL")


def level_env(level):
    """This process's environment with the op library's kernels at `level`: ``"baseline"`` (the portable
    loops, what arm64 runs), ``"avx2"`` or ``"avx512"`` (a cap: a CPU without it runs its highest level)."""
    env = {k: v for k, v in os.environ.items() if k not in LEVEL_VARIABLES}
    env.update({"TFMETAL_EXT_CPU_BASELINE": "1"} if level == "baseline" else {"TFMETAL_EXT_CPU_LEVEL": level})
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def run_at_level(script, level, *args):
    """Runs `script` (Python source) with `args` in a fresh interpreter at `level`; its completed process,
    after asserting it exited 0 (with the end of its stderr as the message)."""
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=level_env(level))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
