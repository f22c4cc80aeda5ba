// The math of the stateless-random gap kernels (StatelessRandomGetKeyCounter,
// StatelessRandomUniformV2 with the Philox algorithm), shared by the Metal
// kernels (custom_ops/metal/gap_random.h) and their host code. The numbers
// are TensorFlow's CPU kernel's, bit for bit
// (tests/ops/test_gap_random_metal_emu.py):
//
// - the key and counter of a seed (s0, s1): one Philox block of the counter
//   (s0 low, s0 high, s1 low, s1 high) under the fixed key
//   (0x3ec8f720, 0x02461e29); its words 0 and 1 are the key, words 2 and 3
//   the counter's second 64-bit word, the first word 0;
// - output element i of StatelessRandomUniformV2 is word i % 4 of Philox block
//   counter + i / 4 (the counter a 128-bit little-endian integer);
// - a word becomes a uniform value in [0, 1) from its low 23 (float), 10
//   (half) or 7 (bfloat16) bits: mantissa bits of a number in [1, 2), minus
//   1. In float that is (word & mask) * 2^-bits, exact, and exactly
//   representable in each type, so the value is the same however it is
//   rounded.
#ifndef TFMETAL_GAP_RANDOM_H_
#define TFMETAL_GAP_RANDOM_H_

#include "tfmetal/philox.h"
#include "tfmetal/portable.h"

// Mantissa bits each output dtype takes from a word: 23 float, 10 half, 7 bfloat16.
TFM_INLINE float gap_uniform_from_word(uint32_t word, uint32_t mantissa_bits) {
  const uint32_t mask = (1u << mantissa_bits) - 1u;
  return static_cast<float>(word & mask) * (1.0f / static_cast<float>(1u << mantissa_bits));
}

// The key (2 words) and counter (4 words) TensorFlow derives from a seed.
TFM_INLINE void gap_key_counter_from_seed(uint64_t seed0, uint64_t seed1, TFM_THREAD uint32_t* key,
                                          TFM_THREAD uint32_t* counter) {
  tfm_philox_block c;
  c.w[0] = static_cast<uint32_t>(seed0);
  c.w[1] = static_cast<uint32_t>(seed0 >> 32);
  c.w[2] = static_cast<uint32_t>(seed1);
  c.w[3] = static_cast<uint32_t>(seed1 >> 32);
  const tfm_philox_block mix = tfm_philox4x32(c, 0x3ec8f720u, 0x02461e29u);
  key[0] = mix.w[0];
  key[1] = mix.w[1];
  counter[0] = 0;
  counter[1] = 0;
  counter[2] = mix.w[2];
  counter[3] = mix.w[3];
}

#endif  // TFMETAL_GAP_RANDOM_H_
