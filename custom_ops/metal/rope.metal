// Host names of the rotary-embedding kernels (templates in rope.h).
#include "rope.h"

TFM_INSTANTIATE_KERNEL(rope_float, rope<float>)
TFM_INSTANTIATE_KERNEL(rope_half, rope<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(rope_bfloat, rope<bfloat>)
#endif

TFM_INSTANTIATE_KERNEL(rope_grad_float, rope_grad<float>)
TFM_INSTANTIATE_KERNEL(rope_grad_half, rope_grad<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(rope_grad_bfloat, rope_grad<bfloat>)
#endif
