// Host names of the activation-gradient kernels (templates in activation_grad.h).
#include "activation_grad.h"

TFM_INSTANTIATE_KERNEL(activation_grad_float, activation_grad_kernel<float>)
TFM_INSTANTIATE_KERNEL(activation_grad_half, activation_grad_kernel<half>)
TFM_INSTANTIATE_KERNEL(gated_activation_grad_float, gated_activation_grad_kernel<float>)
TFM_INSTANTIATE_KERNEL(gated_activation_grad_half, gated_activation_grad_kernel<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(activation_grad_bfloat, activation_grad_kernel<bfloat>)
TFM_INSTANTIATE_KERNEL(gated_activation_grad_bfloat, gated_activation_grad_kernel<bfloat>)
#endif
