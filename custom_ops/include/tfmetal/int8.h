// Weight-only int8 contractions (TfmetalExt>Int8MatMul, TfmetalExt>Int8Conv2D): the math
// shared by the CPU kernels, the Metal kernels and the emulator (see tfmetal/portable.h).
//
// Convention (Keras' `quantize("int8")`): a float kernel w is stored as int8 q with a
// float32 scale per output channel, q = round(w * scale) clipped to [-127, 127], so
// w ~= q / scale. An output element is
//
//   y = activation(acc / scale + bias),   acc = sum_k float(x_k) * float(q_k)
//
// accumulated in float32 for every activation dtype, in this order (divide, add, activate:
// the order of Keras' quantized Dense call). The weights are never de-quantized into memory.
#ifndef TFMETAL_INT8_H_
#define TFMETAL_INT8_H_

#include "tfmetal/portable.h"

// Activation codes: the op's `activation` attribute string maps to one of these
// (tfmetal_ext/backends/fusion.py INT8_ACTIVATIONS lists the strings in this order).
#define TFM_INT8_LINEAR 0
#define TFM_INT8_RELU 1
#define TFM_INT8_RELU6 2
#define TFM_INT8_ELU 3
#define TFM_INT8_LEAKY_RELU 4
#define TFM_INT8_GELU 5              // exact (erf) GELU, Keras' "gelu"
#define TFM_INT8_GELU_APPROXIMATE 6  // tanh approximation
#define TFM_INT8_TANH 7
#define TFM_INT8_SIGMOID 8
#define TFM_INT8_NUM_ACTIVATIONS 9

// erf(x) for float, the same in every mode (Metal has no erf). Abramowitz & Stegun
// 7.1.26 refined to a maximum absolute error of 1.2e-7 (Numerical Recipes' erfc
// Chebyshev form): within float32 rounding of erff for every x.
// erfc(z) for z >= 0 in that form is t * exp(exponent), t = 1 / (1 + z / 2): the
// exponent, for callers that choose the exp (tfmetal/activation_grad.h takes tfm_exp_poly).
TFM_INLINE float tfm_int8_erfc_exponent(float z, float t) {
  return -z * z - 1.26551223f +
         t * (1.00002368f +
         t * (0.37409196f +
         t * (0.09678418f +
         t * (-0.18628806f +
         t * (0.27886807f +
         t * (-1.13520398f +
         t * (1.48851587f +
         t * (-0.82215223f +
         t * 0.17087277f))))))));
}

TFM_INLINE float tfm_int8_erf(float x) {
  float z = tfm_abs(x);
  float t = 1.0f / (1.0f + 0.5f * z);
  float poly = tfm_int8_erfc_exponent(z, t);
  float erfc = t * tfm_exp(poly);
  float r = 1.0f - erfc;
  return x < 0.0f ? -r : r;
}

// activation(v) for one of the TFM_INT8_* codes; `alpha` is leaky_relu's negative slope.
// NaN propagates through every activation (relu/relu6 test v < 0 and v > 6, both false
// for NaN, so NaN comes out).
TFM_INLINE float tfm_int8_activate(int32_t kind, float v, float alpha) {
  switch (kind) {
    case TFM_INT8_RELU:
      return v < 0.0f ? 0.0f : v;
    case TFM_INT8_RELU6:
      return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);
    case TFM_INT8_ELU:
      return v < 0.0f ? tfm_exp(v) - 1.0f : v;
    case TFM_INT8_LEAKY_RELU:
      return v < 0.0f ? v * alpha : v;
    case TFM_INT8_GELU:
      return 0.5f * v * (1.0f + tfm_int8_erf(v * 0.70710678118654752f));
    case TFM_INT8_GELU_APPROXIMATE: {
      float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + tfm_tanh(inner));
    }
    case TFM_INT8_TANH:
      return tfm_tanh(v);
    case TFM_INT8_SIGMOID:
      return 1.0f / (1.0f + tfm_exp(-v));
    default:
      return v;
  }
}

// The epilogue of one output element: acc / scale (+ bias), activated.
TFM_INLINE float tfm_int8_epilogue(float acc, float scale, float bias, int32_t kind, float alpha) {
  return tfm_int8_activate(kind, acc / scale + bias, alpha);
}

// Output size of one spatial dimension of Int8Conv2D (TF's Conv2D rules):
// VALID: ceil((in - (k - 1) * d) / s); SAME: ceil(in / s), padded before by
// max((out - 1) * s + (k - 1) * d + 1 - in, 0) / 2.
TFM_INLINE int32_t tfm_int8_conv_out(int32_t in, int32_t k, int32_t s, int32_t d, bool same) {
  if (same) return (in + s - 1) / s;
  int32_t eff = (k - 1) * d + 1;
  return in < eff ? 0 : (in - eff) / s + 1;
}

TFM_INLINE int32_t tfm_int8_conv_pad_before(int32_t in, int32_t out, int32_t k, int32_t s, int32_t d, bool same) {
  if (!same) return 0;
  int32_t need = (out - 1) * s + (k - 1) * d + 1 - in;
  return need > 0 ? need / 2 : 0;
}

#endif  // TFMETAL_INT8_H_
