// UnsortedSegmentSum gap kernel: the host's segmentation and the sum, shared
// by the Metal kernel (custom_ops/metal/gap_segment.h) and its host code.
//
// TensorFlow's CPU kernel adds the rows of each segment into the output in
// increasing row order, in the data type itself (half and bfloat16 round after
// every add). The kernel does the same: the host (segment_ids and
// num_segments are in host memory) checks the ids with TF's errors, drops
// negative ids as TF does, and sorts the row numbers by segment, stably
// (a counting sort): order[offsets[s] .. offsets[s + 1]) are segment s's rows
// in increasing order. The GPU then sums, one thread per (segment, column),
// in that order, so the results are TF's bit for bit.
#ifndef TFMETAL_GAP_SEGMENT_H_
#define TFMETAL_GAP_SEGMENT_H_

#include "tfmetal/portable.h"

#if !defined(__METAL_VERSION__)
// ---------------------------------------------------------------- host side
// Stable counting sort of rows by segment. ids: n row ids (negative: dropped);
// offsets: num_segments + 1 entries; order: n entries (the kept rows first).
// Returns -1, or the first row whose id is >= num_segments (TF's error).
template <typename Id>
inline int64_t GapSegmentOrder(const Id* ids, int64_t n, int64_t num_segments, uint32_t* offsets,
                               uint32_t* order) {
  for (int64_t s = 0; s <= num_segments; ++s) offsets[s] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) continue;
    if (static_cast<int64_t>(ids[i]) >= num_segments) return i;
    ++offsets[ids[i] + 1];
  }
  for (int64_t s = 0; s < num_segments; ++s) offsets[s + 1] += offsets[s];
  // offsets[s] is now where segment s starts; fill with a moving cursor per segment.
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) continue;
    order[offsets[ids[i]]++] = static_cast<uint32_t>(i);
  }
  // Each cursor ended at the next segment's start: shift back.
  for (int64_t s = num_segments; s > 0; --s) offsets[s] = offsets[s - 1];
  offsets[0] = 0;
  return -1;
}
#endif  // !__METAL_VERSION__

#endif  // TFMETAL_GAP_SEGMENT_H_
