// CPU kernels of TfmetalExt>Attention and TfmetalExt>AttentionGrad.
//
// Flash-style: the [Tq, Tk] score matrix is never stored, only float32 tiles
// of kBlockQ x kBlockK scores. The math per element is tfmetal/attention.h's;
// this file owns the tiling, the loops and the threading.
//
// Forward: one work item per (batch, head, tile of kBlockQ query rows). Over
// the key tiles (with causal, only those holding a key <= the tile's last row)
// S^T = K Q^T (one small GEMM; the tile is kept transposed so the query tile
// is transposed once), the scores scaled and masked, the online softmax
// updates the running max and sum of each row and rescales the running output
// O, then O += P V (a second GEMM). The end writes O / sum and the row lse.
//
// Backward: one work item per (batch, head). Dr = rowsum(dO * O) of every row,
// then over the key tiles, over the query tiles that reach them: S = Q K^T and
// dP = dO V^T are recomputed, P = exp(S - lse), dS = scale P (dP - Dr), and
// dV += P^T dO, dK += dS^T Q (owned by the key tile: float32 tiles written once
// at its end), dQ += dS K (owned by the work item: a float32 [Tq, D] buffer
// written at the end). No atomics: the summation order depends on the shapes
// only, so the results do not depend on the number of threads.
//
// The GEMMs are Eigen products of float32 tiles; on x86-64 (picked at run
// time, cpu_common.h's CpuVectorLevel) register-blocked micro-kernels, AVX2 +
// FMA or AVX-512, and the element-wise loops (exp, masking, online softmax)
// are compiled for that level too. Both micro-kernels sum each output
// element in the same order, one fused multiply-add per term: their GEMMs
// give the same bits (the element-wise loops may not, in the last bit, where
// the compiler fuses a multiply and an add at one level and not the other).
// Half and bfloat16 tiles are widened to float32 once per tile; every sum is
// float32.
//
// A tile whose mask bytes are all set (a padding mask short of the padding)
// skips the mask test, as an unmasked tile does.
//
// Attention dropout (dropout_rate > 0; tfmetal/attention.h): each query row
// of a tile draws the Philox blocks of its keys' mask (4 keys a block) and the
// tile's probabilities are dropped after the online softmax has summed them
// (forward, before O += P V); the backward draws the same blocks again and
// drops P (for dV) and dP. Where every row starts at the same word of a block
// (tk % 4 == 0), the forward draws with the query rows as the Philox lanes:
// the transposed tile's layout.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "Eigen/Core"
#include "cpu/cpu_common.h"
#include "cpu/philox_lanes.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tfmetal/attention.h"
#include "tfmetal/dropout.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TFMETAL_ATTN_X86 1
#endif

namespace tfmetal_ext {
namespace attention_cpu {

#define TFMETAL_ATTN_INLINE inline __attribute__((always_inline))

constexpr int64_t kBlockQ = 64;   // query rows per tile
constexpr int64_t kBlockK = 128;  // keys per tile
constexpr int kLanes = 16;        // independent accumulators of the row reductions
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t AttnCeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------- element-wise math

TFMETAL_ATTN_INLINE float AttnBitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TFMETAL_ATTN_INLINE uint32_t AttnFloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// exp(x) in float32, branch-free so its loops vectorize: portable.h's
// tfm_exp_poly (Cephes' expf, |error| about 1 ulp; 0 for x < -87.3 and -inf:
// masked scores; NaN for NaN). The arguments here are <= 0 but for rounding.
TFMETAL_ATTN_INLINE float AttnExp(float x) { return tfm_exp_poly(x); }

TFMETAL_ATTN_INLINE float AttnReduceLanes(float* acc, bool take_max) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] = take_max ? std::max(acc[j], acc[j + width]) : acc[j] + acc[j + width];
  return acc[0];
}

TFMETAL_ATTN_INLINE float AttnRowMax(const float* __restrict s, int64_t n) {
  float acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = kNegInf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = std::max(acc[j], s[i + j]);
  for (int j = 0; i + j < n; ++j) acc[j] = std::max(acc[j], s[i + j]);
  return AttnReduceLanes(acc, true);
}

// s[j] = exp(s[j] - m); returns the sum.
TFMETAL_ATTN_INLINE float AttnExpRow(float* __restrict s, int64_t n, float m) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float e = AttnExp(s[i + j] - m);
      s[i + j] = e;
      acc[j] += e;
    }
  for (int j = 0; i + j < n; ++j) {
    const float e = AttnExp(s[i + j] - m);
    s[i + j] = e;
    acc[j] += e;
  }
  return AttnReduceLanes(acc, false);
}

TFMETAL_ATTN_INLINE float AttnDot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return AttnReduceLanes(acc, false);
}

