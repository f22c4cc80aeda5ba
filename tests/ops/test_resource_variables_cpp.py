"""custom_ops/include/tfmetal/resource_variables.h against TensorFlow's own variable kernels, on the CPU.

The Metal gap kernels of AssignVariableOp / AssignAddVariableOp / AssignSubVariableOp
(custom_ops/metal/gap_variable_metal.mm) and the Metal multi-tensor optimizer kernels reach variables through
this header's C++ code; only the copy of copy-on-write (a blit) and the update's dispatch are Metal. Neither
runs here, so this test builds a small op library whose CPU kernels run the same header with the CPU's copy
(variables::HostCopy) and the same update math (tfmetal/gap_variable.h), and checks them against
TensorFlow's kernels on the same variables: the values bit for bit for every dtype the gap kernels register
(float32, float16, bfloat16, int64: signed zeros, subnormals, infinities, NaN, wrap-around), every error
(text and type), copy-on-write when a read still holds the buffer, the first assignment that creates a
variable, validate_shape, and copy-on-read mode (a variable read sparsely gets a private copy).
The CPU kernels of the multi-tensor ops use the header's LockedVariables (tests/ops/test_multi_tensor_*.py).
"""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.ops import _cpp_library

pytestmark = [pytest.mark.no_keras, pytest.mark.full]

ROOT = Path(__file__).resolve().parents[2]

