// Broadcasting gap kernels (DivNoNan, BroadcastTo): the math and the index
// mapping, shared by the Metal kernels (custom_ops/metal/gap_broadcast.h) and
// their host code.
//
// DivNoNan(x, y) = +0 where y == 0 (either sign, whatever x is), else x / y in
// float, rounded once to the output type: TensorFlow's CPU kernel computes
// half and bfloat16 division in float and rounds once too, so the two agree
// bit for bit (NaN y gives NaN, as x / NaN). TF's CPU kernels also run with
// the CPU's flush-to-zero and denormals-are-zero modes on (its threads set
// them: MXCSR FTZ/DAZ on x86, FPCR.FZ on arm64 Macs), so a subnormal input
// counts as a zero of its sign (a subnormal y gives +0) and a subnormal
// quotient is a zero of its sign. The kernel does the same explicitly,
// whatever the GPU's own denormal handling. (Half values are never subnormal
// in float, nor are quotients of them, so only float and bfloat16 see it.)
//
// The index mapping: the output's shape collapsed to at most
// TFM_GAP_BCAST_MAX_DIMS dimensions (size-1 dimensions dropped, neighbours
// merged where every input walks them contiguously), with each input's
// element stride per output dimension (0 where it broadcasts). An output
// index is decomposed innermost dimension first, in 32-bit arithmetic below
// 2^32 (the GPU's 64-bit division is many times slower), in 64-bit above.
//
// TF's shape rules and error texts for the two ops are host-only C++ in
// tfmetal/gap_broadcast_checks.h.
#ifndef TFMETAL_GAP_BROADCAST_H_
#define TFMETAL_GAP_BROADCAST_H_

#include "tfmetal/portable.h"

#define TFM_GAP_BCAST_MAX_DIMS 8

// v, or a zero of v's sign if v is subnormal (|v| < FLT_MIN = 2^-126).
TFM_INLINE float gap_flush_denormal(float v) { return tfm_abs(v) < 1.17549435e-38f ? v * 0.0f : v; }

TFM_INLINE float gap_div_no_nan(float x, float y) {
  x = gap_flush_denormal(x);
  y = gap_flush_denormal(y);
  return y == 0.0f ? 0.0f : gap_flush_denormal(x / y);
}

// setBytes data of the broadcasting kernels; the host fills it (GapBroadcastPlan).
struct tfm_gap_bcast_params {
  uint32_t n;          // outputs in this dispatch
  uint32_t rank;       // dimensions used below (>= 1)
  uint32_t start_lo;   // index of this dispatch's first output (64-bit, for chunks)
  uint32_t start_hi;
  uint32_t dims[TFM_GAP_BCAST_MAX_DIMS];     // output dimensions, outermost first
  uint32_t strides0[TFM_GAP_BCAST_MAX_DIMS];  // input 0's element stride per output dimension
  uint32_t strides1[TFM_GAP_BCAST_MAX_DIMS];  // input 1's (unused by BroadcastTo)
};

// The element offsets into inputs 0 and 1 of output `index`. Below 2^32 the
// offsets fit 32 bits too: an input is never larger than the output it is
// mapped onto (its stride in each dimension is at most the output's), so each
// partial sum of coord * stride is at most the index. Threads differ only in
// the chunk that straddles 2^32.
TFM_INLINE void gap_bcast_offsets(TFM_CONSTANT const tfm_gap_bcast_params& p, uint64_t index,
                                  TFM_THREAD uint64_t& off0, TFM_THREAD uint64_t& off1) {
  if ((index >> 32) == 0) {
    uint32_t i = static_cast<uint32_t>(index), o0 = 0, o1 = 0;
    for (int d = static_cast<int>(p.rank) - 1; d >= 0; --d) {
      const uint32_t size = p.dims[d];
      const uint32_t coord = i % size;
      i /= size;
      o0 += coord * p.strides0[d];
      o1 += coord * p.strides1[d];
    }
    off0 = o0;
    off1 = o1;
    return;
  }
  off0 = 0;
  off1 = 0;
  for (int d = static_cast<int>(p.rank) - 1; d >= 0; --d) {
    const uint64_t size = p.dims[d];
    const uint64_t coord = index % size;
    index /= size;
    off0 += coord * p.strides0[d];
    off1 += coord * p.strides1[d];
  }
}

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Plain C++ (the host code, and the emulator's tests through gap_broadcast.metal's exports).

