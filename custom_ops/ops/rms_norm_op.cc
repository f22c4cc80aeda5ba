// Registration of TfmetalExt>RMSNorm and its gradient op TfmetalExt>RMSNormGrad.
//
// gamma, rstd and dgamma are float32 for every x dtype: under mixed precision
// the layer's float32 scale goes in without a cast, and the statistics keep
// float32 accuracy for half inputs. Helpers live in namespace rms_norm_shape:
// all op files are one translation unit (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/norm_shapes.h"

namespace tfmetal_ext {
namespace rms_norm_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

using norm_shapes::CheckVectorShape;
using norm_shapes::InferRowsAndChannels;

Status ForwardShape(InferenceContext* c) {
  DimensionHandle channels, rows;
  TF_RETURN_IF_ERROR(InferRowsAndChannels(c, c->input(0), &channels, &rows));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 1, "gamma", channels, "the last dimension of x"));
  c->set_output(0, c->input(0));
  c->set_output(1, c->Vector(rows));
  return Status();
}

Status GradShape(InferenceContext* c) {
  ShapeHandle x;
  if (!c->Merge(c->input(0), c->input(1), &x).ok()) {
    return ::tensorflow::errors::InvalidArgument("dy and x must have the same shape, got ",
                                                 c->DebugString(c->input(0)), " and ", c->DebugString(c->input(1)));
  }
  DimensionHandle channels, rows;
  TF_RETURN_IF_ERROR(InferRowsAndChannels(c, x, &channels, &rows));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 2, "gamma", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 3, "rstd", rows, "the number of rows of x"));
  c->set_output(0, x);
  c->set_output(1, c->Vector(channels));
  return Status();
}

}  // namespace rms_norm_shape

REGISTER_OP("TfmetalExt>RMSNorm")
    .Input("x: T")
    .Input("gamma: float")
    .Output("y: T")
    .Output("rstd: float")
    .Attr("T: {float, half, bfloat16}")
    .Attr("epsilon: float = 0.000001")
    .SetShapeFn(rms_norm_shape::ForwardShape)
    .Doc(R"doc(
RMS normalization over the last axis of x (C = its size; rows = the other elements).
y = x * rstd * gamma with per-row rstd = 1 / sqrt(mean(x^2) + epsilon), computed in
float32. rstd (float32, [rows]) is saved for TfmetalExt>RMSNormGrad. epsilon must be
finite and > 0. An empty row (C = 0) has rstd = 1 / sqrt(epsilon). A NaN in a row makes
that row's outputs NaN; an infinity makes its rstd 0 (the row's finite values give 0, the
infinity NaN), as the unfused computation does.
)doc");

REGISTER_OP("TfmetalExt>RMSNormGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("gamma: float")
    .Input("rstd: float")
    .Output("dx: T")
    .Output("dgamma: float")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(rms_norm_shape::GradShape)
    .Doc(R"doc(
Gradient of TfmetalExt>RMSNorm given its saved rstd: dx, and dgamma summed over the rows
in float32. The sum uses a fixed partition of the rows, so the result does not depend on
the number of threads.
)doc");

}  // namespace tfmetal_ext
