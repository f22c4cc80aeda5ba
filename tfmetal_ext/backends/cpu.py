"""TensorFlow on a CPU, with oneDNN (``cpu_onednn``) and without (``cpu``).

Sources: TF 2.21 ``tensorflow/core/grappler/optimizers/remapper.cc`` (the
CPU conditions: oneDNN-only fusions, ``IsCpuCompatible*``, half skipped
without AVX512_FP16/AMX_FP16/AVX_NE_CONVERT), re-measured on TF 2.19 and
2.21 with the tests in ``tests/inspect`` and ``tests/layers`` on an AVX-512
CPU (oneDNN on) and with ``TF_ENABLE_ONEDNN_OPTS=0``. oneDNN is on by
default in x86-64 Linux wheels only on CPUs with AVX-512 features; an
AVX2-only CPU, and (as far as we know) TF's macOS arm64 wheel, run the
no-oneDNN path.
"""

import types

from tfmetal_ext.backends._table import PREDICT, Fusion, RnnStock, backend, never
from tfmetal_ext.backends import fusion
from tfmetal_ext.backends.fusion import CONTRACTION_ACTIVATION_OPS as ACTS

F32_BF16 = ("float32", "bfloat16")

# Where FusedLSTM / FusedGRU run the stock form on a CPU (`Backend.rnn_cpu_form`): cell -> `RnnStock`
# regions, one rule per table, each measured in its own process. Measured: train step of Input -> RNN(H)
# -> Dense(1), float32, F=32, Keras' layer vs the fused loop (forced where the table chose stock), paired
# rounds in one process, median of per-round ratios (`benchmarks/bench_rnn.py --grid --rounds 5
# --repeats 3`, results/bench_rnn_grid_*onednn*.md, and re-runs of single shapes); TF 2.21, 2-core
# AMD EPYC (AVX-512, AVX512_BF16), the host shared with other jobs: one shape's ratio moved by up to
# 0.4 between runs (LSTM batch 128 T 50 H 128: 0.72x, 1.10x, 1.19x), so a region holds where the
# fused loop lost or only tied in most runs. Batch sizes measured: 32, 64, 128, 256; a batch bound is
# the smallest measured batch where it lost. Mixed precision was not measured apart: the regions hold
# for every dtype. An unknown batch (a `fit` step traced with batch None) meets no batch bound: at
# batch 32 and 64 the fused loop won (LSTM 1.3-2.0x, GRU 1.4-2.9x, traced None included), and a
# run-time switch between both forms (tf.cond on the batch) cost 25% at batch 64.
_RNN_STOCK_ONEDNN = types.MappingProxyType({
    "lstm": (
        RnnStock(
            "oneDNN, batch 256: the fused LSTM loop tied or lost (per run: T 50 H 128 0.60x, 0.69x, "
            "1.22x, 1.13x; T 200: H 32 0.83x, 1.00x, 0.89x, 1.08x, H 256 1.01x, 0.91x, 0.98x; T 10: "
            "H 32 0.86x, 1.19x, 1.03x, 1.09x, H 256 1.24x, 1.36x, 0.82x, 0.91x)",
            min_batch=256,
        ),
    ),
    # Batch 128 (T 50 H 128: 0.72x, 1.10x, 1.19x, 1.04x; T 200 H 32: 0.93x, 1.37x): the fused loop, its
    # median won. GRU: the fused loop won at every measured shape but one (batch 256 T 200 H 256: 1.04x,
    # 1.12x, 0.93x; 1.0-2.2x elsewhere).
})
_RNN_STOCK_EIGEN = types.MappingProxyType({
    "lstm": (
        RnnStock(
            "without oneDNN, batch 256: the fused LSTM loop tied or lost (T 10: 1.05x at H 32, 1.00x "
            "at H 256; T 200: 0.83x at H 32, 0.73x at H 256)",
            min_batch=256,
        ),
    ),
    "gru": (
        RnnStock(
            "without oneDNN, batch 256 with 256 units: the fused GRU loop lost (T 10 0.96x, T 200 "
            "0.80x; with 32 units it won, 1.26x)",
            min_batch=256, min_units=256,
        ),
    ),
})

