"""Fused Keras optimizers: one training op per variable, or one op per dtype group, per step.

`FusedAdam`, `FusedAdamW` and `FusedSGD` are drop-in replacements for
`keras.optimizers.Adam`, `AdamW` and `SGD` (same arguments, results and
optimizer variables) that update each variable with one TF training op
(``ResourceApplyAdam``, ``ResourceApplyKerasMomentum``,
``ResourceApplyGradientDescent``), which tensorflow-metal, CUDA and the CPU
implement as single kernels. Keras' own optimizers issue about 27 (Adam) or 8
(SGD with momentum) small ops per variable.

`FusedRMSprop` and `FusedAdagrad` replace `keras.optimizers.RMSprop` and
`Adagrad` the same way: one ``ResourceApplyRMSProp``
(``ResourceApplyCenteredRMSProp`` when centered) or ``ResourceApplyAdagradV2``
per variable. ``ResourceApplyAdagradV2`` adds epsilon outside the square root
where Keras adds it inside, so `FusedAdagrad` emits it only where the two agree
to rounding (the default ``initial_accumulator_value=0.1``) and Keras' math as
elementwise ops otherwise (`FusedAdagrad.composite_reason` says so).

`FusedLion` replaces `keras.optimizers.Lion`. TF has no Lion training op, so
its per-variable form is Keras' math as elementwise ops with the step's
scalars built once per step.

`FusedAdam`, `FusedAdamW`, `FusedLion` and `FusedRMSprop` take
``multi_tensor="auto"`` by default: one ``TfmetalExt>MultiTensorAdam`` /
``MultiTensorLion`` / ``MultiTensorRMSprop`` op per (dtype, device, decayed
or not) group and step where the op library
is loaded and has the op's kernel for the variables' device (not inside XLA,
not under an unsupported `tf.distribute` strategy, not avoided by
``configure(avoid_fusions=...)``); elsewhere the per-variable form below,
with the reason logged once at INFO (WARNING for an explicit
``multi_tensor=True``). ``multi_tensor=False`` always uses the per-variable
form. ``opt.update_form`` / ``opt.update_form_reason`` say what the last
traced step used, and a train step's `tfmetal_ext.inspect` fusion report
(``optimizer_update``, also in `MetalCallback`'s summary) counts it from the
executed graph.

Which form runs where (`FusedUpdateMixin.composite_reason`, read from the
backend table, not from a plugin name):

| backend | per-variable form (FusedAdam / FusedAdamW / FusedSGD / FusedRMSprop / FusedAdagrad; FusedLion: Keras' math everywhere) | ``multi_tensor="auto"`` (default) / ``True`` |
|---|---|---|
| CPU, CUDA, Apple's tensorflow-metal | one ``ResourceApply*`` per variable (FusedAdagrad with a tiny ``initial_accumulator_value``: the composite form; on tensorflow-metal, whose ``ResourceApply*`` kernels are float32 only, a float16 or bfloat16 variable takes the composite form too) | one ``TfmetalExt>MultiTensorAdam`` / ``MultiTensorLion`` / ``MultiTensorRMSprop`` per group (CPU and Metal; CUDA: no kernel, so "auto" keeps the per-variable form) |
| the open tensorflow-metal-plugin on TF 2.21 | the composite form: Keras' update math as elementwise ops into ``AssignAddVariableOp`` / ``AssignSubVariableOp`` / ``AssignVariableOp``, scalars once per step (Adam: about 10 ops per variable, Keras 27) | one multi-tensor op per group, as elsewhere: its Metal kernel reaches the variables through TF's C++ kernel API, which TF 2.21 exports |

Why the composite form on the open plugin (TF 2.21): TF 2.20/2.21 export none
of the resource-variable kernel C API (tensorflow/tensorflow#126374), so the
plugin registers no ``ResourceApply*`` and no ``Assign*VariableOp`` of its
own (its table's `host_ops`), and TF registers no device-default kernel for
any ``ResourceApply*``. Each fused op would then run on the CPU against
variables and slots that live on the GPU device: the gradient crosses
devices for every variable, and a resource consumed off its device may even
be refused by the placer. The composite form's elementwise ops have plugin
kernels, and its ``Assign*VariableOp`` are TF's own kernels registered for
every device: they are placed on the GPU device with the variables and
write the unified memory from the host (the plugin makes every Metal kernel
wait for the GPU before returning on TF 2.21, which keeps that safe). So no
op leaves the device and nothing is copied; the host work is the assigns'
memory traffic, which Keras' own optimizer (what the plugin's author trained
with) does too, with about 2.5x our op count. Our op library's gap kernels
for those three ops (`tfmetal_ext.backends.gap_kernels`, family
``gap_variable``) take the traffic to the GPU: they reach the variables
through TF's C++ kernel API (``custom_ops/include/tfmetal/resource_variables.h``),
which TF 2.21 exports, and update them with a Metal dispatch; the placement
prediction counts them on the GPU ("tfmetal_ext gap kernel"). The default
``multi_tensor="auto"`` needs neither: its one op per group has a Metal
kernel there for the same reason. Where TF exports the C API (2.22, or 2.19
with Apple's plugin) the table has the kernels and the one fused op per
variable comes back by itself. A Mac has to confirm: that a
``ResourceApplyAdam`` on GPU-resident variables really is worse there (or is
refused), and the step times of both forms.

Loss scaling: under ``mixed_float16`` Keras wraps the optimizer in a
`keras.optimizers.LossScaleOptimizer`. Around `FusedAdam`, `FusedAdamW`,
`FusedLion` and `FusedRMSprop`, where their multi-tensor op runs, the
wrapper's step is that one op taking the loss scale (it checks every
gradient, skips the whole update on a NaN or an infinity, unscales in the
kernel) and Keras' dynamic-scale rule driven by its flag: no ``IsFinite``,
division, ``Pack`` or ``cond`` per step, results identical to Keras' loss
scaling. `tfmetal_ext.optimizers.loss_scale` says how and where not;
``opt.loss_scale_form`` says what the last traced step used.
"""

from tfmetal_ext.optimizers import loss_scale
from tfmetal_ext.optimizers.adam import FusedAdam
from tfmetal_ext.optimizers.adagrad import FusedAdagrad
from tfmetal_ext.optimizers.adamw import FusedAdamW
from tfmetal_ext.optimizers.lion import FusedLion
from tfmetal_ext.optimizers.rmsprop import FusedRMSprop
from tfmetal_ext.optimizers.sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLion", "FusedRMSprop", "FusedSGD"]

# A LossScaleOptimizer around FusedAdam / FusedAdamW / FusedLion / FusedRMSprop scales inside their
# multi-tensor op (`tfmetal_ext.optimizers.loss_scale`; TFMETAL_EXT_FUSED_LOSS_SCALE=0 turns it off).
loss_scale.install()
