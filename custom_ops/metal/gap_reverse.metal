// Host names of the ReverseV2 / ReverseSequence gap kernels (templates in gap_reverse.h), by element size:
// half and bfloat16 2 bytes, float 4.
#include "gap_reverse.h"

TFM_INSTANTIATE_KERNEL(gap_reverse_2, gap_reverse<ushort>)
TFM_INSTANTIATE_KERNEL(gap_reverse_4, gap_reverse<uint>)
TFM_INSTANTIATE_KERNEL(gap_reverse_sequence_2, gap_reverse_sequence<ushort>)
TFM_INSTANTIATE_KERNEL(gap_reverse_sequence_4, gap_reverse_sequence<uint>)

#if defined(TFM_EMU)
#include <cstring>

// The host's checks and geometry, exported for the emulator tests (ctypes). Both return the TF_Code (0: OK)
// and write the message (NUL-terminated, cut at `cap`).
namespace {
int tfm_gap_reverse_message(int code, const std::string& error, char* message, int cap) {
  std::strncpy(message, error.c_str(), static_cast<size_t>(cap));
  message[cap - 1] = '\0';
  return code;
}
}  // namespace

// ReverseV2: fills *p (64 bytes) and *identity.
extern "C" __attribute__((visibility("default"))) int tfm_gap_reverse_plan(const int64_t* dims, int rank,
                                                                         int axis_rank, const int64_t* axes,
                                                                         int64_t n_axes, tfm_gap_reverse_params* p,
                                                                         int* identity, char* message, int cap) {
  bool same = false;
  std::string error;
  const int code = GapReversePlan(dims, rank, axis_rank, axes, n_axes, p, &same, &error);
  *identity = same ? 1 : 0;
  return tfm_gap_reverse_message(code, error, message, cap);
}

// ReverseSequence: the checks (code 3 with TF's message) and, when they pass, the geometry in *p.
extern "C" __attribute__((visibility("default"))) int tfm_gap_reverse_sequence_plan(
    const int64_t* dims, int rank, int64_t seq_dim, int64_t batch_dim, int len_rank, const int64_t* lengths,
    int64_t n_lengths, int wide, tfm_gap_reverse_sequence_params* p, char* message, int cap) {
  const std::string error = GapReverseSequenceCheck(dims, rank, seq_dim, batch_dim, len_rank, lengths, n_lengths);
  if (!error.empty()) return tfm_gap_reverse_message(TFM_GAP_REVERSE_INVALID_ARGUMENT, error, message, cap);
  GapReverseSequenceGeometry(dims, rank, seq_dim, batch_dim, wide != 0, p);
  return tfm_gap_reverse_message(0, "", message, cap);
}
// The index mappings themselves, for indices the emulator cannot dispatch (the 64-bit branches).
extern "C" __attribute__((visibility("default"))) uint64_t tfm_gap_reverse_source(const tfm_gap_reverse_params* p,
                                                                                 uint64_t index) {
  return gap_reverse_source(*p, index);
}

extern "C" __attribute__((visibility("default"))) uint64_t tfm_gap_reverse_sequence_source(
    const tfm_gap_reverse_sequence_params* p, uint64_t index, const int64_t* lengths) {
  uint64_t batch = 0, seq = 0;
  gap_reverse_sequence_coords(*p, index, batch, seq);
  const uint64_t stride_s = (static_cast<uint64_t>(p->stride_s_hi) << 32) | p->stride_s_lo;
  return gap_reverse_sequence_source(index, seq, static_cast<uint64_t>(lengths[batch]), stride_s);
}
#endif
