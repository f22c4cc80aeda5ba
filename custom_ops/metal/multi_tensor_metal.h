// multi_tensor_metal.h: the host code the Metal kernels of the multi-tensor
// optimizer ops (multi_tensor_adam_metal.mm, multi_tensor_lion_metal.mm)
// share: TF's experimental resource-variable C API, looked up at load time,
// copy-on-write on the GPU, duplicate detection, and locking + reading the
// variables with their dtype and shape checks. Objective-C++ with ARC, macOS
// arm64 only; header-only (inline), included by both .mm files.
//
// Resource variables go through TF's experimental kernel C API
// (tensorflow/c/kernels_experimental.h), as TF's own training kernels do in C++:
// - TF_MaybeLockVariableInputMutexesInOrder: exclusive locks on every
//   variable and slot, in address order, held until the dispatches are encoded;
// - TF_GetInputTensorFromVariable(sparse = false): the variable's tensor, after
//   copy-on-write (PrepareToUpdateVariable): when a pending read still shares
//   the buffer, TF allocates a new one and calls CopyTensorOnStream below,
//   which copies on the GPU with a blit, in stream order before the update.
// What the C API cannot express, and what the kernels do instead:
// - no Var* or "is initialized" flag: an uninitialized variable is reported by
//   TF_GetInputTensorFromVariable itself (an uninitialized tensor does not
//   convert to a TF_Tensor), not with the CPU kernels' FailedPrecondition text;
// - no variable identity: a variable passed twice is detected by comparing the
//   inputs' serialized ResourceHandleProtos (same device/container/name);
// - TF_MaybeLockVariableInputMutexesInOrder removes duplicate mutexes with a
//   linear search per input (quadratic in the number of resources; ~0.1 ms at
//   800 resources);
// - the copy callback gets no status: a failed copy-on-write copy (no Metal
//   stream) fails the op through TF_OpKernelContext_Failure;
// - not every TF exports it: TF 2.19's libtensorflow_framework does, 2.21's
//   (Linux wheel, checked) does not. Its three functions are looked up at load
//   time (VariableApi) instead of linked, so the op library loads everywhere;
//   without them the kernels are not registered and the Python wrappers run
//   their per-variable references on the GPU instead.
#ifndef TFMETAL_METAL_MULTI_TENSOR_METAL_H_
#define TFMETAL_METAL_MULTI_TENSOR_METAL_H_

#include "metal/metal_helper.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/kernels_experimental.h"
#include "tensorflow/c/tf_buffer.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

namespace tfmetal_ext {
namespace multi_tensor_metal {

// The experimental variable API of kernels_experimental.h, looked up in the
// library that exports TF's kernel C API (see the top of the file).
struct VariableApi {
  decltype(&TF_MaybeLockVariableInputMutexesInOrder) lock_in_order = nullptr;
  decltype(&TF_ReleaseVariableInputLockHolder) release_locks = nullptr;
  decltype(&TF_GetInputTensorFromVariable) input_from_variable = nullptr;