SOURCE = r"""
#include <cstdint>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tfmetal/gap_variable.h"
#include "tfmetal/resource_variables.h"

namespace tensorflow {
namespace {

namespace v = ::tfmetal_ext::variables;

REGISTER_OP("TfmetalExtTestAssignVariable")
    .Input("resource: resource")
    .Input("value: dtype")
    .Output("aliased: bool")
    .Attr("dtype: type")
    .Attr("validate_shape: bool = false")
    .SetShapeFn(shape_inference::ScalarShape);

REGISTER_OP("TfmetalExtTestAssignUpdateVariable")
    .Input("resource: resource")
    .Input("value: dtype")
    .Attr("dtype: type")
    .Attr("subtract: bool = false")
    .SetShapeFn(shape_inference::NoOutputs);

// AssignVariableOp through the header; `aliased`: whether the variable now holds the value's own buffer.
class AssignVariable : public OpKernel {
 public:
  explicit AssignVariable(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(c, c->GetAttr("validate_shape", &validate_shape_));
  }
  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, v::AssignVariable(ctx, dtype_, validate_shape_, &v::HostCopy));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    const Tensor& value = ctx->input(1);
    out->scalar<bool>()() = value.TotalBytes() > 0 && var->tensor()->tensor_data().data() == value.tensor_data().data();
  }

 private:
  DataType dtype_;
  bool validate_shape_ = false;
};

// AssignAddVariableOp / AssignSubVariableOp through the header and the gap kernels' math.
template <typename T>
class AssignUpdate : public OpKernel {
 public:
  explicit AssignUpdate(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("subtract", &subtract_));
  }
  void Compute(OpKernelContext* ctx) override {
    v::VariableForUpdate var;
    OP_REQUIRES_OK(ctx, var.Acquire(ctx, &v::HostCopy));
    auto out = var.tensor()->flat<T>();
    auto in = ctx->input(1).flat<T>();
    const uint32_t op = subtract_ ? TFM_GAP_VARIABLE_SUB : TFM_GAP_VARIABLE_ADD;
    for (int64_t i = 0; i < out.size(); ++i) out(i) = tfm_assign_update<T>(op, out(i), in(i));
  }

 private:
  bool subtract_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TfmetalExtTestAssignVariable").Device(DEVICE_CPU), AssignVariable);
#define REGISTER(T) \
  REGISTER_KERNEL_BUILDER(Name("TfmetalExtTestAssignUpdateVariable").Device(DEVICE_CPU).TypeConstraint<T>("dtype"), \
                          AssignUpdate<T>);
REGISTER(float)
REGISTER(Eigen::half)
REGISTER(Eigen::bfloat16)
REGISTER(int64_t)
#undef REGISTER

}  // namespace
}  // namespace tensorflow
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = _cpp_library.build(tmp_path_factory.mktemp("resource_variables"), "resource_variable_ops", SOURCE,
                              include_dirs=[ROOT / "custom_ops" / "include"])
    return tf.load_op_library(str(path))


DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "int64": tf.int64}


def _specials(name):
    if name == "int64":
        i = np.iinfo(np.int64)
        a = np.array([i.max, i.min, i.min, -1, 0, 7, i.max, 12345678901], np.int64)
        b = np.array([1, -1, 1, i.min, 0, -9, i.max, -98765432109], np.int64)
        return a, b
    sub = {"float32": 1e-45, "float16": 6e-8, "bfloat16": 9.2e-41}[name]
    big = {"float32": 3.0e38, "float16": 65504.0, "bfloat16": 3.0e38}[name]
    a = np.array([-0.0, 0.0, -0.0, sub, -sub, np.inf, np.inf, -np.inf, np.nan, 1.0, big, 1.0, 3.0, 0.1], np.float32)
    b = np.array([0.0, -0.0, -0.0, sub, sub, -np.inf, 1.0, 5.0, 1.0, np.nan, big, 2.0 ** -9, 2.0 ** -8, 0.2],
                 np.float32)
    return a, b


def _bits(t):
    x = t.numpy() if hasattr(t, "numpy") else t
    if x.dtype.itemsize == 8:
        return x.view(np.uint64)
    return np.frombuffer(x.tobytes(), {2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("subtract", [False, True], ids=["add", "sub"])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_assign_update_is_tensorflows_bit_for_bit(lib, name, subtract):
    dtype = DTYPES[name]
    a, b = _specials(name)
    rng = np.random.default_rng(3)
    if name == "int64":
        ra, rb = (rng.integers(-2 ** 62, 2 ** 62, 500) for _ in range(2))
    else:
        ra, rb = (rng.standard_normal(500).astype(np.float32) * 100 for _ in range(2))
    a, b = np.concatenate([a, ra]), np.concatenate([b, rb])
    ours, theirs = tf.Variable(tf.constant(a, dtype)), tf.Variable(tf.constant(a, dtype))
    value = tf.constant(b, dtype)
    lib.tfmetal_ext_test_assign_update_variable(ours.handle, value, subtract=subtract)
    (tf.raw_ops.AssignSubVariableOp if subtract else tf.raw_ops.AssignAddVariableOp)(resource=theirs.handle,
                                                                                    value=value)
    got, want = ours.read_value(), theirs.read_value()
    if name == "int64":
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        return
    # NaN's sign is not a result: TensorFlow's own bfloat16 kernel gives inf + -inf a positive NaN in its
    # vectorized loop and x86's negative one in its scalar tail. Everything else, bit for bit.
    nan = np.isnan(tf.cast(want, tf.float32).numpy())
    np.testing.assert_array_equal(np.isnan(tf.cast(got, tf.float32).numpy()), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def test_assign_update_copies_on_write_and_works_in_a_function(lib):
    v = tf.Variable([1.0, 2.0])
    held = v.read_value()  # shares the buffer: the update must copy first
    lib.tfmetal_ext_test_assign_update_variable(v.handle, tf.constant([10.0, 20.0]))
    np.testing.assert_array_equal(v.numpy(), [11.0, 22.0])
    np.testing.assert_array_equal(held.numpy(), [1.0, 2.0])

    @tf.function
    def step(delta):
        lib.tfmetal_ext_test_assign_update_variable(v.handle, delta, subtract=True)
        return v.read_value()

    np.testing.assert_array_equal(step(tf.constant([1.0, 2.0])).numpy(), [10.0, 20.0])
    empty = tf.Variable(tf.zeros([0, 3]))
    lib.tfmetal_ext_test_assign_update_variable(empty.handle, tf.zeros([0, 3]))
    assert empty.shape == (0, 3)


def _error(fn):
    with pytest.raises(tf.errors.OpError) as info:
        fn()
    # Without the op's own name: "{{function_node __wrapped__<op>_device_...}} " and " [Op:<op>]".
    message = info.value.message.split("\n")[0].split(" [Op:")[0]
    return type(info.value), message.split("}} ", 1)[-1]


@pytest.mark.parametrize("case", ["shape", "dtype", "missing"])
def test_assign_update_errors_are_tensorflows(lib, case):
    def pair():
        if case == "missing":  # a handle whose variable was never created
            name = f"never_assigned_{np.random.default_rng().integers(1 << 30)}"
            return [tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], shared_name=name)] * 2, tf.constant([1.0, 2.0])
        return [tf.Variable([1.0, 2.0]).handle for _ in range(2)], (
            tf.constant([1.0]) if case == "shape" else tf.constant([1, 2], tf.int64))

    (h_ours, h_theirs), value = pair()
    ours = _error(lambda: lib.tfmetal_ext_test_assign_update_variable(h_ours, value))
    theirs = _error(lambda: tf.raw_ops.AssignAddVariableOp(resource=h_theirs, value=value))
    assert ours == theirs
    if case == "shape":
        assert ours[0] is tf.errors.InvalidArgumentError and "shapes must be equal" in ours[1]


def test_assign_variable_aliases_creates_and_validates_as_tensorflow(lib):
    v = tf.Variable([1.0, 2.0])
    value = tf.constant([5.0, 6.0])
    # The variable takes the value's buffer (TensorFlow's AssignVariableOp never copies it).
    assert bool(lib.tfmetal_ext_test_assign_variable(v.handle, value))
    np.testing.assert_array_equal(v.numpy(), [5.0, 6.0])
    # ...and a later in-place update copies on write: the value is untouched.
    lib.tfmetal_ext_test_assign_update_variable(v.handle, tf.constant([1.0, 1.0]))
    np.testing.assert_array_equal(value.numpy(), [5.0, 6.0])
    np.testing.assert_array_equal(v.numpy(), [6.0, 7.0])

    # A handle's first assignment creates its variable.
    name = f"created_{np.random.default_rng().integers(1 << 30)}"
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[3], shared_name=name)
    lib.tfmetal_ext_test_assign_variable(handle, tf.constant([1, 2, 3], tf.int64))
    np.testing.assert_array_equal(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64).numpy(), [1, 2, 3])

    # validate_shape=False lets the shape change; True refuses it with TensorFlow's message.
    lib.tfmetal_ext_test_assign_variable(v.handle, tf.constant([1.0, 2.0, 3.0]))
    assert tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32).shape == (3,)
    for validate in (True,):
        ours = _error(lambda: lib.tfmetal_ext_test_assign_variable(v.handle, tf.constant([1.0]),
                                                                   validate_shape=validate))
        theirs = _error(lambda: tf.raw_ops.AssignVariableOp(resource=v.handle, value=tf.constant([1.0]),
                                                            validate_shape=validate))
        assert ours == theirs and ours[0] is tf.errors.InvalidArgumentError
    # A value of another dtype than the variable's: TensorFlow's error.
    other = tf.Variable([1, 2], dtype=tf.int64)
    ours = _error(lambda: lib.tfmetal_ext_test_assign_variable(other.handle, tf.constant([1.0, 2.0])))
    theirs = _error(lambda: tf.raw_ops.AssignVariableOp(resource=other.handle, value=tf.constant([1.0, 2.0])))
    assert ours == theirs and "wrong dtype" in ours[1]


def test_assign_variable_copies_in_copy_on_read_mode(lib):
    v = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    # A sparse read puts the variable in copy-on-read mode (TensorFlow's EnsureSparseVariableAccess).
    tf.raw_ops.ResourceGather(resource=v.handle, indices=[1], dtype=tf.float32)
    value = tf.constant([[9.0, 8.0], [7.0, 6.0]])
    assert not bool(lib.tfmetal_ext_test_assign_variable(v.handle, value))  # a private copy
    np.testing.assert_array_equal(v.numpy(), value.numpy())
