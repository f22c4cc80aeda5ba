// Batch normalization in training mode + optional residual add + activation
// (TfmetalExt>BatchNormAct, TfmetalExt>BatchNormActGrad): the per-element and
// per-channel math, shared by the CPU kernel and the Metal kernels (see
// tfmetal/portable.h). The kernels own the loops and the summation order.
//
// x is [M rows, C channels] (channels last; every other axis is a row axis).
// Per channel c, over the M rows, accumulated in float32 for every dtype:
//   mean     = sum(x) / M
//   variance = sum((x - mean)^2) / M            (biased, as Keras' moments)
//   inv_std  = 1 / sqrt(variance + epsilon)
// Per element:
//   pre = (x - mean) * (inv_std * gamma) + beta  (+ side)
//   y   = act(pre), rounded once to T.
// (x - mean) first, then the scale: x * scale + (beta - mean * scale) would
// cancel two large terms when |mean| >> std.)
//
// Numerically stable statistics: the rows are cut into blocks fixed by the
// shape (not by the thread count). A block's mean is its shifted sum
// (shift = its first row) and its squared deviations are summed about that
// mean with the compensating term of the corrected two-pass algorithm; the
// blocks' (count, shift + mean, M2) are merged in block order by Chan et
// al.'s formula (bna_merge), the means kept relative to a shift. A channel of 1e4 + N(0, 1) keeps its variance to
// float32 accuracy (the naive E[x^2] - E[x]^2 loses all of it).
// An empty batch (M == 0) gives mean = variance = NaN, as Keras' moments of
// an empty batch do (0 / 0).
//
// Gradient (dpre = dy * act'(pre), xhat = (x - mean) * inv_std):
//   dbeta  = sum over rows of dpre
//   dgamma = sum over rows of dpre * xhat
//   dx     = gamma * inv_std / M * (M dpre - dbeta - xhat dgamma)
//          = scale * (dpre - (dbeta + xhat dgamma) / M)
//   dside  = dpre
// Which of y / pre the derivative reads: EVERY activation reads pre,
// recomputed from x (+ side) and the saved mean / inv_std exactly as the
// forward computed it (bna_pre; same float32 operations, so the same value).
// The gradient reads x anyway (for xhat), so pre costs no memory traffic
// without a side input and the same as reading y with one; and it is exact:
// y is rounded to T, which for half / bfloat16 would move relu6's upper kink
// (bfloat16 rounds 5.98 to 6) and lose elu's exp(pre) = y + 1 near 0. y is an
// input of the gradient op for the interface's sake and is not read.
// Derivatives at the kinks follow TensorFlow's gradient ops: relu' = [pre > 0],
// relu6' = [0 < pre < 6], leaky_relu' = pre > 0 ? 1 : alpha, elu' = pre < 0 ?
// exp(pre) : 1.
#ifndef TFMETAL_BATCH_NORM_ACT_H_
#define TFMETAL_BATCH_NORM_ACT_H_

#include "tfmetal/int8.h"  // tfm_int8_erf: the one float erf of every mode
#include "tfmetal/portable.h"

// Activation codes: the op's `activation` attribute maps to one of these
// (tfmetal_ext/backends/fusion.py BATCH_NORM_ACT_ACTIVATIONS lists the names in this order).
#define TFM_BNA_LINEAR 0
#define TFM_BNA_RELU 1
#define TFM_BNA_RELU6 2
#define TFM_BNA_ELU 3
#define TFM_BNA_LEAKY_RELU 4
#define TFM_BNA_SILU 5  // x * sigmoid(x), Keras' "silu" / "swish"
#define TFM_BNA_GELU 6  // exact (erf) GELU, Keras' "gelu" (approximate=False)
#define TFM_BNA_NUM_ACTIVATIONS 7

TFM_INLINE float bna_sigmoid(float v) { return 1.0f / (1.0f + tfm_exp(-v)); }

