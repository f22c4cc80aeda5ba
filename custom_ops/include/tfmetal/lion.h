// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on
// one element, in the operation order of Keras 3's keras.optimizers.Lion
// update_step, with its optional decoupled weight decay first:
//
//   var  -= var * decay_rate                      (when has_decay)
//   c     = m * beta1 + g * (1 - beta1)
//   var  -= lr * sign(c)
//   m     = m * beta2 + g * (1 - beta2)
//
// Keras casts lr, beta_1, beta_2 and the gradient to the variable's dtype T and
// runs each of these operations as one TF op in T; 1 - beta1 and 1 - beta2 are
// formed in T from the rounded betas. R::round(x) rounds a float to T and back
// (identity for float), after every operation, as in tfmetal/adam.h (which
// explains why rounding a float result of +, -, * to half or bfloat16 equals
// computing in that type): with it these functions are bitwise TF's ops for
// all three dtypes.
//
// sign follows tf.sign on floats: +1 above zero, -1 below, +0 for both zeros
// (TF returns +0 for -0), and NaN for NaN (TF keeps the NaN; its sign bit
// differs between TF's scalar and vectorized paths, so only "is NaN" is
// specified).
//
// Each operation is its own statement so no compiler contracts a multiply and
// an add into an FMA (see tfmetal/adam.h). Plain values in and out, no library
// calls: shared by the CPU kernel and the Metal kernel (tfmetal/portable.h).
#ifndef TFMETAL_LION_H_
#define TFMETAL_LION_H_

#include "tfmetal/portable.h"

// The per-step constants of one call, already rounded to T.
struct tfm_lion_coeffs {
  float lr;
  float beta1;
  float one_minus_beta1;  // 1 - beta1, rounded to T
  float beta2;
  float one_minus_beta2;  // 1 - beta2, rounded to T
  float decay_rate;       // decoupled weight decay lr * wd (used when has_decay)
  int has_decay;
};

// The state of one element after the update.
struct tfm_lion_state {
  float var;
  float m;
};

// Inputs are values of T (exactly representable); the results are values of T.
template <typename R>
TFM_INLINE tfm_lion_coeffs tfm_lion_make_coeffs(float lr, float beta1, float beta2, int has_decay, float decay_rate) {
  tfm_lion_coeffs c;
  c.lr = lr;
  c.beta1 = beta1;
  c.one_minus_beta1 = R::round(1.0f - beta1);
  c.beta2 = beta2;
  c.one_minus_beta2 = R::round(1.0f - beta2);
  c.decay_rate = decay_rate;
  c.has_decay = has_decay;
  return c;
}

// tf.sign of a float: 1, -1, +0 for +-0 (1 - 1 never happens, 0 - 0 is +0),
// NaN for NaN (returned as is). Selects, not branches: the signs of a
// gradient step are random, and the selects let the CPU loop vectorize.
TFM_INLINE float tfm_lion_sign(float x) {
  const float pos = x > 0.0f ? 1.0f : 0.0f;
  const float neg = x < 0.0f ? 1.0f : 0.0f;
  const float sign = pos - neg;
  return x == x ? sign : x;
}

// One element.
template <typename R>
TFM_INLINE tfm_lion_state tfm_lion_update(float var, float m, float g, tfm_lion_coeffs c) {
  tfm_lion_state s;
  if (c.has_decay) {
    const float decay = R::round(var * c.decay_rate);
    var = R::round(var - decay);
  }
  const float m_part = R::round(m * c.beta1);
  const float g_part = R::round(g * c.one_minus_beta1);
  const float blend = R::round(m_part + g_part);
  const float step = R::round(c.lr * tfm_lion_sign(blend));
  s.var = R::round(var - step);
  const float m_keep = R::round(m * c.beta2);
  const float g_new = R::round(g * c.one_minus_beta2);
  s.m = R::round(m_keep + g_new);
  return s;
}

#endif  // TFMETAL_LION_H_
