// CPU kernels of TfmetalExt>LayerNorm and TfmetalExt>LayerNormGrad.
//
// Rows are independent and contiguous, so both ops split rows over TF's CPU
// thread pool, and a row (a few KB) stays in L1 between its passes: each
// input is read from memory once and each output written once. Half inputs
// are widened to float32 once per row into a per-thread scratch buffer (one
// temp tensor, so running out of memory fails the op instead of the process).
//
// Every row loop vectorizes (checked with -fopt-info-vec): row sums use
// kLanes independent accumulators (no -ffast-math needed), and the half
// conversions are branch-free bit arithmetic. On x86-64 the loops are also
// compiled for AVX2 and picked at run time. The rounding order is fixed by the
// code, not by the thread count or the ISA: the gradient's dgamma/dbeta are
// summed per fixed block of rows (the partition depends on the shape only)
// and the block partials added in block order, so results are bitwise the
// same on any number of threads.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/layer_norm.h"

namespace tfmetal_ext {
namespace {

constexpr int kLanes = 16;
// Gradient blocks: at most kMaxBlocks, each of at least kMinBlockElements
// elements and kMinBlockRows rows (bounds the partials to half of a float x).
constexpr int64_t kMaxBlocks = 64;
constexpr int64_t kMinBlockElements = 1 << 15;
constexpr int64_t kMinBlockRows = 4;
// Rough cycles per element, for the thread pool's sharding.
constexpr int64_t kForwardCost = 8;
constexpr int64_t kBackwardCost = 12;

// The row loops are inlined into per-ISA entry points (see ForwardRows).
#define TFMETAL_LN_INLINE inline __attribute__((always_inline))

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Adds the lanes pairwise, in a fixed order.
TFMETAL_LN_INLINE float ReduceLanes(float* acc) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

TFMETAL_LN_INLINE float RowSumShifted(const float* __restrict x, int64_t n, float shift) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] - shift;
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j] - shift;
  return ReduceLanes(acc);
}

TFMETAL_LN_INLINE float SquaredDeviation(float x, float mean) {
  const float d = x - mean;
  return d * d;
}

TFMETAL_LN_INLINE float RowSumSquaredDeviations(const float* __restrict x, int64_t n, float mean) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += SquaredDeviation(x[i + j], mean);
  for (int j = 0; i + j < n; ++j) acc[j] += SquaredDeviation(x[i + j], mean);
  return ReduceLanes(acc);
}

// Half conversions as branch-free bit arithmetic, so the row loops vectorize
// (Eigen's scalar conversions do not, without F16C in the baseline flags).
// Same results as Eigen's: round to nearest even, NaN -> a quiet NaN.
TFMETAL_LN_INLINE uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TFMETAL_LN_INLINE float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// All-ones where `condition`, else 0: selects without branches (g++ keeps a
// branch around a conditional float op under -ftrapping-math, and a branch
// stops vectorization).
TFMETAL_LN_INLINE uint32_t MaskIf(bool condition) { return 0u - static_cast<uint32_t>(condition); }

