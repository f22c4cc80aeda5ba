#include "elementwise.h"

TFM_INSTANTIATE_KERNEL(affine_float, affine<float>)
TFM_INSTANTIATE_KERNEL(affine_half, affine<half>)
TFM_INSTANTIATE_KERNEL(affine_bfloat, affine<bfloat>)
TFM_REGISTER_KERNEL(mark_once)
TFM_REGISTER_KERNEL(grid2d)
