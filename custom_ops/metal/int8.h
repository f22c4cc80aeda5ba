// Metal kernels of TfmetalExt>Int8MatMul and TfmetalExt>Int8Conv2D
// (instantiated in int8.metal; host code in int8_metal.mm). The math (Keras'
// scale convention, the epilogue, the activations, TF's conv padding) is
// tfmetal/int8.h, shared with the CPU kernels.
//
// int8_matmul<T>  y[m, n] = act(sum_k x[m, k] * q[k, n] / scale[n] + bias[n])
// int8_conv2d<T>  y[b, oh, ow, co] = act(sum_{kh, kw, ci} x[b, ih, iw, ci] *
//                 q[kh, kw, ci, co] / scale[co] + bias[co]), NHWC x, HWIO q,
//                 ih = oh * stride_h - pad_top + kh * dilation_h (likewise iw);
//                 taps outside the input (the SAME padding) contribute nothing.
//
// q is the int8 kernel (`kernel` is a keyword in Metal).
//
// Threads over a 1-D grid (dispatchThreads), output channel fastest, so the
// 32 lanes of a SIMD-group read 32 consecutive int8 weights of one kernel row
// and (mostly) the same activation:
//   int8_matmul: one thread per column n and block of TFM_INT8_MATMUL_ROWS
//                rows of x (thread t: block t / N, column t % N); each weight
//                it loads serves every row of its block (batch 8 reads the
//                kernel twice, not 8 times), the rows past M of the last
//                block re-read row M - 1 and are not stored;
//   int8_conv2d: one thread per output element (b, oh, ow, co).
// The accumulator of each output is float32 for every T, summed in the order
// of k (matmul) or of kh, kw, ci (conv), then tfm_int8_epilogue. The weights
// are read as int8 and converted in registers: nothing is de-quantized into
// memory.
//
// A dispatch covers threads [base, base + count) (count <= 2^30, the helper's
// kMaxElementsPerDispatch); the host encodes as many as the output needs.
// Indices into the tensors are 64-bit; each dimension is < 2^31 (checked by
// the host).
//
// kernel_scale is in device memory, so the host cannot check its values
// without waiting for the GPU: an output channel whose scale is not finite
// and > 0 is written as NaN (never a silently wrong number); the CPU kernel
// raises InvalidArgumentError for it.
#ifndef TFMETAL_METAL_INT8_KERNELS_H_
#define TFMETAL_METAL_INT8_KERNELS_H_

#include "tfmetal/portable.h"
#include "tfmetal/int8.h"

// Rows of x one int8_matmul thread computes (the host sizes the grid with it).
#define TFM_INT8_MATMUL_ROWS 4

// setBytes data of int8_matmul (shared with the host).
struct tfm_int8_matmul_params {
  uint64_t base;        // first thread of this dispatch (row block * n + col)
  uint32_t count;       // threads in this dispatch
  uint32_t m;           // rows of x and y
  uint32_t k;           // columns of x, rows of the kernel
  uint32_t n;           // columns of the kernel and y (output channels)
  int32_t activation;   // a TFM_INT8_* code
  float alpha;          // leaky_relu's negative slope
  uint32_t has_bias;    // 1: bias[n] is bound and added
  uint32_t unused;      // padding to a multiple of 8 bytes
};
static_assert(sizeof(tfm_int8_matmul_params) == 40, "tfm_int8_matmul_params layout is shared with the host");

// setBytes data of int8_conv2d (shared with the host).
struct tfm_int8_conv2d_params {
  uint64_t base;        // first output element of this dispatch
  uint32_t count;       // output elements in this dispatch
  uint32_t batch;       // B
  uint32_t in_h;        // H
  uint32_t in_w;        // W
  uint32_t in_c;        // Cin
  uint32_t k_h;         // KH
  uint32_t k_w;         // KW
  uint32_t out_h;       // OH
  uint32_t out_w;       // OW
  uint32_t out_c;       // Cout
  int32_t stride_h;
  int32_t stride_w;
  int32_t dilation_h;
  int32_t dilation_w;
  int32_t pad_top;      // tfm_int8_conv_pad_before of the rows (0 for VALID)
  int32_t pad_left;     // ... of the columns
  int32_t activation;   // a TFM_INT8_* code
  float alpha;          // leaky_relu's negative slope
  uint32_t has_bias;    // 1: bias[Cout] is bound and added
  uint32_t unused;      // padding to a multiple of 8 bytes
};
static_assert(sizeof(tfm_int8_conv2d_params) == 88, "tfm_int8_conv2d_params layout is shared with the host");

#if TFM_METAL

