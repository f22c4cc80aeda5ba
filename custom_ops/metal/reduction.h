// reduction.h: the threadgroup reductions the row kernels share (layer_norm.h,
// rms_norm.h, sparse_xent.h; the next row kernel too): a float sum and a float
// max over the threadgroup, SIMD-group results first, then the SIMD-group
// partials in order. Metal (and the emulator) only.
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

// Max of `value` over the threadgroup, returned to every thread, with the same
// slots rule as tfm_threadgroup_sum. `value` must not be NaN (a row kernel's
// per-thread fold that started at -inf and skipped NaN), so simd_max needs no
// NaN rule; the SIMD-group maxima are folded in order, the larger one winning.
inline float tfm_threadgroup_max(float value, threadgroup float* slots, uint threads, uint simd_lane,
                                 uint simd_id) {
  const float partial = simd_max(value);
  if (simd_lane == 0) slots[simd_id] = partial;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint groups = (threads + TFM_SIMD_WIDTH - 1) / TFM_SIMD_WIDTH;
  float total = -INFINITY;
  for (uint s = 0; s < groups; ++s) total = tfm_select(slots[s] > total, slots[s], total);
  return total;
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_REDUCTION_H_
