// Host names of the softshrink kernels (templates in softshrink.h).
#include "softshrink.h"

TFM_INSTANTIATE_KERNEL(softshrink_float, softshrink<float>)
TFM_INSTANTIATE_KERNEL(softshrink_half, softshrink<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(softshrink_bfloat, softshrink<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(softshrink_grad_float, softshrink_grad<float>)
TFM_INSTANTIATE_KERNEL(softshrink_grad_half, softshrink_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(softshrink_grad_bfloat, softshrink_grad<bfloat>)
#endif
