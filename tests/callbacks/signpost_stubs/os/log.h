// Test stand-in for Apple's <os/log.h>: just what tfm_signpost.c uses.
#pragma once
#include <stdbool.h>
#include <stdint.h>

typedef struct tfm_stub_log *os_log_t;
#define OS_LOG_CATEGORY_POINTS_OF_INTEREST "PointsOfInterest"
os_log_t os_log_create(const char *subsystem, const char *category);
