// Host-only C++ of the broadcasting gap kernels (gap_broadcast_metal.mm):
// TF's shape rules for DivNoNan and BroadcastTo, in the order and with the
// InvalidArgument texts of TF's CPU kernels. Kept out of tfmetal/gap_broadcast.h
// (which Metal and the emulator compile with every kernel) because it needs
// std::string. The emulator tests build this header alone (TFM_EMU: the C
// functions at the end) and hold its answers against TF's CPU kernels.
#ifndef TFMETAL_GAP_BROADCAST_CHECKS_H_
#define TFMETAL_GAP_BROADCAST_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tfmetal/gap_broadcast.h"
#include "tfmetal/host_checks.h"

// DivNoNan's output shape from x's and y's (numpy broadcasting, as TF's BCast):
// "" and *out, or TF's InvalidArgument text "Incompatible shapes: [2,3] vs. [4]".
inline std::string GapBinaryShape(const std::vector<int64_t>& x, const std::vector<int64_t>& y,
                                  std::vector<int64_t>* out) {
  out->assign(x.size() > y.size() ? x.size() : y.size(), 0);
  int rank = 0;
  if (!GapBroadcastShape(x.data(), static_cast<int>(x.size()), y.data(), static_cast<int>(y.size()), out->data(),
                         &rank)) {
    return "Incompatible shapes: " + tfmetal_ext::ShapeText(x.data(), static_cast<int>(x.size())) + " vs. " +
           tfmetal_ext::ShapeText(y.data(), static_cast<int>(y.size()));
  }
  return "";
}

// What BroadcastTo does with an input and its `shape` argument.
enum GapBroadcastToAction { kGapBroadcastToCopy = 0, kGapBroadcastToForward = 1, kGapBroadcastToError = 2 };

// BroadcastTo's checks, in the order and with the InvalidArgument texts of
// TF's CPU kernel. `shape_dims` is the shape argument's own shape, `shape` its
// values (int32 or int64, widened). On success *out is the output shape and
// the action says whether to copy or to forward the input (TF forwards it when
// the shapes are equal); on failure *error is TF's message.
inline GapBroadcastToAction GapBroadcastToCheck(const std::vector<int64_t>& input,
                                                const std::vector<int64_t>& shape_dims,
                                                const std::vector<int64_t>& shape, std::vector<int64_t>* out,
                                                std::string* error) {
  const int in_rank = static_cast<int>(input.size());
  if (shape_dims.size() != 1) {
    *error = "shape must be a vector of {int32,int64}, got shape " +
             tfmetal_ext::ShapeText(shape_dims.data(), static_cast<int>(shape_dims.size()));
    return kGapBroadcastToError;
  }
  // The shape's values, as TensorShape builds them (254 dimensions at most, none negative, at most
  // 2^63 - 1 elements).
  *error = tfmetal_ext::ShapeValuesError(shape.data(), static_cast<int64_t>(shape.size()));
  if (!error->empty()) return kGapBroadcastToError;
  *out = shape;
  if (shape == input) return kGapBroadcastToForward;
  const int out_rank = static_cast<int>(shape.size());
  if (in_rank > out_rank) {
    *error = "Rank of input (" + std::to_string(in_rank) + ") must be no greater than rank of output shape (" +
             std::to_string(out_rank) + ").";
    return kGapBroadcastToError;
  }
  // TF's BCast of (input, shape): incompatible where neither is 1; valid but
  // not `shape` where shape has a 1 the input does not.
  bool incompatible = false, unable = false;
  for (int i = 0; i < in_rank; ++i) {
    const int64_t d = input[in_rank - 1 - i], o = shape[out_rank - 1 - i];
    incompatible |= d != o && d != 1 && o != 1;
    unable |= o == 1 && d != 1;
  }
  const std::string in_text = tfmetal_ext::ShapeText(input.data(), in_rank);
  const std::string out_text = tfmetal_ext::ShapeText(shape.data(), out_rank);
  if (incompatible) {
    *error = "Incompatible shapes: " + in_text + " vs. " + out_text;
    return kGapBroadcastToError;
  }
  if (unable) {
    *error = "Unable to broadcast tensor of shape " + in_text + " to tensor of shape " + out_text;
    return kGapBroadcastToError;
  }
  return kGapBroadcastToCopy;
}

#if defined(TFM_EMU)
// For the emulator tests (ctypes). Messages are copied into error[capacity], cut if longer.
#include <cstring>

#define TFM_GAP_BCAST_CHECKS_API extern "C" __attribute__((visibility("default")))

inline void GapCopyText(const std::string& text, char* error, int capacity) {
  const size_t n = text.size() < static_cast<size_t>(capacity - 1) ? text.size() : static_cast<size_t>(capacity - 1);
  std::memcpy(error, text.data(), n);
  error[n] = '\0';
}

// DivNoNan's shape rule: the output rank (out[] filled), or -1 with TF's message.
TFM_GAP_BCAST_CHECKS_API int tfm_gap_binary_shape(const int64_t* x, int x_rank, const int64_t* y, int y_rank,
                                                  int64_t* out, char* error, int capacity) {
  std::vector<int64_t> shape;
  const std::string message = GapBinaryShape(std::vector<int64_t>(x, x + x_rank), std::vector<int64_t>(y, y + y_rank),
                                             &shape);
  GapCopyText(message, error, capacity);
  if (!message.empty()) return -1;
  for (size_t i = 0; i < shape.size(); ++i) out[i] = shape[i];
  return static_cast<int>(shape.size());
}

// BroadcastTo's checks: the GapBroadcastToAction, with TF's message for kGapBroadcastToError.
TFM_GAP_BCAST_CHECKS_API int tfm_gap_broadcast_to_check(const int64_t* input, int in_rank, const int64_t* shape_dims,
                                                        int shape_rank, const int64_t* shape, int shape_len,
                                                        char* error, int capacity) {
  std::vector<int64_t> out;
  std::string message;
  const GapBroadcastToAction action = GapBroadcastToCheck(
      std::vector<int64_t>(input, input + in_rank), std::vector<int64_t>(shape_dims, shape_dims + shape_rank),
      std::vector<int64_t>(shape, shape + shape_len), &out, &message);
  GapCopyText(message, error, capacity);
  return static_cast<int>(action);
}
#endif  // TFM_EMU

#endif  // TFMETAL_GAP_BROADCAST_CHECKS_H_
