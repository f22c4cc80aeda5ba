// tfm_philox4x32 (tfmetal/philox.h) of kPhiloxLanes counters at once, for the
// CPU kernels that draw Philox masks (attention dropout, dropout). The blocks
// are computed word by word across the lanes (structure of arrays): c0..c3
// hold word 0..3 of each lane's counter and receive the block's words. With
// AVX-512 or AVX2 (cpu_common.h's level) the rounds' 32 x 32 -> 64-bit
// products are vector multiplies of the even lanes (the odd lanes shifted
// down first), their low and high words blended back; elsewhere a portable
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

constexpr int kPhiloxLanes = 16;

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

// The 10 rounds of 16 Philox blocks in one AVX-512 register per word: the
// round of AttnPhilox16Avx2, 16 lanes wide.
__attribute__((target("avx512f"))) inline void PhiloxLanesAvx512(uint32_t* c0, uint32_t* c1, uint32_t* c2,
                                                           uint32_t* c3, uint32_t k0, uint32_t k1) {
  __m512i w0 = _mm512_loadu_si512(c0);
  __m512i w1 = _mm512_loadu_si512(c1);
  __m512i w2 = _mm512_loadu_si512(c2);
  __m512i w3 = _mm512_loadu_si512(c3);
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __mmask16 odd = 0xAAAA;
  for (int round = 0; round < 10; ++round) {
    const __m512i e0 = _mm512_mul_epu32(w0, m0), o0 = _mm512_mul_epu32(_mm512_srli_epi64(w0, 32), m0);
    const __m512i e1 = _mm512_mul_epu32(w2, m1), o1 = _mm512_mul_epu32(_mm512_srli_epi64(w2, 32), m1);
    const __m512i lo0 = _mm512_mask_blend_epi32(odd, e0, _mm512_slli_epi64(o0, 32));
    const __m512i hi0 = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(e0, 32), o0);
    const __m512i lo1 = _mm512_mask_blend_epi32(odd, e1, _mm512_slli_epi64(o1, 32));
    const __m512i hi1 = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(e1, 32), o1);
    w0 = _mm512_xor_si512(_mm512_xor_si512(hi1, w1), _mm512_set1_epi32(static_cast<int>(k0)));
    w2 = _mm512_xor_si512(_mm512_xor_si512(hi0, w3), _mm512_set1_epi32(static_cast<int>(k1)));
    w1 = lo1;
    w3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm512_storeu_si512(c0, w0);
  _mm512_storeu_si512(c1, w1);
  _mm512_storeu_si512(c2, w2);
  _mm512_storeu_si512(c3, w3);
}
#endif  // TFMETAL_PHILOX_X86

inline void PhiloxLanesPortable(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    for (int l = 0; l < kPhiloxLanes; ++l) {
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

// The 10 rounds of kPhiloxLanes blocks with key (k0, k1), in place.
inline void PhiloxLanes(uint32_t* c0, uint32_t* c1, uint32_t* c2, uint32_t* c3, uint32_t k0, uint32_t k1) {
#ifdef TFMETAL_PHILOX_X86
  if (CpuUseAvx512()) return PhiloxLanesAvx512(c0, c1, c2, c3, k0, k1);
  if (CpuUseAvx2()) return PhiloxLanesAvx2(c0, c1, c2, c3, k0, k1);
#endif
  PhiloxLanesPortable(c0, c1, c2, c3, k0, k1);
}

}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_PHILOX_LANES_H_
