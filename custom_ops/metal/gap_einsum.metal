// Host names of the Einsum gap kernel (template in gap_einsum.h).
#include "gap_einsum.h"

TFM_INSTANTIATE_KERNEL(gap_einsum_float, gap_einsum<float>)
TFM_INSTANTIATE_KERNEL(gap_einsum_half, gap_einsum<half>)
#if TFM_HAS_BFLOAT
TFM_INSTANTIATE_KERNEL(gap_einsum_bfloat, gap_einsum<bfloat>)
#endif

#if defined(TFM_EMU)
// The host's planner and geometry (tfmetal/gap_einsum.h), exported for the
// emulator tests (ctypes).

// 1 if `equation` is accepted, else 0 with the reason in `reason`.
extern "C" __attribute__((visibility("default"))) int tfm_gap_einsum_parse(const char* equation, char* reason,
                                                                         int size) {
  GapEinsumSpec spec;
  return GapEinsumParse(equation, &spec, reason, size) ? 1 : 0;
}

// The plan of `equation` for operands of shapes a / b: the status code
// (0 OK, else TF_Code with the message in `error`), the output's rank and
// dims, the params. -1 with the reason in `error` if the equation is rejected.
extern "C" __attribute__((visibility("default"))) int tfm_gap_einsum_plan(
    const char* equation, const int64_t* a, int a_rank, const int64_t* b, int b_rank, int64_t* out_dims,
    int* out_rank, tfm_gap_einsum_params* params, char* error, int size) {
  GapEinsumSpec spec;
  if (!GapEinsumParse(equation, &spec, error, size)) return -1;
  *out_rank = spec.rank[2];
  return GapEinsumPlan(spec, a, a_rank, b, b_rank, out_dims, params, error, size);
}

// The threadgroups of one dispatch (GapEinsumGrid) and the batches it may cover.
extern "C" __attribute__((visibility("default"))) void tfm_gap_einsum_grid(const tfm_gap_einsum_params* params,
                                                                         uint32_t count, uint32_t* xyz) {
  GapEinsumGrid(*params, count, &xyz[0], &xyz[1], &xyz[2]);
}
extern "C" __attribute__((visibility("default"))) uint32_t tfm_gap_einsum_max_batch() {
  return TFM_GAP_EINSUM_MAX_BATCH;
}
#endif
