// Metal kernel of TfmetalExt>MultiTensorLion (instantiated in
// multi_tensor_lion.metal; host code in multi_tensor_lion_metal.mm).
//
// The structure of multi_tensor_adam.h: multi_tensor_lion<T> updates one
// contiguous chunk of one variable and its momentum, one thread per element
// (dispatchThreads, guard gid.x < p.n); the host encodes one dispatch per
// variable (per chunk of at most 2^30 elements, via buffer offsets) into ONE
// compute encoder. The scalars (lr, beta1, beta2, weight_decay_rate) stay in
// device memory; every thread derives the coefficients from them with
// tfm_lion_make_coeffs and updates its element with tfm_lion_update, rounding
// every intermediate to T like TF's ops (tfmetal/lion.h): bitwise the CPU
// kernel's results (only +, -, * and comparisons: no fast-math sensitivity
// beyond the host's fast math off).
//
// With a loss scale (p.has_scale) the runner first encodes the finite check
// of multi_tensor_check.h, and every thread returns at once if it found a
// non-finite gradient element, else divides its gradient element by
// scale[0], as in multi_tensor_adam.h.
#ifndef TFMETAL_METAL_MULTI_TENSOR_LION_KERNELS_H_
#define TFMETAL_METAL_MULTI_TENSOR_LION_KERNELS_H_

#include "multi_tensor_check.h"  // the finite check that runs first with a loss scale
#include "tfmetal/lion.h"
#include "tfmetal/loss_scale.h"
#include "tfmetal/portable.h"

// setBytes data ([[buffer(7)]]), one per dispatch (shared with the host).
struct tfm_multi_tensor_lion_params {
  uint32_t n;          // elements in this dispatch
  uint32_t has_decay;  // 1: weight_decay_rate is bound (decoupled weight decay first)
  uint32_t has_scale;  // 1: scale and found are bound (loss scaling, as in multi_tensor_adam.h)
};
static_assert(sizeof(tfm_multi_tensor_lion_params) == 12,
              "tfm_multi_tensor_lion_params layout is shared with the host");

#if TFM_METAL

// R::round for tfm_lion_*: float -> T -> float (identity for float). The same
// four lines as tfm_metal_adam_round in multi_tensor_adam.h, repeated so this
// kernel's embedded source does not pull in the Adam kernel.
template <typename T>
struct tfm_metal_lion_round {
  static TFM_INLINE float round(float x) { return static_cast<float>(static_cast<T>(x)); }
};
template <>
struct tfm_metal_lion_round<float> {
  static TFM_INLINE float round(float x) { return x; }
};

// weight_decay_rate is always bound (the host binds lr as a placeholder when
// the op has none) and read only when p.has_decay.
template <typename T>
[[kernel]] void multi_tensor_lion(device T* var [[buffer(0)]],
                                  device T* m [[buffer(1)]],
                                  device const T* grad [[buffer(2)]],
                                  device const T* lr [[buffer(3)]],
                                  device const T* beta1 [[buffer(4)]],
                                  device const T* beta2 [[buffer(5)]],
                                  device const T* weight_decay_rate [[buffer(6)]],
                                  constant tfm_multi_tensor_lion_params& p [[buffer(7)]],
                                  device const float* scale [[buffer(8)]],
                                  device const uint* found [[buffer(9)]],
                                  TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const int has_scale = p.has_scale != 0 ? 1 : 0;
  if (has_scale && found[0] != 0u) return;  // a non-finite gradient somewhere: the step writes nothing
  typedef tfm_metal_lion_round<T> R;
  const int has_decay = p.has_decay != 0 ? 1 : 0;
  const float decay_rate = has_decay ? static_cast<float>(weight_decay_rate[0]) : 0.0f;
  const tfm_lion_coeffs coeffs = tfm_lion_make_coeffs<R>(static_cast<float>(lr[0]), static_cast<float>(beta1[0]),
                                                         static_cast<float>(beta2[0]), has_decay, decay_rate);
  const uint i = gid.x;
  const float g = has_scale ? tfm_unscale_gradient<R>(static_cast<float>(grad[i]), scale[0])
                            : static_cast<float>(grad[i]);
  const tfm_lion_state s = tfm_lion_update<R>(static_cast<float>(var[i]), static_cast<float>(m[i]), g, coeffs);
  var[i] = static_cast<T>(s.var);
  m[i] = static_cast<T>(s.m);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_MULTI_TENSOR_LION_KERNELS_H_
