// Metal kernels of the variable update gap kernels: AssignAddVariableOp and
// AssignSubVariableOp (host code in gap_variable_metal.mm, math in
// tfmetal/gap_variable.h).
//
// One thread per element over the variable's buffer, updated in place
// (dispatchThreads, edge threadgroups smaller, chunks bound at buffer offsets
// as DispatchChunked1D binds them: `gid.x < p.count` is the only guard). Each
// element is read and written by its own thread only, so no order matters.
// An empty variable is never dispatched.
#ifndef TFMETAL_METAL_GAP_VARIABLE_KERNELS_H_
#define TFMETAL_METAL_GAP_VARIABLE_KERNELS_H_

#include "tfmetal/gap_variable.h"
#include "tfmetal/portable.h"

// setBytes data of the kernels.
struct tfm_gap_variable_params {
  uint32_t count;   // elements in this dispatch (the host splits larger tensors)
  uint32_t op;      // TFM_GAP_VARIABLE_ADD or TFM_GAP_VARIABLE_SUB
  uint32_t pad[2];
};
static_assert(sizeof(tfm_gap_variable_params) == 16, "tfm_gap_variable_params layout is shared with the host");

#if TFM_METAL

// var = var + value (op ADD) or var - value (op SUB): for float, half and
// bfloat in float, rounded once to T; for int64_t wrapping around
// (tfm_assign_update's int64_t specialization).
template <typename T>
[[kernel]] void gap_assign_update(device T* var [[buffer(0)]],
                                  device const T* value [[buffer(1)]],
                                  constant tfm_gap_variable_params& p [[buffer(2)]],
                                  TFM_KERNEL_BUILTINS) {
  if (gid.x >= p.count) return;
  const uint i = gid.x;
  var[i] = tfm_assign_update<T>(p.op, var[i], value[i]);
}

#endif  // TFM_METAL

#endif  // TFMETAL_METAL_GAP_VARIABLE_KERNELS_H_
