"""The broadcast plan of the gap kernels' host code (GapBroadcastPlan in tfmetal/gap_broadcast.h), for emulator tests.

gap_broadcast.metal and gap_int.metal export it under TFM_EMU; `plan_function(lib, symbol, params)` calls it
through ctypes, so a test dispatches with exactly the params the host builds.
"""

import ctypes

import numpy as np

MAX_DIMS = 8
# tfm_gap_bcast_params
BCAST = np.dtype([("n", "<u4"), ("rank", "<u4"), ("start_lo", "<u4"), ("start_hi", "<u4"),
                  ("dims", "<u4", MAX_DIMS), ("strides0", "<u4", MAX_DIMS), ("strides1", "<u4", MAX_DIMS)])


def plan_function(lib, symbol, params_dtype=BCAST, field=None):
    """``plan(out, in0, in1=None)`` -> a params record of `params_dtype` (its `field` holds the plan), or None."""
    fn = getattr(ctypes.CDLL(str(lib.path)), symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int] * 3 + [ctypes.c_void_p]

    def plan(out, in0, in1=None):
        arrays = [np.ascontiguousarray(s, np.int64) for s in (out, in0, in1 if in1 is not None else ())]
        params = np.zeros((), params_dtype)
        target = params[field] if field else params
        ok = fn(arrays[0].ctypes.data, len(out), arrays[1].ctypes.data, len(in0),
                arrays[2].ctypes.data if in1 is not None else None, len(in1) if in1 is not None else 0,
                target.ctypes.data)
        return params if ok else None
    return plan
