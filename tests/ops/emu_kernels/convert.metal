// half and bfloat conversions and arithmetic, for the emulator's self-test.
#include "tfmetal/portable.h"

template <typename From, typename To>
[[kernel]] void convert(device const From* x [[buffer(0)]], device To* y [[buffer(1)]],
                        constant uint& n [[buffer(2)]], TFM_KERNEL_BUILTINS) {
  if (gid.x < n) y[gid.x] = static_cast<To>(x[gid.x]);
}

// y = a * b + a in T's own arithmetic (each operation rounds to T).
template <typename T>
[[kernel]] void mul_add(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]], device T* y [[buffer(2)]],
                        constant uint& n [[buffer(3)]], TFM_KERNEL_BUILTINS) {
  if (gid.x < n) y[gid.x] = a[gid.x] * b[gid.x] + a[gid.x];
}

TFM_INSTANTIATE_KERNEL(float_to_half, convert<float, half>)
TFM_INSTANTIATE_KERNEL(half_to_float, convert<half, float>)
TFM_INSTANTIATE_KERNEL(float_to_bfloat, convert<float, bfloat>)
TFM_INSTANTIATE_KERNEL(bfloat_to_float, convert<bfloat, float>)
TFM_INSTANTIATE_KERNEL(mul_add_half, mul_add<half>)
TFM_INSTANTIATE_KERNEL(mul_add_bfloat, mul_add<bfloat>)
