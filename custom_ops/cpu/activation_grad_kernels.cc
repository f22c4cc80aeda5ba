// CPU kernels of TfmetalExt>ActivationGrad: dx = dy * act'(x), and of
// TfmetalExt>GatedActivationGrad: d_gate = dy * up * act'(gate) and
// d_up = dy * act(gate), elementwise.
//
// Elements are split over TF's CPU thread pool (ParallelFor, as the other
// elementwise kernels). The activation is a template argument, so each loop
// body is straight-line float math from tfmetal/activation_grad.h (the switch
// folds away; its exps are tfm_exp_poly, its selects compute both arms), the
// same operations as the Metal kernel's: same bits. The loop vectorizes; on
// x86-64 it is also compiled for AVX2 (8 lanes) and chosen at run time from
// the CPU's features. Not for FMA: g++ contracts a * b + c into one rounding
// in C++ wherever FMA is available, and the results would no longer be the
// baseline build's and the emulator's.
//
// Helpers live in namespace activation_grad_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <string>

#include "cpu/activation_grad_attrs.h"
#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfmetal/activation_grad.h"

namespace tfmetal_ext {
namespace activation_grad_cpu {

// Rough cycles per element (an exp, a division or two, a dozen multiplies
// and adds; erf's polynomial for gelu), for the thread pool's sharding.
constexpr int64_t kElementCost = 40;

template <typename T, int32_t kKind>
inline __attribute__((always_inline)) void Loop(const T* __restrict dy, const T* __restrict x, T* dx, int64_t begin,
                                                 int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    dx[i] = FromFloat<T>(activation_grad(kKind, ToFloat(dy[i]), ToFloat(x[i])));
  }
}

template <typename T, int32_t kKind>
void LoopBaseline(const T* dy, const T* x, T* dx, int64_t begin, int64_t end) {
  Loop<T, kKind>(dy, x, dx, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename T, int32_t kKind>
__attribute__((target("avx2"))) void LoopAvx2(const T* dy, const T* x, T* dx, int64_t begin, int64_t end) {
  Loop<T, kKind>(dy, x, dx, begin, end);
}
#endif

template <typename T, int32_t kKind>
void Run(OpKernelContext* ctx, const T* dy, const T* x, T* dx, int64_t n) {
  auto loop = &LoopBaseline<T, kKind>;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (CpuUseAvx2()) loop = &LoopAvx2<T, kKind>;
#endif
  ParallelFor(ctx, n, kElementCost, [=](int64_t begin, int64_t end) { loop(dy, x, dx, begin, end); });
}

// Both ops' `activation` attribute, checked once at construction (cpu/activation_grad_attrs.h).
class ActivationKernel : public OpKernel {
 public:
  explicit ActivationKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &name));
    const std::string error = activation_grad_attrs::ActivationError(name);
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
    kind_ = activation_grad_attrs::ActivationCode(name);
  }

 protected:
  int32_t kind_ = TFM_ACTGRAD_SILU;
};

template <typename T>
class ActivationGradOp : public ActivationKernel {
 public:
  explicit ActivationGradOp(OpKernelConstruction* ctx) : ActivationKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckSameShape(dy, "dy", x, "x"));  // tfmetal/host_checks.h, as the Metal host code
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &dx));  // dx may reuse dy
    const int64_t n = x.NumElements();
    if (n == 0) return;
    const T* g = dy.flat<T>().data();
    const T* in = x.flat<T>().data();
    T* out = dx->flat<T>().data();
    switch (kind_) {
      case TFM_ACTGRAD_SILU:
        return Run<T, TFM_ACTGRAD_SILU>(ctx, g, in, out, n);
      case TFM_ACTGRAD_GELU:
        return Run<T, TFM_ACTGRAD_GELU>(ctx, g, in, out, n);
      default:
        return Run<T, TFM_ACTGRAD_GELU_APPROXIMATE>(ctx, g, in, out, n);
    }
  }
};

// ---------------------------------------------------------------- gated form

