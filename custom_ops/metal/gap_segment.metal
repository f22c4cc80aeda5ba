// Host names of the UnsortedSegmentSum gap kernel (template in gap_segment.h).
#include "gap_segment.h"

TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_float, gap_unsorted_segment_sum<float>)
TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_half, gap_unsorted_segment_sum<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_unsorted_segment_sum_bfloat, gap_unsorted_segment_sum<bfloat>)
#endif

#if defined(TFM_EMU)
#include <cstring>

// The host's checks and segmentation, exported for the emulator tests (ctypes): they dispatch with the row
// order the host builds and compare its error text with TensorFlow's.
extern "C" __attribute__((visibility("default"))) int64_t tfm_gap_segment_order_i64(
    const int64_t* ids, int64_t n, int64_t data_elements, int64_t num_segments, uint32_t* offsets,
    uint32_t* order) {
  return GapSegmentOrder(ids, n, data_elements, num_segments, offsets, order);
}

extern "C" __attribute__((visibility("default"))) int64_t tfm_gap_segment_order_i32(
    const int32_t* ids, int64_t n, int64_t data_elements, int64_t num_segments, uint32_t* offsets,
    uint32_t* order) {
  return GapSegmentOrder(ids, n, data_elements, num_segments, offsets, order);
}

namespace {
int tfm_gap_segment_message(const std::string& error, char* message, int cap) {
  std::strncpy(message, error.c_str(), static_cast<size_t>(cap));
  message[cap - 1] = '\0';
  return error.empty() ? 1 : 0;
}
}  // namespace

// 1 and *num_segments if the shapes and num_segments (an int32 or int64 `num_value`) pass TF's checks, else 0
// and the message (cut at `cap`).
extern "C" __attribute__((visibility("default"))) int tfm_gap_segment_check(
    const int64_t* data, int data_rank, const int64_t* ids, int ids_rank, int ids_are_int64, const int64_t* num,
    int num_rank, const void* num_value, int num_is_int64, int64_t* num_segments, char* message, int cap) {
  return tfm_gap_segment_message(GapSegmentCheck(data, data_rank, ids, ids_rank, ids_are_int64 != 0, num, num_rank,
                                                 num_value, num_is_int64 != 0, num_segments),
                                 message, cap);
}

extern "C" __attribute__((visibility("default"))) void tfm_gap_segment_id_error(
    const int64_t* ids, int ids_rank, int64_t bad, int64_t value, int64_t num_segments, char* message, int cap) {
  tfm_gap_segment_message(GapSegmentIdError(ids, ids_rank, bad, value, num_segments), message, cap);
}
#endif
