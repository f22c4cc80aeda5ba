// Registration of TfmetalExt>BatchNormAct (batch normalization with batch
// statistics + optional residual side input + activation) and its gradient op
// TfmetalExt>BatchNormActGrad. The math: custom_ops/include/tfmetal/batch_norm_act.h.
//
// gamma, beta and the statistics are float32 for every x dtype (the layer's
// float32 variables go in without a cast under mixed precision). The side
// input is a list of 0 or 1 tensors of x's shape and dtype. Helpers live in
// namespace batch_norm_act_shape: all op files are one translation unit
// (tfmetal_ext/ops/_loader.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "ops/norm_shapes.h"

namespace tfmetal_ext {
namespace batch_norm_act_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

using norm_shapes::CheckVectorShape;
using norm_shapes::InferRowsAndChannels;

// x's rank (>= 2) and channels; inputs [first, first + count) must have x's shape.
Status XShape(InferenceContext* c, int x_index, int first, int count, const char* const* names, ShapeHandle* x,
              DimensionHandle* channels) {
  *x = c->input(x_index);
  if (c->RankKnown(*x) && c->Rank(*x) < 2) {
    return ::tensorflow::errors::InvalidArgument(
        "x must have rank >= 2 (channels last, batch statistics over the other axes), got shape ", c->DebugString(*x));
  }
  for (int i = 0; i < count; ++i) {
    if (!c->Merge(*x, c->input(first + i), x).ok()) {
      return ::tensorflow::errors::InvalidArgument(names[i], " must have the shape of x, ",
                                                   c->DebugString(c->input(x_index)), ", got ",
                                                   c->DebugString(c->input(first + i)));
    }
  }
  DimensionHandle rows;
  return InferRowsAndChannels(c, *x, channels, &rows);
}

Status ForwardShape(InferenceContext* c) {
  int n = 0, m = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  TF_RETURN_IF_ERROR(c->GetAttr("M", &m));
  if (n > 1) return ::tensorflow::errors::InvalidArgument("at most one side input, got ", n);
  if (m != 0 && m != 2) {
    return ::tensorflow::errors::InvalidArgument(
        "moving must be empty or (moving_mean, moving_variance), got ", m, " tensors");
  }
  const char* names[] = {"side"};
  ShapeHandle x;
  DimensionHandle channels;
  TF_RETURN_IF_ERROR(XShape(c, 0, 3, n, names, &x, &channels));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 1, "gamma", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 2, "beta", channels, "the last dimension of x"));
  if (m == 2) {
    TF_RETURN_IF_ERROR(CheckVectorShape(c, 3 + n, "moving_mean", channels, "the last dimension of x"));
    TF_RETURN_IF_ERROR(CheckVectorShape(c, 4 + n, "moving_variance", channels, "the last dimension of x"));
  }
  c->set_output(0, x);
  for (int i = 1; i < 4 + m; ++i) c->set_output(i, c->Vector(channels));
  return Status();
}

Status GradShape(InferenceContext* c) {
  int n = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  if (n > 1) return ::tensorflow::errors::InvalidArgument("at most one side input, got ", n);
  // dy (0), x (1), y (2), gamma (3), beta (4), side (5 .. 5 + n), mean, inv_std.
  const char* like_x[] = {"y", "side"};
  ShapeHandle x;
  DimensionHandle channels;
  TF_RETURN_IF_ERROR(XShape(c, 1, 2, 1, like_x, &x, &channels));
  if (n == 1) TF_RETURN_IF_ERROR(XShape(c, 1, 5, 1, like_x + 1, &x, &channels));
  if (!c->Merge(x, c->input(0), &x).ok()) {
    return ::tensorflow::errors::InvalidArgument("dy must have the shape of x, ", c->DebugString(c->input(1)),
                                                 ", got ", c->DebugString(c->input(0)));
  }
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 3, "gamma", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 4, "beta", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 5 + n, "mean", channels, "the last dimension of x"));
  TF_RETURN_IF_ERROR(CheckVectorShape(c, 6 + n, "inv_std", channels, "the last dimension of x"));
  c->set_output(0, x);
  c->set_output(1, c->Vector(channels));
  c->set_output(2, c->Vector(channels));
  if (n == 1) c->set_output(3, x);
  return Status();
}

}  // namespace batch_norm_act_shape

// The activation names in the order of tfmetal/batch_norm_act.h's TFM_BNA_* codes
// (tfmetal_ext/backends/fusion.py BATCH_NORM_ACT_ACTIVATIONS, checked by tests/ops/test_batch_norm_act.py).
#define TFMETAL_BNA_ACTIVATION_ATTR \
  "activation: {'linear', 'relu', 'relu6', 'elu', 'leaky_relu', 'silu', 'gelu'} = 'relu'"

REGISTER_OP("TfmetalExt>BatchNormAct")
    .Input("x: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Input("side: N * T")
    .Input("moving: M * float")
    .Output("y: T")
    .Output("mean: float")
    .Output("inv_std: float")
    .Output("variance: float")
    .Output("new_moving: M * float")
    .Attr("T: {float, half, bfloat16}")
    .Attr("N: int >= 0 = 0")
    .Attr("M: int >= 0 = 0")
    .Attr(TFMETAL_BNA_ACTIVATION_ATTR)
    .Attr("alpha: float = 0.2")
    .Attr("epsilon: float = 0.001")
    .Attr("momentum: float = 0.99")
    .SetShapeFn(batch_norm_act_shape::ForwardShape)
    .Doc(R"doc(
Batch normalization with batch statistics (training), an optional residual side input
and an activation, in one op. x has rank >= 2, channels last; the statistics are over
every other axis (M rows), in float32: mean, biased variance, inv_std = 1 / sqrt(variance
+ epsilon). y = act((x - mean) * inv_std * gamma + beta (+ side)), rounded once to T.
activation: linear, relu, relu6, elu, leaky_relu (negative slope alpha), silu (x *
sigmoid(x)) or gelu (exact, erf form). side: zero or one tensor of x's shape. An empty
batch (M = 0) gives NaN statistics. The row sums use a fixed partition of the rows: the
results do not depend on the number of threads.
moving: empty, or (moving_mean, moving_variance), float32 vectors of x's last dimension;
then new_moving is their update, moving * momentum + batch * (1 - momentum) for the mean
and the biased variance, taken only when every updated value is finite (else moving comes
back unchanged: a batch with an inf or NaN, or an empty batch, leaves it as it was).
)doc");

REGISTER_OP("TfmetalExt>BatchNormActGrad")
    .Input("dy: T")
    .Input("x: T")
    .Input("y: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Input("side: N * T")
    .Input("mean: float")
    .Input("inv_std: float")
    .Output("dx: T")
    .Output("dgamma: float")
    .Output("dbeta: float")
    .Output("dside: N * T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("N: int >= 0 = 0")
    .Attr(TFMETAL_BNA_ACTIVATION_ATTR)
    .Attr("alpha: float = 0.2")
    .Attr("epsilon: float = 0.001")
    .SetShapeFn(batch_norm_act_shape::GradShape)
    .Doc(R"doc(
Gradient of TfmetalExt>BatchNormAct given its saved mean and inv_std: dx, dgamma and dbeta
(float32 sums over the rows) and, with a side input, dside (= d pre). The activation's
derivative reads pre, recomputed from x (+ side) and the statistics; y is not read.
)doc");

#undef TFMETAL_BNA_ACTIVATION_ATTR

}  // namespace tfmetal_ext
