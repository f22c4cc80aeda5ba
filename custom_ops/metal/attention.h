// Metal kernels of TfmetalExt>Attention and TfmetalExt>AttentionGrad
// (instantiated in attention.metal; host code in attention_metal.mm; the op
// contract: query [B, H, Tq, D], key [B, Hk, Tk, D], value [B, Hk, Tk, Dv]
// with Hk dividing H (grouped-query attention), output and the gradients
// alike; or with layout BSHD [B, Tq, H, D], [B, Tk, Hk, D], [B, Tk, Hk, Dv];
// a broadcast bool mask [Bm, Hm, Tqm, Tkm], causal, sliding window, scale).
//
// Flash-style: the Tq x Tk score matrix is never stored, only tiles of it in
// threadgroup memory; softmax statistics and every sum are float32 whatever T.
// Every kernel runs TFM_ATTN_THREADS = 128 threads (4 SIMD-groups of 32) per
// threadgroup; the grid is 3-D: x = tile, y = head, z = batch.
//
// attention_fwd<T>        one threadgroup per (batch, head, tile of
//                         TFM_ATTN_BLOCK_Q = 8 query rows); each SIMD-group
//                         owns 2 rows. Loops over key tiles of
//                         TFM_ATTN_BLOCK_K = 32 keys (lane j = key j of the
//                         tile): the scores come from query and key chunks of
//                         TFM_ATTN_CHUNK = 64 head dims staged in threadgroup
//                         memory (head dims up to 256 = 4 chunks), the row max
//                         and sum of the tile are simd_max / simd_sum, the
//                         online softmax rescales the running output, then the
//                         tile's values are staged chunk by chunk and each lane
//                         accumulates the output dims lane, lane + 32, ...
//                         Key tiles wholly above the diagonal of the query
//                         tile (causal) or outside its window are skipped. Writes output and lse;
//                         a fully masked row (and every row when Tk == 0)
//                         writes output 0 and lse -inf.
// attention_bwd_dq<T>     one threadgroup per (batch, head, query tile):
//                         Dr = rowsum(dO * O) of its rows (simd_sum), then
//                         over key tiles p = exp(s - lse), dp = dO . v,
//                         ds = p (dp - Dr), dQ += ds K (K staged in chunks);
//                         dQ = scale * sum.
// attention_bwd_dkdv<T>   one threadgroup per (batch, key/value head, key tile,
//                         head-dim chunk c): dK[:, 64c, 64c + 64) and
//                         dV[:, 64c, 64c + 64) of its 32 keys, accumulated in
//                         registers (16 + 16 floats per thread) over the query
//                         heads that read the key/value head (grouped-query
//                         attention: H / Hk of them) and their query tiles
//                         that reach the key tile (causal: from the diagonal;
//                         window: up to the window's end). The scores and dp are recomputed for each
//                         chunk (once when D, Dv <= 64), and Dr of each query
//                         tile is recomputed here instead of being stored: no
//                         scratch tensor, no atomics, one writer per element.
// Deterministic: the summation order depends only on the shapes.
//
// Layouts (p.layout, tfmetal/attention.h): a head's rows are contiguous (BHSD)
// or H (key/value: Hk) rows apart (BSHD). Tiles are read and written row by
// row through that stride, so the layout moves addresses only: the same sums
// in the same order, BSHD's results are BHSD's bits. lse is [B, H, Tq] in both.
//
// Attention dropout (p.dropout = 1): every kernel derives the Philox key and
// counter from the seed buffer (2 int32, or 4 words of 2 int64; one Philox
// block per thread) and each lane draws the block of its own (row, key)
// element (tfmetal/attention.h: flat index ((b H + h) Tq + i) Tk + j), only
// for attended elements. The forward drops the weights after the online sum
// (P V uses the dropped ones); the backward drops p for dV and dp for ds.
// With p.dropout = 0 the seed buffer is a placeholder, never read.
//
// The per-element math (masked/causal predicate, online-softmax rescale, lse,
// 1 / sum, p from lse, ds) and the causal tile ranges are the CPU kernel's,
// from tfmetal/attention.h; these kernels own only the tiling and the
// summation order (which differs from the CPU kernel's: results agree to
// float32 rounding, not bit for bit). Verified on the Metal emulator
// (custom_ops/emu, tests/ops/test_attention_metal_emu.py), not on a GPU.
#ifndef TFMETAL_METAL_ATTENTION_KERNELS_H_
#define TFMETAL_METAL_ATTENTION_KERNELS_H_

