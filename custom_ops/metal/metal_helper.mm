// metal_helper.mm: see metal_helper.h. Objective-C++ with ARC, macOS only.
#include "metal/metal_helper.h"

#include <dlfcn.h>
#include <mach-o/dyld.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#ifndef TFMETAL_EXT_OPEN_PLUGIN_VERIFIED
#error "TFMETAL_EXT_OPEN_PLUGIN_VERIFIED (the tensorflow-metal-plugin release metal_plugin_stream.h is checked against) is defined by tfmetal_ext.ops._loader from backends/metal_plugin.py's PIN"
#endif

namespace tfmetal_ext {
namespace {

std::string Describe(NSError* error) {
  if (error == nil) return "unknown Metal error";
  NSString* description = error.localizedDescription;
  const char* text = description != nil ? description.UTF8String : nullptr;
  return text != nullptr ? std::string(text) : std::string("unknown Metal error");
}

NSUInteger RoundUp(NSUInteger value, NSUInteger multiple) {
  return multiple == 0 ? value : (value + multiple - 1) / multiple * multiple;
}

// Directory of the loaded binary that contains this code (the op library).
std::string ThisLibraryDirectory() {
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&ThisLibraryDirectory), &info) == 0 || info.dli_fname == nullptr) {
    return std::string();
  }
  std::string path(info.dli_fname);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// <dir>/<name>.metallib if it exists, from $TFMETAL_EXT_METALLIB_DIR or next
// to the op library; empty otherwise.
std::string PrecompiledLibraryPath(const char* name) {
  const char* env = std::getenv("TFMETAL_EXT_METALLIB_DIR");
  const std::string dirs[] = {env != nullptr ? std::string(env) : std::string(), ThisLibraryDirectory()};
  for (const std::string& dir : dirs) {
    if (dir.empty()) continue;
    const std::string path = dir + "/" + name + ".metallib";
    if (access(path.c_str(), R_OK) == 0) return path;
  }
  return std::string();
}

MTLCompileOptions* CompileOptions() {
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  // IEEE floating point (NaN and Inf honoured, no reassociation): the Metal
  // kernels must give what the CPU kernels and the emulator give. Fast math
  // (the default) may fold isnan() to false and reorder sums.
#if defined(__MAC_15_0)
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    return options;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
  options.fastMathEnabled = NO;
#pragma clang diagnostic pop
  return options;
}

bool SyncRequested() {
  const char* env = std::getenv("TFMETAL_EXT_METAL_SYNC");
  return env != nullptr && env[0] != '\0' && std::strcmp(env, "0") != 0;
}

// ---------------------------------------------------------------------------
// The backend binding (metal_binding.h, metal_plugin_stream.h)

// The open plugin's functions, found in its image when it is the loaded backend.
struct OpenPluginApi {
  const void* registry = nullptr;  // MetalBufferRegistry::Global()
  open_plugin::RegistryLookupFn lookup = nullptr;
  open_plugin::SynchronousModeFn synchronous_mode = nullptr;  // optional
  open_plugin::NoteCompletionFn note_completion = nullptr;    // optional
};

struct BindingState {
  binding::Decision decision;
  OpenPluginApi open;
  bool synchronous = false;  // the open plugin's kernels wait for the GPU
};

bool EndsWith(const char* s, const char* suffix) {
  const size_t n = std::strlen(s), m = std::strlen(suffix);
  return n >= m && std::strcmp(s + n - m, suffix) == 0;
}

