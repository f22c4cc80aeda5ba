// RMS normalization over the last axis: the per-row and per-element math,
// shared by the CPU kernel and the Metal kernel (see tfmetal/portable.h).
//
// Per row of C values, accumulated in float32 whatever the input dtype:
//   rstd = 1 / sqrt(sum(x^2) / C + epsilon)     (no mean is subtracted)
//   y    = x * rstd * gamma
// Gradient, with xhat = x * rstd and g = dy * gamma:
//   dx     = rstd * (g - xhat * mean(g * xhat))
//   dgamma = sum over rows of dy * xhat
// (d rstd / d x_j = -rstd^3 x_j / C, so the row term is
//  -x_i rstd^3 sum_j(g_j x_j) / C = -rstd xhat_i mean(g xhat).)
// An empty row (C == 0) has a zero mean square, so rstd = 1 / sqrt(epsilon).
// The kernels own the loops and the summation order; only the formulas live here.
#ifndef TFMETAL_RMS_NORM_H_
#define TFMETAL_RMS_NORM_H_

#include "tfmetal/portable.h"

// 1 / C, or 0 for an empty row (whose sum of squares is 0).
TFM_INLINE float rms_norm_inv_count(float count) { return count > 0.0f ? 1.0f / count : 0.0f; }

// rstd from the row's sum of squares.
TFM_INLINE float rms_norm_rstd(float sum_squares, float inv_count, float epsilon) {
  return tfm_rsqrt(sum_squares * inv_count + epsilon);
}

TFM_INLINE float rms_norm_xhat(float x, float rstd) { return x * rstd; }

TFM_INLINE float rms_norm_forward(float x, float rstd, float gamma) { return rms_norm_xhat(x, rstd) * gamma; }

// dx for one element; mean_gxhat = mean(dy * gamma * xhat) over the element's row.
TFM_INLINE float rms_norm_backward(float dy, float gamma, float xhat, float rstd, float mean_gxhat) {
  return rstd * (dy * gamma - xhat * mean_gxhat);
}

#endif  // TFMETAL_RMS_NORM_H_
