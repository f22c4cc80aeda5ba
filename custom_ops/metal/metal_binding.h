// metal_binding.h: which Metal backend this process runs, and whether the
// custom ops' GPU kernels can bind to it, decided once when the op library
// loads (before any kernel is registered). Plain C++17 with no Metal or
// Objective-C, so tests/ops/test_metal_host_code.py compiles and runs the
// decision and the status text on Linux; metal_helper.mm gathers the Probe
// on macOS and registers kernels only where Decide() says so.
//
// Why at load: a GPU kernel registered for "GPU" is picked by TF for any GPU
// device. One that then cannot bind to the stream it is handed is a failed
// op, not a fallback; with no GPU kernel registered TF places the op on the
// CPU (its CPU kernel is always registered).
//
// The discriminator never dereferences a guess: an SP_Stream is either
// Apple's Objective-C object (conforming to TF_MetalStream) or the open
// plugin's C++ struct, and nothing in the pointer says which. So the loaded
// images decide: both distributions install their PluggableDevice as
// site-packages/tensorflow-plugins/libmetal_plugin.dylib, TF loads it at
// `import tensorflow` (before this library), and only the open plugin's
// image exports tensorflow::metal::MetalBufferRegistry. The installed
// distributions (TFMETAL_EXT_METAL_PLUGINS, set by tfmetal_ext.ops._loader
// from importlib.metadata) confirm it and give the open plugin's version:
// its stream layout is only vouched for at the release our declaration was
// checked against.
#ifndef TFMETAL_METAL_BINDING_H_
#define TFMETAL_METAL_BINDING_H_

#include <cstring>
#include <string>
#include <vector>

namespace tfmetal_ext {
namespace binding {

constexpr char kApple[] = "tensorflow-metal";
constexpr char kOpenPlugin[] = "tensorflow-metal-plugin";
// The environment variable the loader sets: "name==version" of each installed
// Metal plugin distribution, comma-separated ("" when none is installed).
constexpr char kInstalledEnv[] = "TFMETAL_EXT_METAL_PLUGINS";

// What the load-time probe found.
struct Probe {
  // Loaded images named libmetal_plugin.dylib.
  int plugin_images = 0;
  // Of those, the ones exporting MetalBufferRegistry::Global (the open plugin's).
  int open_plugin_images = 0;
  // That image also exports MetalBufferRegistry::Lookup.
  bool registry_lookup = false;
  // kInstalledEnv's value; nullptr when unset (library loaded by hand).
  const char* installed = nullptr;
};

struct Decision {
  const char* backend = "";  // kApple, kOpenPlugin, or "" (none bound)
  bool gpu = false;          // register the GPU kernels
  std::string reason;        // why not, when !gpu
};

// The version of `name` in an installed list ("a==1,b==2"); false if absent.
inline bool InstalledVersion(const char* installed, const char* name, std::string* version) {
  if (installed == nullptr) return false;
  const std::string list(installed);
  const std::string key = std::string(name) + "==";
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(start, end - start);
    if (item.compare(0, key.size(), key) == 0) {
      if (version != nullptr) *version = item.substr(key.size());
      return true;
    }
    start = end + 1;
  }
  return false;
}

inline Decision NoGpu(const char* backend, std::string reason) {
  Decision d;
  d.backend = backend;
  d.reason = std::move(reason);
  return d;
}

// The decision for `probe`; `verified` is the open plugin release whose
// layout metal_plugin_stream.h declares.
inline Decision Decide(const Probe& probe, const char* verified) {
  const bool known = probe.installed != nullptr;
  std::string open_version;
  const bool apple_installed = InstalledVersion(probe.installed, kApple, nullptr);
  const bool open_installed = InstalledVersion(probe.installed, kOpenPlugin, &open_version);
  if (apple_installed && open_installed) {
    return NoGpu("", "both tensorflow-metal and tensorflow-metal-plugin are installed, and only one Metal "
                     "backend can run; uninstall one of them");
  }
  if (probe.plugin_images == 0) {
    return NoGpu("", "no Metal PluggableDevice (libmetal_plugin.dylib) is loaded in this process");
  }
  if (probe.plugin_images > 1) {
    return NoGpu("", std::to_string(probe.plugin_images) +
                         " Metal PluggableDevice libraries are loaded; the GPU stream's type is ambiguous");
  }
  if (probe.open_plugin_images == 1) {
    if (!probe.registry_lookup) {
      return NoGpu(kOpenPlugin,
                   "tensorflow-metal-plugin's library does not export MetalBufferRegistry::Lookup, so tensor "
                   "addresses cannot be mapped to their MTLBuffers (its device allocations are not whole pages, "
                   "so no page-aligned no-copy wrapper is safe)");
    }
    if (!known) {
      return NoGpu(kOpenPlugin, std::string("the installed tensorflow-metal-plugin's version is unknown (") +
                                    kInstalledEnv + " is unset: load the op library through tfmetal_ext.ops), so "
                                    "its stream layout cannot be vouched for");
    }
    if (!open_installed) {
      return NoGpu(kOpenPlugin, "the loaded libmetal_plugin.dylib is tensorflow-metal-plugin's, but that "
                                "distribution is not installed (a stale file in tensorflow-plugins/?)");
    }
    if (open_version != verified) {
      return NoGpu(kOpenPlugin, "tensorflow-metal-plugin " + open_version + " is installed; tfmetal_ext's "
                                "declaration of its stream (SP_Stream_st) is verified against " + verified +
                                " only");
    }
    Decision d;
    d.backend = kOpenPlugin;
    d.gpu = true;
    return d;
  }
  // A libmetal_plugin.dylib without the open plugin's registry: Apple's.
  if (known && open_installed) {
    return NoGpu(kOpenPlugin, "tensorflow-metal-plugin is installed but its loaded library exports none of the "
                              "symbols the binding needs (built with hidden symbols?)");
  }
  if (known && !apple_installed) {
    return NoGpu("", "a libmetal_plugin.dylib is loaded but no Metal plugin distribution is installed");
  }
  Decision d;
  d.backend = kApple;
  d.gpu = true;
  return d;
}

// One op's registration, as status() reports it.
struct OpRecord {
  std::string op;        // "TfmetalExt>LayerNorm"
  bool gpu = false;      // a GPU kernel is registered
  std::string backend;   // the Metal backend it is bound to / was refused on
  std::string reason;    // why not, when !gpu
};

// The text tfmetal_ext.ops reads (TfmetalExt_MetalKernelStatus): one line
// per op, "<op>\t<1|0>\t<backend>\t<reason>"; tabs and newlines in the
// reason become spaces.
inline std::string FormatRecords(const std::vector<OpRecord>& records) {
  std::string out;
  for (const OpRecord& r : records) {
    std::string reason = r.reason;
    for (char& c : reason) {
      if (c == '\t' || c == '\n' || c == '\r') c = ' ';
    }
    out += r.op + "\t" + (r.gpu ? "1" : "0") + "\t" + r.backend + "\t" + reason + "\n";
  }
  return out;
}

}  // namespace binding
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_BINDING_H_