TFMETAL_LN_INLINE uint32_t Select(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

TFMETAL_LN_INLINE float WidenHalf(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  uint32_t normal = (em << 13) + (112u << 23);                      // rebias 15 -> 127
  normal += MaskIf(em >= 0x7c00u) & (112u << 23);                   // Inf / NaN: exponent 255
  const float subnormal = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;  // em * 2^-24
  const uint32_t magnitude = Select(MaskIf(em < 0x0400u), FloatBits(subnormal), normal);
  return BitsFloat(magnitude | ((h & 0x8000u) << 16));
}

TFMETAL_LN_INLINE uint16_t NarrowHalf(float value) {
  const uint32_t bits = FloatBits(value);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t f = bits ^ sign;
  const uint32_t special = Select(MaskIf(f > (255u << 23)), 0x7e00u, 0x7c00u);  // NaN / overflow to Inf
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t subnormal = FloatBits(BitsFloat(f) + BitsFloat(denorm_magic)) - denorm_magic;
  const uint32_t normal = (f + ((15u - 127u) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
  const uint32_t finite = Select(MaskIf(f < (113u << 23)), subnormal, normal);
  return static_cast<uint16_t>(Select(MaskIf(f >= ((127u + 16u) << 23)), special, finite) | (sign >> 16));
}

TFMETAL_LN_INLINE float WidenBfloat16(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

TFMETAL_LN_INLINE uint16_t NarrowBfloat16(float value) {
  const uint32_t u = FloatBits(value);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<uint16_t>(Select(MaskIf((u & 0x7fffffffu) > 0x7f800000u), nan, rounded));
}

template <typename T>
TFMETAL_LN_INLINE uint16_t Bits16(T v) {
  uint16_t b;
  std::memcpy(&b, &v, 2);
  return b;
}

template <typename T>
TFMETAL_LN_INLINE T FromBits16(uint16_t b) {
  T v;
  std::memcpy(static_cast<void*>(&v), &b, 2);
  return v;
}

TFMETAL_LN_INLINE float Widen(float v) { return v; }
TFMETAL_LN_INLINE float Widen(Eigen::half v) { return WidenHalf(Bits16(v)); }
TFMETAL_LN_INLINE float Widen(Eigen::bfloat16 v) { return WidenBfloat16(Bits16(v)); }

template <typename T>
struct Narrow;
template <>
struct Narrow<float> {
  static TFMETAL_LN_INLINE float Of(float v) { return v; }
};
template <>
struct Narrow<Eigen::half> {
  static TFMETAL_LN_INLINE Eigen::half Of(float v) { return FromBits16<Eigen::half>(NarrowHalf(v)); }
};
template <>
struct Narrow<Eigen::bfloat16> {
  static TFMETAL_LN_INLINE Eigen::bfloat16 Of(float v) { return FromBits16<Eigen::bfloat16>(NarrowBfloat16(v)); }
};

// The row as float32: the row itself for float, else widened into `scratch`.
TFMETAL_LN_INLINE const float* RowAsFloat(const float* row, int64_t, float*) { return row; }

template <typename T>
TFMETAL_LN_INLINE const float* RowAsFloat(const T* row, int64_t n, float* __restrict scratch) {
  for (int64_t c = 0; c < n; ++c) scratch[c] = Widen(row[c]);
  return scratch;
}

template <typename T>
TFMETAL_LN_INLINE void ForwardRow(const float* __restrict x, int64_t n, float inv_n, float epsilon,
                                  const float* __restrict gamma, const float* __restrict beta, T* __restrict y,
                                  float* mean_out, float* rstd_out) {
  const float mean = layer_norm_mean(x[0], RowSumShifted(x, n, x[0]), inv_n);
  const float rstd = layer_norm_rstd(RowSumSquaredDeviations(x, n, mean), inv_n, epsilon);
  for (int64_t c = 0; c < n; ++c) {
    y[c] = Narrow<T>::Of(layer_norm_forward(x[c], mean, rstd, gamma[c], beta[c]));
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// The first pass of BackwardRow over column c: dy * gamma and dy * gamma * xhat
// summed into lane j, dy * xhat and dy added into dgamma / dbeta.
TFMETAL_LN_INLINE void BackwardColumn(const float* __restrict dy, const float* __restrict x,
                                      const float* __restrict gamma, float mean, float rstd, int64_t c, int j,
                                      float* __restrict sum_g, float* __restrict sum_gx, float* __restrict dgamma,
                                      float* __restrict dbeta) {
  const float xhat = layer_norm_xhat(x[c], mean, rstd);
  const float g = dy[c] * gamma[c];
  sum_g[j] += g;
  sum_gx[j] += g * xhat;
  dgamma[c] += dy[c] * xhat;
  dbeta[c] += dy[c];
}

// dx of one row, and the row's dy * xhat and dy added into dgamma / dbeta.
template <typename T>
TFMETAL_LN_INLINE void BackwardRow(const float* __restrict dy, const float* __restrict x, int64_t n, float inv_n,
                                   const float* __restrict gamma, float mean, float rstd, T* __restrict dx,
                                   float* __restrict dgamma, float* __restrict dbeta) {
  float sum_g[kLanes] = {};
  float sum_gx[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) BackwardColumn(dy, x, gamma, mean, rstd, i + j, j, sum_g, sum_gx, dgamma, dbeta);
  for (int j = 0; i + j < n; ++j) BackwardColumn(dy, x, gamma, mean, rstd, i + j, j, sum_g, sum_gx, dgamma, dbeta);
  const float mean_g = ReduceLanes(sum_g) * inv_n;
  const float mean_gx = ReduceLanes(sum_gx) * inv_n;
  for (int64_t c = 0; c < n; ++c) {
    const float xhat = layer_norm_xhat(x[c], mean, rstd);
    dx[c] = Narrow<T>::Of(layer_norm_backward(dy[c], gamma[c], xhat, rstd, mean_g, mean_gx));
  }
}

// What one shard of the forward op works on.
template <typename T>
struct ForwardArgs {
  const T* x;
  const float* gamma;
  const float* beta;
  T* y;
  float* mean;
  float* rstd;
  int64_t n;  // C
  float inv_n;
  float epsilon;
};

// Floats of scratch per thread: a row widened to float (none for float).
template <typename T>
constexpr int64_t ForwardScratch(int64_t n) { return std::is_same<T, float>::value ? 0 : n; }

// `scratch`: ForwardScratch<T>(a.n) floats of this thread's own.
template <typename T>
TFMETAL_LN_INLINE void ForwardRowsImpl(const ForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = RowAsFloat(a.x + r * a.n, a.n, scratch);
    ForwardRow<T>(xr, a.n, a.inv_n, a.epsilon, a.gamma, a.beta, a.y + r * a.n, a.mean + r, a.rstd + r);
  }
}

// What one shard of the gradient op works on: blocks of rows_per_block rows;
// block b adds its dgamma / dbeta into partial + b * 2 * n (dgamma, then dbeta).
template <typename T>
struct BackwardArgs {
  const T* dy;
  const T* x;
  const float* gamma;
  const float* mean;
  const float* rstd;
  T* dx;
  float* partial;
  int64_t rows;
  int64_t rows_per_block;
  int64_t n;
  float inv_n;
};

// Floats of scratch per thread: dy's and x's rows widened to float (none for float).
template <typename T>
constexpr int64_t BackwardScratch(int64_t n) { return std::is_same<T, float>::value ? 0 : 2 * n; }

// `scratch`: BackwardScratch<T>(a.n) floats of this thread's own.
template <typename T>
TFMETAL_LN_INLINE void BackwardBlocksImpl(const BackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t n = a.n;
  float* dy_scratch = scratch;
  float* x_scratch = scratch != nullptr ? scratch + n : nullptr;
  for (int64_t block = begin; block < end; ++block) {
    float* dgamma = a.partial + block * 2 * n;
    float* dbeta = dgamma + n;
    std::fill(dgamma, dgamma + 2 * n, 0.0f);
    const int64_t last = std::min(a.rows, (block + 1) * a.rows_per_block);
    for (int64_t r = block * a.rows_per_block; r < last; ++r) {
      const float* dyr = RowAsFloat(a.dy + r * n, n, dy_scratch);
      const float* xr = RowAsFloat(a.x + r * n, n, x_scratch);
      BackwardRow<T>(dyr, xr, n, a.inv_n, a.gamma, a.mean[r], a.rstd[r], a.dx + r * n, dgamma, dbeta);
    }
  }
}

// Each loop is compiled for the baseline ISA and, on x86-64, once more for
// AVX2 (twice the vector width of the SSE2 baseline), picked at run time.
// Both give the same results: the summation order is the same, and the
// compiler does not contract to FMA under -std=c++17.
template <typename T>
void ForwardRowsBaseline(const ForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  ForwardRowsImpl(a, begin, end, scratch);
}

template <typename T>
void BackwardBlocksBaseline(const BackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  BackwardBlocksImpl(a, begin, end, scratch);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TFMETAL_LN_AVX2 1
template <typename T>
__attribute__((target("avx2"))) void ForwardRowsAvx2(const ForwardArgs<T>& a, int64_t begin, int64_t end,
                                                     float* scratch) {
  ForwardRowsImpl(a, begin, end, scratch);
}

template <typename T>
__attribute__((target("avx2"))) void BackwardBlocksAvx2(const BackwardArgs<T>& a, int64_t begin, int64_t end,
                                                        float* scratch) {
  BackwardBlocksImpl(a, begin, end, scratch);
}

#endif

// The AVX2 loops where cpu_common.h's level allows them; the tests compare them with the baseline
// loops (TFMETAL_EXT_CPU_BASELINE=1), which are also what arm64 runs, NEON-vectorized.
template <typename T>
void ForwardRows(const ForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
#ifdef TFMETAL_LN_AVX2
  if (CpuUseAvx2()) return ForwardRowsAvx2(a, begin, end, scratch);
#endif
  ForwardRowsBaseline(a, begin, end, scratch);
}

template <typename T>
void BackwardBlocks(const BackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
#ifdef TFMETAL_LN_AVX2
  if (CpuUseAvx2()) return BackwardBlocksAvx2(a, begin, end, scratch);
#endif
  BackwardBlocksBaseline(a, begin, end, scratch);
}

template <typename T>
class LayerNormOp : public OpKernel {
 public:
  explicit LayerNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES(ctx, std::isfinite(epsilon_) && epsilon_ > 0.0f,
                errors::InvalidArgument("epsilon must be finite and > 0, got ", epsilon_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    const Tensor& beta = ctx->input(2);
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, RowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(beta, "beta", channels, "the last dimension of x"));
    Tensor *y = nullptr, *mean_t = nullptr, *rstd_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rows}), &mean_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({rows}), &rstd_t));
    ForwardArgs<T> a;
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.beta = beta.flat<float>().data();
    a.y = y->flat<T>().data();
    a.mean = mean_t->flat<float>().data();
    a.rstd = rstd_t->flat<float>().data();
    a.n = channels;
    a.inv_n = layer_norm_inv_count(static_cast<float>(channels));
    a.epsilon = epsilon_;
    if (channels == 0) {  // empty rows: mean 0, variance 0
      for (int64_t r = 0; r < rows; ++r) {
        a.mean[r] = 0.0f;
        a.rstd[r] = layer_norm_rstd(0.0f, 0.0f, a.epsilon);
      }
      return;
    }
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, rows, kForwardCost * channels, ForwardScratch<T>(channels),
                                               [&a](int64_t begin, int64_t end, float* scratch) {
                                                 ForwardRows(a, begin, end, scratch);
                                               }));
  }

 private:
  float epsilon_ = 0.0f;
};

