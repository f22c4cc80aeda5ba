// gap_plan.h: which gap kernels (GPU kernels for standard TensorFlow ops the
// loaded Metal backend has none for) the op library registers, as the text
// tfmetal_ext.backends.gap_kernels.plan_text() writes into
// $TFMETAL_EXT_GAP_KERNELS before the library loads. Python holds the
// decision (the backend tables); this header only parses it, so the host
// code registers exactly what the text lists and never a kernel the backend
// already has (two matching registrations fail the op in TensorFlow).
//
// Plain C++17, no TF and no Objective-C: tests/ops/test_metal_host_code.py
// compiles and runs the parser on Linux.
//
// Text: line 1 is the backend distribution the plan was made for
// ("tensorflow-metal" / "tensorflow-metal-plugin"); then one line per op:
//   <op>|<attr>=<dtype>,<dtype>|<attr>=<dtype>,...|host=<arg>,<arg>
// The first attr is the one the plan decided on (its dtypes are the
// registered ones); every combination of the attrs' dtypes is registered.
// Dtype names as Python spells them (float32, float16, bfloat16, bool,
// int32, int64).
#ifndef TFMETAL_METAL_GAP_PLAN_H_
#define TFMETAL_METAL_GAP_PLAN_H_

#include <string>
#include <utility>
#include <vector>

namespace tfmetal_ext {
namespace gap {

inline constexpr char kPlanEnv[] = "TFMETAL_EXT_GAP_KERNELS";

struct Constraint {
  std::string attr;                 // "T"
  std::vector<std::string> dtypes;  // {"float16", "bfloat16"}
};

struct KernelDef {
  std::string op;                        // "DivNoNan"
  std::vector<Constraint> constraints;   // first: the planned attr
  std::vector<std::string> host_memory;  // argument names kept in host memory
};

struct Plan {
  bool present = false;  // the environment variable was set
  std::string backend;   // line 1
  std::vector<KernelDef> kernels;
  std::string error;     // a malformed text: nothing is registered
};

// TF_DataType's value for a Python dtype name, -1 if not one we register.
// (The enum values are TensorFlow's stable DataType numbers.)
inline int DtypeValue(const std::string& name) {
  if (name == "float32") return 1;   // TF_FLOAT
  if (name == "int32") return 3;     // TF_INT32
  if (name == "int64") return 9;     // TF_INT64
  if (name == "bool") return 10;     // TF_BOOL
  if (name == "bfloat16") return 14; // TF_BFLOAT16
  if (name == "float16") return 19;  // TF_HALF
  return -1;
}

inline std::vector<std::string> Split(const std::string& text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(sep, start);
    out.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

inline bool IsName(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    if (!ok) return false;
  }
  return true;
}

inline Plan Fail(Plan plan, const std::string& error) {
  plan.kernels.clear();
  plan.error = error;
  return plan;
}

// The plan in `text` (nullptr: the variable is unset, an empty plan).
inline Plan ParsePlan(const char* text) {
  Plan plan;
  if (text == nullptr) return plan;
  plan.present = true;
  std::vector<std::string> lines = Split(text, '\n');
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.empty() || lines[0].empty()) return Fail(plan, "the plan names no backend");
  plan.backend = lines[0];
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> fields = Split(lines[i], '|');
    KernelDef def;
    def.op = fields[0];
    if (!IsName(def.op)) return Fail(plan, "line " + std::to_string(i + 1) + ": bad op name '" + def.op + "'");
    for (size_t f = 1; f < fields.size(); ++f) {
      const size_t eq = fields[f].find('=');
      if (eq == std::string::npos) {
        return Fail(plan, "line " + std::to_string(i + 1) + ": field '" + fields[f] + "' has no '='");
      }
      const std::string key = fields[f].substr(0, eq);
      const std::vector<std::string> values = Split(fields[f].substr(eq + 1), ',');
      for (const std::string& v : values) {
        if (!IsName(v)) return Fail(plan, "line " + std::to_string(i + 1) + ": bad value '" + v + "'");
      }
      if (key == "host") {
        def.host_memory = values;
        continue;
      }
      if (!IsName(key)) return Fail(plan, "line " + std::to_string(i + 1) + ": bad attr '" + key + "'");
      for (const std::string& v : values) {
        if (DtypeValue(v) < 0) return Fail(plan, "line " + std::to_string(i + 1) + ": unknown dtype '" + v + "'");
      }
      def.constraints.push_back(Constraint{key, values});
    }
    if (def.constraints.empty()) {
      return Fail(plan, "line " + std::to_string(i + 1) + ": " + def.op + " has no type constraint");
    }
    for (const KernelDef& other : plan.kernels) {
      if (other.op == def.op) return Fail(plan, "line " + std::to_string(i + 1) + ": " + def.op + " twice");
    }
    plan.kernels.push_back(def);
  }
  return plan;
}

// The plan's definition of `op`, or nullptr.
inline const KernelDef* Find(const Plan& plan, const std::string& op) {
  for (const KernelDef& def : plan.kernels) {
    if (def.op == op) return &def;
  }
  return nullptr;
}

// Every combination of `def`'s constraints: one (attr, dtype) per constraint,
// the first constraint varying slowest.
inline std::vector<std::vector<std::pair<std::string, std::string>>> Combinations(const KernelDef& def) {
  std::vector<std::vector<std::pair<std::string, std::string>>> out(1);
  for (const Constraint& c : def.constraints) {
    std::vector<std::vector<std::pair<std::string, std::string>>> next;
    for (const auto& partial : out) {
      for (const std::string& d : c.dtypes) {
        auto combo = partial;
        combo.emplace_back(c.attr, d);
        next.push_back(combo);
      }
    }
    out = next;
  }
  return out;
}

// How status records name one registered (op, planned dtype): "DivNoNan[float16]".
inline std::string RecordName(const std::string& op, const std::string& dtype) { return op + "[" + dtype + "]"; }

}  // namespace gap
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_GAP_PLAN_H_
