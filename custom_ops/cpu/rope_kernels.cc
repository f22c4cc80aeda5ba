// CPU kernels of TfmetalExt>Rope and TfmetalExt>RopeGrad.
//
// Rows (b, t) are split over TF's CPU thread pool. Each row's cos/sin are
// computed once and applied to all of its heads (the dimensions between
// sequence and features), so a [B, T, N, H] input costs B*T*H/2 cos/sin, not
// N times that; where every batch element has the same positions (a [T] or
// [1, T] positions input), a [T, H] table of them is made first: T*H/2. The
// math is tfmetal/rope.h, shared with the Metal kernel: same float32
// operations, so the same bits given the same cos/sin.
//
// Helpers live in namespace rope_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <cmath>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/host_checks.h"
#include "tfmetal/rope.h"

namespace tfmetal_ext {
namespace rope_cpu {

// Rough cycles per rotated pair and per cos/sin pair, for the thread pool's sharding.
constexpr int64_t kPairCost = 6;
constexpr int64_t kCosSinCost = 40;

inline Status Geometry(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, const char* x_name,
                       RopeGeometry* g) {
  const std::string error =
      RopeShapeError(x_name, x.shape().dim_sizes().data(), x.dims(), positions.shape().dim_sizes().data(),
                     positions.dims(), inv_freq.shape().dim_sizes().data(), inv_freq.dims(), g);
  return error.empty() ? Status() : errors::InvalidArgument(error);
}

// Forward (kBack = false) or gradient (kBack = true).
template <typename T, bool kBack>
class RopeOp : public OpKernel {
 public:
  explicit RopeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES(ctx, std::isfinite(scale_), errors::InvalidArgument("scale must be finite, got ", scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& positions = ctx->input(1);
    const Tensor& inv_freq = ctx->input(2);
    RopeGeometry g;
    OP_REQUIRES_OK(ctx, Geometry(x, positions, inv_freq, kBack ? "dy" : "x", &g));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const int64_t rows = g.batch * g.sequence;
    if (rows == 0 || g.inner == 0 || g.half == 0) return;
    const T* in = x.flat<T>().data();
    T* out = y->flat<T>().data();
    const float* pos = positions.flat<float>().data();
    const float* freq = inv_freq.flat<float>().data();
    const float scale = scale_;
    const int64_t half = g.half, inner = g.inner, sequence = g.sequence, stride = g.position_batch_stride;
    // Every row's pairs turned by its cos/sin (cs: half cos, then half sin).
    const auto rotate_row = [=](int64_t row, const float* cs) {
      for (int64_t m = 0; m < inner; ++m) {
        const int64_t base = (row * inner + m) * 2 * half;
        const T* xr = in + base;
        T* yr = out + base;
        for (int64_t i = 0; i < half; ++i) {
          const tfm_rope_cos_sin c{cs[i], cs[half + i]};
          const float x1 = ToFloat(xr[i]), x2 = ToFloat(xr[i + half]);
          const tfm_rope_pair r = kBack ? rope_rotate_back(x1, x2, c) : rope_rotate(x1, x2, c);
          yr[i] = FromFloat<T>(r.first);  // each element is read before it is written: y may alias x
          yr[i + half] = FromFloat<T>(r.second);
        }
      }
    };
    const auto cos_sin_of = [=](const float* p_row, int64_t t, float* cs) {
      const float p = p_row[t];
      for (int64_t i = 0; i < half; ++i) {
        const tfm_rope_cos_sin c = rope_cos_sin(p, freq[i], scale);
        cs[i] = c.c;
        cs[half + i] = c.s;
      }
    };
    if (stride == 0 && g.batch > 1) {
      // One positions row for every batch element: the [sequence, 2 * half] cos/sin once, then the
      // rows (the same values, so the same bits, as computing them per row).
      Tensor table;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({sequence, 2 * half}), &table));
      float* cs = table.flat<float>().data();
      ParallelFor(ctx, sequence, half * kCosSinCost,
                  [=](int64_t begin, int64_t end) {
                    for (int64_t t = begin; t < end; ++t) cos_sin_of(pos, t, cs + t * 2 * half);
                  });
      ParallelFor(ctx, rows, inner * half * kPairCost, [=](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) rotate_row(row, cs + (row % sequence) * 2 * half);
      });
      return;
    }
    const int64_t cost = inner * half * kPairCost + half * kCosSinCost;
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, rows, cost, 2 * half, [=](int64_t begin, int64_t end,
                                                                                 float* scratch) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / sequence, t = row % sequence;
        cos_sin_of(pos + b * stride, t, scratch);
        rotate_row(row, scratch);
      }
    }));
  }

 private:
  float scale_ = 1.0f;
};

template <typename T>
using RopeForward = RopeOp<T, false>;
template <typename T>
using RopeBackward = RopeOp<T, true>;

}  // namespace rope_cpu

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Rope"), rope_cpu::RopeForward)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>RopeGrad"), rope_cpu::RopeBackward)

}  // namespace tfmetal_ext