TFMETAL_ATTN_INLINE void AttnScaleRow(float* __restrict x, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// ---------------------------------------------------------------- tile GEMMs

// C[m x n] (+)= A B: A's element (r, p) at a[r * a_rs + p * a_cs] (a_cs == 1:
// row-major A; a_rs == 1: A stored transposed), B [k x n] row-major with
// leading dimension ldb, C row-major with leading dimension ldc.
struct AttnGemm {
  int64_t m, n, k;
  const float* a;
  int64_t a_rs, a_cs;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  bool accumulate;
};

using AttnRowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using AttnMap = Eigen::Map<AttnRowMat, 0, Eigen::OuterStride<>>;
using AttnConstMap = Eigen::Map<const AttnRowMat, 0, Eigen::OuterStride<>>;

inline void AttnGemmEigen(const AttnGemm& g) {
  AttnConstMap b(g.b, g.k, g.n, Eigen::OuterStride<>(g.ldb));
  AttnMap c(g.c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
  if (g.a_cs == 1) {
    AttnConstMap a(g.a, g.m, g.k, Eigen::OuterStride<>(g.a_rs));
    if (g.accumulate) {
      c.noalias() += a * b;
    } else {
      c.noalias() = a * b;
    }
  } else {
    AttnConstMap at(g.a, g.k, g.m, Eigen::OuterStride<>(g.a_cs));
    if (g.accumulate) {
      c.noalias() += at.transpose() * b;
    } else {
      c.noalias() = at.transpose() * b;
    }
  }
}

#ifdef TFMETAL_ATTN_X86
#define TFMETAL_ATTN_AVX2 __attribute__((target("avx2,fma")))

// R rows x 16 columns of C, over the whole k. kAT: A is stored transposed
// (a_rs == 1), so a row block's values of one p are adjacent.
template <int R, bool kAT>
TFMETAL_ATTN_AVX2 TFMETAL_ATTN_INLINE void AttnMicro16(const AttnGemm& g, int64_t r0, int64_t c0) {
  __m256 acc0[R], acc1[R];
  float* c = g.c + r0 * g.ldc + c0;
  const int64_t ldc = g.ldc, ldb = g.ldb, a_rs = kAT ? 1 : g.a_rs, a_cs = kAT ? g.a_cs : 1;
  for (int r = 0; r < R; ++r) {
    acc0[r] = g.accumulate ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    acc1[r] = g.accumulate ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
  const float* ap = g.a + r0 * a_rs;
  const float* bp = g.b + c0;
  for (int64_t p = g.k; p > 0; --p) {
    const __m256 b0 = _mm256_loadu_ps(bp);
    const __m256 b1 = _mm256_loadu_ps(bp + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(ap + r * a_rs);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
    ap += a_cs;
    bp += ldb;
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, acc1[r]);
  }
}

// R rows x `cols` (1..8) columns of C, over the whole k (masked loads/stores).
template <int R>
TFMETAL_ATTN_AVX2 TFMETAL_ATTN_INLINE void AttnMicro8(const AttnGemm& g, int64_t r0, int64_t c0, int cols) {
  alignas(32) static const int32_t kMaskSource[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskSource + 8 - cols));
  __m256 acc[R];
  float* c = g.c + r0 * g.ldc + c0;
  for (int r = 0; r < R; ++r) acc[r] = g.accumulate ? _mm256_maskload_ps(c + r * g.ldc, mask) : _mm256_setzero_ps();
  const float* a = g.a + r0 * g.a_rs;
  const float* b = g.b + c0;
  for (int64_t p = 0; p < g.k; ++p) {
    const __m256 bv = _mm256_maskload_ps(b + p * g.ldb, mask);
    const float* ap = a + p * g.a_cs;
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(ap + r * g.a_rs), bv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(c + r * g.ldc, mask, acc[r]);
}

template <int R>
TFMETAL_ATTN_AVX2 TFMETAL_ATTN_INLINE void AttnRowBlock(const AttnGemm& g, int64_t r0) {
  int64_t c0 = 0;
  if (g.a_rs == 1) {
    for (; c0 + 16 <= g.n; c0 += 16) AttnMicro16<R, true>(g, r0, c0);
  } else {
    for (; c0 + 16 <= g.n; c0 += 16) AttnMicro16<R, false>(g, r0, c0);
  }
  for (; c0 < g.n; c0 += 8) AttnMicro8<R>(g, r0, c0, static_cast<int>(std::min<int64_t>(8, g.n - c0)));
}

TFMETAL_ATTN_AVX2 void AttnGemmAvx2(const AttnGemm& g) {
  constexpr int kRows = 6;
  int64_t r0 = 0;
  for (; r0 + kRows <= g.m; r0 += kRows) AttnRowBlock<kRows>(g, r0);
  switch (g.m - r0) {
    case 5: AttnRowBlock<5>(g, r0); break;
    case 4: AttnRowBlock<4>(g, r0); break;
    case 3: AttnRowBlock<3>(g, r0); break;
    case 2: AttnRowBlock<2>(g, r0); break;
    case 1: AttnRowBlock<1>(g, r0); break;
    default: break;
  }
}

#define TFMETAL_ATTN_AVX512 __attribute__((target("avx512f,avx2,fma")))

// R rows x 16 V columns of C (V zmm registers a row), over the whole k; `cols`
// (1..16) columns in the last register when kTail (masked loads and stores).
// Each element is summed as AttnMicro16 sums it: C (or 0), then one fused
// multiply-add per p in order.
template <int R, int V, bool kAT, bool kTail>
TFMETAL_ATTN_AVX512 TFMETAL_ATTN_INLINE void AttnMicro512(const AttnGemm& g, int64_t r0, int64_t c0, int cols) {
  const __mmask16 last = kTail ? static_cast<__mmask16>((1u << cols) - 1u) : static_cast<__mmask16>(0xFFFF);
  __m512 acc[R][V];
  float* c = g.c + r0 * g.ldc + c0;
  const int64_t ldc = g.ldc, ldb = g.ldb, a_rs = kAT ? 1 : g.a_rs, a_cs = kAT ? g.a_cs : 1;
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const __mmask16 mk = v == V - 1 ? last : static_cast<__mmask16>(0xFFFF);
      acc[r][v] = g.accumulate ? _mm512_maskz_loadu_ps(mk, c + r * ldc + 16 * v) : _mm512_setzero_ps();
    }
  }
  const float* ap = g.a + r0 * a_rs;
  const float* bp = g.b + c0;
  for (int64_t p = g.k; p > 0; --p) {
    __m512 bv[V];
    for (int v = 0; v < V; ++v) {
      bv[v] = (kTail && v == V - 1) ? _mm512_maskz_loadu_ps(last, bp + 16 * v) : _mm512_loadu_ps(bp + 16 * v);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(ap[r * a_rs]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
    ap += a_cs;
    bp += ldb;
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      if (kTail && v == V - 1) {
        _mm512_mask_storeu_ps(c + r * ldc + 16 * v, last, acc[r][v]);
      } else {
        _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
      }
    }
  }
}

// Rows [r0, r0 + R) of C: blocks of 64 columns, then one of 16-48, then a masked one.
template <int R, bool kAT>
TFMETAL_ATTN_AVX512 TFMETAL_ATTN_INLINE void AttnRowBlock512(const AttnGemm& g, int64_t r0) {
  int64_t c0 = 0;
  for (; c0 + 64 <= g.n; c0 += 64) AttnMicro512<R, 4, kAT, false>(g, r0, c0, 16);
  const int64_t left = g.n - c0;
  if (left >= 48) {
    AttnMicro512<R, 3, kAT, false>(g, r0, c0, 16);
    c0 += 48;
  } else if (left >= 32) {
    AttnMicro512<R, 2, kAT, false>(g, r0, c0, 16);
    c0 += 32;
  } else if (left >= 16) {
    AttnMicro512<R, 1, kAT, false>(g, r0, c0, 16);
    c0 += 16;
  }
  if (c0 < g.n) AttnMicro512<R, 1, kAT, true>(g, r0, c0, static_cast<int>(g.n - c0));
}

template <int R>
TFMETAL_ATTN_AVX512 TFMETAL_ATTN_INLINE void AttnRows512(const AttnGemm& g, int64_t r0) {
  if (g.a_rs == 1) {
    AttnRowBlock512<R, true>(g, r0);
  } else {
    AttnRowBlock512<R, false>(g, r0);
  }
}

// 6 rows x 64 columns a block: 24 accumulators of the 32 registers.
TFMETAL_ATTN_AVX512 void AttnGemmAvx512(const AttnGemm& g) {
  constexpr int kRows = 6;
  int64_t r0 = 0;
  for (; r0 + kRows <= g.m; r0 += kRows) AttnRows512<kRows>(g, r0);
  switch (g.m - r0) {
    case 5: AttnRows512<5>(g, r0); break;
    case 4: AttnRows512<4>(g, r0); break;
    case 3: AttnRows512<3>(g, r0); break;
    case 2: AttnRows512<2>(g, r0); break;
    case 1: AttnRows512<1>(g, r0); break;
    default: break;
  }
}
#endif

// The code level of a work function (cpu_common.h): kLevel is a CpuLevel.
constexpr int kAttnBaseline = static_cast<int>(CpuLevel::kBaseline);
constexpr int kAttnAvx2 = static_cast<int>(CpuLevel::kAvx2);
constexpr int kAttnAvx512 = static_cast<int>(CpuLevel::kAvx512);

template <int kLevel>
TFMETAL_ATTN_INLINE void AttnRunGemm(const AttnGemm& g) {
  if (g.m == 0 || g.n == 0) return;
#ifdef TFMETAL_ATTN_X86
  if (kLevel == kAttnAvx512) return AttnGemmAvx512(g);
  if (kLevel == kAttnAvx2) return AttnGemmAvx2(g);
#endif
  AttnGemmEigen(g);
}

inline AttnGemm AttnMakeGemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                             const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  AttnGemm g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.a_rs = a_rs;
  g.a_cs = a_cs;
  g.b = b;
  g.ldb = ldb;
  g.c = c;
  g.ldc = ldc;
  g.accumulate = accumulate;
  return g;
}

// ---------------------------------------------------------------- tile loads

// rows x cols of `src` (row-major, leading dimension cols) as float into dst.
template <typename T>
TFMETAL_ATTN_INLINE void AttnWiden(const T* __restrict src, int64_t count, float* __restrict dst) {
  for (int64_t e = 0; e < count; ++e) dst[e] = static_cast<float>(src[e]);
}

// rows x cols of `src` (row stride src_rs) as float, with *rs their row stride:
// src itself for float, else widened into scratch (row stride cols).
TFMETAL_ATTN_INLINE const float* AttnRowsAsFloat(const float* src, int64_t, int64_t, int64_t src_rs, float*,
                                                 int64_t* rs) {
  *rs = src_rs;
  return src;
}
template <typename T>
TFMETAL_ATTN_INLINE const float* AttnRowsAsFloat(const T* src, int64_t rows, int64_t cols, int64_t src_rs,
                                                 float* scratch, int64_t* rs) {
  if (src_rs == cols) {
    AttnWiden(src, rows * cols, scratch);
  } else {
    for (int64_t r = 0; r < rows; ++r) AttnWiden(src + r * src_rs, cols, scratch + r * cols);
  }
  *rs = cols;
  return scratch;
}

// dst[c * ld + r] = src[r * src_rs + c] for rows x cols of src, as float.
template <typename T>
TFMETAL_ATTN_INLINE void AttnTranspose(const T* __restrict src, int64_t rows, int64_t cols, int64_t src_rs,
                                       float* __restrict dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = static_cast<float>(src[r * src_rs + c]);
}

// ---------------------------------------------------------------- shapes and the mask

struct AttnShape {
  int64_t b = 0, h = 0, tq = 0, tk = 0, d = 0, dv = 0;
  int64_t hk = 0;      // key/value heads (grouped-query attention: they divide h)
  int64_t groups = 1;  // query heads per key/value head, h / hk
  // Element strides of the mask along b, h, q, k (0 along a broadcast dimension).
  int64_t mask_b = 0, mask_h = 0, mask_q = 0, mask_k = 0;
  bool mask_trivial = false;  // [1, 1, 1, 1] True: no mask
  // TFM_ATTENTION_LAYOUT_* of query, key, value, output and the gradients, and their row strides.
  uint32_t layout = TFM_ATTENTION_LAYOUT_BHSD;
  int64_t q_rs = 0, k_rs = 0, v_rs = 0, o_rs = 0;

  // The offset of row 0 of a head: query (and dQ), output (and dO), key (and dK), value (and dV).
  int64_t QHead(int64_t bi, int64_t hi) const { return Head(bi, hi, h, tq, d); }
  int64_t OHead(int64_t bi, int64_t hi) const { return Head(bi, hi, h, tq, dv); }
  int64_t KHead(int64_t bi, int64_t hki) const { return Head(bi, hki, hk, tk, d); }
  int64_t VHead(int64_t bi, int64_t hki) const { return Head(bi, hki, hk, tk, dv); }

  int64_t Head(int64_t bi, int64_t hi, int64_t heads, int64_t t, int64_t width) const {
    return static_cast<int64_t>(attention_head_offset(layout, static_cast<uint32_t>(bi), static_cast<uint32_t>(hi),
                                                      static_cast<uint32_t>(heads), static_cast<uint32_t>(t),
                                                      static_cast<uint32_t>(width)));
  }
};

// Attention dropout of one op call (tfmetal/attention.h).
struct AttnDropout {
  bool on = false;  // dropout_rate > 0
  dropout_stream stream;
  uint32_t bits = 23;  // mantissa bits of T
  float rate = 0.0f, scale = 1.0f;
};

// Philox blocks one draw computes: the interleaved groups of cpu/philox_lanes.h.
constexpr int kAttnDrawBlocks = kPhiloxLanes * kPhiloxMaxGroups;
static_assert(kBlockQ <= kAttnDrawBlocks, "AttnDropTileByLanes draws a tile's rows at once");

// keep[j] (1 kept, 0 dropped) for the n consecutive mask elements from flat
// index `first`: one Philox block per 4 of them (cpu/philox_lanes.h: each lane
// is tfm_philox4x32 exactly), up to kAttnDrawBlocks blocks in one draw.
TFMETAL_ATTN_INLINE void AttnDropoutKeepRow(const AttnDropout& d, uint64_t first, int64_t n, float* keep) {
  if (n <= 0) return;
  const uint64_t end = first + static_cast<uint64_t>(n);
  for (uint64_t g = first / 4u; g * 4u < end; g += kAttnDrawBlocks) {
    const int blocks = static_cast<int>(std::min<uint64_t>(kAttnDrawBlocks, (end + 3u) / 4u - g));
    const int groups = (blocks + kPhiloxLanes - 1) / kPhiloxLanes;
    uint32_t c0[kAttnDrawBlocks], c1[kAttnDrawBlocks], c2[kAttnDrawBlocks], c3[kAttnDrawBlocks];
    for (int l = 0; l < groups * kPhiloxLanes; ++l) {
      const tfm_philox_block ctr = tfm_philox_skip(d.stream.counter, g + static_cast<uint64_t>(l));
      c0[l] = ctr.w[0];
      c1[l] = ctr.w[1];
      c2[l] = ctr.w[2];
      c3[l] = ctr.w[3];
    }
    PhiloxLanes(c0, c1, c2, c3, d.stream.key[0], d.stream.key[1], groups);
    // Lanes [whole_lo, whole_hi) have all 4 words in [first, end): no bounds test per word, so
    // their loop vectorizes. Only a row's first and last lanes can be partial.
    const uint64_t base = g * 4u;
    const int whole_lo = first > base ? static_cast<int>((first - base + 3u) / 4u) : 0;
    const int whole_hi = std::max(whole_lo, std::min(blocks, static_cast<int>((end - base) / 4u)));
    float* out = keep + (base + 4u * static_cast<uint64_t>(whole_lo) - first);
    for (int l = whole_lo; l < whole_hi; ++l) {
      const int at = 4 * (l - whole_lo);
      out[at + 0] = attention_dropout_keeps(c0[l], d.bits, d.rate) ? 1.0f : 0.0f;
      out[at + 1] = attention_dropout_keeps(c1[l], d.bits, d.rate) ? 1.0f : 0.0f;
      out[at + 2] = attention_dropout_keeps(c2[l], d.bits, d.rate) ? 1.0f : 0.0f;
      out[at + 3] = attention_dropout_keeps(c3[l], d.bits, d.rate) ? 1.0f : 0.0f;
    }
    const auto partial_lane = [&](int l) {
      const uint32_t words[4] = {c0[l], c1[l], c2[l], c3[l]};
      for (uint32_t w = 0; w < 4u; ++w) {
        const uint64_t at = base + 4u * static_cast<uint64_t>(l) + w;
        if (at >= first && at < end) {
          keep[at - first] = attention_dropout_keeps(words[w], d.bits, d.rate) ? 1.0f : 0.0f;
        }
      }
    };
    for (int l = 0; l < whole_lo; ++l) partial_lane(l);
    for (int l = whole_hi; l < blocks; ++l) partial_lane(l);
  }
}

Status AttnCheckRank4(const Tensor& t, const char* name) {
  if (t.dims() != 4) {
    return errors::InvalidArgument(name, " must have rank 4, got shape ", t.shape().DebugString());
  }
  return Status();
}

// The [B, heads, T, width] shape `layout` stores ("BSHD": [B, T, heads, width]).
TensorShape AttnInLayout(uint32_t layout, int64_t b, int64_t heads, int64_t t, int64_t width) {
  return layout == TFM_ATTENTION_LAYOUT_BSHD ? TensorShape({b, t, heads, width}) : TensorShape({b, heads, t, width});
}

Status AttnCheckInputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, uint32_t layout,
                       AttnShape* s) {
  TF_RETURN_IF_ERROR(AttnCheckRank4(q, "query"));
  TF_RETURN_IF_ERROR(AttnCheckRank4(k, "key"));
  TF_RETURN_IF_ERROR(AttnCheckRank4(v, "value"));
  TF_RETURN_IF_ERROR(AttnCheckRank4(mask, "mask"));
  const int ha = attention_heads_axis(layout), sa = 3 - ha;  // the heads and sequence axes
  s->layout = layout;
  s->b = q.dim_size(0);
  s->h = q.dim_size(ha);
  s->tq = q.dim_size(sa);
  s->d = q.dim_size(3);
  s->hk = k.dim_size(ha);
  s->tk = k.dim_size(sa);
  s->dv = v.dim_size(3);
  if (k.dim_size(0) != s->b || k.dim_size(3) != s->d) {
    return errors::InvalidArgument("key must have the batch and head dim of query, got shapes ",
                                   q.shape().DebugString(), " and ", k.shape().DebugString());
  }
  const std::string heads_error = AttentionKvHeadsError(s->h, s->hk);  // tfmetal/host_checks.h
  if (!heads_error.empty()) {
    return errors::InvalidArgument(heads_error, ", got shapes ", q.shape().DebugString(), " and ",
                                   k.shape().DebugString());
  }
  s->groups = s->hk == 0 ? 1 : s->h / s->hk;
  if (v.dim_size(0) != s->b || v.dim_size(ha) != s->hk || v.dim_size(sa) != s->tk) {
    return errors::InvalidArgument("value must have the batch of query and the heads and sequence length of key, ",
                                   "got shapes ", q.shape().DebugString(), ", ", k.shape().DebugString(), " and ",
                                   v.shape().DebugString());
  }
  if (s->d < 1 || s->d > TFM_ATTENTION_MAX_HEAD_DIM || s->dv < 1 || s->dv > TFM_ATTENTION_MAX_HEAD_DIM) {
    return errors::InvalidArgument("the head dims of query and value must be in [1, ", TFM_ATTENTION_MAX_HEAD_DIM,
                                   "], got shapes ", q.shape().DebugString(), " and ", v.shape().DebugString());
  }
  if (s->tq > kMaxDimension || s->tk > kMaxDimension) {  // tfmetal/host_checks.h
    return errors::InvalidArgument("sequence lengths must be < 2^31, got shapes ", q.shape().DebugString(), " and ",
                                   k.shape().DebugString());
  }
  const int64_t full[4] = {s->b, s->h, s->tq, s->tk};
  int64_t stride[4];
  int64_t step = 1;
  for (int axis = 3; axis >= 0; --axis) {
    const int64_t got = mask.dim_size(axis);
    if (got != 1 && got != full[axis]) {
      return errors::InvalidArgument("mask must broadcast to [batch, heads, q_seq, kv_seq] = [", s->b, ", ", s->h,
                                     ", ", s->tq, ", ", s->tk, "] with each dimension 1 or the full size, got shape ",
                                     mask.shape().DebugString());
    }
    stride[axis] = got == 1 ? 0 : step;
    step *= got;
  }
  s->mask_b = stride[0];
  s->mask_h = stride[1];
  s->mask_q = stride[2];
  s->mask_k = stride[3];
  s->mask_trivial = mask.NumElements() == 1 && mask.flat<bool>()(0);
  const auto row_stride = [layout](int64_t heads, int64_t width) {
    return static_cast<int64_t>(attention_row_stride(layout, static_cast<uint32_t>(heads), static_cast<uint32_t>(width)));
  };
  s->q_rs = row_stride(s->h, s->d);
  s->o_rs = row_stride(s->h, s->dv);
  s->k_rs = row_stride(s->hk, s->d);
  s->v_rs = row_stride(s->hk, s->dv);
  return Status();
}

