// Registration of TfmetalExt>MultiTensorRMSprop: Keras' RMSprop over N resource variables in one op.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/multi_tensor_shapes.h"

namespace tfmetal_ext {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// var[i], ms[i], mom[i], mg[i] (when present and their handles carry shapes)
// and grad[i] must agree; the scalars are scalars.
Status MultiTensorRMSpropShape(InferenceContext* c) {
  int n = 0, num_mom = 0, num_mg = 0, num_decay = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("num_mom", &num_mom));
  TF_RETURN_IF_ERROR(c->GetAttr("num_mg", &num_mg));
  TF_RETURN_IF_ERROR(c->GetAttr("num_decay", &num_decay));
  if (num_mom != 0 && num_mom != n) {
    return ::tensorflow::errors::InvalidArgument("mom must hold 0 or N = ", n, " variables, got ", num_mom);
  }
  if (num_mg != 0 && num_mg != n) {
    return ::tensorflow::errors::InvalidArgument("mg must hold 0 or N = ", n, " variables, got ", num_mg);
  }
  if (num_decay > 1) {
    return ::tensorflow::errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay);
  }
  const int groups = 2 + (num_mom ? 1 : 0) + (num_mg ? 1 : 0);
  const int grad_start = groups * n;
  for (int i = 0; i < n; ++i) {
    ShapeHandle shape = c->input(grad_start + i);
    for (int slot = 0; slot < groups; ++slot) {
      const auto* handle_data = c->input_handle_shapes_and_types(slot * n + i);
      if (handle_data == nullptr || handle_data->empty()) continue;
      Status s = c->Merge(shape, (*handle_data)[0].shape, &shape);
      if (!s.ok()) {
        return ::tensorflow::errors::InvalidArgument("variable ", i, ": var, its slots and grad shapes differ: ",
                                                     s.message());
      }
    }
  }
  ShapeHandle unused;
  for (int k = 0; k < 5 + num_decay; ++k) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(grad_start + n + k), 0, &unused));
  }
  return multi_tensor_shapes::LossScale(c);
}

}  // namespace

REGISTER_OP("TfmetalExt>MultiTensorRMSprop")
    .Input("var: N * resource")
    .Input("ms: N * resource")
    .Input("mom: num_mom * resource")
    .Input("mg: num_mg * resource")
    .Input("grad: N * T")
    .Input("lr: T")
    .Input("rho: T")
    .Input("one_minus_rho: T")
    .Input("momentum: T")
    .Input("epsilon: T")
    .Input("weight_decay_rate: num_decay * T")
    .Input("scale: num_scale * float")
    .Output("found_non_finite: num_scale * bool")
    .Attr("N: int >= 1")
    .Attr("num_mom: int >= 0 = 0")
    .Attr("num_mg: int >= 0 = 0")
    .Attr("num_decay: int >= 0 = 0")
    .Attr("num_scale: int >= 0 = 0")
    .Attr("T: {float, half, bfloat16}")
    .SetIsStateful()
    .SetShapeFn(MultiTensorRMSpropShape)
    .Doc(R"doc(
RMSprop update of N resource variables (all of dtype T) and their slots in one op.

For each variable i, elementwise and in T, in the operation order of Keras'
keras.optimizers.RMSprop:
  ms[i] = rho * ms[i] + one_minus_rho * grad[i]^2
  mg[i] = rho * mg[i] + one_minus_rho * grad[i]             (num_mg = N)
  denom = ms[i] - mg[i]^2 + epsilon   (num_mg = N)   else ms[i] + epsilon
  inc = lr * grad[i] / sqrt(denom)
  mom[i] = momentum * mom[i] + inc; var[i] -= mom[i]         (num_mom = N)
  var[i] -= inc                                              (num_mom = 0)
With num_decay = 1, var[i] -= var[i] * weight_decay_rate first (decoupled
weight decay). one_minus_rho is an input because Keras forms 1 - rho before
rounding it to T (float32 1 - 0.9 is 0.1f, not 1 - 0.9f).

With num_scale = 1 (loss scaling, as Keras' LossScaleOptimizer does it) grad
holds the loss-scaled gradients. Every element of every grad[i] is checked
before anything is written: if one is NaN or infinite, nothing is written (no
variable, slot or decay) and found_non_finite is true; else it is false and
every grad[i] above stands for float(grad[i]) / scale rounded to T.

Every var, ms, mom and mg must be a distinct variable.
)doc");

}  // namespace tfmetal_ext
