// Metal kernels of the broadcasting gap kernels, DivNoNan and BroadcastTo
// (host code in gap_broadcast_metal.mm; math and index mapping in
// tfmetal/gap_broadcast.h).
//
// One thread per output element. The host dispatches chunks of the output:
// the output is bound at the chunk's first element, the inputs at their start,
// and the chunk's first global index is in the params, so each thread maps its
// global index to the inputs' elements. DivNoNan of two inputs of one shape
// (GapBroadcastContiguous) takes the contiguous variant instead: no mapping,
// all three bound at the chunk's first element.
#ifndef TFMETAL_METAL_GAP_BROADCAST_KERNELS_H_
#define TFMETAL_METAL_GAP_BROADCAST_KERNELS_H_

#include "tfmetal/gap_broadcast.h"
#include "tfmetal/portable.h"

static_assert(sizeof(tfm_gap_bcast_params) == 16 + 3 * 4 * TFM_GAP_BCAST_MAX_DIMS,
              "tfm_gap_bcast_params layout is shared with the host");

#if TFM_METAL

// z = div_no_nan(x, y), broadcast.
template <typename T>
[[kernel]] void gap_div_no_nan(device const T* x [[buffer(0)]],
                               device const T* y [[buffer(1)]],
                               device T* z [[buffer(2)]],
                               constant tfm_gap_bcast_params& p [[buffer(3)]],
                               TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  uint64_t ox, oy;
  gap_bcast_offsets(p, index, ox, oy);
  z[gid.x] = static_cast<T>(gap_div_no_nan(static_cast<float>(x[ox]), static_cast<float>(y[oy])));
}

// z = div_no_nan(x, y), x and y of z's shape (bound at the chunk; p.n used only).
template <typename T>
[[kernel]] void gap_div_no_nan_contiguous(device const T* x [[buffer(0)]],
                                          device const T* y [[buffer(1)]],
                                          device T* z [[buffer(2)]],
                                          constant tfm_gap_bcast_params& p [[buffer(3)]],
                                          TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  z[gid.x] = static_cast<T>(gap_div_no_nan(static_cast<float>(x[gid.x]), static_cast<float>(y[gid.x])));
}

// out = input broadcast to out's shape: a copy of U-sized elements (any dtype of that size).
template <typename U>
[[kernel]] void gap_broadcast_to(device const U* input [[buffer(0)]],
                                 device U* out [[buffer(1)]],
                                 constant tfm_gap_bcast_params& p [[buffer(2)]],
                                 TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  uint64_t oi, unused;
  gap_bcast_offsets(p, index, oi, unused);
  out[gid.x] = input[oi];
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_BROADCAST_KERNELS_H_