// Elements per block of GatedLoop.
constexpr int64_t kGatedBlock = 256;

template <typename T, int32_t kKind>
inline __attribute__((always_inline)) void GatedLoop(const T* dy, const T* gate, const T* up, T* d_gate, T* d_up,
                                                     int64_t begin, int64_t end) {
  // d_gate may reuse dy's or gate's buffer and d_up up's. So each block is computed from the inputs
  // into local arrays (a loop that only reads the inputs: it vectorizes with no overlap test), then
  // stored.
  float dg[kGatedBlock], du[kGatedBlock];
  for (int64_t b = begin; b < end; b += kGatedBlock) {
    const int64_t n = end - b < kGatedBlock ? end - b : kGatedBlock;
    for (int64_t i = 0; i < n; ++i) {
      gated_activation_grad(kKind, ToFloat(dy[b + i]), ToFloat(gate[b + i]), ToFloat(up[b + i]), &dg[i], &du[i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      d_gate[b + i] = FromFloat<T>(dg[i]);
      d_up[b + i] = FromFloat<T>(du[i]);
    }
  }
}

template <typename T, int32_t kKind>
void GatedLoopBaseline(const T* dy, const T* gate, const T* up, T* d_gate, T* d_up, int64_t begin, int64_t end) {
  GatedLoop<T, kKind>(dy, gate, up, d_gate, d_up, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename T, int32_t kKind>
__attribute__((target("avx2"))) void GatedLoopAvx2(const T* dy, const T* gate, const T* up, T* d_gate, T* d_up,
                                                   int64_t begin, int64_t end) {
  GatedLoop<T, kKind>(dy, gate, up, d_gate, d_up, begin, end);
}
#endif

template <typename T, int32_t kKind>
void GatedRun(OpKernelContext* ctx, const T* dy, const T* gate, const T* up, T* d_gate, T* d_up, int64_t n) {
  auto loop = &GatedLoopBaseline<T, kKind>;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (CpuUseAvx2()) loop = &GatedLoopAvx2<T, kKind>;
#endif
  ParallelFor(ctx, n, 2 * kElementCost,
              [=](int64_t begin, int64_t end) { loop(dy, gate, up, d_gate, d_up, begin, end); });
}

template <typename T>
class GatedActivationGradOp : public ActivationKernel {
 public:
  explicit GatedActivationGradOp(OpKernelConstruction* ctx) : ActivationKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& gate = ctx->input(1);
    const Tensor& up = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckSameShape(dy, "dy", gate, "gate"));  // tfmetal/host_checks.h, as the Metal host code
    OP_REQUIRES_OK(ctx, CheckSameShape(up, "up", gate, "gate"));
    Tensor* d_gate = nullptr;
    Tensor* d_up = nullptr;
    // The outputs may reuse inputs nothing else holds (the backward pass's dy, the replayed gate
    // and up): a gated feed-forward's backward then allocates nothing of its width.
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, gate.shape(), &d_gate));
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({2}, 1, gate.shape(), &d_up));
    const int64_t n = gate.NumElements();
    if (n == 0) return;
    const T* g = dy.flat<T>().data();
    const T* a = gate.flat<T>().data();
    const T* b = up.flat<T>().data();
    T* da = d_gate->flat<T>().data();
    T* db = d_up->flat<T>().data();
    switch (kind_) {
      case TFM_ACTGRAD_SILU:
        return GatedRun<T, TFM_ACTGRAD_SILU>(ctx, g, a, b, da, db, n);
      case TFM_ACTGRAD_GELU:
        return GatedRun<T, TFM_ACTGRAD_GELU>(ctx, g, a, b, da, db, n);
      default:
        return GatedRun<T, TFM_ACTGRAD_GELU_APPROXIMATE>(ctx, g, a, b, da, db, n);
    }
  }
};

}  // namespace activation_grad_cpu

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>ActivationGrad"), activation_grad_cpu::ActivationGradOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>GatedActivationGrad"),
                                       activation_grad_cpu::GatedActivationGradOp)

}  // namespace tfmetal_ext
