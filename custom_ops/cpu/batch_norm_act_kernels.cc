// CPU kernels of TfmetalExt>BatchNormAct and TfmetalExt>BatchNormActGrad.
//
// x is [M rows, C channels], channels contiguous. Work is sharded over
// channels and then over rows: a work item is (row block, channel chunk),
// the rows cut into blocks and the channels into chunks of at most kChunk,
// both fixed by the shape only, so every sum has the same order on any
// number of threads (bitwise the same results). An item walks its rows with
// the channels of its chunk as the contiguous inner loop (per-channel
// accumulators on the stack: the loop vectorizes across channels without
// -ffast-math), and writes its per-channel partials; the partials are then
// merged per channel in block order (Chan's merge for the statistics, plain
// sums for dgamma / dbeta). The per-element passes (normalize + activate, and
// dx) are sharded over rows.
//
// Memory passes: the forward reads x twice (statistics; normalize) -- a
// block's second statistics pass re-reads it from cache; the gradient reads
// dy, x (and side) twice (sums; dx), except that with a side input in
// float32 the dx pass reads the dside the sums pass wrote instead of dy and side. The activation is a template argument,
// so each pass's loop is specialized (no switch per element).
//
// Helpers live in namespace batch_norm_act_cpu: all CPU kernel files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "cpu/batch_norm_act_attrs.h"
#include "cpu/cpu_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/batch_norm_act.h"

namespace tfmetal_ext {
namespace batch_norm_act_cpu {

using ::tensorflow::OpInputList;
using ::tensorflow::OpOutputList;

// Channels per work item (the accumulators live on the stack).
constexpr int64_t kChunk = 256;
// Elements per work item (rows x chunk): a block's two statistics passes
// stay in the L2 cache.
constexpr int64_t kBlockElements = 16384;
constexpr int64_t kMinBlockRows = 8;
// Rough cycles per element, for the thread pool's sharding.
constexpr int64_t kStatsCost = 4;
constexpr int64_t kForwardCost = 6;
constexpr int64_t kBackwardCost = 12;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The loops are bound by memory and by the per-element arithmetic: on x86-64
// each pass is also compiled for AVX2 + FMA (8 lanes, fused multiply-adds;
// the baseline build is SSE2) and chosen at run time from the CPU's features.
// The bodies are always inlined into both versions. The AVX2 version rounds
// differently (fused multiply-adds): the forward and the gradient use the same
// version, so the gradient still sees the forward's pre-activations.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TFM_BNA_X86 1
#define TFM_BNA_BODY inline __attribute__((always_inline))
#define TFM_BNA_AVX2 __attribute__((target("avx2,fma")))
#else
#define TFM_BNA_X86 0
#define TFM_BNA_BODY inline
#endif

// The fixed partition of an [rows, channels] input into work items.
struct Partition {
  int64_t rows = 0, channels = 0;
  int64_t chunk = 0, chunks = 0;            // channel chunks
  int64_t rows_per_block = 0, blocks = 0;   // row blocks
  int64_t items() const { return blocks * chunks; }
};

inline Partition MakePartition(int64_t rows, int64_t channels) {
  Partition p;
  p.rows = rows;
  p.channels = channels;
  if (rows == 0 || channels == 0) return p;
  p.chunk = std::min(channels, kChunk);
  p.chunks = CeilDiv(channels, p.chunk);
  p.rows_per_block = std::max(kMinBlockRows, CeilDiv(kBlockElements, p.chunk));
  p.blocks = CeilDiv(rows, p.rows_per_block);
  return p;
}

// The rows [r0, r1) and channels [c0, c0 + width) of work item `item`.
struct Item {
  int64_t block, r0, r1, c0, width;
};

inline Item ItemOf(const Partition& p, int64_t item) {
  Item it;
  it.block = item / p.chunks;
  const int64_t k = item % p.chunks;
  it.r0 = it.block * p.rows_per_block;
  it.r1 = std::min(p.rows, it.r0 + p.rows_per_block);
  it.c0 = k * p.chunk;
  it.width = std::min(p.chunk, p.channels - it.c0);
  return it;
}

template <typename T>
inline float Load(T v) { return static_cast<float>(v); }

// ---------------------------------------------------------------- forward

template <typename T>
struct ForwardArgs {
  const T* x;
  const float* gamma;
  const float* beta;
  const T* side;  // nullptr without a side input
  T* y;
  float* mean;
  float* inv_std;
  float* variance;
  float* scale;         // temp [C]: inv_std * gamma
  float* block_mean;    // temp [blocks, C]: relative to the block's first row
  float* block_m2;      // temp [blocks, C]
  float alpha;
  float epsilon;
  Partition p;
};

// The moments of one work item: a shifted sum for the block mean, then the
// corrected two-pass sums about it (the block is still in cache). The shift
// is the block's first row (read again by MergeStats).
template <typename T>
TFM_BNA_BODY void StatsItemBody(const ForwardArgs<T>& a, int64_t item) {
  const Partition& p = a.p;
  const Item it = ItemOf(p, item);
  const int64_t C = p.channels, w = it.width;
  const float n = static_cast<float>(it.r1 - it.r0);
  float shift[kChunk], s1[kChunk], s2[kChunk], mean0[kChunk];
  const T* first = a.x + it.r0 * C + it.c0;
  for (int64_t j = 0; j < w; ++j) {
    shift[j] = Load(first[j]);
    s1[j] = 0.0f;
  }
  for (int64_t r = it.r0; r < it.r1; ++r) {
    const T* __restrict row = a.x + r * C + it.c0;
    for (int64_t j = 0; j < w; ++j) s1[j] += Load(row[j]) - shift[j];
  }
  for (int64_t j = 0; j < w; ++j) {
    mean0[j] = bna_block_mean0(s1[j], n);
    s1[j] = 0.0f;
    s2[j] = 0.0f;
  }
  for (int64_t r = it.r0; r < it.r1; ++r) {
    const T* __restrict row = a.x + r * C + it.c0;
    for (int64_t j = 0; j < w; ++j) {
      const float e = (Load(row[j]) - shift[j]) - mean0[j];
      s1[j] += e;
      s2[j] += e * e;
    }
  }
  float* bm = a.block_mean + it.block * C + it.c0;
  float* bm2 = a.block_m2 + it.block * C + it.c0;
  for (int64_t j = 0; j < w; ++j) {
    const bna_moments m = bna_block_moments(n, shift[j], mean0[j], s1[j], s2[j]);
    bm[j] = m.mean;
    bm2[j] = m.m2;
  }
}

// The body compiled twice: for the baseline ISA and, on x86-64, for AVX2 + FMA.
template <typename T>
void StatsItems(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) StatsItemBody(a, item);
}
#if TFM_BNA_X86
template <typename T>
TFM_BNA_AVX2 void StatsItemsAvx2(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) StatsItemBody(a, item);
}
#endif

