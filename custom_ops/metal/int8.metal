// Host names of the int8 kernels (templates in int8.h).
#include "int8.h"

TFM_INSTANTIATE_KERNEL(int8_matmul_float, int8_matmul<float>)
TFM_INSTANTIATE_KERNEL(int8_matmul_half, int8_matmul<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(int8_matmul_bfloat, int8_matmul<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(int8_conv2d_float, int8_conv2d<float>)
TFM_INSTANTIATE_KERNEL(int8_conv2d_half, int8_conv2d<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(int8_conv2d_bfloat, int8_conv2d<bfloat>)
#endif
