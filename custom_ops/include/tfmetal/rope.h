// Rotary position embedding (RoPE), the half-split form keras-hub's
// RotaryEmbedding uses: the last axis of x is [x1 | x2], two halves of H
// features, and feature pair (x1[i], x2[i]) turns by the angle
// position * inv_freq[i]:
//   y1 = x1 * c - x2 * s,   y2 = x2 * c + x1 * s,   c = scale * cos, s = scale * sin.
// The gradient turns dy back (the transpose of the rotation):
//   dx1 = dy1 * c + dy2 * s,   dx2 = dy2 * c - dy1 * s.
// Shared by the CPU kernel and the Metal kernel (see tfmetal/portable.h).
//
// Rounding: everything is float32 and x's dtype is rounded to once, when the
// result is stored. In float32 this is the stock layer's exact sequence: the
// angle is one float32 product (its einsum "bi,j->bij" has nothing to sum),
// cos and sin of it in float32, then two float32 products and one float32 sum
// per output (its `x * cos + rotate_half(x) * sin`; -x2 * s is exactly
// -(x2 * s)). Each product is its own statement so that no compiler contracts
// a product and the sum into one fma (C++'s and Metal's default contraction
// works within an expression only): the results then differ from the stock
// layer only where the two libraries' cos/sin differ (by an ulp). Under mixed
// precision the stock layer rounds cos, sin, both products and the sum to
// float16/bfloat16 (five roundings); rounding once is at least as accurate,
// and the two differ by at most about 4 units of x's dtype's roundoff times
// |x1 c| + |x2 s| (tests/ops/test_rope.py derives and asserts the bound).
#ifndef TFMETAL_ROPE_H_
#define TFMETAL_ROPE_H_

#include "tfmetal/portable.h"

// The cos and sin of one pair's angle, times `scale` (1, or YaRN's attention
// temperature: the stock layer multiplies its float32 cos/sin by it).
struct tfm_rope_cos_sin {
  float c;
  float s;
};

TFM_INLINE tfm_rope_cos_sin rope_cos_sin(float position, float inv_freq, float scale) {
  const float angle = position * inv_freq;
  tfm_rope_cos_sin r;
  r.c = tfm_cos(angle);
  r.s = tfm_sin(angle);
  if (scale != 1.0f) {  // x * 1 is x: the branch only skips two multiplies
    r.c = r.c * scale;
    r.s = r.s * scale;
  }
  return r;
}

// One rotated pair (first-half and second-half output).
struct tfm_rope_pair {
  float first;
  float second;
};

// y = R(angle) x: forward.
TFM_INLINE tfm_rope_pair rope_rotate(float x1, float x2, tfm_rope_cos_sin cs) {
  const float x1c = x1 * cs.c;
  const float x2s = x2 * cs.s;
  const float x2c = x2 * cs.c;
  const float x1s = x1 * cs.s;
  tfm_rope_pair y;
  y.first = x1c - x2s;
  y.second = x2c + x1s;
  return y;
}

// dx = R(angle)^T dy: the gradient with respect to x.
TFM_INLINE tfm_rope_pair rope_rotate_back(float dy1, float dy2, tfm_rope_cos_sin cs) {
  const float d1c = dy1 * cs.c;
  const float d2s = dy2 * cs.s;
  const float d2c = dy2 * cs.c;
  const float d1s = dy1 * cs.s;
  tfm_rope_pair dx;
  dx.first = d1c + d2s;
  dx.second = d2c - d1s;
  return dx;
}

#endif  // TFMETAL_ROPE_H_
