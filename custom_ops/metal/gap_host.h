// gap_host.h: host-side helpers the broadcasting gap kernels share
// (gap_broadcast_metal.mm, gap_int_metal.mm, gap_reverse_metal.mm): the broadcast plan with TF-style
// errors, and one thread per element of an iteration space dispatched in
// chunks. Objective-C++ with ARC, macOS arm64 only (uses metal_helper.h).
#ifndef TFMETAL_METAL_GAP_HOST_H_
#define TFMETAL_METAL_GAP_HOST_H_

#include <string>
#include <vector>

#include "metal/metal_helper.h"
#include "tfmetal/gap_broadcast.h"
#include "tfmetal/gap_reverse.h"

namespace tfmetal_ext {

// GapBroadcastPlan for `out` read from `in0` (and `in1` unless null), with an
// Unimplemented status when the shapes stay above TFM_GAP_BCAST_MAX_DIMS
// dimensions after collapsing (or an input exceeds 2^32 elements).
inline bool GapPlan(const std::vector<int64_t>& out, const std::vector<int64_t>& in0,
                    const std::vector<int64_t>* in1, tfm_gap_bcast_params* params, TF_Status* status) {
  if (!GapBroadcastPlan(out.data(), static_cast<int>(out.size()), in0.data(), static_cast<int>(in0.size()),
                        in1 != nullptr ? in1->data() : nullptr, in1 != nullptr ? static_cast<int>(in1->size()) : 0,
                        params)) {
    SetStatus(status, TF_UNIMPLEMENTED, "shape " + ShapeString(out) + " needs more than " +
                                            std::to_string(TFM_GAP_BCAST_MAX_DIMS) +
                                            " dimensions after collapsing, or an input of more than 2^32 elements");
    return false;
  }
  return true;
}

// One thread per element of an n-element iteration space, in chunks of at most
// kMaxElementsPerDispatch: for each, the chunk's count and first index go into
// the struct GapBcast(params) gives (its fields n, start_lo, start_hi: the
// params themselves, or their `b` member), then `bind(start, params)` binds
// and the chunk is dispatched.
inline tfm_gap_bcast_params& GapBcast(tfm_gap_bcast_params& p) { return p; }
inline tfm_gap_reverse_params& GapBcast(tfm_gap_reverse_params& p) { return p; }
inline tfm_gap_reverse_sequence_params& GapBcast(tfm_gap_reverse_sequence_params& p) { return p; }

template <class Params>
auto GapBcast(Params& p) -> decltype((p.b)) {
  return p.b;
}

template <class Params, class Bind>
void DispatchGapSpace(id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> pipeline, int64_t n,
                      Params params, Bind&& bind) {
  for (int64_t start = 0; start < n; start += kMaxElementsPerDispatch) {
    const int64_t count = geometry::ChunkElements(n, start, kMaxElementsPerDispatch);
    auto& b = GapBcast(params);
    b.n = static_cast<uint32_t>(count);
    b.start_lo = static_cast<uint32_t>(start);
    b.start_hi = static_cast<uint32_t>(static_cast<uint64_t>(start) >> 32);
    bind(start, params);
    DispatchThreads1D(encoder, pipeline, static_cast<NSUInteger>(count));
  }
}

}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_GAP_HOST_H_
