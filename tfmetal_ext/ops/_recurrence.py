"""The recurrence engine behind `FusedLSTM` and `FusedGRU`: each form, run as its caller chooses.

`lstm` and `gru` take the form as an argument (``"cudnn"``, ``"loop"``,
``"stock"``). Which form runs where is the backend table's choice
(`tfmetal_ext.backends.Backend.rnn_implementation`, `rnn_list_form`,
`rnn_cpu_form`), made by the layers (`tfmetal_ext.layers.recurrent`).

CUDA and Apple's tensorflow-metal: one `CudnnRNNV3` op for the whole sequence
(tensorflow-metal implements it for float32, float16 and bfloat16), called the way Keras calls it
there (batch-major input, ``sequence_lengths`` always given, ``is_training``),
with the weights packed into cuDNN's canonical flat layout by
`tfmetal_ext.ops._cudnn_params`. A mask that is not right-padded (or has an empty row)
switches, at run time through a `tf.cond`, to the generic loop below.

The open tensorflow-metal-plugin has no `CudnnRNNV3` kernel (and TF has no CPU
kernel): the loop below runs there, chosen from the backend table
(`Backend.rnn_implementation`), in its GPU form: the composite cell gradient (no
`LSTMBlockCellGrad` there), per-step tensors cut with one `Split` and stacked
with one `ConcatV2` (`Backend.rnn_list_form`: the plugin registers no `Pack`/`Unpack`,
which would run on the host), masks as 0/1 floats (its `Split`, `Transpose`
and `ReverseV2`, and TF's any-device TensorList kernels, take no bool), and
only full slice specs (its
`StridedSlice` refuses ``x[t]`` on a 3-D tensor at run time). Why this form
(read from the plugin's source, not measured: there is no Mac here): each op
there is one Metal dispatch, and on TF 2.21 every Metal kernel waits for the
GPU before returning (the plugin's `TF_METAL_SYNCHRONOUS` default while the
resource-variable C API is missing), so fewer ops per step is the lever. The
unrolled form (static lengths up to `MAX_UNROLL`) runs per LSTM step one
MatMul and the gate ops forward and one MatMul and the gate gradients
backward, with no loop control and no TensorList ops; the while loop adds
per step the loop-control ops (`Enter`/`Merge`/`Switch`/`NextIteration`/
`LoopCond` with a host-side predicate) and a TensorList read and write per
recorded tensor, all kernels TensorFlow registers for any device
(``DEVICE_DEFAULT``), so it is kept only for lengths the graph cannot unroll.
A Mac has to measure: the step times of both forms against Keras' own loop
(``use_cudnn=False``) there, where the unrolled form stops paying (its graph
grows with the length), and whether TF's device-default TensorList kernels
copy through the host on that backend.

CPU (and the fallback): the input projection of all timesteps is one
MatMul + BiasAdd before the loop (`_FusedMatMul[BiasAdd]` with oneDNN); the loop
is a `tf.custom_gradient` whose forward keeps only what the backward needs and
whose backward computes per step only the gate gradients and
``dh_{t-1} = dz_t @ U^T``; dU (and through autodiff dW, db, dx) are single large
MatMuls over all timesteps after the loop. A static sequence length up to
`MAX_UNROLL` is unrolled in the graph: intermediates are then plain tensors kept
for the backward (no TensorArray writes and reads, no loop-control nodes per
step); longer or unknown lengths run a `tf.while_loop` with TensorArrays.
LSTM gate gradients come from one `LSTMBlockCellGrad` op per step (TF's fused
LSTM cell backward, elementwise only; CPU kernels for float32 and float16); in
float64, under XLA and on GPUs the same math runs as a composite
(`SigmoidGrad`/`TanhGrad`). Under mixed precision the states and the gate math
stay float32 and only the MatMuls run in the compute dtype: bfloat16
elementwise ops are slow on CPUs, and this is also closer to the float32
result than Keras' all-bfloat16 loop.

Why this CPU design: prototypes measured against `keras.layers.LSTM` in the
same process, train step (forward, backward, SGD) B=64 T=50 F=32 H=128,
float32 unless noted, medians in ms on the project's 2-core x86-64 host (TF 2.21, oneDNN;
the host was shared with other jobs, so read the ratios):

| variant                                                       | ours | Keras | Keras / ours |
|---------------------------------------------------------------|------|-------|--------------|
| BlockLSTMV2 (whole sequence in one op, Eigen GEMMs)           | 22.8 | 11.0  | 0.48         |
| while_loop + TensorArrays, composite backward                 | 13.6 | 9.8   | 0.72         |
| unrolled, composite backward                                  | 11.9 | 9.8   | 0.82         |
| unrolled, `LSTMBlockCell` forward (GEMM inside, Eigen)        | 15.6 | 13.6  | 0.87         |
| loops compiled with XLA                                       | 16.4 | 13.6  | 0.83         |
| per-step input added inside `_FusedMatMul[BiasAdd, Add]`      | 17.2 | 14.1  | 0.82         |
| unrolled, `LSTMBlockCellGrad` backward (kept)                 | 12.1 | 14.1  | 1.17         |
| + U^T materialized for the backward MatMul (kept)             | microbenchmark: dz@U^T 18% faster |
| + float32 gate math under mixed_bfloat16 (kept; vs Keras bf16) | 10.2 | 12.0  | 1.17         |

On this host the three GEMM-sized products of a train step (h@U over the
forward steps, dz@U^T over the backward steps, dU = Hprev^T@DZ after the loop) already run near one core's peak
(about 215 GFLOPS; about 2 ms each at this size) for Keras and for us alike,
and threads in one process did not speed up a MatMul while we measured (a
2048^3 MatMul took the same time with 1 and 2 threads). What is left is the
per-step elementwise work and per-op overhead (3-4 us per small op), which
the hoisted projection, the unrolled graph and the fused cell gradient cut:
shipped (`benchmarks/bench_rnn.py --grid`, same host, both CPU configurations,
results/bench_rnn_grid_summary.md), Keras / ours at B=64 T=50 F=32 H=128 in float32:
with oneDNN LSTM 1.05-2.0x and GRU 1.5-2.9x over four runs, without oneDNN LSTM
about 1.2-1.4x and GRU 1.5-2.1x; at batch 32 1.1-2.2x everywhere. At batch 256 the
fused LSTM ties or loses (0.6-1.2x per run; GRU without oneDNN at 256 units too), so
the backend tables run the stock form there. A profile at B=256 T=50 H=128 with
oneDNN (TF's profiler, host under load) showed ours issuing 103 MatMuls against
Keras' 251 for the same total MatMul time: our per-step ``dz @ U^T`` took 0.84 ms
in the step against 0.53 ms for Keras' ``transpose_b`` form in its loop, though
alone ours is the faster form (0.20 vs 0.22 ms at that shape), and the one
projection weight gradient over all steps took 15 ms against 4 ms alone, which
suggests ops of the unrolled graph contending for the two cores (not shown: one
inter-op thread gave 1.19x against 1.10x, within the noise). Finding that out,
or fusing the cell's elementwise math into one kernel per step, is what would
lift batch 256.

The stock form (`stock_lstm`, `stock_gru`): Keras' own generic loop
(`keras.src.backend.rnn`, what keras.layers.LSTM / GRU run on a CPU) over
Keras' cell math with autodiff gradients, on the layer's own weights. It runs
for ``unroll=True`` and recurrent dropout (the fused loop has neither), and
on a CPU where the fused loop was measured slower than the stock layer:
`Backend.rnn_cpu_form` reads the `rnn_stock` regions of the backend table of the CPU
configuration (oneDNN on or off, measured apart: `tfmetal_ext.backends.cpu`,
`benchmarks/bench_rnn.py --grid`). A batch or length unknown when the step is traced
meets no batch or length bound there. Its bias is added with `BiasAdd`, as Keras
adds a 1-D bias (one `BiasAddGrad` in the backward, not a broadcast `Sum`), so
its train step is Keras' own.
"""

