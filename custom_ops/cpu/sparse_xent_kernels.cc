// CPU kernels of TfmetalExt>SparseSoftmaxCrossEntropy and its gradient op.
//
// Rows are independent: both ops split rows over TF's CPU thread pool. Half
// and bfloat16 rows are widened to float32 once per row into a per-thread
// scratch buffer (one temp tensor). The forward op reads a row twice (its max,
// then its sum of exp(x - max)), each with kLanes independent accumulators
// combined pairwise in a fixed order: the loops vectorize without
// -ffast-math, and the result depends on the shape only, not on the thread
// count. The gradient op writes each element from the shared formula
// (tfmetal/sparse_xent.h), the Metal kernel's per-element operations: the same
// bits for the same statistics. Its output takes over the logits' buffer when
// nothing else reads them.
//
// On x86-64 the row loops are also compiled for AVX2 (not FMA, which would
// contract a * b + c differently from the baseline build and the emulator)
// and chosen at run time, like the elementwise kernels.
//
// Helpers live in namespace sparse_xent_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/host_checks.h"
#include "tfmetal/sparse_xent.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace tfmetal_ext {
namespace sparse_xent_cpu {

constexpr int kLanes = 16;
// Rough cycles per logit (two reads, an exp polynomial), for the thread pool's sharding.
constexpr int64_t kForwardCost = 10;
constexpr int64_t kBackwardCost = 10;

// The row's max and sum of exp(x - max).
struct RowStats {
  float max;
  float sum;
};

// Lane j of `m` (kLanes of them) gets the max of the elements i with
// i % kLanes == j: the plain loop, which compilers do not vectorize as a
// compare-and-select chain.
inline __attribute__((always_inline)) void MaxLanes(const float* __restrict x, int64_t n, float* m) {
  for (int j = 0; j < kLanes; ++j) m[j] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) m[j] = sparse_xent_max(m[j], x[i + j]);
  for (int j = 0; i + j < n; ++j) m[j] = sparse_xent_max(m[j], x[i + j]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// MaxLanes in two AVX registers of 8 lanes (lanes 0-7 and 8-15). MAXPS(a, b)
// is a > b ? a : b, sparse_xent_max(m, x) with a = x: the same lanes, the
// same values.
__attribute__((target("avx2"))) inline void MaxLanesAvx2(const float* __restrict x, int64_t n, float* m) {
  __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 hi = lo;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    lo = _mm256_max_ps(_mm256_loadu_ps(x + i), lo);
    hi = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), hi);
  }
  _mm256_storeu_ps(m, lo);
  _mm256_storeu_ps(m + 8, hi);
  for (int j = 0; i + j < n; ++j) m[j] = sparse_xent_max(m[j], x[i + j]);
}
#endif

template <bool kAvx2>
inline __attribute__((always_inline)) RowStats Stats(const float* __restrict x, int64_t n) {
  float m[kLanes];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if constexpr (kAvx2) {
    MaxLanesAvx2(x, n, m);
  } else {
    MaxLanes(x, n, m);
  }
#else
  MaxLanes(x, n, m);
#endif
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) m[j] = sparse_xent_max(m[j], m[j + width]);
  const float row_max = m[0];
  float s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) s[j] += sparse_xent_term(x[i + j], row_max);
  for (int j = 0; i + j < n; ++j) s[j] += sparse_xent_term(x[i + j], row_max);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) s[j] += s[j + width];
  return {row_max, s[0]};
}

// dx of a row from its statistics. For float, `dx` may be the logits' own
// buffer (forwarded): then the row is updated in place through one pointer,
// and the label's element is made before the loop overwrites its logit.
template <typename T>
inline __attribute__((always_inline)) void GradRow(const float* x, int64_t n, float row_max, float inv_sum,
                                                   int64_t label, float dloss, T* dx) {
  const float at_label = sparse_xent_grad(x[label], row_max, inv_sum, true, dloss);
  if constexpr (std::is_same<T, float>::value) {
    if (x == dx) {
      float* p = dx;
      for (int64_t j = 0; j < n; ++j) p[j] = sparse_xent_grad(p[j], row_max, inv_sum, false, dloss);
      p[label] = at_label;
      return;
    }
  }
  const float* __restrict in = x;
  T* __restrict out = dx;
  for (int64_t j = 0; j < n; ++j) out[j] = FromFloat<T>(sparse_xent_grad(in[j], row_max, inv_sum, false, dloss));
  out[label] = FromFloat<T>(at_label);
}

