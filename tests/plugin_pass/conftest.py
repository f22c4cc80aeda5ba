"""Builds the open tensorflow-metal-plugin's graph pass for the tests in this package.

The pass (``FuseGraph`` in the plugin's ``src/tensorflow/core/common_runtime/metal/metal_graph.mm``)
is plain C++ over wire-format GraphDef, so it compiles on Linux as C++ (``-x c++``) against the TF
wheel's own headers (``tf.sysconfig.get_include()``: absl and ``tensorflow/c/...``). Found when this
was written (plugin 0.4.1, TF 2.21.0, g++ 12): the file and the two headers it includes,
``metal_platform.h`` (which names no Objective-C type) and ``tensorflow/c/experimental/grappler/grappler.h``,
compile as they are, so no stub header is needed; ``absl/log/log.h``'s LOG and ``TF_SetStatus``
link against ``libtensorflow_framework.so.2`` (``tf.sysconfig.get_link_flags()``). The build takes
about 3 s.

TF's grappler runs in a worker process with ``TF_ENABLE_ONEDNN_OPTS=0`` (fixture `grappler`): with
oneDNN on, TF's remapper skips every half-precision node whatever its device (a CPU check, not
scoped to CPU nodes), which a Mac's TF (no oneDNN) does not do; so the worker gives the Mac's
remapper on any Linux machine, and the tests expect the same with and without oneDNN in-process.

tfmetal-ext holds none of the plugin's code: the sdist is a test-time download
(`tfmetal_ext.testing.metal_plugin_source`, pip, sha256-checked, cached), and the binary is built
into this session's temporary directory with our own driver (``fuse_graph_driver.cc``: GraphDef
bytes on stdin, the rewritten GraphDef on stdout, exit status 2 when FuseGraph refuses the input).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
DRIVER = HERE / "fuse_graph_driver.cc"
PASS_SOURCE = pathlib.Path("src/tensorflow/core/common_runtime/metal/metal_graph.mm")


class PassRefused(RuntimeError):
    """FuseGraph returned false: it could not read the GraphDef it was given."""


@dataclasses.dataclass
class PluginPass:
    """The plugin's FuseGraph, built and callable: ``plugin_pass(graph_def) -> GraphDef``."""

    binary: pathlib.Path
    compiler: str
    build_seconds: float
    source_root: pathlib.Path

    def run_bytes(self, data):
        """Runs the pass on serialized bytes; returns the CompletedProcess (stdout: bytes)."""
        return subprocess.run([str(self.binary)], input=data, capture_output=True, timeout=60, check=False)

    def __call__(self, graph_def):
        import tensorflow as tf

        done = self.run_bytes(graph_def.SerializeToString())
        if done.returncode == 2:
            raise PassRefused(done.stderr.decode(errors="replace").strip())
        if done.returncode != 0:
            raise RuntimeError(
                f"{self.binary.name} exited {done.returncode}: {done.stderr.decode(errors='replace').strip()}"
            )
        out = tf.compat.v1.GraphDef()
        out.ParseFromString(done.stdout)
        return out


def _compilers():
    seen = []
    for name in ("g++", "clang++"):  # g++ first (always present here); clang++ if g++ fails
        path = shutil.which(name)
        if path:
            seen.append(path)
    return seen


def _build(source_root, out_dir):
    import tensorflow as tf

    source = source_root / PASS_SOURCE
    if not source.is_file():
        raise FileNotFoundError(f"the sdist has no {PASS_SOURCE}: the plugin's layout changed. Received: {source_root}")
    lib_dir = pathlib.Path(tf.sysconfig.get_lib())
    failures = []
    for compiler in _compilers():
        binary = out_dir / f"fuse_graph_{pathlib.Path(compiler).name.replace('+', 'x')}"
        cmd = [
            compiler, *tf.sysconfig.get_compile_flags(), "-O1", "-w",
            "-I", str(source_root / "src"),
            "-x", "c++", str(source), "-x", "none", str(DRIVER),
            *tf.sysconfig.get_link_flags(), f"-Wl,-rpath,{lib_dir}",
            "-o", str(binary),
        ]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        seconds = time.perf_counter() - start
        if done.returncode == 0:
            return binary, compiler, seconds
        failures.append(f"{compiler}: {(done.stderr or done.stdout).strip()[-2000:]}")
    if not failures:
        pytest.skip("no C++ compiler (g++ or clang++) on PATH to build the plugin's graph pass")
    raise RuntimeError("could not compile the plugin's graph pass:\n" + "\n".join(failures))


