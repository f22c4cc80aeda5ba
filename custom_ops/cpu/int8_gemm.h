// The int8-weight contraction shared by the CPU kernels of TfmetalExt>Int8MatMul and
// TfmetalExt>Int8Conv2D: y[M, N] = epilogue(rows[M, K] @ float(q[K, N])), the float32
// rows given by a row source (the x rows themselves, x widened from half/bfloat16, or
// im2col rows of a convolution) and the epilogue of tfmetal/int8.h.
//
// Work is split into items: a group of up to `group_rows` rows times a unit of up to
// `unit_cols` contiguous output columns, sharded over TF's CPU thread pool. An item
// accumulates in float32 into a per-thread scratch (group_rows x unit_cols), in blocks of
// kKC rows of the kernel: each 64-column panel of a block (kKC x 64 int8, 16 KB, one
// cache line per kernel row) is read from memory once and reused from L1 by every
// microkernel pass over it (kMR rows x kNR columns in registers, k innermost; a weight is
// converted int8 -> float once per pass and used for kMR rows). While a panel is
// computed, the next panel's lines are prefetched (the kernel rows are N bytes apart,
// a stride the hardware prefetchers do not follow). One or two rows (batch 1 and 2) skip
// the packing and stream each kernel row's run of the unit once (StreamRows).
//
// The rounding: each output is the sum over k in increasing order of float(x) * float(q),
// one float32 accumulator per output (fused multiply-add where the loops vectorize to
// FMA), independent of the thread count. The loops (cpu/int8_gemm_body.h) are compiled
// twice on x86-64 with GCC: portable (namespace int8_cpu::portable, also what arm64 runs,
// auto-vectorized for NEON) and for AVX2+FMA (int8_cpu::avx2, with intrinsics), picked
// at run time; TFMETAL_EXT_CPU_BASELINE=1 runs the portable ones.
#ifndef TFMETAL_CPU_INT8_GEMM_H_
#define TFMETAL_CPU_INT8_GEMM_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tfmetal/int8.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define TFMETAL_INT8_X86 1
#endif

namespace tfmetal_ext {
namespace int8_cpu {

#define TFMETAL_INT8_INLINE inline __attribute__((always_inline))

constexpr int64_t kMR = 4;      // rows per microkernel pass
constexpr int64_t kNR = 16;     // columns per microkernel pass
constexpr int64_t kPanel = 64;  // columns per panel: one cache line of int8 per kernel row
constexpr int64_t kMaxUnitCols = 4096;  // columns per work item at most
constexpr int64_t kKC = 64;     // kernel rows per block (a packed panel is kKC x 64 int8 = 4 KB)

inline int64_t Int8CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t Int8RoundUp(int64_t a, int64_t b) { return Int8CeilDiv(a, b) * b; }

// One microkernel pass: acc[r][j] += sum_k x[r * ldx + k] * q[k * ldq + j] for r < MR,
// j < nc, k < kc (q: a packed panel, ldq = kPanel).
struct Pass {
  const float* x;
  int64_t ldx;
  const int8_t* q;
  int64_t ldq;
  int64_t kc;
  int64_t nc;
  float* acc;
  int64_t ldacc;
};

// The problem of one op call.
struct Problem {
  int64_t m, k, n;
  const int8_t* q;     // [K, N]
  const float* scale;  // [N]
  int32_t activation;
  float alpha;
  int64_t group_rows;  // rows per work item (a multiple of kMR)
  int64_t unit_cols;   // columns per work item
  int64_t units;       // ceil(n / unit_cols)
};

// The inputs of one call, for the work items.
template <typename T>
struct Call {
  Problem p;
  const T* bias;  // null without bias
  T* y;           // [M, N]
};

// Partition of an m x k x n problem into work items for `threads` threads: row groups
// of at most 64 rows (and 64K floats of rows); the columns split into one unit per thread
// when there are fewer groups than threads (a unit reads long runs of each kernel row:
// one TLB entry per kernel row and unit, sequential lines for the prefetchers), else one
// unit (the groups are the parallelism, each kernel row read in one run).
inline void Partition(Problem* p, int64_t threads) {
  int64_t cap = std::min<int64_t>(64, (int64_t{1} << 16) / std::max<int64_t>(p->k, 1));
  cap = std::max<int64_t>(kMR, cap / kMR * kMR);
  p->group_rows = std::min(cap, Int8RoundUp(std::max<int64_t>(p->m, 1), kMR));
  const int64_t groups = Int8CeilDiv(std::max<int64_t>(p->m, 1), p->group_rows);
  const int64_t want_units = std::max<int64_t>(1, Int8CeilDiv(std::max<int64_t>(threads, 1), groups));
  int64_t cols = std::min<int64_t>(kMaxUnitCols, Int8RoundUp(Int8CeilDiv(p->n, want_units), kPanel));
  p->unit_cols = std::max<int64_t>(1, std::min(cols, Int8RoundUp(p->n, kNR)));
  p->units = Int8CeilDiv(p->n, p->unit_cols);
}

inline int64_t Groups(const Problem& p) { return Int8CeilDiv(p.m, p.group_rows); }

// Floats of scratch that hold one packed block: kKC rows x the unit's panels.
inline int64_t PackedFloats(const Problem& p) { return Int8CeilDiv(p.unit_cols, kPanel) * kKC * kPanel / 4; }

// Scratch floats per thread: the accumulators, the packed block, and the rows when the
// source copies them.
inline int64_t ScratchFloats(const Problem& p, bool copies_rows) {
  return p.group_rows * p.unit_cols + PackedFloats(p) + (copies_rows ? p.group_rows * p.k : 0);
}

namespace portable {
#include "cpu/int8_gemm_body.h"
}  // namespace portable

#ifdef TFMETAL_INT8_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define TFMETAL_INT8_BODY_AVX2 1
namespace avx2 {
#include "cpu/int8_gemm_body.h"
}  // namespace avx2
#undef TFMETAL_INT8_BODY_AVX2
#pragma GCC pop_options
#endif

}  // namespace int8_cpu
}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_INT8_GEMM_H_
