// metal_emu.h: the Metal Shading Language surface our kernels use, as C++20 for
// g++/clang, so every .metal kernel also compiles and runs on the CPU in tests.
//
// Compiled through custom_ops/emu/emu.py (`build()`), which flattens the
// .metal file's includes and rewrites the two MSL constructs a C++ header
// cannot express (`[[threadgroup(n)]]` on a parameter, `threadgroup T x[N];`
// declared in a kernel body) before handing it to g++ with -DTFM_EMU.
//
// Emulated: address spaces (device/constant/threadgroup/thread: no-ops),
// `kernel` / `[[kernel]]` and other attributes (ignored), scalar types
// (uint/ushort/uchar/ulong, half = _Float16, bfloat), vector types
// (T2/T3/T4 and metal::vec<T, N>, members .x.y.z.w / .r.g.b.a, operator[];
// no swizzles like .xy), math (metal:: and metal::precise::/metal::fast::,
// float and half, elementwise on vectors), as_type, numeric_limits,
// threadgroup_barrier / simdgroup_barrier, SIMD-group functions (width 32),
// atomics (atomic_int/uint/bool/float, *_explicit), and the kernel
// registration used by TFM_INSTANTIATE_KERNEL.
// Not emulated: textures, samplers, matrices (float4x4, simdgroup_matrix),
// quad-group functions, function constants, literal suffixes other than
// h/bf (emu.py rewrites `1.5h` / `1.5bf`), packed_* types.
#ifndef TFMETAL_EMU_METAL_EMU_H_
#define TFMETAL_EMU_METAL_EMU_H_

#ifndef TFM_EMU
#define TFM_EMU 1
#endif

#ifndef __FLT16_MAX__
#error "the Metal emulator needs a C++ compiler with _Float16 (g++ >= 12, clang >= 15, Apple clang on arm64)"
#endif

// Metal attributes ([[buffer(0)]], [[kernel]], [[thread_position_in_grid]]...)
// are unknown to g++/clang: ignore them, for the rest of the translation unit.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wunknown-attributes"
#pragma clang diagnostic ignored "-Wunused-parameter"
#pragma clang diagnostic ignored "-Wgnu-anonymous-struct"
#pragma clang diagnostic ignored "-Wnested-anon-types"
#else
#pragma GCC diagnostic ignored "-Wattributes"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wpedantic"
#endif

#include <stddef.h>
#include <stdint.h>

#include "emu_runtime.h"

// ----------------------------------------------------------------------------
// Scalar types.

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace tfm_emu {

inline uint32_t float_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// float -> bfloat16 bits: round to nearest, ties to even; NaN stays NaN (made
// quiet, sign and top payload bits kept); overflow rounds to infinity.
inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bfloat_bits_to_float(uint16_t b) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16);
}

template <class T> struct is_arith { static constexpr bool value = false; };
#define TFM_EMU_ARITH(T) template <> struct is_arith<T> { static constexpr bool value = true; };
TFM_EMU_ARITH(bool) TFM_EMU_ARITH(char) TFM_EMU_ARITH(signed char) TFM_EMU_ARITH(unsigned char)
TFM_EMU_ARITH(short) TFM_EMU_ARITH(unsigned short) TFM_EMU_ARITH(int) TFM_EMU_ARITH(unsigned int)
TFM_EMU_ARITH(long) TFM_EMU_ARITH(unsigned long) TFM_EMU_ARITH(long long)
TFM_EMU_ARITH(unsigned long long) TFM_EMU_ARITH(float) TFM_EMU_ARITH(double) TFM_EMU_ARITH(_Float16)
#undef TFM_EMU_ARITH

template <class T> struct is_integral { static constexpr bool value = false; };
#define TFM_EMU_INTEGRAL(T) template <> struct is_integral<T> { static constexpr bool value = true; };
TFM_EMU_INTEGRAL(bool) TFM_EMU_INTEGRAL(char) TFM_EMU_INTEGRAL(signed char) TFM_EMU_INTEGRAL(unsigned char)
TFM_EMU_INTEGRAL(short) TFM_EMU_INTEGRAL(unsigned short) TFM_EMU_INTEGRAL(int) TFM_EMU_INTEGRAL(unsigned int)
TFM_EMU_INTEGRAL(long) TFM_EMU_INTEGRAL(unsigned long) TFM_EMU_INTEGRAL(long long)
TFM_EMU_INTEGRAL(unsigned long long)
#undef TFM_EMU_INTEGRAL

template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> struct is_const { static constexpr bool value = false; };
template <class T> struct is_const<const T> { static constexpr bool value = true; };
template <class T> struct is_const<const volatile T> { static constexpr bool value = true; };

}  // namespace tfm_emu

// MSL bfloat (Metal 3.1): 16-bit brain float. Converts implicitly to float
// (arithmetic with float gives float); float -> bfloat must be explicit;
// bfloat op bfloat rounds the float result back to bfloat.
struct bfloat {
  uint16_t bits_;
  bfloat() = default;
  explicit bfloat(float f) : bits_(tfm_emu::float_to_bfloat_bits(f)) {}
  template <class U, class = typename tfm_emu::enable_if<tfm_emu::is_arith<U>::value &&
                                                         !tfm_emu::is_same<U, float>::value>::type>
  explicit bfloat(U v) : bfloat(static_cast<float>(v)) {}
  operator float() const { return tfm_emu::bfloat_bits_to_float(bits_); }
  bfloat operator-() const {
    bfloat r;
    r.bits_ = static_cast<uint16_t>(bits_ ^ 0x8000u);
    return r;
  }
  bfloat operator+() const { return *this; }
};