from __future__ import annotations

import tensorflow as tf

from tfmetal_ext.ops import _common, _cudnn_params

# Static sequence lengths up to this are unrolled (the CPU path, and the loop on a GPU). Measured on the
# 2-core host with oneDNN (train step, paired rounds, T 200 F 32): the unrolled loop 1.0-2.3x the
# while loop's speed (GRU batch 32 H 32: 1.85x vs 0.94x Keras; H 256: 2.29x vs 1.42x; LSTM batch 32
# H 256: 2.05x vs 1.75x; batch 256 H 32: 1.03x vs 0.98x), and its first fit (trace and graph passes)
# no slower: 0.4 s vs 0.7 s at 200 steps, 0.7 s vs 0.6 s at 400.
MAX_UNROLL = 256

# What `lstm` / `gru` run: one CudnnRNNV3, the custom-gradient loop, or Keras' own loop.
FORMS = ("cudnn", "loop", "stock")





# ----------------------------------------------------------------------------
# Masks.


def _cudnn_mask_ok(mask):
    """(ok, lengths): `mask` (batch, time) is right-padded with no empty row."""
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    padded = tf.sequence_mask(lengths, tf.shape(mask)[1])
    ok = tf.logical_and(tf.reduce_all(tf.equal(mask, padded)), tf.reduce_all(lengths > 0))
    return ok, lengths


def _finish(seq_tm, last, mask_tm, return_sequences, zero_output_for_mask):
    """Keras' outputs at masked steps, from the carried states.

    Keras' generic RNN (`zero_output_for_mask=False`, its default) outputs at a
    masked step the previous step's output, starting from zeros: so the carried
    state once any step so far was unmasked, else zeros. With
    `zero_output_for_mask=True` masked steps output zeros. `seq_tm` is
    (time, batch, units) in processing order; `mask_tm` (time, batch) bool or
    0/1 float (counted as floats: a GPU backend may have float kernels only);
    returns batch-major outputs.
    """
    m = None
    if mask_tm is not None:
        m = tf.cast(mask_tm, tf.float32) if mask_tm.dtype == tf.bool else mask_tm
    if return_sequences:
        if m is not None:
            keep = (m if zero_output_for_mask else tf.cumsum(m, axis=0)) > 0
            seq_tm = tf.where(tf.expand_dims(keep, -1), seq_tm, tf.zeros_like(seq_tm))
        return tf.transpose(seq_tm, [1, 0, 2])
    if m is not None:
        keep = (m[-1, :] if zero_output_for_mask else tf.reduce_max(m, axis=0)) > 0
        last = tf.where(tf.expand_dims(keep, -1), last, tf.zeros_like(last))
    return last


