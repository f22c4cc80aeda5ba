// Elementwise self-test kernels of the Metal emulator.
#ifndef TFM_TEST_ELEMENTWISE_H_
#define TFM_TEST_ELEMENTWISE_H_

#include "affine.h"
#include "tfmetal/portable.h"

struct AffineParams {
  float a;
  float b;
  uint n;
};

// y = a * x + b, computed in float.
template <typename T>
[[kernel]] void affine(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],
                       constant AffineParams& p [[buffer(2)]], TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<T>(affine_math(static_cast<float>(x[gid.x]), p.a, p.b));
}

// Counts how often each thread ran and records the size of its threadgroup.
[[kernel]] void mark_once(device uint* count [[buffer(0)]], device uint* group_size [[buffer(1)]],
                          constant uint& n [[buffer(2)]], TFM_KERNEL_BUILTINS) {
  if (gid.x >= n) return;
  count[gid.x] += 1u;
  group_size[gid.x] = tgsize.x;
}

// 2-D grid: each in-range thread writes (x, y, threadgroup width, height).
[[kernel]] void grid2d(device uint4* out [[buffer(0)]], constant uint2& shape [[buffer(1)]], TFM_KERNEL_BUILTINS) {
  if (gid.x >= shape.x || gid.y >= shape.y) return;
  out[gid.y * shape.x + gid.x] = uint4(gid.x, gid.y, tgsize.x, tgsize.y);
}

#endif  // TFM_TEST_ELEMENTWISE_H_