#include "tfmetal/portable.h"
#include "tfmetal/attention.h"

// setBytes data of the three kernels (shared with the host).
struct tfm_attention_params {
  uint32_t batch;     // B
  uint32_t heads;     // H
  uint32_t tq;        // query length
  uint32_t tk;        // key length
  uint32_t d;         // query/key head dim, 1..256
  uint32_t dv;        // value head dim, 1..256
  uint32_t mask_stride_b;  // element strides of the mask; 0 along a broadcast (size-1) dimension
  uint32_t mask_stride_h;
  uint32_t mask_stride_q;
  uint32_t mask_stride_k;
  float scale;        // finite and > 0 (checked by the host)
  uint32_t causal;    // 1: query i attends key j only if j <= i
  uint32_t dropout;   // 1: attention dropout (the seed buffer is read), 0: none
  uint32_t seed_is_int64;  // 1: the seed is 2 int64 (4 words), 0: 2 int32 (widened with their sign)
  uint32_t mantissa_bits;  // of T: 23 float, 10 half, 7 bfloat16
  float dropout_rate;      // keep where the uniform number >= dropout_rate (rounded to T by the wrapper)
  float dropout_scale;     // 1 / (1 - rate), rounded to T (may be inf in half: nothing is kept then)
  uint32_t kv_heads;       // Hk: key/value heads, dividing H (query head h reads h / (H / Hk))
  uint32_t window;         // sliding window w: |i - j| < w; 0: none
  uint32_t layout;         // TFM_ATTENTION_LAYOUT_* of query, key, value, output and the gradients
};
static_assert(sizeof(tfm_attention_params) == 80, "tfm_attention_params layout is shared with the host");

#define TFM_ATTN_THREADS 128u      // threads per threadgroup, every kernel
#define TFM_ATTN_BLOCK_Q 8u        // query rows per tile
#define TFM_ATTN_BLOCK_K 32u       // keys per tile (one per SIMD lane)
#define TFM_ATTN_CHUNK 64u         // head dims staged at a time
// Registers per lane for a head-dim row of up to TFM_ATTENTION_MAX_HEAD_DIM
// (256, tfmetal/attention.h): dims lane + 32 t.
#define TFM_ATTN_DIMS_PER_LANE (TFM_ATTENTION_MAX_HEAD_DIM / 32u)
static_assert(TFM_ATTN_BLOCK_K % TFM_ATTN_BLOCK_Q == 0, "a key tile starts at a query tile's first row");
static_assert(TFM_ATTN_BLOCK_Q % (TFM_ATTN_THREADS / 32u) == 0, "each SIMD-group owns as many query rows");

#if TFM_METAL

#define TFM_ATTN_SIMDGROUPS (TFM_ATTN_THREADS / 32u)
#define TFM_ATTN_ROWS_PER_SIMD (TFM_ATTN_BLOCK_Q / TFM_ATTN_SIMDGROUPS)
#define TFM_ATTN_KEY_STRIDE (TFM_ATTN_CHUNK + 1u)  // padded: lanes read different banks

// ---------------------------------------------------------------------------
// Tiling helpers.

// The mask value for (b, h, i, j), broadcast through zero strides.
inline bool attn_mask_at(device const bool* mask, constant tfm_attention_params& p, uint b, uint h, uint i, uint j) {
  const ulong at = static_cast<ulong>(b) * p.mask_stride_b + static_cast<ulong>(h) * p.mask_stride_h +
                   static_cast<ulong>(i) * p.mask_stride_q + static_cast<ulong>(j) * p.mask_stride_k;
  return mask[at];
}

// The dropout's Philox key and counter, from the seed buffer (not read
// without dropout: the stream is then unused).
inline dropout_stream attn_dropout_stream(device const uint* seed, constant tfm_attention_params& p) {
  int64_t s0 = 0, s1 = 0;
  if (p.dropout != 0u) {
    if (p.seed_is_int64 != 0u) {
      s0 = static_cast<int64_t>(static_cast<uint64_t>(seed[0]) | (static_cast<uint64_t>(seed[1]) << 32));
      s1 = static_cast<int64_t>(static_cast<uint64_t>(seed[2]) | (static_cast<uint64_t>(seed[3]) << 32));
    } else {
      s0 = static_cast<int64_t>(static_cast<int32_t>(seed[0]));
      s1 = static_cast<int64_t>(static_cast<int32_t>(seed[1]));
    }
  }
  return dropout_stream_from_seed(s0, s1);
}

