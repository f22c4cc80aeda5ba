// Metal kernel of TfmetalExt>MultiTensorAdam (instantiated in
// multi_tensor_adam.metal; host code in multi_tensor_adam_metal.mm).
//
// multi_tensor_adam<T> updates one contiguous chunk of one variable and its
// slots, one thread per element (dispatchThreads, guard gid.x < p.n). The
// host encodes one dispatch per variable (per chunk of at most 2^30
// elements, via buffer offsets) into ONE compute encoder; see the .mm for
// why that, not apex's single launch over a table of tensors, is the Metal
// equivalent.
//
// The scalars (lr, beta1, ...) stay in device memory, where the optimizer
// computes them: reading them on the host would wait for the GPU every step.
// Every thread derives the step's coefficients from them with
// tfm_adam_make_coeffs (a few float ops, identical in every thread), then
// updates its element with tfm_adam_update, rounding every intermediate to T
// like TF's kernels (tfmetal/adam.h): bitwise the CPU kernel's results, given
// IEEE float division and square root (the host compiles with fast math off).
//
// With a loss scale (p.has_scale) the runner first encodes the finite check
// of multi_tensor_check.h; every thread here then returns at once if it found
// a non-finite gradient element (found[0] != 0), and otherwise divides its
// gradient element by scale[0] (tfm_unscale_gradient, tfmetal/loss_scale.h).
#ifndef TFMETAL_METAL_MULTI_TENSOR_ADAM_KERNELS_H_
#define TFMETAL_METAL_MULTI_TENSOR_ADAM_KERNELS_H_

#include "multi_tensor_check.h"  // the finite check that runs first with a loss scale
#include "tfmetal/adam.h"
#include "tfmetal/loss_scale.h"
#include "tfmetal/portable.h"

// setBytes data ([[buffer(12)]]), one per dispatch (shared with the host).
struct tfm_multi_tensor_adam_params {
  uint32_t n;          // elements in this dispatch
  uint32_t amsgrad;    // 1: vhat is bound and updated (ResourceApplyAdamWithAmsgrad)
  uint32_t has_decay;  // 1: weight_decay_rate is bound (decoupled weight decay first)
  uint32_t has_scale;  // 1: scale and found are bound (loss scaling)
};
static_assert(sizeof(tfm_multi_tensor_adam_params) == 16,
              "tfm_multi_tensor_adam_params layout is shared with the host");

#if TFM_METAL

// R::round for tfm_adam_*: float -> T -> float (identity for float).
template <typename T>
struct tfm_metal_adam_round {
  static TFM_INLINE float round(float x) { return static_cast<float>(static_cast<T>(x)); }
};
template <>
struct tfm_metal_adam_round<float> {
  static TFM_INLINE float round(float x) { return x; }
};

// vhat, weight_decay_rate, scale and found are always bound (the host binds a
// placeholder buffer when the op has none) and read only when p.amsgrad /
// p.has_decay / p.has_scale.
template <typename T>
[[kernel]] void multi_tensor_adam(device T* var [[buffer(0)]],
                                  device T* m [[buffer(1)]],
                                  device T* v [[buffer(2)]],
                                  device T* vhat [[buffer(3)]],
                                  device const T* grad [[buffer(4)]],
                                  device const T* lr [[buffer(5)]],
                                  device const T* beta1 [[buffer(6)]],
                                  device const T* beta2 [[buffer(7)]],
                                  device const T* epsilon [[buffer(8)]],
                                  device const T* beta1_power [[buffer(9)]],
                                  device const T* beta2_power [[buffer(10)]],
                                  device const T* weight_decay_rate [[buffer(11)]],
                                  constant tfm_multi_tensor_adam_params& p [[buffer(12)]],
                                  device const float* scale [[buffer(13)]],
                                  device const uint* found [[buffer(14)]],
                                  TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const int has_scale = p.has_scale != 0 ? 1 : 0;
  if (has_scale && found[0] != 0u) return;  // a non-finite gradient somewhere: the step writes nothing
  typedef tfm_metal_adam_round<T> R;
  const int has_decay = p.has_decay != 0 ? 1 : 0;
  const float decay_rate = has_decay ? static_cast<float>(weight_decay_rate[0]) : 0.0f;
  const tfm_adam_coeffs coeffs = tfm_adam_make_coeffs<R>(
      static_cast<float>(lr[0]), static_cast<float>(beta1[0]), static_cast<float>(beta2[0]),
      static_cast<float>(epsilon[0]), static_cast<float>(beta1_power[0]), static_cast<float>(beta2_power[0]),
      has_decay, decay_rate);
  const uint i = gid.x;
  const int amsgrad = p.amsgrad != 0 ? 1 : 0;
  const float vhat_i = amsgrad ? static_cast<float>(vhat[i]) : 0.0f;
  const float g = has_scale ? tfm_unscale_gradient<R>(static_cast<float>(grad[i]), scale[0])
                            : static_cast<float>(grad[i]);
  const tfm_adam_state s = tfm_adam_update<R>(static_cast<float>(var[i]), static_cast<float>(m[i]),
                                              static_cast<float>(v[i]), vhat_i, g, coeffs, amsgrad);
  var[i] = static_cast<T>(s.var);
  m[i] = static_cast<T>(s.m);
  v[i] = static_cast<T>(s.v);
  if (amsgrad) vhat[i] = static_cast<T>(s.vhat);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_MULTI_TENSOR_ADAM_KERNELS_H_
