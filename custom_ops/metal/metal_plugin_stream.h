// metal_plugin_stream.h: what tfmetal_ext's Metal host code relies on in the
// open tensorflow-metal-plugin (PyPI; Apache-2.0), declared here from facts
// read in its sdist (src/tensorflow/core/common_runtime/metal/metal_stream.h,
// metal_stream.mm, metal_buffer_registry.h, kernels/metal_kernel_util.mm).
// None of its code is in this project: this is our own declaration of the
// layout and the protocol, for the release that backends/metal_plugin.py
// pins (TFMETAL_EXT_OPEN_PLUGIN_VERIFIED, defined by the op loader from PIN).
//
// Plain C++17 (no Objective-C types: the plugin's `id<...>` members are
// declared as the object pointers they are), so the same header serves the
// ARC host code and the Linux tests:
// - tests/ops/test_metal_host_code.py compiles a translation unit that
//   static_asserts every offset, the size and the alignment of StreamLayout
//   against the plugin's real SP_Stream_st (its headers, stub Metal), and
//   checks the symbol names below against what clang mangles for the
//   plugin's own declarations;
// - the same test runs Submission (below) from many threads and checks the
//   sequence numbers are committed in the order they were handed out.
//
// What the plugin does (0.4.1):
// - TF_GetStream() returns its `SP_Stream_st*` (new'd C++ struct): an
//   MTLCommandQueue and an MTLSharedEvent used as a sequence counter;
// - each command buffer takes the next number under the stream's `mu`
//   (last_enqueued + 1), encodes encodeWaitForEvent:order_event
//   value:(number - 1) (skipped for 0, the event's initial value), its work,
//   encodeSignalEvent:order_event value:number, and is committed. The
//   `submit` mutex is held from taking the number until the commit, so commit
//   order equals number order (otherwise a buffer committed first could wait
//   forever for a number only a buffer behind it signals);
// - a command buffer that cannot be created gives its number back
//   (last_enqueued = number - 1 if still equal); one that fails to encode is
//   still signalled and committed, empty, so the stream never stalls;
// - failures are sticky on the stream (`failed`, `failure_message` under mu);
// - device tensors are MTLResourceStorageModeShared buffers: TF_TensorData()
//   is their host-visible `contents` (plus the BFC allocator's offset), and
//   MetalBufferRegistry::Lookup(address, &buffer, &offset) maps it back.
//   Device allocations are newBufferWithLength:max(size, 1), NOT rounded to
//   whole pages (only host allocations are, with posix_memalign), so a
//   page-aligned newBufferWithBytesNoCopy wrapper around a tensor near a
//   buffer's end would cover memory the plugin never allocated: without the
//   registry we register no GPU kernel rather than guess;
// - the plugin is built without -fvisibility=hidden or an export list, so
//   its C++ functions are exported by their mangled names; TF loads it with
//   RTLD_LOCAL, so they are found with dlsym on a handle to its image.
// - both the plugin and this op library take absl from TF's headers and
//   libtensorflow_framework (absl::Mutex is exported there), so locking its
//   mutexes here runs the same absl code on the same objects.
#ifndef TFMETAL_METAL_PLUGIN_STREAM_H_
#define TFMETAL_METAL_PLUGIN_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/synchronization/mutex.h"

namespace tfmetal_ext {
namespace open_plugin {

// tensorflow-metal-plugin's `struct SP_Stream_st`, field for field. Never
// constructed, copied or destroyed here: only reached through the SP_Stream
// that TF_GetStream() returns when the open plugin is the loaded backend.
struct StreamLayout {
  void* queue;        // id<MTLCommandQueue> (owned by the plugin)
  void* order_event;  // id<MTLSharedEvent>: the sequence counter
  absl::Mutex submit;  // held from taking a number until the commit
  absl::Mutex mu;      // guards the three fields below
  uint64_t last_enqueued;
  bool failed;
  std::string failure_message;

