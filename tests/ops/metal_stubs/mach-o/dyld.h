// Stand-in for the part of <mach-o/dyld.h> custom_ops/metal/*.mm use (syntax
// checks on Linux only; see Foundation/Foundation.h): the loaded images.
#pragma once

#include <stdint.h>

extern "C" uint32_t _dyld_image_count(void);
extern "C" const char* _dyld_get_image_name(uint32_t image_index);