// Looks at the loaded images (never at a stream): see metal_binding.h.
BindingState ProbeBinding() {
  BindingState state;
  binding::Probe probe;
  open_plugin::RegistryGlobalFn global = nullptr;
  const uint32_t count = _dyld_image_count();
  for (uint32_t i = 0; i < count; ++i) {
    const char* name = _dyld_get_image_name(i);
    if (name == nullptr || !EndsWith(name, "/libmetal_plugin.dylib")) continue;
    ++probe.plugin_images;
    // TF loads PluggableDevices with RTLD_LOCAL: their symbols are only found
    // through a handle to their image (already loaded: RTLD_NOLOAD).
    void* handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    void* found = dlsym(handle, open_plugin::kRegistryGlobalSymbol);
    if (found == nullptr) continue;
    ++probe.open_plugin_images;
    global = reinterpret_cast<open_plugin::RegistryGlobalFn>(found);
    state.open.lookup =
        reinterpret_cast<open_plugin::RegistryLookupFn>(dlsym(handle, open_plugin::kRegistryLookupSymbol));
    state.open.synchronous_mode =
        reinterpret_cast<open_plugin::SynchronousModeFn>(dlsym(handle, open_plugin::kSynchronousModeSymbol));
    state.open.note_completion =
        reinterpret_cast<open_plugin::NoteCompletionFn>(dlsym(handle, open_plugin::kNoteCompletionSymbol));
    probe.registry_lookup = state.open.lookup != nullptr;
  }
  probe.installed = std::getenv(binding::kInstalledEnv);
  state.decision = binding::Decide(probe, TFMETAL_EXT_OPEN_PLUGIN_VERIFIED);
  if (state.decision.gpu && std::strcmp(state.decision.backend, binding::kOpenPlugin) == 0) {
    state.open.registry = global();
    if (state.open.synchronous_mode != nullptr) {
      state.synchronous = state.open.synchronous_mode();
    } else {
      const bool variable_api = dlsym(RTLD_DEFAULT, "TF_GetInputTensorFromVariable") != nullptr &&
                                dlsym(RTLD_DEFAULT, "TF_MaybeLockVariableInputMutexesInOrder") != nullptr;
      state.synchronous = open_plugin::SynchronousModeRule(std::getenv("TF_METAL_SYNCHRONOUS"), variable_api);
    }
  }
  return state;
}

const BindingState& GetBindingState() {
  static const BindingState* state = new BindingState(ProbeBinding());  // never destroyed
  return *state;
}

bool IsOpenPlugin(const BindingState& s) {
  return s.decision.gpu && std::strcmp(s.decision.backend, binding::kOpenPlugin) == 0;
}

// What registration recorded per op, for TfmetalExt_MetalKernelStatus().
struct Records {
  std::mutex mutex;
  std::vector<binding::OpRecord> ops;
  std::string text;
};

Records& GetRecords() {
  static Records* records = new Records();
  return *records;
}

void Record(const char* op, bool gpu, const std::string& reason) {
  Records& r = GetRecords();
  std::lock_guard<std::mutex> lock(r.mutex);
  binding::OpRecord record;
  record.op = op;
  record.gpu = gpu;
  record.backend = Binding().backend;
  record.reason = reason;
  r.ops.push_back(record);
}

}  // namespace

const binding::Decision& Binding() { return GetBindingState().decision; }

void SetStatus(TF_Status* status, TF_Code code, const std::string& message) {
  TF_SetStatus(status, code, ("tfmetal_ext: " + message).c_str());
}

void SetStatusFromNSError(TF_Status* status, NSError* error, const std::string& what) {
  SetStatus(status, TF_INTERNAL, what + ": " + Describe(error));
}

const char* DtypeName(TF_DataType dtype) {
  switch (dtype) {
    case TF_FLOAT: return "float";
    case TF_DOUBLE: return "double";
    case TF_INT32: return "int32";
    case TF_UINT8: return "uint8";
    case TF_INT16: return "int16";
    case TF_INT8: return "int8";
    case TF_STRING: return "string";
    case TF_COMPLEX64: return "complex64";
    case TF_INT64: return "int64";
    case TF_BOOL: return "bool";
    case TF_QINT8: return "qint8";
    case TF_QUINT8: return "quint8";
    case TF_QINT32: return "qint32";
    case TF_BFLOAT16: return "bfloat16";
    case TF_QINT16: return "qint16";
    case TF_QUINT16: return "quint16";
    case TF_UINT16: return "uint16";
    case TF_COMPLEX128: return "complex128";
    case TF_HALF: return "half";
    case TF_RESOURCE: return "resource";
    case TF_VARIANT: return "variant";
    case TF_UINT32: return "uint32";
    case TF_UINT64: return "uint64";
    case TF_FLOAT8_E5M2: return "float8_e5m2";
    case TF_FLOAT8_E4M3FN: return "float8_e4m3fn";
    case TF_FLOAT8_E4M3FNUZ: return "float8_e4m3fnuz";
    case TF_FLOAT8_E4M3B11FNUZ: return "float8_e4m3b11fnuz";
    case TF_FLOAT8_E5M2FNUZ: return "float8_e5m2fnuz";
    case TF_INT4: return "int4";
    case TF_UINT4: return "uint4";
    default: return "unknown";  // a dtype newer than these headers
  }
}

