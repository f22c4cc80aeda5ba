// Registration of TfmetalExt>ActivationGrad: dx = dy * act'(x) for a smooth activation.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace activation_grad_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::InferenceContext;

// dx has x's shape; dy must agree with it (merged: either may be partly unknown).
Status MergedShape(InferenceContext* c) {
  ::tensorflow::shape_inference::ShapeHandle merged;
  TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &merged));
  c->set_output(0, merged);
  return Status();
}

// d_gate and d_up have gate's shape; dy and up must agree with it.
Status GatedShapes(InferenceContext* c) {
  ::tensorflow::shape_inference::ShapeHandle merged;
  TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &merged));
  TF_RETURN_IF_ERROR(c->Merge(merged, c->input(2), &merged));
  c->set_output(0, merged);
  c->set_output(1, merged);
  return Status();
}

}  // namespace activation_grad_shape

// The activation names in the order of tfmetal/activation_grad.h's TFM_ACTGRAD_* codes
// (tfmetal_ext/backends/fusion.py ACTIVATION_GRAD_ACTIVATIONS, checked by tests/ops/test_activation_grad.py).
REGISTER_OP("TfmetalExt>ActivationGrad")
    .Input("dy: T")
    .Input("x: T")
    .Output("dx: T")
    .Attr("activation: {'silu', 'gelu', 'gelu_approximate'}")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(activation_grad_shape::MergedShape)
    .Doc(R"doc(
The gradient of a smooth activation, dx = dy * act'(x), in float32 per element, rounded once to T
(the math: tfmetal/activation_grad.h). The activations are silu (s (1 + x (1 - s)), s = sigmoid(x)),
gelu (erf form, Phi(x) + x phi(x)) and gelu_approximate (the tanh form's derivative). dy and x
must have the same shape. NaN propagates; x = +inf gives dy, -inf gives 0 * dy.
)doc");

REGISTER_OP("TfmetalExt>GatedActivationGrad")
    .Input("dy: T")
    .Input("gate: T")
    .Input("up: T")
    .Output("d_gate: T")
    .Output("d_up: T")
    .Attr("activation: {'silu', 'gelu', 'gelu_approximate'}")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(activation_grad_shape::GatedShapes)
    .Doc(R"doc(
The backward of a gated product y = act(gate) * up: d_gate = dy * up * act'(gate) and
d_up = dy * act(gate), each in float32 per element, rounded once to T (tfmetal/activation_grad.h).
The activations are ActivationGrad's. dy, gate and up must have the same shape. NaN propagates.
)doc");

}  // namespace tfmetal_ext