// Whether the dropout keeps element (b, h, i, j) of the probabilities.
inline bool attn_dropout_keeps(dropout_stream stream, constant tfm_attention_params& p, uint b, uint h, uint i,
                               uint j) {
  return attention_dropout_keeps_at(stream, attention_dropout_index(b, h, i, j, p.heads, p.tq, p.tk),
                                    p.mantissa_bits, p.dropout_rate);
}

// Row addressing in p.layout: the element offset of row 0 of a head and the
// stride between its rows, of `width` elements each. Query, output and their
// gradients have H heads of Tq rows (q); key, value and theirs Hk of Tk (kv).
inline ulong attn_q_offset(constant tfm_attention_params& p, uint b, uint h, uint width) {
  return attention_head_offset(p.layout, b, h, p.heads, p.tq, width);
}
inline ulong attn_q_stride(constant tfm_attention_params& p, uint width) {
  return attention_row_stride(p.layout, p.heads, width);
}
inline ulong attn_kv_offset(constant tfm_attention_params& p, uint b, uint hk, uint width) {
  return attention_head_offset(p.layout, b, hk, p.kv_heads, p.tk, width);
}
inline ulong attn_kv_stride(constant tfm_attention_params& p, uint width) {
  return attention_row_stride(p.layout, p.kv_heads, width);
}

// Key tiles [first, end) a query tile [q0, q0 + rows) visits: all of them, or
// those holding a key <= its last row (causal) and within its rows' windows.
inline uint attn_key_tile_begin(constant tfm_attention_params& p, uint q0) {
  return attention_key_begin(p.window, q0) / TFM_ATTN_BLOCK_K;
}
inline uint attn_key_tiles(constant tfm_attention_params& p, uint q0, uint rows) {
  return attention_ceil_div(attention_key_end(p.causal != 0u, p.window, q0, rows, p.tk), TFM_ATTN_BLOCK_K);
}

// Query tiles [first, end) holding a row that attends a key of the tile
// [k0, k0 + keys) (with causal from the row k0, with a window up to the
// window's last row; k0 is a multiple of TFM_ATTN_BLOCK_Q).
inline uint attn_first_query_tile(constant tfm_attention_params& p, uint k0) {
  const uint first = attention_query_begin(p.causal != 0u, p.window, k0) / TFM_ATTN_BLOCK_Q;
  return tfm_min(attention_ceil_div(p.tq, TFM_ATTN_BLOCK_Q), first);
}
inline uint attn_query_tiles_end(constant tfm_attention_params& p, uint k0, uint keys) {
  return attention_ceil_div(attention_query_end(p.window, k0, keys, p.tq), TFM_ATTN_BLOCK_Q);
}

// Dot products of a tile of 8 rows of `a` with a tile of 32 rows of `b`
// (both rows of `len` T, a_stride / b_stride elements apart), in float:
// out[r] = a[row(r)] . b[simd_lane] for the SIMD-group's rows
// row(r) = simd_id * 2 + r. Rows past a_rows / b_rows are staged as 0. Stages
// chunks of 64 columns in a_st [8 * 64] and b_st [32 * 65]; starts each chunk
// with a barrier, so the caller's previous reads of a_st/b_st are complete.
// All threads must call it.
template <typename T>
inline void attn_tile_dots(device const T* a, ulong a_stride, uint a_rows, device const T* b, ulong b_stride,
                           uint b_rows, uint len, threadgroup float* a_st, threadgroup float* b_st, uint tid,
                           uint simd_lane, uint simd_id, thread float* out) {
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) out[r] = 0.0f;
  for (uint c0 = 0; c0 < len; c0 += TFM_ATTN_CHUNK) {
    const uint width = tfm_min(TFM_ATTN_CHUNK, len - c0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK; e += TFM_ATTN_THREADS) {
      const uint row = e / TFM_ATTN_CHUNK, col = e % TFM_ATTN_CHUNK;
      a_st[e] = (row < a_rows && col < width) ? static_cast<float>(a[row * a_stride + c0 + col]) : 0.0f;
    }
    for (uint e = tid; e < TFM_ATTN_BLOCK_K * TFM_ATTN_CHUNK; e += TFM_ATTN_THREADS) {
      const uint row = e / TFM_ATTN_CHUNK, col = e % TFM_ATTN_CHUNK;
      b_st[row * TFM_ATTN_KEY_STRIDE + col] =
          (row < b_rows && col < width) ? static_cast<float>(b[row * b_stride + c0 + col]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
      threadgroup const float* ar = a_st + (simd_id * TFM_ATTN_ROWS_PER_SIMD + r) * TFM_ATTN_CHUNK;
      threadgroup const float* br = b_st + simd_lane * TFM_ATTN_KEY_STRIDE;
      float sum = 0.0f;
      for (uint c = 0; c < width; ++c) sum += ar[c] * br[c];
      out[r] += sum;
    }
  }
}

