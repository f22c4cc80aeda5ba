"""Fused recurrent layers: `FusedLSTM` and `FusedGRU`, drop-ins for Keras' LSTM and GRU.

Both take the common Keras configuration (tanh / sigmoid, no recurrent
dropout, GRU with ``reset_after=True``) and have the Keras weights (same names,
shapes and order), so weights copy both ways with `get_weights` /
`set_weights`. What runs is chosen per backend (`tfmetal_ext.ops._recurrence`
documents the forms and the measurements behind them):

| backend | what runs |
|---|---|
| Metal, Apple's tensorflow-metal | one `CudnnRNNV3` (float32, float16, bfloat16) |
| Metal, the open tensorflow-metal-plugin | no `CudnnRNNV3` kernel there (nor on the CPU): the loop below, in its GPU form (composite cell gradient; `Split`/`ConcatV2` instead of `Unpack`/`Pack`, which have no kernel there) |
| CUDA | one `CudnnRNNV3` (cuDNN) |
| CPU | input projection of all steps as one MatMul + BiasAdd, then a custom-gradient loop (unrolled for static lengths up to 256) with one fused `LSTMBlockCellGrad` per LSTM step |

The backend table decides (`Backend.rnn_implementation`: the ``cudnn_rnn`` row and
`Backend.has_kernel`), not the plugin's name.

Under mixed precision the CPU loop keeps its states and gate math in float32
and runs the MatMuls in the compute dtype (faster than bfloat16 elementwise ops
on a CPU, and closer to the float32 result than Keras' all-bfloat16 loop);
outputs and returned states are in the compute dtype as in Keras.

For ``unroll=True``, recurrent dropout, and on a CPU for the static batch
shapes where the backend table says the fused loop was measured slower
(``rnn_stock``, one rule per CPU configuration), the layers run the stock form: Keras' own loop over
Keras' cell math (`_recurrence.stock_lstm` / `stock_gru`). ``layer.form`` says which
form the last trace ran, `stock_form_reason` and the fusion report why.

Masked steps behave as in Keras' generic RNN on every backend: they carry the
previous state, and output the previous output (zeros before the first
unmasked step), or zeros with ``zero_output_for_mask=True``. On the cuDNN path
right-padded masks become ``sequence_lengths``; any other mask switches, at run
time, to the loop.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmetal_ext import _env, backends, devices
from tfmetal_ext.backends import fusion
from tfmetal_ext.inspect import catalog
from tfmetal_ext.inspect.catalog import Expectation
from tfmetal_ext.layers import _contraction as C
from tfmetal_ext.ops import _recurrence

# The activation callables the layers accept: the Keras activation, its keras.ops function and
# the TensorFlow functions of the same op (tf.tanh is tf.math.tanh).
_ACTIVATION_SOURCES = (fusion.KERAS, fusion.TF_FUNCTIONS, fusion.KERAS_OPS)


def _fixed_activation(value, name, expected, layer):
    try:
        fn = keras.activations.get(value)
    except (ValueError, TypeError):
        fn = None
    if fn is None or fusion.activation_name(fn, sources=_ACTIVATION_SOURCES) != expected:
        raise ValueError(
            f"{layer} supports only `{name}='{expected}'` (what the fused kernels compute); "
            f"use keras.layers.{layer[5:]} for others. Received: {name}={value!r}"
        )
    return expected


def _rate(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def _rnn_table(backend):
    """The backend table the layers read for `backend` (a `tfmetal_ext.devices.backend` value).

    On Metal, the table of the plugin this process has (or is assuming, see
    `tfmetal_ext.devices.assume_backend`); Apple's tensorflow-metal when no
    plugin is known.
    """
    caps = _env.current().capabilities
    plugin = caps.metal_plugin if backend == "metal" else None
    return backends.table(backends.support_key(backend, caps.onednn, plugin))


def _implementation(backend, dtype=None, table=None):
    """``"cudnn"`` or ``"loop"`` on `backend` in the compute `dtype` (`Backend.rnn_implementation`).

    Only Metal's choice reads the probed table (which plugin); the CPU's and
    CUDA's do not depend on oneDNN, so no capability is probed for them.
    """
    if table is None:
        table = _rnn_table(backend) if backend == "metal" else backends.table(backends.support_key(backend, False))
    return table.rnn_implementation(dtype, cuda_build=table.device == "cuda" and devices._built_with_cuda())


class _UnitForgetBias:
    """Keras' LSTM bias initialization with ``unit_forget_bias``: ones for the forget gate."""

    def __init__(self, base, units):
        self.base, self.units = base, units

    def __call__(self, shape, dtype=None):
        h = self.units
        return tf.concat(
            [self.base((h,), dtype=dtype), tf.ones((h,), dtype=dtype), self.base((2 * h,), dtype=dtype)], 0
        )