  bool available() const { return lock_in_order && release_locks && input_from_variable; }
};

inline void* LookUp(void* library, const char* name) {
  void* symbol = library != nullptr ? dlsym(library, name) : nullptr;
  return symbol != nullptr ? symbol : dlsym(RTLD_DEFAULT, name);
}

inline const VariableApi& Variables() {
  static const VariableApi api = [] {
    VariableApi a;
    void* library = nullptr;
    Dl_info info;
    if (dladdr(reinterpret_cast<const void*>(&TF_NewKernelBuilder), &info) != 0 && info.dli_fname != nullptr) {
      library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);  // already loaded: just a handle
    }
    a.lock_in_order = reinterpret_cast<decltype(a.lock_in_order)>(
        LookUp(library, "TF_MaybeLockVariableInputMutexesInOrder"));
    a.release_locks = reinterpret_cast<decltype(a.release_locks)>(LookUp(library, "TF_ReleaseVariableInputLockHolder"));
    a.input_from_variable =
        reinterpret_cast<decltype(a.input_from_variable)>(LookUp(library, "TF_GetInputTensorFromVariable"));
    return a;
  }();
  return api;
}

// Why a kernel needing the API is not registered (RecordNotRegistered).
inline const char* NoVariableApiReason() {
  return "this TensorFlow does not export the resource-variable kernel C API "
         "(TF_GetInputTensorFromVariable, TF_MaybeLockVariableInputMutexesInOrder: TF 2.20/2.21)";
}

struct LockDeleter {
  void operator()(TF_VariableInputLockHolder* h) const { Variables().release_locks(h); }
};
using LockPtr = std::unique_ptr<TF_VariableInputLockHolder, LockDeleter>;

// The resource inputs of one op: groups of n variables named names[0..)
// ("var", "m", ...), all of them first, in that order.
struct Layout {
  std::vector<const char*> names;  // every group the op can have (for messages)
  int groups = 0;                  // groups present in this op instance
  int n = 0;

