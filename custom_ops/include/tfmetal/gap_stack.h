// Pack / Unpack gap kernels: the index mapping, shared by the Metal kernel
// (custom_ops/metal/gap_stack.h) and its host code. Pure data movement, by
// element size, so every dtype of a size shares one kernel and the values
// are copied bit for bit.
//
// Stacking N tensors of shape S at `axis`: with outer = prod(S[:axis]) and
// inner = prod(S[axis:]), element t of tensor k (t = o * inner + i) is element
// (o * N + k) * inner + i of the stacked tensor. Pack copies each tensor into
// the stack; Unpack copies each out of it.
#ifndef TFMETAL_GAP_STACK_H_
#define TFMETAL_GAP_STACK_H_

#include "tfmetal/portable.h"

// The stacked tensor's element holding element t of the k-th tensor.
TFM_INLINE uint64_t gap_stack_index(uint64_t t, uint64_t k, uint64_t n_tensors, uint64_t inner) {
  const uint64_t o = t / inner, i = t - o * inner;
  return (o * n_tensors + k) * inner + i;
}

#endif  // TFMETAL_GAP_STACK_H_