@pytest.fixture(scope="session")
def plugin_pass(tmp_path_factory):
    """The open plugin's FuseGraph built from its pinned sdist for this TF (one build per session)."""
    import tensorflow as tf

    from tfmetal_ext import testing
    from tfmetal_ext.backends import metal_plugin

    if tf.__version__ != metal_plugin.TF_VERSION:
        pytest.skip(
            f"tensorflow-metal-plugin {metal_plugin.PIN} loads only into TF {metal_plugin.TF_VERSION} "
            f"(its pass runs after that TF's remapper); this is TF {tf.__version__}"
        )
    try:
        root = testing.metal_plugin_source()
    except testing.SourceUnavailable as e:
        pytest.skip(str(e))
    binary, compiler, seconds = _build(root, tmp_path_factory.mktemp("metal_plugin_pass"))
    os.environ.pop("TF_METAL_LOG_FUSION", None)  # the pass logs through absl when set; keep stderr quiet
    return PluginPass(binary=binary, compiler=compiler, build_seconds=seconds, source_root=root)


# ----------------------------------------------------------------------------
# TF's grappler with a virtual cluster holding a device of type "GPU".

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"

# Shared by this process and the worker: the MetaGraphDef grappler gets and its config.
_GRAPPLER_CODE = r"""
def virtual_cluster(gpu_name, cpu_name):
    from tensorflow.core.protobuf import device_properties_pb2
    from tensorflow.python.grappler import cluster as gcluster

    gpu = device_properties_pb2.NamedDevice(name=gpu_name)
    gpu.properties.type = "GPU"  # no environment: no compute capability, so no cuDNN runtime fusion
    cpu = device_properties_pb2.NamedDevice(name=cpu_name)
    cpu.properties.type = "CPU"
    return gcluster.Cluster(devices=[gpu, cpu])


def optimize(meta, cluster):
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer

    config = config_pb2.ConfigProto()
    # TF's default optimizers, with the layout optimizer off as the plugin's optimizer config sets it.
    config.graph_options.rewrite_options.layout_optimizer = rewriter_config_pb2.RewriterConfig.OFF
    return tf_optimizer.OptimizeGraph(config, meta, verbose=False, cluster=cluster)
"""

_WORKER = _GRAPPLER_CODE + r"""
import os, struct, sys
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
from tensorflow.core.protobuf import meta_graph_pb2
cluster = virtual_cluster(sys.argv[1], sys.argv[2])
src = sys.stdin.buffer
while True:
    head = src.read(8)
    if len(head) < 8:
        break
    (size,) = struct.unpack("<Q", head)
    meta = meta_graph_pb2.MetaGraphDef.FromString(src.read(size))
    try:
        body, status = optimize(meta, cluster).SerializeToString(), 0
    except Exception as e:  # reported to the test, which raises it
        body, status = f"{type(e).__name__}: {e}".encode(), 1
    out.write(struct.pack("<BQ", status, len(body)))
    out.write(body)
    out.flush()
"""

_here = {}
exec(compile(_GRAPPLER_CODE, "<grappler>", "exec"), _here)


def meta_graph(graph_def):
    """A MetaGraphDef around a function body: its ``_Retval`` nodes are the fetches."""
    from tensorflow.core.protobuf import meta_graph_pb2

    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    fetch = [n.name for n in graph_def.node if n.op == "_Retval"]
    meta.collection_def["train_op"].node_list.value.extend(fetch)
    return meta


_CLUSTER = []


def optimize_here(graph_def):
    """TF's grappler in this process (its oneDNN setting) on the virtual GPU cluster."""
    if not _CLUSTER:
        _CLUSTER.append(_here["virtual_cluster"](GPU, CPU))
    return _here["optimize"](meta_graph(graph_def), _CLUSTER[0])


class Grappler:
    """TF's grappler in a worker process without oneDNN: ``grappler(graph_def) -> GraphDef``."""

    def __init__(self, log_path):
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        self._log_path = log_path
        self._log = open(log_path, "wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, GPU, CPU], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=env,
        )

    def _fail(self, what):
        self._log.flush()
        tail = pathlib.Path(self._log_path).read_bytes()[-2000:].decode(errors="replace")
        raise RuntimeError(f"grappler worker {what}; its stderr ends:\n{tail}")

    def __call__(self, graph_def):
        import tensorflow as tf

        data = meta_graph(graph_def).SerializeToString()
        try:
            self._proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("exited")
        head = self._proc.stdout.read(9)
        if len(head) < 9:
            self._fail("exited")
        status, size = struct.unpack("<BQ", head)
        body = self._proc.stdout.read(size)
        if status:
            raise RuntimeError(f"grappler failed: {body.decode(errors='replace')}")
        out = tf.compat.v1.GraphDef()
        out.ParseFromString(body)
        return out

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def grappler(plugin_pass, tmp_path_factory):
    """TF's grappler on a virtual GPU, without oneDNN (a Mac's TF), in one worker per session."""
    worker = Grappler(tmp_path_factory.mktemp("grappler") / "worker.log")
    yield worker
    worker.close()
