// CPU kernel of TfmetalExt>Gemv: y = x @ kernel (+ bias) for a few rows of x.
//
// The columns are cut into units, one per thread when there are few (a unit is a work item
// over TF's CPU thread pool). A unit keeps its rows' float32 sums in the thread's scratch
// (rows x width floats, in L1 at a decoding step's sizes) and walks the kernel rows k in
// increasing order, four at a time: each pass reads the unit's run of four kernel rows, which
// are contiguous in memory (a long sequential read per row, what the prefetchers follow), and
// adds their four products to each sum in k order. So every weight is read once per call (TF's
// MatMul packs the whole kernel for a one-row product first), and each output is tfmetal/gemv.h's
// chain: +0.0, then one fused multiply-add per k in increasing order. The AVX2 and AVX-512 loops
// do the same steps on 8 or 16 columns at once (a vector fma rounds each lane as the scalar
// fma does) and the baseline loop (arm64's, and TFMETAL_EXT_CPU_BASELINE=1) one column at a
// time: every level, thread count and the Metal kernel give the same bits.
//
// Helpers live in namespace gemv_cpu: all CPU kernel files are one translation unit
// (tfmetal_ext/ops/_loader.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/gemv.h"
#include "tfmetal/host_checks.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TFMETAL_GEMV_X86 1
#endif

