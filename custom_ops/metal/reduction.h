// reduction.h: the threadgroup reduction the row kernels share (layer_norm.h,
// rms_norm.h; the next row kernel too): a float sum over the threadgroup,
// SIMD-group sums first, then the SIMD-group partials in order. Metal (and
// the emulator) only.
#ifndef TFMETAL_METAL_REDUCTION_H_
#define TFMETAL_METAL_REDUCTION_H_

#include "tfmetal/portable.h"

#if TFM_METAL

// SIMD-groups are 32 wide on Apple GPUs (and in the emulator).
#define TFM_SIMD_WIDTH 32u
#define TFM_MAX_SIMDGROUPS 32u  // 1024 threads

// Sum of `value` over the threadgroup of `threads` threads, returned to every
// thread. Uses slots[0, number of SIMD-groups) of threadgroup memory; a later
// reduction must use other slots (then no barrier is needed after this one).
// The same order in every thread and every run: deterministic.
inline float tfm_threadgroup_sum(float value, threadgroup float* slots, uint threads, uint simd_lane,
                                 uint simd_id) {
  const float partial = simd_sum(value);
  if (simd_lane == 0) slots[simd_id] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint groups = (threads + TFM_SIMD_WIDTH - 1) / TFM_SIMD_WIDTH;
  float total = 0.0f;
  for (uint s = 0; s < groups; ++s) total += slots[s];
  return total;
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_REDUCTION_H_
