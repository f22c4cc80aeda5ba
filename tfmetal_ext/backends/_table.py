"""The shape of a backend table: what one backend has and fuses."""

from __future__ import annotations

import contextlib
import dataclasses
import types

from tfmetal_ext import _env

TRAIN, PREDICT = "train", "predict"


@dataclasses.dataclass(frozen=True)
class Fusion:
    """How one catalog pattern fuses on one backend.

    Attributes:
        summary: the conditions in words (shown in `inspect.PATTERNS`).
        dtypes: compute dtypes whose nodes fuse; empty: never fuses here.
        acts: activation ops (``fused_ops`` names) a contraction absorbs.
        train_acts: the activations absorbed in a training step (the
            gradient of the others needs the pre-activation); None: as `acts`.
        modes: the modes in which the pattern fuses.
        train_partial: what fuses for sure in a training step where `modes`
            has only predict (e.g. ``("BiasAdd",)``), with `train_reason`.
        train_reason: why a training step falls short.
        requires_act: the pattern fuses only with one of these activations.
        no_1x1: 1x1 filters are not fused.
        needs: a `FusionContext` flag that must be true (``"cublaslt"``),
            with `why_not` as the reason when it is false.
        train_dtypes: the dtypes that fuse in training, when narrower.
        train_channels_multiple: training fuses only when channels are a
            multiple of this.
        side_input: a batch norm also absorbs an Add side input (residual).
        why_not: the reason when nothing fuses here (dtypes empty or `needs`
            unmet); defaults to a generic one.
        note: a caveat worth reading even when fused.
        dtype_notes: dtype -> what happens to that dtype's nodes, for a dtype
            outside `dtypes` whose story is more than "no fused kernel"
            (e.g. a pass that would fuse it into an op with no kernel).
    """

    summary: str
    dtypes: tuple = ()
    acts: tuple = ()
    train_acts: tuple | None = None
    modes: tuple = (TRAIN, PREDICT)
    train_partial: tuple | None = None
    train_reason: str | None = None
    requires_act: tuple = ()
    no_1x1: bool = False
    needs: str | None = None
    train_dtypes: tuple | None = None
    train_channels_multiple: int = 1
    side_input: bool = True
    why_not: str | None = None
    note: str | None = None
    dtype_notes: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        if not isinstance(self.dtype_notes, types.MappingProxyType):
            object.__setattr__(self, "dtype_notes", types.MappingProxyType(dict(self.dtype_notes)))

    @property
    def fuses(self):
        return bool(self.dtypes)

    def acts_in(self, mode):
        if mode == TRAIN and self.train_acts is not None:
            return self.train_acts
        return self.acts

    def dtypes_in(self, mode):
        if mode == TRAIN and self.train_dtypes is not None:
            return self.train_dtypes
        return self.dtypes


def never(summary, why_not=None):
    """A pattern that does not fuse on a backend."""
    return Fusion(summary, why_not=why_not)


