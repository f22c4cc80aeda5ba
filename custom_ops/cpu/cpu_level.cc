// The vector level the CPU kernels run at in this process (cpu_common.h's
// CpuVectorLevel), for `tfmetal_ext.ops.status()` to read with ctypes.
#include "cpu/cpu_common.h"

extern "C" __attribute__((visibility("default"))) const char* TfmetalExt_CpuVectorLevel() {
  switch (tfmetal_ext::CpuVectorLevel()) {
    case tfmetal_ext::CpuLevel::kAvx512:
      return "avx512";
    case tfmetal_ext::CpuLevel::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}
