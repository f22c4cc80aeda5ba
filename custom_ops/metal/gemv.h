// Metal kernel of TfmetalExt>Gemv, y = x @ w (+ bias) for a few rows of x
// (instantiated in gemv.metal; host code in gemv_metal.mm). The math and its
// rounding are tfmetal/gemv.h, shared with the CPU kernel.
//
// One thread per output y[m, n], over a 2-D grid (dispatchThreads): x over
// the columns n, y over the rows m. Adjacent threads take adjacent columns,
// so at each k the lanes of a SIMD-group read consecutive weights of row k
// (one contiguous load) and the same x[m, k]. The threadgroups are 1-D along
// n (metal_helper's ThreadgroupSize1D over N, at most 256 threads): for M
// small, a taller threadgroup would only leave threads idle.
//
// Each thread's float32 accumulator starts at +0.0 and takes k = 0 .. K - 1
// in increasing order, one gemv_step (a fused multiply-add) per k; then the
// bias (gemv_finish) and one rounding to T. That order is the CPU kernel's,
// so the two give the same bits. The loop is unrolled by 4: the four weights
// (K rows apart) are loaded first so their loads overlap, then the four fmas
// run in k order, which leaves the rounding unchanged. With K == 0 the loop
// does not run: every output is the bias, or +0.0.
//
// The rows go in dispatches of whole rows, as many as fit in
// kMaxElementsPerDispatch threads as the 1-D ops bound theirs (one row when a
// row is longer: its columns, < 2^31, still fit gid.x); `first_row` is the
// dispatch's first row, so the buffers stay bound at their start. Every
// dimension is < 2^31 (checked by the host), but M * K, K * N and M * N may
// not be: offsets into x, w and y are 64-bit.
//
// The params struct is also compiled by the host (.mm, plain C++ mode of
// portable.h), so both sides agree on its layout.
#ifndef TFMETAL_METAL_GEMV_KERNELS_H_
#define TFMETAL_METAL_GEMV_KERNELS_H_

#include "tfmetal/portable.h"
#include "tfmetal/gemv.h"

// setBytes data of the kernel ([[buffer(4)]]).
struct tfm_gemv_params {
  uint32_t first_row;  // the row of x and y that gid.y == 0 computes in this dispatch
  uint32_t rows;       // rows in this dispatch (the grid's height)
  uint32_t k;          // columns of x, rows of w
  uint32_t n;          // columns of w and y (the grid's width)
  uint32_t has_bias;   // 1: bias[n] is bound and added; 0: bias is a placeholder, never read
};
static_assert(sizeof(tfm_gemv_params) == 20, "tfm_gemv_params layout is shared with the host");

#if TFM_METAL

template <typename T>
[[kernel]] void gemv(device const T* x [[buffer(0)]],
                     device const T* w [[buffer(1)]],
                     device const T* bias [[buffer(2)]],
                     device T* y [[buffer(3)]],
                     constant tfm_gemv_params& p [[buffer(4)]],
                     TFM_KERNEL_BUILTINS) {
  // dispatchThreads puts no thread outside the grid; the guard keeps a
  // dispatch of whole threadgroups (the emulator tests') from writing past y.
  if (gid.x >= p.n || gid.y >= p.rows) return;
  const uint col = gid.x;
  const ulong row = static_cast<ulong>(p.first_row) + gid.y;
  const ulong n = p.n;
  const uint k = p.k;
  device const T* xr = x + row * k;
  device const T* wc = w + col;  // w[kk, col] = wc[kk * n]

  float acc = 0.0f;
  uint kk = 0;
  for (; kk + 4 <= k; kk += 4) {
    const float w0 = static_cast<float>(wc[0]);
    const float w1 = static_cast<float>(wc[n]);
    const float w2 = static_cast<float>(wc[2 * n]);
    const float w3 = static_cast<float>(wc[3 * n]);
    wc += 4 * n;
    acc = gemv_step(acc, static_cast<float>(xr[kk]), w0);
    acc = gemv_step(acc, static_cast<float>(xr[kk + 1]), w1);
    acc = gemv_step(acc, static_cast<float>(xr[kk + 2]), w2);
    acc = gemv_step(acc, static_cast<float>(xr[kk + 3]), w3);
  }
  for (; kk < k; ++kk) {
    acc = gemv_step(acc, static_cast<float>(xr[kk]), static_cast<float>(wc[0]));
    wc += n;
  }
  const bool has_bias = p.has_bias != 0;
  const float b = has_bias ? static_cast<float>(bias[col]) : 0.0f;
  y[row * n + col] = static_cast<T>(gemv_finish(acc, b, has_bias));
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GEMV_KERNELS_H_