// The positions [lo, hi) of `n` consecutive keys (first: key `k0`, for the
// query at `qi`) or queries (first: query `q0`, for the key at `kj`) that the
// causal mask and the sliding window let attend: attention_attends without its
// mask value, as a range (both conditions bound a contiguous run).
struct AttnRange {
  int32_t lo, hi;
};

inline AttnRange AttnClampRange(int64_t lo, int64_t hi, int64_t n) {
  lo = std::min<int64_t>(std::max<int64_t>(lo, 0), n);
  hi = std::min<int64_t>(std::max<int64_t>(hi, lo), n);
  return AttnRange{static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// Keys k0 + j for query qi: j <= qi - k0 (causal), qi - w < k0 + j < qi + w (window w).
inline AttnRange AttnKeyRange(bool causal, uint32_t window, int64_t qi, int64_t k0, int64_t n) {
  int64_t lo = 0, hi = n;
  if (causal) hi = std::min<int64_t>(hi, qi - k0 + 1);
  if (window != 0u) {
    lo = std::max<int64_t>(lo, qi - k0 - static_cast<int64_t>(window) + 1);
    hi = std::min<int64_t>(hi, qi - k0 + static_cast<int64_t>(window));
  }
  return AttnClampRange(lo, hi, n);
}

// Queries q0 + i for key kj: q0 + i >= kj (causal), kj - w < q0 + i < kj + w (window w).
inline AttnRange AttnQueryRange(bool causal, uint32_t window, int64_t q0, int64_t kj, int64_t n) {
  int64_t lo = 0, hi = n;
  if (causal) lo = std::max<int64_t>(lo, kj - q0);
  if (window != 0u) {
    lo = std::max<int64_t>(lo, kj - q0 - static_cast<int64_t>(window) + 1);
    hi = std::min<int64_t>(hi, kj - q0 + static_cast<int64_t>(window));
  }
  return AttnClampRange(lo, hi, n);
}

// s[e] * scale where position e is in r and its mask byte (mask[e * stride]) is
// set, else -inf. stride is 0 (one mask value for all) or 1 (one byte each):
// branch-free loops the compiler vectorizes; any other stride, a plain loop.
TFMETAL_ATTN_INLINE void AttnScaleAndMaskRun(float* __restrict s, int64_t n, float scale, const bool* mask,
                                             int64_t stride, AttnRange r) {
  const uint32_t neg_inf = AttnFloatBits(kNegInf);
  const int32_t count = static_cast<int32_t>(n);
  if (stride == 0 || stride == 1) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(mask);
    const uint32_t all = stride == 0 ? 0u - static_cast<uint32_t>(bytes[0] != 0) : 0u;
    if (stride == 0 && all == 0u) {
      for (int32_t e = 0; e < count; ++e) s[e] = kNegInf;
      return;
    }
    for (int32_t e = 0; e < count; ++e) {
      const uint32_t in_range = 0u - static_cast<uint32_t>((e >= r.lo) & (e < r.hi));
      const uint32_t set = stride == 0 ? all : 0u - static_cast<uint32_t>(bytes[e] != 0);
      const uint32_t keep = in_range & set;
      s[e] = AttnBitsFloat((AttnFloatBits(s[e] * scale) & keep) | (neg_inf & ~keep));
    }
    return;
  }
  for (int32_t e = 0; e < count; ++e) {
    const bool ok = e >= r.lo && e < r.hi && mask[e * stride];
    const uint32_t keep = 0u - static_cast<uint32_t>(ok);
    s[e] = AttnBitsFloat((AttnFloatBits(s[e] * scale) & keep) | (neg_inf & ~keep));
  }
}

// Whether every mask byte of a tile (qn queries, kn keys; `mask` at its first
// query and key, strides 0 along a broadcast dimension) is set. Such a tile
// needs no mask test: a padding mask's tiles short of the padding. A row
// broadcast along the queries (mask_q == 0) is read once.
TFMETAL_ATTN_INLINE bool AttnMaskTileAllSet(const bool* mask, int64_t mask_q, int64_t mask_k, int64_t qn,
                                            int64_t kn) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(mask);
  const int64_t rows = mask_q == 0 ? 1 : qn, cols = mask_k == 0 ? 1 : kn;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = bytes + r * mask_q;
    uint8_t least = 1;
    if (mask_k <= 1) {
      for (int64_t c = 0; c < cols; ++c) least = std::min<uint8_t>(least, row[c]);  // vectorizes (bytes: 0 or 1)
    } else {
      for (int64_t c = 0; c < cols; ++c) least = std::min<uint8_t>(least, row[c * mask_k]);
    }
    if (least == 0) return false;
  }
  return true;
}

