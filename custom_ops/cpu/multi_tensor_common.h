// What the CPU kernels of the multi-tensor optimizer ops (TfmetalExt>MultiTensorAdam,
// TfmetalExt>MultiTensorLion) share: variable lookup, duplicate detection,
// locking, validation, copy-on-write, and the one index space over all
// variables that is sharded over TF's thread pool.
//
// Variable access follows TF's own training kernels
// (tensorflow/core/kernels/training_op_helpers.h): exclusive locks on every
// variable, taken in address order, and copy-on-write of a buffer that is
// shared with a pending read before it is updated in place. Both are written
// out (tfmetal/resource_variables.h, shared with the Metal kernels) instead of
// calling MaybeLockVariableInputMutexesInOrder (its duplicate check is
// quadratic in the number of inputs) and PrepareToUpdateVariable (its Eigen
// copy needs EIGEN_USE_THREADS defined before the first Eigen include, which
// the unity build cannot promise).
//
// One index space: the elements of all variables are split over TF's
// intra-op thread pool with a per-element cost, so 100 small variables cost
// one dispatch and run on one or two threads as their total size warrants.
// (TF's per-variable CPU training kernels pass the whole tensor's cost as the
// per-element cost and so shard even a 64x64 variable over all threads.)
//
// An op's resource inputs come first, in groups of N (var[0..N), m[0..N), ...),
// followed by the N gradients; its optional loss scale is its last input.
//
// Loss scaling (num_scale = 1, tfmetal/loss_scale.h): after the variables are
// acquired and checked, one pass over every gradient element (AnyNonFinite),
// then the `found_non_finite` output, and the update pass only when it is
// false, with each gradient divided by the scale (the kernels' kScaled
// instantiations). Nothing is written before the first pass has finished.
#ifndef TFMETAL_CPU_MULTI_TENSOR_COMMON_H_
#define TFMETAL_CPU_MULTI_TENSOR_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/loss_scale.h"
#include "tfmetal/portable.h"
#include "tfmetal/resource_variables.h"

namespace tfmetal_ext {
namespace multi_tensor {

using ::tensorflow::Var;

// R::round of the shared math headers (tfmetal/adam.h, tfmetal/lion.h) for
// each T: float -> T -> float (identity for float).
template <typename T>
struct Round {
  static inline float round(float x) { return static_cast<float>(static_cast<T>(x)); }
};
template <>
struct Round<float> {
  static inline float round(float x) { return x; }
};

// Variable access (locks, copy-on-write, lookup and checks) is shared with the
// Metal kernels: tfmetal/resource_variables.h. The CPU copies with memcpy.
using variables::Layout;
using variables::JoinNames;

class LockedVariables : public variables::LockedVariables {
 public:
  Status Acquire(OpKernelContext* ctx, const Layout& layout, ::tensorflow::DataType dtype) {
    return variables::LockedVariables::Acquire(ctx, layout, dtype, &variables::HostCopy);
  }
};

// Runs fn(i, lo, hi) on elements [lo, hi) of variable i, for every element of
// every variable exactly once, sharded over TF's thread pool as one index
// space of offsets.back() elements at `cost_per_element` cycles each.
template <typename Fn>
void ForEachElementRange(OpKernelContext* ctx, const std::vector<int64_t>& offsets, int64_t cost_per_element,
                         Fn&& fn) {
  const int n = static_cast<int>(offsets.size()) - 1;
  auto shard = [&](int64_t begin, int64_t end) {
    // The variable holding element `begin`: the last one starting at or
    // before it (empty variables start where the next one does).
    int i = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
    for (int64_t pos = begin; pos < end && i < n; ++i) {
      const int64_t lo = pos - offsets[i];
      const int64_t hi = std::min(end, offsets[i + 1]) - offsets[i];
      if (hi > lo) fn(i, lo, hi);
      pos = std::max(pos, offsets[i + 1]);
    }
  };
  ParallelFor(ctx, offsets[n], cost_per_element, shard);
}

// Reads scalar input `index` (called `name`) of type T as a float.
template <typename T>
Status ScalarInput(OpKernelContext* ctx, int index, const char* name, float* out) {
  const Tensor& t = ctx->input(index);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return errors::InvalidArgument(name, " is not a scalar: ", t.shape().DebugString());
  }
  *out = ToFloat(t.scalar<T>()());
  return Status();
}

// The op's optional loss scale (its last input, num_scale = 0 or 1 float scalars).
struct LossScale {
  bool active = false;
  float scale = 1.0f;
};

inline Status ReadLossScale(OpKernelContext* ctx, int num_scale, LossScale* out) {
  *out = LossScale();
  if (num_scale == 0) return Status();
  const Tensor& t = ctx->input(ctx->num_inputs() - 1);
  if (!::tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return errors::InvalidArgument("scale is not a scalar: ", t.shape().DebugString());
  }
  out->active = true;
  out->scale = t.scalar<float>()();
  return Status();
}

// Whether any element of any gradient is NaN or infinite: one read-only pass
// over the index space of `offsets`, sharded like the update.
template <typename T>
bool AnyNonFinite(OpKernelContext* ctx, const std::vector<int64_t>& offsets, const std::vector<const T*>& grads) {
  std::atomic<bool> found(false);
  ForEachElementRange(ctx, offsets, /*cost_per_element=*/2, [&](int i, int64_t lo, int64_t hi) {
    if (found.load(std::memory_order_relaxed)) return;
    const T* g = grads[i];
    bool bad = false;
    for (int64_t j = lo; j < hi; ++j) bad |= !tfm_gradient_is_finite(ToFloat(g[j]));
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

// Output 0, found_non_finite (a bool scalar).
inline Status WriteFound(OpKernelContext* ctx, bool found) {
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({}), &out));
  out->scalar<bool>()() = found;
  return Status();
}

}  // namespace multi_tensor
}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_MULTI_TENSOR_COMMON_H_