# The same with oneDNN on or off: TF's own Conv2D + FusedBatchNorm inference fusion, and this
# package's custom ops (its own CPU kernels).
_CUSTOM = ("float32", "float16", "bfloat16")
_EITHER = {
    "conv2d_batchnorm_act": Fusion(
        "[FusedBatchNorm(, act)] float32, inference", dtypes=("float32",), acts=ACTS, modes=(PREDICT,),
    ),
    "batchnorm_grad_relugrad": never("not fused"),
    "custom_layer_norm": Fusion(
        f"tfmetal_ext custom op: one {fusion.LAYER_NORM_OP} forward, one {fusion.LAYER_NORM_GRAD_OP} backward",
        dtypes=_CUSTOM,
    ),
    "custom_rms_norm": Fusion(
        f"tfmetal_ext custom op: one {fusion.RMS_NORM_OP} forward, one {fusion.RMS_NORM_GRAD_OP} backward",
        dtypes=_CUSTOM,
    ),
    "custom_softshrink": Fusion(
        f"tfmetal_ext custom op: one {fusion.SOFTSHRINK_OP} forward, one {fusion.SOFTSHRINK_GRAD_OP} backward",
        dtypes=_CUSTOM,
    ),
    # Measured (bench_ops --sections activation_grad: y = act(x) and dx at 4096x512 float32, TF's autodiff
    # against the same forward + the op, 2-core AMD EPYC AVX-512, TF 2.21, medians of paired rounds): the op
    # is 1.24x / 1.01x / 1.50x (silu / gelu / tanh gelu) oneDNN on, 1.24x / 1.10x / 2.02x off, with one
    # tensor where TF's gradient makes 3-5 temporaries of x's size.
    # Measured (bench_ops --sections sparse_softmax_cross_entropy, the mean loss and the logits' gradient,
    # float32, 2-core AMD EPYC AVX-512, TF 2.21, paired rounds; benchmarks/results/bench_ops_sparse_xent*.md):
    # 2.4-2.6x TF's op + Mul at 2048x1000 and 4096x1000, 2.9-3.0x at 2048x32000 with oneDNN; 1.7-3.1x
    # without (TF's plain allocator then pays page faults for the 256 MiB gradient on both sides).
    "custom_sparse_softmax_cross_entropy": Fusion(
        f"tfmetal_ext custom op: one {fusion.SPARSE_XENT_OP} forward, one {fusion.SPARSE_XENT_GRAD_OP} backward",
        dtypes=_CUSTOM,
    ),
    # Measured (a tiny keras-hub Llama's decoding step, 10 projections of 256 x 128..512 at batch 1,
    # float32, 2-core AMD EPYC AVX-512, TF 2.21, oneDNN off): ~6.7 us an op where TF's MatMul took ~37 us
    # (it packs the whole kernel first); the step 0.59 ms against 1.18 ms stock (bench_hub's generate case).
    "custom_gemv": Fusion(
        f"tfmetal_ext custom op: one {fusion.GEMV_OP} (bias in it) for a decoding step's rows; its gradient "
        "is MatMuls",
        dtypes=_CUSTOM,
    ),
    "custom_activation_grad": Fusion(
        f"tfmetal_ext custom op: one {fusion.ACTIVATION_GRAD_OP}, or one {fusion.GATED_ACTIVATION_GRAD_OP} for a "
        "gated product (their second-order gradients: the op again and the reference's autodiff)",
        dtypes=_CUSTOM,
    ),
    # Measured (benchmarks/bench_ops.py --sections dropout: train step x -> Dropout(0.5) -> sum(y^2) -> dx,
    # float32, paired rounds, 2-core AMD EPYC with AVX-512, TF 2.21): the op's CPU kernel draws the Philox
    # mask twice (forward and backward) where Keras' stateless dropout draws it once and keeps a boolean
    # mask, yet with 64 Philox blocks in vector registers at once (4 interleaved groups of 16) and its
    # select on bits (a branch per element before: mispredicted at random) it is 1.52-2.42x Keras' step
    # with oneDNN, 1.48-2.14x without (benchmarks/results/bench_ops_dropout[_no_onednn].md and earlier
    # runs; 1.29-2.10x and 1.34-1.93x with one group of 16 at a time), 1.39-1.62x with
    # its AVX2 code (TFMETAL_EXT_CPU_LEVEL=avx2) and 1.09-1.25x with its portable code (arm64's) at
    # (64, 1600), (64, 128, 256), (32, 197, 192) and (8, 64, 64, 32); it keeps no mask. (Before:
    # 1.5-2.6x slower, and this row kept Keras' call on CPUs.)
    "custom_dropout": Fusion(
        f"tfmetal_ext custom op: one {fusion.DROPOUT_OP} forward, one {fusion.DROPOUT_GRAD_OP} backward "
        "(the mask drawn again, never stored)",
        dtypes=_CUSTOM,
    ),
    "custom_attention": Fusion(
        f"tfmetal_ext custom op: one {fusion.ATTENTION_OP} forward, one {fusion.ATTENTION_GRAD_OP} backward",
        dtypes=_CUSTOM,
    ),
    "custom_int8_matmul": Fusion(
        f"tfmetal_ext custom op: one {fusion.INT8_MATMUL_OP} (int8 weights, scale, bias, activation); "
        "gradients through the de-quantized kernel",
        dtypes=_CUSTOM,
    ),
    "custom_int8_conv2d": Fusion(
        f"tfmetal_ext custom op: one {fusion.INT8_CONV2D_OP} (int8 weights, scale, bias, activation); "
        "gradients through the de-quantized kernel",
        dtypes=_CUSTOM,
    ),
    "multi_tensor_adam": Fusion("one op per step and dtype group", dtypes=_CUSTOM),
    "multi_tensor_lion": Fusion("one op per step and dtype group", dtypes=_CUSTOM),
    "multi_tensor_rmsprop": Fusion("one op per step and dtype group", dtypes=_CUSTOM),
}
_NO_LEAKY = tuple(a for a in ACTS if a != "LeakyRelu")

