// CPU kernels of TfmetalExt>Int8MatMul and TfmetalExt>Int8Conv2D.
//
// Both run the contraction of cpu/int8_gemm.h: the matmul on the rows of x (read in
// place for float, widened to float32 per work item for half/bfloat16), the convolution
// on im2col rows (output pixels; k = (kh, kw, ci), so the HWIO kernel is the [K, Cout]
// matrix as stored; padded positions are zeros). The epilogue (scale, bias, activation)
// is tfmetal/int8.h's, applied as each output leaves the accumulators.
//
// Helpers live in namespace int8_cpu: all CPU kernel files are one translation unit
// (tfmetal_ext/ops/_loader.py).
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/int8_attrs.h"
#include "cpu/int8_gemm.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/int8.h"

namespace tfmetal_ext {
namespace int8_cpu {

// The AVX2 loops where cpu_common.h's level allows them (TFMETAL_EXT_CPU_BASELINE=1: the portable
// loops, what arm64 runs).
inline bool Int8HasAvx2() {
#ifdef TFMETAL_INT8_X86
  return CpuUseAvx2();
#else
  return false;
#endif
}

// Runs every work item of `c` over the thread pool.
template <typename T, typename Source>
Status RunCall(OpKernelContext* ctx, const Call<T>& c, const Source& source, bool copies_rows) {
  const Problem& p = c.p;
  const int64_t items = Groups(p) * p.units;
  const int64_t cost = std::max<int64_t>(1, p.group_rows * p.unit_cols * std::max<int64_t>(p.k, 1) / 4);
  const bool avx2 = Int8HasAvx2();
  return ParallelForWithScratch(ctx, items, cost, ScratchFloats(p, copies_rows),
                                [&](int64_t begin, int64_t end, float* scratch) {
#ifdef TFMETAL_INT8_X86
                                  if (avx2) return avx2::RunItems(c, source, begin, end, scratch);
#endif
                                  (void)avx2;
                                  portable::RunItems(c, source, begin, end, scratch);
                                });
}

inline int64_t WorkerThreads(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
}

// ---------------------------------------------------------------- shared attrs and checks

class Int8OpBase : public OpKernel {
 public:
  explicit Int8OpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string activation;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    activation_ = int8_attrs::ActivationCode(activation);
    OP_REQUIRES(ctx, activation_ >= 0,
                errors::InvalidArgument("activation must be one of ", int8_attrs::kActivationList, ", got \"",
                                        activation, "\""));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("leaky_relu_alpha", &alpha_));
    OP_REQUIRES(ctx, std::isfinite(alpha_), errors::InvalidArgument("leaky_relu_alpha must be finite, got ", alpha_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias_));
  }

 protected:
  // kernel_scale: a float32 vector of n finite values > 0; bias: n values, or 0 without bias.
  Status CheckScaleAndBias(const Tensor& scale, const Tensor& bias, int64_t n) const {
    TF_RETURN_IF_ERROR(CheckVector(scale, "kernel_scale", n, "the output channels"));
    const float* s = scale.flat<float>().data();
    for (int64_t i = 0; i < n; ++i) {
      if (!(std::isfinite(s[i]) && s[i] > 0.0f)) {
        return errors::InvalidArgument("kernel_scale must be finite and > 0, got ", s[i], " at index ", i);
      }
    }
    if (has_bias_) return CheckVector(bias, "bias", n, "the output channels");
    return CheckVector(bias, "bias", 0, "size 0 when has_bias is false");
  }

  template <typename T>
  void Fill(Call<T>* c, const Tensor& kernel, const Tensor& scale, const Tensor& bias, int64_t m, int64_t k,
            int64_t n, Tensor* y) const {
    c->p.m = m;
    c->p.k = k;
    c->p.n = n;
    c->p.q = kernel.flat<int8_t>().data();
    c->p.scale = scale.flat<float>().data();
    c->p.activation = activation_;
    c->p.alpha = alpha_;
    c->bias = has_bias_ ? bias.flat<T>().data() : nullptr;
    c->y = y->flat<T>().data();
  }