// Channels [begin, end): the block moments merged in block order.
template <typename T>
void MergeStats(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  const Partition& p = a.p;
  const int64_t C = p.channels;
  for (int64_t c = begin; c < end; ++c) {
    bna_moments m{0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t r0 = b * p.rows_per_block;
      const float n = static_cast<float>(std::min(p.rows, r0 + p.rows_per_block) - r0);
      m = bna_merge(m, bna_moments{n, Load(a.x[r0 * C + c]), a.block_mean[b * C + c], a.block_m2[b * C + c]});
    }
    const float var = bna_variance(m);
    a.mean[c] = bna_mean(m);
    a.variance[c] = var;
    a.inv_std[c] = bna_inv_std(var, a.epsilon);
    a.scale[c] = bna_scale(a.inv_std[c], a.gamma[c]);
  }
}

template <int kAct, bool kSide, typename T>
TFM_BNA_BODY void NormalizeRowsBody(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  const int64_t C = a.p.channels;
  const float* __restrict mean = a.mean;
  const float* __restrict scale = a.scale;
  const float* __restrict beta = a.beta;
  const float alpha = a.alpha;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict x = a.x + r * C;
    const T* __restrict side = kSide ? a.side + r * C : nullptr;
    T* __restrict y = a.y + r * C;
    for (int64_t c = 0; c < C; ++c) {
      float pre = bna_pre(Load(x[c]), mean[c], scale[c], beta[c]);
      if (kSide) pre += Load(side[c]);
      y[c] = static_cast<T>(bna_activate(kAct, pre, alpha));
    }
  }
}

