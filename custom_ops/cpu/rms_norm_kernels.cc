// CPU kernels of TfmetalExt>RMSNorm and TfmetalExt>RMSNormGrad.
//
// Rows are independent and contiguous: both ops split rows over TF's CPU
// thread pool, and a row stays in cache between its passes. Half and bfloat16
// rows are widened to float32 once per row into a per-thread scratch buffer
// (one temp tensor: running out of memory fails the op, not the process).
// Row sums use kLanes independent accumulators added pairwise in a fixed
// order, so they vectorize without -ffast-math and the rounding does not
// depend on the thread count. dgamma is summed per fixed block of rows (the
// partition depends on the shape only) and the block partials are added in
// block order: bitwise the same on any number of threads.
//
// Helpers live in namespace rms_norm_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/rms_norm.h"

namespace tfmetal_ext {
namespace rms_norm_cpu {

constexpr int kLanes = 16;
// dgamma blocks: at most kMaxBlocks, each of at least kMinBlockElements
// elements and kMinBlockRows rows.
constexpr int64_t kMaxBlocks = 64;
constexpr int64_t kMinBlockElements = 1 << 15;
constexpr int64_t kMinBlockRows = 4;
// Rough cycles per element, for the thread pool's sharding.
constexpr int64_t kForwardCost = 6;
constexpr int64_t kBackwardCost = 10;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Adds the lanes pairwise, in a fixed order.
inline float SumLanes(float* acc) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

inline float RowSumSquares(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j] * x[i + j];
  return SumLanes(acc);
}

// The row as float32: the row itself for float, else widened into `scratch`.
inline const float* RowAsFloat(const float* row, int64_t, float*) { return row; }

template <typename T>
inline const float* RowAsFloat(const T* row, int64_t n, float* __restrict scratch) {
  for (int64_t c = 0; c < n; ++c) scratch[c] = static_cast<float>(row[c]);
  return scratch;
}

// Floats of scratch per thread for `rows_needed` widened rows (none for float).
template <typename T>
constexpr int64_t ScratchFloats(int64_t n, int64_t rows_needed) {
  return std::is_same<T, float>::value ? 0 : rows_needed * n;
}

template <typename T>
struct ForwardArgs {
  const T* x;
  const float* gamma;
  T* y;
  float* rstd;
  int64_t n;  // C
  float inv_n;
  float epsilon;
};

template <typename T>
void ForwardRows(const ForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t n = a.n;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = RowAsFloat(a.x + r * n, n, scratch);
    const float rstd = rms_norm_rstd(RowSumSquares(x, n), a.inv_n, a.epsilon);
    T* y = a.y + r * n;
    for (int64_t c = 0; c < n; ++c) y[c] = static_cast<T>(rms_norm_forward(x[c], rstd, a.gamma[c]));
    a.rstd[r] = rstd;
  }
}

// Block b of rows_per_block rows adds its dy * xhat into partial + b * n.
template <typename T>
struct BackwardArgs {
  const T* dy;
  const T* x;
  const float* gamma;
  const float* rstd;
  T* dx;
  float* partial;
  int64_t rows;
  int64_t rows_per_block;
  int64_t n;
  float inv_n;
};

// dx of one row; the row's dy * xhat added into dgamma.
template <typename T>
inline void BackwardRow(const float* __restrict dy, const float* __restrict x, const BackwardArgs<T>& a, float rstd,
                        T* __restrict dx, float* __restrict dgamma) {
  const int64_t n = a.n;
  const float* __restrict gamma = a.gamma;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float xhat = rms_norm_xhat(x[i + j], rstd);
      acc[j] += dy[i + j] * gamma[i + j] * xhat;
      dgamma[i + j] += dy[i + j] * xhat;
    }
  }
  for (int j = 0; i + j < n; ++j) {
    const float xhat = rms_norm_xhat(x[i + j], rstd);
    acc[j] += dy[i + j] * gamma[i + j] * xhat;
    dgamma[i + j] += dy[i + j] * xhat;
  }
  const float mean_gxhat = SumLanes(acc) * a.inv_n;
  for (int64_t c = 0; c < n; ++c) {
    dx[c] = static_cast<T>(rms_norm_backward(dy[c], gamma[c], rms_norm_xhat(x[c], rstd), rstd, mean_gxhat));
  }
}

