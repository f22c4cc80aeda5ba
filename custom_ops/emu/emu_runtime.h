// Interface between the emulated Metal surface (metal_emu.h, compiled with each
// kernel) and the emulator's runtime (runtime.cc: dispatch, threads, barriers).
// No STL here: this header is part of every emulated kernel translation unit,
// where `device`, `thread`, `kernel` ... are macros.
#ifndef TFMETAL_EMU_RUNTIME_H_
#define TFMETAL_EMU_RUNTIME_H_

#include <stddef.h>
#include <stdint.h>

#define TFM_EMU_API extern "C" __attribute__((visibility("default")))

namespace tfm_emu {

// Bump when the extern "C" API or KernelEntry changes (emu.py checks it).
constexpr int kAbiVersion = 1;
constexpr uint32_t kSimdWidth = 32;
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr uint32_t kMaxThreadgroupMemory = 32768;  // bytes, Apple GPUs
constexpr uint32_t kMaxBytesArgument = 4096;       // setBytes:length:atIndex: limit
constexpr uint32_t kSimdSlotBytes = 64;            // largest value a SIMD-group function moves

// How a kernel parameter binds to a dispatch argument.
enum ParamKind : int32_t {
  kParamPointer = 0,    // device T* / constant T* / threadgroup T*
  kParamReference = 1,  // constant T&
};

struct ParamInfo {
  int32_t kind;
  int32_t is_const;   // pointee is const: the kernel cannot write through it
  uint32_t size;      // sizeof(pointee)
  uint32_t align;     // alignof(pointee)
};

// Builtins handed to each emulated thread, in TFM_KERNEL_BUILTINS order:
// gid.xyz, lid.xyz, tgid.xyz, tgsize.xyz, simd_lane, simd_id.
constexpr int kNumBuiltinWords = 14;

typedef void (*Invoker)(void (*fn)(), void* const* args, const uint32_t* builtins);

struct KernelEntry {
  const char* name;    // host name, as in [[host_name("...")]]
  const char* file;    // where TFM_INSTANTIATE_KERNEL was expanded
  int line;
  void (*fn)();        // the kernel, type-erased
  Invoker invoke;
  int nparams;         // parameters before the builtins
  const ParamInfo* params;
};

void register_kernel(const KernelEntry* entry);

// Where a synchronizing call was made, to detect divergent barriers.
struct Site {
  const char* op;
  const char* file;
  int line;
  int column;
};

// All threads of the threadgroup meet here (threadgroup_barrier).
void threadgroup_barrier(const Site& site);

// All active threads of the caller's SIMD-group meet here; each deposits
// `size` bytes of `value`. The result describes the exchange.
struct SimdExchange {
  const unsigned char* slots;  // kSimdWidth slots of kSimdSlotBytes bytes
  uint32_t active;             // bit i: lane i took part
  uint32_t lane;               // the caller's lane
};
SimdExchange simd_exchange(const Site& site, const void* value, uint32_t size);

// Storage shared by the threadgroup for a `threadgroup T name[N];` declared in
// a kernel body (emu.py rewrites those declarations into calls of this).
// Same `tag` in the same threadgroup -> same storage; filled with 0xFF bytes
// (NaN for every floating type) at the start of each threadgroup.
void* threadgroup_variable(const void* tag, size_t size, size_t align);

// The calling emulated thread's linear index in its threadgroup.
uint32_t current_thread_index();

}  // namespace tfm_emu

#endif  // TFMETAL_EMU_RUNTIME_H_