// act(v). NaN propagates through every activation (the comparisons are false for NaN).
TFM_INLINE float bna_activate(int32_t kind, float v, float alpha) {
  switch (kind) {
    case TFM_BNA_RELU:
      return v < 0.0f ? 0.0f : v;
    case TFM_BNA_RELU6:
      return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);
    case TFM_BNA_ELU:
      return v < 0.0f ? tfm_exp(v) - 1.0f : v;
    case TFM_BNA_LEAKY_RELU: {  // selects, then arithmetic on both: no branch (vectorizes)
      const bool positive = v > 0.0f;
      return (positive ? v : 0.0f) + alpha * (positive ? 0.0f : v);
    }
    case TFM_BNA_SILU:
      return v * bna_sigmoid(v);
    case TFM_BNA_GELU:
      return 0.5f * v * (1.0f + tfm_int8_erf(v * 0.70710678118654752f));
    default:
      return v;
  }
}

// act'(v), as TensorFlow's gradient ops define it at the kinks. NaN gives NaN
// for the smooth activations and 0 (relu, relu6) / alpha (leaky_relu) / 1
// (elu, linear) at the kinked ones, as their gradient ops; the NaN still
// reaches dgamma / dbeta through xhat and dx through the channel sums.
TFM_INLINE float bna_activation_grad(int32_t kind, float v, float alpha) {
  switch (kind) {
    case TFM_BNA_RELU:
      return v > 0.0f ? 1.0f : 0.0f;
    case TFM_BNA_RELU6:
      return (v > 0.0f && v < 6.0f) ? 1.0f : 0.0f;
    case TFM_BNA_ELU:
      return v < 0.0f ? tfm_exp(v) : 1.0f;
    case TFM_BNA_LEAKY_RELU:
      return v > 0.0f ? 1.0f : alpha;
    case TFM_BNA_SILU: {
      const float s = bna_sigmoid(v);
      return s * (1.0f + v * (1.0f - s));
    }
    case TFM_BNA_GELU: {
      // 0.5 (1 + erf(v / sqrt 2)) + v * phi(v), phi the standard normal density.
      const float cdf = 0.5f * (1.0f + tfm_int8_erf(v * 0.70710678118654752f));
      return cdf + v * 0.39894228040143268f * tfm_exp(-0.5f * v * v);
    }
    default:
      return 1.0f;
  }
}

// dpre = dy * act'(v), as TensorFlow's gradient ops compute it: the kinked
// activations select dy or 0 (ReluGrad, Relu6Grad: a NaN dy where the unit is
// off gives 0), leaky_relu scales by alpha there. Written as selects of loaded
// values and constants, never a conditional multiply, so the CPU loops
// vectorize without -fno-trapping-math.
TFM_INLINE float bna_dpre(int32_t kind, float dy, float v, float alpha) {
  switch (kind) {
    case TFM_BNA_LINEAR:
      return dy;
    case TFM_BNA_RELU:
      return v > 0.0f ? dy : 0.0f;
    case TFM_BNA_RELU6:
      return (v > 0.0f && v < 6.0f) ? dy : 0.0f;
    case TFM_BNA_LEAKY_RELU: {
      const bool positive = v > 0.0f;
      return (positive ? dy : 0.0f) + alpha * (positive ? 0.0f : dy);
    }
    default:
      return dy * bna_activation_grad(kind, v, alpha);
  }
}

// ---------------------------------------------------------------- statistics
// A block's (or a merged run's) statistics of one channel: count, the mean as
// shift + mean (shift: a value of the channel, the block's first row; mean
// relative to it, so a large common offset costs no precision), and M2 =
// the sum of squared deviations from the mean.
struct bna_moments {
  float count;
  float shift;
  float mean;  // relative to shift
  float m2;
};

