// Registration of TfmetalExt>LayerNorm and its gradient op TfmetalExt>LayerNormGrad.
//
// gamma, beta, the statistics and the parameter gradients are float32 for
// every x dtype: under mixed precision the layer's float32 variables go in
// without casts, and the statistics keep float32 accuracy for half inputs.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/norm_shapes.h"

namespace tfmetal_ext {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

using norm_shapes::CheckVectorShape;
using norm_shapes::InferRowsAndChannels;

Status LayerNormShape(InferenceContext* c) {
  DimensionHandle channels, rows;
  TF_RETURN_IF_ERROR(InferRowsAndChannels(c, c->input(0), &channels, &rows));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 1, "gamma", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 2, "beta", channels, "the last dimension of x"));
  c->set_output(0, c->input(0));
  c->set_output(1, c->Vector(rows));
  c->set_output(2, c->Vector(rows));
  return Status();
}

Status LayerNormGradShape(InferenceContext* c) {
  ShapeHandle x;
  if (!c->Merge(c->input(0), c->input(1), &x).ok()) {
    return ::tensorflow::errors::InvalidArgument("dy and x must have the same shape, got ",
                                                 c->DebugString(c->input(0)), " and ", c->DebugString(c->input(1)));
  }
  DimensionHandle channels, rows;
  TF_RETURN_IF_ERROR(InferRowsAndChannels(c, x, &channels, &rows));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 2, "gamma", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 3, "mean", rows, "the number of rows of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 4, "rstd", rows, "the number of rows of x"));
  c->set_output(0, x);
  c->set_output(1, c->Vector(channels));
  c->set_output(2, c->Vector(channels));
  return Status();
}

}  // namespace

REGISTER_OP("TfmetalExt>LayerNorm")
    .Input("x: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Output("y: T")
    .Output("mean: float")
    .Output("rstd: float")
    .Attr("T: {float, half, bfloat16}")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn(LayerNormShape)
    .Doc(R"doc(
Layer normalization over the last axis of x (C = its size; rows = the other elements).
y = (x - mean) * rstd * gamma + beta with per-row mean and rstd = 1 / sqrt(var + epsilon),
computed in float32 (two passes over the row). mean and rstd (float32, [rows]) are saved for
TfmetalExt>LayerNormGrad. epsilon must be finite and > 0. An empty row (C = 0) has mean 0
and rstd = 1 / sqrt(epsilon). NaN/Inf in a row make that row's outputs NaN.
)doc");

REGISTER_OP("TfmetalExt>LayerNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("gamma: float")
    .Input("mean: float")
    .Input("rstd: float")
    .Output("dx: T")
    .Output("dgamma: float")
    .Output("dbeta: float")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(LayerNormGradShape)
    .Doc(R"doc(
Gradient of TfmetalExt>LayerNorm given its saved mean and rstd: dx, and dgamma / dbeta summed
over the rows in float32. The sums use a fixed partition of the rows, so the result does not
depend on the number of threads.
)doc");

}  // namespace tfmetal_ext
