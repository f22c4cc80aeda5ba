// Metal kernels of the int64 and bool gap kernels (host code in
// gap_int_metal.mm; semantics in tfmetal/gap_int.h, index mapping in
// tfmetal/gap_broadcast.h).
//
// Binary ops: one thread per output element, broadcast as DivNoNan is.
// All / Any: the output is first filled with the identity (true / false),
// then one thread per input element writes the other value to its output
// element where the element differs from the identity. Threads that write one
// element all write the same value, so the result does not depend on their order.
#ifndef TFMETAL_METAL_GAP_INT_KERNELS_H_
#define TFMETAL_METAL_GAP_INT_KERNELS_H_

#include "tfmetal/gap_broadcast.h"
#include "tfmetal/gap_int.h"
#include "tfmetal/portable.h"

// The broadcast mapping plus the operation (binary) or the identity (reduction).
struct tfm_gap_int_params {
  tfm_gap_bcast_params b;
  uint32_t op;  // TFM_GAP_INT_*; for All / Any the identity (1 / 0)
  uint32_t pad[3];
};
static_assert(sizeof(tfm_gap_int_params) == sizeof(tfm_gap_bcast_params) + 16,
              "tfm_gap_int_params layout is shared with the host");

#if TFM_METAL

[[kernel]] void gap_int64_binary(device const int64_t* x [[buffer(0)]],
                                 device const int64_t* y [[buffer(1)]],
                                 device int64_t* z [[buffer(2)]],
                                 constant tfm_gap_int_params& p [[buffer(3)]],
                                 TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.b.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.b.start_hi) << 32) | p.b.start_lo) + gid.x;
  uint64_t ox, oy;
  gap_bcast_offsets(p.b, index, ox, oy);
  z[gid.x] = gap_int64_binary(p.op, x[ox], y[oy]);
}

[[kernel]] void gap_int64_compare(device const int64_t* x [[buffer(0)]],
                                  device const int64_t* y [[buffer(1)]],
                                  device uint8_t* z [[buffer(2)]],
                                  constant tfm_gap_int_params& p [[buffer(3)]],
                                  TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.b.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.b.start_hi) << 32) | p.b.start_lo) + gid.x;
  uint64_t ox, oy;
  gap_bcast_offsets(p.b, index, ox, oy);
  z[gid.x] = gap_int64_compare(p.op, x[ox], y[oy]);
}

// out[i] = identity for the p.b.n elements bound.
[[kernel]] void gap_bool_fill(device uint8_t* out [[buffer(0)]],
                              constant tfm_gap_int_params& p [[buffer(1)]],
                              TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.b.n) return;
  out[gid.x] = static_cast<uint8_t>(p.op);
}

// Input element (start + gid.x) -> its output element (offsets of input 0 in the
// mapping: the kept dimensions' strides, 0 for the reduced ones).
[[kernel]] void gap_bool_reduce(device const uint8_t* input [[buffer(0)]],
                                device uint8_t* out [[buffer(1)]],
                                constant tfm_gap_int_params& p [[buffer(2)]],
                                TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.b.n) return;
  const uint64_t index = ((static_cast<uint64_t>(p.b.start_hi) << 32) | p.b.start_lo) + gid.x;
  uint64_t o, unused;
  gap_bcast_offsets(p.b, index, o, unused);
  if ((input[gid.x] != 0) != (p.op != 0)) out[o] = static_cast<uint8_t>(p.op == 0 ? 1 : 0);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_INT_KERNELS_H_