// The row as float32: the row itself for float, else widened into `scratch`.
inline const float* Widen(const float* row, int64_t, float*) { return row; }

template <typename T>
inline const float* Widen(const T* row, int64_t n, float* __restrict scratch) {
  for (int64_t c = 0; c < n; ++c) scratch[c] = static_cast<float>(row[c]);
  return scratch;
}

template <typename T>
constexpr int64_t ScratchFloats(int64_t n) {
  return std::is_same<T, float>::value ? 0 : n;
}

template <typename T, typename Label>
struct Args {
  const T* logits;
  const Label* labels;
  const T* dloss;        // the gradient op's
  const float* row_max;  // the gradient op's
  const float* row_sum;  // the gradient op's
  T* out;                // loss [rows] or dlogits [rows, classes]
  float* out_max;        // the forward op's
  float* out_sum;        // the forward op's
  int64_t classes;
};

template <bool kAvx2, typename T, typename Label>
inline __attribute__((always_inline)) void ForwardLoop(const Args<T, Label>& a, int64_t begin, int64_t end,
                                                       float* scratch) {
  const int64_t n = a.classes;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = Widen(a.logits + r * n, n, scratch);
    const RowStats st = Stats<kAvx2>(x, n);
    a.out[r] = FromFloat<T>(sparse_xent_loss(st.sum, st.max, x[a.labels[r]]));
    a.out_max[r] = st.max;
    a.out_sum[r] = st.sum;
  }
}

template <typename T, typename Label>
inline __attribute__((always_inline)) void GradLoop(const Args<T, Label>& a, int64_t begin, int64_t end,
                                                    float* scratch) {
  const int64_t n = a.classes;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = Widen(a.logits + r * n, n, scratch);
    GradRow<T>(x, n, a.row_max[r], 1.0f / a.row_sum[r], static_cast<int64_t>(a.labels[r]), ToFloat(a.dloss[r]),
               a.out + r * n);
  }
}

// Rows [begin, end) of the forward (kGrad false) or gradient op, in portable code.
template <bool kGrad, typename T, typename Label>
void RowsBaseline(const Args<T, Label>& a, int64_t begin, int64_t end, float* scratch) {
  if constexpr (kGrad) {
    GradLoop(a, begin, end, scratch);
  } else {
    ForwardLoop<false>(a, begin, end, scratch);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same, compiled for AVX2 (the forward's max with AVX2 intrinsics).
template <bool kGrad, typename T, typename Label>
__attribute__((target("avx2"))) void RowsAvx2(const Args<T, Label>& a, int64_t begin, int64_t end, float* scratch) {
  if constexpr (kGrad) {
    GradLoop(a, begin, end, scratch);
  } else {
    ForwardLoop<true>(a, begin, end, scratch);
  }
}
#endif

// Every row of either op over TF's pool (a row of scratch per thread for half and bfloat16), in the
// highest vector level this CPU runs.
template <bool kGrad, typename T, typename Label>
Status RunRows(OpKernelContext* ctx, const Args<T, Label>& a, int64_t rows) {
  auto loop = &RowsBaseline<kGrad, T, Label>;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (CpuUseAvx2()) loop = &RowsAvx2<kGrad, T, Label>;
#endif
  const int64_t cost = (kGrad ? kBackwardCost : kForwardCost) * a.classes;
  return ParallelForWithScratch(ctx, rows, cost, ScratchFloats<T>(a.classes),
                                [&a, loop](int64_t begin, int64_t end, float* scratch) { loop(a, begin, end, scratch); });
}

// The shapes and labels, checked in TensorFlow's order and words (tfmetal/host_checks.h).
template <typename Label>
Status CheckOperands(const Tensor& logits, const Tensor& labels) {
  std::string error = SparseXentShapeError(logits.shape().dim_sizes().data(), logits.dims(),
                                           labels.shape().dim_sizes().data(), labels.dims());
  if (error.empty()) error = SparseXentLabelError(labels.flat<Label>().data(), logits.dim_size(0), logits.dim_size(1));
  return error.empty() ? Status() : errors::InvalidArgument(error);
}

template <typename T, typename Label>
class SparseXentOp : public OpKernel {
 public:
  explicit SparseXentOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& logits = ctx->input(0);
    const Tensor& labels = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckOperands<Label>(logits, labels));
    const int64_t rows = logits.dim_size(0);
    Tensor *loss = nullptr, *row_max = nullptr, *row_sum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows}), &loss));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rows}), &row_max));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({rows}), &row_sum));
    Args<T, Label> a{};
    a.logits = logits.flat<T>().data();
    a.labels = labels.flat<Label>().data();
    a.out = loss->flat<T>().data();
    a.out_max = row_max->flat<float>().data();
    a.out_sum = row_sum->flat<float>().data();
    a.classes = logits.dim_size(1);
    OP_REQUIRES_OK(ctx, (RunRows<false, T, Label>(ctx, a, rows)));
  }
};

