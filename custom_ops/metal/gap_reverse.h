// Metal kernels of the ReverseV2 and ReverseSequence gap kernels (host code in
// gap_reverse_metal.mm; index mapping and checks in tfmetal/gap_reverse.h).
//
// One thread per output element over the whole output (dispatchThreads,
// chunks pass their first element's index); the input is bound at its start.
// By element size U: the values are copied, never converted.
#ifndef TFMETAL_METAL_GAP_REVERSE_KERNELS_H_
#define TFMETAL_METAL_GAP_REVERSE_KERNELS_H_

#include "tfmetal/gap_reverse.h"
#include "tfmetal/portable.h"

static_assert(sizeof(tfm_gap_reverse_params) == 64, "tfm_gap_reverse_params layout is shared with the host");
static_assert(sizeof(tfm_gap_reverse_sequence_params) == 48,
              "tfm_gap_reverse_sequence_params layout is shared with the host");

#if TFM_METAL

// y (bound at this dispatch's first output) = x mirrored along p's reversed dimensions.
template <typename U>
[[kernel]] void gap_reverse(device const U* x [[buffer(0)]],
                            device U* y [[buffer(1)]],
                            constant tfm_gap_reverse_params& p [[buffer(2)]],
                            TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  y[gid.x] = x[gap_reverse_source(p, index)];
}

// y (bound at this dispatch's first output) = x with each batch entry's first
// seq_lengths[b] sequence steps reversed; lengths are int32 or int64 (p.wide).
template <typename U>
[[kernel]] void gap_reverse_sequence(device const U* x [[buffer(0)]],
                                     device U* y [[buffer(1)]],
                                     device const int32_t* lengths [[buffer(2)]],
                                     constant tfm_gap_reverse_sequence_params& p [[buffer(3)]],
                                     TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  uint64_t batch = 0, seq = 0;
  gap_reverse_sequence_coords(p, index, batch, seq);
  // int64 lengths: the low word (the host checked 0 <= length <= dim_s < 2^32), little-endian.
  const uint64_t length = static_cast<uint64_t>(static_cast<uint32_t>(lengths[p.wide != 0 ? 2 * batch : batch]));
  const uint64_t stride_s = (static_cast<uint64_t>(p.stride_s_hi) << 32) | p.stride_s_lo;
  y[gid.x] = x[gap_reverse_sequence_source(index, seq, length, stride_s)];
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_REVERSE_KERNELS_H_
