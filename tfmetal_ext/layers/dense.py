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
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

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
        **kwargs,
    ):
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
        self.input_spec = keras.layers.InputSpec(min_ndim=2)

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(
                "Expected an input of rank >= 2 with a known last dimension. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        in_dim = int(input_shape[-1])
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_dim})
        self.kernel = self.add_weight(
            name="kernel",
            shape=(in_dim, self.units),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            trainable=True,
        )
        C.add_bias(self, self.units)

    def call(self, inputs):
        rank = inputs.shape.rank
        flat = inputs
        if rank > 2:
            flat = tf.reshape(inputs, [-1, self.kernel.shape[0]])
        outputs = tf.matmul(flat, self.kernel)
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
            }
        )
        return config


def _fused_dense_rule(layer, ctx):
    name = C.catalog_activation_name(layer._activation_name, layer.activation)
    # Rank > 2 inputs are flattened before the MatMul, so they fuse like 2-D ones.
    return catalog.dense_rule(layer, ctx, act_name=name, reshape_blocks=False)


catalog.register_rule(FusedDense, catalog.unless_avoided("matmul_bias_relu", _fused_dense_rule))
