// CPU kernels of TfmetalExt>Softshrink and TfmetalExt>SoftshrinkGrad.
#include <cmath>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/softshrink.h"

namespace tfmetal_ext {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

namespace {

// Reads and checks the `lambd` attr; on error sets ctx's status (kernel
// construction then fails with InvalidArgument) and returns 0.
float GetLambd(OpKernelConstruction* ctx) {
  float lambd = 0.0f;
  ::tensorflow::Status s = ctx->GetAttr("lambd", &lambd);
  if (!s.ok()) {
    ctx->CtxFailure(__FILE__, __LINE__, s);
    return 0.0f;
  }
  if (!(std::isfinite(lambd) && lambd >= 0.0f)) {
    ctx->CtxFailure(__FILE__, __LINE__,
                    ::tensorflow::errors::InvalidArgument("lambd must be finite and >= 0, got ", lambd));
  }
  return lambd;
}

}  // namespace

template <typename T>
class SoftshrinkOp : public OpKernel {
 public:
  explicit SoftshrinkOp(OpKernelConstruction* ctx) : OpKernel(ctx), lambd_(GetLambd(ctx)) {}

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

 private:
  const float lambd_;
};

template <typename T>
class SoftshrinkGradOp : public OpKernel {
 public:
  explicit SoftshrinkGradOp(OpKernelConstruction* ctx) : OpKernel(ctx), lambd_(GetLambd(ctx)) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                ::tensorflow::errors::InvalidArgument("dy and x must have the same shape, got ",
                                                      dy.shape().DebugString(), " and ", x.shape().DebugString()));
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

 private:
  const float lambd_;
};

#define TFMETAL_REGISTER_SOFTSHRINK(T)                                                               \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TfmetalExt>Softshrink").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),         \
      SoftshrinkOp<T>);                                                                              \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TfmetalExt>SoftshrinkGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),     \
      SoftshrinkGradOp<T>);

TFMETAL_REGISTER_SOFTSHRINK(float)
TFMETAL_REGISTER_SOFTSHRINK(Eigen::half)
TFMETAL_REGISTER_SOFTSHRINK(Eigen::bfloat16)
#undef TFMETAL_REGISTER_SOFTSHRINK

}  // namespace tfmetal_ext
