// Metal kernel of TfmetalExt>MultiTensorRMSprop (instantiated in
// multi_tensor_rmsprop.metal; host code in multi_tensor_rmsprop_metal.mm).
//
// The structure of multi_tensor_lion.h: multi_tensor_rmsprop<T> updates one
// contiguous chunk of one variable and its slots, one thread per element
// (dispatchThreads, guard gid.x < p.n); the host encodes one dispatch per
// variable (per chunk of at most 2^30 elements, via buffer offsets) into ONE
// compute encoder. The scalars (lr, rho, one_minus_rho, momentum, epsilon,
// weight_decay_rate) stay in device memory; every thread reads them and
// updates its element with tfm_rmsprop_update, rounding every intermediate
// to T like TF's ops (tfmetal/rmsprop.h): bitwise the CPU kernel's results
// given correctly rounded sqrt and division (the host compiles with fast
// math off).
//
// With a loss scale (p.has_scale) the runner first encodes the finite check
// of multi_tensor_check.h, and every thread returns at once if it found a
// non-finite gradient element, else divides its gradient element by
// scale[0], as in multi_tensor_adam.h.
#ifndef TFMETAL_METAL_MULTI_TENSOR_RMSPROP_KERNELS_H_
#define TFMETAL_METAL_MULTI_TENSOR_RMSPROP_KERNELS_H_

#include "multi_tensor_check.h"  // the finite check that runs first with a loss scale
#include "tfmetal/loss_scale.h"
#include "tfmetal/portable.h"
#include "tfmetal/rmsprop.h"

// setBytes data ([[buffer(11)]]), one per dispatch (shared with the host).
struct tfm_multi_tensor_rmsprop_params {
  uint32_t n;             // elements in this dispatch
  uint32_t has_decay;     // 1: weight_decay_rate is bound (decoupled weight decay first)
  uint32_t centered;      // 1: mg is bound and updated
  uint32_t has_momentum;  // 1: mom is bound and updated
  uint32_t has_scale;     // 1: scale and found are bound (loss scaling, as in multi_tensor_adam.h)
};
static_assert(sizeof(tfm_multi_tensor_rmsprop_params) == 20,
              "tfm_multi_tensor_rmsprop_params layout is shared with the host");

#if TFM_METAL

// R::round for tfm_rmsprop_update: float -> T -> float (identity for float).
// The same four lines as in multi_tensor_lion.h, repeated so this kernel's
// embedded source does not pull in another kernel.
template <typename T>
struct tfm_metal_rmsprop_round {
  static TFM_INLINE float round(float x) { return static_cast<float>(static_cast<T>(x)); }
};
template <>
struct tfm_metal_rmsprop_round<float> {
  static TFM_INLINE float round(float x) { return x; }
};

// mom, mg, weight_decay_rate, scale and found are always bound (the host
// binds placeholders when the op has none) and touched only when p says they
// are used.
template <typename T>
[[kernel]] void multi_tensor_rmsprop(device T* var [[buffer(0)]],
                                     device T* ms [[buffer(1)]],
                                     device T* mom [[buffer(2)]],
                                     device T* mg [[buffer(3)]],
                                     device const T* grad [[buffer(4)]],
                                     device const T* lr [[buffer(5)]],
                                     device const T* rho [[buffer(6)]],
                                     device const T* one_minus_rho [[buffer(7)]],
                                     device const T* momentum [[buffer(8)]],
                                     device const T* epsilon [[buffer(9)]],
                                     device const T* weight_decay_rate [[buffer(10)]],
                                     constant tfm_multi_tensor_rmsprop_params& p [[buffer(11)]],
                                     device const float* scale [[buffer(12)]],
                                     device const uint* found [[buffer(13)]],
                                     TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const int has_scale = p.has_scale != 0 ? 1 : 0;
  if (has_scale && found[0] != 0u) return;  // a non-finite gradient somewhere: the step writes nothing
  typedef tfm_metal_rmsprop_round<T> R;
  const int has_decay = p.has_decay != 0 ? 1 : 0;
  const int centered = p.centered != 0 ? 1 : 0;
  const int has_momentum = p.has_momentum != 0 ? 1 : 0;
  const float decay_rate = has_decay ? static_cast<float>(weight_decay_rate[0]) : 0.0f;
  const tfm_rmsprop_coeffs coeffs = tfm_rmsprop_make_coeffs(
      static_cast<float>(lr[0]), static_cast<float>(rho[0]), static_cast<float>(one_minus_rho[0]),
      static_cast<float>(momentum[0]), static_cast<float>(epsilon[0]), has_decay, decay_rate, centered, has_momentum);
  const uint i = gid.x;
  const float mg_in = centered ? static_cast<float>(mg[i]) : 0.0f;
  const float m_in = has_momentum ? static_cast<float>(mom[i]) : 0.0f;
  const float g = has_scale ? tfm_unscale_gradient<R>(static_cast<float>(grad[i]), scale[0])
                            : static_cast<float>(grad[i]);
  const tfm_rmsprop_state s =
      tfm_rmsprop_update<R>(static_cast<float>(var[i]), static_cast<float>(ms[i]), mg_in, m_in, g, coeffs);
  var[i] = static_cast<T>(s.var);
  ms[i] = static_cast<T>(s.v);
  if (centered) mg[i] = static_cast<T>(s.mg);
  if (has_momentum) mom[i] = static_cast<T>(s.m);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_MULTI_TENSOR_RMSPROP_KERNELS_H_