# ----------------------------------------------------------------------------
# The loop (CPU, and GPU fallback).


def _select(m, a, b):
    return a if m is None else tf.where(m, a, b)


class _Recurrence:
    """One recurrence: a forward step, its backward step, and the weight gradients.

    Subclasses define `step(xs_t, states, weights, m)` -> ``(new_states,
    record)`` (`record_size` tensors shaped like h), `prepare_grad(weights)`,
    `step_grad(record, dstates, prepared, m)` -> ``(dstates_prev, outs)`` where
    the first ``len(xs)`` of the `per_step_outputs` tensors are the gradients of
    the step's inputs, and `weight_grads(hprev, per_step)` from the stacked
    per-step outputs. `xs` are the per-timestep inputs of the loop (the hoisted
    projections), `states` the carried states with h first, `m` the step's
    (batch, 1) mask or None.
    """

    # `Backend.rnn_list_form`: "pack" (Unpack/Pack) or "split" (Split + Reshape, ExpandDims + ConcatV2).
    lists = "pack"

    def __init__(self, steps, go_backwards, mask_tm):
        self.steps = steps
        self.go_backwards = go_backwards
        self.mask = mask_tm

    def _unstack(self, x, n):
        if self.lists == "pack":
            return tf.unstack(x, num=n)
        return [tf.squeeze(p, axis=0) for p in tf.split(x, n, axis=0)]

    def _stack(self, ts):
        if self.lists == "pack":
            return tf.stack(ts)
        return tf.concat([tf.expand_dims(t, 0) for t in ts], axis=0)

    def _mask_steps(self, n):
        """The per-step (batch, 1) bool masks of the unrolled loop, or None."""
        if self.mask is None:
            return None
        if self.mask.dtype == tf.bool:
            return tf.unstack(self.mask[:, :, None], num=n)
        # A float mask (the "split" form): cut as floats, cast back per step.
        return [tf.cast(m, tf.bool) for m in self._unstack(tf.expand_dims(self.mask, -1), n)]

    def run(self, xs, states, weights, return_sequences):
        """Returns ``(seq_or_last_h, *final_states_after_h)`` with a custom gradient."""
        n_x, n_s = len(xs), len(states)

        @tf.custom_gradient
        def core(*args):
            xs_, states_, weights_ = args[:n_x], args[n_x : n_x + n_s], args[n_x + n_s :]
            self.h0 = states_[0]
            if self.steps is not None and self.steps <= MAX_UNROLL:
                final, hs, backward = self._unrolled(xs_, states_, weights_)
            else:
                final, hs, backward = self._while(xs_, states_, weights_)
            first = hs if return_sequences else final[0]

            def grad(dfirst, *dfinal):
                if return_sequences:
                    dseq, dh = dfirst, tf.zeros_like(states_[0])
                else:
                    dseq, dh = None, dfirst
                dxs, dstates, dweights = backward(dseq, (dh,) + tuple(dfinal))
                return tuple(dxs) + tuple(dstates) + tuple(dweights)

            return (first,) + tuple(final[1:]), grad

        return core(*xs, *states, *weights)

    def _order(self, n):
        return list(reversed(range(n))) if self.go_backwards else list(range(n))

    def _unrolled(self, xs, states, weights):
        steps = self.steps
        x_steps = [self._unstack(x, steps) for x in xs]
        m_steps = self._mask_steps(steps)
        records, hprev, hs = [None] * steps, [None] * steps, []
        for t in self._order(steps):
            m = None if m_steps is None else m_steps[t]
            hprev[t] = states[0]
            states, records[t] = self.step([x[t] for x in x_steps], states, weights, m)
            hs.append(states[0])
        seq = self._stack(hs)

        def backward(dseq, dstates):
            dseq_steps = None if dseq is None else self._unstack(dseq, steps)
            per_step = [[None] * steps for _ in range(self.per_step_outputs)]
            prepared = self.prepare_grad(weights)
            for k, t in reversed(list(enumerate(self._order(steps)))):
                m = None if m_steps is None else m_steps[t]
                if dseq_steps is not None:
                    dstates = (dstates[0] + dseq_steps[k],) + tuple(dstates[1:])
                dstates, outs = self.step_grad(records[t], dstates, prepared, m)
                for j, d in enumerate(outs):
                    per_step[j][t] = d
            per_step = [self._stack(d) for d in per_step]
            return per_step[: len(xs)], dstates, self.weight_grads(self._stack(hprev), per_step)

        return states, seq, backward

    def _while(self, xs, states, weights):
        steps = tf.shape(xs[0])[0]
        dtype = xs[0].dtype
        x_tas = [tf.TensorArray(x.dtype, size=steps, element_shape=x.shape[1:]).unstack(x) for x in xs]
        m_ta = None
        if self.mask is not None:
            if self.mask.dtype == tf.bool:
                m_ta = tf.TensorArray(tf.bool, size=steps).unstack(self.mask[:, :, None])
            else:  # a float mask: TF's TensorList kernels for any device take numbers, not bool
                m_ta = _BoolAsFloat(tf.TensorArray(tf.float32, size=steps).unstack(tf.expand_dims(self.mask, -1)))
        index = (lambda k: steps - 1 - k) if self.go_backwards else (lambda k: k)
        rec_tas = [tf.TensorArray(dtype, size=steps, element_shape=states[0].shape) for _ in range(self.record_size)]
        h_ta = tf.TensorArray(dtype, size=steps, element_shape=states[0].shape)
        hp_ta = tf.TensorArray(dtype, size=steps, element_shape=states[0].shape)

        def body(k, states, rec_tas, h_ta, hp_ta):
            t = index(k)
            m = None if m_ta is None else m_ta.read(t)
            hp_ta = hp_ta.write(t, states[0])
            new_states, record = self.step([x.read(t) for x in x_tas], states, weights, m)
            rec_tas = [ta.write(t, r) for ta, r in zip(rec_tas, record)]
            return k + 1, tuple(new_states), rec_tas, h_ta.write(k, new_states[0]), hp_ta

        _, final, rec_tas, h_ta, hp_ta = tf.while_loop(
            lambda k, *_: k < steps, body, (0, tuple(states), rec_tas, h_ta, hp_ta),
            maximum_iterations=steps,
        )
        seq = h_ta.stack()

        def backward(dseq, dstates):
            prepared = self.prepare_grad(weights)
            dseq_ta = None if dseq is None else tf.TensorArray(dtype, size=steps).unstack(dseq)
            out_tas = [tf.TensorArray(dtype, size=steps) for _ in range(self.per_step_outputs)]

            def bbody(k, dstates, out_tas):
                t = index(k)
                m = None if m_ta is None else m_ta.read(t)
                if dseq_ta is not None:
                    dstates = (dstates[0] + dseq_ta.read(k),) + tuple(dstates[1:])
                record = [ta.read(t) for ta in rec_tas]
                dstates, outs = self.step_grad(record, dstates, prepared, m)
                return k - 1, tuple(dstates), [ta.write(t, d) for ta, d in zip(out_tas, outs)]

            _, dstates, out_tas = tf.while_loop(
                lambda k, *_: k >= 0, bbody, (steps - 1, tuple(dstates), out_tas),
                maximum_iterations=steps,
            )
            per_step = [ta.stack() for ta in out_tas]
            for x, d in zip(xs, per_step):
                d.set_shape(x.shape)
            return per_step[: len(xs)], dstates, self.weight_grads(hp_ta.stack(), per_step)

        return final, seq, backward


