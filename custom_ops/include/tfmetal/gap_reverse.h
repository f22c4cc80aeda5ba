// ReverseV2 / ReverseSequence gap kernels: the index mapping, shared by the
// Metal kernels (custom_ops/metal/gap_reverse.h) and their host code, and the
// host's checks. Pure data movement by element size, so every dtype of a size
// shares one kernel and values are copied bit for bit.
//
// ReverseV2 (tf.reverse: Keras' go_backwards RNNs, Bidirectional): the
// output element at coordinates c reads the input at c with every reversed
// axis a mirrored, c[a] -> dims[a] - 1 - c[a]. The host collapses the shape
// first: size-1 axes dropped (mirroring them changes nothing), neighbours that
// are both reversed or both kept merged (mirroring two neighbours is
// mirroring their product), so at most TFM_GAP_REVERSE_MAX_DIMS remain
// (TensorFlow's own limit on the rank is 8).
//
// ReverseSequence (tf.reverse_sequence: Keras' RNNs with a mask): with
// L = seq_lengths[b] for the element's batch coordinate b, its sequence
// coordinate s reads L - 1 - s where s < L and s itself elsewhere. In element
// strides: b = (i / stride_b) % dim_b, s = (i / stride_s) % dim_s and the
// source is i + (s' - s) * stride_s.
//
// Indices are decomposed in 32-bit arithmetic for tensors below 2^32 elements
// (the GPU's 64-bit division is many times slower) and in 64-bit above.
#ifndef TFMETAL_GAP_REVERSE_H_
#define TFMETAL_GAP_REVERSE_H_

#if !defined(__METAL_VERSION__)
#include <string>  // host side only (below); first, before the emulator's address-space macros
#include <vector>
#endif

#include "tfmetal/portable.h"

#define TFM_GAP_REVERSE_MAX_DIMS 8

// setBytes data of the ReverseV2 kernel; the host fills it (GapReversePlan).
struct tfm_gap_reverse_params {
  uint32_t n;         // outputs in this dispatch
  uint32_t rank;      // collapsed dimensions used below (>= 1)
  uint32_t start_lo;  // index of this dispatch's first output (64-bit, for chunks)
  uint32_t start_hi;
  uint32_t reversed;  // bit d: dimension d is mirrored
  uint32_t wide;      // the tensor has 2^32 or more elements: 64-bit arithmetic throughout
  uint32_t pad[2];
  uint32_t dims[TFM_GAP_REVERSE_MAX_DIMS];  // collapsed dimensions, outermost first
};

// setBytes data of the ReverseSequence kernel.
struct tfm_gap_reverse_sequence_params {
  uint32_t n;  // outputs in this dispatch
  uint32_t start_lo;
  uint32_t start_hi;
  uint32_t wide;  // seq_lengths are int64 (else int32)
  uint32_t dim_b, dim_s;
  uint32_t stride_b_lo, stride_b_hi;  // element strides of the batch and sequence axes (64-bit)
  uint32_t stride_s_lo, stride_s_hi;
  uint32_t pad[2];
};

// The mirrored source of output `i`, in index type I (uint32_t or uint64_t).
template <typename I>
TFM_INLINE I gap_reverse_source_in(TFM_CONSTANT const tfm_gap_reverse_params& p, I i) {
  I src = 0, stride = 1;
  for (int d = static_cast<int>(p.rank) - 1; d >= 0; --d) {
    const I size = static_cast<I>(p.dims[d]);
    I coord = i % size;
    i /= size;
    if ((p.reversed >> d) & 1u) coord = size - 1u - coord;
    src += coord * stride;
    stride *= size;
  }
  return src;
}

// The input element that output `index` reads (ReverseV2). A mirrored
// source can lie anywhere in the tensor, so the 32-bit arithmetic is used
// only for tensors below 2^32 elements (p.wide == 0), whatever the index.
TFM_INLINE uint64_t gap_reverse_source(TFM_CONSTANT const tfm_gap_reverse_params& p, uint64_t index) {
  if (p.wide == 0) return gap_reverse_source_in<uint32_t>(p, static_cast<uint32_t>(index));
  return gap_reverse_source_in<uint64_t>(p, index);
}

