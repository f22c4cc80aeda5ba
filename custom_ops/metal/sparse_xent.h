// Metal kernels of TfmetalExt>SparseSoftmaxCrossEntropy and
// TfmetalExt>SparseSoftmaxCrossEntropyGrad (instantiated in sparse_xent.metal;
// host code in sparse_xent_metal.mm). The math is tfmetal/sparse_xent.h's,
// shared with the CPU kernel; this file only owns the loops and the order.
//
// sparse_xent<T, Label>       one threadgroup per row (dispatchThreadgroups):
//                             the row's max (strided over the threads, then
//                             simd_max, then the SIMD-group maxima in order),
//                             then its sum of exp(x - max) the same way
//                             (tfm_threadgroup_sum), then the loss; row_max
//                             and row_sum are written for the gradient op.
// sparse_xent_grad<T, Label>  one threadgroup per row too: each thread reads
//                             the row's statistics, label and dloss once and
//                             writes its strided elements. Chosen over one
//                             thread per element because a row is the unit of
//                             everything it reads: no per-element division to
//                             find the row, rows * classes may pass 2^32
//                             without chunked dispatches (32-bit row and
//                             column, a 64-bit row base), and it has the
//                             forward's geometry (norm_metal.h). The cost is
//                             idle lanes on rows shorter than a SIMD-group
//                             (classes < 32), where the op is tiny anyway.
//
// Labels (int32 or int64) stay in device memory: a label outside [0, classes)
// gives a NaN loss and a NaN gradient row (TensorFlow's GPU kernel does the
// same), and is never used as an index. row_max and row_sum are written
// whatever the label.
//
// Threadgroup sizes: any multiple of 32 up to 1024 (the host picks a power of
// two: NormRowThreads). classes >= 1 and rows >= 1 (the host refuses
// classes == 0 and dispatches nothing for rows == 0).
//
// Summation order: thread i adds the terms i, i + threads, i + 2 threads, ...
// in order, simd_sum adds the 32 lanes, then the SIMD-group partials are
// added in order: fixed by classes and the threadgroup size only
// (deterministic), but not the CPU kernel's (16 lanes, then pairwise), so
// row_sum and the loss agree with it to rounding, not bit for bit. The max is
// exact, so row_max is the CPU's; the gradient's per-element operations are
// the CPU's, so for the same statistics it is the CPU's bit for bit.
#ifndef TFMETAL_METAL_SPARSE_XENT_KERNELS_H_
#define TFMETAL_METAL_SPARSE_XENT_KERNELS_H_

#include "reduction.h"  // tfm_threadgroup_max, tfm_threadgroup_sum, TFM_MAX_SIMDGROUPS
#include "tfmetal/portable.h"
#include "tfmetal/sparse_xent.h"

// setBytes data of both kernels (shared with the host).
struct tfm_sparse_xent_params {
  uint32_t rows;     // rows of logits (one threadgroup each)
  uint32_t classes;  // the last dimension of logits, >= 1
};
static_assert(sizeof(tfm_sparse_xent_params) == 8, "tfm_sparse_xent_params layout is shared with the host");

#if TFM_METAL

template <typename T, typename Label>
[[kernel]] void sparse_xent(device const T* logits [[buffer(0)]],
                            device const Label* labels [[buffer(1)]],
                            device T* loss [[buffer(2)]],
                            device float* row_max [[buffer(3)]],
                            device float* row_sum [[buffer(4)]],
                            constant tfm_sparse_xent_params& p [[buffer(5)]],
                            TFM_KERNEL_BUILTINS) {
  threadgroup float slots[2 * TFM_MAX_SIMDGROUPS];  // the max's, then the sum's
  const uint row = tgid.x;
  const uint classes = p.classes;
  const uint threads = tgsize.x;
  device const T* xr = logits + static_cast<ulong>(row) * classes;  // 64-bit: rows * classes may exceed 2^32

  float m = -INFINITY;
  for (uint c = lid.x; c < classes; c += threads) m = sparse_xent_max(m, static_cast<float>(xr[c]));
  m = tfm_threadgroup_max(m, slots, threads, simd_lane, simd_id);

  float s = 0.0f;
  for (uint c = lid.x; c < classes; c += threads) s += sparse_xent_term(static_cast<float>(xr[c]), m);
  s = tfm_threadgroup_sum(s, slots + TFM_MAX_SIMDGROUPS, threads, simd_lane, simd_id);

  if (lid.x == 0) {
    const int64_t label = static_cast<int64_t>(labels[row]);
    // A bad label is not an index: its row's loss is NaN.
    loss[row] = static_cast<T>(sparse_xent_label_ok(label, classes)
                                   ? sparse_xent_loss(s, m, static_cast<float>(xr[label]))
                                   : NAN);
    row_max[row] = m;
    row_sum[row] = s;
  }
}

// dlogits may alias logits (the host forwards the logits' buffer when TF
// allows it): each element is read by the thread that writes it, before it
// writes.
template <typename T, typename Label>
[[kernel]] void sparse_xent_grad(device const T* dloss [[buffer(0)]],
                                 device const T* logits [[buffer(1)]],
                                 device const Label* labels [[buffer(2)]],
                                 device const float* row_max [[buffer(3)]],
                                 device const float* row_sum [[buffer(4)]],
                                 device T* dlogits [[buffer(5)]],
                                 constant tfm_sparse_xent_params& p [[buffer(6)]],
                                 TFM_KERNEL_BUILTINS) {
  const uint row = tgid.x;
  const uint classes = p.classes;
  const uint threads = tgsize.x;
  const ulong base = static_cast<ulong>(row) * classes;
  const int64_t label = static_cast<int64_t>(labels[row]);
  const bool label_ok = sparse_xent_label_ok(label, classes);
  const float m = row_max[row];
  const float inv_sum = 1.0f / row_sum[row];
  const float g = static_cast<float>(dloss[row]);
  for (uint c = lid.x; c < classes; c += threads) {
    const float dx = sparse_xent_grad(static_cast<float>(logits[base + c]), m, inv_sum,
                                      static_cast<int64_t>(c) == label, g);
    dlogits[base + c] = static_cast<T>(label_ok ? dx : NAN);
  }
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_SPARSE_XENT_KERNELS_H_