class _BoolAsFloat:
    """A TensorArray of 0/1 floats read back as bool."""

    def __init__(self, ta):
        self.ta = ta

    def read(self, t):
        return tf.cast(self.ta.read(t), tf.bool)


def _materialized_transpose(u):
    """U^T as its own buffer: MatMul(dz, U^T) measured about 18% faster than
    MatMul(dz, U, transpose_b=True) for the per-step backward shapes, and the
    Snapshot keeps grappler from folding the Transpose back into the MatMul."""
    return tf.raw_ops.Snapshot(input=tf.transpose(u))


def _flat(t):
    width = t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]
    return tf.reshape(t, [-1, width])


def _mm(a, w):
    """a @ w in w's dtype (the compute dtype), result in a's (float32 state under mixed precision)."""
    return tf.cast(tf.matmul(tf.cast(a, w.dtype), w), a.dtype)


def _mm_t(a, b, dtype):
    """flat(a)^T @ flat(b) over all timesteps, one MatMul in `dtype`."""
    return tf.matmul(tf.cast(_flat(a), dtype), tf.cast(_flat(b), dtype), transpose_a=True)


def _state_dtype(dtype):
    """Elementwise math and states in float32 under mixed precision: half and bfloat16
    elementwise ops are slower than float32 on CPUs (and less accurate); MatMuls stay
    in the compute dtype."""
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class _LSTM(_Recurrence):
    """LSTM with the gate columns in i, c, f, o order (the order `LSTMBlockCellGrad` uses).

    xs: the projection (time, batch, 4H) with bias. states: h, c. weights: U (H, 4H).
    """

    record_size = 6
    per_step_outputs = 1

    def __init__(self, steps, go_backwards, mask_tm, fused_grad):
        super().__init__(steps, go_backwards, mask_tm)
        self.fused_grad = fused_grad

    def step(self, xs_t, states, weights, m):
        (xw,), (h, c), (u,) = xs_t, states, weights
        z = xw + _mm(h, u)
        zi, zc, zf, zo = tf.split(z, 4, axis=1)
        i, g, f, o = tf.sigmoid(zi), tf.tanh(zc), tf.sigmoid(zf), tf.sigmoid(zo)
        c_new = f * c + i * g
        tc = tf.tanh(c_new)
        h_new = o * tc
        return (_select(m, h_new, h), _select(m, c_new, c)), (c, i, f, o, g, tc)

    def prepare_grad(self, weights):
        (u,) = weights
        prepared = {"u_t": _materialized_transpose(u)}
        if self.fused_grad:
            # LSTMBlockCellGrad reads only the shapes of w and b (no peepholes), in the state dtype.
            units, dtype = u.shape[0], self.state_dtype
            prepared["w"] = u if u.dtype == dtype else tf.zeros(tf.shape(u), dtype)
            prepared["zeros_h"] = tf.zeros([units], dtype)
            prepared["zeros_4h"] = tf.zeros([4 * units], dtype)
            prepared["no_input"] = tf.zeros(tf.stack([tf.shape(self.h0)[0], 0]), dtype)  # x: (batch, 0)
        return prepared

    def step_grad(self, record, dstates, p, m):
        c_prev, i, f, o, g, tc = record
        dh, dc = dstates
        if m is not None:  # a masked step passed h and c through unchanged
            dh_in, dc_in = dh, dc
            zeros = tf.zeros_like(dh)
            dh, dc = tf.where(m, dh, zeros), tf.where(m, dc, zeros)
        if self.fused_grad:
            zh = p["zeros_h"]
            dc_prev, dz, _, _, _ = tf.raw_ops.LSTMBlockCellGrad(
                x=p["no_input"], cs_prev=c_prev, h_prev=c_prev, w=p["w"], wci=zh, wcf=zh, wco=zh,
                b=p["zeros_4h"], i=i, cs=c_prev, f=f, o=o, ci=g, co=tc, cs_grad=dc, h_grad=dh,
                use_peephole=False,
            )
        else:
            dcs = dc + tf.raw_ops.TanhGrad(y=tc, dy=dh * o)
            dz = tf.concat(
                [
                    tf.raw_ops.SigmoidGrad(y=i, dy=dcs * g),
                    tf.raw_ops.TanhGrad(y=g, dy=dcs * i),
                    tf.raw_ops.SigmoidGrad(y=f, dy=dcs * c_prev),
                    tf.raw_ops.SigmoidGrad(y=o, dy=dh * tc),
                ],
                axis=1,
            )
            dc_prev = dcs * f
        dh_prev = _mm(dz, p["u_t"])
        if m is not None:
            dh_prev = tf.where(m, dh_prev, dh_in)
            dc_prev = tf.where(m, dc_prev, dc_in)
        return (dh_prev, dc_prev), (dz,)

    def weight_grads(self, hprev, per_step):
        (dz,) = per_step
        return (_mm_t(hprev, dz, self.matmul_dtype),)


