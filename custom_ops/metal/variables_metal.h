// variables_metal.h: the Metal side of reaching resource variables through
// TensorFlow's C++ kernel API (tfmetal/resource_variables.h holds the rest,
// shared with the CPU kernels and tested there). Used by the multi-tensor
// optimizer kernels (multi_tensor_metal.h) and the AssignVariableOp /
// AssignAddVariableOp / AssignSubVariableOp gap kernels
// (gap_variable_metal.mm). Objective-C++ with ARC, macOS arm64 only;
// header-only (inline).
//
// Our kernels are registered through the C API, and a TF_OpKernelContext is
// TensorFlow's OpKernelContext (tensorflow/c/kernels.cc casts between the
// two), so Cc() hands the C++ calls the same context. What is Metal here:
// - CopyOnStream, the CopyFn of copy-on-write: allocate_temp gives the new
//   buffer from the device's allocator (the plugin's, or Apple's), and a blit
//   on the op's stream copies the old one into it, ordered before the update
//   the op encodes next on the same stream;
// - Slice: a variable tensor's buffer and offset (ResolveData of its data
//   pointer, which is what TF_TensorData returns for the same tensor);
// - FromStatus / SetFrom: between absl::Status and TF_Status.
#ifndef TFMETAL_METAL_VARIABLES_METAL_H_
#define TFMETAL_METAL_VARIABLES_METAL_H_

#include "metal/metal_helper.h"

#include <string>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_status.h"
#include "tfmetal/resource_variables.h"

namespace tfmetal_ext {
namespace variables_metal {

inline ::tensorflow::OpKernelContext* Cc(TF_OpKernelContext* ctx) {
  return reinterpret_cast<::tensorflow::OpKernelContext*>(ctx);
}

// `status` (a TF_Status) as an absl::Status.
inline variables::Status FromStatus(const TF_Status* status) {
  if (Ok(status)) return variables::Status();
  return variables::Status(static_cast<absl::StatusCode>(TF_GetCode(status)), TF_Message(status));
}

// Sets `status` from `s`; true when `s` is OK.
inline bool SetFrom(const variables::Status& s, TF_Status* status) {
  if (s.ok()) return true;
  SetStatus(status, static_cast<TF_Code>(s.code()), std::string(s.message()));
  return false;
}

// Where variable tensor `tensor` (named `name` in messages) lives.
inline bool Slice(const ::tensorflow::Tensor& tensor, const std::string& name, MetalSlice* slice, TF_Status* status) {
  return ResolveData(tensor.tensor_data().data(), tensor.TotalBytes(), name.c_str(), slice, status);
}

// The CopyFn of copy-on-write on a Metal device (see the top of the file).
inline variables::Status CopyOnStream(::tensorflow::OpKernelContext* cc, const ::tensorflow::Tensor& from,
                                      ::tensorflow::Tensor* to) {
  const NSUInteger bytes = from.TotalBytes();
  if (bytes == 0) return variables::Status();
  TF_OpKernelContext* ctx = reinterpret_cast<TF_OpKernelContext*>(cc);
  StatusPtr status(TF_NewStatus());
  MetalStream stream = GetMetalStream(ctx, status.get());
  if (!stream) return FromStatus(status.get());
  MetalSlice source, dest;
  if (!Slice(from, "a variable's tensor", &source, status.get()) ||
      !Slice(*to, "a variable's copy-on-write copy", &dest, status.get())) {
    return FromStatus(status.get());
  }
  TF_Status* raw_status = status.get();
  internal::Submit(stream, "variable copy-on-write", raw_status, ^(id<MTLCommandBuffer> command_buffer) {
    id<MTLBlitCommandEncoder> blit = [command_buffer blitCommandEncoder];
    if (blit == nil) {
      SetStatus(raw_status, TF_INTERNAL, "could not create a blit encoder for a variable's copy-on-write copy");
      return;
    }
    [blit copyFromBuffer:source.buffer sourceOffset:source.offset toBuffer:dest.buffer destinationOffset:dest.offset
                    size:bytes];
    [blit endEncoding];
  });
  return FromStatus(status.get());
}

}  // namespace variables_metal
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_VARIABLES_METAL_H_