// Stages a chunk of 64 columns [c0, c0 + 64) of `rows_total` rows of `len` T
// of `src` (src_stride elements apart) in `dst` (float, row stride
// `dst_stride`), rows past `rows` and columns past `len` as 0. Barrier before
// (previous readers done) and after.
template <typename T>
inline void attn_stage_chunk(device const T* src, ulong src_stride, uint rows, uint rows_total, uint len, uint c0,
                             threadgroup float* dst, uint dst_stride, uint tid) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < rows_total * TFM_ATTN_CHUNK; e += TFM_ATTN_THREADS) {
    const uint row = e / TFM_ATTN_CHUNK, col = e % TFM_ATTN_CHUNK;
    dst[row * dst_stride + col] =
        (row < rows && c0 + col < len) ? static_cast<float>(src[row * src_stride + c0 + col]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// ---------------------------------------------------------------------------
// Forward.

template <typename T>
[[kernel]] void attention_fwd(device const T* query [[buffer(0)]],
                              device const T* key [[buffer(1)]],
                              device const T* value [[buffer(2)]],
                              device const bool* mask [[buffer(3)]],
                              device const uint* seed [[buffer(4)]],
                              device T* output [[buffer(5)]],
                              device float* lse [[buffer(6)]],
                              constant tfm_attention_params& p [[buffer(7)]],
                              TFM_KERNEL_BUILTINS) {
  threadgroup float a_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK];
  threadgroup float b_st[TFM_ATTN_BLOCK_K * TFM_ATTN_KEY_STRIDE];
  threadgroup float p_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_BLOCK_K];
  const uint tid = lid.x;
  const uint b = tgid.z, h = tgid.y;
  const uint q0 = tgid.x * TFM_ATTN_BLOCK_Q;
  const uint rows = tfm_min(TFM_ATTN_BLOCK_Q, p.tq - q0);
  const ulong bh = static_cast<ulong>(b) * p.heads + h;
  const uint hk = attention_kv_head(h, p.heads, p.kv_heads);
  const ulong q_stride = attn_q_stride(p, p.d), k_stride = attn_kv_stride(p, p.d), v_stride = attn_kv_stride(p, p.dv);
  device const T* q_tile = query + attn_q_offset(p, b, h, p.d) + q0 * q_stride;
  device const T* k_head = key + attn_kv_offset(p, b, hk, p.d);
  device const T* v_head = value + attn_kv_offset(p, b, hk, p.dv);
  const bool causal = p.causal != 0u;
  const bool dropout = p.dropout != 0u;
  const dropout_stream stream = attn_dropout_stream(seed, p);

  float run_max[TFM_ATTN_ROWS_PER_SIMD];
  float run_sum[TFM_ATTN_ROWS_PER_SIMD];
  float alpha[TFM_ATTN_ROWS_PER_SIMD];
  float acc[TFM_ATTN_ROWS_PER_SIMD][TFM_ATTN_DIMS_PER_LANE];
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
    run_max[r] = -INFINITY;
    run_sum[r] = 0.0f;
    for (uint t = 0; t < TFM_ATTN_DIMS_PER_LANE; ++t) acc[r][t] = 0.0f;
  }

  const uint key_tiles = attn_key_tiles(p, q0, rows);
  for (uint kt = attn_key_tile_begin(p, q0); kt < key_tiles; ++kt) {
    const uint k0 = kt * TFM_ATTN_BLOCK_K;
    const uint keys = tfm_min(TFM_ATTN_BLOCK_K, p.tk - k0);
    float dots[TFM_ATTN_ROWS_PER_SIMD];
    attn_tile_dots(q_tile, q_stride, rows, k_head + k0 * k_stride, k_stride, keys, p.d, a_st, b_st, tid, simd_lane,
                   simd_id, dots);
    const uint j = k0 + simd_lane;
    for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
      const uint row = simd_id * TFM_ATTN_ROWS_PER_SIMD + r;
      const uint i = q0 + row;
      const bool attended = row < rows && simd_lane < keys &&
                            attention_attends(attn_mask_at(mask, p, b, h, i, j), causal, p.window, i, j);
      const float score = attended ? p.scale * dots[r] : -INFINITY;
      const float new_max = attention_new_max(run_max[r], simd_max(score));
      alpha[r] = attention_rescale(run_max[r], new_max);
      const float weight = attention_weight(score, new_max);  // 0 where not attended (score -inf)
      run_sum[r] = run_sum[r] * alpha[r] + simd_sum(weight);
      run_max[r] = new_max;
      // P V takes the dropped weight; the sum above is of the undropped ones.
      p_st[row * TFM_ATTN_BLOCK_K + simd_lane] =
          (dropout && attended)
              ? attention_dropout_apply(weight, attn_dropout_keeps(stream, p, b, h, i, j), p.dropout_scale)
              : weight;
    }
    // acc = acc * alpha + P V, V staged chunk by chunk (the staging's barrier
    // also publishes p_st to the SIMD-group's other lanes).
    for (uint c0 = 0; c0 < p.dv; c0 += TFM_ATTN_CHUNK) {
      attn_stage_chunk(v_head + k0 * v_stride, v_stride, keys, TFM_ATTN_BLOCK_K, p.dv, c0, b_st,
                       TFM_ATTN_KEY_STRIDE, tid);
      for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
        threadgroup const float* pr = p_st + (simd_id * TFM_ATTN_ROWS_PER_SIMD + r) * TFM_ATTN_BLOCK_K;
        for (uint half_chunk = 0; half_chunk < TFM_ATTN_CHUNK / 32u; ++half_chunk) {
          const uint col = half_chunk * 32u + simd_lane;
          float sum = 0.0f;
          for (uint jj = 0; jj < TFM_ATTN_BLOCK_K; ++jj) sum += pr[jj] * b_st[jj * TFM_ATTN_KEY_STRIDE + col];
          const uint t = c0 / 32u + half_chunk;
          acc[r][t] = acc[r][t] * alpha[r] + sum;
        }
      }
    }
  }

  const ulong out_head = attn_q_offset(p, b, h, p.dv), out_stride = attn_q_stride(p, p.dv);
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
    const uint row = simd_id * TFM_ATTN_ROWS_PER_SIMD + r;
    if (row >= rows) continue;
    const ulong out_row = out_head + (q0 + row) * out_stride;
    const float inv_sum = attention_inv_sum(run_sum[r]);
    for (uint t = 0; t < TFM_ATTN_DIMS_PER_LANE; ++t) {
      const uint c = t * 32u + simd_lane;
      if (c < p.dv) output[out_row + c] = static_cast<T>(acc[r][t] * inv_sum);
    }
    if (simd_lane == 0) lse[bh * p.tq + q0 + row] = attention_lse(run_max[r], run_sum[r]);
  }
}