class _GRU(_Recurrence):
    """GRU (reset_after=True), Keras gate order z, r, h.

    xs: projections (time, batch, 2H) for z, r (input and recurrent biases of
    z, r folded in) and (time, batch, H) for h (input bias). states: h.
    weights: U_zr (H, 2H), U_h (H, H) and, with a bias, the recurrent bias of h (H,).
    """

    record_size = 5
    per_step_outputs = 3

    def step(self, xs_t, states, weights, m):
        (xzr, xh), (h,), (u_zr, u_h, *b_h) = xs_t, states, weights
        s = tf.sigmoid(xzr + _mm(h, u_zr))
        z, r = tf.split(s, 2, axis=1)
        rh = _mm(h, u_h)
        if b_h:
            rh = tf.nn.bias_add(rh, b_h[0])
        hh = tf.tanh(xh + r * rh)
        d = h - hh
        h_new = hh + z * d
        return (_select(m, h_new, h),), (z, r, rh, hh, d)

    def prepare_grad(self, weights):
        u_zr, u_h = weights[:2]
        return {"u_zr_t": _materialized_transpose(u_zr), "u_h_t": _materialized_transpose(u_h)}

    def step_grad(self, record, dstates, p, m):
        z, r, rh, hh, d = record
        (dh,) = dstates
        dh_in = dh
        if m is not None:
            dh = tf.where(m, dh, tf.zeros_like(dh))
        da = tf.raw_ops.TanhGrad(y=hh, dy=dh - dh * z)  # d(x_h + r * rh)
        drh = da * r
        dzr = tf.concat(
            [tf.raw_ops.SigmoidGrad(y=z, dy=dh * d), tf.raw_ops.SigmoidGrad(y=r, dy=da * rh)], axis=1
        )
        dh_prev = tf.add_n([dh * z, _mm(dzr, p["u_zr_t"]), _mm(drh, p["u_h_t"])])
        if m is not None:
            dh_prev = tf.where(m, dh_prev, dh_in)
        return (dh_prev,), (dzr, da, drh)

    def weight_grads(self, hprev, per_step):
        dzr, _, drh = per_step
        grads = (_mm_t(hprev, dzr, self.matmul_dtype), _mm_t(hprev, drh, self.matmul_dtype))
        if self.has_bias:
            grads += (tf.reduce_sum(_flat(drh), axis=0),)
        return grads


