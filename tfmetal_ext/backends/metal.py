"""Apple's tensorflow-metal PluggableDevice (1.2, TF <= 2.19).

Kernels (`KERNELS`, `GATED_KERNELS`, `HOST_MEMORY`, `TF_DEFAULT_KERNELS`):
generated from the plugin's own wheel by ``scripts/gen_metal_kernels.py``
into `tfmetal_ext.backends._metal_kernels`, which runs the plugin's
``TF_InitKernel`` on an arm64 emulator against recording stand-ins of TF's
kernel-builder C API. 1.2.0: 561 registrations of 184 ops on its ``GPU``
device with macOS 13 or later; ten stateless-random ops register only there
(they ask MPSGraph for its GRU API), so macOS 12 has 174 ops. The table is
complete: an op it does not list, and that TensorFlow's own
``DEVICE_DEFAULT`` kernels (of TF 2.19.1, which serve every pluggable
device) do not cover, has no kernel on that GPU. Among what it lacks:
``Einsum``, ``IsFinite``, ``StatelessRandomGetKeyCounter``, ``Pack`` /
``Unpack``, ``Elu``, ``LSTMBlockCell`` / ``BlockLSTM``; ``Sigmoid``,
``ZerosLike``, ``Fill`` and every ``ResourceApply*`` optimizer kernel are
float32 only; ``_FusedConv2D`` / ``_FusedMatMul`` are float32/half only,
though 93 ops have bfloat16 kernels.

Fusions: the plugin's own grappler optimizer ("Plugin optimizer for
device_type GPU is enabled"; patterns for contraction + bias (+ Relu, Relu6,
Elu, LeakyRelu) and for the optimizers Adam, AdamAMSGrad, SGD, KerasMomentum,
KerasNesterovMomentum, Adagrad and RMSprop), the kernel symbols of
tensorflow-metal 1.2.0 (macOS arm64 wheel, 2025-01-31), and user reports
(Apple Developer Forums, tensorflow/tensorflow issues) for the pairings and
the graph-mode ``relu(bias_add(matmul))`` miscompute. Not measured here: no
Mac on the project's machines.
"""

import types

from tfmetal_ext.backends import _metal_kernels as _generated
from tfmetal_ext.backends import fusion, gaps
from tfmetal_ext.backends._table import Fusion, backend, never
from tfmetal_ext.backends.fusion import CONTRACTION_ACTIVATION_OPS as ACTS

F32_F16 = ("float32", "float16")
_ALL_FLOAT = ("float32", "float16", "bfloat16")

MATMUL_RELU_NOTE = (
    "tensorflow-metal is reported to miscompute relu(bias_add(matmul)) in graph "
    "mode; check with `tfmetal-ext doctor --selftest`"
)

# Generated from the wheel: see the module docstring.
KERNELS = types.MappingProxyType(_generated.KERNELS)
DTYPE_ATTR = types.MappingProxyType(_generated.DTYPE_ATTR)
GATED_KERNELS = types.MappingProxyType(_generated.GATED_KERNELS)
HOST_MEMORY = types.MappingProxyType({op: types.MappingProxyType(by) for op, by in _generated.HOST_MEMORY.items()})
TF_DEFAULT_KERNELS = types.MappingProxyType(_generated.TF_DEFAULT_KERNELS)
# (what the gated kernels need, the oldest macOS that has it).
GATE = (_generated.GATE, _generated.GATE_MIN_MACOS)


def _registered(op):
    """The float dtypes `KERNELS` registers for `op`, in the order rows list them."""
    return tuple(d for d in _ALL_FLOAT if d in KERNELS.get(op, ()))


_BF16_FUSED = (
    "bfloat16 on Metal: tensorflow-metal has bfloat16 {op} and BiasAdd kernels but registers {fused} for "
    "float32/half only, so a bfloat16 chain runs unfused"
)