std::string KernelName(const char* op, const char* variant, TF_DataType dtype, TF_Status* status) {
  const std::string base = variant[0] == '\0' ? std::string(op) : std::string(op) + "_" + variant;
  const char* suffix = KernelSuffix(dtype);
  if (suffix == nullptr) {
    SetStatus(status, TF_INVALID_ARGUMENT,
              base + ": unsupported dtype " + DtypeName(dtype) + " (float, half or bfloat16)");
    return std::string();
  }
  return base + "_" + suffix;
}

std::string StringAttr(TF_OpKernelConstruction* ctx, const char* attr, TF_Status* status) {
  int32_t list_size = 0, total_size = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, attr, &list_size, &total_size, status);
  if (!Ok(status)) return "";
  if (total_size < 0) total_size = 0;
  std::vector<char> buffer(static_cast<size_t>(total_size) + 1, '\0');
  TF_OpKernelConstruction_GetAttrString(ctx, attr, buffer.data(), static_cast<size_t>(total_size), status);
  if (!Ok(status)) return "";
  return std::string(buffer.data(), static_cast<size_t>(total_size));
}

bool CheckSameShape(const TF_Tensor* a, const char* a_name, const TF_Tensor* b, const char* b_name,
                    TF_Status* status) {
  const std::vector<int64_t> a_dims = Dims(a);
  const std::vector<int64_t> b_dims = Dims(b);
  const std::string error = SameShapeError(a_name, a_dims.data(), static_cast<int>(a_dims.size()), b_name,
                                           b_dims.data(), static_cast<int>(b_dims.size()));  // tfmetal/host_checks.h
  if (error.empty()) return true;
  SetStatus(status, TF_INVALID_ARGUMENT, error);
  return false;
}

TensorPtr Output(TF_OpKernelContext* ctx, int index, TF_DataType dtype, const std::vector<int64_t>& dims,
                 TF_Status* status) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  return TensorPtr(TF_AllocateOutput(ctx, index, dtype, dims.data(), static_cast<int>(dims.size()),
                                     static_cast<size_t>(count) * TF_DataTypeSize(dtype), status));
}

TensorPtr ForwardInputOrAllocateOutput(TF_OpKernelContext* ctx, int input, int output,
                                       const std::vector<int64_t>& dims, TF_Status* status) {
  const int candidates[] = {input};
  int forwarded = -1;
  return TensorPtr(TF_ForwardInputOrAllocateOutput(ctx, candidates, 1, output, dims.data(),
                                                   static_cast<int>(dims.size()), &forwarded, status));
}

// ---------------------------------------------------------------------------
// Registration

void RegisterFloatKernels(const char* op, void* (*create)(TF_OpKernelConstruction*),
                          void (*compute)(void*, TF_OpKernelContext*), void (*destroy)(void*)) {
  const binding::Decision& decision = Binding();
  if (!decision.gpu) {
    Record(op, false, decision.reason);
    return;
  }
  const TF_DataType dtypes[] = {TF_FLOAT, TF_HALF, TF_BFLOAT16};
  StatusPtr status(TF_NewStatus());
  std::string failed;
  int registered = 0;
  for (TF_DataType dtype : dtypes) {
    TF_SetStatus(status.get(), TF_OK, "");
    TF_KernelBuilder* builder = TF_NewKernelBuilder(op, "GPU", create, compute, destroy);
    TF_KernelBuilder_TypeConstraint(builder, "T", dtype, status.get());
    if (!Ok(status.get())) {
      TF_DeleteKernelBuilder(builder);  // not registered: still ours
      failed += std::string(failed.empty() ? "" : ", ") + DtypeName(dtype) + ": " + TF_Message(status.get());
      continue;
    }
    TF_RegisterKernelBuilder((std::string(op) + "_GPU_" + KernelSuffix(dtype)).c_str(), builder, status.get());
    if (Ok(status.get())) {
      ++registered;
    } else {
      failed += std::string(failed.empty() ? "" : ", ") + DtypeName(dtype) + ": " + TF_Message(status.get());
    }
  }
  Record(op, registered > 0, failed.empty() ? std::string() : "GPU kernel registration failed for " + failed);
}

