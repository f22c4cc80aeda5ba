// Dropout with a counter-based mask: the math of TfmetalExt>Dropout and
// TfmetalExt>DropoutGrad, shared by the CPU kernel and the Metal kernel (see
// tfmetal/portable.h).
//
// The mask is TensorFlow's stateless dropout's, bit for bit
// (tf.nn.experimental.stateless_dropout, which keras.layers.Dropout runs on
// the TF backend): the seed (s0, s1) becomes a Philox key and counter as
// StatelessRandomGetKeyCounter makes them (tfmetal/gap_random.h); element i
// draws word i % 4 of Philox block counter + i / 4, made a uniform number in
// [0, 1) from the low mantissa bits of the element's dtype (23 float, 10 half,
// 7 bfloat16) as StatelessRandomUniformV2 does; the element is kept when that
// number is >= rate. A kept element is x * scale, a dropped one +0:
//
//   y_i = u_i >= rate ? x_i * scale : 0
//
// with `rate` and `scale` = 1 / (1 - rate) as the element's dtype rounds them
// (tfmetal_ext.ops.dropout passes them so). The product is computed in float
// and rounded once to the dtype, as TensorFlow's Mul does for half and
// bfloat16. The gradient is the same map applied to dy with the same seed:
// the mask is regenerated, never stored.
#ifndef TFMETAL_DROPOUT_H_
#define TFMETAL_DROPOUT_H_

#include "tfmetal/gap_random.h"
#include "tfmetal/philox.h"
#include "tfmetal/portable.h"

// One element: `word` is its Philox output word. x * scale where kept, +0
// where dropped, selected on bits: g++ keeps a branch for ?: here, which a
// random mask mispredicts (at rate 0.5, half the time).
TFM_INLINE float dropout_element(float x, uint32_t word, uint32_t mantissa_bits, float rate, float scale) {
  const uint32_t keep = 0u - static_cast<uint32_t>(gap_uniform_from_word(word, mantissa_bits) >= rate);
  return tfm_bits_to_float(tfm_float_to_bits(x * scale) & keep);
}

// The Philox key and counter of a seed, from its two words as the seed tensor
// holds them: int64 (wide) or int32 widened with its sign, as TensorFlow does.
struct dropout_stream {
  uint32_t key[2];
  tfm_philox_block counter;
};

TFM_INLINE dropout_stream dropout_stream_from_seed(int64_t s0, int64_t s1) {
  dropout_stream s;
  uint32_t counter[4];
  gap_key_counter_from_seed(static_cast<uint64_t>(s0), static_cast<uint64_t>(s1), s.key, counter);
  for (int w = 0; w < 4; ++w) s.counter.w[w] = counter[w];
  return s;
}

// Philox block `g` of the stream: the words of elements 4g .. 4g + 3.
TFM_INLINE tfm_philox_block dropout_block(dropout_stream s, uint64_t g) {
  return tfm_philox4x32(tfm_philox_skip(s.counter, g), s.key[0], s.key[1]);
}

#endif  // TFMETAL_DROPOUT_H_