  int32_t activation_ = TFM_INT8_LINEAR;
  float alpha_ = 0.2f;
  bool has_bias_ = false;
};

// ---------------------------------------------------------------- Int8MatMul

template <typename T>
class Int8MatMulOp : public Int8OpBase {
 public:
  explicit Int8MatMulOp(OpKernelConstruction* ctx) : Int8OpBase(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& kernel = ctx->input(1);
    const Tensor& scale = ctx->input(2);
    const Tensor& bias = ctx->input(3);
    OP_REQUIRES(ctx, x.dims() == 2, errors::InvalidArgument("x must be a matrix [M, K], got shape ",
                                                            x.shape().DebugString()));
    OP_REQUIRES(ctx, kernel.dims() == 2, errors::InvalidArgument("kernel must be a matrix [K, N], got shape ",
                                                                 kernel.shape().DebugString()));
    const int64_t m = x.dim_size(0), k = x.dim_size(1), n = kernel.dim_size(1);
    OP_REQUIRES(ctx, kernel.dim_size(0) == k,
                errors::InvalidArgument("x's K (", k, ") must match kernel's first dimension, got kernel shape ",
                                        kernel.shape().DebugString()));
    OP_REQUIRES_OK(ctx, CheckScaleAndBias(scale, bias, n));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, n}), &y));
    if (m == 0 || n == 0) return;
    Call<T> c;
    Fill(&c, kernel, scale, bias, m, k, n, y);
    Partition(&c.p, WorkerThreads(ctx));
    const T* xd = x.flat<T>().data();
    if (std::is_same<T, float>::value) {
      const float* xf = reinterpret_cast<const float*>(xd);
      auto rows = [xf, k](int64_t r0, int64_t, float*) { return xf + r0 * k; };
      OP_REQUIRES_OK(ctx, RunCall(ctx, c, rows, false));
    } else {
      auto rows = [xd, k](int64_t r0, int64_t count, float* buffer) {
        const T* src = xd + r0 * k;
        for (int64_t i = 0; i < count * k; ++i) buffer[i] = static_cast<float>(src[i]);
        return static_cast<const float*>(buffer);
      };
      OP_REQUIRES_OK(ctx, RunCall(ctx, c, rows, true));
    }
  }
};

// ---------------------------------------------------------------- Int8Conv2D

Status PairAttr(OpKernelConstruction* ctx, const char* name, int64_t out[2]) {
  std::vector<int32_t> v;
  TF_RETURN_IF_ERROR(ctx->GetAttr(name, &v));
  if (v.size() != 2 || v[0] <= 0 || v[1] <= 0) {
    std::string got;
    for (size_t i = 0; i < v.size(); ++i) got += (i ? "," : "") + std::to_string(v[i]);
    return errors::InvalidArgument(name, " must be 2 positive ints (h, w), got [", got, "]");
  }
  out[0] = v[0];
  out[1] = v[1];
  return Status();
}

// Output size and padding before of one spatial dimension (tfmetal/int8.h), the int32
// arithmetic there checked to fit.
Status ConvDim(const char* what, int64_t in, int64_t k, int64_t s, int64_t d, bool same, int64_t* out,
               int64_t* pad) {
  const int64_t eff = (k - 1) * d + 1;
  if (in > INT32_MAX / 2 || eff > INT32_MAX / 2 || s > INT32_MAX / 2) {
    return errors::InvalidArgument(what, ": input size ", in, ", dilated kernel size ", eff, " and stride ", s,
                                   " must each be below 2^30");
  }
  *out = tfm_int8_conv_out(static_cast<int32_t>(in), static_cast<int32_t>(k), static_cast<int32_t>(s),
                           static_cast<int32_t>(d), same);
  *pad = tfm_int8_conv_pad_before(static_cast<int32_t>(in), static_cast<int32_t>(*out), static_cast<int32_t>(k),
                                  static_cast<int32_t>(s), static_cast<int32_t>(d), same);
  return Status();
}

