// Shape-function checks shared by the registrations of the ops that normalize
// over the last axis (layer_norm_op.cc, rms_norm_op.cc): x's rows and channels,
// and the per-channel / per-row vectors that go with it.
#ifndef TFMETAL_OPS_NORM_SHAPES_H_
#define TFMETAL_OPS_NORM_SHAPES_H_

#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace norm_shapes {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Input `input` (called `name`) must be a vector of `want` elements (when both are known).
inline Status CheckVectorShape(InferenceContext* c, int input, const char* name, DimensionHandle want,
                               const char* what) {
  ShapeHandle s = c->input(input);
  if (!c->RankKnown(s)) return Status();
  if (c->Rank(s) != 1) {
    return ::tensorflow::errors::InvalidArgument(name, " must be a vector of ", what, ", got shape ",
                                                 c->DebugString(s));
  }
  DimensionHandle got = c->Dim(s, 0);
  if (c->ValueKnown(got) && c->ValueKnown(want) && c->Value(got) != c->Value(want)) {
    return ::tensorflow::errors::InvalidArgument(name, " must be a vector of ", what, " = ", c->Value(want),
                                                 ", got shape ", c->DebugString(s));
  }
  return Status();
}

// Checks x's rank (>= 1) and gives its last dimension C and its number of rows.
inline Status InferRowsAndChannels(InferenceContext* c, ShapeHandle x, DimensionHandle* channels,
                                   DimensionHandle* rows) {
  *channels = c->UnknownDim();
  *rows = c->UnknownDim();
  if (!c->RankKnown(x)) return Status();
  const int rank = c->Rank(x);
  if (rank < 1) {
    return ::tensorflow::errors::InvalidArgument("x must have rank >= 1 (normalized over its last axis), got shape ",
                                                 c->DebugString(x));
  }
  *channels = c->Dim(x, rank - 1);
  DimensionHandle n = c->MakeDim(1);
  for (int i = 0; i < rank - 1; ++i) TF_RETURN_IF_ERROR(c->Multiply(n, c->Dim(x, i), &n));
  *rows = n;
  return Status();
}

}  // namespace norm_shapes
}  // namespace tfmetal_ext

#endif  // TFMETAL_OPS_NORM_SHAPES_H_
