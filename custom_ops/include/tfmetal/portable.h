// portable.h: the small common ground of C++ (CPU kernels, g++/clang) and
// Metal Shading Language, so each kernel's math is written once in
// custom_ops/include/tfmetal/<op>.h and used by both.
//
// Three modes:
//   __METAL_VERSION__  real Metal: <metal_stdlib>, `using namespace metal`.
//   TFM_EMU            a Metal kernel compiled as C++ by the emulator
//                      (custom_ops/emu/metal_emu.h, found on the -I path).
//   otherwise          plain C++ for the CPU kernels: no half, no Metal names.
//
// In all modes:
//   TFM_INLINE                      qualifier of shared math functions
//   TFM_DEVICE / TFM_CONSTANT /     pointer qualifiers for shared helpers taking
//   TFM_THREADGROUP / TFM_THREAD    pointers (address spaces in Metal, empty in C++)
//   int32_t uint32_t int64_t ...    fixed-width integers
//   tfm_sqrt tfm_rsqrt tfm_abs tfm_max tfm_min tfm_clamp tfm_isnan tfm_isinf
//   tfm_isfinite tfm_select tfm_exp tfm_log tfm_tanh tfm_pow tfm_floor tfm_ceil
//   tfm_fma tfm_sin tfm_cos          math on float (and double in C++, half in
//                                    Metal/emulation), identical semantics in
//                                    every mode: tfm_max/tfm_min return the
//                                    other argument when one is NaN (C fmax);
//                                    tfm_select(c, a, b) is c ? a : b.
//   tfm_bits_to_float tfm_float_to_bits   a float's IEEE-754 bits and back
//   tfm_exp_poly                    exp as a branch-free polynomial (CPU loops
//                                    over it vectorize; arguments <= 0)
// Metal kernel files also get TFM_KERNEL_BUILTINS, TFM_INSTANTIATE_KERNEL and
// TFM_REGISTER_KERNEL (see below), and TFM_HAS_BFLOAT says whether `bfloat`
// exists.
//
// Shared math must stay in the subset both languages accept: no STL, no
// exceptions, no recursion, no function pointers, no double in code Metal
// compiles, no `half` outside `#if TFM_HAS_HALF`.
#ifndef TFMETAL_PORTABLE_H_
#define TFMETAL_PORTABLE_H_

#if defined(__METAL_VERSION__)
// ---------------------------------------------------------------- Metal
#include <metal_stdlib>
using namespace metal;

#define TFM_METAL 1
#define TFM_HAS_HALF 1
#if __METAL_VERSION__ >= 310
#define TFM_HAS_BFLOAT 1
#else
#define TFM_HAS_BFLOAT 0
#endif
#define TFM_DEVICE device
#define TFM_CONSTANT constant
#define TFM_THREADGROUP threadgroup
#define TFM_THREAD thread

// The builtins every kernel takes last, in this order (the emulator binds them
// by position): position in grid, in threadgroup, threadgroup position,
// actual threadgroup size, lane in SIMD-group, SIMD-group in threadgroup.
#define TFM_KERNEL_BUILTINS                                                                        \
  uint3 gid [[thread_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]],            \
      uint3 tgid [[threadgroup_position_in_grid]], uint3 tgsize [[threads_per_threadgroup]],      \
      uint simd_lane [[thread_index_in_simdgroup]], uint simd_id [[simdgroup_index_in_threadgroup]]

