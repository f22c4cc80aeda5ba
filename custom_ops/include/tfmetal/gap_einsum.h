// Einsum gap kernel: the equation as a strided batched matrix product, shared
// by the Metal kernel (custom_ops/metal/gap_einsum.h), its host code
// (gap_einsum_metal.mm) and the emulator tests (through gap_einsum.metal's
// exports). This header is the one home of the planner.
//
// Supported: two-operand contractions "A,B->C" with every label a letter,
// no label twice in one subscript, every output label in an operand, and
// every label of one operand only kept in the output. Each label then falls
// in one of four groups:
//   batch  in A, B and C          M  in A and C only
//   N      in B and C only        K  in A and B only (summed)
// and C[batch, m, n] = sum_k A[batch, m, k] * B[batch, k, n]. Nothing is
// transposed: each group is read through its own strides in each tensor.
// Labels of a group that sit next to each other, in the same order, in every
// tensor holding the group merge into one dimension (a "run"); a group may
// have up to TFM_GAP_EINSUM_MAX_RUNS runs. The kernel decomposes a group's
// flat index into its runs and sums their strides.
//
// Rejected, with the reason (they keep TensorFlow's CPU kernel: the equation
// allowlist in tfmetal_ext.backends.gap_kernels holds only equations this
// planner accepts): no "->", not two operands, an ellipsis, a character that
// is not a letter, a label twice in one subscript (a diagonal or a repeated
// output axis), an output label in no operand, a label of one operand that
// is not in the output (a sum that is not a contraction), more runs than
// TFM_GAP_EINSUM_MAX_RUNS in a group.
//
// Shapes (GapEinsumPlan): ranks and label sizes are checked with
// TensorFlow's messages (no broadcasting of named labels, as TensorFlow);
// each tensor must have fewer than 2^32 elements (32-bit offsets).
//
// The sum runs over k in increasing order in float, one rounding to T at
// the end: |C - exact| <= u_T |exact| + (1 + u_T) gamma_K sum_k |a_k b_k|
// with gamma_K = K u / (1 - K u), u = 2^-24 (float accumulation) and u_T the
// unit roundoff of T (2^-24 float, 2^-11 half, 2^-8 bfloat16).
#ifndef TFMETAL_GAP_EINSUM_H_
#define TFMETAL_GAP_EINSUM_H_

#include "tfmetal/portable.h"

#define TFM_GAP_EINSUM_MAX_RUNS 4   // dimensions per group after merging
#define TFM_GAP_EINSUM_TILE 32u     // output tile: 32 x 32 (M x N)
#define TFM_GAP_EINSUM_TILE_K 16u   // K per step
#define TFM_GAP_EINSUM_THREADS 16u  // threadgroup: 16 x 16 threads, 2 x 2 outputs each

// One group of labels (batch, M, N or K), merged into `rank` dimensions.
struct tfm_gap_einsum_group {
  uint32_t rank;                          // >= 1
  uint32_t dims[TFM_GAP_EINSUM_MAX_RUNS];  // sizes, outermost first
  uint32_t a[TFM_GAP_EINSUM_MAX_RUNS];     // element strides in A (0: not in A)
  uint32_t b[TFM_GAP_EINSUM_MAX_RUNS];     // in B
  uint32_t c[TFM_GAP_EINSUM_MAX_RUNS];     // in the output
};

// setBytes data of the kernel; the host fills it (GapEinsumPlan).
struct tfm_gap_einsum_params {
  uint32_t batch, m, n, k;  // each group's size (product of its dims)
  uint32_t batch_start;     // first batch index of this dispatch (chunks of TFM_GAP_EINSUM_MAX_BATCH)
  uint32_t pad[3];
  tfm_gap_einsum_group g[4];  // batch, M, N, K
};

#define TFM_GAP_EINSUM_BATCH 0
#define TFM_GAP_EINSUM_M 1
#define TFM_GAP_EINSUM_N 2
#define TFM_GAP_EINSUM_K 3
// Threadgroups per dispatch along z (batch): Metal's limit per grid dimension.
#define TFM_GAP_EINSUM_MAX_BATCH 65535u

