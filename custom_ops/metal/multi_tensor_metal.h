// multi_tensor_metal.h: the host code of the Metal kernels of the multi-tensor
// optimizer ops (multi_tensor_{adam,lion,rmsprop}_metal.mm): one table-driven
// runner (Spec, Register at the end) and what it is built on: the variables
// reached through TF's C++ kernel API (locked, checked, copied on write on
// the GPU: see below). Objective-C++ with ARC, macOS arm64 only;
// header-only (inline), included by each op's .mm, which holds one Spec.
//
// One launch for N variables, the Metal way. apex's FusedAdam launches one
// CUDA kernel over a table of raw device pointers. Metal buffers are separate
// objects: a kernel can only reach a buffer bound to the encoder (or made
// resident and addressed through an argument buffer / gpuAddress table, which
// needs Metal 3 and a useResource: call per buffer anyway). So an op encodes
// ONE compute encoder with one dispatch per variable (per 2^30-element chunk,
// via buffer offsets): a single command-buffer submission and no CPU-GPU
// synchronization, with a few microseconds of GPU-side cost per dispatch; the
// scalar buffers are bound once and stay bound across the dispatches. The
// kernels compute the step's coefficients on the GPU from the scalar tensors,
// which stay in device memory (reading them on the host would wait for the GPU).
//
// Resource variables go through TF's C++ kernel API, shared with the CPU
// kernels (tfmetal/resource_variables.h, variables_metal.h): every variable
// and slot looked up, a variable passed twice refused, exclusive locks in
// address order held until the dispatches are encoded, dtype and shape
// checks, then copy-on-write (a buffer still shared with a pending read is
// copied on the GPU with a blit, in stream order before the update). Nothing
// is written before every check has passed. The C API's experimental variable
// functions (TF_GetInputTensorFromVariable, ...) are not used: TF 2.20 and
// 2.21 export none of them (tensorflow/tensorflow#126374), and TensorFlow
// implements them with these same C++ calls; so the kernels register on every
// TF version, the open tensorflow-metal-plugin on TF 2.21 included, with the
// CPU kernels' messages.
#ifndef TFMETAL_METAL_MULTI_TENSOR_METAL_H_
#define TFMETAL_METAL_MULTI_TENSOR_METAL_H_

#include "metal/metal_helper.h"
#include "metal/multi_tensor_check.h"  // tfm_multi_tensor_check_params, shared with the check kernels
#include "metal/variables_metal.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

