"""A string-attribute constraint steers TensorFlow's kernel choice: the experiment behind the Einsum gap kernel.

The Einsum gap kernel cannot give a node back to the CPU at run time, so it is registered with an
allowed-values constraint on ``equation`` (custom_ops/metal/gap_plan.h: the plan's ``string:`` field,
serialized into a KernelDef for ``TF_RegisterKernelBuilderWithKernelDef``). No Metal device exists here,
so the same registration path runs on the CPU device, in a small library this test builds against the
installed TensorFlow: the plan text is written by `gap_kernels.plan_text`'s escaping, parsed by
gap_plan.h, serialized by its ``SerializeKernelDef`` and registered through the C API, as
RegisterGapKernels does.

- A test-only op whose only kernel carries the constraint: a node with a listed equation runs it; any
  other equation finds no kernel on any device (NotFound at placement), and TensorFlow's registry
  shows the constraint as ``equation in [...]``.
- The stock Einsum op, with a second CPU kernel (priority 1, so it wins over TensorFlow's where both
  match) constrained to three equations Keras emits that fills its output with 42 (shaped by the
  Einsum gap kernel's planner, tfmetal/gap_einsum.h): nodes with
  those equations run it, every other equation and dtype still runs TensorFlow's own kernel, eagerly
  and in a graph. On a Metal device there is no other GPU Einsum kernel, so a node whose equation is
  not listed matches no GPU kernel and the placer puts it on the CPU.

Each check runs in a subprocess (the library changes Einsum for the process that loads it).
"""

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tensorflow as tf

from tfmetal_ext.backends import gap_kernels
from tfmetal_ext.ops import _loader

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.no_keras, pytest.mark.full]