def _time_major(x):
    return tf.transpose(x, [1, 0, 2])


def _project(x_tm, kernel, bias):
    """(time, batch, in) @ kernel + bias as one 2-D MatMul + BiasAdd (fuses on oneDNN)."""
    steps, batch = tf.shape(x_tm)[0], tf.shape(x_tm)[1]
    flat = tf.matmul(tf.reshape(x_tm, [-1, x_tm.shape[-1]]), kernel)
    if bias is not None:
        flat = tf.nn.bias_add(flat, bias)
    out = tf.reshape(flat, tf.stack([steps, batch, kernel.shape[-1]]))
    out.set_shape(x_tm.shape[:2].concatenate([kernel.shape[-1]]))
    return out


def _icfo(t, units):
    """Keras LSTM gate columns i, f, c, o -> i, c, f, o (last axis)."""
    i, f, c, o = tf.split(t, [units] * 4, axis=-1)
    return tf.concat([i, c, f, o], axis=-1)


def _mask_time_major(mask, lists):
    """(time, batch): bool for the "pack" form, 0/1 float32 for "split" (see `Backend.rnn_list_form`)."""
    if mask is None:
        return None
    return tf.transpose(mask if lists == "pack" else tf.cast(mask, tf.float32))


def _lstm_loop(x, h0, c0, kernel, recurrent_kernel, bias, mask, go_backwards, return_sequences,
               zero_output_for_mask, cpu, lists="pack"):
    units = recurrent_kernel.shape[0]
    state = _state_dtype(x.dtype)
    x_tm = _time_major(x)
    mask_tm = _mask_time_major(mask, lists)
    xw = _project(x_tm, _icfo(kernel, units), None if bias is None else _icfo(bias, units))
    # LSTMBlockCellGrad has CPU kernels for float32 and float16 (none on tensorflow-metal, none in XLA).
    fused_grad = cpu and state in (tf.float32, tf.float16) and not _common.in_xla_context()
    rec = _LSTM(x.shape[1], go_backwards, mask_tm, fused_grad=fused_grad)
    rec.matmul_dtype, rec.state_dtype, rec.lists = x.dtype, state, lists
    first, c_t = rec.run(
        [tf.cast(xw, state)], [tf.cast(h0, state), tf.cast(c0, state)], [_icfo(recurrent_kernel, units)],
        return_sequences,
    )
    h_t = first[-1, :, :] if return_sequences else first  # a full slice spec (see `_gru_loop`)
    if mask_tm is not None and go_backwards:
        mask_tm = tf.reverse(mask_tm, [0])
    out = _finish(first if return_sequences else None, h_t, mask_tm, return_sequences, zero_output_for_mask)
    return tf.cast(out, x.dtype), [tf.cast(h_t, x.dtype), tf.cast(c_t, x.dtype)]


def _gru_loop(x, h0, kernel, recurrent_kernel, bias, mask, go_backwards, return_sequences,
              zero_output_for_mask, lists="pack"):
    units = recurrent_kernel.shape[0]
    x_tm = _time_major(x)
    mask_tm = _mask_time_major(mask, lists)
    w_zr, w_h = tf.split(kernel, [2 * units, units], axis=1)
    u_zr, u_h = tf.split(recurrent_kernel, [2 * units, units], axis=1)
    b_h = None
    if bias is None:
        b_zr = b_xh = None
    else:
        # Split, not Unpack (no kernel on every GPU backend); no partial slice spec
        # either (the open plugin's StridedSlice refuses one at run time).
        b_in, b_rec = (tf.squeeze(b, 0) for b in tf.split(bias, 2, axis=0))
        b_in_zr, b_xh = tf.split(b_in, [2 * units, units])
        b_rec_zr, b_h = tf.split(b_rec, [2 * units, units])
        b_zr = b_in_zr + b_rec_zr  # z and r see x@W + b_in + h@U + b_rec: one bias
    state = _state_dtype(x.dtype)
    xzr = tf.cast(_project(x_tm, w_zr, b_zr), state)
    xh = tf.cast(_project(x_tm, w_h, b_xh), state)
    rec = _GRU(x.shape[1], go_backwards, mask_tm)
    rec.lists = lists
    rec.has_bias = b_h is not None
    rec.matmul_dtype = x.dtype
    weights = [u_zr, u_h] + ([tf.cast(b_h, state)] if b_h is not None else [])
    (first,) = rec.run([xzr, xh], [tf.cast(h0, state)], weights, return_sequences)
    h_t = first[-1, :, :] if return_sequences else first  # a full slice spec (see `_gru_loop`)
    if mask_tm is not None and go_backwards:
        mask_tm = tf.reverse(mask_tm, [0])
    out = _finish(first if return_sequences else None, h_t, mask_tm, return_sequences, zero_output_for_mask)
    return tf.cast(out, x.dtype), [tf.cast(h_t, x.dtype)]


# ----------------------------------------------------------------------------
# CudnnRNNV3.


