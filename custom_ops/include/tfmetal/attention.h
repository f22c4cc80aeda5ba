// Softmax attention (TfmetalExt>Attention / TfmetalExt>AttentionGrad): the
// per-element math and the tile ranges, shared by the CPU kernel and the Metal
// kernel (see tfmetal/portable.h).
//
// Per query row i, over the keys j it attends (attention_attends), in float32
// whatever the input dtype, with s_ij = scale * q_i . k_j:
//   forward (online softmax over key tiles):
//     m' = max(m, max_j s_ij)          running max (starts at -inf)
//     a  = exp(m - m')                 rescale of the running sum and output
//     l' = a * l + sum_j exp(s_ij - m')
//     o' = a * o + sum_j exp(s_ij - m') v_j
//     finally out_i = o / l and lse_i = m + log(l); a row attending no key has
//     l = 0: out_i = 0 and lse_i = -inf.
//   backward, from the saved lse:
//     p_ij = exp(s_ij - lse_i)         0 where masked out, and for lse = -inf
//     Dr_i = dO_i . out_i,  dp_ij = dO_i . v_j,  ds_ij = p_ij (dp_ij - Dr_i)
//     dQ = scale * ds K,  dK = scale * ds^T Q,  dV = p^T dO.
// Causal is top-left aligned: key j is attended by query i only if j <= i.
// A sliding window w > 0 (0: none) keeps the keys within w - 1 positions of
// the query on either side, |i - j| < w: with causal, the w keys i - w + 1 .. i
// (Mistral's, Gemma's and Qwen's band), also top-left aligned.
//
// Grouped-query attention: key and value have Hk heads, Hk dividing the H
// query heads; query head h reads key/value head h / (H / Hk), so consecutive
// query heads share one (keras-hub's repeat of the key/value heads). dK and dV
// of a key/value head sum over the query heads that read it.
//
// Attention dropout (dropout rate r > 0): the normalized probabilities are
// dropped, p_ij -> p_ij * m_ij with m_ij = keep_ij ? s_d : 0 and s_d =
// 1 / (1 - r); the online softmax (running max, sum, lse) is of the undropped
// scores. keep_ij is TensorFlow's stateless dropout mask of a [B, H, Tq, Tk]
// tensor (tfmetal/dropout.h): element (b, h, i, j) has the flat index
// n = ((b H + h) Tq + i) Tk + j and is kept when the uniform number of word
// n % 4 of Philox block counter + n / 4 is >= r. r and s_d come as the input
// dtype rounds them, the uniform number from that dtype's mantissa bits, so
// the mask is keras.layers.Dropout's on the (batch, heads, q, kv) scores of
// that dtype, bit for bit. The mask is drawn again in the backward pass,
// never stored:
//     out_i = sum_j p_ij m_ij v_j,  Dr_i = dO_i . out_i (the dropped output),
//     dp_ij = m_ij (dO_i . v_j),    ds_ij = p_ij (dp_ij - Dr_i),
//     dV = (p m)^T dO; dQ and dK from ds as without dropout.
// The kernels own the loops, the tiling and the summation order.
#ifndef TFMETAL_ATTENTION_H_
#define TFMETAL_ATTENTION_H_

#include "tfmetal/dropout.h"
#include "tfmetal/portable.h"

#define TFM_ATTENTION_MAX_HEAD_DIM 256

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif

// Whether query i attends key j: the mask says so, (causal) j <= i and
// (window w > 0) |i - j| < w. Positions and w are < 2^31 (the hosts check),
// so the sums do not wrap.
TFM_INLINE bool attention_attends(bool mask_value, bool causal, uint32_t window, uint32_t i, uint32_t j) {
  return mask_value && (!causal || j <= i) && (window == 0u || (j + window > i && i + window > j));
}

// The key/value head query head h reads (H query heads, Hk key/value heads,
// Hk dividing H).
TFM_INLINE uint32_t attention_kv_head(uint32_t h, uint32_t heads, uint32_t kv_heads) {
  return h / (heads / kv_heads);
}

