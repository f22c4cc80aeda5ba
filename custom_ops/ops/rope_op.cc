// Registration of TfmetalExt>Rope and its gradient op TfmetalExt>RopeGrad.
//
// positions and inv_freq are float32 for every x dtype: the angle is their
// float32 product, as in keras-hub's RotaryEmbedding. Neither has a gradient
// (the wrapper computes them from integers and the layer's constants).
// Helpers live in namespace rope_shape: all op files are one translation unit
// (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace rope_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// x: [batch, sequence, ..., features] with even features; positions [sequence]
// or [1 or batch, sequence]; inv_freq [features / 2]. Unknown dimensions pass
// (the kernels check the real shapes).
Status RopeShape(InferenceContext* c) {
  ShapeHandle x, positions, inv_freq;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 3, &x));
  TF_RETURN_IF_ERROR(c->WithRankAtMost(c->input(1), 2, &positions));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(positions, 1, &positions));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &inv_freq));
  if (c->RankKnown(x)) {
    DimensionHandle features = c->Dim(x, -1);
    if (c->ValueKnown(features)) {
      if (c->Value(features) % 2 != 0) {
        return ::tensorflow::errors::InvalidArgument(
            "the last dimension of x (features) must be even: its halves are rotated together, got shape ",
            c->DebugString(x));
      }
      DimensionHandle half;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(inv_freq, 0), c->MakeDim(c->Value(features) / 2), &half));
    }
    if (c->RankKnown(positions)) {
      DimensionHandle sequence;
      if (!c->Merge(c->Dim(positions, -1), c->Dim(x, 1), &sequence).ok()) {
        return ::tensorflow::errors::InvalidArgument("positions must have shape [sequence] or [batch, sequence] of x ",
                                                     c->DebugString(x), ", got ", c->DebugString(positions));
      }
    }
  }
  c->set_output(0, c->input(0));
  return Status();
}

Status RopeGradShape(InferenceContext* c) {
  return RopeShape(c);
}

}  // namespace rope_shape

REGISTER_OP("TfmetalExt>Rope")
    .Input("x: T")
    .Input("positions: float")
    .Input("inv_freq: float")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("scale: float = 1.0")
    .SetShapeFn(rope_shape::RopeShape)
    .Doc(R"doc(
Rotary position embedding over the last axis of x ([batch, sequence, ..., features],
features even), split into halves x1 | x2: pair i of row (b, t) turns by
angle = positions[b, t] * inv_freq[i] (positions [sequence] or [1 or batch, sequence]):
y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s with c = scale * cos(angle), s = scale * sin(angle),
in float32, rounded once to x's dtype.
)doc");

REGISTER_OP("TfmetalExt>RopeGrad")
    .Input("dy: T")
    .Input("positions: float")
    .Input("inv_freq: float")
    .Output("dx: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("scale: float = 1.0")
    .SetShapeFn(rope_shape::RopeGradShape)
    .Doc("Gradient of TfmetalExt>Rope with respect to x: dy turned back, dx1 = dy1 * c + dy2 * s, "
         "dx2 = dy2 * c - dy1 * s. positions and inv_freq get no gradient.");

}  // namespace tfmetal_ext
