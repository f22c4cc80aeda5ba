// Metal kernel of TfmetalExt>Dropout and TfmetalExt>DropoutGrad (instantiated
// in dropout.metal; host code in dropout_metal.mm; math in tfmetal/dropout.h).
//
// One thread per Philox block: thread g draws block first_block + g of the
// seed's stream and maps the 4 elements 4g .. 4g + 3 of its dispatch (fewer at
// the end), exactly as the CPU kernel maps them, so the results are the CPU
// kernel's bit for bit. Both ops are the same map (y = kept ? x * scale : 0,
// of x forward and of dy backward), so they share the kernel.
//
// The seed is read on the GPU (2 int32 or 4 words of 2 int64): it stays in
// device memory, where the step's seed generator leaves it, and the host
// never waits for it. Each thread derives the key and counter from it (one
// more Philox block), which costs less than a round trip through the host.
//
// The params struct is also compiled by the host (.mm, plain C++ mode of
// portable.h), so both sides agree on its layout.
#ifndef TFMETAL_METAL_DROPOUT_KERNELS_H_
#define TFMETAL_METAL_DROPOUT_KERNELS_H_

#include "tfmetal/dropout.h"
#include "tfmetal/portable.h"

// setBytes data of the kernel ([[buffer(3)]]).
struct tfm_dropout_params {
  uint32_t n;               // elements in this dispatch (the host splits larger tensors)
  uint32_t blocks;          // ceil(n / 4): threads that work
  uint32_t first_block[2];  // the stream position of this dispatch's first element / 4 (low, high word)
  uint32_t seed_is_int64;   // 1: the seed is 2 int64 (4 words), 0: 2 int32 (widened with their sign)
  uint32_t mantissa_bits;   // 23 float, 10 half, 7 bfloat16
  float rate;               // keep where the uniform number >= rate (rounded to T by the wrapper)
  float scale;              // 1 / (1 - rate), rounded to T
};
static_assert(sizeof(tfm_dropout_params) == 32, "tfm_dropout_params layout is shared with the host");

#if TFM_METAL

// y = dropout(x). y may alias x (the host forwards x's buffer when it can).
template <typename T>
[[kernel]] void dropout(device const T* x [[buffer(0)]],
                        device const uint* seed [[buffer(1)]],
                        device T* y [[buffer(2)]],
                        constant tfm_dropout_params& p [[buffer(3)]],
                        TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.blocks) return;
  int64_t s0, s1;
  if (p.seed_is_int64 != 0) {
    s0 = static_cast<int64_t>(static_cast<uint64_t>(seed[0]) | (static_cast<uint64_t>(seed[1]) << 32));
    s1 = static_cast<int64_t>(static_cast<uint64_t>(seed[2]) | (static_cast<uint64_t>(seed[3]) << 32));
  } else {
    s0 = static_cast<int64_t>(static_cast<int32_t>(seed[0]));
    s1 = static_cast<int64_t>(static_cast<int32_t>(seed[1]));
  }
  const dropout_stream stream = dropout_stream_from_seed(s0, s1);
  const uint64_t g = (static_cast<uint64_t>(p.first_block[1]) << 32 | p.first_block[0]) + gid.x;
  const tfm_philox_block b = dropout_block(stream, g);
  const uint first = gid.x * 4;
  for (uint j = 0; j < 4; ++j) {
    const uint i = first + j;
    if (i < p.n) y[i] = static_cast<T>(dropout_element(static_cast<float>(x[i]), b.w[j], p.mantissa_bits, p.rate, p.scale));
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_DROPOUT_KERNELS_H_
