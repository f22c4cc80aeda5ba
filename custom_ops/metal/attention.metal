// Host names of the attention kernels (templates in attention.h).
#include "attention.h"

TFM_INSTANTIATE_KERNEL(attention_fwd_float, attention_fwd<float>)
TFM_INSTANTIATE_KERNEL(attention_fwd_half, attention_fwd<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(attention_fwd_bfloat, attention_fwd<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(attention_bwd_dq_float, attention_bwd_dq<float>)
TFM_INSTANTIATE_KERNEL(attention_bwd_dq_half, attention_bwd_dq<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(attention_bwd_dq_bfloat, attention_bwd_dq<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(attention_bwd_dkdv_float, attention_bwd_dkdv<float>)
TFM_INSTANTIATE_KERNEL(attention_bwd_dkdv_half, attention_bwd_dkdv<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(attention_bwd_dkdv_bfloat, attention_bwd_dkdv<bfloat>)
#endif
