"""tfmetal-ext: Keras 3 extensions that make TensorFlow fuse on Apple-silicon GPUs (and CUDA, CPU)."""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(here, "tfmetal_ext", "_version.py")) as f:
    exec(f.read(), version)

with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

_MAC_ARM = "sys_platform == 'darwin' and platform_machine == 'arm64'"

setup(
    name="tfmetal-ext",
    version=version["__version__"],
    description="Keras 3 layers, optimizers and tools that make TensorFlow fuse on Apple-silicon GPUs",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # The custom-op sources ship inside the package (as tfmetal_ext._custom_ops)
    # so a wheel can build the op library on first use.
    packages=find_packages(include=["tfmetal_ext", "tfmetal_ext.*"]) + ["tfmetal_ext._custom_ops"],
    package_dir={"tfmetal_ext._custom_ops": "custom_ops"},
    package_data={
        "tfmetal_ext._custom_ops": [
            "include/tfmetal/*.h", "ops/*.cc", "ops/*.h", "cpu/*.cc", "cpu/*.h", "signpost/*.c",
            "metal/*.h", "metal/*.metal", "metal/*.mm", "metal/*.py", "emu/*.h", "emu/*.cc", "emu/*.py",
        ]
    },
    install_requires=[
        "tensorflow>=2.16",
        "keras>=3.5",
        "numpy",
    ],
    extras_require={
        # Two Metal backends, one extra each (README "Which Metal backend"; the pairings live in
        # tfmetal_ext.devices). An extra cannot depend on the TensorFlow already installed, so each pins
        # the TensorFlow its plugin loads into.
        #
        # Apple's tensorflow-metal: 1.2 is its last release and loads into TF 2.16-2.19 only (it fails to
        # load into 2.20/2.21). Its wheels stop at cp312; there is deliberately no python_version marker,
        # so on Python >= 3.13 pip says no tensorflow-metal matches instead of installing a CPU-only setup
        # that looks like a Metal one. Use "metal-plugin" there.
        "metal": [
            f"tensorflow-metal==1.2.* ; {_MAC_ARM}",
            f"tensorflow>=2.16,<2.20 ; {_MAC_ARM}",
        ],
        # The open tensorflow-metal-plugin (0.4.x is built for TF 2.21, macOS 15+, Python >= 3.10). It
        # is an sdist compiled at install against the TensorFlow installed at that moment, and pip builds
        # it before installing anything, so this extra works only as a second command once TF 2.21 is
        # installed:  pip install "tensorflow==2.21.*" tfmetal-ext  then  pip install "tfmetal-ext[metal-plugin]".
        # In one command on a fresh environment the plugin's build stops with "TensorFlow was not found".
        "metal-plugin": [
            f"tensorflow==2.21.* ; {_MAC_ARM}",
            f"tensorflow-metal-plugin>=0.4.1,<0.5 ; {_MAC_ARM}",
        ],
        "test": ["pytest>=7", "pytest-xdist>=3.5,<4", "hypothesis>=6"],
        # scripts/gen_metal_kernels.py: Apple's tensorflow-metal kernel table, read by running its
        # TF_InitKernel on an arm64 emulator (unicorn) over the Mach-O as lief parses it.
        "gen": ["unicorn>=2.1,<3", "lief>=1.0,<2"],
        # keras-hub's models (keras-hub pulls tensorflow-text, which pins the TensorFlow minor it was
        # built for: install it beside the TensorFlow it matches).
        "hub": ["keras-hub>=0.32,<0.33"],
        "examples": ["scikit-learn>=1.2", "matplotlib>=3.5"],
        # tfmetal_ext.export's converters and the runtimes its check reloads artifacts with
        # (tfmetal_ext.deploy.formats.FORMATS). All install beside TensorFlow 2.19 and 2.21; coremltools
        # states TF 2.12 as its last tested version, and converts the portable graphs of TF 2.21 here.
        "export": [
            "tf2onnx>=1.16,<2", "onnx>=1.16,<2", "onnxruntime>=1.18,<2", "ai-edge-litert>=1.2,<3",
            "openvino>=2024.4,<2027", "coremltools>=8.0,<10",
        ],
    },
    entry_points={"console_scripts": ["tfmetal-ext=tfmetal_ext.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: MacOS",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
