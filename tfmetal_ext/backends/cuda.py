"""TensorFlow on a CUDA GPU.

Source: TF 2.21 ``tensorflow/core/grappler/optimizers/remapper.cc`` (the GPU
conditions: ``IsGpuCompatibleConv2D``, ``IsGpuCompatibleMatMul`` with
``TF_USE_CUBLASLT``, ``_FusedBatchNormEx`` needing half, NHWC and channels
% 4 in training). Not measured here: no CUDA GPU on the project's machines.
"""

from tfmetal_ext.backends import fusion
from tfmetal_ext.backends._table import TRAIN, Fusion, backend, never

_NEEDS_CUBLASLT = f"{fusion.FUSED_MATMUL} needs TF_USE_CUBLASLT=1"

CUDA = backend(
    "cuda", "cuda", "CUDA",
    {
        "conv2d_bias_act": Fusion(
            "needs an activation; Relu only by default, float32/half, not 1x1 filters",
            dtypes=("float32", "float16"), acts=("Relu",), requires_act=("Relu",), no_1x1=True,
        ),
        "matmul_bias_act": Fusion(
            "only with TF_USE_CUBLASLT=1",
            dtypes=("float32", "float16", "bfloat16", "float64"),
            acts=("Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid", "GeluExact", "GeluApproximate"),
            needs="cublaslt", why_not=_NEEDS_CUBLASLT,
        ),
        "matmul_bias_gelu": Fusion(
            "half with cuDNN runtime fusion", dtypes=("float32", "float16", "bfloat16", "float64"),
            acts=("GeluExact", "GeluApproximate"), needs="cublaslt", why_not=_NEEDS_CUBLASLT,
        ),
        "depthwise_bias_act": never("not fused", why_not="no fused depthwise kernel"),
        "conv2d_bias_add_relu": never("not fused", why_not="no Conv2D+BiasAdd+Add+Relu fusion"),
        "conv2d_batchnorm_act": never("not fused", why_not="Conv2D + FusedBatchNorm is fused only on CPU"),
        "batchnorm_act": Fusion(
            "float32/half; training needs half, NHWC, channels % 4 == 0",
            dtypes=("float32", "float16"), acts=("Relu",), requires_act=("Relu",),
            train_dtypes=("float16",), train_channels_multiple=4,
        ),
        "batchnorm_grad_relugrad": Fusion(
            "training only, half, NHWC, channels % 4 == 0", dtypes=("float16",), modes=(TRAIN,),
            train_channels_multiple=4,
        ),
        "custom_layer_norm": never("no CUDA kernel: the pure-TF reference runs (18 ops fwd+bwd)"),
        "custom_rms_norm": never("no CUDA kernel: the pure-TF reference runs"),
        "custom_batch_norm_act": never(
            "no CUDA kernel: FusedBatchNormV3 runs (cuDNN; _FusedBatchNormEx with Relu in half)"
        ),
        "custom_softshrink": never("no CUDA kernel: the op runs on the CPU (copies each way); use the reference there"),
        "custom_activation_grad": never("no CUDA kernel: the pure-TF reference runs (TF's elementwise ops)"),
        "custom_sparse_softmax_cross_entropy": never(
            "no CUDA kernel: Keras' own loss runs (TF's SparseSoftmaxCrossEntropyWithLogits)"
        ),
        "custom_gemv": never("no CUDA kernel: MatMul + BiasAdd run (cuBLAS)"),
        "custom_dropout": never("no CUDA kernel: the pure-TF reference runs (TensorFlow's stateless dropout)"),
        "custom_attention": never("no CUDA kernel: the pure-TF reference runs (the score matrix is materialized)"),
        "custom_int8_matmul": never(
            "no CUDA kernel: the pure-TF reference runs (kernel de-quantized, MatMul + BiasAdd + act)"
        ),
        "custom_int8_conv2d": never(
            "no CUDA kernel: the pure-TF reference runs (kernel de-quantized, Conv2D + BiasAdd + act)"
        ),
        "multi_tensor_adam": never("no CUDA kernel: one ResourceApplyAdam per variable"),
        "multi_tensor_lion": never("no CUDA kernel: Keras' Lion ops per variable"),
        "multi_tensor_rmsprop": never("no CUDA kernel: one ResourceApply(Centered)RMSProp per variable"),
        "cudnn_rnn": Fusion(
            "cuDNN: float32, float16, float64 (bfloat16 kernels registered, cuDNN support varies); "
            "masks must be right-padded (sequence_lengths)",
            dtypes=("float32", "float16", "float64", "bfloat16"),
        ),
    },
    source=__doc__,
)


def precision(caps):
    return "mixed_float16", "CUDA GPU: mixed_float16 (tensor cores, cuDNN half kernels)"
