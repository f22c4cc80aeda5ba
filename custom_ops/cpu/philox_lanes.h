// tfm_philox4x32 (tfmetal/philox.h) of groups of kPhiloxLanes counters, for the
// CPU kernels that draw Philox masks (attention dropout, dropout). The blocks
// are computed word by word across the lanes (structure of arrays): c0..c3
// hold word 0..3 of each lane's counter and receive the block's words. With
// AVX-512 or AVX2 (cpu_common.h's level) the rounds' 32 x 32 -> 64-bit
// products are vector multiplies of the even lanes (the odd lanes shifted
// down first), their low and high words merged back; elsewhere a portable
// loop the compiler may vectorize. Integer operations only: every level gives
// the same words.
#ifndef TFMETAL_CPU_PHILOX_LANES_H_
#define TFMETAL_CPU_PHILOX_LANES_H_

#include <cstdint>

#include "cpu/cpu_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TFMETAL_PHILOX_X86 1
#endif

namespace tfmetal_ext {

constexpr int kPhiloxLanes = 16;     // blocks per group: one AVX-512 register per word
constexpr int kPhiloxMaxGroups = 4;  // groups a caller may draw at once (their rounds interleave)

#ifdef TFMETAL_PHILOX_X86
// One Philox round of 8 blocks in AVX2 registers: _mm256_mul_epu32 multiplies
// the even 32-bit lanes into 64-bit products (the odd lanes shifted down
// first), and the products' low and high words are blended back into 8 lanes.
#define TFMETAL_PHILOX8_ROUND(w0, w1, w2, w3, kk0, kk1)                                           \
  do {                                                                                                  \
    const __m256i e0_ = _mm256_mul_epu32(w0, m0), o0_ = _mm256_mul_epu32(_mm256_srli_epi64(w0, 32), m0); \
    const __m256i e1_ = _mm256_mul_epu32(w2, m1), o1_ = _mm256_mul_epu32(_mm256_srli_epi64(w2, 32), m1); \
    const __m256i lo0_ = _mm256_blend_epi32(e0_, _mm256_slli_epi64(o0_, 32), 0xAA);                      \
    const __m256i hi0_ = _mm256_blend_epi32(_mm256_srli_epi64(e0_, 32), o0_, 0xAA);                      \
    const __m256i lo1_ = _mm256_blend_epi32(e1_, _mm256_slli_epi64(o1_, 32), 0xAA);                      \
    const __m256i hi1_ = _mm256_blend_epi32(_mm256_srli_epi64(e1_, 32), o1_, 0xAA);                      \
    w0 = _mm256_xor_si256(_mm256_xor_si256(hi1_, w1), kk0);                                             \
    w2 = _mm256_xor_si256(_mm256_xor_si256(hi0_, w3), kk1);                                             \
    w1 = lo1_;                                                                                          \
    w3 = lo0_;                                                                                          \
  } while (0)

// The 10 rounds of 16 Philox blocks with AVX2: two independent groups of 8
// interleaved, so each round's multiply latency of one group overlaps the
// other's work.
__attribute__((target("avx2"))) inline void PhiloxLanesAvx2(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3, uint32_t k0,
                                        uint32_t k1) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1));
  __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c2));
  __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c3));
  __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + 8));
  __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 + 8));
  __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c2 + 8));
  __m256i b3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c3 + 8));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  for (int round = 0; round < 10; ++round) {
    const __m256i kk0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i kk1 = _mm256_set1_epi32(static_cast<int>(k1));
    TFMETAL_PHILOX8_ROUND(a0, a1, a2, a3, kk0, kk1);
    TFMETAL_PHILOX8_ROUND(b0, b1, b2, b3, kk0, kk1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c0), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c1), a1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c2), a2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c3), a3);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c0 + 8), b0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c1 + 8), b1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c2 + 8), b2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c3 + 8), b3);
}
#undef TFMETAL_PHILOX8_ROUND

