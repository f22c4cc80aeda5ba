// Metal kernel of the UnsortedSegmentSum gap kernel (host code in
// gap_segment_metal.mm; the segmentation, made on the host, in
// tfmetal/gap_segment.h).
//
// One thread per (segment, column): it adds its segment's rows in order, in T
// (each add rounded, as TF's CPU kernel does), and writes 0 for an empty
// segment. Chunks of the output bind it at the chunk's first element and pass
// that element's index.
#ifndef TFMETAL_METAL_GAP_SEGMENT_KERNELS_H_
#define TFMETAL_METAL_GAP_SEGMENT_KERNELS_H_

#include "tfmetal/gap_segment.h"
#include "tfmetal/portable.h"

struct tfm_gap_segment_params {
  uint32_t n;         // outputs in this dispatch
  uint32_t start_lo;  // index of this dispatch's first output (64-bit)
  uint32_t start_hi;
  uint32_t inner;     // columns: elements per row of data and of the output
};
static_assert(sizeof(tfm_gap_segment_params) == 16, "tfm_gap_segment_params layout is shared with the host");

#if TFM_METAL

template <typename T>
[[kernel]] void gap_unsorted_segment_sum(device const T* data [[buffer(0)]],
                                         device const uint* order [[buffer(1)]],
                                         device const uint* offsets [[buffer(2)]],
                                         device T* out [[buffer(3)]],
                                         constant tfm_gap_segment_params& p [[buffer(4)]],
                                         TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  const uint64_t segment = index / p.inner, column = index - segment * p.inner;
  T acc = static_cast<T>(0.0f);
  for (uint k = offsets[segment]; k < offsets[segment + 1]; ++k) {
    acc = static_cast<T>(static_cast<float>(acc) + static_cast<float>(data[static_cast<uint64_t>(order[k]) * p.inner + column]));
  }
  out[gid.x] = acc;
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_SEGMENT_KERNELS_H_
