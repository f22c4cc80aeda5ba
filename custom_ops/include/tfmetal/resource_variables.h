// Resource variables reached through TensorFlow's C++ kernel API: what every
// kernel of ours that updates a tf.Variable shares, on any device.
//
// Users: the CPU kernels of the multi-tensor optimizer ops
// (custom_ops/cpu/multi_tensor_common.h), their Metal kernels
// (custom_ops/metal/multi_tensor_metal.h) and the Metal gap kernels of
// AssignVariableOp / AssignAddVariableOp / AssignSubVariableOp
// (custom_ops/metal/gap_variable_metal.mm). Each passes a CopyFn, the one
// device-specific step: copying a variable's buffer into a new one on its
// device (the CPU: memcpy; Metal: a blit on the op's stream).
//
// Why the C++ API. TensorFlow's kernel C API reaches variables only through
// the functions of tensorflow/c/kernels_experimental.h
// (TF_GetInputTensorFromVariable, TF_MaybeLockVariableInputMutexesInOrder,
// ...), which TF 2.20 and 2.21 declare but no binary of theirs exports
// (tensorflow/tensorflow#126374). TensorFlow implements them with the C++
// calls used here (LookupResource of the input's handle, Var::mu(),
// Var::tensor()), and those are exported by libtensorflow_framework on Linux
// and macOS, 2.19 and 2.21 alike (docs/findings/cpp_kernel_api_resource_variables.md).
// A C API kernel's TF_OpKernelContext is TensorFlow's OpKernelContext
// (tensorflow/c/kernels.cc casts between them), so a kernel registered through
// the C API calls these with reinterpret_cast<OpKernelContext*>(ctx).
//
// The rules are TensorFlow's own (resource_variable_ops.cc,
// training_op_helpers.h), restated:
// - locks: exclusive, on every variable an op updates, taken in address order
//   (the order of TF's training kernels, so no deadlock with them);
// - copy-on-write: before an in-place update, a buffer still shared with a
//   pending read (its refcount is not one), or any buffer of a variable in
//   copy-on-read mode (a variable read sparsely), is replaced by a copy;
// - AssignVariableOp never copies the value: the variable takes the value's
//   buffer (every writer copies on write, so sharing it is safe), except in
//   copy-on-read mode, where it takes a private copy; it creates the variable
//   when the handle has none yet (a variable's first assignment);
// - errors: TensorFlow's messages, checked against TensorFlow's own kernels by
//   tests/ops/test_cpp_kernel_resource_variable.py.
#ifndef TFMETAL_RESOURCE_VARIABLES_H_
#define TFMETAL_RESOURCE_VARIABLES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tfmetal_ext {
namespace variables {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::Var;
using Status = ::absl::Status;

// An error status with TensorFlow's code and the message of `parts`
// (strings and integers), built without TensorFlow's deprecated errors::
// helpers.
inline std::string Piece(const std::string& s) { return s; }
inline std::string Piece(const char* s) { return s; }
template <typename Int, typename = std::enable_if_t<std::is_integral<Int>::value>>
inline std::string Piece(Int v) {
  return std::to_string(v);
}
template <typename... Parts>
Status Error(absl::StatusCode code, const Parts&... parts) {
  std::string message;
  ((message += Piece(parts)), ...);
  return Status(code, message);
}
inline constexpr absl::StatusCode kInvalidArgument = absl::StatusCode::kInvalidArgument;

// Copies the bytes of `from` into `to`, a new tensor of the same dtype and
// shape on the op's device, ordered before anything the op writes later.
using CopyFn = std::function<Status(OpKernelContext* ctx, const Tensor& from, Tensor* to)>;

// The CPU's CopyFn (the buffers are host memory).
inline Status HostCopy(OpKernelContext*, const Tensor& from, Tensor* to) {
  if (from.TotalBytes() > 0) {
    std::memcpy(const_cast<char*>(to->tensor_data().data()), from.tensor_data().data(), from.TotalBytes());
  }
  return Status();
}

// Exclusive locks on a set of distinct variables, acquired in address order
// and released in reverse order.
class ExclusiveLocks {
 public:
  explicit ExclusiveLocks(std::vector<Var*> vars) : vars_(std::move(vars)) {
    std::sort(vars_.begin(), vars_.end(), [](Var* a, Var* b) { return a->mu() < b->mu(); });
    for (Var* var : vars_) var->mu()->lock();
  }
  ~ExclusiveLocks() {
    for (auto it = vars_.rbegin(); it != vars_.rend(); ++it) (*it)->mu()->unlock();
  }
  ExclusiveLocks(const ExclusiveLocks&) = delete;
  ExclusiveLocks& operator=(const ExclusiveLocks&) = delete;