void RecordNotRegistered(const char* op, const std::string& reason) { Record(op, false, reason); }

namespace {

const gap::Plan& GapPlan() {
  static const gap::Plan* plan = new gap::Plan(gap::ParsePlan(std::getenv(gap::kPlanEnv)));  // never destroyed
  return *plan;
}

}  // namespace

void RegisterGapKernels(const char* op, void* (*create)(TF_OpKernelConstruction*),
                        void (*compute)(void*, TF_OpKernelContext*), void (*destroy)(void*)) {
  const gap::Plan& plan = GapPlan();
  const gap::KernelDef* def = gap::Find(plan, op);
  if (def == nullptr) return;  // not planned here: Python's rows say why
  const binding::Decision& decision = Binding();
  std::string refused;
  if (!plan.error.empty()) {
    refused = std::string("malformed ") + gap::kPlanEnv + ": " + plan.error;
  } else if (!decision.gpu) {
    refused = decision.reason;
  } else if (plan.backend != decision.backend) {
    refused = "the plan was made for " + plan.backend + " but this process runs " + decision.backend;
  }
  const gap::Constraint& planned = def->constraints.front();
  if (!refused.empty()) {
    for (const std::string& dtype : planned.dtypes) Record(gap::RecordName(op, dtype).c_str(), false, refused);
    return;
  }
  StatusPtr status(TF_NewStatus());
  for (const std::string& dtype : planned.dtypes) {
    std::string failed;
    int registered = 0;
    for (const auto& combo : gap::Combinations(*def)) {
      if (combo.front().second != dtype) continue;
      TF_SetStatus(status.get(), TF_OK, "");
      TF_KernelBuilder* builder = TF_NewKernelBuilder(op, "GPU", create, compute, destroy);
      std::string name = std::string(op) + "_GPU_tfmetal_ext";
      for (const auto& [attr, value] : combo) name += "_" + value;
      // A string constraint (Einsum's equations) has no builder call: then the
      // whole KernelDef goes to TensorFlow serialized (type and string
      // constraints, host memory), and the builder only carries the functions.
      const std::string kernel_def = def->strings.empty() ? std::string() : gap::SerializeKernelDef(*def, "GPU", combo);
      // Looked up, not linked: a TensorFlow without it then loses only these kernels, not the whole library.
      using RegisterWithKernelDef = void (*)(const char*, const char*, TF_KernelBuilder*, TF_Status*);
      static const auto register_with_kernel_def =
          reinterpret_cast<RegisterWithKernelDef>(dlsym(RTLD_DEFAULT, "TF_RegisterKernelBuilderWithKernelDef"));
      if (def->strings.empty()) {
        for (const auto& [attr, value] : combo) {
          if (Ok(status.get())) {
            TF_KernelBuilder_TypeConstraint(builder, attr.c_str(), static_cast<TF_DataType>(gap::DtypeValue(value)),
                                            status.get());
          }
        }
        for (const std::string& arg : def->host_memory) {
          if (Ok(status.get())) TF_KernelBuilder_HostMemory(builder, arg.c_str());
        }
      } else if (register_with_kernel_def == nullptr) {
        TF_SetStatus(status.get(), TF_UNIMPLEMENTED,
                     "this TensorFlow does not export TF_RegisterKernelBuilderWithKernelDef, which a string "
                     "constraint needs");
      } else if (kernel_def.empty()) {
        TF_SetStatus(status.get(), TF_INVALID_ARGUMENT, "the planned KernelDef cannot be serialized");
      }
      if (!Ok(status.get())) {
        TF_DeleteKernelBuilder(builder);  // not registered: still ours
        failed += std::string(failed.empty() ? "" : "; ") + name + ": " + TF_Message(status.get());
        continue;
      }
      if (def->strings.empty()) {
        TF_RegisterKernelBuilder(name.c_str(), builder, status.get());
      } else {
        register_with_kernel_def(kernel_def.c_str(), name.c_str(), builder, status.get());
      }
      if (Ok(status.get())) {
        ++registered;
      } else {
        failed += std::string(failed.empty() ? "" : "; ") + name + ": " + TF_Message(status.get());
      }
    }
    Record(gap::RecordName(op, dtype).c_str(), registered > 0 && failed.empty(),
           failed.empty() ? std::string() : "GPU kernel registration failed: " + failed);
  }
}