# Whether ConvBNAct / ResidualBlock / FusedBatchNorm(activation=...) train with TfmetalExt>BatchNormAct
# on this CPU configuration (`tfmetal_ext.layers._ops.batch_norm_act_reason`). Measured on a 2-core AMD
# EPYC (AVX-512, AVX512_BF16), TF 2.21, float32, paired rounds, medians:
# - the op alone, forward + backward at 64x32x32x64 against FusedBatchNormV3 + Relu (+ AddV2) and their
#   gradients (`benchmarks/bench_ops.py --sections batch_norm_act`): with oneDNN 1.42x (relu; 1.28-1.57x
#   over runs) and 1.20x (relu + side); without oneDNN 6.07x and 3.12x;
# - ResNet-20's train step against stock Keras (`benchmarks/bench_layers.py`, 7 rounds, quiet host): with
#   oneDNN 1.37x with the op against 1.28x with FusedBatchNormV3 (ceiling 1.57x); without oneDNN 1.13x
#   against 1.05x (ceiling 1.32x).
# bfloat16 and float16 were not measured: they keep FusedBatchNormV3.
_BNA_ONEDNN = Fusion(
    "training, float32: one op each way (measured faster than oneDNN's FusedBatchNormV3 + Relu: "
    "1.2-1.4x alone, ResNet-20 step 1.37x vs 1.28x)",
    dtypes=("float32",),
)
_BNA_EIGEN = Fusion(
    "training, float32: one op each way (measured faster than TF's FusedBatchNormV3 + Relu: 3-6x alone, "
    "ResNet-20 step 1.13x vs 1.05x)",
    dtypes=("float32",),
)

