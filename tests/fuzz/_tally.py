"""Module-level tallies of the fuzz suite, written to JSON at session end (see conftest.py).

Every fuzzed call goes through `expect_ok` or `expect_error`:

- ``tried``: calls made;
- ``clean_errors``: bad input rejected with the documented error type;
- ``crashes``: a child python died by a signal (tests/fuzz/test_fuzz_crash.py);
- ``silent_wrong``: a result off the numpy/Keras reference, or bad input accepted, or
  rejected with an undocumented error type;
- ``data_lost``: a rejected update that still changed a variable.
"""

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, Phase, settings

TALLY = {"tried": 0, "ok": 0, "clean_errors": 0, "crashes": 0, "silent_wrong": 0, "data_lost": 0}


def expect_ok(call, verify):
    """Runs `call()`, then `verify(result)` (asserts); a failed check counts as silent wrong."""
    TALLY["tried"] += 1
    result = call()
    try:
        verify(result)
    except AssertionError:
        TALLY["silent_wrong"] += 1
        raise
    TALLY["ok"] += 1
    return result


def expect_error(call, errors, snapshot=None):
    """`call()` must raise one of `errors`; `snapshot()` (optional) must return the same arrays after."""
    TALLY["tried"] += 1
    before = snapshot() if snapshot is not None else None
    try:
        call()
    except errors:
        TALLY["clean_errors"] += 1
    except Exception as e:  # noqa: BLE001 - an undocumented error type is a finding
        TALLY["silent_wrong"] += 1
        raise AssertionError(f"expected {errors}, got {type(e).__name__}: {e}") from e
    else:
        TALLY["silent_wrong"] += 1
        raise AssertionError(f"expected {errors}, the call returned normally")
    if snapshot is not None:
        after = snapshot()
        lost = [i for i, (a, b) in enumerate(zip(before, after)) if a.tobytes() != b.tobytes()]
        if lost:
            TALLY["data_lost"] += 1
            raise AssertionError(f"the rejected call changed variables {lost}")


def ulp_tolerance(ref, dtype):
    """One unit in the last place of `dtype` at |ref| (ref in float64), at least its smallest subnormal."""
    info = np.finfo(dtype)
    mantissa = int(info.nmant)
    tiny = float(info.smallest_subnormal)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.maximum(np.abs(ref) * 2.0**-mantissa, tiny)


FLOAT_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
MODES = ["eager", "function"]


def fuzz_settings(max_examples):
    """The suite's hypothesis settings: bounded, reproducible in CI (derandomized),
    no deadline (the first call of a case traces a tf.function). The `impl`
    fixture only sets an env var that is the same for every example. No shrinking:
    each shrink step retraces tf.functions, and a failure once shrank for over 10
    minutes; the first failing example is reported as drawn."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
