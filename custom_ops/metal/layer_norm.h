// Metal kernels of TfmetalExt>LayerNorm and TfmetalExt>LayerNormGrad
// (instantiated in layer_norm.metal; host code in layer_norm_metal.mm).
//
// layer_norm<T>             one threadgroup per row (dispatchThreadgroups):
//                           y, mean, rstd with the header's two passes
//                           (shifted sum, then squared deviations from the
//                           mean), each a threadgroup reduction in float32.
// layer_norm_grad<T>        one threadgroup per row: dx from the row sums of
//                           g = dy * gamma and g * xhat.
// layer_norm_param_grad<T>  dgamma / dbeta: one threadgroup per block of 32
//                           columns, reducing over all rows, so no atomics and
//                           no second pass; the summation order depends only
//                           on the threadgroup size (deterministic).
//
// Threadgroup sizes: any multiple of 32 up to 1024 (the host picks a power of
// two from the pipeline's maxTotalThreadsPerThreadgroup). Rows of any length
// (a row is strided over the threadgroup), including C == 0: the forward
// kernel then writes mean 0 and rstd = 1 / sqrt(epsilon) as the CPU kernel
// does; layer_norm_param_grad writes zeros when rows == 0.
//
// The order of the float sums differs from the CPU kernel's (16 lanes there,
// strided threads + SIMD-group tree here): results agree to float32 rounding,
// not bit for bit.
#ifndef TFMETAL_METAL_LAYER_NORM_KERNELS_H_
#define TFMETAL_METAL_LAYER_NORM_KERNELS_H_

#include "reduction.h"  // tfm_threadgroup_sum
#include "tfmetal/portable.h"
#include "tfmetal/layer_norm.h"

// setBytes data of the three kernels (shared with the host).
struct tfm_layer_norm_params {
  uint32_t rows;      // rows of x (product of all but the last dimension)
  uint32_t channels;  // C, the last dimension
  float epsilon;      // forward only: finite and > 0 (checked by the host)
};
static_assert(sizeof(tfm_layer_norm_params) == 12, "tfm_layer_norm_params layout is shared with the host");

// Columns per threadgroup of layer_norm_param_grad (one SIMD-group's width:
// each SIMD-group reads 32 consecutive floats of a row).
#define TFM_LAYER_NORM_PARAM_GRAD_COLUMNS 32

#if TFM_METAL