// The input element that output `index` reads (ReverseSequence); `length` is
// the element's seq_lengths entry, looked up by the caller from `batch`.
TFM_INLINE uint64_t gap_reverse_sequence_source(uint64_t index, uint64_t seq, uint64_t length, uint64_t stride_s) {
  if (seq >= length) return index;
  return index - seq * stride_s + (length - 1u - seq) * stride_s;
}

// The (batch, sequence) coordinates of output `index`.
TFM_INLINE void gap_reverse_sequence_coords(TFM_CONSTANT const tfm_gap_reverse_sequence_params& p, uint64_t index,
                                            TFM_THREAD uint64_t& batch, TFM_THREAD uint64_t& seq) {
  const uint64_t stride_b = (static_cast<uint64_t>(p.stride_b_hi) << 32) | p.stride_b_lo;
  const uint64_t stride_s = (static_cast<uint64_t>(p.stride_s_hi) << 32) | p.stride_s_lo;
  if ((index >> 32) == 0 && p.stride_b_hi == 0 && p.stride_s_hi == 0) {
    const uint32_t i = static_cast<uint32_t>(index);
    batch = (i / static_cast<uint32_t>(stride_b)) % p.dim_b;
    seq = (i / static_cast<uint32_t>(stride_s)) % p.dim_s;
    return;
  }
  batch = (index / stride_b) % p.dim_b;
  seq = (index / stride_s) % p.dim_s;
}

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Plain C++ (the host code, and the emulator tests through gap_reverse.metal's
// exports): TensorFlow's checks of both ops, in the order and with the text of
// its CPU kernels (reverse_op.cc, reverse_sequence_op.cc; measured against
// TF 2.21), and the geometry.

// TF_Code values the host sets (TensorFlow's stable numbers).
#define TFM_GAP_REVERSE_INVALID_ARGUMENT 3
#define TFM_GAP_REVERSE_UNIMPLEMENTED 12

// ReverseV2 of a tensor of shape dims[rank] along `axes` (n_axes values; the
// axis tensor's rank is axis_rank). Returns 0 and fills `p` (with p->n and the
// start left to the caller), sets *identity when the output is the input
// itself (rank 0, nothing mirrored, or only size-1 axes), or returns a TF_Code
// with TF's message in *error.
inline int GapReversePlan(const int64_t* dims, int rank, int axis_rank, const int64_t* axes, int64_t n_axes,
                          tfm_gap_reverse_params* p, bool* identity, std::string* error) {
  *identity = false;
  if (rank == 0) {  // TF returns a scalar as it is, whatever the axes
    *identity = true;
    return 0;
  }
  if (axis_rank != 1) {
    *error = "'dims' must be 1-dimension, not " + std::to_string(axis_rank);
    return TFM_GAP_REVERSE_INVALID_ARGUMENT;
  }
  std::vector<bool> mirrored(static_cast<size_t>(rank), false);
  for (int64_t i = 0; i < n_axes; ++i) {
    const int64_t a = axes[i];
    const int64_t canonical = a < 0 ? a + rank : a;
    if (canonical < 0 || canonical >= rank) {
      *error = "'axis'[" + std::to_string(i) + "] = " + std::to_string(a) + " is out of valid range [0, " +
               std::to_string(rank - 1);  // sic: TF's text has no closing bracket
      return TFM_GAP_REVERSE_INVALID_ARGUMENT;
    }
    if (mirrored[static_cast<size_t>(canonical)]) {
      *error = "axis " + std::to_string(canonical) + " specified more than once.";
      return TFM_GAP_REVERSE_INVALID_ARGUMENT;
    }
    mirrored[static_cast<size_t>(canonical)] = true;
  }
  if (rank > 8) {
    *error = "reverse is not implemented for tensors of rank > 8.";
    return TFM_GAP_REVERSE_UNIMPLEMENTED;
  }
  // Collapse: drop size-1 axes, merge neighbours with the same state.
  std::vector<int64_t> out_dims;
  std::vector<bool> out_rev;
  for (int d = 0; d < rank; ++d) {
    if (dims[d] == 1) continue;
    const bool rev = mirrored[static_cast<size_t>(d)];
    if (!out_dims.empty() && out_rev.back() == rev) {
      out_dims.back() *= dims[d];
    } else {
      out_dims.push_back(dims[d]);
      out_rev.push_back(rev);
    }
  }
  bool any = false;
  for (bool r : out_rev) any = any || r;
  if (!any) {
    *identity = true;
    return 0;
  }
  *p = tfm_gap_reverse_params{};
  p->rank = static_cast<uint32_t>(out_dims.size());
  uint64_t total = 1;
  for (int64_t d : out_dims) total *= static_cast<uint64_t>(d);
  p->wide = (total >> 32) != 0 ? 1u : 0u;
  for (size_t d = 0; d < out_dims.size(); ++d) {
    if (out_dims[d] > 0xFFFFFFFFll) {  // a dimension past 2^32 elements: not on a GPU of this decade
      *error = "ReverseV2: a dimension of " + std::to_string(out_dims[d]) + " elements exceeds the gap kernel's "
               "32-bit dimensions";
      return TFM_GAP_REVERSE_UNIMPLEMENTED;
    }
    p->dims[d] = static_cast<uint32_t>(out_dims[d]);
    if (out_rev[d]) p->reversed |= 1u << d;
  }
  return 0;
}

// ReverseSequence's checks, TF's order and words. seq_lengths has rank
// len_rank and n_lengths values (already read from host memory).
inline std::string GapReverseSequenceCheck(const int64_t* dims, int rank, int64_t seq_dim, int64_t batch_dim,
                                           int len_rank, const int64_t* lengths, int64_t n_lengths) {
  if (batch_dim < 0) return "Invalid batch_dim " + std::to_string(batch_dim);
  if (seq_dim < 0) return "Invalid seq_dim " + std::to_string(seq_dim);
  if (len_rank != 1) return "seq_lengths must be 1-dim, not " + std::to_string(len_rank);
  if (batch_dim == seq_dim) return "batch_dim == seq_dim == " + std::to_string(seq_dim);
  if (seq_dim >= rank) {
    return "seq_dim must be < input rank ( " + std::to_string(seq_dim) + " vs. " + std::to_string(rank) + ")";
  }
  if (batch_dim >= rank) {
    return "batch_dim must be < input rank ( " + std::to_string(batch_dim) + " vs. " + std::to_string(rank) + ")";
  }
  if (n_lengths != dims[batch_dim]) {
    return "Length of seq_lengths != input.dims(" + std::to_string(batch_dim) + "), (" + std::to_string(n_lengths) +
           " vs. " + std::to_string(dims[batch_dim]) + ")";
  }
  for (int64_t d = 0; d < n_lengths; ++d) {
    if (lengths[d] < 0) return "seq_lens(" + std::to_string(d) + ") < 0";
    if (lengths[d] > dims[seq_dim]) {
      return "seq_lens(" + std::to_string(d) + ") > input.dims(" + std::to_string(seq_dim) + ")";
    }
  }
  if (dims[batch_dim] > 0xFFFFFFFFll || dims[seq_dim] > 0xFFFFFFFFll) {  // not TF's: the kernel's 32-bit axes
    return "ReverseSequence: the batch or sequence axis has 2^32 or more elements, beyond the gap kernel";
  }
  return "";
}

// The element strides and sizes of the batch and sequence axes (after the checks).
inline void GapReverseSequenceGeometry(const int64_t* dims, int rank, int64_t seq_dim, int64_t batch_dim,
                                       bool wide, tfm_gap_reverse_sequence_params* p) {
  *p = tfm_gap_reverse_sequence_params{};
  uint64_t stride = 1, stride_b = 1, stride_s = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (d == batch_dim) stride_b = stride;
    if (d == seq_dim) stride_s = stride;
    stride *= static_cast<uint64_t>(dims[d]);
  }
  p->wide = wide ? 1u : 0u;
  p->dim_b = static_cast<uint32_t>(dims[batch_dim]);
  p->dim_s = static_cast<uint32_t>(dims[seq_dim]);
  p->stride_b_lo = static_cast<uint32_t>(stride_b);
  p->stride_b_hi = static_cast<uint32_t>(stride_b >> 32);
  p->stride_s_lo = static_cast<uint32_t>(stride_s);
  p->stride_s_hi = static_cast<uint32_t>(stride_s >> 32);
}
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_REVERSE_H_