// ---------------------------------------------------------------------------
// Backward.

// Dr = sum_c dO[i, c] * O[i, c] of the SIMD-group's rows of a query tile
// (rows of both `stride` elements apart).
template <typename T>
inline void attn_rows_dr(device const T* d_out_tile, device const T* out_tile, ulong stride, uint rows, uint dv,
                         uint simd_lane, uint simd_id, thread float* dr) {
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
    const uint row = simd_id * TFM_ATTN_ROWS_PER_SIMD + r;
    float sum = 0.0f;
    if (row < rows) {
      for (uint c = simd_lane; c < dv; c += 32u) {
        const ulong at = row * stride + c;
        sum += static_cast<float>(d_out_tile[at]) * static_cast<float>(out_tile[at]);
      }
    }
    dr[r] = simd_sum(sum);
  }
}

// p and ds of the SIMD-group's rows of query tile q0 against key tile k0
// (lane = key), written to p_st / ds_st [8 * 32] (0 where not attended);
// dr: Dr of the SIMD-group's rows (attn_rows_dr). With dropout p_st holds the
// dropped p (for dV) and ds = p (dropped dp - Dr).
template <typename T>
inline void attn_tile_p_ds(device const T* query, device const T* key, device const T* value, device const bool* mask,
                           device const T* d_output, device const float* lse, thread const float* dr,
                           dropout_stream stream,
                           constant tfm_attention_params& p, uint b, uint h, uint q0, uint rows, uint k0, uint keys,
                           threadgroup float* a_st, threadgroup float* b_st, threadgroup float* p_st,
                           threadgroup float* ds_st, uint tid, uint simd_lane, uint simd_id) {
  const ulong bh = static_cast<ulong>(b) * p.heads + h;
  const uint hk = attention_kv_head(h, p.heads, p.kv_heads);
  float dots[TFM_ATTN_ROWS_PER_SIMD];
  float dps[TFM_ATTN_ROWS_PER_SIMD];
  const ulong q_stride = attn_q_stride(p, p.d), do_stride = attn_q_stride(p, p.dv);
  const ulong k_stride = attn_kv_stride(p, p.d), v_stride = attn_kv_stride(p, p.dv);
  device const T* q_tile = query + attn_q_offset(p, b, h, p.d) + q0 * q_stride;
  device const T* do_tile = d_output + attn_q_offset(p, b, h, p.dv) + q0 * do_stride;
  attn_tile_dots(q_tile, q_stride, rows, key + attn_kv_offset(p, b, hk, p.d) + k0 * k_stride, k_stride, keys, p.d,
                 a_st, b_st, tid, simd_lane, simd_id, dots);
  attn_tile_dots(do_tile, do_stride, rows, value + attn_kv_offset(p, b, hk, p.dv) + k0 * v_stride, v_stride, keys,
                 p.dv, a_st, b_st, tid, simd_lane, simd_id, dps);
  const uint j = k0 + simd_lane;
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
    const uint row = simd_id * TFM_ATTN_ROWS_PER_SIMD + r;
    const uint i = q0 + row;
    const bool attended = row < rows && simd_lane < keys &&
                          attention_attends(attn_mask_at(mask, p, b, h, i, j), p.causal != 0u, p.window, i, j);
    const float pij = attended ? attention_p(p.scale * dots[r], lse[bh * p.tq + i]) : 0.0f;
    float p_used = pij, dp_used = dps[r];
    if (p.dropout != 0u && attended) {
      const bool keep = attn_dropout_keeps(stream, p, b, h, i, j);
      p_used = attention_dropout_apply(pij, keep, p.dropout_scale);
      dp_used = attention_dropout_apply(dps[r], keep, p.dropout_scale);
    }
    p_st[row * TFM_ATTN_BLOCK_K + simd_lane] = p_used;
    ds_st[row * TFM_ATTN_BLOCK_K + simd_lane] = attended ? attention_ds(pij, dp_used, dr[r]) : 0.0f;
  }
}

