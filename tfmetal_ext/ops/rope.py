"""rope: rotary position embedding, one op forward (``TfmetalExt>Rope``), one op backward."""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

from tfmetal_ext.backends import fusion
from tfmetal_ext.ops import _common, _reference

ROPE_OP = fusion.ROPE_OP

# rope_type -> what it is (keras-hub's RotaryEmbedding types and LlamaRotaryEmbedding's scaling).
ROPE_TYPES = {
    "linear": "inverse frequencies divided by scaling_factor (keras-hub's default)",
    "dynamic": "inverse frequencies divided by scaling_factor ** (D / (D - 2))",
    "yarn": "YaRN: interpolation and extrapolation blended by beta_fast/beta_slow, cos/sin scaled by "
            "0.1 * ln(scaling_factor) + 1",
    "llama3": "LlamaRotaryEmbedding: Llama 3.1's low/high-frequency smoothing (all four of "
              "frequency_adjustment_factor, low_freq_factor, high_freq_factor, pretraining_sequence_length, or none)",
}
_LLAMA3_ARGS = ("frequency_adjustment_factor", "low_freq_factor", "high_freq_factor", "pretraining_sequence_length")


def rope(x, positions=None, max_wavelength=10000, scaling_factor=1.0, *, start_index=0, sequence_axis=1,
         feature_axis=-1, rope_type="linear", beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096,
         truncate=True, denominator_dim=None, frequency_adjustment_factor=None, low_freq_factor=None,
         high_freq_factor=None, pretraining_sequence_length=None, name=None):
    """Rotary position embedding, as keras-hub's ``RotaryEmbedding`` (and its Llama variant) applies it.

    The feature axis is split into halves ``x1 | x2`` and pair ``i`` of the
    token at position ``p`` turns by ``p * inv_freq[i]``:
    ``y1 = x1 cos - x2 sin``, ``y2 = x2 cos + x1 sin``. One custom op forward
    and one backward (CPU kernel; Metal kernel on Apple GPUs) where the stock
    layer emits about 20 (Einsum, Cos, Sin, Pack, Unpack, ...). The inverse
    frequencies are computed once per configuration with the stock layer's own
    float32 operations (bit for bit), and the rotation in float32, rounded once
    to x's dtype: in float32 the stock layer's result, except where the two
    libraries' cos/sin differ by an ulp; under mixed precision (the stock
    layer rounds cos, sin, both products and the sum to float16/bfloat16)
    within about 4 roundoffs of x's dtype times ``|x1 cos| + |x2 sin|``, and
    more accurate. The gradient is dy turned back; `positions` gets none.

    Args:
        x: float32, float16 or bfloat16, with a sequence axis and an even-sized
            feature axis, e.g. ``[batch, seq, features]`` or ``[batch, seq, heads, head_dim]``.
        positions: optional positions, shape ``[seq]`` or ``[batch, seq]`` (any
            real dtype, used as float32). Default: ``start_index + arange(seq)``.
        max_wavelength, scaling_factor, rope_type, beta_fast, beta_slow,
            original_max_position_embeddings, truncate, denominator_dim: as
            keras-hub's ``RotaryEmbedding``; `rope_type` is ``"linear"``,
            ``"dynamic"``, ``"yarn"`` or ``"llama3"``.
        start_index: first position when `positions` is None (an int or a
            scalar tensor: cached decoding); ignored with `positions`, as in keras-hub.
        sequence_axis, feature_axis: the axes (keras-hub's defaults 1 and -1).
        frequency_adjustment_factor, low_freq_factor, high_freq_factor,
            pretraining_sequence_length: ``rope_type="llama3"`` only, as
            ``LlamaRotaryEmbedding`` names them (all four or none). Like that
            layer, llama3 takes no `scaling_factor` (it must be 1).
        name: optional op name.

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: for another dtype, an odd feature size, bad axes, an
            unsupported `rope_type` or inconsistent arguments.

    >>> y = rope(tf.constant([[[1.0, 0.0], [1.0, 0.0]]]))  # positions 0 and 1, one pair
    >>> np.round(y.numpy(), 4)
    array([[[1.    , 0.    ],
            [0.5403, 0.8415]]], dtype=float32)
    """
    x = tf.convert_to_tensor(x)
    _common.check_float("x", x)
    config = _Config.make(max_wavelength, scaling_factor, rope_type, beta_fast, beta_slow,
                          original_max_position_embeddings, truncate, denominator_dim, frequency_adjustment_factor,
                          low_freq_factor, high_freq_factor, pretraining_sequence_length)
    rank = x.shape.rank
    if rank is None:
        raise ValueError(f"`x` must have a known rank. Received: x.shape={x.shape}")
    seq_axis, feat_axis = _normalize_axes(rank, sequence_axis, feature_axis)
    features = x.shape[feat_axis]
    if features is None:
        raise ValueError(f"The feature axis of `x` must have a known size. Received: x.shape={x.shape}")
    if features % 2:
        raise ValueError(f"The feature axis of `x` must have an even size (its halves are rotated together). "
                         f"Received: x.shape={x.shape}, feature_axis={feature_axis}")
    moved = _to_canonical(x, seq_axis, feat_axis)
    positions = _positions(moved, positions, start_index)
    inv_freq = tf.constant(_inverse_freq(config, features))
    scale = _attention_scale(config, x.dtype)
    if uses_kernel():
        y = _common.library().tfmetal_ext_rope(moved, positions, inv_freq, scale=scale, name=name)
    else:
        y = _with_reference_gradient(moved, positions, inv_freq, scale)
    return _from_canonical(y, seq_axis, feat_axis)


