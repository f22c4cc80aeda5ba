// Registration of TfmetalExt>MultiTensorLion: Lion over N resource variables in one op.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/multi_tensor_shapes.h"

namespace tfmetal_ext {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// var[i], m[i] (when their handles carry shapes) and grad[i] must agree;
// lr, beta1, beta2 (and weight_decay_rate) are scalars.
Status MultiTensorLionShape(InferenceContext* c) {
  int n = 0, num_decay = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("num_decay", &num_decay));
  if (num_decay > 1) {
    return ::tensorflow::errors::InvalidArgument("weight_decay_rate must hold 0 or 1 scalar, got ", num_decay);
  }
  const int grad_start = 2 * n;
  for (int i = 0; i < n; ++i) {
    ShapeHandle shape = c->input(grad_start + i);
    for (int slot = 0; slot < 2; ++slot) {
      const auto* handle_data = c->input_handle_shapes_and_types(slot * n + i);
      if (handle_data == nullptr || handle_data->empty()) continue;
      Status s = c->Merge(shape, (*handle_data)[0].shape, &shape);
      if (!s.ok()) {
        return ::tensorflow::errors::InvalidArgument("variable ", i, ": var, m and grad shapes differ: ",
                                                     s.message());
      }
    }
  }
  ShapeHandle unused;
  for (int k = 0; k < 3 + num_decay; ++k) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(grad_start + n + k), 0, &unused));
  }
  return multi_tensor_shapes::LossScale(c);
}

}  // namespace

REGISTER_OP("TfmetalExt>MultiTensorLion")
    .Input("var: N * resource")
    .Input("m: N * resource")
    .Input("grad: N * T")
    .Input("lr: T")
    .Input("beta1: T")
    .Input("beta2: T")
    .Input("weight_decay_rate: num_decay * T")
    .Input("scale: num_scale * float")
    .Output("found_non_finite: num_scale * bool")
    .Attr("N: int >= 1")
    .Attr("num_decay: int >= 0 = 0")
    .Attr("num_scale: int >= 0 = 0")
    .Attr("T: {float, half, bfloat16}")
    .SetIsStateful()
    .SetShapeFn(MultiTensorLionShape)
    .Doc(R"doc(
Lion update of N resource variables (all of dtype T) and their momentums in one op.

For each variable i, elementwise and in T, in the operation order of Keras'
keras.optimizers.Lion:
  c = m[i] * beta1 + grad[i] * (1 - beta1)
  var[i] -= lr * sign(c)
  m[i] = m[i] * beta2 + grad[i] * (1 - beta2)
With num_decay = 1, var[i] -= var[i] * weight_decay_rate first (decoupled
weight decay). sign is tf.sign: +0 for +-0, NaN for NaN.

With num_scale = 1 (loss scaling, as Keras' LossScaleOptimizer does it) grad
holds the loss-scaled gradients. Every element of every grad[i] is checked
before anything is written: if one is NaN or infinite, nothing is written (no
variable, slot or decay) and found_non_finite is true; else it is false and
every grad[i] above stands for float(grad[i]) / scale rounded to T.

var and m must be distinct variables.
)doc");

}  // namespace tfmetal_ext
