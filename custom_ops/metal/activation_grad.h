// Metal kernels of TfmetalExt>ActivationGrad and TfmetalExt>GatedActivationGrad (instantiated in
// activation_grad.metal; host code in activation_grad_metal.mm).
//
// Elementwise over contiguous buffers: one thread per element, launched with
// dispatchThreads (edge threadgroups smaller), so `gid.x < p.n` is the only
// guard. Math in float through the shared header, as the CPU kernel does:
// same results bit for bit for every dtype (half and bfloat round once, to
// nearest even, when the float result is stored). The activation is a
// uniform in the params: every thread of a dispatch takes the same branch.
//
// The params struct is also compiled by the host (.mm, plain C++ mode of
// portable.h), so both sides agree on its layout.
#ifndef TFMETAL_METAL_ACTIVATION_GRAD_KERNELS_H_
#define TFMETAL_METAL_ACTIVATION_GRAD_KERNELS_H_

#include "tfmetal/activation_grad.h"
#include "tfmetal/portable.h"

// setBytes data of the kernel ([[buffer(3)]]).
struct tfm_activation_grad_params {
  uint32_t n;          // elements in this dispatch (the host splits larger tensors)
  int32_t activation;  // a TFM_ACTGRAD_* code (checked by the host)
};
static_assert(sizeof(tfm_activation_grad_params) == 8, "tfm_activation_grad_params layout is shared with the host");

#if TFM_METAL

// dx = dy * act'(x). dx may alias dy (the host forwards dy's buffer when it can).
template <typename T>
[[kernel]] void activation_grad_kernel(device const T* dy [[buffer(0)]],
                                       device const T* x [[buffer(1)]],
                                       device T* dx [[buffer(2)]],
                                       constant tfm_activation_grad_params& p [[buffer(3)]],
                                       TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint i = gid.x;
  dx[i] = static_cast<T>(activation_grad(p.activation, static_cast<float>(dy[i]), static_cast<float>(x[i])));
}

// d_gate = dy * up * act'(gate), d_up = dy * act(gate) (the backward of act(gate) * up). d_gate may
// alias dy or gate, d_up may alias up (the host forwards buffers when it can): each thread reads its
// element of every input before it writes.
template <typename T>
[[kernel]] void gated_activation_grad_kernel(device const T* dy [[buffer(0)]],
                                             device const T* gate [[buffer(1)]],
                                             device const T* up [[buffer(2)]],
                                             device T* d_gate [[buffer(3)]],
                                             device T* d_up [[buffer(4)]],
                                             constant tfm_activation_grad_params& p [[buffer(5)]],
                                             TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint i = gid.x;
  float dg, du;
  gated_activation_grad(p.activation, static_cast<float>(dy[i]), static_cast<float>(gate[i]),
                        static_cast<float>(up[i]), &dg, &du);
  d_gate[i] = static_cast<T>(dg);
  d_up[i] = static_cast<T>(du);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_ACTIVATION_GRAD_KERNELS_H_