namespace tfmetal_ext {
namespace gemv_cpu {

constexpr int64_t kAlign = 16;          // unit widths are multiples of one AVX-512 register
constexpr int64_t kSumFloats = 4096;    // rows x width of one unit's sums: 16 KB, in L1

struct Problem {
  int64_t m, k, n;
  const float* xf;  // the rows in float32, [M, K]
};

// One step of kernel rows w0..w3 (k, k+1, k+2, k+3) into the sum `s` of x row `xr`: four
// fused multiply-adds in k order.
#define TFMETAL_GEMV_FOUR_STEPS(s, xr, w0, w1, w2, w3, j)  \
  s = gemv_step(s, xr[0], ToFloat(w0[j]));                 \
  s = gemv_step(s, xr[1], ToFloat(w1[j]));                 \
  s = gemv_step(s, xr[2], ToFloat(w2[j]));                 \
  s = gemv_step(s, xr[3], ToFloat(w3[j]))

// The unit's sums `acc` (rows x width, row stride width) one column at a time: the baseline loop.
template <typename T>
inline void UnitBaseline(const Problem& p, const T* w, int64_t c0, int64_t width, float* acc) {
  int64_t kk = 0;
  for (; kk + 4 <= p.k; kk += 4) {
    const T* w0 = w + kk * p.n + c0;
    const T *w1 = w0 + p.n, *w2 = w1 + p.n, *w3 = w2 + p.n;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.xf + r * p.k + kk;
      float* a = acc + r * width;
      for (int64_t j = 0; j < width; ++j) {
        float s = a[j];
        TFMETAL_GEMV_FOUR_STEPS(s, xr, w0, w1, w2, w3, j);
        a[j] = s;
      }
    }
  }
  for (; kk < p.k; ++kk) {
    const T* w0 = w + kk * p.n + c0;
    for (int64_t r = 0; r < p.m; ++r) {
      const float xv = p.xf[r * p.k + kk];
      float* a = acc + r * width;
      for (int64_t j = 0; j < width; ++j) a[j] = gemv_step(a[j], xv, ToFloat(w0[j]));
    }
  }
}

#ifdef TFMETAL_GEMV_X86
#define TFMETAL_GEMV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TFMETAL_GEMV_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// 8 weights widened to float32 (exact).
TFMETAL_GEMV_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
TFMETAL_GEMV_AVX2 inline __m256 Load8(const ::Eigen::half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TFMETAL_GEMV_AVX2 inline __m256 Load8(const ::Eigen::bfloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// 16 weights widened to float32 (exact).
TFMETAL_GEMV_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
TFMETAL_GEMV_AVX512 inline __m512 Load16(const ::Eigen::half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TFMETAL_GEMV_AVX512 inline __m512 Load16(const ::Eigen::bfloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The vector loops: LANES columns a step (8: AVX2, 16: AVX-512), the last width % LANES one at a time.
#define TFMETAL_GEMV_VECTOR_UNIT(NAME, ATTR, VEC, LANES, LOAD, SET1, FMA, LOADF, STOREF)                     \
  template <typename T>                                                                                    \
  ATTR void NAME(const Problem& p, const T* w, int64_t c0, int64_t width, float* acc) {                   \
    const int64_t vec_end = width / LANES * LANES;                                                         \
    int64_t kk = 0;                                                                                        \
    for (; kk + 4 <= p.k; kk += 4) {                                                                       \
      const T* w0 = w + kk * p.n + c0;                                                                     \
      const T *w1 = w0 + p.n, *w2 = w1 + p.n, *w3 = w2 + p.n;                                              \
      for (int64_t r = 0; r < p.m; ++r) {                                                                  \
        const float* xr = p.xf + r * p.k + kk;                                                             \
        const VEC x0 = SET1(xr[0]), x1 = SET1(xr[1]), x2 = SET1(xr[2]), x3 = SET1(xr[3]);                  \
        float* a = acc + r * width;                                                                        \
        for (int64_t j = 0; j < vec_end; j += LANES) {                                                     \
          VEC s = LOADF(a + j);                                                                            \
          s = FMA(x0, LOAD(w0 + j), s);                                                                    \
          s = FMA(x1, LOAD(w1 + j), s);                                                                    \
          s = FMA(x2, LOAD(w2 + j), s);                                                                    \
          s = FMA(x3, LOAD(w3 + j), s);                                                                    \
          STOREF(a + j, s);                                                                                \
        }                                                                                                  \
        for (int64_t j = vec_end; j < width; ++j) {                                                        \
          float s = a[j];                                                                                  \
          TFMETAL_GEMV_FOUR_STEPS(s, xr, w0, w1, w2, w3, j);                                               \
          a[j] = s;                                                                                        \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    for (; kk < p.k; ++kk) {                                                                               \
      const T* w0 = w + kk * p.n + c0;                                                                     \
      for (int64_t r = 0; r < p.m; ++r) {                                                                  \
        const float xs = p.xf[r * p.k + kk];                                                               \
        const VEC xv = SET1(xs);                                                                           \
        float* a = acc + r * width;                                                                        \
        for (int64_t j = 0; j < vec_end; j += LANES) STOREF(a + j, FMA(xv, LOAD(w0 + j), LOADF(a + j)));  \
        for (int64_t j = vec_end; j < width; ++j) a[j] = gemv_step(a[j], xs, ToFloat(w0[j]));              \
      }                                                                                                    \
    }                                                                                                      \
  }

TFMETAL_GEMV_VECTOR_UNIT(UnitAvx2, TFMETAL_GEMV_AVX2, __m256, 8, Load8, _mm256_set1_ps, _mm256_fmadd_ps,
                         _mm256_loadu_ps, _mm256_storeu_ps)
TFMETAL_GEMV_VECTOR_UNIT(UnitAvx512, TFMETAL_GEMV_AVX512, __m512, 16, Load16, _mm512_set1_ps, _mm512_fmadd_ps,
                         _mm512_loadu_ps, _mm512_storeu_ps)
#undef TFMETAL_GEMV_VECTOR_UNIT

// The vector loops read half weights with F16C, which every AVX2 CPU has; checked all the same.
inline bool HasF16c() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return f16c;
}
#endif

template <typename T>
inline void RunUnit(CpuLevel level, const Problem& p, const T* w, int64_t c0, int64_t width, float* acc) {
#ifdef TFMETAL_GEMV_X86
  if (level == CpuLevel::kAvx512 && HasF16c()) return UnitAvx512(p, w, c0, width, acc);
  if (level == CpuLevel::kAvx2 && HasF16c()) return UnitAvx2(p, w, c0, width, acc);
#endif
  (void)level;
  UnitBaseline(p, w, c0, width, acc);
}

template <typename T>
class GemvOp : public OpKernel {
 public:
  explicit GemvOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("has_bias", &has_bias_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& kernel = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    const std::string error =
        GemvShapeError(x.shape().dim_sizes().data(), x.dims(), kernel.shape().dim_sizes().data(), kernel.dims(),
                       bias.shape().dim_sizes().data(), bias.dims(), has_bias_);
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
    const int64_t m = x.dim_size(0), k = x.dim_size(1), n = kernel.dim_size(1);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, n}), &y));
    if (m == 0 || n == 0) return;

    Problem p{m, k, n, nullptr};
    Tensor widened;
    if (std::is_same<T, float>::value) {
      p.xf = reinterpret_cast<const float*>(x.flat<T>().data());
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({m * k}), &widened));
      float* dst = widened.flat<float>().data();
      const T* src = x.flat<T>().data();
      for (int64_t i = 0; i < m * k; ++i) dst[i] = ToFloat(src[i]);
      p.xf = dst;
    }
    // Units: the columns split evenly over the threads (each a long run of every kernel row),
    // narrower where the rows' sums would outgrow kSumFloats.
    const int64_t threads = std::max<int64_t>(1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
    const int64_t cap = std::max<int64_t>(kAlign, kSumFloats / m / kAlign * kAlign);
    const int64_t even = (n + threads - 1) / threads;
    const int64_t width = std::min(cap, (even + kAlign - 1) / kAlign * kAlign);
    const int64_t units = (n + width - 1) / width;
    const int64_t cost = std::max<int64_t>(1, (m + 1) * k * width / 4);
    const T* w = kernel.flat<T>().data();
    const T* b = has_bias_ ? bias.flat<T>().data() : nullptr;
    T* out = y->flat<T>().data();
    const CpuLevel level = CpuVectorLevel();
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, units, cost, m * width, [&](int64_t begin, int64_t end,
                                                                               float* acc) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t c0 = unit * width, cols = std::min(width, n - c0);
        std::fill(acc, acc + m * cols, 0.0f);  // +0.0: where every chain starts
        RunUnit(level, p, w, c0, cols, acc);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t j = 0; j < cols; ++j) {
            const float bj = has_bias_ ? ToFloat(b[c0 + j]) : 0.0f;
            out[r * n + c0 + j] = FromFloat<T>(gemv_finish(acc[r * cols + j], bj, has_bias_));
          }
        }
      }
    }));
  }

 private:
  bool has_bias_ = false;
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Gemv"), GemvOp)

}  // namespace gemv_cpu
}  // namespace tfmetal_ext
