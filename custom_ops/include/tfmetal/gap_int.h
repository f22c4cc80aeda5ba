// int64 and bool gap kernels: the integer arithmetic and comparisons of
// Keras' step counters (the optimizer's iterations, the loss scale's counter,
// Dropout's seed state) and the bool reductions of loss scaling's finite
// check (All / Any). Shared by the Metal kernels (custom_ops/metal/gap_int.h)
// and their host code. TensorFlow's CPU semantics, exactly:
// - AddV2, Sub, Mul wrap around in two's complement;
// - FloorMod takes the sign of the divisor (x - floor(x / y) * y), with
//   INT64_MIN mod -1 = 0; a zero divisor is TF's error "Integer division by
//   zero", which the host raises before the GPU runs (the divisor is in host
//   memory);
// - Maximum, Minimum, and the six comparisons, bool (one byte) out;
// - All / Any over a set of axes: true / false over an empty set.
#ifndef TFMETAL_GAP_INT_H_
#define TFMETAL_GAP_INT_H_

#include "tfmetal/portable.h"

// Operation codes (the host sets them from the op's name).
#define TFM_GAP_INT_ADD 0
#define TFM_GAP_INT_SUB 1
#define TFM_GAP_INT_MUL 2
#define TFM_GAP_INT_FLOORMOD 3
#define TFM_GAP_INT_MAX 4
#define TFM_GAP_INT_MIN 5
#define TFM_GAP_INT_EQ 10
#define TFM_GAP_INT_NE 11
#define TFM_GAP_INT_LT 12
#define TFM_GAP_INT_LE 13
#define TFM_GAP_INT_GT 14
#define TFM_GAP_INT_GE 15

// y != 0 (the host checked).
TFM_INLINE int64_t gap_floor_mod(int64_t x, int64_t y) {
  if (y == -1) return 0;  // INT64_MIN % -1 overflows in C++; the result is 0
  const int64_t r = x % y;
  return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
}

TFM_INLINE int64_t gap_int64_binary(uint32_t op, int64_t x, int64_t y) {
  const uint64_t ux = static_cast<uint64_t>(x), uy = static_cast<uint64_t>(y);
  switch (op) {
    case TFM_GAP_INT_ADD: return static_cast<int64_t>(ux + uy);
    case TFM_GAP_INT_SUB: return static_cast<int64_t>(ux - uy);
    case TFM_GAP_INT_MUL: return static_cast<int64_t>(ux * uy);
    case TFM_GAP_INT_FLOORMOD: return gap_floor_mod(x, y);
    case TFM_GAP_INT_MAX: return x > y ? x : y;
    default: return x < y ? x : y;  // TFM_GAP_INT_MIN
  }
}

TFM_INLINE uint8_t gap_int64_compare(uint32_t op, int64_t x, int64_t y) {
  switch (op) {
    case TFM_GAP_INT_EQ: return x == y ? 1 : 0;
    case TFM_GAP_INT_NE: return x != y ? 1 : 0;
    case TFM_GAP_INT_LT: return x < y ? 1 : 0;
    case TFM_GAP_INT_LE: return x <= y ? 1 : 0;
    case TFM_GAP_INT_GT: return x > y ? 1 : 0;
    default: return x >= y ? 1 : 0;  // TFM_GAP_INT_GE
  }
}

#endif  // TFMETAL_GAP_INT_H_
