// Helpers shared by the CPU kernels: the TF names they use, the TF CPU thread
// pool, dtype conversion and kernel registration.
//
// The CPU kernel files are compiled as one unity translation unit (with the op
// registration files; see tfmetal_ext/ops/_loader.py), all in namespace
// tfmetal_ext: each file keeps its helpers in an unnamed namespace, so a name
// two files define alike is a compile error, not a silent clash.
#ifndef TFMETAL_CPU_COMMON_H_
#define TFMETAL_CPU_COMMON_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tfmetal/host_checks.h"

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tfmetal_ext {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

// Runs fn(begin, end) over [0, n) on TF's intra-op CPU thread pool, in
// blocks sized from `cost_per_unit` (cycles per element), so small inputs
// stay on the calling thread.
template <typename Fn>
void ParallelFor(OpKernelContext* ctx, int64_t n, int64_t cost_per_unit, Fn&& fn) {
  if (n <= 0) return;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  workers->ParallelFor(n, cost_per_unit, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
}

// ParallelFor with `scratch_floats` floats of scratch per thread:
// fn(begin, end, scratch), where no two threads share a scratch (nullptr when
// scratch_floats == 0). The scratch is one temp tensor, allocated before any
// work starts: an allocation failure is returned (for OP_REQUIRES_OK), it
// never aborts a worker thread.
template <typename Fn>
Status ParallelForWithScratch(OpKernelContext* ctx, int64_t n, int64_t cost_per_unit, int64_t scratch_floats,
                              Fn&& fn) {
  if (n <= 0) return Status();
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  Tensor scratch;
  float* base = nullptr;
  if (scratch_floats > 0) {
    // One slice per thread that may run a shard: the pool's NumThreads() and
    // the calling thread.
    TensorShape shape;
    TF_RETURN_IF_ERROR(TensorShape::BuildTensorShape({(workers->NumThreads() + 1) * scratch_floats}, &shape));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_FLOAT, shape, &scratch));
    base = scratch.flat<float>().data();
  }
  // The slice of the thread running the shard: CurrentThreadId() is in
  // [0, NumThreads()) on a pool thread and -1 elsewhere (as TF's
  // ParallelForWithWorkerId numbers them; its signature differs across TF versions).
  workers->ParallelFor(n, cost_per_unit, [&fn, workers, base, scratch_floats](int64_t begin, int64_t end) {
    fn(begin, end, base != nullptr ? base + (workers->CurrentThreadId() + 1) * scratch_floats : nullptr);
  });
  return Status();
}

// The vector code a CPU kernel may pick at run time, decided once for every
// kernel: kBaseline (portable loops: what arm64 runs, NEON-vectorized by the
// compiler), kAvx2 (AVX2 and FMA), kAvx512 (AVX-512F as well). Each kernel
// runs the highest level it has code for, at most this one.
// TFMETAL_EXT_CPU_BASELINE=1 forces kBaseline; TFMETAL_EXT_CPU_LEVEL=baseline,
// avx2 or avx512 caps the level, so the tests compare the levels' results on
// one machine.
enum class CpuLevel : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline CpuLevel CpuVectorLevel() {
  static const CpuLevel level = [] {
    CpuLevel have = CpuLevel::kBaseline;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      have = __builtin_cpu_supports("avx512f") ? CpuLevel::kAvx512 : CpuLevel::kAvx2;
    }
#endif
    const char* baseline = std::getenv("TFMETAL_EXT_CPU_BASELINE");
    if (baseline != nullptr && std::strcmp(baseline, "1") == 0) return CpuLevel::kBaseline;
    const char* cap = std::getenv("TFMETAL_EXT_CPU_LEVEL");
    CpuLevel most = CpuLevel::kAvx512;
    if (cap != nullptr && std::strcmp(cap, "baseline") == 0) most = CpuLevel::kBaseline;
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0) most = CpuLevel::kAvx2;
    return static_cast<int>(have) < static_cast<int>(most) ? have : most;
  }();
  return level;
}

