// RMSprop (plain, centered, with or without momentum) on one element, in the
// operation order of Keras 3's keras.optimizers.RMSprop update_step, with an
// optional decoupled weight decay first:
//
//   var  -= var * decay_rate                         (when has_decay)
//   v     = rho * v + (1 - rho) * g^2
//   mg    = rho * mg + (1 - rho) * g                 (centered)
//   denom = (v - mg^2) + epsilon   (centered)   or   v + epsilon
//   inc   = (lr * g) / sqrt(denom)
//   m     = momentum * m + inc; var -= m             (has_momentum)
//   var  -= inc                                      (otherwise)
//
// Keras casts lr and the gradient to the variable's dtype T and runs each of
// these operations as one TF op in T. Its rho, momentum and epsilon are
// Python floats that TF converts to T where they meet a tensor, and
// `1 - rho` is computed in Python (double) before that conversion: for
// float32 and rho = 0.9 that is 0.1f, not 1 - 0.9f = 0.10000002f. So
// one_minus_rho is an input of its own, not derived here. R::round(x) rounds
// a float to T and back (identity for float) after every operation, as in
// tfmetal/adam.h, which explains why that is bitwise TF's half and bfloat16
// ops (+, -, *, / and sqrt correctly rounded in float, then rounded to T).
//
// Each operation is its own statement so no compiler contracts a multiply
// and an add into an FMA (see tfmetal/adam.h). Plain values in and out, no
// library calls but tfm_sqrt: shared by the CPU kernel and the Metal kernel
// (tfmetal/portable.h; the Metal kernel needs correctly rounded sqrt and
// division, i.e. fast math off, as the host helper compiles).
#ifndef TFMETAL_RMSPROP_H_
#define TFMETAL_RMSPROP_H_

#include "tfmetal/portable.h"

// The per-step constants of one call, each a value of T.
struct tfm_rmsprop_coeffs {
  float lr;
  float rho;
  float one_minus_rho;  // Keras' 1 - rho (formed in double, then rounded to T)
  float momentum;
  float epsilon;
  float decay_rate;     // decoupled weight decay lr * wd (used when has_decay)
  int has_decay;
  int centered;         // update mg and subtract mg^2 in the denominator
  int has_momentum;     // update m and subtract it (else subtract the increment)
};

// The state of one element after the update (mg, m unchanged when unused).
struct tfm_rmsprop_state {
  float var;
  float v;
  float mg;
  float m;
};

TFM_INLINE tfm_rmsprop_coeffs tfm_rmsprop_make_coeffs(float lr, float rho, float one_minus_rho, float momentum,
                                                      float epsilon, int has_decay, float decay_rate, int centered,
                                                      int has_momentum) {
  tfm_rmsprop_coeffs c;
  c.lr = lr;
  c.rho = rho;
  c.one_minus_rho = one_minus_rho;
  c.momentum = momentum;
  c.epsilon = epsilon;
  c.decay_rate = decay_rate;
  c.has_decay = has_decay;
  c.centered = centered;
  c.has_momentum = has_momentum;
  return c;
}

// One element. Inputs are values of T; the results are values of T.
template <typename R>
TFM_INLINE tfm_rmsprop_state tfm_rmsprop_update(float var, float v, float mg, float m, float g,
                                                tfm_rmsprop_coeffs c) {
  tfm_rmsprop_state s;
  if (c.has_decay) {
    const float decay = R::round(var * c.decay_rate);
    var = R::round(var - decay);
  }
  const float v_keep = R::round(c.rho * v);
  const float g2 = R::round(g * g);
  const float v_new = R::round(c.one_minus_rho * g2);
  v = R::round(v_keep + v_new);
  float denom;
  if (c.centered) {
    const float mg_keep = R::round(c.rho * mg);
    const float mg_new = R::round(c.one_minus_rho * g);
    mg = R::round(mg_keep + mg_new);
    const float mg2 = R::round(mg * mg);
    const float centered_v = R::round(v - mg2);
    denom = R::round(centered_v + c.epsilon);
  } else {
    denom = R::round(v + c.epsilon);
  }
  const float scaled = R::round(c.lr * g);
  const float root = R::round(tfm_sqrt(denom));
  const float inc = R::round(scaled / root);
  if (c.has_momentum) {
    const float m_keep = R::round(c.momentum * m);
    m = R::round(m_keep + inc);
    s.var = R::round(var - m);
  } else {
    s.var = R::round(var - inc);
  }
  s.v = v;
  s.mg = mg;
  s.m = m;
  return s;
}

#endif  // TFMETAL_RMSPROP_H_
