"""Which EinsumDense equations are a matrix product after reshapes, and how: the plan, as data.

`einsum_plan(equation, bias_axes, input_rank)` reads an EinsumDense equation
(Keras' three forms: ``ab,bc->ac``, ``...ab,bc->...ac``, ``ab...,bc->ac...``)
with its ellipsis expanded for the input's rank, and returns an `EinsumPlan`
(or None and the reason it is not one). The equations it takes are those
whose input is ``rows + contracted + trailing`` axes (the contracted group
contiguous, every input axis either contracted with the kernel or kept in
the output) and whose output is ``rows + trailing + kernel's free axes``
(input axes in their own order; the kernel's free axes in any order, since
transposing the kernel costs a weight-sized Transpose, never an
activation-sized one). That covers every EinsumDense equation Keras'
MultiHeadAttention and keras-hub 0.32 build (``abc,cde->abde``,
``btd,dnh->btnh``, ``btnh,nhd->btd``, ``bsd,kdh->bskh``, ``ibnd,hnd->ibh``...).

Such an equation is computed as

* no trailing axes: ``reshape(x, (-1, K)) @ reshape(kernel, (K, N))``, a 2-D
  ``MatMul`` (the rows fold into one axis);
* trailing axes: ``reshape(x, (-1, K, S))`` contracted over its middle axis
  with the 2-D kernel, a ``BatchMatMulV2`` with ``adj_x``;

then reshaped to the output. A bias whose axes are all the kernel's free
axes (the usual ``bias_axes``) is added by ``BiasAdd`` on the product's
last axis before the reshape (tiled over the free axes it omits), so
``MatMul + BiasAdd (+ activation)`` stay adjacent for the remapper; a bias
over other axes is added after the reshape as stock adds it.
"""

from __future__ import annotations

import dataclasses
import re

MATMUL = "MatMul"
BATCH_MATMUL = "BatchMatMulV2"

BIAS_ADD = "bias_add"  # BiasAdd on the product's last (flattened free-kernel) axis, before the reshape
BIAS_AFTER = "add"  # the add stock uses, on the output, after the reshape

_LETTERS = "[a-zA-Z]"
_FORMS = (  # (regex over the equation with "..." as "0", where the ellipsis is)
    (re.compile(f"({_LETTERS}+),({_LETTERS}+)->({_LETTERS}+)"), None),
    (re.compile(f"0({_LETTERS}+),({_LETTERS}+)->0({_LETTERS}+)"), "left"),
    (re.compile(f"({_LETTERS}{{2,}})0,({_LETTERS}+)->({_LETTERS}+)0"), "right"),
)


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
    """How FusedEinsumDense computes one equation for inputs of one rank.

    Attributes:
        equation: the EinsumDense equation.
        input_rank: the input rank the ellipsis was expanded for.
        rows: the leading input axes kept in the output (folded into the rows).
        contracted: the input axes after them that the kernel contracts (in
            the kernel, after `kernel_perm`, its leading axes, same order).
        trailing: the input axes after the contracted ones, kept in the
            output before the kernel's free axes; nonzero means BatchMatMulV2.
        kernel_perm: the transpose that orders the kernel as ``contracted +
            free axes in output order``, or None when it is stored that way.
        bias: `BIAS_ADD`, `BIAS_AFTER`, or None (no bias).
    """

    equation: str
    input_rank: int
    rows: int
    contracted: int
    trailing: int
    kernel_perm: tuple | None
    bias: str | None

    @property
    def op(self):
        """The product op: `MATMUL` (2-D) or `BATCH_MATMUL`."""
        return BATCH_MATMUL if self.trailing else MATMUL


def _specs(equation, input_rank):
    """``(input, kernel, output)`` label lists with the ellipsis expanded, or a reason string."""
    text = re.sub(r"\.\.\.", "0", equation.replace(" ", ""))
    for regex, side in _FORMS:
        m = regex.fullmatch(text)
        if m is None:
            continue
        inp, ker, out = (list(g) for g in m.groups())
        if side is None:
            return inp, ker, out
        elided = input_rank - len(inp) if input_rank is not None else 0
        if elided < 0:
            return f"an input of rank {input_rank} has fewer axes than the equation names"
        extra = [f"<{i}>" for i in range(elided)]  # labels no letter can clash with
        if side == "left":
            return extra + inp, ker, extra + out
        return inp + extra, ker, out + extra
    return "not one of EinsumDense's equation forms ([X],[Y]->[Z], ...[X],[Y]->...[Z], [X]...,[Y]->[Z]...)"


def einsum_plan(equation, bias_axes, input_rank=None):
    """``(EinsumPlan, None)`` for an equation FusedEinsumDense computes as a matrix product, else ``(None, reason)``.

    Args:
        equation: the EinsumDense equation.
        bias_axes: its ``bias_axes`` (output letters) or None.
        input_rank: the input rank (expands the ellipsis); None reads the
            equation with an ellipsis of no axes.
    """
    specs = _specs(equation, input_rank)
    if isinstance(specs, str):
        return None, specs
    inp, ker, out = specs
    if input_rank is not None and len(inp) != input_rank:
        return None, f"an input of rank {input_rank} for an equation over {len(inp)} input axes"
    for name, spec in (("input", inp), ("kernel", ker), ("output", out)):
        if len(set(spec)) != len(spec):
            return None, f"a repeated letter in the {name} spec (a diagonal): no matrix product"
    shared = [c for c in inp if c in ker and c in out]
    if shared:
        return None, (f"axis {shared[0]!r} is in the input, kernel and output (a batched kernel): "
                      "stock's einsum runs")
    summed = [c for c in inp + ker if c not in out and not (c in inp and c in ker)]
    if summed:
        return None, f"axis {summed[0]!r} is summed over one operand alone: stock's einsum runs"
    contracted = [c for c in inp if c in ker]
    if not contracted:
        return None, "no axis is contracted (an outer product): stock's einsum runs"
    start = inp.index(contracted[0])
    if inp[start:start + len(contracted)] != contracted:
        return None, "the contracted input axes are not adjacent: stock's einsum runs"
    rows, trailing = inp[:start], inp[start + len(contracted):]
    free = out[len(rows) + len(trailing):]
    if out[:len(rows) + len(trailing)] != rows + trailing or sorted(free) != sorted(c for c in ker if c in out):
        return None, ("the output does not keep the input's free axes first, in their order, then the "
                      "kernel's (a transposed output): stock's einsum runs")
    order = [ker.index(c) for c in contracted + free]
    perm = None if order == list(range(len(ker))) else tuple(order)
    bias = None
    if bias_axes:
        missing = [c for c in bias_axes if c not in out]
        if missing:
            return None, f"bias axis {missing[0]!r} is not in the output: stock's build raises"
        first = min(out.index(c) for c in bias_axes)
        bias = BIAS_ADD if first >= len(rows) + len(trailing) else BIAS_AFTER
    plan = EinsumPlan(equation, len(inp), len(rows), len(contracted), len(trailing), perm, bias)
    return plan, None
