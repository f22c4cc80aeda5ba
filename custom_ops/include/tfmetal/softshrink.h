// Softshrink: y = x - l for x > l, x + l for x < -l, else 0; NaN propagates.
// Shared by the CPU kernel and the Metal kernel (see tfmetal/portable.h).
#ifndef TFMETAL_SOFTSHRINK_H_
#define TFMETAL_SOFTSHRINK_H_

#include "tfmetal/portable.h"

// Written as x minus x clamped to [-l, l]: two selects the compiler turns into
// min/max-style vector code (a nested ternary stays a branch under GCC's
// default -ftrapping-math, 10x slower on random data). NaN stays NaN (both
// comparisons are false, so the clamp keeps x and x - x is NaN); inside
// [-l, l] the result is x - x = 0; +-inf shrink to themselves.
TFM_INLINE float softshrink_forward(float x, float lambd) {
  float m = x < -lambd ? -lambd : x;
  m = m > lambd ? lambd : m;
  return x - m;
}

// dL/dx = dL/dy where |x| > lambd, else 0 (0 at the kinks |x| == lambd).
// A NaN input gives a NaN gradient.
TFM_INLINE float softshrink_backward(float dy, float x, float lambd) {
  return (x > lambd || x < -lambd) ? dy : (x != x ? x : 0.0f);
}

#endif  // TFMETAL_SOFTSHRINK_H_
