// Registration of TfmetalExt>Int8MatMul and TfmetalExt>Int8Conv2D: weight-only int8
// contractions (float activations, an int8 kernel with a float32 scale per output channel,
// Keras' convention w ~= q / scale), bias and activation in the same op. The math is
// custom_ops/include/tfmetal/int8.h. Their gradients are registered in Python
// (tfmetal_ext/ops/int8.py): no gradient op. Helpers live in namespace int8_shape: all op
// files are one translation unit (tfmetal_ext/ops/_loader.py).
#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "cpu/int8_attrs.h"
#include "tfmetal/int8.h"

namespace tfmetal_ext {
namespace int8_shape {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

Status CheckActivation(InferenceContext* c) {
  std::string activation;
  TF_RETURN_IF_ERROR(c->GetAttr("activation", &activation));
  if (int8_attrs::ActivationCode(activation) >= 0) return Status();
  return ::tensorflow::errors::InvalidArgument("activation must be one of ", int8_attrs::kActivationList, ", got \"",
                                               activation, "\"");
}

// Input `input` must be a vector of `want` elements.
Status CheckVector(InferenceContext* c, int input, const char* name, DimensionHandle want, const char* what) {
  ShapeHandle s;
  if (!c->WithRank(c->input(input), 1, &s).ok()) {
    return ::tensorflow::errors::InvalidArgument(name, " must be a vector of ", what, ", got shape ",
                                                 c->DebugString(c->input(input)));
  }
  DimensionHandle merged;
  if (!c->Merge(c->Dim(s, 0), want, &merged).ok()) {
    return ::tensorflow::errors::InvalidArgument(name, " must be a vector of ", what, " (", c->DebugString(want),
                                                 "), got shape ", c->DebugString(s));
  }
  return Status();
}

// kernel_scale [N] and bias [N] (has_bias) or [0].
Status CheckScaleAndBias(InferenceContext* c, DimensionHandle n) {
  TF_RETURN_IF_ERROR(CheckVector(c, 2, "kernel_scale", n, "the output channels"));
  bool has_bias = false;
  TF_RETURN_IF_ERROR(c->GetAttr("has_bias", &has_bias));
  if (has_bias) return CheckVector(c, 3, "bias", n, "the output channels");
  return CheckVector(c, 3, "bias", c->MakeDim(0), "size 0 when has_bias is false");
}

Status WithRankNamed(InferenceContext* c, int input, int rank, const char* name, const char* layout,
                     ShapeHandle* out) {
  if (!c->WithRank(c->input(input), rank, out).ok()) {
    return ::tensorflow::errors::InvalidArgument(name, " must be ", layout, ", got shape ",
                                                 c->DebugString(c->input(input)));
  }
  return Status();
}

Status MatMulShape(InferenceContext* c) {
  TF_RETURN_IF_ERROR(CheckActivation(c));
  ShapeHandle x, kernel;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 2, "x", "a matrix [M, K]", &x));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 2, "kernel", "a matrix [K, N]", &kernel));
  DimensionHandle k;
  if (!c->Merge(c->Dim(x, 1), c->Dim(kernel, 0), &k).ok()) {
    return ::tensorflow::errors::InvalidArgument("x's K (", c->DebugString(c->Dim(x, 1)),
                                                 ") must match kernel's first dimension (",
                                                 c->DebugString(c->Dim(kernel, 0)), ")");
  }
  TF_RETURN_IF_ERROR(CheckScaleAndBias(c, c->Dim(kernel, 1)));
  c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(kernel, 1)));
  return Status();
}

Status CheckPair(InferenceContext* c, const char* attr, int32_t out[2]) {
  std::vector<int32_t> v;
  TF_RETURN_IF_ERROR(c->GetAttr(attr, &v));
  if (v.size() != 2 || v[0] <= 0 || v[1] <= 0) {
    std::string got;
    for (size_t i = 0; i < v.size(); ++i) got += (i ? "," : "") + std::to_string(v[i]);
    return ::tensorflow::errors::InvalidArgument(attr, " must be 2 positive ints (h, w), got [", got, "]");
  }
  out[0] = v[0];
  out[1] = v[1];
  return Status();
}

