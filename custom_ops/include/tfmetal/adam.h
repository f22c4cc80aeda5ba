// Adam (and AMSGrad, with optional decoupled weight decay) on one element,
// in the operation order of TensorFlow's ResourceApplyAdam CPU kernel
// (ApplyAdamNonCuda) and ResourceApplyAdamWithAmsgrad:
//
//   alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
//   m    += (g - m) * (1 - beta1)
//   v    += (g * g - v) * (1 - beta2)
//   vhat  = max(vhat, v)                            (AMSGrad only)
//   var  -= (m * alpha) / (sqrt(v or vhat) + epsilon)
//
// Decoupled weight decay, when used, runs first as ResourceApplyGradientDescent
// with delta = var does: var -= var * rate.
//
// TF evaluates each operation in the variable's dtype T (Eigen::half and
// Eigen::bfloat16 round every intermediate to T). The template parameter R
// reproduces that: R::round(x) rounds a float to T and back (identity for
// float). Rounding a correctly rounded float result of +, -, *, / or sqrt to
// half or bfloat16 equals doing the operation in that type directly (float has
// more than 2p+2 bits for both), so these functions are bitwise identical to
// TF's kernels for all three dtypes.
//
// Each operation is its own statement so no compiler contracts a multiply
// and an add into an FMA (clang's default -ffp-contract=on only fuses within
// one expression; TF's kernel has no FMAs either). GCC contracts across
// statements where FMA instructions exist (-ffp-contract=fast with -mfma, or
// aarch64); the x86-64 build here has none.
//
// Shared by the CPU kernel and a Metal kernel (see tfmetal/portable.h): plain
// values in and out, no pointers, no library calls but tfm_sqrt. To match TF
// bitwise a Metal kernel needs correctly rounded sqrt and division (fast math
// off, as the host helper compiles) and R::round as float(half(x)) /
// float(bfloat(x)) for half / bfloat variables.
#ifndef TFMETAL_ADAM_H_
#define TFMETAL_ADAM_H_

#include "tfmetal/portable.h"

// The per-step constants of one call, already rounded to T.
struct tfm_adam_coeffs {
  float alpha;            // lr * sqrt(1 - beta2_power) / (1 - beta1_power)
  float one_minus_beta1;  // 1 - beta1
  float one_minus_beta2;  // 1 - beta2
  float epsilon;
  float decay_rate;       // decoupled weight decay lr * wd (used when has_decay)
  int has_decay;
};

// The state of one element after the update.
struct tfm_adam_state {
  float var;
  float m;
  float v;
  float vhat;
};

// Inputs are values of T (exactly representable); the results are values of T.
template <typename R>
TFM_INLINE tfm_adam_coeffs tfm_adam_make_coeffs(float lr, float beta1, float beta2, float epsilon,
                                                float beta1_power, float beta2_power, int has_decay,
                                                float decay_rate) {
  tfm_adam_coeffs c;
  const float one_minus_b2p = R::round(1.0f - beta2_power);
  const float root = R::round(tfm_sqrt(one_minus_b2p));
  const float scaled = R::round(lr * root);
  const float one_minus_b1p = R::round(1.0f - beta1_power);
  c.alpha = R::round(scaled / one_minus_b1p);
  c.one_minus_beta1 = R::round(1.0f - beta1);
  c.one_minus_beta2 = R::round(1.0f - beta2);
  c.epsilon = epsilon;
  c.decay_rate = decay_rate;
  c.has_decay = has_decay;
  return c;
}

// One element. `amsgrad` selects ResourceApplyAdamWithAmsgrad's update
// (vhat is ignored and returned unchanged otherwise).
template <typename R>
TFM_INLINE tfm_adam_state tfm_adam_update(float var, float m, float v, float vhat, float g, tfm_adam_coeffs c,
                                          int amsgrad) {
  tfm_adam_state s;
  if (c.has_decay) {
    const float decay = R::round(var * c.decay_rate);
    var = R::round(var - decay);
  }
  const float dm = R::round(g - m);
  const float dm_scaled = R::round(dm * c.one_minus_beta1);
  m = R::round(m + dm_scaled);
  const float g2 = R::round(g * g);
  const float dv = R::round(g2 - v);
  const float dv_scaled = R::round(dv * c.one_minus_beta2);
  v = R::round(v + dv_scaled);
  float denom_base = v;
  if (amsgrad) {
    // Eigen's scalar max: (vhat < v) ? v : vhat.
    vhat = vhat < v ? v : vhat;
    denom_base = vhat;
  }
  const float root = R::round(tfm_sqrt(denom_base));
  const float denom = R::round(root + c.epsilon);
  const float step = R::round(m * c.alpha);
  const float delta = R::round(step / denom);
  s.var = R::round(var - delta);
  s.m = m;
  s.v = v;
  s.vhat = vhat;
  return s;
}

#endif  // TFMETAL_ADAM_H_
