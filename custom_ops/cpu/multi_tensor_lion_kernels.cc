// CPU kernel of TfmetalExt>MultiTensorLion.
//
// One op for N variables and their momentums, on the infrastructure it shares
// with TfmetalExt>MultiTensorAdam (cpu/multi_tensor_common.h): variables
// looked up, refused when passed twice, locked in address order, validated
// (dtype, shapes) before anything is written, copied on write, and the
// elements of all variables updated as one index space sharded over TF's
// intra-op thread pool. The per-element math is tfmetal/lion.h, shared with
// the Metal kernel.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/multi_tensor_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/lion.h"

namespace tfmetal_ext {
namespace {

// Elementwise Lion update of elements [lo, hi) of one variable; kScaled: each
// gradient element divided by `scale` first (tfmetal/loss_scale.h).
template <typename T, bool kDecay, bool kScaled>
void LionUpdateRange(T* __restrict__ var, T* __restrict__ m, const T* __restrict__ g, int64_t lo, int64_t hi,
                     tfm_lion_coeffs coeffs, float scale) {
  using R = multi_tensor::Round<T>;
  coeffs.has_decay = kDecay ? 1 : 0;  // a constant here, so the branch folds away
  for (int64_t j = lo; j < hi; ++j) {
    const float g_j = kScaled ? tfm_unscale_gradient<R>(ToFloat(g[j]), scale) : ToFloat(g[j]);
    const tfm_lion_state s = tfm_lion_update<R>(ToFloat(var[j]), ToFloat(m[j]), g_j, coeffs);
    var[j] = FromFloat<T>(s.var);
    m[j] = FromFloat<T>(s.m);
  }
}

template <typename T>
class MultiTensorLionOp : public OpKernel {
 public:
  explicit MultiTensorLionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_decay", &num_decay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_scale", &num_scale_));
    OP_REQUIRES(ctx, num_decay_ <= 1,
                errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay_));
    OP_REQUIRES(ctx, num_scale_ <= 1, errors::InvalidArgument("scale must hold 0 or 1 scalar, got ", num_scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = n_;
    const multi_tensor::Layout layout{"MultiTensorLion", {"var", "m"}, 2, n};
    const int scalar_start = layout.grad_start() + n;

    // Scalars first: cheap, and no lock is needed to check them.
    static const char* const kScalarNames[] = {"lr", "beta1", "beta2", "weight_decay_rate"};
    float scalars[4] = {0, 0, 0, 0};
    for (int k = 0; k < 3 + num_decay_; ++k) {
      OP_REQUIRES_OK(ctx, multi_tensor::ScalarInput<T>(ctx, scalar_start + k, kScalarNames[k], &scalars[k]));
    }
    multi_tensor::LossScale loss_scale;
    OP_REQUIRES_OK(ctx, multi_tensor::ReadLossScale(ctx, num_scale_, &loss_scale));

    // Everything is validated before anything is updated: an error leaves
    // all variables unchanged.
    multi_tensor::LockedVariables vars;
    OP_REQUIRES_OK(ctx, vars.Acquire(ctx, layout, ::tensorflow::DataTypeToEnum<T>::value));

    std::vector<T*> var_ptr(n), m_ptr(n);
    std::vector<const T*> g_ptr(n);
    for (int i = 0; i < n; ++i) {
      var_ptr[i] = vars.data<T>(0, i);
      m_ptr[i] = vars.data<T>(1, i);
      g_ptr[i] = ctx->input(layout.grad_start() + i).flat<T>().data();
    }

    // Loss scaling: the whole check before any write; a non-finite gradient writes nothing.
    if (loss_scale.active) {
      const bool found = multi_tensor::AnyNonFinite<T>(ctx, vars.offsets(), g_ptr);
      OP_REQUIRES_OK(ctx, multi_tensor::WriteFound(ctx, found));
      if (found) return;
    }

    const tfm_lion_coeffs coeffs =
        tfm_lion_make_coeffs<multi_tensor::Round<T>>(scalars[0], scalars[1], scalars[2], num_decay_, scalars[3]);
    const bool decay = num_decay_ != 0;
    const bool scaled = loss_scale.active;
    const float scale = loss_scale.scale;
    multi_tensor::ForEachElementRange(ctx, vars.offsets(), CostPerElement(scaled), [&](int i, int64_t lo, int64_t hi) {
      if (decay && scaled) {
        LionUpdateRange<T, true, true>(var_ptr[i], m_ptr[i], g_ptr[i], lo, hi, coeffs, scale);
      } else if (decay) {
        LionUpdateRange<T, true, false>(var_ptr[i], m_ptr[i], g_ptr[i], lo, hi, coeffs, scale);
      } else if (scaled) {
        LionUpdateRange<T, false, true>(var_ptr[i], m_ptr[i], g_ptr[i], lo, hi, coeffs, scale);
      } else {
        LionUpdateRange<T, false, false>(var_ptr[i], m_ptr[i], g_ptr[i], lo, hi, coeffs, scale);
      }
    });
  }

 private:
  // Cycles per element for the thread pool's sharding: ~8 multiplies and
  // adds and a sign, 12 bytes read and 8 written (float); half and bfloat16
  // add a conversion per operation; the unscale a division.
  static constexpr int64_t CostPerElement(bool scaled) {
    return (std::is_same<T, float>::value ? 12 : 60) + (scaled ? 10 : 0);
  }

  int n_ = 0;
  int num_decay_ = 0;
  int num_scale_ = 0;
};

// Resource handles live in host memory on every device.
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>MultiTensorLion").HostMemory("var").HostMemory("m"),
                                       MultiTensorLionOp)

}  // namespace
}  // namespace tfmetal_ext
