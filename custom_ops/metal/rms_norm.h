// Metal kernels of TfmetalExt>RMSNorm and TfmetalExt>RMSNormGrad
// (instantiated in rms_norm.metal; host code in rms_norm_metal.mm).
//
// rms_norm<T>             one threadgroup per row (dispatchThreadgroups): the
//                         row's sum of squares as a threadgroup reduction in
//                         float32 (SIMD-group sums, then the SIMD-group
//                         partials in order), then y and rstd.
// rms_norm_grad<T>        one threadgroup per row: dx from the row sum of
//                         g * xhat (g = dy * gamma).
// rms_norm_param_grad<T>  dgamma: one threadgroup per block of 32 columns,
//                         reducing over all rows, so no atomics and no
//                         second pass; the summation order depends only on
//                         the threadgroup size (deterministic).
//
// Threadgroup sizes: any multiple of 32 up to 1024 (the host picks a power of
// two from the pipeline's maxTotalThreadsPerThreadgroup). Rows of any length
// (a row is strided over the threadgroup), including C == 0: the forward
// kernel then writes rstd = 1 / sqrt(epsilon) as the CPU kernel does;
// rms_norm_param_grad writes zeros when rows == 0.
//
// The order of the float sums differs from the CPU kernel's (16 lanes there,
// strided threads + SIMD-group tree here): results agree to float32 rounding,
// not bit for bit.
#ifndef TFMETAL_METAL_RMS_NORM_KERNELS_H_
#define TFMETAL_METAL_RMS_NORM_KERNELS_H_

#include "reduction.h"  // tfm_threadgroup_sum
#include "tfmetal/portable.h"
#include "tfmetal/rms_norm.h"

// setBytes data of the three kernels (shared with the host).
struct tfm_rms_norm_params {
  uint32_t rows;      // rows of x (product of all but the last dimension)
  uint32_t channels;  // C, the last dimension
  float epsilon;      // forward only: finite and > 0 (checked by the host)
};
static_assert(sizeof(tfm_rms_norm_params) == 12, "tfm_rms_norm_params layout is shared with the host");

// Columns per threadgroup of rms_norm_param_grad (one SIMD-group's width:
// each SIMD-group reads 32 consecutive values of a row).
#define TFM_RMS_NORM_PARAM_GRAD_COLUMNS 32

#if TFM_METAL

template <typename T>
[[kernel]] void rms_norm(device const T* x [[buffer(0)]],
                         device const float* gamma [[buffer(1)]],
                         device T* y [[buffer(2)]],
                         device float* rstd_out [[buffer(3)]],
                         constant tfm_rms_norm_params& p [[buffer(4)]],
                         TFM_KERNEL_BUILTINS) {
  threadgroup float slots[TFM_MAX_SIMDGROUPS];
  const uint row = tgid.x;
  const uint channels = p.channels;
  const uint threads = tgsize.x;
  device const T* xr = x + static_cast<ulong>(row) * channels;  // 64-bit: rows * C may exceed 2^32
  device T* yr = y + static_cast<ulong>(row) * channels;

  float squares = 0.0f;
  for (uint c = lid.x; c < channels; c += threads) {
    const float v = static_cast<float>(xr[c]);
    squares += v * v;
  }
  const float rstd =
      rms_norm_rstd(tfm_threadgroup_sum(squares, slots, threads, simd_lane, simd_id),
                    rms_norm_inv_count(static_cast<float>(channels)), p.epsilon);
  for (uint c = lid.x; c < channels; c += threads) {
    yr[c] = static_cast<T>(rms_norm_forward(static_cast<float>(xr[c]), rstd, gamma[c]));
  }
  if (lid.x == 0) rstd_out[row] = rstd;
}

// dx for one row per threadgroup; dx must not alias dy or x (the host
// allocates it: rms_norm_param_grad reads dy and x too).
template <typename T>
[[kernel]] void rms_norm_grad(device const T* dy [[buffer(0)]],
                              device const T* x [[buffer(1)]],
                              device const float* gamma [[buffer(2)]],
                              device const float* rstd [[buffer(3)]],
                              device T* dx [[buffer(4)]],
                              constant tfm_rms_norm_params& p [[buffer(5)]],
                              TFM_KERNEL_BUILTINS) {
  threadgroup float slots[TFM_MAX_SIMDGROUPS];
  const uint row = tgid.x;
  const uint channels = p.channels;
  const uint threads = tgsize.x;
  const ulong base = static_cast<ulong>(row) * channels;
  const float row_rstd = rstd[row];

  float sum_gxhat = 0.0f;
  for (uint c = lid.x; c < channels; c += threads) {
    const float xhat = rms_norm_xhat(static_cast<float>(x[base + c]), row_rstd);
    sum_gxhat += static_cast<float>(dy[base + c]) * gamma[c] * xhat;
  }
  const float mean_gxhat = tfm_threadgroup_sum(sum_gxhat, slots, threads, simd_lane, simd_id) *
                           rms_norm_inv_count(static_cast<float>(channels));
  for (uint c = lid.x; c < channels; c += threads) {
    const float xhat = rms_norm_xhat(static_cast<float>(x[base + c]), row_rstd);
    dx[base + c] =
        static_cast<T>(rms_norm_backward(static_cast<float>(dy[base + c]), gamma[c], xhat, row_rstd, mean_gxhat));
  }
}

// dgamma[c] = sum over rows of dy * xhat. Threadgroup t covers columns
// [32 t, 32 t + 32): thread i handles column 32 t + i % 32 for rows i / 32,
// i / 32 + L, ... (L = threads / 32 row lanes), then the first 32 threads
// add the L partials in lane order.
// Dispatch: ceil(C / 32) threadgroups of a multiple of 32 threads.
template <typename T>
[[kernel]] void rms_norm_param_grad(device const T* dy [[buffer(0)]],
                                    device const T* x [[buffer(1)]],
                                    device const float* rstd [[buffer(2)]],
                                    device float* dgamma [[buffer(3)]],
                                    constant tfm_rms_norm_params& p [[buffer(4)]],
                                    TFM_KERNEL_BUILTINS) {
  threadgroup float partial[1024];
  const uint width = TFM_RMS_NORM_PARAM_GRAD_COLUMNS;
  const uint lanes = tgsize.x / width;
  const uint lane = lid.x / width;
  const uint column = tgid.x * width + lid.x % width;
  const bool active = column < p.channels && lane < lanes;

  float sum = 0.0f;
  if (active) {
    for (uint r = lane; r < p.rows; r += lanes) {
      const ulong i = static_cast<ulong>(r) * p.channels + column;
      sum += static_cast<float>(dy[i]) * rms_norm_xhat(static_cast<float>(x[i]), rstd[r]);
    }
  }
  partial[lid.x] = sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid.x < width && column < p.channels) {
    float total = 0.0f;
    for (uint l = 0; l < lanes; ++l) total += partial[l * width + lid.x];
    dgamma[column] = total;
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_RMS_NORM_KERNELS_H_
