// Shape-function part shared by the registrations of the multi-tensor
// optimizer ops (multi_tensor_{adam,lion,rmsprop}_op.cc): their optional loss
// scale (tfmetal/loss_scale.h), the last input, and the flag it adds as the
// only output.
#ifndef TFMETAL_OPS_MULTI_TENSOR_SHAPES_H_
#define TFMETAL_OPS_MULTI_TENSOR_SHAPES_H_

#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace multi_tensor_shapes {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// `scale` (num_scale = 0 or 1 scalars, the op's last input) and
// `found_non_finite` (num_scale scalars, its outputs).
inline Status LossScale(InferenceContext* c) {
  int num_scale = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("num_scale", &num_scale));
  if (num_scale > 1) {
    return ::tensorflow::errors::InvalidArgument("scale must hold 0 or 1 scalar, got ", num_scale);
  }
  ShapeHandle unused;
  for (int k = 0; k < num_scale; ++k) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - num_scale + k), 0, &unused));
    c->set_output(k, c->Scalar());
  }
  return Status();
}

}  // namespace multi_tensor_shapes
}  // namespace tfmetal_ext

#endif  // TFMETAL_OPS_MULTI_TENSOR_SHAPES_H_