def _cudnn(mode, x, states, params, mask, go_backwards, return_sequences, zero_output_for_mask):
    """One `CudnnRNNV3` over batch-major `x`; Keras' generic-RNN outputs at masked steps."""
    batch, steps = tf.shape(x)[0], tf.shape(x)[1]
    if mask is None:
        lengths = tf.fill(tf.reshape(batch, [1]), steps)
    else:
        lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    if go_backwards:
        # cuDNN runs each row over its first `length` steps; Keras' go_backwards
        # reverses the padded sequence. Reverse the valid part, run, reverse it
        # back and then reverse the whole row (padding first, as Keras has it).
        x = tf.reverse_sequence(x, lengths, seq_axis=1, batch_axis=0)
    input_h = tf.expand_dims(states[0], axis=1)  # batch-major: (batch, layers, units)
    input_c = tf.expand_dims(states[1], axis=1) if mode == "lstm" else tf.zeros([], x.dtype)
    outputs, h, c, _, _ = tf.raw_ops.CudnnRNNV3(
        input=x,
        input_h=input_h,
        input_c=input_c,
        params=params,
        sequence_lengths=lengths,
        rnn_mode=mode,
        input_mode="linear_input",
        direction="unidirectional",
        is_training=True,
        time_major=False,
    )
    h = tf.squeeze(h, axis=1)
    new_states = [h, tf.squeeze(c, axis=1)] if mode == "lstm" else [h]
    if go_backwards:
        outputs = tf.reverse(tf.reverse_sequence(outputs, lengths, seq_axis=1, batch_axis=0), [1])
        mask = None if mask is None else tf.reverse(mask, [1])
    if not return_sequences:
        last = h
        if mask is not None and zero_output_for_mask:
            last = tf.where(mask[:, -1:], h, tf.zeros_like(h))
        return last, new_states
    if mask is not None and not go_backwards and not zero_output_for_mask:
        # cuDNN zero-fills steps past each row's length; Keras carries the last output.
        outputs = tf.where(mask[:, :, None], outputs, h[:, None, :])
    return outputs, new_states


def _with_mask_fallback(mask, cudnn_fn, loop_fn):
    if mask is None:
        return cudnn_fn()
    ok, _ = _cudnn_mask_ok(mask)
    return tf.cond(ok, cudnn_fn, loop_fn)


# ----------------------------------------------------------------------------
# The stock form: Keras' own generic loop (`keras.src.backend.rnn`, what
# keras.layers.LSTM / GRU run on a CPU) over Keras' cell math, autodiff
# gradients. Taken where the fused loop cannot honour an argument (unroll=True,
# recurrent dropout) and for the shapes where it was measured slower (`Backend.rnn_cpu_form`).


def _keras_rnn(step, x, states, mask, go_backwards, return_sequences, zero_output_for_mask, unroll):
    from keras.src import backend as keras_backend

    last, outputs, new_states = keras_backend.rnn(
        step, x, list(states), go_backwards=go_backwards, mask=mask, unroll=unroll,
        input_length=x.shape[1], zero_output_for_mask=zero_output_for_mask,
        return_all_outputs=return_sequences,
    )
    return (outputs if return_sequences else last), list(new_states)


def stock_lstm(x, h0, c0, kernel, recurrent_kernel, bias, *, mask, go_backwards, return_sequences,
               zero_output_for_mask, unroll=False, recurrent_mask=None):
    """keras.layers.LSTM's computation (gates i, f, c, o) over batch-major `x`; ``(output, [h, c])``.

    `recurrent_mask` (batch, units) multiplies the previous h before the
    recurrent MatMul at every step (recurrent dropout: one mask per sequence).
    """

    def step(x_t, states):
        h, c = states
        h_in = h if recurrent_mask is None else h * recurrent_mask
        z = tf.matmul(x_t, kernel) + tf.matmul(h_in, recurrent_kernel)
        if bias is not None:
            z = tf.nn.bias_add(z, bias)  # as Keras' add of a 1-D bias (its gradient one BiasAddGrad, no Sum)
        zi, zf, zc, zo = tf.split(z, 4, axis=1)
        c_new = tf.sigmoid(zf) * c + tf.sigmoid(zi) * tf.tanh(zc)
        h_new = tf.sigmoid(zo) * tf.tanh(c_new)
        return h_new, [h_new, c_new]

    return _keras_rnn(step, x, [h0, c0], mask, go_backwards, return_sequences, zero_output_for_mask, unroll)


