"""The open tensorflow-metal-plugin PluggableDevice (PyPI; Apache-2.0), the Metal backend of TF 2.21.

Facts read from its sdist (``pip download --no-deps tensorflow-metal-plugin==0.4.1``:
``README.md``, ``TF_SUPPORTED_VERSION``, ``setup.py`` and
``src/tensorflow/core/common_runtime/metal/``). None of its code is in this
project; the tests and scripts that need its source fetch the sdist at run
time (`tfmetal_ext.testing.metal_plugin_source`). Not measured here: no Mac on
the project's machines.
"""

# The release this package's tables were generated from and tested against. When the pin moves,
# rerun `python scripts/gen_metal_plugin_kernels.py` and update SDIST_SHA256.
PIN = "0.4.1"
# Its TF_SUPPORTED_VERSION: the one TensorFlow release it loads into (checked at load).
TF_VERSION = "2.21.0"
# sha256 of tensorflow_metal_plugin-0.4.1.tar.gz as PyPI serves it.
SDIST_SHA256 = "7ce3f583d679fc4fda2f0aec1ab497681c0faf986e12912028b5159ecfcf2bd7"
# The oldest macOS it runs on (it calls APIs that arrived in macOS 15).
MIN_MACOS = (15, 0)

import types

from tfmetal_ext.backends._table import Fusion, backend, never
from tfmetal_ext.backends.fusion import CONTRACTION_ACTIVATION_OPS

F32_F16 = ("float32", "float16")
# Its graph pass (FuseGraph) folds these activations after Conv2D/MatMul + BiasAdd.
PASS_ACTS = tuple(CONTRACTION_ACTIVATION_OPS) + tuple(a for a in ("Sigmoid", "Tanh") if a not in CONTRACTION_ACTIVATION_OPS)

# Provisional table (the kernel table generated from the sdist replaces `kernels`).
METAL_PLUGIN = backend(
    "metal_plugin", "metal", "tensorflow-metal-plugin",
    {
        "conv2d_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu|Sigmoid|Tanh)] float32/half (TF remapper on GPU, then the "
            "plugin's graph pass); no bfloat16 kernels",
            dtypes=F32_F16, acts=PASS_ACTS,
        ),
        "matmul_bias_act": Fusion(
            "[BiasAdd(, Relu|Relu6|Elu|LeakyRelu|Sigmoid|Tanh)] float32/half (the plugin's graph pass)",
            dtypes=F32_F16, acts=PASS_ACTS,
        ),
        "matmul_bias_gelu": never("not fused"),
        "depthwise_bias_act": never("not fused", why_not="the plugin's graph pass fuses Conv2D and MatMul only"),
        "conv2d_bias_add_relu": never("not fused", why_not="no Conv2D + BiasAdd + Add + Relu fusion"),
        "conv2d_batchnorm_act": never("not fused", why_not="Conv2D + FusedBatchNorm is fused only on CPU"),
        "batchnorm_act": never("not fused"),
        "batchnorm_grad_relugrad": never("not fused"),
        "custom_layer_norm": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "custom_softshrink": Fusion("tfmetal_ext custom op", dtypes=F32_F16),
        "multi_tensor_adam": Fusion("tfmetal_ext custom op (CPU kernel on TF 2.21)", dtypes=F32_F16),
        "cudnn_rnn": never("not fused", why_not="the plugin has no CudnnRNN kernel (and TF no CPU kernel)"),
    },
    kernels=None,
    source=__doc__,
)