namespace tfmetal_ext {
namespace multi_tensor_metal {

using variables::JoinNames;
using variables::Layout;

// Locks and checks every variable of the call (variables::LockedVariables:
// held by `*locked` until it is destroyed, copy-on-write done on the GPU) and
// resolves each one's buffer into `*slices` (group-major: var[0..n), m[0..n),
// ...). Nothing is written: on failure every variable is unchanged.
inline bool LockVariables(TF_OpKernelContext* ctx, const Layout& layout, TF_DataType dtype,
                          variables::LockedVariables* locked, std::vector<MetalSlice>* slices, TF_Status* status) {
  if (!variables_metal::SetFrom(locked->Acquire(variables_metal::Cc(ctx), layout,
                                                static_cast<::tensorflow::DataType>(dtype),
                                                &variables_metal::CopyOnStream),
                                status)) {
    return false;
  }
  slices->resize(static_cast<size_t>(layout.num_resources()));
  for (int i = 0; i < layout.num_resources(); ++i) {
    if (!variables_metal::Slice(*locked->resource(i), layout.InputName(i), &(*slices)[i], status)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// The runner: one op = one Spec (a row of names and [[buffer(n)]] indices).
//
// Inputs, in order: the resource groups of `slots` (each N variables; an
// optional slot's group only when its count attr is N), grad (N tensors),
// the `scalars`, weight_decay_rate when num_decay is 1, then the float32
// scale when num_scale is 1 (and then the op's one output, found_non_finite).
// The kernel takes, per dispatch, every slot (an absent optional slot bound
// to its `placeholder` slot, not touched), grad and the params {count,
// flags...}; the scalars, weight_decay_rate, scale and found (absent:
// scalars[0], not read) are bound once. Messages name the inputs as the CPU
// kernels do.

// A kernel buffer: the input's name and its [[buffer(index)]].
struct Buffer {
  const char* name;
  int index;
};

// A per-variable slot (var, m, ...). Optional slots have a count attr that
// must be 0 or N ("vhat must hold 0 (Adam) or N = 2 (AMSGrad) variables").
struct Slot {
  const char* name;
  int index;
  const char* count_attr = nullptr;   // nullptr: always present
  const char* without = nullptr;      // "(Adam)": what 0 means, in the message
  const char* with = nullptr;         // "(AMSGrad)": what N means
  int placeholder = 0;                // slot bound in its place when absent
  bool listed_when_absent = false;    // still named in "every var, m, v and vhat must be a distinct
                                      // variable" (as the CPU kernel names it); last slots only
};

struct Spec {
  const char* op;      // "TfmetalExt>MultiTensorAdam"
  const char* kernel;  // "multi_tensor_adam": host names <kernel>_<dtype>
  MetalLibrarySource library;
  std::vector<Slot> slots;  // in input order
  Buffer grad;
  std::vector<Buffer> scalars;
  Buffer decay;   // weight_decay_rate (num_decay = 0 or 1)
  Buffer params;  // constant <kernel>_params& p: uint32 {count, flags...}
  Buffer scale;   // device const float* scale: the loss scale (num_scale = 0 or 1)
  Buffer found;   // device const uint* found: the finite check's result (multi_tensor_check.h)
  std::vector<const char*> flags;  // params after count: 1 if the slot (or decay, or scale) named is present
  size_t params_size;              // sizeof the kernel's params struct
};

// The finite check's kernels (multi_tensor_check.h), in every op's library.
constexpr const char* kFoundReset = "multi_tensor_found_reset";
constexpr const char* kFoundWrite = "multi_tensor_found_write";
constexpr const char* kFindNonFinite = "multi_tensor_find_non_finite";

// One op instance: its attrs.
struct Kernel {
  const Spec* spec = nullptr;
  int n = 0;
  std::vector<int> counts;  // per slot: 0 or N (required slots: N)
  int num_decay = 0;
  int num_scale = 0;
  TF_DataType dtype = TF_FLOAT;
  std::string kernel_name;
  std::string check_name;  // multi_tensor_find_non_finite_<T>
};

template <const Spec& S>
void* Create(TF_OpKernelConstruction* ctx) {
  StatusPtr status(TF_NewStatus());
  Kernel k;
  k.spec = &S;
  int32_t n = 0, num_decay = 0, num_scale = 0;
  std::vector<int32_t> counts(S.slots.size(), 0);
  TF_OpKernelConstruction_GetAttrInt32(ctx, "N", &n, status.get());
  for (size_t s = 0; s < S.slots.size(); ++s) {
    if (S.slots[s].count_attr == nullptr) {
      counts[s] = n;
    } else if (Ok(status.get())) {
      TF_OpKernelConstruction_GetAttrInt32(ctx, S.slots[s].count_attr, &counts[s], status.get());
    }
  }
  if (Ok(status.get())) TF_OpKernelConstruction_GetAttrInt32(ctx, "num_decay", &num_decay, status.get());
  if (Ok(status.get())) TF_OpKernelConstruction_GetAttrInt32(ctx, "num_scale", &num_scale, status.get());
  if (Ok(status.get())) TF_OpKernelConstruction_GetAttrType(ctx, "T", &k.dtype, status.get());
  for (size_t s = 0; s < S.slots.size(); ++s) {
    const Slot& slot = S.slots[s];
    if (Ok(status.get()) && counts[s] != 0 && counts[s] != n) {
      SetStatus(status.get(), TF_INVALID_ARGUMENT,
                std::string(slot.name) + " must hold 0" + (slot.without ? std::string(" ") + slot.without : "") +
                    " or N = " + std::to_string(n) + (slot.with ? std::string(" ") + slot.with : "") +
                    " variables, got " + std::to_string(counts[s]));
    }
  }
  if (Ok(status.get()) && num_decay > 1) {
    SetStatus(status.get(), TF_INVALID_ARGUMENT,
              std::string(S.decay.name) + " must hold 0 or 1 scalar, got " + std::to_string(num_decay));
  }
  if (Ok(status.get()) && num_scale > 1) {
    SetStatus(status.get(), TF_INVALID_ARGUMENT,
              std::string(S.scale.name) + " must hold 0 or 1 scalar, got " + std::to_string(num_scale));
  }
  if (Ok(status.get())) k.kernel_name = KernelName(S.kernel, "", k.dtype, status.get());
  if (Ok(status.get())) k.check_name = KernelName(kFindNonFinite, "", k.dtype, status.get());
  k.n = n;
  k.counts.assign(counts.begin(), counts.end());
  k.num_decay = num_decay;
  k.num_scale = num_scale;
  return NewKernelOrFail(ctx, status.get(), k);
}

inline void Run(const Kernel& k, TF_OpKernelContext* ctx, TF_Status* status) {
  const Spec& spec = *k.spec;
  const int n = k.n;
  // The groups present, in input order, and where each slot's group is (-1: absent).
  const char* short_op = std::strchr(spec.op, '>') != nullptr ? std::strchr(spec.op, '>') + 1 : spec.op;
  Layout layout{short_op, {}, 0, n};
  std::vector<int> group(spec.slots.size(), -1);
  for (size_t s = 0; s < spec.slots.size(); ++s) {
    if (k.counts[s] == 0) continue;
    group[s] = layout.groups++;
    layout.names.push_back(spec.slots[s].name);
  }
  for (const Slot& slot : spec.slots) {
    if (k.counts[&slot - spec.slots.data()] == 0 && slot.listed_when_absent) layout.names.push_back(slot.name);
  }
  const int grad_start = layout.num_resources();
  const int scalar_start = grad_start + n;
  const int num_scalars = static_cast<int>(spec.scalars.size()) + k.num_decay;
  auto scalar = [&](int s) -> const Buffer& {  // the s-th scalar input: spec.scalars, then weight_decay_rate
    return s < static_cast<int>(spec.scalars.size()) ? spec.scalars[s] : spec.decay;
  };

  // Scalars first: cheap, and no lock is needed to check their shapes (their
  // values stay on the GPU).
  std::vector<TensorPtr> scalars(static_cast<size_t>(num_scalars));
  for (int s = 0; s < num_scalars; ++s) {
    scalars[s] = Input(ctx, scalar_start + s, status);
    if (!Ok(status)) return;
    if (TF_NumDims(scalars[s].get()) != 0) {
      SetStatus(status, TF_INVALID_ARGUMENT,
                std::string(scalar(s).name) + " is not a scalar: " + ShapeString(Dims(scalars[s].get())));
      return;
    }
  }
  std::vector<TensorPtr> grads(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    grads[i] = Input(ctx, grad_start + i, status);
    if (!Ok(status)) return;
  }
  // Lock every variable (held until the end of this function, after the
  // update is encoded), get their tensors (copy-on-write done), and validate
  // everything before updating anything: an error leaves every variable unchanged.
  variables::LockedVariables locked;
  std::vector<MetalSlice> var_slices;  // group-major, groups present only
  if (!LockVariables(ctx, layout, k.dtype, &locked, &var_slices, status)) return;
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += TF_TensorElementCount(grads[i].get());

  // The loss scale (the last input): its flag output and the check's 4-byte
  // temp, which the updates read (multi_tensor_check.h).
  const bool scaled = k.num_scale != 0;
  TensorPtr scale, found_out, found;
  MetalSlice scale_slice, found_out_slice, found_slice;
  if (scaled) {
    scale = Input(ctx, scalar_start + num_scalars, status);
    if (!Ok(status)) return;
    if (TF_NumDims(scale.get()) != 0) {
      SetStatus(status, TF_INVALID_ARGUMENT,
                std::string(spec.scale.name) + " is not a scalar: " + ShapeString(Dims(scale.get())));
      return;
    }
    found_out = Output(ctx, 0, TF_BOOL, {}, status);
    if (!Ok(status)) return;
    const int64_t one = 1;
    TF_AllocatorAttributes attributes{TF_ALLOCATOR_ATTRIBUTES_STRUCT_SIZE, /*on_host=*/0};
    found.reset(TF_AllocateTemp(ctx, TF_INT32, &one, 1, &attributes, status));
    if (!Ok(status)) return;
    if (!Resolve(scale.get(), spec.scale.name, &scale_slice, status) ||
        !Resolve(found_out.get(), "found_non_finite", &found_out_slice, status) ||
        !Resolve(found.get(), "the finite check's flag", &found_slice, status)) {
      return;
    }
  }
  if (total == 0 && !scaled) return;

  // Every tensor's buffer and offset, resolved before anything is encoded.
  std::vector<MetalSlice> scalar_slices(static_cast<size_t>(num_scalars));
  for (int s = 0; s < num_scalars; ++s) {
    if (!Resolve(scalars[s].get(), scalar(s).name, &scalar_slices[s], status)) return;
  }
  std::vector<MetalSlice> grad_slices(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    if (!Resolve(grads[i].get(), ("grad[" + std::to_string(i) + "]").c_str(), &grad_slices[i], status)) return;
  }
  // params after count: 1 where the named slot (or weight_decay_rate, or scale) is present.
  std::vector<uint32_t> words(1 + spec.flags.size(), 0);
  for (size_t f = 0; f < spec.flags.size(); ++f) {
    const std::string flag = spec.flags[f];
    if (flag == spec.decay.name) words[1 + f] = k.num_decay ? 1u : 0u;
    if (flag == spec.scale.name) words[1 + f] = scaled ? 1u : 0u;
    for (size_t s = 0; s < spec.slots.size(); ++s) {
      if (flag == spec.slots[s].name) words[1 + f] = group[s] >= 0 ? 1u : 0u;
    }
  }
  const size_t element_size = TF_DataTypeSize(k.dtype);
  EncodeKernel(ctx, spec.library, k.kernel_name.c_str(), status,
               [&](id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> pipeline) {
    if (scaled) {
      // Every pipeline before anything is encoded: a failure leaves the encoder empty.
      PipelineCache& cache = PipelineCache::Global();
      id<MTLComputePipelineState> reset = cache.Pipeline(pipeline.device, spec.library, kFoundReset, status);
      id<MTLComputePipelineState> check =
          reset == nil ? nil : cache.Pipeline(pipeline.device, spec.library, k.check_name.c_str(), status);
      id<MTLComputePipelineState> write =
          check == nil ? nil : cache.Pipeline(pipeline.device, spec.library, kFoundWrite, status);
      if (write == nil) return;
      // found = 0; then 1 where a gradient element is not finite; then the op's output.
      [encoder setComputePipelineState:reset];
      [encoder setBuffer:found_slice.buffer offset:found_slice.offset atIndex:0];  // device atomic_uint* found [[buffer(0)]]
      DispatchThreads1D(encoder, reset, 1);
      [encoder setComputePipelineState:check];
      [encoder setBuffer:found_slice.buffer offset:found_slice.offset atIndex:1];  // device atomic_uint* found [[buffer(1)]]
      for (int i = 0; i < n; ++i) {
        DispatchChunked1D(encoder, check, TF_TensorElementCount(grads[i].get()), element_size,
                          [&](NSUInteger offset, uint32_t count) {
          const MetalSlice& grad = grad_slices[i];
          [encoder setBuffer:grad.buffer offset:grad.offset + offset atIndex:0];  // device const T* grad [[buffer(0)]]
          const tfm_multi_tensor_check_params params{count};
          SetBytes(encoder, params, 2);  // constant tfm_multi_tensor_check_params& p [[buffer(2)]]
        });
      }
      [encoder setComputePipelineState:write];
      [encoder setBuffer:found_slice.buffer offset:found_slice.offset atIndex:0];  // device const uint* found [[buffer(0)]]
      // device uint8_t* found_non_finite [[buffer(1)]]
      [encoder setBuffer:found_out_slice.buffer offset:found_out_slice.offset atIndex:1];
      DispatchThreads1D(encoder, write, 1);
      // The encoder is serial (each dispatch sees the previous ones' writes); the barrier says so explicitly.
      [encoder memoryBarrierWithScope:MTLBarrierScopeBuffers];
      [encoder setComputePipelineState:pipeline];
    }
    // The scalars, bound once: bindings persist across the dispatches of an encoder.
    for (size_t s = 0; s < spec.scalars.size(); ++s) {
      [encoder setBuffer:scalar_slices[s].buffer offset:scalar_slices[s].offset atIndex:spec.scalars[s].index];
    }
    const MetalSlice& decay = scalar_slices[k.num_decay ? spec.scalars.size() : 0];  // absent: scalars[0], not read
    [encoder setBuffer:decay.buffer offset:decay.offset atIndex:spec.decay.index];
    const MetalSlice& scale_bound = scaled ? scale_slice : scalar_slices[0];  // absent: not read
    const MetalSlice& found_bound = scaled ? found_slice : scalar_slices[0];
    [encoder setBuffer:scale_bound.buffer offset:scale_bound.offset atIndex:spec.scale.index];
    [encoder setBuffer:found_bound.buffer offset:found_bound.offset atIndex:spec.found.index];
    for (int i = 0; i < n; ++i) {
      // Nothing is dispatched for an empty variable.
      DispatchChunked1D(encoder, pipeline, TF_TensorElementCount(grads[i].get()), element_size,
                        [&](NSUInteger offset, uint32_t count) {
        for (size_t s = 0; s < spec.slots.size(); ++s) {
          const int g = group[s] >= 0 ? group[s] : group[spec.slots[s].placeholder];
          const MetalSlice& slot = var_slices[g * n + i];
          [encoder setBuffer:slot.buffer offset:slot.offset + offset atIndex:spec.slots[s].index];
        }
        const MetalSlice& grad = grad_slices[i];
        [encoder setBuffer:grad.buffer offset:grad.offset + offset atIndex:spec.grad.index];
        words[0] = count;
        [encoder setBytes:words.data() length:words.size() * sizeof(uint32_t) atIndex:spec.params.index];
      });
    }
  });
}

// Registers the op's GPU kernel for float, half and bfloat16, if the spec's
// params match the kernel's struct.
template <const Spec& S>
void Register() {
  if (S.params_size != (1 + S.flags.size()) * sizeof(uint32_t)) {
    RecordNotRegistered(S.op, "internal error: the host's params do not match the kernel's struct");
    return;
  }
  RegisterFloatKernels<Kernel, &Run>(S.op, &Create<S>);
}

}  // namespace multi_tensor_metal
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_MULTI_TENSOR_METAL_H_
