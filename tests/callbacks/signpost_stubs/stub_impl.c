// Records what tfm_signpost.c emits, for tests/callbacks/test_signpost.py.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <os/signpost.h>

struct tfm_stub_log { char subsystem[64]; char category[64]; };
static struct tfm_stub_log the_log;
static uint64_t next_id = 100;
static char events[4096];

os_log_t os_log_create(const char *subsystem, const char *category) {
  snprintf(the_log.subsystem, sizeof the_log.subsystem, "%s", subsystem);
  snprintf(the_log.category, sizeof the_log.category, "%s", category);
  return &the_log;
}
bool os_signpost_enabled(os_log_t log) { return log == &the_log; }
os_signpost_id_t os_signpost_id_generate(os_log_t log) { return log == &the_log ? next_id++ : 0; }

void tfm_stub_emit(os_log_t log, os_signpost_id_t id, int kind, const char *name, const char *format, ...) {
  char message[128];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  size_t used = strlen(events);
  snprintf(events + used, sizeof events - used, "%s/%s %s %s id=%llu %s;", log->subsystem, log->category,
           kind == 1 ? "begin" : "end", name, (unsigned long long)id, message);
}

const char *tfm_stub_events(void) { return events; }
