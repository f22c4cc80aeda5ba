// The math of the elementwise gap kernels: GPU kernels tfmetal_ext registers
// for standard TensorFlow ops a Metal backend has none for
// (tfmetal_ext.backends.gap_kernels). Shared by the Metal kernels
// (custom_ops/metal/gap_elementwise.h) and the emulator tests; every
// function takes and returns float: half and bfloat16 are widened on load and
// rounded once, to nearest even, on store.
//
// Agreement with TensorFlow's CPU kernels, measured against TF 2.21 on x86
// (AVX2) over 2.4M inputs spanning [-100, 100] and 1e-45..100 in magnitude,
// and derived below; the bounds are what tests/ops/test_gap_elementwise_metal_emu.py
// asserts. "ulp" is the spacing of the output type at TF's value.
// - IsFinite, Fill, ZerosLike, OnesLike: bit for bit.
// - EluGrad: TF's expression (outputs + 1) * gradients, in float the same two
//   roundings: bit for bit. In half/bfloat16 TF rounds outputs + 1 too, an
//   error that propagates as at most 1 ulp, plus half an ulp for each final
//   rounding: at most 2 ulps (1 measured).
// - SigmoidGrad: dy * (y * (1 - y)), the association of TF's vectorised
//   path (bit for bit with it in float). Its scalar path, for the elements
//   left over after the last whole AVX packet (all of a 7-float tensor),
//   multiplies dy * y first. Both round t = 1 - y alike; then each rounds
//   one product of its own (< 1 ulp once propagated) and the result (half an
//   ulp): at most 3 float ulps apart (2 measured). In half/bfloat16 TF
//   rounds 1 - y, y * (.) and dy * (.): two propagated roundings and a final
//   half ulp, against our one half ulp: at most 3 ulps (2 measured).
// - Sigmoid: 1 / (1 + exp(-x)), within 2.35 float ulps of exact (measured,
//   with the host libm's expf in the emulator). TF's float kernel uses
//   Eigen's own approximation, measured within 6.2 ulps of exact: at most 8
//   ulps apart. In half/bfloat16 TF rounds exp, 1 + e and the quotient (at
//   most 2.5 ulps from exact, 1.8 measured), we round once: at most 3 ulps
//   (2 measured).
// - Elu: exp(x) - 1 for x < 0, as TF's functor writes it (not expm1), so the
//   difference is exp's, as an absolute error: below 1 the subtraction is
//   exact (Sterbenz) or rounds to the grid of (-1, -0.5]. Float: TF's scalar
//   path (std::exp) is ours bit for bit in the emulator; its vectorised exp
//   and ours are each within about an ulp of e < 1 (2^-24): asserted 2^-23
//   absolute, 2^-24 measured. In
//   half/bfloat16 TF rounds exp(x) before subtracting: one ulp of the type
//   just below 1 (2^-11, 2^-8) absolute, measured equal to it.
// - Erfc: our own evaluation (gap_erfc below), within 6.9 float ulps of the
//   exact value for every float in [-11, 11] (checked exhaustively against
//   double erfc with the host's expf); the bound asserted is 8. TF's float
//   kernel evaluates exp(-x * x) with x * x rounded: a relative error of up to
//   x^2 * 2^-24 in the result, x^2 ulps (64 measured at x = 8.7), plus its
//   approximation's own few ulps: asserted x^2 + 4 from exact, so at most
//   x^2 + 12 ulps apart. In half/bfloat16 TF evaluates in float and rounds
//   once (measured within half an ulp of exact), as we do: when both float
//   values round to different neighbours the exact value lies between them,
//   so at most 1 ulp apart.
// - TF's CPU kernels run with subnormals flushed to zero; these kernels keep
//   them, and sigmoid's exp(-x) overflows below x = -88.7, where the exact
//   value is a float subnormal: near 0 both sides are within float's
//   smallest normal (2^-126) of each other and of the exact value.
// - On a Mac, metal::exp (fast math off) replaces the host's expf: its
//   accuracy is the Metal Shading Language's bound for precise exp, not
//   checked here; `tfmetal-ext doctor --selftest` compares the GPU with TF's
//   CPU kernel on the device (relative 1e-5 in float).
#ifndef TFMETAL_GAP_ELEMENTWISE_H_
#define TFMETAL_GAP_ELEMENTWISE_H_

