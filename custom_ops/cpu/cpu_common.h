// Helpers shared by the CPU kernels: the TF CPU thread pool and dtype conversion.
#ifndef TFMETAL_CPU_COMMON_H_
#define TFMETAL_CPU_COMMON_H_

#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tfmetal_ext {

// Runs fn(begin, end) over [0, n) on TF's intra-op CPU thread pool, in
// blocks sized from `cost_per_unit` (cycles per element), so small inputs
// stay on the calling thread.
template <typename Fn>
void ParallelFor(::tensorflow::OpKernelContext* ctx, int64_t n, int64_t cost_per_unit, Fn&& fn) {
  if (n <= 0) return;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  workers->ParallelFor(n, cost_per_unit, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
}

template <typename T>
inline float ToFloat(T v) { return static_cast<float>(v); }

template <typename T>
inline T FromFloat(float v) { return static_cast<T>(v); }

}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_COMMON_H_
