// Registration of TfmetalExt>Attention and its gradient op TfmetalExt>AttentionGrad.
//
// query [B, H, Tq, D], key [B, Hk, Tk, D], value [B, Hk, Tk, Dv] of one float
// dtype T (layout "BHSD"; with layout "BSHD" the sequence and heads axes of
// query, key, value, output and the gradients are swapped: [B, Tq, H, D] ...), Hk dividing H (grouped-query attention; Hk = H without); a boolean "attend" mask of rank 4 whose every dimension is 1 or the
// full size of [B, H, Tq, Tk] ([1, 1, 1, 1] True for no mask). The saved
// log-sum-exp is float32 for every T.
//
// Attention dropout: `seed` is a list of 0 or 1 tensors (Tseed, default
// empty), so a graph written before the input existed (4 / 7 inputs, no
// Tseed attr) still loads and runs as before, and dropout_rate defaults to 0.
// With dropout_rate > 0 the list holds the stateless seed (2 int32 or int64,
// as TfmetalExt>Dropout's); the kernels refuse a missing or malformed one.
#include <string>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tfmetal/attention.h"
#include "tfmetal/host_checks.h"

namespace tfmetal_ext {
namespace attention_op {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

constexpr int64_t kMaxHeadDim = 256;

Status Rank4(InferenceContext* c, int input, const char* name, ShapeHandle* out) {
  ShapeHandle s = c->input(input);
  if (c->RankKnown(s) && c->Rank(s) != 4) {
    return ::tensorflow::errors::InvalidArgument(name, " must have rank 4, got shape ", c->DebugString(s));
  }
  return c->WithRank(s, 4, out);
}

// Merges dimension `a_axis` of a with `b_axis` of b (an error naming both when they differ).
Status MergeDim(InferenceContext* c, ShapeHandle a, int a_axis, const char* a_name, ShapeHandle b, int b_axis,
                const char* b_name, const char* what, DimensionHandle* out) {
  if (!c->Merge(c->Dim(a, a_axis), c->Dim(b, b_axis), out).ok()) {
    return ::tensorflow::errors::InvalidArgument(a_name, " and ", b_name, " must have the same ", what, ", got shapes ",
                                                 c->DebugString(a), " and ", c->DebugString(b));
  }
  return Status();
}

Status CheckHeadDim(InferenceContext* c, DimensionHandle d, const char* name, ShapeHandle s) {
  if (c->ValueKnown(d) && (c->Value(d) < 1 || c->Value(d) > kMaxHeadDim)) {
    return ::tensorflow::errors::InvalidArgument("the last dimension of ", name, " must be in [1, ", kMaxHeadDim,
                                                 "], got shape ", c->DebugString(s));
  }
  return Status();
}

// The shape of a [B, heads, T, width] operand in `layout` ("BSHD": [B, T, heads, width]).
ShapeHandle InLayout(InferenceContext* c, bool bshd, DimensionHandle b, DimensionHandle heads, DimensionHandle t,
                     DimensionHandle width) {
  return bshd ? c->MakeShape({b, t, heads, width}) : c->MakeShape({b, heads, t, width});
}

Status ReadLayout(InferenceContext* c, bool* bshd) {
  std::string value;
  TF_RETURN_IF_ERROR(c->GetAttr("layout", &value));
  uint32_t layout = TFM_ATTENTION_LAYOUT_BHSD;
  const std::string error = AttentionLayoutFromString(value, &layout);  // tfmetal/host_checks.h
  if (!error.empty()) return ::tensorflow::errors::InvalidArgument(error);
  *bshd = layout == TFM_ATTENTION_LAYOUT_BSHD;
  return Status();
}

// Checks query/key/value/mask (inputs first..first+3) and gives B, H, Tq, Tk, D, Dv, Hk.
// The heads and sequence axes of query/key/value are 1 and 2 (BHSD) or 2 and 1 (BSHD).
Status CheckAttentionInputs(InferenceContext* c, int first, bool bshd, DimensionHandle dims[7]) {
  const int ha = attention_heads_axis(bshd ? TFM_ATTENTION_LAYOUT_BSHD : TFM_ATTENTION_LAYOUT_BHSD), sa = 3 - ha;
  ShapeHandle q, k, v, m;
  TF_RETURN_IF_ERROR(Rank4(c, first, "query", &q));
  TF_RETURN_IF_ERROR(Rank4(c, first + 1, "key", &k));
  TF_RETURN_IF_ERROR(Rank4(c, first + 2, "value", &v));
  TF_RETURN_IF_ERROR(Rank4(c, first + 3, "mask", &m));
  DimensionHandle b, h = c->Dim(q, ha), hk, tk, d;
  TF_RETURN_IF_ERROR(MergeDim(c, q, 0, "query", k, 0, "key", "batch dimension", &b));
  TF_RETURN_IF_ERROR(MergeDim(c, q, 3, "query", k, 3, "key", "head dim", &d));
  ShapeHandle qb = c->MakeShape({b, h, c->Dim(q, sa), d});
  TF_RETURN_IF_ERROR(MergeDim(c, qb, 0, "query", v, 0, "value", "batch dimension", &b));
  TF_RETURN_IF_ERROR(MergeDim(c, k, ha, "key", v, ha, "value", "heads dimension", &hk));
  TF_RETURN_IF_ERROR(MergeDim(c, k, sa, "key", v, sa, "value", "sequence length", &tk));
  if (c->ValueKnown(h) && c->ValueKnown(hk) && (c->Value(hk) < 1 || c->Value(h) % c->Value(hk) != 0) &&
      !(c->Value(h) == 0 && c->Value(hk) == 0)) {
    return ::tensorflow::errors::InvalidArgument("the key/value heads must divide the query heads, got shapes ",
                                                 c->DebugString(q), " and ", c->DebugString(k));
  }
  DimensionHandle tq = c->Dim(q, sa), dv = c->Dim(v, 3);
  TF_RETURN_IF_ERROR(CheckHeadDim(c, d, "query", q));
  TF_RETURN_IF_ERROR(CheckHeadDim(c, dv, "value", v));
  const DimensionHandle full[4] = {b, h, tq, tk};
  for (int axis = 0; axis < 4; ++axis) {
    DimensionHandle got = c->Dim(m, axis);
    if (c->ValueKnown(got) && c->ValueKnown(full[axis]) && c->Value(got) != 1 &&
        c->Value(got) != c->Value(full[axis])) {
      return ::tensorflow::errors::InvalidArgument(
          "mask must broadcast to [batch, heads, q_seq, kv_seq] = ", c->DebugString(c->MakeShape({b, h, tq, tk})),
          " with each dimension 1 or the full size, got shape ", c->DebugString(m));
    }
  }
  dims[0] = b;
  dims[1] = h;
  dims[2] = tq;
  dims[3] = tk;
  dims[4] = d;
  dims[5] = dv;
  dims[6] = hk;
  return Status();
}

// The optional seed (inputs first..): at most one tensor, a vector of 2 where known.
Status CheckSeed(InferenceContext* c, int first) {
  const int n = c->num_inputs() - first;
  if (n > 1) {
    return ::tensorflow::errors::InvalidArgument("seed must be a list of at most one tensor, got ", n);
  }
  if (n == 1) {
    ShapeHandle seed;
    DimensionHandle two;
    if (!c->WithRank(c->input(first), 1, &seed).ok() || !c->WithValue(c->Dim(seed, 0), 2, &two).ok()) {
      return ::tensorflow::errors::InvalidArgument("seed must have shape [2], not ", c->DebugString(c->input(first)));
    }
  }
  return Status();
}

Status AttentionShape(InferenceContext* c) {
  DimensionHandle dims[7];
  bool bshd = false;
  TF_RETURN_IF_ERROR(ReadLayout(c, &bshd));
  TF_RETURN_IF_ERROR(CheckAttentionInputs(c, 0, bshd, dims));
  TF_RETURN_IF_ERROR(CheckSeed(c, 4));
  c->set_output(0, InLayout(c, bshd, dims[0], dims[1], dims[2], dims[5]));
  c->set_output(1, c->MakeShape({dims[0], dims[1], dims[2]}));
  return Status();
}

Status AttentionGradShape(InferenceContext* c) {
  DimensionHandle dims[7];
  bool bshd = false;
  TF_RETURN_IF_ERROR(ReadLayout(c, &bshd));
  TF_RETURN_IF_ERROR(CheckAttentionInputs(c, 1, bshd, dims));
  TF_RETURN_IF_ERROR(CheckSeed(c, 7));
  ShapeHandle want_out = InLayout(c, bshd, dims[0], dims[1], dims[2], dims[5]);
  ShapeHandle merged;
  for (int input : {0, 5}) {
    if (!c->Merge(c->input(input), want_out, &merged).ok()) {
      return ::tensorflow::errors::InvalidArgument(input == 0 ? "d_output" : "output",
                                                   " must have the shape of the op's output, ",
                                                   c->DebugString(want_out), ", got ", c->DebugString(c->input(input)));
    }
  }
  ShapeHandle want_lse = c->MakeShape({dims[0], dims[1], dims[2]});
  if (!c->Merge(c->input(6), want_lse, &merged).ok()) {
    return ::tensorflow::errors::InvalidArgument("lse must have the shape [batch, heads, q_seq] = ",
                                                 c->DebugString(want_lse), ", got ", c->DebugString(c->input(6)));
  }
  c->set_output(0, InLayout(c, bshd, dims[0], dims[1], dims[2], dims[4]));
  c->set_output(1, InLayout(c, bshd, dims[0], dims[6], dims[3], dims[4]));
  c->set_output(2, InLayout(c, bshd, dims[0], dims[6], dims[3], dims[5]));
  return Status();
}

}  // namespace attention_op

REGISTER_OP("TfmetalExt>Attention")
    .Input("query: T")
    .Input("key: T")
    .Input("value: T")
    .Input("mask: bool")
    .Input("seed: Tseed")
    .Output("output: T")
    .Output("lse: float")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tseed: list({int32, int64}) >= 0 = []")
    .Attr("causal: bool = false")
    .Attr("sliding_window: int = 0")
    .Attr("scale: float = 1.0")
    .Attr("dropout_rate: float = 0.0")
    .Attr("dropout_scale: float = 1.0")
    .Attr("layout: {'BHSD', 'BSHD'} = 'BHSD'")
    .SetShapeFn(attention_op::AttentionShape)
    .Doc(R"doc(
Scaled dot-product softmax attention per batch and head, flash-style (the
[Tq, Tk] score matrix is never stored): output = softmax(scale * query key^T)
value over the attended keys, computed in float32 for every T. Key j is
attended by query i where mask (broadcast: each dimension 1 or the full size
of [B, H, Tq, Tk]) is True, with causal j <= i, and with sliding_window w > 0
|i - j| < w. Grouped-query attention: key and value may have Hk heads, Hk
dividing H; query head h reads key/value head h / (H / Hk). lse (float32, [B, H, Tq])
is each row's log-sum-exp of the attended scores, saved for
TfmetalExt>AttentionGrad. A row attending no key has output 0 and lse -inf.
scale must be finite and > 0; head dims 1..256.

Attention dropout when dropout_rate > 0: the probabilities are multiplied by
dropout_scale where kept and 0 where dropped, by the mask of
tf.nn.experimental.stateless_dropout of a [B, H, Tq, Tk] tensor of dtype T
with seed `seed` (one tensor of 2 int32/int64 values, required then);
dropout_rate (in [0, 1]) and dropout_scale (> 0) are taken as given
(tfmetal_ext.ops.attention passes the rate and 1 / (1 - rate) as T rounds
them). lse stays the log-sum-exp of the undropped scores.

layout "BSHD" takes query [B, Tq, H, D], key [B, Tk, Hk, D], value
[B, Tk, Hk, Dv] and gives output [B, Tq, H, Dv] (the sequence before the
heads, as a projection to heads writes them), read and written in place with
the same math and summation order as "BHSD": the same values, bit for bit.
The mask, lse and the dropout mask keep their [B, H, Tq, Tk] indexing.
)doc");

REGISTER_OP("TfmetalExt>AttentionGrad")
    .Input("d_output: T")
    .Input("query: T")
    .Input("key: T")
    .Input("value: T")
    .Input("mask: bool")
    .Input("output: T")
    .Input("lse: float")
    .Input("seed: Tseed")
    .Output("d_query: T")
    .Output("d_key: T")
    .Output("d_value: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tseed: list({int32, int64}) >= 0 = []")
    .Attr("causal: bool = false")
    .Attr("sliding_window: int = 0")
    .Attr("scale: float = 1.0")
    .Attr("dropout_rate: float = 0.0")
    .Attr("dropout_scale: float = 1.0")
    .Attr("layout: {'BHSD', 'BSHD'} = 'BHSD'")
    .SetShapeFn(attention_op::AttentionGradShape)
    .Doc(R"doc(
Gradient of TfmetalExt>Attention from its output and saved lse: the
probabilities are recomputed tile by tile (p = exp(scale q.k - lse)), with
Dr = rowsum(d_output * output) and ds = p (d_output . v - Dr):
d_query = scale ds key, d_key = scale ds^T query, d_value = p^T d_output
(with grouped-query attention, d_key and d_value of a key/value head sum
over the query heads that read it).
float32 accumulation for every T; deterministic (no atomics, the summation
order depends on the shapes only). With dropout (the forward's seed,
dropout_rate and dropout_scale) the mask m (dropout_scale or 0) is drawn
once more, d_value = (p m)^T d_output and ds = p (m (d_output . v) - Dr),
with output the forward's dropped output. layout is the forward's: d_output,
output and the three gradients are in it.
)doc");

}  // namespace tfmetal_ext
