// Host names of the dropout kernel (template in dropout.h), shared by
// TfmetalExt>Dropout and TfmetalExt>DropoutGrad.
#include "dropout.h"

TFM_INSTANTIATE_KERNEL(dropout_float, dropout<float>)
TFM_INSTANTIATE_KERNEL(dropout_half, dropout<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(dropout_bfloat, dropout<bfloat>)
#endif