template <typename T>
using RowsFn = void (*)(const ForwardArgs<T>&, int64_t, int64_t);

template <int kAct, bool kSide, typename T>
void NormalizeRows(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  NormalizeRowsBody<kAct, kSide, T>(a, begin, end);
}
#if TFM_BNA_X86
template <int kAct, bool kSide, typename T>
TFM_BNA_AVX2 void NormalizeRowsAvx2(const ForwardArgs<T>& a, int64_t begin, int64_t end) {
  NormalizeRowsBody<kAct, kSide, T>(a, begin, end);
}
#endif

template <typename T>
RowsFn<T> StatsFn() {
#if TFM_BNA_X86
  if (CpuUseAvx2()) return &StatsItemsAvx2<T>;
#endif
  return &StatsItems<T>;
}

template <int kAct, typename T>
RowsFn<T> NormalizeFor(bool side) {
#if TFM_BNA_X86
  if (CpuUseAvx2()) return side ? &NormalizeRowsAvx2<kAct, true, T> : &NormalizeRowsAvx2<kAct, false, T>;
#endif
  return side ? &NormalizeRows<kAct, true, T> : &NormalizeRows<kAct, false, T>;
}

template <typename T>
RowsFn<T> NormalizeFn(int32_t act, bool side) {
  switch (act) {
    case TFM_BNA_RELU: return NormalizeFor<TFM_BNA_RELU, T>(side);
    case TFM_BNA_RELU6: return NormalizeFor<TFM_BNA_RELU6, T>(side);
    case TFM_BNA_ELU: return NormalizeFor<TFM_BNA_ELU, T>(side);
    case TFM_BNA_LEAKY_RELU: return NormalizeFor<TFM_BNA_LEAKY_RELU, T>(side);
    case TFM_BNA_SILU: return NormalizeFor<TFM_BNA_SILU, T>(side);
    case TFM_BNA_GELU: return NormalizeFor<TFM_BNA_GELU, T>(side);
    default: return NormalizeFor<TFM_BNA_LINEAR, T>(side);
  }
}

// ---------------------------------------------------------------- gradient

template <typename T>
struct BackwardArgs {
  const T* dy;
  const T* x;
  const float* gamma;
  const float* beta;
  const T* side;  // nullptr without a side input
  const float* mean;
  const float* inv_std;
  T* dx;
  T* dside;         // nullptr without a side input
  float* dgamma;
  float* dbeta;
  float* scale;         // temp [C]
  float* block_dbeta;   // temp [blocks, C]
  float* block_dgamma;  // temp [blocks, C]
  float alpha;
  float inv_count;
  Partition p;
};

// One work item's sums of dpre and dpre * xhat (and dside = dpre).
template <int kAct, bool kSide, typename T>
TFM_BNA_BODY void GradSumsItemBody(const BackwardArgs<T>& a, int64_t item) {
  const Partition& p = a.p;
  const Item it = ItemOf(p, item);
  const int64_t C = p.channels, w = it.width;
  const float* __restrict mean = a.mean + it.c0;
  const float* __restrict inv_std = a.inv_std + it.c0;
  const float* __restrict scale = a.scale + it.c0;
  const float* __restrict beta = a.beta + it.c0;
  const float alpha = a.alpha;
  float sb[kChunk], sg[kChunk];
  for (int64_t j = 0; j < w; ++j) sb[j] = sg[j] = 0.0f;
  for (int64_t r = it.r0; r < it.r1; ++r) {
    const int64_t off = r * C + it.c0;
    const T* __restrict x = a.x + off;
    const T* __restrict dy = a.dy + off;
    const T* __restrict side = kSide ? a.side + off : nullptr;
    T* __restrict dside = kSide ? a.dside + off : nullptr;
    for (int64_t j = 0; j < w; ++j) {
      const float xv = Load(x[j]);
      float pre = bna_pre(xv, mean[j], scale[j], beta[j]);
      if (kSide) pre += Load(side[j]);
      const float dpre = bna_dpre(kAct, Load(dy[j]), pre, alpha);
      if (kSide) dside[j] = static_cast<T>(dpre);
      sb[j] += dpre;
      sg[j] += dpre * bna_xhat(xv, mean[j], inv_std[j]);
    }
  }
  float* bb = a.block_dbeta + it.block * C + it.c0;
  float* bg = a.block_dgamma + it.block * C + it.c0;
  for (int64_t j = 0; j < w; ++j) {
    bb[j] = sb[j];
    bg[j] = sg[j];
  }
}