template <typename T>
void BackwardBlocks(const BackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t n = a.n;
  float* dy_scratch = scratch;
  float* x_scratch = scratch != nullptr ? scratch + n : nullptr;
  for (int64_t block = begin; block < end; ++block) {
    float* dgamma = a.partial + block * n;
    std::fill(dgamma, dgamma + n, 0.0f);
    const int64_t last = std::min(a.rows, (block + 1) * a.rows_per_block);
    for (int64_t r = block * a.rows_per_block; r < last; ++r) {
      const float* dy = RowAsFloat(a.dy + r * n, n, dy_scratch);
      const float* x = RowAsFloat(a.x + r * n, n, x_scratch);
      BackwardRow<T>(dy, x, a, a.rstd[r], a.dx + r * n, dgamma);
    }
  }
}

template <typename T>
class RMSNormOp : public OpKernel {
 public:
  explicit RMSNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES(ctx, std::isfinite(epsilon_) && epsilon_ > 0.0f,
                errors::InvalidArgument("epsilon must be finite and > 0, got ", epsilon_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, RowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    Tensor *y = nullptr, *rstd_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rows}), &rstd_t));
    ForwardArgs<T> a;
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.y = y->flat<T>().data();
    a.rstd = rstd_t->flat<float>().data();
    a.n = channels;
    a.inv_n = rms_norm_inv_count(static_cast<float>(channels));
    a.epsilon = epsilon_;
    if (channels == 0) {  // empty rows: a zero mean square
      for (int64_t r = 0; r < rows; ++r) a.rstd[r] = rms_norm_rstd(0.0f, 0.0f, a.epsilon);
      return;
    }
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, rows, kForwardCost * channels, ScratchFloats<T>(channels, 1),
                                               [&a](int64_t begin, int64_t end, float* scratch) {
                                                 ForwardRows(a, begin, end, scratch);
                                               }));
  }

 private:
  float epsilon_ = 0.0f;
};

template <typename T>
class RMSNormGradOp : public OpKernel {
 public:
  explicit RMSNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& gamma = ctx->input(2);
    const Tensor& rstd = ctx->input(3);
    OP_REQUIRES(ctx, dy.shape() == x.shape(),
                errors::InvalidArgument("dy and x must have the same shape, got ", dy.shape().DebugString(), " and ",
                                        x.shape().DebugString()));
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, RowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(rstd, "rstd", rows, "the number of rows of x"));
    Tensor *dx = nullptr, *dgamma_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({channels}), &dgamma_t));
    float* dgamma = dgamma_t->flat<float>().data();
    const int64_t n = channels;
    if (rows == 0 || n == 0) {
      std::fill(dgamma, dgamma + n, 0.0f);
      return;
    }
    BackwardArgs<T> a;
    a.dy = dy.flat<T>().data();
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.rstd = rstd.flat<float>().data();
    a.dx = dx->flat<T>().data();
    a.rows = rows;
    a.n = n;
    a.inv_n = rms_norm_inv_count(static_cast<float>(n));
    // A fixed partition of the rows into blocks, from the shape only.
    a.rows_per_block = std::max({CeilDiv(rows, kMaxBlocks), CeilDiv(kMinBlockElements, n), kMinBlockRows});
    const int64_t blocks = CeilDiv(rows, a.rows_per_block);
    Tensor partial_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({blocks * n}), &partial_t));
    a.partial = partial_t.flat<float>().data();
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, blocks, kBackwardCost * a.rows_per_block * n,
                                               ScratchFloats<T>(n, 2), [&a](int64_t begin, int64_t end, float* scratch) {
                                                 BackwardBlocks(a, begin, end, scratch);
                                               }));
    // The block partials, added in block order.
    const float* partial = a.partial;
    ParallelFor(ctx, n, blocks, [=](int64_t begin, int64_t end) {
      std::fill(dgamma + begin, dgamma + end, 0.0f);
      for (int64_t block = 0; block < blocks; ++block) {
        const float* dg = partial + block * n;
        for (int64_t c = begin; c < end; ++c) dgamma[c] += dg[c];
      }
    });
  }
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>RMSNorm"), RMSNormOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>RMSNormGrad"), RMSNormGradOp)

}  // namespace rms_norm_cpu
}  // namespace tfmetal_ext
