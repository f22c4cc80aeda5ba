// CPU kernel of TfmetalExt>MultiTensorRMSprop.
//
// One op for N variables and their RMSprop slots (velocity, optionally
// momentum and average gradient), on the infrastructure shared with the
// other multi-tensor ops (cpu/multi_tensor_common.h): variables looked up,
// refused when passed twice, locked in address order, validated (dtype,
// shapes) before anything is written, copied on write, and the elements of
// all variables updated as one index space sharded over TF's intra-op thread
// pool. One pass over memory: var, ms and grad read, var and ms written (plus
// the momentum and average-gradient slots when present), where TF's
// ResourceApplyRMSProp makes three passes and always needs a momentum buffer.
// The per-element math is tfmetal/rmsprop.h, shared with the Metal kernel.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/multi_tensor_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/rmsprop.h"

namespace tfmetal_ext {
namespace {

// Elementwise RMSprop update of elements [lo, hi) of one variable. mom / mg
// are null when the op has no such slots (kMomentum / kCentered false);
// kScaled: each gradient element divided by `scale` first (tfmetal/loss_scale.h).
template <typename T, bool kDecay, bool kCentered, bool kMomentum, bool kScaled>
void RMSpropUpdateRange(T* __restrict__ var, T* __restrict__ ms, T* __restrict__ mom, T* __restrict__ mg,
                        const T* __restrict__ g, int64_t lo, int64_t hi, tfm_rmsprop_coeffs coeffs, float scale) {
  using R = multi_tensor::Round<T>;
  // Constants here, so the branches in tfm_rmsprop_update fold away.
  coeffs.has_decay = kDecay ? 1 : 0;
  coeffs.centered = kCentered ? 1 : 0;
  coeffs.has_momentum = kMomentum ? 1 : 0;
  for (int64_t j = lo; j < hi; ++j) {
    const float mg_in = kCentered ? ToFloat(mg[j]) : 0.0f;
    const float m_in = kMomentum ? ToFloat(mom[j]) : 0.0f;
    const float g_j = kScaled ? tfm_unscale_gradient<R>(ToFloat(g[j]), scale) : ToFloat(g[j]);
    const tfm_rmsprop_state s = tfm_rmsprop_update<R>(ToFloat(var[j]), ToFloat(ms[j]), mg_in, m_in, g_j, coeffs);
    var[j] = FromFloat<T>(s.var);
    ms[j] = FromFloat<T>(s.v);
    if (kCentered) mg[j] = FromFloat<T>(s.mg);
    if (kMomentum) mom[j] = FromFloat<T>(s.m);
  }
}

template <typename T, bool kDecay, bool kScaled>
void RMSpropDispatch(bool centered, bool momentum, T* var, T* ms, T* mom, T* mg, const T* g, int64_t lo, int64_t hi,
                     const tfm_rmsprop_coeffs& coeffs, float scale) {
  if (centered) {
    if (momentum) {
      RMSpropUpdateRange<T, kDecay, true, true, kScaled>(var, ms, mom, mg, g, lo, hi, coeffs, scale);
    } else {
      RMSpropUpdateRange<T, kDecay, true, false, kScaled>(var, ms, mom, mg, g, lo, hi, coeffs, scale);
    }
  } else if (momentum) {
    RMSpropUpdateRange<T, kDecay, false, true, kScaled>(var, ms, mom, mg, g, lo, hi, coeffs, scale);
  } else {
    RMSpropUpdateRange<T, kDecay, false, false, kScaled>(var, ms, mom, mg, g, lo, hi, coeffs, scale);
  }
}

template <typename T>
class MultiTensorRMSpropOp : public OpKernel {
 public:
  explicit MultiTensorRMSpropOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_mom", &num_mom_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_mg", &num_mg_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_decay", &num_decay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scale", &num_scale_));
    OP_REQUIRES(ctx, num_mom_ == 0 || num_mom_ == n_,
                errors::InvalidArgument("mom must hold 0 or N = ", n_, " variables, got ", num_mom_));
    OP_REQUIRES(ctx, num_mg_ == 0 || num_mg_ == n_,
                errors::InvalidArgument("mg must hold 0 or N = ", n_, " variables, got ", num_mg_));
    OP_REQUIRES(ctx, num_decay_ <= 1,
                errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay_));
    OP_REQUIRES(ctx, num_scale_ <= 1, errors::InvalidArgument("scale must hold 0 or 1 scalar, got ", num_scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = n_;
    const bool momentum = num_mom_ != 0;
    const bool centered = num_mg_ != 0;
    // The groups present, in input order: var, ms, then mom and mg when used.
    multi_tensor::Layout layout{"MultiTensorRMSprop", {"var", "ms"}, 2, n};
    int mom_group = -1, mg_group = -1;
    if (momentum) {
      mom_group = layout.groups++;
      layout.names.push_back("mom");
    }
    if (centered) {
      mg_group = layout.groups++;
      layout.names.push_back("mg");
    }
    const int scalar_start = layout.grad_start() + n;

    // Scalars first: cheap, and no lock is needed to check them.
    static const char* const kScalarNames[] = {"lr", "rho", "one_minus_rho", "momentum", "epsilon",
                                               "weight_decay_rate"};
    float scalars[6] = {0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 5 + num_decay_; ++k) {
      OP_REQUIRES_OK(ctx, multi_tensor::ScalarInput<T>(ctx, scalar_start + k, kScalarNames[k], &scalars[k]));
    }
    multi_tensor::LossScale loss_scale;
    OP_REQUIRES_OK(ctx, multi_tensor::ReadLossScale(ctx, num_scale_, &loss_scale));

    // Everything is validated before anything is updated: an error leaves
    // all variables unchanged.
    multi_tensor::LockedVariables vars;
    OP_REQUIRES_OK(ctx, vars.Acquire(ctx, layout, ::tensorflow::DataTypeToEnum<T>::value));

    std::vector<T*> var_ptr(n), ms_ptr(n), mom_ptr(n, nullptr), mg_ptr(n, nullptr);
    std::vector<const T*> g_ptr(n);
    for (int i = 0; i < n; ++i) {
      var_ptr[i] = vars.data<T>(0, i);
      ms_ptr[i] = vars.data<T>(1, i);
      if (momentum) mom_ptr[i] = vars.data<T>(mom_group, i);
      if (centered) mg_ptr[i] = vars.data<T>(mg_group, i);
      g_ptr[i] = ctx->input(layout.grad_start() + i).flat<T>().data();
    }

    // Loss scaling: the whole check before any write; a non-finite gradient writes nothing.
    if (loss_scale.active) {
      const bool found = multi_tensor::AnyNonFinite<T>(ctx, vars.offsets(), g_ptr);
      OP_REQUIRES_OK(ctx, multi_tensor::WriteFound(ctx, found));
      if (found) return;
    }

    const tfm_rmsprop_coeffs coeffs = tfm_rmsprop_make_coeffs(
        scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], num_decay_, scalars[5], centered, momentum);
    const bool decay = num_decay_ != 0;
    const bool scaled = loss_scale.active;
    const float scale = loss_scale.scale;
    const int64_t cost = CostPerElement(centered, momentum, scaled);
    multi_tensor::ForEachElementRange(ctx, vars.offsets(), cost, [&](int i, int64_t lo, int64_t hi) {
      T* const a[4] = {var_ptr[i], ms_ptr[i], mom_ptr[i], mg_ptr[i]};
      if (decay && scaled) {
        RMSpropDispatch<T, true, true>(centered, momentum, a[0], a[1], a[2], a[3], g_ptr[i], lo, hi, coeffs, scale);
      } else if (decay) {
        RMSpropDispatch<T, true, false>(centered, momentum, a[0], a[1], a[2], a[3], g_ptr[i], lo, hi, coeffs, scale);
      } else if (scaled) {
        RMSpropDispatch<T, false, true>(centered, momentum, a[0], a[1], a[2], a[3], g_ptr[i], lo, hi, coeffs, scale);
      } else {
        RMSpropDispatch<T, false, false>(centered, momentum, a[0], a[1], a[2], a[3], g_ptr[i], lo, hi, coeffs, scale);
      }
    });
  }

 private:
  // Cycles per element for the thread pool's sharding: a division and a
  // square root (~10 cycles each when not vectorized) and ~8 multiplies and
  // adds; 12 bytes read and 8 written (float), more with the slots. half and
  // bfloat16 add a conversion per operation.
  // The unscale adds a division.
  static int64_t CostPerElement(bool centered, bool momentum, bool scaled) {
    const int64_t base = std::is_same<T, float>::value ? 20 : 80;
    return base + (centered ? 6 : 0) + (momentum ? 4 : 0) + (scaled ? 10 : 0);
  }

  int n_ = 0;
  int num_mom_ = 0;
  int num_mg_ = 0;
  int num_decay_ = 0;
  int num_scale_ = 0;
};

// Resource handles live in host memory on every device.
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(
    Name("TfmetalExt>MultiTensorRMSprop").HostMemory("var").HostMemory("ms").HostMemory("mom").HostMemory("mg"),
    MultiTensorRMSpropOp)

}  // namespace
}  // namespace tfmetal_ext
