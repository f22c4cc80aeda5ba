// os_signpost intervals for training steps, so Instruments (Metal System Trace,
// os_signpost and Points of Interest tracks) shows each step beside the GPU work.
//
// Built on first use on macOS only (tfmetal_ext/callbacks/_signpost.py), into its
// own small dylib: it needs no TensorFlow headers. The os_signpost macros need
// string literals for the name and format (they are placed in the image's
// __oslogstring section), which is why this is C and not ctypes calls.
//
// Subsystem "tfmetal_ext", category "PointsOfInterest"; one interval named
// "step" per training step, carrying the global step number.

#include <os/log.h>
#include <os/signpost.h>
#include <stddef.h>
#include <stdint.h>

static os_log_t tfm_log;

// Returns 1 when signposts are enabled for the subsystem (an Instruments
// recording is running), else 0. Cheap: call it every step.
int tfm_signpost_init(void) {
  if (tfm_log == NULL) {
    tfm_log = os_log_create("tfmetal_ext", OS_LOG_CATEGORY_POINTS_OF_INTEREST);
  }
  return tfm_log != NULL && os_signpost_enabled(tfm_log) ? 1 : 0;
}

uint64_t tfm_signpost_step_begin(uint64_t step) {
  if (tfm_log == NULL) return 0;
  os_signpost_id_t id = os_signpost_id_generate(tfm_log);
  os_signpost_interval_begin(tfm_log, id, "step", "step %llu", (unsigned long long)step);
  return (uint64_t)id;
}

void tfm_signpost_step_end(uint64_t id, uint64_t step) {
  if (tfm_log == NULL || id == 0) return;
  os_signpost_interval_end(tfm_log, (os_signpost_id_t)id, "step", "step %llu", (unsigned long long)step);
}
