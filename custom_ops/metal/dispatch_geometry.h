// dispatch_geometry.h: how the Metal host code sizes its dispatches
// (threadgroup sizes, grids, chunks), as plain C++ with no Objective-C, no
// Metal and no TensorFlow, so that two programs compute it from one source:
// - the host code: metal_helper.mm and the <op>_metal.mm files call these
//   functions with the pipeline's threadExecutionWidth and
//   maxTotalThreadsPerThreadgroup;
// - the emulator tests: emu.build() compiles this header on its own (with
//   TFM_EMU defined it exports the C functions at the end) and
//   tfmetal_ext.testing.host_geometry() calls them through ctypes, so a test
//   dispatches a kernel exactly as the host would, without restating the rules.
// Sizes are in threads; `cap` 0 means no cap.
#ifndef TFMETAL_METAL_DISPATCH_GEOMETRY_H_
#define TFMETAL_METAL_DISPATCH_GEOMETRY_H_

#include <stdint.h>

namespace tfmetal_ext {
namespace geometry {

// The most elements one 1-D dispatch covers: the kernels index elements with
// 32-bit integers, so larger tensors are dispatched in chunks at buffer offsets.
inline constexpr int64_t kMaxElementsPerDispatch = int64_t{1} << 30;

// Rows of the norm kernels (layer_norm, rms_norm): enough threads for about
// 4 elements each, at most 1024 threads per row.
inline constexpr uint64_t kNormElementsPerThread = 4;
inline constexpr uint64_t kNormMaxRowThreads = 1024;

inline uint64_t RoundUp(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

inline uint64_t PowerOfTwoAtMost(uint64_t value) {
  uint64_t p = 1;
  while (p <= value / 2) p *= 2;
  return p;
}

inline uint64_t Max(uint64_t a, uint64_t b) { return a > b ? a : b; }
inline uint64_t Min(uint64_t a, uint64_t b) { return a < b ? a : b; }

// The pipeline's limit under `cap` (0: none).
inline uint64_t Limit(uint64_t max_total, uint64_t cap) { return Min(max_total, cap == 0 ? UINT64_MAX : cap); }

// Elementwise: whole SIMD-groups, no more threads than the work needs, at
// most min(cap, max_total).
inline uint64_t ThreadgroupSize1D(uint64_t width, uint64_t max_total, uint64_t threads, uint64_t cap) {
  width = Max(width, 1);
  uint64_t limit = Limit(max_total, cap);
  if (limit >= width) limit -= limit % width;  // whole SIMD-groups
  limit = Max(limit, 1);
  return Min(limit, RoundUp(Max(threads, 1), width));
}

// One threadgroup per row (tree or SIMD reductions): a power of two between
// the SIMD width and min(cap, max_total), the smallest that covers
// row_length / elements_per_thread.
inline uint64_t ReductionThreadgroupSize(uint64_t width, uint64_t max_total, uint64_t row_length,
                                         uint64_t elements_per_thread, uint64_t cap) {
  width = Max(width, 1);
  const uint64_t limit = PowerOfTwoAtMost(Max(Limit(max_total, cap), 1));
  const uint64_t per_thread = Max(elements_per_thread, 1);
  const uint64_t wanted = (Max(row_length, 1) + per_thread - 1) / per_thread;
  uint64_t threads = Min(PowerOfTwoAtMost(width), limit);
  while (threads < wanted && threads * 2 <= limit) threads *= 2;
  return threads;
}

// The elements of the 1-D chunk starting at `start` of n (chunks of at most
// `chunk` elements; the host's is kMaxElementsPerDispatch).
inline int64_t ChunkElements(int64_t n, int64_t start, int64_t chunk) {
  return n - start < chunk ? n - start : chunk;
}

// The norm kernels (layer_norm, rms_norm). Forward and dx: one threadgroup
// per row of `channels` elements.
inline uint64_t NormRowThreads(uint64_t width, uint64_t max_total, uint64_t channels, uint64_t cap) {
  return ReductionThreadgroupSize(width, max_total, channels, kNormElementsPerThread, cap);
}

// The parameter gradients: ceil(C / columns) threadgroups, each of `columns`
// columns times as many row lanes as there are rows, up to the limit.
inline uint64_t NormParamGradGroups(uint64_t channels, uint64_t columns) { return (channels + columns - 1) / columns; }

inline uint64_t NormParamGradThreads(uint64_t width, uint64_t max_total, uint64_t rows, uint64_t columns,
                                     uint64_t cap) {
  return Max(columns, ReductionThreadgroupSize(width, max_total, Max(rows, 1) * columns, 1, cap));
}

}  // namespace geometry
}  // namespace tfmetal_ext

#if defined(TFM_EMU)
// Built alone by the emulator (tfmetal_ext.testing.host_geometry): the same
// functions with C linkage, for ctypes.
#define TFM_GEOMETRY_API extern "C" __attribute__((visibility("default")))
TFM_GEOMETRY_API int64_t tfm_geometry_max_elements_per_dispatch() {
  return tfmetal_ext::geometry::kMaxElementsPerDispatch;
}
TFM_GEOMETRY_API uint64_t tfm_geometry_threadgroup_size_1d(uint64_t width, uint64_t max_total, uint64_t threads,
                                                           uint64_t cap) {
  return tfmetal_ext::geometry::ThreadgroupSize1D(width, max_total, threads, cap);
}
TFM_GEOMETRY_API uint64_t tfm_geometry_reduction_threadgroup_size(uint64_t width, uint64_t max_total,
                                                                  uint64_t row_length, uint64_t elements_per_thread,
                                                                  uint64_t cap) {
  return tfmetal_ext::geometry::ReductionThreadgroupSize(width, max_total, row_length, elements_per_thread, cap);
}
TFM_GEOMETRY_API int64_t tfm_geometry_chunk_elements(int64_t n, int64_t start, int64_t chunk) {
  return tfmetal_ext::geometry::ChunkElements(n, start, chunk);
}
TFM_GEOMETRY_API uint64_t tfm_geometry_norm_row_threads(uint64_t width, uint64_t max_total, uint64_t channels,
                                                        uint64_t cap) {
  return tfmetal_ext::geometry::NormRowThreads(width, max_total, channels, cap);
}
TFM_GEOMETRY_API uint64_t tfm_geometry_norm_param_grad_groups(uint64_t channels, uint64_t columns) {
  return tfmetal_ext::geometry::NormParamGradGroups(channels, columns);
}
TFM_GEOMETRY_API uint64_t tfm_geometry_norm_param_grad_threads(uint64_t width, uint64_t max_total, uint64_t rows,
                                                               uint64_t columns, uint64_t cap) {
  return tfmetal_ext::geometry::NormParamGradThreads(width, max_total, rows, columns, cap);
}
#undef TFM_GEOMETRY_API
#endif  // TFM_EMU

#endif  // TFMETAL_METAL_DISPATCH_GEOMETRY_H_
