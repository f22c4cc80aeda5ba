// Softmax cross-entropy with integer labels (TfmetalExt>SparseSoftmaxCrossEntropy
// and its gradient op): the per-row and per-element math, shared by the CPU
// kernel and the Metal kernel (see tfmetal/portable.h).
//
// Per row of C logits x and its label l, in float32 whatever the input dtype:
//   m    = max_j x_j                  (sparse_xent_max: a NaN logit is skipped
//                                      here and makes the sum NaN below)
//   s    = sum_j exp(x_j - m)         (each term in (0, 1]; the max's term is 1)
//   loss = log(s) - (x_l - m)         (= logsumexp(x) - x_l, without the
//                                      cancellation of m + log(s) - x_l)
// The forward op keeps m and s per row; the gradient op needs nothing else:
//   dx_j = (exp(x_j - m) * (1 / s) - [j == l]) * dloss
// rounded once to the dtype. A label outside [0, C) has no loss: the kernels
// give NaN for its row (the loss and every dx_j, as TensorFlow's GPU kernel),
// and the CPU kernels refuse it first with TensorFlow's CPU error.
// Infinite logits follow the formulas: +inf makes x - m NaN (a NaN loss, as
// TensorFlow gives); a -inf label logit gives an infinite loss; a row of -inf
// gives NaN.
// The kernels own the loops and the summation order; only the formulas live here.
#ifndef TFMETAL_SPARSE_XENT_H_
#define TFMETAL_SPARSE_XENT_H_

#include "tfmetal/portable.h"

// Whether label `label` indexes one of `classes` classes.
TFM_INLINE bool sparse_xent_label_ok(int64_t label, int64_t classes) { return label >= 0 && label < classes; }

// The running max with logit x: x when it is larger (a NaN is never larger, so
// it is skipped; the max starts at -inf). A select, so loops over it vectorize.
TFM_INLINE float sparse_xent_max(float row_max, float x) { return tfm_select(x > row_max, x, row_max); }

// The term of logit x in the row's sum: exp(x - m), in (0, 1] for x <= m.
TFM_INLINE float sparse_xent_term(float x, float row_max) { return tfm_exp_poly(x - row_max); }

// The row's loss from its sum s, its max m and its label's logit.
TFM_INLINE float sparse_xent_loss(float row_sum, float row_max, float label_logit) {
  return tfm_log(row_sum) - (label_logit - row_max);
}

// dx of one logit: (softmax - one_hot) * dloss; inv_sum = 1 / s of the row.
TFM_INLINE float sparse_xent_grad(float x, float row_max, float inv_sum, bool is_label, float dloss) {
  const float p = sparse_xent_term(x, row_max) * inv_sum;
  return (p - tfm_select(is_label, 1.0f, 0.0f)) * dloss;
}

#endif  // TFMETAL_SPARSE_XENT_H_
