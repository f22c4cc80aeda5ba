// Host names of the layer norm kernels (templates in layer_norm.h).
#include "layer_norm.h"

TFM_INSTANTIATE_KERNEL(layer_norm_float, layer_norm<float>)
TFM_INSTANTIATE_KERNEL(layer_norm_half, layer_norm<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(layer_norm_bfloat, layer_norm<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(layer_norm_grad_float, layer_norm_grad<float>)
TFM_INSTANTIATE_KERNEL(layer_norm_grad_half, layer_norm_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(layer_norm_grad_bfloat, layer_norm_grad<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(layer_norm_param_grad_float, layer_norm_param_grad<float>)
TFM_INSTANTIATE_KERNEL(layer_norm_param_grad_half, layer_norm_param_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(layer_norm_param_grad_bfloat, layer_norm_param_grad<bfloat>)
#endif