// TFM_INSTANTIATE_KERNEL(softshrink_float, softshrink<float>): an explicit
// instantiation exported under the host name "softshrink_float".
#define TFM_INSTANTIATE_KERNEL(host_name, ...) \
  template [[host_name(#host_name)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

// TFM_REGISTER_KERNEL(fn) after a non-template kernel `fn` (host name "fn"):
// nothing in Metal; registers it with the emulator.
#define TFM_REGISTER_KERNEL(fn)

#elif defined(TFM_EMU)
// ---------------------------------------------------------------- emulation
// Defines the MSL surface, TFM_KERNEL_BUILTINS, TFM_INSTANTIATE_KERNEL and
// TFM_REGISTER_KERNEL.
#include <metal_emu.h>
using namespace metal;

#define TFM_METAL 1
#define TFM_HAS_HALF 1
#define TFM_HAS_BFLOAT 1
#define TFM_DEVICE device
#define TFM_CONSTANT constant
#define TFM_THREADGROUP threadgroup
#define TFM_THREAD thread

#else
// ---------------------------------------------------------------- C++ (CPU)
#include <math.h>
#include <stdint.h>

#define TFM_METAL 0
#define TFM_HAS_HALF 0
#define TFM_HAS_BFLOAT 0
#define TFM_DEVICE
#define TFM_CONSTANT
#define TFM_THREADGROUP
#define TFM_THREAD
#endif

#define TFM_INLINE inline

// ---------------------------------------------------------------- shared math
// Defined once from a few primitives per mode, so the semantics (NaN, signed
// zero) are the same on the CPU, on the GPU and in the emulator. Metal is
// compiled with fast math off (metal_helper.mm) so isnan/isinf hold there.
#if TFM_METAL
#define TFM_MATH_PRIMITIVES(T)                                             \
  TFM_INLINE T tfm_sqrt(T x) { return metal::sqrt(x); }                   \
  TFM_INLINE T tfm_rsqrt(T x) { return metal::rsqrt(x); }                 \
  TFM_INLINE T tfm_abs(T x) { return metal::abs(x); }                     \
  TFM_INLINE bool tfm_isnan(T x) { return metal::isnan(x); }              \
  TFM_INLINE bool tfm_isinf(T x) { return metal::isinf(x); }              \
  TFM_INLINE bool tfm_isfinite(T x) { return metal::isfinite(x); }        \
  TFM_INLINE T tfm_exp(T x) { return metal::exp(x); }                     \
  TFM_INLINE T tfm_log(T x) { return metal::log(x); }                     \
  TFM_INLINE T tfm_tanh(T x) { return metal::tanh(x); }                   \
  TFM_INLINE T tfm_pow(T x, T y) { return metal::pow(x, y); }             \
  TFM_INLINE T tfm_floor(T x) { return metal::floor(x); }                 \
  TFM_INLINE T tfm_ceil(T x) { return metal::ceil(x); }                   \
  TFM_INLINE T tfm_fma(T a, T b, T c) { return metal::fma(a, b, c); }     \
  TFM_INLINE T tfm_sin(T x) { return metal::sin(x); }                     \
  TFM_INLINE T tfm_cos(T x) { return metal::cos(x); }
TFM_MATH_PRIMITIVES(float)
TFM_MATH_PRIMITIVES(half)
#undef TFM_MATH_PRIMITIVES
#else
TFM_INLINE float tfm_sqrt(float x) { return sqrtf(x); }
TFM_INLINE float tfm_rsqrt(float x) { return 1.0f / sqrtf(x); }
TFM_INLINE float tfm_abs(float x) { return fabsf(x); }
TFM_INLINE bool tfm_isnan(float x) { return __builtin_isnan(x); }
TFM_INLINE bool tfm_isinf(float x) { return __builtin_isinf(x); }
TFM_INLINE bool tfm_isfinite(float x) { return __builtin_isfinite(x); }
TFM_INLINE float tfm_exp(float x) { return expf(x); }
TFM_INLINE float tfm_log(float x) { return logf(x); }
TFM_INLINE float tfm_tanh(float x) { return tanhf(x); }
TFM_INLINE float tfm_pow(float x, float y) { return powf(x, y); }
TFM_INLINE float tfm_floor(float x) { return floorf(x); }
TFM_INLINE float tfm_ceil(float x) { return ceilf(x); }
TFM_INLINE float tfm_fma(float a, float b, float c) { return fmaf(a, b, c); }
TFM_INLINE float tfm_sin(float x) { return sinf(x); }
TFM_INLINE float tfm_cos(float x) { return cosf(x); }
TFM_INLINE double tfm_sqrt(double x) { return sqrt(x); }
TFM_INLINE double tfm_rsqrt(double x) { return 1.0 / sqrt(x); }
TFM_INLINE double tfm_abs(double x) { return fabs(x); }
TFM_INLINE bool tfm_isnan(double x) { return __builtin_isnan(x); }
TFM_INLINE bool tfm_isinf(double x) { return __builtin_isinf(x); }
TFM_INLINE bool tfm_isfinite(double x) { return __builtin_isfinite(x); }
TFM_INLINE double tfm_exp(double x) { return exp(x); }
TFM_INLINE double tfm_log(double x) { return log(x); }
TFM_INLINE double tfm_tanh(double x) { return tanh(x); }
TFM_INLINE double tfm_pow(double x, double y) { return pow(x, y); }
TFM_INLINE double tfm_floor(double x) { return floor(x); }
TFM_INLINE double tfm_ceil(double x) { return ceil(x); }
TFM_INLINE double tfm_fma(double a, double b, double c) { return fma(a, b, c); }
TFM_INLINE double tfm_sin(double x) { return sin(x); }
TFM_INLINE double tfm_cos(double x) { return cos(x); }
#endif

// Built from the primitives above: one definition for every mode and type.
#if TFM_METAL
#define TFM_MATH_TYPES(X) X(float) X(half)
#else
#define TFM_MATH_TYPES(X) X(float) X(double)
#endif
/* tfm_max/tfm_min follow C fmax/fmin: the non-NaN argument wins. */
#define TFM_MATH_DERIVED(T)                                                           \
  TFM_INLINE T tfm_max(T a, T b) { return (tfm_isnan(b) || a > b) ? a : b; }       \
  TFM_INLINE T tfm_min(T a, T b) { return (tfm_isnan(b) || a < b) ? a : b; }       \
  TFM_INLINE T tfm_clamp(T x, T lo, T hi) { return tfm_min(tfm_max(x, lo), hi); }  \
  TFM_INLINE T tfm_select(bool c, T a, T b) { return c ? a : b; }
TFM_MATH_TYPES(TFM_MATH_DERIVED)
#undef TFM_MATH_DERIVED
#undef TFM_MATH_TYPES

TFM_INLINE int32_t tfm_max(int32_t a, int32_t b) { return a > b ? a : b; }
TFM_INLINE int32_t tfm_min(int32_t a, int32_t b) { return a < b ? a : b; }
TFM_INLINE uint32_t tfm_max(uint32_t a, uint32_t b) { return a > b ? a : b; }
TFM_INLINE uint32_t tfm_min(uint32_t a, uint32_t b) { return a < b ? a : b; }
TFM_INLINE int32_t tfm_select(bool c, int32_t a, int32_t b) { return c ? a : b; }
TFM_INLINE uint32_t tfm_select(bool c, uint32_t a, uint32_t b) { return c ? a : b; }

// The float whose IEEE-754 bits are `x` (and back).
#if TFM_METAL
TFM_INLINE float tfm_bits_to_float(uint32_t x) { return as_type<float>(x); }
TFM_INLINE uint32_t tfm_float_to_bits(float x) { return as_type<uint32_t>(x); }
#else
TFM_INLINE float tfm_bits_to_float(uint32_t x) {
  float f;
  __builtin_memcpy(&f, &x, sizeof(f));
  return f;
}
TFM_INLINE uint32_t tfm_float_to_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
}
#endif

// exp(x) in float32 from a polynomial, branch-free (selects on bits), so CPU
// loops over it vectorize where expf() is a scalar library call; the same float
// operations in every mode, so the CPU and the emulator agree bit for bit.
// Cephes' expf: x = n ln 2 + r with n = round(x / ln 2) and ln 2 split in two
// parts, exp(r) by a degree-6 polynomial, times 2^n from the exponent bits;
// |error| about 1 ulp on [-87.3, 88.3]. Below -87.3 (and -inf): 0. NaN: NaN.
// Above 88.3 it returns exp(88.3): callers pass arguments <= 0.
TFM_INLINE float tfm_exp_poly(float x) {
  const uint32_t low = 0u - static_cast<uint32_t>(x < -87.3f);
  const uint32_t high = 0u - static_cast<uint32_t>(x > 88.3f);
  const float xc = tfm_bits_to_float((tfm_float_to_bits(-87.3f) & low) | (tfm_float_to_bits(88.3f) & high) |
                                     (tfm_float_to_bits(x) & ~(low | high)));
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const float two_n = tfm_bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return tfm_bits_to_float(tfm_float_to_bits(y * two_n) & ~low);
}

#endif  // TFMETAL_PORTABLE_H_
