"""FusedEinsumDense: keras.layers.EinsumDense as reshape -> MatMul / BatchMatMulV2 -> BiasAdd -> activation."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfmetal_ext import _saved_names
from tfmetal_ext import ops as tfm_ops
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers import _replay
from tfmetal_ext.layers._einsum_plan import BIAS_ADD, BIAS_AFTER, MATMUL, einsum_plan

_STOCK = keras.layers.EinsumDense


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedEinsumDense(_STOCK):
    """`keras.layers.EinsumDense` that emits ``MatMul`` / ``BatchMatMulV2`` + ``BiasAdd`` instead of ``Einsum``.

    A drop-in: a subclass with EinsumDense's constructor, config, variables
    (``kernel``, ``bias``, ``lora_kernel_a`` / ``lora_kernel_b``, and every
    quantization mode's), saving and outputs. For an equation that is a
    matrix product after reshapes (the input's contracted axes adjacent,
    its other axes kept in order, the kernel's free axes last in the output:
    every equation Keras' MultiHeadAttention and keras-hub build; see
    `tfmetal_ext.layers._einsum_plan`), decided once at build for the input
    rank, a call is

        reshape -> MatMul (rows folded) or BatchMatMulV2 (axes after the
        contracted ones) -> BiasAdd -> activation -> reshape

    and the kernel is transposed first when its free axes are stored in
    another order than the output's. A bias over the kernel's free axes
    (the usual ``bias_axes``) is a BiasAdd on the product's last axis, tiled
    over the free axes it omits; a bias over other axes is added after the
    reshape, as stock adds it. Any other equation runs stock's `call`
    (``Einsum``); `unfused_reason` says why.

    What the pattern becomes: the same as `FusedDense` for the 2-D MatMul
    form (``_FusedMatMul[BiasAdd(, act)]`` on CPU, CUDA with cuBLASLt and
    Metal, per the backend tables); ``BatchMatMulV2`` + ``BiasAdd`` is not
    fused by any remapper, but the open Metal plugin, which has no ``Einsum``
    kernel, has kernels for both. While ``configure(avoid_fusions=
    ["matmul_bias_relu"])`` is in force the bias is an AddV2 (as FusedDense).

    Decoding: a MatMul plan on an input with one position per sequence
    (``[batch, 1, ...]``, a generation step's) and a static batch of at most
    ``fusion.GEMV_MAX_ROWS`` rows is one ``TfmetalExt>Gemv`` instead, with a
    BiasAdd plan's bias inside, where the backend table takes it (the CPU's:
    each weight read once, where TF's CPU MatMul packs the kernel first; not
    Metal's yet, see `tfmetal_ext.ops.gemv`).

    LoRA: as stock, ``kernel + (lora_alpha / lora_rank) * a @ b`` is the
    kernel the product reads (EinsumDense's own ``kernel`` property), so the
    adapters get gradients and a frozen kernel none.

    Training memory: as `FusedDense`, a planned product's input made by a
    feed-forward's elementwise chain (``silu(gate) * up``, ``gelu(x1) * x2``)
    is made again in the backward pass inside a tf.function
    (`tfmetal_ext.layers._replay`), not kept.

    Quantization: ``quantize(mode)`` and the ``<mode>_from_<policy>`` dtype
    policies are stock's (the same variables and stores). ``"int8"``
    weight-only (a config whose ``activation_quantizer`` is None) computes
    stock's math with the product above in place of ``Einsum``: the int8
    kernel cast to the compute dtype, the product, then divided by
    ``kernel_scale`` (stock divides after its einsum too), LoRA added as
    stock adds it; the input gradient flows through the same product. Every
    other case (int8 with an activation quantizer, which is Keras' default
    ``quantize("int8")``; int4, float8, gptq, awq) runs stock's quantized call,
    with its ``Einsum``.

    Args:
        equation: the einsum equation (``"abc,cd->abd"``, ``"...b,bc->...c"``...).
        output_shape: the output shape without the batch axis and the
            ellipsis axes (None for unknown dimensions).
        activation: a Keras activation (name, config or callable) or None.
        bias_axes: output letters the bias spans, or None for no bias.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, kernel_constraint, bias_constraint: as EinsumDense.
        lora_rank, lora_alpha: LoRA at build, as EinsumDense.
        gptq_unpacked_column_size, quantization_config: as EinsumDense.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Input shape:
        What the equation's input spec names (the ellipsis any number of axes).

    Output shape:
        What the equation's output spec names, as EinsumDense.

    Returns:
        ``activation(einsum(equation, inputs, kernel) + bias)``.

    Raises:
        ValueError: EinsumDense's errors (an invalid equation, mismatched
            shapes, a bias axis not in the output), at build.

    Example:

    >>> layer = FusedEinsumDense("btd,dnh->btnh", output_shape=(None, 4, 8), bias_axes="nh")
    >>> layer(np.zeros((2, 5, 16), "float32")).shape
    TensorShape([2, 5, 4, 8])
    """

    def build(self, input_shape):
        super().build(input_shape)
        self._plan, self._plan_reason = einsum_plan(self.equation, self.bias_axes, len(input_shape))

    @property
    def plan(self):
        """The `EinsumPlan` the float call follows (None: stock's einsum runs; `unfused_reason` says why)."""
        if self.built:
            return self._plan
        return einsum_plan(self.equation, self.bias_axes)[0]

    @property
    def unfused_reason(self):
        """Why a call runs stock's ``Einsum`` (its quantized call or its equation), or None."""
        mode = self.quantization_mode
        if mode is not None and not self._weight_only_int8():
            if mode == "int8":
                return ("int8 with an activation quantizer (Keras' default int8 config): stock's int8 call "
                        "runs (it quantizes the inputs and contracts with Einsum)")
            return f"quantization mode {mode!r}: stock's {mode} call runs (Einsum)"
        reason = self._plan_reason if self.built else einsum_plan(self.equation, self.bias_axes)[1]
        return f"equation {self.equation!r}: {reason}" if reason else None

    def _weight_only_int8(self):
        return self.quantization_mode == "int8" and getattr(self, "inputs_quantizer", None) is None

    # ------------------------------------------------------------------
    # The product.

    def _product(self, x, kernel, gemv=False):
        """``einsum(equation, x, kernel)`` as a MatMul / BatchMatMulV2 of reshapes.

        Returns ``(flat, static, free)``: the product, ``(rows, N)`` (MatMul)
        or ``(rows, trailing, N)`` (BatchMatMulV2) with `N` the kernel's free
        axes flattened in output order; the output's static shape; the free
        axes' sizes (`_reshape` makes the output). With `gemv` (a MatMul plan
        on a decoding step's rows, `_ops.gemv_rows`) the product is one
        ``TfmetalExt>Gemv`` with the flat bias (BIAS_ADD plans) in it.
        """
        p = self._plan
        k = tf.convert_to_tensor(kernel)
        if k.dtype != x.dtype:
            k = tf.cast(k, x.dtype)
        if p.kernel_perm is not None:
            k = tf.transpose(k, p.kernel_perm)
        kshape = k.shape.as_list()
        depth, free = math.prod(kshape[: p.contracted]), kshape[p.contracted:]
        if k.shape.rank != 2 or p.contracted != 1:
            k = tf.reshape(k, [depth, math.prod(free)])
        after = p.rows + p.contracted  # the first trailing axis
        static = x.shape[: p.rows].concatenate(x.shape[after:]).concatenate(free)
        if p.op == MATMUL:
            flat = x if (x.shape.rank, p.rows) == (2, 1) else tf.reshape(x, [-1, depth])
            if gemv:
                bias = tf.cast(self._flat_bias(free), x.dtype) if p.bias == BIAS_ADD else None
                return tfm_ops.gemv(flat, k, bias), static, free
            return tf.matmul(flat, k), static, free
        trailing = x.shape[after:]
        if trailing.is_fully_defined():
            x3 = tf.reshape(x, [-1, depth, trailing.num_elements()])
        else:
            x3 = tf.reshape(x, tf.stack([-1, depth, tf.reduce_prod(tf.shape(x)[after:])]))
        return tf.matmul(x3, k, adjoint_a=True), static, free

    def _flat_bias(self, free):
        """The bias as one vector over the flattened free kernel axes (tiled where its shape has 1s)."""
        b = tf.convert_to_tensor(self.bias)
        shape = b.shape.as_list()
        lead = len(free) - len(shape)
        if lead:
            shape = [1] * lead + shape
            b = tf.reshape(b, shape)
        multiples = [f if s == 1 else 1 for s, f in zip(shape, free)]
        if any(m != 1 for m in multiples):
            b = tf.tile(b, multiples)
        return b if b.shape.rank == 1 else tf.reshape(b, [-1])

    def _reshape(self, y, x, static, free):
        """The product `y` of input `x` in the output's shape ``rows + trailing + free`` (`static` statically)."""
        p = self._plan
        if p.op == MATMUL and p.rows == 1 and static.rank == 2:  # (rows, N) is the output already
            return y
        if static.is_fully_defined():
            y = tf.reshape(y, static)
        else:
            shape = tf.shape(x)
            y = tf.reshape(y, tf.concat([shape[: p.rows], shape[p.rows + p.contracted:], free], axis=0))
        y.set_shape(static)
        return y

    def call(self, inputs, training=None):
        p = getattr(self, "_plan", None)
        if p is None:
            return super().call(inputs, training=training)
        if training:
            # A feed-forward's `act(gate) * up` input, or a norm's output, is made again in the backward
            # pass (`_replay`) instead of kept for the kernel gradient.
            replay = _replay.plan(inputs) or _replay.norm_plan(inputs)
            if replay is not None:
                fn, name = C.resolve_activation(self.activation)
                return _replay.apply_projection(lambda x, activate: self._planned_call(x, training, activate),
                                                inputs, replay, fn, name, training)
        return self._planned_call(inputs, training)

    def _planned_call(self, inputs, training=None, activate=True):
        p = self._plan
        fn, name = C.resolve_activation(self.activation) if activate else (None, "linear")
        # A decoding step's few rows: one TfmetalExt>Gemv (bias in it), no MatMul to fuse.
        gemv = p.op == MATMUL and p.bias != BIAS_AFTER and _ops.gemv_rows(inputs.shape, p.rows, inputs.dtype)
        y, static, free = self._product(inputs, self.kernel, gemv=gemv)
        if gemv:
            return self._reshape(C.apply_activation(y, fn, name, training), inputs, static, free)
        if p.bias == BIAS_ADD:
            # MatMul -> BiasAdd -> activation adjacent (the remapper's pattern), then the reshape.
            y = _ops.bias_add(y, self._flat_bias(free), "matmul_bias_relu")
            return self._reshape(C.apply_activation(y, fn, name, training), inputs, static, free)
        y = self._reshape(y, inputs, static, free)
        if p.bias == BIAS_AFTER:
            y = keras.ops.add(y, self.bias)
        return C.apply_activation(y, fn, name, training)

    # ------------------------------------------------------------------
    # Quantization: stock's, with the weight-only int8 product as above.

    def quantize(self, mode=None, type_check=True, config=None):
        """Stock EinsumDense's `quantize` (every mode), which refuses subclasses of this class unless
        ``type_check=False``, as stock refuses subclasses of EinsumDense."""
        if type_check and _saved_names.unaliased(type(self)) is not FusedEinsumDense:
            raise self._not_implemented_error(self.quantize)
        return super().quantize(mode, type_check=False, config=config)

    def _einsum(self, x, kernel):
        y, static, free = self._product(x, kernel)
        return self._reshape(y, x, static, free)

    def _int8_call(self, inputs, training=None):
        if getattr(self, "_plan", None) is None or not self._weight_only_int8():
            return super()._int8_call(inputs, training=training)
        # Stock's weight-only int8 math (einsum with the int8 kernel, then / kernel_scale), the
        # product in place of the einsum; the input gradient is the product's (stock: a custom
        # gradient through the de-quantized kernel, the same value).
        x = self._einsum(inputs, tf.cast(tf.convert_to_tensor(self._kernel), self.compute_dtype))
        x = keras.ops.divide(keras.ops.cast(x, self.compute_dtype), keras.ops.convert_to_tensor(self.kernel_scale))
        if self.lora_enabled:
            a = keras.ops.convert_to_tensor(self.lora_kernel_a)
            dtype = keras.backend.result_type(inputs.dtype, a.dtype)
            lora_x = self._einsum(keras.ops.cast(inputs, dtype), keras.ops.cast(a, dtype))
            lora_x = keras.ops.matmul(lora_x, self.lora_kernel_b)
            x = keras.ops.add(x, (self.lora_alpha / self.lora_rank) * lora_x)
            x = keras.ops.cast(x, self.compute_dtype)
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x


# ----------------------------------------------------------------------------
# Fusion report rule.


class _DenseView:
    """What `catalog.dense_rule` reads of a FusedEinsumDense: its bias, dtype, activation and output width."""

    def __init__(self, layer):
        self.use_bias = layer.bias is not None
        self.compute_dtype = layer.compute_dtype
        self.activation = layer.activation
        self.units = None  # read for stock Dense's one-element bias only


def _float_rule(layer, ctx):
    exp = catalog.dense_rule(_DenseView(layer), ctx, reshape_blocks=False)
    why = layer.unfused_reason
    plan = layer.plan
    if why is None and plan is not None and plan.op != MATMUL:
        why = (f"equation {layer.equation!r}: the axes after the contracted ones make it a BatchMatMulV2, which "
               "no remapper fuses with a BiasAdd")
    elif why is None and plan is not None and plan.bias == BIAS_AFTER:
        why = f"bias_axes={layer.bias_axes!r} spans input-side axes: the bias is added after the reshape"
    if why is None:
        return exp
    return catalog.Expectation(exp.pattern, None, None, exp.ideal_fused_ops, reason=why)


_rule = catalog.unless_avoided("matmul_bias_relu", _float_rule)


def _quantized_or_float_rule(layer, ctx):
    mode = layer.quantization_mode
    if mode is not None and not layer._weight_only_int8():
        return catalog.keras_quantized_rule(layer, ctx, layer.unfused_reason)
    if mode is not None:
        return catalog.Expectation(
            "matmul_bias_act", None, None, ("BiasAdd",),
            reason="weight-only int8: the int8 kernel is cast and the product divided by kernel_scale before the "
                   "bias (stock's int8 math), so nothing fuses",
        )
    return _rule(layer, ctx)


catalog.register_rule(FusedEinsumDense, _quantized_or_float_rule)