#define TFM_EMU_BFLOAT_ARITH(op)                                                    \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); } \
  template <class U, class = typename tfm_emu::enable_if<tfm_emu::is_integral<U>::value>::type> \
  inline bfloat operator op(bfloat a, U b) { return bfloat(float(a) op float(b)); }   \
  template <class U, class = typename tfm_emu::enable_if<tfm_emu::is_integral<U>::value>::type> \
  inline bfloat operator op(U a, bfloat b) { return bfloat(float(a) op float(b)); }   \
  template <class U>                                                                 \
  inline bfloat& operator op##=(bfloat& a, U b) { a = bfloat(float(a) op b); return a; }
TFM_EMU_BFLOAT_ARITH(+)
TFM_EMU_BFLOAT_ARITH(-)
TFM_EMU_BFLOAT_ARITH(*)
TFM_EMU_BFLOAT_ARITH(/)
#undef TFM_EMU_BFLOAT_ARITH

#define TFM_EMU_BFLOAT_CMP(op) \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }
TFM_EMU_BFLOAT_CMP(==)
TFM_EMU_BFLOAT_CMP(!=)
TFM_EMU_BFLOAT_CMP(<)
TFM_EMU_BFLOAT_CMP(<=)
TFM_EMU_BFLOAT_CMP(>)
TFM_EMU_BFLOAT_CMP(>=)
#undef TFM_EMU_BFLOAT_CMP

namespace tfm_emu {
template <> struct is_arith<bfloat> { static constexpr bool value = true; };
template <class T> struct is_floating { static constexpr bool value = false; };
template <> struct is_floating<float> { static constexpr bool value = true; };
template <> struct is_floating<_Float16> { static constexpr bool value = true; };
template <> struct is_floating<bfloat> { static constexpr bool value = true; };
}  // namespace tfm_emu

// ----------------------------------------------------------------------------
// Vector types: metal::vec<T, N>, N = 2, 3, 4. A T3 is padded to 4 elements
// (sizeof(float3) == 16), as in Metal.

namespace metal {

template <class T, int N> struct vec;

}  // namespace metal

namespace tfm_emu {

template <class T> struct vec_traits {
  static constexpr int count = 1;
};
template <class T, int N> struct vec_traits<metal::vec<T, N>> {
  static constexpr int count = N;
};

template <class V, class S>
inline void vec_put(V& v, int& k, const S& s) {
  v[k++] = static_cast<typename V::value_type>(s);
}
template <class V, class U, int M>
inline void vec_put(V& v, int& k, const metal::vec<U, M>& s) {
  for (int i = 0; i < M; ++i) v[k++] = static_cast<typename V::value_type>(s[i]);
}

}  // namespace tfm_emu

#define TFM_EMU_VEC_COMMON(N)                                                                    \
  typedef T value_type;                                                                          \
  vec() = default;                                                                               \
  vec(T s) {                                                                                     \
    for (int i = 0; i < N; ++i) v_[i] = s;                                                       \
  }                                                                                              \
  template <class U, class = typename ::tfm_emu::enable_if<::tfm_emu::is_arith<U>::value &&     \
                                                           !::tfm_emu::is_same<U, T>::value>::type> \
  vec(U s) : vec(static_cast<T>(s)) {}                                                           \
  template <class A, class B, class... R>                                                        \
  vec(const A& a, const B& b, const R&... r) {                                                   \
    static_assert(::tfm_emu::vec_traits<A>::count + ::tfm_emu::vec_traits<B>::count +            \
                          (0 + ... + ::tfm_emu::vec_traits<R>::count) == N,                      \
                  "vector constructor: the components do not add up to the vector size");       \
    int k = 0;                                                                                   \
    ::tfm_emu::vec_put(*this, k, a);                                                             \
    ::tfm_emu::vec_put(*this, k, b);                                                             \
    (::tfm_emu::vec_put(*this, k, r), ...);                                                      \
  }                                                                                              \
  template <class U>                                                                             \
  explicit vec(const vec<U, N>& o) {                                                             \
    for (int i = 0; i < N; ++i) v_[i] = static_cast<T>(o[i]);                                    \
  }                                                                                              \
  T& operator[](int i) { return v_[i]; }                                                         \
  const T& operator[](int i) const { return v_[i]; }

namespace metal {

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  union {
    struct { T x, y; };
    struct { T r, g; };
    T v_[2];
  };
  TFM_EMU_VEC_COMMON(2)
};

template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  union {
    struct { T x, y, z; };
    struct { T r, g, b; };
    T v_[4];
  };
  TFM_EMU_VEC_COMMON(3)
};

template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  union {
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    T v_[4];
  };
  TFM_EMU_VEC_COMMON(4)
};

#undef TFM_EMU_VEC_COMMON

#define TFM_EMU_SCALAR_ARG class S, class = typename ::tfm_emu::enable_if<::tfm_emu::is_arith<S>::value>::type

#define TFM_EMU_VEC_BINOP(op)                                                          \
  template <class T, int N>                                                            \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {               \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op b[i]);                  \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N, TFM_EMU_SCALAR_ARG>                                        \
  inline vec<T, N> operator op(const vec<T, N>& a, S s) {                              \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op static_cast<T>(s));      \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N, TFM_EMU_SCALAR_ARG>                                        \
  inline vec<T, N> operator op(S s, const vec<T, N>& a) {                              \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(static_cast<T>(s) op a[i]);      \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N, class U>                                                   \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const U& b) {                         \
    a = a op b;                                                                        \
    return a;                                                                          \
  }
TFM_EMU_VEC_BINOP(+)
TFM_EMU_VEC_BINOP(-)
TFM_EMU_VEC_BINOP(*)
TFM_EMU_VEC_BINOP(/)
TFM_EMU_VEC_BINOP(%)
TFM_EMU_VEC_BINOP(&)
TFM_EMU_VEC_BINOP(|)
TFM_EMU_VEC_BINOP(^)
TFM_EMU_VEC_BINOP(<<)
TFM_EMU_VEC_BINOP(>>)
#undef TFM_EMU_VEC_BINOP

