// The `activation` attribute of TfmetalExt>BatchNormAct / BatchNormActGrad: its strings, in
// the order of the TFM_BNA_* codes of tfmetal/batch_norm_act.h (tfmetal_ext/backends/fusion.py
// BATCH_NORM_ACT_ACTIVATIONS lists the same; tests/ops/test_batch_norm_act.py checks the op's
// registered list against it). Shared by the CPU kernels and the Metal host code.
#ifndef TFMETAL_CPU_BATCH_NORM_ACT_ATTRS_H_
#define TFMETAL_CPU_BATCH_NORM_ACT_ATTRS_H_

#include <cstdint>
#include <string>

#include "tfmetal/batch_norm_act.h"

namespace tfmetal_ext {
namespace batch_norm_act_attrs {

constexpr const char* kActivationNames[TFM_BNA_NUM_ACTIVATIONS] = {
    "linear", "relu", "relu6", "elu", "leaky_relu", "silu", "gelu",
};

constexpr const char* kActivationList = "linear, relu, relu6, elu, leaky_relu, silu, gelu";

// The TFM_BNA_* code of `name`, or -1.
inline int32_t ActivationCode(const std::string& name) {
  for (int32_t i = 0; i < TFM_BNA_NUM_ACTIVATIONS; ++i) {
    if (name == kActivationNames[i]) return i;
  }
  return -1;
}

}  // namespace batch_norm_act_attrs
}  // namespace tfmetal_ext

#endif  // TFMETAL_CPU_BATCH_NORM_ACT_ATTRS_H_