// ---------------------------------------------------------------- layouts

// Where a head's rows live. Query, key, value, output and their gradients are
// [B, heads, T, width] ("BHSD", layout 0: a head's rows are contiguous) or
// [B, T, heads, width] ("BSHD", layout 1: what a projection to (batch, seq,
// heads, dim) writes, read in place). The mask stays [B, H, Tq, Tk] and lse
// [B, H, Tq] in both; the dropout mask's flat index is of the logical
// (b, h, i, j), so both layouts draw the same mask.
#define TFM_ATTENTION_LAYOUT_BHSD 0u
#define TFM_ATTENTION_LAYOUT_BSHD 1u

// The element offset of row 0 of head h of batch b in a tensor of `heads`
// heads, `t` rows per head and `width` elements per row.
TFM_INLINE uint64_t attention_head_offset(uint32_t layout, uint32_t b, uint32_t h, uint32_t heads, uint32_t t,
                                          uint32_t width) {
  const uint64_t batch = static_cast<uint64_t>(b) * heads * t * width;
  return layout == TFM_ATTENTION_LAYOUT_BSHD ? batch + static_cast<uint64_t>(h) * width
                                             : batch + static_cast<uint64_t>(h) * t * width;
}

// The heads axis of query, key and value (and the output and gradients) in
// `layout`; the sequence axis is the other of 1 and 2.
TFM_INLINE int attention_heads_axis(uint32_t layout) { return layout == TFM_ATTENTION_LAYOUT_BSHD ? 2 : 1; }

// The element stride between consecutive rows of one head.
TFM_INLINE uint64_t attention_row_stride(uint32_t layout, uint32_t heads, uint32_t width) {
  return layout == TFM_ATTENTION_LAYOUT_BSHD ? static_cast<uint64_t>(heads) * width : static_cast<uint64_t>(width);
}

// The running max after a tile whose (masked) max score is tile_max.
TFM_INLINE float attention_new_max(float running_max, float tile_max) { return tfm_max(running_max, tile_max); }

// The factor the running sum and output are multiplied by when the max moves
// from running_max to new_max (1 while nothing is attended yet; 0 for the
// first attended tile, whose running sum and output are 0 anyway).
TFM_INLINE float attention_rescale(float running_max, float new_max) {
  return new_max == -INFINITY ? 1.0f : tfm_exp(running_max - new_max);
}

// exp(s - max) of a score: 0 for a masked score s = -inf (also when nothing
// is attended yet, max = -inf). The test is on the score, not the max, so a
// NaN score gives NaN, which reaches the row's sum, output and lse as it does
// in a softmax.
TFM_INLINE float attention_weight(float score, float running_max) {
  return score == -INFINITY ? 0.0f : tfm_exp(score - running_max);
}

// The row's log-sum-exp at the end: -inf for a row that attends no key.
TFM_INLINE float attention_lse(float running_max, float running_sum) {
  return running_sum == 0.0f ? -INFINITY : running_max + tfm_log(running_sum);  // NaN stays NaN
}

// 1 / running_sum, or 0 for a row that attends no key (its output is 0).
TFM_INLINE float attention_inv_sum(float running_sum) { return running_sum == 0.0f ? 0.0f : 1.0f / running_sum; }

// The probability in the backward pass, from the saved lse (0 for a row that
// attends no key, and for a masked score s = -inf).
TFM_INLINE float attention_p(float score, float lse) { return lse == -INFINITY ? 0.0f : tfm_exp(score - lse); }

// d(score) of one element, before the scale: p (dp - Dr).
TFM_INLINE float attention_ds(float p, float dp, float dr) { return p * (dp - dr); }

// ---------------------------------------------------------------- dropout

// The flat index of (b, h, i, j) in the [B, H, Tq, Tk] mask: the element's
// position in TensorFlow's stateless random stream.
TFM_INLINE uint64_t attention_dropout_index(uint32_t b, uint32_t h, uint32_t i, uint32_t j, uint32_t heads,
                                            uint32_t tq, uint32_t tk) {
  return ((static_cast<uint64_t>(b) * heads + h) * tq + i) * static_cast<uint64_t>(tk) + j;
}