#define TFM_EMU_VEC_CMP(op)                                                         \
  template <class T, int N>                                                         \
  inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {         \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, TFM_EMU_SCALAR_ARG>                                     \
  inline vec<bool, N> operator op(const vec<T, N>& a, S s) {                        \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = a[i] op static_cast<T>(s);                   \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, TFM_EMU_SCALAR_ARG>                                     \
  inline vec<bool, N> operator op(S s, const vec<T, N>& a) {                        \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(s) op a[i];                   \
    return r;                                                                       \
  }
TFM_EMU_VEC_CMP(==)
TFM_EMU_VEC_CMP(!=)
TFM_EMU_VEC_CMP(<)
TFM_EMU_VEC_CMP(<=)
TFM_EMU_VEC_CMP(>)
TFM_EMU_VEC_CMP(>=)
TFM_EMU_VEC_CMP(&&)
TFM_EMU_VEC_CMP(||)
#undef TFM_EMU_VEC_CMP

template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(-a[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <class T, int N>
inline vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = static_cast<T>(~a[i]);
  return r;
}
template <class T, int N>
inline vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

}  // namespace metal

#define TFM_EMU_VEC_TYPEDEFS(T, name) \
  typedef metal::vec<T, 2> name##2;   \
  typedef metal::vec<T, 3> name##3;   \
  typedef metal::vec<T, 4> name##4;
TFM_EMU_VEC_TYPEDEFS(float, float)
TFM_EMU_VEC_TYPEDEFS(half, half)
TFM_EMU_VEC_TYPEDEFS(bfloat, bfloat)
TFM_EMU_VEC_TYPEDEFS(int, int)
TFM_EMU_VEC_TYPEDEFS(uint, uint)
TFM_EMU_VEC_TYPEDEFS(short, short)
TFM_EMU_VEC_TYPEDEFS(ushort, ushort)
TFM_EMU_VEC_TYPEDEFS(char, char)
TFM_EMU_VEC_TYPEDEFS(uchar, uchar)
TFM_EMU_VEC_TYPEDEFS(long, long)
TFM_EMU_VEC_TYPEDEFS(ulong, ulong)
TFM_EMU_VEC_TYPEDEFS(bool, bool)
#undef TFM_EMU_VEC_TYPEDEFS

// ----------------------------------------------------------------------------
// Math. float functions use the C library (correctly rounded or close: MSL's
// precise:: accuracy); half ones compute in float and round, like the GPU's
// half ALU for these. Vectors apply them per component.

namespace metal {

#define TFM_EMU_UNARY_F(name, expr)                                   \
  inline float name(float x) { return expr; }                         \
  inline half name(half hx) { return static_cast<half>(name(static_cast<float>(hx))); } \
  template <class T, int N>                                           \
  inline vec<T, N> name(const vec<T, N>& v) {                         \
    vec<T, N> r;                                                      \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                    \
    return r;                                                         \
  }

TFM_EMU_UNARY_F(sqrt, __builtin_sqrtf(x))
TFM_EMU_UNARY_F(rsqrt, 1.0f / __builtin_sqrtf(x))
TFM_EMU_UNARY_F(cbrt, __builtin_cbrtf(x))
TFM_EMU_UNARY_F(fabs, __builtin_fabsf(x))
TFM_EMU_UNARY_F(exp, __builtin_expf(x))
TFM_EMU_UNARY_F(exp2, __builtin_exp2f(x))
TFM_EMU_UNARY_F(exp10, __builtin_powf(10.0f, x))
TFM_EMU_UNARY_F(log, __builtin_logf(x))
TFM_EMU_UNARY_F(log2, __builtin_log2f(x))
TFM_EMU_UNARY_F(log10, __builtin_log10f(x))
TFM_EMU_UNARY_F(sin, __builtin_sinf(x))
TFM_EMU_UNARY_F(cos, __builtin_cosf(x))
TFM_EMU_UNARY_F(tan, __builtin_tanf(x))
TFM_EMU_UNARY_F(asin, __builtin_asinf(x))
TFM_EMU_UNARY_F(acos, __builtin_acosf(x))
TFM_EMU_UNARY_F(atan, __builtin_atanf(x))
TFM_EMU_UNARY_F(sinh, __builtin_sinhf(x))
TFM_EMU_UNARY_F(cosh, __builtin_coshf(x))
TFM_EMU_UNARY_F(tanh, __builtin_tanhf(x))
TFM_EMU_UNARY_F(asinh, __builtin_asinhf(x))
TFM_EMU_UNARY_F(acosh, __builtin_acoshf(x))
TFM_EMU_UNARY_F(atanh, __builtin_atanhf(x))
TFM_EMU_UNARY_F(floor, __builtin_floorf(x))
TFM_EMU_UNARY_F(ceil, __builtin_ceilf(x))
TFM_EMU_UNARY_F(round, __builtin_roundf(x))
TFM_EMU_UNARY_F(rint, __builtin_rintf(x))
TFM_EMU_UNARY_F(trunc, __builtin_truncf(x))
TFM_EMU_UNARY_F(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
TFM_EMU_UNARY_F(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
TFM_EMU_UNARY_F(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? x : 0.0f)))
#undef TFM_EMU_UNARY_F

#define TFM_EMU_BINARY_F(name, expr)                                               \
  inline float name(float x, float y) { return expr; }                             \
  inline half name(half hx, half hy) {                                             \
    return static_cast<half>(name(static_cast<float>(hx), static_cast<float>(hy))); \
  }                                                                                \
  template <class T, int N>                                                        \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                   \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                           \
    return r;                                                                      \
  }

TFM_EMU_BINARY_F(pow, __builtin_powf(x, y))
TFM_EMU_BINARY_F(powr, __builtin_powf(x, y))
TFM_EMU_BINARY_F(atan2, __builtin_atan2f(x, y))
TFM_EMU_BINARY_F(fmod, __builtin_fmodf(x, y))
TFM_EMU_BINARY_F(copysign, __builtin_copysignf(x, y))
// MSL precise::fmax/fmin: if one argument is NaN the other is returned.
TFM_EMU_BINARY_F(fmax, __builtin_fmaxf(x, y))
TFM_EMU_BINARY_F(fmin, __builtin_fminf(x, y))
TFM_EMU_BINARY_F(step, y < x ? 0.0f : 1.0f)
TFM_EMU_BINARY_F(fdim, __builtin_fdimf(x, y))
TFM_EMU_BINARY_F(divide, x / y)
#undef TFM_EMU_BINARY_F

// max/min on floats are fmax/fmin; on integers the usual comparison.
inline float max(float x, float y) { return fmax(x, y); }
inline float min(float x, float y) { return fmin(x, y); }
inline half max(half x, half y) { return fmax(x, y); }
inline half min(half x, half y) { return fmin(x, y); }
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T max(T x, T y) { return x < y ? y : x; }
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T min(T x, T y) { return y < x ? y : x; }
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N, TFM_EMU_SCALAR_ARG>
inline vec<T, N> max(const vec<T, N>& a, S b) { return max(a, vec<T, N>(static_cast<T>(b))); }
template <class T, int N, TFM_EMU_SCALAR_ARG>
inline vec<T, N> min(const vec<T, N>& a, S b) { return min(a, vec<T, N>(static_cast<T>(b))); }

inline float clamp(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }
inline half clamp(half x, half lo, half hi) { return fmin(fmax(x, lo), hi); }
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = clamp(x[i], lo[i], hi[i]);
  return r;
}
template <class T, int N, TFM_EMU_SCALAR_ARG>
inline vec<T, N> clamp(const vec<T, N>& x, S lo, S hi) {
  return clamp(x, vec<T, N>(static_cast<T>(lo)), vec<T, N>(static_cast<T>(hi)));
}

inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return fabs(x); }
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T abs(T x) { return x < 0 ? static_cast<T>(-x) : x; }
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) {
  // One float fma, then rounding to half (a fused half fma can differ in rare
  // double-rounding ties).
  return static_cast<half>(__builtin_fmaf(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c)));
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline half mix(half x, half y, half a) { return static_cast<half>(mix(float(x), float(y), float(a))); }
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = mix(x[i], y[i], a[i]);
  return r;
}
template <class T, int N, TFM_EMU_SCALAR_ARG>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, S a) {
  return mix(x, y, vec<T, N>(static_cast<T>(a)));
}
inline float smoothstep(float e0, float e1, float x) {
  float t = clamp((x - e0) / (e1 - e0), 0.0f, 1.0f);
  return t * t * (3.0f - 2.0f * t);
}