// Scales row i of the tile (scores of query q0 + i, keys k0 ..) and sets the
// scores it does not attend to -inf.
TFMETAL_ATTN_INLINE void AttnScaleAndMaskRow(float* __restrict s, int64_t kn, float scale, const bool* mask_row,
                                             int64_t mask_k, bool causal, uint32_t window, int64_t qi, int64_t k0,
                                             bool masked) {
  if (!masked) {
    AttnScaleRow(s, kn, scale);
    return;
  }
  AttnScaleAndMaskRun(s, kn, scale, mask_row + k0 * mask_k, mask_k, AttnKeyRange(causal, window, qi, k0, kn));
}

// Scales the scores of key kj for the queries q0 .. q0 + n - 1 (a key row of
// the transposed tile) and sets those not attended to -inf; mask_col is the
// mask at (q0, kj), mask_q its stride along the queries.
TFMETAL_ATTN_INLINE void AttnScaleAndMaskColumn(float* __restrict s, int64_t n, float scale, const bool* mask_col,
                                                int64_t mask_q, bool causal, uint32_t window, int64_t q0, int64_t kj,
                                                bool masked) {
  if (!masked) {
    AttnScaleRow(s, n, scale);
    return;
  }
  AttnScaleAndMaskRun(s, n, scale, mask_col, mask_q, AttnQueryRange(causal, window, q0, kj, n));
}

