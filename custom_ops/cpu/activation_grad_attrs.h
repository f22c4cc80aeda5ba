// The `activation` attribute of TfmetalExt>ActivationGrad: its strings, in the order of the
// TFM_ACTGRAD_* codes of tfmetal/activation_grad.h (tfmetal_ext/backends/fusion.py
// ACTIVATION_GRAD_ACTIVATIONS lists the same; tests/ops/test_activation_grad.py checks the op's
// registered list against it). Shared by the CPU kernel and the Metal host code.
#ifndef TFMETAL_CPU_ACTIVATION_GRAD_ATTRS_H_
#define TFMETAL_CPU_ACTIVATION_GRAD_ATTRS_H_

#include <cstdint>
#include <string>

#include "tfmetal/activation_grad.h"

namespace tfmetal_ext {
namespace activation_grad_attrs {

constexpr const char* kActivationNames[TFM_ACTGRAD_NUM_ACTIVATIONS] = {"silu", "gelu", "gelu_approximate"};

constexpr const char* kActivationList = "silu, gelu, gelu_approximate";

// The TFM_ACTGRAD_* code of `name`, or -1.
inline int32_t ActivationCode(const std::string& name) {
  for (int32_t i = 0; i < TFM_ACTGRAD_NUM_ACTIVATIONS; ++i) {
    if (name == kActivationNames[i]) return i;
  }
  return -1;
}

// "" for a known name, else the InvalidArgument message (both backends' text).
inline std::string ActivationError(const std::string& name) {
  if (ActivationCode(name) >= 0) return "";
  return std::string("activation must be one of ") + kActivationList + ", got \"" + name + "\"";
}

}  // namespace activation_grad_attrs
}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_ACTIVATION_GRAD_ATTRS_H_
