// Kernels with bugs the emulator must report instead of hanging, plus reads
// of uninitialized threadgroup memory (NaN) and legal inactive-lane cases.
#include "tfmetal/portable.h"

[[kernel]] void divergent_barrier(device float* out [[buffer(0)]], TFM_KERNEL_BUILTINS) {
  if (lid.x < 5) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid.x] = 1.0f;
}

[[kernel]] void return_before_barrier(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                                      TFM_KERNEL_BUILTINS) {
  if (gid.x >= n) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid.x] = 1.0f;
}

[[kernel]] void different_barriers(device float* out [[buffer(0)]], TFM_KERNEL_BUILTINS) {
  if (lid.x % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
  out[gid.x] = 1.0f;
}

[[kernel]] void divergent_simd(device float* out [[buffer(0)]], TFM_KERNEL_BUILTINS) {
  float v;
  if (simd_lane < 16) {
    v = simd_sum(1.0f);
  } else {
    v = simd_max(1.0f);
  }
  out[gid.x] = v;
}

// Legal: lanes that returned do not take part (sum = number of active lanes).
[[kernel]] void simd_after_return(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                                  TFM_KERNEL_BUILTINS) {
  if (gid.x >= n) return;
  out[gid.x] = simd_sum(1.0f);
}

// Threadgroup 0 writes its threadgroup memory, the others only read theirs.
[[kernel]] void read_uninitialized(device float* out [[buffer(0)]], device half* out_half [[buffer(1)]],
                                   threadgroup float* shm [[threadgroup(0)]], TFM_KERNEL_BUILTINS) {
  threadgroup half local[64];
  if (tgid.x == 0) {
    shm[lid.x] = 1.0f;
    local[lid.x] = half(2.0h);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid.x] = shm[lid.x];
  out_half[gid.x] = local[lid.x];
}

[[kernel]] void too_much_threadgroup_memory(device float* out [[buffer(0)]], TFM_KERNEL_BUILTINS) {
  threadgroup float huge[9000];  // 36000 bytes > 32 KB
  huge[lid.x] = 1.0f;
  out[gid.x] = huge[lid.x];
}

// Thread 1 keeps counting while the others wait at the barrier.
[[kernel]] void slow_thread(device atomic_uint* counter [[buffer(0)]], constant uint& iterations [[buffer(1)]],
                            TFM_KERNEL_BUILTINS) {
  if (lid.x == 1) {
    for (uint i = 0; i < iterations; ++i) atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_device);
}

TFM_REGISTER_KERNEL(divergent_barrier)
TFM_REGISTER_KERNEL(return_before_barrier)
TFM_REGISTER_KERNEL(different_barriers)
TFM_REGISTER_KERNEL(divergent_simd)
TFM_REGISTER_KERNEL(simd_after_return)
TFM_REGISTER_KERNEL(read_uninitialized)
TFM_REGISTER_KERNEL(too_much_threadgroup_memory)
TFM_REGISTER_KERNEL(slow_thread)
