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
//   <op>|<attr>=<dtype>,<dtype>|<attr>=<dtype>,...|string:<attr>=<value>,<value>|host=<arg>,<arg>
// The first attr is the one the plan decided on (its dtypes are the
// registered ones); every combination of the attrs' dtypes is registered.
// Dtype names as Python spells them (float32, float16, bfloat16, bool,
// int32, int64). A `string:<attr>` field restricts a string attribute to the
// values listed (Einsum's equation): each registration carries it as an
// allowed-values constraint, so TensorFlow matches the kernel only to nodes
// with one of them and places every other node where a kernel for it exists
// (the CPU). Values are percent-escaped (every byte outside [A-Za-z0-9_] as
// %XX, so ',' '|' '=' and newlines never appear raw).
//
// Registration hands TensorFlow a serialized KernelDef
// (TF_RegisterKernelBuilderWithKernelDef: the C API's builder has no way to
// constrain a string attribute). SerializeKernelDef writes the protobuf wire
// format of tensorflow.KernelDef (tensorflow/core/framework/kernel_def.proto,
// attr_value.proto) by hand: TensorFlow reads it as a C string, so it must
// hold no zero byte, and it never does for the definitions this header
// builds (no empty field, no zero number).
#ifndef TFMETAL_METAL_GAP_PLAN_H_
#define TFMETAL_METAL_GAP_PLAN_H_

#include <cstdint>
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

// A string attribute restricted to `values` (e.g. Einsum's "equation").
struct StringConstraint {
  std::string attr;
  std::vector<std::string> values;  // unescaped
};

struct KernelDef {
  std::string op;                        // "DivNoNan"
  std::vector<Constraint> constraints;   // first: the planned attr
  std::vector<StringConstraint> strings;  // string attributes' allowed values
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
  if (name == "int8") return 6;      // TF_INT8
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

// `text` with each %XX replaced by its byte; false for a malformed escape,
// a raw byte outside [A-Za-z0-9_], a zero byte or an empty result.
inline bool Unescape(const std::string& text, std::string* out) {
  out->clear();
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '%') {
      if (i + 2 >= text.size()) return false;
      const int hi = hex(text[i + 1]), lo = hex(text[i + 2]);
      if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) return false;
      out->push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
      continue;
    }
    if (!IsName(std::string(1, c))) return false;
    out->push_back(c);
  }
  return !out->empty();
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
      if (key.rfind("string:", 0) == 0) {
        StringConstraint sc{key.substr(7), {}};
        if (!IsName(sc.attr)) return Fail(plan, "line " + std::to_string(i + 1) + ": bad attr '" + key + "'");
        for (const std::string& v : values) {
          std::string value;
          if (!Unescape(v, &value)) {
            return Fail(plan, "line " + std::to_string(i + 1) + ": bad escaped value '" + v + "'");
          }
          sc.values.push_back(value);
        }
        def.strings.push_back(sc);
        continue;
      }
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

// ---------------------------------------------------------------------------
// tensorflow.KernelDef in protobuf wire format.

namespace wire {
inline void Varint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}
// Field `field` of wire type 2 (length-delimited: string, bytes, message, packed).
inline void Bytes(int field, const std::string& value, std::string* out) {
  Varint(static_cast<uint64_t>(field) << 3 | 2, out);
  Varint(value.size(), out);
  *out += value;
}
// Field `field` of wire type 0 (varint).
inline void Number(int field, uint64_t value, std::string* out) {
  Varint(static_cast<uint64_t>(field) << 3, out);
  Varint(value, out);
}
}  // namespace wire

// The serialized KernelDef of one registration of `def` on `device`: one
// type constraint per (attr, dtype) of `combo` (an entry of Combinations),
// every string constraint of `def`, its host-memory arguments, `priority`
// (0: TensorFlow's default; only tests set another). "" when an argument
// would put a zero byte in it (an empty name or value, an unknown dtype).
//
//   KernelDef      { string op = 1; string device_type = 2;
//                    repeated AttrConstraint constraint = 3;
//                    repeated string host_memory_arg = 4; int32 priority = 6; }
//   AttrConstraint { string name = 1; AttrValue allowed_values = 2; }
//   AttrValue      { ListValue list = 1; ... }
//   ListValue      { repeated bytes s = 2; repeated DataType type = 6 [packed]; }
inline std::string SerializeKernelDef(const KernelDef& def, const std::string& device,
                                      const std::vector<std::pair<std::string, std::string>>& combo,
                                      int priority = 0) {
  std::string out;
  if (def.op.empty() || device.empty() || priority < 0) return "";
  wire::Bytes(1, def.op, &out);
  wire::Bytes(2, device, &out);
  for (const auto& [attr, dtype] : combo) {
    const int value = DtypeValue(dtype);
    if (attr.empty() || value <= 0) return "";
    std::string packed, list, allowed, constraint;
    wire::Varint(static_cast<uint64_t>(value), &packed);
    wire::Bytes(6, packed, &list);
    wire::Bytes(1, list, &allowed);
    wire::Bytes(1, attr, &constraint);
    wire::Bytes(2, allowed, &constraint);
    wire::Bytes(3, constraint, &out);
  }
  for (const StringConstraint& sc : def.strings) {
    if (sc.attr.empty() || sc.values.empty()) return "";
    std::string list, allowed, constraint;
    for (const std::string& v : sc.values) {
      if (v.empty()) return "";
      wire::Bytes(2, v, &list);
    }
    wire::Bytes(1, list, &allowed);
    wire::Bytes(1, sc.attr, &constraint);
    wire::Bytes(2, allowed, &constraint);
    wire::Bytes(3, constraint, &out);
  }
  for (const std::string& arg : def.host_memory) {
    if (arg.empty()) return "";
    wire::Bytes(4, arg, &out);
  }
  if (priority > 0) wire::Number(6, static_cast<uint64_t>(priority), &out);
  if (out.find('\0') != std::string::npos) return "";  // TensorFlow would read a truncated definition
  return out;
}

// How status records name one registered (op, planned dtype): "DivNoNan[float16]".
inline std::string RecordName(const std::string& op, const std::string& dtype) { return op + "[" + dtype + "]"; }

}  // namespace gap
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_GAP_PLAN_H_
