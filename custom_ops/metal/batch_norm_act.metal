// Host names of the batch norm + activation kernels (batch_norm_act.h).
#include "batch_norm_act.h"

TFM_INSTANTIATE_KERNEL(batch_norm_act_stats_float, batch_norm_act_stats<float>)
TFM_INSTANTIATE_KERNEL(batch_norm_act_stats_half, batch_norm_act_stats<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(batch_norm_act_stats_bfloat, batch_norm_act_stats<bfloat>)
#endif

// The moving statistics' update: float32 only, whatever T (not a template).
TFM_REGISTER_KERNEL(batch_norm_act_moving)

TFM_INSTANTIATE_KERNEL(batch_norm_act_float, batch_norm_act<float>)
TFM_INSTANTIATE_KERNEL(batch_norm_act_half, batch_norm_act<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(batch_norm_act_bfloat, batch_norm_act<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_sums_float, batch_norm_act_grad_sums<float>)
TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_sums_half, batch_norm_act_grad_sums<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_sums_bfloat, batch_norm_act_grad_sums<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_float, batch_norm_act_grad<float>)
TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_half, batch_norm_act_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(batch_norm_act_grad_bfloat, batch_norm_act_grad<bfloat>)
#endif
