"""Fusion-first dense layer: MatMul -> BiasAdd -> activation, for inputs of any rank."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext.inspect import catalog
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.layers import _ops


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedDense(keras.layers.Layer):
    """Densely connected layer that emits ``MatMul -> BiasAdd -> activation``.

    Same math, arguments and weights (``kernel`` ``(in, units)``, ``bias``
    ``(units,)``) as `keras.layers.Dense`. Inputs of rank > 2 are reshaped to
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
        quantization_config: None only (no quantized form; use
            `keras.layers.Dense`).
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Masks pass through unchanged (``supports_masking``), as Keras' Dense.

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
        if quantization_config is not None:
            raise ValueError(
                "FusedDense has no quantized form (its MatMul is the float one the remapper fuses); "
                f"use keras.layers.Dense. Received: quantization_config={quantization_config!r}"
            )
        activity_regularizer = C.keras_object(
            keras.regularizers.get, activity_regularizer, "activity_regularizer"
        )
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units = C.positive_int(units, "units")
        self.activation, self._activation_name = C.resolve_activation(
            activation, allow_gelu_approximate=True
        )
        self.use_bias = C.boolean(use_bias, "use_bias")
        self.kernel_initializer = C.keras_object(keras.initializers.get, kernel_initializer, "kernel_initializer")
        self.bias_initializer = C.keras_object(keras.initializers.get, bias_initializer, "bias_initializer")
        self.kernel_regularizer = C.keras_object(keras.regularizers.get, kernel_regularizer, "kernel_regularizer")
        self.bias_regularizer = C.keras_object(keras.regularizers.get, bias_regularizer, "bias_regularizer")
        self.kernel_constraint = C.keras_object(keras.constraints.get, kernel_constraint, "kernel_constraint")
        self.bias_constraint = C.keras_object(keras.constraints.get, bias_constraint, "bias_constraint")
        if lora_rank is not None:
            lora_rank = C.positive_int(lora_rank, "lora_rank")
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        self.lora_enabled = False
        self.quantization_config = None
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True  # masks pass through, as Keras' Dense

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(
                "Expected an input of rank >= 2 with a known last dimension. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        in_dim = int(input_shape[-1])
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_dim})
        self._kernel = self.add_weight(
            name="kernel",
            shape=(in_dim, self.units),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            trainable=True,
        )
        C.add_bias(self, self.units)
        self.built = True
        if self.lora_rank:
            self.enable_lora(self.lora_rank, lora_alpha=self.lora_alpha)

    @property
    def kernel(self):
        """The kernel variable; with LoRA enabled, the effective kernel
        ``kernel + (lora_alpha / lora_rank) * lora_kernel_a @ lora_kernel_b`` in
        the compute dtype (a tensor), as Keras' Dense."""
        if not self.lora_enabled:
            return self._kernel
        dtype = self.compute_dtype  # as Keras: in the compute dtype (the variables autocast in call)
        a, b = tf.cast(self.lora_kernel_a, dtype), tf.cast(self.lora_kernel_b, dtype)
        return tf.cast(self._kernel, dtype) + tf.matmul(a, b) * (self.lora_alpha / self.lora_rank)

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

    def save_own_variables(self, store):
        # As Keras' Dense: the kernel with the LoRA update merged in, then the bias.
        if not self.built:
            return
        store["0"] = keras.ops.convert_to_numpy(self.kernel)
        if self.bias is not None:
            store["1"] = keras.ops.convert_to_numpy(self.bias)

    def load_own_variables(self, store):
        if not self.built:
            return
        expected = 1 + (self.bias is not None)
        if len(store.keys()) != expected:
            raise ValueError(
                f"Layer '{self.name}' expected {expected} variables, but received {len(store.keys())} "
                f"variables during loading. Expected: {['kernel', 'bias'][:expected]}. "
                f"Received: store keys={sorted(store.keys())}"
            )
        self._kernel.assign(store["0"])
        if self.bias is not None:
            self.bias.assign(store["1"])
        if self.lora_enabled:  # the stored kernel has the update merged: restart it from zero
            self.lora_kernel_a.assign(tf.zeros(self.lora_kernel_a.shape, self.lora_kernel_a.dtype))
            self.lora_kernel_b.assign(tf.zeros(self.lora_kernel_b.shape, self.lora_kernel_b.dtype))

    def call(self, inputs, training=None):
        kernel = self.kernel
        if isinstance(inputs, tf.SparseTensor):
            # As Keras' Dense: a sparse MatMul, dense output (nothing to fuse), sparse kernel gradient.
            outputs = keras.ops.matmul(inputs, kernel)
            if self.use_bias:
                outputs = outputs + self.bias
            return C.apply_activation(outputs, self.activation, self._activation_name)
        rank = inputs.shape.rank
        flat = inputs
        if rank > 2:
            flat = tf.reshape(inputs, [-1, kernel.shape[0]])
        outputs = tf.matmul(flat, kernel)
        if self.use_bias:
            outputs = _ops.add_bias(outputs, self.bias, "matmul_bias_relu")
        outputs = C.apply_activation(outputs, self.activation, self._activation_name)
        if rank > 2:
            # Back to (batch, ..., units); the activation already ran on the 2-D
            # tensor so MatMul -> BiasAdd -> act stay adjacent for the remapper.
            out_shape = tf.concat([tf.shape(inputs)[:-1], [self.units]], axis=0)
            outputs = tf.reshape(outputs, out_shape)
            outputs.set_shape(inputs.shape[:-1].concatenate([self.units]))
        return outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)[:-1] + (self.units,)

    def get_config(self):
        config = super().get_config()
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
                "quantization_config": None,
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


catalog.register_rule(FusedDense, catalog.unless_avoided("matmul_bias_relu", _fused_dense_rule))