#include "tfmetal/portable.h"

// NaN stays NaN; -inf gives 0 and +inf 1 (exp(inf) = inf, 1 / inf = 0).
TFM_INLINE float gap_sigmoid(float x) { return 1.0f / (1.0f + tfm_exp(-x)); }

TFM_INLINE float gap_sigmoid_grad(float y, float dy) { return dy * (y * (1.0f - y)); }

// x for x >= 0 (and NaN), exp(x) - 1 below: -1 at -inf.
TFM_INLINE float gap_elu(float x) { return x < 0.0f ? tfm_exp(x) - 1.0f : x; }

TFM_INLINE float gap_elu_grad(float dy, float y) { return y < 0.0f ? (y + 1.0f) * dy : dy; }

// erfc(x) = 1 - erf(x): 2 at -inf, 0 at +inf, NaN for NaN.
// - |x| < 0.5: 1 - x * P(x^2), P the Taylor series of erf(x) / x to x^18
//   (the next term is below 2^-30 of erf there; 1 - erf >= 0.47, no
//   cancellation beyond an ulp).
// - |x| >= 0.5: erfc(z) = t * exp(-z^2 + Q(t)), t = 1 / (1 + z / 2), with
//   the published Chebyshev fit Q of Press et al. (Numerical Recipes,
//   fractional error below 1.2e-7). z^2 is split exactly (h + l, l by fma)
//   and exp(-h) taken on its own, so the rounding of z^2 (which costs TF's
//   kernel up to z^2 ulps) never enters the exponent. Negative x: 2 - erfc(-x).
// Below FLT_MIN (x > 9.19) the result is a subnormal, exact to within 2^-149.
TFM_INLINE float gap_erfc(float x) {
  if (!(x == x)) return x;
  const float z = x < 0.0f ? -x : x;
  if (z < 0.5f) {
    const float s = x * x;
    float p = -1.6365844691234924e-07f;
    p = tfm_fma(p, s, 1.6462114365889246e-06f);
    p = tfm_fma(p, s, -1.492565035840625e-05f);
    p = tfm_fma(p, s, 1.2055332981789664e-04f);
    p = tfm_fma(p, s, -8.548327023450852e-04f);
    p = tfm_fma(p, s, 5.223977625442188e-03f);
    p = tfm_fma(p, s, -2.6866170645131252e-02f);
    p = tfm_fma(p, s, 1.1283791670955126e-01f);
    p = tfm_fma(p, s, -3.7612638903183754e-01f);
    p = tfm_fma(p, s, 1.1283791670955126f);
    return 1.0f - x * p;
  }
  if (z > 10.5f) return x < 0.0f ? 2.0f : 0.0f;  // erfc(10.5) < 2^-149 (and z * z overflows at inf)
  const float t = 1.0f / (1.0f + 0.5f * z);
  float q = 0.17087277f;
  q = tfm_fma(q, t, -0.82215223f);
  q = tfm_fma(q, t, 1.48851587f);
  q = tfm_fma(q, t, -1.13520398f);
  q = tfm_fma(q, t, 0.27886807f);
  q = tfm_fma(q, t, -0.18628806f);
  q = tfm_fma(q, t, 0.09678418f);
  q = tfm_fma(q, t, 0.37409196f);
  q = tfm_fma(q, t, 1.00002368f);
  q = tfm_fma(q, t, -1.26551223f);
  const float h = z * z;
  const float l = tfm_fma(z, z, -h);  // z * z - h, exactly
  const float r = t * tfm_exp(q - l) * tfm_exp(-h);
  return x < 0.0f ? 2.0f - r : r;
}

// 1 for a finite value, 0 for NaN and +-inf.
TFM_INLINE uint8_t gap_is_finite(float x) { return tfm_isfinite(x) ? 1 : 0; }

#endif  // TFMETAL_GAP_ELEMENTWISE_H_