ONEDNN = backend(
    "cpu_onednn", "cpu", "CPU with oneDNN",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, act)] float32, bfloat16; training: LeakyRelu not fused (its gradient needs the pre-activation)",
            dtypes=F32_BF16, acts=ACTS, train_acts=_NO_LEAKY,
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, act)] float32, bfloat16; Tanh and Sigmoid too; training: LeakyRelu not fused",
            dtypes=F32_BF16, acts=ACTS + ("Tanh", "Sigmoid"), train_acts=_NO_LEAKY + ("Tanh", "Sigmoid"),
        ),
        "matmul_bias_gelu": Fusion(
            "[BiasAdd, GeluExact|GeluApproximate], inference only",
            dtypes=F32_BF16, acts=("GeluExact", "GeluApproximate"), train_acts=(),
            train_reason="training: the GELU gradient needs the pre-activation, so only BiasAdd fuses",
        ),
        "depthwise_bias_act": Fusion(
            # Measured on TF 2.21 oneDNN: LeakyRelu does not fuse into the depthwise conv.
            "[BiasAdd(, Relu|Relu6|Elu)] float32, bfloat16",
            dtypes=F32_BF16, acts=("Relu", "Relu6", "Elu"),
        ),
        "conv2d_bias_add_relu": Fusion(
            "[BiasAdd, Add, Relu], inference", dtypes=F32_BF16, acts=("Relu",), modes=(PREDICT,),
            train_partial=("BiasAdd",),
            train_reason=(
                "training step: the remapper fuses the residual Add+Relu into the conv only "
                "in some graphs (seen both ways on TF 2.21); BiasAdd fuses either way"
            ),
        ),
        "batchnorm_act": Fusion(
            "yes, without side input", dtypes=F32_BF16, acts=("Relu",), requires_act=("Relu",), side_input=False,
        ),
        "custom_batch_norm_act": _BNA_ONEDNN,
        **_EITHER,
        "cudnn_rnn": never(
            "no kernel (GPU-only op); FusedLSTM/FusedGRU hoist the input projection into one _FusedMatMul[BiasAdd]",
            why_not="no fused RNN kernel on CPU (CudnnRNNV3 is GPU-only)",
        ),
    },
    half_needs_native=True,
    # Measured on TF 2.21 with TF_ENABLE_ONEDNN_OPTS=1 on an AVX2-only AMD EPYC: no bfloat16 node fuses
    # (TF's IsBF16SupportedByOneDNNOnThisCPU needs AVX512F or AVX_NE_CONVERT).
    bf16_needs_onednn_isa=True,
    addv2_bias=True,  # measured on TF 2.19 and 2.21: a broadcast AddV2 fuses as the BiasAdd
    # Measured (TF 2.21, ResNet-50's pointwise shapes, batch 16): MatMul 5-15% faster.
    pointwise_train_as_matmul=True,
    rnn_stock=_RNN_STOCK_ONEDNN,
    # Measured on TF 2.19.1 and 2.21.0 with oneDNN, inference graphs: the Xception residual
    # (keras.io "Image classification from scratch"), where the Add after a conv also feeds the
    # next block's shortcut conv besides its ReLU.
    pass_failure=(
        "a Conv2D + BiasAdd + Add whose Add output has more than one consumer (e.g. a ReLU and "
        "the next residual's conv) makes oneDNN's remapper fail on the whole graph in inference "
        "(TF logs 'remapper failed: ... Mutation::Apply error'), so nothing in it fuses"
    ),
    source=__doc__,
)

EIGEN = backend(
    "cpu", "cpu", "CPU without oneDNN",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, act)] float32/float64, NHWC; no bfloat16; training: LeakyRelu not fused",
            dtypes=("float32", "float64"), acts=ACTS, train_acts=_NO_LEAKY,
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu)] float32; training: LeakyRelu not fused",
            dtypes=("float32",), acts=ACTS, train_acts=_NO_LEAKY,
        ),
        "matmul_bias_gelu": never("not fused"),
        "depthwise_bias_act": never("not fused", why_not="no fused depthwise kernel"),
        "conv2d_bias_add_relu": never("only [BiasAdd]", why_not="no Conv2D+BiasAdd+Add+Relu fusion"),
        "batchnorm_act": never("not fused", why_not="no _FusedBatchNormEx kernel"),
        "custom_batch_norm_act": _BNA_EIGEN,
        **_EITHER,
        "cudnn_rnn": never(
            "no kernel (GPU-only op); the input projection fuses as _FusedMatMul[BiasAdd] (float32)",
            why_not="no fused RNN kernel on CPU (CudnnRNNV3 is GPU-only)",
        ),
    },
    half_needs_native=True,
    # Measured (TF 2.21, TF_ENABLE_ONEDNN_OPTS=0, forward + both backward products): MatMul is
    # 1.03-1.49x faster than Conv2D for 1x1 convolutions from 64x32x32x16->32 to 16x56x56x64->256.
    pointwise_train_as_matmul=True,
    rnn_stock=_RNN_STOCK_EIGEN,
    source=__doc__,
)


def precision(caps):
    """The policy a CPU computes fastest in, and why."""
    if caps.cpu_bf16 and caps.onednn:
        return "mixed_bfloat16", (
            "CPU with native bfloat16 (AVX512_BF16/AMX/FEAT_BF16) and oneDNN: mixed_bfloat16 "
            "(fuses like float32 under oneDNN)"
        )
    if caps.cpu_bf16:
        return "float32", (
            "CPU with native bfloat16 but oneDNN off: float32 (TF's own CPU kernels fuse float32 only)"
        )
    return "float32", "CPU without native bfloat16: float32"
