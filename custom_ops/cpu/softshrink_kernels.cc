// CPU kernels of TfmetalExt>Softshrink and TfmetalExt>SoftshrinkGrad.
#include <cmath>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/softshrink.h"

namespace tfmetal_ext {
namespace {

// Both kernels' attr: `lambd`, checked at construction (InvalidArgument).
class SoftshrinkOpBase : public OpKernel {
 protected:
  explicit SoftshrinkOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lambd", &lambd_));
    OP_REQUIRES(ctx, std::isfinite(lambd_) && lambd_ >= 0.0f,
                errors::InvalidArgument("lambd must be finite and >= 0, got ", lambd_));
  }

  float lambd_ = 0.0f;
};

template <typename T>
class SoftshrinkOp : public SoftshrinkOpBase {
 public:
  explicit SoftshrinkOp(OpKernelConstruction* ctx) : SoftshrinkOpBase(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const T* in = x.flat<T>().data();
    T* out = y->flat<T>().data();
    const float lambd = lambd_;
    ParallelFor(ctx, x.NumElements(), 4, [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = FromFloat<T>(softshrink_forward(ToFloat(in[i]), lambd));
    });
  }
};

template <typename T>
class SoftshrinkGradOp : public SoftshrinkOpBase {
 public:
  explicit SoftshrinkGradOp(OpKernelConstruction* ctx) : SoftshrinkOpBase(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                errors::InvalidArgument("dy and x must have the same shape, got ", dy.shape().DebugString(), " and ",
                                        x.shape().DebugString()));
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &dx));
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    T* out = dx->flat<T>().data();
    const float lambd = lambd_;
    ParallelFor(ctx, x.NumElements(), 4, [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        out[i] = FromFloat<T>(softshrink_backward(ToFloat(g[i]), ToFloat(in[i]), lambd));
    });
  }
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Softshrink"), SoftshrinkOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>SoftshrinkGrad"), SoftshrinkGradOp)

}  // namespace
}  // namespace tfmetal_ext
