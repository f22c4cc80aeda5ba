// Metal kernels of the elementwise gap kernels (IsFinite, Sigmoid, SigmoidGrad,
// Elu, EluGrad, Erfc, Fill, ZerosLike, OnesLike; host code in gap_elementwise_metal.mm,
// math in tfmetal/gap_elementwise.h).
//
// One thread per element over one contiguous buffer (dispatchThreads, edge
// threadgroups smaller, chunks at buffer offsets: `gid.x < p.n` is the only
// guard). Fill writes a bit pattern of the element's size: ZerosLike and
// OnesLike are fills with 0 and 1 in the output's dtype, so every dtype of a
// size shares one kernel and the value is stored exactly. At the end, for the
// host code only: Fill's shape checks (gap_shape_from_dims).
#ifndef TFMETAL_METAL_GAP_ELEMENTWISE_KERNELS_H_
#define TFMETAL_METAL_GAP_ELEMENTWISE_KERNELS_H_

#include "tfmetal/gap_elementwise.h"
#include "tfmetal/portable.h"

// setBytes data of the unary and binary kernels.
struct tfm_gap_elementwise_params {
  uint32_t n;  // elements in this dispatch (the host splits larger tensors)
};
static_assert(sizeof(tfm_gap_elementwise_params) == 4, "tfm_gap_elementwise_params layout is shared with the host");

// setBytes data of the fill kernels.
struct tfm_gap_fill_params {
  uint32_t n;     // elements in this dispatch
  uint32_t bits;  // the value's bit pattern in its low bytes (element size 1, 2 or 4)
};
static_assert(sizeof(tfm_gap_fill_params) == 8, "tfm_gap_fill_params layout is shared with the host");

#if TFM_METAL

// y = isfinite(x), one byte per element (TF's bool).
template <typename T>
[[kernel]] void gap_is_finite(device const T* x [[buffer(0)]],
                              device uint8_t* y [[buffer(1)]],
                              constant tfm_gap_elementwise_params& p [[buffer(2)]],
                              TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = gap_is_finite(static_cast<float>(x[gid.x]));
}

// y = sigmoid(x). y may alias x.
template <typename T>
[[kernel]] void gap_sigmoid(device const T* x [[buffer(0)]],
                            device T* y [[buffer(1)]],
                            constant tfm_gap_elementwise_params& p [[buffer(2)]],
                            TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<T>(gap_sigmoid(static_cast<float>(x[gid.x])));
}

// y = elu(x). y may alias x.
template <typename T>
[[kernel]] void gap_elu(device const T* x [[buffer(0)]],
                        device T* y [[buffer(1)]],
                        constant tfm_gap_elementwise_params& p [[buffer(2)]],
                        TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<T>(gap_elu(static_cast<float>(x[gid.x])));
}

// y = erfc(x). y may alias x.
template <typename T>
[[kernel]] void gap_erfc(device const T* x [[buffer(0)]],
                         device T* y [[buffer(1)]],
                         constant tfm_gap_elementwise_params& p [[buffer(2)]],
                         TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<T>(gap_erfc(static_cast<float>(x[gid.x])));
}

// The two gradient kernels take the op's inputs in its order, as in0 and in1
// (one host function binds both). z may alias in0.
//
// SigmoidGrad(y, dy): z = dy * (y * (1 - y)).
template <typename T>
[[kernel]] void gap_sigmoid_grad(device const T* in0 [[buffer(0)]],
                                 device const T* in1 [[buffer(1)]],
                                 device T* z [[buffer(2)]],
                                 constant tfm_gap_elementwise_params& p [[buffer(3)]],
                                 TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint i = gid.x;
  z[i] = static_cast<T>(gap_sigmoid_grad(static_cast<float>(in0[i]), static_cast<float>(in1[i])));
}

// EluGrad(gradients, outputs): z = outputs < 0 ? (outputs + 1) * gradients : gradients.
template <typename T>
[[kernel]] void gap_elu_grad(device const T* in0 [[buffer(0)]],
                             device const T* in1 [[buffer(1)]],
                             device T* z [[buffer(2)]],
                             constant tfm_gap_elementwise_params& p [[buffer(3)]],
                             TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  const uint i = gid.x;
  z[i] = static_cast<T>(gap_elu_grad(static_cast<float>(in0[i]), static_cast<float>(in1[i])));
}

// Every element of y = the low sizeof(U) bytes of p.bits.
template <typename U>
[[kernel]] void gap_fill(device U* y [[buffer(0)]],
                         constant tfm_gap_fill_params& p [[buffer(1)]],
                         TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.n) return;
  y[gid.x] = static_cast<U>(p.bits);
}

#endif  // TFM_METAL

#if !defined(__METAL_VERSION__)
// Host C++ only (gap_elementwise_metal.mm and the emulator tests; never compiled by Metal).

// Fill's output shape from its `dims` values, with the checks of TF's
// TensorShapeUtils::MakeShape (which its CPU kernel calls): at most
// TFM_GAP_MAX_DIMS dimensions, each >= 0, and the running product of the
// dimensions, in order, within int64. TF's allocation aborts the process on a
// shape that fails them, so the host code must refuse it first.
#define TFM_GAP_MAX_DIMS 254

enum {
  TFM_GAP_SHAPE_OK = 0,
  TFM_GAP_SHAPE_TOO_MANY_DIMS = 1,  // "Too many dimensions"
  TFM_GAP_SHAPE_NEGATIVE = 2,       // "Dimension <d> must be >= 0" (*detail = d)
  TFM_GAP_SHAPE_OVERFLOW = 3,       // "Shape [..] would have more than 2**63 - 1 elements"
};

// One of the codes above; on success *detail is the number of elements. Reads
// none of `dims` when `rank` is above the limit.
TFM_INLINE int gap_shape_from_dims(const int64_t* dims, int64_t rank, int64_t* detail) {
  if (rank > TFM_GAP_MAX_DIMS) return TFM_GAP_SHAPE_TOO_MANY_DIMS;
  const int64_t kMax = 0x7fffffffffffffffLL;
  int64_t n = 1;
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t d = dims[i];
    if (d < 0) {
      *detail = d;
      return TFM_GAP_SHAPE_NEGATIVE;
    }
    // TF checks the product as it goes: [2^40, 2^40, 0] overflows before the 0.
    if (n != 0 && d > kMax / n) return TFM_GAP_SHAPE_OVERFLOW;
    n *= d;
  }
  *detail = n;
  return TFM_GAP_SHAPE_OK;
}

#if defined(TFM_EMU)
// For the emulator tests (ctypes), with C linkage.
extern "C" __attribute__((visibility("default"))) int tfm_gap_shape_from_dims(const int64_t* dims, int64_t rank,
                                                                               int64_t* detail) {
  return gap_shape_from_dims(dims, rank, detail);
}
#endif  // TFM_EMU
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_METAL_GAP_ELEMENTWISE_KERNELS_H_
