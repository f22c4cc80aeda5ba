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