def uses_kernel() -> bool:
    """`rope` runs the custom op here (else its pure-TF reference)."""
    return _common.uses_kernel(ROPE_OP)


# ----------------------------------------------------------------------------
# Arguments


class _Config(tuple):
    """The arguments that decide the inverse frequencies and the cos/sin scale (hashable, for the cache)."""

    FIELDS = ("max_wavelength", "scaling_factor", "rope_type", "beta_fast", "beta_slow",
              "original_max_position_embeddings", "truncate", "denominator_dim") + _LLAMA3_ARGS

    @classmethod
    def make(cls, *values):
        c = dict(zip(cls.FIELDS, values))
        if c["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"Argument `rope_type` must be one of {sorted(ROPE_TYPES)}. "
                             f"Received: rope_type={c['rope_type']!r}")
        for key in ("max_wavelength", "scaling_factor"):
            v = c[key]
            if isinstance(v, (bool, str, bytes)) or not isinstance(v, (int, float, np.number)) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"Argument `{key}` must be a finite number > 0. Received: {key}={v!r}")
        if c["denominator_dim"] is not None and (isinstance(c["denominator_dim"], bool) or
                                                 not isinstance(c["denominator_dim"], (int, np.integer)) or
                                                 c["denominator_dim"] <= 0):
            raise ValueError(f"Argument `denominator_dim` must be None or an int > 0. "
                             f"Received: denominator_dim={c['denominator_dim']!r}")
        llama = [c[k] for k in _LLAMA3_ARGS]
        if c["rope_type"] == "llama3":
            if any(v is None for v in llama) and not all(v is None for v in llama):
                raise ValueError("With rope_type='llama3', either all or none of `frequency_adjustment_factor`, "
                                 "`low_freq_factor`, `high_freq_factor` and `pretraining_sequence_length` must be "
                                 f"set. Received: {dict(zip(_LLAMA3_ARGS, llama))}")
            if c["scaling_factor"] != 1.0:
                raise ValueError("rope_type='llama3' takes no `scaling_factor` (LlamaRotaryEmbedding does not use "
                                 f"its position_scaling_factor). Received: scaling_factor={c['scaling_factor']!r}")
            if c["denominator_dim"] is not None:
                raise ValueError("rope_type='llama3' takes no `denominator_dim`. "
                                 f"Received: denominator_dim={c['denominator_dim']!r}")
        elif any(v is not None for v in llama):
            raise ValueError(f"{', '.join(f'`{k}`' for k in _LLAMA3_ARGS)} are for rope_type='llama3' only. "
                             f"Received: rope_type={c['rope_type']!r}, {dict(zip(_LLAMA3_ARGS, llama))}")
        return cls(tuple(c[k] for k in cls.FIELDS))

    def __getattr__(self, key):
        try:
            return self[self.FIELDS.index(key)]
        except ValueError:
            raise AttributeError(key) from None


