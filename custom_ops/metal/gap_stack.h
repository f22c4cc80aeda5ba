// Metal kernel of the Pack and Unpack gap kernels (host code in
// gap_stack_metal.mm; index mapping in tfmetal/gap_stack.h).
//
// One dispatch per stacked tensor k, one thread per element of it: Pack
// copies tensor k into the stack, Unpack copies it out. Chunks of a tensor
// bind the tensor's buffer at the chunk and pass its first element's index.
#ifndef TFMETAL_METAL_GAP_STACK_KERNELS_H_
#define TFMETAL_METAL_GAP_STACK_KERNELS_H_

#include "tfmetal/gap_stack.h"
#include "tfmetal/portable.h"

struct tfm_gap_stack_params {
  uint32_t n;          // elements of tensor k in this dispatch
  uint32_t pack;       // 1: tensor -> stack (Pack); 0: stack -> tensor (Unpack)
  uint32_t start_lo;   // index in tensor k of this dispatch's first element (64-bit)
  uint32_t start_hi;
  uint32_t k;          // which tensor
  uint32_t n_tensors;  // N
  uint32_t inner_lo;   // prod(S[axis:]) (64-bit)
  uint32_t inner_hi;
};
static_assert(sizeof(tfm_gap_stack_params) == 32, "tfm_gap_stack_params layout is shared with the host");

#if TFM_METAL

// `tensor` is bound at this dispatch's first element, `stack` at its start.
template <typename U>
[[kernel]] void gap_stack_copy(device U* tensor [[buffer(0)]],
                               device U* stack [[buffer(1)]],
                               constant tfm_gap_stack_params& p [[buffer(2)]],
                               TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint64_t t = ((static_cast<uint64_t>(p.start_hi) << 32) | p.start_lo) + gid.x;
  const uint64_t inner = (static_cast<uint64_t>(p.inner_hi) << 32) | p.inner_lo;
  const uint64_t s = gap_stack_index(t, p.k, p.n_tensors, inner);
  if (p.pack != 0) {
    stack[s] = tensor[gid.x];
  } else {
    tensor[gid.x] = stack[s];
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_STACK_KERNELS_H_
