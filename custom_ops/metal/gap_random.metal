// Host names of the StatelessRandomUniformV2 gap kernel (template in gap_random.h).
#include "gap_random.h"

TFM_INSTANTIATE_KERNEL(gap_random_uniform_float, gap_random_uniform<float>)
TFM_INSTANTIATE_KERNEL(gap_random_uniform_half, gap_random_uniform<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_random_uniform_bfloat, gap_random_uniform<bfloat>)
#endif