METAL = backend(
    "metal", "metal", "tensorflow-metal",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half (tensorflow-metal plugin remapper); no bfloat16",
            dtypes=_registered(fusion.FUSED_CONV2D), acts=ACTS,
            dtype_notes={"bfloat16": _BF16_FUSED.format(op="Conv2D", fused=fusion.FUSED_CONV2D)},
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half; relu(bias_add(matmul)) reported to miscompute "
            "in graph mode",
            dtypes=_registered(fusion.FUSED_MATMUL), acts=ACTS, note=MATMUL_RELU_NOTE,
            dtype_notes={"bfloat16": _BF16_FUSED.format(op="MatMul", fused=fusion.FUSED_MATMUL)},
        ),
        "matmul_bias_gelu": never("not fused"),
        "depthwise_bias_act": never("not fused", why_not="no fused depthwise kernel"),
        "conv2d_bias_add_relu": never("not fused", why_not="no Conv2D + BiasAdd + Add + Relu fusion"),
        "conv2d_batchnorm_act": never("not fused", why_not="Conv2D + FusedBatchNorm is fused only on CPU"),
        "batchnorm_act": Fusion(
            "float32/half (kernel present in tensorflow-metal)", dtypes=F32_F16, acts=("Relu",),
            requires_act=("Relu",),
        ),
        "batchnorm_grad_relugrad": never("not fused"),
        "custom_layer_norm": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_rms_norm": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_batch_norm_act": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16), training: batch norm + "
            "residual add + activation in one op each way (FusedBatchNormV3, Add, act and their gradients "
            "are separate kernels otherwise)",
            dtypes=_ALL_FLOAT,
        ),
        "custom_softshrink": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_activation_grad": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_sparse_softmax_cross_entropy": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_gemv": never(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16); not used by the layers here",
            why_not=fusion.GEMV_METAL_UNMEASURED,
        ),
        "custom_attention": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_dropout": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_int8_matmul": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_int8_conv2d": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "multi_tensor_adam": Fusion(
            "tfmetal_ext custom op with a Metal kernel (variables through TF's C++ kernel API)",
            dtypes=_ALL_FLOAT,
        ),
        "multi_tensor_lion": Fusion(
            "tfmetal_ext custom op with a Metal kernel (variables through TF's C++ kernel API)",
            dtypes=_ALL_FLOAT,
        ),
        "multi_tensor_rmsprop": Fusion(
            "tfmetal_ext custom op with a Metal kernel (variables through TF's C++ kernel API)",
            dtypes=_ALL_FLOAT,
        ),
        "cudnn_rnn": Fusion(
            "tensorflow-metal kernel: float32, float16, bfloat16; emitted as Keras emits it "
            "(batch-major, sequence_lengths)",
            dtypes=_registered(fusion.CUDNN_RNN),
        ),
    },
    kernels=KERNELS,
    kernels_complete=True,
    shared_kernels=TF_DEFAULT_KERNELS,
    dtype_attrs=DTYPE_ATTR,
    host_memory=HOST_MEMORY,
    gated_kernels=GATED_KERNELS,
    gate=GATE,
    source=__doc__,
)


def precision(caps):
    """mixed_float16 on either Metal backend; the reason names the train-step ops without a half kernel there."""
    from tfmetal_ext.backends import registry  # registry imports this module

    table = registry.table(registry.support_key("metal", False, getattr(caps, "metal_plugin", None)))
    reason = "Metal GPU: mixed_float16 (half kernels, fused conv/matmul in half)"
    from tfmetal_ext.backends import gap_kernels

    half_gaps = sorted(gaps.kernel_gaps(table, dtypes=("float16",)))
    ours = set(gap_kernels.registered(gap_kernels.plan(table, enabled=True)))
    covered, left = [op for op in half_gaps if op in ours], [op for op in half_gaps if op not in ours]
    if covered:
        reason += f"; {table.label} has no half kernel for {', '.join(covered)}: tfmetal_ext's gap kernels run them"
    if left:
        reason += f"; {table.label} has no half kernel for {', '.join(left)}: those ops fall back to the CPU"
    return "mixed_float16", reason
