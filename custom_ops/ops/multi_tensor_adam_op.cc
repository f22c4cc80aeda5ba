// Registration of TfmetalExt>MultiTensorAdam: Adam over N resource variables in one op.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/multi_tensor_shapes.h"

namespace tfmetal_ext {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Merges the shape of resource input `index` (when its handle carries one)
// into `*shape`.
Status MergeHandleShape(InferenceContext* c, int index, ShapeHandle* shape) {
  const auto* handle_data = c->input_handle_shapes_and_types(index);
  if (handle_data == nullptr || handle_data->empty()) return Status();
  return c->Merge(*shape, (*handle_data)[0].shape, shape);
}

Status MultiTensorAdamShape(InferenceContext* c) {
  int n = 0, num_vhat = 0, num_decay = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("num_vhat", &num_vhat));
  TF_RETURN_IF_ERROR(c->GetAttr("num_decay", &num_decay));
  if (num_vhat != 0 && num_vhat != n) {
    return ::tensorflow::errors::InvalidArgument("vhat must hold 0 (Adam) or N = ", n,
                                                 " (AMSGrad) variables, got ", num_vhat);
  }
  if (num_decay > 1) {
    return ::tensorflow::errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay);
  }
  const int grad_start = 3 * n + num_vhat;
  for (int i = 0; i < n; ++i) {
    ShapeHandle shape = c->input(grad_start + i);
    for (int slot = 0; slot < 3; ++slot) {
      Status s = MergeHandleShape(c, slot * n + i, &shape);
      if (!s.ok()) {
        return ::tensorflow::errors::InvalidArgument("variable ", i, ": var, m, v and grad shapes differ: ",
                                                     s.message());
      }
    }
    if (num_vhat) TF_RETURN_IF_ERROR(MergeHandleShape(c, 3 * n + i, &shape));
  }
  ShapeHandle unused;
  for (int k = 0; k < 6 + num_decay; ++k) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(grad_start + n + k), 0, &unused));
  }
  return multi_tensor_shapes::LossScale(c);
}

}  // namespace

REGISTER_OP("TfmetalExt>MultiTensorAdam")
    .Input("var: N * resource")
    .Input("m: N * resource")
    .Input("v: N * resource")
    .Input("vhat: num_vhat * resource")
    .Input("grad: N * T")
    .Input("lr: T")
    .Input("beta1: T")
    .Input("beta2: T")
    .Input("epsilon: T")
    .Input("beta1_power: T")
    .Input("beta2_power: T")
    .Input("weight_decay_rate: num_decay * T")
    .Input("scale: num_scale * float")
    .Output("found_non_finite: num_scale * bool")
    .Attr("N: int >= 1")
    .Attr("num_vhat: int >= 0 = 0")
    .Attr("num_decay: int >= 0 = 0")
    .Attr("num_scale: int >= 0 = 0")
    .Attr("T: {float, half, bfloat16}")
    .SetIsStateful()
    .SetShapeFn(MultiTensorAdamShape)
    .Doc(R"doc(
Adam update of N resource variables (all of dtype T) and their slots in one op.

For each variable i, elementwise and in T, in the order of ResourceApplyAdam:
  alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
  m[i] += (grad[i] - m[i]) * (1 - beta1)
  v[i] += (grad[i] * grad[i] - v[i]) * (1 - beta2)
  var[i] -= (m[i] * alpha) / (sqrt(v[i]) + epsilon)
With num_vhat = N (AMSGrad, as ResourceApplyAdamWithAmsgrad) vhat[i] = max(vhat[i], v[i])
is used in place of v[i] in the last line. With num_decay = 1, var[i] -= var[i] * weight_decay_rate
first (decoupled weight decay, as ResourceApplyGradientDescent with delta = var).

With num_scale = 1 (loss scaling, as Keras' LossScaleOptimizer does it) grad
holds the loss-scaled gradients. Every element of every grad[i] is checked
before anything is written: if one is NaN or infinite, nothing is written (no
variable, slot or decay) and found_non_finite is true; else it is false and
every grad[i] above stands for float(grad[i]) / scale rounded to T.

var, m, v (and vhat) must be distinct variables.
)doc");

}  // namespace tfmetal_ext