DimensionHandle OutputDim(InferenceContext* c, DimensionHandle in, DimensionHandle k, int32_t s, int32_t d,
                          bool same) {
  if (!c->ValueKnown(in) || !c->ValueKnown(k)) return c->UnknownDim();
  const int64_t iv = c->Value(in), kv = c->Value(k);
  if (iv > INT32_MAX || kv > INT32_MAX) return c->UnknownDim();  // the kernel reports it
  return c->MakeDim(tfm_int8_conv_out(static_cast<int32_t>(iv), static_cast<int32_t>(kv), s, d, same));
}

Status Conv2DShape(InferenceContext* c) {
  TF_RETURN_IF_ERROR(CheckActivation(c));
  int32_t strides[2], dilations[2];
  TF_RETURN_IF_ERROR(CheckPair(c, "strides", strides));
  TF_RETURN_IF_ERROR(CheckPair(c, "dilations", dilations));
  std::string padding;
  TF_RETURN_IF_ERROR(c->GetAttr("padding", &padding));
  const bool same = padding == "SAME";
  ShapeHandle x, kernel;
  TF_RETURN_IF_ERROR(WithRankNamed(c, 0, 4, "x", "NHWC [B, H, W, Cin]", &x));
  TF_RETURN_IF_ERROR(WithRankNamed(c, 1, 4, "kernel", "HWIO [KH, KW, Cin, Cout]", &kernel));
  DimensionHandle cin;
  if (!c->Merge(c->Dim(x, 3), c->Dim(kernel, 2), &cin).ok()) {
    return ::tensorflow::errors::InvalidArgument("x's Cin (", c->DebugString(c->Dim(x, 3)),
                                                 ") must match kernel's input channels (",
                                                 c->DebugString(c->Dim(kernel, 2)), ")");
  }
  DimensionHandle cout = c->Dim(kernel, 3);
  TF_RETURN_IF_ERROR(CheckScaleAndBias(c, cout));
  DimensionHandle oh = OutputDim(c, c->Dim(x, 1), c->Dim(kernel, 0), strides[0], dilations[0], same);
  DimensionHandle ow = OutputDim(c, c->Dim(x, 2), c->Dim(kernel, 1), strides[1], dilations[1], same);
  c->set_output(0, c->MakeShape({c->Dim(x, 0), oh, ow, cout}));
  return Status();
}

}  // namespace int8_shape

REGISTER_OP("TfmetalExt>Int8MatMul")
    .Input("x: T")
    .Input("kernel: int8")
    .Input("kernel_scale: float")
    .Input("bias: T")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("activation: string = 'linear'")
    .Attr("leaky_relu_alpha: float = 0.2")
    .Attr("has_bias: bool = false")
    .SetShapeFn(int8_shape::MatMulShape)
    .Doc(R"doc(
y = activation(acc / kernel_scale + bias), acc = x @ float(kernel) accumulated in float32.
x is [M, K] float, kernel int8 [K, N], kernel_scale float32 [N], finite and > 0 (Keras'
int8 convention, w ~= kernel / kernel_scale), bias [N] when has_bias (else [0]). The
activation is linear, relu, relu6, elu, leaky_relu (negative slope leaky_relu_alpha), gelu,
gelu_approximate, tanh, sigmoid. The int8 weights are converted inside the kernel.
)doc");

REGISTER_OP("TfmetalExt>Int8Conv2D")
    .Input("x: T")
    .Input("kernel: int8")
    .Input("kernel_scale: float")
    .Input("bias: T")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("activation: string = 'linear'")
    .Attr("leaky_relu_alpha: float = 0.2")
    .Attr("has_bias: bool = false")
    .Attr("strides: list(int) = [1, 1]")
    .Attr("dilations: list(int) = [1, 1]")
    .Attr("padding: {'SAME', 'VALID'} = 'VALID'")
    .SetShapeFn(int8_shape::Conv2DShape)
    .Doc(R"doc(
The 2-D convolution of x (NHWC [B, H, W, Cin]) with the int8 kernel (HWIO [KH, KW, Cin,
Cout]) de-scaled per output channel: y = activation(acc / kernel_scale + bias), acc
accumulated in float32. strides and dilations are (h, w); padding follows TF's Conv2D
rules. Attributes and the other inputs as TfmetalExt>Int8MatMul.
)doc");

}  // namespace tfmetal_ext
