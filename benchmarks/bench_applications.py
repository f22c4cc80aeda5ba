"""keras.applications (weights=None, 96x96x3, batch 4, 10 classes): stock vs `tfmetal_ext.convert()` + FusedAdam.

ResNet50V2, MobileNetV3Small, EfficientNetB0, Xception, ConvNeXtTiny and DenseNet121, measured by the
harness of bench_models.py (one process per model): convert() time, verified, variables shared with
the stock model, train-step ops (stock, FusedAdam only, layers only, both; target <= 0.7x), time to
first step and step-time ratio (target: none slower). The models are big for a 2-core CPU: use few
rounds.

    .venv/bin/python benchmarks/bench_applications.py [--quick] [--models Xception,DenseNet121] [--rounds 3]
    (the same as: .venv/bin/python benchmarks/bench_models.py --applications ...)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a in ("--rounds",) or a.startswith("--rounds=") for a in args) and "--quick" not in args:
        args += ["--rounds", "3", "--repeats", "3"]
    main(["--applications"] + args, script="bench_applications.py")