#define TFM_EMU_PREDICATE(name, expr)                                        \
  inline bool name(float x) { return expr; }                                 \
  inline bool name(half hx) { return name(static_cast<float>(hx)); }         \
  template <class T, int N>                                                  \
  inline vec<bool, N> name(const vec<T, N>& v) {                             \
    vec<bool, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                           \
    return r;                                                                \
  }
TFM_EMU_PREDICATE(isnan, __builtin_isnan(x))
TFM_EMU_PREDICATE(isinf, __builtin_isinf(x))
TFM_EMU_PREDICATE(isfinite, __builtin_isfinite(x))
TFM_EMU_PREDICATE(isnormal, __builtin_isnormal(x))
TFM_EMU_PREDICATE(signbit, __builtin_signbit(x))
#undef TFM_EMU_PREDICATE

// select(a, b, c): c ? b : a (per component for vectors).
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = static_cast<T>(s + a[i] * b[i]);
  return s;
}
template <class T, int N>
inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }

// Integer bit functions.
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T popcount(T x) { return static_cast<T>(__builtin_popcountll(static_cast<unsigned long long>(x) & (~0ull >> (64 - 8 * sizeof(T))))); }
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T clz(T x) {
  unsigned long long u = static_cast<unsigned long long>(x) & (~0ull >> (64 - 8 * sizeof(T)));
  return static_cast<T>(u == 0 ? 8 * sizeof(T) : __builtin_clzll(u) - (64 - 8 * sizeof(T)));
}
template <class T, class = typename ::tfm_emu::enable_if<::tfm_emu::is_integral<T>::value>::type>
inline T ctz(T x) {
  unsigned long long u = static_cast<unsigned long long>(x) & (~0ull >> (64 - 8 * sizeof(T)));
  return static_cast<T>(u == 0 ? 8 * sizeof(T) : __builtin_ctzll(u));
}

// Reinterprets the bits of x (same size).
template <class T, class U>
inline T as_type(const U& x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the types must have the same size");
  return __builtin_bit_cast(T, x);
}

// metal::precise:: and metal::fast:: name the same functions here: the
// emulator always computes precisely (the host helper compiles with fast math
// off, so real Metal follows IEEE NaN/Inf rules as well).
#define TFM_EMU_MATH_NAMES(X)                                                                  \
  X(sqrt) X(rsqrt) X(cbrt) X(fabs) X(abs) X(exp) X(exp2) X(exp10) X(log) X(log2) X(log10)       \
  X(sin) X(cos) X(tan) X(asin) X(acos) X(atan) X(sinh) X(cosh) X(tanh) X(asinh) X(acosh)        \
  X(atanh) X(floor) X(ceil) X(round) X(rint) X(trunc) X(fract) X(saturate) X(sign) X(pow)       \
  X(powr) X(atan2) X(fmod) X(copysign) X(fmax) X(fmin) X(max) X(min) X(clamp) X(step) X(fdim)  \
  X(divide) X(fma) X(mix) X(smoothstep) X(isnan) X(isinf) X(isfinite)
