// Metal kernel of the Einsum gap kernel (host code in gap_einsum_metal.mm;
// the planner, the params and the geometry in tfmetal/gap_einsum.h).
//
// A tiled batched matrix product C[batch, m, n] = sum_k A[batch, m, k] *
// B[batch, k, n] that reads every operand through the plan's per-group
// strides (no transposed copy). One threadgroup of 16 x 16 threads per 32 x
// 32 tile of (m, n) and per batch index (grid: x = N tiles, y = M tiles,
// z = batch). Each step stages a 32 x 16 tile of A and a 16 x 32 tile of B
// in threadgroup memory, as float (zero outside the matrices), and each
// thread accumulates its 2 x 2 outputs (rows ty, ty + 16; columns tx, tx +
// 16) in float, over k in increasing order; one rounding to T on the store.
// K = 0 stores zeros.
#ifndef TFMETAL_METAL_GAP_EINSUM_KERNELS_H_
#define TFMETAL_METAL_GAP_EINSUM_KERNELS_H_

#include "tfmetal/gap_einsum.h"
#include "tfmetal/portable.h"

static_assert(sizeof(tfm_gap_einsum_group) == 4 + 4 * 4 * TFM_GAP_EINSUM_MAX_RUNS,
              "tfm_gap_einsum_group layout is shared with the host");
static_assert(sizeof(tfm_gap_einsum_params) == 32 + 4 * sizeof(tfm_gap_einsum_group),
              "tfm_gap_einsum_params layout is shared with the host");
static_assert(TFM_GAP_EINSUM_TILE == 2 * TFM_GAP_EINSUM_THREADS, "each thread owns 2 x 2 outputs");
static_assert(TFM_GAP_EINSUM_TILE * TFM_GAP_EINSUM_TILE_K == 2 * TFM_GAP_EINSUM_THREADS * TFM_GAP_EINSUM_THREADS,
              "each thread stages two elements of each tile");

#if TFM_METAL

template <typename T>
[[kernel]] void gap_einsum(device const T* a [[buffer(0)]],
                           device const T* b [[buffer(1)]],
                           device T* c [[buffer(2)]],
                           constant tfm_gap_einsum_params& p [[buffer(3)]],
                           TFM_KERNEL_BUILTINS) {
  threadgroup float a_tile[TFM_GAP_EINSUM_TILE_K * TFM_GAP_EINSUM_TILE];  // [k][m]
  threadgroup float b_tile[TFM_GAP_EINSUM_TILE_K * TFM_GAP_EINSUM_TILE];  // [k][n]
  const uint tid = lid.y * TFM_GAP_EINSUM_THREADS + lid.x;
  const uint m0 = tgid.y * TFM_GAP_EINSUM_TILE, n0 = tgid.x * TFM_GAP_EINSUM_TILE;
  uint32_t base_a, base_b, base_c;
  gap_einsum_offsets(p.g[TFM_GAP_EINSUM_BATCH], p.batch_start + tgid.z, base_a, base_b, base_c);
  float acc00 = 0.0f, acc01 = 0.0f, acc10 = 0.0f, acc11 = 0.0f;
  for (uint k0 = 0; k0 < p.k; k0 += TFM_GAP_EINSUM_TILE_K) {
    for (uint i = 0; i < 2; ++i) {
      const uint l = tid + i * TFM_GAP_EINSUM_THREADS * TFM_GAP_EINSUM_THREADS;
      // A: row m0 + l / 16, column k0 + l % 16.
      const uint am = m0 + l / TFM_GAP_EINSUM_TILE_K, ak = k0 + l % TFM_GAP_EINSUM_TILE_K;
      float av = 0.0f;
      if (am < p.m && ak < p.k) {
        uint32_t ma, mb, mc, ka, kb, kc;
        gap_einsum_offsets(p.g[TFM_GAP_EINSUM_M], am, ma, mb, mc);
        gap_einsum_offsets(p.g[TFM_GAP_EINSUM_K], ak, ka, kb, kc);
        av = static_cast<float>(a[base_a + ma + ka]);
      }
      a_tile[(l % TFM_GAP_EINSUM_TILE_K) * TFM_GAP_EINSUM_TILE + l / TFM_GAP_EINSUM_TILE_K] = av;
      // B: row k0 + l / 32, column n0 + l % 32.
      const uint bk = k0 + l / TFM_GAP_EINSUM_TILE, bn = n0 + l % TFM_GAP_EINSUM_TILE;
      float bv = 0.0f;
      if (bk < p.k && bn < p.n) {
        uint32_t na, nb, nc, ka, kb, kc;
        gap_einsum_offsets(p.g[TFM_GAP_EINSUM_N], bn, na, nb, nc);
        gap_einsum_offsets(p.g[TFM_GAP_EINSUM_K], bk, ka, kb, kc);
        bv = static_cast<float>(b[base_b + nb + kb]);
      }
      b_tile[l] = bv;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Steps past K add 0 * 0 (both tiles are zero there).
    for (uint kk = 0; kk < TFM_GAP_EINSUM_TILE_K; ++kk) {
      const float a0 = a_tile[kk * TFM_GAP_EINSUM_TILE + lid.y];
      const float a1 = a_tile[kk * TFM_GAP_EINSUM_TILE + lid.y + TFM_GAP_EINSUM_THREADS];
      const float b0 = b_tile[kk * TFM_GAP_EINSUM_TILE + lid.x];
      const float b1 = b_tile[kk * TFM_GAP_EINSUM_TILE + lid.x + TFM_GAP_EINSUM_THREADS];
      acc00 += a0 * b0;
      acc01 += a0 * b1;
      acc10 += a1 * b0;
      acc11 += a1 * b1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2; ++i) {
    const uint m = m0 + lid.y + i * TFM_GAP_EINSUM_THREADS;
    if (m >= p.m) continue;
    uint32_t ma, mb, mc;
    gap_einsum_offsets(p.g[TFM_GAP_EINSUM_M], m, ma, mb, mc);
    for (uint j = 0; j < 2; ++j) {
      const uint n = n0 + lid.x + j * TFM_GAP_EINSUM_THREADS;
      if (n >= p.n) continue;
      uint32_t na, nb, nc;
      gap_einsum_offsets(p.g[TFM_GAP_EINSUM_N], n, na, nb, nc);
      const float v = i == 0 ? (j == 0 ? acc00 : acc01) : (j == 0 ? acc10 : acc11);
      c[base_c + mc + nc] = static_cast<T>(v);
    }
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_EINSUM_KERNELS_H_
