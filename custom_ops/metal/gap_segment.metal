// Host names of the UnsortedSegmentSum gap kernel (template in gap_segment.h).
#include "gap_segment.h"

TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_float, gap_unsorted_segment_sum<float>)
TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_half, gap_unsorted_segment_sum<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_bfloat, gap_unsorted_segment_sum<bfloat>)
#endif

#if defined(TFM_EMU)
// The host's segmentation, exported for the emulator tests (ctypes).
extern "C" __attribute__((visibility("default"))) int64_t tfm_gap_segment_order_i64(
    const int64_t* ids, int64_t n, int64_t num_segments, uint32_t* offsets, uint32_t* order) {
  return GapSegmentOrder(ids, n, num_segments, offsets, order);
}
#endif
