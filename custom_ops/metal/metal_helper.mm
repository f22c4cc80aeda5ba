// metal_helper.mm: see metal_helper.h. Objective-C++ with ARC, macOS only.
#include "metal/metal_helper.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

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

NSUInteger PowerOfTwoAtMost(NSUInteger value) {
  NSUInteger p = 1;
  while (p * 2 <= value) p *= 2;
  return p;
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

}  // namespace

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

bool CheckSameShape(const TF_Tensor* a, const char* a_name, const TF_Tensor* b, const char* b_name,
                    TF_Status* status) {
  const std::vector<int64_t> a_dims = Dims(a);
  const std::vector<int64_t> b_dims = Dims(b);
  if (a_dims == b_dims) return true;
  SetStatus(status, TF_INVALID_ARGUMENT, std::string(a_name) + " and " + b_name + " must have the same shape, got " +
                                             ShapeString(a_dims) + " and " + ShapeString(b_dims));
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
  const TF_DataType dtypes[] = {TF_FLOAT, TF_HALF, TF_BFLOAT16};
  StatusPtr status(TF_NewStatus());
  for (TF_DataType dtype : dtypes) {
    TF_KernelBuilder* builder = TF_NewKernelBuilder(op, "GPU", create, compute, destroy);
    TF_KernelBuilder_TypeConstraint(builder, "T", dtype, status.get());
    if (!Ok(status.get())) {
      TF_DeleteKernelBuilder(builder);  // not registered: still ours
      continue;
    }
    TF_RegisterKernelBuilder((std::string(op) + "_GPU_" + KernelSuffix(dtype)).c_str(), builder, status.get());
  }
}

id<TF_MetalStream> GetMetalStream(TF_OpKernelContext* ctx, TF_Status* status) {
  SP_Stream stream = TF_GetStream(ctx, status);
  if (TF_GetCode(status) != TF_OK) return nil;
  if (stream == nullptr) {
    SetStatus(status, TF_INTERNAL, "the op has no Metal stream (is tensorflow-metal loaded?)");
    return nil;
  }
  return (__bridge id<TF_MetalStream>)static_cast<void*>(stream);
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

MTLSize ThreadgroupSize1D(id<MTLComputePipelineState> pipeline, NSUInteger threads, NSUInteger cap) {
  const NSUInteger width = std::max<NSUInteger>(pipeline.threadExecutionWidth, 1);
  NSUInteger limit = std::min<NSUInteger>(pipeline.maxTotalThreadsPerThreadgroup, cap == 0 ? NSUIntegerMax : cap);
  if (limit >= width) limit -= limit % width;  // whole SIMD-groups
  limit = std::max<NSUInteger>(limit, 1);
  const NSUInteger wanted = RoundUp(std::max<NSUInteger>(threads, 1), width);
  return MTLSizeMake(std::min(limit, wanted), 1, 1);
}

NSUInteger ReductionThreadgroupSize(id<MTLComputePipelineState> pipeline, NSUInteger row_length,
                                    NSUInteger elements_per_thread, NSUInteger cap) {
  const NSUInteger width = std::max<NSUInteger>(pipeline.threadExecutionWidth, 1);
  const NSUInteger limit = PowerOfTwoAtMost(
      std::max<NSUInteger>(std::min<NSUInteger>(pipeline.maxTotalThreadsPerThreadgroup, cap == 0 ? NSUIntegerMax : cap), 1));
  const NSUInteger per_thread = std::max<NSUInteger>(elements_per_thread, 1);
  const NSUInteger wanted = (std::max<NSUInteger>(row_length, 1) + per_thread - 1) / per_thread;
  NSUInteger threads = std::min(PowerOfTwoAtMost(width), limit);
  while (threads < wanted && threads * 2 <= limit) threads *= 2;
  return threads;
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

void Commit(id<TF_MetalStream> stream, id<MTLCommandBuffer> command_buffer, const char* kernel_name,
            TF_Status* status) {
  if (!SyncRequested()) {
    [stream commit];
    return;
  }
  [stream commitAndWait];
  if (command_buffer.status == MTLCommandBufferStatusError) {
    SetStatusFromNSError(status, command_buffer.error, std::string("running ") + kernel_name);
  }
}

}  // namespace internal
}  // namespace tfmetal_ext
