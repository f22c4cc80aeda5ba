"""Child process of test_fuzz_crash.py: runs the named cases given on the command line.

Prints ``CASE <name>`` (flushed) before each case and ``DONE <name> <outcome>``
after it, so a parent that sees the child die by a signal knows which case
killed it. Python exceptions are clean outcomes here; only the process dying
is a crash. The raw kernels are called directly, past the Python wrappers'
checks, with inputs the wrappers would reject.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmetal_ext import ops  # noqa: E402
from tfmetal_ext.ops import _loader  # noqa: E402


def lib():
    library = _loader.load()
    if library is None:
        raise RuntimeError("no op library")
    return library


def _adam_raw(shapes_var, shapes_grad, dup=False):
    ws = [tf.Variable(tf.ones(s)) for s in shapes_var]
    ms = [tf.Variable(tf.zeros(s)) for s in shapes_var]
    vs = [tf.Variable(tf.zeros(s)) for s in shapes_var]
    if dup:
        ms = [ws[0]] + ms[1:]
    grads = [tf.ones(s) for s in shapes_grad]
    c = tf.constant(0.1)
    lib().tfmetal_ext_multi_tensor_adam(
        [w.handle for w in ws], [m.handle for m in ms], [v.handle for v in vs], [], grads, c, c, c, c, c, c, [], []
    )


CASES = {
    "softshrink_raw_empty": lambda: lib().tfmetal_ext_softshrink(tf.zeros([0, 3]), lambd=0.5),
    "softshrink_raw_negative_lambd": lambda: lib().tfmetal_ext_softshrink(tf.ones([3]), lambd=-1.0),
    "softshrink_raw_nan_lambd": lambda: lib().tfmetal_ext_softshrink(tf.ones([3]), lambd=float("nan")),
    "softshrink_grad_raw_shape_mismatch": lambda: lib().tfmetal_ext_softshrink_grad(tf.ones([5]), tf.ones([2]), lambd=0.5),
    "softshrink_big": lambda: ops.softshrink(tf.ones([1 << 20]), 0.5),
    "layer_norm_raw_short_gamma": lambda: lib().tfmetal_ext_layer_norm(tf.ones([4, 8]), tf.ones([3]), tf.ones([8]), epsilon=1e-3),
    "layer_norm_raw_short_beta": lambda: lib().tfmetal_ext_layer_norm(tf.ones([4, 8]), tf.ones([8]), tf.ones([1]), epsilon=1e-3),
    "layer_norm_raw_rank0": lambda: lib().tfmetal_ext_layer_norm(tf.constant(1.0), tf.ones([1]), tf.ones([1]), epsilon=1e-3),
    "layer_norm_raw_zero_epsilon_constant_row": lambda: lib().tfmetal_ext_layer_norm(tf.ones([2, 4]), tf.ones([4]), tf.ones([4]), epsilon=0.0),
    "layer_norm_raw_empty_last": lambda: lib().tfmetal_ext_layer_norm(tf.ones([3, 0]), tf.ones([0]), tf.ones([0]), epsilon=1e-3),
    "layer_norm_grad_raw_bad_stats": lambda: lib().tfmetal_ext_layer_norm_grad(
        tf.ones([4, 8]), tf.ones([4, 8]), tf.ones([8]), tf.ones([1]), tf.ones([2])
    ),
    "layer_norm_grad_raw_bad_dy": lambda: lib().tfmetal_ext_layer_norm_grad(
        tf.ones([2, 8]), tf.ones([4, 8]), tf.ones([8]), tf.ones([4]), tf.ones([4])
    ),
    "layer_norm_nan_rows": lambda: ops.layer_norm(tf.constant([[np.nan, 1.0], [np.inf, 2.0]]), epsilon=1e-3),
    "adam_raw_grad_shape_mismatch": lambda: _adam_raw([(3,), (4, 2)], [(3,), (2, 4)]),
    "adam_raw_grad_too_small": lambda: _adam_raw([(1000,)], [(1,)]),
    "adam_raw_duplicate_slot": lambda: _adam_raw([(3,), (3,)], [(3,), (3,)], dup=True),
    "adam_raw_empty_lists": lambda: _adam_raw([], []),
    "adam_raw_list_lengths": lambda: lib().tfmetal_ext_multi_tensor_adam(
        [tf.Variable(tf.ones(2)).handle], [], [], [], [tf.ones(2)], *([tf.constant(0.1)] * 6), [], []
    ),
    # The harness' own check: this case must be reported as a crash.
    "selftest_sigsegv": lambda: os.kill(os.getpid(), 11),
}


def main(names):
    for name in names:
        print(f"CASE {name}", flush=True)
        try:
            CASES[name]()
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - any Python-level error is a clean outcome here
            outcome = "error:" + type(e).__name__
        print(f"DONE {name} {outcome}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
