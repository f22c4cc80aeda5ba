// Host names of the sparse softmax cross-entropy kernels (templates in
// sparse_xent.h): sparse_xent[_grad]_<labels>_<dtype>, as metal_helper's
// KernelName builds them with the label type as the variant.
#include "sparse_xent.h"

TFM_INSTANTIATE_KERNEL(sparse_xent_int32_float, sparse_xent<float, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_int64_float, sparse_xent<float, int64_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_int32_half, sparse_xent<half, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_int64_half, sparse_xent<half, int64_t>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(sparse_xent_int32_bfloat, sparse_xent<bfloat, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_int64_bfloat, sparse_xent<bfloat, int64_t>)
#endif

TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int32_float, sparse_xent_grad<float, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int64_float, sparse_xent_grad<float, int64_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int32_half, sparse_xent_grad<half, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int64_half, sparse_xent_grad<half, int64_t>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int32_bfloat, sparse_xent_grad<bfloat, int32_t>)
TFM_INSTANTIATE_KERNEL(sparse_xent_grad_int64_bfloat, sparse_xent_grad<bfloat, int64_t>)
#endif
