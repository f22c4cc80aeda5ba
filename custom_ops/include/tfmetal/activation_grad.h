// The gradient of a smooth activation in one pass (TfmetalExt>ActivationGrad):
//   dx = dy * act'(x), in float32 per element, rounded once to T by the kernel.
// Shared by the CPU kernel and the Metal kernels (see tfmetal/portable.h).
//
// act' per activation code (tfmetal_ext/backends/fusion.py
// ACTIVATION_GRAD_ACTIVATIONS lists the names in this order):
//   silu              s = sigmoid(x); s * (1 + x * (1 - s)), with
//                     e = exp(-|x|) in (0, 1]: s = 1 / (1 + e) (x >= 0) or
//                     e / (1 + e) (x < 0) (no exp overflow)
//   gelu              Phi(x) + x * phi(x), Phi = 0.5 (1 + erf(x / sqrt 2)),
//                     phi the standard normal density; Phi = 1 - erfc(z) / 2
//                     (x >= 0) or erfc(z) / 2 (x < 0), z = |x| / sqrt 2, erfc
//                     int8.h's form (tfm_int8_erfc_exponent: fractional error
//                     < 1.2e-7), so no 1 + erf cancellation for x < 0
//   gelu_approximate  the derivative of 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3),
//                     c = sqrt(2 / pi):
//                       0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2),  t = tanh(u)
//                     computed through 0.5 (1 + tanh(u)) = sigmoid(2u) =: s and
//                     1 - t^2 = 4 s (1 - s), with e = exp(-2|u|) in (0, 1]:
//                     s = 1 / (1 + e) (u >= 0) or e / (1 + e) (u < 0),
//                     s (1 - s) = e / (1 + e)^2. Same function; no 1 - t^2
//                     cancellation (which costs ~|x|^3 ulps near |x| = 3..5)
//                     and no tanh call: exp saturates to 0 cleanly.
// Every exp here has an argument <= 0 and is tfm_exp_poly (portable.h: a
// polynomial of about 1 ulp, branch-free), so the CPU kernel's loop vectorizes
// (expf is a scalar library call, ~5x slower per element than TF's own
// vectorized ops) and the CPU and the emulator agree bit for bit.
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
//   at x = -100 is s (1 + x (1 - s)) with s = exp(-100) / (1 + exp(-100)) = 0
//   (tfm_exp_poly gives 0 below -87.3), so 0 (the true value -3.7e-42 is a
//   float32 subnormal); gelu_approximate at +-50: e = exp(-2|u|) = 0, so
//   exactly 1 / 0.
#ifndef TFMETAL_ACTIVATION_GRAD_H_
#define TFMETAL_ACTIVATION_GRAD_H_

#include "tfmetal/int8.h"  // tfm_int8_erfc_exponent: the erfc of exact gelu's Phi
#include "tfmetal/portable.h"

// Activation codes: the op's `activation` attribute maps to one of these.
#define TFM_ACTGRAD_SILU 0              // x * sigmoid(x): Keras' "silu" / "swish", tf.nn.silu
#define TFM_ACTGRAD_GELU 1              // exact (erf) GELU: tf.nn.gelu(approximate=False)
#define TFM_ACTGRAD_GELU_APPROXIMATE 2  // tanh GELU: tf.nn.gelu(approximate=True)
#define TFM_ACTGRAD_NUM_ACTIVATIONS 3

// Beyond +-this x is evaluated here (see the edge cases above).
#define TFM_ACTGRAD_SATURATION 128.0f

// sigmoid(v) from e = exp(-|v|) (no overflow): r = 1 / (1 + e) for v >= 0,
// e * r below. The selects pick constants or values computed either way
// (here: the factor 1 or e, by their bits), never an operation done in one arm
// only, which g++ keeps as a branch (it might trap), stopping the loop vectorizing.
TFM_INLINE float actgrad_sigmoid(float v) {
  const float e = tfm_exp_poly(-tfm_abs(v));
  const float r = 1.0f / (1.0f + e);
  const uint32_t positive = 0u - static_cast<uint32_t>(v >= 0.0f);  // a select on bits (g++ keeps a branch for ?:)
  return tfm_bits_to_float((tfm_float_to_bits(1.0f) & positive) | (tfm_float_to_bits(e) & ~positive)) * r;
}