// st[j * kBlockQ + i] (the transposed tile) dropped by keep[i * kBlockK + j]
// (the mask's rows), in 16 x 16 blocks: the blocks' rows of both stay in L1
// (a whole column of either, one row per 256 or 512 bytes, falls on a few
// cache sets only).
TFMETAL_ATTN_INLINE void AttnDropTransposed(float* __restrict st, const float* __restrict keep, int64_t qn,
                                            int64_t kn, float drop_scale) {
  constexpr int64_t kB = 16;
  for (int64_t j0 = 0; j0 < kn; j0 += kB) {
    const int64_t j1 = std::min(kn, j0 + kB);
    for (int64_t i0 = 0; i0 < qn; i0 += kB) {
      const int64_t i1 = std::min(qn, i0 + kB);
      for (int64_t j = j0; j < j1; ++j) {
        float* row = st + j * kBlockQ;
        for (int64_t i = i0; i < i1; ++i) {
          // attention_dropout_apply, on bits (no branch: a tenth of the keys drop at random): the kept
          // product, or +0 (keep is 1.0f or +0.0f).
          const uint32_t kept = 0u - static_cast<uint32_t>(AttnFloatBits(keep[i * kBlockK + j]) != 0u);
          row[i] = AttnBitsFloat(AttnFloatBits(row[i] * drop_scale) & kept);
        }
      }
    }
  }
}

