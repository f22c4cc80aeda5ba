// What the CPU kernels of the multi-tensor optimizer ops (TfmetalExt>MultiTensorAdam,
// TfmetalExt>MultiTensorLion) share: variable lookup, duplicate detection,
// locking, validation, copy-on-write, and the one index space over all
// variables that is sharded over TF's thread pool.
//
// Variable access follows TF's own training kernels
// (tensorflow/core/kernels/training_op_helpers.h): exclusive locks on every
// variable, taken in address order, and copy-on-write of a buffer that is
// shared with a pending read before it is updated in place. Both are written
// out here instead of calling MaybeLockVariableInputMutexesInOrder (its
// duplicate check is quadratic in the number of inputs) and
// PrepareToUpdateVariable (its Eigen copy needs EIGEN_USE_THREADS defined
// before the first Eigen include, which the unity build cannot promise).
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

// Exclusive locks on a set of distinct variables, acquired in address order
// (the order every TF training kernel uses, so no deadlock with them) and
// released in reverse order.
class ExclusiveLocks {
 public:
  explicit ExclusiveLocks(std::vector<Var*> vars) : vars_(std::move(vars)) {
    std::sort(vars_.begin(), vars_.end(), [](Var* a, Var* b) { return a->mu() < b->mu(); });
    for (Var* var : vars_) var->mu()->lock();
  }
  ~ExclusiveLocks() {
    for (auto it = vars_.rbegin(); it != vars_.rend(); ++it) (*it)->mu()->unlock();
  }
  ExclusiveLocks(const ExclusiveLocks&) = delete;
  ExclusiveLocks& operator=(const ExclusiveLocks&) = delete;

 private:
  std::vector<Var*> vars_;
};

// TF's PrepareToUpdateVariable for a POD dtype: if the variable's buffer is
// shared (a read still holds it) or the variable is in copy-on-read mode,
// replace it with a private copy. Requires the variable's lock.
inline Status PrepareToUpdate(OpKernelContext* ctx, Var* var) {
  Tensor* tensor = var->tensor();
  if (!var->copy_on_read_mode.load() && tensor->RefCountIsOne()) return Status();
  ::tensorflow::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy, attr));
  if (tensor->TotalBytes() > 0) {
    std::memcpy(const_cast<char*>(copy.tensor_data().data()), tensor->tensor_data().data(), tensor->TotalBytes());
  }
  *tensor = copy;
  return Status();
}

// The resource inputs of one op: `groups` groups of n variables, named
// names[0..groups) ("var", "m", ...), then n gradients.
struct Layout {
  const char* op;                    // "MultiTensorAdam", for error messages
  std::vector<const char*> names;    // every group the op can have ("var", "m", "v", "vhat")
  int groups = 0;                    // groups present in this op instance (<= names.size())
  int n = 0;

  int num_resources() const { return groups * n; }
  int grad_start() const { return groups * n; }
  // "var[3]", "m[0]", ...: the user-facing name of resource input `index`.
  std::string InputName(int index) const {
    return std::string(names[index / n]) + "[" + std::to_string(index % n) + "]";
  }
};

// "var, m, v and vhat" from names[0..count).
inline std::string JoinNames(const std::vector<const char*>& names, size_t count) {
  std::string out;
  for (size_t k = 0; k < count; ++k) {
    if (k > 0) out += k + 1 == count ? " and " : ", ";
    out += names[k];
  }
  return out;
}

// The variables of one op call, looked up, checked and locked. Acquire()
// validates everything before any variable is written, so an error leaves
// every variable unchanged: distinct variables, initialized, of dtype
// `dtype`, every slot of variable i of grad[i]'s shape; then it makes each
// buffer private (copy-on-write). The locks are held until destruction.
class LockedVariables {
 public:
  Status Acquire(OpKernelContext* ctx, const Layout& layout, ::tensorflow::DataType dtype) {
    const int num_resources = layout.num_resources();
    const int n = layout.n;
    n_ = n;
    refs_.resize(num_resources);
    // Look up every variable; refuse one passed twice (the update is not
    // sequential, so aliasing inputs would race).
    std::vector<std::pair<Var*, int>> by_address(num_resources);
    for (int i = 0; i < num_resources; ++i) {
      Status s = ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, i), &refs_[i]);
      if (!s.ok()) {
        errors::AppendToMessage(&s, "(", layout.op, " input ", layout.InputName(i), ")");
        return s;
      }
      by_address[i] = {refs_[i].get(), i};
    }
    std::sort(by_address.begin(), by_address.end());
    for (int i = 1; i < num_resources; ++i) {
      if (by_address[i].first == by_address[i - 1].first) {
        return errors::InvalidArgument("the same variable is passed as ", layout.InputName(by_address[i - 1].second),
                                       " and ", layout.InputName(by_address[i].second), "; every ",
                                       JoinNames(layout.names, layout.names.size()),
                                       " must be a distinct variable");
      }
    }

    std::vector<Var*> raw(num_resources);
    for (int i = 0; i < num_resources; ++i) raw[i] = refs_[i].get();
    locks_ = std::make_unique<ExclusiveLocks>(std::move(raw));

    for (int i = 0; i < num_resources; ++i) {
      const Tensor* t = refs_[i]->tensor();
      if (!t->IsInitialized()) {
        return errors::FailedPrecondition("Attempting to use uninitialized variables: ", layout.InputName(i));
      }
      if (t->dtype() != dtype) {
        return errors::InvalidArgument(layout.InputName(i), " has dtype ", ::tensorflow::DataTypeString(t->dtype()),
                                       " but T is ", ::tensorflow::DataTypeString(dtype),
                                       "; all variables of one call must share the dtype T");
      }
    }
    offsets_.assign(n + 1, 0);
    for (int i = 0; i < n; ++i) {
      const Tensor& grad = ctx->input(layout.grad_start() + i);
      bool same = true;
      for (int g = 0; g < layout.groups; ++g) same = same && tensor(g, i)->shape().IsSameSize(grad.shape());
      if (!same) {
        std::string shapes;
        for (int g = 0; g < layout.groups; ++g) {
          shapes += std::string(layout.names[g]) + " " + tensor(g, i)->shape().DebugString() + ", ";
        }
        shapes += "grad " + grad.shape().DebugString();
        std::vector<const char*> checked(layout.names.begin(), layout.names.begin() + layout.groups);
        checked.push_back("grad");
        return errors::InvalidArgument("variable ", i, ": ", JoinNames(checked, checked.size()),
                                       " must have the same shape, got ", shapes);
      }
      offsets_[i + 1] = offsets_[i] + grad.NumElements();
    }

    // Copy-on-write, as TF's training ops do: a buffer still shared with a
    // read is copied before the in-place update.
    for (int i = 0; i < num_resources; ++i) TF_RETURN_IF_ERROR(PrepareToUpdate(ctx, refs_[i].get()));
    return Status();
  }

  // Slot `group` of variable i (group 0: the variable itself).
  Tensor* tensor(int group, int i) const { return refs_[group * n_ + i]->tensor(); }

  template <typename T>
  T* data(int group, int i) const {
    return tensor(group, i)->template flat<T>().data();
  }

  // offsets()[i]: the index of variable i's first element in the one index
  // space over all variables; offsets()[n] is the total.
  const std::vector<int64_t>& offsets() const { return offsets_; }

 private:
  std::vector<::tensorflow::core::RefCountPtr<Var>> refs_;
  std::unique_ptr<ExclusiveLocks> locks_;
  std::vector<int64_t> offsets_;
  int n_ = 0;
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
