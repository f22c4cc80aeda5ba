// Pack / Unpack gap kernels: the index mapping, shared by the Metal kernel
// (custom_ops/metal/gap_stack.h) and its host code, and the host's checks.
// Pure data movement, by element size, so every dtype of a size shares one
// kernel and the values are copied bit for bit.
//
// Stacking N tensors of shape S at `axis`: with outer = prod(S[:axis]) and
// inner = prod(S[axis:]), element t of tensor k (t = o * inner + i) is element
// (o * N + k) * inner + i of the stacked tensor. Pack copies each tensor into
// the stack; Unpack copies each out of it.
#ifndef TFMETAL_GAP_STACK_H_
#define TFMETAL_GAP_STACK_H_

#if !defined(__METAL_VERSION__)
#include <string>  // host side only (below); first, before the emulator's address-space macros
#endif

#include "tfmetal/portable.h"

// The stacked tensor's element holding element t of the k-th tensor.
TFM_INLINE uint64_t gap_stack_index(uint64_t t, uint64_t k, uint64_t n_tensors, uint64_t inner) {
  const uint64_t o = t / inner, i = t - o * inner;
  return (o * n_tensors + k) * inner + i;
}

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Plain C++ (the host code, and the emulator tests through gap_stack.metal's
// exports): TensorFlow's checks of Pack and Unpack, in the order and with the
// text of its CPU kernels (pack_op.cc, unpack_op.cc; shapes as
// TensorShape::DebugString writes them), and the copy geometry.

// One tensor's part of the stack (the `inner` of gap_stack_index).
struct GapStackGeometry {
  int64_t axis;        // the stacked tensor's axis, normalized to [0, rank of the stack)
  int64_t inner;       // prod(S[axis:]) of the unstacked shape S
  int64_t per_tensor;  // prod(S): elements of one unstacked tensor
};

inline std::string GapStackShapeText(const int64_t* dims, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string GapStackAxisError(int64_t axis, int64_t rank) {
  return "axis = " + std::to_string(axis) + " not in [" + std::to_string(-rank) + ", " + std::to_string(rank) + ")";
}

// Pack of n >= 1 tensors, tensor k of shape shapes[k] (ranks[k] dimensions),
// at attr `axis`: "" and the geometry, or TF's InvalidArgument text. TF checks
// the axis against the first tensor's rank + 1 before comparing the shapes.
inline std::string GapPackCheck(const int64_t* const* shapes, const int* ranks, int n, int64_t axis,
                                GapStackGeometry* g) {
  const int64_t rank = static_cast<int64_t>(ranks[0]) + 1;
  const int64_t normalized = axis < 0 ? axis + rank : axis;
  if (normalized < 0 || normalized >= rank) return GapStackAxisError(axis, rank);
  for (int k = 1; k < n; ++k) {
    bool same = ranks[k] == ranks[0];
    for (int d = 0; same && d < ranks[0]; ++d) same = shapes[k][d] == shapes[0][d];
    if (!same) {
      return "Shapes of all inputs must match: values[0].shape = " + GapStackShapeText(shapes[0], ranks[0]) +
             " != values[" + std::to_string(k) + "].shape = " + GapStackShapeText(shapes[k], ranks[k]);
    }
  }
  g->axis = normalized;
  g->inner = 1;
  g->per_tensor = 1;
  for (int d = 0; d < ranks[0]; ++d) {
    g->per_tensor *= shapes[0][d];
    if (d >= normalized) g->inner *= shapes[0][d];
  }
  return "";
}

// Unpack of a tensor of shape `shape` into `num` tensors at attr `axis`: ""
// and the geometry (of the unstacked shape), or TF's InvalidArgument text.
inline std::string GapUnpackCheck(const int64_t* shape, int rank, int64_t num, int64_t axis, GapStackGeometry* g) {
  const int64_t normalized = axis < 0 ? axis + rank : axis;
  if (normalized < 0 || normalized >= rank) return GapStackAxisError(axis, rank);
  if (shape[normalized] != num) {
    return "Input shape axis " + std::to_string(normalized) + " must equal " + std::to_string(num) +
           ", got shape " + GapStackShapeText(shape, rank);
  }
  // The unstacked shape: `shape` without dimension `normalized`.
  g->axis = normalized;
  g->inner = 1;
  g->per_tensor = 1;
  for (int d = 0; d < rank; ++d) {
    if (d == normalized) continue;
    g->per_tensor *= shape[d];
    if (d > normalized) g->inner *= shape[d];
  }
  return "";
}
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_STACK_H_