  int num_resources() const { return groups * n; }
  // "var[3]", "m[0]", ...: the user-facing name of resource input `index`.
  std::string InputName(int index) const {
    return std::string(names[index / n]) + "[" + std::to_string(index % n) + "]";
  }
};

// "var, m, v and vhat" from names[0..count).
inline std::string JoinNames(const std::vector<const char*>& names, size_t count) {
  std::string out;
  for (size_t k = 0; k < count; ++k) {
    if (k > 0) out += k + 1 == count ? " and " : ", ";
    out += names[k];
  }
  return out;
}

// The copy callback of TF's copy-on-write (see the top of the file): copies
// `source` into the newly allocated `dest` on the op's Metal stream, ordered
// before the update encoded later on the same stream. Owns both tensors.
inline void CopyTensorOnStream(TF_OpKernelContext* ctx, TF_Tensor* source, TF_Tensor* dest) {
  TensorPtr src(source), dst(dest);
  const NSUInteger bytes = TF_TensorByteSize(source);
  if (bytes == 0) return;
  StatusPtr status(TF_NewStatus());
  MetalStream stream = GetMetalStream(ctx, status.get());
  if (!stream) {
    TF_OpKernelContext_Failure(ctx, status.get());
    return;
  }
  MetalSlice from, to;
  if (!Resolve(source, "a variable's tensor", &from, status.get()) ||
      !Resolve(dest, "a variable's copy-on-write copy", &to, status.get())) {
    TF_OpKernelContext_Failure(ctx, status.get());
    return;
  }
  TF_Status* raw_status = status.get();
  internal::Submit(stream, "multi-tensor optimizer copy-on-write", raw_status, ^(id<MTLCommandBuffer> command_buffer) {
    id<MTLBlitCommandEncoder> blit = [command_buffer blitCommandEncoder];
    if (blit == nil) {
      SetStatus(raw_status, TF_INTERNAL, "could not create a blit encoder for a variable's copy-on-write copy");
      return;
    }
    [blit copyFromBuffer:from.buffer sourceOffset:from.offset toBuffer:to.buffer destinationOffset:to.offset size:bytes];
    [blit endEncoding];
  });
  if (!Ok(status.get())) TF_OpKernelContext_Failure(ctx, status.get());
}

// Refuses a variable passed twice (its elements would be updated by racing
// threads), as the CPU kernels do, from the serialized resource handles.
inline bool CheckDistinctVariables(TF_OpKernelContext* ctx, const Layout& layout, TF_Status* status) {
  const int num_resources = layout.num_resources();
  std::vector<std::pair<std::string, int>> handles(static_cast<size_t>(num_resources));
  for (int i = 0; i < num_resources; ++i) {
    TF_Buffer* buffer = TF_NewBuffer();
    TF_GetSerializedResourceHandleProto(ctx, i, buffer, status);
    if (Ok(status)) handles[i] = {std::string(static_cast<const char*>(buffer->data), buffer->length), i};
    TF_DeleteBuffer(buffer);
    if (!Ok(status)) return false;
  }
  std::sort(handles.begin(), handles.end());
  for (size_t i = 1; i < handles.size(); ++i) {
    if (handles[i].first == handles[i - 1].first) {
      SetStatus(status, TF_INVALID_ARGUMENT,
                "the same variable is passed as " + layout.InputName(handles[i - 1].second) + " and " +
                    layout.InputName(handles[i].second) + "; every " + JoinNames(layout.names, layout.names.size()) +
                    " must be a distinct variable");
      return false;
    }
  }
  return true;
}

// Checks that no variable is passed twice, locks every variable (into
// `*locks`, held until it is destroyed), gets their tensors (copy-on-write
// done) into `*vars` (group-major: var[0..n), m[0..n), ...), and checks
// their dtype against `dtype` and every slot's shape against grads[i]'s.
// Nothing is written: on failure every variable is unchanged.
inline bool LockAndReadVariables(TF_OpKernelContext* ctx, const Layout& layout, TF_DataType dtype,
                                 const std::vector<TensorPtr>& grads, LockPtr* locks, std::vector<TensorPtr>* vars,
                                 TF_Status* status) {
  if (!CheckDistinctVariables(ctx, layout, status)) return false;
  const int num_resources = layout.num_resources();
  std::vector<int> resource_inputs(static_cast<size_t>(num_resources));
  std::iota(resource_inputs.begin(), resource_inputs.end(), 0);
  TF_VariableInputLockHolder* holder = nullptr;
  Variables().lock_in_order(ctx, /*do_lock=*/true, /*sparse=*/false, resource_inputs.data(), resource_inputs.size(),
                            &CopyTensorOnStream, &holder, status);
  locks->reset(holder);
  if (!Ok(status)) return false;
  vars->resize(static_cast<size_t>(num_resources));
  for (int i = 0; i < num_resources; ++i) {
    TF_Tensor* t = nullptr;
    Variables().input_from_variable(ctx, i, /*lock_held=*/true, /*isVariantType=*/false, /*sparse=*/false,
                                    &CopyTensorOnStream, &t, status);
    (*vars)[i].reset(t);
    if (!Ok(status) || t == nullptr) {
      // Older TF only fails the context: give the op a status of its own.
      if (Ok(status)) SetStatus(status, TF_FAILED_PRECONDITION, "could not read variable " + layout.InputName(i));
      return false;
    }
  }
  for (int i = 0; i < num_resources; ++i) {
    const TF_DataType got = TF_TensorType((*vars)[i].get());
    if (got != dtype) {
      SetStatus(status, TF_INVALID_ARGUMENT,
                layout.InputName(i) + " has dtype " + DtypeName(got) + " but T is " + DtypeName(dtype) +
                    "; all variables of one call must share the dtype T");
      return false;
    }
  }
  for (int i = 0; i < layout.n; ++i) {
    const std::vector<int64_t> shape = Dims(grads[i].get());
    bool same = true;
    for (int g = 0; g < layout.groups; ++g) same = same && Dims((*vars)[g * layout.n + i].get()) == shape;
    if (!same) {
      std::string shapes;
      for (int g = 0; g < layout.groups; ++g) {
        shapes += std::string(layout.names[g]) + " " + ShapeString(Dims((*vars)[g * layout.n + i].get())) + ", ";
      }
      std::vector<const char*> checked(layout.names.begin(), layout.names.begin() + layout.groups);
      checked.push_back("grad");
      SetStatus(status, TF_INVALID_ARGUMENT,
                "variable " + std::to_string(i) + ": " + JoinNames(checked, checked.size()) +
                    " must have the same shape, got " + shapes + "grad " + ShapeString(shape));
      return false;
    }
  }
  return true;
}

}  // namespace multi_tensor_metal
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_MULTI_TENSOR_METAL_H_