// d/dx of x * sigmoid(x).
TFM_INLINE float actgrad_silu_grad(float x) {
  const float s = actgrad_sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// Phi(x) = 0.5 (1 + erf(x / sqrt 2)), as 1 - erfc(z) / 2 (x >= 0) or erfc(z) / 2 (x < 0), z = |x| / sqrt 2.
TFM_INLINE float actgrad_gelu_cdf(float x) {
  const float z = tfm_abs(x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.5f * z);
  const float half_erfc = 0.5f * t * tfm_exp_poly(tfm_int8_erfc_exponent(z, t));
  const bool upper = x >= 0.0f;  // 1 - half_erfc, else half_erfc (selects of constants: see actgrad_sigmoid)
  return (upper ? 1.0f : 0.0f) + (upper ? -1.0f : 1.0f) * half_erfc;
}

// d/dx of 0.5 x (1 + erf(x / sqrt 2)): Phi(x) + x phi(x).
TFM_INLINE float actgrad_gelu_grad(float x) {
  return actgrad_gelu_cdf(x) + x * 0.39894228040143268f * tfm_exp_poly(-0.5f * x * x);
}

// d/dx of 0.5 x (1 + tanh(c (x + 0.044715 x^3))).
TFM_INLINE float actgrad_gelu_tanh_grad(float x) {
  const float c = 0.79788456080286536f;  // sqrt(2 / pi)
  const float k = 0.044715f;
  const float x2 = x * x;
  const float u = c * x * (1.0f + k * x2);
  const float e = tfm_exp_poly(-2.0f * tfm_abs(u));  // in (0, 1]; 0 once |u| > ~44
  const float r = 1.0f / (1.0f + e);
  const float er = e * r;
  const float s = u < 0.0f ? er : r;  // sigmoid(2u) = 0.5 (1 + tanh(u))
  const float sech2_over_4 = er * r;  // s (1 - s) = (1 - tanh(u)^2) / 4
  return s + 2.0f * x * sech2_over_4 * c * (1.0f + 3.0f * k * x2);
}

// x clamped to +-TFM_ACTGRAD_SATURATION by selects on bits, not tfm_clamp: NaN must stay NaN
// (tfm_clamp returns a bound for NaN), and ?: keeps branches (see actgrad_sigmoid).
TFM_INLINE float actgrad_clamped(float x) {
  const uint32_t high = 0u - static_cast<uint32_t>(x > TFM_ACTGRAD_SATURATION);
  const uint32_t low = 0u - static_cast<uint32_t>(x < -TFM_ACTGRAD_SATURATION);
  return tfm_bits_to_float((tfm_float_to_bits(TFM_ACTGRAD_SATURATION) & high) |
                           (tfm_float_to_bits(-TFM_ACTGRAD_SATURATION) & low) | (tfm_float_to_bits(x) & ~(high | low)));
}

// act'(x) for one of the TFM_ACTGRAD_* codes, in float32.
TFM_INLINE float actgrad_derivative(int32_t kind, float x) {
  const float v = actgrad_clamped(x);
  switch (kind) {
    case TFM_ACTGRAD_SILU:
      return actgrad_silu_grad(v);
    case TFM_ACTGRAD_GELU:
      return actgrad_gelu_grad(v);
    default:
      return actgrad_gelu_tanh_grad(v);
  }
}

// dx = dy * act'(x), float32; the kernels round it once to T.
TFM_INLINE float activation_grad(int32_t kind, float dy, float x) { return dy * actgrad_derivative(kind, x); }

// ---------------------------------------------------------------- gated form
//
// TfmetalExt>GatedActivationGrad: the backward of y = act(gate) * up (a gated
// feed-forward's product: Llama's silu(gate) * up, Gemma's gelu(x1) * x2):
//   d_gate = dy * up * act'(gate),   d_up = dy * act(gate),
// each in float32 and rounded once to T. act(gate) = gate * f(gate) with
// f = sigmoid (silu), Phi (gelu) or 0.5 (1 + tanh(u)) = sigmoid(2u)
// (gelu_approximate), the factor computed at the clamped gate (it is exactly
// 1 or 0 in float32 beyond +-128) and multiplied by the gate itself: so
// act(+inf) = +inf and act(-inf) = -inf * 0 = NaN, as TensorFlow's forward
// formulas give. NaN propagates.

// f(v) of act(v) = v * f(v), v within +-TFM_ACTGRAD_SATURATION.
TFM_INLINE float actgrad_factor(int32_t kind, float v) {
  switch (kind) {
    case TFM_ACTGRAD_SILU:
      return actgrad_sigmoid(v);
    case TFM_ACTGRAD_GELU:
      return actgrad_gelu_cdf(v);
    default: {
      const float u = 0.79788456080286536f * v * (1.0f + 0.044715f * v * v);
      return actgrad_sigmoid(2.0f * u);
    }
  }
}

// d_gate and d_up of y = act(gate) * up, float32; the kernels round each once to T.
TFM_INLINE void gated_activation_grad(int32_t kind, float dy, float gate, float up, TFM_THREAD float* d_gate,
                                      TFM_THREAD float* d_up) {
  *d_gate = (dy * up) * actgrad_derivative(kind, gate);
  *d_up = dy * (gate * actgrad_factor(kind, actgrad_clamped(gate)));
}

#endif  // TFMETAL_ACTIVATION_GRAD_H_