  StreamLayout() = delete;
  StreamLayout(const StreamLayout&) = delete;
  StreamLayout& operator=(const StreamLayout&) = delete;
};

// The plugin's exported functions this code calls, by their Itanium-mangled
// names (dlsym spells them without Mach-O's leading underscore):
//   tensorflow::metal::MetalBufferRegistry::Global()
constexpr char kRegistryGlobalSymbol[] = "_ZN10tensorflow5metal19MetalBufferRegistry6GlobalEv";
//   bool tensorflow::metal::MetalBufferRegistry::Lookup(const void*, id<MTLBuffer>*, size_t*) const
constexpr char kRegistryLookupSymbol[] =
    "_ZNK10tensorflow5metal19MetalBufferRegistry6LookupEPKvPPU19objcproto9MTLBuffer11objc_objectPm";
//   bool tensorflow::metal::SynchronousMode()
constexpr char kSynchronousModeSymbol[] = "_ZN10tensorflow5metal15SynchronousModeEv";
//   void tensorflow::metal::NoteCommandBufferCompletion(SP_Stream, id<MTLCommandBuffer>)
constexpr char kNoteCompletionSymbol[] =
    "_ZN10tensorflow5metal27NoteCommandBufferCompletionEP12SP_Stream_stPU27objcproto16MTLCommandBuffer11objc_object";

// Their C-level signatures. A non-virtual member function takes `this` as
// its first argument in the Itanium C++ ABI (arm64 included), and a
// reference is returned as a pointer.
using RegistryGlobalFn = void* (*)();
using RegistryLookupFn = bool (*)(const void* registry, const void* address, void** buffer, size_t* offset);
using SynchronousModeFn = bool (*)();
using NoteCompletionFn = void (*)(void* stream, void* command_buffer);

// The plugin's rule for whether a kernel waits for the GPU before returning
// (SynchronousMode in kernels/metal_kernel_util.mm), for when its own
// function cannot be found: TF_METAL_SYNCHRONOUS when set and non-empty
// ("0" = no), else yes exactly when TF does not export the resource-variable
// kernel C API (TF 2.20 and 2.21), because TF's host kernels then update
// variables in device memory from the host while GPU work may be in flight.
inline bool SynchronousModeRule(const char* tf_metal_synchronous, bool variable_api_exported) {
  if (tf_metal_synchronous != nullptr && tf_metal_synchronous[0] != '\0') {
    return !(tf_metal_synchronous[0] == '0' && tf_metal_synchronous[1] == '\0');
  }
  return !variable_api_exported;
}

// One command buffer's place in the stream's sequence, taken the way the
// plugin takes it (see the top of the file). Construct it right before
// creating the command buffer; then either Cancel() (no command buffer) or
// encode the wait for wait_value() (when > 0), the work and the signal of
// signal_value(), commit, and Release(). The destructor releases the
// submission lock if neither was called (never leaves the stream locked).
class Submission {
 public:
  explicit Submission(StreamLayout* stream) : stream_(stream) {
    stream_->submit.Lock();
    held_ = true;
    absl::MutexLock lock(&stream_->mu);
    wait_value_ = stream_->last_enqueued;
    signal_value_ = wait_value_ + 1;
    stream_->last_enqueued = signal_value_;
  }
  ~Submission() { Release(); }

  Submission(const Submission&) = delete;
  Submission& operator=(const Submission&) = delete;

  // The number to wait for (0: nothing to wait for) and the one to signal.
  uint64_t wait_value() const { return wait_value_; }
  uint64_t signal_value() const { return signal_value_; }

  // No command buffer was made: give the number back, as the plugin does.
  void Cancel() {
    {
      absl::MutexLock lock(&stream_->mu);
      if (stream_->last_enqueued == signal_value_) stream_->last_enqueued = wait_value_;
    }
    Release();
  }

  // After the commit.
  void Release() {
    if (!held_) return;
    held_ = false;
    stream_->submit.Unlock();
  }

 private:
  StreamLayout* stream_;
  uint64_t wait_value_ = 0;
  uint64_t signal_value_ = 0;
  bool held_ = false;
};

// The stream's sticky failure, as the plugin reports it; false if none.
inline bool StreamFailed(StreamLayout* stream, std::string* message) {
  absl::MutexLock lock(&stream->mu);
  if (stream->failed && message != nullptr) *message = stream->failure_message;
  return stream->failed;
}

// Records a failed command buffer of ours on the stream (the first failure
// is kept), for when the plugin's NoteCommandBufferCompletion is not found.
inline void NoteFailure(StreamLayout* stream, const std::string& message) {
  absl::MutexLock lock(&stream->mu);
  if (stream->failed) return;
  stream->failed = true;
  stream->failure_message = message;
}

}  // namespace open_plugin
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_PLUGIN_STREAM_H_
