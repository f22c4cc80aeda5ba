// Registration of TfmetalExt>SparseSoftmaxCrossEntropy and its gradient op
// TfmetalExt>SparseSoftmaxCrossEntropyGrad.
//
// The forward op keeps two float32 statistics per row (the max logit and the
// sum of exp(x - max)) instead of TensorFlow's [rows, classes] backprop: the
// gradient op makes the softmax again from them and the logits, in one pass
// that writes the gradient (into the logits' buffer when nothing else reads
// them). Helpers live in namespace sparse_xent_shape: all op files are one
// translation unit (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfmetal_ext {
namespace sparse_xent_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// logits [rows, classes] at input `logits_index`; `rows_inputs` more [rows]
// vectors from `first_vector` on (labels, and the statistics and dloss of the
// gradient op). Unknown dimensions pass (the kernels check the real shapes).
Status RowsOf(InferenceContext* c, int logits_index, int first_vector, int vectors, DimensionHandle* rows) {
  ShapeHandle logits;
  if (!c->WithRank(c->input(logits_index), 2, &logits).ok()) {
    return ::tensorflow::errors::InvalidArgument("logits must be 2-D, but got shape ",
                                                 c->DebugString(c->input(logits_index)));
  }
  *rows = c->Dim(logits, 0);
  for (int i = first_vector; i < first_vector + vectors; ++i) {
    ShapeHandle v;
    if (!c->WithRank(c->input(i), 1, &v).ok()) {
      return ::tensorflow::errors::InvalidArgument("all row vectors (labels, dloss, row_max, row_sum) must be 1-D, "
                                                   "but got shape ", c->DebugString(c->input(i)));
    }
    if (!c->Merge(*rows, c->Dim(v, 0), rows).ok()) {
      return ::tensorflow::errors::InvalidArgument("logits and the row vectors must have the same first dimension, "
                                                   "got logits shape ", c->DebugString(logits), " and shape ",
                                                   c->DebugString(v));
    }
  }
  return Status();
}

Status ForwardShape(InferenceContext* c) {
  DimensionHandle rows;
  TF_RETURN_IF_ERROR(RowsOf(c, 0, 1, 1, &rows));
  for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(rows));
  return Status();
}

Status GradShape(InferenceContext* c) {
  DimensionHandle rows;
  // dloss, logits, labels, row_max, row_sum.
  TF_RETURN_IF_ERROR(RowsOf(c, 1, 2, 3, &rows));
  TF_RETURN_IF_ERROR(RowsOf(c, 1, 0, 1, &rows));
  ShapeHandle logits;
  TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(1), 0, rows, &logits));
  c->set_output(0, logits);
  return Status();
}

}  // namespace sparse_xent_shape

REGISTER_OP("TfmetalExt>SparseSoftmaxCrossEntropy")
    .Input("logits: T")
    .Input("labels: Tlabels")
    .Output("loss: T")
    .Output("row_max: float")
    .Output("row_sum: float")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tlabels: {int32, int64} = DT_INT64")
    .SetShapeFn(sparse_xent_shape::ForwardShape)
    .Doc(R"doc(
Softmax cross-entropy of logits [rows, classes] (classes >= 1) with integer labels [rows] in
[0, classes), in float32, rounded once to T: loss = log(sum_j exp(x_j - m)) - (x_label - m) with
m the row's max. row_max (m) and row_sum (the sum) are the gradient op's statistics. The CPU
kernel refuses a label outside [0, classes) with TensorFlow's error; the Metal kernel gives NaN
for its row (as TensorFlow's GPU kernel).
)doc");

REGISTER_OP("TfmetalExt>SparseSoftmaxCrossEntropyGrad")
    .Input("dloss: T")
    .Input("logits: T")
    .Input("labels: Tlabels")
    .Input("row_max: float")
    .Input("row_sum: float")
    .Output("dlogits: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tlabels: {int32, int64} = DT_INT64")
    .SetShapeFn(sparse_xent_shape::GradShape)
    .Doc("Gradient of TfmetalExt>SparseSoftmaxCrossEntropy's loss with respect to the logits: "
         "dlogits = (exp(x - row_max) / row_sum - one_hot(labels)) * dloss[:, None], in float32, rounded "
         "once to T. The labels get no gradient.");

}  // namespace tfmetal_ext
