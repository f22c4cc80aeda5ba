// Host names of the gemv kernel (template in gemv.h).
#include "gemv.h"

TFM_INSTANTIATE_KERNEL(gemv_float, gemv<float>)
TFM_INSTANTIATE_KERNEL(gemv_half, gemv<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gemv_bfloat, gemv<bfloat>)
#endif
