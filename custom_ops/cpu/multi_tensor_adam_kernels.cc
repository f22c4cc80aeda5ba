// CPU kernel of TfmetalExt>MultiTensorAdam.
//
// One op for N variables: the elements of all variables form one index
// space that is split over TF's intra-op thread pool with a per-element cost,
// so 100 small variables cost one dispatch and run on one or two threads as
// their total size warrants. (TF's ResourceApplyAdam CPU kernel passes the
// whole tensor's cost as the per-element cost and so shards even a 64x64
// variable over all threads: ~20 us per call where ~7 us would do.)
//
// Variable access follows TF's own training kernels
// (tensorflow/core/kernels/training_op_helpers.h): exclusive locks on every
// variable, taken in address order, and copy-on-write of a buffer that is
// shared with a pending read before it is updated in place. Both are written
// out here instead of calling MaybeLockVariableInputMutexesInOrder (its
// duplicate check is quadratic in the number of inputs, 3N-4N here) and
// PrepareToUpdateVariable (its Eigen copy needs EIGEN_USE_THREADS defined
// before the first Eigen include, which the unity build cannot promise).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/adam.h"

namespace tfmetal_ext {
namespace {

using ::tensorflow::Var;

// R::round for each T: float -> T -> float (see tfmetal/adam.h).
template <typename T>
struct Round;
template <>
struct Round<float> : tfm_round_float {};
template <>
struct Round<Eigen::half> {
  static inline float round(float x) { return static_cast<float>(static_cast<Eigen::half>(x)); }
};
template <>
struct Round<Eigen::bfloat16> {
  static inline float round(float x) { return static_cast<float>(static_cast<Eigen::bfloat16>(x)); }
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
Status PrepareToUpdate(OpKernelContext* ctx, Var* var) {
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

// "var[3]", "m[0]", ...: the user-facing name of resource input `index`.
std::string InputName(int index, int n) {
  static const char* const kNames[] = {"var", "m", "v", "vhat"};
  return std::string(kNames[index / n]) + "[" + std::to_string(index % n) + "]";
}

// Elementwise update of elements [lo, hi) of one variable.
template <typename T, bool kAmsgrad, bool kDecay>
void UpdateRange(T* __restrict__ var, T* __restrict__ m, T* __restrict__ v, T* __restrict__ vhat,
                 const T* __restrict__ g, int64_t lo, int64_t hi, tfm_adam_coeffs coeffs) {
  using R = Round<T>;
  coeffs.has_decay = kDecay ? 1 : 0;  // a constant here, so the branch folds away
  for (int64_t j = lo; j < hi; ++j) {
    const float vhat_j = kAmsgrad ? ToFloat(vhat[j]) : 0.0f;
    const tfm_adam_state s =
        tfm_adam_update<R>(ToFloat(var[j]), ToFloat(m[j]), ToFloat(v[j]), vhat_j, ToFloat(g[j]), coeffs, kAmsgrad);
    var[j] = FromFloat<T>(s.var);
    m[j] = FromFloat<T>(s.m);
    v[j] = FromFloat<T>(s.v);
    if (kAmsgrad) vhat[j] = FromFloat<T>(s.vhat);
  }
}

template <typename T>
class MultiTensorAdamOp : public OpKernel {
 public:
  explicit MultiTensorAdamOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_vhat", &num_vhat_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_decay", &num_decay_));
    OP_REQUIRES(ctx, num_vhat_ == 0 || num_vhat_ == n_,
                errors::InvalidArgument("vhat must hold 0 (Adam) or N = ", n_, " (AMSGrad) variables, got ",
                                        num_vhat_));
    OP_REQUIRES(ctx, num_decay_ <= 1,
                errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = n_;
    const int num_resources = 3 * n + num_vhat_;
    const int grad_start = num_resources;
    const int scalar_start = grad_start + n;

    // Scalars first: cheap, and no lock is needed to check them.
    static const char* const kScalarNames[] = {"lr", "beta1", "beta2", "epsilon", "beta1_power", "beta2_power",
                                               "weight_decay_rate"};
    float scalars[7] = {0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 6 + num_decay_; ++k) {
      const Tensor& t = ctx->input(scalar_start + k);
      OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(t.shape()),
                  errors::InvalidArgument(kScalarNames[k], " is not a scalar: ", t.shape().DebugString()));
      scalars[k] = ToFloat(t.scalar<T>()());
    }

    // Look up every variable; refuse one passed twice (the update is not
    // sequential, so aliasing inputs would race).
    std::vector<::tensorflow::core::RefCountPtr<Var>> refs(num_resources);
    std::vector<std::pair<Var*, int>> by_address(num_resources);
    for (int i = 0; i < num_resources; ++i) {
      Status s = ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, i), &refs[i]);
      if (!s.ok()) {
        errors::AppendToMessage(&s, "(MultiTensorAdam input ", InputName(i, n), ")");
        ctx->CtxFailureWithWarning(__FILE__, __LINE__, s);
        return;
      }
      by_address[i] = {refs[i].get(), i};
    }
    std::sort(by_address.begin(), by_address.end());
    for (int i = 1; i < num_resources; ++i) {
      OP_REQUIRES(ctx, by_address[i].first != by_address[i - 1].first,
                  errors::InvalidArgument("the same variable is passed as ", InputName(by_address[i - 1].second, n),
                                          " and ", InputName(by_address[i].second, n),
                                          "; every var, m, v and vhat must be a distinct variable"));
    }

