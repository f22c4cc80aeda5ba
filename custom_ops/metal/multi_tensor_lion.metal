// Host names of the multi-tensor Lion kernel (template in multi_tensor_lion.h).
#include "multi_tensor_lion.h"

TFM_INSTANTIATE_KERNEL(multi_tensor_lion_float, multi_tensor_lion<float>)
TFM_INSTANTIATE_KERNEL(multi_tensor_lion_half, multi_tensor_lion<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(multi_tensor_lion_bfloat, multi_tensor_lion<bfloat>)
#endif

// The finite check run first with a loss scale (multi_tensor_check.h), in this library too.
TFM_REGISTER_KERNEL(multi_tensor_found_reset)
TFM_REGISTER_KERNEL(multi_tensor_found_write)
TFM_INSTANTIATE_KERNEL(multi_tensor_find_non_finite_float, multi_tensor_find_non_finite<float>)
TFM_INSTANTIATE_KERNEL(multi_tensor_find_non_finite_half, multi_tensor_find_non_finite<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(multi_tensor_find_non_finite_bfloat, multi_tensor_find_non_finite<bfloat>)
#endif
