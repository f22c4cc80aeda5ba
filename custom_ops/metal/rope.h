// Metal kernels of TfmetalExt>Rope and TfmetalExt>RopeGrad
// (instantiated in rope.metal; host code in rope_metal.mm).
//
// One thread per feature pair (x1[i], x2[i]) of a row, over all
// batch * sequence * inner * half pairs, launched with dispatchThreads in
// chunks of at most 2^30 threads; `first` is the chunk's first pair, so the
// buffers stay bound at their start. Each thread computes its pair's cos/sin
// (the CPU kernel computes a row's once and reuses them over the heads: same
// values) and the rotation from tfmetal/rope.h in float32, rounding once to
// T when it stores. With fast math off (metal_helper.mm) Metal's cos/sin are
// its precise ones; they may differ from the CPU's libm by an ulp, so GPU
// and CPU results agree to that, not always bit for bit.
//
// The params struct is also compiled by the host (.mm, plain C++ mode of
// portable.h), so both sides agree on its layout.
#ifndef TFMETAL_METAL_ROPE_KERNELS_H_
#define TFMETAL_METAL_ROPE_KERNELS_H_

#include "tfmetal/portable.h"
#include "tfmetal/rope.h"

// setBytes data of both kernels ([[buffer(4)]]).
struct tfm_rope_params {
  uint32_t count;     // pairs in this dispatch (<= 2^30)
  uint32_t first_lo;  // index of this dispatch's first pair, low and high 32 bits
  uint32_t first_hi;
  uint32_t half;      // pairs per row: features / 2
  uint32_t inner;     // rows per (batch, sequence) position: the heads
  uint32_t sequence;  // the sequence length
  uint32_t position_batch_stride;  // sequence when positions is [batch > 1, sequence], else 0
  float scale;        // multiplies cos and sin (finite; 1 unless YaRN)
};
static_assert(sizeof(tfm_rope_params) == 32, "tfm_rope_params layout is shared with the host");

#if TFM_METAL

// Forward (y = R x) or gradient (dx = R^T dy). out may alias in: a pair's
// two elements are read by the thread that writes them, before it writes.
template <typename T, bool kBack>
TFM_INLINE void rope_pair(device const T* in, device const float* positions, device const float* inv_freq,
                          device T* out, constant tfm_rope_params& p, uint gid) {
  if (gid >= p.count) return;
  const ulong pair = ((static_cast<ulong>(p.first_hi) << 32) | p.first_lo) + gid;
  const ulong row = pair / p.half;  // over batch * sequence * inner
  const uint i = static_cast<uint>(pair % p.half);
  const ulong bt = row / p.inner;
  const ulong b = bt / p.sequence;
  const uint t = static_cast<uint>(bt % p.sequence);
  const tfm_rope_cos_sin cs = rope_cos_sin(positions[b * p.position_batch_stride + t], inv_freq[i], p.scale);
  const ulong first = row * (2 * static_cast<ulong>(p.half)) + i;
  const ulong second = first + p.half;
  const float a = static_cast<float>(in[first]);
  const float c = static_cast<float>(in[second]);
  const tfm_rope_pair r = kBack ? rope_rotate_back(a, c, cs) : rope_rotate(a, c, cs);
  out[first] = static_cast<T>(r.first);
  out[second] = static_cast<T>(r.second);
}

// The two kernels bind alike: `in` is x (forward) or dy (gradient), `out` y or dx.
template <typename T>
[[kernel]] void rope(device const T* in [[buffer(0)]],
                     device const float* positions [[buffer(1)]],
                     device const float* inv_freq [[buffer(2)]],
                     device T* out [[buffer(3)]],
                     constant tfm_rope_params& p [[buffer(4)]],
                     TFM_KERNEL_BUILTINS) {
  rope_pair<T, false>(in, positions, inv_freq, out, p, gid.x);
}

template <typename T>
[[kernel]] void rope_grad(device const T* in [[buffer(0)]],
                          device const float* positions [[buffer(1)]],
                          device const float* inv_freq [[buffer(2)]],
                          device T* out [[buffer(3)]],
                          constant tfm_rope_params& p [[buffer(4)]],
                          TFM_KERNEL_BUILTINS) {
  rope_pair<T, true>(in, positions, inv_freq, out, p, gid.x);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_ROPE_KERNELS_H_