#define TFM_EMU_USING(name) using ::metal::name;
namespace precise {
TFM_EMU_MATH_NAMES(TFM_EMU_USING)
}
namespace fast {
TFM_EMU_MATH_NAMES(TFM_EMU_USING)
}
#undef TFM_EMU_USING
#undef TFM_EMU_MATH_NAMES

// numeric_limits, as in <metal_limits>.
template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr bool is_signed = true;
  static constexpr float min() { return 0x1p-126f; }
  static constexpr float max() { return 0x1.fffffep127f; }
  static constexpr float lowest() { return -0x1.fffffep127f; }
  static constexpr float epsilon() { return 0x1p-23f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return 0x1p-149f; }
};
template <> struct numeric_limits<half> {
  static constexpr bool is_signed = true;
  static constexpr half min() { return static_cast<half>(0x1p-14f); }
  static constexpr half max() { return static_cast<half>(65504.0f); }
  static constexpr half lowest() { return static_cast<half>(-65504.0f); }
  static constexpr half epsilon() { return static_cast<half>(0x1p-10f); }
  static constexpr half infinity() { return static_cast<half>(__builtin_inff()); }
  static constexpr half quiet_NaN() { return static_cast<half>(__builtin_nanf("")); }
  static constexpr half denorm_min() { return static_cast<half>(0x1p-24f); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_signed = true;
  static bfloat from_bits(uint16_t b) {
    bfloat r;
    r.bits_ = b;
    return r;
  }
  static bfloat min() { return from_bits(0x0080); }
  static bfloat max() { return from_bits(0x7f7f); }
  static bfloat lowest() { return from_bits(0xff7f); }
  static bfloat epsilon() { return from_bits(0x3c00); }
  static bfloat infinity() { return from_bits(0x7f80); }
  static bfloat quiet_NaN() { return from_bits(0x7fc0); }
  static bfloat denorm_min() { return from_bits(0x0001); }
};
#define TFM_EMU_INT_LIMITS(T, lo, hi, sgn)                        \
  template <> struct numeric_limits<T> {                          \
    static constexpr bool is_signed = sgn;                        \
    static constexpr T min() { return lo; }                       \
    static constexpr T max() { return hi; }                       \
    static constexpr T lowest() { return lo; }                    \
  };
TFM_EMU_INT_LIMITS(bool, false, true, false)
TFM_EMU_INT_LIMITS(char, -128, 127, true)
TFM_EMU_INT_LIMITS(uchar, 0, 255, false)
TFM_EMU_INT_LIMITS(short, -32768, 32767, true)
TFM_EMU_INT_LIMITS(ushort, 0, 65535, false)
TFM_EMU_INT_LIMITS(int, -2147483647 - 1, 2147483647, true)
TFM_EMU_INT_LIMITS(uint, 0u, 4294967295u, false)
TFM_EMU_INT_LIMITS(long, -9223372036854775807L - 1, 9223372036854775807L, true)
TFM_EMU_INT_LIMITS(ulong, 0ul, 18446744073709551615ul, false)
#undef TFM_EMU_INT_LIMITS

}  // namespace metal

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_inff())
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 0x1.fffffep127f
#endif
#ifndef FLT_MAX
#define FLT_MAX 0x1.fffffep127f
#endif
#ifndef FLT_MIN
#define FLT_MIN 0x1p-126f
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 0x1p-23f
#endif
#define HALF_MAX (static_cast<half>(65504.0f))
#define HALF_MIN (static_cast<half>(0x1p-14f))
#define HALF_EPSILON (static_cast<half>(0x1p-10f))
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define METAL_FUNC inline

// ----------------------------------------------------------------------------
// Barriers and SIMD-group functions. Each synchronizing call records its call
// site (default arguments evaluated at the caller), so threads of one group
// meeting at different call sites are reported as divergent control flow.

#if defined(__has_builtin) && __has_builtin(__builtin_COLUMN)
#define TFM_EMU_CALLER_COLUMN __builtin_COLUMN()
#else
#define TFM_EMU_CALLER_COLUMN 0
#endif
#define TFM_EMU_SITE_PARAMS \
  const char *tfm_file_ = __builtin_FILE(), int tfm_line_ = __builtin_LINE(), int tfm_col_ = TFM_EMU_CALLER_COLUMN
#define TFM_EMU_SITE(op) ::tfm_emu::Site{op, tfm_file_, tfm_line_, tfm_col_}

namespace metal {

enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<uint>(a) | static_cast<uint>(b));
}

// Every thread of the threadgroup must reach the same barrier; the emulated
// threads run concurrently and really wait here.
inline void threadgroup_barrier(mem_flags, TFM_EMU_SITE_PARAMS) {
  ::tfm_emu::threadgroup_barrier(TFM_EMU_SITE("threadgroup_barrier"));
}
inline void simdgroup_barrier(mem_flags, TFM_EMU_SITE_PARAMS) {
  ::tfm_emu::simd_exchange(TFM_EMU_SITE("simdgroup_barrier"), nullptr, 0);
}

}  // namespace metal

