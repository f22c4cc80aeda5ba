// Metal kernels of TfmetalExt>BatchNormAct and TfmetalExt>BatchNormActGrad
// (instantiated in batch_norm_act.metal; host code in batch_norm_act_metal.mm).
// The math is tfmetal/batch_norm_act.h, shared with the CPU kernel.
//
// x is [rows, C], channels contiguous. The per-channel reductions are column
// reductions: a SIMD-group reads 32 consecutive channels of one row (coalesced
// loads), so each lane accumulates its own channel and no cross-lane (simd_sum)
// reduction is needed inside a SIMD-group; the row lanes of a threadgroup are
// merged through threadgroup memory in lane order. (reduction.h's
// tfm_threadgroup_sum reduces along a row: it fits the row-normalizing ops,
// not a channels-last batch norm, whose channel read down the rows would be
// strided.)
//
// batch_norm_act_stats<T>       one threadgroup per block of 32 channels, over
//                               all rows: thread i takes channel 32 t + i % 32
//                               and rows i / 32, i / 32 + L, ... (L = threads / 32
//                               row lanes); its moments by the shifted sum and
//                               corrected two-pass sums (shift: its first row),
//                               then the first 32 threads merge the L lanes'
//                               moments in lane order (Chan's merge) and write
//                               mean, inv_std and variance.
// batch_norm_act_moving         with the moving statistics (has_moving): ONE
//                               threadgroup (at most TFM_BNA_MOVING_THREADS
//                               threads) loops over the channels, c = lid,
//                               lid + threads, ...: each thread ANDs the
//                               finiteness of its channels' blends, a tree
//                               reduction in threadgroup memory gives the
//                               all-channels flag, then each thread writes its
//                               channels' new_mean / new_variance: the blends
//                               when the flag holds, else bitwise copies of
//                               moving_mean / moving_variance. Runs after the
//                               stats pass, also when rows == 0 (NaN
//                               statistics: the copies).
// batch_norm_act<T>             one thread per element: y = act(pre).
// batch_norm_act_grad_sums<T>   as the stats kernel: dbeta = sum dpre,
//                               dgamma = sum dpre * xhat (zeros when rows == 0).
// batch_norm_act_grad<T>        one thread per element: dx, and dside = dpre.
//
// Deterministic: no atomics; each sum's order depends only on the
// threadgroup size. The sums run in another order than the CPU kernel's, so
// results agree to float32 rounding, not bit for bit. Elementwise kernels
// index with 32 bits: the host rejects rows * C >= 2^31.
#ifndef TFMETAL_METAL_BATCH_NORM_ACT_KERNELS_H_
#define TFMETAL_METAL_BATCH_NORM_ACT_KERNELS_H_

#include "tfmetal/batch_norm_act.h"
#include "tfmetal/portable.h"

// setBytes data of the five kernels (shared with the host).
struct tfm_batch_norm_act_params {
  uint32_t rows;        // M: the product of all but the last dimension of x
  uint32_t channels;    // C, the last dimension
  int32_t activation;   // a TFM_BNA_* code
  uint32_t has_side;    // 1: a side input (else its buffer is a placeholder, not read)
  float alpha;          // leaky_relu's negative slope
  float epsilon;        // finite and > 0 (checked by the host)
  float momentum;       // forward with moving statistics: finite (checked by the host)
  uint32_t has_moving;  // forward: 1 when the moving statistics pass is encoded
};
static_assert(sizeof(tfm_batch_norm_act_params) == 32, "tfm_batch_norm_act_params layout is shared with the host");

// Channels per threadgroup of the column reductions (one SIMD-group's width).
#define TFM_BNA_COLUMNS 32

// The most threads of batch_norm_act_moving's one threadgroup (the host's cap;
// the length of its threadgroup flags).
#define TFM_BNA_MOVING_THREADS 1024

#if TFM_METAL