def _normalize_axes(rank, sequence_axis, feature_axis):
    axes = []
    for label, axis in (("sequence_axis", sequence_axis), ("feature_axis", feature_axis)):
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -rank <= axis < rank:
            raise ValueError(f"Argument `{label}` must be an axis of x (rank {rank}). Received: {label}={axis!r}")
        axes.append(int(axis) % rank)
    if axes[0] == axes[1]:
        raise ValueError(f"`sequence_axis` and `feature_axis` must differ. Received: sequence_axis={sequence_axis}, "
                         f"feature_axis={feature_axis}")
    if 0 in axes or rank < 3:
        # keras-hub moves them to 1 and -1: the batch axis stays first.
        raise ValueError(f"`x` needs a batch axis 0 besides the sequence and feature axes (rank >= 3, neither axis "
                         f"0). Received: rank={rank}, sequence_axis={sequence_axis}, feature_axis={feature_axis}")
    return axes[0], axes[1]


def _permutation(rank, seq_axis, feat_axis):
    """The transpose that moves `seq_axis` to 1 and `feat_axis` to -1 (keras' moveaxis), or None."""
    rest = [a for a in range(rank) if a not in (seq_axis, feat_axis)]
    perm = [rest[0], seq_axis] + rest[1:] + [feat_axis]
    return None if perm == list(range(rank)) else perm


def _to_canonical(x, seq_axis, feat_axis):
    perm = _permutation(x.shape.rank, seq_axis, feat_axis)
    return x if perm is None else tf.transpose(x, perm)


def _from_canonical(y, seq_axis, feat_axis):
    perm = _permutation(y.shape.rank, seq_axis, feat_axis)
    return y if perm is None else tf.transpose(y, np.argsort(perm))


def _positions(x, positions, start_index):
    """float32 positions [seq] or [batch, seq]: keras-hub's ``arange(seq) + float32(start_index)`` by default."""
    if positions is None:
        seq = tf.shape(x)[1]
        return tf.range(seq, dtype=tf.float32) + tf.cast(start_index, tf.float32)
    positions = tf.cast(tf.convert_to_tensor(positions), tf.float32)
    if positions.shape.rank not in (None, 1, 2):
        raise ValueError(f"`positions` must have shape [seq] or [batch, seq]. Received: positions.shape="
                         f"{positions.shape}")
    return positions


# ----------------------------------------------------------------------------
# Inverse frequencies and the cos/sin scale: keras-hub's float32 operations, in its order, once per configuration.


@functools.lru_cache(maxsize=256)
def _inverse_freq(config, rotary_dim):
    """float32 [rotary_dim // 2], computed eagerly on the CPU as keras-hub computes it (bit for bit)."""
    with tf.init_scope(), tf.device("/CPU:0"):
        if config.rope_type == "llama3":
            inv = _llama3_inverse_freq(config, rotary_dim)
        elif config.rope_type == "yarn":
            inv = _yarn_inverse_freq(config, rotary_dim)
        else:
            inv = _base_inverse_freq(config, rotary_dim)
        out = np.asarray(inv.numpy(), np.float32)
    out.setflags(write=False)
    return out


def _f32(v):
    return tf.cast(v, tf.float32)


def _base_inverse_freq(config, rotary_dim):
    # keras-hub RotaryEmbedding._get_inverse_freq.
    idx = tf.range(0, rotary_dim, 2, dtype=tf.float32)
    denom = _f32(config.denominator_dim if config.denominator_dim is not None else rotary_dim)
    inv = tf.pow(_f32(config.max_wavelength), -(idx / denom))
    if config.rope_type == "linear":
        return inv / _f32(config.scaling_factor)
    exponent = _f32(rotary_dim) / _f32(max(1, rotary_dim - 2))  # "dynamic"
    return inv / tf.pow(_f32(config.scaling_factor), exponent)


