// Host names of the broadcasting gap kernels (templates in gap_broadcast.h).
#include "gap_broadcast.h"

TFM_INSTANTIATE_KERNEL(gap_div_no_nan_float, gap_div_no_nan<float>)
TFM_INSTANTIATE_KERNEL(gap_div_no_nan_half, gap_div_no_nan<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_div_no_nan_bfloat, gap_div_no_nan<bfloat>)
#endif
TFM_INSTANTIATE_KERNEL(gap_div_no_nan_contiguous_float, gap_div_no_nan_contiguous<float>)
TFM_INSTANTIATE_KERNEL(gap_div_no_nan_contiguous_half, gap_div_no_nan_contiguous<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_div_no_nan_contiguous_bfloat, gap_div_no_nan_contiguous<bfloat>)
#endif

// By element size: bool 1 byte, half and bfloat16 2, float 4.
TFM_INSTANTIATE_KERNEL(gap_broadcast_to_1, gap_broadcast_to<uchar>)
TFM_INSTANTIATE_KERNEL(gap_broadcast_to_2, gap_broadcast_to<ushort>)
TFM_INSTANTIATE_KERNEL(gap_broadcast_to_4, gap_broadcast_to<uint>)

#if defined(TFM_EMU)
// The host's plan and its choice of variant, exported for the emulator tests (ctypes): they dispatch
// with what the host computes. (TF's shape checks: tfmetal/gap_broadcast_checks.h, built on its own.)
extern "C" __attribute__((visibility("default"))) int tfm_gap_broadcast_plan(
    const int64_t* out, int out_rank, const int64_t* in0, int rank0, const int64_t* in1, int rank1,
    tfm_gap_bcast_params* p) {
  return GapBroadcastPlan(out, out_rank, in0, rank0, in1, rank1, p) ? 1 : 0;
}

extern "C" __attribute__((visibility("default"))) int tfm_gap_broadcast_contiguous(const tfm_gap_bcast_params* p) {
  return GapBroadcastContiguous(*p) ? 1 : 0;
}
#endif
