// The product of a few rows with a weight matrix, y = x @ w (+ bias), as a
// decoding step runs it (batch x 1 token): x [M, K] with M small, w [K, N]
// stored as Keras stores a Dense kernel (row k holds the N weights that
// input feature k feeds). The weights are read once, in K rows of N; every
// output y[m, n] has one float32 accumulator.
//
// The rounding, the same in every kernel (CPU portable, AVX2, AVX-512 and
// Metal) and on every thread count: the accumulator starts at +0.0 and takes
// k = 0, 1, ..., K - 1 in increasing order, each step one fused multiply-add
// fma(x[m, k], w[k, n], acc) (one rounding per step: a vector fma rounds each
// lane as the scalar one does); then the bias, if any, is added in float32
// (one rounding) and the result rounded to T once. x, w and bias of half or
// bfloat16 are widened to float32 exactly. So the CPU and Metal kernels agree
// bit for bit; TF's MatMul sums in another order (blocked, vectorized over k
// on the CPU) and rounds the product to T before a BiasAdd, so against it the
// results differ within the usual bound of a float32 sum of K products
// (tests/ops/test_gemv.py derives it).
#ifndef TFMETAL_GEMV_H_
#define TFMETAL_GEMV_H_

#include "tfmetal/portable.h"

// One step of an output's sum: acc + x * w, rounded once.
TFM_INLINE float gemv_step(float acc, float x, float w) { return tfm_fma(x, w, acc); }

// The finished output before its rounding to T: the sum, plus the bias when there is one.
TFM_INLINE float gemv_finish(float acc, float bias, bool has_bias) { return has_bias ? acc + bias : acc; }

#endif  // TFMETAL_GEMV_H_