namespace tfm_emu {

template <class T>
inline T simd_slot(const SimdExchange& ex, uint32_t lane) {
  T v;
  __builtin_memcpy(&v, ex.slots + lane * kSimdSlotBytes, sizeof(T));
  return v;
}

// What reading an inactive lane gives: all bits set, NaN for floating types,
// so a kernel that depends on it shows NaN (on the GPU it is undefined).
template <class T>
inline T simd_poison() {
  T v;
  __builtin_memset(&v, 0xff, sizeof(T));
  return v;
}

template <class T>
inline SimdExchange simd_share(const Site& site, const T& value) {
  static_assert(sizeof(T) <= kSimdSlotBytes, "SIMD-group function on a type larger than 64 bytes");
  return simd_exchange(site, &value, sizeof(T));
}

template <class T>
inline T simd_lane_value(const SimdExchange& ex, int src, const T& own) {
  if (src < 0 || src >= static_cast<int>(kSimdWidth)) return own;
  if (!((ex.active >> src) & 1u)) return simd_poison<T>();
  return simd_slot<T>(ex, static_cast<uint32_t>(src));
}

// Pairwise tree over the active lanes in lane order, like a butterfly on the
// GPU: the same value in every lane.
template <class T, class Op>
inline T simd_reduce(const SimdExchange& ex, Op op) {
  T vals[kSimdWidth];
  bool have[kSimdWidth];
  for (uint32_t i = 0; i < kSimdWidth; ++i) {
    have[i] = (ex.active >> i) & 1u;
    if (have[i]) vals[i] = simd_slot<T>(ex, i);
  }
  for (uint32_t w = 1; w < kSimdWidth; w *= 2) {
    for (uint32_t i = 0; i + w < kSimdWidth; i += 2 * w) {
      if (!have[i + w]) continue;
      vals[i] = have[i] ? static_cast<T>(op(vals[i], vals[i + w])) : vals[i + w];
      have[i] = true;
    }
  }
  return vals[0];
}

template <class T, class Op>
inline T simd_scan(const SimdExchange& ex, Op op, T init, bool inclusive) {
  T acc = init;
  const uint32_t end = inclusive ? ex.lane + 1 : ex.lane;
  for (uint32_t i = 0; i < end; ++i)
    if ((ex.active >> i) & 1u) acc = static_cast<T>(op(acc, simd_slot<T>(ex, i)));
  return acc;
}

}  // namespace tfm_emu

namespace metal {

typedef ulong vote_t;
class simd_vote {
 public:
  explicit constexpr simd_vote(vote_t v = 0) : v_(v) {}
  explicit constexpr operator vote_t() const { return v_; }
  bool all() const { return v_ == ~0ull >> (64 - ::tfm_emu::kSimdWidth); }
  bool any() const { return v_ != 0; }

