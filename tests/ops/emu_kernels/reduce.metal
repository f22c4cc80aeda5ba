#include "reduce.h"

TFM_INSTANTIATE_KERNEL(row_sum_tree_float, row_sum_tree<float>)
TFM_INSTANTIATE_KERNEL(row_sum_tree_half, row_sum_tree<half>)
TFM_INSTANTIATE_KERNEL(row_sum_simd_float, row_sum_simd<float>)
TFM_INSTANTIATE_KERNEL(row_sum_simd_half, row_sum_simd<half>)
TFM_REGISTER_KERNEL(neighbour_exchange)
TFM_REGISTER_KERNEL(simd_functions)
