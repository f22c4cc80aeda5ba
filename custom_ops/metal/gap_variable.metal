// Host names of the variable update gap kernels (gap_variable.h): the template
// per dtype (int64 through tfm_assign_update's int64_t specialization).
#include "gap_variable.h"

TFM_INSTANTIATE_KERNEL(gap_assign_update_float, gap_assign_update<float>)
TFM_INSTANTIATE_KERNEL(gap_assign_update_half, gap_assign_update<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_assign_update_bfloat, gap_assign_update<bfloat>)
#endif
TFM_INSTANTIATE_KERNEL(gap_assign_update_int64, gap_assign_update<int64_t>)