// The per-channel statistics. Dispatch: ceil(C / 32) threadgroups of a
// multiple of 32 threads (at most 1024).
template <typename T>
[[kernel]] void batch_norm_act_stats(device const T* x [[buffer(0)]],
                                     device float* mean [[buffer(1)]],
                                     device float* inv_std [[buffer(2)]],
                                     device float* variance [[buffer(3)]],
                                     constant tfm_batch_norm_act_params& p [[buffer(4)]],
                                     TFM_KERNEL_BUILTINS) {
  threadgroup float t_count[1024];
  threadgroup float t_shift[1024];
  threadgroup float t_mean[1024];
  threadgroup float t_m2[1024];
  const uint width = TFM_BNA_COLUMNS;
  const uint lanes = tgsize.x / width;
  const uint lane = lid.x / width;
  const uint column = tgid.x * width + lid.x % width;
  const uint channels = p.channels;

  bna_moments m;
  m.count = 0.0f;
  m.shift = 0.0f;
  m.mean = 0.0f;
  m.m2 = 0.0f;
  if (column < channels && lane < p.rows) {
    const float shift = static_cast<float>(x[static_cast<ulong>(lane) * channels + column]);
    float sum_d = 0.0f;
    float n = 0.0f;
    for (uint r = lane; r < p.rows; r += lanes) {
      sum_d += static_cast<float>(x[static_cast<ulong>(r) * channels + column]) - shift;
      n += 1.0f;
    }
    const float mean0 = bna_block_mean0(sum_d, n);
    float sum_e = 0.0f;
    float sum_e2 = 0.0f;
    for (uint r = lane; r < p.rows; r += lanes) {
      const float e = (static_cast<float>(x[static_cast<ulong>(r) * channels + column]) - shift) - mean0;
      sum_e += e;
      sum_e2 += e * e;
    }
    m = bna_block_moments(n, shift, mean0, sum_e, sum_e2);
  }
  t_count[lid.x] = m.count;
  t_shift[lid.x] = m.shift;
  t_mean[lid.x] = m.mean;
  t_m2[lid.x] = m.m2;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid.x < width && column < channels) {
    bna_moments total;
    total.count = 0.0f;
    total.shift = 0.0f;
    total.mean = 0.0f;
    total.m2 = 0.0f;
    for (uint l = 0; l < lanes; ++l) {
      const uint s = l * width + lid.x;
      bna_moments part;
      part.count = t_count[s];
      part.shift = t_shift[s];
      part.mean = t_mean[s];
      part.m2 = t_m2[s];
      total = bna_merge(total, part);
    }
    const float var = bna_variance(total);
    mean[column] = bna_mean(total);
    variance[column] = var;
    inv_std[column] = bna_inv_std(var, p.epsilon);
  }
}

// The guarded update of the moving statistics from the batch's (the stats
// pass's outputs). Dispatch: one threadgroup of at most TFM_BNA_MOVING_THREADS
// threads (any size: the reduction does not need a power of two).
[[kernel]] void batch_norm_act_moving(device const float* mean [[buffer(0)]],
                                      device const float* variance [[buffer(1)]],
                                      device const float* moving_mean [[buffer(2)]],
                                      device const float* moving_variance [[buffer(3)]],
                                      device float* new_mean [[buffer(4)]],
                                      device float* new_variance [[buffer(5)]],
                                      constant tfm_batch_norm_act_params& p [[buffer(6)]],
                                      TFM_KERNEL_BUILTINS) {
  threadgroup uint t_finite[TFM_BNA_MOVING_THREADS];
  const uint threads = tgsize.x;
  const uint channels = p.channels;
  const float momentum = p.momentum;

  uint finite = 1u;
  for (uint c = lid.x; c < channels; c += threads) {
    const float m = bna_blend(moving_mean[c], mean[c], momentum);
    const float v = bna_blend(moving_variance[c], variance[c], momentum);
    if (!bna_blend_finite(m, v)) finite = 0u;
  }
  t_finite[lid.x] = finite;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Fold the upper half of the n live flags onto the lower half until one is
  // left: the writes (indices < n - half) never meet the reads (>= half).
  for (uint n = threads; n > 1;) {
    const uint half = (n + 1) / 2;
    if (lid.x < n - half) t_finite[lid.x] = t_finite[lid.x] & t_finite[lid.x + half];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    n = half;
  }
  const bool update = t_finite[0] != 0u;

  for (uint c = lid.x; c < channels; c += threads) {
    if (update) {
      new_mean[c] = bna_blend(moving_mean[c], mean[c], momentum);
      new_variance[c] = bna_blend(moving_variance[c], variance[c], momentum);
    } else {
      new_mean[c] = moving_mean[c];
      new_variance[c] = moving_variance[c];
    }
  }
}

// pre of element i (channel c) as the forward computed it.
template <typename T>
inline float bna_metal_pre(device const T* x, device const T* side, device const float* gamma,
                           device const float* beta, device const float* mean, device const float* inv_std,
                           ulong i, uint c, bool has_side) {
  float pre = bna_pre(static_cast<float>(x[i]), mean[c], bna_scale(inv_std[c], gamma[c]), beta[c]);
  if (has_side) pre += static_cast<float>(side[i]);
  return pre;
}

