// UnsortedSegmentSum gap kernel: the host's checks and segmentation, shared
// by the Metal kernel (custom_ops/metal/gap_segment.h) and its host code.
//
// The order of the sum. TensorFlow's CPU kernel (UnsortedSegmentFunctor in
// segment_reduction_ops_impl.h) adds the rows of each segment into the
// zeroed output in increasing row order, in the data type itself: Eigen's
// half and bfloat16 `+` computes in float and rounds to the type after every
// add (or adds natively in the type, as on arm64; the two agree: a sum of two
// values is rounded twice innocuously when the wider format has at least
// 2p + 2 bits of precision, and float's 24 >= 2 * 11 + 2 for half, >= 2 * 8
// + 2 for bfloat16). The kernel does the same: the host sorts the row
// numbers by segment, stably (a counting sort: order[offsets[s] ..
// offsets[s + 1]) are segment s's rows in increasing order), and the GPU
// sums, one thread per (segment, column), in that order, each add rounded to
// T. So the results are TF's bit for bit, and deterministic.
//
// The ids on the host. segment_ids and num_segments are host-memory arguments
// of the kernel (tfmetal_ext.backends.gap_kernels): TF's CPU kernel fails on
// an id >= num_segments, so the ids must be read before the op returns, and
// reading them on the host is one wait either way (for the copy below, or
// for a checking kernel). In a Keras train step they usually are on the host
// already: an Embedding's gradient takes its int32 ids from a Reshape, whose
// int32 kernel keeps them in host memory; int64 ids made on the GPU are
// copied to the host by TF before the op runs. The op itself never waits for
// the GPU.
//
// TF's checks, in its order (ValidateUnsortedSegmentReduction, then the
// functor): num_segments a scalar, data.shape starting with
// segment_ids.shape, num_segments >= 0; then, only when data has an element,
// each id in order: a negative id drops its row (TF's documented rule), an id
// >= num_segments is "segment_ids[i, j] = v is out of range [0, n)".
#ifndef TFMETAL_GAP_SEGMENT_H_
#define TFMETAL_GAP_SEGMENT_H_

#if !defined(__METAL_VERSION__)
#include <string>  // host side only (below); first, before the emulator's address-space macros
#endif

#include "tfmetal/portable.h"

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Plain C++ (the host code, and the emulator tests through gap_segment.metal's exports).

inline std::string GapSegmentShapeText(const int64_t* dims, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

// TF's checks before any id is read, in its order: "" and *num_segments (read
// from `num_value`, an int32 or int64 scalar, once it is known to be one), or
// the InvalidArgument text. As TF's kernel does, the count is taken in the
// ids' type: int32 ids with an int64 num_segments of 2^32 + 3 make 3 segments,
// and 2^31 is "Input num_segments == -2147483648 must not be negative.".
inline std::string GapSegmentCheck(const int64_t* data, int data_rank, const int64_t* ids, int ids_rank,
                                   bool ids_are_int64, const int64_t* num, int num_rank, const void* num_value,
                                   bool num_is_int64, int64_t* num_segments) {
  if (num_rank != 0) return "num_segments should be a scalar, not shape " + GapSegmentShapeText(num, num_rank);
  bool prefix = ids_rank <= data_rank;
  for (int d = 0; prefix && d < ids_rank; ++d) prefix = ids[d] == data[d];
  if (!prefix) {
    return "data.shape = " + GapSegmentShapeText(data, data_rank) + " does not start with segment_ids.shape = " +
           GapSegmentShapeText(ids, ids_rank);
  }
  const int64_t value = num_is_int64 ? *static_cast<const int64_t*>(num_value)
                                     : *static_cast<const int32_t*>(num_value);
  *num_segments = ids_are_int64 ? value : static_cast<int32_t>(static_cast<uint32_t>(value));
  if (*num_segments < 0) return "Input num_segments == " + std::to_string(*num_segments) + " must not be negative.";
  return "";
}

// TF's error for the id at flat index `bad` of segment_ids (shape `ids`):
// "segment_ids[2,1] = 5 is out of range [0, 2)", the index unflattened as
// TF's SliceDebugString writes it (none for a scalar).
inline std::string GapSegmentIdError(const int64_t* ids, int ids_rank, int64_t bad, int64_t value,
                                     int64_t num_segments) {
  std::string index;
  for (int d = 0; d < ids_rank; ++d) {
    int64_t stride = 1;  // elements per step of dimension d
    for (int e = d + 1; e < ids_rank; ++e) stride *= ids[e];
    index += (d ? "," : "[") + std::to_string(stride > 0 ? bad / stride : 0);
    if (stride > 0) bad %= stride;
  }
  if (ids_rank > 0) index += "]";
  return "segment_ids" + index + " = " + std::to_string(value) + " is out of range [0, " +
         std::to_string(num_segments) + ")";
}

// Stable counting sort of rows by segment. ids: n row ids (negative: dropped);
// offsets: num_segments + 1 entries; order: n entries (the kept rows first).
// With data_elements == 0 no id is read (TF's kernel returns before its
// check) and every segment is empty. Returns -1, or the first row whose id is
// >= num_segments (TF's error).
template <typename Id>
inline int64_t GapSegmentOrder(const Id* ids, int64_t n, int64_t data_elements, int64_t num_segments,
                               uint32_t* offsets, uint32_t* order) {
  for (int64_t s = 0; s <= num_segments; ++s) offsets[s] = 0;
  if (data_elements == 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) continue;
    if (static_cast<int64_t>(ids[i]) >= num_segments) return i;
    ++offsets[ids[i] + 1];
  }
  for (int64_t s = 0; s < num_segments; ++s) offsets[s + 1] += offsets[s];
  // offsets[s] is now where segment s starts; fill with a moving cursor per segment.
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) continue;
    order[offsets[ids[i]]++] = static_cast<uint32_t>(i);
  }
  // Each cursor ended at the next segment's start: shift back.
  for (int64_t s = num_segments; s > 0; --s) offsets[s] = offsets[s - 1];
  offsets[0] = 0;
  return -1;
}
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_SEGMENT_H_