 private:
  std::vector<Var*> vars_;
};

// A private buffer of `tensor`'s dtype and shape, allocated as TensorFlow
// allocates a variable's copy (GPU- and NIC-compatible), filled by `copy`.
inline Status CopyToNewBuffer(OpKernelContext* ctx, const Tensor& tensor, const CopyFn& copy, Tensor* out) {
  ::tensorflow::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor.dtype(), tensor.shape(), out, attr));
  return copy(ctx, tensor, out);
}

// Copy-on-write before an in-place update (TensorFlow's
// PrepareToUpdateVariable for a dense dtype). Requires the variable's lock.
inline Status PrepareToUpdate(OpKernelContext* ctx, Var* var, const CopyFn& copy) {
  Tensor* tensor = var->tensor();
  if (!var->copy_on_read_mode.load() && tensor->RefCountIsOne()) return Status();
  Tensor fresh;
  TF_RETURN_IF_ERROR(CopyToNewBuffer(ctx, *tensor, copy, &fresh));
  *tensor = fresh;
  return Status();
}

// The resource inputs of a multi-tensor op: `groups` groups of n variables,
// named names[0..groups) ("var", "m", ...), then n gradients.
struct Layout {
  const char* op;                  // "MultiTensorAdam", for error messages
  std::vector<const char*> names;  // every group the op can have ("var", "m", "v", "vhat")
  int groups = 0;                  // groups present in this op instance (<= names.size())
  int n = 0;

  int num_resources() const { return groups * n; }
  int grad_start() const { return groups * n; }
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

// The variables of one multi-tensor op call, looked up, checked and locked.
// Acquire() validates everything before any variable is written, so an error
// leaves every variable unchanged: distinct variables, initialized, of dtype
// `dtype`, every slot of variable i of grad[i]'s shape; then it makes each
// buffer private (copy-on-write, through `copy`). The locks are held until
// destruction.
class LockedVariables {
 public:
  Status Acquire(OpKernelContext* ctx, const Layout& layout, ::tensorflow::DataType dtype, const CopyFn& copy) {
    const int num_resources = layout.num_resources();
    const int n = layout.n;
    n_ = n;
    refs_.resize(num_resources);
    // Look up every variable; refuse one passed twice (the update is not
    // sequential, so aliasing inputs would race).
    std::vector<std::pair<Var*, int>> by_address(num_resources);
    for (int i = 0; i < num_resources; ++i) {
      Status s = ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, i), &refs_[i]);
      if (!s.ok()) {
        return Status(s.code(),
                      std::string(s.message()) + "\n\t(" + layout.op + " input " + layout.InputName(i) + ")");
      }
      by_address[i] = {refs_[i].get(), i};
    }
    std::sort(by_address.begin(), by_address.end());
    for (int i = 1; i < num_resources; ++i) {
      if (by_address[i].first == by_address[i - 1].first) {
        return Error(kInvalidArgument, "the same variable is passed as ", layout.InputName(by_address[i - 1].second),
                                       " and ", layout.InputName(by_address[i].second), "; every ",
                                       JoinNames(layout.names, layout.names.size()),
                                       " must be a distinct variable");
      }
    }

    std::vector<Var*> raw(num_resources);
    for (int i = 0; i < num_resources; ++i) raw[i] = refs_[i].get();
    locks_ = std::make_unique<ExclusiveLocks>(std::move(raw));

    for (int i = 0; i < num_resources; ++i) {
      const Tensor* t = refs_[i]->tensor();
      if (!t->IsInitialized()) {
        return Error(absl::StatusCode::kFailedPrecondition, "Attempting to use uninitialized variables: ", layout.InputName(i));
      }
      if (t->dtype() != dtype) {
        return Error(kInvalidArgument, layout.InputName(i), " has dtype ", ::tensorflow::DataTypeString(t->dtype()),
                                       " but T is ", ::tensorflow::DataTypeString(dtype),
                                       "; all variables of one call must share the dtype T");
      }
    }
    offsets_.assign(n + 1, 0);
    for (int i = 0; i < n; ++i) {
      const Tensor& grad = ctx->input(layout.grad_start() + i);
      bool same = true;
      for (int g = 0; g < layout.groups; ++g) same = same && tensor(g, i)->shape().IsSameSize(grad.shape());
      if (!same) {
        std::string shapes;
        for (int g = 0; g < layout.groups; ++g) {
          shapes += std::string(layout.names[g]) + " " + tensor(g, i)->shape().DebugString() + ", ";
        }
        shapes += "grad " + grad.shape().DebugString();
        std::vector<const char*> checked(layout.names.begin(), layout.names.begin() + layout.groups);
        checked.push_back("grad");
        return Error(kInvalidArgument, "variable ", i, ": ", JoinNames(checked, checked.size()),
                                       " must have the same shape, got ", shapes);
      }
      offsets_[i + 1] = offsets_[i] + grad.NumElements();
    }

