"""A kernel registered through TensorFlow's C++ kernel API reaches a resource variable.

The finding this backs: docs/findings/cpp_kernel_api_resource_variables.md.

On TF 2.21 no binary exports the kernel C API's resource-variable functions (TF_GetInputTensorFromVariable,
...), so the open tensorflow-metal-plugin registers no ResourceApply* kernel. TensorFlow implements those
functions (tensorflow/c/kernels_experimental.cc) with its C++ API: LookupResource of the input's handle,
the Var's mutex and tensor. This test builds a small C++ op library against the installed TensorFlow and
shows, on the CPU device, that a REGISTER_KERNEL_BUILDER kernel does the same with the symbols TF 2.21
exports: it looks the variable up, locks it, copies on write when a reader still holds its buffer, and
updates it in place, eagerly and in a tf.function; and that TF_GetStream, called with the C++ kernel's
context, takes the branch it takes for any device (here the CPU's: no stream), the one that returns the
SP_Stream on a PluggableDevice. What only a Mac can confirm is in the findings document.
"""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.ops import _cpp_library

pytestmark = [pytest.mark.no_keras, pytest.mark.full]

SOURCE = r"""
#include <string>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tensorflow {
namespace {

REGISTER_OP("TfmetalExtTestAddToVariable")
    .Input("var: resource")
    .Input("delta: float")
    .Output("stream_status: string")
    .SetShapeFn(shape_inference::ScalarShape);

// var += delta, in place, as a ResourceApply* kernel updates its variable; outputs what TF_GetStream said.
class AddToVariable : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    mutex_lock lock(*var->mu());
    const Tensor& delta = ctx->input(1);
    Tensor* value = var->tensor();
    OP_REQUIRES(ctx, var->is_initialized && value->dtype() == DT_FLOAT && value->shape() == delta.shape(),
                errors::InvalidArgument("var ", value->DebugString(), " does not match delta ", delta.DebugString()));
    if (!value->RefCountIsOne() || var->copy_on_read_mode.load()) {
      // A reader still holds the buffer: update a copy (TensorFlow's PrepareToUpdateVariable does the same).
      Tensor copy;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DT_FLOAT, delta.shape(), &copy));
      copy.flat<float>() = value->flat<float>();
      *value = copy;
    }
    auto v = value->flat<float>();
    auto d = delta.flat<float>();
    for (int64_t i = 0; i < v.size(); ++i) v(i) += d(i);
    // The C API's TF_OpKernelContext is this OpKernelContext (tensorflow/c/kernels.cc casts it back).
    TF_Status* status = TF_NewStatus();
    SP_Stream stream = TF_GetStream(reinterpret_cast<TF_OpKernelContext*>(ctx), status);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tstring>()() = std::to_string(TF_GetCode(status)) + "|" + TF_Message(status) + "|" +
                               (stream != nullptr ? "stream" : "none");
    TF_DeleteStatus(status);
  }
};

REGISTER_KERNEL_BUILDER(Name("TfmetalExtTestAddToVariable").Device(DEVICE_CPU), AddToVariable);

}  // namespace
}  // namespace tensorflow
"""

# What TF_GetInputTensorFromVariable and its siblings would need, and what the C++ path uses instead.
C_VARIABLE_API = ("TF_GetInputTensorFromVariable", "TF_MaybeLockVariableInputMutexesInOrder",
                  "TF_ReleaseVariableInputLockHolder", "TF_AssignRefVariable", "TF_AssignVariable",
                  "TF_AssignUpdateVariable", "TF_OpKernelContext_ForwardRefInputToRefOutput")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    path = _cpp_library.build(tmp_path_factory.mktemp("cpp_variable"), "add_to_variable", SOURCE)
    return path, tf.load_op_library(str(path))


def test_a_cpp_kernel_updates_a_resource_variable_in_place(library):
    _, lib = library
    v = tf.Variable([1.0, 2.0])
    held = v.read_value()  # shares the variable's buffer: the kernel must copy before writing
    lib.tfmetal_ext_test_add_to_variable(v.handle, tf.constant([10.0, 20.0]))
    np.testing.assert_array_equal(v.numpy(), [11.0, 22.0])
    np.testing.assert_array_equal(held.numpy(), [1.0, 2.0])

    @tf.function
    def step(delta):
        lib.tfmetal_ext_test_add_to_variable(v.handle, delta)
        return v.read_value()

    np.testing.assert_array_equal(step(tf.constant([100.0, 200.0])).numpy(), [111.0, 222.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not match delta"):
        lib.tfmetal_ext_test_add_to_variable(v.handle, tf.constant([1.0]))


def test_tf_get_stream_takes_the_cpp_kernels_context(library):
    _, lib = library
    code, message, stream = lib.tfmetal_ext_test_add_to_variable(
        tf.Variable([0.0]).handle, tf.constant([1.0])).numpy().decode().split("|")
    # The CPU device's branch of TF_GetStream (no device context); a PluggableDevice's returns its SP_Stream.
    assert (int(code), message, stream) == (9, "Accessing device stream is not supported for a CPU device.", "none")


def test_the_cpp_path_needs_only_exported_symbols_and_the_c_path_has_none(library):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed: the symbol tables cannot be listed")
    path, _ = library
    lib_dir = Path(tf.sysconfig.get_lib())
    binaries = [p for p in [lib_dir / "libtensorflow_framework.so.2", lib_dir / "libtensorflow_cc.so.2",
                            lib_dir / "python" / "_pywrap_tensorflow_internal.so"] if p.exists()]
    exported = set()
    for binary in binaries:
        listing = subprocess.run([nm, "-D", "--defined-only", str(binary)], capture_output=True, text=True).stdout
        exported |= {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}
    for name in C_VARIABLE_API:
        assert name not in exported, name  # tensorflow/tensorflow#126374
    assert "TF_GetStream" in exported
    listing = subprocess.run([nm, "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
    needed = {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}
    ours = {s for s in needed if s.startswith(("_ZN10tensorflow", "_ZNK10tensorflow", "_ZTIN10tensorflow",
                                               "_ZN3tsl", "TF_"))}
    # LookupResource<Var>: HandleFromInput, internal::ValidateDevice, ResourceMgr::DoLookup, typeinfo of Var.
    for key in ("15HandleFromInput", "8internal14ValidateDevice", "11ResourceMgr8DoLookup", "_ZTIN10tensorflow3VarE"):
        assert any(key in s for s in ours), key
    assert ours <= exported, sorted(ours - exported)