template <typename T, typename Label>
class SparseXentGradOp : public OpKernel {
 public:
  explicit SparseXentGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dloss = ctx->input(0);
    const Tensor& logits = ctx->input(1);
    const Tensor& labels = ctx->input(2);
    const Tensor& row_max = ctx->input(3);
    const Tensor& row_sum = ctx->input(4);
    OP_REQUIRES_OK(ctx, CheckOperands<Label>(logits, labels));
    const int64_t rows = logits.dim_size(0);
    for (const auto& v : {std::make_pair("dloss", &dloss), std::make_pair("row_max", &row_max),
                          std::make_pair("row_sum", &row_sum)}) {
      const std::string error =
          SparseXentRowVectorError(v.first, v.second->shape().dim_sizes().data(), v.second->dims(), rows);
      OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
    }
    Tensor* dlogits = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, logits.shape(), &dlogits));
    Args<T, Label> a{};
    a.logits = logits.flat<T>().data();
    a.labels = labels.flat<Label>().data();
    a.dloss = dloss.flat<T>().data();
    a.row_max = row_max.flat<float>().data();
    a.row_sum = row_sum.flat<float>().data();
    a.out = dlogits->flat<T>().data();
    a.classes = logits.dim_size(1);
    OP_REQUIRES_OK(ctx, (RunRows<true, T, Label>(ctx, a, rows)));
  }
};

#define TFMETAL_EXT_REGISTER_SPARSE_XENT(T, Label)                                                              \
  REGISTER_KERNEL_BUILDER(Name("TfmetalExt>SparseSoftmaxCrossEntropy")                                         \
                              .Device(::tensorflow::DEVICE_CPU)                                                 \
                              .TypeConstraint<T>("T")                                                           \
                              .TypeConstraint<Label>("Tlabels"),                                                \
                          SparseXentOp<T, Label>);                                                              \
  REGISTER_KERNEL_BUILDER(Name("TfmetalExt>SparseSoftmaxCrossEntropyGrad")                                     \
                              .Device(::tensorflow::DEVICE_CPU)                                                 \
                              .TypeConstraint<T>("T")                                                           \
                              .TypeConstraint<Label>("Tlabels"),                                                \
                          SparseXentGradOp<T, Label>);
#define TFMETAL_EXT_REGISTER_SPARSE_XENT_LABELS(T) \
  TFMETAL_EXT_REGISTER_SPARSE_XENT(T, int32_t)     \
  TFMETAL_EXT_REGISTER_SPARSE_XENT(T, int64_t)

TFMETAL_EXT_REGISTER_SPARSE_XENT_LABELS(float)
TFMETAL_EXT_REGISTER_SPARSE_XENT_LABELS(::Eigen::half)
TFMETAL_EXT_REGISTER_SPARSE_XENT_LABELS(::Eigen::bfloat16)

#undef TFMETAL_EXT_REGISTER_SPARSE_XENT_LABELS
#undef TFMETAL_EXT_REGISTER_SPARSE_XENT

}  // namespace sparse_xent_cpu
}  // namespace tfmetal_ext
