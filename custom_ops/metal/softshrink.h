// Metal kernels of TfmetalExt>Softshrink and TfmetalExt>SoftshrinkGrad
// (instantiated in softshrink.metal; host code in softshrink_metal.mm).
//
// Elementwise over one contiguous buffer: one thread per element, launched
// with dispatchThreads (edge threadgroups smaller), so `gid.x < p.n` is the
// only guard. Math in float through the shared header, as the CPU kernel
// does: same results bit for bit for every dtype (half and bfloat round once,
// to nearest even, when the float result is stored).
//
// The params struct is also compiled by the host (.mm, plain C++ mode of
// portable.h), so both sides agree on its layout.
#ifndef TFMETAL_METAL_SOFTSHRINK_KERNELS_H_
#define TFMETAL_METAL_SOFTSHRINK_KERNELS_H_

#include "tfmetal/portable.h"
#include "tfmetal/softshrink.h"

// setBytes data of both kernels ([[buffer(2)]] forward, [[buffer(3)]] grad).
struct tfm_softshrink_params {
  uint32_t n;   // elements in this dispatch (the host splits larger tensors)
  float lambd;  // threshold, finite and >= 0 (checked by the host)
};
static_assert(sizeof(tfm_softshrink_params) == 8, "tfm_softshrink_params layout is shared with the host");

#if TFM_METAL

// y = softshrink(x). y may alias x (the host forwards x's buffer when it can).
template <typename T>
[[kernel]] void softshrink(device const T* x [[buffer(0)]],
                           device T* y [[buffer(1)]],
                           constant tfm_softshrink_params& p [[buffer(2)]],
                           TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<T>(softshrink_forward(static_cast<float>(x[gid.x]), p.lambd));
}

// dx = dy where |x| > lambd, else 0 (NaN for NaN x). dx may alias dy.
template <typename T>
[[kernel]] void softshrink_grad(device const T* dy [[buffer(0)]],
                                device const T* x [[buffer(1)]],
                                device T* dx [[buffer(2)]],
                                constant tfm_softshrink_params& p [[buffer(3)]],
                                TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint i = gid.x;
  dx[i] = static_cast<T>(softshrink_backward(static_cast<float>(dy[i]), static_cast<float>(x[i]), p.lambd));
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_SOFTSHRINK_KERNELS_H_
