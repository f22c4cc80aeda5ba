"""FusedAdamW: Keras' AdamW with fused Adam and decay ops."""

from __future__ import annotations

import keras

from tfmetal_ext.optimizers.adam import FusedAdam


@keras.saving.register_keras_serializable(package="tfmetal_ext")
class FusedAdamW(FusedAdam):
    """AdamW (Adam with decoupled weight decay) with fused per-variable ops.

    Same algorithm, arguments and defaults as `keras.optimizers.AdamW`: each
    step first decays ``var -= learning_rate * weight_decay * var`` (one
    ``ResourceApplyGradientDescent`` per decayed variable, ``lr * wd``
    computed once), then applies Adam (one ``ResourceApplyAdam``). Variables
    excluded with `exclude_from_weight_decay` are only updated by Adam.
    With ``multi_tensor=True`` decay and Adam run inside one
    ``TfmetalExt>MultiTensorAdam`` op per dtype and decay setting.

    Args:
        learning_rate: a float, a learning-rate schedule or a callable.
        weight_decay: the decoupled decay rate, a float >= 0.
        beta_1, beta_2, epsilon, amsgrad: as `FusedAdam`.
        multi_tensor: as `FusedAdam`: one ``TfmetalExt>MultiTensorAdam`` op
            per dtype (and per decayed/excluded set) does both the decay and
            the Adam update.
        **kwargs: `keras.optimizers.Optimizer` arguments.
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay=0.004,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
        multi_tensor=False,
        name="fused_adamw",
        **kwargs,
    ):
        if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
            raise ValueError(
                f"Argument `weight_decay` must be a float >= 0. Received: weight_decay={weight_decay!r}"
            )
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            multi_tensor=multi_tensor,
            weight_decay=float(weight_decay),
            name=name,
            **kwargs,
        )