// AVX2 and FMA code may run (the level is kAvx2 or higher).
inline bool CpuUseAvx2() { return static_cast<int>(CpuVectorLevel()) >= static_cast<int>(CpuLevel::kAvx2); }

// AVX-512F code may run.
inline bool CpuUseAvx512() { return CpuVectorLevel() == CpuLevel::kAvx512; }

template <typename T>
inline float ToFloat(T v) { return static_cast<float>(v); }

template <typename T>
inline T FromFloat(float v) { return static_cast<T>(v); }

// The ops that normalize over the last axis (layer_norm, rms_norm): x must
// have rank >= 1; rows = the product of all but the last dimension
// (tfmetal/host_checks.h, shared with the Metal host code).
inline Status RowsAndChannels(const TensorShape& shape, int64_t* rows, int64_t* channels) {
  const std::string error = NormRowsAndChannels(shape.dim_sizes().data(), shape.dims(), rows, channels);
  return error.empty() ? Status() : errors::InvalidArgument(error);
}

// `t` (called `name`) must be a vector of `n` elements (`what`: what n is).
inline Status CheckVector(const Tensor& t, const char* name, int64_t n, const char* what) {
  const std::string error = VectorShapeError(name, t.shape().dim_sizes().data(), t.dims(), n, what);
  return error.empty() ? Status() : errors::InvalidArgument(error);
}

// `a` and `b` (called `a_name`, `b_name`) have the same shape (tfmetal/host_checks.h, shared with the
// Metal host code's CheckSameShape).
inline Status CheckSameShape(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  const std::string error = SameShapeError(a_name, a.shape().dim_sizes().data(), a.dims(), b_name,
                                           b.shape().dim_sizes().data(), b.dims());
  return error.empty() ? Status() : errors::InvalidArgument(error);
}

// A stateless-random seed (TfmetalExt>Dropout's, TfmetalExt>Attention's): its
// two values, int64 or int32 widened with its sign (as TensorFlow reads them).
inline Status ReadSeed(const Tensor& seed, int64_t* s0, int64_t* s1) {
  const std::string error = SeedShapeError(seed.shape().dim_sizes().data(), seed.dims());
  if (!error.empty()) return errors::InvalidArgument(error);
  if (seed.dtype() == ::tensorflow::DT_INT64) {
    *s0 = seed.flat<int64_t>()(0);
    *s1 = seed.flat<int64_t>()(1);
  } else {
    *s0 = seed.flat<int32_t>()(0);
    *s1 = seed.flat<int32_t>()(1);
  }
  return Status();
}

// Mantissa bits of a uniform number in each dtype (StatelessRandomUniformV2's).
template <typename T>
constexpr uint32_t MantissaBits();
template <>
constexpr uint32_t MantissaBits<float>() { return 23; }
template <>
constexpr uint32_t MantissaBits<::Eigen::half>() { return 10; }
template <>
constexpr uint32_t MantissaBits<::Eigen::bfloat16>() { return 7; }

}  // namespace tfmetal_ext

// Registers the CPU kernel Kernel<T> for T in {float, half, bfloat16} (the
// "T" attr of every op here). `builder` is Name("TfmetalExt>Op") with the
// op's HostMemory(...) inputs, if any.
#define TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(builder, Kernel)   \
  TFMETAL_EXT_REGISTER_CPU_KERNEL_FOR_T(builder, Kernel, float)   \
  TFMETAL_EXT_REGISTER_CPU_KERNEL_FOR_T(builder, Kernel, ::Eigen::half) \
  TFMETAL_EXT_REGISTER_CPU_KERNEL_FOR_T(builder, Kernel, ::Eigen::bfloat16)
#define TFMETAL_EXT_REGISTER_CPU_KERNEL_FOR_T(builder, Kernel, T) \
  REGISTER_KERNEL_BUILDER(builder.Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), Kernel<T>);

#endif  // TFMETAL_CPU_COMMON_H_