    std::vector<Var*> raw(num_resources);
    for (int i = 0; i < num_resources; ++i) raw[i] = refs[i].get();
    ExclusiveLocks locks(std::move(raw));

    // Validate everything before updating anything: an error leaves all
    // variables unchanged.
    constexpr ::tensorflow::DataType kDtype = ::tensorflow::DataTypeToEnum<T>::value;
    for (int i = 0; i < num_resources; ++i) {
      const Tensor* t = refs[i]->tensor();
      OP_REQUIRES(ctx, t->IsInitialized(),
                  errors::FailedPrecondition("Attempting to use uninitialized variables: ", InputName(i, n)));
      OP_REQUIRES(ctx, t->dtype() == kDtype,
                  errors::InvalidArgument(InputName(i, n), " has dtype ", ::tensorflow::DataTypeString(t->dtype()),
                                          " but T is ", ::tensorflow::DataTypeString(kDtype),
                                          "; all variables of one call must share the dtype T"));
    }
    for (int i = 0; i < n; ++i) {
      const auto& var_shape = refs[i]->tensor()->shape();
      const Tensor& grad = ctx->input(grad_start + i);
      bool same = var_shape.IsSameSize(grad.shape());
      for (int slot = 1; slot < 3 + (num_vhat_ ? 1 : 0); ++slot) {
        same = same && var_shape.IsSameSize(refs[slot * n + i]->tensor()->shape());
      }
      if (!same) {
        std::string shapes = "var " + var_shape.DebugString() + ", m " + refs[n + i]->tensor()->shape().DebugString() +
                             ", v " + refs[2 * n + i]->tensor()->shape().DebugString() + ", grad " +
                             grad.shape().DebugString();
        if (num_vhat_) shapes += ", vhat " + refs[3 * n + i]->tensor()->shape().DebugString();
        ctx->CtxFailure(__FILE__, __LINE__,
                        errors::InvalidArgument("variable ", i, ": var, m, v", num_vhat_ ? ", vhat" : "",
                                                " and grad must have the same shape, got ", shapes));
        return;
      }
    }

    // Copy-on-write, as TF's training ops do: a buffer still shared with a
    // read is copied before the in-place update.
    for (int i = 0; i < num_resources; ++i) {
      OP_REQUIRES_OK(ctx, PrepareToUpdate(ctx, refs[i].get()));
    }

    std::vector<T*> var_ptr(n), m_ptr(n), v_ptr(n), vhat_ptr(n, nullptr);
    std::vector<const T*> g_ptr(n);
    std::vector<int64_t> offsets(n + 1, 0);
    for (int i = 0; i < n; ++i) {
      var_ptr[i] = refs[i]->tensor()->flat<T>().data();
      m_ptr[i] = refs[n + i]->tensor()->flat<T>().data();
      v_ptr[i] = refs[2 * n + i]->tensor()->flat<T>().data();
      if (num_vhat_) vhat_ptr[i] = refs[3 * n + i]->tensor()->flat<T>().data();
      g_ptr[i] = ctx->input(grad_start + i).flat<T>().data();
      offsets[i + 1] = offsets[i] + refs[i]->tensor()->NumElements();
    }

    const tfm_adam_coeffs coeffs = tfm_adam_make_coeffs<Round<T>>(
        scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5], num_decay_, scalars[6]);
    const bool amsgrad = num_vhat_ != 0;
    const bool decay = num_decay_ != 0;
    auto update = [&](int64_t begin, int64_t end) {
      // The variable holding element `begin`: the last one starting at or
      // before it (empty variables start where the next one does).
      int i = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
      for (int64_t pos = begin; pos < end && i < n; ++i) {
        const int64_t lo = pos - offsets[i];
        const int64_t hi = std::min(end, offsets[i + 1]) - offsets[i];
        if (hi > lo) {
          if (amsgrad && decay) {
            UpdateRange<T, true, true>(var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi, coeffs);
          } else if (amsgrad) {
            UpdateRange<T, true, false>(var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi, coeffs);
          } else if (decay) {
            UpdateRange<T, false, true>(var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi, coeffs);
          } else {
            UpdateRange<T, false, false>(var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi, coeffs);
          }
        }
        pos = std::max(pos, offsets[i + 1]);
      }
    };
    ParallelFor(ctx, offsets[n], CostPerElement(), update);
  }

 private:
  // Cycles per element for the thread pool's sharding: ~12 arithmetic ops
  // including a divide and a square root, 16 bytes read and 12 written
  // (float); half and bfloat16 add a conversion per operation.
  static constexpr int64_t CostPerElement() { return std::is_same<T, float>::value ? 24 : 80; }

  int n_ = 0;
  int num_vhat_ = 0;
  int num_decay_ = 0;
};

// Resource handles live in host memory on every device.
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(
    Name("TfmetalExt>MultiTensorAdam").HostMemory("var").HostMemory("m").HostMemory("v").HostMemory("vhat"),
    MultiTensorAdamOp)

}  // namespace
}  // namespace tfmetal_ext
