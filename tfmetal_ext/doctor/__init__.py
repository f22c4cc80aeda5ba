"""What this install runs on, and whether its fused kernels compute the right values.

`collect()` gathers versions, the TF / tensorflow-metal pairing verdict (with the
pip command that fixes a broken one), devices, oneDNN and native bf16/fp16, what
`configure()` would choose and why, the custom-op library status and the
avoided fusions. `selftest()` runs each fused pattern on the current device in a
graph-mode `tf.function` (so grappler fuses it) and compares it with an eager,
unfused reference on the same device; it catches e.g. the wrong
``_FusedMatMul[BiasAdd, Relu]`` reported on Metal. Every failure says how to fix
or avoid it, usually ``tfmetal_ext.configure(avoid_fusions=...)``:

>>> result = tfmetal_ext.doctor.selftest()
>>> print(result)
>>> tfmetal_ext.configure(avoid_fusions=result)   # the safe forms of what failed

Command line: ``tfmetal-ext doctor [--selftest] [--json]``.

Modules: `report` (`collect()`), `checks` (the one registry of self-test
checks: adding a check is one ``@checks.register(...)`` case), `runner`
(`selftest()`: running them).
"""

from tfmetal_ext.doctor import checks
from tfmetal_ext.doctor.checks import CHECKS, Check
from tfmetal_ext.doctor.report import DoctorInfo, collect
from tfmetal_ext.doctor.runner import FAIL, PASS, SKIP, CheckResult, SelfTestResult, selftest

__all__ = [
    "CHECKS",
    "FAIL",
    "PASS",
    "SKIP",
    "Check",
    "CheckResult",
    "DoctorInfo",
    "SelfTestResult",
    "checks",
    "collect",
    "selftest",
]
