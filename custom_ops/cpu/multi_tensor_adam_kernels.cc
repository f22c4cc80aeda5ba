// CPU kernel of TfmetalExt>MultiTensorAdam.
//
// One op for N variables: the elements of all variables form one index
// space that is split over TF's intra-op thread pool with a per-element cost,
// so 100 small variables cost one dispatch and run on one or two threads as
// their total size warrants. (TF's ResourceApplyAdam CPU kernel passes the
// whole tensor's cost as the per-element cost and so shards even a 64x64
// variable over all threads: ~20 us per call where ~7 us would do.)
//
// Variable lookup, duplicate and shape checks, locking, copy-on-write, the
// sharded index space and the loss scale's finite check are shared with the
// other multi-tensor ops (cpu/multi_tensor_common.h).
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/multi_tensor_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/adam.h"

namespace tfmetal_ext {
namespace {

using multi_tensor::Round;

// Elementwise update of elements [lo, hi) of one variable; kScaled: each
// gradient element divided by `scale` first (tfmetal/loss_scale.h).
template <typename T, bool kAmsgrad, bool kDecay, bool kScaled>
void UpdateRange(T* __restrict__ var, T* __restrict__ m, T* __restrict__ v, T* __restrict__ vhat,
                 const T* __restrict__ g, int64_t lo, int64_t hi, tfm_adam_coeffs coeffs, float scale) {
  using R = Round<T>;
  coeffs.has_decay = kDecay ? 1 : 0;  // a constant here, so the branch folds away
  for (int64_t j = lo; j < hi; ++j) {
    const float vhat_j = kAmsgrad ? ToFloat(vhat[j]) : 0.0f;
    const float g_j = kScaled ? tfm_unscale_gradient<R>(ToFloat(g[j]), scale) : ToFloat(g[j]);
    const tfm_adam_state s =
        tfm_adam_update<R>(ToFloat(var[j]), ToFloat(m[j]), ToFloat(v[j]), vhat_j, g_j, coeffs, kAmsgrad);
    var[j] = FromFloat<T>(s.var);
    m[j] = FromFloat<T>(s.m);
    v[j] = FromFloat<T>(s.v);
    if (kAmsgrad) vhat[j] = FromFloat<T>(s.vhat);
  }
}

// UpdateRange with the flags as template arguments.
template <typename T, bool kAmsgrad, bool kDecay>
void UpdateRangeScaledOrNot(bool scaled, T* var, T* m, T* v, T* vhat, const T* g, int64_t lo, int64_t hi,
                            const tfm_adam_coeffs& coeffs, float scale) {
  if (scaled) {
    UpdateRange<T, kAmsgrad, kDecay, true>(var, m, v, vhat, g, lo, hi, coeffs, scale);
  } else {
    UpdateRange<T, kAmsgrad, kDecay, false>(var, m, v, vhat, g, lo, hi, coeffs, scale);
  }
}

template <typename T>
class MultiTensorAdamOp : public OpKernel {
 public:
  explicit MultiTensorAdamOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_vhat", &num_vhat_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_decay", &num_decay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scale", &num_scale_));
    OP_REQUIRES(ctx, num_vhat_ == 0 || num_vhat_ == n_,
                errors::InvalidArgument("vhat must hold 0 (Adam) or N = ", n_, " (AMSGrad) variables, got ",
                                        num_vhat_));
    OP_REQUIRES(ctx, num_decay_ <= 1,
                errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay_));
    OP_REQUIRES(ctx, num_scale_ <= 1, errors::InvalidArgument("scale must hold 0 or 1 scalar, got ", num_scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = n_;
    const multi_tensor::Layout layout{"MultiTensorAdam", {"var", "m", "v", "vhat"}, num_vhat_ ? 4 : 3, n};
    const int scalar_start = layout.grad_start() + n;

    // Scalars first: cheap, and no lock is needed to check them.
    static const char* const kScalarNames[] = {"lr", "beta1", "beta2", "epsilon", "beta1_power", "beta2_power",
                                               "weight_decay_rate"};
    float scalars[7] = {0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 6 + num_decay_; ++k) {
      OP_REQUIRES_OK(ctx, multi_tensor::ScalarInput<T>(ctx, scalar_start + k, kScalarNames[k], &scalars[k]));
    }
    multi_tensor::LossScale loss_scale;
    OP_REQUIRES_OK(ctx, multi_tensor::ReadLossScale(ctx, num_scale_, &loss_scale));

    // Everything is validated before anything is updated: an error leaves
    // all variables unchanged.
    multi_tensor::LockedVariables vars;
    OP_REQUIRES_OK(ctx, vars.Acquire(ctx, layout, ::tensorflow::DataTypeToEnum<T>::value));

    std::vector<T*> var_ptr(n), m_ptr(n), v_ptr(n), vhat_ptr(n, nullptr);
    std::vector<const T*> g_ptr(n);
    for (int i = 0; i < n; ++i) {
      var_ptr[i] = vars.data<T>(0, i);
      m_ptr[i] = vars.data<T>(1, i);
      v_ptr[i] = vars.data<T>(2, i);
      if (num_vhat_) vhat_ptr[i] = vars.data<T>(3, i);
      g_ptr[i] = ctx->input(layout.grad_start() + i).flat<T>().data();
    }

    // Loss scaling: the whole check before any write; a non-finite gradient writes nothing.
    if (loss_scale.active) {
      const bool found = multi_tensor::AnyNonFinite<T>(ctx, vars.offsets(), g_ptr);
      OP_REQUIRES_OK(ctx, multi_tensor::WriteFound(ctx, found));
      if (found) return;
    }

    const tfm_adam_coeffs coeffs = tfm_adam_make_coeffs<Round<T>>(
        scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5], num_decay_, scalars[6]);
    const bool amsgrad = num_vhat_ != 0;
    const bool decay = num_decay_ != 0;
    const bool scaled = loss_scale.active;
    const float scale = loss_scale.scale;
    multi_tensor::ForEachElementRange(ctx, vars.offsets(), CostPerElement(scaled), [&](int i, int64_t lo, int64_t hi) {
      if (amsgrad && decay) {
        UpdateRangeScaledOrNot<T, true, true>(scaled, var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi,
                                              coeffs, scale);
      } else if (amsgrad) {
        UpdateRangeScaledOrNot<T, true, false>(scaled, var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi,
                                               coeffs, scale);
      } else if (decay) {
        UpdateRangeScaledOrNot<T, false, true>(scaled, var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo, hi,
                                               coeffs, scale);
      } else {
        UpdateRangeScaledOrNot<T, false, false>(scaled, var_ptr[i], m_ptr[i], v_ptr[i], vhat_ptr[i], g_ptr[i], lo,
                                                hi, coeffs, scale);
      }
    });
  }

 private:
  // Cycles per element for the thread pool's sharding: ~12 arithmetic ops
  // including a divide and a square root, 16 bytes read and 12 written
  // (float); half and bfloat16 add a conversion per operation; the unscale
  // one more division.
  static constexpr int64_t CostPerElement(bool scaled) {
    return (std::is_same<T, float>::value ? 24 : 80) + (scaled ? 10 : 0);
  }

  int n_ = 0;
  int num_vhat_ = 0;
  int num_decay_ = 0;
  int num_scale_ = 0;
};

// Resource handles live in host memory on every device.
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(
    Name("TfmetalExt>MultiTensorAdam").HostMemory("var").HostMemory("m").HostMemory("v").HostMemory("vhat"),
    MultiTensorAdamOp)

}  // namespace
}  // namespace tfmetal_ext