template <typename T>
[[kernel]] void attention_bwd_dq(device const T* d_output [[buffer(0)]],
                                 device const T* query [[buffer(1)]],
                                 device const T* key [[buffer(2)]],
                                 device const T* value [[buffer(3)]],
                                 device const bool* mask [[buffer(4)]],
                                 device const T* output [[buffer(5)]],
                                 device const float* lse [[buffer(6)]],
                                 device const uint* seed [[buffer(7)]],
                                 device T* d_query [[buffer(8)]],
                                 constant tfm_attention_params& p [[buffer(9)]],
                                 TFM_KERNEL_BUILTINS) {
  threadgroup float a_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK];
  threadgroup float b_st[TFM_ATTN_BLOCK_K * TFM_ATTN_KEY_STRIDE];
  threadgroup float p_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_BLOCK_K];
  threadgroup float ds_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_BLOCK_K];
  const uint tid = lid.x;
  const uint b = tgid.z, h = tgid.y;
  const uint q0 = tgid.x * TFM_ATTN_BLOCK_Q;
  const uint rows = tfm_min(TFM_ATTN_BLOCK_Q, p.tq - q0);
  const ulong k_stride = attn_kv_stride(p, p.d);
  device const T* k_head = key + attn_kv_offset(p, b, attention_kv_head(h, p.heads, p.kv_heads), p.d);
  const dropout_stream stream = attn_dropout_stream(seed, p);

  float acc[TFM_ATTN_ROWS_PER_SIMD][TFM_ATTN_DIMS_PER_LANE];
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r)
    for (uint t = 0; t < TFM_ATTN_DIMS_PER_LANE; ++t) acc[r][t] = 0.0f;
  float dr[TFM_ATTN_ROWS_PER_SIMD];
  const ulong do_stride = attn_q_stride(p, p.dv);
  const ulong do_tile = attn_q_offset(p, b, h, p.dv) + q0 * do_stride;  // of d_output and output
  attn_rows_dr(d_output + do_tile, output + do_tile, do_stride, rows, p.dv, simd_lane, simd_id, dr);

  const uint key_tiles = attn_key_tiles(p, q0, rows);
  for (uint kt = attn_key_tile_begin(p, q0); kt < key_tiles; ++kt) {
    const uint k0 = kt * TFM_ATTN_BLOCK_K;
    const uint keys = tfm_min(TFM_ATTN_BLOCK_K, p.tk - k0);
    attn_tile_p_ds(query, key, value, mask, d_output, lse, dr, stream, p, b, h, q0, rows, k0, keys, a_st, b_st, p_st,
                   ds_st, tid, simd_lane, simd_id);
    // dQ += dS K, K staged chunk by chunk.
    for (uint c0 = 0; c0 < p.d; c0 += TFM_ATTN_CHUNK) {
      attn_stage_chunk(k_head + k0 * k_stride, k_stride, keys, TFM_ATTN_BLOCK_K, p.d, c0, b_st,
                       TFM_ATTN_KEY_STRIDE, tid);
      for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
        threadgroup const float* dsr = ds_st + (simd_id * TFM_ATTN_ROWS_PER_SIMD + r) * TFM_ATTN_BLOCK_K;
        for (uint half_chunk = 0; half_chunk < TFM_ATTN_CHUNK / 32u; ++half_chunk) {
          const uint col = half_chunk * 32u + simd_lane;
          float sum = 0.0f;
          for (uint jj = 0; jj < TFM_ATTN_BLOCK_K; ++jj) sum += dsr[jj] * b_st[jj * TFM_ATTN_KEY_STRIDE + col];
          acc[r][c0 / 32u + half_chunk] += sum;
        }
      }
    }
  }

  const ulong dq_head = attn_q_offset(p, b, h, p.d), dq_stride = attn_q_stride(p, p.d);
  for (uint r = 0; r < TFM_ATTN_ROWS_PER_SIMD; ++r) {
    const uint row = simd_id * TFM_ATTN_ROWS_PER_SIMD + r;
    if (row >= rows) continue;
    const ulong dq_row = dq_head + (q0 + row) * dq_stride;
    for (uint t = 0; t < TFM_ATTN_DIMS_PER_LANE; ++t) {
      const uint c = t * 32u + simd_lane;
      if (c < p.d) d_query[dq_row + c] = static_cast<T>(p.scale * acc[r][t]);
    }
  }
}

