// The gradient of a smooth activation in one pass (TfmetalExt>ActivationGrad):
//   dx = dy * act'(x), in float32 per element, rounded once to T by the kernel.
// Shared by the CPU kernel and the Metal kernels (see tfmetal/portable.h).
//
// act' per activation code (tfmetal_ext/backends/fusion.py
// ACTIVATION_GRAD_ACTIVATIONS lists the names in this order):
//   silu              s = sigmoid(x); s * (1 + x * (1 - s))
//                     (batch_norm_act.h's bna_activation_grad, TFM_BNA_SILU)
//   gelu              Phi(x) + x * phi(x), Phi = 0.5 (1 + erf(x / sqrt 2)),
//                     phi the standard normal density (bna_activation_grad,
//                     TFM_BNA_GELU; erf is tfm_int8_erf: erfc's fractional
//                     error < 1.2e-7, so Phi is off by at most ~1.2e-7 absolute)
//   gelu_approximate  the derivative of 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3),
//                     c = sqrt(2 / pi):
//                       0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2),  t = tanh(u)
//                     computed through 0.5 (1 + tanh(u)) = sigmoid(2u) =: s and
//                     1 - t^2 = 4 s (1 - s), with e = exp(-2|u|) in (0, 1]:
//                     s = 1 / (1 + e) (u >= 0) or e / (1 + e) (u < 0),
//                     s (1 - s) = e / (1 + e)^2. Same function; no 1 - t^2
//                     cancellation (which costs ~|x|^3 ulps near |x| = 3..5)
//                     and no tanh call: exp saturates to 0 cleanly.
//
// Edge cases:
// - NaN in x or dy gives NaN (every comparison below is false for NaN, and
//   the arithmetic propagates it).
// - |x| > TFM_ACTGRAD_SATURATION (128, +-inf included) is evaluated at
//   +-128, where every act' above is exactly 1 (x > 0) or 0 (x < 0) in
//   float32: silu's x e^x and gelu's x phi(x) are far below float32's
//   smallest subnormal (2^-149 ~ 1.4e-45) there (silu's underflows past
//   x ~ -104), and exp(-2|u|) is 0. So +inf gives dy, -inf gives 0 * dy
//   (0 for a finite dy), and no finite x overflows (x^3 of |x| <= 128 is
//   2.1e6; unclamped it would overflow only past |x| ~ 7e12, and x * (1 - s)
//   would be inf * 0 at inf).
//   TensorFlow's autodiff (float32, TF 2.21) differs only where it makes
//   inf * 0: at x = +-inf for tf.nn.silu (s (1 + x (1 - s))) and both forms
//   of tf.nn.gelu, and for tf.nn.gelu(approximate=True) also at finite
//   |x| > ~7e12, where its x^3 overflows (1e20 gives NaN there). Those NaNs
//   are artefacts of the formula, not of the function: the derivative tends
//   to 1 and 0, so that is what we return. Elsewhere (silu at -100,
//   gelu_approximate at +-50, ...) TF gives our values.
// - Large finite |x| below 128 is computed by the formulas themselves: silu
//   at x = -100 is s (1 + x (1 - s)) with exp(100) = inf in float32, s = 0,
//   so 0 (the true value -3.7e-42 is a float32 subnormal); gelu_approximate
//   at +-50: e = exp(-2|u|) = 0, so exactly 1 / 0.
#ifndef TFMETAL_ACTIVATION_GRAD_H_
#define TFMETAL_ACTIVATION_GRAD_H_

#include "tfmetal/batch_norm_act.h"  // bna_activation_grad: silu's and exact gelu's derivatives
#include "tfmetal/portable.h"

// Activation codes: the op's `activation` attribute maps to one of these.
#define TFM_ACTGRAD_SILU 0              // x * sigmoid(x): Keras' "silu" / "swish", tf.nn.silu
#define TFM_ACTGRAD_GELU 1              // exact (erf) GELU: tf.nn.gelu(approximate=False)
#define TFM_ACTGRAD_GELU_APPROXIMATE 2  // tanh GELU: tf.nn.gelu(approximate=True)
#define TFM_ACTGRAD_NUM_ACTIVATIONS 3

// Beyond +-this x is evaluated here (see the edge cases above).
#define TFM_ACTGRAD_SATURATION 128.0f

// d/dx of 0.5 x (1 + tanh(c (x + 0.044715 x^3))).
TFM_INLINE float actgrad_gelu_tanh_grad(float x) {
  const float c = 0.79788456080286536f;  // sqrt(2 / pi)
  const float k = 0.044715f;
  const float x2 = x * x;
  const float u = c * x * (1.0f + k * x2);
  const float e = tfm_exp(-2.0f * tfm_abs(u));  // in (0, 1]; 0 once |u| > ~52
  const float r = 1.0f / (1.0f + e);
  const float s = u < 0.0f ? e * r : r;  // sigmoid(2u) = 0.5 (1 + tanh(u))
  const float sech2_over_4 = e * r * r;  // s (1 - s) = (1 - tanh(u)^2) / 4
  return s + 2.0f * x * sech2_over_4 * c * (1.0f + 3.0f * k * x2);
}

// act'(x) for one of the TFM_ACTGRAD_* codes, in float32.
TFM_INLINE float actgrad_derivative(int32_t kind, float x) {
  // Clamped by selects, not tfm_clamp: NaN must stay NaN (tfm_clamp returns a bound for NaN).
  float v = x > TFM_ACTGRAD_SATURATION ? TFM_ACTGRAD_SATURATION : x;
  v = v < -TFM_ACTGRAD_SATURATION ? -TFM_ACTGRAD_SATURATION : v;
  switch (kind) {
    case TFM_ACTGRAD_SILU:
      return bna_activation_grad(TFM_BNA_SILU, v, 0.0f);
    case TFM_ACTGRAD_GELU:
      return bna_activation_grad(TFM_BNA_GELU, v, 0.0f);
    default:
      return actgrad_gelu_tanh_grad(v);
  }
}

// dx = dy * act'(x), float32; the kernels round it once to T.
TFM_INLINE float activation_grad(int32_t kind, float dy, float x) { return dy * actgrad_derivative(kind, x); }

#endif  // TFMETAL_ACTIVATION_GRAD_H_
