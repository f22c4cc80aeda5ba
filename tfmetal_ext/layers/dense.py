"""Fusion-first dense layer: MatMul -> BiasAdd -> activation, for inputs of any rank."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext import _saved_names
from tfmetal_ext import ops as tfm_ops
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.layers import _ops
from tfmetal_ext.layers import _quantize as Q
from tfmetal_ext.layers import _replay


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedDense(keras.layers.Dense):
    """Densely connected layer that emits ``MatMul -> BiasAdd -> activation``.

    A drop-in for `keras.layers.Dense`: a subclass with the same math,
    arguments, weights (``kernel`` ``(in, units)``, ``bias`` ``(units,)``),
    LoRA and quantization modes. Inputs of rank > 2 are reshaped to
    2-D, multiplied, biased and activated, then reshaped back, so the MatMul,
    BiasAdd and activation stay adjacent and fuse (Keras' Dense puts a Reshape
    between MatMul and BiasAdd there, and nothing fuses).

    Activations emitted as one fusable TF op: relu, relu6, elu, leaky_relu
    (slope 0.2, as `keras.activations.leaky_relu`), tanh, sigmoid and GELU:
    ``"gelu"`` is the exact (erf) GELU, like Keras' ``"gelu"``, and
    ``"gelu_approximate"`` the tanh approximation (as
    ``keras.activations.gelu(x, approximate=True)``). Any other activation is
    applied unfused with `keras.activations` after the BiasAdd.

    What the pattern becomes:

    | backend | fused op |
    |---|---|
    | Metal (tensorflow-metal) | `_FusedMatMul[BiasAdd(, Relu/Relu6/Elu/LeakyRelu)]`, float32/float16; relu is reported to miscompute in graph mode |
    | CUDA | `_FusedMatMul[BiasAdd(, act)]` only with ``TF_USE_CUBLASLT=1`` |
    | CPU (oneDNN) | `_FusedMatMul[BiasAdd(, act)]` incl. Tanh, Sigmoid, GeluExact/GeluApproximate (inference), float32/bfloat16; training: LeakyRelu and GELU leave only `[BiasAdd]` |
    | CPU (no oneDNN) | `_FusedMatMul[BiasAdd(, Relu/Relu6/Elu/LeakyRelu)]`, float32 |

    Training memory: in a training call inside a tf.function, an input made
    by a short elementwise chain over tensors the backward pass keeps anyway
    (a feed-forward's ``silu(gate) * up`` or ``gelu(pre)``) is made again in
    the backward pass instead of being kept with the chain's intermediates
    (`tfmetal_ext.layers._replay`); the gradients are TensorFlow's own for
    the same ops. Eagerly the ordinary path runs.

    Decoding: an input of the shape ``[batch, 1, ..., in]`` (one position per
    sequence, as a generation step's) with a static batch of at most
    ``fusion.GEMV_MAX_ROWS`` rows is one ``TfmetalExt>Gemv`` instead (bias in
    it, then the activation) where the backend table takes it (the CPU's:
    each weight read once, where TF's CPU MatMul spends most of a one-row
    product on packing the kernel; not Metal's yet, see
    `tfmetal_ext.ops.gemv`). Any other input keeps the pattern above.

    float16 on a CPU without native half fuses nothing. While
    ``tfmetal_ext.configure(avoid_fusions=["matmul_bias_relu"])`` is in force
    (set before tracing), the bias is added with AddV2 instead: nothing fuses
    on a GPU, and on CPU with oneDNN the AddV2 still fuses as a BiasAdd.

    Args:
        units: output size, a positive int.
        activation: a Keras activation (name, config or callable),
            ``"gelu_approximate"``, or None (linear).
        use_bias: whether to add a bias (and so emit the BiasAdd that fuses).
        kernel_initializer: initializer of the ``(in, units)`` kernel.
        bias_initializer: initializer of the ``(units,)`` bias.
        kernel_regularizer: regularizer of the kernel.
        bias_regularizer: regularizer of the bias.
        activity_regularizer: regularizer of the output.
        kernel_constraint: constraint of the kernel.
        bias_constraint: constraint of the bias.
        lora_rank: with an int, LoRA is enabled at build (`enable_lora`).
        lora_alpha: the LoRA scale numerator (``alpha / rank``); defaults to
            `lora_rank`.
        quantization_config: None or a `keras.quantizers.QuantizationConfig`,
            used when the layer is quantized (`quantize`, an ``<mode>_from_*``
            dtype policy); see below.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Masks pass through unchanged (``supports_masking``), as Keras' Dense.

    Quantization: every mode stock Dense has. ``"int8"`` (``quantize("int8")``,
    ``model.quantize("int8")``, a ``dtype`` / ``dtype_policy`` of
    ``"int8_from_<policy>"``) with no config (Keras' default one), or with
    ``Int8QuantizationConfig(activation_quantizer=None)``, runs the fused form:
    the kernel is stored as int8 with a per-column float ``kernel_scale``
    (stock Dense's variables and stores, so weights load either way) and each
    call is one ``TfmetalExt>Int8MatMul``, weight-only (the activations stay
    float; stock Dense also quantizes its inputs by default). The int8 kernel
    and its scale are not trainable; gradients reach the inputs, the bias and
    LoRA, computed with the de-quantized kernel. A config with an activation
    quantizer (stock Dense then quantizes its inputs) or another weight
    quantizer, and the modes ``"int4"``, ``"float8"``, ``"gptq"`` and
    ``"awq"``, run Keras' own implementation of that form, as stock Dense
    does; the fusion report says which form ran and why.

    Input shape:
        N-D tensor ``(batch, ..., in)``, N >= 2, last dimension known.

    Output shape:
        N-D tensor ``(batch, ..., units)``.

    Returns:
        ``activation(inputs @ kernel + bias)``, in the layer's compute dtype.

    Raises:
        ValueError: on an invalid argument (the message ends with
            ``Received: name=value``) or an input of rank < 2 or unknown last
            dimension.

    Example:

    >>> layer = FusedDense(16, activation="gelu")
    >>> layer(np.zeros((4, 10, 8), "float32")).shape
    TensorShape([4, 10, 16])
    """

    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        **kwargs,
    ):
        if isinstance(quantization_config, dict):  # a serialized config (from_config)
            quantization_config = keras.saving.deserialize_keras_object(quantization_config)
        if quantization_config is not None and not isinstance(quantization_config, keras.quantizers.QuantizationConfig):
            raise ValueError(
                "`quantization_config` must be None or a keras.quantizers.QuantizationConfig. "
                f"Received: quantization_config={quantization_config!r}"
            )
        activation_fn, activation_name = C.resolve_activation(activation, allow_gelu_approximate=True)
        if lora_rank is not None:
            lora_rank = C.positive_int(lora_rank, "lora_rank")
        super().__init__(
            C.positive_int(units, "units"),
            activation=None,  # set below: "gelu_approximate" is ours
            use_bias=C.boolean(use_bias, "use_bias"),
            kernel_initializer=C.keras_object(keras.initializers.get, kernel_initializer, "kernel_initializer"),
            bias_initializer=C.keras_object(keras.initializers.get, bias_initializer, "bias_initializer"),
            kernel_regularizer=C.keras_object(keras.regularizers.get, kernel_regularizer, "kernel_regularizer"),
            bias_regularizer=C.keras_object(keras.regularizers.get, bias_regularizer, "bias_regularizer"),
            activity_regularizer=C.keras_object(keras.regularizers.get, activity_regularizer, "activity_regularizer"),
            kernel_constraint=C.keras_object(keras.constraints.get, kernel_constraint, "kernel_constraint"),
            bias_constraint=C.keras_object(keras.constraints.get, bias_constraint, "bias_constraint"),
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            quantization_config=quantization_config,
            **kwargs,
        )
        self.activation, self._activation_name = activation_fn, activation_name
        self._tfm_int8 = False  # the fused int8 form is built (see `_int8_build`)

    def _keras_form(self):
        """The layer runs Keras' own form of its quantization mode (not ours)."""
        mode = self.quantization_mode
        if mode is None:
            return False
        if self.built:
            return not self._tfm_int8
        return not (mode == Q.INT8 and Q.weight_only(self.quantization_config, axes=(0,), ndim=2))

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(
                "Expected an input of rank >= 2 with a known last dimension. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        if self._keras_form():  # int4, float8, gptq, awq, or int8 with quantizers ours does not run
            super().build(input_shape)
            return
        in_dim = int(input_shape[-1])
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_dim})
        kernel_shape = (in_dim, self.units)
        if self.quantization_mode:  # an int8_from_* dtype policy: build the quantized variables
            self.quantized_build(kernel_shape, mode=self.quantization_mode, config=self.quantization_config)
        else:
            self._kernel = self.add_weight(
                name="kernel",
                shape=kernel_shape,
                initializer=self.kernel_initializer,
                regularizer=self.kernel_regularizer,
                constraint=self.kernel_constraint,
                trainable=True,
            )
        C.add_bias_weight(self, self.units)
        self.built = True
        if self.lora_rank:
            self.enable_lora(self.lora_rank, lora_alpha=self.lora_alpha)

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"):
        """Low-rank adaptation, as `keras.layers.Dense.enable_lora`.

        The kernel is frozen; trainable float32 ``lora_kernel_a`` ``(in, rank)``
        and ``lora_kernel_b`` ``(rank, units)`` are added. The effective kernel
        is computed before the MatMul, so MatMul -> BiasAdd -> activation stay
        adjacent and fuse as without LoRA. Saving stores the merged kernel
        (``kernel + (alpha / rank) * a @ b``), as Keras does.

        Raises:
            ValueError: with a kernel constraint, before the layer is built, or
                when LoRA is already enabled (Keras' messages).
        """
        if self._keras_form():
            return super().enable_lora(rank, lora_alpha, a_initializer, b_initializer)
        if self.kernel_constraint:
            raise ValueError(
                "Lora is incompatible with kernel constraints. In order to enable lora on this layer, "
                f"remove the `kernel_constraint` argument. Received: kernel_constraint={self.kernel_constraint!r}"
            )
        if not self.built:
            raise ValueError("Cannot enable lora on a layer that isn't yet built. Received: built=False")
        if self.lora_enabled:
            raise ValueError("lora is already enabled. This can only be done once per layer. Received: lora_enabled=True")
        rank = C.positive_int(rank, "rank")
        self._tracker.unlock()
        try:
            self.lora_kernel_a = self.add_weight(
                name="lora_kernel_a", shape=(self._kernel.shape[0], rank),
                initializer=keras.initializers.get(a_initializer), dtype="float32",
                regularizer=self.kernel_regularizer,
            )
            self.lora_kernel_b = self.add_weight(
                name="lora_kernel_b", shape=(rank, self.units),
                initializer=keras.initializers.get(b_initializer), dtype="float32",
                regularizer=self.kernel_regularizer,
            )
        finally:
            self._tracker.lock()
        self._kernel.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else rank

    # ------------------------------------------------------------------
    # Saving: stock Dense's stores (`variable_serialization_spec` order).

    def _merged_int8_kernel(self):
        """``(q, scale)`` with the LoRA update merged and re-quantized (as Keras' Dense saves it)."""
        if not self.lora_enabled:
            return self._kernel, self.kernel_scale
        delta = tf.matmul(self.lora_kernel_a, self.lora_kernel_b) * (self.lora_alpha / self.lora_rank)
        merged = Q.dequantized(self, dtype=tf.float32) + delta
        return Q.quantize_kernel(merged, (0,), self.units)

    def save_own_variables(self, store):
        # As Keras' Dense: kernel (LoRA merged; int8: merged and re-quantized), bias, kernel_scale.
        if self._keras_form():
            return super().save_own_variables(store)
        if not self.built:
            return
        names = Q.stored_names(self)
        if self.quantization_mode == Q.INT8:
            kernel, scale = self._merged_int8_kernel()
        else:
            kernel, scale = self.kernel, None
        values = {"kernel": kernel, "bias": self.bias, "kernel_scale": scale}
        for i, name in enumerate(names):
            store[str(i)] = keras.ops.convert_to_numpy(values[name])

    def load_own_variables(self, store):
        if self._keras_form():
            return super().load_own_variables(store)
        if not self.built:
            return
        names = Q.stored_names(self)
        Q.check_store(self, store, names)
        targets = {"kernel": self._kernel, "bias": self.bias, "kernel_scale": getattr(self, "kernel_scale", None)}
        for i, name in enumerate(names):
            targets[name].assign(store[str(i)])
        if self.lora_enabled:  # the stored kernel has the update merged: restart it from zero
            self.lora_kernel_a.assign(tf.zeros(self.lora_kernel_a.shape, self.lora_kernel_a.dtype))
            self.lora_kernel_b.assign(tf.zeros(self.lora_kernel_b.shape, self.lora_kernel_b.dtype))

    # ------------------------------------------------------------------
    # Keras' quantization API: the fused weight-only int8 form, else Keras' own form.

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the kernel in place, as `keras.layers.Dense.quantize`.

        ``"int8"`` with no config (``quantize("int8")``,
        ``model.quantize("int8")``: Keras resolves it to ``Int8QuantizationConfig()``)
        or ``Int8QuantizationConfig(activation_quantizer=None)``: the fused
        weight-only form. The float kernel becomes a non-trainable
        int8 ``_kernel`` and a non-trainable float ``kernel_scale`` of the
        ``units`` columns (`tfmetal_ext.ops.quantize_int8`: Keras' abs-max
        scale, bitwise the weights stock Dense stores); the dtype policy
        becomes ``int8_from_<policy>``. Calls then run one
        ``TfmetalExt>Int8MatMul`` (bias and activation in the op; with LoRA,
        the op then the adapters, bias and activation). Keras' default config
        is taken as "no config": its default activation quantizer is dropped
        (the stored config says ``activation_quantizer=None``, what runs).
        To run Keras' own int8 form, with its inputs quantized, pass a config
        that names its quantizers.

        Every other case (a config with an activation quantizer, another
        weight quantizer, and the modes ``"int4"``, ``"float8"``, ``"gptq"``,
        ``"awq"``) is Keras' own implementation, as stock Dense runs it.

        Args:
            mode: a Keras quantization mode, or None with a `config`.
            type_check: as Keras: a subclass of FusedDense raises
                NotImplementedError unless this is False.
            config: None or a `keras.quantizers.QuantizationConfig`.

        Raises:
            ValueError: an unbuilt or already quantized layer, an unknown
                mode, ``compute_dtype="float16"``, a config that does not
                match the mode (Keras' checks).
            NotImplementedError: a subclass with `type_check`.
        """
        if type_check and _saved_names.unaliased(type(self)) is not FusedDense:
            raise self._not_implemented_error(self.quantize)
        if mode == Q.INT8 and Q.weight_only(config, axes=(0,), ndim=2):
            config = Q.weight_only_config(config)
            Q.quantize_in_place(self, self._kernel, (0,), self.units, mode, config, self._drop_float_kernel)
            return
        super().quantize(mode, type_check=False, config=config)

    def _drop_float_kernel(self):
        del self._kernel

    def _int8_build(self, kernel_shape, config=None):
        if not Q.weight_only(config, axes=(0,), ndim=2):  # Keras' int8 form, with its quantizers
            self._tfm_int8 = False
            return super()._int8_build(kernel_shape, config)
        self._tfm_int8 = True
        self.inputs_quantizer = None  # weight-only: the inputs stay float
        Q.add_int8_weights(self, kernel_shape, self.units)

    def _int8_call(self, inputs, training=None):
        if not self._tfm_int8:
            return super()._int8_call(inputs, training=training)
        tops = Q.ops()
        scale = Q.scale_f32(self)
        if isinstance(inputs, tf.SparseTensor):  # as the float layer: a sparse MatMul, nothing fuses
            outputs = keras.ops.matmul(inputs, Q.dequantized(self))
            if self.lora_enabled:
                outputs = outputs + self._lora_update(inputs)
            if self.use_bias:
                outputs = outputs + self.bias
            return C.apply_activation(outputs, self.activation, self._activation_name, training)
        dtype = inputs.dtype
        bias = tf.cast(self.bias, dtype) if self.use_bias else None
        act = self._activation_name
        if self.lora_enabled or act not in fusion.INT8_ACTIVATIONS:
            outputs = tops.int8_matmul(inputs, self._kernel, scale, bias=None if self.lora_enabled else bias)
            if self.lora_enabled:
                outputs = outputs + self._lora_update(inputs)
                if bias is not None:
                    outputs = outputs + bias
            return C.apply_activation(outputs, self.activation, act, training)
        return tops.int8_matmul(inputs, self._kernel, scale, bias=bias, activation=act)

    def _lora_update(self, inputs):
        a = tf.cast(self.lora_kernel_a, inputs.dtype)
        b = tf.cast(self.lora_kernel_b, inputs.dtype)
        return keras.ops.matmul(keras.ops.matmul(inputs, a), b) * (self.lora_alpha / self.lora_rank)

    def call(self, inputs, training=None):
        if training and not isinstance(inputs, tf.SparseTensor):
            # A feed-forward's `act(gate) * up` input, or a norm's output, is made again in the backward
            # pass (`_replay`) instead of kept for the kernel gradient.
            replay = _replay.plan(inputs) or _replay.norm_plan(inputs)
            if replay is not None:
                return _replay.apply_projection(lambda x, activate: self._float_call(x, training, activate), inputs,
                                                replay, self.activation, self._activation_name, training)
        return self._float_call(inputs, training)

    def _float_call(self, inputs, training=None, activate=True):
        kernel = self.kernel
        if isinstance(inputs, tf.SparseTensor):
            # As Keras' Dense: a sparse MatMul, dense output (nothing to fuse), sparse kernel gradient.
            outputs = keras.ops.matmul(inputs, kernel)
            if self.use_bias:
                outputs = outputs + self.bias
            return C.apply_activation(outputs, self.activation, self._activation_name, training)
        rank = inputs.shape.rank
        flat = inputs
        if rank > 2:
            flat = tf.reshape(inputs, [-1, kernel.shape[0]])
        if rank is not None and _ops.gemv_rows(inputs.shape, rank - 1, flat.dtype):
            # A decoding step's few rows ([batch, 1, ..., features]): one TfmetalExt>Gemv, bias in it.
            bias = tf.cast(self.bias, flat.dtype) if self.use_bias else None
            outputs = tfm_ops.gemv(flat, tf.cast(kernel, flat.dtype), bias)
        else:
            outputs = tf.matmul(flat, kernel)
            if self.use_bias:
                outputs = _ops.bias_add(outputs, self.bias, "matmul_bias_relu")
        if activate:
            outputs = C.apply_activation(outputs, self.activation, self._activation_name, training)
        if rank > 2:
            # Back to (batch, ..., units); the activation already ran on the 2-D
            # tensor so MatMul -> BiasAdd -> act stay adjacent for the remapper.
            outputs = tf.reshape(outputs, _leading_shape(inputs, self.units))
            outputs.set_shape(inputs.shape[:-1].concatenate([self.units]))
        return outputs

    def get_config(self):
        # Keras Layer's config, then Dense's keys (its get_config would serialize "gelu_approximate" as a function).
        config = keras.layers.Layer.get_config(self)
        config.update(
            {
                "units": self.units,
                "activation": C.serialize_activation(self.activation, self._activation_name),
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "quantization_config": keras.saving.serialize_keras_object(self.quantization_config),
            }
        )
        if self.lora_rank:
            config["lora_rank"] = self.lora_rank
            config["lora_alpha"] = self.lora_alpha
        return config


def _fused_dense_rule(layer, ctx):
    name = C.catalog_activation_name(layer._activation_name, layer.activation)
    # Rank > 2 inputs are flattened before the MatMul, so they fuse like 2-D ones.
    return catalog.dense_rule(layer, ctx, act_name=name, reshape_blocks=False)


_float_rule = catalog.unless_avoided("matmul_bias_relu", _fused_dense_rule)


def _rule(layer, ctx):
    if layer._keras_form():  # Keras' own quantized form: unfused, the report says which ran and why
        return catalog.keras_quantized_rule(layer, ctx, Q.keras_form_reason(layer))
    if layer.quantization_mode == Q.INT8:  # one TfmetalExt>Int8MatMul (bias, activation in it)
        note = None
        if layer.lora_enabled or layer._activation_name not in fusion.INT8_ACTIVATIONS:
            note = ("LoRA: the adapters, bias and activation run after the op" if layer.lora_enabled
                    else "this activation runs after the op")
        return catalog.int8_rule(layer, ctx, "matmul", note=note, reference=_fused_dense_rule(layer, ctx))
    return _float_rule(layer, ctx)


catalog.register_rule(FusedDense, _rule)


def _leading_shape(x, units):
    """The shape ``x.shape[:-1] + [units]`` as a reshape takes it: a constant where at most one leading
    dimension is unknown statically (it becomes -1), else computed from ``tf.shape(x)``. A constant
    adds no op to the graph (a decode loop runs each op once per token). A static 0 leaves -1
    undetermined for an empty tensor: then the shape is computed too."""
    lead = x.shape[:-1].as_list()
    if sum(d is None for d in lead) <= 1 and 0 not in lead:
        return [-1 if d is None else d for d in lead] + [units]
    return tf.concat([tf.shape(x)[:-1], [units]], axis=0)