// Threadgroup x = key tile * chunks + chunk, chunks = ceil(max(D, Dv) / 64);
// y = key/value head (Hk of them), z = batch.
template <typename T>
[[kernel]] void attention_bwd_dkdv(device const T* d_output [[buffer(0)]],
                                   device const T* query [[buffer(1)]],
                                   device const T* key [[buffer(2)]],
                                   device const T* value [[buffer(3)]],
                                   device const bool* mask [[buffer(4)]],
                                   device const T* output [[buffer(5)]],
                                   device const float* lse [[buffer(6)]],
                                   device const uint* seed [[buffer(7)]],
                                   device T* d_key [[buffer(8)]],
                                   device T* d_value [[buffer(9)]],
                                   constant tfm_attention_params& p [[buffer(10)]],
                                   TFM_KERNEL_BUILTINS) {
  threadgroup float a_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK];
  threadgroup float b_st[TFM_ATTN_BLOCK_K * TFM_ATTN_KEY_STRIDE];
  threadgroup float p_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_BLOCK_K];
  threadgroup float ds_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_BLOCK_K];
  threadgroup float q_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK];
  threadgroup float do_st[TFM_ATTN_BLOCK_Q * TFM_ATTN_CHUNK];
  const uint tid = lid.x;
  const uint b = tgid.z, hk = tgid.y;
  const uint chunks = attention_ceil_div(tfm_max(p.d, p.dv), TFM_ATTN_CHUNK);
  const uint kt = tgid.x / chunks;
  const uint c0 = (tgid.x % chunks) * TFM_ATTN_CHUNK;
  const uint k0 = kt * TFM_ATTN_BLOCK_K;
  const uint keys = tfm_min(TFM_ATTN_BLOCK_K, p.tk - k0);
  const uint groups = p.heads / p.kv_heads;  // the query heads reading this key/value head
  const dropout_stream stream = attn_dropout_stream(seed, p);

  // This thread's elements of the [32 keys, 64 dims] chunk: key tid / 64 + 2 n, dim tid % 64.
  constexpr uint kPerThread = TFM_ATTN_BLOCK_K * TFM_ATTN_CHUNK / TFM_ATTN_THREADS;
  constexpr uint kKeyStep = TFM_ATTN_THREADS / TFM_ATTN_CHUNK;
  const uint col = tid % TFM_ATTN_CHUNK;
  float dk[kPerThread];
  float dv[kPerThread];
  for (uint n = 0; n < kPerThread; ++n) {
    dk[n] = 0.0f;
    dv[n] = 0.0f;
  }

  // Causal: query rows before k0 attend no key of this tile; a window: nor rows past its end.
  const uint query_tiles = attn_query_tiles_end(p, k0, keys);
  const ulong q_stride = attn_q_stride(p, p.d), do_stride = attn_q_stride(p, p.dv);
  for (uint g = 0; g < groups; ++g) {
    const uint h = hk * groups + g;
    const ulong q_head = attn_q_offset(p, b, h, p.d), do_head = attn_q_offset(p, b, h, p.dv);
    for (uint qt = attn_first_query_tile(p, k0); qt < query_tiles; ++qt) {
      const uint q0 = qt * TFM_ATTN_BLOCK_Q;
      const uint rows = tfm_min(TFM_ATTN_BLOCK_Q, p.tq - q0);
      const ulong do_tile = do_head + q0 * do_stride;  // of d_output and output
      // Dr of the query tile, recomputed here rather than stored (no scratch tensor).
      float dr[TFM_ATTN_ROWS_PER_SIMD];
      attn_rows_dr(d_output + do_tile, output + do_tile, do_stride, rows, p.dv, simd_lane, simd_id, dr);
      attn_tile_p_ds(query, key, value, mask, d_output, lse, dr, stream, p, b, h, q0, rows, k0, keys, a_st, b_st, p_st,
                     ds_st, tid, simd_lane, simd_id);
      // The chunk's columns of Q and dO for this query tile (the staging's
      // barriers publish p_st / ds_st too).
      attn_stage_chunk(query + q_head + q0 * q_stride, q_stride, rows, TFM_ATTN_BLOCK_Q, p.d, c0, q_st, TFM_ATTN_CHUNK,
                       tid);
      attn_stage_chunk(d_output + do_tile, do_stride, rows, TFM_ATTN_BLOCK_Q, p.dv, c0, do_st, TFM_ATTN_CHUNK, tid);
      for (uint n = 0; n < kPerThread; ++n) {
        const uint jj = tid / TFM_ATTN_CHUNK + kKeyStep * n;
        float sum_dk = 0.0f;
        float sum_dv = 0.0f;
        for (uint row = 0; row < TFM_ATTN_BLOCK_Q; ++row) {
          sum_dk += ds_st[row * TFM_ATTN_BLOCK_K + jj] * q_st[row * TFM_ATTN_CHUNK + col];
          sum_dv += p_st[row * TFM_ATTN_BLOCK_K + jj] * do_st[row * TFM_ATTN_CHUNK + col];
        }
        dk[n] += sum_dk;
        dv[n] += sum_dv;
      }
    }
  }  // query heads of the key/value head

  const ulong dk_head = attn_kv_offset(p, b, hk, p.d), dk_stride = attn_kv_stride(p, p.d);
  const ulong dv_head = attn_kv_offset(p, b, hk, p.dv), dv_stride = attn_kv_stride(p, p.dv);
  for (uint n = 0; n < kPerThread; ++n) {
    const uint jj = tid / TFM_ATTN_CHUNK + kKeyStep * n;
    if (jj >= keys) continue;
    const uint j = k0 + jj;
    if (c0 + col < p.d) d_key[dk_head + j * dk_stride + c0 + col] = static_cast<T>(p.scale * dk[n]);
    if (c0 + col < p.dv) d_value[dv_head + j * dv_stride + c0 + col] = static_cast<T>(dv[n]);
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_ATTENTION_KERNELS_H_
