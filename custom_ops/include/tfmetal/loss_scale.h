// Loss scaling inside the multi-tensor optimizer ops (TfmetalExt>MultiTensorAdam,
// MultiTensorLion, MultiTensorRMSprop; the update math is tfmetal/adam.h,
// lion.h and rmsprop.h). With the optional `scale` input, the gradients an op
// receives are the loss-scaled ones (g * scale, as a mixed_float16 step
// computes them), and the op does what Keras' LossScaleOptimizer does around
// its inner optimizer, in two passes:
//
//   1. every element of every gradient is checked with tfm_gradient_is_finite,
//      before anything is written;
//   2. if one is not finite the op writes nothing at all (no variable, no
//      slot, no weight decay) and reports it in its `found_non_finite` output;
//      otherwise every variable is updated with the unscaled gradient
//      tfm_unscale_gradient(g, scale) in place of g.
//
// The check is on the gradient as given (the scaled one, in its dtype T), as
// Keras checks the gradients it is handed. The unscale is Keras' own
// operation: `ops.divide(g, scale)` in float32 (a half or bfloat16 gradient
// is promoted to float32 first), which our optimizers then cast to the
// variable's dtype. A float division rounded once to T is exactly that, so
// the unscaled gradient is bitwise Keras' for every scale (a power of two or
// not) and all three dtypes. It needs IEEE division: the CPU has it, and a
// Metal kernel has it with fast math off (as the host helper compiles).
//
// Shared by the CPU kernels and the Metal kernels (tfmetal/portable.h): plain
// values in and out.
#ifndef TFMETAL_LOSS_SCALE_H_
#define TFMETAL_LOSS_SCALE_H_

#include "tfmetal/portable.h"

// False for NaN and +-Inf; `g` is a value of T as float (exact for half and bfloat16).
TFM_INLINE bool tfm_gradient_is_finite(float g) { return tfm_isfinite(g); }

// g / scale in float, rounded to T (R::round: float -> T -> float, identity for float).
template <typename R>
TFM_INLINE float tfm_unscale_gradient(float g, float scale) {
  const float unscaled = g / scale;
  return R::round(unscaled);
}

#endif  // TFMETAL_LOSS_SCALE_H_