template <int kAct, bool kSide, typename T>
TFM_BNA_BODY void GradRowsBody(const BackwardArgs<T>& a, int64_t begin, int64_t end) {
  const int64_t C = a.p.channels;
  const float* __restrict mean = a.mean;
  const float* __restrict inv_std = a.inv_std;
  const float* __restrict scale = a.scale;
  const float* __restrict beta = a.beta;
  const float* __restrict dbeta = a.dbeta;
  const float* __restrict dgamma = a.dgamma;
  const float alpha = a.alpha, inv_count = a.inv_count;
  // With a side input and float32 data, the sums pass wrote dside = dpre exactly: read it
  // back (one tensor) instead of dy and side (two) and the activation's derivative.
  constexpr bool kReadDside = kSide && std::is_same<T, float>::value;
  for (int64_t r = begin; r < end; ++r) {
    const T* __restrict x = a.x + r * C;
    const T* __restrict dy = a.dy + r * C;
    const T* __restrict side = kSide ? a.side + r * C : nullptr;
    const T* __restrict dside = kSide ? a.dside + r * C : nullptr;
    T* __restrict dx = a.dx + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float xv = Load(x[c]);
      float dpre;
      if (kReadDside) {
        dpre = Load(dside[c]);
      } else {
        float pre = bna_pre(xv, mean[c], scale[c], beta[c]);
        if (kSide) pre += Load(side[c]);
        dpre = bna_dpre(kAct, Load(dy[c]), pre, alpha);
      }
      dx[c] = static_cast<T>(
          bna_dx(dpre, bna_xhat(xv, mean[c], inv_std[c]), scale[c], dbeta[c], dgamma[c], inv_count));
    }
  }
}

// Both passes over [begin, end): work items for the sums, rows for dx.
template <typename T>
struct GradFns {
  void (*sums)(const BackwardArgs<T>&, int64_t, int64_t);
  void (*rows)(const BackwardArgs<T>&, int64_t, int64_t);
};

template <int kAct, bool kSide, typename T>
void GradSums(const BackwardArgs<T>& a, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) GradSumsItemBody<kAct, kSide, T>(a, item);
}
template <int kAct, bool kSide, typename T>
void GradRows(const BackwardArgs<T>& a, int64_t begin, int64_t end) {
  GradRowsBody<kAct, kSide, T>(a, begin, end);
}
#if TFM_BNA_X86
template <int kAct, bool kSide, typename T>
TFM_BNA_AVX2 void GradSumsAvx2(const BackwardArgs<T>& a, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) GradSumsItemBody<kAct, kSide, T>(a, item);
}
template <int kAct, bool kSide, typename T>
TFM_BNA_AVX2 void GradRowsAvx2(const BackwardArgs<T>& a, int64_t begin, int64_t end) {
  GradRowsBody<kAct, kSide, T>(a, begin, end);
}
#endif

template <int kAct, typename T>
GradFns<T> GradFor(bool side) {
#if TFM_BNA_X86
  if (CpuUseAvx2()) {
    if (side) return {&GradSumsAvx2<kAct, true, T>, &GradRowsAvx2<kAct, true, T>};
    return {&GradSumsAvx2<kAct, false, T>, &GradRowsAvx2<kAct, false, T>};
  }
#endif
  if (side) return {&GradSums<kAct, true, T>, &GradRows<kAct, true, T>};
  return {&GradSums<kAct, false, T>, &GradRows<kAct, false, T>};
}

template <typename T>
GradFns<T> GradFn(int32_t act, bool side) {
  switch (act) {
    case TFM_BNA_RELU: return GradFor<TFM_BNA_RELU, T>(side);
    case TFM_BNA_RELU6: return GradFor<TFM_BNA_RELU6, T>(side);
    case TFM_BNA_ELU: return GradFor<TFM_BNA_ELU, T>(side);
    case TFM_BNA_LEAKY_RELU: return GradFor<TFM_BNA_LEAKY_RELU, T>(side);
    case TFM_BNA_SILU: return GradFor<TFM_BNA_SILU, T>(side);
    case TFM_BNA_GELU: return GradFor<TFM_BNA_GELU, T>(side);
    default: return GradFor<TFM_BNA_LINEAR, T>(side);
  }
}