// The forward's dropout of the transposed tile st[j * kBlockQ + i] with the
// mask drawn in that layout: the Philox lanes are the tile's query rows, so
// word w of lane l's block holds the mask element of one key of row i0 + l,
// and a key's rows are one contiguous run of st (the loop vectorizes; no
// transposed reads). Row i's elements start at flat index
// first + i * row_stride; the rows must start at the same word of a Philox
// block (row_stride % 4 == 0, i.e. tk % 4 == 0). The same mask and the same
// select as AttnDropoutKeepRow + AttnDropTransposed, so the same bits.
TFMETAL_ATTN_INLINE void AttnDropTileByLanes(const AttnDropout& d, uint64_t first, uint64_t row_stride,
                                             int64_t qn, int64_t kn, float* __restrict st) {
  const int64_t offset = static_cast<int64_t>(first % 4u);  // key 0's word in its block (every row's)
  for (int64_t i0 = 0; i0 < qn; i0 += kAttnDrawBlocks) {
    const int64_t ln = std::min<int64_t>(kAttnDrawBlocks, qn - i0);
    const int groups = static_cast<int>((ln + kPhiloxLanes - 1) / kPhiloxLanes);
    for (int64_t t = 0; 4 * t - offset < kn; ++t) {
      uint32_t c[4][kAttnDrawBlocks];
      for (int l = 0; l < groups * kPhiloxLanes; ++l) {
        // Lanes past the tile's last row draw that row's block again; they are not stored.
        const uint64_t row = static_cast<uint64_t>(i0 + std::min<int64_t>(l, ln - 1));
        const tfm_philox_block ctr =
            tfm_philox_skip(d.stream.counter, (first + row * row_stride) / 4u + static_cast<uint64_t>(t));
        for (int w = 0; w < 4; ++w) c[w][l] = ctr.w[w];
      }
      PhiloxLanes(c[0], c[1], c[2], c[3], d.stream.key[0], d.stream.key[1], groups);
      for (int w = 0; w < 4; ++w) {
        const int64_t j = 4 * t + w - offset;
        if (j < 0 || j >= kn) continue;
        float* row = st + j * kBlockQ + i0;
        const uint32_t* words = c[w];
        // attention_dropout_apply on bits (no branch: the keys drop at random): the kept product, or +0.
        for (int64_t l = 0; l < ln; ++l) {
          const uint32_t kept = 0u - static_cast<uint32_t>(attention_dropout_keeps(words[l], d.bits, d.rate));
          row[l] = AttnBitsFloat(AttnFloatBits(row[l] * d.scale) & kept);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- forward

template <typename T>
struct AttnForwardArgs {
  const T* q;
  const T* k;
  const T* v;
  const bool* mask;
  T* out;
  float* lse;
  AttnShape s;
  bool causal;
  uint32_t window;  // sliding window, 0: none
  float scale;
  int64_t q_tiles;
  AttnDropout drop;
};

template <typename T>
inline int64_t AttnForwardScratch(const AttnShape& s) {
  // qt [D x BQ], st [BK x BQ], o [BQ x Dv], six vectors [BQ], keep [BQ x BK]; widened k [BK x D], v [BK x Dv].
  return s.d * kBlockQ + kBlockK * kBlockQ + kBlockQ * s.dv + 6 * kBlockQ + kBlockQ * kBlockK +
         (std::is_same<T, float>::value ? 0 : kBlockK * s.d + kBlockK * s.dv);
}

// The scores are kept transposed, st[j * kBlockQ + i] for key j and query i:
// S^T = K Q^T needs the query tile transposed once (not each key tile), and
// the softmax loops over a key row run along the queries (vectorized).
template <typename T, int kLevel>
TFMETAL_ATTN_INLINE void AttnForwardItemsImpl(const AttnForwardArgs<T>& a, int64_t begin, int64_t end,
                                              float* scratch) {
  const AttnShape& s = a.s;
  float* qt = scratch;
  float* st = qt + s.d * kBlockQ;
  float* o = st + kBlockK * kBlockQ;
  float* m = o + kBlockQ * s.dv;      // running max per query row
  float* l = m + kBlockQ;             // running sum
  float* tile_max = l + kBlockQ;
  float* rescale = tile_max + kBlockQ;
  float* shift = rescale + kBlockQ;   // the max exp(s - shift) uses (0 while nothing is attended)
  float* tile_sum = shift + kBlockQ;
  float* keep = tile_sum + kBlockQ;  // the tile's dropout mask, a row of kBlockK per query
  float* kbuf = keep + kBlockQ * kBlockK;
  float* vbuf = kbuf + kBlockK * s.d;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bh = item / a.q_tiles;
    const int64_t q0 = (item % a.q_tiles) * kBlockQ;
    const int64_t qn = std::min(kBlockQ, s.tq - q0);
    const int64_t bi = bh / s.h, hi = bh % s.h;
    AttnTranspose(a.q + s.QHead(bi, hi) + q0 * s.q_rs, qn, s.d, s.q_rs, qt, kBlockQ);
    const T* kh = a.k + s.KHead(bi, hi / s.groups);  // the key/value head this query head reads
    const T* vh = a.v + s.VHead(bi, hi / s.groups);
    const bool* mask_q = a.mask + bi * s.mask_b + hi * s.mask_h + q0 * s.mask_q;
    std::fill(o, o + qn * s.dv, 0.0f);
    std::fill(m, m + qn, kNegInf);
    std::fill(l, l + qn, 0.0f);
    const int64_t key_end = attention_key_end(a.causal, a.window, static_cast<uint32_t>(q0),
                                              static_cast<uint32_t>(qn), static_cast<uint32_t>(s.tk));
    const int64_t key_begin = std::min<int64_t>(key_end, attention_key_begin(a.window, static_cast<uint32_t>(q0)));
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlockK) {
      const int64_t kn = std::min(kBlockK, key_end - k0);
      int64_t kf_rs = 0;
      const float* kf = AttnRowsAsFloat(kh + k0 * s.k_rs, kn, s.d, s.k_rs, kbuf, &kf_rs);
      AttnRunGemm<kLevel>(AttnMakeGemm(kn, qn, s.d, kf, kf_rs, 1, qt, kBlockQ, st, kBlockQ, false));
      const bool masked = !attention_tile_unmasked(a.causal, a.window, static_cast<uint32_t>(q0),
                                                   static_cast<uint32_t>(qn), static_cast<uint32_t>(k0),
                                                   static_cast<uint32_t>(kn)) ||
                          (!s.mask_trivial && !AttnMaskTileAllSet(mask_q + k0 * s.mask_k, s.mask_q, s.mask_k, qn, kn));
      std::fill(tile_max, tile_max + qn, kNegInf);
      for (int64_t j = 0; j < kn; ++j) {
        float* row = st + j * kBlockQ;
        AttnScaleAndMaskColumn(row, qn, a.scale, mask_q + (k0 + j) * s.mask_k, s.mask_q, a.causal, a.window, q0,
                               k0 + j, masked);
        for (int64_t i = 0; i < qn; ++i) tile_max[i] = std::max(tile_max[i], row[i]);
      }
      for (int64_t i = 0; i < qn; ++i) {
        const float new_max = attention_new_max(m[i], tile_max[i]);
        rescale[i] = attention_rescale(m[i], new_max);
        shift[i] = new_max == kNegInf ? 0.0f : new_max;  // every score is -inf: exp gives 0
        m[i] = new_max;
      }
      std::fill(tile_sum, tile_sum + qn, 0.0f);
      for (int64_t j = 0; j < kn; ++j) {
        float* row = st + j * kBlockQ;
        for (int64_t i = 0; i < qn; ++i) {
          const float e = AttnExp(row[i] - shift[i]);
          row[i] = e;
          tile_sum[i] += e;
        }
      }
      for (int64_t i = 0; i < qn; ++i) {
        l[i] = l[i] * rescale[i] + tile_sum[i];
        if (rescale[i] != 1.0f) AttnScaleRow(o + i * s.dv, s.dv, rescale[i]);
      }
      if (a.drop.on && s.tk % 4 == 0) {  // drop the summed probabilities (row i is column i of st)
        AttnDropTileByLanes(a.drop, static_cast<uint64_t>((bh * s.tq + q0) * s.tk + k0), static_cast<uint64_t>(s.tk),
                            qn, kn, st);
      } else if (a.drop.on) {  // rows that start at different words of a Philox block: drawn row by row
        for (int64_t i = 0; i < qn; ++i) {
          AttnDropoutKeepRow(a.drop, static_cast<uint64_t>((bh * s.tq + q0 + i) * s.tk + k0), kn,
                             keep + i * kBlockK);
        }
        AttnDropTransposed(st, keep, qn, kn, a.drop.scale);
      }
      // O += P V, P = (S^T)^T.
      int64_t vf_rs = 0;
      const float* vf = AttnRowsAsFloat(vh + k0 * s.v_rs, kn, s.dv, s.v_rs, vbuf, &vf_rs);
      AttnRunGemm<kLevel>(AttnMakeGemm(qn, s.dv, kn, st, 1, kBlockQ, vf, vf_rs, o, s.dv, true));
    }
    T* out = a.out + s.OHead(bi, hi) + q0 * s.o_rs;
    float* lse = a.lse + bh * s.tq + q0;
    for (int64_t i = 0; i < qn; ++i) {
      const float inv = attention_inv_sum(l[i]);
      for (int64_t c = 0; c < s.dv; ++c) out[i * s.o_rs + c] = static_cast<T>(o[i * s.dv + c] * inv);
      lse[i] = attention_lse(m[i], l[i]);
    }
  }
}

// ---------------------------------------------------------------- backward

template <typename T>
struct AttnBackwardArgs {
  const T* d_out;
  const T* q;
  const T* k;
  const T* v;
  const bool* mask;
  const T* out;
  const float* lse;
  T* dq;
  T* dk;
  T* dv;
  // Split mode (not null): one item per query head, whose dK and dV go to its own float slice of
  // these [B, H, Tk, D] / [B, H, Tk, Dv] partials, summed per key/value head afterwards.
  float* dk_part = nullptr;
  float* dv_part = nullptr;
  AttnShape s;
  bool causal;
  uint32_t window;  // sliding window, 0: none
  float scale;
  AttnDropout drop;
};

template <typename T>
inline int64_t AttnBackwardScratch(const AttnShape& s) {
  // dq [Tq x D], dr [Tq], kt [D x BK], vt [Dv x BK], dk [Tk x D], dv [Tk x Dv] (summed over
  // the query heads of a key/value head), s and dp [BQ x BK], keep [BK]; widened k [BK x D],
  // q [BQ x D], dO [BQ x Dv].
  return s.tq * s.d + s.tq + s.d * kBlockK + s.dv * kBlockK + s.tk * s.d + s.tk * s.dv +
         2 * kBlockQ * kBlockK + kBlockK + (std::is_same<T, float>::value ? 0 : kBlockK * s.d + kBlockQ * s.d + kBlockQ * s.dv);
}

// rows x cols of float `src` (row stride cols) into dst (row stride dst_rs), as T.
template <typename T>
TFMETAL_ATTN_INLINE void AttnStoreRows(const float* __restrict src, int64_t rows, int64_t cols, T* __restrict dst,
                                       int64_t dst_rs) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * dst_rs + c] = static_cast<T>(src[r * cols + c]);
}

template <typename T, int kLevel>
TFMETAL_ATTN_INLINE void AttnBackwardItemsImpl(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end,
                                               float* scratch) {
  const AttnShape& s = a.s;
  float* dq = scratch;
  float* dr = dq + s.tq * s.d;
  float* kt = dr + s.tq;
  float* vt = kt + s.d * kBlockK;
  float* dk_head = vt + s.dv * kBlockK;  // the key/value head's dK, dV: every key, summed over its query heads
  float* dv_head = dk_head + s.tk * s.d;
  float* st = dv_head + s.tk * s.dv;
  float* dp = st + kBlockQ * kBlockK;
  float* keep = dp + kBlockQ * kBlockK;  // one row's dropout mask
  float* kbuf = keep + kBlockK;
  float* qbuf = kbuf + kBlockK * s.d;
  float* dobuf = qbuf + kBlockQ * s.d;
  // One item per key/value head: its query heads in turn, so dK and dV have one writer. In split
  // mode one item per query head, writing its own partial.
  const bool split = a.dk_part != nullptr;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bi = item / (split ? s.h : s.hk);
    const int64_t hki = split ? (item % s.h) / s.groups : item % s.hk;
    const int64_t g_begin = split ? (item % s.h) % s.groups : 0;
    const int64_t g_end = split ? g_begin + 1 : s.groups;
    const T* kh = a.k + s.KHead(bi, hki);
    const T* vh = a.v + s.VHead(bi, hki);
    float* dk_acc = split ? a.dk_part + item * s.tk * s.d : dk_head;
    float* dv_acc = split ? a.dv_part + item * s.tk * s.dv : dv_head;
    std::fill(dk_acc, dk_acc + s.tk * s.d, 0.0f);
    std::fill(dv_acc, dv_acc + s.tk * s.dv, 0.0f);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t hi = hki * s.groups + g;
      const int64_t bh = bi * s.h + hi;
      const T* qh = a.q + s.QHead(bi, hi);
      const T* doh = a.d_out + s.OHead(bi, hi);
      const T* oh = a.out + s.OHead(bi, hi);
      const float* lse = a.lse + bh * s.tq;
      const bool* mask_bh = a.mask + bi * s.mask_b + hi * s.mask_h;
      std::fill(dq, dq + s.tq * s.d, 0.0f);
      for (int64_t i = 0; i < s.tq; ++i) {
        float acc = 0.0f;
        const T* do_row = doh + i * s.o_rs;
        const T* o_row = oh + i * s.o_rs;
        for (int64_t c = 0; c < s.dv; ++c) acc += static_cast<float>(do_row[c]) * static_cast<float>(o_row[c]);
        dr[i] = acc;
      }
      for (int64_t k0 = 0; k0 < s.tk; k0 += kBlockK) {
        const int64_t kn = std::min(kBlockK, s.tk - k0);
        const int64_t q_begin =
            (attention_query_begin(a.causal, a.window, static_cast<uint32_t>(k0)) / kBlockQ) * kBlockQ;
        const int64_t q_end = attention_query_end(a.window, static_cast<uint32_t>(k0), static_cast<uint32_t>(kn),
                                                  static_cast<uint32_t>(s.tq));
        if (q_begin >= q_end) continue;  // no query row attends these keys: their dK, dV stay 0
        int64_t kf_rs = 0;
        const float* kf = AttnRowsAsFloat(kh + k0 * s.k_rs, kn, s.d, s.k_rs, kbuf, &kf_rs);
        AttnTranspose(kf, kn, s.d, kf_rs, kt, kBlockK);
        AttnTranspose(vh + k0 * s.v_rs, kn, s.dv, s.v_rs, vt, kBlockK);
        float* dk = dk_acc + k0 * s.d;
        float* dv = dv_acc + k0 * s.dv;
        for (int64_t q0 = q_begin; q0 < q_end; q0 += kBlockQ) {
          const int64_t qn = std::min(kBlockQ, s.tq - q0);
          int64_t qf_rs = 0, dof_rs = 0;
          const float* qf = AttnRowsAsFloat(qh + q0 * s.q_rs, qn, s.d, s.q_rs, qbuf, &qf_rs);
          const float* dof = AttnRowsAsFloat(doh + q0 * s.o_rs, qn, s.dv, s.o_rs, dobuf, &dof_rs);
          AttnRunGemm<kLevel>(AttnMakeGemm(qn, kn, s.d, qf, qf_rs, 1, kt, kBlockK, st, kBlockK, false));
          AttnRunGemm<kLevel>(AttnMakeGemm(qn, kn, s.dv, dof, dof_rs, 1, vt, kBlockK, dp, kBlockK, false));
          const bool masked =
              !attention_tile_unmasked(a.causal, a.window, static_cast<uint32_t>(q0), static_cast<uint32_t>(qn),
                                       static_cast<uint32_t>(k0), static_cast<uint32_t>(kn)) ||
              (!s.mask_trivial &&
               !AttnMaskTileAllSet(mask_bh + q0 * s.mask_q + k0 * s.mask_k, s.mask_q, s.mask_k, qn, kn));
          for (int64_t i = 0; i < qn; ++i) {
            float* srow = st + i * kBlockK;
            float* dprow = dp + i * kBlockK;
            const float row_lse = lse[q0 + i];
            if (row_lse == kNegInf) {  // attends no key: p = 0, ds = 0
              std::fill(srow, srow + kn, 0.0f);
              std::fill(dprow, dprow + kn, 0.0f);
              continue;
            }
            AttnScaleAndMaskRow(srow, kn, a.scale, mask_bh + (q0 + i) * s.mask_q, s.mask_k, a.causal, a.window,
                                q0 + i, k0, masked);
            const float row_dr = dr[q0 + i];
            if (a.drop.on) {  // dV takes the dropped p; ds the dropped dp (the same mask, drawn again)
              AttnDropoutKeepRow(a.drop, static_cast<uint64_t>((bh * s.tq + q0 + i) * s.tk + k0), kn, keep);
              for (int64_t j = 0; j < kn; ++j) {
                const float p = AttnExp(srow[j] - row_lse);
                const bool kept = keep[j] != 0.0f;
                srow[j] = attention_dropout_apply(p, kept, a.drop.scale);
                dprow[j] = a.scale * attention_ds(p, attention_dropout_apply(dprow[j], kept, a.drop.scale), row_dr);
              }
              continue;
            }
            for (int64_t j = 0; j < kn; ++j) {
              const float p = AttnExp(srow[j] - row_lse);  // exact 0 for a masked score (-inf)
              srow[j] = p;
              dprow[j] = a.scale * attention_ds(p, dprow[j], row_dr);
            }
          }
          // dV += P^T dO, dK += dS^T Q (scale folded into dS), dQ += dS K.
          AttnRunGemm<kLevel>(AttnMakeGemm(kn, s.dv, qn, st, 1, kBlockK, dof, dof_rs, dv, s.dv, true));
          AttnRunGemm<kLevel>(AttnMakeGemm(kn, s.d, qn, dp, 1, kBlockK, qf, qf_rs, dk, s.d, true));
          AttnRunGemm<kLevel>(AttnMakeGemm(qn, s.d, kn, dp, kBlockK, 1, kf, kf_rs, dq + q0 * s.d, s.d, true));
        }
      }
      AttnStoreRows(dq, s.tq, s.d, a.dq + s.QHead(bi, hi), s.q_rs);
    }
    if (split) continue;
    AttnStoreRows(dk_head, s.tk, s.d, a.dk + s.KHead(bi, hki), s.k_rs);
    AttnStoreRows(dv_head, s.tk, s.dv, a.dv + s.VHead(bi, hki), s.v_rs);
  }
}

