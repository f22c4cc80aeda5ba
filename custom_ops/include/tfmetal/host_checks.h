// host_checks.h: the input checks and limits the CPU kernels (cpu/*.cc, TF's
// C++ API) and the Metal host code (metal/*.mm, TF's C API) share, written
// once so both backends refuse the same inputs with the same text. Host C++
// only (std::string): never included by a kernel's Metal source.
//
// Each backend wraps a check in its own status type: cpu_common.h
// (tensorflow::Status) and metal_helper.h (TF_Status).
#ifndef TFMETAL_HOST_CHECKS_H_
#define TFMETAL_HOST_CHECKS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tfmetal/attention.h"  // TFM_ATTENTION_LAYOUT_*

namespace tfmetal_ext {

// The Metal kernels index a dimension (a row, a count of rows, ...) with
// 32-bit integers: larger dimensions are refused by the host code.
inline constexpr int64_t kMaxDimension = std::numeric_limits<int32_t>::max();

// "[2,3]", as TensorShape::DebugString and metal_helper's ShapeString write it.
inline std::string ShapeText(const int64_t* dims, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

// "" if the values `dims` make a TensorShape, else TF's InvalidArgument text
// (TensorShapeUtils::MakeShape's checks, in its order: at most 254
// dimensions; then dimension by dimension, a negative one, or a running
// product past 2^63 - 1, so [2^40, 2^40, 0] overflows before the 0). The
// overflow text shows the whole shape, -1 as "?" (TensorShapeProto's text).
inline std::string ShapeValuesError(const int64_t* dims, int64_t rank) {
  if (rank > 254) return "Too many dimensions";
  int64_t elements = 1;
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t d = dims[i];
    if (d < 0) return "Dimension " + std::to_string(d) + " must be >= 0";
    if (elements != 0 && d > std::numeric_limits<int64_t>::max() / elements) {
      std::string text = "[";
      for (int64_t j = 0; j < rank; ++j) {
        text += (j ? "," : "") + (dims[j] == -1 ? std::string("?") : std::to_string(dims[j]));
      }
      return "Shape " + text + "] would have more than 2**63 - 1 elements";
    }
    elements *= d;
  }
  return "";
}

// "" if `a` and `b` (called `a_name`, `b_name`) have the same shape, else the
// InvalidArgument message "<a_name> and <b_name> must have the same shape, got
// [..] and [..]" (the elementwise gradient ops' dy and x: TfmetalExt>ActivationGrad, ...).
inline std::string SameShapeError(const char* a_name, const int64_t* a, int a_rank, const char* b_name,
                                  const int64_t* b, int b_rank) {
  bool same = a_rank == b_rank;
  for (int i = 0; same && i < a_rank; ++i) same = a[i] == b[i];
  if (same) return "";
  return std::string(a_name) + " and " + b_name + " must have the same shape, got " + ShapeText(a, a_rank) +
         " and " + ShapeText(b, b_rank);
}

// "" if `dims` is a vector of `n` elements; otherwise the InvalidArgument
// message "<name> must be a vector of <what> = <n>, got shape [..]".
inline std::string VectorShapeError(const char* name, const int64_t* dims, int rank, int64_t n, const char* what) {
  if (rank == 1 && dims[0] == n) return "";
  return std::string(name) + " must be a vector of " + what + " = " + std::to_string(n) + ", got shape " +
         ShapeText(dims, rank);
}

// The ops that normalize over the last axis (layer_norm, rms_norm): x must
// have rank >= 1; rows = the product of all but the last dimension, channels
// the last. "" on success, else the InvalidArgument message.
inline std::string NormRowsAndChannels(const int64_t* dims, int rank, int64_t* rows, int64_t* channels) {
  if (rank < 1) {
    return "x must have rank >= 1 (normalized over its last axis), got shape " + ShapeText(dims, rank);
  }
  *channels = dims[rank - 1];
  int64_t n = 1;
  for (int i = 0; i + 1 < rank; ++i) n *= dims[i];
  *rows = n;
  return "";
}

// TfmetalExt>Rope's and TfmetalExt>RopeGrad's operands: x [batch, sequence,
// inner..., features] (rank >= 3, features even), positions [sequence] or
// [1 or batch, sequence], inv_freq [features / 2]. `x` is any tensor of x's
// shape (dy for the gradient). Fills the geometry both kernels index with.
struct RopeGeometry {
  int64_t batch = 0;
  int64_t sequence = 0;
  int64_t inner = 1;       // the product of the dimensions between sequence and features (heads)
  int64_t half = 0;        // features / 2: pairs per row
  int64_t position_batch_stride = 0;  // sequence when positions has a batch dimension > 1, else 0
};

inline std::string RopeShapeError(const char* x_name, const int64_t* x, int x_rank, const int64_t* positions,
                                  int positions_rank, const int64_t* inv_freq, int inv_freq_rank,
                                  RopeGeometry* g) {
  if (x_rank < 3) {
    return std::string(x_name) + " must have rank >= 3 ([batch, sequence, ..., features]), got shape " +
           ShapeText(x, x_rank);
  }
  const int64_t features = x[x_rank - 1];
  if (features % 2 != 0) {
    return std::string("the last dimension of ") + x_name +
           " (features) must be even: its halves are rotated together, got shape " + ShapeText(x, x_rank);
  }
  g->batch = x[0];
  g->sequence = x[1];
  g->inner = 1;
  for (int i = 2; i + 1 < x_rank; ++i) g->inner *= x[i];
  g->half = features / 2;
  const bool batched = positions_rank == 2 && (positions[0] == 1 || positions[0] == g->batch);
  if (!((positions_rank == 1 && positions[0] == g->sequence) || (batched && positions[1] == g->sequence))) {
    return "positions must have shape [sequence] = [" + std::to_string(g->sequence) + "] or [batch, sequence] = [" +
           std::to_string(g->batch) + "," + std::to_string(g->sequence) + "] (batch may be 1), got shape " +
           ShapeText(positions, positions_rank) + " for " + x_name + " of shape " + ShapeText(x, x_rank);
  }
  g->position_batch_stride = (batched && positions[0] > 1) ? g->sequence : 0;
  return VectorShapeError("inv_freq", inv_freq, inv_freq_rank, g->half, "half the last dimension of x");
}

// A stateless-random seed (StatelessRandomGetKeyCounter's, the dropout ops'):
// "" if it is a vector of 2, else TensorFlow's InvalidArgument message.
inline std::string SeedShapeError(const int64_t* dims, int rank) {
  if (rank == 1 && dims[0] == 2) return "";
  return "seed must have shape [2], not " + ShapeText(dims, rank);
}

// The dropout ops' attributes: rate in [0, 1] and scale > 0 (tfmetal_ext.ops.dropout
// passes a rate in [0, 1) and 1 / (1 - rate) as the dtype rounds them: float16
// and bfloat16 round rates close enough to 1 up to 1, which drops every element
// as TensorFlow's dropout does, and float16 overflows scales above 65504 to
// infinity, only for rates that round to 1). "" when they are fine, else the
// InvalidArgument message.
inline std::string DropoutAttrsError(float rate, float scale) {
  if (!(rate >= 0.0f && rate <= 1.0f)) return "rate must be in [0, 1], got " + std::to_string(rate);
  if (!(scale > 0.0f)) return "scale must be > 0, got " + std::to_string(scale);
  return "";
}

// The attention ops' dropout attributes (TfmetalExt>Attention, its gradient):
// as the dropout ops' (DropoutAttrsError), named as the attention ops name them.
inline std::string AttentionDropoutAttrsError(float rate, float scale) {
  const std::string error = DropoutAttrsError(rate, scale);
  return error.empty() ? error : "dropout_" + error;
}

// The attention ops' optional seed input (a list of 0 or 1 tensors): one is
// needed when dropout_rate > 0. "" when fine, else the InvalidArgument message.
// The attention ops' sliding window (0: none): a key count below 2^31, as
// the sequence lengths are (the kernels add positions and the window).
inline std::string AttentionWindowError(int64_t window) {
  if (window < 0 || window > kMaxDimension) {
    return "sliding_window must be in [0, 2^31 - 1] (0: no window), got " + std::to_string(window);
  }
  return "";
}

// The attention ops' layout attribute: "BHSD" or "BSHD" as
// TFM_ATTENTION_LAYOUT_BHSD / _BSHD in *layout. "" when valid, else the
// InvalidArgument message (the op's attr allows only these two; a kernel
// checks anyway, as it does the other attributes).
inline std::string AttentionLayoutFromString(const std::string& value, uint32_t* layout) {
  if (value == "BHSD") {
    *layout = TFM_ATTENTION_LAYOUT_BHSD;
  } else if (value == "BSHD") {
    *layout = TFM_ATTENTION_LAYOUT_BSHD;
  } else {
    return "layout must be \"BHSD\" or \"BSHD\", got \"" + value + "\"";
  }
  return "";
}

// Key and value heads of grouped-query attention: at least 1 and dividing the
// query heads (query head h reads key/value head h / (heads / kv_heads)).
inline std::string AttentionKvHeadsError(int64_t heads, int64_t kv_heads) {
  if (heads == 0 && kv_heads == 0) return "";
  if (kv_heads < 1 || heads % kv_heads != 0) {
    return "the key/value heads (" + std::to_string(kv_heads) + ") must divide the query heads (" +
           std::to_string(heads) + ")";
  }
  return "";
}

inline std::string AttentionSeedCountError(int64_t seeds, float dropout_rate) {
  if (seeds > 1) return "seed must be a list of at most one tensor, got " + std::to_string(seeds);
  if (dropout_rate > 0.0f && seeds == 0) {
    return "dropout_rate = " + std::to_string(dropout_rate) +
           " > 0 needs the seed input (2 int32 or int64 values), got none";
  }
  return "";
}

// StatelessRandomUniformV2's arguments (all in host memory), checked in the
// order of TensorFlow's CPU kernel (stateless_random_ops_v2.cc and
// stateless_random_ops_v2_util.h), with its messages: alg a scalar; key [1];
// counter a long enough vector; shape a vector of dimensions >= 0; then the
// algorithm, of which only Philox (1; auto-select 3 means Philox on the CPU) is
// supported. `alg` is read only when alg_rank == 0, `shape` only when
// shape_rank == 1 (shape_len values). "" when they are fine.
//
// TF's CPU kernel asks for at least as many counter words as the algorithm's
// id (CheckKeyCounterShape is passed the id where a size is meant): so 1 for
// Philox, whose two words it then reads. We ask Philox for its 2 words; for
// any other id the message is TF's.
inline constexpr int32_t kRngAlgPhilox = 1;
inline constexpr int32_t kRngAlgAutoSelect = 3;

inline std::string StatelessUniformArgsError(int alg_rank, const int64_t* alg_dims, int32_t alg,
                                             const int64_t* key_dims, int key_rank, const int64_t* counter_dims,
                                             int counter_rank, const int64_t* shape_dims, int shape_rank,
                                             const int64_t* shape, int64_t shape_len) {
  if (alg_rank != 0) return "input 3 (0-based) must have shape [], not " + ShapeText(alg_dims, alg_rank);
  const int32_t resolved = alg == kRngAlgAutoSelect ? kRngAlgPhilox : alg;
  if (!(key_rank == 1 && key_dims[0] == 1)) {
    return "key must have shape [1], not " + ShapeText(key_dims, key_rank) +
           ". (Note that batched keys are not supported yet.)";
  }
  const int64_t min_counter = resolved == kRngAlgPhilox ? 2 : resolved;
  if (!(counter_rank == 1 && counter_dims[0] >= min_counter)) {
    return "counter must be a vector with length at least " + std::to_string(min_counter) +
           "; got shape: " + ShapeText(counter_dims, counter_rank) +
           ". (Note that batched counters are not supported yet.)";
  }
  if (shape_rank != 1) return "shape must be a vector of {int32,int64}, got shape " + ShapeText(shape_dims, shape_rank);
  const std::string shape_error = ShapeValuesError(shape, shape_len);
  if (!shape_error.empty()) return shape_error;
  if (resolved != kRngAlgPhilox) return "Unsupported algorithm id: " + std::to_string(alg);
  return "";
}

// Bitcast's output shape, TensorFlow's rule: elements of `in_size` bytes
// (TF_DataType `in_type`) viewed as elements of `out_size` bytes. Equal
// sizes keep the shape; a larger input element adds a last dimension of
// in_size / out_size; a smaller one needs a last dimension of
// out_size / in_size, which goes. "" with `out` set, else the InvalidArgument
// message, in TF's words (the two types as TF_DataType numbers).
inline std::string BitcastShape(int in_type, int64_t in_size, int out_type, int64_t out_size, const int64_t* dims,
                                int rank, std::vector<int64_t>* out) {
  const std::string error = "Cannot bitcast from " + std::to_string(in_type) + " to " + std::to_string(out_type);
  out->assign(dims, dims + rank);
  if (in_size <= 0 || out_size <= 0) return error;
  if (in_size == out_size) return "";
  if (in_size > out_size) {
    if (in_size % out_size != 0) return error;
    out->push_back(in_size / out_size);
    return "";
  }
  if (out_size % in_size != 0 || rank < 1 || dims[rank - 1] != out_size / in_size) return error;
  out->pop_back();
  return "";
}

// TfmetalExt>Gemv's operands: x [M, K], kernel [K, N], bias [N] (has_bias) or [0]; "" if they
// fit, else the InvalidArgument text both backends give.
inline std::string GemvShapeError(const int64_t* x, int x_rank, const int64_t* w, int w_rank, const int64_t* bias,
                                  int bias_rank, bool has_bias) {
  // (`w` is the op's `kernel` input: that word is a macro where the Metal emulator includes this file.)
  if (x_rank != 2) return "x must be a matrix [M, K], got shape " + ShapeText(x, x_rank);
  if (w_rank != 2) return "kernel must be a matrix [K, N], got shape " + ShapeText(w, w_rank);
  if (w[0] != x[1]) {
    return "x's K (" + std::to_string(x[1]) + ") must match kernel's first dimension, got x shape " +
           ShapeText(x, x_rank) + " and kernel shape " + ShapeText(w, w_rank);
  }
  const int64_t want = has_bias ? w[1] : 0;
  if (bias_rank != 1 || bias[0] != want) {
    return std::string(has_bias ? "bias must be a vector of the kernel's N (" + std::to_string(want) + ") values"
                                : "bias must have shape [0] when has_bias is false") +
           ", got shape " + ShapeText(bias, bias_rank);
  }
  return "";
}

// TfmetalExt>SparseSoftmaxCrossEntropy's operands, checked in TensorFlow's
// order and words (SparseSoftmaxCrossEntropyWithLogits' CPU kernel): logits
// [rows, classes] with classes >= 1, labels [rows]. "" on success.
inline std::string SparseXentShapeError(const int64_t* logits, int logits_rank, const int64_t* labels,
                                        int labels_rank) {
  if (logits_rank != 2) return "logits must be 2-D, but got shape " + ShapeText(logits, logits_rank);
  if (labels_rank != 1) return "labels must be 1-D, but got shape " + ShapeText(labels, labels_rank);
  if (logits[0] != labels[0]) {
    return "logits and labels must have the same first dimension, got logits shape " + ShapeText(logits, 2) +
           " and labels shape " + ShapeText(labels, 1);
  }
  if (logits[1] == 0) return "Must have at least one class, but got logits shape " + ShapeText(logits, 2);
  return "";
}

// The gradient op's further row vectors (dloss, row_max, row_sum): each [rows].
inline std::string SparseXentRowVectorError(const char* name, const int64_t* dims, int rank, int64_t rows) {
  return VectorShapeError(name, dims, rank, rows, "the number of rows of logits");
}

// "" if every label is in [0, classes), else TensorFlow's CPU message: the
// first bad label, then every label value, each followed by a space.
template <typename Label>
std::string SparseXentLabelError(const Label* labels, int64_t rows, int64_t classes) {
  int64_t bad = -1;
  for (int64_t r = 0; r < rows && bad < 0; ++r) {
    if (labels[r] < 0 || labels[r] >= classes) bad = r;
  }
  if (bad < 0) return "";
  std::string text = "Received a label value of " + std::to_string(static_cast<int64_t>(labels[bad])) +
                     " which is outside the valid range of [0, " + std::to_string(classes) + ").  Label values: ";
  for (int64_t r = 0; r < rows; ++r) text += std::to_string(static_cast<int64_t>(labels[r])) + " ";
  return text;
}

}  // namespace tfmetal_ext

#endif  // TFMETAL_HOST_CHECKS_H_