def stock_gru(x, h0, kernel, recurrent_kernel, bias, *, mask, go_backwards, return_sequences,
              zero_output_for_mask, unroll=False, recurrent_mask=None, reset_after=True):
    """keras.layers.GRU's computation (gates z, r, h); ``(output, [h])``.

    ``reset_after=True``: bias (2, 3H), the reset gate applied to ``h @ U_h``;
    False: bias (3H,), the candidate from ``(r * h) @ U_h``.
    """
    units = recurrent_kernel.shape[0]

    def step(x_t, states):
        (h,) = states
        h_in = h if recurrent_mask is None else h * recurrent_mask
        mx = tf.matmul(x_t, kernel)
        if reset_after:
            mh = tf.matmul(h_in, recurrent_kernel)
            if bias is not None:
                mx, mh = tf.nn.bias_add(mx, bias[0]), tf.nn.bias_add(mh, bias[1])
        else:
            mh = tf.matmul(h_in, recurrent_kernel[:, : 2 * units])
            if bias is not None:
                mx = tf.nn.bias_add(mx, bias)
        xz, xr, xh = tf.split(mx, 3, axis=1)
        hz, hr = mh[:, :units], mh[:, units : 2 * units]
        z = tf.sigmoid(xz + hz)
        r = tf.sigmoid(xr + hr)
        if reset_after:
            cand = tf.tanh(xh + r * mh[:, 2 * units :])
        else:
            cand = tf.tanh(xh + tf.matmul(r * h_in, recurrent_kernel[:, 2 * units :]))
        h_new = z * h + (1.0 - z) * cand
        return h_new, [h_new]

    return _keras_rnn(step, x, [h0], mask, go_backwards, return_sequences, zero_output_for_mask, unroll)


# ----------------------------------------------------------------------------
# Entry points: the form is the caller's choice (`tfmetal_ext.backends.Backend.rnn_implementation`,
# `rnn_list_form` and `rnn_cpu_form`).


def _check_form(form, unroll, recurrent_mask):
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {', '.join(FORMS)}. Received: form={form!r}")
    if form != "stock" and (unroll or recurrent_mask is not None):
        raise ValueError(f"`unroll` and `recurrent_mask` need the stock form. Received: form={form!r}")


def lstm(x, h0, c0, kernel, recurrent_kernel, bias, *, form, mask, go_backwards, return_sequences,
         zero_output_for_mask, device="cpu", lists="pack", unroll=False, recurrent_mask=None):
    """Runs an LSTM over batch-major `x` (all tensors in the compute dtype) in `form`.

    `form`: ``"cudnn"`` (one `CudnnRNNV3`; a mask that is not right-padded
    switches to the loop at run time), ``"loop"`` (the custom-gradient loop)
    or ``"stock"`` (`stock_lstm`, the only form taking `unroll` and
    `recurrent_mask`). `device`: the `tfmetal_ext.devices.backend` value it
    runs on (on ``"cpu"`` the loop's cell gradient is `LSTMBlockCellGrad`).
    `lists`: how the unrolled loop cuts and stacks its per-step tensors
    (`tfmetal_ext.backends.Backend.rnn_list_form`).

    Returns ``(output, [h, c])``; `output` is the sequence (batch, time, units)
    in processing order or the last output (batch, units), as Keras' LSTM.
    """
    _check_form(form, unroll, recurrent_mask)
    if form == "stock":
        return stock_lstm(x, h0, c0, kernel, recurrent_kernel, bias, mask=mask, go_backwards=go_backwards,
                          return_sequences=return_sequences, zero_output_for_mask=zero_output_for_mask,
                          unroll=unroll, recurrent_mask=recurrent_mask)
    units = recurrent_kernel.shape[0]

    def loop():
        return _lstm_loop(x, h0, c0, kernel, recurrent_kernel, bias, mask, go_backwards,
                          return_sequences, zero_output_for_mask, cpu=device == "cpu", lists=lists)

    if form == "loop":
        return loop()

    def cudnn():
        params = _cudnn_params.lstm_cudnn_params(kernel, recurrent_kernel, bias, units)
        return _cudnn("lstm", x, [h0, c0], params, mask, go_backwards, return_sequences, zero_output_for_mask)

    return _with_mask_fallback(mask, cudnn, loop)


def gru(x, h0, kernel, recurrent_kernel, bias, *, form, mask, go_backwards, return_sequences,
        zero_output_for_mask, device="cpu", lists="pack", unroll=False, recurrent_mask=None,
        reset_after=True):
    """Runs a GRU over batch-major `x` in `form` (as `lstm`); returns ``(output, [h])``.

    The ``"cudnn"`` and ``"loop"`` forms compute ``reset_after=True``; on
    `device` ``"cuda"`` cuDNN takes the gates in its own order (r, z, h).
    """
    _check_form(form, unroll, recurrent_mask)
    if form == "stock":
        return stock_gru(x, h0, kernel, recurrent_kernel, bias, mask=mask, go_backwards=go_backwards,
                         return_sequences=return_sequences, zero_output_for_mask=zero_output_for_mask,
                         unroll=unroll, recurrent_mask=recurrent_mask, reset_after=reset_after)
    if not reset_after:
        raise ValueError(f"reset_after=False needs the stock form. Received: form={form!r}")
    units = recurrent_kernel.shape[0]

    def loop():
        return _gru_loop(x, h0, kernel, recurrent_kernel, bias, mask, go_backwards,
                         return_sequences, zero_output_for_mask, lists=lists)

    if form == "loop":
        return loop()

    def cudnn():
        params = _cudnn_params.gru_cudnn_params(kernel, recurrent_kernel, bias, units, swap_gates=device == "cuda")
        return _cudnn("gru", x, [h0], params, mask, go_backwards, return_sequences, zero_output_for_mask)

    return _with_mask_fallback(mask, cudnn, loop)
