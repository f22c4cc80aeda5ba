// The finite check of a loss-scaled multi-tensor update (tfmetal/loss_scale.h)
// on the GPU: kernels shared by multi_tensor_{adam,lion,rmsprop}.metal (each
// library instantiates them beside its update kernel) and encoded by the
// runner in multi_tensor_metal.h. With a `scale`, one op call is, in ONE
// compute encoder and in this order:
//
//   multi_tensor_found_reset          1 thread: found = 0
//   multi_tensor_find_non_finite_<T>  one thread per gradient element (per
//                                     gradient and 2^30-element chunk): found = 1
//                                     where the element is NaN or infinite
//   multi_tensor_found_write          1 thread: found_non_finite (the op's bool
//                                     output) = found != 0
//   <update kernel>_<T>               per variable chunk, as without a scale, but
//                                     every thread returns at once when found != 0
//                                     and unscales its gradient element otherwise
//
// `found` is a 4-byte scratch buffer (the op's temp): the checking threads
// store to it atomically (no two threads race on plain memory), and only
// ever store 1, so the order among them does not matter. The encoder is
// serial (Metal's default dispatch type: a dispatch starts when the one
// before has finished and sees its writes), and the host adds a memory
// barrier on buffers before the first update for good measure: the whole
// check completes before any variable is written, so a non-finite gradient
// anywhere leaves every variable and slot unchanged.
#ifndef TFMETAL_METAL_MULTI_TENSOR_CHECK_KERNELS_H_
#define TFMETAL_METAL_MULTI_TENSOR_CHECK_KERNELS_H_

#include "tfmetal/loss_scale.h"
#include "tfmetal/portable.h"

// setBytes data of multi_tensor_find_non_finite ([[buffer(2)]]), one per dispatch.
struct tfm_multi_tensor_check_params {
  uint32_t n;  // elements in this dispatch
};
static_assert(sizeof(tfm_multi_tensor_check_params) == 4,
              "tfm_multi_tensor_check_params layout is shared with the host");

#if TFM_METAL

[[kernel]] void multi_tensor_found_reset(device atomic_uint* found [[buffer(0)]], TFM_KERNEL_BUILTINS) {
  if (gid.x != 0) return;
  atomic_store_explicit(found, 0u, memory_order_relaxed);
}

template <typename T>
[[kernel]] void multi_tensor_find_non_finite(device const T* grad [[buffer(0)]],
                                             device atomic_uint* found [[buffer(1)]],
                                             constant tfm_multi_tensor_check_params& p [[buffer(2)]],
                                             TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  if (!tfm_gradient_is_finite(static_cast<float>(grad[gid.x]))) atomic_store_explicit(found, 1u, memory_order_relaxed);
}

[[kernel]] void multi_tensor_found_write(device const uint* found [[buffer(0)]],
                                         device uint8_t* found_non_finite [[buffer(1)]],
                                         TFM_KERNEL_BUILTINS) {
  if (gid.x != 0) return;
  found_non_finite[0] = found[0] != 0u ? 1 : 0;
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_MULTI_TENSOR_CHECK_KERNELS_H_
