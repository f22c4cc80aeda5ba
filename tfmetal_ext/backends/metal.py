"""Apple's tensorflow-metal PluggableDevice (1.2, TF <= 2.19).

Sources: the plugin's own grappler optimizer ("Plugin optimizer for
device_type GPU is enabled"; patterns for contraction + bias (+ Relu, Relu6,
Elu, LeakyRelu) and for the optimizers Adam, AdamAMSGrad, SGD, KerasMomentum,
KerasNesterovMomentum, Adagrad and RMSprop), the kernel symbols of
tensorflow-metal 1.2.0 (macOS arm64 wheel, 2025-01-31), and user reports
(Apple Developer Forums, tensorflow/tensorflow issues) for the pairings and
the graph-mode ``relu(bias_add(matmul))`` miscompute and for the silent CPU
fallback of ops without a GPU kernel (``RngReadAndSkip``). Not measured here:
no Mac on the project's machines.
"""

import types

from tfmetal_ext.backends import fusion
from tfmetal_ext.backends._table import Fusion, backend, never
from tfmetal_ext.backends.fusion import CONTRACTION_ACTIVATION_OPS as ACTS

F32_F16 = ("float32", "float16")
_ALL_FLOAT = ("float32", "float16", "bfloat16")

MATMUL_RELU_NOTE = (
    "tensorflow-metal is reported to miscompute relu(bias_add(matmul)) in graph "
    "mode; check with `tfmetal-ext doctor --selftest`"
)

# Kernels found in the binary's symbols (REGISTER names), with the dtypes registered. Only the
# facts known: the table is not complete (`kernels_complete=False`), so an op not listed here
# is unknown (`Backend.has_kernel` -> None), not missing.
KERNELS = types.MappingProxyType(
    {
        fusion.FUSED_CONV2D: F32_F16,
        fusion.FUSED_MATMUL: F32_F16,
        fusion.FUSED_BATCH_NORM_EX: F32_F16,
        fusion.FUSED_BATCH_MATMUL: F32_F16,
        "ResourceApplyAdam": F32_F16,
        "ResourceApplyAdamWithAmsgrad": F32_F16,
        "ResourceApplyKerasMomentum": F32_F16,
        "ResourceApplyMomentum": F32_F16,
        "ResourceApplyRMSProp": F32_F16,
        "ResourceApplyAdagrad": F32_F16,
        "ResourceApplyAdagradV2": F32_F16,
        "ResourceApplyGradientDescent": F32_F16,
        "CudnnRNN": _ALL_FLOAT,
        "CudnnRNNV2": _ALL_FLOAT,
        fusion.CUDNN_RNN: _ALL_FLOAT,
        "CudnnRNNBackprop": _ALL_FLOAT,
        "CudnnRNNBackpropV2": _ALL_FLOAT,
        fusion.CUDNN_RNN_GRAD: _ALL_FLOAT,
    }
)

# Ops known to have no kernel in tensorflow-metal 1.2 (any dtype): no fused LSTM cell kernels
# in its symbols, and the stateless-RNG counter op users see silently fall back to the CPU.
MISSING_KERNELS = frozenset({"BlockLSTM", "LSTMBlockCell", "RngReadAndSkip"})

METAL = backend(
    "metal", "metal", "Metal",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half (tensorflow-metal plugin remapper); no bfloat16",
            dtypes=F32_F16, acts=ACTS,
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32/half; relu(bias_add(matmul)) reported to miscompute "
            "in graph mode",
            dtypes=F32_F16, acts=ACTS, note=MATMUL_RELU_NOTE,
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
        "custom_softshrink": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_attention": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_int8_matmul": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "custom_int8_conv2d": Fusion(
            "tfmetal_ext custom op with a Metal kernel (float32, float16, bfloat16)", dtypes=_ALL_FLOAT
        ),
        "multi_tensor_adam": Fusion(
            "Metal kernel where TF exports the resource-variable C API (TF 2.19 yes, 2.21 Linux wheel no); "
            "else one ResourceApplyAdam per variable",
            dtypes=_ALL_FLOAT,
        ),
        "multi_tensor_lion": Fusion(
            "Metal kernel where TF exports the resource-variable C API (TF 2.19 yes, 2.21 Linux wheel no); "
            "else Keras' Lion ops per variable",
            dtypes=_ALL_FLOAT,
        ),
        "multi_tensor_rmsprop": Fusion(
            "Metal kernel where TF exports the resource-variable C API (TF 2.19 yes, 2.21 Linux wheel no); "
            "else one ResourceApply(Centered)RMSProp per variable",
            dtypes=_ALL_FLOAT,
        ),
        "cudnn_rnn": Fusion(
            "tensorflow-metal kernel: float32, float16, bfloat16; emitted as Keras emits it "
            "(batch-major, sequence_lengths)",
            dtypes=_ALL_FLOAT,
        ),
    },
    kernels=KERNELS,
    kernels_complete=False,
    missing_kernels=MISSING_KERNELS,
    source=__doc__,
)


def precision(caps):
    return "mixed_float16", "Metal GPU: mixed_float16 (half kernels, fused conv/matmul in half)"