// The broadcast shape of a and b (numpy rules); false if incompatible.
inline bool GapBroadcastShape(const int64_t* a, int a_rank, const int64_t* b, int b_rank, int64_t* out,
                              int* out_rank) {
  const int rank = a_rank > b_rank ? a_rank : b_rank;
  for (int i = 0; i < rank; ++i) {
    const int ia = a_rank - rank + i, ib = b_rank - rank + i;
    const int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) return false;
    out[i] = da == 1 ? db : da;
  }
  *out_rank = rank;
  return true;
}

// Fills p.rank, p.dims, p.strides0/1 for `out` (rank out_rank) read from inputs
// of shapes in0 and in1 (each broadcastable to out, right-aligned; in1 may be
// null for one input). Returns false when more than TFM_GAP_BCAST_MAX_DIMS
// dimensions remain after collapsing, or a stride does not fit 32 bits.
inline bool GapBroadcastPlan(const int64_t* out, int out_rank, const int64_t* in0, int rank0, const int64_t* in1,
                             int rank1, tfm_gap_bcast_params* p) {
  int64_t dims[64], s0[64], s1[64];
  if (out_rank > 64) return false;
  // Each input's contiguous strides, 0 where it broadcasts.
  int64_t acc0 = 1, acc1 = 1;
  for (int i = out_rank - 1; i >= 0; --i) {
    const int i0 = rank0 - out_rank + i, i1 = rank1 - out_rank + i;
    const int64_t d0 = i0 >= 0 ? in0[i0] : 1, d1 = (in1 != nullptr && i1 >= 0) ? in1[i1] : 1;
    dims[i] = out[i];
    s0[i] = (d0 == 1 && out[i] != 1) ? 0 : acc0;
    s1[i] = (d1 == 1 && out[i] != 1) ? 0 : acc1;
    acc0 *= d0;
    acc1 *= d1;
  }
  // Drop size-1 dimensions, then merge neighbours both inputs walk contiguously.
  int n = 0;
  for (int i = 0; i < out_rank; ++i) {
    if (dims[i] == 1) continue;
    if (n > 0) {
      const int j = n - 1;
      const bool merge0 = s0[j] == s0[i] * dims[i];
      const bool merge1 = s1[j] == s1[i] * dims[i];
      if (merge0 && merge1) {
        dims[j] *= dims[i];
        s0[j] = s0[i];
        s1[j] = s1[i];
        continue;
      }
    }
    dims[n] = dims[i];
    s0[n] = s0[i];
    s1[n] = s1[i];
    ++n;
  }
  if (n == 0) {  // a scalar output
    dims[0] = 1;
    s0[0] = 0;
    s1[0] = 0;
    n = 1;
  }
  if (n > TFM_GAP_BCAST_MAX_DIMS) return false;
  p->rank = static_cast<uint32_t>(n);
  for (int i = 0; i < TFM_GAP_BCAST_MAX_DIMS; ++i) {
    const bool used = i < n;
    if (used && (dims[i] > 0xffffffffll || s0[i] > 0xffffffffll || s1[i] > 0xffffffffll)) return false;
    p->dims[i] = used ? static_cast<uint32_t>(dims[i]) : 1u;
    p->strides0[i] = used ? static_cast<uint32_t>(s0[i]) : 0u;
    p->strides1[i] = used ? static_cast<uint32_t>(s1[i]) : 0u;
  }
  return true;
}

// True when the plan reads element i of both inputs for output i (x and y of
// one shape, up to size-1 dimensions): the kernel's contiguous variant, which
// needs no index mapping, serves it.
inline bool GapBroadcastContiguous(const tfm_gap_bcast_params& p) {
  return p.rank == 1 && p.strides0[0] == 1 && p.strides1[0] == 1;
}

#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_BROADCAST_H_
