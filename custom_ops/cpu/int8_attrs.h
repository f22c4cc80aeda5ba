// The `activation` attribute of TfmetalExt>Int8MatMul / Int8Conv2D: its strings, in the
// order of the TFM_INT8_* codes of tfmetal/int8.h (tfmetal_ext/backends/fusion.py
// INT8_ACTIVATIONS lists the same). Shared by the op registrations and the CPU kernels.
#ifndef TFMETAL_CPU_INT8_ATTRS_H_
#define TFMETAL_CPU_INT8_ATTRS_H_

#include <cstdint>
#include <string>

#include "tfmetal/int8.h"

namespace tfmetal_ext {
namespace int8_attrs {

constexpr const char* kActivationNames[TFM_INT8_NUM_ACTIVATIONS] = {
    "linear", "relu", "relu6", "elu", "leaky_relu", "gelu", "gelu_approximate", "tanh", "sigmoid",
};

constexpr const char* kActivationList =
    "linear, relu, relu6, elu, leaky_relu, gelu, gelu_approximate, tanh, sigmoid";

// The TFM_INT8_* code of `name`, or -1.
inline int32_t ActivationCode(const std::string& name) {
  for (int32_t i = 0; i < TFM_INT8_NUM_ACTIVATIONS; ++i) {
    if (name == kActivationNames[i]) return i;
  }
  return -1;
}

}  // namespace int8_attrs
}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_INT8_ATTRS_H_
