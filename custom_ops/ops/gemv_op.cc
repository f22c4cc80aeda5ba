// Registration of TfmetalExt>Gemv: y = x @ kernel (+ bias) for a few rows of x, each
// weight read once (a decoding step's projections). The math and its rounding are
// custom_ops/include/tfmetal/gemv.h. Its gradient is registered in Python
// (tfmetal_ext/ops/gemv.py, MatMuls): no gradient op. Helpers live in namespace
// gemv_shape: all op files are one translation unit (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace gemv_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// x [M, K], kernel [K, N], bias [N] (has_bias) or [0] -> y [M, N]. Unknown dimensions pass
// (the kernels check the real shapes).
Status GemvShape(InferenceContext* c) {
  ShapeHandle x, kernel, bias;
  if (!c->WithRank(c->input(0), 2, &x).ok()) {
    return ::tensorflow::errors::InvalidArgument("x must be a matrix [M, K], got shape ",
                                                 c->DebugString(c->input(0)));
  }
  if (!c->WithRank(c->input(1), 2, &kernel).ok()) {
    return ::tensorflow::errors::InvalidArgument("kernel must be a matrix [K, N], got shape ",
                                                 c->DebugString(c->input(1)));
  }
  DimensionHandle k;
  if (!c->Merge(c->Dim(x, 1), c->Dim(kernel, 0), &k).ok()) {
    return ::tensorflow::errors::InvalidArgument("x's K (", c->DebugString(c->Dim(x, 1)),
                                                 ") must match kernel's first dimension (",
                                                 c->DebugString(c->Dim(kernel, 0)), ")");
  }
  bool has_bias = false;
  TF_RETURN_IF_ERROR(c->GetAttr("has_bias", &has_bias));
  DimensionHandle want = has_bias ? c->Dim(kernel, 1) : c->MakeDim(0);
  DimensionHandle merged;
  if (!c->WithRank(c->input(2), 1, &bias).ok() || !c->Merge(c->Dim(bias, 0), want, &merged).ok()) {
    return ::tensorflow::errors::InvalidArgument(
        has_bias ? "bias must be a vector of the kernel's N values" : "bias must have shape [0] when has_bias is false",
        ", got shape ", c->DebugString(c->input(2)));
  }
  c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(kernel, 1)));
  return Status();
}

}  // namespace gemv_shape

REGISTER_OP("TfmetalExt>Gemv")
    .Input("x: T")
    .Input("kernel: T")
    .Input("bias: T")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("has_bias: bool = false")
    .SetShapeFn(gemv_shape::GemvShape)
    .Doc(R"doc(
y = x @ kernel (+ bias) for x [M, K] with few rows (a decoding step: batch x 1 token) and
kernel [K, N]: every weight is read once, each output one float32 accumulator over k in
increasing order, one fused multiply-add per step, the bias (has_bias: a [N] vector, else
bias is [0]) added in float32, rounded once to T. Meant for small M: the work is M passes
of K x N multiply-adds.
)doc");

}  // namespace tfmetal_ext