// One Philox round of 16 blocks in AVX-512 registers (one per word), in 12
// instructions: the products of the even lanes (e) and of the odd lanes moved
// down (o: _MM_PERM_DDBB copies lane 2i + 1 to 2i); a masked in-lane shuffle
// merges their low words (lane 2i of o up to 2i + 1) and their high words
// (lane 2i + 1 of e down to 2i); a ternary-logic op (truth table 0x96) is the
// three-way xor.
__attribute__((target("avx512f"), always_inline)) inline void PhiloxRoundAvx512(__m512i& w0, __m512i& w1, __m512i& w2,
                                                                              __m512i& w3, __m512i kk0, __m512i kk1) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __mmask16 even = 0x5555, odd = 0xAAAA;
  const __m512i e0 = _mm512_mul_epu32(w0, m0), o0 = _mm512_mul_epu32(_mm512_shuffle_epi32(w0, _MM_PERM_DDBB), m0);
  const __m512i e1 = _mm512_mul_epu32(w2, m1), o1 = _mm512_mul_epu32(_mm512_shuffle_epi32(w2, _MM_PERM_DDBB), m1);
  const __m512i lo0 = _mm512_mask_shuffle_epi32(e0, odd, o0, _MM_PERM_CCAA);
  const __m512i hi0 = _mm512_mask_shuffle_epi32(o0, even, e0, _MM_PERM_DDBB);
  const __m512i lo1 = _mm512_mask_shuffle_epi32(e1, odd, o1, _MM_PERM_CCAA);
  const __m512i hi1 = _mm512_mask_shuffle_epi32(o1, even, e1, _MM_PERM_DDBB);
  w0 = _mm512_ternarylogic_epi32(hi1, w1, kk0, 0x96);
  w2 = _mm512_ternarylogic_epi32(hi0, w3, kk1, 0x96);
  w1 = lo1;
  w3 = lo0;
}

// The 10 rounds of G groups of 16 blocks, the groups' rounds interleaved: a
// round is a chain of dependent multiplies and shuffles, so one group alone
// waits on their latency; 4 groups (16 state registers) keep the units busy.
template <int G>
__attribute__((target("avx512f"))) inline void PhiloxGroupsAvx512(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3,
                                                                 uint32_t k0, uint32_t k1) {
  __m512i w[G][4];
  for (int g = 0; g < G; ++g) {
    w[g][0] = _mm512_loadu_si512(c0 + kPhiloxLanes * g);
    w[g][1] = _mm512_loadu_si512(c1 + kPhiloxLanes * g);
    w[g][2] = _mm512_loadu_si512(c2 + kPhiloxLanes * g);
    w[g][3] = _mm512_loadu_si512(c3 + kPhiloxLanes * g);
  }
  for (int round = 0; round < 10; ++round) {
    const __m512i kk0 = _mm512_set1_epi32(static_cast<int>(k0));
    const __m512i kk1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < G; ++g) PhiloxRoundAvx512(w[g][0], w[g][1], w[g][2], w[g][3], kk0, kk1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int g = 0; g < G; ++g) {
    _mm512_storeu_si512(c0 + kPhiloxLanes * g, w[g][0]);
    _mm512_storeu_si512(c1 + kPhiloxLanes * g, w[g][1]);
    _mm512_storeu_si512(c2 + kPhiloxLanes * g, w[g][2]);
    _mm512_storeu_si512(c3 + kPhiloxLanes * g, w[g][3]);
  }
}

__attribute__((target("avx512f"))) inline void PhiloxLanesAvx512(uint32_t* c0, uint32_t* c1, uint32_t* c2,
                                                               uint32_t* c3, uint32_t k0, uint32_t k1, int groups) {
  int g = 0;
  for (; g + 4 <= groups; g += 4) {
    const int at = kPhiloxLanes * g;
    PhiloxGroupsAvx512<4>(c0 + at, c1 + at, c2 + at, c3 + at, k0, k1);
  }
  const int at = kPhiloxLanes * g;
  switch (groups - g) {
    case 3:
      PhiloxGroupsAvx512<3>(c0 + at, c1 + at, c2 + at, c3 + at, k0, k1);
      break;
    case 2:
      PhiloxGroupsAvx512<2>(c0 + at, c1 + at, c2 + at, c3 + at, k0, k1);
      break;
    case 1:
      PhiloxGroupsAvx512<1>(c0 + at, c1 + at, c2 + at, c3 + at, k0, k1);
      break;
    default:
      break;
  }
}
#endif  // TFMETAL_PHILOX_X86

inline void PhiloxLanesPortable(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3, uint32_t k0, uint32_t k1,
                                int groups) {
  const int lanes = kPhiloxLanes * groups;
  for (int round = 0; round < 10; ++round) {
    for (int l = 0; l < lanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
      const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p1);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// The 10 rounds of groups * kPhiloxLanes blocks with key (k0, k1), in place
// (c0..c3 hold groups * kPhiloxLanes words each). Drawing up to
// kPhiloxMaxGroups groups in one call lets the AVX-512 code interleave them.
inline void PhiloxLanes(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3, uint32_t k0, uint32_t k1,
                        int groups = 1) {
#ifdef TFMETAL_PHILOX_X86
  if (CpuUseAvx512()) return PhiloxLanesAvx512(c0, c1, c2, c3, k0, k1, groups);
  if (CpuUseAvx2()) {
    for (int g = 0; g < groups; ++g) {
      const int at = kPhiloxLanes * g;
      PhiloxLanesAvx2(c0 + at, c1 + at, c2 + at, c3 + at, k0, k1);
    }
    return;
  }
#endif
  PhiloxLanesPortable(c0, c1, c2, c3, k0, k1, groups);
}

}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_PHILOX_LANES_H_
