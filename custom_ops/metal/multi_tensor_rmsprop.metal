// Host names of the multi-tensor RMSprop kernel (template in multi_tensor_rmsprop.h).
#include "multi_tensor_rmsprop.h"

TFM_INSTANTIATE_KERNEL(multi_tensor_rmsprop_float, multi_tensor_rmsprop<float>)
TFM_INSTANTIATE_KERNEL(multi_tensor_rmsprop_half, multi_tensor_rmsprop<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(multi_tensor_rmsprop_bfloat, multi_tensor_rmsprop<bfloat>)
#endif
