// Registration of TfmetalExt>Dropout and its gradient op TfmetalExt>DropoutGrad.
//
// Both take the seed as a tensor (2 elements, int32 or int64, like the
// stateless random ops' seeds), so the gradient regenerates the forward's
// mask from it instead of storing the mask. Helpers live in namespace
// dropout_shape: all op files are one translation unit (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace dropout_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Output: the shape of input 0; input 1 (the seed) a vector of 2 where known.
Status Shape(InferenceContext* c) {
  ShapeHandle seed;
  DimensionHandle two;
  if (!c->WithRank(c->input(1), 1, &seed).ok() || !c->WithValue(c->Dim(seed, 0), 2, &two).ok()) {
    return ::tensorflow::errors::InvalidArgument("seed must have shape [2], not ", c->DebugString(c->input(1)));
  }
  c->set_output(0, c->input(0));
  return Status();
}

}  // namespace dropout_shape

REGISTER_OP("TfmetalExt>Dropout")
    .Input("x: T")
    .Input("seed: Tseed")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tseed: {int32, int64} = DT_INT64")
    .Attr("rate: float")
    .Attr("scale: float")
    .SetShapeFn(dropout_shape::Shape)
    .Doc(R"doc(
Dropout with the mask of tf.nn.experimental.stateless_dropout(x, rate, seed), bit for bit:
y = x * scale where the element's uniform number in [0, 1) is >= rate, else 0. The uniform
numbers are StatelessRandomUniformV2's (Philox, dtype T) for the key and counter
StatelessRandomGetKeyCounter makes of `seed`. rate (in [0, 1]) and scale (> 0; 1 / (1 - rate))
are taken as given: tfmetal_ext.ops.dropout passes them as T rounds them (a rate that rounds
to 1 drops everything; a float16 scale may then overflow to inf).
)doc");

REGISTER_OP("TfmetalExt>DropoutGrad")
    .Input("dy: T")
    .Input("seed: Tseed")
    .Output("dx: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tseed: {int32, int64} = DT_INT64")
    .Attr("rate: float")
    .Attr("scale: float")
    .SetShapeFn(dropout_shape::Shape)
    .Doc(R"doc(
Gradient of TfmetalExt>Dropout: dx = dy * scale where the forward kept the element, else 0.
The mask is regenerated from the same seed, rate and dtype, never stored.
)doc");

}  // namespace tfmetal_ext