// ---------------------------------------------------------------- op kernels

// The attrs of both ops.
struct Attrs {
  int32_t activation = TFM_BNA_LINEAR;
  float alpha = 0.2f;
  float epsilon = 0.0f;

  Status Read(OpKernelConstruction* ctx) {
    std::string name;
    TF_RETURN_IF_ERROR(ctx->GetAttr("activation", &name));
    activation = batch_norm_act_attrs::ActivationCode(name);
    if (activation < 0) {
      return errors::InvalidArgument("activation must be one of ", batch_norm_act_attrs::kActivationList, ", got \"",
                                     name, "\"");
    }
    TF_RETURN_IF_ERROR(ctx->GetAttr("alpha", &alpha));
    TF_RETURN_IF_ERROR(ctx->GetAttr("epsilon", &epsilon));
    if (!(std::isfinite(epsilon) && epsilon > 0.0f)) {
      return errors::InvalidArgument("epsilon must be finite and > 0, got ", epsilon);
    }
    if (!std::isfinite(alpha)) return errors::InvalidArgument("alpha must be finite, got ", alpha);
    return Status();
  }
};

// x of rank >= 2: rows = the product of all but the last dimension.
inline Status BatchRowsAndChannels(const TensorShape& shape, int64_t* rows, int64_t* channels) {
  if (shape.dims() < 2) {
    return errors::InvalidArgument("x must have rank >= 2 (channels last, batch statistics over the other axes), "
                                   "got shape ", shape.DebugString());
  }
  return RowsAndChannels(shape, rows, channels);
}

inline Status CheckLike(const Tensor& t, const char* name, const Tensor& x) {
  if (t.shape() != x.shape()) {
    return errors::InvalidArgument(name, " must have the shape of x, ", x.shape().DebugString(), ", got ",
                                   t.shape().DebugString());
  }
  return Status();
}

inline Status TempFloats(OpKernelContext* ctx, int64_t n, Tensor* t, float** data) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({std::max<int64_t>(n, 1)}), t));
  *data = t->flat<float>().data();
  return Status();
}

// The moving statistics' update (tfmetal/batch_norm_act.h): the blend of every channel, taken only
// when all of them are finite, else the moving statistics unchanged. C is a layer's channel count:
// one thread.
inline void UpdateMoving(const float* mean, const float* variance, const float* moving_mean,
                         const float* moving_variance, float momentum, int64_t channels, float* new_mean,
                         float* new_variance) {
  bool finite = true;
  for (int64_t c = 0; c < channels; ++c) {
    new_mean[c] = bna_blend(moving_mean[c], mean[c], momentum);
    new_variance[c] = bna_blend(moving_variance[c], variance[c], momentum);
    finite = finite && bna_blend_finite(new_mean[c], new_variance[c]);
  }
  if (finite) return;
  std::copy(moving_mean, moving_mean + channels, new_mean);
  std::copy(moving_variance, moving_variance + channels, new_variance);
}