LIBRARY_CC = r"""
#include <cstdio>
#include <cstdlib>
#include <string>

#include "metal/gap_plan.h"
#include "tensorflow/c/kernels.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tfmetal/gap_einsum.h"

REGISTER_OP("TfmetalExtTestEquationOp")
    .Input("x: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("equation: string")
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

namespace {
namespace gap = tfmetal_ext::gap;

// The kernel's state: its node's equation.
void* Create(TF_OpKernelConstruction* ctx) {
  TF_Status* s = TF_NewStatus();
  int32_t list_size = 0, size = 0;
  TF_OpKernelConstruction_GetAttrSize(ctx, "equation", &list_size, &size, s);
  std::string* equation = new std::string(static_cast<size_t>(size), '\0');
  TF_OpKernelConstruction_GetAttrString(ctx, "equation", equation->data(), static_cast<size_t>(size), s);
  TF_DeleteStatus(s);
  return equation;
}
void Delete(void* equation) { delete static_cast<std::string*>(equation); }

// The test op: y = 2 x.
void Double(void*, TF_OpKernelContext* ctx) {
  TF_Status* s = TF_NewStatus();
  TF_Tensor* x = nullptr;
  TF_GetInput(ctx, 0, &x, s);
  int64_t dims[8];
  for (int i = 0; i < TF_NumDims(x); ++i) dims[i] = TF_Dim(x, i);
  TF_Tensor* y = TF_AllocateOutput(ctx, 0, TF_FLOAT, dims, TF_NumDims(x), TF_TensorByteSize(x), s);
  for (int64_t i = 0; i < TF_TensorElementCount(x); ++i) {
    static_cast<float*>(TF_TensorData(y))[i] = 2 * static_cast<const float*>(TF_TensorData(x))[i];
  }
  TF_DeleteTensor(x);
  TF_DeleteTensor(y);
  TF_DeleteStatus(s);
}

// Einsum: an output of the shape the gap kernel's planner gives, filled with 42.
void Fill42(void* kernel, TF_OpKernelContext* ctx) {
  TF_Status* s = TF_NewStatus();
  TF_Tensor *a = nullptr, *b = nullptr;
  TF_GetInput(ctx, 0, &a, s);
  TF_GetInput(ctx, 1, &b, s);
  int64_t ad[16], bd[16], od[52];
  for (int i = 0; i < TF_NumDims(a); ++i) ad[i] = TF_Dim(a, i);
  for (int i = 0; i < TF_NumDims(b); ++i) bd[i] = TF_Dim(b, i);
  const char* equation = static_cast<const std::string*>(kernel)->c_str();
  GapEinsumSpec spec;
  char message[256];
  tfm_gap_einsum_params p;
  if (!GapEinsumParse(equation, &spec, message, sizeof(message)) ||
      GapEinsumPlan(spec, ad, TF_NumDims(a), bd, TF_NumDims(b), od, &p, message, sizeof(message)) != 0) {
    TF_SetStatus(s, TF_INTERNAL, message);
    TF_OpKernelContext_Failure(ctx, s);
  } else {
    int64_t n = 1;
    for (int i = 0; i < spec.rank[2]; ++i) n *= od[i];
    TF_Tensor* y = TF_AllocateOutput(ctx, 0, TF_FLOAT, od, spec.rank[2], n * 4, s);
    for (int64_t i = 0; i < n; ++i) static_cast<float*>(TF_TensorData(y))[i] = 42;
    TF_DeleteTensor(y);
  }
  TF_DeleteTensor(a);
  TF_DeleteTensor(b);
  TF_DeleteStatus(s);
}

void Register(const char* env, void (*compute)(void*, TF_OpKernelContext*), int priority) {
  const gap::Plan plan = gap::ParsePlan(std::getenv(env));
  if (!plan.error.empty() || plan.kernels.size() != 1) {
    std::fprintf(stderr, "plan %s: %s\n", env, plan.error.c_str());
    std::abort();
  }
  const gap::KernelDef& def = plan.kernels[0];
  for (const auto& combo : gap::Combinations(def)) {
    const std::string serialized = gap::SerializeKernelDef(def, "CPU", combo, priority);
    TF_Status* s = TF_NewStatus();
    TF_KernelBuilder* builder = TF_NewKernelBuilder(def.op.c_str(), "CPU", Create, compute, Delete);
    TF_RegisterKernelBuilderWithKernelDef(serialized.c_str(), (def.op + "_placement_test").c_str(), builder, s);
    if (TF_GetCode(s) != TF_OK) {
      std::fprintf(stderr, "registration failed: %s\n", TF_Message(s));
      std::abort();
    }
    TF_DeleteStatus(s);
  }
}

struct Init {
  Init() {
    Register("TEST_OP_PLAN", Double, 0);
    Register("EINSUM_PLAN", Fill42, 1);
  }
} init;
}  // namespace
"""