template <typename T>
class LayerNormGradOp : public OpKernel {
 public:
  explicit LayerNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& mean = ctx->input(3);
    const Tensor& rstd = ctx->input(4);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                errors::InvalidArgument("dy and x must have the same shape, got ", dy.shape().DebugString(), " and ",
                                        x.shape().DebugString()));
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, RowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(mean, "mean", rows, "the number of rows of x"));
    OP_REQUIRES_OK(ctx, CheckVector(rstd, "rstd", rows, "the number of rows of x"));
    Tensor *dx = nullptr, *dgamma_t = nullptr, *dbeta_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({channels}), &dgamma_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({channels}), &dbeta_t));
    float* dgamma = dgamma_t->flat<float>().data();
    float* dbeta = dbeta_t->flat<float>().data();
    const int64_t n = channels;
    if (rows == 0 || n == 0) {
      std::fill(dgamma, dgamma + n, 0.0f);
      std::fill(dbeta, dbeta + n, 0.0f);
      return;
    }
    BackwardArgs<T> a;
    a.dy = dy.flat<T>().data();
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.mean = mean.flat<float>().data();
    a.rstd = rstd.flat<float>().data();
    a.dx = dx->flat<T>().data();
    a.rows = rows;
    a.n = n;
    a.inv_n = layer_norm_inv_count(static_cast<float>(n));
    // A fixed partition of the rows into blocks, from the shape only.
    a.rows_per_block = std::max({CeilDiv(rows, kMaxBlocks), CeilDiv(kMinBlockElements, n), kMinBlockRows});
    const int64_t blocks = CeilDiv(rows, a.rows_per_block);
    Tensor partial_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({blocks * 2 * n}), &partial_t));
    a.partial = partial_t.flat<float>().data();
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, blocks, kBackwardCost * a.rows_per_block * n,
                                               BackwardScratch<T>(n), [&a](int64_t begin, int64_t end, float* scratch) {
                                                 BackwardBlocks(a, begin, end, scratch);
                                               }));
    // The block partials, added in block order.
    const float* partial = a.partial;
    ParallelFor(ctx, n, 2 * blocks, [=](int64_t begin, int64_t end) {
      std::fill(dgamma + begin, dgamma + end, 0.0f);
      std::fill(dbeta + begin, dbeta + end, 0.0f);
      for (int64_t block = 0; block < blocks; ++block) {
        const float* dg = partial + block * 2 * n;
        const float* db = dg + n;
        for (int64_t c = begin; c < end; ++c) {
          dgamma[c] += dg[c];
          dbeta[c] += db[c];
        }
      }
    });
  }
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>LayerNorm"), LayerNormOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>LayerNormGrad"), LayerNormGradOp)

}  // namespace
}  // namespace tfmetal_ext