id<MTLDevice> MetalStream::Device() const {
  return open != nullptr ? ((__bridge id<MTLCommandQueue>)open->queue).device : nil;
}

MetalStream GetMetalStream(TF_OpKernelContext* ctx, TF_Status* status) {
  MetalStream stream;
  SP_Stream handle = TF_GetStream(ctx, status);
  if (TF_GetCode(status) != TF_OK) return stream;
  if (handle == nullptr) {
    SetStatus(status, TF_INTERNAL, "the op has no Metal stream (is a Metal PluggableDevice loaded?)");
    return stream;
  }
  const BindingState& state = GetBindingState();
  if (!state.decision.gpu) {  // unreachable: no GPU kernel is registered then
    SetStatus(status, TF_INTERNAL, "no Metal backend is bound: " + state.decision.reason);
    return stream;
  }
  if (IsOpenPlugin(state)) {
    // The backend is known (decided at load), so the handle is its C++
    // struct, laid out as metal_plugin_stream.h declares (checked in tests).
    auto* layout = reinterpret_cast<open_plugin::StreamLayout*>(handle);
    id queue = (__bridge id)layout->queue;
    id event = (__bridge id)layout->order_event;
    if (queue == nil || event == nil || ![queue respondsToSelector:@selector(commandBuffer)] ||
        ![event respondsToSelector:@selector(signaledValue)]) {
      SetStatus(status, TF_INTERNAL, "tensorflow-metal-plugin's stream has no command queue and order event");
      return stream;
    }
    stream.open = layout;
    return stream;
  }
  // Apple's: an Objective-C object (the loaded backend says so); make sure it
  // answers the protocol before using it.
  id object = (__bridge id)static_cast<void*>(handle);
  if (![object respondsToSelector:@selector(queue)] || ![object respondsToSelector:@selector(currentCommandBuffer)] ||
      ![object respondsToSelector:@selector(commit)] || ![object respondsToSelector:@selector(commitAndWait)]) {
    SetStatus(status, TF_INTERNAL, "tensorflow-metal's stream does not answer the TF_MetalStream protocol");
    return stream;
  }
  stream.apple = (id<TF_MetalStream>)object;
  return stream;
}

bool Resolve(const TF_Tensor* tensor, const char* name, MetalSlice* slice, TF_Status* status) {
  return ResolveData(TF_TensorData(tensor), TF_TensorByteSize(tensor), name, slice, status);
}

bool ResolveData(const void* const_data, size_t bytes, const char* name, MetalSlice* slice, TF_Status* status) {
  *slice = MetalSlice();
  void* data = const_cast<void*>(const_data);
  const bool empty = bytes == 0;
  const BindingState& state = GetBindingState();
  if (!IsOpenPlugin(state)) {
    slice->buffer = (__bridge id<MTLBuffer>)data;  // Apple's: the tensor's data is its MTLBuffer
    if (slice->buffer == nil && !empty) {
      SetStatus(status, TF_INTERNAL, std::string(name) + " has no Metal buffer");
      return false;
    }
    return true;
  }
  void* buffer = nullptr;
  size_t offset = 0;
  if (data == nullptr || !state.open.lookup(state.open.registry, data, &buffer, &offset) || buffer == nullptr) {
    if (empty) return true;
    SetStatus(status, TF_INTERNAL,
              std::string(name) + " is not in tensorflow-metal-plugin's device memory (no Metal allocation holds it)");
    return false;
  }
  slice->buffer = (__bridge id<MTLBuffer>)buffer;  // not retained by the registry; the tensor keeps it alive
  slice->offset = static_cast<NSUInteger>(offset);
  return true;
}

// ---------------------------------------------------------------------------
// PipelineCache

namespace {

struct CacheState {
  std::mutex mutex;
  std::unordered_map<std::string, id<MTLLibrary>> libraries;              // "<device id>/<library name>"
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;  // "<device id>/<kernel name>"
  int compiled_from_source = 0;
  int loaded_from_metallib = 0;
};

CacheState& GetCacheState() {
  static CacheState* state = new CacheState();  // never destroyed: used until process exit
  return *state;
}

}  // namespace

PipelineCache& PipelineCache::Global() {
  static PipelineCache* cache = new PipelineCache();
  return *cache;
}

int PipelineCache::compiled_from_source() {
  CacheState& s = GetCacheState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.compiled_from_source;
}

