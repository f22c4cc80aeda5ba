// The math of the elementwise gap kernels: GPU kernels tfmetal_ext registers
// for standard TensorFlow ops a Metal backend has none for
// (tfmetal_ext.backends.gap_kernels). Shared by the Metal kernels
// (custom_ops/metal/gap_elementwise.h) and the tests' references; every
// function takes and returns float: half and bfloat16 are widened on load and
// rounded once, to nearest even, on store.
//
// Agreement with TensorFlow's CPU kernels (tests/ops/test_gap_elementwise_metal_emu.py):
// - IsFinite, Fill, ZerosLike, OnesLike: bit for bit.
// - Sigmoid: 1 / (1 + exp(-x)). TF's CPU kernel (Eigen's scalar_logistic_op)
//   evaluates a rational approximation for float; the two differ by a few
//   float ulps. For half/bfloat16 both round a float result once.
// - Elu: exp(x) - 1 for x < 0, as TF's functor writes it (not expm1), so the
//   difference is exp's: TF uses Eigen's vectorised exp, Metal its own.
// - SigmoidGrad dy * (y * (1 - y)) and EluGrad (outputs < 0 ? (outputs + 1) *
//   dy : dy): TF's functors' operations, in the association of their
//   vectorised path (Eigen's scalar tail multiplies dy * y first, so TF
//   itself differs by an ulp between the two). For half/bfloat16 TF rounds
//   after each operation and we round once: up to 2 ulps of the output type.
// - TF's CPU kernels run with subnormals flushed to zero; these kernels keep
//   them, so a result below float's smallest normal can be 0 there and not here.
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