def _yarn_inverse_freq(config, rotary_dim):
    # keras-hub RotaryEmbedding._get_yarn_inverse_freq.
    base = _f32(config.max_wavelength)
    idx = tf.range(0, rotary_dim, 2, dtype=tf.float32)
    pos_freqs = tf.pow(base, idx / _f32(rotary_dim))
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (_f32(config.scaling_factor) * pos_freqs)

    def correction_dim(num_rotations):
        max_pos = _f32(config.original_max_position_embeddings)
        return (_f32(rotary_dim) * tf.math.log(max_pos / (num_rotations * 2.0 * np.pi))) / (
            2.0 * tf.math.log(base))

    low = correction_dim(_f32(config.beta_fast))
    high = correction_dim(_f32(config.beta_slow))
    if config.truncate:
        low, high = tf.floor(low), tf.math.ceil(high)
    low = tf.maximum(low, _f32(0))
    high = tf.minimum(high, _f32(rotary_dim - 1))
    idx_half = tf.range(0, rotary_dim // 2, dtype=tf.float32)
    diff = tf.maximum(high - low, _f32(0.001))
    ramp = tf.clip_by_value((idx_half - low) / diff, 0.0, 1.0)
    extrapolation_factor = 1.0 - ramp
    return interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3_inverse_freq(config, rotary_dim):
    # keras-hub LlamaRotaryEmbedding._get_inverse_freq.
    freq_range = tf.range(0, rotary_dim, 2, dtype=tf.float32) / _f32(rotary_dim)
    inv = 1.0 / tf.pow(_f32(config.max_wavelength), freq_range)
    if config.low_freq_factor is None:
        return inv
    seq_len = config.pretraining_sequence_length
    low_wavelen = seq_len / config.low_freq_factor  # Python floats, compared in float32
    high_wavelen = seq_len / config.high_freq_factor
    adjust = _f32(config.frequency_adjustment_factor)
    wavelen = _f32(2 * math.pi) / inv
    inv = tf.where(wavelen > _f32(low_wavelen), inv / adjust, inv)
    smooth = (_f32(seq_len) / wavelen - _f32(config.low_freq_factor)) / _f32(
        config.high_freq_factor - config.low_freq_factor)
    smoothed = (1.0 - smooth) * (inv / adjust) + smooth * inv
    medium = tf.logical_and(wavelen >= _f32(high_wavelen), wavelen <= _f32(low_wavelen))
    return tf.where(medium, smoothed, inv)


def _attention_scale(config, dtype):
    """YaRN's cos/sin factor ``0.1 * ln(scaling_factor) + 1``, computed in x's dtype as keras-hub does; else 1."""
    if config.rope_type != "yarn":
        return 1.0
    with tf.init_scope(), tf.device("/CPU:0"):
        factor = tf.constant(0.1, dtype) * tf.math.log(tf.cast(config.scaling_factor, dtype)) + tf.constant(1.0, dtype)
        return float(tf.cast(factor, tf.float32).numpy())


# ----------------------------------------------------------------------------
# Gradient


def _with_reference_gradient(x, positions, inv_freq, scale):
    if _common.portable():
        return _reference.rope(x, positions, inv_freq, scale)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            return _reference.rope(dy, positions, inv_freq, scale, inverse=True)

        return _reference.rope(x, positions, inv_freq, scale), grad

    return fn(x)


@tf.RegisterGradient(ROPE_OP)
def _rope_grad(op, dy):
    """dx = dy turned back; positions and inv_freq get no gradient (integers and constants in keras-hub)."""
    lib = _common.library() or _loaded_library()
    dx = lib.tfmetal_ext_rope_grad(dy, op.inputs[1], op.inputs[2], scale=op.get_attr("scale"))
    return dx, None, None


def _loaded_library():
    # The forward op exists, so the library is loaded even if the reference
    # switch was set since.
    from tfmetal_ext.ops import _loader

    return _loader.load()