int PipelineCache::loaded_from_metallib() {
  CacheState& s = GetCacheState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.loaded_from_metallib;
}

id<MTLComputePipelineState> PipelineCache::Pipeline(id<MTLDevice> device, const MetalLibrarySource& library,
                                                     const char* kernel_name, TF_Status* status) {
  if (device == nil) {
    SetStatus(status, TF_INTERNAL, "no Metal device");
    return nil;
  }
  const std::string device_id = std::to_string(device.registryID);
  const std::string pipeline_key = device_id + "/" + kernel_name;
  CacheState& s = GetCacheState();
  // One lock for lookups and (rare, one-time) compilation: simple, and two
  // threads never compile the same library twice.
  std::lock_guard<std::mutex> lock(s.mutex);
  auto found = s.pipelines.find(pipeline_key);
  if (found != s.pipelines.end()) return found->second;

  const std::string library_key = device_id + "/" + library.name;
  id<MTLLibrary> metal_library = nil;
  auto cached = s.libraries.find(library_key);
  if (cached != s.libraries.end()) {
    metal_library = cached->second;
  } else {
    NSError* error = nil;
    const std::string metallib = PrecompiledLibraryPath(library.name);
    if (!metallib.empty()) {
      NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:metallib.c_str()]];
      metal_library = [device newLibraryWithURL:url error:&error];
      if (metal_library != nil) ++s.loaded_from_metallib;
      // A .metallib that does not load (other OS, corrupted): fall back to the source.
    }
    if (metal_library == nil) {
      NSString* source = [NSString stringWithUTF8String:library.source];
      if (source == nil) {
        SetStatus(status, TF_INTERNAL, std::string("the embedded Metal source of ") + library.name + " is not UTF-8");
        return nil;
      }
      error = nil;
      metal_library = [device newLibraryWithSource:source options:CompileOptions() error:&error];
      if (metal_library == nil) {
        SetStatusFromNSError(status, error, std::string("compiling the Metal library ") + library.name);
        return nil;
      }
      ++s.compiled_from_source;
    }
    s.libraries[library_key] = metal_library;
  }

  id<MTLFunction> function = [metal_library newFunctionWithName:[NSString stringWithUTF8String:kernel_name]];
  if (function == nil) {
    SetStatus(status, TF_INTERNAL,
              std::string("no kernel '") + kernel_name + "' in the Metal library " + library.name +
                  " (is it instantiated with TFM_INSTANTIATE_KERNEL?)");
    return nil;
  }
  NSError* error = nil;
  id<MTLComputePipelineState> pipeline = [device newComputePipelineStateWithFunction:function error:&error];
  if (pipeline == nil) {
    SetStatusFromNSError(status, error, std::string("creating the pipeline of ") + kernel_name);
    return nil;
  }
  s.pipelines[pipeline_key] = pipeline;
  return pipeline;
}

// ---------------------------------------------------------------------------
// Sizing and dispatch

// The sizes themselves: dispatch_geometry.h (shared with the emulator tests).
MTLSize ThreadgroupSize1D(id<MTLComputePipelineState> pipeline, NSUInteger threads, NSUInteger cap) {
  return MTLSizeMake(geometry::ThreadgroupSize1D(pipeline.threadExecutionWidth, pipeline.maxTotalThreadsPerThreadgroup,
                                                 threads, cap),
                     1, 1);
}

NSUInteger ReductionThreadgroupSize(id<MTLComputePipelineState> pipeline, NSUInteger row_length,
                                    NSUInteger elements_per_thread, NSUInteger cap) {
  return geometry::ReductionThreadgroupSize(pipeline.threadExecutionWidth, pipeline.maxTotalThreadsPerThreadgroup,
                                            row_length, elements_per_thread, cap);
}

void DispatchThreads1D(id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> pipeline, NSUInteger n,
                       NSUInteger cap) {
  if (n == 0) return;
  [encoder dispatchThreads:MTLSizeMake(n, 1, 1) threadsPerThreadgroup:ThreadgroupSize1D(pipeline, n, cap)];
}

void DispatchRows(id<MTLComputeCommandEncoder> encoder, NSUInteger rows, NSUInteger threads_per_row) {
  if (rows == 0 || threads_per_row == 0) return;
  [encoder dispatchThreadgroups:MTLSizeMake(rows, 1, 1) threadsPerThreadgroup:MTLSizeMake(threads_per_row, 1, 1)];
}