// The moments of a block of n rows from, with d = x - shift: the first
// pass's sum of d (mean0 = sum_d / n), then the second pass's sums of
// e = d - mean0 and e^2 (the corrected two-pass algorithm: the e-sum
// corrects mean0's rounding).
TFM_INLINE float bna_block_mean0(float sum_d, float n) { return sum_d / n; }

TFM_INLINE bna_moments bna_block_moments(float n, float shift, float mean0, float sum_e, float sum_e2) {
  bna_moments m;
  m.count = n;
  m.shift = shift;
  m.mean = mean0 + sum_e / n;
  m.m2 = sum_e2 - sum_e * sum_e / n;
  return m;
}

// Chan, Golub & LeVeque's merge of two disjoint runs' moments (a first: the
// order is part of the result), kept relative to a's shift; the difference
// of the shifts is taken first (exact for nearby values). An empty run
// (count 0) leaves the other.
TFM_INLINE bna_moments bna_merge(bna_moments a, bna_moments b) {
  if (b.count == 0.0f) return a;
  if (a.count == 0.0f) return b;
  bna_moments m;
  m.count = a.count + b.count;
  m.shift = a.shift;
  const float delta = (b.shift - a.shift) + (b.mean - a.mean);
  const float wb = b.count / m.count;
  m.mean = a.mean + delta * wb;
  m.m2 = a.m2 + b.m2 + delta * delta * a.count * wb;
  return m;
}

// The merged mean (one rounding at the end); NaN for an empty batch (its
// M2 / count = 0 / 0, as Keras' moments of an empty batch).
TFM_INLINE float bna_mean(bna_moments m) { return m.count > 0.0f ? m.shift + m.mean : m.m2 / m.count; }

// The biased variance M2 / M: NaN for an empty batch (0 / 0, as Keras' moments).
TFM_INLINE float bna_variance(bna_moments m) { return m.m2 / m.count; }

TFM_INLINE float bna_inv_std(float variance, float epsilon) { return 1.0f / tfm_sqrt(variance + epsilon); }

// ---------------------------------------------------------------- moving statistics
// With the layer's moving statistics as inputs (the op's `moving`, attr
// momentum), the op also returns their update, as Keras' BatchNormalization
// computes it in float32:
//   new = moving * momentum + batch * (1 - momentum)
// for the mean and for the biased variance. (1 - momentum is rounded in
// float32 from the float32 momentum; Keras rounds it from the Python double:
// the two batch weights can differ by one float32 ulp.) The update is taken
// only when every blended mean and variance of every channel is finite;
// otherwise (an inf or NaN in the batch, an empty batch's NaN statistics) the
// moving statistics come back bitwise unchanged: a loss-scaled step that is
// skipped leaves them as they were.
TFM_INLINE float bna_blend(float moving, float batch, float momentum) {
  const float kept = moving * momentum;
  const float added = batch * (1.0f - momentum);
  return kept + added;
}

// The finiteness of one channel's update (the guard ANDs it over the channels).
TFM_INLINE bool bna_blend_finite(float new_mean, float new_variance) {
  return tfm_isfinite(new_mean) && tfm_isfinite(new_variance);
}

// ---------------------------------------------------------------- elements
// scale = inv_std * gamma per channel (computed once per channel by every kernel).
TFM_INLINE float bna_scale(float inv_std, float gamma) { return inv_std * gamma; }

// pre without the side input; the kernels add the side as `pre + side`.
TFM_INLINE float bna_pre(float x, float mean, float scale, float beta) { return (x - mean) * scale + beta; }

TFM_INLINE float bna_xhat(float x, float mean, float inv_std) { return (x - mean) * inv_std; }

// dx of one element from its dpre, xhat and its channel's sums (inv_count = 1 / M).
TFM_INLINE float bna_dx(float dpre, float xhat, float scale, float dbeta, float dgamma, float inv_count) {
  return scale * (dpre - (dbeta + xhat * dgamma) * inv_count);
}

#endif  // TFMETAL_BATCH_NORM_ACT_H_
