// Reduction self-test kernels of the Metal emulator: one threadgroup per row.
#ifndef TFM_TEST_REDUCE_H_
#define TFM_TEST_REDUCE_H_

#include "tfmetal/portable.h"

// Tree reduction in threadgroup memory passed as an argument; needs a
// power-of-two threadgroup.
template <typename T>
[[kernel]] void row_sum_tree(device const T* x [[buffer(0)]], device float* out [[buffer(1)]],
                             constant uint& cols [[buffer(2)]], threadgroup float* shm [[threadgroup(0)]],
                             TFM_KERNEL_BUILTINS) {
  const uint row = tgid.x;
  float acc = 0.0f;
  for (uint c = lid.x; c < cols; c += tgsize.x) acc += static_cast<float>(x[row * cols + c]);
  shm[lid.x] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = tgsize.x / 2; s > 0; s /= 2) {
    if (lid.x < s) shm[lid.x] += shm[lid.x + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid.x == 0) out[row] = shm[0];
}

// simd_sum within each SIMD-group, partial sums through a threadgroup array
// declared in the kernel, simd_sum again in SIMD-group 0.
template <typename T>
[[kernel]] void row_sum_simd(device const T* x [[buffer(0)]], device float* out [[buffer(1)]],
                             constant uint& cols [[buffer(2)]], TFM_KERNEL_BUILTINS) {
  threadgroup float partial[32];
  const uint row = tgid.x;
  float acc = 0.0f;
  for (uint c = lid.x; c < cols; c += tgsize.x) acc += static_cast<float>(x[row * cols + c]);
  acc = simd_sum(acc);
  if (simd_lane == 0) partial[simd_id] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_id == 0) {
    const uint nsimd = (tgsize.x + 31) / 32;
    float v = simd_lane < nsimd ? partial[simd_lane] : 0.0f;
    v = simd_sum(v);
    if (simd_lane == 0) out[row] = v;
  }
}

// Each thread writes its slot, waits, then reads its neighbour's: fails
// unless the threads of a threadgroup really run together.
[[kernel]] void neighbour_exchange(device float* out [[buffer(0)]], threadgroup float* shm [[threadgroup(0)]],
                                   TFM_KERNEL_BUILTINS) {
  shm[lid.x] = static_cast<float>(gid.x) * 2.0f + 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid.x] = shm[(lid.x + 1) % tgsize.x];
}

// Every SIMD-group function the kernels may use, 12 results per thread.
[[kernel]] void simd_functions(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                               constant uint& n [[buffer(2)]], TFM_KERNEL_BUILTINS) {
  if (gid.x >= n) return;  // returned lanes are inactive
  const float v = x[gid.x];
  device float* o = out + gid.x * 12;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_prefix_exclusive_sum(v);
  o[4] = simd_prefix_inclusive_sum(v);
  o[5] = simd_shuffle_down(v, 1);
  o[6] = simd_shuffle_up(v, 2);
  o[7] = simd_shuffle_xor(v, 1);
  o[8] = simd_broadcast(v, 3);
  o[9] = simd_broadcast_first(v);
  o[10] = simd_all(v > 0.0f) ? 1.0f : 0.0f;
  o[11] = static_cast<float>(static_cast<ulong>(simd_ballot(v > 0.5f)) & 0xffffffu);
}

#endif  // TFM_TEST_REDUCE_H_