@dataclasses.dataclass(frozen=True)
class RnnStock:
    """Shapes where a CPU's stock recurrent train step was measured faster than FusedLSTM / FusedGRU's loop.

    One region of a backend table's `Backend.rnn_stock` rule: the stock form
    runs for a shape inside it (`Backend.rnn_cpu_form`). A bound left None
    holds for any value. A batch or length bound holds only for a static value
    (an unknown batch or length is not known to reach it: see
    `Backend.rnn_cpu_form`).

    Attributes:
        reason: the measurement behind the region, for reports.
        min_batch, min_steps: from this static batch / sequence length on.
        min_units, max_units: units within these bounds.
        dtypes: compute dtype names it holds for; None: every dtype.
    """

    reason: str
    min_batch: int | None = None
    min_steps: int | None = None
    min_units: int | None = None
    max_units: int | None = None
    dtypes: tuple | None = None

    def holds(self, batch, steps, units, dtype=None):
        """True when a layer of `units` over a (`batch`, `steps`) input in `dtype` is inside the region."""

        def at_least(value, bound):
            return bound is None or (value is not None and value >= bound)

        return (
            at_least(batch, self.min_batch)
            and at_least(steps, self.min_steps)
            and at_least(units, self.min_units)
            and (self.max_units is None or (units is not None and units <= self.max_units))
            and (self.dtypes is None or dtype is None or dtype in self.dtypes)
        )


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one backend has and fuses.

    Attributes:
        key: ``"cpu_onednn"``, ``"cpu"``, ``"cuda"``, ``"metal"`` (Apple's
            tensorflow-metal) or ``"metal_plugin"`` (the open
            tensorflow-metal-plugin): the `FusionContext.support_key` that
            selects it.
        device: the `devices.backend()` value it serves.
        label: how reasons name it (``"CPU without oneDNN"``).
        fusions: catalog pattern name -> `Fusion`.
        kernels: op -> dtypes it has kernels for, where known (None: not
            recorded; TF's full registry applies).
        half_needs_native: float16 nodes fuse only on a CPU with native fp16.
        bf16_needs_onednn_isa: bfloat16 nodes fuse only where oneDNN supports
            bfloat16 on the CPU (`devices.Capabilities.onednn_bf16`).
        addv2_bias: a broadcast AddV2 after a contraction counts as its
            BiasAdd (oneDNN); elsewhere only a real BiasAdd fuses.
        pointwise_train_as_matmul: in a training step a 1x1, stride-1
            convolution is faster as one MatMul (forward and both backward
            products) than as Conv2D and its backprop kernels.
        rnn_stock: recurrent cell (``"lstm"``, ``"gru"``) -> a tuple of
            `RnnStock` regions: the shapes where FusedLSTM / FusedGRU's loop
            was measured slower than the stock layer's train step on this
            backend, so the stock form runs there (`rnn_cpu_form`); None or a
            missing cell: the fused form everywhere.
        pass_failure: a known graph shape on which the remapper pass fails
            as a whole here (TF logs "remapper failed: ... Mutation::Apply
            error" and rolls every remapper fusion of that graph back), as
            text for reports; None when none is known.
        kernels_complete: `kernels` lists every op the backend registers
            (generated from its source), so an op missing there (and from
            `shared_kernels`) has no kernel; False: `kernels` holds only the
            facts known.
        shared_kernels: op -> dtypes of TensorFlow's own ``DEVICE_DEFAULT``
            kernels, which serve this device too (control flow, ``Const``,
            ``Identity``, ``Shape``, ``ReadVariableOp``, int32 host-memory
            arithmetic, ...); None: not recorded.
        dtype_attrs: op -> the type attribute whose dtypes `kernels` lists,
            where it is not ``T`` (``Cast``: ``SrcT``): the attribute whose
            dtype to ask `has_kernel` about.
        missing_kernels: ops known to have no kernel here, whatever dtype.
        host_ops: op -> reason, for ops whose kernels the backend's source
            has but does not register on the TensorFlow it runs on (they run
            on the host).
        unsupported_layers: Keras class name -> reason (with the fix) for
            stock layers that fail on this backend.
        host_memory: op -> {dtype name, or "" for a registration without a
            type constraint: the names of the op's arguments (inputs or
            outputs, as in its OpDef) the backend's kernel keeps in host
            memory}; None: not recorded (the table's kernels then say nothing
            about memory; TensorFlow's own rules still apply: resource and
            string tensors live on the host, and an int32 argument no kernel
            declares is taken to live there too; see
            `tfmetal_ext.inspect.transfers`).
        gated_kernels: op -> dtypes registered only when `gate` holds on the
            user's machine (Apple's tensorflow-metal: ten stateless-random ops
            need macOS 13's MPSGraph). They are part of `kernels` as well.
        gate: ``(label, minimum macOS as a tuple)`` naming the condition of
            `gated_kernels`; None when nothing is gated.
        source: where the facts come from.
    """

    key: str
    device: str
    label: str
    fusions: types.MappingProxyType
    kernels: types.MappingProxyType | None = None
    half_needs_native: bool = False
    bf16_needs_onednn_isa: bool = False
    addv2_bias: bool = False
    pointwise_train_as_matmul: bool = False
    rnn_stock: types.MappingProxyType | None = None
    pass_failure: str | None = None
    kernels_complete: bool = False
    shared_kernels: types.MappingProxyType | None = None
    dtype_attrs: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    missing_kernels: frozenset = frozenset()
    host_ops: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    unsupported_layers: types.MappingProxyType = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    host_memory: types.MappingProxyType | None = None
    gated_kernels: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    gate: tuple | None = None
    source: str = ""

    def host_memory_args(self, op, dtype=None):
        """frozenset of the argument names this backend's own kernel of `op` keeps in host memory, or None.

        None: the table does not record memory, or has no own kernel of `op`
        for `dtype` (a shared TensorFlow kernel or the CPU runs it; ask
        TensorFlow's registry). `dtype` as in `has_kernel`; with None, the
        arguments every registration of `op` keeps on the host.
        """
        if self.host_memory is None or op not in (self.kernels or {}):
            return None
        registered = self.kernels[op]
        by_dtype = self.host_memory.get(op, {})
        if not registered:
            return frozenset(by_dtype.get("", ()))
        if dtype is None:
            return frozenset.intersection(*(frozenset(by_dtype.get(d, ())) for d in registered))
        if dtype not in registered:
            return None
        return frozenset(by_dtype.get(dtype, ()))

    def gate_met(self, macos=None):
        """Whether `gated_kernels` are registered on `macos` (a version tuple); None: the gate is assumed met."""
        if self.gate is None or macos is None:
            return True
        return tuple(macos) >= tuple(self.gate[1])

    def has_kernel(self, op, dtype=None, macos=None):
        """True / False / None: whether `op` has a kernel on this backend's device for `dtype`.

        `dtype` is a dtype name (``"float32"``) of the op's type attribute
        (``T``, or the attr the table names, e.g. ``SrcT`` for Cast); None
        asks about any dtype. `macos`: the user's macOS as a version tuple,
        for a table with `gated_kernels` (None: the gate is assumed met; see
        `gate_met`). In order:

        * False for an op in `host_ops` (the backend does not register it on
          this TensorFlow: it runs on the host) or in `missing_kernels`.
        * None when the table records no kernels at all.
        * True when `kernels` or `shared_kernels` lists the op for `dtype`
          (an empty dtype tuple: registered without a type constraint).
        * False when the op is listed there but not for `dtype` (the listed
          dtypes are what is registered).
        * Otherwise (the op is not listed): False when `kernels_complete`,
          else None (unknown: the table holds only the facts known).

        Which device runs an op without a kernel here (the CPU, or nothing
        when TF has no CPU kernel either) is the caller's question: this
        answers for this backend's device only.
        """
        if op in self.host_ops or op in self.missing_kernels:
            return False
        if self.kernels is None:
            return None
        listed = False
        gated = () if self.gate_met(macos) else self.gated_kernels.get(op, ())
        for registered in (self.kernels, self.shared_kernels or {}):
            if op in registered:
                dtypes = registered[op]
                if registered is self.kernels and gated:
                    dtypes = tuple(d for d in dtypes if d not in gated)
                    if not dtypes:
                        continue
                listed = True
                if dtype is None or not dtypes or dtype in dtypes:
                    return True
        if listed:
            return False
        return False if self.kernels_complete else None

    def fusion(self, pattern):
        """The `Fusion` of `pattern` here (a never-fusing one when the table has no row)."""
        return self.fusions.get(pattern) or never("not fused")

    # ------------------------------------------------------------------------
    # The recurrent forms FusedLSTM / FusedGRU run here (the engine: `tfmetal_ext.ops._recurrence`).

    def cudnn_rnn_kernels(self, dtype=None):
        """True / False / None: whether this backend runs `CudnnRNNV3` (and its backprop) in `dtype`.

        Data only: the ``cudnn_rnn`` row must list `dtype` and neither op may
        be known to lack a kernel here (`has_kernel`). None: the row fuses but
        the table does not know the kernels (taken as present).
        """
        from tfmetal_ext.backends import fusion

        row = self.fusion("cudnn_rnn")
        if not row.fuses or (dtype is not None and dtype not in row.dtypes):
            return False
        known = [self.has_kernel(op, dtype) for op in (fusion.CUDNN_RNN, fusion.CUDNN_RNN_GRAD)]
        if False in known:
            return False
        return True if all(known) else None

    def rnn_implementation(self, dtype=None, cuda_build=False):
        """``"cudnn"`` or ``"loop"``: what runs the recurrence here in the compute `dtype`.

        CUDA means a CUDA build of TensorFlow with a GPU (`cuda_build`, which
        the caller probes); other GPU platforms served as ``"cuda"`` (ROCm,
        unknown PluggableDevices) get the loop, since their RNN kernels' weight
        layouts differ. On Metal the table decides (`cudnn_rnn_kernels`):
        Apple's tensorflow-metal has `CudnnRNNV3`; the open
        tensorflow-metal-plugin has no kernel for it (and TF none on the CPU),
        so the loop runs there.
        """
        if self.device == "cuda":
            return "cudnn" if cuda_build else "loop"
        if self.device != "metal":
            return "loop"
        return "loop" if self.cudnn_rnn_kernels(dtype) is False else "cudnn"

    def rnn_list_form(self, dtype):
        """``"pack"`` or ``"split"``: how the unrolled loop cuts its per-step tensors and stacks them again.

        ``"pack"``: `Unpack` / `Pack` (one op each way; the CPU form).
        ``"split"``: one `Split` and a `Squeeze` per step, `ExpandDims` per
        step and one `ConcatV2`: the same number of device kernels (the
        reshapes are metadata-only kernels TensorFlow registers for every
        device), for a GPU whose table does not know `Pack` / `Unpack` to have
        kernels (the open tensorflow-metal-plugin registers neither: they would
        run on the host, a round trip per use). Masks then travel as float32
        and are cast back per step, since such a backend's `Split` and
        TensorLists need not take bool.
        """
        if self.device == "cpu":
            return "pack"
        if self.has_kernel("Pack", dtype) is True and self.has_kernel("Unpack", dtype) is True:
            return "pack"
        return "split"

    def rnn_cpu_form(self, cell, batch, steps, units, dtype=None):
        """``"fused"`` or ``"stock"``: which form a CPU `FusedLSTM` / `FusedGRU` runs for a shape.

        The rule is data: the `rnn_stock` regions of this table (one table per
        CPU configuration, oneDNN on or off, each measured apart; see
        `tfmetal_ext.backends.cpu`). A batch or length unknown when the step is
        traced (`fit` traces batch None when the data does not split into full
        batches) meets no batch or length bound, so it runs the form the
        regions without such a bound give: the fused form, unless a region
        covers every batch (a run-time switch between the two forms on the
        batch cost more than it saved). `force_cpu_form` overrides it.
        """
        forced = forced_rnn_form()
        if forced is not None:
            return forced
        return "stock" if self.rnn_stock_region(cell, batch, steps, units, dtype) is not None else "fused"

    def rnn_stock_region(self, cell, batch, steps, units, dtype=None):
        """The `RnnStock` region of this table holding the shape (the measured reason), or None."""
        for region in (self.rnn_stock or {}).get(cell, ()):
            if region.holds(batch, steps, units, dtype):
                return region
        return None


def forced_rnn_form():
    """The form `force_cpu_form` forces, or None: the environment's `rnn_form` (`tfmetal_ext._env`)."""
    return _env.current().rnn_form


@contextlib.contextmanager
def force_cpu_form(form):
    """Layers built (and traced) inside run `form` regardless of the threshold (benchmarks, tests).

    Sets the environment's `rnn_form` for the block.
    """
    with _env.scope(rnn_form=form):
        yield


def backend(key, device, label, fusions, **kw):
    return Backend(key, device, label, types.MappingProxyType(dict(fusions)), **kw)