class _FusedRNN(keras.layers.Layer):
    """Shared argument handling, weights, states, masking and config of FusedLSTM / FusedGRU."""

    _gates = None  # 4 for LSTM, 3 for GRU
    _state_names = ()

    def __init__(
        self,
        units,
        activation="tanh",
        recurrent_activation="sigmoid",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        recurrent_initializer="orthogonal",
        bias_initializer="zeros",
        kernel_regularizer=None,
        recurrent_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        recurrent_constraint=None,
        bias_constraint=None,
        dropout=0.0,
        recurrent_dropout=0.0,
        seed=None,
        return_sequences=False,
        return_state=False,
        go_backwards=False,
        stateful=False,
        unroll=False,
        zero_output_for_mask=False,
        use_cudnn="auto",
        **kwargs,
    ):
        layer = type(self).__name__
        implementation = kwargs.pop("implementation", 2)
        if isinstance(implementation, bool) or not isinstance(implementation, int):
            raise ValueError(f"`implementation` must be an integer (1 or 2). Received: implementation={implementation!r}")
        activity_regularizer = C.keras_object(keras.regularizers.get, activity_regularizer, "activity_regularizer")
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units = C.positive_int(units, "units")
        self.activation = _fixed_activation(activation, "activation", "tanh", layer)
        self.recurrent_activation = _fixed_activation(
            recurrent_activation, "recurrent_activation", "sigmoid", layer
        )
        if use_cudnn not in ("auto", True, False):
            raise ValueError(f"`use_cudnn` must be 'auto', True or False. Received: use_cudnn={use_cudnn!r}")
        self.use_bias = C.boolean(use_bias, "use_bias")
        self.kernel_initializer = C.keras_object(keras.initializers.get, kernel_initializer, "kernel_initializer")
        self.recurrent_initializer = C.keras_object(
            keras.initializers.get, recurrent_initializer, "recurrent_initializer"
        )
        self.bias_initializer = C.keras_object(keras.initializers.get, bias_initializer, "bias_initializer")
        self.kernel_regularizer = C.keras_object(keras.regularizers.get, kernel_regularizer, "kernel_regularizer")
        self.recurrent_regularizer = C.keras_object(
            keras.regularizers.get, recurrent_regularizer, "recurrent_regularizer"
        )
        self.bias_regularizer = C.keras_object(keras.regularizers.get, bias_regularizer, "bias_regularizer")
        self.kernel_constraint = C.keras_object(keras.constraints.get, kernel_constraint, "kernel_constraint")
        self.recurrent_constraint = C.keras_object(
            keras.constraints.get, recurrent_constraint, "recurrent_constraint"
        )
        self.bias_constraint = C.keras_object(keras.constraints.get, bias_constraint, "bias_constraint")
        self.dropout = _rate(dropout, "dropout")
        self.recurrent_dropout = _rate(recurrent_dropout, "recurrent_dropout")
        # Keras' cells compute the same math either way (1: per-gate MatMuls, 2: one MatMul; Keras
        # switches to 1 with recurrent dropout): accepted, kept in the config, nothing else changes.
        self.implementation = 1 if self.recurrent_dropout else implementation
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"`seed` must be an integer or None. Received: seed={seed!r}")
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed=seed)
        self.return_sequences = C.boolean(return_sequences, "return_sequences")
        self.return_state = C.boolean(return_state, "return_state")
        self.go_backwards = C.boolean(go_backwards, "go_backwards")
        self.stateful = C.boolean(stateful, "stateful")
        self.unroll = C.boolean(unroll, "unroll")
        self.zero_output_for_mask = C.boolean(zero_output_for_mask, "zero_output_for_mask")
        self.use_cudnn = use_cudnn
        self.supports_masking = True
        self.input_spec = keras.layers.InputSpec(ndim=3)
        self.states = None
        self.form = None  # "fused" or "stock": what the last trace ran
        if _implementation(_env.current().backend, self.compute_dtype) == "cudnn" and use_cudnn:
            self.supports_jit = False  # CudnnRNNV3 has no XLA kernel

    # ------------------------------------------------------------------ weights

    def _bias_initializer(self):
        return self.bias_initializer

    def _bias_shape(self):
        return (self._gates * self.units,)

    def build(self, sequences_shape, initial_state_shape=None):
        if len(sequences_shape) != 3 or sequences_shape[-1] is None:
            raise ValueError(
                f"{type(self).__name__} expects (batch, timesteps, features) inputs with known features. "
                f"Received: input_shape={tuple(sequences_shape)}"
            )
        in_dim = int(sequences_shape[-1])
        self.input_spec = keras.layers.InputSpec(ndim=3, axes={-1: in_dim})
        width = self._gates * self.units
        self.kernel = self.add_weight(
            name="kernel", shape=(in_dim, width), initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint,
        )
        self.recurrent_kernel = self.add_weight(
            name="recurrent_kernel", shape=(self.units, width), initializer=self.recurrent_initializer,
            regularizer=self.recurrent_regularizer, constraint=self.recurrent_constraint,
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias", shape=self._bias_shape(), initializer=self._bias_initializer(),
                regularizer=self.bias_regularizer, constraint=self.bias_constraint,
            )
        if self.stateful:
            if sequences_shape[0] is None:
                raise ValueError(
                    "`stateful=True` needs a static batch size (pass `batch_shape` to keras.Input). "
                    f"Received: input_shape={tuple(sequences_shape)}"
                )
            self._create_state_variables(int(sequences_shape[0]))

    def _create_state_variables(self, batch):
        # Plain tf.Variables: not Keras weights (Keras' own RNN states are untracked too).
        self.states = [
            tf.Variable(tf.zeros((batch, self.units), self.variable_dtype), trainable=False, name=f"rnn_state_{n}")
            for n in self._state_names
        ]

    def reset_state(self):
        """Zeros the states of a stateful layer."""
        if self.states is not None:
            for v in self.states:
                v.assign(tf.zeros_like(v))

    def reset_states(self):
        """Alias of `reset_state` (the Keras 2 name)."""
        self.reset_state()

    # ------------------------------------------------------------------ call

    def _initial_states(self, x, initial_state):
        n = len(self._state_names)
        dtype = self.compute_dtype
        if initial_state is None:
            if self.stateful:
                return [tf.cast(v, dtype) for v in self.states]
            zeros = tf.zeros(tf.stack([tf.shape(x)[0], self.units]), dtype)
            return [zeros] * n
        states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
        states = [tf.cast(s, dtype) for s in states]
        batch = x.shape[0]
        shapes = [tuple(s.shape) for s in states]
        if len(states) != n or any(
            len(s) != 2 or s[-1] != self.units or (batch is not None and s[0] is not None and s[0] != batch)
            for s in shapes
        ):
            raise ValueError(
                f"{type(self).__name__} expects `initial_state` to be {n} tensor(s) "
                f"[{', '.join(self._state_names)}], each of shape (batch, {self.units}) with the "
                f"batch of the inputs {tuple(x.shape)}. Received: initial_state shapes={shapes}"
            )
        return states

    def _weights_in(self, dtype):
        bias = None if self.bias is None else tf.cast(self.bias, dtype)
        return tf.cast(self.kernel, dtype), tf.cast(self.recurrent_kernel, dtype), bias

    def call(self, sequences, initial_state=None, mask=None, training=None):
        x = tf.cast(sequences, self.compute_dtype)
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if mask is not None:
            mask = tf.cast(mask, tf.bool)
        states = self._initial_states(x, initial_state)
        if training and self.dropout > 0:
            # One mask per sequence, the same for every timestep (as Keras' LSTM/GRU).
            keep = keras.random.dropout(tf.ones_like(x[:, 0, :]), self.dropout, seed=self.seed_generator)
            x = x * keep[:, None, :]
        backend = _env.current().backend
        if self.use_cudnn is True and not _env.current().portable \
                and _implementation(backend, self.compute_dtype) != "cudnn":
            raise ValueError(
                f"`use_cudnn=True` needs a backend with a CudnnRNNV3 kernel for {self.compute_dtype} (CUDA, "
                f"Apple's tensorflow-metal); this one is {_rnn_table(backend).label}. "
                f"Received: use_cudnn={self.use_cudnn!r}"
            )
        if self.unroll and x.shape[1] is None:
            raise ValueError(
                "Cannot unroll a RNN if the time dimension is undefined: give keras.Input a `shape` "
                f"with the number of timesteps. Received: input_shape={tuple(x.shape)}"
            )
        why = self.stock_form_reason(x.shape[0], backend, x.shape[1])
        self.form = "stock" if why else "fused"  # what the last trace ran (the report's `why` says it)
        if why:
            recurrent_mask = None
            if training and self.recurrent_dropout > 0:
                # One mask per sequence on the previous h, the same at every step (as Keras' cells).
                recurrent_mask = keras.random.dropout(
                    tf.ones_like(states[0]), self.recurrent_dropout, seed=self.seed_generator
                )
            output, new_states = self._run_stock(x, states, mask, recurrent_mask)
        else:
            output, new_states = self._run(
                x, states, mask, backend=backend, use_cudnn=bool(self.use_cudnn),
            )
        if self.stateful:
            for v, s in zip(self.states, new_states):
                v.assign(tf.cast(s, v.dtype))
        if self.return_state:
            return (output, *new_states)
        return output

    def stock_form_reason(self, batch=None, backend=None, steps=None):
        """Why this layer runs the stock form (Keras' own loop and cell math), or None (the fused form).

        The stock form runs for ``unroll=True`` and recurrent dropout (the
        fused loop has neither), and on a CPU for the shapes where the
        backend table's `rnn_stock` regions say the fused loop was measured
        slower (`tfmetal_ext.backends.Backend.rnn_cpu_form`: batch, length,
        units, dtype, in the table of the CPU configuration, oneDNN on or off).
        """
        if self.unroll:
            return "unroll=True: Keras' unrolled loop"
        if _env.current().portable:
            return "traced for export: Keras' own loop, which every converter knows"
        if self.recurrent_dropout > 0:
            return f"recurrent_dropout={self.recurrent_dropout}: no fused kernel masks the recurrent state"
        backend = backend or _env.current().backend
        cudnn = _implementation(backend, self.compute_dtype) == "cudnn" and self.use_cudnn is not False
        if backend == "cpu" and not cudnn:
            cell = type(self).__name__[5:].lower()
            table = backends.current()
            if table.rnn_cpu_form(cell, batch, steps, self.units, self.compute_dtype) == "stock":
                region = table.rnn_stock_region(cell, batch, steps, self.units, self.compute_dtype)
                why = region.reason if region is not None else "forced by force_cpu_form"
                return (
                    f"batch {batch}, {steps} steps, {self.units} units on the {table.label}: the stock "
                    f"{type(self).__name__[5:]} train step was measured faster for this shape "
                    f"(backend table rnn_stock: {why})"
                )
        return None

    def _fused_forms(self, backend, dtype, use_cudnn):
        """The engine's arguments for the fused forms on `backend` in `dtype`: form, device, list form."""
        table = _rnn_table(backend)
        cudnn = use_cudnn and _implementation(backend, dtype, table) == "cudnn"
        return {"form": "cudnn" if cudnn else "loop", "device": backend, "lists": table.rnn_list_form(dtype)}

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        batch, steps = sequences_shape[0], sequences_shape[1]
        out = (batch, steps, self.units) if self.return_sequences else (batch, self.units)
        if self.return_state:
            return (out,) + tuple((batch, self.units) for _ in self._state_names)
        return out

    def compute_mask(self, inputs, mask=None):
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        out_mask = mask if self.return_sequences else None
        if self.return_state:
            return [out_mask] + [None] * len(self._state_names)
        return out_mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "activation": self.activation,
                "recurrent_activation": self.recurrent_activation,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "recurrent_initializer": keras.initializers.serialize(self.recurrent_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "recurrent_regularizer": keras.regularizers.serialize(self.recurrent_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "recurrent_constraint": keras.constraints.serialize(self.recurrent_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "dropout": self.dropout,
                "recurrent_dropout": self.recurrent_dropout,
                "seed": self.seed,
                "return_sequences": self.return_sequences,
                "return_state": self.return_state,
                "go_backwards": self.go_backwards,
                "stateful": self.stateful,
                "unroll": self.unroll,
                "zero_output_for_mask": self.zero_output_for_mask,
                "use_cudnn": self.use_cudnn,
                "implementation": self.implementation,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedLSTM(_FusedRNN):
    """Long Short-Term Memory layer; a drop-in for the common `keras.layers.LSTM`.

    Same math, arguments, weights (``kernel`` ``(in, 4*units)``,
    ``recurrent_kernel`` ``(units, 4*units)``, ``bias`` ``(4*units,)``, gates
    i, f, c, o) and outputs as ``keras.layers.LSTM`` with tanh / sigmoid and no
    recurrent dropout. Masks (``mask=`` or Keras masking) and ``dropout`` on the
    inputs (one mask per sequence, as Keras) are supported; mixed precision
    computes in the policy's compute dtype with float32 weights.

    What it becomes:

    | backend | op |
    |---|---|
    | Metal, Apple's tensorflow-metal | `CudnnRNNV3` + `CudnnRNNBackpropV3` (float32, float16, bfloat16) |
    | Metal, tensorflow-metal-plugin | MatMul + BiasAdd for all inputs (its graph pass fuses them), then per step MatMul + gate ops forward and a composite gradient (`SigmoidGrad`/`TanhGrad`) + MatMul backward, unrolled up to 256 static steps, else a while loop; every op with a kernel there |
    | CUDA | `CudnnRNNV3` + `CudnnRNNBackpropV3` (cuDNN) |
    | CPU | `_FusedMatMul[BiasAdd]` for all inputs, then per step MatMul + gate ops forward and `LSTMBlockCellGrad` + MatMul backward (float32/float16; a composite in bfloat16), dU as one MatMul; no fused RNN kernel exists on CPU |

    Args:
        units: size of the output and the states, a positive int.
        activation: only ``"tanh"``.
        recurrent_activation: only ``"sigmoid"``.
        use_bias: whether the layer has a bias.
        kernel_initializer, recurrent_initializer, bias_initializer: initializers.
        unit_forget_bias: initialize the forget gate's bias to one (as Keras).
        kernel_regularizer, recurrent_regularizer, bias_regularizer,
        activity_regularizer: regularizers.
        kernel_constraint, recurrent_constraint, bias_constraint: constraints.
        dropout: fraction of input features dropped in training, in [0, 1).
        recurrent_dropout: fraction of the recurrent state dropped in training,
            in [0, 1) (one mask per sequence; runs the stock form).
        seed: seed of the dropout masks.
        return_sequences: return the whole output sequence, else the last output.
        return_state: also return the final states h and c.
        go_backwards: process the sequence backwards (and return it reversed).
        stateful: carry the final states of one batch into the next (static batch size).
        unroll: True runs the stock form unrolled (Keras' loop); False lets
            the layer pick its loop.
        zero_output_for_mask: output zeros at masked steps instead of the previous output.
        use_cudnn: ``"auto"``; False forces the loop on a GPU; True requires a backend with a
            `CudnnRNNV3` kernel (CUDA, Apple's tensorflow-metal; not the open plugin).
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`), and
            Keras' ``implementation`` (1 or 2; the same math either way, kept
            in the config).

    Stock form: for ``unroll=True``, recurrent dropout, and on a CPU for the
    shapes where the fused loop was measured slower than the
    stock layer (the backend table's ``rnn_stock``), the layer runs
    Keras' own loop over Keras' cell math (`stock_form_reason` says why,
    ``layer.form`` says which form the last trace ran, and the fusion report
    names it).

    Input shape:
        ``(batch, timesteps, features)``; call arguments ``initial_state``
        (``[h, c]``, each ``(batch, units)``), ``mask`` ``(batch, timesteps)``
        and ``training``.

    Output shape:
        ``(batch, timesteps, units)`` with `return_sequences`, else
        ``(batch, units)``; with `return_state` followed by h and c.

    Raises:
        ValueError: on an unsupported or invalid argument (the message ends
            with ``Received: name=value``), an input that is not 3-D, or
            initial states of the wrong number or shape.

    Example:

    >>> layer = FusedLSTM(8, return_sequences=True)
    >>> layer(np.zeros((2, 5, 3), "float32")).shape
    TensorShape([2, 5, 8])
    """

    _gates = 4
    _state_names = ("h", "c")

    def __init__(
        self,
        units,
        activation="tanh",
        recurrent_activation="sigmoid",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        recurrent_initializer="orthogonal",
        bias_initializer="zeros",
        unit_forget_bias=True,
        **kwargs,
    ):
        # Positional order as keras.layers.LSTM's; the rest as in `_FusedRNN`.
        super().__init__(
            units, activation=activation, recurrent_activation=recurrent_activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer, recurrent_initializer=recurrent_initializer,
            bias_initializer=bias_initializer, **kwargs,
        )
        self.unit_forget_bias = C.boolean(unit_forget_bias, "unit_forget_bias")

    def _bias_initializer(self):
        if self.unit_forget_bias:
            return _UnitForgetBias(self.bias_initializer, self.units)
        return self.bias_initializer

    def _run(self, x, states, mask, backend, use_cudnn):
        kernel, recurrent_kernel, bias = self._weights_in(x.dtype)
        return _recurrence.lstm(
            x, states[0], states[1], kernel, recurrent_kernel, bias, mask=mask,
            go_backwards=self.go_backwards, return_sequences=self.return_sequences,
            zero_output_for_mask=self.zero_output_for_mask, **self._fused_forms(backend, x.dtype.name, use_cudnn),
        )

    def _run_stock(self, x, states, mask, recurrent_mask):
        kernel, recurrent_kernel, bias = self._weights_in(x.dtype)
        return _recurrence.lstm(
            x, states[0], states[1], kernel, recurrent_kernel, bias, form="stock", mask=mask,
            go_backwards=self.go_backwards, return_sequences=self.return_sequences,
            zero_output_for_mask=self.zero_output_for_mask, unroll=self.unroll, recurrent_mask=recurrent_mask,
        )

    def get_config(self):
        config = super().get_config()
        config["unit_forget_bias"] = self.unit_forget_bias
        return config


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedGRU(_FusedRNN):
    """Gated Recurrent Unit layer; a drop-in for the common `keras.layers.GRU`.

    Same math, arguments, weights (``kernel`` ``(in, 3*units)``,
    ``recurrent_kernel`` ``(units, 3*units)``, ``bias`` ``(2, 3*units)``: input
    and recurrent biases, gates z, r, h) and outputs as ``keras.layers.GRU`` with
    ``reset_after=True`` (Keras' default and the form cuDNN computes), tanh /
    sigmoid. ``reset_after=False`` runs the stock form (no fused kernel
    computes it), with Keras' ``(3*units,)`` bias. Masks, input dropout and mixed precision as
    `FusedLSTM`.

    What it becomes:

    | backend | op |
    |---|---|
    | Metal, Apple's tensorflow-metal | `CudnnRNNV3` + `CudnnRNNBackpropV3` (float32, float16, bfloat16); weights packed in Keras' gate order, as Keras packs them there |
    | Metal, tensorflow-metal-plugin | the loop as `FusedLSTM` there (two MatMuls per step), every op with a kernel there |
    | CUDA | `CudnnRNNV3` + `CudnnRNNBackpropV3` (cuDNN; gates reordered to cuDNN's r, z, h) |
    | CPU | `_FusedMatMul[BiasAdd]` for all inputs, then per step two MatMuls (z/r and h) + gate ops forward and a composite gradient backward, dU as two MatMuls; no fused RNN kernel exists on CPU |

    Args:
        units: size of the output and the state, a positive int.
        activation: only ``"tanh"``.
        recurrent_activation: only ``"sigmoid"``.
        use_bias: whether the layer has biases.
        kernel_initializer, recurrent_initializer, bias_initializer: initializers.
        kernel_regularizer, recurrent_regularizer, bias_regularizer,
        activity_regularizer: regularizers.
        kernel_constraint, recurrent_constraint, bias_constraint: constraints.
        dropout: fraction of input features dropped in training, in [0, 1).
        recurrent_dropout: as `FusedLSTM` (stock form).
        seed: seed of the dropout masks.
        return_sequences, return_state, go_backwards, stateful, unroll,
        zero_output_for_mask, use_cudnn, implementation: as `FusedLSTM`
            (one state, h; the same stock form).
        reset_after: True (Keras' default, the cuDNN form, fused); False runs
            the stock form (bias ``(3*units,)``, as Keras).
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`).

    Input shape:
        ``(batch, timesteps, features)``; call arguments ``initial_state``
        (h, ``(batch, units)``), ``mask`` ``(batch, timesteps)`` and ``training``.

    Output shape:
        ``(batch, timesteps, units)`` with `return_sequences`, else
        ``(batch, units)``; with `return_state` followed by h.

    Raises:
        ValueError: as `FusedLSTM`.

    Example:

    >>> layer = FusedGRU(8)
    >>> layer(np.zeros((2, 5, 3), "float32")).shape
    TensorShape([2, 8])
    """

    _gates = 3
    _state_names = ("h",)

    def __init__(self, units, *args, reset_after=True, **kwargs):
        super().__init__(units, *args, **kwargs)
        self.reset_after = C.boolean(reset_after, "reset_after")

    def _bias_shape(self):
        return (2, 3 * self.units) if self.reset_after else (3 * self.units,)

    def stock_form_reason(self, batch=None, backend=None, steps=None):
        if not self.reset_after:
            return "reset_after=False: no fused kernel computes that GRU form"
        return super().stock_form_reason(batch, backend, steps)

    def _run(self, x, states, mask, backend, use_cudnn):
        kernel, recurrent_kernel, bias = self._weights_in(x.dtype)
        return _recurrence.gru(
            x, states[0], kernel, recurrent_kernel, bias, mask=mask,
            go_backwards=self.go_backwards, return_sequences=self.return_sequences,
            zero_output_for_mask=self.zero_output_for_mask, **self._fused_forms(backend, x.dtype.name, use_cudnn),
        )

    def _run_stock(self, x, states, mask, recurrent_mask):
        kernel, recurrent_kernel, bias = self._weights_in(x.dtype)
        return _recurrence.gru(
            x, states[0], kernel, recurrent_kernel, bias, form="stock", mask=mask,
            go_backwards=self.go_backwards, return_sequences=self.return_sequences,
            zero_output_for_mask=self.zero_output_for_mask, unroll=self.unroll, recurrent_mask=recurrent_mask,
            reset_after=self.reset_after,
        )

    def get_config(self):
        config = super().get_config()
        config["reset_after"] = self.reset_after
        return config


# ----------------------------------------------------------------------------
# Inspection rules.

REASON_CPU_RNN = (
    "no fused RNN kernel on CPU (CudnnRNNV3 is GPU-only): {name} runs its input projection as one "
    "MatMul + BiasAdd and a custom-gradient loop"
)


REASON_STOCK_FORM = "{name} ran the stock form (Keras' loop and cell math, nothing fused): {why}"


def _static_batch_and_steps(layer):
    """``(batch, steps)`` of the input the layer was built with (None where unknown)."""
    for shape in (getattr(layer, "_build_shapes_dict", None) or {}).values():
        try:
            return shape[0], shape[1]
        except (TypeError, IndexError):
            continue
    return None, None


def loop_form(steps):
    """How the loop runs for a static sequence length `steps` (None: unknown), in words."""
    if steps is not None and steps <= _recurrence.MAX_UNROLL:
        return f"unrolled over its {steps} steps (per step MatMul + gate ops; no loop control, no TensorLists)"
    return "a tf.while_loop with TensorLists (length unknown or over MAX_UNROLL)"


REASON_NO_CUDNN = (
    "{label} has no CudnnRNNV3 kernel (and TF has no CPU one): {name} runs its loop there instead, the input "
    "projection as one MatMul + BiasAdd, then {form}"
)


def _fused_rnn_rule(layer, ctx):
    """CudnnRNNV3 where the backend table has its kernels (CUDA, Apple's tensorflow-metal); elsewhere the loop:
    on CPU the hoisted input projection fuses (`_FusedMatMul[BiasAdd]`), on a Metal backend without the kernel
    it may (the open plugin's graph pass fuses MatMul + BiasAdd), which a Linux run cannot require."""
    name = type(layer).__name__
    batch, steps = _static_batch_and_steps(layer)
    why = layer.stock_form_reason(batch, ctx.backend, steps)
    if why is not None:
        return Expectation("cudnn_rnn", None, None, None, reason=REASON_STOCK_FORM.format(name=name, why=why))
    if ctx.xla:
        return Expectation("cudnn_rnn", None, None, None, reason=catalog.REASON_XLA)
    table = catalog.table(ctx)
    cudnn = _implementation(ctx.backend, layer.compute_dtype, table) == "cudnn"
    if cudnn and layer.use_cudnn is not False:
        return Expectation("cudnn_rnn", fusion.CUDNN_RNN, (), ())
    if ctx.backend == "cpu":
        reason = REASON_CPU_RNN.format(name=name)
    elif layer.use_cudnn is False:
        reason = "use_cudnn=False: the generic loop runs"
    elif ctx.backend == "metal":
        reason = REASON_NO_CUDNN.format(label=table.label, name=name, form=loop_form(steps))
        blocked = catalog.dtype_block(ctx, layer.compute_dtype, "matmul_bias_act")
        row = table.fusion("matmul_bias_act")
        may = ()
        if layer.use_bias and not blocked and layer.compute_dtype in row.dtypes_in(ctx.mode):
            may = ((fusion.FUSED_MATMUL, ("BiasAdd",)),)
        return Expectation("cudnn_rnn", None, None, (), reason=reason, ideal_op=fusion.CUDNN_RNN, may_fuse=may)
    else:
        reason = f"{ctx.backend} without a CUDA build: the generic loop runs"
    blocked = catalog.dtype_block(ctx, layer.compute_dtype, "matmul_bias_act")
    if not layer.use_bias or blocked or ctx.backend != "cpu":
        why = "use_bias=False" if not layer.use_bias else blocked
        return Expectation("cudnn_rnn", None, None, (), reason=reason + (f"; {why}" if why else ""), ideal_op=fusion.CUDNN_RNN)
    return Expectation("cudnn_rnn", fusion.FUSED_MATMUL, ("BiasAdd",), (), reason=reason, ideal_op=fusion.CUDNN_RNN)


catalog.register_rule(FusedLSTM, _fused_rnn_rule)
catalog.register_rule(FusedGRU, _fused_rnn_rule)
