// Host names of the elementwise gap kernels (templates in gap_elementwise.h).
#include "gap_elementwise.h"

#define TFM_GAP_FLOAT_KERNELS(name)                      \
  TFM_INSTANTIATE_KERNEL(name##_float, name<float>)      \
  TFM_INSTANTIATE_KERNEL(name##_half, name<half>)

TFM_GAP_FLOAT_KERNELS(gap_is_finite)
TFM_GAP_FLOAT_KERNELS(gap_sigmoid)
TFM_GAP_FLOAT_KERNELS(gap_sigmoid_grad)
TFM_GAP_FLOAT_KERNELS(gap_elu)
TFM_GAP_FLOAT_KERNELS(gap_elu_grad)
TFM_GAP_FLOAT_KERNELS(gap_erfc)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_is_finite_bfloat, gap_is_finite<bfloat>)
TFM_INSTANTIATE_KERNEL(gap_sigmoid_bfloat, gap_sigmoid<bfloat>)
TFM_INSTANTIATE_KERNEL(gap_sigmoid_grad_bfloat, gap_sigmoid_grad<bfloat>)
TFM_INSTANTIATE_KERNEL(gap_elu_bfloat, gap_elu<bfloat>)
TFM_INSTANTIATE_KERNEL(gap_elu_grad_bfloat, gap_elu_grad<bfloat>)
TFM_INSTANTIATE_KERNEL(gap_erfc_bfloat, gap_erfc<bfloat>)
#endif

// By element size: bool is 1 byte, half and bfloat16 are 2, float 4.
TFM_INSTANTIATE_KERNEL(gap_fill_1, gap_fill<uchar>)
TFM_INSTANTIATE_KERNEL(gap_fill_2, gap_fill<ushort>)
TFM_INSTANTIATE_KERNEL(gap_fill_4, gap_fill<uint>)