// Split mode's second pass: key rows [begin, end) of [B, Hk, Tk] get the sum of their query heads'
// partials (in query-head order) in T.
template <typename T>
void AttnSumPartials(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end) {
  const AttnShape& s = a.s;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t kv = row / s.tk, j = row % s.tk;
    const int64_t bi = kv / s.hk, hki = kv % s.hk;
    const int64_t first = bi * s.h + hki * s.groups;  // the group's first query head
    const auto sum_into = [&](const float* part, T* out, int64_t width) {  // out: key j's row
      for (int64_t c = 0; c < width; ++c) {
        float sum = 0.0f;
        for (int64_t g = 0; g < s.groups; ++g) sum += part[((first + g) * s.tk + j) * width + c];
        out[c] = static_cast<T>(sum);
      }
    };
    sum_into(a.dk_part, a.dk + s.KHead(bi, hki) + j * s.k_rs, s.d);
    sum_into(a.dv_part, a.dv + s.VHead(bi, hki) + j * s.v_rs, s.dv);
  }
}

// ---------------------------------------------------------------- per-ISA entry points

template <typename T>
void AttnForwardItemsBaseline(const AttnForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  AttnForwardItemsImpl<T, kAttnBaseline>(a, begin, end, scratch);
}
template <typename T>
void AttnBackwardItemsBaseline(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
  AttnBackwardItemsImpl<T, kAttnBaseline>(a, begin, end, scratch);
}

#ifdef TFMETAL_ATTN_X86
template <typename T>
TFMETAL_ATTN_AVX2 void AttnForwardItemsAvx2(const AttnForwardArgs<T>& a, int64_t begin, int64_t end,
                                            float* scratch) {
  AttnForwardItemsImpl<T, kAttnAvx2>(a, begin, end, scratch);
}
template <typename T>
TFMETAL_ATTN_AVX512 void AttnForwardItemsAvx512(const AttnForwardArgs<T>& a, int64_t begin, int64_t end,
                                                float* scratch) {
  AttnForwardItemsImpl<T, kAttnAvx512>(a, begin, end, scratch);
}
template <typename T>
TFMETAL_ATTN_AVX2 void AttnBackwardItemsAvx2(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end,
                                             float* scratch) {
  AttnBackwardItemsImpl<T, kAttnAvx2>(a, begin, end, scratch);
}
template <typename T>
TFMETAL_ATTN_AVX512 void AttnBackwardItemsAvx512(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end,
                                                 float* scratch) {
  AttnBackwardItemsImpl<T, kAttnAvx512>(a, begin, end, scratch);
}
#endif

template <typename T>
void AttnForwardItems(const AttnForwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
#ifdef TFMETAL_ATTN_X86
  if (CpuUseAvx512()) return AttnForwardItemsAvx512(a, begin, end, scratch);
  if (CpuUseAvx2()) return AttnForwardItemsAvx2(a, begin, end, scratch);
#endif
  AttnForwardItemsBaseline(a, begin, end, scratch);
}

template <typename T>
void AttnBackwardItems(const AttnBackwardArgs<T>& a, int64_t begin, int64_t end, float* scratch) {
#ifdef TFMETAL_ATTN_X86
  if (CpuUseAvx512()) return AttnBackwardItemsAvx512(a, begin, end, scratch);
  if (CpuUseAvx2()) return AttnBackwardItemsAvx2(a, begin, end, scratch);
#endif
  AttnBackwardItemsBaseline(a, begin, end, scratch);
}

// ---------------------------------------------------------------- op kernels