    for (int i = 0; i < num_resources; ++i) TF_RETURN_IF_ERROR(PrepareToUpdate(ctx, refs_[i].get(), copy));
    return Status();
  }

  // Slot `group` of variable i (group 0: the variable itself).
  Tensor* tensor(int group, int i) const { return refs_[group * n_ + i]->tensor(); }
  // Resource input `index` (group-major: var[0..n), m[0..n), ...).
  Tensor* resource(int index) const { return refs_[index]->tensor(); }

  template <typename T>
  T* data(int group, int i) const {
    return tensor(group, i)->template flat<T>().data();
  }

  // offsets()[i]: the index of variable i's first element in the one index
  // space over all variables; offsets()[n] is the total.
  const std::vector<int64_t>& offsets() const { return offsets_; }

 private:
  std::vector<::tensorflow::core::RefCountPtr<Var>> refs_;
  std::unique_ptr<ExclusiveLocks> locks_;
  std::vector<int64_t> offsets_;
  int n_ = 0;
};

// AssignAddVariableOp / AssignSubVariableOp(resource, value): the variable,
// looked up, locked (until destruction), checked against `value` with
// TensorFlow's messages, and private (copy-on-write). The caller then updates
// tensor() in place.
class VariableForUpdate {
 public:
  Status Acquire(OpKernelContext* ctx, const CopyFn& copy) {
    TF_RETURN_IF_ERROR(::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 0), &var_));
    const Tensor& value = ctx->input(1);
    lock_ = std::make_unique<ExclusiveLocks>(std::vector<Var*>{var_.get()});
    Tensor* tensor = var_->tensor();
    if (!tensor->shape().IsSameSize(value.shape())) {
      return Error(kInvalidArgument, "Cannot update variable with shape ", tensor->shape().DebugString(),
                                     " using a Tensor with shape ", value.shape().DebugString(),
                                     ", shapes must be equal.");
    }
    if (tensor->dtype() != value.dtype()) {
      return Error(kInvalidArgument, "DType of variable handle and value does not match.");
    }
    return PrepareToUpdate(ctx, var_.get(), copy);
  }

  Tensor* tensor() const { return var_->tensor(); }

 private:
  ::tensorflow::core::RefCountPtr<Var> var_;
  std::unique_ptr<ExclusiveLocks> lock_;
};

// AssignVariableOp(resource, value) with attrs dtype and validate_shape:
// the whole kernel. `copy` runs only for a variable in copy-on-read mode.
inline Status AssignVariable(OpKernelContext* ctx, ::tensorflow::DataType dtype, bool validate_shape,
                             const CopyFn& copy) {
  const Tensor& value = ctx->input(1);
  if (value.dtype() != dtype) {
    return Error(kInvalidArgument, "Variable and value dtypes don't match; respectively, ",
                                   ::tensorflow::DataTypeString(dtype), " and ",
                                   ::tensorflow::DataTypeString(value.dtype()));
  }
  ::tensorflow::core::RefCountPtr<Var> var;
  TF_RETURN_IF_ERROR(::tensorflow::LookupOrCreateResource<Var>(
      ctx, ::tensorflow::HandleFromInput(ctx, 0), &var, [dtype, &value](Var** ptr) {
        // The handle's first assignment: the new variable holds the value.
        *ptr = new Var(dtype);
        *(*ptr)->tensor() = value;
        (*ptr)->is_initialized = true;
        return Status();
      }));
  ExclusiveLocks lock(std::vector<Var*>{var.get()});
  Tensor* tensor = var->tensor();
  // An uninitialized variable with no dtype yet may take any (as TensorFlow allows).
  if (!(tensor->dtype() == ::tensorflow::DT_INVALID && !var->is_initialized) && tensor->dtype() != dtype) {
    return Error(kInvalidArgument, "Trying to assign variable with wrong dtype. Expected ",
                                   ::tensorflow::DataTypeString(tensor->dtype()), " got ",
                                   ::tensorflow::DataTypeString(dtype));
  }
  if (validate_shape && var->is_initialized && !tensor->shape().IsSameSize(value.shape())) {
    return Error(kInvalidArgument, "Trying to assign to variable with tensor with wrong shape. Expected ",
                                   tensor->shape().DebugString(), " got ", value.shape().DebugString());
  }
  if (var->copy_on_read_mode.load()) {
    Tensor fresh;
    TF_RETURN_IF_ERROR(CopyToNewBuffer(ctx, value, copy, &fresh));
    *tensor = fresh;
  } else {
    *tensor = value;
  }
  var->is_initialized = true;
  return Status();
}

}  // namespace variables
}  // namespace tfmetal_ext

#endif  // TFMETAL_RESOURCE_VARIABLES_H_