// y = act(pre), one thread per element. Dispatch: rows * C threads.
template <typename T>
[[kernel]] void batch_norm_act(device const T* x [[buffer(0)]],
                               device const float* gamma [[buffer(1)]],
                               device const float* beta [[buffer(2)]],
                               device const T* side [[buffer(3)]],
                               device const float* mean [[buffer(4)]],
                               device const float* inv_std [[buffer(5)]],
                               device T* y [[buffer(6)]],
                               constant tfm_batch_norm_act_params& p [[buffer(7)]],
                               TFM_KERNEL_BUILTINS) {
  const uint i = gid.x;
  if (i >= p.rows * p.channels) return;
  const uint c = i % p.channels;
  const float pre = bna_metal_pre(x, side, gamma, beta, mean, inv_std, i, c, p.has_side != 0);
  y[i] = static_cast<T>(bna_activate(p.activation, pre, p.alpha));
}

// dbeta and dgamma, as batch_norm_act_stats reduces (same dispatch).
template <typename T>
[[kernel]] void batch_norm_act_grad_sums(device const T* dy [[buffer(0)]],
                                         device const T* x [[buffer(1)]],
                                         device const float* gamma [[buffer(2)]],
                                         device const float* beta [[buffer(3)]],
                                         device const T* side [[buffer(4)]],
                                         device const float* mean [[buffer(5)]],
                                         device const float* inv_std [[buffer(6)]],
                                         device float* dgamma [[buffer(7)]],
                                         device float* dbeta [[buffer(8)]],
                                         constant tfm_batch_norm_act_params& p [[buffer(9)]],
                                         TFM_KERNEL_BUILTINS) {
  threadgroup float t_db[1024];
  threadgroup float t_dg[1024];
  const uint width = TFM_BNA_COLUMNS;
  const uint lanes = tgsize.x / width;
  const uint lane = lid.x / width;
  const uint column = tgid.x * width + lid.x % width;
  const uint channels = p.channels;
  const bool has_side = p.has_side != 0;

  float db = 0.0f;
  float dg = 0.0f;
  if (column < channels) {
    const float m = mean[column];
    const float s = inv_std[column];
    for (uint r = lane; r < p.rows; r += lanes) {
      const ulong i = static_cast<ulong>(r) * channels + column;
      const float pre = bna_metal_pre(x, side, gamma, beta, mean, inv_std, i, column, has_side);
      const float dpre = bna_dpre(p.activation, static_cast<float>(dy[i]), pre, p.alpha);
      db += dpre;
      dg += dpre * bna_xhat(static_cast<float>(x[i]), m, s);
    }
  }
  t_db[lid.x] = db;
  t_dg[lid.x] = dg;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid.x < width && column < channels) {
    float total_db = 0.0f;
    float total_dg = 0.0f;
    for (uint l = 0; l < lanes; ++l) {
      total_db += t_db[l * width + lid.x];
      total_dg += t_dg[l * width + lid.x];
    }
    dbeta[column] = total_db;
    dgamma[column] = total_dg;
  }
}

// dx (and dside = dpre), one thread per element. Dispatch: rows * C threads.
// dx and dside must not alias dy, x or side (the host allocates them).
template <typename T>
[[kernel]] void batch_norm_act_grad(device const T* dy [[buffer(0)]],
                                    device const T* x [[buffer(1)]],
                                    device const float* gamma [[buffer(2)]],
                                    device const float* beta [[buffer(3)]],
                                    device const T* side [[buffer(4)]],
                                    device const float* mean [[buffer(5)]],
                                    device const float* inv_std [[buffer(6)]],
                                    device const float* dgamma [[buffer(7)]],
                                    device const float* dbeta [[buffer(8)]],
                                    device T* dx [[buffer(9)]],
                                    device T* dside [[buffer(10)]],
                                    constant tfm_batch_norm_act_params& p [[buffer(11)]],
                                    TFM_KERNEL_BUILTINS) {
  const uint i = gid.x;
  if (i >= p.rows * p.channels) return;
  const uint c = i % p.channels;
  const bool has_side = p.has_side != 0;
  const float pre = bna_metal_pre(x, side, gamma, beta, mean, inv_std, i, c, has_side);
  const float dpre = bna_dpre(p.activation, static_cast<float>(dy[i]), pre, p.alpha);
  const float xhat = bna_xhat(static_cast<float>(x[i]), mean[c], inv_std[c]);
  dx[i] = static_cast<T>(bna_dx(dpre, xhat, bna_scale(inv_std[c], gamma[c]), dbeta[c], dgamma[c],
                                1.0f / static_cast<float>(p.rows)));
  if (has_side) dside[i] = static_cast<T>(dpre);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_BATCH_NORM_ACT_KERNELS_H_
