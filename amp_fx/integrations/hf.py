"""Hugging Face ``Trainer`` with amp_fx (``pip install amp_fx[hf]``; imports transformers).

A model compiled in place goes into ``Trainer`` unchanged: it trains, evaluates and saves with its
usual ``state_dict`` keys, since it is the same module object::

    amp_fx.compile(model, inplace=True, dtype="bf16")
    Trainer(model=model, args=TrainingArguments(...), ...).train()

``bf16=True``/``fp16=True`` in ``TrainingArguments`` make accelerate run the forward inside
``torch.autocast``. amp_fx's graphs run with autocast off and their own casts, and amp_fx opens its
own ``torch.autocast`` (its dtype) inside accelerate's for the code Dynamo leaves to eager: amp_fx's
dtype and policy hold either way (tests/integrations/test_hf.py checks it bit for bit).

For fp16, loss scaling is needed; :class:`AmpFxTrainer` is ``Trainer`` with amp_fx's
:class:`~amp_fx.GradScaler` as accelerate's scaler (``TrainingArguments(fp16=True)``). On CPU,
accelerate 1.15 creates no scaler and no autocast for ``fp16=True`` (it trains in fp32 without a
word); AmpFxTrainer gives it both, as accelerate does on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised where transformers is missing
    raise ImportError("amp_fx.hf needs Hugging Face transformers and accelerate: pip install amp_fx[hf]") from e

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.report import did_less
from amp_fx.api import options_of
from amp_fx.scaler import GradScaler

__all__ = ["AmpFxTrainer", "amp_fx_dtype"]


def amp_fx_dtype(model: object) -> torch.dtype | None:
    """The dtype ``model`` was compiled to by ``amp_fx.compile`` (in place or not), else None."""
    try:
        return options_of(model).dtype
    except TypeError:  # not compiled by amp_fx
        return None


class AmpFxTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose fp16 loss scaling is amp_fx's :class:`~amp_fx.GradScaler`.

    Args:
        scaler: the scaler accelerate uses when ``TrainingArguments(fp16=True)``; default
            ``amp_fx.GradScaler`` with accelerate's ``GradScalerKwargs`` (torch.amp.GradScaler's
            defaults). Any object with torch.amp.GradScaler's interface.
        *args, **kwargs: those of ``transformers.Trainer``.

    With ``fp16=True`` on a CPU (where accelerate 1.15 neither scales nor autocasts), it also
    turns on accelerate's fp16 autocast, as accelerate does on a GPU. It checks the model: an
    amp_fx fp16 model needs ``fp16=True`` (no loss scaling otherwise: ValueError), and a
    ``bf16=``/``fp16=`` other than the model's amp_fx dtype is reported (amp_fx's dtype wins
    inside the model).
    """

    def __init__(self, *args: Any, scaler: torch.amp.GradScaler | None = None, **kwargs: Any) -> None:
        self._amp_fx_scaler = scaler
        super().__init__(*args, **kwargs)
        dtype = amp_fx_dtype(self.model)
        if dtype is None:
            return
        if dtype is torch.float16 and not self.args.fp16:
            raise ValueError(
                "amp_fx.hf.AmpFxTrainer: the model is compiled by amp_fx to fp16, whose gradients need "
                "loss scaling; set TrainingArguments(fp16=True) (amp_fx's GradScaler then scales)"
            )
        asked = torch.float16 if self.args.fp16 else torch.bfloat16 if self.args.bf16 else None
        if asked is not None and asked is not dtype:
            did_less(
                ("hf dtype", asked, dtype),
                (
                    f"amp_fx.hf.AmpFxTrainer: TrainingArguments asks for {dtype_name(asked)} but the model is "
                    f"compiled by amp_fx to {dtype_name(dtype)}: amp_fx's dtype is used inside the model. Set "
                    f"{'fp16' if dtype is torch.float16 else 'bf16'}=True (or compile the model to "
                    f"{dtype_name(asked)})."
                ),
            )

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        if accelerator.mixed_precision != "fp16":
            return
        if self._amp_fx_scaler is not None:
            accelerator.scaler = self._amp_fx_scaler
        else:
            handler = accelerator.scaler_handler
            kwargs = handler.to_kwargs() if handler is not None else {}
            accelerator.scaler = GradScaler(accelerator.device.type, **kwargs)
        # accelerate on a CPU: native_amp off means no autocast around the forward and no unscale
        # before clipping (Accelerator.unscale_gradients); on a GPU it is already on.
        accelerator.native_amp = True