template <typename T>
[[kernel]] void layer_norm(device const T* x [[buffer(0)]],
                           device const float* gamma [[buffer(1)]],
                           device const float* beta [[buffer(2)]],
                           device T* y [[buffer(3)]],
                           device float* mean_out [[buffer(4)]],
                           device float* rstd_out [[buffer(5)]],
                           constant tfm_layer_norm_params& p [[buffer(6)]],
                           TFM_KERNEL_BUILTINS) {
  threadgroup float slots[2 * TFM_MAX_SIMDGROUPS];
  const uint row = tgid.x;
  const uint channels = p.channels;
  const uint threads = tgsize.x;
  device const T* xr = x + static_cast<ulong>(row) * channels;  // 64-bit: rows * C may exceed 2^32
  device T* yr = y + static_cast<ulong>(row) * channels;
  const float inv_count = layer_norm_inv_count(static_cast<float>(channels));

  // Pass 1: sum of (x - x0) -> mean.
  const float x0 = channels > 0 ? static_cast<float>(xr[0]) : 0.0f;
  float shifted = 0.0f;
  for (uint c = lid.x; c < channels; c += threads) shifted += static_cast<float>(xr[c]) - x0;
  const float mean =
      layer_norm_mean(x0, tfm_threadgroup_sum(shifted, slots, threads, simd_lane, simd_id), inv_count);

  // Pass 2: sum of (x - mean)^2 -> rstd.
  float squares = 0.0f;
  for (uint c = lid.x; c < channels; c += threads) {
    const float d = static_cast<float>(xr[c]) - mean;
    squares += d * d;
  }
  const float rstd = layer_norm_rstd(
      tfm_threadgroup_sum(squares, slots + TFM_MAX_SIMDGROUPS, threads, simd_lane, simd_id),
      inv_count, p.epsilon);

  for (uint c = lid.x; c < channels; c += threads) {
    yr[c] = static_cast<T>(layer_norm_forward(static_cast<float>(xr[c]), mean, rstd, gamma[c], beta[c]));
  }
  if (lid.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx for one row per threadgroup; dx must not alias dy or x (the host
// allocates it: layer_norm_param_grad reads dy and x too).
template <typename T>
[[kernel]] void layer_norm_grad(device const T* dy [[buffer(0)]],
                                device const T* x [[buffer(1)]],
                                device const float* gamma [[buffer(2)]],
                                device const float* mean [[buffer(3)]],
                                device const float* rstd [[buffer(4)]],
                                device T* dx [[buffer(5)]],
                                constant tfm_layer_norm_params& p [[buffer(6)]],
                                TFM_KERNEL_BUILTINS) {
  threadgroup float slots[2 * TFM_MAX_SIMDGROUPS];
  const uint row = tgid.x;
  const uint channels = p.channels;
  const uint threads = tgsize.x;
  const ulong base = static_cast<ulong>(row) * channels;
  const float row_mean = mean[row];
  const float row_rstd = rstd[row];
  const float inv_count = layer_norm_inv_count(static_cast<float>(channels));

  float sum_g = 0.0f;
  float sum_gxhat = 0.0f;
  for (uint c = lid.x; c < channels; c += threads) {
    const float xhat = layer_norm_xhat(static_cast<float>(x[base + c]), row_mean, row_rstd);
    const float g = static_cast<float>(dy[base + c]) * gamma[c];
    sum_g += g;
    sum_gxhat += g * xhat;
  }
  // Two reductions into separate slots: no barrier between them is needed.
  const float mean_g = tfm_threadgroup_sum(sum_g, slots, threads, simd_lane, simd_id) * inv_count;
  const float mean_gxhat =
      tfm_threadgroup_sum(sum_gxhat, slots + TFM_MAX_SIMDGROUPS, threads, simd_lane, simd_id) *
      inv_count;

  for (uint c = lid.x; c < channels; c += threads) {
    const float xhat = layer_norm_xhat(static_cast<float>(x[base + c]), row_mean, row_rstd);
    dx[base + c] = static_cast<T>(
        layer_norm_backward(static_cast<float>(dy[base + c]), gamma[c], xhat, row_rstd, mean_g, mean_gxhat));
  }
}

// dgamma[c] = sum over rows of dy * xhat, dbeta[c] = sum over rows of dy.
// Threadgroup t covers columns [32 t, 32 t + 32): thread i handles column
// 32 t + i % 32 for rows i / 32, i / 32 + L, ... (L = threads / 32 row
// lanes), then the first 32 threads add the L partials in lane order.
// Dispatch: ceil(C / 32) threadgroups of a multiple of 32 threads.
template <typename T>
[[kernel]] void layer_norm_param_grad(device const T* dy [[buffer(0)]],
                                      device const T* x [[buffer(1)]],
                                      device const float* mean [[buffer(2)]],
                                      device const float* rstd [[buffer(3)]],
                                      device float* dgamma [[buffer(4)]],
                                      device float* dbeta [[buffer(5)]],
                                      constant tfm_layer_norm_params& p [[buffer(6)]],
                                      TFM_KERNEL_BUILTINS) {
  threadgroup float partial_dgamma[1024];
  threadgroup float partial_dbeta[1024];
  const uint width = TFM_LAYER_NORM_PARAM_GRAD_COLUMNS;
  const uint lanes = tgsize.x / width;  // row lanes
  const uint lane = lid.x / width;
  const uint column = tgid.x * width + lid.x % width;
  const bool active = column < p.channels && lane < lanes;

  float sum_dgamma = 0.0f;
  float sum_dbeta = 0.0f;
  if (active) {
    for (uint r = lane; r < p.rows; r += lanes) {
      const ulong i = static_cast<ulong>(r) * p.channels + column;
      const float d = static_cast<float>(dy[i]);
      sum_dgamma += d * layer_norm_xhat(static_cast<float>(x[i]), mean[r], rstd[r]);
      sum_dbeta += d;
    }
  }
  partial_dgamma[lid.x] = sum_dgamma;
  partial_dbeta[lid.x] = sum_dbeta;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid.x < width && column < p.channels) {
    float total_dgamma = 0.0f;
    float total_dbeta = 0.0f;
    for (uint l = 0; l < lanes; ++l) {
      total_dgamma += partial_dgamma[l * width + lid.x];
      total_dbeta += partial_dbeta[l * width + lid.x];
    }
    dgamma[column] = total_dgamma;
    dbeta[column] = total_dbeta;
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_LAYER_NORM_KERNELS_H_
