// norm_metal.h: the host code the Metal kernels of the ops that normalize
// over the last axis share (layer_norm_metal.mm, rms_norm_metal.mm): the
// epsilon attr, rows and channels of x with the kernels' 32-bit limits, and
// the encoding of their passes with the geometry of dispatch_geometry.h:
//   forward   one threadgroup per row (NormRowThreads);
//   gradient  the parameter gradients first, one threadgroup per block of
//             `columns` columns over all rows (NormParamGrad*), then dx, one
//             threadgroup per row, in one compute encoder (both only read dy
//             and x); dx is skipped when there are no rows.
// Each .mm keeps what is its own: its inputs, outputs and buffer bindings
// (the `bind` callbacks). Objective-C++ with ARC, macOS arm64 only;
// header-only (inline).
#ifndef TFMETAL_METAL_NORM_METAL_H_
#define TFMETAL_METAL_NORM_METAL_H_

#include "metal/metal_helper.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "metal/dispatch_geometry.h"
#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_status.h"
#include "tfmetal/host_checks.h"

namespace tfmetal_ext {
namespace norm_metal {

// The attrs of a norm op: the forward op's epsilon (0 for the gradient op).
struct NormKernel {
  float epsilon;
};

// Create function of the forward op: epsilon must be finite and > 0.
inline void* CreateForward(TF_OpKernelConstruction* ctx) {
  StatusPtr status(TF_NewStatus());
  float epsilon = 0.0f;
  TF_OpKernelConstruction_GetAttrFloat(ctx, "epsilon", &epsilon, status.get());
  if (Ok(status.get()) && !(std::isfinite(epsilon) && epsilon > 0.0f)) {
    SetStatus(status.get(), TF_INVALID_ARGUMENT, "epsilon must be finite and > 0, got " + std::to_string(epsilon));
  }
  return NewKernelOrFail(ctx, status.get(), NormKernel{epsilon});
}

// Create function of the gradient op (no attrs besides T).
inline void* CreateGrad(TF_OpKernelConstruction*) { return new NormKernel{0.0f}; }

// rows (product of all but the last dimension) and C of x, as the CPU kernel
// defines them (tfmetal/host_checks.h); errors for rank 0 and for sizes the
// kernels cannot index.
inline bool RowsAndChannels(const std::vector<int64_t>& dims, int64_t* rows, int64_t* channels, TF_Status* status) {
  const std::string error = NormRowsAndChannels(dims.data(), static_cast<int>(dims.size()), rows, channels);
  if (!error.empty()) {
    SetStatus(status, TF_INVALID_ARGUMENT, error);
    return false;
  }
  if (*rows > kMaxDimension || *channels > kMaxDimension) {
    SetStatus(status, TF_INVALID_ARGUMENT,
              "x of shape " + ShapeString(dims) + " is too large for the Metal kernel (rows and the last dimension "
              "must each be < 2^31)");
    return false;
  }
  return true;
}

// The inputs 0..count) of the op; false with `status` set on failure.
inline bool Inputs(TF_OpKernelContext* ctx, int count, std::vector<TensorPtr>* in, TF_Status* status) {
  in->resize(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    (*in)[i] = Input(ctx, i, status);
    if (!Ok(status)) return false;
  }
  return true;
}

// The forward pass: `bind(encoder)` binds the buffers and the params, then
// one threadgroup per row (rows > 0: the caller returns before otherwise).
template <class Bind>
void EncodeForward(TF_OpKernelContext* ctx, const MetalLibrarySource& library, const std::string& name,
                   uint32_t rows, uint32_t channels, TF_Status* status, Bind&& bind) {
  EncodeKernel(ctx, library, name.c_str(), status,
               [&](id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> pipeline) {
                 bind(encoder);
                 DispatchRows(encoder, rows,
                              geometry::NormRowThreads(pipeline.threadExecutionWidth,
                                                       pipeline.maxTotalThreadsPerThreadgroup, channels,
                                                       geometry::kNormMaxRowThreads));
               });
}

// The gradient's two passes in one encoder (channels > 0: the caller
// returns before otherwise): `bind_param(encoder)` then the parameter
// gradients over ceil(C / columns) threadgroups; if rows > 0,
// `bind_dx(encoder)` then dx, one threadgroup per row. Both pipelines are
// built before anything is encoded: a failure leaves the encoder empty.
template <class BindParam, class BindDx>
void EncodeGrad(TF_OpKernelContext* ctx, const MetalLibrarySource& library, const std::string& param_name,
                const std::string& dx_name, uint32_t rows, uint32_t channels, uint32_t columns, TF_Status* status,
                BindParam&& bind_param, BindDx&& bind_dx) {
  EncodeKernel(
      ctx, library, param_name.c_str(), status,
      [&](id<MTLComputeCommandEncoder> encoder, id<MTLComputePipelineState> param_pipeline) {
        id<MTLComputePipelineState> dx_pipeline = nil;
        if (rows > 0) {
          dx_pipeline = PipelineCache::Global().Pipeline(param_pipeline.device, library, dx_name.c_str(), status);
          if (dx_pipeline == nil) return;
        }
        bind_param(encoder);
        DispatchRows(encoder, geometry::NormParamGradGroups(channels, columns),
                     geometry::NormParamGradThreads(param_pipeline.threadExecutionWidth,
                                                    param_pipeline.maxTotalThreadsPerThreadgroup, rows, columns,
                                                    geometry::kNormMaxRowThreads));
        if (rows == 0) return;
        [encoder setComputePipelineState:dx_pipeline];
        bind_dx(encoder);
        DispatchRows(encoder, rows,
                     geometry::NormRowThreads(dx_pipeline.threadExecutionWidth,
                                              dx_pipeline.maxTotalThreadsPerThreadgroup, channels,
                                              geometry::kNormMaxRowThreads));
      });
}

}  // namespace norm_metal
}  // namespace tfmetal_ext

#endif  // TFMETAL_METAL_NORM_METAL_H_
