// Host names of the int64 and bool gap kernels (gap_int.h): not templates, one kernel each.
#include "gap_int.h"

TFM_REGISTER_KERNEL(gap_int64_binary)
TFM_REGISTER_KERNEL(gap_int64_compare)
TFM_REGISTER_KERNEL(gap_bool_fill)
TFM_REGISTER_KERNEL(gap_bool_reduce)

#if defined(TFM_EMU)
// The host's plan, exported for the emulator tests (ctypes).
extern "C" __attribute__((visibility("default"))) int tfm_gap_int_plan(
    const int64_t* out, int out_rank, const int64_t* in0, int rank0, const int64_t* in1, int rank1,
    tfm_gap_bcast_params* p) {
  return GapBroadcastPlan(out, out_rank, in0, rank0, in1, rank1, p) ? 1 : 0;
}
#endif