template <typename T>
class BatchNormActOp : public OpKernel {
 public:
  explicit BatchNormActOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, attrs_.Read(ctx));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("M", &moving_));
    OP_REQUIRES(ctx, moving_ == 0 || moving_ == 2,
                errors::InvalidArgument("moving must be empty or (moving_mean, moving_variance), got ", moving_,
                                        " tensors"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
    OP_REQUIRES(ctx, std::isfinite(momentum_), errors::InvalidArgument("momentum must be finite, got ", momentum_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& gamma = ctx->input(1);
    const Tensor& beta = ctx->input(2);
    OpInputList sides;
    OP_REQUIRES_OK(ctx, ctx->input_list("side", &sides));
    OP_REQUIRES(ctx, sides.size() <= 1, errors::InvalidArgument("at most one side input, got ", sides.size()));
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, BatchRowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(beta, "beta", channels, "the last dimension of x"));
    const bool has_side = sides.size() == 1;
    if (has_side) OP_REQUIRES_OK(ctx, CheckLike(sides[0], "side", x));
    OpInputList moving;
    OP_REQUIRES_OK(ctx, ctx->input_list("moving", &moving));
    if (moving_ == 2) {
      OP_REQUIRES_OK(ctx, CheckVector(moving[0], "moving_mean", channels, "the last dimension of x"));
      OP_REQUIRES_OK(ctx, CheckVector(moving[1], "moving_variance", channels, "the last dimension of x"));
    }
    Tensor *y = nullptr, *mean_t = nullptr, *inv_std_t = nullptr, *var_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({channels}), &mean_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({channels}), &inv_std_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({channels}), &var_t));
    OpOutputList new_moving;
    OP_REQUIRES_OK(ctx, ctx->output_list("new_moving", &new_moving));
    Tensor *new_mean_t = nullptr, *new_var_t = nullptr;
    if (moving_ == 2) {
      OP_REQUIRES_OK(ctx, new_moving.allocate(0, TensorShape({channels}), &new_mean_t));
      OP_REQUIRES_OK(ctx, new_moving.allocate(1, TensorShape({channels}), &new_var_t));
    }
    // After the statistics (any batch, empty included): the guarded update of the moving statistics.
    auto update_moving = [&]() {
      if (moving_ != 2) return;
      UpdateMoving(mean_t->flat<float>().data(), var_t->flat<float>().data(), moving[0].flat<float>().data(),
                   moving[1].flat<float>().data(), momentum_, channels, new_mean_t->flat<float>().data(),
                   new_var_t->flat<float>().data());
    };
    ForwardArgs<T> a;
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.beta = beta.flat<float>().data();
    a.side = has_side ? sides[0].flat<T>().data() : nullptr;
    a.y = y->flat<T>().data();
    a.mean = mean_t->flat<float>().data();
    a.inv_std = inv_std_t->flat<float>().data();
    a.variance = var_t->flat<float>().data();
    a.alpha = attrs_.alpha;
    a.epsilon = attrs_.epsilon;
    a.p = MakePartition(rows, channels);
    if (channels == 0) return;
    if (rows == 0) {  // an empty batch: 0 / 0 statistics, as Keras' moments
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::fill(a.mean, a.mean + channels, nan);
      std::fill(a.variance, a.variance + channels, nan);
      std::fill(a.inv_std, a.inv_std + channels, nan);
      update_moving();
      return;
    }
    const Partition& p = a.p;
    Tensor scale_t, bm_t, bm2_t;
    OP_REQUIRES_OK(ctx, TempFloats(ctx, channels, &scale_t, &a.scale));
    OP_REQUIRES_OK(ctx, TempFloats(ctx, p.blocks * channels, &bm_t, &a.block_mean));
    OP_REQUIRES_OK(ctx, TempFloats(ctx, p.blocks * channels, &bm2_t, &a.block_m2));
    const ForwardArgs<T>& ca = a;
    const RowsFn<T> stats = StatsFn<T>();
    ParallelFor(ctx, p.items(), kStatsCost * p.rows_per_block * p.chunk,
                [&ca, stats](int64_t begin, int64_t end) { stats(ca, begin, end); });
    ParallelFor(ctx, channels, 4 * p.blocks, [&ca](int64_t begin, int64_t end) { MergeStats(ca, begin, end); });
    update_moving();
    const RowsFn<T> normalize = NormalizeFn<T>(attrs_.activation, has_side);
    ParallelFor(ctx, rows, kForwardCost * channels,
                [&ca, normalize](int64_t begin, int64_t end) { normalize(ca, begin, end); });
  }

 private:
  Attrs attrs_;
  int32_t moving_ = 0;      // M: 0, or 2 (moving_mean, moving_variance)
  float momentum_ = 0.99f;  // the moving statistics' momentum (finite)
};

