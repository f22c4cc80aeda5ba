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

// 1 for a finite value, 0 for NaN and +-inf.
TFM_INLINE uint8_t gap_is_finite(float x) { return tfm_isfinite(x) ? 1 : 0; }

#endif  // TFMETAL_GAP_ELEMENTWISE_H_
