"""Kernel gaps: which ops of an ordinary Keras train step a backend has no kernel for, by dtype.

`TRAIN_STEP_OPS` lists the ops Keras and keras-hub emit in ordinary train
steps outside the layers' own math (the loss, loss scaling, Dropout's and
the initializers' random numbers, the embedding gradient, attention's
einsums, counters, common activations), each with what emits it.
`kernel_gaps` reads a backend table (`tfmetal_ext.backends.Backend`) for
them, and `summary` says it in one line: the README's backend section, the
doctor and ``configure()``'s reasons all print that line, so none of them
restates the tables.
"""

from __future__ import annotations

FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# op -> what emits it in an ordinary train step.
TRAIN_STEP_OPS = {
    "DivNoNan": "Keras' loss reduction",
    "BroadcastTo": "the loss gradient and attention masks",
    "IsFinite": (
        "LossScaleOptimizer (mixed_float16), per gradient (none around FusedAdam, FusedAdamW, FusedLion and "
        "FusedRMSprop where their multi-tensor op runs: tfmetal_ext.optimizers.loss_scale)"
    ),
    "Pack": "stacked tensors (keras-hub's rotary embedding, shapes)",
    "Unpack": "unstacked tensors (keras-hub's rotary embedding)",
    "UnsortedSegmentSum": "an Embedding's gradient",
    "StatelessRandomGetKeyCounter": "Dropout and initializers (Keras' seed generator)",
    "StatelessRandomUniformV2": "Dropout and initializers",
    "Sigmoid": "sigmoid activations and LSTM/GRU gates",
    "Fill": "constants of a traced shape",
    "ZerosLike": "gradients of unused outputs",
    "OnesLike": "the loss gradient's seed",
    "Elu": "elu activations",
    "Einsum": "MultiHeadAttention, EinsumDense and keras-hub's attention and rotary embedding",
}


def kernel_gaps(table, ops=None, dtypes=FLOAT_DTYPES, macos=None):
    """``{op: dtypes of `dtypes` without a kernel}`` for the ops of `ops` (default `TRAIN_STEP_OPS`) that have a gap.

    Only a definite answer counts: an op the table does not know
    (`Backend.has_kernel` is None) is left out. `macos` as in `has_kernel`.
    """
    out = {}
    for op in ops if ops is not None else TRAIN_STEP_OPS:
        missing = tuple(d for d in dtypes if table.has_kernel(op, d, macos=macos) is False)
        if missing:
            out[op] = missing
    return out


def summary(table, macos=None):
    """One line: the `TRAIN_STEP_OPS` the table has no kernel for, grouped by the float dtypes that do have one."""
    groups = {}
    for op, missing in kernel_gaps(table, macos=macos).items():
        have = tuple(d for d in FLOAT_DTYPES if d not in missing)
        groups.setdefault(have, []).append(op)
    parts = []
    for have in sorted(groups, key=lambda h: (len(h), h)):
        ops = ", ".join(f"`{op}`" for op in sorted(groups[have]))
        parts.append(f"no kernel for {ops}" if not have else f"{ops} {'/'.join(have)} only")
    return "; ".join(parts) if parts else "a kernel for every one of them in every float dtype"
