// Host names of the multi-tensor Adam kernel (template in multi_tensor_adam.h).
#include "multi_tensor_adam.h"

TFM_INSTANTIATE_KERNEL(multi_tensor_adam_float, multi_tensor_adam<float>)
TFM_INSTANTIATE_KERNEL(multi_tensor_adam_half, multi_tensor_adam<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(multi_tensor_adam_bfloat, multi_tensor_adam<bfloat>)
#endif
