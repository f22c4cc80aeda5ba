// Shared math of the emulator's self-test kernels (portable C++/MSL subset),
// included through a second header to exercise nested includes.
#ifndef TFM_TEST_AFFINE_H_
#define TFM_TEST_AFFINE_H_

#include "tfmetal/portable.h"

TFM_INLINE float affine_math(float x, float a, float b) { return a * x + b; }

#endif  // TFM_TEST_AFFINE_H_