RUNNER = r"""
import json, os, sys
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import kernels

lib = tf.load_op_library(sys.argv[1])
out = {}
x = tf.constant([[1.0, 2.0]])
for eq in json.loads(os.environ["TEST_EQUATIONS"]):
    try:
        out[eq] = lib.tfmetal_ext_test_equation_op(x=x, equation=eq).numpy().tolist()
    except tf.errors.NotFoundError as e:
        out[eq] = "NotFound: " + e.message.splitlines()[0]
out["registry"] = [str(k.constraint) for k in kernels.get_registered_kernels_for_op("TfmetalExtTestEquationOp").kernel]
rng = np.random.default_rng(0)
def operands(eq, dtype):
    sizes = {c: 2 + i for i, c in enumerate(sorted(set(eq) - set(",->")))}
    return [tf.constant(rng.standard_normal([sizes[c] for c in s]), dtype) for s in eq.split("->")[0].split(",")]
@tf.function
def graph(eq_values):
    return [tf.raw_ops.Einsum(inputs=list(v), equation=eq) for eq, v in eq_values]
einsum = {}
for eq in json.loads(os.environ["EINSUM_EQUATIONS"]):
    for dtype in (tf.float32, tf.float64):
        a, b = operands(eq, dtype)
        got = tf.raw_ops.Einsum(inputs=[a, b], equation=eq).numpy()
        want = np.einsum(eq, a.numpy(), b.numpy())
        einsum[f"{eq}|{dtype.name}"] = "ours" if np.all(got == 42) else ("tf" if np.allclose(got, want) else "wrong")
pairs = [(eq, operands(eq, tf.float32)) for eq in json.loads(os.environ["EINSUM_EQUATIONS"])]
for (eq, _), got in zip(pairs, graph(pairs)):
    einsum[f"{eq}|graph"] = "ours" if np.all(got.numpy() == 42) else "tf"
out["einsum"] = einsum
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    compiler = _loader.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found: the experiment library cannot be built here")
    out = tmp_path_factory.mktemp("placement")
    source = LIBRARY_CC
    (out / "placement.cc").write_text(source)
    library = out / "libplacement.so"
    cmd = shlex.split(compiler) + ["-std=c++17", "-shared", "-fPIC", "-O1", "-w"]
    cmd += list(tf.sysconfig.get_compile_flags())
    cmd += ["-I", str(ROOT / "custom_ops"), "-I", str(ROOT / "custom_ops" / "include"), str(out / "placement.cc"),
            "-o", str(library)] + list(tf.sysconfig.get_link_flags())
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-10000:]
    listed = ["ab,bc->ac", "abc,cde->abde"]
    einsum_listed = ["BTNH,BSNH->BNTS", "abc,cde->abde", "ab,c->abc"]  # three Keras emits
    env = dict(os.environ,
               TEST_OP_PLAN="test\nTfmetalExtTestEquationOp|T=float32|string:equation="
                            + ",".join(gap_kernels.escape(e) for e in listed) + "\n",
               EINSUM_PLAN="test\nEinsum|T=float32|string:equation="
                           + ",".join(gap_kernels.escape(e) for e in einsum_listed) + "\n",
               TEST_EQUATIONS=json.dumps(listed + ["ab,cb->ac", "abc,cd->abd"]),
               EINSUM_EQUATIONS=json.dumps(einsum_listed + ["ab,cb->ac", "abc,dce->abde"]),
               # Where oneDNN is on (AVX-512 CPUs by default) TensorFlow rewrites a CPU Einsum into
               # _MklEinsum, eagerly and in graphs, before any kernel is chosen, so the experiment's
               # Einsum kernels would never be asked. A Metal node is never rewritten: TF's own path here.
               TF_ENABLE_ONEDNN_OPTS="0")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(RUNNER), str(library)], capture_output=True,
                         text=True, timeout=600, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-10000:]
    return json.loads(lines[0][len("RESULT "):]), listed, einsum_listed


def test_a_listed_equation_runs_the_constrained_kernel_and_another_finds_none(experiment):
    result, listed, _ = experiment
    for eq in listed:
        assert result[eq] == [[2.0, 4.0]], (eq, result[eq])
    for eq in ("ab,cb->ac", "abc,cd->abd"):
        assert result[eq].startswith("NotFound: Could not find device for node"), (eq, result[eq])
        assert f'equation="{eq}"' in result[eq]
    (constraint,) = result["registry"]
    assert '"equation"' in constraint and all(f's: "{eq}"' in constraint for eq in listed)


def test_the_stock_einsum_op_is_steered_per_equation(experiment):
    result, _, einsum_listed = experiment
    for eq in einsum_listed:
        assert result["einsum"][f"{eq}|float32"] == "ours", eq
        assert result["einsum"][f"{eq}|graph"] == "ours", eq
        assert result["einsum"][f"{eq}|float64"] == "tf", eq  # the type constraint still applies
    for eq in ("ab,cb->ac", "abc,dce->abde"):
        for how in ("float32", "float64", "graph"):
            assert result["einsum"][f"{eq}|{how}"] == "tf", (eq, how)