template <typename T>
class BatchNormActGradOp : public OpKernel {
 public:
  explicit BatchNormActGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) { OP_REQUIRES_OK(ctx, attrs_.Read(ctx)); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& dy = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& y = ctx->input(2);
    const Tensor& gamma = ctx->input(3);
    const Tensor& beta = ctx->input(4);
    OpInputList sides;
    OP_REQUIRES_OK(ctx, ctx->input_list("side", &sides));
    OP_REQUIRES(ctx, sides.size() <= 1, errors::InvalidArgument("at most one side input, got ", sides.size()));
    const int first_stat = 5 + sides.size();
    const Tensor& mean = ctx->input(first_stat);
    const Tensor& inv_std = ctx->input(first_stat + 1);
    int64_t rows = 0, channels = 0;
    OP_REQUIRES_OK(ctx, BatchRowsAndChannels(x.shape(), &rows, &channels));
    OP_REQUIRES_OK(ctx, CheckLike(dy, "dy", x));
    OP_REQUIRES_OK(ctx, CheckLike(y, "y", x));
    const bool has_side = sides.size() == 1;
    if (has_side) OP_REQUIRES_OK(ctx, CheckLike(sides[0], "side", x));
    OP_REQUIRES_OK(ctx, CheckVector(gamma, "gamma", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(beta, "beta", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(mean, "mean", channels, "the last dimension of x"));
    OP_REQUIRES_OK(ctx, CheckVector(inv_std, "inv_std", channels, "the last dimension of x"));
    Tensor *dx = nullptr, *dgamma_t = nullptr, *dbeta_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({channels}), &dgamma_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({channels}), &dbeta_t));
    OpOutputList dsides;
    OP_REQUIRES_OK(ctx, ctx->output_list("dside", &dsides));
    Tensor* dside = nullptr;
    if (has_side) OP_REQUIRES_OK(ctx, dsides.allocate(0, x.shape(), &dside));
    BackwardArgs<T> a;
    a.dy = dy.flat<T>().data();
    a.x = x.flat<T>().data();
    a.gamma = gamma.flat<float>().data();
    a.beta = beta.flat<float>().data();
    a.side = has_side ? sides[0].flat<T>().data() : nullptr;
    a.mean = mean.flat<float>().data();
    a.inv_std = inv_std.flat<float>().data();
    a.dx = dx->flat<T>().data();
    a.dside = has_side ? dside->flat<T>().data() : nullptr;
    a.dgamma = dgamma_t->flat<float>().data();
    a.dbeta = dbeta_t->flat<float>().data();
    a.alpha = attrs_.alpha;
    a.inv_count = rows > 0 ? 1.0f / static_cast<float>(rows) : 0.0f;
    a.p = MakePartition(rows, channels);
    if (rows == 0 || channels == 0) {  // nothing to sum
      std::fill(a.dgamma, a.dgamma + channels, 0.0f);
      std::fill(a.dbeta, a.dbeta + channels, 0.0f);
      return;
    }
    const Partition& p = a.p;
    Tensor scale_t, bb_t, bg_t;
    OP_REQUIRES_OK(ctx, TempFloats(ctx, channels, &scale_t, &a.scale));
    OP_REQUIRES_OK(ctx, TempFloats(ctx, p.blocks * channels, &bb_t, &a.block_dbeta));
    OP_REQUIRES_OK(ctx, TempFloats(ctx, p.blocks * channels, &bg_t, &a.block_dgamma));
    for (int64_t c = 0; c < channels; ++c) a.scale[c] = bna_scale(a.inv_std[c], a.gamma[c]);
    const BackwardArgs<T>& ca = a;
    const GradFns<T> fns = GradFn<T>(attrs_.activation, has_side);
    ParallelFor(ctx, p.items(), kBackwardCost * p.rows_per_block * p.chunk,
                [&ca, fns](int64_t begin, int64_t end) { fns.sums(ca, begin, end); });
    // The block partials, added in block order.
    ParallelFor(ctx, channels, 2 * p.blocks, [&ca](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        float sb = 0.0f, sg = 0.0f;
        for (int64_t b = 0; b < ca.p.blocks; ++b) {
          sb += ca.block_dbeta[b * ca.p.channels + c];
          sg += ca.block_dgamma[b * ca.p.channels + c];
        }
        ca.dbeta[c] = sb;
        ca.dgamma[c] = sg;
      }
    });
    ParallelFor(ctx, rows, kBackwardCost * channels, [&ca, fns](int64_t begin, int64_t end) { fns.rows(ca, begin, end); });
  }

 private:
  Attrs attrs_;
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>BatchNormAct"), BatchNormActOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>BatchNormActGrad"), BatchNormActGradOp)

#undef TFM_BNA_X86
#undef TFM_BNA_BODY
#undef TFM_BNA_AVX2

}  // namespace batch_norm_act_cpu
}  // namespace tfmetal_ext