// The epilogue of one output element, NaN where the channel's scale is not
// finite and > 0 (the host cannot check values in device memory).
inline float int8_finish(float acc, float scale, float bias, int32_t activation, float alpha) {
  if (!(tfm_isfinite(scale) && scale > 0.0f)) return NAN;
  return tfm_int8_epilogue(acc, scale, bias, activation, alpha);
}

template <typename T>
[[kernel]] void int8_matmul(device const T* x [[buffer(0)]],
                            device const int8_t* q [[buffer(1)]],
                            device const float* kernel_scale [[buffer(2)]],
                            device const T* bias [[buffer(3)]],
                            device T* y [[buffer(4)]],
                            constant tfm_int8_matmul_params& p [[buffer(5)]],
                            TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.count) return;
  const ulong t = p.base + static_cast<ulong>(gid.x);
  const ulong cols = p.n;
  const uint block = static_cast<uint>(t / cols);
  const uint col = static_cast<uint>(t - static_cast<ulong>(block) * cols);
  const uint row0 = block * TFM_INT8_MATMUL_ROWS;  // < m: the host dispatches ceil(m / ROWS) blocks
  device const T* xr[TFM_INT8_MATMUL_ROWS];
  float acc[TFM_INT8_MATMUL_ROWS];
  for (uint r = 0; r < TFM_INT8_MATMUL_ROWS; ++r) {
    xr[r] = x + static_cast<ulong>(min(row0 + r, p.m - 1)) * p.k;
    acc[r] = 0.0f;
  }
  device const int8_t* qc = q + col;

  for (uint i = 0; i < p.k; ++i) {
    const float w = static_cast<float>(qc[static_cast<ulong>(i) * cols]);
    for (uint r = 0; r < TFM_INT8_MATMUL_ROWS; ++r) acc[r] += static_cast<float>(xr[r][i]) * w;
  }
  const float scale = kernel_scale[col];
  const float b = p.has_bias != 0 ? static_cast<float>(bias[col]) : 0.0f;
  for (uint r = 0; r < TFM_INT8_MATMUL_ROWS; ++r) {
    if (row0 + r < p.m) {
      const float out = int8_finish(acc[r], scale, b, p.activation, p.alpha);
      y[static_cast<ulong>(row0 + r) * cols + col] = static_cast<T>(out);
    }
  }
}

template <typename T>
[[kernel]] void int8_conv2d(device const T* x [[buffer(0)]],
                            device const int8_t* q [[buffer(1)]],
                            device const float* kernel_scale [[buffer(2)]],
                            device const T* bias [[buffer(3)]],
                            device T* y [[buffer(4)]],
                            constant tfm_int8_conv2d_params& p [[buffer(5)]],
                            TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.count) return;
  const ulong e = p.base + static_cast<ulong>(gid.x);
  const ulong out_c = p.out_c;
  const ulong pixel = e / out_c;  // (b * OH + oh) * OW + ow
  const uint co = static_cast<uint>(e - pixel * out_c);
  const ulong line = pixel / p.out_w;  // b * OH + oh
  const int ow = static_cast<int>(pixel - line * p.out_w);
  const uint b = static_cast<uint>(line / p.out_h);
  const int oh = static_cast<int>(line - static_cast<ulong>(b) * p.out_h);
  const int h0 = oh * p.stride_h - p.pad_top;
  const int w0 = ow * p.stride_w - p.pad_left;
  const int in_h = static_cast<int>(p.in_h);
  const int in_w = static_cast<int>(p.in_w);
  const uint in_c = p.in_c;

  float acc = 0.0f;
  for (uint kh = 0; kh < p.k_h; ++kh) {
    const int ih = h0 + static_cast<int>(kh) * p.dilation_h;
    if (ih < 0 || ih >= in_h) continue;
    for (uint kw = 0; kw < p.k_w; ++kw) {
      const int iw = w0 + static_cast<int>(kw) * p.dilation_w;
      if (iw < 0 || iw >= in_w) continue;
      device const T* xp = x + ((static_cast<ulong>(b) * p.in_h + static_cast<ulong>(ih)) * p.in_w +
                                static_cast<ulong>(iw)) * in_c;
      device const int8_t* qp = q + ((static_cast<ulong>(kh) * p.k_w + kw) * in_c) * out_c + co;
      for (uint ci = 0; ci < in_c; ++ci) {
        acc += static_cast<float>(xp[ci]) * static_cast<float>(qp[static_cast<ulong>(ci) * out_c]);
      }
    }
  }
  const float bv = p.has_bias != 0 ? static_cast<float>(bias[co]) : 0.0f;
  y[e] = static_cast<T>(int8_finish(acc, kernel_scale[co], bv, p.activation, p.alpha));
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_INT8_KERNELS_H_
