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

}  // namespace tfmetal_ext

#endif  // TFMETAL_HOST_CHECKS_H_
