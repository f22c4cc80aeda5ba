// Metal kernel of the StatelessRandomUniformV2 gap kernel (host code in
// gap_random_metal.mm, math in tfmetal/gap_random.h and tfmetal/philox.h).
//
// One thread per Philox block: thread g computes block counter + g and writes
// outputs 4g .. 4g + 3 (fewer at the end). The host dispatches chunks of
// blocks, each with its counter already advanced to the chunk's first block
// and the output bound at that block's first element.
#ifndef TFMETAL_METAL_GAP_RANDOM_KERNELS_H_
#define TFMETAL_METAL_GAP_RANDOM_KERNELS_H_

#include "tfmetal/gap_random.h"
#include "tfmetal/philox.h"
#include "tfmetal/portable.h"

// setBytes data of gap_random_uniform.
struct tfm_gap_uniform_params {
  uint32_t n;              // outputs in this dispatch
  uint32_t blocks;         // ceil(n / 4): threads that write
  uint32_t counter[4];     // the counter of this dispatch's first block
  uint32_t key[2];
  uint32_t mantissa_bits;  // 23 float, 10 half, 7 bfloat16
  uint32_t pad;
};
static_assert(sizeof(tfm_gap_uniform_params) == 40, "tfm_gap_uniform_params layout is shared with the host");

#if TFM_METAL

template <typename T>
[[kernel]] void gap_random_uniform(device T* y [[buffer(0)]],
                                   constant tfm_gap_uniform_params& p [[buffer(1)]],
                                   TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.blocks) return;
  tfm_philox_block c;
  c.w[0] = p.counter[0];
  c.w[1] = p.counter[1];
  c.w[2] = p.counter[2];
  c.w[3] = p.counter[3];
  const tfm_philox_block b = tfm_philox4x32(tfm_philox_skip(c, gid.x), p.key[0], p.key[1]);
  const uint first = gid.x * 4;
  for (uint j = 0; j < 4; ++j) {
    if (first + j < p.n) y[first + j] = static_cast<T>(gap_uniform_from_word(b.w[j], p.mantissa_bits));
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_RANDOM_KERNELS_H_
