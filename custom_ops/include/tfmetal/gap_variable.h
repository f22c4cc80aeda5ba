// The arithmetic of the variable update gap kernels: AssignAddVariableOp and
// AssignSubVariableOp, `var = var + value` and `var = var - value` element by
// element, in place. Shared by the Metal kernels (custom_ops/metal/gap_variable.h)
// and host C++ (plain C++ mode of portable.h: float, int64, and any storage
// type that converts to and from float explicitly, e.g. Eigen::half and
// Eigen::bfloat16).
//
// What TensorFlow's CPU kernel gives, and why this is it:
// - float: one IEEE add (or subtract), rounded to nearest even.
// - half, bfloat16: both operands widened to float (exactly), one float add,
//   and the float rounded once to the storage type: T(float(var) +- float(value)).
//   Eigen's half and bfloat16 arithmetic, which TF's kernel runs, is this very
//   expression, so the two agree by construction. It is also the correctly
//   rounded sum of the two values, whichever path the CPU takes (a native
//   half add rounds the exact sum directly):
//     Rounding the exact sum s to float (24-bit significand) and then to a
//     p-bit type is rounding twice. Twice-rounding to nearest an exact sum or
//     difference of p-bit numbers equals rounding it once when the wider
//     format has at least 2p + 2 bits (2p + 1 already suffices for + and -).
//     half has p = 11 (2p + 2 = 24) and bfloat16 p = 8 (2p + 2 = 18), both
//     <= 24. Float's exponent range holds both types' (bfloat16's is float's).
//     Below 2^-126, where bfloat16 and float are both subnormal, each loses
//     the same number k of bits, and 24 - k >= 2(8 - k) + 2 still holds; half's
//     subnormals are normal floats. Float overflows only where the type's
//     correctly rounded result is infinite already (float's overflow
//     threshold lies above either type's).
//   Signed zeros follow IEEE in float and survive the conversions: -0 + -0 =
//   -0, -0 - 0 = -0, 0 - 0 = +0, x - x = +0. inf - inf and inf + -inf are NaN;
//   a NaN operand gives NaN. Which NaN (sign and payload bits) is not fixed:
//   x86 returns a NaN operand, quieted, or a negative default NaN for
//   inf - inf; compilers may swap the operands of an add; Eigen's bfloat16
//   rounding replaces every NaN with the canonical quiet NaN of its sign; a
//   GPU has its own rule. So the results agree bit for bit except inside
//   NaNs, and the tests compare where the values are NaN (numpy's isnan
//   masks) and the bit patterns everywhere else.
// - int64: two's complement wrap-around (INT64_MAX + 1 = INT64_MIN), the
//   arithmetic done in uint64 so that no signed overflow occurs in C++.
// Subnormals: TF runs its CPU kernels with the x86 flush-to-zero and
// denormals-are-zero modes on, so in float and bfloat16 (whose widened values
// are float subnormals) a subnormal operand reads as a zero of its sign and a
// subnormal result becomes one. half is untouched by this: its subnormals are
// normal floats once widened, and the rounding of a float to a half
// subnormal is not flushed (measured with TF 2.21 on x86). The
// kernels here keep IEEE subnormals (the emulator always does; on a GPU it is
// the device's handling); host C++ calling these functions inside a TF kernel
// runs under the same modes as TF and flushes as TF does.
#ifndef TFMETAL_GAP_VARIABLE_H_
#define TFMETAL_GAP_VARIABLE_H_

#include "tfmetal/portable.h"

// Operation codes (the host sets them from the op: AssignAdd- / AssignSubVariableOp).
#define TFM_GAP_VARIABLE_ADD 0
#define TFM_GAP_VARIABLE_SUB 1

// var + value or var - value in float, rounded once (float's own rounding).
TFM_INLINE float tfm_assign_update_float(uint32_t op, float a, float b) {
  return op == TFM_GAP_VARIABLE_SUB ? a - b : a + b;
}

// var + value or var - value modulo 2^64.
TFM_INLINE int64_t tfm_assign_update_int64(uint32_t op, int64_t a, int64_t b) {
  const uint64_t ua = static_cast<uint64_t>(a), ub = static_cast<uint64_t>(b);
  return static_cast<int64_t>(op == TFM_GAP_VARIABLE_SUB ? ua - ub : ua + ub);
}

// Any floating storage type T (float; half and bfloat in Metal; Eigen::half
// and Eigen::bfloat16 in host C++): widen to float, update, round once to T.
template <typename T>
TFM_INLINE T tfm_assign_update(uint32_t op, T var, T value) {
  return static_cast<T>(tfm_assign_update_float(op, static_cast<float>(var), static_cast<float>(value)));
}

// int64 wraps around; never through float.
template <>
TFM_INLINE int64_t tfm_assign_update<int64_t>(uint32_t op, int64_t var, int64_t value) {
  return tfm_assign_update_int64(op, var, value);
}

#endif  // TFMETAL_GAP_VARIABLE_H_