 private:
  vote_t v_;
};

#define TFM_EMU_SIMD_REDUCE(name, expr)                                              \
  template <class T>                                                                 \
  inline T name(T x, TFM_EMU_SITE_PARAMS) {                                          \
    ::tfm_emu::SimdExchange ex = ::tfm_emu::simd_share(TFM_EMU_SITE(#name), x);      \
    return ::tfm_emu::simd_reduce<T>(ex, [](const T& a, const T& b) { return expr; }); \
  }
TFM_EMU_SIMD_REDUCE(simd_sum, a + b)
TFM_EMU_SIMD_REDUCE(simd_product, a * b)
TFM_EMU_SIMD_REDUCE(simd_max, max(a, b))
TFM_EMU_SIMD_REDUCE(simd_min, min(a, b))
TFM_EMU_SIMD_REDUCE(simd_and, a & b)
TFM_EMU_SIMD_REDUCE(simd_or, a | b)
TFM_EMU_SIMD_REDUCE(simd_xor, a ^ b)
#undef TFM_EMU_SIMD_REDUCE

template <class T>
inline T simd_prefix_inclusive_sum(T x, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_prefix_inclusive_sum"), x);
  return ::tfm_emu::simd_scan<T>(ex, [](const T& a, const T& b) { return a + b; }, T(0), true);
}
template <class T>
inline T simd_prefix_exclusive_sum(T x, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_prefix_exclusive_sum"), x);
  return ::tfm_emu::simd_scan<T>(ex, [](const T& a, const T& b) { return a + b; }, T(0), false);
}
template <class T>
inline T simd_prefix_inclusive_product(T x, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_prefix_inclusive_product"), x);
  return ::tfm_emu::simd_scan<T>(ex, [](const T& a, const T& b) { return a * b; }, T(1), true);
}
template <class T>
inline T simd_prefix_exclusive_product(T x, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_prefix_exclusive_product"), x);
  return ::tfm_emu::simd_scan<T>(ex, [](const T& a, const T& b) { return a * b; }, T(1), false);
}

template <class T>
inline T simd_shuffle(T x, ushort lane, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle"), x);
  if (lane >= ::tfm_emu::kSimdWidth) return ::tfm_emu::simd_poison<T>();
  return ::tfm_emu::simd_lane_value(ex, lane, x);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle_down"), x);
  return ::tfm_emu::simd_lane_value(ex, static_cast<int>(ex.lane) + delta, x);
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle_up"), x);
  return ::tfm_emu::simd_lane_value(ex, static_cast<int>(ex.lane) - delta, x);
}
template <class T>
inline T simd_shuffle_rotate_down(T x, ushort delta, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle_rotate_down"), x);
  return ::tfm_emu::simd_lane_value(ex, static_cast<int>((ex.lane + delta) % ::tfm_emu::kSimdWidth), x);
}
template <class T>
inline T simd_shuffle_rotate_up(T x, ushort delta, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle_rotate_up"), x);
  const uint32_t w = ::tfm_emu::kSimdWidth;
  return ::tfm_emu::simd_lane_value(ex, static_cast<int>((ex.lane + w - delta % w) % w), x);
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_shuffle_xor"), x);
  const int src = static_cast<int>(ex.lane ^ mask);
  if (src >= static_cast<int>(::tfm_emu::kSimdWidth)) return ::tfm_emu::simd_poison<T>();
  return ::tfm_emu::simd_lane_value(ex, src, x);
}
template <class T>
inline T simd_broadcast(T x, ushort lane, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_broadcast"), x);
  if (lane >= ::tfm_emu::kSimdWidth) return ::tfm_emu::simd_poison<T>();
  return ::tfm_emu::simd_lane_value(ex, lane, x);
}
template <class T>
inline T simd_broadcast_first(T x, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_broadcast_first"), x);
  return ::tfm_emu::simd_slot<T>(ex, static_cast<uint32_t>(__builtin_ctz(ex.active)));
}
inline simd_vote simd_ballot(bool pred, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_ballot"), pred);
  vote_t v = 0;
  for (uint32_t i = 0; i < ::tfm_emu::kSimdWidth; ++i)
    if (((ex.active >> i) & 1u) && ::tfm_emu::simd_slot<bool>(ex, i)) v |= vote_t(1) << i;
  return simd_vote(v);
}
inline simd_vote simd_active_threads_mask(TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_active_threads_mask"), true);
  return simd_vote(ex.active);
}
inline bool simd_all(bool pred, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_all"), pred);
  for (uint32_t i = 0; i < ::tfm_emu::kSimdWidth; ++i)
    if (((ex.active >> i) & 1u) && !::tfm_emu::simd_slot<bool>(ex, i)) return false;
  return true;
}
inline bool simd_any(bool pred, TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_any"), pred);
  for (uint32_t i = 0; i < ::tfm_emu::kSimdWidth; ++i)
    if (((ex.active >> i) & 1u) && ::tfm_emu::simd_slot<bool>(ex, i)) return true;
  return false;
}
inline bool simd_is_first(TFM_EMU_SITE_PARAMS) {
  auto ex = ::tfm_emu::simd_share(TFM_EMU_SITE("simd_is_first"), true);
  return static_cast<uint32_t>(__builtin_ctz(ex.active)) == ex.lane;
}

// ----------------------------------------------------------------------------
// Atomics (<metal_atomic>): only memory_order_relaxed exists in MSL.

enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T> struct atomic {
  typedef T value_type;
  T value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;

#define TFM_EMU_ATOMIC_T typename ::tfm_emu::remove_cv<A>::type::value_type

template <class A>
inline TFM_EMU_ATOMIC_T atomic_load_explicit(A* obj, memory_order) {
  TFM_EMU_ATOMIC_T v;
  __atomic_load(&obj->value_, &v, __ATOMIC_SEQ_CST);
  return v;
}
template <class A, class C>
inline void atomic_store_explicit(A* obj, C desired, memory_order) {
  TFM_EMU_ATOMIC_T v = static_cast<TFM_EMU_ATOMIC_T>(desired);
  __atomic_store(&obj->value_, &v, __ATOMIC_SEQ_CST);
}
template <class A, class C>
inline TFM_EMU_ATOMIC_T atomic_exchange_explicit(A* obj, C desired, memory_order) {
  TFM_EMU_ATOMIC_T v = static_cast<TFM_EMU_ATOMIC_T>(desired), old;
  __atomic_exchange(&obj->value_, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
template <class A, class C>
inline bool atomic_compare_exchange_weak_explicit(A* obj, C* expected, C desired, memory_order, memory_order) {
  TFM_EMU_ATOMIC_T d = static_cast<TFM_EMU_ATOMIC_T>(desired);
  return __atomic_compare_exchange(&obj->value_, expected, &d, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

#define TFM_EMU_ATOMIC_RMW(name, expr)                                                   \
  template <class A, class M>                                                            \
  inline TFM_EMU_ATOMIC_T name(A* obj, M operand, memory_order) {                        \
    typedef TFM_EMU_ATOMIC_T V;                                                          \
    const V b = static_cast<V>(operand);                                                 \
    V old;                                                                               \
    __atomic_load(&obj->value_, &old, __ATOMIC_SEQ_CST);                                 \
    for (;;) {                                                                           \
      const V a = old;                                                                   \
      V desired = static_cast<V>(expr);                                                  \
      if (__atomic_compare_exchange(&obj->value_, &old, &desired, false, __ATOMIC_SEQ_CST, \
                                    __ATOMIC_SEQ_CST))                                   \
        return a;                                                                        \
    }                                                                                    \
  }
TFM_EMU_ATOMIC_RMW(atomic_fetch_add_explicit, a + b)
TFM_EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, a - b)
TFM_EMU_ATOMIC_RMW(atomic_fetch_and_explicit, a & b)
TFM_EMU_ATOMIC_RMW(atomic_fetch_or_explicit, a | b)
TFM_EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, a ^ b)
TFM_EMU_ATOMIC_RMW(atomic_fetch_max_explicit, a < b ? b : a)
TFM_EMU_ATOMIC_RMW(atomic_fetch_min_explicit, b < a ? b : a)
#undef TFM_EMU_ATOMIC_RMW
#undef TFM_EMU_ATOMIC_T

#undef TFM_EMU_SCALAR_ARG

}  // namespace metal

// ----------------------------------------------------------------------------
// Kernel registration: TFM_INSTANTIATE_KERNEL(host_name, fn<T...>) records the
// specialization under its host name; the runtime binds dispatch arguments to
// its parameters by position.

namespace tfm_emu {

template <unsigned... I> struct seq {};
template <unsigned N, unsigned... I> struct make_seq : make_seq<N - 1, N - 1, I...> {};
template <unsigned... I> struct make_seq<0, I...> { typedef seq<I...> type; };

template <unsigned I, class... P> struct nth;
template <class H, class... P> struct nth<0, H, P...> { typedef H type; };
template <unsigned I, class H, class... P> struct nth<I, H, P...> { typedef typename nth<I - 1, P...>::type type; };

template <class T> struct size_of { static constexpr uint32_t value = sizeof(T); };
template <> struct size_of<void> { static constexpr uint32_t value = 1; };
template <> struct size_of<const void> { static constexpr uint32_t value = 1; };
template <class T> struct align_of { static constexpr uint32_t value = alignof(T); };
template <> struct align_of<void> { static constexpr uint32_t value = 1; };
template <> struct align_of<const void> { static constexpr uint32_t value = 1; };

template <class P> struct param_kind { static constexpr int value = -1; };
template <class T> struct param_kind<T*> { static constexpr int value = kParamPointer; };
template <class T> struct param_kind<T&> { static constexpr int value = kParamReference; };

template <class P> struct pointee { typedef void type; };
template <class T> struct pointee<T*> { typedef T type; };
template <class T> struct pointee<T&> { typedef T type; };

template <class P, bool Builtin>
constexpr ParamInfo param_info() {
  static_assert(Builtin || param_kind<P>::value >= 0,
                "kernel parameters must be buffers (device/constant/threadgroup T*) or constant T&, "
                "followed by TFM_KERNEL_BUILTINS");
  typedef typename pointee<P>::type T;
  return ParamInfo{param_kind<P>::value, is_const<T>::value ? 1 : 0,
                   size_of<typename remove_cv<T>::type>::value, align_of<typename remove_cv<T>::type>::value};
}

template <class... P>
struct kernel_signature {
  static constexpr unsigned kN = sizeof...(P);
  static_assert(kN >= 6, "a kernel must end with TFM_KERNEL_BUILTINS");
  static constexpr unsigned kFirstBuiltin = kN - 6;
  typedef void (*Fn)(P...);

  template <unsigned I>
  static constexpr bool builtin_ok() {
    typedef typename remove_cv<typename nth<I, P...>::type>::type B;
    return I - kFirstBuiltin < 4 ? is_same<B, metal::vec<uint, 3>>::value : is_same<B, uint>::value;
  }
  static_assert(builtin_ok<kFirstBuiltin>() && builtin_ok<kFirstBuiltin + 1>() &&
                    builtin_ok<kFirstBuiltin + 2>() && builtin_ok<kFirstBuiltin + 3>() &&
                    builtin_ok<kFirstBuiltin + 4>() && builtin_ok<kFirstBuiltin + 5>(),
                "a kernel's last parameters must be TFM_KERNEL_BUILTINS "
                "(uint3 gid, uint3 lid, uint3 tgid, uint3 tgsize, uint simd_lane, uint simd_id)");

  template <class Q, unsigned I>
  static Q arg(void* const* args, const uint32_t* b) {
    if constexpr (I >= kFirstBuiltin) {
      constexpr unsigned j = I - kFirstBuiltin;
      if constexpr (j < 4) {
        return metal::vec<uint, 3>(b[3 * j], b[3 * j + 1], b[3 * j + 2]);
      } else {
        return b[12 + (j - 4)];
      }
    } else if constexpr (param_kind<Q>::value == kParamPointer) {
      return static_cast<Q>(args[I]);
    } else {
      return *static_cast<typename pointee<Q>::type*>(args[I]);
    }
  }

  template <unsigned... I>
  static void call(Fn fn, void* const* args, const uint32_t* b, seq<I...>) {
    fn(arg<P, I>(args, b)...);
  }

  static void invoke(void (*fn)(), void* const* args, const uint32_t* b) {
    call(reinterpret_cast<Fn>(fn), args, b, typename make_seq<kN>::type());
  }
};

// Builtin positions do not go through param_info's static_assert.
template <class... P>
struct kernel_param_table {
  template <unsigned... I>
  static constexpr ParamInfo at(unsigned i, seq<I...>) {
    constexpr ParamInfo table[] = {param_info<P, (I >= sizeof...(P) - 6)>()...};
    return table[i];
  }
};

class Registrar {
 public:
  template <class... P>
  Registrar(const char* name, void (*fn)(P...), const char* file, int line) {
    typedef kernel_signature<P...> S;
    static ParamInfo params[sizeof...(P)];
    for (unsigned i = 0; i < sizeof...(P); ++i)
      params[i] = kernel_param_table<P...>::at(i, typename make_seq<sizeof...(P)>::type());
    entry_.name = name;
    entry_.file = file;
    entry_.line = line;
    entry_.fn = reinterpret_cast<void (*)()>(fn);
    entry_.invoke = &S::invoke;
    entry_.nparams = static_cast<int>(S::kFirstBuiltin);
    entry_.params = params;
    register_kernel(&entry_);
  }

 private:
  KernelEntry entry_;
};

}  // namespace tfm_emu

// The kernel builtins, as plain by-value parameters the runner fills in.
#define TFM_KERNEL_BUILTINS uint3 gid, uint3 lid, uint3 tgid, uint3 tgsize, uint simd_lane, uint simd_id

// TFM_INSTANTIATE_KERNEL(softshrink_float, softshrink<float>)
#define TFM_INSTANTIATE_KERNEL(host_name, ...) \
  static ::tfm_emu::Registrar tfm_emu_kernel_##host_name(#host_name, &__VA_ARGS__, __FILE__, __LINE__);

// TFM_REGISTER_KERNEL(fn): a non-template kernel, under its own name.
#define TFM_REGISTER_KERNEL(fn) \
  static ::tfm_emu::Registrar tfm_emu_kernel_##fn(#fn, &fn, __FILE__, __LINE__);

// Address spaces and function qualifiers: no-ops in C++. Defined last so the
// code above is unaffected. (emu.py rewrites `[[threadgroup(n)]]`, which would
// otherwise become `[[(n)]]`, and threadgroup variables declared in kernels.)
#define device
#define constant
#define threadgroup
#define thread
#define kernel

#endif  // TFMETAL_EMU_METAL_EMU_H_
