// Host names of the Pack / Unpack gap kernel (template in gap_stack.h), by element size:
// bool 1 byte, half and bfloat16 2, float 4.
#include "gap_stack.h"

TFM_INSTANTIATE_KERNEL(gap_stack_copy_1, gap_stack_copy<uchar>)
TFM_INSTANTIATE_KERNEL(gap_stack_copy_2, gap_stack_copy<ushort>)
TFM_INSTANTIATE_KERNEL(gap_stack_copy_4, gap_stack_copy<uint>)

#if defined(TFM_EMU)
#include <cstring>

// The host's checks and geometry, exported for the emulator tests (ctypes): they dispatch with the geometry
// the host computes and compare its error text with TensorFlow's. Returns 1 and fills g[3] (axis, inner,
// per_tensor), or 0 and writes the message (NUL-terminated, cut at `cap`).
namespace {
int tfm_gap_stack_result(const std::string& error, const GapStackGeometry& geometry, int64_t* g, char* message,
                         int cap) {
  if (error.empty()) {
    g[0] = geometry.axis;
    g[1] = geometry.inner;
    g[2] = geometry.per_tensor;
    return 1;
  }
  std::strncpy(message, error.c_str(), static_cast<size_t>(cap));
  message[cap - 1] = '\0';
  return 0;
}
}  // namespace

// Pack: tensor k's shape is dims[offsets[k] .. offsets[k] + ranks[k]).
extern "C" __attribute__((visibility("default"))) int tfm_gap_pack_check(const int64_t* dims, const int* offsets,
                                                                       const int* ranks, int n, int64_t axis,
                                                                       int64_t* g, char* message, int cap) {
  if (n < 1) return -1;
  const int64_t** shapes = new const int64_t*[n];
  for (int k = 0; k < n; ++k) shapes[k] = dims + offsets[k];
  GapStackGeometry geometry{};
  const std::string error = GapPackCheck(shapes, ranks, n, axis, &geometry);
  delete[] shapes;
  return tfm_gap_stack_result(error, geometry, g, message, cap);
}

extern "C" __attribute__((visibility("default"))) int tfm_gap_unpack_check(const int64_t* shape, int rank,
                                                                         int64_t num, int64_t axis, int64_t* g,
                                                                         char* message, int cap) {
  GapStackGeometry geometry{};
  return tfm_gap_stack_result(GapUnpackCheck(shape, rank, num, axis, &geometry), geometry, g, message, cap);
}
#endif
