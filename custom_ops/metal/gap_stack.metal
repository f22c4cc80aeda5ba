// Host names of the Pack / Unpack gap kernel (template in gap_stack.h), by element size:
// bool 1 byte, half and bfloat16 2, float 4.
#include "gap_stack.h"

TFM_INSTANTIATE_KERNEL(gap_stack_copy_1, gap_stack_copy<uchar>)
TFM_INSTANTIATE_KERNEL(gap_stack_copy_2, gap_stack_copy<ushort>)
TFM_INSTANTIATE_KERNEL(gap_stack_copy_4, gap_stack_copy<uint>)