// The element offsets of index `index` of group `g` in A, B and the output.
// (A size-0 dimension never gets here: its group is empty, nothing runs.)
TFM_INLINE void gap_einsum_offsets(TFM_CONSTANT const tfm_gap_einsum_group& g, uint32_t index,
                                   TFM_THREAD uint32_t& oa, TFM_THREAD uint32_t& ob, TFM_THREAD uint32_t& oc) {
  oa = 0;
  ob = 0;
  oc = 0;
  for (int d = static_cast<int>(g.rank) - 1; d >= 0; --d) {
    uint32_t coord = index;
    if (d > 0) {
      coord = index % g.dims[d];
      index /= g.dims[d];
    }
    oa += coord * g.a[d];
    ob += coord * g.b[d];
    oc += coord * g.c[d];
  }
}

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Plain C++ without the standard library (the emulator compiles this in the
// kernel's translation unit, where Metal's keywords are macros).

#define TFM_GAP_EINSUM_MAX_LABELS 52  // a-z, A-Z

// A parsed, accepted equation (shape-independent).
struct GapEinsumSpec {
  int rank[3];                                      // A, B, output
  int8_t axis_label[3][TFM_GAP_EINSUM_MAX_LABELS];  // the label id at each axis
  int count[4];                                     // labels per group
  int8_t labels[4][TFM_GAP_EINSUM_MAX_LABELS];      // each group's labels, outermost first
  int runs[4];                                      // runs per group
  int8_t run_end[4][TFM_GAP_EINSUM_MAX_RUNS];       // run r ends before labels[g][run_end[g][r]]
};

// Messages into a caller's buffer (no std::string here).
inline void GapEinsumAppend(char* buf, int size, const char* text) {
  int n = 0;
  while (n < size - 1 && buf[n] != 0) ++n;
  for (int i = 0; text[i] != 0 && n < size - 1; ++i) buf[n++] = text[i];
  if (size > 0) buf[n] = 0;
}

inline void GapEinsumAppendInt(char* buf, int size, int64_t value) {
  char digits[24];
  int n = 0;
  const bool negative = value < 0;
  uint64_t v = negative ? static_cast<uint64_t>(-(value + 1)) + 1 : static_cast<uint64_t>(value);
  do {
    digits[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  char text[26];
  int t = 0;
  if (negative) text[t++] = '-';
  while (n > 0) text[t++] = digits[--n];
  text[t] = 0;
  GapEinsumAppend(buf, size, text);
}

inline void GapEinsumAppendChar(char* buf, int size, char c) {
  const char text[2] = {c, 0};
  GapEinsumAppend(buf, size, text);
}

inline void GapEinsumAppendShape(char* buf, int size, const int64_t* dims, int rank) {
  GapEinsumAppend(buf, size, "[");
  for (int i = 0; i < rank; ++i) {
    if (i) GapEinsumAppend(buf, size, ",");
    GapEinsumAppendInt(buf, size, dims[i]);
  }
  GapEinsumAppend(buf, size, "]");
}

inline int GapEinsumLabelId(char c) {
  if (c >= 'a' && c <= 'z') return c - 'a';
  if (c >= 'A' && c <= 'Z') return 26 + (c - 'A');
  return -1;
}

inline char GapEinsumLabelChar(int id) { return static_cast<char>(id < 26 ? 'a' + id : 'A' + (id - 26)); }

// Parses `equation` into `spec`. true if accepted; otherwise false with the
// reason in `reason` (a buffer of `size` bytes).
inline bool GapEinsumParse(const char* equation, GapEinsumSpec* spec, char* reason, int size) {
  if (size > 0) reason[0] = 0;
  const char* names[3] = {"operand 0", "operand 1", "the output"};
  int tensor = 0, arrows = 0;
  for (int t = 0; t < 3; ++t) spec->rank[t] = 0;
  for (const char* p = equation; *p != 0; ++p) {
    const char c = *p;
    if (c == '-' && p[1] == '>') {
      if (++arrows > 1) {
        GapEinsumAppend(reason, size, "more than one '->'");
        return false;
      }
      if (tensor != 1) {
        GapEinsumAppendInt(reason, size, tensor + 1);
        GapEinsumAppend(reason, size, " operand(s): only two-operand contractions are supported");
        return false;
      }
      tensor = 2;
      ++p;
      continue;
    }
    if (c == ',') {
      if (tensor == 2) {
        GapEinsumAppend(reason, size, "a ',' in the output");
        return false;
      }
      if (++tensor > 1) {
        GapEinsumAppend(reason, size, "more than two operands: only two-operand contractions are supported");
        return false;
      }
      continue;
    }
    if (c == '.') {
      GapEinsumAppend(reason, size, "an ellipsis (broadcast dimensions) is not supported");
      return false;
    }
    const int id = GapEinsumLabelId(c);
    if (id < 0) {
      GapEinsumAppend(reason, size, "'");
      GapEinsumAppendChar(reason, size, c);
      GapEinsumAppend(reason, size, "' is not a label (labels are letters)");
      return false;
    }
    for (int i = 0; i < spec->rank[tensor]; ++i) {
      if (spec->axis_label[tensor][i] == id) {
        GapEinsumAppend(reason, size, "label '");
        GapEinsumAppendChar(reason, size, c);
        GapEinsumAppend(reason, size, "' appears twice in ");
        GapEinsumAppend(reason, size, names[tensor]);
        GapEinsumAppend(reason, size, tensor == 2 ? " (a repeated output axis)" : " (a diagonal)");
        return false;
      }
    }
    spec->axis_label[tensor][spec->rank[tensor]++] = static_cast<int8_t>(id);
  }
  if (arrows == 0) {
    GapEinsumAppend(reason, size, "no '->': the output must be explicit");
    return false;
  }
  // Where each label is: bit t set if tensor t has it.
  int where[TFM_GAP_EINSUM_MAX_LABELS];
  for (int l = 0; l < TFM_GAP_EINSUM_MAX_LABELS; ++l) where[l] = 0;
  for (int t = 0; t < 3; ++t) {
    for (int i = 0; i < spec->rank[t]; ++i) where[spec->axis_label[t][i]] |= 1 << t;
  }
  for (int l = 0; l < TFM_GAP_EINSUM_MAX_LABELS; ++l) {
    if (where[l] == 4) {
      GapEinsumAppend(reason, size, "output label '");
      GapEinsumAppendChar(reason, size, GapEinsumLabelChar(l));
      GapEinsumAppend(reason, size, "' is in neither operand");
      return false;
    }
    if (where[l] == 1 || where[l] == 2) {
      GapEinsumAppend(reason, size, "label '");
      GapEinsumAppendChar(reason, size, GapEinsumLabelChar(l));
      GapEinsumAppend(reason, size, where[l] == 1 ? "' of operand 0" : "' of operand 1");
      GapEinsumAppend(reason, size, " is summed without being contracted (a reduction, not a contraction)");
      return false;
    }
  }
  // Groups: labels in the order of the first tensor holding the group
  // (A for batch, M and K; B for N).
  const int group_mask[4] = {7, 5, 6, 3};
  const int first[4] = {0, 0, 1, 0};
  for (int g = 0; g < 4; ++g) {
    spec->count[g] = 0;
    const int t = first[g];
    for (int i = 0; i < spec->rank[t]; ++i) {
      const int l = spec->axis_label[t][i];
      if (where[l] == group_mask[g]) spec->labels[g][spec->count[g]++] = static_cast<int8_t>(l);
    }
  }
  // Runs: a label continues the run of the one before it if it follows it
  // directly in every tensor holding the group.
  const char* group_names[4] = {"batch", "M", "N", "K"};
  for (int g = 0; g < 4; ++g) {
    spec->runs[g] = 0;
    for (int i = 0; i < spec->count[g]; ++i) {
      bool continues = i > 0;
      for (int t = 0; t < 3 && continues; ++t) {
        if (!(group_mask[g] & (1 << t))) continue;
        int pos = -1, prev = -1;
        for (int j = 0; j < spec->rank[t]; ++j) {
          if (spec->axis_label[t][j] == spec->labels[g][i]) pos = j;
          if (spec->axis_label[t][j] == spec->labels[g][i - 1]) prev = j;
        }
        continues = pos == prev + 1;
      }
      if (continues) {
        spec->run_end[g][spec->runs[g] - 1] = static_cast<int8_t>(i + 1);
        continue;
      }
      if (spec->runs[g] == TFM_GAP_EINSUM_MAX_RUNS) {
        GapEinsumAppend(reason, size, "the ");
        GapEinsumAppend(reason, size, group_names[g]);
        GapEinsumAppend(reason, size, " labels form more than ");
        GapEinsumAppendInt(reason, size, TFM_GAP_EINSUM_MAX_RUNS);
        GapEinsumAppend(reason, size, " separate dimensions");
        return false;
      }
      spec->run_end[g][spec->runs[g]++] = static_cast<int8_t>(i + 1);
    }
  }
  return true;
}

// Status codes of GapEinsumPlan (TF_Code's values).
#define TFM_GAP_EINSUM_OK 0
#define TFM_GAP_EINSUM_INVALID_ARGUMENT 3
#define TFM_GAP_EINSUM_UNIMPLEMENTED 12

// The output shape (`out_dims`, spec.rank[2] entries) and the kernel's
// params for operands of shapes `a_dims` / `b_dims`. Returns
// TFM_GAP_EINSUM_OK, or a status code with the message in `error`:
// InvalidArgument for TensorFlow's own shape errors (with its text),
// Unimplemented beyond the kernel's 32-bit offsets.
inline int GapEinsumPlan(const GapEinsumSpec& spec, const int64_t* a_dims, int a_rank, const int64_t* b_dims,
                         int b_rank, int64_t* out_dims, tfm_gap_einsum_params* p, char* error, int size) {
  if (size > 0) error[0] = 0;
  const int64_t* dims[2] = {a_dims, b_dims};
  const int ranks[2] = {a_rank, b_rank};
  for (int t = 0; t < 2; ++t) {
    if (ranks[t] != spec.rank[t]) {
      GapEinsumAppend(error, size, "Expected input ");
      GapEinsumAppendInt(error, size, t);
      GapEinsumAppend(error, size, " to have rank ");
      GapEinsumAppendInt(error, size, spec.rank[t]);
      GapEinsumAppend(error, size, " but got: ");
      GapEinsumAppendInt(error, size, ranks[t]);
      return TFM_GAP_EINSUM_INVALID_ARGUMENT;
    }
  }
  int64_t label_size[TFM_GAP_EINSUM_MAX_LABELS];
  bool seen[TFM_GAP_EINSUM_MAX_LABELS];
  for (int l = 0; l < TFM_GAP_EINSUM_MAX_LABELS; ++l) {
    label_size[l] = 0;
    seen[l] = false;
  }
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < ranks[t]; ++i) {
      const int l = spec.axis_label[t][i];
      if (seen[l] && label_size[l] != dims[t][i]) {
        GapEinsumAppend(error, size, "Expected dimension ");
        GapEinsumAppendInt(error, size, label_size[l]);
        GapEinsumAppend(error, size, " at axis ");
        GapEinsumAppendInt(error, size, i);
        GapEinsumAppend(error, size, " of the input shaped ");
        GapEinsumAppendShape(error, size, dims[t], ranks[t]);
        GapEinsumAppend(error, size, " but got dimension ");
        GapEinsumAppendInt(error, size, dims[t][i]);
        return TFM_GAP_EINSUM_INVALID_ARGUMENT;
      }
      seen[l] = true;
      label_size[l] = dims[t][i];
    }
  }
  for (int i = 0; i < spec.rank[2]; ++i) out_dims[i] = label_size[spec.axis_label[2][i]];
  // Contiguous element strides of each label in each tensor (0 where absent),
  // and each tensor's element count.
  int64_t stride[3][TFM_GAP_EINSUM_MAX_LABELS];
  const int64_t* shapes[3] = {a_dims, b_dims, out_dims};
  for (int t = 0; t < 3; ++t) {
    for (int l = 0; l < TFM_GAP_EINSUM_MAX_LABELS; ++l) stride[t][l] = 0;
    int64_t acc = 1;
    bool empty = false;
    for (int i = spec.rank[t] - 1; i >= 0; --i) {
      stride[t][spec.axis_label[t][i]] = acc;
      if (shapes[t][i] == 0) empty = true;
      // Saturating: a tensor of 2^32 elements or more is refused below.
      acc = (shapes[t][i] != 0 && acc > (int64_t{1} << 40) / shapes[t][i]) ? (int64_t{1} << 40) : acc * shapes[t][i];
    }
    if (!empty && acc >= (int64_t{1} << 32)) {
      GapEinsumAppend(error, size, "Einsum's GPU kernel takes tensors of fewer than 2^32 elements; ");
      GapEinsumAppend(error, size, t == 2 ? "the output" : (t == 0 ? "input 0" : "input 1"));
      GapEinsumAppend(error, size, " has more");
      return TFM_GAP_EINSUM_UNIMPLEMENTED;
    }
  }
  const int group_mask[4] = {7, 5, 6, 3};
  uint32_t* sizes[4] = {&p->batch, &p->m, &p->n, &p->k};
  for (int g = 0; g < 4; ++g) {
    tfm_gap_einsum_group& out = p->g[g];
    out.rank = 0;
    uint64_t total = 1;
    int start = 0;
    for (int r = 0; r < spec.runs[g]; ++r) {
      uint64_t run = 1;
      for (int i = start; i < spec.run_end[g][r]; ++i) run *= static_cast<uint64_t>(label_size[spec.labels[g][i]]);
      const int inner = spec.labels[g][spec.run_end[g][r] - 1];
      start = spec.run_end[g][r];
      total *= run;
      if (run == 1) continue;  // a size-1 dimension moves nothing
      out.dims[out.rank] = static_cast<uint32_t>(run);
      out.a[out.rank] = (group_mask[g] & 1) ? static_cast<uint32_t>(stride[0][inner]) : 0u;
      out.b[out.rank] = (group_mask[g] & 2) ? static_cast<uint32_t>(stride[1][inner]) : 0u;
      out.c[out.rank] = (group_mask[g] & 4) ? static_cast<uint32_t>(stride[2][inner]) : 0u;
      ++out.rank;
    }
    if (out.rank == 0 || total == 0) {  // no dimension, or an empty group: one size dimension, never decomposed
      out.rank = 1;
      out.dims[0] = static_cast<uint32_t>(total);
      out.a[0] = out.b[0] = out.c[0] = 0u;
    }
    for (uint32_t d = out.rank; d < TFM_GAP_EINSUM_MAX_RUNS; ++d) {
      out.dims[d] = 1u;
      out.a[d] = out.b[d] = out.c[d] = 0u;
    }
    *sizes[g] = static_cast<uint32_t>(total);  // < 2^32: every group lies within a tensor of fewer elements
  }
  p->batch_start = 0;
  p->pad[0] = p->pad[1] = p->pad[2] = 0;
  return TFM_GAP_EINSUM_OK;
}

// The threadgroups of the dispatch covering batches [batch_start,
// batch_start + count): (ceil(N / 32), ceil(M / 32), count), 16 x 16 threads each.
inline void GapEinsumGrid(const tfm_gap_einsum_params& p, uint32_t count, uint32_t* x, uint32_t* y, uint32_t* z) {
  *x = (p.n + TFM_GAP_EINSUM_TILE - 1) / TFM_GAP_EINSUM_TILE;
  *y = (p.m + TFM_GAP_EINSUM_TILE - 1) / TFM_GAP_EINSUM_TILE;
  *z = count;
}
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_EINSUM_H_
