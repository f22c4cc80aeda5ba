// Philox-4x32-10, the counter-based generator TensorFlow's stateless random
// ops use (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), and the conversions of its 32-bit words to floats that TensorFlow's
// CPU kernels apply, so our kernels draw the same numbers bit for bit.
// Shared by the CPU and the Metal kernels (see tfmetal/portable.h).
//
// One call of philox4x32 maps (counter: 4 words, key: 2 words) to 4 words.
// Stream position g (the g-th block of 4 outputs) is counter + g, the counter
// read as one 128-bit little-endian integer (word 0 least significant).
#ifndef TFMETAL_PHILOX_H_
#define TFMETAL_PHILOX_H_

#include "tfmetal/portable.h"

struct tfm_philox_block {
  uint32_t w[4];
};

// 32x32 -> 64-bit product, as (high, low) words.
TFM_INLINE void tfm_philox_mul(uint32_t a, uint32_t b, TFM_THREAD uint32_t& hi, TFM_THREAD uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// The 10 rounds (round constants and Weyl key increments of Philox-4x32).
TFM_INLINE tfm_philox_block tfm_philox4x32(tfm_philox_block ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    tfm_philox_mul(0xD2511F53u, ctr.w[0], hi0, lo0);
    tfm_philox_mul(0xCD9E8D57u, ctr.w[2], hi1, lo1);
    tfm_philox_block next;
    next.w[0] = hi1 ^ ctr.w[1] ^ k0;
    next.w[1] = lo1;
    next.w[2] = hi0 ^ ctr.w[3] ^ k1;
    next.w[3] = lo0;
    ctr = next;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return ctr;
}

// counter + g, with carries across the four words.
TFM_INLINE tfm_philox_block tfm_philox_skip(tfm_philox_block ctr, uint64_t g) {
  const uint32_t lo = static_cast<uint32_t>(g), hi = static_cast<uint32_t>(g >> 32);
  const uint32_t w0 = ctr.w[0] + lo;
  uint32_t carry = w0 < lo ? 1u : 0u;
  const uint32_t w1a = ctr.w[1] + hi;
  uint32_t carry1 = w1a < hi ? 1u : 0u;
  const uint32_t w1 = w1a + carry;
  carry1 += (w1 < carry) ? 1u : 0u;
  const uint32_t w2 = ctr.w[2] + carry1;
  const uint32_t carry2 = (w2 < carry1) ? 1u : 0u;
  tfm_philox_block out;
  out.w[0] = w0;
  out.w[1] = w1;
  out.w[2] = w2;
  out.w[3] = ctr.w[3] + carry2;
  return out;
}

// A uniform float in [0, 1) from 23 random bits, as TensorFlow's
// Uint32ToFloat: the bits as the mantissa of a number in [1, 2), minus 1.
TFM_INLINE float tfm_uint32_to_unit_float(uint32_t x) {
  return tfm_bits_to_float((x & 0x7fffffu) | 0x3f800000u) - 1.0f;
}

#endif  // TFMETAL_PHILOX_H_