// Whether the element drawing Philox output `word` is kept: its uniform number
// in [0, 1) (the low `mantissa_bits` of the word) is >= rate.
TFM_INLINE bool attention_dropout_keeps(uint32_t word, uint32_t mantissa_bits, float rate) {
  return gap_uniform_from_word(word, mantissa_bits) >= rate;
}

// Whether the element at flat index n of the mask is kept (one Philox block:
// kernels that visit 4 consecutive elements may draw the block once, with
// dropout_block(stream, n / 4), and pick word n % 4 themselves).
TFM_INLINE bool attention_dropout_keeps_at(dropout_stream stream, uint64_t n, uint32_t mantissa_bits, float rate) {
  const tfm_philox_block block = dropout_block(stream, n / 4u);
  return attention_dropout_keeps(block.w[static_cast<uint32_t>(n % 4u)], mantissa_bits, rate);
}

// x * m_ij: a kept element times the dropout scale, a dropped one 0. A select,
// not a product with 0: a float16 scale may be inf (a rate rounded to 1, where
// nothing is kept) and a NaN probability stays out of a dropped element, as in
// TensorFlow's dropout.
TFM_INLINE float attention_dropout_apply(float x, bool keep, float dropout_scale) {
  return keep ? x * dropout_scale : 0.0f;
}

// ---------------------------------------------------------------- tile ranges

TFM_INLINE uint32_t attention_ceil_div(uint32_t a, uint32_t b) { return (a + b - 1u) / b; }

// The first key any of the query rows [q0, ...) attends: 0, or with a window
// w the key q0 - w + 1 (0 when that is negative).
TFM_INLINE uint32_t attention_key_begin(uint32_t window, uint32_t q0) {
  return (window == 0u || q0 < window) ? 0u : q0 - window + 1u;
}

// The end of the keys the query rows [q0, q0 + rows) attend at most: every
// key, with causal the keys j <= q0 + rows - 1, with a window w the keys
// j < q0 + rows - 1 + w.
TFM_INLINE uint32_t attention_key_end(bool causal, uint32_t window, uint32_t q0, uint32_t rows, uint32_t tk) {
  if (rows == 0u) return 0u;
  uint32_t end = tk;
  if (causal) end = tfm_min(end, q0 + rows);
  if (window != 0u) end = tfm_min(end, q0 + rows - 1u + window);
  return end;
}

// The first query row that attends any key of [k0, ...): 0, with causal k0,
// with a window w (and no causality) k0 - w + 1 (0 when negative).
TFM_INLINE uint32_t attention_query_begin(bool causal, uint32_t window, uint32_t k0) {
  if (causal) return k0;
  return attention_key_begin(window, k0);
}

// The end of the query rows that attend any key of [k0, k0 + keys): tq, or
// with a window w the rows i < k0 + keys - 1 + w.
TFM_INLINE uint32_t attention_query_end(uint32_t window, uint32_t k0, uint32_t keys, uint32_t tq) {
  if (window == 0u || keys == 0u) return tq;
  return tfm_min(tq, k0 + keys - 1u + window);
}

// Whether causality and the window mask nothing in the tile of query rows
// [q0, q0 + rows) and keys [k0, k0 + keys): every key j <= every row i (with
// causal), and every |i - j| < w (with a window w).
TFM_INLINE bool attention_tile_unmasked(bool causal, uint32_t window, uint32_t q0, uint32_t rows, uint32_t k0,
                                        uint32_t keys) {
  if (keys == 0u || rows == 0u) return true;
  const uint32_t last_q = q0 + rows - 1u, last_k = k0 + keys - 1u;
  if (causal && last_k > q0) return false;
  if (window != 0u && (last_q >= k0 + window || last_k >= q0 + window)) return false;
  return true;
}

#endif  // TFMETAL_ATTENTION_H_