void SetThreadgroupMemory(id<MTLComputeCommandEncoder> encoder, NSUInteger bytes, NSUInteger index) {
  [encoder setThreadgroupMemoryLength:RoundUp(std::max<NSUInteger>(bytes, 16), 16) atIndex:index];
}

namespace internal {
namespace {

void SubmitApple(id<TF_MetalStream> stream, const char* what, TF_Status* status, EncodeBlock encode) {
  dispatch_sync(stream.queue, ^{
    @autoreleasepool {
      id<MTLCommandBuffer> command_buffer = stream.currentCommandBuffer;
      if (command_buffer == nil) {
        SetStatus(status, TF_INTERNAL, std::string("no Metal command buffer to encode ") + what);
        return;
      }
      encode(command_buffer);
      if (!SyncRequested()) {
        [stream commit];
        return;
      }
      [stream commitAndWait];
      if (command_buffer.status == MTLCommandBufferStatusError) {
        SetStatusFromNSError(status, command_buffer.error, std::string("running ") + what);
      }
    }
  });
}

void SubmitOpenPlugin(open_plugin::StreamLayout* stream, const char* what, TF_Status* status, EncodeBlock encode) {
  const BindingState& state = GetBindingState();
  std::string failure;
  if (open_plugin::StreamFailed(stream, &failure)) {
    SetStatus(status, TF_INTERNAL, "the Metal stream previously failed: " + failure);
    return;
  }
  @autoreleasepool {
    id<MTLCommandQueue> queue = (__bridge id<MTLCommandQueue>)stream->queue;
    id<MTLSharedEvent> order_event = (__bridge id<MTLSharedEvent>)stream->order_event;
    open_plugin::Submission submission(stream);  // the next number, under the stream's locks
    id<MTLCommandBuffer> command_buffer = [queue commandBuffer];
    if (command_buffer == nil) {
      submission.Cancel();  // the number goes back: nothing will signal it
      SetStatus(status, TF_INTERNAL, std::string("the Metal command queue gave no command buffer for ") + what);
      return;
    }
    command_buffer.label = [NSString stringWithUTF8String:what];
    if (submission.wait_value() > 0) [command_buffer encodeWaitForEvent:order_event value:submission.wait_value()];
    encode(command_buffer);  // on failure it leaves the buffer empty, which still advances the sequence
    [command_buffer encodeSignalEvent:order_event value:submission.signal_value()];
    const open_plugin::NoteCompletionFn note = state.open.note_completion;
    open_plugin::StreamLayout* raw_stream = stream;  // outlives the buffer: the plugin drains a stream before freeing it
    [command_buffer addCompletedHandler:^(id<MTLCommandBuffer> completed) {
      if (note != nullptr) {
        note(raw_stream, (__bridge void*)completed);  // the plugin's own failure (and profiler) bookkeeping
      } else if (completed.error != nil) {
        NSString* label = completed.label;
        const char* name = label != nil ? label.UTF8String : nullptr;
        open_plugin::NoteFailure(raw_stream,
                                 Describe(completed.error) + (name != nullptr ? std::string(", encoded by ") + name : ""));
      }
    }];
    [command_buffer commit];
    submission.Release();
    if (state.synchronous || SyncRequested()) {
      [command_buffer waitUntilCompleted];
      if (command_buffer.status == MTLCommandBufferStatusError) {
        SetStatusFromNSError(status, command_buffer.error, std::string("running ") + what);
      }
    }
  }
}

}  // namespace

void Submit(const MetalStream& stream, const char* what, TF_Status* status, EncodeBlock encode) {
  if (stream.open != nullptr) {
    SubmitOpenPlugin(stream.open, what, status, encode);
  } else if (stream.apple != nil) {
    SubmitApple(stream.apple, what, status, encode);
  } else {
    SetStatus(status, TF_INTERNAL, std::string("no Metal stream to encode ") + what);
  }
}

}  // namespace internal
}  // namespace tfmetal_ext

extern "C" const char* TfmetalExt_MetalKernelStatus() {
  tfmetal_ext::Records& r = tfmetal_ext::GetRecords();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.text = tfmetal_ext::binding::FormatRecords(r.ops);
  return r.text.c_str();
}
