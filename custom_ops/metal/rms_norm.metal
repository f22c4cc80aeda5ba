// Host names of the RMS norm kernels (templates in rms_norm.h).
#include "rms_norm.h"

TFM_INSTANTIATE_KERNEL(rms_norm_float, rms_norm<float>)
TFM_INSTANTIATE_KERNEL(rms_norm_half, rms_norm<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(rms_norm_bfloat, rms_norm<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(rms_norm_grad_float, rms_norm_grad<float>)
TFM_INSTANTIATE_KERNEL(rms_norm_grad_half, rms_norm_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(rms_norm_grad_bfloat, rms_norm_grad<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(rms_norm_param_grad_float, rms_norm_param_grad<float>)
TFM_INSTANTIATE_KERNEL(rms_norm_param_grad_half, rms_norm_param_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(rms_norm_param_grad_bfloat, rms_norm_param_grad<bfloat>)
#endif
