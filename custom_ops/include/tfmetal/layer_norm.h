// Layer normalization over the last axis: the per-row and per-element math,
// shared by the CPU kernel and the Metal kernel (see tfmetal/portable.h).
//
// Per row of C values, accumulated in float32 whatever the input dtype:
//   mean = x0 + sum(x - x0) / C        x0 = the row's first value: the sum's rounding
//                                       scales with the spread, not with |mean|
//   var  = sum((x - mean)^2) / C       second pass over the row: stays accurate
//                                       when |mean| >> std (E[x^2] - mean^2 does not)
//   rstd = 1 / sqrt(var + epsilon)
//   y    = (x - mean) * rstd * gamma + beta
// Gradient, with xhat = (x - mean) * rstd and g = dy * gamma:
//   dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dgamma = sum over rows of dy * xhat,   dbeta = sum over rows of dy
// An empty row (C == 0) has mean 0 and variance 0, so rstd = 1 / sqrt(epsilon).
// The kernels own the loops and the summation order; only the formulas live here.
#ifndef TFMETAL_LAYER_NORM_H_
#define TFMETAL_LAYER_NORM_H_

#include "tfmetal/portable.h"

// 1 / C, or 0 for an empty row (whose sums are 0: mean 0, variance 0).
TFM_INLINE float layer_norm_inv_count(float count) { return count > 0.0f ? 1.0f / count : 0.0f; }

// The row's mean from its first value x0 and the sum of (x - x0).
TFM_INLINE float layer_norm_mean(float x0, float sum_shifted, float inv_count) {
  return x0 + sum_shifted * inv_count;
}

// rstd from the row's sum of squared deviations from its mean.
TFM_INLINE float layer_norm_rstd(float sum_sq_centered, float inv_count, float epsilon) {
  return tfm_rsqrt(sum_sq_centered * inv_count + epsilon);
}

TFM_INLINE float layer_norm_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

TFM_INLINE float layer_norm_forward(float x, float mean, float rstd, float gamma, float beta) {
  return layer_norm_xhat(x, mean, rstd) * gamma + beta;
}

// dx for one element; mean_g = mean(dy * gamma), mean_gxhat = mean(dy * gamma * xhat)
// over the element's row.
TFM_INLINE float layer_norm_backward(float dy, float gamma, float xhat, float rstd, float mean_g,
                                     float mean_gxhat) {
  return rstd * (dy * gamma - mean_g - xhat * mean_gxhat);
}

#endif  // TFMETAL_LAYER_NORM_H_