template <typename T>
class Int8Conv2DOp : public Int8OpBase {
 public:
  explicit Int8Conv2DOp(OpKernelConstruction* ctx) : Int8OpBase(ctx) {
    OP_REQUIRES_OK(ctx, PairAttr(ctx, "strides", strides_));
    OP_REQUIRES_OK(ctx, PairAttr(ctx, "dilations", dilations_));
    std::string padding;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding));
    OP_REQUIRES(ctx, padding == "SAME" || padding == "VALID",
                errors::InvalidArgument("padding must be SAME or VALID, got \"", padding, "\""));
    same_ = padding == "SAME";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& kernel = ctx->input(1);
    const Tensor& scale = ctx->input(2);
    const Tensor& bias = ctx->input(3);
    OP_REQUIRES(ctx, x.dims() == 4, errors::InvalidArgument("x must be NHWC [B, H, W, Cin], got shape ",
                                                            x.shape().DebugString()));
    OP_REQUIRES(ctx, kernel.dims() == 4, errors::InvalidArgument("kernel must be HWIO [KH, KW, Cin, Cout], got shape ",
                                                                 kernel.shape().DebugString()));
    const int64_t batch = x.dim_size(0), h = x.dim_size(1), w = x.dim_size(2), cin = x.dim_size(3);
    const int64_t kh = kernel.dim_size(0), kw = kernel.dim_size(1), cout = kernel.dim_size(3);
    OP_REQUIRES(ctx, kernel.dim_size(2) == cin,
                errors::InvalidArgument("x's Cin (", cin, ") must match kernel's input channels, got kernel shape ",
                                        kernel.shape().DebugString()));
    OP_REQUIRES(ctx, kh > 0 && kw > 0,
                errors::InvalidArgument("kernel's KH and KW must be >= 1, got kernel shape ",
                                        kernel.shape().DebugString()));
    OP_REQUIRES_OK(ctx, CheckScaleAndBias(scale, bias, cout));
    int64_t oh = 0, ow = 0, ph = 0, pw = 0;
    OP_REQUIRES_OK(ctx, ConvDim("height", h, kh, strides_[0], dilations_[0], same_, &oh, &ph));
    OP_REQUIRES_OK(ctx, ConvDim("width", w, kw, strides_[1], dilations_[1], same_, &ow, &pw));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({batch, oh, ow, cout}), &y));
    const int64_t m = batch * oh * ow, k = kh * kw * cin;
    if (m == 0 || cout == 0) return;
    Call<T> c;
    Fill(&c, kernel, scale, bias, m, k, cout, y);
    Partition(&c.p, WorkerThreads(ctx));
    const T* xd = x.flat<T>().data();
    const int64_t sh = strides_[0], sw = strides_[1], dh = dilations_[0], dw = dilations_[1];
    // im2col rows of output pixels r0 .. r0 + count.
    auto rows = [=](int64_t r0, int64_t count, float* buffer) {
      for (int64_t i = 0; i < count; ++i) {
        const int64_t pixel = r0 + i;
        const int64_t b = pixel / (oh * ow), rem = pixel % (oh * ow);
        const int64_t y0 = (rem / ow) * sh - ph, x0 = (rem % ow) * sw - pw;
        float* dst = buffer + i * k;
        for (int64_t a = 0; a < kh; ++a) {
          const int64_t iy = y0 + a * dh;
          for (int64_t e = 0; e < kw; ++e, dst += cin) {
            const int64_t ix = x0 + e * dw;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) {
              std::fill(dst, dst + cin, 0.0f);
              continue;
            }
            const T* src = xd + ((b * h + iy) * w + ix) * cin;
            for (int64_t ci = 0; ci < cin; ++ci) dst[ci] = static_cast<float>(src[ci]);
          }
        }
      }
      return static_cast<const float*>(buffer);
    };
    OP_REQUIRES_OK(ctx, RunCall(ctx, c, rows, true));
  }

 private:
  int64_t strides_[2] = {1, 1};
  int64_t dilations_[2] = {1, 1};
  bool same_ = false;
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Int8MatMul"), Int8MatMulOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Int8Conv2D"), Int8Conv2DOp)

}  // namespace int8_cpu
}  // namespace tfmetal_ext
