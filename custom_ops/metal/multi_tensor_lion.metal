// Host names of the multi-tensor Lion kernel (template in multi_tensor_lion.h).
#include "multi_tensor_lion.h"

TFM_INSTANTIATE_KERNEL(multi_tensor_lion_float, multi_tensor_lion<float>)
TFM_INSTANTIATE_KERNEL(multi_tensor_lion_half, multi_tensor_lion<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(multi_tensor_lion_bfloat, multi_tensor_lion<bfloat>)
#endif