class AttnAttrs {
 public:
  explicit AttnAttrs(OpKernelConstruction* ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("causal", &causal_));
    int64_t window = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sliding_window", &window));
    const std::string window_error = AttentionWindowError(window);  // tfmetal/host_checks.h
    OP_REQUIRES(ctx, window_error.empty(), errors::InvalidArgument(window_error));
    window_ = static_cast<uint32_t>(window);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES(ctx, std::isfinite(scale_) && scale_ > 0.0f,
                errors::InvalidArgument("scale must be finite and > 0, got ", scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dropout_rate", &dropout_rate_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dropout_scale", &dropout_scale_));
    const std::string error = AttentionDropoutAttrsError(dropout_rate_, dropout_scale_);  // tfmetal/host_checks.h
    OP_REQUIRES(ctx, error.empty(), errors::InvalidArgument(error));
    std::string layout;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layout", &layout));
    const std::string layout_error = AttentionLayoutFromString(layout, &layout_);  // tfmetal/host_checks.h
    OP_REQUIRES(ctx, layout_error.empty(), errors::InvalidArgument(layout_error));
  }

  // The dropout of a call from its seed list (input `seed`: 0 or 1 tensors).
  template <typename T>
  Status Dropout(OpKernelContext* ctx, AttnDropout* d) const {
    ::tensorflow::OpInputList seeds;
    TF_RETURN_IF_ERROR(ctx->input_list("seed", &seeds));
    const std::string error = AttentionSeedCountError(seeds.size(), dropout_rate_);
    if (!error.empty()) return errors::InvalidArgument(error);
    int64_t s0 = 0, s1 = 0;
    if (seeds.size() == 1) TF_RETURN_IF_ERROR(ReadSeed(seeds[0], &s0, &s1));
    d->on = dropout_rate_ > 0.0f;
    if (!d->on) return Status();
    d->stream = dropout_stream_from_seed(s0, s1);
    d->bits = MantissaBits<T>();
    d->rate = dropout_rate_;
    d->scale = dropout_scale_;
    return Status();
  }

  bool causal_ = false;
  uint32_t window_ = 0;
  float scale_ = 1.0f;
  float dropout_rate_ = 0.0f;
  float dropout_scale_ = 1.0f;
  uint32_t layout_ = TFM_ATTENTION_LAYOUT_BHSD;
};

template <typename T>
class AttentionOp : public OpKernel {
 public:
  explicit AttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& q = ctx->input(0);
    const Tensor& k = ctx->input(1);
    const Tensor& v = ctx->input(2);
    const Tensor& mask = ctx->input(3);
    AttnShape s;
    OP_REQUIRES_OK(ctx, AttnCheckInputs(q, k, v, mask, attrs_.layout_, &s));
    AttnDropout drop;
    OP_REQUIRES_OK(ctx, attrs_.Dropout<T>(ctx, &drop));
    Tensor *out = nullptr, *lse = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, AttnInLayout(s.layout, s.b, s.h, s.tq, s.dv), &out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({s.b, s.h, s.tq}), &lse));
    AttnForwardArgs<T> a;
    a.q = q.flat<T>().data();
    a.k = k.flat<T>().data();
    a.v = v.flat<T>().data();
    a.mask = mask.flat<bool>().data();
    a.out = out->flat<T>().data();
    a.lse = lse->flat<float>().data();
    a.s = s;
    a.causal = attrs_.causal_;
    a.window = attrs_.window_;
    a.scale = attrs_.scale_;
    a.q_tiles = AttnCeilDiv(s.tq, kBlockQ);
    a.drop = drop;
    const int64_t items = s.b * s.h * a.q_tiles;
    // Cycles per item, roughly: two GEMMs of (up to kBlockQ) query rows x Tk x D at ~8 flops a
    // cycle. A decode step's single query row costs 1/64 of a full tile: counted so, its few items
    // run on the calling thread (waking the pool's threads took ~50 us of a ~60 us call).
    const int64_t cost = std::max<int64_t>(1, std::min(kBlockQ, s.tq) * s.tk * (s.d + s.dv) / 4);
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, items, cost, AttnForwardScratch<T>(s),
                                               [&a](int64_t begin, int64_t end, float* scratch) {
                                                 AttnForwardItems(a, begin, end, scratch);
                                               }));
  }

 private:
  AttnAttrs attrs_;
};

Status AttnCheckShape(const Tensor& t, const char* name, const TensorShape& want) {
  if (t.shape() != want) {
    return errors::InvalidArgument(name, " must have the shape ", want.DebugString(), ", got ",
                                   t.shape().DebugString());
  }
  return Status();
}

template <typename T>
class AttentionGradOp : public OpKernel {
 public:
  explicit AttentionGradOp(OpKernelConstruction* ctx) : OpKernel(ctx), attrs_(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& d_out = ctx->input(0);
    const Tensor& q = ctx->input(1);
    const Tensor& k = ctx->input(2);
    const Tensor& v = ctx->input(3);
    const Tensor& mask = ctx->input(4);
    const Tensor& out = ctx->input(5);
    const Tensor& lse = ctx->input(6);
    AttnShape s;
    OP_REQUIRES_OK(ctx, AttnCheckInputs(q, k, v, mask, attrs_.layout_, &s));
    const TensorShape out_shape = AttnInLayout(s.layout, s.b, s.h, s.tq, s.dv);
    OP_REQUIRES_OK(ctx, AttnCheckShape(d_out, "d_output", out_shape));
    OP_REQUIRES_OK(ctx, AttnCheckShape(out, "output", out_shape));
    OP_REQUIRES_OK(ctx, AttnCheckShape(lse, "lse", TensorShape({s.b, s.h, s.tq})));
    AttnDropout drop;
    OP_REQUIRES_OK(ctx, attrs_.Dropout<T>(ctx, &drop));
    Tensor *dq = nullptr, *dk = nullptr, *dv = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, q.shape(), &dq));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, k.shape(), &dk));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, v.shape(), &dv));
    AttnBackwardArgs<T> a;
    a.d_out = d_out.flat<T>().data();
    a.q = q.flat<T>().data();
    a.k = k.flat<T>().data();
    a.v = v.flat<T>().data();
    a.mask = mask.flat<bool>().data();
    a.out = out.flat<T>().data();
    a.lse = lse.flat<float>().data();
    a.dq = dq->flat<T>().data();
    a.dk = dk->flat<T>().data();
    a.dv = dv->flat<T>().data();
    a.s = s;
    a.causal = attrs_.causal_;
    a.window = attrs_.window_;
    a.scale = attrs_.scale_;
    a.drop = drop;
    if (s.b * s.hk == 0) return;
    if (s.tq == 0 || s.h == 0) {  // no query: no gradient flows to key and value
      std::fill(a.dk, a.dk + dk->NumElements(), static_cast<T>(0.0f));
      std::fill(a.dv, a.dv + dv->NumElements(), static_cast<T>(0.0f));
      return;
    }
    // One item per key/value head (its query heads in turn, one writer per dK/dV element), unless
    // grouped heads leave fewer of those than threads: then one item per query head, each with its
    // own float partial of dK/dV, summed per key/value head afterwards.
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    Tensor dk_part, dv_part;
    if (s.groups > 1 && s.b * s.hk < threads) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({s.b * s.h, s.tk, s.d}), &dk_part));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_FLOAT, TensorShape({s.b * s.h, s.tk, s.dv}), &dv_part));
      a.dk_part = dk_part.flat<float>().data();
      a.dv_part = dv_part.flat<float>().data();
    }
    const int64_t items = a.dk_part != nullptr ? s.b * s.h : s.b * s.hk;
    const int64_t per_item = a.dk_part != nullptr ? 1 : s.groups;
    // Cycles per item, roughly: five GEMMs of Tq x Tk x D per query head at ~8 flops a cycle.
    const int64_t cost = std::max<int64_t>(1, per_item * s.tq * s.tk * (3 * s.d + 2 * s.dv) / 4);
    OP_REQUIRES_OK(ctx, ParallelForWithScratch(ctx, items, cost, AttnBackwardScratch<T>(s),
                                               [&a](int64_t begin, int64_t end, float* scratch) {
                                                 AttnBackwardItems(a, begin, end, scratch);
                                               }));
    if (a.dk_part != nullptr) {
      ParallelFor(ctx, s.b * s.hk * s.tk, std::max<int64_t>(1, s.groups * (s.d + s.dv)),
                  [&a](int64_t begin, int64_t end) { AttnSumPartials(a, begin, end); });
    }
  }

 private:
  AttnAttrs attrs_;
};

TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>Attention"), AttentionOp)
TFMETAL_EXT_REGISTER_CPU_FLOAT_KERNELS(Name("TfmetalExt>AttentionGrad"), AttentionGradOp)

}  // namespace attention_cpu
}  // namespace tfmetal_ext
