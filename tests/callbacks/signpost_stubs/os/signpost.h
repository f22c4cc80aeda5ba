// Test stand-in for Apple's <os/signpost.h>. Like the real macros, the name
// and format must be string literals ("" name fails to compile otherwise).
#pragma once
#include <os/log.h>

typedef uint64_t os_signpost_id_t;
bool os_signpost_enabled(os_log_t log);
os_signpost_id_t os_signpost_id_generate(os_log_t log);
void tfm_stub_emit(os_log_t log, os_signpost_id_t id, int kind, const char *name, const char *format, ...);
#define os_signpost_interval_begin(log, id, name, format, ...) \
  tfm_stub_emit(log, id, 1, "" name "", "" format "", __VA_ARGS__)
#define os_signpost_interval_end(log, id, name, format, ...) \
  tfm_stub_emit(log, id, 2, "" name "", "" format "", __VA_ARGS__)
