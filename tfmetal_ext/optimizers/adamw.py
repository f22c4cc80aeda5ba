"""FusedAdamW: Keras' AdamW with fused Adam and decay ops."""

from __future__ import annotations

import keras

from tfmetal_ext.ops._common import check_nonnegative
from tfmetal_ext.optimizers.adam import FusedAdam


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedAdamW(FusedAdam):
    """AdamW (Adam with decoupled weight decay) with fused per-variable ops.

    Same algorithm, arguments and defaults as `keras.optimizers.AdamW`: each
    step first decays ``var -= learning_rate * weight_decay * var`` (one
    ``ResourceApplyGradientDescent`` per decayed variable, ``lr * wd``
    computed once), then applies Adam (one ``ResourceApplyAdam``). Variables
    excluded with `exclude_from_weight_decay` are only updated by Adam.
    By default (``multi_tensor="auto"``, where the op runs) decay and Adam run inside one
    ``TfmetalExt>MultiTensorAdam`` op per dtype and decay setting.

    Args:
        learning_rate: a float, a learning-rate schedule or a callable.
        weight_decay: the decoupled decay rate, a float >= 0.
        beta_1, beta_2, epsilon, amsgrad: as `FusedAdam`.
        clipnorm, clipvalue, global_clipnorm, use_ema, ema_momentum,
            ema_overwrite_frequency, loss_scale_factor,
            gradient_accumulation_steps, name: the `keras.optimizers.Optimizer`
            arguments, in `keras.optimizers.AdamW`'s positional order
            (``name`` defaults to ``"fused_adamw"``).
        multi_tensor: (keyword-only) as `FusedAdam`: one ``TfmetalExt>MultiTensorAdam`` op
            per dtype (and per decayed/excluded set) does both the decay and
            the Adam update.
        **kwargs: what `keras.optimizers.Optimizer` accepts beyond these.
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay=0.004,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        multi_tensor="auto",
        **kwargs,
    ):
        # keras.optimizers.AdamW's positional order; `multi_tensor` is
        # keyword-only.
        if weight_decay is None:
            # keras.optimizers.AdamW's own message for this case.
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        weight_decay = check_nonnegative("weight_decay", weight_decay)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            multi_tensor=multi_tensor,
            **kwargs,
        )
